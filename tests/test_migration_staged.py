"""``migrate_local``'s staged batches against the transports' path (pack, verify, convert, publish).

The staged path gathers batches of source rows into a small buffer, converts them there and scatters
them straight from the converted page parts, without checksums; the transports' path is what
``migrate_local`` ran before. Both must leave every destination pool byte-identical, report the same
loss, and refuse the same bad inputs with the same errors, claiming nothing.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from test_migration_local import MODEL, PAIRS, TOKENS

import kvbridge.migration.execute as ex
from kvbridge.backends import dispatch, native
from kvbridge.engines.topology import Role
from kvbridge.errors import InputError, KVBridgeError, NonFiniteError
from kvbridge.migration import EnginePools, destination_pools, migrate_local, pack, plan_migration, source_request
from kvbridge.migration.execute import finish
from kvbridge.migration.pools import _run_array, _runs, gather_records, pool_tensors, scatter_records, table_of
from kvbridge.ops import keys as ix


def _pools(pools: EnginePools) -> dict:
    return {(k, i): t.clone() for k, v in pools.pools.items() for i, t in enumerate(pool_tensors(v))}


def _transport_path(plan, src, src_tables, dst, loss_report):
    payload = pack(plan, src, src_tables, convert=False, loss_report=loss_report)
    return finish(plan, payload, dst, converted_on="receiver", pack_s=0.0, wire_s=0.0, loss_report=loss_report)


def _same_loss(a, b) -> None:
    for key in ("kv_lossless", "kv_max_abs_error", "indexer_max_abs_error", "state_max_abs_error", "payload_bytes"):
        assert getattr(a, key) == getattr(b, key), key
    assert sum(r.num_tokens for r in a.loss) == sum(r.num_tokens for r in b.loss)


@pytest.mark.parametrize("stage_bytes", [ex.STAGE_BYTES, 3000])
@pytest.mark.parametrize(("src_spec", "dst_spec"), PAIRS)
def test_staged_migration_writes_the_transport_paths_bytes(monkeypatch, src_spec, dst_spec, stage_bytes):
    """Every engine pair of the in-process tests, with the default batches and with batches of a few
    entries (pieces cut inside pages, several transfers per batch)."""
    monkeypatch.setattr(ex, "STAGE_BYTES", stage_bytes)
    plan = plan_migration(src_spec, dst_spec, MODEL, TOKENS, draft_tokens=2)
    src, src_tables = source_request(plan, spare_pages=1, seed=3)
    for loss_report in (True, False):
        want_dst = destination_pools(plan, spare_pages=1, seed=4)
        want_tables, want = _transport_path(plan, src, src_tables, want_dst, loss_report)
        got_dst = destination_pools(plan, spare_pages=1, seed=4)
        assert ex._stage(plan, src, src_tables, got_dst) is not None  # the staged path serves these pools
        got_tables, got = migrate_local(plan, src, src_tables, got_dst, loss_report=loss_report)
        assert got_tables == want_tables and got_dst.free == want_dst.free
        want_pools, got_pools = _pools(want_dst), _pools(got_dst)
        assert all(torch.equal(got_pools[k], want_pools[k]) for k in want_pools), f"{src_spec} -> {dst_spec}"
        _same_loss(got, want)


def test_sender_side_staged_report_counts_destination_bytes_and_packing_time():
    plan = plan_migration("trtllm:fp8:tpb=128", "vllm", MODEL, TOKENS)
    src, src_tables = source_request(plan, seed=2)
    _, report = migrate_local(plan, src, src_tables, destination_pools(plan), convert_on="sender")
    assert report.payload_bytes == plan.totals()["all"]["dst_bytes"] and report.convert_s == 0.0
    assert report.pack_s > 0 and report.wire_s == 0.0


def test_non_contiguous_pools_take_the_transport_path_with_the_same_bytes():
    plan = plan_migration("trtllm:fp8:tpb=128", "vllm", MODEL, TOKENS)
    src, src_tables = source_request(plan, seed=5)
    plain = destination_pools(plan, seed=6)
    want_tables, _ = migrate_local(plan, src, src_tables, plain)
    owned = destination_pools(plan, seed=6)
    strided = {k: torch.zeros(v.shape[0], v.shape[1] + 8, dtype=torch.uint8)[:, 8:] for k, v in owned.pools.items()}
    wrapped = EnginePools.wrap("vllm", MODEL, strided, free=owned.free)
    assert ex._stage(plan, src, src_tables, wrapped) is None
    got_tables, _ = migrate_local(plan, src, src_tables, wrapped)
    assert got_tables == want_tables
    assert all(torch.equal(strided[k], plain.pools[k]) for k in strided)


def _refused(plan, src, tables, match, error=InputError):
    """Both paths raise ``error`` matching ``match``; the staged one claims nothing and writes nothing."""
    with pytest.raises(error, match=match):
        _transport_path(plan, src, tables, destination_pools(plan), True)
    dst = destination_pools(plan)
    free = {k: sorted(v) for k, v in dst.free.items()}
    with pytest.raises(error, match=match):
        migrate_local(plan, src, tables, dst)
    assert {k: sorted(v) for k, v in dst.free.items()} == free
    return dst


def test_bad_source_tables_are_refused_before_any_page_is_claimed():
    plan = plan_migration("trtllm:fp8:tpb=128", "vllm", MODEL, TOKENS)
    src, tables = source_request(plan, seed=7)
    cases = [
        ("compress4", lambda t: t.__setitem__(2, src.pages_per_table["compress4"] + 5),
         r"block table 'compress4' index 2 names page \d+; the pool has"),
        ("compress4", lambda t: t.__setitem__(1, -1), r"block table 'compress4' index 1 is released"),
        ("compress4", lambda t: t.pop(), r"block table 'compress4' has \d+ pages; entry \d+ needs page index"),
        ("swa", lambda t: t.__setitem__(5, -1), r"block table 'swa' index 5 is released"),
    ]
    for name, change, match in cases:
        bad = {k: list(v) for k, v in tables.items()}
        change(bad[name])
        dst = _refused(plan, src, bad, match)
        assert not any(bool(t.any()) for t in _pools(dst).values())


def test_a_nan_source_is_refused_and_its_claimed_pages_are_released():
    plan = plan_migration("trtllm:fp8:tpb=128", "vllm", MODEL, TOKENS)
    src, tables = source_request(plan, seed=8)
    t = next(t for t in plan.transfers if t.spec.role == Role.COMPRESS and t.spec.ratio == 4)
    records = gather_records(src.pool(t.spec), t.src, table_of(tables, t.src), t.first, t.count)
    records[100, 7] = 0x7F  # E4M3 NaN
    scatter_records(src.pool(t.spec), t.src, table_of(tables, t.src), t.first, records)
    _refused(plan, src, tables, r"non-finite values \(1; first at token 100, dim 7\)", NonFiniteError)


def test_an_indexer_nan_scale_is_refused_like_the_torch_path():
    plan = plan_migration("trtllm:fp8:tpb=128", "vllm", MODEL, TOKENS)
    src, tables = source_request(plan, seed=9)
    t = next(t for t in plan.transfers if t.spec.role == Role.INDEXER)
    records = gather_records(src.pool(t.spec), t.src, table_of(tables, t.src), t.first, t.count)
    records[3, t.src.split] = 0xFF  # a NaN UE8M0 block scale
    scatter_records(src.pool(t.spec), t.src, table_of(tables, t.src), t.first, records)
    dst = destination_pools(plan)
    with pytest.raises(KVBridgeError) as caught:
        migrate_local(plan, src, tables, dst)
    with pytest.raises(type(caught.value), match=str(caught.value)[:30].replace("(", r"\(")):
        _transport_path(plan, src, tables, destination_pools(plan), True)
    assert sum(map(len, dst.free.values())) == sum(dst.pages_per_table.values())


# The FNUZ rules have no native kernel: their keys take the torch path (tests/test_migration_indexer.py).
@pytest.mark.parametrize(("rule", "dim"), [(r, d) for r in ix.FP8_RULES for d in (128, 64)
                                           if not (r == "vllm-ue8m0" and d != 128) and r not in ix.FNUZ_RULES])
def test_fp4_to_fp8_keys_between_page_parts_equal_the_torch_path(monkeypatch, rule, dim):
    """The native kernel on a page's two parts (8-byte aligned rows: the word path of the power-of-two rules)
    writes the torch path's bytes and error, for blocks whose scales lie close together (exact, word
    arithmetic) and far apart (E4M3 subnormals and underflow, table path), and refuses a NaN scale."""
    src, dst = ix.indexer_format("fp4", dim), ix.indexer_format("fp8", dim)
    g = torch.Generator().manual_seed(11)
    n = 6000
    records = torch.randint(0, 256, (n, src.record_bytes), dtype=torch.uint8, generator=g)
    scales = records[:, src.split :]
    lo, hi = (60, 200) if rule == "trtllm" else (0, 251)  # trtllm's 448 / amax overflows below 2^-67 or so
    scales.copy_(torch.randint(lo, hi, scales.shape, generator=g, dtype=torch.uint8))
    scales[2000:] = torch.randint(117, 123, scales[2000:].shape, generator=g, dtype=torch.uint8)
    scales[4000:] = (scales[4000:, :1] + torch.randint(-6, 1, scales[4000:].shape, generator=g)).clamp(lo, hi - 1)
    records[10:20, : src.split] = 0x88  # -0.0
    records[20:30, : src.split] = 0
    monkeypatch.setenv("KVBRIDGE_BACKEND", "reference")
    assert not ix.native_transcode_applies(records, src, dst, rule)
    want, want_err = ix.transcode_keys(records, src, dst, rule)
    monkeypatch.delenv("KVBRIDGE_BACKEND")
    keys, key_scales = records[:, : src.split].contiguous(), records[:, src.split :].contiguous()
    out_keys = torch.empty(n, dim, dtype=torch.uint8)
    out_scales = torch.empty(n, 4, dtype=torch.uint8)
    flat = [x.view(-1) for x in (keys, key_scales, out_keys, out_scales)]
    for measure in (True, False):
        err = dispatch.fp4_to_fp8_key_rows(flat[0], src.split, flat[1], key_scales.shape[1], n, flat[2], dim, flat[3],
                                           4, dim, rule, measure=measure)
        assert torch.equal(torch.cat([out_keys, out_scales], dim=1), want)
        assert err == (want_err if measure else 0.0)
    key_scales[4321, 0] = 0xFF
    assert dispatch.fp4_to_fp8_key_rows(flat[0], src.split, flat[1], key_scales.shape[1], n, flat[2], dim, flat[3],
                                        4, dim, rule, measure=False) is None


@pytest.mark.parametrize("spec", ["vllm", "trtllm:fp8:tpb=128", "sglang:draft=3", "vllm:gpu=sm100"])
def test_page_runs_as_arrays_equal_the_entry_by_entry_runs(spec):
    """``_run_array`` (array operations for plain paging) gives ``_runs``'s runs for every cache of the model
    and many entry ranges, and raises its errors."""
    plan = plan_migration(spec, spec, MODEL, TOKENS, draft_tokens=2)
    src, tables = source_request(plan, spare_pages=1, seed=1)
    rng = np.random.default_rng(2)
    for t in plan.transfers:
        ids = tables[t.src.table]
        pages = pool_tensors(src.pool(t.spec))[0].shape[0]
        for first, count in [(t.first, t.count), (t.first, 1), (t.first + t.count - 1, 1)] + [
                (t.first + int(a), int(b)) for a, b in rng.integers(0, max(t.count, 1), (6, 2))]:
            count = min(count, t.first + t.count - first)
            try:
                want = np.array(_runs(t.src, ids, first, count, pages, "x"), np.int64).reshape(-1, 4)
            except InputError as exc:
                with pytest.raises(InputError, match=str(exc).replace("(", r"\(").replace(")", r"\)")):
                    _run_array(t.src, ids, first, count, pages, "x")
                continue
            assert np.array_equal(_run_array(t.src, ids, first, count, pages, "x"), want)
        bad = list(ids)
        live = [i for i, p in enumerate(bad) if p >= 0]
        if t.src.addressing == "paged" and live:
            bad[live[-1]] = pages
            with pytest.raises(InputError, match=f"names page {pages}; the pool has {pages}"):
                _run_array(t.src, bad, t.first, t.count, pages, "x")


def test_large_row_moves_run_on_the_threads_with_the_same_bytes(monkeypatch):
    plan = plan_migration("vllm", "vllm", MODEL, TOKENS)
    src, tables = source_request(plan, seed=4)
    for t in plan.transfers:
        pool, table = src.pool(t.spec), table_of(tables, t.src)
        want = gather_records(pool, t.src, table, t.first, t.count)
        monkeypatch.setattr(native, "INLINE_MOVE_BYTES", 0)
        assert torch.equal(gather_records(pool, t.src, table, t.first, t.count), want)
        monkeypatch.undo()


def test_pack_without_checksums_gathers_the_same_records():
    """NIXL's sender-converted path checksums the destination page runs it stages, so it packs without the
    source-chunk checksums: same records, empty checksum lists."""
    plan = plan_migration("trtllm:fp8:tpb=128", "vllm", MODEL, TOKENS)
    src, tables = source_request(plan, seed=3)
    full = pack(plan, src, tables, convert=True)
    bare = pack(plan, src, tables, convert=True, checksum=False)
    assert bare.checksums == [[] for _ in plan.transfers] and all(map(len, full.checksums))
    assert all(torch.equal(a, b) for a, b in zip(full.records, bare.records, strict=True))


@pytest.mark.parametrize("pair", [("trtllm-fp8", "flashmla-model1"), ("flashmla-model1", "trtllm-fp8"),
                                  ("flashmla-model1", "v41-fp8")])
def test_kv_records_convert_in_record_pages_with_each_records_own_bytes(pair):
    """``convert_kv_records`` runs N records as pages of ``RECORD_PAGE_ROWS`` rows and one page of the rest
    (600 = 2 x 256 + 88): each converted record holds the bytes of that record converted alone, on the native
    backend and the reference."""
    from kvbridge.layouts.registry import get_layout
    from kvbridge.ops import pages as page_ops
    from kvbridge.ops.records import RECORD_PAGE_ROWS, convert_kv_records

    src, dst = (get_layout(name) for name in pair)
    n = 2 * RECORD_PAGE_ROWS + 88
    x = torch.randn(n, 512, generator=torch.Generator().manual_seed(3)) * 2.0
    scales = {"src_scale": 1.0 if src.per_tensor_scale else None, "dst_scale": 1.0 if dst.per_tensor_scale else None,
              "dialect": None}
    records = src.pages_to_records(page_ops.encode(x, src, page_size=64, scale=scales["src_scale"]), 64, n)
    want = torch.cat([convert_kv_records(records[i : i + 1], src, dst, **scales)[0]
                      for i in range(0, n, 37)])
    got, _ = convert_kv_records(records, src, dst, **scales)
    assert torch.equal(got[::37], want)
    ref = torch.empty_like(got)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(dispatch.BACKEND_ENV, "reference")
        convert_kv_records(records, src, dst, **scales, out=ref)
    assert torch.equal(got, ref)


def test_move_spans_native_equals_the_reference():
    """Row segments between two tensors, whole spans (strides = width) and strided rows, native and reference."""
    g = torch.Generator().manual_seed(5)
    src = torch.randint(0, 256, (40000,), dtype=torch.uint8, generator=g)
    segs = np.array([[0, 100, 7], [5000, 9000, 30], [12345, 3, 1], [20000, 30000, 0]], np.int64)
    for src_stride, dst_stride, width in ((64, 64, 64), (68, 132, 64), (8, 4, 4)):
        want, got = torch.zeros(40000, dtype=torch.uint8), torch.zeros(40000, dtype=torch.uint8)
        from kvbridge.backends import reference
        reference.move_spans([(src, want, segs, src_stride, dst_stride, width)])
        native.move_spans([(src, got, segs, src_stride, dst_stride, width)])
        assert torch.equal(got, want) and bool(want.any())


@pytest.mark.parametrize("rule", ["vllm", "sglang", "trtllm", "vllm-ue8m0"])
def test_fp4_to_fp8_key_segments_from_unaligned_records_equal_the_torch_path(monkeypatch, rule):
    """Segments of 68-byte records starting at odd offsets (keys not 8-byte aligned: read through aligned local
    copies) into 132-byte records: the torch path's bytes and error."""
    src, dst = ix.indexer_format("fp4"), ix.indexer_format("fp8")
    g = torch.Generator().manual_seed(3)
    n = 3000
    records = torch.randint(0, 256, (n + 1, src.record_bytes), dtype=torch.uint8, generator=g)
    view = records.view(-1)[3 : 3 + n * src.record_bytes]  # 3 bytes in: no key is 8-byte aligned
    keys = view.view(n, src.record_bytes)
    keys[:, src.split :] = torch.randint(100, 140, (n, 4), dtype=torch.uint8, generator=g)
    monkeypatch.setenv("KVBRIDGE_BACKEND", "reference")
    want, want_err = ix.transcode_keys(keys.contiguous(), src, dst, rule)
    monkeypatch.delenv("KVBRIDGE_BACKEND")
    out = torch.zeros(n, dst.record_bytes, dtype=torch.uint8)
    firsts = np.array([0, 1, 17, 1000, 2999], np.int64)
    counts = np.diff(np.append(firsts, n))
    rb, ob = src.record_bytes, dst.record_bytes
    segs = np.stack([firsts * rb, firsts * rb + src.split, firsts * ob, firsts * ob + dst.split, counts], axis=1)
    flat = out.view(-1)
    err = dispatch.fp4_to_fp8_key_segments(view, view, flat, flat, segs, (rb, rb, ob, ob), 128, rule, measure=True)
    assert torch.equal(out, want) and err == want_err
    got, got_err = dispatch.fp4_to_fp8_keys(keys, 128, rule, measure=False)
    assert torch.equal(got, want) and got_err == 0.0


@pytest.mark.parametrize("kernels", ["C", "numba"])
def test_large_span_moves_split_over_threads_equal_the_reference(monkeypatch, kernels):
    """Moves over the inline and streaming thresholds (runs cut into row ranges across threads, non-temporal
    stores), several moves in one call, strided rows: the C span copy and numba's loop write the reference's bytes."""
    from kvbridge.backends import reference
    from kvbridge.backends.native import accel

    if kernels == "numba":
        monkeypatch.setattr(accel, "_SPANS", None)
    elif accel._SPANS is None:
        pytest.skip("the C extension is not built")
    g = torch.Generator().manual_seed(9)
    n = native.INLINE_MOVE_BYTES + (3 << 20)
    src = torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g)
    rows = (n - 4096) // 1024

    def moves(outs):  # one long span, then strided rows
        return [(src, outs[0], np.array([[0, 512, rows]], np.int64), 1024, 1024, 1024),
                (src, outs[1], np.array([[7, 3, 900], [200000, 100000, 5000]], np.int64), 68, 64, 64)]

    want = [torch.zeros(n, dtype=torch.uint8) for _ in range(2)]
    got = [torch.zeros(n, dtype=torch.uint8) for _ in range(2)]
    reference.move_spans(moves(want))
    native.move_spans(moves(got), into_pool=True)
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True)) and bool(want[1].any())


@pytest.mark.parametrize("kernels", ["C", "numba"])
def test_a_span_move_out_of_bounds_is_refused_before_any_byte_moves(monkeypatch, kernels):
    """Every segment of every move is checked against both tensors before any copy (the C copy sees only
    addresses, numba's loop runs without bounds checks)."""
    from kvbridge.backends.native import accel

    if kernels == "numba":
        monkeypatch.setattr(accel, "_SPANS", None)
    src, dst = torch.ones(1000, dtype=torch.uint8), torch.zeros(1000, dtype=torch.uint8)
    for segs, strides in (([[0, 0, 2], [990, 0, 1]], (64, 64)), ([[0, 980, 1]], (64, 64)), ([[-1, 0, 1]], (64, 64)),
                          ([[0, 0, -1]], (64, 64)), ([[0, 0, 1]], (32, 64))):
        with pytest.raises(InputError, match="span move out of bounds"):
            native.move_spans([(src, dst, np.array([[0, 0, 1]], np.int64), 64, 64, 64),
                               (src, dst, np.array(segs, np.int64), *strides, 64)])
        assert not bool(dst.any())


def test_direct_batches_serve_the_keys_and_byte_moves(monkeypatch):
    """``migrate_local`` and ``finish`` convert fp4 -> fp8 keys straight between pages and byte-move straight from
    the source (no staging), with the transports' unfused bytes."""
    ran = []
    monkeypatch.setattr(ex, "_convert_keys_direct", lambda *a, _f=ex._convert_keys_direct: ran.append("k") or _f(*a))
    plan = plan_migration("trtllm:fp8:tpb=128", "vllm", MODEL, TOKENS)
    src, tables = source_request(plan, seed=3)
    payload = pack(plan, src, tables, convert=False)
    want_dst = destination_pools(plan, seed=4)
    want_tables = ex.publish(plan, ex.convert_payload(plan, payload), want_dst)
    for run in (lambda d: migrate_local(plan, src, tables, d), lambda d: _transport_path(plan, src, tables, d, True)):
        ran.clear()
        got_dst = destination_pools(plan, seed=4)
        assert run(got_dst)[0] == want_tables and "k" in ran
        want_pools, got_pools = _pools(want_dst), _pools(got_dst)
        assert all(torch.equal(got_pools[k], want_pools[k]) for k in want_pools)
    same = plan_migration("vllm", "vllm:block=128", MODEL, TOKENS)
    src, tables = source_request(same, seed=3)
    want_dst = destination_pools(same, seed=4)
    ex.publish(same, ex.convert_payload(same, pack(same, src, tables, convert=False)), want_dst)
    moved = []
    monkeypatch.setattr(dispatch, "move_spans", lambda moves, into_pool=False, _f=dispatch.move_spans:
                        moved.append(1) or _f(moves, into_pool))
    got_dst = destination_pools(same, seed=4)
    migrate_local(same, src, tables, got_dst)
    assert moved and all(torch.equal(a, b) for a, b in zip(_pools(got_dst).values(), _pools(want_dst).values(),
                                                            strict=True))


def test_adjacent_runs_merge_into_one_move_with_the_same_bytes(monkeypatch):
    """Segments that continue each other on both sides merge (strides apart: rows of adjacent pages), others stay;
    a byte move between pools whose pages are handed out in order (adjacent page runs) moves fewer, longer
    segments and writes the transports' unfused bytes."""
    from kvbridge.migration.pools import coalesce_segments

    segs = np.array([[0, 0, 2], [20, 20, 3], [100, 50, 1], [110, 60, 1], [130, 70, 1]], np.int64)
    assert coalesce_segments(segs, 10, 10).tolist() == [[0, 0, 5], [100, 50, 2], [130, 70, 1]]
    assert coalesce_segments(segs[:1], 10, 10).tolist() == [[0, 0, 2]]
    same = plan_migration("vllm", "vllm:block=128", MODEL, TOKENS)
    src = EnginePools.create(same.src, same.model, same.held_pages("src"), include_mtp=same.include_mtp)
    src.free = {name: ids[::-1] for name, ids in src.free.items()}  # claimed in order: page runs adjacent
    tables = src.claim(same.table_lengths("src"), same.released("src"))
    from kvbridge.migration.synthetic import fill_synthetic
    fill_synthetic(same, src, tables, seed=3)
    want_dst = destination_pools(same, seed=None)
    want_dst.free = {name: ids[::-1] for name, ids in want_dst.free.items()}
    ex.publish(same, ex.convert_payload(same, pack(same, src, tables, convert=False)), want_dst)
    rows = []
    def counted(moves, into_pool=False, _f=dispatch.move_spans):
        rows.append(sum(m[2].shape[0] for m in moves))
        _f(moves, into_pool)

    monkeypatch.setattr(dispatch, "move_spans", counted)
    counts = []
    for merge in (False, True):
        if not merge:
            monkeypatch.setattr(ex, "coalesce_segments", lambda segs, *_: segs)
        got_dst = destination_pools(same, seed=None)
        got_dst.free = {name: ids[::-1] for name, ids in got_dst.free.items()}
        rows.clear()
        migrate_local(same, src, tables, got_dst)
        counts.append(sum(rows))
        assert all(torch.equal(a, b) for a, b in zip(_pools(got_dst).values(), _pools(want_dst).values(), strict=True))
        monkeypatch.setattr(ex, "coalesce_segments", coalesce_segments)
    assert 0 < counts[1] <= counts[0]  # vLLM's pages interleave their parts: few runs continue across pages
