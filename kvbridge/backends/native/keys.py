"""Native indexer-key kernels: fp4 keys -> fp8 keys of every fp8 writer rule, between strided rows.

Byte-identical to ``kvbridge.ops.keys`` (decode the fp4 keys, re-encode them by the fp8 rule);
records and a page's two parts (codes, scale bytes) are both strided rows of flat uint8 arrays.
``KEY_CHUNK`` keys per unit of parallel work (``pool._run_chunks``). The C extension's ``fp4_to_fp8_keys``
(``accel._KEYS``: vpshufb table lookups, where it is built and the CPU has AVX2) runs the segments, byte-identical
to ``_fp4_to_fp8_keys_kernel`` (numba: the fallback, and the definition), checking every segment against its arrays.
"""

from __future__ import annotations

from functools import cache

import numpy as np
import torch
from numba import njit

from kvbridge.backends.native import accel
from kvbridge.backends.native.pool import _flat, _run_chunks
from kvbridge.backends.native.records import _E2M1_F32, _E4M3_F32, _UE8M0_F32, _e4m3_code

#: Indexer keys per unit of parallel work.
KEY_CHUNK = 4096

#: Range of the fp8 key exponent e (scale 2^e) that ``_pow2_key_codes`` tabulates: a key's amax is at least
#: the writers' 1e-4 floor (e >= -22) and a finite fp32 (e <= 119; the table goes on to 127).
_KEY_E_MIN, _KEY_E_MAX = -22, 127


@njit(cache=True, inline="always")
def _key_code(value, mult) -> int:
    """E4M3 code of ``fp32(value * mult)`` (both fp32), sign included, as the fp8 key writers round it."""
    y = np.float32(value * mult)
    b = np.int64(np.uint32(y.view(np.uint32)))
    return _e4m3_code(b & 0x7FFFFFFF) | ((b >> 24) & 0x80)


@njit(cache=True, inline="always")
def _key_code_unbounded(y) -> int:
    """``_e4m3_code``'s normal-range formula on the positive finite fp32 ``y``, unbounded: the E4M3 code of
    ``y * 2^d`` is this + 8 * d wherever ``y * 2^d`` is in [2^-6, 448)."""
    b = np.int64(np.float32(y).view(np.uint32))
    return ((b + 0x7FFFF + ((b >> 20) & 1)) >> 20) - 960


@njit(cache=True)
def _pow2_key_codes(e2m1, ue8m0):
    """``codes[b, e - _KEY_E_MIN, c]``: the E4M3 code of fp4 code ``c`` under UE8M0 block scale byte ``b``
    in a key of scale 2^e (multiplier ``ue8m0[127 - e]``), computed by ``_key_code`` itself."""
    codes = np.empty((256, _KEY_E_MAX - _KEY_E_MIN + 1, 16), np.uint8)
    for b in range(256):
        for e in range(_KEY_E_MIN, _KEY_E_MAX + 1):
            mult = ue8m0[127 - e]
            for c in range(16):
                codes[b, e - _KEY_E_MIN, c] = _key_code(np.float32(e2m1[c] * ue8m0[b]), mult)
    return codes


_NIB_1 = np.uint64(0x1111111111111111)
_NIB_7 = np.uint64(0x7777777777777777)
_NIB_8 = np.uint64(0x8888888888888888)
_BYTE_01 = np.uint64(0x0101010101010101)
_BYTE_07 = np.uint64(0x0707070707070707)
_BYTE_08 = np.uint64(0x0808080808080808)
_BYTE_7F = np.uint64(0x7F7F7F7F7F7F7F7F)
_BYTE_80 = np.uint64(0x8080808080808080)


@njit(cache=True, inline="always")
def _even_bytes(y):
    """The 4 low bytes of ``y`` spread to bytes 0, 2, 4, 6 of a 64-bit word."""
    u = (y | (y << np.uint64(16))) & np.uint64(0x0000FFFF0000FFFF)
    return (u | (u << np.uint64(8))) & np.uint64(0x00FF00FF00FF00FF)


@njit(cache=True, inline="always")
def _fp4_word_codes(y, base):
    """8 E2M1 codes (the low 32 bits of ``y``, low nibble first) -> their 8 E4M3 codes in one word, for a
    block whose values stay normal in E4M3: magnitude a >= 2 is 2^(E - 1) * (1 + M / 2) with a = 2E + M,
    so its code is ``base + 4a``, and a = 1 (0.5) is ``base`` = 8 * (E4M3 exponent field of 0.5 in this
    block); 0 stays 0 and the sign bit moves from bit 3 to bit 7. Byte-wise arithmetic without carries
    (codes <= 0x7E)."""
    nib = _even_bytes(y & np.uint64(0x0F0F0F0F)) | (_even_bytes((y >> np.uint64(4)) & np.uint64(0x0F0F0F0F))
                                                    << np.uint64(8))
    a = nib & _BYTE_07
    nonzero = ((a + _BYTE_7F) & _BYTE_80) >> np.uint64(7)
    one = (((((a ^ _BYTE_01) + _BYTE_7F) & _BYTE_80) >> np.uint64(7)) ^ _BYTE_01)
    codes = base + (a << np.uint64(2)) - (one << np.uint64(2))
    return (codes & ((nonzero << np.uint64(8)) - nonzero)) | ((nib & _BYTE_08) << np.uint64(4))


@njit(cache=True, inline="always")
def _fp4_block_magnitude(w0, w1) -> int:
    """Largest E2M1 magnitude (0..7) among the 32 codes of two words: t counts when some nibble's
    magnitude + (8 - t) reaches bit 3."""
    w0, w1 = w0 & _NIB_7, w1 & _NIB_7
    m = 0
    for t in range(1, 8):
        add = np.uint64(8 - t) * _NIB_1
        if ((w0 + add) | (w1 + add)) & _NIB_8:
            m = t
    return m


@njit(cache=True, nogil=True)
def _fp4_to_fp8_keys_kernel(c0, c1, sd, ss, dd, ds, segs, sds, sss, dds, dss, dim, rule, floor, e2m1, ue8m0, e4m3,
                            pow2_codes, words, sd64, dd64, measure, err, bad):
    """fp4 indexer keys -> fp8 keys by writer ``rule`` (``_KEY_RULES``) over segments ``[c0, c1)`` of ``segs``
    (int64 ``[S, 5]``: byte offsets of the segment's first key's codes in ``sd``, its scales in ``ss``, its fp8
    codes in ``dd`` and scale in ``ds``, then its key count; key ``r`` of a segment is ``r`` row strides ``sds``,
    ``sss``, ``dds``, ``dss`` further). An fp4 key is ``dim / 2`` bytes of E2M1 pairs and ``dim / 32`` UE8M0
    scales, an fp8 key ``dim`` E4M3 bytes and 4 scale bytes. With ``measure`` ``err[seg]`` is the segment's max
    |decoded fp8 - decoded fp4|; ``bad[seg]`` is 1 when an fp4 value decodes to NaN/Inf (the segment's output is
    then meaningless). Records, a page's two parts and runs of pool pages are all strided rows.

    A decoded fp4 value ``e2m1(c) * 2^(b - 127)`` is exact in fp32 and bf16 (vLLM's bf16 rounding
    changes nothing), so the key's amax is the value of its largest code magnitude per block; the
    scale and multiplier follow the rule in fp32 operations, as ``indexer.fp8_scales`` computes them.
    Each output byte is then a function of the block's 16 possible codes: a 16-entry table per block,
    taken from ``pow2_codes`` for the power-of-two rules (vllm, vllm-ue8m0) and computed otherwise.
    Computed (sglang, deepgemm, sglang-rocm, trtllm: any fp32 multiplier ``mult``): a magnitude's value is
    ``m * 2^j`` (m = 1 or 1.5, both fp32 exact), so ``fp32(value * mult) = 2^j * fp32(m * mult)`` wherever it
    is normal, and E4M3's normal codes step by 8 per power of two: with ``C_m`` the code formula's value for
    ``fp32(m * mult)`` (``_e4m3_code``'s normal branch, unbounded) a block of scale 2^k has codes
    ``min(C_m + 8 * (k + j), 0x7E)`` once its smallest value 0.5 * 2^k * mult is E4M3-normal (>= 2^-6),
    else ``_key_code`` per code; negative codes are the positive ones with bit 7 set.
    With ``words`` (``sd64``/``dd64`` are the bytes of ``sd``/``dd`` as uint64) block magnitudes come from 16
    codes per word (``_fp4_block_magnitude``), and the power-of-two rules write blocks whose values stay normal
    in E4M3 (2^(b - 127 - e) >= 2^-5, exact: no error) by ``_fp4_word_codes``; a key whose codes are not 8-byte
    aligned on both sides (records of 68 bytes) is read from and written through aligned local copies.
    """
    half, blocks = dim // 2, dim // 32
    lut = np.empty(16, np.uint8)
    key64 = np.empty(2 * blocks, np.uint64)  # an unaligned key's codes, and its fp8 codes
    out64 = np.empty(4 * blocks, np.uint64)
    key8, out8 = key64.view(np.uint8), out64.view(np.uint8)
    for chunk in range(c0, c1):
        worst = np.float32(0.0)
        for r in range(segs[chunk, 4]):
            so, o = segs[chunk, 0] + r * sds, segs[chunk, 1] + r * sss
            do, dso = segs[chunk, 2] + r * dds, segs[chunk, 3] + r * dss
            sc = ss[o : o + blocks]
            local = words and (so % 8 != 0 or do % 8 != 0)
            if local:
                src, dst, src64, dst64 = key8, out8, key64, out64
                src[:] = sd[so : so + half]
            else:
                src, dst = sd[so : so + half], dd[do : do + dim]
                src64, dst64 = sd64[so // 8 : so // 8 + 2 * blocks], dd64[do // 8 : do // 8 + 4 * blocks]
            amax = np.float32(0.0)
            e = 0
            for j in range(blocks):
                s = ue8m0[sc[j]]
                if words:
                    m = _fp4_block_magnitude(src64[2 * j], src64[2 * j + 1])
                else:
                    m = np.uint8(0)
                    for i in range(16):
                        c = src[16 * j + i]
                        m = max(m, np.uint8(c & np.uint8(7)), np.uint8((c >> np.uint8(4)) & np.uint8(7)))
                v = e2m1[m] * s
                if not np.isfinite(v):  # scale byte 0xFF (NaN) or 6 * 2^127 (Inf): the caller's torch path refuses it
                    bad[chunk] = 1
                amax = max(amax, v)
            if rule <= 1:  # vllm, vllm-ue8m0: 2^ceil(log2(max(amax, 1e-4) / 448))
                q = np.uint32(np.float32(max(amax, floor) * np.float32(1.0 / 448.0)).view(np.uint32)) & 0x7FFFFFFF
                e = np.int64(q >> 23) - 127 + ((q & 0x7FFFFF) != 0)
                scale = ue8m0[e + 127]
                mult = ue8m0[127 - e]
            elif rule == 2:  # sglang, deepgemm, sglang-rocm: max(amax, floor) / 448
                scale = np.float32(max(amax, floor) / np.float32(448.0))
                mult = np.float32(np.float32(1.0) / scale)
            else:  # trtllm: amax / 448, multiplier 448 / amax (0 for an all-zero key)
                scale = np.float32(amax / np.float32(448.0))
                mult = np.float32(np.float32(448.0) / amax) if amax > 0 else np.float32(0.0)
                if not np.isfinite(mult):  # amax < 448 / fp32 max: the torch path's product overflows
                    bad[chunk] = 1
            tabled = rule <= 1 and _KEY_E_MIN <= e <= _KEY_E_MAX
            shifted = rule >= 2 and np.isfinite(mult) and mult >= np.float32(2.0**-126)
            c1 = c15 = m1 = 0
            if shifted:  # C_1, C_1.5 (see the docstring)
                c1 = _key_code_unbounded(mult)
                c15 = _key_code_unbounded(np.float32(np.float32(1.5) * mult))
                m1 = np.int64(np.float32(mult).view(np.uint32))
            for j in range(blocks):
                s = ue8m0[sc[j]]
                if words and tabled and np.int64(sc[j]) - 127 - e >= -5:
                    base = np.uint64(8 * (np.int64(sc[j]) - 127 - e + 6)) * _BYTE_01
                    for h in range(2):
                        x = src64[2 * j + h]
                        dst64[4 * j + 2 * h] = _fp4_word_codes(x & np.uint64(0xFFFFFFFF), base)
                        dst64[4 * j + 2 * h + 1] = _fp4_word_codes(x >> np.uint64(32), base)
                    continue
                if tabled:
                    lut[:] = pow2_codes[sc[j], e - _KEY_E_MIN]
                elif shifted and m1 + ((np.int64(sc[j]) - 128) << 23) >= 0x3C800000:  # 0.5 * 2^k * mult >= 2^-6
                    b8 = 8 * (np.int64(sc[j]) - 127)
                    lut[0], lut[8] = 0, 0x80
                    for c, code in ((1, c1 - 8), (2, c1), (3, c15), (4, c1 + 8), (5, c15 + 8), (6, c1 + 16),
                                    (7, c15 + 16)):
                        v = min(code + b8, 0x7E)
                        lut[c] = v
                        lut[c + 8] = v | 0x80
                else:
                    for c in range(16):
                        lut[c] = _key_code(np.float32(e2m1[c] * s), mult)
                if not measure:
                    for i in range(16):
                        c = src[16 * j + i]
                        dst[32 * j + 2 * i] = lut[c & 15]
                        dst[32 * j + 2 * i + 1] = lut[c >> 4]
                    continue
                present = 0
                for i in range(16):
                    c = src[16 * j + i]
                    dst[32 * j + 2 * i] = lut[c & 15]
                    dst[32 * j + 2 * i + 1] = lut[c >> 4]
                    present |= (1 << (c & 15)) | (1 << (c >> 4))
                present |= present >> 8  # a negative code's error is its magnitude's (both codes are symmetric)
                for c in range(1, 8):  # codes 0 and 8 (+-0) are exact
                    if present & (1 << c):
                        worst = max(worst, abs(np.float32(e4m3[lut[c]] * scale) - np.float32(e2m1[c] * s)))
            if local:
                dd[do : do + dim] = dst
            out_scale = ds[dso : dso + 4]
            if rule == 1:
                for i in range(4):
                    out_scale[i] = e + 127
            else:
                sb = np.uint32(np.float32(scale).view(np.uint32))
                for i in range(4):
                    out_scale[i] = (sb >> (8 * i)) & 0xFF
        err[chunk] = worst


#: Destination fp8 writer rules of ``fp4_to_fp8_keys``: kernel rule id and amax floor.
_KEY_RULES = {"vllm": (0, 1e-4), "vllm-ue8m0": (1, 1e-4), "sglang": (2, 1e-4), "deepgemm": (2, 1e-4),
              "sglang-rocm": (2, 1e-8), "trtllm": (3, 0.0)}


def fp4_to_fp8_keys(records: torch.Tensor, dim: int, rule: str, *, measure: bool = True,
                    out: torch.Tensor | None = None) -> tuple[torch.Tensor, float] | None:
    """fp4 indexer records ``[N, dim / 2 + dim / 32]`` -> fp8 records ``[N, dim + 4]`` (into ``out`` when given)
    written by ``rule`` (128-value keys for ``vllm-ue8m0``), and the max |decoded fp8 - decoded fp4| (0.0 unless
    ``measure``); byte-identical to ``indexer.transcode_keys``. None when a value decodes to NaN/Inf."""
    n, half, rb = records.shape[0], dim // 2, records.shape[1]
    out = torch.empty(n, dim + 4, dtype=torch.uint8) if out is None else out
    src, dst = _flat(records), _flat(out)
    err = fp4_to_fp8_key_rows(src, rb, src[half:], rb, n, dst, dim + 4, dst[dim:], dim + 4, dim, rule, measure=measure)
    return None if err is None else (out, err)


@cache
def _key_code_table() -> np.ndarray:
    return _pow2_key_codes(_E2M1_F32, _UE8M0_F32)


def _words(a: np.ndarray) -> np.ndarray | None:
    """The 8-byte-aligned flat uint8 ``a`` as uint64 words (its whole words), None when it is not aligned."""
    return a[: a.shape[0] // 8 * 8].view(np.uint64) if a.ctypes.data % 8 == 0 else None


def fp4_to_fp8_key_segments(src_keys: np.ndarray, src_scales: np.ndarray, dst_keys: np.ndarray,
                            dst_scales: np.ndarray, segs: np.ndarray, strides: tuple[int, int, int, int], dim: int,
                            rule: str, *, measure: bool) -> float | None:
    """fp4 keys -> fp8 keys by ``rule`` between strided rows of flat uint8 arrays, segment by segment (``segs``
    int64 ``[S, 5]``: byte offsets of a segment's first key's codes, scales, fp8 codes and fp8 scale in the four
    arrays, then its key count; ``strides``: the four row strides within a segment). Returns the max
    |decoded fp8 - decoded fp4| (0.0 unless ``measure``), None when a value decodes to NaN/Inf."""
    nseg = segs.shape[0]
    err = np.zeros(max(nseg, 1), np.float32)
    bad = np.zeros(max(nseg, 1), np.int64)
    rule_id, floor = _KEY_RULES[rule]
    sd64, dd64 = _words(src_keys), _words(dst_keys)
    words = sd64 is not None and dd64 is not None and dim % 16 == 0
    none = np.zeros(0, np.uint64)
    segs = np.ascontiguousarray(segs, dtype=np.int64)
    compiled = accel._KEYS
    if nseg and compiled is not None and dim % 32 == 0 and 0 < dim <= 2048:
        _run_chunks(compiled.fp4_to_fp8_keys, nseg, src_keys, src_scales, dst_keys, dst_scales, segs, *strides, dim,
                    rule_id, floor, _E2M1_F32, _UE8M0_F32, _E4M3_F32, _key_code_table(), words, measure, err, bad)
    elif nseg:
        _run_chunks(_fp4_to_fp8_keys_kernel, nseg, src_keys, src_scales, dst_keys, dst_scales, segs, *strides, dim,
                    rule_id, np.float32(floor), _E2M1_F32, _UE8M0_F32, _E4M3_F32, _key_code_table(), words,
                    sd64 if words else none, dd64 if words else none, measure, err, bad)
    return None if bad.any() else float(err.max())


def fp4_to_fp8_key_rows(src_keys: np.ndarray, src_stride: int, src_scales: np.ndarray, src_scale_stride: int, n: int,
                        dst_keys: np.ndarray, dst_stride: int, dst_scales: np.ndarray, dst_scale_stride: int,
                        dim: int, rule: str, *, measure: bool) -> float | None:
    """``n`` fp4 keys -> fp8 keys by ``rule``, between strided rows of flat uint8 arrays (key ``k``'s codes at
    ``keys[k * stride]``, its scale bytes at ``scales[k * scale_stride]``: records or a page's two parts);
    returns the max |decoded fp8 - decoded fp4| (0.0 unless ``measure``), None when a value decodes to NaN/Inf."""
    first = np.arange(0, n, KEY_CHUNK, dtype=np.int64)
    segs = np.stack([first * src_stride, first * src_scale_stride, first * dst_stride, first * dst_scale_stride,
                     np.minimum(n - first, KEY_CHUNK)], axis=1)
    return fp4_to_fp8_key_segments(src_keys, src_scales, dst_keys, dst_scales, segs,
                                   (src_stride, src_scale_stride, dst_stride, dst_scale_stride), dim, rule,
                                   measure=measure)
