"""KV records converted straight from the source pages (or a payload's records) into the destination pages
(``dispatch.transcode_kv_segments``, the C segment kernels: per-tensor FP8 <-> MODEL1), byte-identical to the staged
conversion; NaN/Inf refused as there; segments outside their tensors refused before any byte is written."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from test_migration_local import MODEL, TOKENS

import kvbridge.migration.execute as ex
from kvbridge.backends import dispatch
from kvbridge.errors import InputError, NonFiniteError
from kvbridge.layouts import get_layout
from kvbridge.migration import destination_pools, migrate_local, pack, plan_migration, source_request
from kvbridge.migration.ape import synthetic_ape
from kvbridge.migration.execute import finish
from kvbridge.migration.pools import gather_records, pool_tensors, scatter_records, table_of
from kvbridge.ops.records import convert_kv_records

FP8, MODEL1 = get_layout("trtllm-fp8"), get_layout("flashmla-model1")
CPU = torch.device("cpu")
pytestmark = pytest.mark.skipif(dispatch.kv_segment_split(FP8, MODEL1, CPU) is None,
                                reason="the C kernels are not loaded here (no AVX-512 VBMI or not built)")

#: Pairs whose KV converts per-tensor FP8 <-> MODEL1 (vLLM's and SGLang's block-split pages, TensorRT-LLM's rows).
PAIRS = [("trtllm:fp8:tpb=128", "vllm"), ("trtllm:fp8:tpb=256:idx=fp8:scale=0.5", "vllm"),
         ("vllm", "trtllm:fp8:tpb=128"), ("trtllm:fp8:tpb=128", "sglang"), ("sglang", "trtllm:fp8:tpb=256:scale=2")]


def _pools(pools) -> dict:
    return {(k, i): t.clone() for k, v in pools.pools.items() for i, t in enumerate(pool_tensors(v))}


@pytest.fixture
def calls(monkeypatch):
    """How many segment transcodes the migration ran (a spy around the dispatcher's function)."""
    seen = []
    real = dispatch.transcode_kv_segments

    def spy(*args, **kwargs):
        seen.append(args[0][2].numel())
        return real(*args, **kwargs)

    monkeypatch.setattr(ex.dispatch, "transcode_kv_segments", spy)
    return seen


@pytest.mark.parametrize("stage_bytes", [ex.STAGE_BYTES, 3000])
@pytest.mark.parametrize(("src_spec", "dst_spec"), PAIRS)
def test_direct_kv_writes_the_staged_conversions_bytes(monkeypatch, calls, src_spec, dst_spec, stage_bytes):
    """Without a loss report (the report reads staged records) KV converts straight into the destination pages, in
    ``migrate_local`` and on the transports' receiver; every pool byte equals the staged conversion's (with batches
    of a few entries too: pieces cut inside pages)."""
    monkeypatch.setattr(ex, "STAGE_BYTES", stage_bytes)
    ape = synthetic_ape(MODEL, seed=1) if "sglang" in (src_spec + dst_spec) else None
    plan = plan_migration(src_spec, dst_spec, MODEL, TOKENS, draft_tokens=2, ape=ape)
    src, src_tables = source_request(plan, spare_pages=1, seed=3)
    want_dst = destination_pools(plan, spare_pages=1, seed=4)
    want_tables, _ = migrate_local(plan, src, src_tables, want_dst, loss_report=True)
    assert not calls  # staged: the loss report reads the records
    want = _pools(want_dst)
    for run in ("local", "transport"):
        got_dst = destination_pools(plan, spare_pages=1, seed=4)
        if run == "local":
            got_tables, _ = migrate_local(plan, src, src_tables, got_dst, loss_report=False)
        else:
            payload = pack(plan, src, src_tables, convert=False, loss_report=False)
            got_tables, _ = finish(plan, payload, got_dst, converted_on="receiver", pack_s=0.0, wire_s=0.0,
                                   loss_report=False)
        assert calls, run
        calls.clear()
        got = _pools(got_dst)
        assert got_tables == want_tables and got_dst.free == want_dst.free
        assert all(torch.equal(got[k], want[k]) for k in want), f"{run}: {src_spec} -> {dst_spec}"


def test_a_nan_source_is_refused_as_staged_and_its_pages_released(calls):
    plan = plan_migration("trtllm:fp8:tpb=128", "vllm", MODEL, TOKENS)
    src, tables = source_request(plan, seed=8)
    t = next(t for t in plan.transfers if t.src.kind == "kv")
    records = gather_records(src.pool(t.spec), t.src, table_of(tables, t.src), t.first, t.count)
    records[100, 7] = 0x7F  # E4M3 NaN
    scatter_records(src.pool(t.spec), t.src, table_of(tables, t.src), t.first, records)
    dst = destination_pools(plan)
    free = {k: sorted(v) for k, v in dst.free.items()}
    with pytest.raises(NonFiniteError, match=r"non-finite values \(1; first at token 100, dim 7\)"):
        migrate_local(plan, src, tables, dst, loss_report=False)
    assert calls and {k: sorted(v) for k, v in dst.free.items()} == free


@settings(max_examples=25, deadline=None)
@given(cuts=st.lists(st.integers(1, 40), min_size=1, max_size=6), scale=st.sampled_from([1.0, 0.5, 3.0]),
       seed=st.integers(0, 2**16), back=st.booleans())
def test_segments_anywhere_equal_the_record_conversion(cuts, scale, seed, back):
    """Rows cut into segments of any length, the MODEL1 side split into data and footer streams in pages of 16 rows
    (a block-split pool part by part) or token-major: the bytes of ``convert_kv_records``."""
    n = sum(cuts)
    g = torch.Generator().manual_seed(seed)
    fp8 = torch.randint(0, 256, (n, 512), dtype=torch.uint8, generator=g)
    fp8[(fp8 & 0x7F) == 0x7F] = 0x11
    m1, _ = convert_kv_records(fp8, FP8, MODEL1, src_scale=scale, dst_scale=None, dialect=None)
    src, dst = (MODEL1, FP8) if back else (FP8, MODEL1)
    want, _ = convert_kv_records(m1 if back else fp8, src, dst, src_scale=None if back else scale,
                                 dst_scale=scale if back else None, dialect=None)
    pages = -(-n // 16)
    split = np.zeros((pages, 16 * 584), np.uint8)  # each page: 16 data rows of 576 bytes, then 16 footers of 8
    starts = np.concatenate([[0], np.cumsum(cuts)[:-1]])

    def m1_at(r):  # (data offset, footer offset) of MODEL1 row r in the split pages
        p, i = divmod(r, 16)
        return p * 16 * 584 + i * 576, p * 16 * 584 + 16 * 576 + i * 8

    segs = []
    for s0, c in zip(starts, cuts, strict=True):
        r = int(s0)
        while r < s0 + c:  # one segment per run inside one page
            rows = min(int(s0) + c - r, 16 - r % 16)
            d, f = m1_at(r)
            fp = (r * 512, r * 512)
            segs.append([*(((d, f) + fp) if back else (fp + (d, f))), rows, r])
            r += rows
    if back:  # fill the split pages with the MODEL1 records
        for r in range(n):
            d, f = m1_at(r)
            split.reshape(-1)[d : d + 576] = m1[r, :576].numpy()
            split.reshape(-1)[f : f + 8] = m1[r, 576:].numpy()
    m1_flat = torch.from_numpy(split.reshape(-1))
    out = torch.zeros(n, 512, dtype=torch.uint8).view(-1) if back else m1_flat
    fp8_flat = fp8.view(-1)
    streams = (m1_flat, m1_flat, out, out) if back else (fp8_flat, fp8_flat, m1_flat, m1_flat)
    strides = (576, 8, 512, 512) if back else (512, 512, 576, 8)
    dispatch.transcode_kv_segments(streams, np.array(segs, np.int64), strides, src, dst, src_scale=None if back
                                   else scale, dst_scale=scale if back else None, dialect=None, into_pool=True)
    if back:
        assert torch.equal(out.view(n, 512), want)
    else:
        for r in range(n):
            d, f = m1_at(r)
            assert bytes(split.reshape(-1)[d : d + 576]) + bytes(split.reshape(-1)[f : f + 8]) == bytes(
                want[r].numpy())


def test_a_segment_outside_its_tensors_is_refused_before_any_byte_is_written():
    fp8 = torch.zeros(10, 512, dtype=torch.uint8).view(-1)
    out = torch.full((10 * 584,), 0xAB, dtype=torch.uint8)
    good = [0, 0, 0, 576, 10, 0]
    for bad in ([0, 0, 584, 584 + 576, 10, 0], [-1, 0, 0, 576, 1, 0], [0, 0, 0, 576, 11, 0], [0, 0, 0, 576, -1, 0]):
        with pytest.raises(InputError, match="KV segment 1 lies outside"):
            dispatch.transcode_kv_segments((fp8, fp8, out, out), np.array([good, bad], np.int64), (512, 512, 584, 584),
                                           FP8, MODEL1, src_scale=1.0, dst_scale=None, dialect=None, into_pool=False)
        assert bool((out == 0xAB).all())
    with pytest.raises(InputError, match="overlap|outside"):  # destination rows closer than their width
        dispatch.transcode_kv_segments((fp8, fp8, out, out), np.array([good], np.int64), (512, 512, 500, 584),
                                       FP8, MODEL1, src_scale=1.0, dst_scale=None, dialect=None, into_pool=False)
    with pytest.raises(InputError, match="no segment kernel"):
        dispatch.transcode_kv_segments((fp8, fp8, out, out), np.array([good], np.int64), (512, 512, 584, 584),
                                       FP8, get_layout("bf16"), src_scale=1.0, dst_scale=None, dialect=None,
                                       into_pool=False)
