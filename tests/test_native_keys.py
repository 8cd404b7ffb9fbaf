"""The fp4 -> fp8 indexer-key kernels, byte for byte: the C extension's (``_kernels.fp4_to_fp8_keys``, portable C on
any CPU), numba's (``native.keys._fp4_to_fp8_keys_kernel``, the fallback) and the torch path of ``kvbridge.ops.keys``.

Two implementations share a name only if byte-identical, so the C and numba kernels are compared on every input,
including keys that decode to NaN/Inf (the kernels flag them and the caller discards the bytes, but both write the
same ones): the codes, the scale bytes, the measured error and the NaN/Inf verdict. Where a key is finite and the
rule applies to its dim, both equal the torch path (decode, re-encode by the writer's rule, max |error|). Inputs:
every scale byte (0, the subnormal 2^-127; 254, 255 = NaN), zero and -0 blocks, max E2M1 (+-6), every code, odd
segment counts and empty segments, padded strides, keys read in place (8-byte aligned: the numba kernel's word
path), through local copies (68-byte records) and from unaligned arrays (no word path).
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import subprocess
import sys

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvbridge.backends.native import accel
from kvbridge.backends.native import keys as key_kernels
from kvbridge.errors import KVBridgeError
from kvbridge.ops import keys as ix

try:
    from kvbridge.backends.native import _kernels
except ImportError:  # not built: only the numba kernel runs
    _kernels = None

def implementations() -> list[str]:
    """Every implementation of the key kernel this machine can run: numba's, the C kernel's portable code and
    (on a CPU with AVX2) its vpshufb code."""
    names = ["numba"]
    if _kernels is not None:
        names += ["C-scalar"] + (["C-avx2"] if _kernels.key_cpu_isa() == "avx2" else [])
    return names


IMPLS = implementations()
RULES = list(key_kernels._KEY_RULES)
GARBAGE = 0xA5
#: Scale bytes the kernels treat specially: the subnormal 2^-127, 1, the common range's ends, 2^126, 2^127, NaN.
EDGE_SCALES = [0, 1, 2, 60, 100, 117, 120, 127, 128, 140, 200, 252, 253, 254, 255]
#: Code bytes of whole blocks: +0, -0, max E2M1 (+6, -6, both), every code, the smallest magnitude.
EDGE_BLOCKS = [0x00, 0x88, 0x77, 0xFF, 0x7F, 0x11, 0x19]


@contextlib.contextmanager
def keys_impl(name: str):
    """Run ``native.keys`` with ``name`` (see ``implementations``; "C": the C kernel's default ISA)."""
    if name.startswith("C") and _kernels is None:
        pytest.skip("the C extension is not built")
    saved, isa = accel._KEYS, None
    accel._KEYS = _kernels if name.startswith("C") else None
    if name.startswith("C-"):
        isa = _kernels.set_key_isa(name[2:])
    try:
        yield
    finally:
        accel._KEYS = saved
        if isa is not None:
            _kernels.set_key_isa(isa)


def run(impl, keys, scales, n, dim, rule, *, segments=None, strides=None, offset=0, measure=True):
    """``n`` fp4 keys (uint8 ``[n, dim / 2]`` codes, ``[n, dim / 32]`` scale bytes) -> (fp8 codes ``[n, dim]``, fp8
    scale bytes ``[n, 4]``, error or None) by ``impl``, through flat arrays laid out with row ``strides`` (codes,
    scales, fp8 codes, fp8 scale; default: records of ``dim / 2 + dim / 32`` and ``dim + 4`` bytes) starting
    ``offset`` bytes into their buffers, in ``segments`` (key counts, default one) of garbage-filled outputs."""
    half, blocks = dim // 2, dim // 32
    sds, sss, dds, dss = strides or (half + blocks, half + blocks, dim + 4, dim + 4)
    records = strides is None
    size = [offset + max(n - 1, 0) * st_ + w + 8 for st_, w in ((sds, half), (sss, blocks), (dds, dim), (dss, 4))]
    bufs = [np.full(sz, GARBAGE, np.uint8) for sz in size]
    if records:  # one buffer each side: codes then scale bytes in every record
        bufs[1], bufs[3] = bufs[0], bufs[2]
    src_k, src_s = bufs[0][offset:], bufs[1][offset + (half if records else 0):]
    dst_k, dst_s = bufs[2][offset:], bufs[3][offset + (dim if records else 0):]
    for k in range(n):
        src_k[k * sds : k * sds + half] = keys[k]
        src_s[k * sss : k * sss + blocks] = scales[k]
    counts = np.asarray(segments if segments is not None else [n], np.int64)
    first = np.concatenate([[0], np.cumsum(counts)[:-1]]).astype(np.int64)
    segs = np.stack([first * sds, first * sss, first * dds, first * dss, counts], axis=1)
    order = np.random.default_rng(n).permutation(len(segs))  # segments in any order
    with keys_impl(impl):
        err = key_kernels.fp4_to_fp8_key_segments(src_k, src_s, dst_k, dst_s, segs[order], (sds, sss, dds, dss), dim,
                                                  rule, measure=measure)
    out_k = np.stack([dst_k[k * dds : k * dds + dim] for k in range(n)]) if n else np.zeros((0, dim), np.uint8)
    out_s = np.stack([dst_s[k * dss : k * dss + 4] for k in range(n)]) if n else np.zeros((0, 4), np.uint8)
    return out_k, out_s, err


def torch_path(keys, scales, dim, rule):
    """``kvbridge.ops.keys``' torch path (``transcode_keys`` without the kernel): (fp8 records, error), or None where
    it refuses the keys."""
    src, dst = ix.indexer_format("fp4", dim), ix.indexer_format("fp8", dim)
    records = torch.from_numpy(np.concatenate([keys, scales], axis=1))
    values = ix.decode_keys(records, src)
    try:
        out = ix.encode_keys(values, dst, rule)
    except KVBridgeError:  # NaN/Inf values, or (trtllm) a multiplier 448 / amax that overflows
        return None
    back = ix.decode_keys(out, dst, rule)
    return out.numpy(), float((back - values).abs().max()) if values.numel() else 0.0


def check(keys, scales, dim, rule, **layout):
    """Every implementation (C on each ISA, numba) agrees byte for byte (and with ``measure=False``: the same
    bytes, error 0.0); and with the torch path where it defines the result. Returns the first's result."""
    got = {impl: run(impl, keys, scales, len(keys), dim, rule, **layout) for impl in IMPLS}
    first = next(iter(got.values()))
    for impl, (k, s, err) in got.items():
        assert np.array_equal(k, first[0]) and np.array_equal(s, first[1]), impl
        assert (err is None) == (first[2] is None) and (err is None or err == first[2]), (impl, err, first[2])
    for impl in got:
        k, s, err = run(impl, keys, scales, len(keys), dim, rule, measure=False, **layout)
        assert np.array_equal(k, first[0]) and np.array_equal(s, first[1]), impl
        assert err == (None if first[2] is None else 0.0)
    if rule in ix.UE8M0_SCALE_RULES and dim != 128:  # the rule is defined for 128-value keys only
        return first
    want = torch_path(keys, scales, dim, rule)
    if want is None:
        assert first[2] is None  # refused, like the torch path
    else:
        assert first[2] is not None
        assert np.array_equal(np.concatenate([first[0], first[1]], axis=1), want[0])
        assert first[2] == want[1]
    return first


def edge_keys(rng, n, dim, scale_pool):
    half, blocks = dim // 2, dim // 32
    keys = rng.integers(0, 256, (n, half), dtype=np.uint8)
    for k in range(n):
        for j in range(blocks):
            pick = rng.integers(0, 3)
            if pick == 1:
                keys[k, 16 * j : 16 * j + 16] = EDGE_BLOCKS[rng.integers(0, len(EDGE_BLOCKS))]
            elif pick == 2:
                keys[k, 16 * j : 16 * j + 16] = np.arange(16, dtype=np.uint8) * 17
    scales = rng.choice(np.asarray(scale_pool, np.uint8), (n, blocks))
    return keys, scales


@pytest.mark.parametrize("rule", RULES)
@pytest.mark.parametrize("dim", [128, 64])
def test_every_scale_byte_c_numba_and_torch_agree(rule, dim):
    """Every scale byte as each block's, next to blocks a few binades above and below it (exact word codes,
    E4M3 subnormals, underflow, saturation) and alone (all blocks the same): the three implementations agree."""
    rng = np.random.default_rng(dim + RULES.index(rule))
    blocks = dim // 32
    rows = []
    for b in range(256):
        for gap in (0, 3, 9, 20, 40):
            rows.append([b] + [int(np.clip(b + gap * (1 if j % 2 else -1), 0, 255)) for j in range(1, blocks)])
    scales = np.asarray(rows, np.uint8)
    keys, _ = edge_keys(rng, len(scales), dim, [0])
    finite = ~(scales == 255).any(axis=1)
    check(keys[finite], scales[finite], dim, rule)  # finite keys: the torch path defines every byte
    check(keys, scales, dim, rule)  # NaN scale bytes too: C and numba agree, both refuse
    for offset in (3, 5):  # unaligned arrays (no word path); and the records at odd offsets
        check(keys, scales, dim, rule, offset=offset, strides=(dim // 2, blocks, dim, 4))
        check(keys[finite], scales[finite], dim, rule, offset=offset)


@settings(max_examples=60, deadline=None)
@given(
    seed=st.integers(0, 2**32 - 1),
    n=st.integers(0, 37),
    dim=st.sampled_from([128, 64, 32, 256]),
    rule=st.sampled_from(RULES),
    scale_pool=st.sampled_from([EDGE_SCALES, list(range(110, 135)), list(range(256)), [120, 121, 122, 255]]),
    layout=st.sampled_from(["records", "parts", "padded", "unaligned", "records-unaligned"]),
    cuts=st.lists(st.integers(0, 37), max_size=6),
)
def test_any_keys_c_numba_and_torch_agree(seed, n, dim, rule, scale_pool, layout, cuts):
    """Hypothesis-drawn keys (edge blocks, edge and NaN scale bytes), layouts and segment cuts (odd counts, empty
    segments, any order)."""
    keys, scales = edge_keys(np.random.default_rng(seed), n, dim, scale_pool)
    half, blocks = dim // 2, dim // 32
    bounds = sorted({0, n, *(c for c in cuts if c <= n)})
    segments = [b - a for a, b in zip(bounds[:-1], bounds[1:], strict=True)] + [0]
    strides = {"records": None, "records-unaligned": None, "parts": (half, blocks, dim, 4),
               "padded": (half + 24, blocks + 5, dim + 40, 13), "unaligned": (half + 1, blocks, dim + 3, 4)}[layout]
    check(keys, scales, dim, rule, segments=segments, strides=strides, offset=3 if "unaligned" in layout else 0)


@pytest.mark.parametrize("impl", IMPLS)
def test_many_segments_on_every_thread(impl):
    """Thousands of segments over the threads (the kernels release the GIL): the one-call bytes."""
    rng = np.random.default_rng(5)
    n, dim = 6000, 128
    keys, scales = edge_keys(rng, n, dim, list(range(100, 140)))
    whole = run(impl, keys, scales, n, dim, "vllm", strides=(64, 4, 128, 4))
    cut = run(impl, keys, scales, n, dim, "vllm", strides=(64, 4, 128, 4), segments=[3] * 2000)
    assert all(np.array_equal(a, b) for a, b in zip(whole[:2], cut[:2], strict=True)) and whole[2] == cut[2]


def test_the_key_isa_switch():
    """``set_key_isa`` takes the ISAs the CPU has and returns the previous one; the default is the best."""
    if _kernels is None:
        pytest.skip("the C extension is not built")
    assert _kernels.key_isa() == _kernels.key_cpu_isa()
    assert _kernels.set_key_isa("scalar") == _kernels.key_cpu_isa()
    assert _kernels.set_key_isa(_kernels.key_cpu_isa()) == "scalar"
    with pytest.raises(ValueError, match="not available"):
        _kernels.set_key_isa("avx9000")


def test_the_c_kernel_refuses_segments_out_of_bounds():
    """The C entry point checks every segment against its buffers (numba's kernel has no bounds checks)."""
    if _kernels is None:
        pytest.skip("the C extension is not built")
    src, dst = np.zeros(640, np.uint8), np.zeros(1320, np.uint8)
    err, bad = np.zeros(1, np.float32), np.zeros(1, np.int64)
    tables = (key_kernels._E2M1_F32, key_kernels._UE8M0_F32, key_kernels._E4M3_F32, key_kernels._key_code_table())
    for seg in ([0, 64, 0, 128, 10], [68, 132, 0, 128, 10], [0, 64, -1, 128, 1], [0, 64, 0, 128, -1]):
        with pytest.raises(ValueError, match="out of bounds"):
            _kernels.fp4_to_fp8_keys(0, 1, src, src, dst, dst, np.array([seg], np.int64), 68, 68, 132, 132, 128, 0,
                                     1e-4, *tables, True, True, err, bad)
    _kernels.fp4_to_fp8_keys(0, 1, src, src, dst, dst, np.array([[0, 64, 0, 128, 9]], np.int64), 68, 68, 132, 132,
                             128, 0, 1e-4, *tables, True, True, err, bad)
    with pytest.raises(ValueError, match="dim"):
        _kernels.fp4_to_fp8_keys(0, 1, src, src, dst, dst, np.array([[0, 64, 0, 128, 1]], np.int64), 68, 68, 132, 132,
                                 48, 0, 1e-4, *tables, True, True, err, bad)


def test_the_package_runs_numba_without_the_c_kernel(monkeypatch):
    """``accel._KEYS`` is the C extension of the span copies where the CPU has AVX2 (None when it is not built, a
    stale build, ``KVBRIDGE_NO_CKERNELS`` is set or the CPU lacks AVX2: then numba's kernel converts); with it,
    numba's kernel is not called."""
    if accel._SPANS is not None and accel._SPANS.key_cpu_isa() == "avx2":
        assert accel._KEYS is accel._SPANS
    else:
        assert accel._KEYS is None and accel._KEYS_WHY_NOT
    keys, scales = edge_keys(np.random.default_rng(1), 50, 128, EDGE_SCALES[:-1])
    want = run("numba", keys, scales, 50, 128, "sglang")
    if _kernels is None:
        return
    monkeypatch.setattr(key_kernels, "_fp4_to_fp8_keys_kernel", None)  # a numba call would fail
    got = run("C", keys, scales, 50, 128, "sglang")
    assert all(np.array_equal(a, b) for a, b in zip(got[:2], want[:2], strict=True)) and got[2] == want[2]


def test_with_the_extension_switched_off_numba_converts():
    """``KVBRIDGE_NO_CKERNELS=1`` (as a missing or stale build) leaves ``accel._KEYS`` None: the numba kernel
    converts, with the same bytes."""
    code = ("import hashlib, torch; from kvbridge.backends.native import accel, keys; assert accel._KEYS is None; "
            "g = torch.Generator().manual_seed(4); "
            "r = torch.randint(0, 256, (300, 68), dtype=torch.uint8, generator=g); r[:, 64:] = 120; "
            "out, err = keys.fp4_to_fp8_keys(r, 128, 'vllm'); print(hashlib.sha256(out.numpy()).hexdigest(), err)")
    env = {**os.environ, accel.NO_CKERNELS_ENV: "1"}
    got = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    g = torch.Generator().manual_seed(4)
    records = torch.randint(0, 256, (300, 68), dtype=torch.uint8, generator=g)
    records[:, 64:] = 120
    out, err = key_kernels.fp4_to_fp8_keys(records, 128, "vllm")
    assert got.stdout.split() == [hashlib.sha256(out.numpy()).hexdigest(), str(err)]
