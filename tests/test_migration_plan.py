"""Migration plan: entries per role, page ranges, byte totals, and the ``kvbridge migrate plan`` command.

The 128K-token Flash numbers are computed here by hand from the layouts' formulas,
independently of kvbridge's profiles: 44 layers with SWA (43 + MTP), 21 ratio-4 and 20
ratio-128 layers; TensorRT-LLM FP8 at tokens_per_block 128 with its fp4 indexer -> vLLM
fp8_ds_mla (block size 256). The destination used to be SGLang; that pair is now refused
(SGLang stores compressor scores without the positional bias, the others with it), so the
numbers are vLLM's: SWA blocks of 64, every block stride rounded up to 576 B.
"""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from cli.main import cli
from kvbridge.engines.topology import FLASH, Role
from kvbridge.errors import InputError
from kvbridge.migration import live_entries, plan_migration

L = 131072
SWA_LAYERS, C4_LAYERS, C128_LAYERS = 44, 21, 20
MODEL1_PAGE = {2: 1728, 64: 37440, 256: 149760}  # ceil(P * 584 / 576) * 576


def _align576(n: int) -> int:
    return -(-n // 576) * 576


def _hand_totals_128k() -> dict[str, dict[str, int]]:
    swa = 128  # the last window, no draft tokens
    c4, c128 = L // 4, L // 128  # 32768, 1024 compressed tokens per layer
    state4 = 4  # L % 4 == 0: only the previous window (overlap), tokens L-4 .. L-1
    row, idx_row = 2 * (2 * 512) * 4, 2 * (2 * 128) * 4  # fp32 [kv | score], overlap doubles the width
    return {
        "swa": {
            "layers": SWA_LAYERS, "entries": SWA_LAYERS * swa,
            "src_bytes": SWA_LAYERS * swa * 512, "dst_bytes": SWA_LAYERS * swa * 584,
            # the window is TensorRT-LLM block 1023 (128 tokens) and vLLM SWA blocks 2046, 2047 (64 tokens)
            "src_page_bytes": SWA_LAYERS * 128 * 512, "dst_page_bytes": SWA_LAYERS * 2 * MODEL1_PAGE[64],
        },
        "compress": {
            "layers": C4_LAYERS + C128_LAYERS, "entries": C4_LAYERS * c4 + C128_LAYERS * c128,
            "src_bytes": (C4_LAYERS * c4 + C128_LAYERS * c128) * 512,
            "dst_bytes": (C4_LAYERS * c4 + C128_LAYERS * c128) * 584,
            # TensorRT-LLM compressed blocks: 32 (r=4) and 1 (r=128) entries of 512 B
            "src_page_bytes": C4_LAYERS * (c4 // 32) * 32 * 512 + C128_LAYERS * c128 * 512,
            # vLLM: compressed blocks of 256 / r entries: 64 (r=4), 2 (r=128)
            "dst_page_bytes": C4_LAYERS * (c4 // 64) * MODEL1_PAGE[64] + C128_LAYERS * (c128 // 2) * MODEL1_PAGE[2],
        },
        "compressor_state": {
            "layers": C4_LAYERS, "entries": C4_LAYERS * state4,
            "src_bytes": C4_LAYERS * state4 * row, "dst_bytes": C4_LAYERS * state4 * row,
            # vLLM: one block of 4 positions (32,768 B, 576-aligned)
            "src_page_bytes": C4_LAYERS * 128 * row, "dst_page_bytes": C4_LAYERS * _align576(4 * row),
        },
        "indexer_compress": {
            "layers": C4_LAYERS, "entries": C4_LAYERS * c4,
            "src_bytes": C4_LAYERS * c4 * 68, "dst_bytes": C4_LAYERS * c4 * 132,
            "src_page_bytes": C4_LAYERS * (c4 // 32) * 32 * 68,
            "dst_page_bytes": C4_LAYERS * (c4 // 64) * _align576(64 * 132),
        },
        "indexer_compressor_state": {
            "layers": C4_LAYERS, "entries": C4_LAYERS * state4,
            "src_bytes": C4_LAYERS * state4 * idx_row, "dst_bytes": C4_LAYERS * state4 * idx_row,
            "src_page_bytes": C4_LAYERS * 128 * idx_row, "dst_page_bytes": C4_LAYERS * _align576(4 * idx_row),
        },
    }


HAND_128K = _hand_totals_128k()
HAND_128K_ALL = {k: sum(role[k] for role in HAND_128K.values()) for k in HAND_128K["swa"]}


def test_hand_computed_numbers_are_what_the_docs_state():
    # docs/migration.md quotes these; a change here must change the docs too.
    assert HAND_128K_ALL["src_bytes"] == 413_343_744
    assert HAND_128K_ALL["dst_bytes"] == 508_809_216
    assert HAND_128K["compress"]["dst_page_bytes"] == 420_249_600
    assert HAND_128K["indexer_compress"]["dst_page_bytes"] == 92_897_280
    assert HAND_128K_ALL["dst_page_bytes"] == 517_312_512


def test_flash_128k_trtllm_fp8_to_vllm_matches_hand_computed_sizes():
    plan = plan_migration("trtllm:fp8:tpb=128", "vllm", "deepseek-v4-flash", L)
    totals = plan.totals()
    assert totals.pop("all") == HAND_128K_ALL
    assert totals == HAND_128K  # compressor state of ratio 128 is empty at L % 128 == 0


def test_cli_plan_json_matches_hand_computed_sizes():
    result = CliRunner().invoke(cli, ["migrate", "plan", "--from", "trtllm:fp8:tpb=128", "--to", "vllm",
                                      "--model", "deepseek-v4-flash", "--tokens", str(L), "--json"])
    assert result.exit_code == 0, result.output
    data = json.loads(result.output)
    assert data["totals"]["all"] == HAND_128K_ALL
    assert data["src"]["spec"] == "trtllm:fp8:tpb=128:idx=fp4" and data["dst"]["kv_layout"] == "flashmla-model1"
    assert data["dst"]["version"] == "vLLM 0.33.0"
    assert data["wire_seconds"]["src_payload"] == pytest.approx(413_343_744 / 40e9)


def test_cli_plan_table_and_transfers():
    result = CliRunner().invoke(cli, ["migrate", "plan", "--from", "trtllm:fp8:tpb=128", "--to", "vllm",
                                      "--tokens", "3000", "--transfers"], env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.output
    assert "indexer_compress: requantize fp4 -> fp8 (vllm)" in result.output
    assert "[2872, 3000)" in result.output  # the SWA tail of every layer
    assert "wire time at 40 GB/s" in result.output
    # every choice of both profiles, given or default, with where it comes from
    assert "from trtllm:fp8:tpb=128:idx=fp4 (TensorRT-LLM main" in result.output
    assert "tpb=128 (given; kv_cache_config tokens_per_block)" in result.output
    assert "block=256 (default; --block-size (recipes use 256))" in result.output
    assert "compressor.py CompressorStateCache" in result.output


@pytest.mark.parametrize(
    ("args", "code", "message"),
    [
        (["--from", "trtllm:fp9", "--to", "sglang", "--tokens", "8"], 2, "KV dtype must be one of"),
        (["--from", "trtllm:tpb=64", "--to", "sglang", "--tokens", "8"], 2, "tpb must be one of 128, 256"),
        (["--from", "sglang:e4m3=fnuz", "--to", "vllm", "--tokens", "8"], 2, "float8_e4m3fnuz"),
        (["--from", "vllm:kv=v41", "--to", "sglang", "--tokens", "8"], 2, "528-B MXFP8"),
        (["--from", "trtllm", "--to", "vllm:block=64", "--tokens", "8"], 2, "ratio-128 layers cannot page"),
        (["--from", "sglang", "--to", "tgi", "--tokens", "8"], 2, "unknown engine 'tgi'"),
        (["--from", "sglang", "--to", "vllm", "--tokens", "8", "--model", "v5"], 2, "unknown model 'v5'"),
        (["--from", "sglang", "--to", "vllm", "--tokens", "0"], 2, "0 is not in the range"),
    ],
)
def test_cli_plan_errors(args, code, message):
    """A bad engine spec, model or size is a usage error: exit 2, with the reason."""
    result = CliRunner().invoke(cli, ["migrate", "plan", *args])
    assert result.exit_code == code
    assert message in result.output


def test_live_entries_windows():
    csa, hca = {c.role: c for c in FLASH.caches(2)}, {c.role: c for c in FLASH.caches(3)}
    n = L + 3
    assert live_entries(csa[Role.SWA], n, 0) == (n - 128, 128)
    assert live_entries(csa[Role.SWA], n, 2) == (n - 130, 130)  # MTP draft slots widen the tail
    assert live_entries(csa[Role.SWA], 50, 0) == (0, 50)
    assert live_entries(csa[Role.COMPRESS], n, 0) == (0, L // 4)
    # Ratio 4 keeps the previous window too (overlapping compression): tokens L-4 .. L+2.
    assert live_entries(csa[Role.STATE], n, 0) == (L - 4, 7)
    assert live_entries(csa[Role.INDEXER_STATE], n, 0) == (L - 4, 7)
    assert live_entries(hca[Role.STATE], n, 0) == (L, 3)
    assert live_entries(hca[Role.COMPRESS], 127, 0) == (0, 0)
    assert live_entries(csa[Role.STATE], 3, 0) == (0, 3)


def test_page_ranges_follow_each_engines_geometry():
    plan = plan_migration("trtllm:fp8:tpb=256", "vllm", FLASH.with_layers(4), 3000, draft_tokens=3)
    by_key = {(t.spec.layer, t.spec.role): t for t in plan.transfers}
    swa = by_key[(0, Role.SWA)]
    assert (swa.first, swa.count) == (3000 - 131, 131)
    assert swa.table_slots(swa.src) == [11]  # tokens 2869..2999 in TensorRT-LLM block 11 of 256
    assert swa.table_slots(swa.dst) == [44, 45, 46]  # vLLM SWA blocks of 64
    c128 = by_key[(3, Role.COMPRESS)]
    assert c128.count == 23 and c128.src.page_size == 2 and c128.dst.page_size == 2
    assert c128.table_slots(c128.dst) == list(range(12))
    state = by_key[(2, Role.STATE)]
    # vLLM: fp32 state in blocks of 4 positions (ratio 4) / 8 (ratio 128) through its own tables
    assert (state.first, state.count) == (2996, 4)  # L % 4 == 0: the previous window only
    assert state.dst.addressing == "paged" and state.dst.page_size == 4 and state.table_slots(state.dst) == [749]
    assert state.src.table == "state4" and state.table_slots(state.src) == [11]
    # TensorRT-LLM: the compressor's score pools have block tables of their own
    assert plan.table_lengths("src") == {"swa": 12, "compress4": 12, "state4": 12, "state4_score": 12, "indexer4": 12,
                                         "indexer_state4": 12, "indexer_state4_score": 12, "compress128": 12,
                                         "state128": 12, "state128_score": 12}
    assert plan.table_lengths("dst") == {"swa": 47, "compress4": 12, "state4": 750, "indexer_state4": 750,
                                         "compress128": 12, "state128": 375}


def test_byte_move_and_requantize_names():
    plan = plan_migration("vllm", "trtllm:fp8-ds-mla:tpb=256:idx=fp8", FLASH.with_layers(3), 1000)
    names = {t.spec.role: t.conversion for t in plan.transfers}
    assert names[Role.SWA] == "byte move" and names[Role.COMPRESS] == "byte move"
    assert names[Role.INDEXER] == "requantize fp8 -> fp8 (trtllm)"
    same = plan_migration("sglang", "sglang:swa=128", FLASH.with_layers(3), 1000)
    assert {t.conversion for t in same.transfers if t.spec.role == Role.INDEXER} == {"byte copy"}
    # vLLM's fp8 writer (power-of-two scale from bf16 keys) is not TensorRT-LLM's: its keys are re-quantized
    other = plan_migration("trtllm:idx=fp8", "vllm", FLASH.with_layers(3), 1000)
    assert {t.conversion for t in other.transfers if t.spec.role == Role.INDEXER} == {"requantize fp8 -> fp8 (vllm)"}


def test_plan_argument_errors_and_fingerprint():
    with pytest.raises(InputError, match="num_tokens must be a positive integer"):
        plan_migration("sglang", "vllm", FLASH, 0)
    with pytest.raises(InputError, match="draft_tokens must be a non-negative integer"):
        plan_migration("sglang", "vllm", FLASH, 10, draft_tokens=-1)
    a = plan_migration("trtllm", "vllm", FLASH, 1000)
    assert a.fingerprint() == plan_migration("trtllm", "vllm", "deepseek-v4-flash", 1000).fingerprint()
    assert a.fingerprint() != plan_migration("trtllm", "vllm", FLASH, 1001).fingerprint()


def test_plan_past_a_prefix_the_destination_computed():
    """A destination that computed tokens [0, C) itself (a prefix-cache hit) holds compressed entries and indexer
    keys below C // ratio, SWA tokens and compressor-state rows below C: ``past(C)`` moves the rest only, with a
    fingerprint of its own."""
    from kvbridge.engines.topology import from_hf_config
    from kvbridge.migration.plan import beyond_computed, held_entries

    cfg = {"architectures": ["DeepseekV4ForCausalLM"], "model_type": "deepseek_v4", "hidden_size": 256,
           "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 1, "head_dim": 512,
           "qk_rope_head_dim": 64, "vocab_size": 1024, "max_position_embeddings": 4096, "intermediate_size": 512,
           "compress_ratios": [0, 0, 4, 128], "sliding_window": 128, "index_head_dim": 128, "index_n_heads": 4,
           "index_topk": 64, "num_nextn_predict_layers": 0}
    model = from_hf_config(cfg)
    plan = plan_migration("trtllm:fp8:tpb=128:scale=0.5", "vllm:block=256", model, 620, include_mtp=False)
    past = plan.past(512)
    assert plan.past(0) is plan and past.computed_tokens == 512 and past.fingerprint() != plan.fingerprint()
    kept = {(t.spec.layer, t.spec.role): t for t in past.transfers}
    for t in plan.transfers:
        held = held_entries(t.spec, 512)
        assert held == (512 // t.spec.ratio if t.spec.role in (Role.COMPRESS, Role.INDEXER) else 512)
        rest = kept.get((t.spec.layer, t.spec.role))
        if t.first + t.count <= held:
            assert rest is None  # held whole: the ratio-128 compressed entries [0, 4)
        else:
            assert (rest.first, rest.first + rest.count) == (max(t.first, held), t.first + t.count)
    assert (3, Role.COMPRESS) not in kept and kept[(2, Role.COMPRESS)].first == 128
    assert kept[(0, Role.SWA)].first == 512 and kept[(2, Role.STATE)].first == 616  # the state rows all move
    assert [i for i, _, _ in beyond_computed(plan.transfers, 512)] == [
        i for i, t in enumerate(plan.transfers) if (t.spec.layer, t.spec.role) in kept]
    for bad in (620, -1, True, 1.5):
        with pytest.raises(InputError, match="computed_tokens"):
            plan.past(bad)
    with pytest.raises(InputError, match="whole plan"):
        past.past(256)
