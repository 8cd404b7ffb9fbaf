"""Native CPU paged operations: multi-threaded numba kernels, byte-identical to ``kvbridge.backends.reference``.

The kernels execute each layout's record description, not a list of layouts:

- the record program: ``Layout.segments`` as an int64 array ``[fields, 6]`` (op, first dim,
  dims, byte offset, tile, scale offset), a runtime argument, so one compiled (and disk-cached)
  kernel serves every layout made of the known element formats and scale rules;
- the geometry: ``record_bytes``, the block-split point ``split`` (token-major layouts use
  ``split = record_bytes``) and the padded ``page_bytes``. Record byte ``i < split`` of the
  token at row ``r`` of page ``p`` sits at ``p * page_bytes + r * split + i``, byte ``i >= split``
  at ``p * page_bytes + P * split + r * (record_bytes - split) + (i - split)``.

Each token is gathered into a small per-thread record buffer, decoded into a 512-value fp32
buffer (2 KiB, L1-resident), re-encoded and scattered, so no fp32 copy of a pool is ever built.
Work is split into chunks of about ``CHUNK_TOKENS`` destination tokens (whole pages), run by a
pool of ``num_threads()`` Python threads (the kernels release the GIL); every byte of every
destination page (padding tail and unused rows: zero) is written by the kernels, so outputs
start uninitialised (``_empty_output``).

Accelerators: specialised kernels registered for a pair of *records* (``ACCELERATORS``; they
serve every geometry of those records; ``LATENTS`` on one side makes an encoder or a decoder),
byte-checked against the generic kernel by the tests. The MODEL1 encoder and decoder have the
record's constants compiled in, read and write pages in place, and convert E4M3 in branch-free
32-bit vector arithmetic (``_e4m3_value``, ``_e4m3_byte``) instead of table lookups.
Per-tensor E4M3 (TensorRT-LLM FP8) -> MODEL1 runs in the code domain: with a per-tensor source
every decoded value is ``fp32(e4m3(c) * s)``, a function of the byte ``c`` alone and monotone in
``c & 0x7F``, so a tile's amax is the value of its largest code magnitude ``m`` and each output
byte is a function of ``(m, c)``: a 128 x 256 table, or at s = 1 an exact exponent shift (built
once per scale and dialect with ``kvbridge.numerics``, exactly as the reference computes it);
per-tensor E4M3 -> V4.1 MXFP8 the same way with 32-value tiles; MODEL1 -> per-tensor E4M3 likewise
through tables of (scale byte, code).

Numba compiles the kernels on first use and caches them on disk (``cache=True``); see
``docs/performance.md`` for the one-time cost. The four MODEL1 accelerators (trtllm-fp8 <-> MODEL1,
MODEL1 encode and decode) and the code-domain amax of MODEL1 and per-tensor E4M3 pools run compiled C
kernels instead (``kvbridge.backends.native._kernels``, an optional
extension built at install time, byte-identical, AVX-512 VBMI table lookups and non-temporal stores)
where it is built and the CPU has AVX-512 VBMI, unless ``KVBRIDGE_NO_CKERNELS=1``
(``kernel_implementation()`` says which runs).
"""

from __future__ import annotations

import mmap
import os
import warnings
from concurrent.futures import ThreadPoolExecutor
from functools import cache, lru_cache
from types import ModuleType

import numpy as np
import torch
from numba import njit

from kvbridge import numerics as nx
from kvbridge.backends import reference
from kvbridge.errors import NonFiniteError
from kvbridge.layouts import Layout, get_layout
from kvbridge.layouts.codec import tensor_multiplier, ue8m0_dialect
from kvbridge.layouts.registry import OP_BF16, OP_E2M1_E4M3, OP_E4M3_TENSOR, OP_E4M3_UE8M0, OP_ZERO

name = "native"

HEAD_DIM = 512
#: Outputs at least this large (bytes) go on transparent huge pages (see ``_empty_output``).
HUGE_PAGE_OUTPUT = 4 << 20
_HUGE_PAGE = 2 << 20
#: Destination tokens per unit of parallel work (~150 KiB of MODEL1 pages: L2-sized).
CHUNK_TOKENS = 256
#: Indexer keys per unit of parallel work.
KEY_CHUNK = 4096

#: MODEL1 record: bytes [0, 576) nope E4M3 + rope bf16, [576, 584) 7 UE8M0 scales + pad (the accelerators').
MODEL1_DATA_BYTES = 576
_E4M3_NAN = nx.E4M3_NAN
_FP4_SCALE_MIN_BITS = nx.FP4_SCALE_MIN_BITS
#: Scratch floats per thread: a scaled tile (up to 512 values), then E4M3 work space.
_TMP = 2 * HEAD_DIM

#: fp32 value of each E4M3 code (0x7F/0xFF NaN), from ``kvbridge.numerics``.
_E4M3_F32 = nx.E4M3_TABLE.numpy().copy()
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
def program(layout: Layout) -> np.ndarray:
    """The record program of ``layout``: ``Layout.segments`` as int64 ``[fields, 6]``, with neighbouring
    unscaled fields of one op that continue each other in dims and bytes merged into one (fewer, longer loops)."""
    rows: list[list[int]] = []
    for seg in layout.segments:
        prev = rows[-1] if rows else None
        width = 2 if seg.op == OP_BF16 else 1
        if prev is not None and seg.op in (OP_BF16, OP_E4M3_TENSOR) and prev[0] == seg.op and \
                prev[1] + prev[2] == seg.dim0 and prev[3] + width * prev[2] == seg.offset:
            prev[2] += seg.ndims
        else:
            rows.append(list(seg))
    return np.array(rows, np.int64).reshape(-1, 6)


def supports(*layouts: Layout) -> bool:
    """Every record description compiles to ops these kernels execute."""
    return True


def accepts(*tensors: torch.Tensor) -> bool:
    """CPU tensors of any alignment (non-contiguous ones are copied)."""
    return True


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
        elif op == OP_E4M3_UE8M0:
            for t in range(nd // tile):
                s = ue8m0[rec[soff + t]]
                src = rec[off + t * tile : off + (t + 1) * tile]
                dst = vals[d0 + t * tile : d0 + (t + 1) * tile]
                for i in range(tile):
                    dst[i] = e4m3[src[i]] * s
        elif op == OP_E2M1_E4M3:
            half = tile // 2
            for t in range(nd // tile):
                s = e4m3[rec[soff + t]]
                src = rec[off + t * half : off + (t + 1) * half]
                dst = vals[d0 + t * tile : d0 + (t + 1) * tile]
                for i in range(half):
                    b = src[i]
                    dst[2 * i] = e2m1[b & 15] * s
                    dst[2 * i + 1] = e2m1[b >> 4] * s


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
        amax_bits = 0  # finite non-negative floats order like their bit patterns
        for i in range(tile):
            amax_bits = max(amax_bits, np.int64(vbits[i]) & 0x7FFFFFFF)
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
def _encode_record(prog, vals, bits, mult, min_exp, pow2, e4m3, tmp, tmp_bits, rec) -> None:
    """512 fp32 values -> record bytes, field by field. ``mult``: per-tensor E4M3 multiplier;
    ``min_exp``: the UE8M0 rule's exponent floor."""
    for k in range(prog.shape[0]):
        op, d0, nd, off, tile, soff = prog[k, 0], prog[k, 1], prog[k, 2], prog[k, 3], prog[k, 4], prog[k, 5]
        if op == OP_BF16:
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
        elif op == OP_E2M1_E4M3:
            half = tile // 2
            for t in range(nd // tile):
                lo = d0 + t * tile
                amax_bits = 0
                for i in range(tile):
                    amax_bits = max(amax_bits, np.int64(bits[lo + i]) & 0x7FFFFFFF)
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
                out = rec[off + t * half : off + (t + 1) * half]
                for i in range(half):
                    out[i] = _e2m1_code(np.int64(tmp_bits[2 * i])) | (_e2m1_code(np.int64(tmp_bits[2 * i + 1])) << 4)
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
def _encode_kernel(c0, c1, x32, x16, from_bf16, n, dst, prog, dp, dpb, dsplit, drb, mult, min_exp, pow2, e4m3):
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
                    _encode_record(prog, vals, bits, mult, min_exp, pow2, e4m3, tmp, tmp_bits, rec)
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
    dst, dprog, dp, dpb, dsplit, drb, mult, min_exp,
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
                    _encode_record(dprog, vals, bits, mult, min_exp, pow2, e4m3, tmp, tmp_bits, rec_out)
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
                elif op == OP_E2M1_E4M3:
                    h = tile // 2
                    for j in range(nd // tile):
                        codes = rec[off + j * h : off + (j + 1) * h]
                        m = np.uint8(0)
                        for i in range(h):
                            c = codes[i]
                            m = max(m, np.uint8(c & np.uint8(7)), np.uint8((c >> np.uint8(4)) & np.uint8(7)))
                        v = abs(e2m1[m] * e4m3[rec[soff + j]])
                        if not np.isfinite(v):
                            flag = 1
                        else:
                            best = max(best, v)
        amax[chunk] = best
        bad[chunk] = flag

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
def _fp4_to_fp8_keys_kernel(c0, c1, sd, sds, ss, sss, n, dim, rule, floor, e2m1, ue8m0, e4m3, pow2_codes,
                            dd, dds, ds, dss, words, sd64, dd64, measure, err, bad):
    """fp4 indexer keys (``dim / 2`` bytes of E2M1 pairs at ``sd[k * sds]``, ``dim / 32`` UE8M0 scales at
    ``ss[k * sss]``) -> fp8 keys (``dim`` E4M3 bytes at ``dd[k * dds]``, 4 scale bytes at ``ds[k * dss]``) by
    writer ``rule`` (``_KEY_RULES``), ``KEY_CHUNK`` keys per chunk; with ``measure`` ``err[chunk]`` is the
    chunk's max |decoded fp8 - decoded fp4|; ``bad[chunk]`` is 1 when an fp4 value decodes to NaN/Inf (the
    chunk's output is then meaningless). Records and page parts are both strided rows.

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
    With ``words`` (codes 8-byte aligned: ``sd64``/``dd64`` are the same bytes as uint64) block magnitudes
    come from 16 codes per word (``_fp4_block_magnitude``), and the power-of-two rules write blocks whose
    values stay normal in E4M3 (2^(b - 127 - e) >= 2^-5, exact: no error) by ``_fp4_word_codes``.
    """
    half, blocks = dim // 2, dim // 32
    sw, dw = (sds // 8, dds // 8) if words else (0, 0)
    lut = np.empty(16, np.uint8)
    for chunk in range(c0, c1):
        worst = np.float32(0.0)
        for k in range(chunk * KEY_CHUNK, min(n, (chunk + 1) * KEY_CHUNK)):
            src = sd[k * sds : k * sds + half]
            sc = ss[k * sss : k * sss + blocks]
            src64 = sd64[k * sw : k * sw + 2 * blocks]
            dst64 = dd64[k * dw : k * dw + 4 * blocks]
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
            dst = dd[k * dds : k * dds + dim]
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
            out_scale = ds[k * dss : k * dss + 4]
            if rule == 1:
                for i in range(4):
                    out_scale[i] = e + 127
            else:
                sb = np.uint32(np.float32(scale).view(np.uint32))
                for i in range(4):
                    out_scale[i] = (sb >> (8 * i)) & 0xFF
        err[chunk] = worst


@njit(cache=True, nogil=True)
def _move_rows_kernel(c0, c1, pool, records, runs, record_bytes, lo, width, to_pool):
    """For runs ``[c0, c1)`` (pool byte offset, first record, rows): copy ``rows`` rows of ``width`` bytes
    between consecutive bytes of ``pool`` and bytes ``[lo, lo + width)`` of consecutive records."""
    for k in range(c0, c1):
        at, first, rows = runs[k, 0], runs[k, 1], runs[k, 2]
        if width == record_bytes:  # whole records: one contiguous span on both sides
            span = pool[at : at + rows * width]
            recs = records[first * width : (first + rows) * width]
            if to_pool:
                _copy(recs, span)
            else:
                _copy(span, recs)
            continue
        for r in range(rows):
            span = pool[at + r * width : at + (r + 1) * width]
            rec = records[(first + r) * record_bytes + lo : (first + r) * record_bytes + lo + width]
            if to_pool:
                _copy(rec, span)
            else:
                _copy(span, rec)


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


# ---------------------------------------------------------------------------------------------
# Python entry points (same signatures and semantics as kvbridge.backends.reference)
# ---------------------------------------------------------------------------------------------


def _flat(t: torch.Tensor) -> np.ndarray:
    return t.contiguous().view(-1).numpy()


_POOLS: dict[int, ThreadPoolExecutor] = {}


def num_threads() -> int:
    """Threads the native kernels use: ``torch.get_num_threads()`` (``OMP_NUM_THREADS`` or
    ``torch.set_num_threads`` change it)."""
    return max(1, torch.get_num_threads())


def _run_chunks(kernel, nchunks: int, *args) -> None:
    """Run ``kernel(c0, c1, *args)`` over chunks ``[0, nchunks)`` on ``num_threads()`` threads.

    The kernels release the GIL; the range is cut into up to 4 pieces per thread, taken from a
    shared queue, so a thread slowed by other load on the machine holds back little work.
    """
    threads = min(num_threads(), nchunks)
    if threads <= 1:
        kernel(0, nchunks, *args)
        return
    pool = _POOLS.get(threads)
    if pool is None:
        pool = _POOLS[threads] = ThreadPoolExecutor(threads, thread_name_prefix="kvbridge-native")
    pieces = min(nchunks, 4 * threads)
    bounds = [nchunks * i // pieces for i in range(pieces + 1)]
    for future in [pool.submit(kernel, bounds[i], bounds[i + 1], *args) for i in range(pieces)]:
        future.result()


def _page_chunks(num_pages: int, page_size: int) -> int:
    """Number of work chunks over ``num_pages`` destination pages (whole pages, ~CHUNK_TOKENS tokens)."""
    per = max(1, CHUNK_TOKENS // page_size)
    return -(-num_pages // per)


def all_finite(x: torch.Tensor) -> bool:
    """True when the fp32 or bf16 CPU tensor ``x`` holds no NaN or Inf (a bit test, multi-threaded)."""
    if x.dtype == torch.bfloat16:
        words, mask = _flat(x.view(torch.int16)).view(np.uint16), np.uint16(0x7F80)
    else:
        words, mask = _flat(x.view(torch.int32)).view(np.uint32), np.uint32(0x7F800000)
    nchunks = -(-words.shape[0] // (CHUNK_TOKENS * HEAD_DIM))
    counts = np.zeros(nchunks, np.int64)
    _run_chunks(_nonfinite_kernel, nchunks, words, mask, counts)
    return not counts.any()


def _empty_output(rows: int, row_bytes: int, dtype: torch.dtype = torch.uint8) -> torch.Tensor:
    """Uninitialised ``[rows, row_bytes / itemsize]`` CPU tensor for a kernel to fill completely.

    Outputs of ``HUGE_PAGE_OUTPUT`` bytes or more are placed on 2 MiB-aligned anonymous memory
    advised for transparent huge pages: first-touch page faults of a fresh 4 KiB-paged output
    otherwise cost more than the transcode itself (measured in docs/performance.md). The tensor
    views into a mapping up to 2 MiB larger than itself, unmapped when the tensor is freed.
    """
    nbytes = rows * row_bytes
    if nbytes < HUGE_PAGE_OUTPUT or not hasattr(mmap, "MADV_HUGEPAGE"):
        return torch.empty(nbytes, dtype=torch.uint8).view(dtype).view(rows, row_bytes // dtype.itemsize)
    mapping = mmap.mmap(-1, nbytes + _HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    mapping.madvise(mmap.MADV_HUGEPAGE)
    whole = torch.frombuffer(mapping, dtype=torch.uint8)
    start = -whole.data_ptr() % _HUGE_PAGE
    return whole[start : start + nbytes].view(dtype).view(rows, row_bytes // dtype.itemsize)


def _new_pages(layout: Layout, num_tokens: int, page_size: int) -> torch.Tensor:
    return _empty_output(layout.num_pages(num_tokens, page_size), layout.page_bytes(page_size))


def _encode_params(dialect: str | None, scale: float) -> tuple[np.float32, int]:
    """(per-tensor E4M3 multiplier, UE8M0 exponent floor) as the reference codec applies them."""
    return np.float32(tensor_multiplier(dialect, scale)), nx.DIALECT_MIN_EXPONENT[ue8m0_dialect(dialect)]


def _x_arrays(x: torch.Tensor) -> tuple[np.ndarray, np.ndarray, bool]:
    """(fp32 values, bf16 bit patterns, from_bf16) of latents ``x`` for ``_encode_kernel``."""
    if x.dtype == torch.bfloat16:
        return np.empty(0, np.float32), _flat(x.view(torch.int16)).view(np.uint16), True
    return _flat(x.float()), np.empty(0, np.uint16), False


def encode_pages(x: torch.Tensor, layout: Layout, page_size: int, dialect: str | None, scale: float,
                 *, out: torch.Tensor | None = None, accelerated: bool = True) -> torch.Tensor:
    """fp32 or bf16 ``[N, 512]`` (CPU) -> pages ``[ceil(N/P), page_bytes]`` uint8, written straight into
    ``out`` (contiguous; every byte written) when given. ``accelerated=False`` runs the generic kernel
    even where an encoder is registered (the tests compare the two)."""
    n = x.shape[0]
    out = _new_pages(layout, n, page_size) if out is None else out
    if n == 0:
        return out
    x32, x16, from_bf16 = _x_arrays(x)
    dp, dpb, dsplit, drb = _geometry(layout, page_size)
    fast = accelerator(LATENTS, layout) if accelerated else None
    if fast is not None:
        fast(x32, x16, from_bf16, n, dialect, scale, (_flat(out), dp, dpb, dsplit, drb))
        return out
    mult, min_exp = _encode_params(dialect, scale)
    _run_chunks(
        _encode_kernel, _page_chunks(out.shape[0], dp),
        x32, x16, from_bf16, n, _flat(out), program(layout), dp, dpb, dsplit, drb, mult, min_exp, _POW2_F32,
        _E4M3_F32,
    )
    return out


def decode_pages(
    pages: torch.Tensor, layout: Layout, page_size: int, num_tokens: int | None, scale: float,
    *, out: torch.Tensor | None = None, accelerated: bool = True,
) -> torch.Tensor:
    """Pages -> fp32 ``[num_tokens, 512]`` (all rows when ``num_tokens`` is None), written straight into
    ``out`` (contiguous) when given. ``accelerated=False`` runs the generic kernel even where a decoder
    is registered (the tests compare the two)."""
    n = layout.token_count(pages, page_size, num_tokens)
    out = _empty_output(n, HEAD_DIM * 4, torch.float32) if out is None else out
    fast = accelerator(layout, LATENTS) if accelerated else None
    if n and fast is not None:
        fast(n, np.float32(scale), (_flat(pages), *_geometry(layout, page_size)), _flat(out))
    elif n:
        sp, spb, ssplit, srb = _geometry(layout, page_size)
        _run_chunks(
            _decode_kernel, -(-n // CHUNK_TOKENS),
            _flat(pages), program(layout), sp, spb, ssplit, srb, np.float32(scale), n, _flat(out),
            _E4M3_F32, _UE8M0_F32, _E2M1_F32,
        )
    return out


def amax_pages(pages: torch.Tensor, layout: Layout, page_size: int, num_tokens: int | None,
               scale: float, *, accelerated: bool = True) -> float | None:
    """Largest |decoded value| of the first ``num_tokens`` tokens (0.0 for none), from the codes and
    scale bytes in one pass with no fp32 copy; None when a value would decode to NaN/Inf. MODEL1 and
    per-tensor E4M3 (TensorRT-LLM FP8) records run the compiled kernels where they are in use;
    ``accelerated=False`` runs the generic kernel (the tests compare the two)."""
    n = layout.token_count(pages, page_size, num_tokens)
    if n == 0:
        return 0.0
    nchunks = -(-n // CHUNK_TOKENS)
    amax = np.zeros(nchunks, np.float32)
    bad = np.zeros(nchunks, np.int64)
    geometry = (_flat(pages), *_geometry(layout, page_size))
    compiled = _CK is not None and accelerated
    if compiled and layout.segments == _MODEL1_SEGMENTS:
        _run_chunks(_CK.model1_amax, nchunks, *geometry, n, amax, bad)
    elif compiled and layout.segments == _FP8_SEGMENTS:
        _run_chunks(_CK.fp8_amax, nchunks, *geometry, n, float(np.float32(scale)), amax, bad)
    else:
        _run_chunks(_amax_kernel, nchunks, geometry[0], program(layout), *geometry[1:], np.float32(scale), n,
                    _E4M3_F32, _UE8M0_F32, _E2M1_F32, amax, bad)
    return None if bad.any() else float(amax.max())


def repage(
    pages: torch.Tensor, src: Layout, src_page_size: int, dst: Layout, dst_page_size: int, num_tokens: int | None,
    *, out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Byte move of identical token records between two page geometries, into ``out`` (every byte
    written) when given."""
    n = src.token_count(pages, src_page_size, num_tokens)
    out = _new_pages(dst, n, dst_page_size) if out is None else out
    if n:
        sp, spb, ssplit, rb = _geometry(src, src_page_size)
        dp, dpb, dsplit, _ = _geometry(dst, dst_page_size)
        _run_chunks(
            _repage_kernel, _page_chunks(out.shape[0], dp),
            _flat(pages), sp, spb, ssplit, _flat(out), dp, dpb, dsplit, rb, n,
        )
    return out


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


def _raise_nonfinite(bad_count: np.ndarray, bad_first: np.ndarray) -> None:
    """Raise the reference's ``NonFiniteError`` when any chunk saw a non-finite decoded value."""
    total = int(bad_count.sum())
    if total:
        first = int(bad_first[bad_count > 0].min())
        token, dim = divmod(first, HEAD_DIM)
        raise NonFiniteError(f"source holds non-finite values ({total}; first at token {token}, dim {dim})")


#: Set to 1 to run the numba MODEL1 kernels even where the compiled ones (``_kernels``) are built.
NO_CKERNELS_ENV = "KVBRIDGE_NO_CKERNELS"


#: The interface ``kvbridge.backends.native._kernels`` must have been built with (its ``KV_INTERFACE``).
KERNELS_INTERFACE = 2


def _warn_line(message: str) -> None:
    """A ``RuntimeWarning`` that prints as one line (``kvbridge: RuntimeWarning: ...``): attributed to no
    source file, so the warnings module shows no source line under it."""
    warnings.warn_explicit(message, RuntimeWarning, "kvbridge", 0, module="kvbridge")


def _compiled_kernels() -> tuple[ModuleType | None, str]:
    """(``kvbridge.backends.native._kernels`` or None, why not): the optional C extension of the MODEL1 accelerators,
    used when it is built, the CPU has its vector ISA (AVX-512 F/BW/VL/DQ/VBMI) and ``NO_CKERNELS_ENV``
    is not set; otherwise the accelerators run their numba kernels."""
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
    if _kernels.cpu_isa() == "scalar":
        return None, "the CPU lacks AVX-512 VBMI"
    return _kernels, ""


_CK, _CK_WHY_NOT = _compiled_kernels()
#: Records whose code-domain amax (``amax_pages``) has a compiled kernel.
_MODEL1_SEGMENTS = get_layout("flashmla-model1").segments
_FP8_SEGMENTS = get_layout("trtllm-fp8").segments


def kernel_implementation() -> str:
    """Which code runs the MODEL1 accelerators (trtllm-fp8 <-> MODEL1, MODEL1 encode and decode):
    ``"C (avx512vbmi)"``, or ``"numba (<why not C>)"``."""
    return f"C ({_CK.isa()})" if _CK is not None else f"numba ({_CK_WHY_NOT})"


def _fp8_to_model1(pages, src_scale, dst_scale, dialect, geometry, bad_count, bad_first) -> None:
    tables = _fp8_to_model1_tables(float(src_scale), ue8m0_dialect(dialect))
    if _CK is not None:
        _run_chunks(_CK.fp8_to_model1, len(bad_count), *geometry,
                    *(tables[name] for name in ("scale_lut", "bad_mag", "code_lut", "rope_lut")), bad_count, bad_first)
        return
    _run_chunks(_fp8_to_model1_kernel, len(bad_count), *geometry, src_scale == 1.0,
                *(tables[name] for name in _FP8_TO_MODEL1_TABLES), bad_count, bad_first)


def _fp8_to_mxfp8(pages, src_scale, dst_scale, dialect, geometry, bad_count, bad_first) -> None:
    tables = _fp8_to_model1_tables(float(src_scale), ue8m0_dialect(dialect))
    _run_chunks(_fp8_to_mxfp8_kernel, len(bad_count), *geometry, src_scale == 1.0,
                *(tables[name] for name in ("scale_lut", "bad_mag", "shift_sub", "code_lut")), bad_count, bad_first)


def _model1_to_fp8(pages, src_scale, dst_scale, dialect, geometry, bad_count, bad_first) -> None:
    mult, _ = _encode_params(dialect, dst_scale)
    tables = _model1_to_fp8_tables(float(mult))
    if _CK is not None:  # the C kernel also takes the multiplier (its vector code computes the rope's codes)
        _run_chunks(_CK.model1_to_fp8, len(bad_count), *geometry, *tables, bad_count, bad_first, float(mult))
        return
    _run_chunks(_model1_to_fp8_kernel, len(bad_count), *geometry, *tables, bad_count, bad_first)


def _model1_encode(x32, x16, from_bf16, n, dialect, scale, geometry) -> None:
    _, min_exp = _encode_params(dialect, scale)
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


def accelerator(src: Layout | str, dst: Layout | str):
    """The specialised kernel registered for ``src``'s and ``dst``'s records (either may be ``LATENTS``), or None."""
    key = (src if src == LATENTS else src.segments, dst if dst == LATENTS else dst.segments)
    return ACCELERATORS.get(key)


def transcode_pages(
    pages: torch.Tensor, src: Layout, src_page_size: int, dst: Layout, dst_page_size: int,
    num_tokens: int | None, src_scale: float, dst_scale: float, dialect: str | None,
    *, out: torch.Tensor | None = None, accelerated: bool = True,
) -> torch.Tensor:
    """Decode ``src`` pages and re-encode them as ``dst``, token by token (NaN/Inf in the source is an
    error), into ``out`` (every byte written) when given. ``accelerated=False`` runs the generic
    kernel even where an accelerator is registered (the tests compare the two)."""
    n = src.token_count(pages, src_page_size, num_tokens)
    out = _new_pages(dst, n, dst_page_size) if out is None else out
    if n == 0:
        return out
    sp, spb, ssplit, srb = _geometry(src, src_page_size)
    dp, dpb, dsplit, drb = _geometry(dst, dst_page_size)
    nchunks = _page_chunks(out.shape[0], dp)
    bad_count = np.zeros(nchunks, np.int64)
    bad_first = np.full(nchunks, -1, np.int64)
    fast = accelerator(src, dst) if accelerated else None
    if fast is not None:
        geometry = (_flat(pages), sp, spb, ssplit, srb, n, _flat(out), dp, dpb, dsplit, drb)
        fast(pages, src_scale, dst_scale, dialect, geometry, bad_count, bad_first)
    else:
        mult, min_exp = _encode_params(dialect, dst_scale)
        _run_chunks(
            _transcode_kernel, nchunks, _flat(pages), program(src), sp, spb, ssplit, srb, np.float32(src_scale), n,
            _flat(out), program(dst), dp, dpb, dsplit, drb, mult, min_exp,
            _E4M3_F32, _UE8M0_F32, _E2M1_F32, _POW2_F32, bad_count, bad_first,
        )
    _raise_nonfinite(bad_count, bad_first)
    return out


#: Destination fp8 writer rules of ``fp4_to_fp8_keys``: kernel rule id and amax floor.
_KEY_RULES = {"vllm": (0, 1e-4), "vllm-ue8m0": (1, 1e-4), "sglang": (2, 1e-4), "deepgemm": (2, 1e-4),
              "sglang-rocm": (2, 1e-8), "trtllm": (3, 0.0)}


def fp4_to_fp8_keys(records: torch.Tensor, dim: int, rule: str) -> tuple[torch.Tensor, float] | None:
    """fp4 indexer records ``[N, dim / 2 + dim / 32]`` -> fp8 records ``[N, dim + 4]`` written by
    ``rule`` (128-value keys for ``vllm-ue8m0``), and the max |decoded fp8 - decoded fp4|;
    byte-identical to ``indexer.transcode_keys``. None when a value decodes to NaN/Inf."""
    n, half = records.shape[0], dim // 2
    out = torch.empty(n, dim + 4, dtype=torch.uint8)
    src, dst = _flat(records), _flat(out)
    err = fp4_to_fp8_key_rows(src, records.shape[1], src[half:], records.shape[1], n, dst, dim + 4, dst[dim:], dim + 4,
                              dim, rule, measure=True)
    return None if err is None else (out, err)


@cache
def _key_code_table() -> np.ndarray:
    return _pow2_key_codes(_E2M1_F32, _UE8M0_F32)


def fp4_to_fp8_key_rows(src_keys: np.ndarray, src_stride: int, src_scales: np.ndarray, src_scale_stride: int, n: int,
                        dst_keys: np.ndarray, dst_stride: int, dst_scales: np.ndarray, dst_scale_stride: int,
                        dim: int, rule: str, *, measure: bool) -> float | None:
    """``n`` fp4 keys -> fp8 keys by ``rule``, between strided rows of flat uint8 arrays (key ``k``'s codes at
    ``keys[k * stride]``, its scale bytes at ``scales[k * scale_stride]``: records or a page's two parts);
    returns the max |decoded fp8 - decoded fp4| (0.0 unless ``measure``), None when a value decodes to NaN/Inf."""
    nchunks = -(-n // KEY_CHUNK)
    err = np.zeros(max(nchunks, 1), np.float32)
    bad = np.zeros(max(nchunks, 1), np.int64)
    rule_id, floor = _KEY_RULES[rule]
    words = (src_stride % 8 == 0 and dst_stride % 8 == 0 and src_keys.ctypes.data % 8 == 0
             and dst_keys.ctypes.data % 8 == 0 and src_keys.shape[0] % 8 == 0 and dst_keys.shape[0] % 8 == 0)
    none = np.zeros(0, np.uint64)
    if n:
        _run_chunks(_fp4_to_fp8_keys_kernel, nchunks, src_keys, src_stride, src_scales, src_scale_stride, n, dim,
                    rule_id, np.float32(floor), _E2M1_F32, _UE8M0_F32, _E4M3_F32, _key_code_table(), dst_keys,
                    dst_stride, dst_scales, dst_scale_stride, words, src_keys.view(np.uint64) if words else none,
                    dst_keys.view(np.uint64) if words else none, measure, err, bad)
    return None if bad.any() else float(err.max())


#: Moves of at most this many bytes run on the calling thread: handing a few MiB to the thread pool cost
#: more than it saved (a 128K-token request's staged gathers took 0.4-0.9x an ``np.copyto`` of their bytes
#: on one thread, 0.5-1.6x on two, at load 4-6 on 2 cores).
INLINE_MOVE_BYTES = 8 << 20


def move_rows(pool: torch.Tensor, records: torch.Tensor, runs: np.ndarray, lo: int, width: int, to_pool: bool) -> None:
    """Copy row runs between a contiguous pool tensor and contiguous records ``[N, record_bytes]``
    (``reference.move_rows``), in place; runs spread over the threads when they move more than
    ``INLINE_MOVE_BYTES``."""
    if not runs.shape[0]:
        return
    args = (pool.view(-1).numpy(), records.view(-1).numpy(), runs, records.shape[1], lo, width, to_pool)
    if int(runs[:, 2].sum()) * width <= INLINE_MOVE_BYTES:
        _move_rows_kernel(0, runs.shape[0], *args)
    else:
        _run_chunks(_move_rows_kernel, runs.shape[0], *args)


def nonfinite_flags(pages: torch.Tensor, layout: Layout, page_size: int, slots: torch.Tensor,
                    scale: float) -> torch.Tensor:
    """Per-slot non-finite flags (``reference.nonfinite_flags``; torch on CPU)."""
    return reference.nonfinite_flags(pages, layout, page_size, slots, scale)


def transcode_slots(*args) -> None:
    """Slot-list transcode in place (``reference.transcode_slots``; torch on CPU)."""
    reference.transcode_slots(*args)


def gather_transcode(*args) -> tuple[torch.Tensor, torch.Tensor]:
    """Gather-transcode into a scratch cache (``reference.gather_transcode``; torch on CPU)."""
    return reference.gather_transcode(*args)
