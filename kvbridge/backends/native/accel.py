"""Native accelerators: specialised kernels registered for a pair of *records*, and the C loader.

``ACCELERATORS`` holds them (they serve every geometry of those records; ``LATENTS`` on one side
makes an encoder or a decoder), byte-checked against the generic kernel (``native.records``) by the
tests. The MODEL1 encoder and decoder have the record's constants compiled in, read and write pages
in place, and convert E4M3 in branch-free 32-bit vector arithmetic (``_e4m3_value``, ``_e4m3_byte``)
instead of table lookups. Per-tensor E4M3 (TensorRT-LLM FP8) -> MODEL1 runs in the code domain: with
a per-tensor source every decoded value is ``fp32(e4m3(c) * s)``, a function of the byte ``c`` alone
and monotone in ``c & 0x7F``, so a tile's amax is the value of its largest code magnitude ``m`` and
each output byte is a function of ``(m, c)``: a 128 x 256 table, or at s = 1 an exact exponent shift
(built once per scale and dialect with ``kvbridge.numerics``, exactly as the reference computes it);
per-tensor E4M3 -> V4.1 MXFP8 the same way with 32-value tiles; MODEL1 -> per-tensor E4M3 likewise
through tables of (scale byte, code).

The four MODEL1 accelerators (trtllm-fp8 <-> MODEL1, MODEL1 encode and decode) and the code-domain
amax of MODEL1 and per-tensor E4M3 pools run compiled C kernels instead (``_CK``:
``kvbridge.backends.native._kernels``, an optional extension built at install time, byte-identical,
AVX-512 VBMI table lookups and non-temporal stores) where it is built and the CPU has AVX-512 VBMI,
unless ``KVBRIDGE_NO_CKERNELS=1`` (``kernel_implementation()`` says which runs). The same extension's span
copies (``_SPANS``) run on any CPU where it is built and not switched off, its fp4 -> fp8 indexer keys (``_KEYS``,
``native.keys``: AVX2 table lookups) where the CPU has AVX2.
"""

from __future__ import annotations

import os
import warnings
from functools import lru_cache
from types import ModuleType

import numpy as np
import torch
from numba import njit

from kvbridge import numerics as nx
from kvbridge.backends.native.pool import CHUNK_TOKENS, _page_chunks, _run_chunks
from kvbridge.backends.native.records import (
    _POW2_F32,
    _UE8M0_F32,
    HEAD_DIM,
    _encode_params,
    _gather,
    _locate,
    _scatter,
    _tile_max_magnitude,
    _zero,
)
from kvbridge.layouts import Layout, get_layout
from kvbridge.layouts.codec import ue8m0_dialect

#: MODEL1 record: bytes [0, 576) nope E4M3 + rope bf16, [576, 584) 7 UE8M0 scales + pad (the accelerators').
MODEL1_DATA_BYTES = 576
#: Per-tensor E4M3 record (TensorRT-LLM FP8): 512 bytes, no footer.
_FP8_RECORD_BYTES = 512

@njit(cache=True, inline="always")
def _tile_shift(rec_in, rec_out, base: int, j: int, sub, width: int = 64) -> None:
    """The ``width`` E4M3 codes at ``rec_in[base:]`` times 2^j (exact, no overflow) into ``rec_out[base:]``:
    normal codes add 8j to the code, subnormal magnitudes 1..7 take ``sub[8j + m]``; written as
    selects so that LLVM vectorizes it."""
    shift = np.uint8(8 * j)
    s1, s2, s3, s4 = sub[8 * j + 1], sub[8 * j + 2], sub[8 * j + 3], sub[8 * j + 4]
    s5, s6, s7 = sub[8 * j + 5], sub[8 * j + 6], sub[8 * j + 7]
    for i in range(width):
        c = rec_in[base + i]
        a = c & np.uint8(0x7F)
        low = np.uint8(0)
        low = s1 if a == 1 else low
        low = s2 if a == 2 else low
        low = s3 if a == 3 else low
        low = s4 if a == 4 else low
        low = s5 if a == 5 else low
        low = s6 if a == 6 else low
        low = s7 if a == 7 else low
        high = np.uint8(a + shift)
        rec_out[base + i] = (high if a >= 8 else low) | (c & np.uint8(0x80))


@njit(cache=True, nogil=True)
def _fp8_to_model1_kernel(
    c0, c1, src, sp, spb, ssplit, srb, n, dst, dp, dpb, dsplit, drb, unit_scale,
    scale_lut, bad_mag, shift_sub, rope_sub, code_lut, rope_lut, bad_count, bad_first,
):
    """Per-tensor E4M3 records -> MODEL1 records in the code domain (see the module docstring).

    A tile whose largest code magnitude is ``m`` gets UE8M0 byte ``scale_lut[m]``; ``bad_mag[m]``
    is 1 when a code of magnitude ``m`` decodes to NaN/Inf. At ``unit_scale`` (s = 1, every
    decoded value an E4M3 value) value bytes are the codes shifted by 2^(127 - scale byte)
    (``_tile_shift`` with ``shift_sub``) and rope bf16 bits are ``(a << 4) + 0x3C00`` for normal
    magnitudes ``a``, ``rope_sub[a]`` for subnormal ones. Otherwise ``code_lut[m * 256 + c]`` is
    the value byte and ``rope_lut[c]`` the bf16 bits of code ``c``.
    """
    npages = dst.shape[0] // dpb
    per = max(1, CHUNK_TOKENS // dp)
    r1, r2, r3, r4 = rope_sub[1], rope_sub[2], rope_sub[3], rope_sub[4]
    r5, r6, r7 = rope_sub[5], rope_sub[6], rope_sub[7]
    for chunk in range(c0, c1):
        rec_in = np.empty(srb, np.uint8)
        rec_out16 = np.empty(drb // 2, np.uint16)  # the record, writable as bf16 words at even offsets
        rec_out = rec_out16.view(np.uint8)
        rope_bits = rec_out16[224:288]  # record bytes [448, 576)
        count = 0
        first = -1
        for p in range(chunk * per, min(npages, (chunk + 1) * per)):
            s_page = (p * dp) // sp  # source page and row of the page's first token, then stepped
            s_row = p * dp - s_page * sp
            for r in range(dp):
                t = p * dp + r
                d_at = p * dpb + r * dsplit
                f_at = p * dpb + dp * dsplit + r * (drb - dsplit)
                if t >= n:
                    _zero(dst, d_at, d_at + dsplit)
                    _zero(dst, f_at, f_at + drb - dsplit)
                    continue
                s_at = s_page * spb + s_row * ssplit
                sf_at = s_page * spb + sp * ssplit + s_row * (srb - ssplit)
                s_row += 1
                if s_row == sp:
                    s_row = 0
                    s_page += 1
                # Whole-record copies in and out; the work in between indexes the local buffers
                # with loop-derived (provably non-negative) indices, which LLVM vectorizes.
                _gather(src, s_at, sf_at, ssplit, srb, rec_in)
                for j in range(8):  # 7 nope tiles, then the rope (scanned for NaN/Inf the same way)
                    m = _tile_max_magnitude(rec_in, 64 * j)
                    if bad_mag[m]:
                        for i in range(64):
                            if bad_mag[rec_in[64 * j + i] & 0x7F]:
                                if count == 0 or t * HEAD_DIM + 64 * j + i < first:
                                    first = t * HEAD_DIM + 64 * j + i
                                count += 1
                    if j == 7:
                        break
                    if unit_scale:
                        _tile_shift(rec_in, rec_out, 64 * j, 127 - scale_lut[m], shift_sub)
                    else:
                        for i in range(64):
                            rec_out[64 * j + i] = code_lut[np.int64(m) * 256 + rec_in[64 * j + i]]
                    rec_out[MODEL1_DATA_BYTES + j] = scale_lut[m]
                if unit_scale:
                    for i in range(64):
                        code = rec_in[448 + i]
                        a = np.uint16(code & 0x7F)
                        low = np.uint16(0)
                        low = r1 if a == 1 else low
                        low = r2 if a == 2 else low
                        low = r3 if a == 3 else low
                        low = r4 if a == 4 else low
                        low = r5 if a == 5 else low
                        low = r6 if a == 6 else low
                        low = r7 if a == 7 else low
                        high = np.uint16((a << 4) + 0x3C00)
                        rope_bits[i] = (high if a >= 8 else low) | (np.uint16(code & 0x80) << 8)
                else:
                    for i in range(64):
                        rope_bits[i] = rope_lut[rec_in[448 + i]]
                rec_out[583] = 0
                _scatter(rec_out, dst, d_at, f_at, dsplit, drb)
            _zero(dst, p * dpb + dp * drb, (p + 1) * dpb)
        bad_count[chunk] = count
        bad_first[chunk] = first


@njit(cache=True, nogil=True)
def _fp8_to_mxfp8_kernel(
    c0, c1, src, sp, spb, ssplit, srb, n, dst, dp, dpb, dsplit, drb, unit_scale,
    scale_lut, bad_mag, shift_sub, code_lut, bad_count, bad_first,
):
    """Per-tensor E4M3 records -> V4.1 MXFP8 records (16 E4M3 tiles of 32, their UE8M0 scales at
    record byte 512) in the code domain, with the tables of ``_fp8_to_model1_kernel`` (the two
    records share the scale rule; only the tile width differs, and the rope is a tile like the others)."""
    npages = dst.shape[0] // dpb
    per = max(1, CHUNK_TOKENS // dp)
    for chunk in range(c0, c1):
        rec_in = np.empty(srb, np.uint8)
        rec_out = np.empty(drb, np.uint8)
        count = 0
        first = -1
        for p in range(chunk * per, min(npages, (chunk + 1) * per)):
            for r in range(dp):
                t = p * dp + r
                d_at, f_at = _locate(t, dp, dpb, dsplit, drb)
                if t >= n:
                    _zero(dst, d_at, d_at + dsplit)
                    _zero(dst, f_at, f_at + drb - dsplit)
                    continue
                s_at, sf_at = _locate(t, sp, spb, ssplit, srb)
                _gather(src, s_at, sf_at, ssplit, srb, rec_in)
                for j in range(16):
                    m = _tile_max_magnitude(rec_in, 32 * j, 32)
                    if bad_mag[m]:
                        for i in range(32):
                            if bad_mag[rec_in[32 * j + i] & 0x7F]:
                                if count == 0 or t * HEAD_DIM + 32 * j + i < first:
                                    first = t * HEAD_DIM + 32 * j + i
                                count += 1
                    if unit_scale:
                        _tile_shift(rec_in, rec_out, 32 * j, 127 - scale_lut[m], shift_sub, 32)
                    else:
                        for i in range(32):
                            rec_out[32 * j + i] = code_lut[np.int64(m) * 256 + rec_in[32 * j + i]]
                    rec_out[HEAD_DIM + j] = scale_lut[m]
                _scatter(rec_out, dst, d_at, f_at, dsplit, drb)
            _zero(dst, p * dpb + dp * drb, (p + 1) * dpb)
        bad_count[chunk] = count
        bad_first[chunk] = first


@njit(cache=True, nogil=True)
def _model1_to_fp8_kernel(
    c0, c1, src, sp, spb, ssplit, srb, n, dst, dp, dpb, dsplit, drb,
    nope_lut, bad_mag, rope_lut, bad_count, bad_first,
):
    """MODEL1 records -> per-tensor E4M3 records in the code domain.

    A MODEL1 nope value is ``fp32(e4m3(c) * 2^(b - 127))``, a function of its code ``c`` and its
    tile's scale byte ``b`` alone, so its per-tensor byte is ``nope_lut[b * 256 + c]``;
    ``bad_mag[b * 128 + m]`` is 1 when magnitude ``m`` at scale byte ``b`` decodes to NaN/Inf
    (checked on the tile's largest magnitude, then per value). A rope value is its bf16 bits
    ``h``, so its byte is ``rope_lut[h]``; NaN/Inf when the exponent bits are all set.
    """
    npages = dst.shape[0] // dpb
    per = max(1, CHUNK_TOKENS // dp)
    for chunk in range(c0, c1):
        rec_in = np.empty(srb, np.uint8)
        rec_out = np.empty(drb, np.uint8)
        count = 0
        first = -1
        for p in range(chunk * per, min(npages, (chunk + 1) * per)):
            s_page = (p * dp) // sp  # source page and row of the page's first token, then stepped
            s_row = p * dp - s_page * sp
            for r in range(dp):
                t = p * dp + r
                d_at = p * dpb + r * dsplit
                f_at = p * dpb + dp * dsplit + r * (drb - dsplit)
                if t >= n:
                    _zero(dst, d_at, d_at + dsplit)
                    _zero(dst, f_at, f_at + drb - dsplit)
                    continue
                s_at = s_page * spb + s_row * ssplit
                sf_at = s_page * spb + sp * ssplit + s_row * (srb - ssplit)
                s_row += 1
                if s_row == sp:
                    s_row = 0
                    s_page += 1
                if ssplit == MODEL1_DATA_BYTES:  # footer = scales + pad: read both parts in place
                    data = src[s_at : s_at + MODEL1_DATA_BYTES]
                    foot = src[sf_at : sf_at + srb - MODEL1_DATA_BYTES]
                else:
                    _gather(src, s_at, sf_at, ssplit, srb, rec_in)
                    data = rec_in[:MODEL1_DATA_BYTES]
                    foot = rec_in[MODEL1_DATA_BYTES:]
                out = dst[d_at : d_at + drb] if dsplit == drb else rec_out  # token-major: write in place
                for j in range(7):
                    tile = data[64 * j : 64 * j + 64]
                    b = np.int64(foot[j])
                    bad = bad_mag[b * 128 : b * 128 + 128]
                    if bad[_tile_max_magnitude(data, 64 * j)]:
                        for i in range(64):
                            if bad[tile[i] & 0x7F]:
                                if count == 0 or t * HEAD_DIM + 64 * j + i < first:
                                    first = t * HEAD_DIM + 64 * j + i
                                count += 1
                    lut = nope_lut[b * 256 : b * 256 + 256]
                    tile_out = out[64 * j : 64 * j + 64]
                    for i in range(64):
                        tile_out[i] = lut[tile[i]]
                rope = data[448:MODEL1_DATA_BYTES]
                rope_out = out[448:512]
                for i in range(64):
                    h = np.uint16(rope[2 * i]) | (np.uint16(rope[2 * i + 1]) << 8)
                    if (h & 0x7F80) == 0x7F80:
                        if count == 0 or t * HEAD_DIM + 448 + i < first:
                            first = t * HEAD_DIM + 448 + i
                        count += 1
                    rope_out[i] = rope_lut[h]
                if dsplit != drb:
                    _scatter(rec_out, dst, d_at, f_at, dsplit, drb)
            _zero(dst, p * dpb + dp * drb, (p + 1) * dpb)
        bad_count[chunk] = count
        bad_first[chunk] = first


@njit(cache=True, inline="always")
def _e4m3_value(c):
    """fp32 value of the E4M3 code ``c`` (uint32 0..255), bit-identical to ``_E4M3_F32`` (NaN codes: its
    quiet NaN), in branch-free arithmetic: normal magnitudes rebias their bits, subnormal ones are
    ``a * 2^-9``. Every integer step is cast back to uint32 (numba widens to 64 bits otherwise, and
    LLVM then runs 8 lanes per vector instead of 16)."""
    a = np.uint32(c & np.uint32(0x7F))
    normal = np.uint32(np.uint32(a << np.uint32(20)) + np.uint32(0x3C000000)).view(np.float32)
    v = normal if a >= np.uint32(8) else np.float32(np.int32(a)) * np.float32(2.0**-9)
    v = -v if np.uint32(c & np.uint32(0x80)) != np.uint32(0) else v
    return np.float32(np.nan) if a == np.uint32(0x7F) else v


@njit(cache=True, inline="always")
def _e4m3_byte(y) -> int:
    """E4M3 code of the fp32 ``y`` as ``_e4m3_tile`` computes it (RNE, saturating to +-448, NaN too),
    every integer step cast back to uint32 (see ``_e4m3_value``)."""
    u32 = np.uint32
    b = np.float32(y).view(u32)
    mag = u32(b & u32(0x7FFFFFFF))
    odd = u32(u32(mag >> u32(20)) & u32(1))
    normal = u32(u32(u32(u32(mag + u32(0x7FFFF)) + odd) >> u32(20)) - u32(960))
    sub = u32(np.float32(abs(y) + np.float32(16384.0)).view(u32) - u32(0x46800000))
    code = normal if mag >= u32(0x3C800000) else sub
    code = u32(0x7E) if mag >= u32(0x43E00000) else code
    return np.uint8(code | u32(u32(b >> u32(24)) & u32(0x80)))


@njit(cache=True, inline="always")
def _tile_exponent(amax_bits, min_exp: int) -> int:
    """UE8M0 exponent of a tile whose largest |value| has fp32 bits ``amax_bits`` (as ``_ue8m0_e4m3_tiles``)."""
    exp = np.int64(amax_bits >> np.uint32(23))
    if exp == 0:
        return min_exp
    return max(min_exp, exp - 135 + (1 if (amax_bits & np.uint32(0x7FFFFF)) > np.uint32(0x600000) else 0))


@njit(cache=True, nogil=True)
def _model1_encode_kernel(c0, c1, x32, x16, from_bf16, n, dst, dp, dpb, dsplit, drb, min_exp, pow2):
    """Latents (fp32 ``x32`` or bf16 bits ``x16``, flat) -> MODEL1 records, with the record's constants
    compiled in: 7 UE8M0-scaled E4M3 tiles of 64, bf16 rope, 7 scale bytes and a zero pad byte."""
    npages = dst.shape[0] // dpb
    per = max(1, CHUNK_TOKENS // dp)
    in_place = dsplit == MODEL1_DATA_BYTES or dsplit == drb
    for chunk in range(c0, c1):
        rec = np.empty(drb, np.uint8)
        for p in range(chunk * per, min(npages, (chunk + 1) * per)):
            for r in range(dp):
                t = p * dp + r
                d_at = p * dpb + r * dsplit
                f_at = p * dpb + dp * dsplit + r * (drb - dsplit)
                if t >= n:
                    _zero(dst, d_at, d_at + dsplit)
                    _zero(dst, f_at, f_at + drb - dsplit)
                    continue
                if in_place:
                    data = dst[d_at : d_at + MODEL1_DATA_BYTES]
                    foot = dst[f_at : f_at + 8] if dsplit == MODEL1_DATA_BYTES else dst[d_at + 576 : d_at + 584]
                else:
                    data = rec[:MODEL1_DATA_BYTES]
                    foot = rec[MODEL1_DATA_BYTES:]
                lo = t * HEAD_DIM
                if from_bf16:
                    row16 = x16[lo : lo + HEAD_DIM]
                    for j in range(7):
                        tile = row16[64 * j : 64 * j + 64]
                        m16 = np.uint16(0)
                        for i in range(64):
                            m16 = max(m16, np.uint16(tile[i] & np.uint16(0x7FFF)))
                        e = _tile_exponent(np.uint32(m16) << np.uint32(16), min_exp)
                        mult = pow2[149 - e]
                        out = data[64 * j : 64 * j + 64]
                        for i in range(64):
                            out[i] = _e4m3_byte(np.uint32(np.uint32(tile[i]) << np.uint32(16)).view(np.float32) * mult)
                        foot[j] = e + 127
                    rope = row16[448:512]
                    rope_out = data[448:576]
                    for i in range(64):
                        h = rope[i]
                        h = h | np.uint16(0x40) if (h & np.uint16(0x7FFF)) > np.uint16(0x7F80) else h
                        rope_out[2 * i] = h & np.uint16(0xFF)
                        rope_out[2 * i + 1] = h >> np.uint16(8)
                else:
                    row = x32[lo : lo + HEAD_DIM]
                    row_bits = row.view(np.uint32)
                    for j in range(7):
                        tile = row[64 * j : 64 * j + 64]
                        tile_bits = row_bits[64 * j : 64 * j + 64]
                        m32 = np.uint32(0)
                        for i in range(64):
                            m32 = max(m32, np.uint32(tile_bits[i] & np.uint32(0x7FFFFFFF)))
                        e = _tile_exponent(m32, min_exp)
                        mult = pow2[149 - e]
                        out = data[64 * j : 64 * j + 64]
                        for i in range(64):
                            out[i] = _e4m3_byte(tile[i] * mult)
                        foot[j] = e + 127
                    rope_bits = row_bits[448:512]
                    rope_out = data[448:576]
                    for i in range(64):  # _bf16_bits in uint32 steps
                        u32 = np.uint32
                        b = rope_bits[i]
                        rounded = u32(u32(u32(b + u32(0x7FFF)) + u32(u32(b >> u32(16)) & u32(1))) >> u32(16))
                        quiet = u32(u32(b >> u32(16)) | u32(0x40))
                        h = quiet if u32(b & u32(0x7FFFFFFF)) > u32(0x7F800000) else rounded
                        rope_out[2 * i] = np.uint8(h & u32(0xFF))
                        rope_out[2 * i + 1] = np.uint8(u32(h >> u32(8)) & u32(0xFF))
                foot[7] = 0
                if not in_place:
                    _scatter(rec, dst, d_at, f_at, dsplit, drb)
            _zero(dst, p * dpb + dp * drb, (p + 1) * dpb)


@njit(cache=True, nogil=True)
def _model1_decode_kernel(c0, c1, src, sp, spb, ssplit, srb, n, out, ue8m0):
    """MODEL1 records -> fp32 latents ``out`` (flat, ``n * 512``), with the record's constants compiled
    in and each E4M3 value computed by ``_e4m3_value`` rather than looked up."""
    out_bits = out.view(np.uint32)
    in_place = ssplit == MODEL1_DATA_BYTES or ssplit == srb
    for chunk in range(c0, c1):
        rec = np.empty(srb, np.uint8)
        t0 = chunk * CHUNK_TOKENS
        s_page = t0 // sp  # source page and row of the chunk's first token, then stepped
        s_row = t0 - s_page * sp
        for t in range(t0, min(n, t0 + CHUNK_TOKENS)):
            s_at = s_page * spb + s_row * ssplit
            sf_at = s_page * spb + sp * ssplit + s_row * (srb - ssplit)
            s_row += 1
            if s_row == sp:
                s_row = 0
                s_page += 1
            if in_place:
                data = src[s_at : s_at + MODEL1_DATA_BYTES]
                foot = src[sf_at : sf_at + 8] if ssplit == MODEL1_DATA_BYTES else src[s_at + 576 : s_at + 584]
            else:
                _gather(src, s_at, sf_at, ssplit, srb, rec)
                data = rec[:MODEL1_DATA_BYTES]
                foot = rec[MODEL1_DATA_BYTES:]
            lo = t * HEAD_DIM
            for j in range(7):
                s = ue8m0[foot[j]]
                tile = data[64 * j : 64 * j + 64]
                vals = out[lo + 64 * j : lo + 64 * j + 64]
                for i in range(64):
                    vals[i] = _e4m3_value(np.uint32(tile[i])) * s
            rope = data[448:MODEL1_DATA_BYTES]
            rope_bits = out_bits[lo + 448 : lo + HEAD_DIM]
            for i in range(64):
                rope_bits[i] = (np.uint32(rope[2 * i]) | (np.uint32(rope[2 * i + 1]) << np.uint32(8))) << np.uint32(16)


#: Largest 2^j a tile of E4M3 values is scaled by when s = 1 (the lowest dialect exponent floor).
_MAX_SHIFT = -min(nx.DIALECT_MIN_EXPONENT.values())


#: Table arguments of ``_fp8_to_model1_kernel``, in order.
_FP8_TO_MODEL1_TABLES = ("scale_lut", "bad_mag", "shift_sub", "rope_sub", "code_lut", "rope_lut")


@lru_cache(maxsize=64)
def _fp8_to_model1_tables(scale: float, dialect: str) -> dict[str, np.ndarray]:
    """Code-domain tables for per-tensor E4M3 at ``scale`` -> MODEL1 in ``dialect`` (arguments of
    ``_fp8_to_model1_kernel``), built with ``kvbridge.numerics`` exactly as the reference decodes
    and re-encodes."""
    values = nx.E4M3_TABLE * torch.tensor(scale, dtype=torch.float32)  # decoded value of each code
    mags = values[:128].abs()  # amax of a tile whose largest code magnitude is m
    finite_mags = torch.where(torch.isfinite(mags), mags, torch.zeros_like(mags))
    exp = nx.scale_exponent(finite_mags, dialect)
    scaled = values.unsqueeze(0) * nx.pow2(-exp).unsqueeze(1)  # [128, 256]
    shifts = torch.arange(_MAX_SHIFT + 1)
    subnormal = nx.E4M3_TABLE[:8].unsqueeze(0) * nx.pow2(shifts).unsqueeze(1)  # [36, 8]
    return {
        "scale_lut": nx.ue8m0_byte(exp).numpy().copy(),
        "bad_mag": (~torch.isfinite(mags)).to(torch.uint8).numpy().copy(),
        "shift_sub": nx.e4m3_encode(subnormal).reshape(-1).numpy().copy(),
        "rope_sub": nx.bf16_round(nx.E4M3_TABLE[:8]).numpy().astype(np.uint16),
        "code_lut": nx.e4m3_encode(torch.nan_to_num(scaled, nan=0.0)).reshape(-1).numpy().copy(),
        "rope_lut": nx.bf16_round(values).numpy().astype(np.uint16),
    }


@lru_cache(maxsize=64)
def _model1_to_fp8_tables(mult: float) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(nope_lut, bad_mag, rope_lut) of ``_model1_to_fp8_kernel`` for the per-tensor multiplier
    ``mult`` (fp32(1/s), or 1 for the ``compress`` dialect), built with ``kvbridge.numerics``
    exactly as the reference decodes MODEL1 and re-encodes per-tensor E4M3."""
    m = torch.tensor(mult, dtype=torch.float32)
    ue8m0 = torch.from_numpy(_UE8M0_F32)
    values = nx.E4M3_TABLE.unsqueeze(0) * ue8m0.unsqueeze(1)  # [scale byte, code]
    codes = nx.e4m3_encode(torch.nan_to_num(values * m, nan=0.0)).reshape(-1)
    bad_mag = (~torch.isfinite(values[:, :128])).to(torch.uint8).reshape(-1)
    rope = (torch.arange(65536, dtype=torch.int64) << 16).to(torch.int32).view(torch.float32)  # every bf16
    rope_codes = nx.e4m3_encode(torch.nan_to_num(rope * m, nan=0.0))
    return codes.numpy().copy(), bad_mag.numpy().copy(), rope_codes.numpy().copy()


#: Set to 1 to run the numba MODEL1 kernels even where the compiled ones (``_kernels``) are built.
NO_CKERNELS_ENV = "KVBRIDGE_NO_CKERNELS"


#: The interface ``kvbridge.backends.native._kernels`` must have been built with (its ``KV_INTERFACE``).
KERNELS_INTERFACE = 6


def _warn_line(message: str) -> None:
    """A ``RuntimeWarning`` that prints as one line (``kvbridge:0: RuntimeWarning: ...``): attributed to no
    source file, so the warnings module shows no source line under it."""
    warnings.warn_explicit(message, RuntimeWarning, "kvbridge", 0, module="kvbridge")


def _compiled_kernels() -> tuple[ModuleType | None, str]:
    """(``kvbridge.backends.native._kernels`` or None, why not): the optional C extension, when it is built from
    these sources and ``NO_CKERNELS_ENV`` is not set. Its span copies run on any CPU (``_SPANS``); its MODEL1
    accelerators only where the CPU has their vector ISA (AVX-512 F/BW/VL/DQ/VBMI, ``_CK``), else numba's run."""
    if os.environ.get(NO_CKERNELS_ENV, "").strip() not in ("", "0"):
        return None, f"{NO_CKERNELS_ENV} is set"
    try:
        from kvbridge.backends.native import _kernels  # optional: the C extension (not built without a compiler)
    except ImportError:
        _warn_line("the compiled kernels (backends/native/_kernels.c) are not built (no C compiler when kvbridge "
                   f"was installed?); running the slower numba kernels. {NO_CKERNELS_ENV}=1 silences this.")
        return None, "the C extension kvbridge.backends.native._kernels is not built"
    if getattr(_kernels, "INTERFACE", 1) != KERNELS_INTERFACE or _kernels.CHUNK_TOKENS != CHUNK_TOKENS:
        _warn_line("the compiled kernels (backends/native/_kernels.c) were built from other sources (rebuild them: "
                   "pip install -e . or python setup.py build_ext --inplace); running the slower numba kernels.")
        return None, "kvbridge.backends.native._kernels is a stale build"
    return _kernels, ""


#: The C extension for span copies (``native.move_spans``: memcpy, non-temporal stores on AVX-512), or None.
_SPANS, _SPANS_WHY_NOT = _compiled_kernels()
#: The C extension for the fp4 -> fp8 indexer keys (``native.keys``), byte-identical to the numba kernel: where the
#: CPU has AVX2 (its vpshufb code, about 4x numba's speed); else None and numba's kernel runs (the C kernel's portable
#: code is about 1.1x slower than numba's word arithmetic: docs/performance.md; the tests run it on every CPU).
_KEYS, _KEYS_WHY_NOT = ((None, "the CPU lacks AVX2") if _SPANS is not None and _SPANS.key_cpu_isa() == "scalar"
                        else (_SPANS, _SPANS_WHY_NOT))
#: The C extension for the MODEL1 accelerators and amax, or None (then numba's kernels run).
_CK, _CK_WHY_NOT = ((None, "the CPU lacks AVX-512 VBMI") if _SPANS is not None and _SPANS.cpu_isa() == "scalar"
                    else (_SPANS, _SPANS_WHY_NOT))
#: Records whose code-domain amax (``amax_pages``) has a compiled kernel.
_MODEL1_SEGMENTS = get_layout("flashmla-model1").segments
_FP8_SEGMENTS = get_layout("trtllm-fp8").segments


def kernel_implementation() -> str:
    """Which code runs the MODEL1 accelerators (trtllm-fp8 <-> MODEL1, MODEL1 encode and decode):
    ``"C (avx512vbmi)"``, or ``"numba (<why not C>)"``."""
    return f"C ({_CK.isa()})" if _CK is not None else f"numba ({_CK_WHY_NOT})"


def _fp8_to_model1_c_tables(src_scale: float, dialect: str | None) -> tuple[np.ndarray, ...]:
    """The table arguments of the C kernels ``fp8_to_model1`` and ``fp8_to_model1_segments``, in order."""
    tables = _fp8_to_model1_tables(float(src_scale), ue8m0_dialect(dialect))
    return tuple(tables[name] for name in ("scale_lut", "bad_mag", "code_lut", "rope_lut"))


def _model1_to_fp8_params(dst_scale: float, dialect: str | None) -> tuple[tuple[np.ndarray, ...], float]:
    """The tables of ``_model1_to_fp8_kernel`` (and its C twins) and the per-tensor multiplier they were built for
    (the C kernels also take it: their vector code computes the rope's codes)."""
    mult, _, _ = _encode_params(dialect, dst_scale)
    return _model1_to_fp8_tables(float(mult)), float(mult)


def _fp8_to_model1(pages, src_scale, dst_scale, dialect, geometry, bad_count, bad_first) -> None:
    if _CK is not None:
        _run_chunks(_CK.fp8_to_model1, len(bad_count), *geometry, *_fp8_to_model1_c_tables(src_scale, dialect),
                    bad_count, bad_first)
        return
    tables = _fp8_to_model1_tables(float(src_scale), ue8m0_dialect(dialect))
    _run_chunks(_fp8_to_model1_kernel, len(bad_count), *geometry, src_scale == 1.0,
                *(tables[name] for name in _FP8_TO_MODEL1_TABLES), bad_count, bad_first)


def _fp8_to_mxfp8(pages, src_scale, dst_scale, dialect, geometry, bad_count, bad_first) -> None:
    tables = _fp8_to_model1_tables(float(src_scale), ue8m0_dialect(dialect))
    _run_chunks(_fp8_to_mxfp8_kernel, len(bad_count), *geometry, src_scale == 1.0,
                *(tables[name] for name in ("scale_lut", "bad_mag", "shift_sub", "code_lut")), bad_count, bad_first)


def _model1_to_fp8(pages, src_scale, dst_scale, dialect, geometry, bad_count, bad_first) -> None:
    tables, mult = _model1_to_fp8_params(dst_scale, dialect)
    if _CK is not None:
        _run_chunks(_CK.model1_to_fp8, len(bad_count), *geometry, *tables, bad_count, bad_first, mult)
        return
    _run_chunks(_model1_to_fp8_kernel, len(bad_count), *geometry, *tables, bad_count, bad_first)


def _model1_encode(x32, x16, from_bf16, n, dialect, scale, geometry) -> None:
    _, _, min_exp = _encode_params(dialect, scale)
    dp, dpb = geometry[1], geometry[2]
    kernel = _model1_encode_kernel if _CK is None else _CK.model1_encode
    _run_chunks(kernel, _page_chunks(geometry[0].shape[0] // dpb, dp), x32, x16, from_bf16, n, *geometry, min_exp,
                _POW2_F32)


def _model1_decode(n, scale, geometry, out) -> None:
    kernel = _model1_decode_kernel if _CK is None else _CK.model1_decode
    _run_chunks(kernel, -(-n // CHUNK_TOKENS), *geometry, n, out, _UE8M0_F32)


#: Stands for fp32/bf16 latents on one side of an ``ACCELERATORS`` key (encode: (LATENTS, record),
#: decode: (record, LATENTS)).
LATENTS = "latents"

#: Specialised kernels per (source, destination) pair of ``Layout.segments`` (or ``LATENTS``):
#: transcodes ``f(pages, src_scale, dst_scale, dialect, geometry, bad_count, bad_first)``, encoders
#: ``f(x32, x16, from_bf16, n, dialect, scale, geometry)``, decoders ``f(n, scale, geometry, out)``.
ACCELERATORS = {
    (get_layout("trtllm-fp8").segments, get_layout("flashmla-model1").segments): _fp8_to_model1,
    (get_layout("flashmla-model1").segments, get_layout("trtllm-fp8").segments): _model1_to_fp8,
    (get_layout("trtllm-fp8").segments, get_layout("v41-fp8").segments): _fp8_to_mxfp8,
    (LATENTS, get_layout("flashmla-model1").segments): _model1_encode,
    (get_layout("flashmla-model1").segments, LATENTS): _model1_decode,
}


def segment_split(src: Layout, dst: Layout) -> tuple[int, int] | None:
    """Where the C kernels convert ``src`` KV records to ``dst`` between record rows of any tensors (per-tensor
    E4M3 <-> MODEL1 with ``_CK`` loaded: ``_kernels.fp8_to_model1_segments`` / ``model1_to_fp8_segments``), the
    bytes of a source and of a destination record in their data stream (the rest is the footer stream: MODEL1's
    scale bytes [576, 584); none for per-tensor E4M3); None elsewhere."""
    fast = accelerator(src, dst) if _CK is not None else None
    if fast is _fp8_to_model1:
        return _FP8_RECORD_BYTES, MODEL1_DATA_BYTES
    if fast is _model1_to_fp8:
        return MODEL1_DATA_BYTES, _FP8_RECORD_BYTES
    return None


def transcode_segments(src: Layout, dst: Layout, flats: tuple[np.ndarray, ...], segs: np.ndarray,
                       strides: tuple[int, ...], src_scale: float, dst_scale: float, dialect: str | None,
                       streaming: bool, inline: bool, bad_count: np.ndarray, bad_first: np.ndarray) -> None:
    """``_kernels``' segment transcode for ``segment_split``'s pairs: ``flats`` the four flat uint8 arrays (source
    data, source footer, destination data, destination footer), ``segs`` int64 ``[S, 6]`` (the four streams' byte
    offsets of a segment's first row, its rows, its first record's index), ``strides`` the four row strides;
    ``bad_count`` / ``bad_first`` per segment, as the page kernels'. ``inline``: on the calling thread."""
    if accelerator(src, dst) is _fp8_to_model1:
        kernel, args, extra = _CK.fp8_to_model1_segments, _fp8_to_model1_c_tables(src_scale, dialect), ()
    else:
        args, mult = _model1_to_fp8_params(dst_scale, dialect)
        kernel, extra = _CK.model1_to_fp8_segments, (mult,)
    call = (*flats, segs, *strides, streaming, *args, bad_count, bad_first, *extra)
    if inline:
        kernel(0, segs.shape[0], *call)
    else:
        _run_chunks(kernel, segs.shape[0], *call)


def accelerator(src: Layout | str, dst: Layout | str):
    """The specialised kernel registered for ``src``'s and ``dst``'s records (either may be ``LATENTS``), or None."""
    key = (src if src == LATENTS else src.segments, dst if dst == LATENTS else dst.segments)
    return ACCELERATORS.get(key)

