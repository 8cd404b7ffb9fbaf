"""Public codec API: conformance to the peers' reference vectors, properties, and bad input."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import kvbridge as kb
from kvbridge.layouts import get_layout
from kvbridge.numerics import DIALECT_MIN_EXPONENT

MODEL1 = "flashmla-model1"
FOOTER = "trtllm-fp8-ds-mla"
TRT = "trtllm-fp8"


def model1_records_from_vectors(model1_vectors, p: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(bf16 input [N, 512], reference MODEL1 records [N, 584]) of case ``p{p}``."""
    tensors, _ = model1_vectors
    x = tensors[f"p{p}.input"].reshape(-1, 512)
    records = get_layout(MODEL1).pages_to_records(tensors[f"p{p}.model1"], p)
    return x, records


# ---------------------------------------------------------------- conformance


@pytest.mark.parametrize("p", [2, 64, 256])
def test_model1_encode_matches_flashmla_reference(model1_vectors, p):
    tensors, cases = model1_vectors
    assert cases[f"p{p}"]["page_bytes"] == get_layout(MODEL1).page_bytes(p)
    x = tensors[f"p{p}.input"].reshape(-1, 512)
    assert torch.equal(kb.encode(x, MODEL1, page_size=p), tensors[f"p{p}.model1"])
    assert torch.equal(kb.encode(x, "sglang-v4", page_size=p, dialect="flashmla"), tensors[f"p{p}.model1"])


@pytest.mark.parametrize("p", [2, 64, 256])
def test_model1_decode_matches_flashmla_dequantizer(model1_vectors, p):
    tensors, _ = model1_vectors
    out = kb.decode(tensors[f"p{p}.model1"], MODEL1, page_size=p)
    assert out.dtype == torch.float32
    # The reference dequantizer returns bf16; every decoded value is bf16-exact, so compare exactly.
    assert torch.equal(out.to(torch.bfloat16), tensors[f"p{p}.dequant"].reshape(-1, 512))
    assert torch.equal(out, out.to(torch.bfloat16).float())


@pytest.mark.parametrize("new_p", [1, 3, 61, 64, 69, 128, 576])
def test_model1_encode_any_page_size_equals_reference_records(model1_vectors, new_p):
    x, records = model1_records_from_vectors(model1_vectors, 64)
    want = get_layout(MODEL1).records_to_pages(records, new_p)
    assert torch.equal(kb.encode(x, MODEL1, page_size=new_p), want)
    assert torch.equal(kb.encode(x, FOOTER, page_size=new_p), get_layout(FOOTER).records_to_pages(records, new_p))


@pytest.mark.parametrize("i", [0, 1, 2, 3])
def test_trtllm_fp8_matches_writer_arithmetic(trtllm_vectors, i):
    tensors, cases = trtllm_vectors
    s = cases[f"s{i}"]["scale"]
    x = tensors[f"s{i}.input"]
    pages = kb.encode(x, TRT, page_size=300, scale=s)
    assert torch.equal(pages.reshape(300, 512), tensors[f"s{i}.fp8"])
    got = kb.decode(tensors[f"s{i}.fp8"].reshape(1, -1), TRT, page_size=300, scale=s)
    assert torch.equal(got, tensors[f"s{i}.decoded"])


def test_trtllm_fp8_any_page_size(trtllm_vectors):
    tensors, cases = trtllm_vectors
    x, want = tensors["s3.input"], tensors["s3.fp8"]
    pages = kb.encode(x, TRT, page_size=128, scale=cases["s3"]["scale"])
    assert pages.shape == (3, 128 * 512)
    flat = pages.reshape(-1, 512)
    assert torch.equal(flat[:300], want) and not flat[300:].any()


# ---------------------------------------------------------------- dialects


@pytest.mark.parametrize(("dialect", "byte"), [("flashmla", 114), ("amax-1e-4", 105), ("amax-1e-8", 92)])
@pytest.mark.parametrize("layout", [MODEL1, FOOTER])
def test_zero_tile_scale_bytes(layout, dialect, byte):
    x = torch.zeros(3, 512)
    x[:, 448:] = 1.0
    lay = get_layout(layout)
    pages = kb.encode(x, layout, page_size=3, dialect=dialect)
    records = lay.pages_to_records(pages, 3)
    assert records[:, 576:583].eq(byte).all()
    assert not records[:, :448].any()
    assert not records[:, 583].any()  # pad byte written as 0


def test_dialects_agree_above_threshold_and_differ_below():
    big = torch.full((1, 512), 0.5)
    small = torch.full((1, 512), 0.02)
    enc = {d: kb.encode(big, MODEL1, page_size=1, dialect=d) for d in ("flashmla", "amax-1e-4", "amax-1e-8")}
    assert torch.equal(enc["flashmla"], enc["amax-1e-4"]) and torch.equal(enc["flashmla"], enc["amax-1e-8"])
    a = kb.encode(small, MODEL1, page_size=1, dialect="flashmla")
    b = kb.encode(small, MODEL1, page_size=1, dialect="amax-1e-4")
    assert not torch.equal(a, b)
    # Different bytes, identical decoded values: 0.02 is representable at both scales.
    assert torch.equal(kb.decode(a, MODEL1, page_size=1), kb.decode(b, MODEL1, page_size=1))


def test_trtllm_compress_dialect_ignores_scale():
    x = torch.randn(5, 512)
    at_one = kb.encode(x, TRT, page_size=5, scale=1.0)
    assert torch.equal(kb.encode(x, TRT, page_size=5, scale=0.25, dialect="compress"), at_one)
    assert not torch.equal(kb.encode(x, TRT, page_size=5, scale=0.25), at_one)


def test_fp32_input_quantized_without_bf16_rounding_first():
    x = torch.ones(1, 512)
    x[0, 0] = 1.0625 + 2.0**-20  # just above the 1.0 / 1.125 E4M3 tie; bf16 rounds it onto the tie
    fp32 = get_layout(TRT).pages_to_records(kb.encode(x, TRT, page_size=1), 1)[0, 0]
    bf16 = get_layout(TRT).pages_to_records(kb.encode(x.to(torch.bfloat16), TRT, page_size=1), 1)[0, 0]
    assert int(fp32) == 0x39 and int(bf16) == 0x38  # 1.125 vs 1.0 (tie to even)


# ---------------------------------------------------------------- properties

latent_rows = st.integers(min_value=1, max_value=40)


def random_latents(n: int, seed: int, magnitude: float) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 512, generator=g) * magnitude
    x[:, ::97] *= 30.0  # a few outlier channels
    return x


@settings(max_examples=40, deadline=None)
@given(n=latent_rows, p=st.integers(1, 70), seed=st.integers(0, 2**16), mag=st.sampled_from([1e-3, 0.1, 1.0, 20.0]),
       dialect=st.sampled_from(["flashmla", "amax-1e-4", "amax-1e-8"]))
def test_model1_round_trip_within_format_bound(n, p, seed, mag, dialect):
    x = random_latents(n, seed, mag).to(torch.bfloat16).float()
    y = kb.decode(kb.encode(x, MODEL1, page_size=p, dialect=dialect), MODEL1, page_size=p, num_tokens=n)
    assert torch.equal(y[:, 448:], x[:, 448:])  # bf16 rope is stored exactly
    tiles = x[:, :448].reshape(n, 7, 64)
    exponent = torch.ceil(torch.log2(tiles.abs().amax(-1, keepdim=True) / 448))
    scale = torch.exp2(exponent.clamp(min=DIALECT_MIN_EXPONENT[dialect]))
    err = (y[:, :448].reshape(n, 7, 64) - tiles).abs()
    # E4M3: half an ulp is 2^-4 relative for normals; 2^-10 * scale absolute in the subnormal range.
    bound = torch.maximum(tiles.abs() * 2.0**-4, scale * 2.0**-10)
    assert (err <= bound).all()


@settings(max_examples=40, deadline=None)
@given(n=latent_rows, seed=st.integers(0, 2**16), s=st.sampled_from([1.0, 0.5, 2.0, 0.037, 3.0]))
def test_per_tensor_round_trip_within_format_bound(n, seed, s):
    x = random_latents(n, seed, 1.0)
    y = kb.decode(kb.encode(x, TRT, page_size=16, scale=s), TRT, page_size=16, num_tokens=n, scale=s)
    inside = (x / s).abs() <= 448
    bound = torch.maximum(x.abs() * 2.0**-4, torch.full_like(x, s * 2.0**-10)) * (1 + 2**-20)
    assert ((y - x).abs() <= bound)[inside].all()
    assert torch.equal(y[~inside].abs(), torch.full_like(y[~inside], 448.0 * s))


@settings(max_examples=40, deadline=None)
@given(n=latent_rows, p1=st.integers(1, 70), p2=st.integers(1, 70), seed=st.integers(0, 2**16),
       pair=st.sampled_from([(MODEL1, MODEL1), (MODEL1, FOOTER), (FOOTER, MODEL1), (TRT, TRT), ("bf16", "bf16")]))
def test_byte_move_transcode_bit_exact_for_any_page_size(n, p1, p2, seed, pair):
    src, dst = pair
    x = random_latents(n, seed, 1.0)
    pages = kb.encode(x, src, page_size=p1)
    out = kb.transcode(pages, src, dst, src_page_size=p1, dst_page_size=p2, num_tokens=n)
    assert torch.equal(out, kb.encode(x, dst, page_size=p2))


@settings(max_examples=25, deadline=None)
@given(n=st.integers(1, 200), p=st.integers(1, 70), seed=st.integers(0, 2**16),
       layout=st.sampled_from([MODEL1, FOOTER, TRT, "bf16"]))
def test_any_page_decodes_alone(n, p, seed, layout):
    pages = kb.encode(random_latents(n, seed, 1.0), layout, page_size=p)
    whole = kb.decode(pages, layout, page_size=p)
    for i in range(pages.shape[0]):
        assert torch.equal(kb.decode(pages[i : i + 1], layout, page_size=p), whole[i * p : (i + 1) * p])


def test_partly_filled_last_page_is_zero():
    pages = kb.encode(random_latents(5, 0, 1.0), MODEL1, page_size=4)
    lay = get_layout(MODEL1)
    assert pages.shape == (2, lay.page_bytes(4))
    records = lay.pages_to_records(pages, 4)
    assert not records[5:].any()
    assert not pages[:, 4 * 584 :].any()  # padding tail up to 2880 = 5 * 576


# ---------------------------------------------------------------- lossy transcodes


def test_trtllm_to_model1_and_back_is_byte_exact():
    x = random_latents(300, 1, 1.0)
    src = kb.encode(x, TRT, page_size=128)
    m1, rep = kb.transcode(src, TRT, MODEL1, src_page_size=128, dst_page_size=64, num_tokens=300, report=True)
    assert rep.lossless and not rep.byte_move and rep.saturated == 0
    back = kb.transcode(m1, MODEL1, TRT, src_page_size=64, dst_page_size=128, num_tokens=300)
    assert torch.equal(back, src)


def test_transcode_equals_decode_then_encode():
    x = random_latents(100, 2, 5.0)
    src = kb.encode(x, MODEL1, page_size=64, dialect="amax-1e-8")
    out = kb.transcode(src, MODEL1, TRT, src_page_size=64, dst_page_size=32, num_tokens=100, dst_scale=0.5)
    want = kb.encode(kb.decode(src, MODEL1, page_size=64, num_tokens=100), TRT, page_size=32, scale=0.5)
    assert torch.equal(out, want)


def test_lossy_transcode_reports_saturation_and_auto_scale_avoids_it():
    x = random_latents(64, 3, 200.0)
    src = kb.encode(x, MODEL1, page_size=64)
    _, rep = kb.transcode(src, MODEL1, TRT, src_page_size=64, dst_scale=1.0, report=True)
    assert rep.saturated > 0 and not rep.lossless and rep.max_abs_error > 0
    out, auto = kb.transcode(src, MODEL1, TRT, src_page_size=64, dst_scale="auto", report=True)
    assert auto.saturated == 0 and auto.dst_scale > 1.0
    assert auto.max_rel_error < rep.max_rel_error
    decoded = kb.decode(out, TRT, page_size=64, scale=auto.dst_scale)
    assert decoded.abs().max() <= kb.decode(src, MODEL1, page_size=64).abs().max()
    assert rep.to_dict()["dst_layout"] == TRT


def test_auto_scale_is_smallest_without_saturation():
    x = random_latents(10, 4, 3.0)
    s = kb.auto_scale(x)
    recip = 1.0 / torch.tensor(s, dtype=torch.float32)
    assert float(x.abs().max() * recip) <= 448.0
    smaller = torch.nextafter(torch.tensor(s, dtype=torch.float32), torch.tensor(0.0))
    assert float(x.abs().max() * (1.0 / smaller)) > 448.0 or float(smaller) < float(x.abs().max()) / 448
    assert kb.auto_scale(torch.zeros(2, 512)) == 1.0


def test_encode_auto_scale_decodes_with_reported_scale():
    x = random_latents(10, 5, 1000.0)
    s = kb.auto_scale(x)
    assert torch.equal(kb.encode(x, TRT, page_size=4, scale="auto"), kb.encode(x, TRT, page_size=4, scale=s))


# ---------------------------------------------------------------- bad input


def test_nonfinite_input_names_token_and_dim():
    x = torch.zeros(4, 512)
    x[2, 17] = float("nan")
    x[3, 1] = float("inf")
    with pytest.raises(kb.NonFiniteError, match=r"token 2, dim 17"):
        kb.encode(x, MODEL1, page_size=2)


def test_nonfinite_policies():
    x = torch.ones(2, 512)
    x[0, 3], x[1, 5], x[1, 6] = float("nan"), float("inf"), -float("inf")
    z = kb.decode(kb.encode(x, TRT, page_size=2, nonfinite="zero"), TRT, page_size=2)
    assert z[0, 3] == 0 and z[1, 5] == 0 and z[1, 6] == 0
    s = kb.decode(kb.encode(x, TRT, page_size=2, nonfinite="saturate"), TRT, page_size=2)
    assert s[0, 3] == 0 and s[1, 5] == 448 and s[1, 6] == -448
    with pytest.raises(kb.InputError, match="nonfinite"):
        kb.encode(x, TRT, page_size=2, nonfinite="ignore")


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"x": torch.zeros(3, 511)}, r"shape \[num_tokens, 512\]"),
        ({"x": torch.zeros(3, 512, dtype=torch.int32)}, "bfloat16, float16 or float32"),
        ({"x": torch.zeros(512)}, "shape"),
        ({"layout": "nope-layout"}, "unknown layout 'nope-layout'"),
        ({"page_size": 0}, "page_size must be a positive integer"),
        ({"page_size": 2.5}, "page_size must be a positive integer"),
        ({"dialect": "amax-1e-9"}, "dialect 'amax-1e-9' does not apply"),
        ({"layout": TRT, "scale": 0.0}, "scale must be a positive finite"),
        ({"layout": TRT, "scale": -1.0}, "scale must be a positive finite"),
        ({"layout": TRT, "scale": float("nan")}, "scale must be a positive finite"),
        ({"layout": TRT, "scale": 1e39}, "as fp32"),
        ({"scale": 2.0}, "per-tensor layouts"),
        ({"layout": "bf16", "dialect": "flashmla"}, "has no encoder dialects"),
    ],
)
def test_encode_rejects_bad_arguments(kwargs, match):
    args = {"x": torch.zeros(3, 512), "layout": MODEL1, "page_size": 2} | kwargs
    x, layout = args.pop("x"), args.pop("layout")
    with pytest.raises(kb.KVBridgeError, match=match):
        kb.encode(x, layout, **args)


def test_decode_rejects_bad_pages():
    pages = kb.encode(torch.zeros(4, 512), MODEL1, page_size=2)
    with pytest.raises(kb.LayoutError, match=r"shape \[num_pages, 1728\]"):
        kb.decode(pages[:, :-1], MODEL1, page_size=2)
    with pytest.raises(kb.LayoutError, match="must be uint8"):
        kb.decode(pages.to(torch.int8), MODEL1, page_size=2)
    with pytest.raises(kb.LayoutError, match="num_tokens=5 does not fit"):
        kb.decode(pages, MODEL1, page_size=2, num_tokens=5)
    with pytest.raises(kb.LayoutError, match=r"pages of 3 tokens must have shape \[num_pages, 2304\], got \[2, 1728\]"):
        kb.decode(pages, MODEL1, page_size=3)


def test_transcode_rejects_dialect_on_byte_move_and_nan_source():
    pages = kb.encode(torch.ones(4, 512), MODEL1, page_size=2)
    with pytest.raises(kb.InputError, match="byte move"):
        kb.transcode(pages, MODEL1, FOOTER, src_page_size=2, dialect="amax-1e-8")
    bad = kb.encode(torch.ones(4, 512), TRT, page_size=2)
    bad[1, 7] = 0x7F  # an E4M3 NaN code
    with pytest.raises(kb.NonFiniteError, match="token 2, dim 7"):
        kb.transcode(bad, TRT, MODEL1, src_page_size=2)
    with pytest.raises(kb.InputError, match="src_scale applies only to per-tensor"):
        kb.transcode(pages, MODEL1, TRT, src_page_size=2, src_scale=2.0)


def test_decode_nan_scale_byte_gives_nan():
    pages = kb.encode(torch.ones(2, 512), MODEL1, page_size=2)
    pages[0, 2 * 576 + 3] = 0xFF  # token 0, tile 3 scale
    out = kb.decode(pages, MODEL1, page_size=2)
    assert torch.isnan(out[0, 192:256]).all() and torch.isfinite(out[0, :192]).all()


def test_layout_registry_field_offsets_and_page_rule():
    m1 = get_layout("vllm-fp8-ds-mla")
    assert m1.name == MODEL1
    assert [m1.page_bytes(p) for p in (2, 64, 256)] == [1728, 37440, 149760]
    assert get_layout(FOOTER).page_bytes(64) == 64 * 584
    assert m1.field_offset("nope", 3, 64) == 3 * 576
    assert m1.field_offset("rope", 3, 64) == 3 * 576 + 448
    assert m1.field_offset("scale", 3, 64) == 64 * 576 + 3 * 8
    assert m1.field_offset("pad", 3, 64) == 64 * 576 + 3 * 8 + 7
    assert get_layout(TRT).field_offset("rope", 5, 128) == 5 * 512 + 448
    with pytest.raises(kb.LayoutError, match="already registered"):
        kb.register(m1)


def test_byte_move_report_is_lossless_and_counts_tokens():
    pages = kb.encode(random_latents(7, 6, 1.0), MODEL1, page_size=4)
    out, rep = kb.transcode(pages, MODEL1, FOOTER, src_page_size=4, dst_page_size=3, report=True)
    assert rep.byte_move and rep.lossless and rep.num_tokens == 8 and rep.max_abs_error == 0.0
    assert out.shape == (3, 3 * 584)


@pytest.mark.parametrize("layout", [MODEL1, FOOTER, TRT, "bf16"])
def test_zero_tokens_give_zero_pages(layout):
    pages = kb.encode(torch.zeros(0, 512), layout, page_size=4)
    assert pages.shape == (0, get_layout(layout).page_bytes(4))
    assert kb.decode(pages, layout, page_size=4).shape == (0, 512)
    one = kb.encode(torch.ones(3, 512), layout, page_size=4)
    assert kb.transcode(one, layout, layout, src_page_size=4, dst_page_size=2, num_tokens=0).shape[0] == 0


@pytest.mark.parametrize("backend", ["auto", "reference"])
@pytest.mark.parametrize(
    ("src", "dst", "kwargs"),
    [
        (TRT, MODEL1, {}),
        (MODEL1, TRT, {"dst_scale": 0.5}),
        (MODEL1, FOOTER, {}),
        (TRT, MODEL1, {"report": True}),
        (MODEL1, TRT, {"dst_scale": "auto"}),
    ],
)
def test_transcode_into_out_writes_every_byte(monkeypatch, backend, src, dst, kwargs):
    monkeypatch.setenv("KVBRIDGE_BACKEND", backend)
    pages = kb.encode(random_latents(70, 7, 3.0), src, page_size=16)
    fresh = kb.transcode(pages, src, dst, src_page_size=16, dst_page_size=32, num_tokens=70, **kwargs)
    fresh = fresh[0] if isinstance(fresh, tuple) else fresh
    out = torch.full_like(fresh, 0xAB)
    got = kb.transcode(pages, src, dst, src_page_size=16, dst_page_size=32, num_tokens=70, out=out, **kwargs)
    got = got[0] if isinstance(got, tuple) else got
    assert got.data_ptr() == out.data_ptr()
    assert torch.equal(out, fresh)


def test_transcode_out_is_checked_before_anything_is_written():
    buffer = torch.zeros(20000, dtype=torch.uint8)
    pages = buffer[:4096].view(2, 2048)
    pages.copy_(kb.encode(random_latents(8, 8, 1.0), TRT, page_size=4))
    good = torch.zeros(2, get_layout(MODEL1).page_bytes(4), dtype=torch.uint8)
    for bad, match in [
        (good[:1], r"shape \[2, 2880\]"),
        (good.to(torch.int8), "must be uint8"),
        (good.t().contiguous().t(), "contiguous"),
        (buffer[2000 : 2000 + good.numel()].view(good.shape), "overlaps the source"),
        ([0] * 10, "must be a torch.Tensor"),
    ]:
        before = bad.clone() if isinstance(bad, torch.Tensor) else None
        with pytest.raises(kb.InputError, match=match):
            kb.transcode(pages, TRT, MODEL1, src_page_size=4, out=bad)
        if before is not None and bad.shape == before.shape:
            assert torch.equal(bad, before)
