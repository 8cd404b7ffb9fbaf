"""Shared by the migration tests: what the reference codecs write at a destination, and a gloo pair on loopback."""

from __future__ import annotations

import os
import socket
from datetime import timedelta

import torch
import torch.distributed as dist

from kvbridge.layouts.codec import record_codec
from kvbridge.migration.ape import add_ape, remove_ape
from kvbridge.migration.rows import state_rows_from_f32, state_rows_to_f32
from kvbridge.ops import keys as ix


def expected_records(t, src_records: torch.Tensor) -> torch.Tensor:
    """Destination records of transfer ``t`` for its source records, by the reference codecs."""
    if t.src.kind == "kv":
        if t.conversion == "byte move":
            return src_records
        values = record_codec(t.src.layout).decode(src_records, scale=t.src.scale or 1.0)
        return record_codec(t.dst.layout).encode(values, dialect=t.dst.dialect, scale=t.dst.scale or 1.0)
    if t.src.kind == "indexer" and t.conversion != "byte copy":
        return ix.encode_keys(ix.decode_keys(src_records, t.src.indexer, t.src.dialect), t.dst.indexer, t.dst.dialect)
    if t.src.kind == "state" and t.ape_sign:  # the destination stores score + APE, or the source does
        values = state_rows_to_f32(src_records, t.src.fmt)
        values = add_ape(values, t.ape, t.first) if t.ape_sign > 0 else remove_ape(values, t.ape, t.first, t.conversion)
        return state_rows_from_f32(values, t.dst.fmt)
    if t.src.kind == "state" and t.src.fmt != t.dst.fmt:
        return state_rows_from_f32(state_rows_to_f32(src_records, t.src.fmt), t.dst.fmt)
    return src_records


def gpu_check_module():
    """``scripts/gpu_check.py`` as a module, for the tests that run its device cases on CPU tensors."""
    import importlib.util
    import sys
    from pathlib import Path

    spec = importlib.util.spec_from_file_location("gpu_check", Path(__file__).parents[1] / "scripts" / "gpu_check.py")
    module = sys.modules["gpu_check"] = importlib.util.module_from_spec(spec)  # its dataclasses look it up
    spec.loader.exec_module(module)
    return module


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_gloo_pair(rank: int, port: int) -> None:
    """Join the two-rank gloo group of a test on ``127.0.0.1:port``."""
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                            timeout=timedelta(seconds=60))


def need_sglang(test: str) -> None:
    """Skip ``test`` (fail it under ``CI=true``, so CI cannot skip it silently) unless the SGLang venv
    (``KVBRIDGE_SGLANG_PYTHON``, made by ``.ci/engine-sglang.sh``), nixl and pyzmq are there."""
    import pytest

    from kvbridge.migration.nixl_agent import nixl_available

    missing = []
    if not os.environ.get("KVBRIDGE_SGLANG_PYTHON"):
        missing.append("KVBRIDGE_SGLANG_PYTHON (the SGLang venv's python, made by .ci/engine-sglang.sh)")
    if not nixl_available():
        missing.append("nixl")
    try:
        import zmq  # noqa: F401
    except ImportError:
        missing.append("pyzmq (pip install 'kvbridge[sglang-pd]')")
    if missing:
        if os.environ.get("CI") == "true":
            pytest.fail(f"CI must run the {test}; missing: " + "; ".join(missing))
        pytest.skip("needs " + "; ".join(missing))
