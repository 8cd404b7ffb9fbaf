"""Versioned engine profiles: options, per-role storage and addressing, and the refusals with their reasons."""

from __future__ import annotations

import pytest
import torch

from kvbridge.engines.profiles import parse_engine
from kvbridge.engines.topology import FLASH, Role
from kvbridge.errors import InputError
from kvbridge.migration import (
    EnginePools,
    destination_pools,
    gather_records,
    migrate_local,
    plan_migration,
    source_request,
)
from kvbridge.migration.pools import table_of

MODEL = FLASH.with_layers(4)


def _storages(spec: str) -> dict:
    prof = parse_engine(spec)
    return {(c.role, c.ratio): prof.storage(c) for c in MODEL.caches(2) + MODEL.caches(3)}


def test_every_profile_names_its_version_choices_and_sources():
    for spec, version in (("sglang", "SGLang 0.5.23"), ("vllm", "vLLM 0.33.0"), ("trtllm", "TensorRT-LLM main")):
        prof = parse_engine(spec)
        assert prof.version.startswith(version)
        assert set(prof.sources) >= {"kv", "indexer", "state"}
        assert prof.choices and not any(c.given for c in prof.choices)
        assert prof.to_dict()["choices"][0]["source"]
    given = parse_engine("sglang:draft=3").choices
    assert [c.option for c in given if c.given] == ["draft"]


def test_sglang_state_follows_the_swa_pages_and_doubles_under_speculative_decoding():
    st = _storages("sglang")
    c4, c128 = st[(Role.STATE, 4)], st[(Role.STATE, 128)]
    assert (c4.addressing, c4.table, c4.page_size, c4.span, c4.record_bytes) == ("page-ring", "swa", 8, 256, 8192)
    assert (c128.addressing, c128.table, c128.page_size) == ("ring", "state128", 128)
    assert st[(Role.INDEXER_STATE, 4)].table == "swa"
    spec = _storages("sglang:draft=2:state=bf16:swa=128")
    assert (spec[(Role.STATE, 4)].page_size, spec[(Role.STATE, 4)].span, spec[(Role.STATE, 4)].record_bytes) == (
        16, 128, 4096)
    assert spec[(Role.STATE, 128)].page_size == 256 and spec[(Role.STATE, 128)].fmt == "bf16"
    assert spec[(Role.COMPRESS, 4)].page_size == 32 and spec[(Role.COMPRESS, 128)].page_size == 1  # page // r
    online = _storages("sglang:online=1")[(Role.STATE, 128)]
    assert (online.fmt, online.record_bytes, online.page_size) == ("online-fp32", 3 * 512 * 4, 1)


def test_vllm_blocks_are_576_aligned_and_state_is_position_paged():
    st = _storages("vllm")
    assert st[(Role.INDEXER, 4)].page_bytes == 8640  # 64 x 132 = 8448, rounded up to 15 x 576
    assert (st[(Role.STATE, 4)].addressing, st[(Role.STATE, 4)].page_size, st[(Role.STATE, 4)].page_bytes) == (
        "paged", 4, 32832)
    assert (st[(Role.STATE, 128)].page_size, st[(Role.STATE, 128)].table) == (8, "state128")
    assert st[(Role.INDEXER, 4)].dialect == "vllm"
    sm100 = _storages("vllm:gpu=sm100:kv=flashinfer")
    assert sm100[(Role.INDEXER, 4)].dialect == "vllm-ue8m0" and sm100[(Role.INDEXER, 4)].page_bytes == 8704
    assert sm100[(Role.SWA, 0)].fmt == "trtllm-fp8" and sm100[(Role.SWA, 0)].scale == 1.0
    assert _storages("vllm:block=512")[(Role.COMPRESS, 4)].page_size == 128


def test_trtllm_keeps_kv_and_score_in_separate_pools():
    st = _storages("trtllm:state=bf16:tpb=256")[(Role.STATE, 4)]
    assert st.separate_pools and st.split == 2048 and st.record_bytes == 4096 and st.page_size == 256
    plan = plan_migration("vllm", "trtllm:state=bf16", MODEL, 700)
    dst = destination_pools(plan)
    kv, score = dst.pool(next(c for c in MODEL.caches(2) if c.role == Role.STATE))
    assert kv.shape[1] == score.shape[1] == 128 * 2048
    with pytest.raises(InputError, match=r"must be uint8 \[num_pages, 262144\] and uint8 \[num_pages, 262144\]"):
        bad = dict(dst.pools)
        bad[(2, Role.STATE)] = kv
        EnginePools.wrap(plan.dst, MODEL, bad)
    wrapped = EnginePools.wrap(plan.dst, MODEL, dst.pools)
    src, src_tables = source_request(plan, seed=2)
    tables, report = migrate_local(plan, src, src_tables, wrapped)
    assert report.state_max_abs_error is not None and report.state_max_abs_error > 0  # fp32 -> bf16, reported
    assert bool(kv.any()) and bool(score.any())
    for pool, name in ((kv, "state4"), (score, "state4_score")):  # two pools, two block tables
        assert not bool(pool[[i for i in range(pool.shape[0]) if i not in tables[name]]].any())
    st4 = plan.dst.storage(next(c for c in MODEL.caches(2) if c.role == Role.STATE))
    assert st4.score_table == "state4_score"
    with pytest.raises(InputError, match="needs both tables"):
        gather_records((kv, score), st4, tables["state4"], 696, 4)


@pytest.mark.parametrize(("spec", "message"), [
    ("sglang:e4m3=fnuz", r"float8_e4m3fnuz pools \(ROCm gfx942"),
    ("vllm:e4m3=fnuz", "float8_e4m3fnuz"),
    ("vllm:gpu=mi300:e4m3=fn", "gfx942 pools are always FNUZ"),
    ("sglang:gpu=mi300", "gfx942.*software E4M3 cast.*448"),
    ("sglang:gpu=mi355", "gfx950.*hardware E4M3 cast.*SGLANG_USE_AITER"),
    ("vllm:kv=v41", r"DeepSeek-V4.1 528-B MXFP8 rows .*v41-fp8-interleaved, dialect amax-1e-4.*ratios 1 and 2 "
                    r"\(vllm/models/deepseek_v41/compressor.py\)"),
    ("sglang:unified=1", r"unified_kv_triton.*request-scoped ratio-4 compressor state .*compressor_v2.py use_req_ring"),
    ("sglang:gpu=mi355:unified=1", "unified-KV build"),
    ("sglang:attn=trtllm:gpu=mi355", "SGLang 0.5.23 on ROCm"),
    ("sglang:attn=trtllm:online=1", "trtllm does not support SGLANG_OPT_USE_ONLINE_COMPRESS"),
    ("sglang:attn=flashinfer", "attn must be one of flashmla, trtllm"),
    ("vllm:kv=flashinfer", "kv=flashinfer on sm100, sm120 only, not sm90"),
    ("vllm:block=100", "block must be a multiple of 64"),
    ("vllm:block=64", "ratio-128 layers cannot page"),
    ("vllm:block=192", "ratio-128 layers cannot page"),
    ("sglang:swa=64", "ratio-128 pages of 0.5 entries"),
    ("sglang:online=1:draft=2", "does not support speculative decoding"),
    ("sglang:state=fp16", "state must be one of fp32, bf16"),
    ("trtllm:fp8:tpb=64", "tpb must be one of 128, 256"),
    ("trtllm:fp8:colour=red", "unknown option 'colour=red'"),
])
def test_unhonourable_options_are_refused_in_one_line(spec, message):
    with pytest.raises(InputError, match=message) as info:
        parse_engine(spec)
    assert "\n" not in str(info.value)


def test_plans_refuse_what_kvbridge_cannot_write_exactly():
    # SGLang stores raw compressor scores, vLLM and TensorRT-LLM score + APE: no state between them
    for src, dst in (("sglang", "vllm"), ("trtllm", "sglang"), ("sglang:state=bf16", "trtllm:state=bf16")):
        with pytest.raises(InputError, match=r"without the positional bias \(APE\).* stores score \+ APE"):
            plan_migration(src, dst, MODEL, 700)
    assert plan_migration("trtllm", "sglang", FLASH.with_layers(2), 700).transfers  # SWA-only layers: no state
    with pytest.raises(InputError, match="cannot be recovered from it"):
        plan_migration("sglang:online=1", "sglang", MODEL, 700)
    with pytest.raises(InputError, match="online ratio-128 state .* cannot write it bit for bit"):
        plan_migration("sglang", "sglang:online=1", MODEL, 700)
    with pytest.raises(InputError, match="2 virtual draft layers"):
        plan_migration("vllm:draft=3", "trtllm:draft=3", MODEL, 700)
    plan = plan_migration("vllm:draft=3", "trtllm:draft=3", MODEL, 700, include_mtp=False)
    assert all(not MODEL.is_mtp(t.spec.layer) for t in plan.transfers)
    online = plan_migration("sglang:online=1", "sglang:online=1", MODEL, 700)
    row = next(t for t in online.transfers if t.spec.role == Role.STATE and t.spec.ratio == 128)
    assert (row.first, row.count, row.conversion) == (5, 1, "online-fp32 rows by position")


def test_swa_range_into_sglang_starts_on_its_page_as_far_as_the_source_holds():
    swa_only = FLASH.with_layers(2)
    # window 2872..2999; SGLang's page starts at 2816; TensorRT-LLM at tpb 256 holds from 2816 too
    plan = plan_migration("trtllm:tpb=256", "sglang", swa_only, 3000)
    swa = next(t for t in plan.transfers if t.spec.role == Role.SWA)
    assert (swa.first, swa.count) == (2816, 184)
    # vLLM releases 64-token blocks: it holds from 2816 (block 44), so the same range moves
    plan = plan_migration("vllm", "sglang", swa_only, 3000)
    assert next(t for t in plan.transfers if t.spec.role == Role.SWA).first == 2816
    # window 2950..3077: SGLang at page 256 wants 2816.., a 128-token source page holds only 2944..
    plan = plan_migration("sglang:swa=128", "sglang", MODEL, 3078)
    assert next(t for t in plan.transfers if t.spec.role == Role.SWA).first == 2944
    # into vLLM or TensorRT-LLM only the window moves
    plan = plan_migration("sglang", "vllm", swa_only, 3000)
    assert next(t for t in plan.transfers if t.spec.role == Role.SWA).first == 2872


def test_bf16_state_into_fp32_is_exact_and_cleared_rows_keep_minus_infinity():
    plan = plan_migration("sglang:state=bf16", "sglang", MODEL, 700)
    src, src_tables = source_request(plan, seed=1)
    dst = destination_pools(plan)
    tables, report = migrate_local(plan, src, src_tables, dst)
    assert report.state_max_abs_error == 0.0
    t = next(t for t in plan.transfers if t.spec.role == Role.STATE and t.spec.ratio == 4)
    rows = gather_records(dst.pool(t.spec), t.dst, table_of(tables, t.dst), t.first, t.count).view(torch.float32)
    assert bool(torch.isneginf(rows[::5, rows.shape[1] // 2 :]).all())  # every fifth row was cleared


def test_no_state_error_is_reported_when_no_state_row_changes_dtype():
    plan = plan_migration("trtllm", "vllm", MODEL, 700)
    src, src_tables = source_request(plan, seed=3)
    _, report = migrate_local(plan, src, src_tables, destination_pools(plan))
    assert report.state_max_abs_error is None and report.indexer_max_abs_error is not None


def test_rocm_profiles_name_each_cache_format_and_its_source():
    mi300 = parse_engine("vllm:gpu=mi300")
    swa = next(c for c in MODEL.caches(0) if c.role == Role.SWA)
    comp = next(c for c in MODEL.caches(2) if c.role == Role.COMPRESS)
    assert (mi300.storage(swa).fmt, mi300.storage(swa).dialect) == ("model1-fnuz", "amax-1e-4/224")
    assert (mi300.storage(comp).fmt, mi300.storage(comp).dialect) == ("flashmla-model1", "amax-1e-4")
    assert mi300.storage(swa).page_bytes == mi300.storage(swa).layout.page_bytes(64)
    assert {c.option: c.value for c in mi300.choices}["e4m3"] == "fnuz" and "use_fnuz" in mi300.source
    p = parse_engine("vllm:gpu=mi355")
    assert p.kv_layout == "flashmla-model1" and p.compress_layout is None


def test_sglang_trtllm_backend_is_trtllm_fp8_at_unit_scale():
    st, flashmla = _storages("sglang:attn=trtllm"), _storages("sglang")
    swa, c4, c128 = st[(Role.SWA, 0)], st[(Role.COMPRESS, 4)], st[(Role.COMPRESS, 128)]
    assert (swa.fmt, swa.scale, swa.dialect, swa.page_size, swa.page_bytes) == ("trtllm-fp8", 1.0, "swa", 256, 131072)
    assert (c4.dialect, c4.page_size, c4.page_bytes) == ("compress", 64, 32768)
    assert (c128.page_size, c128.page_bytes) == (2, 1024)  # 512-B rows, no page pad
    for key in ((Role.STATE, 4), (Role.STATE, 128), (Role.INDEXER, 4), (Role.INDEXER_STATE, 4)):
        assert st[key] == flashmla[key]  # the trtllm backend changes only the KV pools
    prof = parse_engine("sglang:attn=trtllm")
    assert prof.spec == "sglang:swa=256:idx=fp8:attn=trtllm" and "DeepSeekV4UniformFP8KVPool" in prof.sources["kv"]
    assert {c.option: (c.value, c.given) for c in prof.choices}["attn"] == ("trtllm", True)
    # TensorRT-LLM at scale 1 -> SGLang's trtllm pools: the KV records move as they are
    plan = plan_migration("trtllm:fp8:tpb=256", "sglang:attn=trtllm", FLASH.with_layers(2), 3000)
    src, src_tables = source_request(plan, seed=4)
    dst = destination_pools(plan)
    tables, _ = migrate_local(plan, src, src_tables, dst)
    for t in plan.transfers:
        assert t.conversion == "byte move"
        got = gather_records(dst.pool(t.spec), t.dst, table_of(tables, t.dst), t.first, t.count)
        assert torch.equal(got, gather_records(src.pool(t.spec), t.src, table_of(src_tables, t.src), t.first, t.count))
    # SGLang's FlashMLA pools <-> its trtllm pools: KV transcoded, state and indexer moved unchanged
    into = {"transcode flashmla-model1 -> trtllm-fp8, swa, scale 1",
            "transcode flashmla-model1 -> trtllm-fp8, compress, scale 1"}
    back = {"transcode trtllm-fp8 -> flashmla-model1, amax-1e-4"}
    for a, b, conversions in (("sglang", "sglang:attn=trtllm", into), ("sglang:attn=trtllm", "sglang", back)):
        plan = plan_migration(a, b, MODEL, 700)
        assert {t.conversion for t in plan.transfers if t.spec.role in (Role.SWA, Role.COMPRESS)} == conversions
        src, src_tables = source_request(plan, seed=6)
        tables, report = migrate_local(plan, src, src_tables, destination_pools(plan))
        assert report.state_max_abs_error is None


def test_sglang_pd_peers_refuse_the_trtllm_backend_pools():
    from kvbridge.adapters.sglang_protocol import pd_layout

    pools = EnginePools.create("sglang:attn=trtllm", FLASH.with_layers(2), {"full": 4, "swa": 4}, include_mtp=False)
    with pytest.raises(InputError, match="stores trtllm-fp8; the SGLang peer serves the V4 .584 B. layout"):
        pd_layout(pools)


def test_vllm_trtllm_gen_rows_move_into_sglang_trtllm_pools_as_bytes():
    from kvbridge.migration.ape import synthetic_ape

    # both engines' TRTLLM-gen backends keep trtllm-fp8 at scale 1: the KV moves as bytes, the state loses its APE
    plan = plan_migration("vllm:gpu=sm100:kv=flashinfer", "sglang:attn=trtllm", MODEL, 700, ape=synthetic_ape(MODEL))
    kv = [t for t in plan.transfers if t.spec.role in (Role.SWA, Role.COMPRESS)]
    assert {t.conversion for t in kv} == {"byte move"}
    src, src_tables = source_request(plan, seed=8)
    dst = destination_pools(plan)
    tables, _ = migrate_local(plan, src, src_tables, dst)
    for t in kv:
        got = gather_records(dst.pool(t.spec), t.dst, table_of(tables, t.dst), t.first, t.count)
        assert torch.equal(got, gather_records(src.pool(t.spec), t.src, table_of(src_tables, t.src), t.first, t.count))
