"""Accuracy study: variants, metrics against hand-computed values, evaluation and reproducibility."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch

import kvbridge as kb
from kvbridge.errors import InputError
from kvbridge.layouts import all_layouts
from kvbridge.study import accuracy as acc

# ---------------------------------------------------------------- variants and scales


def test_registry_variants_cover_every_layout_and_dialect():
    variants = acc.registry_variants()
    assert variants[0] == acc.Variant("bf16")
    seen = {(v.layout, v.dialect) for v in variants}
    for lay in all_layouts():
        for dialect in lay.dialects or (None,):
            assert (lay.name, dialect) in seen
    trt = [v.scale for v in variants if v.layout == "trtllm-fp8" and v.dialect == "swa"]
    assert trt == [1.0, acc.CALIBRATED, acc.CALIBRATED_POW2, *acc.DEFAULT_POW2_SCALES]
    assert [v.scale for v in variants if v.dialect == "compress"] == [1.0]
    assert len({v.label for v in variants}) == len(variants)


def test_registry_variants_rejects_non_power_of_two():
    with pytest.raises(InputError, match="pow2_scales"):
        acc.registry_variants((0.3,))


@pytest.mark.parametrize(("scale", "label"), [(1.0, "1"), (0.015625, "2^-6"), (8.0, "2^3"), (0.037, "0.037"),
                                              (acc.CALIBRATED, "amax/448")])
def test_scale_label(scale, label):
    assert acc.scale_label(scale) == label


def test_calibrated_scales():
    x = torch.tensor([[3.0] + [0.5] * 511, [-5.0] + [0.25] * 511], dtype=torch.bfloat16)
    assert acc.resolve_scale(acc.CALIBRATED, x) == kb.auto_scale(x.float())
    s = acc.resolve_scale(acc.CALIBRATED_POW2, x)
    assert s == 2.0**-6  # 5/448 = 0.01116 lies in (2^-7, 2^-6]
    assert acc.resolve_scale(None, x) is None
    assert acc.resolve_scale(2, x) == 2.0
    with pytest.raises(InputError, match="scale must be"):
        acc.resolve_scale("max", x)


# ---------------------------------------------------------------- metrics


def test_e4m3_stats_counts_saturation_subnormals_and_flushes():
    x = torch.ones(4, 512)
    x[0, 0] = 500.0  # saturates at s = 1 (> 448)
    x[0, 1] = -1000.0  # saturates
    x[0, 2] = 0.01  # E4M3 subnormal at s = 1 (< 2^-6), stored as 5 * 2^-9
    x[0, 3] = 2.0**-11  # below half the smallest subnormal: flushes to 0
    x[2, 4] = 0.0  # zero input: neither subnormal nor flushed
    x[3, 500] = 0.005  # rope subnormal
    x = x.to(torch.bfloat16)
    q = acc.quantize(x, acc.Variant("trtllm-fp8", "swa", 1.0), 2)
    stats = acc.e4m3_stats(x, q)
    assert stats["nope_saturated_frac"] == 2 / (4 * 448)
    assert stats["nope_subnormal_frac"] == 2 / (4 * 448)
    assert stats["nope_flushed_frac"] == 1 / (4 * 448)
    assert stats["rope_subnormal_frac"] == 1 / (4 * 64)
    assert stats["rope_saturated_frac"] == 0.0
    assert stats["saturated_frac"] == 2 / 2048
    assert stats["subnormal_frac"] == 3 / 2048
    assert stats["flushed_frac"] == 1 / 2048
    # Per-tile scales: no saturation; 0.01 and 2^-11 share their tile with -1000 (scale 2^2), so
    # 0.01 / 4 is subnormal and 2^-13 flushes there too; rope is bf16 (no E4M3 field).
    m1 = acc.e4m3_stats(x, acc.quantize(x, acc.Variant("flashmla-model1", "flashmla"), 2))
    assert m1["saturated_frac"] == 0.0
    assert m1["nope_subnormal_frac"] == 2 / (4 * 448)
    assert m1["nope_flushed_frac"] == 1 / (4 * 448)
    assert "rope_subnormal_frac" not in m1
    bf = acc.e4m3_stats(x, acc.quantize(x, acc.Variant("bf16"), 2))
    assert bf == {"saturated_frac": 0.0, "subnormal_frac": 0.0, "flushed_frac": 0.0}


def test_k_error_separates_nope_and_rope():
    ref = torch.zeros(2, 512)
    ref[:, :448] = 2.0
    ref[:, 448:] = 1.0
    val = ref.clone()
    val[0, 0] = 2.5  # nope error 0.5 at one value
    val[1, 500] = 0.0  # rope error 1.0 at one value
    err = acc.k_error(val, ref)
    assert err["k_nope_max_abs"] == 0.5
    assert err["k_rope_max_abs"] == 1.0
    assert err["k_nope_rel_l2"] == pytest.approx(0.5 / math.sqrt(2 * 448 * 4), rel=1e-12)
    assert err["k_rope_rel_l2"] == pytest.approx(1.0 / math.sqrt(2 * 64), rel=1e-12)


def test_output_error_hand_values():
    ref = torch.zeros(1, 1, 2, 512)
    ref[..., 0] = 1.0
    out = ref.clone()
    out[0, 0, 1, 0] = 0.0
    out[0, 0, 1, 1] = 1.0  # second row orthogonal to its reference
    lse = torch.tensor([[[1.0], [2.0]]])
    err = acc.output_error(out, ref, lse + 0.25, lse)
    assert err["out_rel_l2"] == pytest.approx(math.sqrt(2) / math.sqrt(2), rel=1e-12)
    assert err["out_max_abs"] == 1.0
    assert err["out_cosine"] == pytest.approx(0.5, rel=1e-12)
    assert err["out_min_row_cosine"] == 0.0
    assert err["lse_max_abs"] == 0.25
    same = acc.output_error(ref, ref, lse, lse)
    assert (same["out_rel_l2"], same["out_max_abs"], same["lse_max_abs"]) == (0.0, 0.0, 0.0)
    assert same["out_cosine"] == pytest.approx(1.0, abs=1e-15)


def test_weight_error_kl_and_overlap_hand_values():
    p = torch.tensor([0.5, 0.25, 0.125, 0.125], dtype=torch.float64)
    r = torch.tensor([0.25, 0.5, 0.125, 0.125], dtype=torch.float64)
    ref = p.log().view(1, 1, 1, 4)
    var = r.log().view(1, 1, 1, 4)
    err = acc.weight_error(var, ref, overlap_k=1)
    assert err["kl_mean"] == pytest.approx(float((p * (p / r).log()).sum()), rel=1e-12)
    assert err["topk_overlap_mean"] == 0.0  # top-1 token differs
    assert acc.weight_error(var, ref, overlap_k=2)["topk_overlap_mean"] == 1.0  # {0, 1} both ways
    # Invalid slots (-inf in both) do not count; overlap_k is capped at the row length.
    masked = torch.tensor([0.0, -math.inf]).view(1, 1, 1, 2)
    assert acc.weight_error(masked, masked, overlap_k=8) == {
        "kl_mean": 0.0, "kl_max": 0.0, "topk_overlap_mean": 1.0, "topk_overlap_min": 1.0}


def test_attention_log_weights_match_softmax_with_sparse_decode_lse():
    g = torch.Generator().manual_seed(3)
    x = torch.randn(40, 512, generator=g).to(torch.bfloat16)
    q = torch.randn(2, 1, 4, 512, generator=g).to(torch.bfloat16)
    idx = torch.randint(0, 40, (2, 1, 8), generator=g, dtype=torch.int32)
    idx[1, 0, 5:] = -1
    pages = kb.encode(x, "bf16", page_size=16)
    _, lse = kb.sparse_decode(q, pages, idx, layout="bf16", page_size=16, backend="reference")
    logw = acc.attention_log_weights(q, x.float(), idx, lse, 512**-0.5)
    k = x.float()[idx.clamp(min=0).long()]
    logits = torch.einsum("bshd,bstd->bsht", q.float(), k) * 512**-0.5
    logits = logits.masked_fill((idx < 0).unsqueeze(2), -math.inf)
    # Same fp32 formula; the lse comes from sparse_decode's own logsumexp: agree to fp32 rounding.
    torch.testing.assert_close(logw.exp(), logits.softmax(dim=-1), rtol=1e-5, atol=1e-7)
    assert bool((logw[1, 0, :, 5:] == -math.inf).all())


# ---------------------------------------------------------------- evaluation on synthetic cases

TINY = acc.SyntheticParams(context=256, topk=64, batch=1, heads=8, page_size=32)


@pytest.fixture(scope="module")
def tiny_rows():
    case = acc.synthetic_case(TINY, seed=1)
    return case, {r["variant"]: r for r in acc.evaluate(case, acc.registry_variants())}


def test_reference_variant_is_exact_and_identical_records_give_identical_results(tiny_rows):
    _, rows = tiny_rows
    ref = rows["bf16"]
    assert (ref["out_rel_l2"], ref["out_max_abs"], ref["kl_mean"], ref["k_nope_rel_l2"]) == (0.0, 0.0, 0.0, 0.0)
    assert ref["topk_overlap_min"] == 1.0
    for dialect in ("flashmla", "amax-1e-4", "amax-1e-8"):
        m1, footer = rows[f"flashmla-model1/{dialect}"], rows[f"trtllm-fp8-ds-mla/{dialect}"]
        # Same 584-byte records in two page geometries: every number must agree exactly.
        assert {k: v for k, v in m1.items() if k not in ("variant", "layout")} == {
            k: v for k, v in footer.items() if k not in ("variant", "layout")}
        assert m1["k_rope_rel_l2"] == 0.0 and m1["out_rel_l2_rope_only"] == 0.0  # bf16 rope is lossless
        assert m1["out_rel_l2_nope_only"] == m1["out_rel_l2"] > 0
    fp8 = rows["trtllm-fp8/swa s=1"]
    assert fp8["k_rope_rel_l2"] > 0 and fp8["out_rel_l2_rope_only"] > 0
    assert rows["trtllm-fp8/compress s=1"]["out_digest"] == fp8["out_digest"]  # bf16 input: same bytes
    assert rows["trtllm-fp8/swa s=amax/448"]["out_rel_l2_rope_only"] is None  # not bf16-exact: no attribution
    assert rows["trtllm-fp8/swa s=amax/448"]["saturated_frac"] == 0.0


def test_attribution_shortcut_equals_the_mixed_pool_decode(tiny_rows):
    case, rows = tiny_rows
    ref = acc.quantize(case.latents, acc.Variant("bf16"), case.page_size)
    ref_out, ref_lse = kb.sparse_decode(case.q, ref.pages, case.indices, layout="bf16", page_size=case.page_size)
    for label, variant in (("flashmla-model1/flashmla", acc.Variant("flashmla-model1", "flashmla")),
                           ("trtllm-fp8/swa s=1", acc.FP8_UNIT)):
        values = acc.quantize(case.latents, variant, case.page_size).values
        for part, sl in (("nope", slice(0, 448)), ("rope", slice(448, 512))):
            mixed = ref.values.clone()
            mixed[:, sl] = values[:, sl]
            pages = kb.encode(mixed.to(torch.bfloat16), "bf16", page_size=case.page_size)
            assert torch.equal(kb.decode(pages, "bf16", page_size=case.page_size, num_tokens=mixed.shape[0]), mixed)
            out, lse = kb.sparse_decode(case.q, pages, case.indices, layout="bf16", page_size=case.page_size)
            want = acc.output_error(out, ref_out, lse, ref_lse)["out_rel_l2"]
            assert rows[label][f"out_rel_l2_{part}_only"] == want


def test_magnitude_extremes_show_subnormals_and_saturation_at_unit_scale():
    variants = [acc.FP8_UNIT, acc.FP8_CALIBRATED, acc.MODEL1_DIALECTS[0]]
    tiny = acc.evaluate(acc.synthetic_case(replace(TINY, magnitude=0.001), 0), variants)
    huge = acc.evaluate(acc.synthetic_case(replace(TINY, magnitude=100.0), 0), variants)
    unit, cal, m1 = tiny
    assert unit["subnormal_frac"] > 0.9 and cal["subnormal_frac"] < 0.05 and m1["subnormal_frac"] < 0.05
    assert unit["out_rel_l2"] > 5 * m1["out_rel_l2"]
    unit, cal, m1 = huge
    assert unit["saturated_frac"] > 0 and cal["saturated_frac"] == 0.0 and m1["saturated_frac"] == 0.0


def test_run_study_is_reproducible_for_a_seed():
    sweeps = {"magnitude": (0.01,), "layer": ("swa",)}
    small = replace(TINY, context=128, window=64, heads=2)
    first = acc.run_study(small, seed=7, sweeps=sweeps, pow2_scales=())
    second = acc.run_study(small, seed=7, sweeps=sweeps, pow2_scales=())
    assert first == second
    assert [(r["sweep"], r["value"]) for r in first["runs"]] == [
        ("nominal", None), ("magnitude", 0.01), ("layer", "swa")]
    assert first["runs"][2]["case"]["topk"] == 64  # swa: the window is attended
    other = acc.run_study(small, seed=8, sweeps={}, pow2_scales=())
    assert other["runs"][0]["rows"][1]["out_digest"] != first["runs"][0]["rows"][1]["out_digest"]


def test_run_study_rejects_unknown_sweeps_and_bad_cases():
    with pytest.raises(InputError, match="cannot sweep 'colour'"):
        acc.run_study(TINY, sweeps={"colour": (1,)})
    with pytest.raises(InputError, match="window"):
        acc.synthetic_case(replace(TINY, layer="swa", window=512), 0)
    case = acc.synthetic_case(TINY, 0)
    with pytest.raises(InputError, match="latents must be bfloat16"):
        acc.evaluate(acc.Case(case.latents.float(), case.q, case.indices), [acc.FP8_UNIT])
    with pytest.raises(InputError, match="overlap_k"):
        acc.evaluate(case, [acc.FP8_UNIT], overlap_k=0)


# ---------------------------------------------------------------- real latents from a dump


def _write_dump(path, tokens: int = 96):
    from kvbridge.dumps.dumpfile import DumpEntry
    from kvbridge.dumps.writer import write_dump
    from kvbridge.study.synthetic import latents

    x = latents(tokens, seed=5).to(torch.bfloat16)
    entries = [
        DumpEntry(0, "swa", x),  # raw latents
        DumpEntry(1, "compress", kb.encode(x, "bf16", page_size=32), layout="bf16", page_size=32, num_tokens=tokens),
        DumpEntry(2, "swa", kb.encode(x, "trtllm-fp8", page_size=32), layout="trtllm-fp8", page_size=32,
                  num_tokens=tokens),
    ]
    write_dump(path, entries)
    return x


def test_dump_study_uses_unquantized_entries(tmp_path):
    path = tmp_path / "req.safetensors"
    x = _write_dump(path)
    params = replace(TINY, heads=2)
    study = acc.run_dump_study(str(path), params=params, seed=3, pow2_scales=())
    assert [r["value"] for r in study["runs"]] == ["layer.0.swa", "layer.1.compress"]
    assert study["skipped"] == [{"entry": "layer.2.swa", "reason": "quantized (trtllm-fp8)"}]
    # The same keys stored two ways give the same case, hence the same numbers.
    assert study["runs"][0]["rows"] == study["runs"][1]["rows"]
    assert study["runs"][0]["rounded_to_bf16"] is False
    assert study["runs"][0]["case"]["tokens"] == x.shape[0]
    assert study["runs"][0]["case"]["topk"] == params.topk  # fewer keys than topk: -1 padded
    with pytest.raises(InputError, match="holds trtllm-fp8 pages"):
        acc.run_dump_study(str(path), entries=("layer.2.swa",), params=params)
    with pytest.raises(InputError, match="'layer.9.swa' is not in"):
        acc.run_dump_study(str(path), entries=("layer.9.swa",), params=params)


# ---------------------------------------------------------------- CLI


def _cli(args):
    from click.testing import CliRunner

    from cli.main import cli

    return CliRunner().invoke(cli, args)


CLI_TINY = ["--context", "128", "--topk", "64", "--batch", "1", "--heads", "2", "--page-size", "32",
            "--pow2-scales", "2^-3"]


def test_cli_records_every_parameter():
    import json

    result = _cli(["accuracy", *CLI_TINY, "--no-sweeps", "--seed", "4", "--peakedness", "2.5", "--json"])
    assert result.exit_code == 0, result.output
    study = json.loads(result.output)
    assert study["seed"] == 4 and study["sweeps"] == {}
    assert study["params"] == {**acc.asdict(replace(TINY, context=128, heads=2, peakedness=2.5))}
    assert study["pow2_scales"] == [0.125]
    assert "trtllm-fp8/swa s=2^-3" in study["variants"]
    table = _cli(["accuracy", *CLI_TINY, "--no-sweeps"])
    assert table.exit_code == 0, table.output
    assert "per-tensor FP8 s=1" in table.output and "peakedness=8.0" in table.output


@pytest.mark.parametrize(("args", "message"), [
    (["--entry", "layer.0.swa"], "--entry needs --from-dump"),
    (["--sweep", "colour"], "unknown parameter 'colour'"),
    (["--sweep", "batch"], "batch has no default sweep"),
    (["--sweep", "context=1k"], "values of context must be ints"),
    (["--pow2-scales", "0.3"], "positive power of two"),
    (["--no-sweeps", "--sweep", "topk"], "exclude each other"),
    (["--no-sweeps", "--plot", "figs"], "--plot draws the synthetic sweeps"),
    (["--layer", "dense"], "'dense' is not one of"),
])
def test_cli_usage_errors(args, message):
    result = _cli(["accuracy", *args])
    assert result.exit_code == 2
    assert message in result.output


def test_cli_from_dump(tmp_path):
    import json

    path = tmp_path / "req.safetensors"
    _write_dump(path)
    result = _cli(["accuracy", *CLI_TINY, "--from-dump", str(path), "--entry", "layer.1.compress", "--json"])
    assert result.exit_code == 0, result.output
    study = json.loads(result.output)
    assert study["source"] == str(path) and [r["value"] for r in study["runs"]] == ["layer.1.compress"]
    bad = _cli(["accuracy", *CLI_TINY, "--from-dump", str(path), "--entry", "layer.2.swa"])
    assert bad.exit_code == 1 and "holds trtllm-fp8 pages" in bad.output


def test_cli_plot_without_matplotlib_is_a_clear_error(tmp_path, monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib now raises ImportError
    result = _cli(["accuracy", *CLI_TINY, "--sweep", "magnitude=1.0", "--plot", str(tmp_path / "figs")])
    assert result.exit_code == 1
    assert "--plot needs matplotlib" in result.output


def test_cli_plot_writes_pngs(tmp_path):
    pytest.importorskip("matplotlib", reason="--plot needs the optional 'plot' extra")
    out = tmp_path / "figs"
    result = _cli(["accuracy", *CLI_TINY, "--sweep", "magnitude=0.01", "--plot", str(out)])
    assert result.exit_code == 0, result.output
    written = sorted(p.name for p in out.iterdir())
    assert written == ["accuracy_magnitude.png", "accuracy_magnitude_range.png"]
    for name in written:
        assert (out / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
