"""The native record-program interpreter: numba kernels that execute each layout's record description.

The kernels take no list of layouts:

- the record program: ``Layout.segments`` (encoders) or ``Layout.read_segments`` (decoders) as an int64
  array ``[fields, 6]`` (op, first dim, dims, byte offset, tile, scale offset), a runtime argument,
  so one compiled (and disk-cached) kernel serves every layout made of the known element formats and scale rules;
- the geometry: ``record_bytes``, the block-split point ``split`` (token-major layouts use
  ``split = record_bytes``) and the padded ``page_bytes``. Record byte ``i < split`` of the
  token at row ``r`` of page ``p`` sits at ``p * page_bytes + r * split + i``, byte ``i >= split``
  at ``p * page_bytes + P * split + r * (record_bytes - split) + (i - split)``.

Each token is gathered into a small per-thread record buffer, decoded into a 512-value fp32
buffer (2 KiB, L1-resident), re-encoded and scattered, so no fp32 copy of a pool is ever built.
Kernels: encode, decode, transcode, code-domain amax, repage (byte move), row moves and the
non-finite bit test; ``kernel(c0, c1, ...)`` runs work chunks ``[c0, c1)`` (``pool._run_chunks``).
Numba compiles them on first use and caches them on disk (``cache=True``).
"""

from __future__ import annotations

from functools import cache

import numpy as np
import torch
from numba import njit

from kvbridge import numerics as nx
from kvbridge.backends.native.pool import CHUNK_TOKENS, _flat
from kvbridge.errors import NonFiniteError
from kvbridge.layouts import Layout
from kvbridge.layouts.codec import tensor_multiplier, ue8m0_dialect
from kvbridge.layouts.registry import (
    OP_BF16,
    OP_E2M1_E4M3,
    OP_E2M1_NVFP4,
    OP_E2M1_NVFP4Z,
    OP_E2M1_UE8M0,
    OP_E4M3_TENSOR,
    OP_E4M3_UE8M0,
    OP_E4M3FNUZ_UE8M0,
    OP_ROUND_BF16,
    OP_ZERO,
)

HEAD_DIM = 512

_E4M3_NAN = nx.E4M3_NAN
_FP4_SCALE_MIN_BITS = nx.FP4_SCALE_MIN_BITS
_NVFP4_RCP6_BITS = nx.NVFP4_RCP6_BITS
_MXFP4_ROUND_UP_SQUARE = nx.MXFP4_ROUND_UP_SQUARE
#: Scratch floats per thread: a scaled tile (up to 512 values), then E4M3 work space.
_TMP = 2 * HEAD_DIM

#: fp32 value of each E4M3 code (0x7F/0xFF NaN), from ``kvbridge.numerics``.
_E4M3_F32 = nx.E4M3_TABLE.numpy().copy()
#: fp32 value of each E4M3 FNUZ code (0x80 NaN), frozen into the kernels as a constant.
_E4M3FNUZ_F32 = nx.E4M3FNUZ_TABLE.numpy().copy()
_E4M3FNUZ_NAN = nx.E4M3FNUZ_NAN
#: The two FNUZ dialects' (exponent floor, writer max M as fp32 bits), frozen into the kernels. A FNUZ
#: tile's rule is told by the floor the kernels receive as ``min_exp`` (the floors differ).
(_FNUZ_A_FLOOR, _FNUZ_A_MAX), (_FNUZ_B_FLOOR, _FNUZ_B_MAX) = nx.FNUZ_DIALECT_RULES.values()
assert _FNUZ_A_FLOOR != _FNUZ_B_FLOOR and _FNUZ_A_MAX >> 23 == _FNUZ_B_MAX >> 23
#: fp32 2^(b - 127) of each UE8M0 byte b (0xFF is NaN), as the reference MODEL1 decoder builds it.
_UE8M0_F32 = torch.where(
    torch.arange(256) == 255, torch.tensor(float("nan")), nx.pow2(torch.arange(256) - 127)
).numpy().copy()
#: fp32 2^e for e in [-149, 127], index e + 149.
_POW2_F32 = nx.pow2(torch.arange(-149, 128)).numpy().copy()


#: fp32 value of each E2M1 code 0..15, from ``kvbridge.numerics``.
_E2M1_F32 = nx.E2M1_TABLE.numpy().copy()
#: E2M1 rounding thresholds (fp32 bits) from ``kvbridge.numerics``, frozen into the kernels as constants;
#: ties round up at the odd-numbered ones (0.75, 1.75, 3.5), ``_e2m1_code`` compares those with >=.
_E2M1_T0, _E2M1_T1, _E2M1_T2, _E2M1_T3, _E2M1_T4, _E2M1_T5, _E2M1_T6 = (t for t, _ in nx.E2M1_THRESHOLDS)


@cache
def program(layout: Layout, read: bool = False) -> np.ndarray:
    """The record program of ``layout``: ``Layout.segments`` (``read``: ``Layout.read_segments``, what decoders
    execute) as int64 ``[fields, 6]``, with neighbouring unscaled fields of one op that continue each other in
    dims and bytes merged into one (fewer, longer loops)."""
    rows: list[list[int]] = []
    for seg in layout.read_segments if read else layout.segments:
        prev = rows[-1] if rows else None
        width = 2 if seg.op == OP_BF16 else 1
        if prev is not None and seg.op in (OP_BF16, OP_E4M3_TENSOR) and prev[0] == seg.op and \
                prev[1] + prev[2] == seg.dim0 and prev[3] + width * prev[2] == seg.offset:
            prev[2] += seg.ndims
        else:
            rows.append(list(seg))
    return np.array(rows, np.int64).reshape(-1, 6)


def _geometry(layout: Layout, page_size: int) -> tuple[int, int, int, int]:
    """(tokens per page, page bytes, split point, record bytes) as the kernels take them."""
    split = layout.record_bytes if layout.split is None else layout.split
    return page_size, layout.page_bytes(page_size), split, layout.record_bytes


# ---------------------------------------------------------------------------------------------
# Scalar helpers (inlined into the kernels by LLVM)
# ---------------------------------------------------------------------------------------------


@njit(cache=True, inline="always")
def _e4m3_tile(values, value_bits, work, work_bits, out) -> None:
    """E4M3 codes of 64 fp32 ``values`` (``value_bits``: their bit patterns): RNE, saturating to
    +-448, NaN saturating too (as ``numerics.e4m3_encode``). Branch-free so that LLVM vectorizes:

    - |x| >= 448: 0x7E;
    - normal E4M3 (|x| >= 2^-6): drop 20 fp32 mantissa bits with ties to even, rebias the exponent;
    - subnormal E4M3: fp32 addition ``|x| + 2^14`` rounds |x| to a multiple of 2^-9 (the fp32 ulp
      at 2^14) with ties to even, so the sum's low mantissa bits are the code (0..8).
    ``work``/``work_bits`` is scratch of the same length.
    """
    for i in range(values.shape[0]):
        work[i] = abs(values[i]) + np.float32(16384.0)
    for i in range(values.shape[0]):
        b = np.int64(value_bits[i])
        mag = b & 0x7FFFFFFF
        normal = ((mag + 0x7FFFF + ((mag >> 20) & 1)) >> 20) - 960
        subnormal = np.int64(work_bits[i]) - 0x46800000
        code = normal if mag >= 0x3C800000 else subnormal
        code = 0x7E if mag >= 0x43E00000 else code
        out[i] = code | ((b >> 24) & 0x80)


@njit(cache=True, inline="always")
def _bf16_bits(b: int) -> int:
    """bf16 bit pattern of the fp32 with bit pattern ``b``: RNE, NaN kept quiet."""
    if (b & 0x7FFFFFFF) > 0x7F800000:
        return ((b >> 16) | 0x40) & 0xFFFF
    return ((b + 0x7FFF + ((b >> 16) & 1)) >> 16) & 0xFFFF


@njit(cache=True, inline="always")
def _locate(token: int, tokens_per_page: int, page_bytes: int, split: int, record_bytes: int) -> tuple[int, int]:
    """Flat byte offsets of a token's data part (record bytes < split) and footer part."""
    page = token // tokens_per_page
    row = token - page * tokens_per_page
    base = page * page_bytes
    return base + row * split, base + tokens_per_page * split + row * (record_bytes - split)


@njit(cache=True, inline="always")
def _copy(src, dst) -> None:
    """Element copy between equal-length views (view indices are provably non-negative, so LLVM vectorizes)."""
    for i in range(src.shape[0]):
        dst[i] = src[i]


@njit(cache=True, inline="always")
def _gather(pool, data_at: int, foot_at: int, split: int, record_bytes: int, rec) -> None:
    _copy(pool[data_at : data_at + split], rec[:split])
    _copy(pool[foot_at : foot_at + record_bytes - split], rec[split:])


@njit(cache=True, inline="always")
def _scatter(rec, pool, data_at: int, foot_at: int, split: int, record_bytes: int) -> None:
    _copy(rec[:split], pool[data_at : data_at + split])
    _copy(rec[split:], pool[foot_at : foot_at + record_bytes - split])


@njit(cache=True, inline="always")
def _amax_bits(bits) -> int:
    """The largest magnitude's bit pattern among fp32 bit patterns ``bits`` (finite non-negative floats order
    like their bit patterns; 0x7F800000 and above: the tile holds Inf or NaN)."""
    amax = 0
    for i in range(bits.shape[0]):
        amax = max(amax, np.int64(bits[i]) & 0x7FFFFFFF)
    return amax


@njit(cache=True, inline="always")
def _pack_e2m1(bits, out) -> None:
    """E2M1 codes of fp32 bit patterns ``bits`` (two per byte, even element in the low nibble) into ``out``."""
    for i in range(out.shape[0]):
        out[i] = _e2m1_code(np.int64(bits[2 * i])) | (_e2m1_code(np.int64(bits[2 * i + 1])) << 4)


@njit(cache=True, inline="always")
def _zero(pool, start: int, stop: int) -> None:
    span = pool[start:stop]
    for i in range(span.shape[0]):
        span[i] = 0


@njit(cache=True, inline="always")
def _e4m3_code(b: int) -> int:
    """E4M3 code of the non-negative finite fp32 with bit pattern ``b`` (RNE, saturating at 448)."""
    if b >= 0x43E00000:
        return 0x7E
    if b >= 0x3C800000:
        return ((b + 0x7FFFF + ((b >> 20) & 1)) >> 20) - 960
    e = b >> 23
    if e == 0:
        return 0
    mant = (b & 0x7FFFFF) | 0x800000
    shift = 14 - (e - 127)
    if shift > 40:
        return 0
    q = mant >> shift
    rem = mant - (q << shift)
    half = np.int64(1) << (shift - 1)
    if rem > half or (rem == half and (q & 1) == 1):
        q += 1
    return q


@njit(cache=True, inline="always")
def _decode_record(prog, rec, scale, e4m3, ue8m0, e2m1, vals, bits) -> None:
    """Record bytes -> 512 fp32 values (``bits`` is the uint32 view of ``vals``), field by field.

    Every loop indexes slices from 0 (provably non-negative indices), which LLVM vectorizes."""
    for k in range(prog.shape[0]):
        op, d0, nd, off, tile, soff = prog[k, 0], prog[k, 1], prog[k, 2], prog[k, 3], prog[k, 4], prog[k, 5]
        if op == OP_BF16:
            src = rec[off : off + 2 * nd]
            dst_bits = bits[d0 : d0 + nd]
            for i in range(nd):
                dst_bits[i] = (np.uint32(src[2 * i]) | (np.uint32(src[2 * i + 1]) << 8)) << 16
        elif op == OP_E4M3_TENSOR:
            src = rec[off : off + nd]
            dst = vals[d0 : d0 + nd]
            for i in range(nd):
                dst[i] = e4m3[src[i]] * scale
        elif op == OP_E4M3_UE8M0 or op == OP_E4M3FNUZ_UE8M0:
            codes = e4m3 if op == OP_E4M3_UE8M0 else _E4M3FNUZ_F32  # the OCP or the FNUZ value table
            for t in range(nd // tile):
                s = ue8m0[rec[soff + t]]
                src = rec[off + t * tile : off + (t + 1) * tile]
                dst = vals[d0 + t * tile : d0 + (t + 1) * tile]
                for i in range(tile):
                    dst[i] = codes[src[i]] * s
        elif op == OP_E2M1_E4M3 or op == OP_E2M1_NVFP4 or op == OP_E2M1_NVFP4Z or op == OP_E2M1_UE8M0:
            half = tile // 2
            for t in range(nd // tile):
                s = ue8m0[rec[soff + t]] if op == OP_E2M1_UE8M0 else e4m3[rec[soff + t]]
                src = rec[off + t * half : off + (t + 1) * half]
                dst = vals[d0 + t * tile : d0 + (t + 1) * tile]
                for i in range(half):
                    b = src[i]
                    dst[2 * i] = e2m1[b & 15] * s
                    dst[2 * i + 1] = e2m1[b >> 4] * s
                if op == OP_E2M1_NVFP4 or op == OP_E2M1_NVFP4Z:  # fp32(e2m1 * scale) * g (``nvfp4_decode_tiles``)
                    for i in range(tile):
                        dst[i] = dst[i] * scale


@njit(cache=True, inline="always")
def _e2m1_code(b: int) -> int:
    """E2M1 code of the fp32 with bit pattern ``b``: the thresholds of ``numerics.E2M1_THRESHOLDS``
    (ties to even: up at 0.75, 1.75 and 3.5), saturating at 6, NaN as 0, the sign in bit 3."""
    mag = b & 0x7FFFFFFF
    mag = 0 if mag > 0x7F800000 else mag
    c = (mag > _E2M1_T0) + (mag >= _E2M1_T1) + (mag > _E2M1_T2) + (mag >= _E2M1_T3)
    c += (mag > _E2M1_T4) + (mag >= _E2M1_T5) + (mag > _E2M1_T6)
    return c | ((b >> 28) & 8)


@njit(cache=True, inline="always")
def _tensor_e4m3_chunks(src, mult, tmp, tmp_bits, out, width: int) -> None:
    """Per-tensor E4M3 codes of ``src * mult`` into ``out``, ``width`` values at a time (a divisor of the length)."""
    for j in range(0, src.shape[0], width):
        chunk = src[j : j + width]
        for i in range(width):
            tmp[i] = chunk[i] * mult
        _e4m3_tile(tmp[:width], tmp_bits[:width], tmp[width : 2 * width], tmp_bits[width : 2 * width],
                   out[j : j + width])


@njit(cache=True, inline="always")
def _ue8m0_e4m3_tiles(src, src_bits, tile: int, min_exp: int, pow2, tmp, tmp_bits, out, scales) -> None:
    """E4M3 tiles of ``tile`` values with UE8M0 scales 2^k (k from the dialect's floor ``min_exp``)."""
    for t in range(src.shape[0] // tile):
        vals = src[t * tile : (t + 1) * tile]
        vbits = src_bits[t * tile : (t + 1) * tile]
        amax_bits = _amax_bits(vbits)
        exp = amax_bits >> 23
        e = min_exp
        if exp > 0:  # amax normal: ceil(log2(amax / 448)) = E - 8 (+1 above mantissa 1.75)
            e = max(min_exp, exp - 135 + (1 if (amax_bits & 0x7FFFFF) > 0x600000 else 0))
        m = pow2[149 - e]
        for i in range(tile):
            tmp[i] = vals[i] * m
        _e4m3_tile(tmp[:tile], tmp_bits[:tile], tmp[tile : 2 * tile], tmp_bits[tile : 2 * tile],
                   out[t * tile : (t + 1) * tile])
        scales[t] = e + 127


@njit(cache=True, inline="always")
def _e4m3fnuz_code(b: int) -> int:
    """E4M3 FNUZ code of the fp32 with bit pattern ``b`` (``numerics.e4m3fnuz_encode``): RNE, saturating
    at 240, NaN 0x80, a value rounding to 0 is 0x00."""
    mag = b & 0x7FFFFFFF
    if mag > 0x7F800000:
        return _E4M3FNUZ_NAN
    if mag > 0x43680000:  # above 232, the midpoint of 224 and 240
        code = 0x7F
    elif mag >= 0x3C000000:  # normal FNUZ (|x| >= 2^-7): drop 20 mantissa bits with RNE, rebias 127 -> 8
        code = ((mag + 0x7FFFF + ((mag >> 20) & 1)) >> 20) - 952
    else:
        e = mag >> 23
        shift = 13 - (e - 127)
        if e == 0 or shift > 40:
            return 0
        mant = (mag & 0x7FFFFF) | 0x800000
        code = mant >> shift
        rem = mant - (code << shift)
        half = np.int64(1) << (shift - 1)
        if rem > half or (rem == half and (code & 1) == 1):
            code += 1
    return 0 if code == 0 else code | ((b >> 24) & 0x80)


@njit(cache=True, inline="always")
def _fnuz_tiles(src, src_bits, tile: int, min_exp: int, pow2, tmp, tmp_bits, out, scales) -> None:
    """E4M3 FNUZ tiles with UE8M0 scales 2^k, k = max(ceil(log2(amax / M)), min_exp) for the FNUZ dialect
    whose floor is ``min_exp`` (``numerics.fnuz_scale_exponent``); value codes of x / 2^k (exact)."""
    max_frac = (_FNUZ_B_MAX if min_exp == _FNUZ_B_FLOOR else _FNUZ_A_MAX) & 0x7FFFFF
    for t in range(src.shape[0] // tile):
        vbits = src_bits[t * tile : (t + 1) * tile]
        amax_bits = _amax_bits(vbits)
        exp = amax_bits >> 23
        e = min_exp
        if exp > 0:  # amax = A * 2^E, M = B * 2^7: E - 7 (+1 when A > B)
            e = max(min_exp, exp - 134 + (1 if (amax_bits & 0x7FFFFF) > max_frac else 0))
        m = pow2[149 - e]
        vals = src[t * tile : (t + 1) * tile]
        for i in range(tile):
            tmp[0] = vals[i] * m
            out[t * tile + i] = _e4m3fnuz_code(np.int64(tmp_bits[0]))
        scales[t] = e + 127


@njit(cache=True, inline="always")
def _nvfp4_tiles(src, src_bits, tile: int, rcp_g, g, e4m3, tmp, tmp_bits, out, scales, zero_scale_zero) -> None:
    """NVFP4 tiles (``numerics.nvfp4_tile_scale`` / ``nvfp4_encode_tiles``) under the global scale ``g``
    (``rcp_g`` = fp32(1/g)): scale byte ``e4m3(rcp_g * (amax * fp32(1/6)))`` (0x7F and all codes 0 when the
    tile holds NaN or Inf), codes of ``x * fp32(1/fp32(scale * g))``, a zero element keeping its signed zero; a
    scale-0 tile multiplies by +Inf, or by 0 with ``zero_scale_zero`` (vLLM's writer, ``OP_E2M1_NVFP4Z``)."""
    half = tile // 2
    for t in range(src.shape[0] // tile):
        lo = t * tile
        amax_bits = _amax_bits(src_bits[lo : lo + tile])
        dst = out[t * half : (t + 1) * half]
        if amax_bits >= 0x7F800000:
            scales[t] = _E4M3_NAN
            _zero(dst, 0, half)
            continue
        tmp_bits[0] = np.uint32(amax_bits)
        tmp_bits[1] = np.uint32(_NVFP4_RCP6_BITS)
        tmp[0] = rcp_g * (tmp[0] * tmp[1])  # +Inf saturates: _e4m3_code(0x7F800000) is 0x7E
        code = _e4m3_code(np.int64(tmp_bits[0]))
        scales[t] = code
        inv = np.float32(np.inf) if code == 0 else np.float32(1.0) / (e4m3[code] * g)  # 1/0 is +Inf
        if code == 0 and zero_scale_zero:
            inv = np.float32(0.0)
        for i in range(tile):
            v = src[lo + i]
            tmp[i] = v if v == 0 else v * inv
        _pack_e2m1(tmp_bits, dst)


@njit(cache=True, inline="always")
def _mxfp4_tiles(src, src_bits, tile: int, pow2, tmp, tmp_bits, out, scales) -> None:
    """MXFP4 tiles (``numerics.mxfp4_scale_byte`` / ``mxfp4_encode_tiles``): UE8M0 byte
    round(log2(amax / 6)) + 127 in [0, 255] from amax's bits (0xFF and all codes 0 when the tile
    holds NaN or Inf), codes of x / 2^(byte - 127)."""
    half = tile // 2
    for t in range(src.shape[0] // tile):
        lo = t * tile
        amax_bits = _amax_bits(src_bits[lo : lo + tile])
        dst = out[t * half : (t + 1) * half]
        if amax_bits >= 0x7F800000:
            scales[t] = 0xFF
            _zero(dst, 0, half)
            continue
        exp = amax_bits >> 23
        mant = (amax_bits & 0x7FFFFF) | 0x800000
        byte = 0
        if exp > 0:
            byte = min(255, max(0, exp - 3 + (1 if mant * mant >= _MXFP4_ROUND_UP_SQUARE else 0)))
        scales[t] = byte
        m = pow2[149 + 127 - byte]  # 2^(127 - byte), exact
        for i in range(tile):
            tmp[i] = src[lo + i] * m
        _pack_e2m1(tmp_bits, dst)


@njit(cache=True, inline="always")
def _encode_record(prog, vals, bits, mult, gscale, min_exp, pow2, e4m3, tmp, tmp_bits, rec) -> None:
    """512 fp32 values -> record bytes, field by field. ``mult``: per-tensor multiplier fp32(1/s) (E4M3 values;
    NVFP4 tile scales, s = ``gscale``, the NVFP4 global scale); ``min_exp``: the UE8M0 rule's exponent floor."""
    for k in range(prog.shape[0]):
        op, d0, nd, off, tile, soff = prog[k, 0], prog[k, 1], prog[k, 2], prog[k, 3], prog[k, 4], prog[k, 5]
        if op == OP_ROUND_BF16:  # the values of a mirrored bf16 field, before its second copy is encoded
            for i in range(d0, d0 + nd):
                bits[i] = np.uint32(_bf16_bits(np.int64(bits[i])) << 16)
        elif op == OP_BF16:
            src_bits = bits[d0 : d0 + nd]
            dst = rec[off : off + 2 * nd]
            for i in range(nd):
                h = _bf16_bits(np.int64(src_bits[i]))
                dst[2 * i] = h & 0xFF
                dst[2 * i + 1] = h >> 8
        elif op == OP_E4M3_TENSOR:
            if nd % 64 == 0:
                _tensor_e4m3_chunks(vals[d0 : d0 + nd], mult, tmp, tmp_bits, rec[off : off + nd], 64)
            else:
                _tensor_e4m3_chunks(vals[d0 : d0 + nd], mult, tmp, tmp_bits, rec[off : off + nd], 1)
        elif op == OP_E4M3_UE8M0:
            src, src_bits = vals[d0 : d0 + nd], bits[d0 : d0 + nd]
            out, scales = rec[off : off + nd], rec[soff : soff + nd // tile]
            if tile == 64:  # literal tile sizes: LLVM sees the trip counts and vectorizes
                _ue8m0_e4m3_tiles(src, src_bits, 64, min_exp, pow2, tmp, tmp_bits, out, scales)
            elif tile == 32:
                _ue8m0_e4m3_tiles(src, src_bits, 32, min_exp, pow2, tmp, tmp_bits, out, scales)
            elif tile == 16:
                _ue8m0_e4m3_tiles(src, src_bits, 16, min_exp, pow2, tmp, tmp_bits, out, scales)
            else:
                _ue8m0_e4m3_tiles(src, src_bits, tile, min_exp, pow2, tmp, tmp_bits, out, scales)
        elif op == OP_E4M3FNUZ_UE8M0:
            _fnuz_tiles(vals[d0 : d0 + nd], bits[d0 : d0 + nd], tile, min_exp, pow2, tmp, tmp_bits,
                        rec[off : off + nd], rec[soff : soff + nd // tile])
        elif op == OP_E2M1_E4M3:
            half = tile // 2
            for t in range(nd // tile):
                lo = d0 + t * tile
                amax_bits = _amax_bits(bits[lo : lo + tile])
                if amax_bits >= 0x7F800000:  # NaN or Inf poisons the tile
                    code = _E4M3_NAN
                else:  # e4m3(clamp(amax / 6, 2^-9, 448)), amax / 6 an fp32 division
                    tmp_bits[0] = np.uint32(amax_bits)
                    tmp[0] = tmp[0] / np.float32(6.0)
                    code = _e4m3_code(max(np.int64(tmp_bits[0]), _FP4_SCALE_MIN_BITS))
                rec[soff + t] = code
                s = e4m3[code]
                for i in range(tile):
                    tmp[i] = vals[lo + i] / s
                _pack_e2m1(tmp_bits, rec[off + t * half : off + (t + 1) * half])
        elif op == OP_E2M1_NVFP4 or op == OP_E2M1_NVFP4Z:
            _nvfp4_tiles(vals[d0 : d0 + nd], bits[d0 : d0 + nd], tile, mult, gscale, e4m3, tmp, tmp_bits,
                         rec[off : off + nd // 2], rec[soff : soff + nd // tile], op == OP_E2M1_NVFP4Z)
        elif op == OP_E2M1_UE8M0:
            _mxfp4_tiles(vals[d0 : d0 + nd], bits[d0 : d0 + nd], tile, pow2, tmp, tmp_bits,
                         rec[off : off + nd // 2], rec[soff : soff + nd // tile])
        elif op == OP_ZERO:
            for i in range(nd):
                rec[off + i] = 0


@njit(cache=True, inline="always")
def _count_nonfinite(bits, token: int, count: int, first: int) -> tuple[int, int]:
    """Add the non-finite values among 512 fp32 bit patterns to (count, first flat index)."""
    for i in range(HEAD_DIM):
        if (bits[i] & 0x7FFFFFFF) >= 0x7F800000:
            if count == 0 or token * HEAD_DIM + i < first:
                first = token * HEAD_DIM + i
            count += 1
    return count, first


# ---------------------------------------------------------------------------------------------
# Parallel kernels
# ---------------------------------------------------------------------------------------------


@njit(cache=True, nogil=True)
def _encode_kernel(c0, c1, x32, x16, from_bf16, n, dst, prog, dp, dpb, dsplit, drb, mult, gscale, min_exp, pow2,
                   e4m3):
    """Latents (fp32 ``x32`` or bf16 bits ``x16``, flat) -> ``dst`` pages (flat uint8)."""
    npages = dst.shape[0] // dpb
    per = max(1, CHUNK_TOKENS // dp)
    for chunk in range(c0, c1):
        rec = np.empty(drb, np.uint8)
        vals = np.empty(HEAD_DIM, np.float32)
        bits = vals.view(np.uint32)
        tmp = np.empty(_TMP, np.float32)  # a scaled tile, then E4M3 scratch
        tmp_bits = tmp.view(np.uint32)
        for p in range(chunk * per, min(npages, (chunk + 1) * per)):
            for r in range(dp):
                t = p * dp + r
                d_at, f_at = _locate(t, dp, dpb, dsplit, drb)
                if t < n:
                    lo = t * HEAD_DIM
                    if from_bf16:
                        row16 = x16[lo : lo + HEAD_DIM]
                        for i in range(HEAD_DIM):
                            bits[i] = np.uint32(row16[i]) << 16
                    else:
                        _copy(x32[lo : lo + HEAD_DIM], vals)
                    _encode_record(prog, vals, bits, mult, gscale, min_exp, pow2, e4m3, tmp, tmp_bits, rec)
                    _scatter(rec, dst, d_at, f_at, dsplit, drb)
                else:
                    _zero(dst, d_at, d_at + dsplit)
                    _zero(dst, f_at, f_at + drb - dsplit)
            _zero(dst, p * dpb + dp * drb, (p + 1) * dpb)


@njit(cache=True, nogil=True)
def _decode_kernel(c0, c1, src, prog, sp, spb, ssplit, srb, scale, n, out, e4m3, ue8m0, e2m1):
    """``src`` pages (flat uint8) -> fp32 latents ``out`` (flat, ``n * 512``)."""
    out_bits = out.view(np.uint32)
    for chunk in range(c0, c1):
        rec = np.empty(srb, np.uint8)
        for t in range(chunk * CHUNK_TOKENS, min(n, (chunk + 1) * CHUNK_TOKENS)):
            d_at, f_at = _locate(t, sp, spb, ssplit, srb)
            _gather(src, d_at, f_at, ssplit, srb, rec)
            lo = t * HEAD_DIM
            _decode_record(prog, rec, scale, e4m3, ue8m0, e2m1, out[lo : lo + HEAD_DIM], out_bits[lo : lo + HEAD_DIM])


@njit(cache=True, nogil=True)
def _transcode_kernel(
    c0, c1, src, sprog, sp, spb, ssplit, srb, scale, n,
    dst, dprog, dp, dpb, dsplit, drb, mult, gscale, min_exp,
    e4m3, ue8m0, e2m1, pow2, bad_count, bad_first,
):
    """Decode each source token into an fp32 buffer and re-encode it (any pair of record programs).

    Per chunk, ``bad_count``/``bad_first`` receive the number of non-finite decoded values and
    the flat index (token * 512 + dim) of the first one.
    """
    npages = dst.shape[0] // dpb
    per = max(1, CHUNK_TOKENS // dp)
    for chunk in range(c0, c1):
        rec_in = np.empty(srb, np.uint8)
        rec_out = np.empty(drb, np.uint8)
        vals = np.empty(HEAD_DIM, np.float32)
        bits = vals.view(np.uint32)
        tmp = np.empty(_TMP, np.float32)  # a scaled tile, then E4M3 scratch
        tmp_bits = tmp.view(np.uint32)
        count = 0
        first = -1
        for p in range(chunk * per, min(npages, (chunk + 1) * per)):
            for r in range(dp):
                t = p * dp + r
                d_at, f_at = _locate(t, dp, dpb, dsplit, drb)
                if t < n:
                    s_at, sf_at = _locate(t, sp, spb, ssplit, srb)
                    _gather(src, s_at, sf_at, ssplit, srb, rec_in)
                    _decode_record(sprog, rec_in, scale, e4m3, ue8m0, e2m1, vals, bits)
                    count, first = _count_nonfinite(bits, t, count, first)
                    _encode_record(dprog, vals, bits, mult, gscale, min_exp, pow2, e4m3, tmp, tmp_bits, rec_out)
                    _scatter(rec_out, dst, d_at, f_at, dsplit, drb)
                else:
                    _zero(dst, d_at, d_at + dsplit)
                    _zero(dst, f_at, f_at + drb - dsplit)
            _zero(dst, p * dpb + dp * drb, (p + 1) * dpb)
        bad_count[chunk] = count
        bad_first[chunk] = first


@njit(cache=True, inline="always")
def _tile_max_magnitude(rec, base: int, width: int = 64) -> int:
    """Largest ``code & 0x7F`` of the ``width`` E4M3 codes at ``rec[base:]`` (the code of their amax)."""
    m = np.uint8(0)
    for i in range(width):  # max() on explicit uint8 operands keeps LLVM's lanes 8-bit wide
        m = max(m, np.uint8(rec[base + i] & np.uint8(0x7F)))
    return m


@njit(cache=True, nogil=True)
def _amax_kernel(c0, c1, src, prog, sp, spb, ssplit, srb, scale, n, e4m3, ue8m0, e2m1, amax, bad):
    """Per chunk of ``CHUNK_TOKENS`` source tokens: ``amax[chunk]``, the largest |decoded value|,
    and ``bad[chunk]``, 1 when a decoded value would be NaN/Inf, computed in the code domain.

    Decoding is ``fp32(v(c) * s)`` with one positive factor ``s`` per field or tile, monotone in
    ``|v(c)|``; so a tile's amax is the decoded value of its largest code magnitude (an integer max),
    exactly what decoding every value and taking the max gives. One value per tile is converted.
    """
    for chunk in range(c0, c1):
        rec16 = np.empty(srb // 2 + 1, np.uint16)  # the record, readable as bf16 words at even offsets
        rec = rec16.view(np.uint8)
        best = np.float32(0.0)
        flag = 0
        for t in range(chunk * CHUNK_TOKENS, min(n, (chunk + 1) * CHUNK_TOKENS)):
            d_at, f_at = _locate(t, sp, spb, ssplit, srb)
            _gather(src, d_at, f_at, ssplit, srb, rec[:srb])
            for k in range(prog.shape[0]):
                op, nd, off, tile, soff = prog[k, 0], prog[k, 2], prog[k, 3], prog[k, 4], prog[k, 5]
                if op == OP_BF16:
                    m16 = np.uint16(0)
                    if off % 2 == 0:
                        words = rec16[off // 2 : off // 2 + nd]
                        for i in range(nd):
                            m16 = max(m16, np.uint16(words[i] & np.uint16(0x7FFF)))
                    else:
                        half = rec[off : off + 2 * nd]  # a layout defined elsewhere may put bf16 at odd offsets
                        for i in range(nd):
                            h = np.uint16(half[2 * i]) | (np.uint16(half[2 * i + 1]) << 8)
                            m16 = max(m16, np.uint16(h & 0x7FFF))
                    if m16 >= 0x7F80:
                        flag = 1
                    else:
                        best = max(best, np.uint32(np.uint32(m16) << 16).view(np.float32))
                elif op == OP_E4M3_TENSOR:
                    m = _tile_max_magnitude(rec[off : off + nd], 0, nd)
                    v = abs(e4m3[m] * scale)
                    if m == 0x7F or not np.isfinite(v):
                        flag = 1
                    else:
                        best = max(best, v)
                elif op == OP_E4M3_UE8M0:
                    for j in range(nd // tile):
                        codes = rec[off + j * tile : off + (j + 1) * tile]
                        m = _tile_max_magnitude(codes, 0, 64) if tile == 64 else _tile_max_magnitude(codes, 0, tile)
                        v = e4m3[m] * ue8m0[rec[soff + j]]
                        if m == 0x7F or not np.isfinite(v):
                            flag = 1
                        else:
                            best = max(best, v)
                elif op == OP_E4M3FNUZ_UE8M0:  # 0x80 is NaN, 0x7F is 240
                    for j in range(nd // tile):
                        codes = rec[off + j * tile : off + (j + 1) * tile]
                        m = _tile_max_magnitude(codes, 0, tile)
                        v = _E4M3FNUZ_F32[m] * ue8m0[rec[soff + j]]
                        for i in range(tile):
                            flag = 1 if codes[i] == _E4M3FNUZ_NAN else flag
                        if not np.isfinite(v):
                            flag = 1
                        else:
                            best = max(best, v)
                elif op == OP_E2M1_E4M3 or op == OP_E2M1_NVFP4 or op == OP_E2M1_NVFP4Z or op == OP_E2M1_UE8M0:
                    h = tile // 2
                    for j in range(nd // tile):
                        codes = rec[off + j * h : off + (j + 1) * h]
                        m = np.uint8(0)
                        for i in range(h):
                            c = codes[i]
                            m = max(m, np.uint8(c & np.uint8(7)), np.uint8((c >> np.uint8(4)) & np.uint8(7)))
                        s = ue8m0[rec[soff + j]] if op == OP_E2M1_UE8M0 else e4m3[rec[soff + j]]
                        v = abs(e2m1[m] * s)
                        if op == OP_E2M1_NVFP4 or op == OP_E2M1_NVFP4Z:  # fp32(e2m1 * scale) * g: monotone
                            v = abs(v * scale)
                        if not np.isfinite(v):
                            flag = 1
                        else:
                            best = max(best, v)
        amax[chunk] = best
        bad[chunk] = flag


@njit(cache=True, nogil=True)
def _move_spans_kernel(c0, c1, src, dst, segs, src_stride, dst_stride, width):
    """For segments ``[c0, c1)`` of ``segs`` (source byte offset, destination byte offset, rows): copy ``rows``
    rows of ``width`` bytes, ``src_stride`` / ``dst_stride`` bytes apart, from ``src`` to ``dst`` (one span when
    both strides are the width)."""
    for k in range(c0, c1):
        at, to, rows = segs[k, 0], segs[k, 1], segs[k, 2]
        if src_stride == width and dst_stride == width:
            _copy(src[at : at + rows * width], dst[to : to + rows * width])
            continue
        for r in range(rows):
            _copy(src[at + r * src_stride : at + r * src_stride + width],
                  dst[to + r * dst_stride : to + r * dst_stride + width])


@njit(cache=True, nogil=True)
def _repage_kernel(c0, c1, src, sp, spb, ssplit, dst, dp, dpb, dsplit, rb, n):
    """Byte move of ``rb``-byte records between two page geometries (splits may differ)."""
    npages = dst.shape[0] // dpb
    per = max(1, CHUNK_TOKENS // dp)
    for chunk in range(c0, c1):
        rec = np.empty(rb, np.uint8)
        for p in range(chunk * per, min(npages, (chunk + 1) * per)):
            for r in range(dp):
                t = p * dp + r
                d_at, f_at = _locate(t, dp, dpb, dsplit, rb)
                if t < n:
                    s_at, sf_at = _locate(t, sp, spb, ssplit, rb)
                    _gather(src, s_at, sf_at, ssplit, rb, rec)
                    _scatter(rec, dst, d_at, f_at, dsplit, rb)
                else:
                    _zero(dst, d_at, d_at + dsplit)
                    _zero(dst, f_at, f_at + rb - dsplit)
            _zero(dst, p * dpb + dp * rb, (p + 1) * dpb)


@njit(cache=True, nogil=True)
def _nonfinite_kernel(c0, c1, words, exp_mask, counts):
    """Per chunk of ``CHUNK_TOKENS * 512`` floats (given as their bit patterns ``words``), how many
    have every exponent bit set (``exp_mask``): NaN or Inf."""
    span = CHUNK_TOKENS * HEAD_DIM
    for chunk in range(c0, c1):
        part = words[chunk * span : min(words.shape[0], (chunk + 1) * span)]
        count = 0
        for i in range(part.shape[0]):
            count += (part[i] & exp_mask) == exp_mask
        counts[chunk] = count


def _encode_params(dialect: str | None, scale: float) -> tuple[np.float32, np.float32, int]:
    """(per-tensor multiplier fp32(1/s), the scale s itself (NVFP4's global scale), UE8M0 exponent floor) as
    the reference codec applies them."""
    if dialect in nx.FNUZ_DIALECT_RULES:
        return np.float32(1.0), np.float32(scale), nx.FNUZ_DIALECT_RULES[dialect][0]
    return (np.float32(tensor_multiplier(dialect, scale)), np.float32(scale),
            nx.DIALECT_MIN_EXPONENT[ue8m0_dialect(dialect)])


def _x_arrays(x: torch.Tensor) -> tuple[np.ndarray, np.ndarray, bool]:
    """(fp32 values, bf16 bit patterns, from_bf16) of latents ``x`` for ``_encode_kernel``."""
    if x.dtype == torch.bfloat16:
        return np.empty(0, np.float32), _flat(x.view(torch.int16)).view(np.uint16), True
    return _flat(x.float()), np.empty(0, np.uint16), False


def _raise_nonfinite(bad_count: np.ndarray, bad_first: np.ndarray) -> None:
    """Raise the reference's ``NonFiniteError`` when any chunk saw a non-finite decoded value."""
    total = int(bad_count.sum())
    if total:
        first = int(bad_first[bad_count > 0].min())
        token, dim = divmod(first, HEAD_DIM)
        raise NonFiniteError(f"source holds non-finite values ({total}; first at token {token}, dim {dim})")

