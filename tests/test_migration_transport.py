"""Distributed migration: two real processes, a real gloo process group on 127.0.0.1.

The request is a synthetic DeepSeek-V4-Flash request of 3000 tokens cut to the first 4 main
layers (+ the MTP layer) to keep the test fast: ratios [0, 0, 4, 128] + [0], so 23 C128
entries in the HCA layer, 750 C4 entries in the CSA layer, and a 128-token SWA window that straddles
a page boundary (tokens 2872..2999). Every process runs under a hard join timeout and every
receive under the transport's own timeout, so nothing here can hang CI.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from migration_helpers import expected_records, free_port, init_gloo_pair
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from kvbridge.engines.topology import FLASH, Role
from kvbridge.migration import (
    ChecksumError,
    EnginePools,
    TransferError,
    destination_pools,
    gather_records,
    pack,
    plan_migration,
    source_request,
)
from kvbridge.migration.pools import pool_tensors, table_of
from kvbridge.migration.transport import receive_request, send_payload, send_request

MODEL = FLASH.with_layers(4)
TOKENS = 3000
FORWARD = ("trtllm:fp8:tpb=128", "vllm")
REVERSE = ("vllm", "trtllm:fp8:tpb=128")
# speculative decoding (rings of 16 / 256) and bf16 state on SGLang; at 2050 tokens the ratio-4 state rows
# 2044..2049 and the SWA window straddle SGLang's 256-token page boundary at 2048, so they land in two rings
SPECULATIVE = ("sglang", "sglang:draft=3:state=bf16")
SPECULATIVE_TOKENS = 2050
JOIN_TIMEOUT_S = 90
RECV_TIMEOUT_S = 30.0


def _plan(pair: tuple[str, str]):
    return plan_migration(pair[0], pair[1], MODEL, SPECULATIVE_TOKENS if pair == SPECULATIVE else TOKENS)


def _save_pools(path: str, pools: EnginePools, tables: dict[str, list[int]] | None, info: dict[str, str]) -> None:
    tensors = {f"{layer}.{role.value}.{i}": t for (layer, role), v in pools.pools.items()
               for i, t in enumerate(pool_tensors(v))}
    meta = {"tables": json.dumps(tables), "free": json.dumps(pools.num_free()), **info}
    tmp = path + ".tmp"
    save_file(tensors, tmp, metadata=meta)
    os.replace(tmp, path)


def _sender_main(port: int) -> None:
    init_gloo_pair(0, port)
    fwd = _plan(FORWARD)
    src, tables = source_request(fwd, spare_pages=2, seed=11)
    send_request(fwd, src, tables, dst_rank=1, convert_on="receiver", chunk_bytes=1 << 20, timeout=RECV_TIMEOUT_S)
    rev = _plan(REVERSE)
    src, tables = source_request(rev, spare_pages=2, seed=12)
    send_request(rev, src, tables, dst_rank=1, convert_on="sender", timeout=RECV_TIMEOUT_S)
    spec = _plan(SPECULATIVE)
    src, tables = source_request(spec, spare_pages=2, seed=14)
    send_request(spec, src, tables, dst_rank=1, convert_on="receiver", timeout=RECV_TIMEOUT_S)
    src, tables = source_request(fwd, spare_pages=2, seed=13)
    payload = pack(fwd, src, tables, convert=False)
    payload.records[5][3, 17] ^= 0x40  # one flipped bit after the checksums were taken
    send_payload(payload, dst_rank=1, timeout=RECV_TIMEOUT_S)
    dist.barrier()
    dist.destroy_process_group()


def _receiver_main(port: int, out_dir: str) -> None:
    init_gloo_pair(1, port)
    for name, pair in (("forward", FORWARD), ("reverse", REVERSE), ("speculative", SPECULATIVE)):
        plan = _plan(pair)
        dst = destination_pools(plan, spare_pages=2, seed=5)
        tables, report = receive_request(plan, dst, src_rank=0, timeout=RECV_TIMEOUT_S)
        _save_pools(f"{out_dir}/{name}.safetensors", dst, tables, {
            "kv_lossless": str(report.kv_lossless), "kv_max_abs_error": repr(report.kv_max_abs_error),
            "loss_entries": str(sum(r.num_tokens for r in report.loss)), "converted_on": report.converted_on,
            "state_max_abs_error": repr(report.state_max_abs_error),
        })
    plan = _plan(FORWARD)
    dst = destination_pools(plan, spare_pages=2, seed=5)
    before = dst.num_free()
    try:
        receive_request(plan, dst, src_rank=0, timeout=RECV_TIMEOUT_S)
        error = "no error"
    except ChecksumError as exc:
        error = f"ChecksumError: {exc}"
    _save_pools(f"{out_dir}/corrupt.safetensors", dst, None, {"error": error, "free_before": json.dumps(before)})
    dist.barrier()
    dist.destroy_process_group()


def _run_pair(targets: list[tuple], timeout: float = JOIN_TIMEOUT_S) -> list[int | None]:
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=fn, args=args) for fn, args in targets]
    for p in procs:
        p.start()
    deadline = time.monotonic() + timeout
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
    codes = []
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join(5)
        codes.append(p.exitcode)
    return codes


@pytest.fixture(scope="module")
def pair_results(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("migration")
    port = free_port()
    codes = _run_pair([(_sender_main, (port,)), (_receiver_main, (port, str(out)))])
    assert codes == [0, 0], f"sender/receiver exit codes {codes}"
    return out


def _load(path: Path, plan, seed: int = 5) -> tuple[EnginePools, dict, dict]:
    tensors = load_file(str(path))
    with safe_open(str(path), "pt") as handle:
        meta = handle.metadata()
    pools = destination_pools(plan, spare_pages=2, seed=seed)
    for (layer, role), v in pools.pools.items():
        parts = tuple(tensors[f"{layer}.{role.value}.{i}"] for i in range(len(pool_tensors(v))))
        pools.pools[(layer, role)] = parts if isinstance(v, tuple) else parts[0]
    tables = json.loads(meta["tables"])
    return pools, tables, meta


def _check_bytes(plan, src_seed: int, dst: EnginePools, tables: dict) -> None:
    src, src_tables = source_request(plan, spare_pages=2, seed=src_seed)
    claimed: dict[str, set[int]] = {name: {i for i in ids if i >= 0} for name, ids in tables.items()}
    for t in plan.transfers:
        src_rec = gather_records(src.pool(t.spec), t.src, table_of(src_tables, t.src), t.first, t.count)
        got = gather_records(dst.pool(t.spec), t.dst, table_of(tables, t.dst), t.first, t.count)
        assert torch.equal(got, expected_records(t, src_rec)), f"layer {t.spec.layer} {t.spec.role.value}"
        parts = pool_tensors(dst.pool(t.spec))
        names = [t.dst.table, t.dst.score_table] if t.dst.score_table else [t.dst.table] * len(parts)
        for pool, name in zip(parts, names, strict=True):
            unclaimed = [i for i in range(pool.shape[0]) if i not in claimed[name]]
            assert not bool(pool[unclaimed].any()), "bytes written outside the request's pages"


def test_forward_trtllm_fp8_to_vllm_bytes_match_reference(pair_results):
    plan = _plan(FORWARD)
    dst, tables, meta = _load(pair_results / "forward.safetensors", plan)
    assert meta["converted_on"] == "receiver"
    # window 2872..2999 in vLLM's SWA blocks 44..46 of 64 tokens; the blocks before it are released
    assert len(tables["swa"]) == -(-TOKENS // 64) and tables["swa"][:44] == [-1] * 44
    _check_bytes(plan, 11, dst, tables)


def test_reverse_vllm_to_trtllm_with_loss_report(pair_results):
    plan = _plan(REVERSE)
    dst, tables, meta = _load(pair_results / "reverse.safetensors", plan)
    assert meta["converted_on"] == "sender"
    assert int(meta["loss_entries"]) == sum(t.count for t in plan.transfers if t.src.kind == "kv")
    # MODEL1 -> per-tensor E4M3 at scale 1 cannot hold the 2^-12-scaled tokens exactly.
    assert meta["kv_lossless"] == "False" and float(meta["kv_max_abs_error"]) > 0
    _check_bytes(plan, 12, dst, tables)


def test_sglang_speculative_bf16_state_straddling_a_page_boundary(pair_results):
    plan = _plan(SPECULATIVE)
    dst, tables, meta = _load(pair_results / "speculative.safetensors", plan)
    state = next(t for t in plan.transfers if t.spec.role == Role.STATE and t.spec.ratio == 4)
    assert (state.first, state.count) == (2044, 6) and state.dst.page_size == 16 and state.dst.fmt == "bf16"
    assert state.table_slots(state.dst) == [7, 8]  # two rings: the SWA pages of 1792..2047 and 2048..2303
    swa = next(t for t in plan.transfers if t.spec.role == Role.SWA)
    assert swa.first == 1792  # SGLang's whole page holding the window's first token, 1922
    assert float(meta["state_max_abs_error"]) > 0  # fp32 -> bf16 rounding, reported
    _check_bytes(plan, 14, dst, tables)


def test_corrupted_page_is_detected_and_nothing_is_claimed(pair_results):
    plan = _plan(FORWARD)
    dst, _, meta = _load(pair_results / "corrupt.safetensors", plan)
    assert meta["error"].startswith("ChecksumError: checksum mismatch in layer"), meta["error"]
    assert meta["free"] == meta["free_before"]
    assert not any(bool(t.any()) for v in dst.pools.values() for t in pool_tensors(v))


def _stalling_sender_main(port: int, sent) -> None:
    init_gloo_pair(0, port)
    plan = _plan(FORWARD)
    src, tables = source_request(plan, spare_pages=2, seed=11)
    dist.barrier()  # the receiver's clock starts now, with the request already built

    def stall_after_first_message(done: int, total: int) -> None:
        sent.set()
        time.sleep(120)  # the test kills this process here, mid-transfer

    send_request(plan, src, tables, dst_rank=1, chunk_bytes=1 << 16, timeout=120, progress=stall_after_first_message)


def _patient_receiver_main(port: int, out_dir: str, timeout: float) -> None:
    init_gloo_pair(1, port)
    plan = _plan(FORWARD)
    dst = destination_pools(plan, spare_pages=2, seed=5)
    before = dst.num_free()
    dist.barrier()
    start = time.monotonic()
    try:
        receive_request(plan, dst, src_rank=0, timeout=timeout)
        error = "no error"
    except TransferError as exc:
        error = f"TransferError: {exc}"
    elapsed = time.monotonic() - start
    _save_pools(f"{out_dir}/failed.safetensors", dst, None,
                {"error": error, "elapsed": repr(elapsed), "free_before": json.dumps(before)})
    os._exit(0)  # the group's peer is dead or stuck: skip a destroy that would wait for it


@pytest.mark.parametrize(("mode", "timeout"), [("killed", 20.0), ("stalled", 5.0)])
def test_sender_dying_or_stalling_mid_transfer_fails_receiver_cleanly(tmp_path, mode, timeout):
    ctx = mp.get_context("spawn")
    sent = ctx.Event()
    port = free_port()
    sender = ctx.Process(target=_stalling_sender_main, args=(port, sent))
    receiver = ctx.Process(target=_patient_receiver_main, args=(port, str(tmp_path), timeout))
    sender.start()
    receiver.start()
    try:
        assert sent.wait(JOIN_TIMEOUT_S), "sender never sent its first data message"
        if mode == "killed":
            sender.kill()  # SIGKILL: no goodbye on the socket beyond the kernel's reset
        receiver.join(60)
    finally:
        for p in (sender, receiver):
            if p.is_alive():
                p.kill()
                p.join(5)
    assert receiver.exitcode == 0
    dst, _, meta = _load(tmp_path / "failed.safetensors", _plan(FORWARD))
    assert meta["error"].startswith("TransferError: data message"), meta["error"]
    assert "from rank 0 failed" in meta["error"] and meta["error"].endswith("nothing was published")
    assert float(meta["elapsed"]) < timeout + 5.0  # within its timeout (plus scheduling slack)
    if mode == "stalled":
        assert float(meta["elapsed"]) >= timeout * 0.9
    assert meta["free"] == meta["free_before"]
    assert not any(bool(t.any()) for v in dst.pools.values() for t in pool_tensors(v))
