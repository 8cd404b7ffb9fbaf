"""The staging cache: a block is reused only once nothing views its memory, the cache's limit, and the refusal of a
bad limit; ``joined`` sees records staged back to back as one view; ``pack(into=)`` gathers in place."""

from __future__ import annotations

import gc

import pytest
import torch

from kvbridge.errors import InputError
from kvbridge.migration import staging
from kvbridge.migration.execute import pack
from kvbridge.migration.plan import plan_migration
from kvbridge.migration.staging import MIN_CACHED_BYTES, STAGING_CACHE_ENV, joined, staging_empty
from kvbridge.migration.synthetic import source_request

N = 3 * MIN_CACHED_BYTES


@pytest.fixture(autouse=True)
def empty_cache():
    """Each test starts with no idle block (earlier tests' payloads leave theirs in the process's cache)."""
    gc.collect()
    staging._CACHE.idle.clear()


def test_a_block_comes_back_only_when_no_view_of_it_is_left():
    a = staging_empty(N)
    ptr = a.data_ptr()
    view = a[100:200].numpy()[10:20]  # a numpy view of a torch view: still keeps the block
    del a
    gc.collect()
    b = staging_empty(N)
    assert b.data_ptr() != ptr
    view[:] = 7
    assert bytes(b[:0].numpy()) == b""
    del view
    gc.collect()
    c = staging_empty(N)
    assert c.data_ptr() == ptr  # the idle block is reused
    assert b.data_ptr() != c.data_ptr()


def test_blocks_are_reused_only_for_sizes_they_fit_closely():
    a = staging_empty(4 * N)
    ptr = a.data_ptr()
    del a
    gc.collect()
    assert staging_empty(N).data_ptr() != ptr  # 4x larger than asked: not handed out
    assert staging_empty(3 * N).data_ptr() == ptr


def test_limit_zero_turns_the_cache_off(monkeypatch):
    monkeypatch.setenv(STAGING_CACHE_ENV, "0")
    a = staging_empty(N)
    assert a._base is None and a.numel() == N


@pytest.mark.parametrize("bad", ["-1", "lots", "1.5"])
def test_a_bad_limit_is_refused(monkeypatch, bad):
    monkeypatch.setenv(STAGING_CACHE_ENV, bad)
    with pytest.raises(InputError, match=STAGING_CACHE_ENV):
        staging_empty(N)


def test_joined_views_records_back_to_back_and_refuses_others():
    block = torch.arange(60, dtype=torch.uint8)
    records = [block[0:12].view(3, 4), block[12:12].view(0, 4), block[12:42].view(5, 6)]
    flat = joined(records)
    assert flat is not None and flat.data_ptr() == block.data_ptr() and torch.equal(flat, block[:42])
    assert joined([block[0:12].view(3, 4), block[13:19].view(1, 6)]) is None  # a gap
    assert joined([block[0:12].view(3, 4), torch.zeros(2, 3, dtype=torch.uint8)]) is None  # another storage
    assert joined([]) is None


def test_pack_gathers_into_given_buffers_with_the_same_bytes_and_checksums():
    """``pack(into=)`` (a transport's registered staging buffer) writes each transfer's records where it is told,
    byte-identical to ``pack``'s own block, with the same checksums; a wrong buffer is refused."""
    plan = plan_migration("trtllm:fp8:tpb=128", "vllm", "deepseek-v4-flash", 1000, include_mtp=False)
    pools, tables = source_request(plan, seed=3)
    want = pack(plan, pools, tables, convert=False)
    buf = torch.zeros(sum(t.src_bytes for t in plan.transfers), dtype=torch.uint8)
    into, at = [], 0
    for t in plan.transfers:
        into.append(buf[at : at + t.src_bytes].view(t.count, t.src.record_bytes))
        at += t.src_bytes
    got = pack(plan, pools, tables, convert=False, into=into)
    assert got.checksums == want.checksums
    for rec, out, ref in zip(got.records, into, want.records, strict=True):
        assert rec.data_ptr() == out.data_ptr() and torch.equal(rec, ref)
    with pytest.raises(InputError, match="into="):
        pack(plan, pools, tables, convert=False, into=into[:-1])
    with pytest.raises(InputError, match="into="):
        pack(plan, pools, tables, convert=False, into=[x.t() for x in into])
