"""``attention.flashmla`` against the real ``sgl-flash-mla`` 1.0.0 interface (``fixtures/flashmla_interface.json``).

The fixture holds the facts of the wheel's Python interface file and extensions (made by
``scripts/flashmla_interface.py``, see fixtures/README.md): no kernel runs here. Detection is run on a
module object carrying exactly the wheel's exported names and signatures; every prepared call must
bind to the real ``flash_mla_with_kvcache`` signature, use the dtypes and values its docstring
requires, and pass a ``kv_format`` the chosen kernel set accepts, on sm_90 (legacy kernels only)
and sm_100 (both sets).
"""

from __future__ import annotations

import inspect
import json
import os
import types
from pathlib import Path

import pytest
import torch
from test_sparse_decode import random_problem

import kvbridge
from kvbridge import LayoutError
from kvbridge.attention.args import validate
from kvbridge.attention.flashmla import detect_build, prepare

ROOT = Path(__file__).resolve().parent.parent
FIXTURE = ROOT / "fixtures" / "flashmla_interface.json"
IFACE = json.loads(FIXTURE.read_text())
ENTRY = IFACE["flash_mla_with_kvcache"]
FACTS = ENTRY["arguments"]
KERNELS = IFACE["kernels"]
DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32, "int32": torch.int32, "uint8": torch.uint8,
          "int8": torch.int8, "float8_e4m3fn": torch.float8_e4m3fn}


def signature(params: list[dict]) -> inspect.Signature:
    """The ``inspect.Signature`` of a parameter list recorded in the fixture."""
    out = []
    for p in params:
        name = p["name"]
        if name.startswith("**"):
            out.append(inspect.Parameter(name[2:], inspect.Parameter.VAR_KEYWORD))
        elif name.startswith("*"):
            out.append(inspect.Parameter(name[1:], inspect.Parameter.VAR_POSITIONAL))
        else:
            default = inspect.Parameter.empty if p["required"] else p["default"]
            out.append(inspect.Parameter(name, inspect.Parameter.POSITIONAL_OR_KEYWORD, default=default))
    return inspect.Signature(out)


def _refuse(*args, **kwargs):
    raise AssertionError("no kernel runs in this test")


def wheel_module(has_legacy: bool = True) -> types.ModuleType:
    """A module object with the wheel's exported names and exactly its recorded signatures."""
    mod = types.ModuleType("flash_mla")
    for name in IFACE["exports"]:
        fn = types.FunctionType(_refuse.__code__, {}, name)
        setattr(mod, name, fn)
    mod.flash_mla_with_kvcache.__signature__ = signature(ENTRY["parameters"])
    mod.get_mla_metadata.__signature__ = signature(IFACE["get_mla_metadata"]["parameters"])
    mod.has_legacy = lambda: has_legacy
    mod.has_legacy.__signature__ = signature(IFACE["has_legacy"]["parameters"])
    return mod


def test_fixture_records_both_kernel_sets():
    assert IFACE["package"] == "sgl-flash-mla" and IFACE["version"] == "1.0.0"
    names = [p["name"] for p in ENTRY["parameters"]]
    assert names[:6] == ["q", "k_cache", "block_table", "cache_seqlens", "head_dim_v", "tile_scheduler_metadata"]
    assert {"use_legacy", "kv_format", "indices", "extra_k_cache", "topk_length", "attn_sink"} <= set(names)
    assert "V4" in KERNELS["legacy"]["kv_format"] and "V41" in KERNELS["legacy"]["kv_format"]
    assert KERNELS["current"]["kv_format"] == [None] and KERNELS["current"]["arch"] == ["sm100f"]
    assert "sm90a" in KERNELS["legacy"]["arch"]


def test_fixture_is_what_the_wheel_says():
    """Re-extract the facts from the wheel when it is at hand (``KVBRIDGE_FLASHMLA_WHEEL``)."""
    wheel = os.environ.get("KVBRIDGE_FLASHMLA_WHEEL")
    if not wheel:
        pytest.skip("set KVBRIDGE_FLASHMLA_WHEEL to the downloaded sgl_flash_mla-1.0.0 wheel to re-extract")
    import importlib.util

    spec = importlib.util.spec_from_file_location("flashmla_interface", ROOT / "scripts" / "flashmla_interface.py")
    extractor = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(extractor)
    assert extractor.extract(Path(wheel)) == IFACE


def test_detection_on_the_wheel_interface():
    build = detect_build(wheel_module(True))
    assert build.problem is None and build.split_legacy and build.has_legacy and build.takes_format
    without = detect_build(wheel_module(False))
    assert without.problem is None and without.split_legacy and not without.has_legacy


SM90, SM100, SM120 = (9, 0), (10, 0), (12, 0)
CASES = [("flashmla-model1", None), ("trtllm-fp8", None), ("bf16", "flashmla-model1"), ("v41-fp8", "v41-fp4"),
         ("v41-fp8", None), ("v41-fp8-interleaved", "v41-fp4-interleaved"), ("v41-fp8-interleaved", None),
         ("trtllm-fp8-ds-mla", "trtllm-fp8")]


def decode_args(main: str, extra: str | None):
    x, q, idx, lengths, sink = random_problem(5, topk=100)
    pages = kvbridge.encode(x, main, page_size=64)
    kw = dict(layout=main, page_size=64, extra_k_cache=None, extra_indices=None, extra_layout=None,
              extra_page_size=None, topk_length=lengths, extra_topk_length=None, attn_sink=sink.float(),
              softmax_scale=None, scale=None, extra_scale=None)
    if extra is not None:
        kw.update(extra_k_cache=kvbridge.encode(x[:50], extra, page_size=2), extra_indices=idx.clamp(max=49),
                  extra_layout=extra, extra_page_size=2)
    return validate(q, pages, idx, **kw)


@pytest.mark.parametrize(("main", "extra"), CASES)
@pytest.mark.parametrize("capability", [SM90, SM100], ids=["sm90", "sm100"])
def test_prepared_call_matches_the_wheel_interface(main, extra, capability):
    build = detect_build(wheel_module(True))
    call = prepare(decode_args(main, extra), build, capability)
    kw = call.kwargs
    inspect.signature(build.module.get_mla_metadata).bind()  # flashmla.run calls it without arguments
    # flashmla.run passes the metadata object and num_splits=None by keyword next to the prepared arguments
    bound = signature(ENTRY["parameters"]).bind(tile_scheduler_metadata=object(), num_splits=None, **kw)
    required = {p["name"] for p in ENTRY["parameters"] if p["required"]}
    assert required <= set(bound.arguments)
    legacy = bool(kw.get("use_legacy", False))
    kernels = KERNELS["legacy" if legacy else "current"]
    assert kw.get("kv_format") in kernels["kv_format"]
    assert f"sm{capability[0]}{'0a' if capability[0] == 9 else '0f'}" in kernels["arch"]
    q = kw["q"]
    assert q.dtype == DTYPES[FACTS["q"]["dtype"]] and q.shape[-1] == FACTS["q"]["head_dim"]
    assert q.shape[2] in FACTS["q"]["num_heads"] and q.is_contiguous()
    for cache in (kw["k_cache"], kw["extra_k_cache"]):
        if cache is not None:
            assert cache.dtype in [DTYPES[d] for d in FACTS["k_cache"]["dtypes"]]
            assert cache.dim() == len(FACTS["k_cache"]["shape"]) and cache.shape[2] == FACTS["k_cache"]["num_heads_k"]
    if not legacy:  # the current kernels take the format from the bytes per token
        assert kw["k_cache"].shape[-1] in FACTS["current_formats"]["main_bytes_per_token"]
        if kw["extra_k_cache"] is not None:
            assert kw["extra_k_cache"].shape[-1] in FACTS["current_formats"]["extra_bytes_per_token"]
    for name in ("indices", "extra_indices_in_kvcache"):
        if kw[name] is not None:
            assert kw[name].dtype == DTYPES[FACTS["indices"]["dtype"]] and kw[name].dim() == 3
            assert int(kw[name].min()) >= FACTS["indices"]["invalid"]
    for name in ("topk_length", "extra_topk_length"):
        if kw[name] is not None:
            assert kw[name].dtype == DTYPES[FACTS["topk_length"]["dtype"]] and kw[name].shape == (q.shape[0],)
    assert kw["attn_sink"].dtype == DTYPES[FACTS["attn_sink"]["dtype"]] and kw["attn_sink"].shape == (q.shape[2],)
    assert kw["head_dim_v"] == FACTS["head_dim_v"]["value"] and kw["causal"] is FACTS["causal"]["value"]
    assert kw["is_fp8_kvcache"] is True  # sparse decoding supports nothing else
    if capability == SM90:  # the current kernels do not run on an H100/H200
        assert legacy


def test_no_kernels_for_sm120_is_a_clear_error():
    build = detect_build(wheel_module(True))
    with pytest.raises(LayoutError, match="cannot run on sm_120"):
        build.route(kvbridge.get_layout("trtllm-fp8"), None, SM120)
    with pytest.raises(LayoutError, match="no legacy kernels"):
        detect_build(wheel_module(False)).route(kvbridge.get_layout("flashmla-model1"), None, SM90)
