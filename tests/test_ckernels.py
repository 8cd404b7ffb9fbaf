"""The compiled MODEL1 kernels (``kvbridge.backends.native._kernels``) against the numba kernels and the generic kernel.

Each case runs every implementation present: the numba accelerators, the C kernels' portable
scalar code and (on a CPU with AVX-512 VBMI) their vector code, the latter with ordinary and with
non-temporal stores; and the generic record-program kernel (``accelerated=False``). Outputs start
filled with garbage, so every byte (padding and unused rows included) must be written, and are
compared byte for byte (decoded fp32 through their bit patterns). Where a source holds values that
decode to NaN/Inf, the transcode fails: there the per-chunk count and first position of those
values are compared exactly (the destination bytes of a failed transcode are not a result).
"""

from __future__ import annotations

import contextlib
import itertools
import math
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

from kvbridge import numerics as nx
from kvbridge.backends import native, reference
from kvbridge.backends.native import accel as native_accel
from kvbridge.backends.native import pool as native_pool
from kvbridge.backends.native import records as native_records
from kvbridge.errors import NonFiniteError
from kvbridge.layouts import Field, Layout, get_layout
from tests.test_native import SPLIT_FP8, TOKEN_MAJOR_MODEL1, edge_latents

try:
    from kvbridge.backends.native import _kernels
except ImportError:  # not built: only the numba kernels run (CI refuses that, see below)
    _kernels = None

FP8 = get_layout("trtllm-fp8")
MODEL1 = get_layout("flashmla-model1")
DS_MLA = get_layout("trtllm-fp8-ds-mla")
#: MODEL1 records block-split inside the rope: neither part is the 576 data bytes (the gather/scatter path).
SPLIT_MODEL1 = Layout(
    name="test-model1-split-448",
    description="unregistered: MODEL1 records block-split at 448 (nope rows, then rope + scales rows)",
    record_bytes=584,
    fields=(
        Field("nope", 0, 448, "e4m3", (0, 448), tile=64, scale="scale"), Field("rope", 448, 128, "bf16", (448, 512)),
        Field("scale", 576, 7, "ue8m0"), Field("pad", 583, 1, "pad"),
    ),
    split=448,
    page_align=64,
    dialects=nx.DIALECTS,
)
MODEL1_LAYOUTS = (MODEL1, DS_MLA, TOKEN_MAJOR_MODEL1, SPLIT_MODEL1)
FP8_LAYOUTS = (FP8, SPLIT_FP8)
GARBAGE = 0xA5


def implementations() -> list[str]:
    """Every implementation of the MODEL1 accelerators this machine can run."""
    names = ["numba"]
    if _kernels is not None:
        names += ["c-scalar"]
        if _kernels.cpu_isa() != "scalar":
            names += [f"c-{_kernels.cpu_isa()}", f"c-{_kernels.cpu_isa()}-nt"]
    return names


@contextlib.contextmanager
def implementation(name: str):
    """Run native's MODEL1 accelerators with ``name`` (see ``implementations``)."""
    saved = native_accel._CK
    isa = nt_min = None
    try:
        if name == "numba":
            native_accel._CK = None
        else:
            native_accel._CK = _kernels
            isa = _kernels.set_isa(name.split("-")[1])
            nt_min = _kernels.set_nt_min(0 if name.endswith("-nt") else 1 << 62)
        yield
    finally:
        native_accel._CK = saved
        if isa is not None:
            _kernels.set_isa(isa)
            _kernels.set_nt_min(nt_min)


def run_transcode(pages, src, sp, dst, dp, n, s_in, s_out, dialect):
    """The registered accelerator into a garbage-filled pool: (pages, bad_count, bad_first)."""
    out = torch.full((dst.num_pages(n, dp), dst.page_bytes(dp)), GARBAGE, dtype=torch.uint8)
    nchunks = native_pool._page_chunks(out.shape[0], dp)
    bad_count, bad_first = np.zeros(nchunks, np.int64), np.full(nchunks, -1, np.int64)
    geometry = (native_pool._flat(pages), *native_records._geometry(src, sp)[:4], n, native_pool._flat(out),
                *native_records._geometry(dst, dp))
    native_accel.accelerator(src, dst)(pages, s_in, s_out, dialect, geometry, bad_count, bad_first)
    return out, bad_count, bad_first


def generic_transcode(*args):
    """The generic kernel's pages, or its NonFiniteError message."""
    try:
        return native.transcode_pages(*args, accelerated=False)
    except NonFiniteError as exc:
        return str(exc)


def check_transcode(pages, src, sp, dst, dp, n, s_in, s_out, dialect) -> int:
    """Every implementation equals the generic kernel (bytes, or per-chunk NaN/Inf count and first
    position and the error message); returns the number of non-finite source values."""
    args = (pages, src, sp, dst, dp, n, s_in, s_out, dialect)
    want = generic_transcode(*args)
    results = {}
    for name in implementations():
        with implementation(name):
            results[name] = run_transcode(*args)
            if isinstance(want, str):
                with pytest.raises(NonFiniteError) as got:
                    native.transcode_pages(*args)
                assert str(got.value) == want, (name, src.name, dst.name)
            else:
                out = torch.full_like(want, GARBAGE)
                assert torch.equal(native.transcode_pages(*args, out=out), want), (name, src.name, dst.name, dialect)
                assert torch.equal(results[name][0], want), (name, src.name, dst.name, dialect)
    first_name, (_, count0, first0) = next(iter(results.items()))
    for name, (_, count, first) in results.items():
        assert np.array_equal(count, count0) and np.array_equal(first, first0), (name, first_name)
    assert isinstance(want, str) == bool(count0.sum())
    return int(count0.sum())


def test_extension_is_built_under_ci():
    """CI (CI=true) must run the compiled kernels, not silently fall back to numba."""
    if os.environ.get("CI", "").strip().lower() != "true":
        pytest.skip("not CI: kvbridge.backends.native._kernels is optional")
    assert _kernels is not None, "the compiled kernels were not built (see the pip install log for the compiler error)"
    implementation = native_accel.kernel_implementation()
    assert implementation.startswith("C ") or native_accel._CK_WHY_NOT, implementation


@pytest.mark.skipif(_kernels is None, reason="kvbridge.backends.native._kernels is not built")
def test_a_stale_build_is_refused_with_the_remedy(monkeypatch):
    """A ``.so`` built from other sources (an editable install not rebuilt) could lack an entry point or take
    other arguments: kvbridge warns once, names the remedy and runs numba."""
    monkeypatch.delenv(native_accel.NO_CKERNELS_ENV, raising=False)
    assert _kernels.INTERFACE == native_accel.KERNELS_INTERFACE
    monkeypatch.setattr(_kernels, "INTERFACE", native_accel.KERNELS_INTERFACE - 1)
    with pytest.warns(RuntimeWarning, match="built from other sources .*build_ext --inplace"):
        assert native_accel._compiled_kernels() == (None, "kvbridge.backends.native._kernels is a stale build")


@pytest.mark.skipif(_kernels is None, reason="kvbridge.backends.native._kernels is not built")
def test_dispatch_and_env_var():
    """The extension is used when present and the CPU has the ISA; KVBRIDGE_NO_CKERNELS=1 forces numba."""
    if _kernels.cpu_isa() != "scalar" and not os.environ.get(native_accel.NO_CKERNELS_ENV):
        assert native_accel._CK is _kernels and native_accel.kernel_implementation() == f"C ({_kernels.isa()})"
    env = {**os.environ, native_accel.NO_CKERNELS_ENV: "1"}
    code = "from kvbridge.backends.native import accel; print(accel.kernel_implementation())"
    got = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert got.stdout.strip() == f"numba ({native_accel.NO_CKERNELS_ENV} is set)"
    with pytest.raises(ValueError, match="not available|ISA"):
        _kernels.set_isa("avx9000")


@pytest.mark.skipif(_kernels is None, reason="kvbridge.backends.native._kernels is not built")
def test_bad_arguments_raise_instead_of_overrunning():
    """The C entry points check buffer sizes and geometry against the token count."""
    src = np.zeros(FP8.page_bytes(64), np.uint8)
    small = np.zeros(MODEL1.page_bytes(64) - 1, np.uint8)
    tables = native_accel._fp8_to_model1_tables(1.0, "flashmla")
    lut = [tables[k] for k in ("scale_lut", "bad_mag", "code_lut", "rope_lut")]
    counts = np.zeros(1, np.int64)
    with pytest.raises(ValueError, match="geometry"):
        _kernels.fp8_to_model1(0, 1, src, 64, FP8.page_bytes(64), 512, 512, 64, small, 64, MODEL1.page_bytes(64), 576,
                               584, *lut, counts, counts.copy())
    with pytest.raises(ValueError, match="short"):
        _kernels.model1_decode(0, 1, np.zeros(MODEL1.page_bytes(64), np.uint8), 64, MODEL1.page_bytes(64), 576, 584,
                               64, np.zeros(64 * 512 - 1, np.float32), native_records._UE8M0_F32)
    with pytest.raises(ValueError, match="exponent floor"):  # 2^-e for e < -127 is past the pow2 table
        _kernels.model1_encode(0, 1, np.zeros(64 * 512, np.float32), np.empty(0, np.uint16), False, 64,
                               np.zeros(MODEL1.page_bytes(64), np.uint8), 64, MODEL1.page_bytes(64), 576, 584, -128,
                               native_records._POW2_F32)


def fp8_sources(g: torch.Generator):
    """(pages, page size, tokens, src_scale) of per-tensor E4M3 sources: the edge-case latents written at
    several scales, random page bytes (every code, NaN included) and clean random bytes."""
    x = edge_latents(1).repeat(3, 1)[:250].clamp(-1e30, 1e30)
    for scale, p in ((1.0, 64), (0.5, 3), (0.037, 61), (2.0, 1), (1.7e-3, 64)):
        yield reference.encode_pages(x, FP8, p, "swa", scale), p, 250, scale
    raw = torch.randint(0, 256, (5, FP8.page_bytes(64)), dtype=torch.uint8, generator=g)
    clean = torch.where((raw & 0x7F) == 0x7F, raw ^ 1, raw)
    for scale in (1.0, 0.25, 3.3e-3):
        yield clean, 64, 5 * 64 - 3, scale
    yield raw, 64, 5 * 64, 1.0
    yield clean, 64, 5 * 64, 1e38  # decoded values overflow to Inf
    sparse = FP8.pages_to_records(clean, 64).clone()  # NaN codes in a few ropes, then in a nope tile
    sparse[70, 460], sparse[71, 511], sparse[300, 448], sparse[301, 3] = 0x7F, 0xFF, 0x7F, 0xFF
    yield FP8.records_to_pages(sparse, 64), 64, 5 * 64, 0.5


def test_fp8_to_model1_every_implementation():
    g = torch.Generator().manual_seed(1)
    bad = 0
    for pages, p, n, scale in fp8_sources(g):
        for dst, dialect, dp in itertools.product(MODEL1_LAYOUTS, nx.DIALECTS, (64, 61, 1)):
            if dst is not MODEL1 and (dp != 64 or dialect != "flashmla") and scale not in (1.0, 0.037):
                continue
            bad += check_transcode(pages, FP8, p, dst, dp, n, scale, 1.0, dialect)
    x = edge_latents(2)[:100]
    split = reference.encode_pages(x, SPLIT_FP8, 61, "swa", 0.5)
    for dst in MODEL1_LAYOUTS:
        check_transcode(split, SPLIT_FP8, 61, dst, 3, 100, 0.5, 1.0, "amax-1e-8")
    assert bad  # the NaN / overflow sources did fail, identically


def model1_sources(g: torch.Generator):
    """(layout, pages, page size, tokens) of MODEL1 sources: the edge-case latents in every dialect, random
    finite page bytes (scale bytes 96-150, no NaN codes or non-finite rope) and raw random bytes."""
    x = edge_latents(3).repeat(3, 1)[:250]
    x = torch.where(x.isfinite(), x, torch.zeros(()))
    for lay, dialect, p in ((MODEL1, "flashmla", 64), (DS_MLA, "amax-1e-4", 3), (TOKEN_MAJOR_MODEL1, "amax-1e-8", 61),
                            (SPLIT_MODEL1, "flashmla", 2)):
        yield lay, reference.encode_pages(x, lay, p, dialect, 1.0), p, 250
    for lay in (MODEL1, SPLIT_MODEL1):
        raw = torch.randint(0, 256, (5, lay.page_bytes(64)), dtype=torch.uint8, generator=g)
        records = lay.pages_to_records(raw, 64).clone()
        records[:, :448] = torch.where((records[:, :448] & 0x7F) == 0x7F, records[:, :448] ^ 1, records[:, :448])
        rope_hi = records[:, 449:576:2]
        records[:, 449:576:2] = torch.where((rope_hi & 0x7F) == 0x7F, rope_hi ^ 0x40, rope_hi)
        records[:, 576:583] = torch.randint(96, 151, (records.shape[0], 7), dtype=torch.uint8, generator=g)
        yield lay, lay.records_to_pages(records, 64), 64, 5 * 64 - 7
        yield lay, raw, 64, 5 * 64
        records[70, 460:462] = torch.tensor([0x80, 0x7F], dtype=torch.uint8)  # rope Inf, NaN, then a NaN scale
        records[71, 574:576] = torch.tensor([0xC1, 0xFF], dtype=torch.uint8)
        records[300, 576 + 3] = 0xFF
        yield lay, lay.records_to_pages(records, 64), 64, 5 * 64


def test_model1_to_fp8_every_implementation():
    g = torch.Generator().manual_seed(2)
    bad = 0
    for src, pages, p, n in model1_sources(g):
        for dst, dialect, s_out, dp in itertools.product(FP8_LAYOUTS, ("swa", "compress"), (1.0, 0.5, 0.037, 1e-30),
                                                         (64, 3)):
            bad += check_transcode(pages, src, p, dst, dp, n, 1.0, s_out, dialect)
    assert bad


def latent_cases(g: torch.Generator):
    """fp32 and bf16 latents: the edge-case suite with NaN/Inf among the values, and random fp32 bit
    patterns (every exponent, subnormals, NaN payloads)."""
    x = edge_latents(4).repeat(3, 1)[:250].clone()
    x[5, 7], x[6, 100], x[7, 450], x[8, 0], x[9, 511] = math.nan, math.inf, -math.inf, -math.nan, math.nan
    bits = torch.randint(-(2**31), 2**31 - 1, (130, 512), dtype=torch.int64, generator=g).to(torch.int32)
    random = bits.view(torch.float32)
    yield from (x, x.bfloat16(), random, random.bfloat16())


def test_model1_encode_every_implementation():
    g = torch.Generator().manual_seed(3)
    for values, lay, dialect, p in itertools.product(list(latent_cases(g)), MODEL1_LAYOUTS, nx.DIALECTS, (64, 3)):
        if lay is not MODEL1 and (dialect != "amax-1e-8" or p != 3):
            continue
        n = values.shape[0]
        want = native.encode_pages(values, lay, p, dialect, 1.0, accelerated=False)
        x32, x16, from_bf16 = native_records._x_arrays(values)
        for name in implementations():
            with implementation(name):
                out = torch.full_like(want, GARBAGE)
                native_accel.accelerator(native_accel.LATENTS, lay)(x32, x16, from_bf16, n, dialect, 1.0,
                                                        (native_pool._flat(out), *native_records._geometry(lay, p)))
                assert torch.equal(out, want), (name, lay.name, dialect, p, values.dtype)
                assert torch.equal(native.encode_pages(values, lay, p, dialect, 1.0), want), (name, lay.name)


def test_model1_decode_every_implementation():
    g = torch.Generator().manual_seed(4)
    x = edge_latents(5).repeat(3, 1)[:200]
    for lay, p in itertools.product(MODEL1_LAYOUTS, (64, 61, 1)):
        encoded = reference.encode_pages(x, lay, p, "amax-1e-8", 1.0)
        raw = torch.randint(0, 256, (6, lay.page_bytes(p)), dtype=torch.uint8, generator=g)
        for pages, n in ((encoded, 200), (raw, 6 * p), (raw, 6 * p - 1)):
            want = native.decode_pages(pages, lay, p, n, 1.0, accelerated=False).view(torch.int32)
            for name in implementations():
                with implementation(name):
                    out = torch.full((n, 512), 0x7FA5A5A5, dtype=torch.int32)
                    native_accel.accelerator(lay, native_accel.LATENTS)(n, np.float32(1.0), (native_pool._flat(pages),
                                                                                *native_records._geometry(lay, p)),
                                                            native_pool._flat(out.view(torch.float32)))
                    assert torch.equal(out, want), (name, lay.name, p, n)
                    got = native.decode_pages(pages, lay, p, n, 1.0).view(torch.int32)
                    assert torch.equal(got, want), (name, lay.name, p, n)


def test_threads_split_chunks_alike():
    """Chunked over 2 threads (4 pieces each) the C kernels write what one thread writes, counts included."""
    g = torch.Generator().manual_seed(6)
    raw = torch.randint(0, 256, (40, FP8.page_bytes(64)), dtype=torch.uint8, generator=g)
    saved = torch.get_num_threads()
    try:
        results = []
        for threads in (1, 2):
            torch.set_num_threads(threads)
            results.append(run_transcode(raw, FP8, 64, MODEL1, 64, 40 * 64 - 5, 1.0, 1.0, "flashmla"))
    finally:
        torch.set_num_threads(saved)
    (a, ca, fa), (b, cb, fb) = results
    assert torch.equal(a, b) and np.array_equal(ca, cb) and np.array_equal(fa, fb) and ca.sum() > 0


def test_bench_header_names_the_kernels():
    """``kvbridge bench`` says which code ran the MODEL1 kernels (C and its ISA, or numba and why)."""
    from click.testing import CliRunner

    from cli.main import cli

    run = CliRunner().invoke(cli, ["bench", "--tokens", "64", "--repeat", "1", "--threads", "1"])
    assert run.exit_code == 0, run.output
    assert f"native MODEL1 kernels: {native_accel.kernel_implementation()}" in run.output
    assert native_accel.kernel_implementation().startswith(("C (", "numba ("))


def test_every_code_and_rope_word_once():
    """Exhaustive tables: MODEL1 -> fp8 over every finite bf16 rope word and every (scale byte, code) pair;
    fp8 -> MODEL1 over tiles whose largest magnitude is each m, holding every code of magnitude <= m."""
    words = torch.arange(65536, dtype=torch.int32)
    words = words[(words & 0x7F80) != 0x7F80]  # finite bf16
    n = -(-words.numel() // 64)
    records = torch.zeros(n, 584, dtype=torch.uint8)
    rope = torch.cat([words, words[: n * 64 - words.numel()]]).reshape(n, 64)
    records[:, 448:576:2], records[:, 449:576:2] = (rope & 0xFF).to(torch.uint8), (rope >> 8).to(torch.uint8)
    codes = torch.arange(256, dtype=torch.uint8)
    codes = codes[(codes & 0x7F) != 0x7F].repeat(-(-n * 448 // 254))[: n * 448]
    records[:, :448] = codes.reshape(n, 448)
    records[:, 576:583] = (torch.arange(n * 7) % 255).to(torch.uint8).reshape(n, 7)  # every finite scale byte
    pages = MODEL1.records_to_pages(records, 64)
    for s_out in (1.0, 0.037, 1e-30):
        check_transcode(pages, MODEL1, 64, FP8, 64, n, 1.0, s_out, "swa")
    tiles = []
    for m in range(127):  # 63 codes of magnitude <= m (all of them, over ceil(2 (m + 1) / 63) tiles), then m
        mags = torch.arange(m + 1, dtype=torch.uint8)
        both = torch.cat([mags, mags | 0x80]).repeat(63)
        for i in range(0, 2 * (m + 1), 63):
            tiles.append(torch.cat([both[i : i + 63], torch.tensor([m], dtype=torch.uint8)]))
    flat = torch.cat(tiles)
    flat = torch.cat([flat, torch.zeros(-flat.numel() % 512, dtype=torch.uint8)])
    fp8_pages = FP8.records_to_pages(flat.reshape(-1, 512), 64)
    for scale, dialect in itertools.product((1.0, 0.037, 3e-5), nx.DIALECTS):
        check_transcode(fp8_pages, FP8, 64, MODEL1, 64, flat.numel() // 512, scale, 1.0, dialect)


def check_amax(pages, layout, p, n, scale) -> float | None:
    """Every implementation's code-domain amax equals the generic kernel's (and the decoded values')."""
    want = native.amax_pages(pages, layout, p, n, scale, accelerated=False)
    decoded = reference.amax_pages(pages, layout, p, n, scale)
    assert (want is None) == (decoded is None) and (want is None or want == decoded), (layout.name, want, decoded)
    for name in implementations():
        with implementation(name):
            got = native.amax_pages(pages, layout, p, n, scale)
        assert (got is None) == (want is None), (name, layout.name, p, n, scale)
        if want is not None:  # fp32 values as Python floats: exact, and +0.0 is not -0.0
            assert math.copysign(1.0, got) == 1.0 and got == want, (name, layout.name, p, n, scale, got, want)
    return want


def test_amax_every_implementation():
    """MODEL1 and per-tensor E4M3 sources (edge cases, random bytes with NaN codes and scale bytes,
    Inf/NaN ropes, overflowing scales), several chunks, pages ending mid-chunk."""
    g = torch.Generator().manual_seed(7)
    results = []
    for lay, pages, p, n in model1_sources(g):
        for count in (n, n - 1, 1):
            results.append(check_amax(pages, lay, p, count, 1.0))
    for pages, p, n, scale in fp8_sources(g):
        for lay, count in itertools.product(FP8_LAYOUTS, (n, n - 1, 1)):
            if lay is SPLIT_FP8:  # the same records, block-split pages
                pages = SPLIT_FP8.records_to_pages(FP8.pages_to_records(pages, p, n), p)
            results.append(check_amax(pages, lay, p, count, scale))
    big = reference.encode_pages(edge_latents(8).repeat(12, 1)[:1100].clamp(-1e30, 1e30), MODEL1, 64, "flashmla", 1.0)
    results.append(check_amax(big, MODEL1, 64, 1100, 1.0))  # 5 chunks
    assert None in results and sum(r is not None and r > 0 for r in results) > 20


def test_amax_every_scale_byte_and_tile():
    """One tile of largest magnitude m and scale byte b (every b, the subnormal, normal, largest and NaN m)
    among zero tiles with other scale bytes, at every tile index and either token of a pair (the AVX-512
    kernel reduces two tokens' 14 tiles together)."""
    g = torch.Generator().manual_seed(8)
    for b, m in itertools.product(range(256), (0, 1, 7, 8, 9, 0x55, 0x7E, 0x7F)):
        records = torch.zeros(3, 584, dtype=torch.uint8)
        records[:, 576:583] = torch.randint(0, 255, (3, 7), dtype=torch.uint8, generator=g)
        t, j = b % 3, (b + m) % 7
        records[t, 64 * j : 64 * j + 64] = torch.randint(0, m + 1, (64,), dtype=torch.uint8, generator=g) | (
            torch.randint(0, 2, (64,), dtype=torch.uint8, generator=g) << 7)
        records[t, 64 * j + (b % 64)] = m | 0x80 * (b & 1)
        records[t, 576 + j] = b
        pages = MODEL1.records_to_pages(records, 2)
        check_amax(pages, MODEL1, 2, 3, 1.0)
        check_amax(pages, MODEL1, 2, 2, 1.0)


@pytest.mark.skipif(_kernels is None, reason="kvbridge.backends.native._kernels is not built")
def test_amax_bad_arguments_raise():
    pages = np.zeros(MODEL1.page_bytes(64), np.uint8)
    amax, bad = np.zeros(1, np.float32), np.zeros(1, np.int64)
    with pytest.raises(ValueError, match="geometry"):
        _kernels.model1_amax(0, 1, pages, 64, MODEL1.page_bytes(64), 576, 584, 65, amax, bad)
    with pytest.raises(ValueError, match="chunk range"):
        _kernels.model1_amax(0, 2, pages, 64, MODEL1.page_bytes(64), 576, 584, 64, np.zeros(2, np.float32),
                             np.zeros(2, np.int64))
    with pytest.raises(ValueError, match="short"):
        _kernels.fp8_amax(0, 1, np.zeros(FP8.page_bytes(64), np.uint8), 64, FP8.page_bytes(64), 512, 512, 64, 1.0,
                          np.zeros(0, np.float32), bad)


def test_model1_encode_every_bf16_magnitude():
    """Exhaustive over bf16 magnitudes (the compiled bf16 encoder computes most tiles' codes in 16-bit lanes and
    falls back to fp32 arithmetic for tiles reaching E4M3's subnormal range): for tile maxima at several
    exponents (the 1.75 mantissa boundary of the scale rule, the dialects' exponent floors), tiles holding every
    bf16 magnitude up to that maximum, both signs, zeros, bf16 subnormals."""
    g = torch.Generator().manual_seed(9)
    rows = []
    for amax in (448.0, 1.0, 3.0, 1.75 * 2.0**-3, 1.7578125 * 2.0**5, 2.0**-20, 2.0**-40, 2.0**-130, 2.0**20, 1e38):
        top = int(torch.tensor(amax, dtype=torch.float32).bfloat16().view(torch.int16)) & 0x7FFF
        mags = torch.arange(top + 1, dtype=torch.int32)
        mags = mags[torch.randperm(mags.numel(), generator=g)]
        lanes = torch.cat([mags, torch.zeros(-mags.numel() % 63, dtype=torch.int32)]).reshape(-1, 63)
        signs = torch.randint(0, 2, lanes.shape, dtype=torch.int32, generator=g) << 15
        tiles = torch.cat([lanes | signs, torch.full((lanes.shape[0], 1), top, dtype=torch.int32)], 1)
        tiles = torch.cat([tiles, tiles[torch.arange(-tiles.shape[0] % 8) % tiles.shape[0]]])  # records of 8 tiles
        rows.append(tiles.reshape(-1, 512))
    x = torch.cat(rows).to(torch.int16).view(torch.bfloat16)
    for dialect in nx.DIALECTS:
        want = native.encode_pages(x, MODEL1, 64, dialect, 1.0, accelerated=False)
        for name in implementations():
            with implementation(name):
                assert torch.equal(native.encode_pages(x, MODEL1, 64, dialect, 1.0), want), (name, dialect)
