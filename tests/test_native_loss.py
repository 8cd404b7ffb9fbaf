"""The loss statistics of a transcode: the native one-pass kernel (kvbridge.backends.native.loss) against the
torch comparison of decoded values (kvbridge.backends.loss_stats), and ``transcode(report=True)`` against the
torch formulas it replaced.

Maxima and counts must be identical; the float64 sum of squared errors differs only in its
summation order (rel 1e-12); the fp32 ``err.square().mean()`` used before differs by its fp32
rounding (rel 1e-5).
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch

from kvbridge.backends import dispatch, native
from kvbridge.backends.loss_stats import LossStats, compare_values
from kvbridge.backends.native import loss as native_loss
from kvbridge.backends.native import records as native_records
from kvbridge.layouts import all_layouts, get_layout
from kvbridge.layouts.codec import tensor_multiplier
from kvbridge.ops import pages as page_ops
from tests.test_ckernels import SPLIT_MODEL1, _kernels, implementation, implementations
from tests.test_native import SPLIT_FP8, TOKEN_MAJOR_MODEL1, edge_latents

LAYOUTS = list(all_layouts())


def finite_latents(seed: int = 0) -> torch.Tensor:
    """Edge-case tiles (ties, subnormals, values that saturate per-tensor E4M3 at small scales), kept
    within bf16's finite range so that every layout stores them finite."""
    x = edge_latents(seed)
    return x.clamp(-3e38, 3e38)


def assert_same_stats(got: LossStats, want: LossStats) -> None:
    for name in ("num_tokens", "src_amax", "max_abs", "nope_max", "rope_max", "unequal", "flushed", "saturated"):
        assert getattr(got, name) == getattr(want, name), name
    assert got.sum_sq == pytest.approx(want.sum_sq, rel=1e-12, abs=0.0)


@pytest.fixture(scope="module")
def latents() -> torch.Tensor:
    return finite_latents()


@pytest.mark.parametrize("src", LAYOUTS, ids=lambda lay: lay.name)
def test_native_stats_match_torch_comparison_for_every_pair(latents, src):
    """Every (source, destination) pair of the registry, mixed page sizes, partly filled pages;
    per-tensor destinations at several scales and both dialects."""
    n = latents.shape[0] - 7
    s_in = 0.037 if src.per_tensor_scale else 1.0
    pages = dispatch.encode_pages(latents, src, 61, src.default_dialect, s_in)
    for dst in LAYOUTS:
        settings = itertools.product(dst.dialects or (None,), (1.0, 0.037, 3.0) if dst.per_tensor_scale else (1.0,))
        for dialect, s_out in settings:
            out = native.transcode_pages(pages, src, 61, dst, 16, n, s_in, s_out, dialect)
            mult = tensor_multiplier(dialect, s_out) if dst.per_tensor_scale else None
            got = native_loss.loss_stats(pages, src, 61, out, dst, 16, n, s_in, s_out, mult)
            a = native.decode_pages(pages, src, 61, n, s_in)
            b = native.decode_pages(out, dst, 16, n, s_out)
            assert_same_stats(got, compare_values(a, b, mult))


def old_report(values: torch.Tensor, back: torch.Tensor, mult: float | None) -> dict:
    """The torch formulas ``transcode(report=True)`` used before the native kernel."""
    err = (back - values).abs()
    sat = int(((values * torch.tensor(mult)).abs() > 448).sum()) if mult is not None else 0
    return {
        "lossless": bool(torch.equal(values, back)),
        "max_abs_error": float(err.max()),
        "max_rel_error": float(err.max()) / float(values.abs().max()),
        "rms_error": float(err.square().mean().sqrt()),
        "saturated": sat,
        "flushed_to_zero": int(((values != 0) & (back == 0)).sum()),
        "nope_max_abs_error": float(err[:, :448].max()),
        "rope_max_abs_error": float(err[:, 448:].max()),
    }


@pytest.mark.parametrize(("src", "dst", "scale", "dialect"), [
    ("trtllm-fp8", "flashmla-model1", None, None),
    ("flashmla-model1", "trtllm-fp8", 0.01, None),
    ("flashmla-model1", "trtllm-fp8", 0.01, "compress"),
    ("bf16", "v41-fp4", None, None),
    ("v41-fp8", "trtllm-fp8", "auto", None),
])
def test_transcode_report_matches_the_torch_formulas(latents, src, dst, scale, dialect):
    """The native report and the old torch formulas agree (on values below 1e15: beyond about 1e19
    the old fp32 sum of squares overflowed to an rms of inf, the float64 sum does not)."""
    latents = latents.clamp(-1e15, 1e15)
    s_lay, d_lay = get_layout(src), get_layout(dst)
    s_in = 0.037 if s_lay.per_tensor_scale else None
    pages = dispatch.encode_pages(latents, s_lay, 64, s_lay.default_dialect, s_in or 1.0)
    out, rep = page_ops.transcode(pages, src, dst, src_page_size=64, src_scale=s_in, dst_scale=scale, dialect=dialect,
                             report=True)
    values = page_ops.decode(pages, src, page_size=64, scale=s_in)
    back = page_ops.decode(out, dst, page_size=64, scale=rep.dst_scale)
    mult = tensor_multiplier(dialect, rep.dst_scale) if d_lay.per_tensor_scale else None
    want = old_report(values, back, mult)
    got = rep.to_dict()
    assert want.pop("rms_error") == pytest.approx(got.pop("rms_error"), rel=1e-5)
    assert {k: got[k] for k in want} == want
    assert not rep.lossless and rep.note == d_lay.loss_note


def test_reference_backend_report_equals_native(latents, monkeypatch):
    pages = dispatch.encode_pages(latents, get_layout("flashmla-model1"), 64, "flashmla", 1.0)
    kwargs = dict(src_page_size=64, dst_page_size=32, dst_scale=0.02, report=True)
    out, native_rep = page_ops.transcode(pages, "flashmla-model1", "trtllm-fp8", **kwargs)
    monkeypatch.setenv(dispatch.BACKEND_ENV, "reference")
    ref_out, ref_rep = page_ops.transcode(pages, "flashmla-model1", "trtllm-fp8", **kwargs)
    assert torch.equal(out, ref_out)
    assert ref_rep.rms_error == pytest.approx(native_rep.rms_error, rel=1e-12)
    assert {**ref_rep.to_dict(), "rms_error": 0} == {**native_rep.to_dict(), "rms_error": 0}


def test_lossless_transcode_report_and_empty_input():
    x = torch.randn(300, 512).bfloat16().float()
    pages = page_ops.encode(x, "bf16", page_size=64)
    _, rep = page_ops.transcode(pages, "bf16", "bf16", src_page_size=64, dst_page_size=16, report=True)  # byte move
    assert rep.lossless and rep.byte_move and rep.max_abs_error == 0
    fp8 = page_ops.encode(x, "trtllm-fp8", page_size=64, scale=0.5)
    _, rep = page_ops.transcode(fp8, "trtllm-fp8", "bf16", src_page_size=64, src_scale=0.5, report=True)
    assert rep.lossless and not rep.byte_move and rep.rms_error == 0 and rep.num_tokens == 320
    empty = torch.zeros(0, get_layout("trtllm-fp8").page_bytes(64), dtype=torch.uint8)
    _, rep = page_ops.transcode(empty, "trtllm-fp8", "flashmla-model1", src_page_size=64, report=True)
    assert rep.lossless and rep.num_tokens == 0 and rep.rms_error == 0


def test_merged_chunk_stats_equal_one_pass(latents):
    """Streamed conversions merge per-chunk statistics: maxima and counts as one pass over all."""
    src, dst = get_layout("flashmla-model1"), get_layout("trtllm-fp8")
    pages = dispatch.encode_pages(latents, src, 64, "flashmla", 1.0)
    n = latents.shape[0]
    out = dispatch.transcode_pages(pages, src, 64, dst, 64, n, 1.0, 0.01, "swa")
    mult = tensor_multiplier("swa", 0.01)
    whole = dispatch.loss_stats(pages, src, 64, out, dst, 64, n, 1.0, 0.01, mult)
    merged = LossStats()
    for p0 in range(0, pages.shape[0], 3):
        k = min(n - 64 * p0, 3 * 64)
        merged.merge(dispatch.loss_stats(pages[p0:p0 + 3], src, 64, out[p0:p0 + 3], dst, 64, k, 1.0, 0.01, mult))
    assert_same_stats(merged, whole)


# --- the per-tensor E4M3 <-> MODEL1 accelerators against the generic kernel -------------------------

TENSOR_MODEL1 = [("trtllm-fp8", "flashmla-model1"), ("trtllm-fp8", "trtllm-fp8-ds-mla"),
                 ("flashmla-model1", "trtllm-fp8"), ("trtllm-fp8-ds-mla", "trtllm-fp8")]


@pytest.fixture(params=[1, 2], ids=lambda k: f"{k}-threads")
def threads(request):
    before = torch.get_num_threads()
    torch.set_num_threads(request.param)
    yield request.param
    torch.set_num_threads(before)


def loss_implementations() -> list[str]:
    """The accelerators' implementations this machine runs: numba, the C kernels' scalar code and (with
    AVX-512 VBMI) their vector code (non-temporal stores do not apply: the statistics write no pool)."""
    return [name for name in implementations() if not name.endswith("-nt")]


def assert_accelerated_equals_generic(args: tuple) -> None:
    """Every implementation of the accelerator gives the generic kernel's numbers: maxima and counts
    identical, the float64 sum of squares up to its order of summation (rel 1e-12: a sum of n
    non-negative terms is within (n - 1) * 2^-53 of the exact one, relatively; both kernels add at
    most 512 squares per token, then at most 256 tokens per chunk, so they differ by < 2e-13)."""
    src, dst = args[1], args[4]
    assert native_loss.LOSS_ACCELERATORS.get((src.segments, dst.segments)) is not None
    want = native_loss.loss_stats(*args, accelerated=False)
    for name in loss_implementations():
        with implementation(name):
            try:
                assert_same_stats(native_loss.loss_stats(*args), want)
            except AssertionError as exc:
                raise AssertionError(f"{name}: {exc}") from exc


def test_accelerators_are_registered_for_tensor_model1_records_only():
    keys = set(native_loss.LOSS_ACCELERATORS)
    fp8, model1 = get_layout("trtllm-fp8").segments, get_layout("flashmla-model1").segments
    assert keys == {(fp8, model1), (model1, fp8)}
    assert get_layout("trtllm-fp8-ds-mla").segments == model1  # served by the same kernels


@pytest.mark.parametrize(("src_name", "dst_name"), TENSOR_MODEL1)
def test_accelerated_stats_equal_generic_on_edge_latents(latents, threads, src_name, dst_name):
    """Every dialect, scales 1, 0.5 and an odd one, page sizes whose token count ends mid-page."""
    src, dst = get_layout(src_name), get_layout(dst_name)
    n = latents.shape[0] - 5
    for (sps, dps), scale in itertools.product(((64, 64), (61, 16), (16, 1), (128, 61)), (1.0, 0.5, 0.037)):
        s_in = scale if src.per_tensor_scale else 1.0
        pages = dispatch.encode_pages(latents, src, sps, src.default_dialect, s_in)
        for dialect in dst.dialects:
            s_out = scale if dst.per_tensor_scale else 1.0
            out = native.transcode_pages(pages, src, sps, dst, dps, n, s_in, s_out, dialect)
            mult = tensor_multiplier(dialect, s_out) if dst.per_tensor_scale else None
            assert_accelerated_equals_generic((pages, src, sps, out, dst, dps, n, s_in, s_out, mult))
            if mult is not None:  # the same pair without a saturation count
                assert_accelerated_equals_generic((pages, src, sps, out, dst, dps, n, s_in, s_out, None))


def finite_random_pages(layout, num_pages: int, page_size: int, g: torch.Generator) -> torch.Tensor:
    """Random bytes of ``layout``'s pages, made finite: E4M3 NaN codes, all-ones bf16 exponents and
    UE8M0 scale bytes above 246 (448 * 2^119 is the largest finite product) moved off."""
    records = torch.randint(0, 256, (num_pages * page_size, layout.record_bytes), dtype=torch.uint8, generator=g)
    nope = records[:, :448] if layout.record_bytes == 584 else records[:, :512]
    nope[(nope & 0x7F) == 0x7F] ^= 1
    if layout.record_bytes == 584:
        hi = records[:, 449:576:2]
        hi[(hi & 0x7F) == 0x7F] ^= 0x40
        scales = records[:, 576:583]
        scales[scales > 246] -= 40
    return layout.records_to_pages(records, page_size)


@pytest.mark.parametrize(("src_name", "dst_name"), TENSOR_MODEL1)
def test_accelerated_stats_equal_generic_on_random_bytes(threads, src_name, dst_name):
    """Two unrelated pools of finite random records (every code, scale byte and bf16 pattern)."""
    g = torch.Generator().manual_seed(13)
    src, dst = get_layout(src_name), get_layout(dst_name)
    for sps, dps, n in ((64, 32, 64 * 9 - 17), (16, 61, 61 * 3 + 1), (256, 256, 3000)):
        a = finite_random_pages(src, -(-n // sps), sps, g)
        b = finite_random_pages(dst, -(-n // dps), dps, g)
        s_in = 0.037 if src.per_tensor_scale else 1.0
        s_out = 0.5 if dst.per_tensor_scale else 1.0
        for mult in (None, 2.0, 27.0):  # a multiplier counts saturated source values whatever the destination
            assert_accelerated_equals_generic((a, src, sps, b, dst, dps, n, s_in, s_out, mult))


@pytest.mark.parametrize("fp8", [get_layout("trtllm-fp8"), SPLIT_FP8], ids=lambda lay: lay.name)
@pytest.mark.parametrize("m1", [TOKEN_MAJOR_MODEL1, SPLIT_MODEL1], ids=lambda lay: lay.name)
def test_accelerated_stats_equal_generic_on_other_record_geometries(threads, fp8, m1):
    """Records read in place from token-major MODEL1 pages, or gathered from pages block-split inside a record
    (per-tensor E4M3 at 448, MODEL1 at 448), both directions: random finite bytes and transcoded latents."""
    g = torch.Generator().manual_seed(19)
    n = 3 * 61 - 4
    a, b = finite_random_pages(fp8, 3, 61, g), finite_random_pages(m1, 3, 61, g)
    for mult in (None, 5.0):
        assert_accelerated_equals_generic((a, fp8, 61, b, m1, 61, n, 0.037, 1.0, mult))
        assert_accelerated_equals_generic((b, m1, 61, a, fp8, 61, n, 1.0, 0.037, mult))
    latents = finite_latents(7)
    n = latents.shape[0]
    pages = dispatch.encode_pages(latents, fp8, 16, "swa", 0.5)
    out = native.transcode_pages(pages, fp8, 16, m1, 3, n, 0.5, 1.0, "flashmla")
    assert_accelerated_equals_generic((pages, fp8, 16, out, m1, 3, n, 0.5, 1.0, None))
    back = native.transcode_pages(out, m1, 3, fp8, 16, n, 1.0, 0.5, "swa")
    assert_accelerated_equals_generic((out, m1, 3, back, fp8, 16, n, 1.0, 0.5, tensor_multiplier("swa", 0.5)))


@pytest.mark.parametrize(("src_name", "dst_name"), TENSOR_MODEL1)
def test_accelerated_stats_equal_generic_at_extreme_scales(threads, src_name, dst_name):
    """Per-tensor scales where the C kernels' exact rescaling by 2^8 would overflow (above FLT_MAX / 256:
    their two-product path), fp32 subnormal and tiny ones; UE8M0 scale bytes 247-254 (2^120 to 2^127,
    the MODEL1 two-product path) holding codes small enough for finite values."""
    g = torch.Generator().manual_seed(17)
    src, dst = get_layout(src_name), get_layout(dst_name)
    latents = finite_latents(5)
    n = latents.shape[0] - 3
    for scale in (2e36, 3.0e38, 1e-40, 2.0**-149 * 3, 1e-30):
        s_in = scale if src.per_tensor_scale else 1.0
        s_out = scale if dst.per_tensor_scale else 1.0
        pages = dispatch.encode_pages(latents, src, 64, src.default_dialect, s_in)
        out = native.transcode_pages(pages, src, 64, dst, 61, n, s_in, s_out, "swa" if dst.per_tensor_scale else None)
        for mult in (None, 1.0, tensor_multiplier("swa", scale)):  # 1/1e-40 is inf in fp32
            assert_accelerated_equals_generic((pages, src, 64, out, dst, 61, n, s_in, s_out, mult))
    m1_name = src_name if src_name != "trtllm-fp8" else dst_name
    m1 = get_layout(m1_name)
    records = m1.pages_to_records(finite_random_pages(m1, 6, 64, g), 64).clone()
    tiles = records[:, :448].reshape(-1, 7, 64)
    big = torch.randint(247, 255, tiles.shape[:2], dtype=torch.uint8, generator=g)
    use = torch.rand(tiles.shape[:2], generator=g) < 0.5
    records[:, 576:583] = torch.where(use, big, records[:, 576:583])
    tiles[use] &= 0xB7  # |e4m3| < 1, so 2^127 times it is finite
    pool = m1.records_to_pages(records, 64)
    other = get_layout("trtllm-fp8")
    pt = finite_random_pages(other, 6, 64, g)
    for s_pt in (1.0, 1e30, 2e36):
        args = (pt, other, 64, pool, m1, 64, 6 * 64 - 9, s_pt, 1.0, 3.0) if src_name == "trtllm-fp8" else (
            pool, m1, 64, pt, other, 64, 6 * 64 - 9, 1.0, s_pt, 3.0)
        assert_accelerated_equals_generic(args)


@pytest.mark.skipif(_kernels is None, reason="kvbridge.backends.native._kernels is not built")
def test_c_loss_kernels_check_their_arguments():
    """Short pools, statistics buffers or tables and chunk ranges past the tokens raise ValueError."""
    fp8, m1 = get_layout("trtllm-fp8"), get_layout("flashmla-model1")
    pt = np.zeros(fp8.page_bytes(64), np.uint8)
    pool = np.zeros(m1.page_bytes(64), np.uint8)
    ue8m0 = native_records._UE8M0_F32
    maxima, sums, counts = np.zeros((1, 4), np.uint32), np.zeros(1), np.zeros((1, 3), np.int64)

    def call(kernel, c1=1, n=64, src=pt, dst=pool, table=ue8m0, out=(maxima, sums, counts)):
        s, d = (fp8, m1) if kernel is _kernels.fp8_model1_loss else (m1, fp8)
        kernel(0, c1, src, 64, s.page_bytes(64), s.record_bytes, s.record_bytes, np.float32(1.0), dst, 64,
               d.page_bytes(64), d.record_bytes, d.record_bytes, np.float32(1.0), n, True, np.float32(1.0), table, *out)

    call(_kernels.fp8_model1_loss)
    call(_kernels.model1_fp8_loss, src=pool, dst=pt)
    with pytest.raises(ValueError, match="geometry"):
        call(_kernels.fp8_model1_loss, dst=pool[:-1])
    with pytest.raises(ValueError, match="geometry"):
        call(_kernels.model1_fp8_loss, src=pool, dst=pt, n=65)
    with pytest.raises(ValueError, match="chunk range"):
        call(_kernels.fp8_model1_loss, c1=2)
    with pytest.raises(ValueError, match="ue8m0"):
        call(_kernels.fp8_model1_loss, table=ue8m0[:255])
    with pytest.raises(ValueError, match="maxima"):
        call(_kernels.fp8_model1_loss, out=(maxima, sums, counts[:, :2]))


@pytest.mark.skipif(_kernels is None, reason="kvbridge.backends.native._kernels is not built")
def test_accelerators_run_the_c_kernels_where_native_runs_compiled_ones(latents, monkeypatch):
    """With ``native_accel._CK`` set (the compiled kernels in use) the accelerators call its loss functions; without
    it, the numba kernels."""
    calls = []

    class Recording:
        def __getattr__(self, name):
            def run(*args):
                calls.append(name)
                return getattr(_kernels, name)(*args)
            return run

    fp8, m1 = get_layout("trtllm-fp8"), get_layout("flashmla-model1")
    pages = dispatch.encode_pages(latents, fp8, 64, "swa", 0.5)
    n = latents.shape[0]
    out = native.transcode_pages(pages, fp8, 64, m1, 64, n, 0.5, 1.0, "flashmla")
    monkeypatch.setattr(native, "_CK", Recording())
    native_loss.loss_stats(pages, fp8, 64, out, m1, 64, n, 0.5, 1.0, None)
    native_loss.loss_stats(out, m1, 64, pages, fp8, 64, n, 1.0, 0.5, 2.0)
    assert set(calls) == {"fp8_model1_loss", "model1_fp8_loss"}
    monkeypatch.setattr(native, "_CK", None)
    calls.clear()
    native_loss.loss_stats(pages, fp8, 64, out, m1, 64, n, 0.5, 1.0, None)
    assert not calls
