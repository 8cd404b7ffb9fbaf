"""In-process migration between every engine pair: destination bytes equal the reference codecs' output.

Model: DeepSeek-V4-Flash cut to its first 4 main layers (+ MTP): ratios [0, 0, 4, 128] + [0].
Request: 700 tokens (5 C128 entries, 175 C4 entries, SWA window 572..699 across a page boundary).
"""

from __future__ import annotations

import json

import pytest
import torch
from click.testing import CliRunner
from migration_helpers import expected_records

from cli.main import cli
from kvbridge.engines.topology import FLASH, Role
from kvbridge.errors import InputError
from kvbridge.migration import (
    ChecksumError,
    EnginePools,
    MigrationError,
    convert_payload,
    destination_pools,
    gather_records,
    migrate_local,
    pack,
    plan_migration,
    publish,
    source_request,
    verify,
)
from kvbridge.migration.pools import part_spans, pool_tensors, scatter_records, table_of

MODEL = FLASH.with_layers(4)
TOKENS = 700


def _flat(pools) -> dict:
    """Every pool tensor of an ``EnginePools`` (kv and score pools of a state role separately)."""
    return {(k, i): t for k, v in pools.pools.items() for i, t in enumerate(pool_tensors(v))}


def _check(plan, src, src_tables, dst, dst_tables) -> None:
    for t in plan.transfers:
        src_records = gather_records(src.pool(t.spec), t.src, table_of(src_tables, t.src), t.first, t.count)
        want = expected_records(t, src_records)
        got = gather_records(dst.pool(t.spec), t.dst, table_of(dst_tables, t.dst), t.first, t.count)
        assert torch.equal(got, want), f"{plan.src.spec} -> {plan.dst.spec}: layer {t.spec.layer} {t.spec.role.value}"


PAIRS = [
    ("trtllm:fp8:tpb=128", "vllm"),
    ("trtllm:fp8:tpb=256:idx=fp8:scale=0.5", "vllm"),
    ("vllm", "trtllm:fp8-ds-mla:tpb=128"),
    ("vllm", "trtllm:bf16:tpb=256:idx=fp4"),
    ("trtllm:bf16:tpb=128", "vllm:idx=fp4"),
    ("sglang", "sglang:swa=128:idx=fp4"),
    # speculative decoding (rings of 16 / 256) and bf16 state, both ways
    ("sglang:draft=3:state=bf16", "sglang"),
    ("sglang", "sglang:draft=2:state=bf16:idx=fp4"),
    # vLLM's fp32 blocks of 4 / 8 positions and SM100 UE8M0 indexer scales, TensorRT-LLM's bf16 state
    ("vllm:gpu=sm100:idx=fp8", "trtllm:state=bf16"),
    ("trtllm:fp8:tpb=256:state=bf16:draft=1", "vllm:gpu=sm100"),
    ("vllm:kv=flashinfer:gpu=sm100:block=512", "trtllm:fp8-ds-mla:tpb=128:idx=fp8"),
    ("sglang:online=1", "sglang:online=1:idx=fp4"),
    # ROCm: gfx942 vLLM (FNUZ SWA, OCP compressed) to and from vLLM on H100/H200
    ("vllm:gpu=mi300", "vllm:gpu=sm90"),
    ("vllm:gpu=sm90:idx=fp4", "vllm:gpu=mi300:idx=fp4"),
]


@pytest.mark.parametrize(("src_spec", "dst_spec"), PAIRS)
def test_local_migration_bytes_match_reference(src_spec, dst_spec):
    plan = plan_migration(src_spec, dst_spec, MODEL, TOKENS, draft_tokens=2)
    src, src_tables = source_request(plan, spare_pages=1, seed=3)
    dst = destination_pools(plan, spare_pages=1)
    tables, report = migrate_local(plan, src, src_tables, dst)
    _check(plan, src, src_tables, dst, tables)
    assert report.transfers == len(plan.transfers)
    assert report.payload_bytes == plan.totals()["all"]["src_bytes"]
    converted_kv = [t for t in plan.transfers if t.src.kind == "kv" and t.conversion != "byte move"]
    # one loss report per conversion batch, covering every converted KV entry once
    assert sum(r.num_tokens for r in report.loss) == sum(t.count for t in converted_kv)


def test_rocm_fnuz_round_trip_reports_the_fnuz_loss():
    """gfx942 vLLM -> vLLM on H100/H200 -> back: each leg's bytes are the destination writer's, the SWA
    transcodes are reported (into FNUZ with its note: tiles scaled to 224), the compressed cache moves as bytes."""
    there = plan_migration("vllm:gpu=mi300", "vllm:gpu=sm90", MODEL, TOKENS)
    src, src_tables = source_request(there, seed=5)
    mid = destination_pools(there)
    mid_tables, report = migrate_local(there, src, src_tables, mid)
    _check(there, src, src_tables, mid, mid_tables)
    swa = [t for t in there.transfers if t.spec.role == Role.SWA]
    assert swa and all(t.src.fmt == "model1-fnuz" and t.dst.fmt == "flashmla-model1" for t in swa)
    assert all(t.conversion == "byte move" for t in there.transfers if t.spec.role == Role.COMPRESS)
    assert report.loss and {r.src_layout for r in report.loss} == {"model1-fnuz"}
    back = plan_migration("vllm:gpu=sm90", "vllm:gpu=mi300", MODEL, TOKENS)
    home = destination_pools(back)
    home_tables, report_back = migrate_local(back, mid, mid_tables, home)
    _check(back, mid, mid_tables, home, home_tables)
    fnuz = [r for r in report_back.loss if r.dst_layout == "model1-fnuz"]
    assert fnuz and all("224" in r.note for r in fnuz if not r.lossless)


def test_sender_side_conversion_gives_the_same_bytes():
    plan = plan_migration("vllm", "trtllm:fp8:tpb=128", MODEL, TOKENS)
    src, src_tables = source_request(plan, seed=4)
    results = []
    for side in ("sender", "receiver"):
        dst = destination_pools(plan, seed=9)
        tables, report = migrate_local(plan, src, src_tables, dst, convert_on=side)
        assert report.converted_on == side and report.payload_bytes == (
            plan.totals()["all"]["dst_bytes" if side == "sender" else "src_bytes"])
        results.append((tables, {k: v.clone() for k, v in _flat(dst).items()}, report))
    assert results[0][0] == results[1][0]
    assert all(torch.equal(results[0][1][k], results[1][1][k]) for k in results[0][1])
    # MODEL1 -> per-tensor FP8 at scale 1: small tiles lose bits, the report says so.
    assert not results[0][2].kv_lossless and results[0][2].kv_max_abs_error == results[1][2].kv_max_abs_error > 0


def test_windowed_blocks_are_released_and_unclaimed_pages_stay_zero():
    plan = plan_migration("vllm", "trtllm:fp8:tpb=128", MODEL, TOKENS)
    src, src_tables = source_request(plan, seed=5)
    dst = destination_pools(plan, spare_pages=2)
    tables, _ = migrate_local(plan, src, src_tables, dst)
    assert tables["swa"][:4] == [-1] * 4 and min(tables["swa"][4:]) >= 0  # tokens 572..699 in blocks 4, 5
    assert tables["state4"][:5] == [-1] * 5  # ratio-4 state rows 696..699 live in block 5
    assert tables["state4_score"][:5] == [-1] * 5 and tables["state4_score"][5] >= 0  # the score pool's own table
    for t in plan.transfers:
        parts = pool_tensors(dst.pool(t.spec))
        names = [t.dst.table, t.dst.score_table] if t.dst.score_table else [t.dst.table] * len(parts)
        for pool, name in zip(parts, names, strict=True):
            held = {i for i in tables[name] if i >= 0}
            assert not any(bool(pool[i].any()) for i in range(pool.shape[0]) if i not in held)


def test_corrupted_chunk_is_refused_and_nothing_is_claimed():
    plan = plan_migration("trtllm:fp8:tpb=128", "vllm", MODEL, TOKENS)
    src, src_tables = source_request(plan, seed=6)
    payload = pack(plan, src, src_tables, convert=False)
    k = next(i for i, t in enumerate(plan.transfers) if t.spec.role == Role.INDEXER)
    payload.records[k][40, 3] ^= 0x01
    dst = destination_pools(plan)
    before = dst.num_free()
    with pytest.raises(ChecksumError, match=r"layer 2 indexer_compress, source page chunk 1 \(xxh3-64"):
        verify(plan, payload)
    assert dst.num_free() == before and not any(bool(p.any()) for p in _flat(dst).values())


def test_payload_for_another_plan_and_unconverted_publish_are_refused():
    plan = plan_migration("trtllm:fp8:tpb=128", "vllm", MODEL, TOKENS)
    other = plan_migration("trtllm:fp8:tpb=128", "vllm", MODEL, TOKENS + 1)
    src, src_tables = source_request(plan, seed=7)
    payload = pack(plan, src, src_tables, convert=False)
    with pytest.raises(MigrationError, match="plan fingerprints differ"):
        verify(other, payload)
    dst = destination_pools(plan)
    with pytest.raises(MigrationError, match="publish needs converted records"):
        publish(plan, payload, dst)
    tables = publish(plan, convert_payload(plan, payload), dst)
    assert set(tables) == set(plan.table_lengths("dst"))


def test_full_destination_claims_nothing():
    plan = plan_migration("trtllm:fp8:tpb=128", "vllm", MODEL, TOKENS)
    src, src_tables = source_request(plan, seed=8)
    dst = destination_pools(plan)
    dst.free["compress4"] = dst.free["compress4"][:1]  # another request holds the rest
    before = dst.num_free()
    with pytest.raises(InputError, match="block table 'compress4' of vllm:block=256:idx=fp8:gpu=sm90:kv=fp8_ds_mla "
                                         "has 1 free pages"):
        migrate_local(plan, src, src_tables, dst)
    assert dst.num_free() == before


def test_pools_of_another_profile_and_released_source_pages_are_refused():
    plan = plan_migration("trtllm:fp8:tpb=128", "vllm", MODEL, TOKENS)
    src, src_tables = source_request(plan, seed=9)
    with pytest.raises(InputError, match="dst pools are sglang:swa=256:idx=fp8"):
        migrate_local(plan, src, src_tables, destination_pools(plan_migration("sglang", "sglang", MODEL, TOKENS)))
    with pytest.raises(InputError, match="convert_on must be 'sender' or 'receiver'"):
        migrate_local(plan, src, src_tables, destination_pools(plan), convert_on="middle")  # type: ignore[arg-type]
    broken = dict(src_tables, swa=[-1] * len(src_tables["swa"]))
    with pytest.raises(InputError, match="block table 'swa' index 4 is released"):
        migrate_local(plan, src, broken, destination_pools(plan))


def test_cli_run_json():
    result = CliRunner().invoke(cli, ["migrate", "run", "--from", "trtllm:fp8:tpb=128", "--to", "vllm",
                                      "--tokens", "300", "--layers", "3", "--json"])
    assert result.exit_code == 0, result.output
    data = json.loads(result.output)
    assert data["kv_lossless"] is True and data["transfers"] == 4 + 4  # 4 SWA caches, layer 2's four caches
    # window 172..299 in vLLM's SWA blocks 2..4 of 64 tokens; blocks 0 and 1 are released
    assert data["tables"]["swa"][:2] == [-1, -1] and min(data["tables"]["swa"][2:]) >= 0


def test_skipping_the_loss_report_writes_the_same_bytes():
    plan = plan_migration("trtllm:fp8:tpb=128", "vllm", MODEL, TOKENS)
    src, src_tables = source_request(plan, seed=10)
    pools = []
    for measure in (True, False):
        dst = destination_pools(plan, seed=2)
        _, report = migrate_local(plan, src, src_tables, dst, loss_report=measure)
        pools.append(_flat(dst))
        if not measure:
            assert report.loss == [] and report.kv_lossless is None and report.indexer_max_abs_error is None
    assert all(torch.equal(pools[0][k], pools[1][k]) for k in pools[0])


def test_wrapping_engine_owned_pool_tensors():
    plan = plan_migration("trtllm:fp8:tpb=128", "vllm", MODEL, TOKENS)
    src, src_tables = source_request(plan, seed=12)
    owned = destination_pools(plan, spare_pages=1)
    wrapped = EnginePools.wrap("vllm", MODEL, owned.pools)
    assert wrapped.num_free() == {k: n for k, n in owned.pages_per_table.items()}
    tables, _ = migrate_local(plan, src, src_tables, wrapped)
    _check(plan, src, src_tables, wrapped, tables)
    assert wrapped.pools[(0, Role.SWA)].data_ptr() == owned.pools[(0, Role.SWA)].data_ptr()  # written in place
    bad = dict(owned.pools)
    bad[(2, Role.INDEXER)] = bad[(2, Role.INDEXER)][:, :-1]
    with pytest.raises(InputError, match=r"pool of layer 2 indexer_compress must be uint8 \[num_pages, 8640\]"):
        EnginePools.wrap("vllm", MODEL, bad)
    del bad[(2, Role.INDEXER)]
    with pytest.raises(InputError, match="pool of layer 2 indexer_compress is missing"):
        EnginePools.wrap("vllm", MODEL, bad)


@pytest.mark.parametrize("spec", ["vllm", "trtllm:fp8:tpb=128", "sglang"])
def test_record_moves_native_reference_and_strided_pools_agree(monkeypatch, spec):
    """Gathering and scattering records moves the same bytes on the native span copies and the reference's
    torch copies, in contiguous pools and in pools whose pages lie a fixed stride apart with other bytes between
    them (views of an engine's buffer, as vLLM's cache layers are: moved as spans of the underlying bytes), for
    every cache of the model (block-split, token-major, separate pools, rings)."""
    plan = plan_migration(spec, spec, MODEL, TOKENS, draft_tokens=2)
    src, tables = source_request(plan, spare_pages=2, seed=5)
    for t in plan.transfers:
        pool, table = src.pool(t.spec), table_of(tables, t.src)
        want = gather_records(pool, t.src, table, t.first, t.count)
        monkeypatch.setenv("KVBRIDGE_BACKEND", "reference")
        assert torch.equal(gather_records(pool, t.src, table, t.first, t.count), want)
        monkeypatch.delenv("KVBRIDGE_BACKEND")
        strided = tuple(torch.zeros(x.shape[0], x.shape[1] + 3, dtype=torch.uint8)[:, 3:] for x in pool_tensors(pool))
        for x, y in zip(strided, pool_tensors(pool), strict=True):
            x.copy_(y)
        strided_pool = strided if isinstance(pool, tuple) else strided[0]
        assert not strided[0].is_contiguous()
        assert part_spans(strided_pool, t.src, table, t.first, t.count) is not None  # span copies, not slices
        assert torch.equal(gather_records(strided_pool, t.src, table, t.first, t.count), want)
        noise = torch.randint(0, 256, want.shape, dtype=torch.uint8)
        for backend in ("auto", "reference"):
            monkeypatch.setenv("KVBRIDGE_BACKEND", backend)
            scatter_records(pool, t.src, table, t.first, noise)
            scatter_records(strided_pool, t.src, table, t.first, noise)
            for x, y in zip(strided, pool_tensors(pool), strict=True):
                assert torch.equal(x, y)
            assert torch.equal(gather_records(pool, t.src, table, t.first, t.count), noise)
            scatter_records(pool, t.src, table, t.first, want)
            scatter_records(strided_pool, t.src, table, t.first, want)
