"""The native CPU kernels (kvbridge.backends.native) against the reference, byte for byte, and the dispatch.

Every comparison is exact: pages with ``torch.equal``, decoded values through their int32 bit
patterns (so -0.0 and NaN payloads count too).
"""

from __future__ import annotations

import itertools
import json
import math

import pytest
import torch
from click.testing import CliRunner
from hypothesis import given, settings
from hypothesis import strategies as st

import kvbridge as kb
from cli.main import cli
from kvbridge import numerics as nx
from kvbridge.backends import dispatch, native, reference
from kvbridge.backends.native import accel as native_accel
from kvbridge.backends.native import pool as native_pool
from kvbridge.errors import InputError, NonFiniteError
from kvbridge.layouts import Field, Layout, all_layouts, get_layout
from kvbridge.study import bench

NATIVE_LAYOUTS = [lay for lay in all_layouts() if native.supports(lay)]
PER_TENSOR_SCALES = (1.0, 0.5, 2.0, 0.037)
PAGE_SIZES = (1, 2, 61, 64)
CHUNKED_TOKENS = 3 * native.CHUNK_TOKENS + 5  # several work chunks, the last one partial


def encode_settings(layout: Layout) -> list[tuple[str | None, float]]:
    """(dialect, scale) pairs worth checking for a layout."""
    dialects = layout.dialects or (None,)
    scales = PER_TENSOR_SCALES if layout.per_tensor_scale else (1.0,)
    return list(itertools.product(dialects, scales))


def bits(x: torch.Tensor) -> torch.Tensor:
    return x.contiguous().view(torch.int32)


def edge_latents(seed: int = 0) -> torch.Tensor:
    """fp32 [N, 512] whose 64-value tiles hit every corner of the scale and E4M3 rules."""
    g = torch.Generator().manual_seed(seed)
    f32 = torch.float32
    tiles: list[torch.Tensor] = [torch.zeros(64), torch.full((64,), -0.0)]
    up = lambda v: torch.nextafter(torch.tensor(v, dtype=f32), torch.tensor(math.inf)).item()  # noqa: E731
    down = lambda v: torch.nextafter(torch.tensor(v, dtype=f32), torch.tensor(0.0)).item()  # noqa: E731
    amaxes = [0.02734375, up(0.02734375), down(0.02734375), 0.0448, 0.04479, 1e-4, 1e-8, 3e-9, 2.0**-140]
    for k in range(-40, 12, 3):
        a = 448.0 * 2.0**k
        amaxes += [a, up(a), down(a), float(torch.tensor(a).bfloat16().float()) * 1.0078125]
    for i, a in enumerate(amaxes):
        tile = (torch.randn(64, generator=g) * a / 4).clamp(-a, a)
        tile[int(torch.randint(64, (1,), generator=g))] = a if i % 2 else -a
        tiles.append(tile)
    # E4M3 ties (halfway between two codes, before and after the power-of-two scale).
    ties = torch.tensor([8.5, 9.5, 0.5 * 2.0**-9, 1.5 * 2.0**-9, 2.5 * 2.0**-9, 17.0, 19.0, 208.0, 240.0, 464.0])
    for k in (0, -6, 3):
        tiles.append(torch.cat([ties * 2.0**k, -ties * 2.0**k, torch.zeros(44)]))
    # Subnormals: fp32 subnormals and the E4M3 subnormal range.
    tiles.append(torch.tensor([2.0**-149, -(2.0**-140), 2.0**-127] * 21 + [0.0]))
    tiles.append(torch.arange(64, dtype=f32) * 2.0**-12 * torch.where(torch.arange(64) % 2 == 0, 1.0, -1.0))
    # Saturating per-tensor values, random magnitudes.
    tiles.append(torch.tensor([1e30, -1e30, 500.0, -464.0, 449.0, 3.4e38] * 10 + [0.0] * 4))
    for mag in (1e-3, 0.1, 1.0, 30.0, 300.0, 1e5):
        tiles.append(torch.randn(64, generator=g) * mag)
    flat = torch.cat([t.to(f32) for t in tiles])
    reps = -(-flat.numel() // 512) * 512
    flat = torch.cat([flat, torch.randn(reps - flat.numel(), generator=g)])
    rows = flat.reshape(-1, 512)
    # Put every tile in every tile slot (nope tiles and rope) by rotating rows.
    return torch.cat([rows.roll(64 * i, dims=1) for i in range(8)])


@pytest.fixture(scope="module")
def latents() -> torch.Tensor:
    return edge_latents()


@pytest.mark.parametrize("layout", NATIVE_LAYOUTS, ids=lambda lay: lay.name)
def test_encode_matches_reference(latents, layout):
    """Every dialect and per-tensor scale, fp32 and bf16 input, several page sizes, partly filled pages."""
    n = latents.shape[0]
    for dialect, scale in encode_settings(layout):
        for x in (latents, latents.bfloat16()):
            want = reference.encode_pages(x.float(), layout, 61, dialect, scale)
            for p in PAGE_SIZES:  # other page sizes: the same records, re-paged by the reference
                got = native.encode_pages(x, layout, p, dialect, scale)
                assert torch.equal(got, reference.repage(want, layout, 61, layout, p, n)), (dialect, scale, p, x.dtype)


def test_e4m3_encoder_on_every_bf16_value_and_random_fp32_bits():
    """The kernels' E4M3 encoder (per-tensor ``compress`` dialect: no scaling) equals numerics'."""
    every_bf16 = torch.arange(65536, dtype=torch.int32).to(torch.int16).view(torch.bfloat16).float()
    g = torch.Generator().manual_seed(3)
    fp32 = torch.randint(-(2**31), 2**31 - 1, (64 * 512,), generator=g, dtype=torch.int64).to(torch.int32)
    fp32 = fp32.view(torch.float32)
    fp8 = get_layout("trtllm-fp8")
    for values in (every_bf16, fp32):
        x = values[torch.isfinite(values)]
        x = torch.cat([x, torch.zeros(-x.numel() % 512)]).reshape(-1, 512)
        assert torch.equal(native.encode_pages(x, fp8, 1, "compress", 1.0), nx.e4m3_encode(x))


@pytest.mark.parametrize("layout", NATIVE_LAYOUTS, ids=lambda lay: lay.name)
def test_decode_matches_reference_on_arbitrary_bytes(layout):
    """Any byte pattern, NaN codes and UE8M0 0xFF included, decodes to the reference's bits."""
    g = torch.Generator().manual_seed(1)
    for p, scale in itertools.product((2, 61), PER_TENSOR_SCALES if layout.per_tensor_scale else (1.0,)):
        pages = torch.randint(0, 256, (5, layout.page_bytes(p)), dtype=torch.uint8, generator=g)
        for n in (None, 5 * p - 3):
            want = reference.decode_pages(pages, layout, p, n, scale)
            got = native.decode_pages(pages, layout, p, n, scale)
            assert torch.equal(bits(got), bits(want)), (layout.name, p, scale, n)
        assert native.decode_pages(pages, layout, p, 0, scale).shape == (0, 512)


def assert_same_transcode(*args) -> None:
    """Native and reference transcode give equal pages, or the same NonFiniteError message."""
    try:
        want = reference.transcode_pages(*args)
    except NonFiniteError as exc:
        with pytest.raises(NonFiniteError) as got:
            native.transcode_pages(*args)
        assert str(got.value) == str(exc)
        return
    assert torch.equal(native.transcode_pages(*args), want), [getattr(a, "name", a) for a in args[1:]]


TRANSCODE_PAIRS = [(a, b) for a in NATIVE_LAYOUTS for b in NATIVE_LAYOUTS]


def source_settings(layout: Layout) -> list[tuple[str | None, float]]:
    """How transcode sources are written: every per-tensor scale, or every dialect's scale bytes."""
    if layout.per_tensor_scale:
        return [(layout.default_dialect, s) for s in PER_TENSOR_SCALES]
    return [(d, 1.0) for d in layout.dialects or (None,)]


def destination_settings(layout: Layout) -> list[tuple[str | None, float]]:
    """Every destination dialect (at scale 0.037 for per-tensor layouts), plus the default at scale 1."""
    if not layout.per_tensor_scale:
        return [(d, 1.0) for d in layout.dialects or (None,)]
    return [(d, 0.037) for d in layout.dialects] + [(layout.default_dialect, 1.0)]


@pytest.mark.parametrize("src,dst", TRANSCODE_PAIRS, ids=lambda lay: lay.name)
def test_transcode_every_pair_matches_reference(latents, src, dst):
    """Every layout pair, source scale and destination dialect; page size changes, partly filled pages."""
    x = latents.clamp(-1e30, 1e30)  # finite in bf16 too
    n = x.shape[0]
    for (enc_dialect, s_in), (dialect, s_out) in itertools.product(source_settings(src), destination_settings(dst)):
        pages = reference.encode_pages(x, src, 64, enc_dialect, s_in)
        for p_out, num_tokens in ((61, n), (2, n - 1)):
            assert_same_transcode(pages, src, 64, dst, p_out, num_tokens, s_in, s_out, dialect)


def test_transcode_many_chunks_on_every_thread(latents):
    """Enough tokens for several chunks per thread; the fp8 -> MODEL1 kernel at unit and other scales."""
    x = latents.repeat(32, 1)[:3000]
    src, dst = get_layout("trtllm-fp8"), get_layout("flashmla-model1")
    for s_in in (1.0, 0.037):
        pages = reference.encode_pages(x, src, 64, "swa", s_in)
        args = (pages, src, 64, dst, 2, 2999, s_in, 1.0, "amax-1e-8")  # 1500 pages: 12 chunks
        assert torch.equal(native.transcode_pages(*args), reference.transcode_pages(*args))


NONFINITE_CASES = [  # (layout, field, {byte index in the field: byte}, source scale)
    ("trtllm-fp8", "nope", {5: 0x7F}, 1.0),  # E4M3 NaN
    ("trtllm-fp8", "rope", {3: 0xFF}, 1.0),
    ("trtllm-fp8", "nope", {100: 0xFF}, 0.037),
    ("flashmla-model1", "nope", {7: 0x7F}, 1.0),
    ("flashmla-model1", "scale", {2: 0xFF}, 1.0),  # UE8M0 NaN
    ("trtllm-fp8-ds-mla", "rope", {8: 0xC0, 9: 0xFF}, 1.0),  # bf16 0xFFC0: NaN
    ("bf16", "nope", {100: 0x80, 101: 0x7F}, 1.0),  # bf16 0x7F80: +Inf
]


@pytest.mark.parametrize("name,field,patch,scale", NONFINITE_CASES)
def test_nonfinite_source_raises_like_reference(latents, name, field, patch, scale):
    src = get_layout(name)
    pages = reference.encode_pages(latents.repeat(2, 1)[:130], src, 61, src.default_dialect, scale)
    for token, (index, byte) in itertools.product((129, 70), patch.items()):
        pages[token // 61, src.field_offset(field, token % 61, 61) + index] = byte
    for dst in NATIVE_LAYOUTS:
        args = (pages, src, 61, dst, 64, None, scale, 1.0, dst.default_dialect)
        with pytest.raises(NonFiniteError) as want:
            reference.transcode_pages(*args)
        with pytest.raises(NonFiniteError) as got:
            native.transcode_pages(*args)
        assert str(got.value) == str(want.value)


def test_overflowing_source_scale_raises_like_reference(latents):
    """448 * s beyond fp32: decoded Inf is an error, as in the reference."""
    src, dst = get_layout("trtllm-fp8"), get_layout("flashmla-model1")
    pages = reference.encode_pages(latents[:64], src, 64, "swa", 1.0)
    args = (pages, src, 64, dst, 64, None, 1e36, 1.0, "flashmla")
    with pytest.raises(NonFiniteError) as want:
        reference.transcode_pages(*args)
    with pytest.raises(NonFiniteError) as got:
        native.transcode_pages(*args)
    assert str(got.value) == str(want.value)



@pytest.mark.parametrize("layout", NATIVE_LAYOUTS, ids=lambda lay: lay.name)
def test_code_domain_amax_matches_decoded_amax(latents, layout):
    """The amax from codes and scale bytes is the decoded values' amax, bit for bit, on edge-case
    records, several chunks, every per-tensor scale (1e36 overflows fp32) and arbitrary bytes; any
    NaN/Inf that decoding would produce gives None."""
    g = torch.Generator().manual_seed(4)
    scales = PER_TENSOR_SCALES + (1e36,) if layout.per_tensor_scale else (1.0,)
    x = latents.repeat(-(-CHUNKED_TOKENS // latents.shape[0]), 1)[:CHUNKED_TOKENS]
    for scale, p in itertools.product(scales, (1, 61)):
        encoded = reference.encode_pages(x, layout, p, layout.default_dialect, scale if scale < 1e30 else 1.0)
        noise = torch.randint(0, 256, (3, layout.page_bytes(p)), dtype=torch.uint8, generator=g)
        for pages, n in ((encoded, None), (encoded, CHUNKED_TOKENS - 7), (noise, 2 * p + 1), (encoded, 0)):
            want = reference.amax_pages(pages, layout, p, n, scale)
            got = native.amax_pages(pages, layout, p, n, scale)
            assert (got is None) == (want is None), (scale, p, n)
            if want is not None:
                assert got == want, (scale, p, n, got, want)  # both fp32 values as Python floats: exact


@pytest.mark.parametrize("name,field,patch,scale", NONFINITE_CASES)
def test_code_domain_amax_sees_every_nonfinite_code(latents, name, field, patch, scale):
    src = get_layout(name)
    x = latents.repeat(2, 1)[:130].clamp(-1e30, 1e30)  # 3.4e38 rounds to Inf in bf16
    pages = reference.encode_pages(x, src, 61, src.default_dialect, scale)
    assert native.amax_pages(pages, src, 61, None, scale) is not None
    for index, byte in patch.items():
        pages[70 // 61, src.field_offset(field, 70 % 61, 61) + index] = byte
    assert native.amax_pages(pages, src, 61, None, scale) is None
    assert native.amax_pages(pages, src, 61, 70, scale) is not None  # the bad token is past num_tokens


@pytest.mark.parametrize("backend", ["auto", "reference"])
@pytest.mark.parametrize("src_name", ["flashmla-model1", "trtllm-fp8", "v41-fp4-interleaved"])
def test_auto_scale_transcode_equals_decoding_first(monkeypatch, latents, backend, src_name):
    """``dst_scale="auto"`` through the code-domain amax gives the bytes of decoding everything and
    taking ``auto_scale`` of the values; a NaN source raises the same error."""
    monkeypatch.setenv("KVBRIDGE_BACKEND", backend)
    src, dst = get_layout(src_name), get_layout("trtllm-fp8")
    scale = 0.037 if src.per_tensor_scale else None
    pages = kb.encode(latents.repeat(4, 1)[:300].clamp(-1e30, 1e30) * 3.0, src, page_size=64, scale=scale)
    values = kb.decode(pages, src, page_size=64, num_tokens=300, scale=scale)
    want = kb.encode(values, dst, page_size=16, scale=kb.auto_scale(values))
    got = kb.transcode(pages, src, dst, src_page_size=64, dst_page_size=16, num_tokens=300, src_scale=scale,
                       dst_scale="auto")
    assert torch.equal(got, want)
    field = "nope_scale" if src_name == "v41-fp4-interleaved" else "nope"  # E4M3 NaN: a code or a tile scale
    pages[1, src.field_offset(field, 3, 64)] = 0x7F
    with pytest.raises(NonFiniteError, match="first at token 67, dim"):
        kb.transcode(pages, src, dst, src_page_size=64, dst_page_size=16, num_tokens=300, src_scale=scale,
                     dst_scale="auto")


REPAGE_GROUPS = {}
for _lay in all_layouts():
    REPAGE_GROUPS.setdefault(_lay.record_bytes, []).append(_lay)
REPAGE_PAIRS = [(a, b) for group in REPAGE_GROUPS.values() for a in group for b in group]


@pytest.mark.parametrize("src,dst", REPAGE_PAIRS, ids=lambda lay: lay.name)
def test_repage_matches_reference(src, dst):
    g = torch.Generator().manual_seed(2)
    for p_in, p_out, n in ((64, 61, 300), (2, 256, 301), (61, 2, None)):
        pages = torch.randint(0, 256, (-(-301 // p_in), src.page_bytes(p_in)), dtype=torch.uint8, generator=g)
        args = (pages, src, p_in, dst, p_out, n)
        assert torch.equal(native.repage(*args), reference.repage(*args)), args[1:]


TOKEN_MAJOR_MODEL1 = Layout(
    name="test-model1-token-major",
    description="unregistered: MODEL1 records token-major, pages padded to 64 B",
    record_bytes=584,
    fields=(
        Field("nope", 0, 448, "e4m3", (0, 448), tile=64, scale="scale"), Field("rope", 448, 128, "bf16", (448, 512)),
        Field("scale", 576, 7, "ue8m0"), Field("pad", 583, 1, "pad"),
    ),
    page_align=64,
    dialects=nx.DIALECTS,
)


SPLIT_FP8 = Layout(
    name="test-fp8-block-split",
    description="unregistered: per-tensor E4M3 records block-split at 448 (nope rows, then rope rows)",
    record_bytes=512,
    fields=(Field("nope", 0, 448, "e4m3", (0, 448)), Field("rope", 448, 64, "e4m3", (448, 512))),
    split=448,
    page_align=256,
    dialects=("swa", "compress"),
    per_tensor_scale=True,
)


def test_new_layout_runs_native(latents):
    """Geometry comes from the layout: a token-major MODEL1 layout needs no native code of its own."""
    assert dispatch.backend_name(latents, TOKEN_MAJOR_MODEL1) == "native"
    x = latents.repeat(3, 1)[:200]
    pages = native.encode_pages(x, TOKEN_MAJOR_MODEL1, 61, "amax-1e-4", 1.0)
    assert torch.equal(pages, reference.encode_pages(x, TOKEN_MAJOR_MODEL1, 61, "amax-1e-4", 1.0))
    model1 = get_layout("flashmla-model1")
    args = (pages, TOKEN_MAJOR_MODEL1, 61, model1, 64, 199)
    assert torch.equal(native.repage(*args), reference.repage(*args))
    fp8 = reference.encode_pages(x, get_layout("trtllm-fp8"), 64, "swa", 0.5)
    args = (fp8, get_layout("trtllm-fp8"), 64, TOKEN_MAJOR_MODEL1, 3, None, 0.5, 1.0, "amax-1e-8")
    assert torch.equal(native.transcode_pages(*args), reference.transcode_pages(*args))


def test_code_domain_kernels_on_other_geometries(latents):
    """The code-domain kernels with records gathered from and scattered to unusual splits."""
    x = latents.repeat(3, 1)[:200].clamp(-1e30, 1e30)
    model1 = get_layout("flashmla-model1")
    for s_in in (1.0, 0.037):
        split_fp8 = reference.encode_pages(x, SPLIT_FP8, 61, "swa", s_in)
        for dst in (model1, TOKEN_MAJOR_MODEL1):
            assert_same_transcode(split_fp8, SPLIT_FP8, 61, dst, 64, 199, s_in, 1.0, "amax-1e-4")
    for src in (model1, TOKEN_MAJOR_MODEL1):
        pages = reference.encode_pages(x, src, 64, "amax-1e-8", 1.0)
        for dst, dialect in itertools.product((SPLIT_FP8, get_layout("trtllm-fp8")), ("swa", "compress")):
            assert_same_transcode(pages, src, 64, dst, 3, None, 1.0, 0.037, dialect)


def test_accelerators_equal_the_generic_kernel(latents):
    """Each registered accelerator writes the bytes the generic record-program kernel writes."""
    x = latents.repeat(3, 1)[:200].clamp(-1e30, 1e30)
    assert native_accel.ACCELERATORS
    for src, dst in itertools.product(all_layouts() + [TOKEN_MAJOR_MODEL1, SPLIT_FP8], repeat=2):
        if native_accel.accelerator(src, dst) is None:
            continue
        for s_in, dialect in itertools.product(src.per_tensor_scale and (1.0, 0.037) or (1.0,), dst.dialects):
            s_out = 0.5 if dst.per_tensor_scale else 1.0
            pages = reference.encode_pages(x, src, 61, src.default_dialect, s_in)
            args = (pages, src, 61, dst, 64, 199, s_in, s_out, dialect)
            generic = native.transcode_pages(*args, accelerated=False)
            assert torch.equal(native.transcode_pages(*args), generic), args[1:]


def test_encode_decode_accelerators_equal_the_generic_kernel(latents):
    """Each registered encoder and decoder writes the bytes (decoded bits) the generic kernel writes:
    every dialect, fp32 and bf16 input with NaN/Inf among the values, arbitrary page bytes, other geometries."""
    layouts = all_layouts() + [TOKEN_MAJOR_MODEL1, SPLIT_FP8]
    encoders = [lay for lay in layouts if native_accel.accelerator(native_accel.LATENTS, lay) is not None]
    decoders = [lay for lay in layouts if native_accel.accelerator(lay, native_accel.LATENTS) is not None]
    assert get_layout("flashmla-model1") in encoders and get_layout("flashmla-model1") in decoders
    assert TOKEN_MAJOR_MODEL1 in encoders and TOKEN_MAJOR_MODEL1 in decoders  # records, not layout names
    x = latents.repeat(3, 1)[:200].clone()
    x[5, 7], x[6, 100], x[7, 450], x[8, 0] = math.nan, math.inf, -math.inf, -math.nan
    for lay in encoders:
        for dialect, values, p in itertools.product(lay.dialects or (None,), (x, x.bfloat16()), (3, 64)):
            want = native.encode_pages(values, lay, p, dialect, 1.0, accelerated=False)
            assert torch.equal(native.encode_pages(values, lay, p, dialect, 1.0), want), (lay.name, dialect, p)
    g = torch.Generator().manual_seed(5)
    for lay, p in itertools.product(decoders, (3, 61)):
        pages = torch.randint(0, 256, (5, lay.page_bytes(p)), dtype=torch.uint8, generator=g)
        for n in (None, 5 * p - 2):
            want = native.decode_pages(pages, lay, p, n, 1.0, accelerated=False)
            assert torch.equal(bits(native.decode_pages(pages, lay, p, n, 1.0)), bits(want)), (lay.name, p, n)


def test_backend_env_var(monkeypatch, latents):
    model1 = get_layout("flashmla-model1")
    assert dispatch.backend_name(latents, model1) == "native"
    monkeypatch.setenv(dispatch.BACKEND_ENV, "reference")
    assert dispatch.backend_name(latents, model1) == "reference"
    want = reference.encode_pages(latents[:10], model1, 2, "flashmla", 1.0)
    assert torch.equal(kb.encode(latents[:10], model1, page_size=2), want)
    monkeypatch.setenv(dispatch.BACKEND_ENV, "fastest")
    with pytest.raises(InputError, match="KVBRIDGE_BACKEND must be one of auto, reference, got 'fastest'"):
        kb.encode(latents[:10], model1, page_size=2)


@pytest.mark.parametrize("p", [2, 64, 256])
def test_public_api_on_cpu_matches_flashmla_vectors(model1_vectors, p):
    tensors, _ = model1_vectors
    x = tensors[f"p{p}.input"].reshape(-1, 512)
    assert dispatch.backend_name(x, get_layout("flashmla-model1")) == "native"
    pages = kb.encode(x, "flashmla-model1", page_size=p)
    assert torch.equal(pages, tensors[f"p{p}.model1"])
    assert torch.equal(kb.encode(x.float(), "model1", page_size=p), tensors[f"p{p}.model1"])
    # Decoded values are bf16-exact (E4M3 times a power of two), so the bf16 comparison is exact.
    assert torch.equal(kb.decode(pages, "model1", page_size=p).bfloat16(), tensors[f"p{p}.dequant"].reshape(-1, 512))


@pytest.mark.parametrize("i", range(4))
def test_public_api_on_cpu_matches_trtllm_vectors(trtllm_vectors, i):
    tensors, cases = trtllm_vectors
    s = cases[f"s{i}"]["scale"]
    x = tensors[f"s{i}.input"]
    pages = kb.encode(x, "trtllm-fp8", page_size=300, scale=s)
    assert torch.equal(pages.reshape(300, 512), tensors[f"s{i}.fp8"])
    assert torch.equal(bits(kb.decode(pages, "trtllm-fp8", page_size=300, scale=s)), bits(tensors[f"s{i}.decoded"]))
    model1 = kb.transcode(pages, "trtllm-fp8", "model1", src_page_size=300, dst_page_size=64, src_scale=s)
    want = reference.transcode_pages(pages, get_layout("trtllm-fp8"), 300, get_layout("model1"), 64, None, s, 1.0,
                                     "flashmla")
    assert torch.equal(model1, want)


finite_f32 = st.floats(width=32, allow_nan=False, allow_infinity=False)


@settings(max_examples=40, deadline=None)
@given(
    values=st.lists(finite_f32, min_size=1, max_size=1024),
    layout=st.sampled_from(NATIVE_LAYOUTS),
    page_size=st.integers(1, 7),
    scale=st.sampled_from(PER_TENSOR_SCALES),
    data=st.data(),
)
def test_encode_any_finite_values(values, layout, page_size, scale, data):
    x = torch.tensor(values, dtype=torch.float32).repeat(-(-512 // len(values)) * 2)[: 512 * 2].reshape(2, 512)
    x = x[:, torch.randperm(512, generator=torch.Generator().manual_seed(len(values)))]
    dialect = data.draw(st.sampled_from(layout.dialects or (None,)))
    s = scale if layout.per_tensor_scale else 1.0
    assert torch.equal(native.encode_pages(x, layout, page_size, dialect, s),
                       reference.encode_pages(x, layout, page_size, dialect, s))


@settings(max_examples=40, deadline=None)
@given(
    raw=st.binary(min_size=512, max_size=512),
    src=st.sampled_from(NATIVE_LAYOUTS),
    dst=st.sampled_from(NATIVE_LAYOUTS),
    scale=st.sampled_from(PER_TENSOR_SCALES),
)
def test_transcode_any_bytes(raw, src, dst, scale):
    """Arbitrary source bytes: equal output, or the same NonFiniteError."""
    p = 3
    pages = torch.frombuffer(bytearray(raw * -(-src.page_bytes(p) * 2 // 512)), dtype=torch.uint8)
    pages = pages[: src.page_bytes(p) * 2].reshape(2, -1).clone()
    s_in = scale if src.per_tensor_scale else 1.0
    s_out = 0.037 if dst.per_tensor_scale else 1.0
    assert_same_transcode(pages, src, p, dst, 2, 5, s_in, s_out, dst.default_dialect)


def test_all_finite_bit_test():
    for dtype in (torch.float32, torch.bfloat16):
        x = torch.randn(CHUNKED_TOKENS, 512).to(dtype)
        assert native.all_finite(x)
        for value, index in itertools.product((math.nan, math.inf, -math.inf), (0, x.numel() - 1, 300 * 512 + 7)):
            y = x.clone()
            y.view(-1)[index] = value
            assert not native.all_finite(y)
            assert not dispatch.all_finite(y)
        big = torch.full((3, 512), 3.0e38).to(dtype)  # finite in fp32; bf16 rounds it to Inf
        assert native.all_finite(big) == bool(torch.isfinite(big).all())


def test_bench_library_and_cli():
    results = bench.run_bench(tokens=200, devices=["cpu"], repeat=1, reference_tokens=70)
    assert {r.case for r in results} >= {bench.TARGET_CASE}
    for r in results:
        assert r.exact and r.backend == "native" and r.device == "cpu"
        assert r.kvbridge.tokens == 200 and r.reference.tokens == 70
        assert r.vs_copy == pytest.approx(r.kvbridge.tokens_per_s / r.copy.tokens_per_s)
        assert r.copy.bytes_moved == r.kvbridge.bytes_moved
    target = bench.cpu_target(results)
    assert target is not None and target["met"] is False  # 200 tokens is below the target's 65536
    run = CliRunner().invoke(cli, ["bench", "--tokens", "130", "--repeat", "1", "--reference-tokens", "64", "--json"])
    assert run.exit_code == 0, run.output
    report = json.loads(run.output)
    assert report["machine"]["cpu_threads"] >= 1
    assert all(r["exact"] and r["kvbridge"]["tokens_per_s"] > 0 for r in report["results"])
    table = CliRunner().invoke(cli, ["bench", "--tokens", "64", "--repeat", "1", "--reference-tokens", "64"])
    assert table.exit_code == 0 and "CPU target" in table.output


def test_large_outputs_on_huge_pages(latents):
    """Outputs of HUGE_PAGE_OUTPUT bytes or more live on their own mappings: same bytes as outputs
    built piecewise on ordinary memory, and intact after other large outputs come and go."""
    fp8, model1 = get_layout("trtllm-fp8"), get_layout("flashmla-model1")
    n = 8192  # 8192 * 585 B of MODEL1 pages > 4 MiB
    assert model1.page_bytes(64) * n // 64 >= native_pool.HUGE_PAGE_OUTPUT
    pages = native.encode_pages(latents.repeat(-(-n // latents.shape[0]), 1)[:n], fp8, 64, "swa", 1.0)
    big = native.transcode_pages(pages, fp8, 64, model1, 64, None, 1.0, 1.0, "flashmla")
    values = native.decode_pages(big, model1, 64, None, 1.0)
    for _ in range(3):  # other outputs of the same sizes are allocated and freed meanwhile
        native.transcode_pages(pages, fp8, 64, model1, 64, None, 1.0, 1.0, "flashmla").fill_(0xAB)
        native.decode_pages(big, model1, 64, None, 1.0).fill_(math.nan)
    step = 16  # 16 pages: 585 KiB, on ordinary memory
    pieces = [native.transcode_pages(pages[i : i + step], fp8, 64, model1, 64, None, 1.0, 1.0, "flashmla")
              for i in range(0, pages.shape[0], step)]
    assert torch.equal(big, torch.cat(pieces))
    assert torch.equal(big[:2], reference.transcode_pages(pages[:2], fp8, 64, model1, 64, None, 1.0, 1.0, "flashmla"))
    assert torch.equal(bits(values), bits(torch.cat([native.decode_pages(p, model1, 64, None, 1.0) for p in pieces])))
