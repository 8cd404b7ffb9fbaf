"""Triton kernels for encode, decode, paged transcode through slot lists, and gather-transcode.

Imported lazily (only for CUDA tensors, or by the interpreter tests), so ``import kvbridge``
never imports Triton. Every entry point takes already-validated arguments (see
``kvbridge.ops.pages`` and ``kvbridge.ops.slots``) and is byte-identical to ``kvbridge.backends.reference``.

Two kernels cover everything:

- ``_convert_kernel``: one program per ``BLOCK_T`` tokens holds each token's 512 values as an
  fp32 ``[BLOCK_T, 8, 64]`` block (8 tiles of 64 dims; tile 7 is the rope). It decodes the
  source (dense fp32, ``bf16``, per-tensor E4M3, MODEL1) and encodes the destination in
  registers, so a transcode reads each source byte once and writes each destination byte once.
- ``_copy_kernel``: the byte move between layouts that store the same token record, in
  8-byte words, one launch per word range that lies on one side of both layouts' splits.

Source and destination rows are addressed by slot lists (``page * P + row``) or, when no list
is given, by the row index itself. E4M3 conversion uses the GPU's ``cvt.rn.satfinite`` through
``.to(tl.float8e4nv)`` after a clamp to +-448 when ``fp8_hardware`` is true, and integer bit
operations mirroring ``kvbridge.numerics.e4m3_encode`` otherwise: the interpreter's fp8 cast is
wrong (it does not round ties to even or saturate), so ``fp8_hardware`` is false under ``TRITON_INTERPRET=1``.
"""

from __future__ import annotations

import contextlib
import math
import os
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from functools import partial

import torch
import triton
import triton.language as tl

from kvbridge.backends.loss_stats import decoded_loss_stats
from kvbridge.backends.reference import FLAG_NONFINITE, FLAG_OUT_OF_RANGE, SpanMove, check_finite
from kvbridge.backends.reference import amax_pages as reference_amax
from kvbridge.backends.reference import decode_pages as reference_decode
from kvbridge.backends.reference import move_spans as reference_move_spans
from kvbridge.backends.triton_formats import (
    _bf16_bits,
    _bf16_to_f32,
    _e4m3_decode,
    _e4m3_encode,
    _e4m3fnuz_bits_from_f32,
    _e4m3fnuz_decode,
    _fnuz_exponent,
    _scale_exponent,
    _ue8m0_decode,
)
from kvbridge.errors import LayoutError
from kvbridge.layouts import Layout
from kvbridge.layouts.codec import HEAD_DIM, tensor_multiplier, ue8m0_dialect
from kvbridge.layouts.registry import OP_BF16, OP_ZERO
from kvbridge.numerics import DIALECT_MIN_EXPONENT, FNUZ_DIALECT_RULES, MXFP4_ROUND_UP_SQUARE, NVFP4_RCP6_BITS

#: True when the kernels below were decorated under ``TRITON_INTERPRET=1`` (CPU tensors then work).
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
#: Use the hardware fp32 <-> E4M3 conversions (GPU only); ``KVBRIDGE_TRITON_INT_E4M3=1`` forces the
#: integer path. ``scripts/gpu_check.py`` checks both byte-for-byte.
fp8_hardware = not INTERPRETED and os.environ.get("KVBRIDGE_TRITON_INT_E4M3") != "1"

name = "triton"
#: No fused fp4 -> fp8 key, state-row or KV segment kernels here: the torch rules of ``ops.keys`` and migration,
#: and staged KV records, run.
KEY_KERNELS = STATE_KERNELS = KV_SEGMENT_KERNELS = False
#: Flag values of the per-token flag array (``reference.FLAG_*``): the decoded source is not finite /
#: the slot is out of range.
_FLAG_NONFINITE = tl.constexpr(FLAG_NONFINITE)  # the same values as kernel-visible globals
_FLAG_OUT_OF_RANGE = tl.constexpr(FLAG_OUT_OF_RANGE)
#: fp32(1/6), the NVFP4 writer's amax multiplier (``numerics.NVFP4_RCP6_BITS``), exact as a Python float.
_NVFP4_RCP6 = tl.constexpr(struct.unpack("<f", struct.pack("<I", NVFP4_RCP6_BITS))[0])
#: MXFP4: an amax mantissa M (24-bit) rounds log2(amax / 6) up when M^2 >= this (``numerics.mxfp4_scale_byte``).
_MXFP4_ROUND_UP_SQUARE = tl.constexpr(MXFP4_ROUND_UP_SQUARE)

#: Launch shape (tuning knobs; ``scripts/gpu_check.py`` times alternatives): tokens per program and warps.
#: 8 tokens on 8 warps keeps each thread at 16 values (sm_90, TensorRT-LLM FP8 -> MODEL1: about 100 registers,
#: no spills, 2 programs per SM; ``scripts/triton_resources.py`` reports every kernel).
convert_block_tokens = 8
convert_warps = 8
#: None: one program per block of tokens; k: a persistent grid of k programs per SM looping over the blocks.
convert_programs_per_sm: int | None = None
copy_block_tokens = 16
copy_warps = 4


# ----------------------------------------------------------------------------- addressing


@triton.jit
def _page_of(slot, P):
    """Page of an int64 slot, divided in int32 (``_Pool`` refuses pools of 2^31 slots or more): a 64-bit
    division is a called subroutine, whose register save across the call spilled to local memory."""
    return (slot.to(tl.int32) // P).to(tl.int64)


@triton.jit
def _data_base(slot, P, PB, S: tl.constexpr, ALIGN: tl.constexpr):
    """Byte offset of a slot's data row (record bytes [0, S)): page * PB + row * S."""
    page = _page_of(slot, P)
    base = page * PB + (slot - page * P) * S
    return tl.multiple_of(base, [ALIGN, ALIGN])


@triton.jit
def _half_index(base, ALIGN: tl.constexpr):
    """An even byte offset as an index into the pool's int16 view (keeping its alignment hint)."""
    return tl.multiple_of(base // 2, [ALIGN // 2, ALIGN // 2])


@triton.jit
def _footer_base(slot, P, PB, S: tl.constexpr, R: tl.constexpr):
    """Byte offset of a block-split slot's footer (record bytes [S, R)): page * PB + P * S + row * (R - S)."""
    page = _page_of(slot, P)
    return page * PB + P * S + (slot - page * P) * (R - S)


@triton.jit
def _row_slots(slots_ptr, i, n, HAS_SLOTS: tl.constexpr):
    """Slot of each row ``i`` (from the list, or ``i`` itself); -1 for rows at or past ``n``."""
    if HAS_SLOTS:
        return tl.load(slots_ptr + i, mask=i < n, other=-1).to(tl.int64)
    else:
        return tl.where(i < n, i, -1)


# ----------------------------------------------------------------------------- record fields


@triton.jit
def _field_at(data, foot, OFF: tl.constexpr, S: tl.constexpr):
    """Byte offset of record byte ``OFF`` (data row ``data`` below the split ``S``, footer ``foot`` above)."""
    if OFF < S:
        return data + OFF
    else:
        return foot + (OFF - S)


@triton.jit
def _e2m1_value(code):
    """E2M1 code (int32 0..15) -> fp32: magnitudes 0, .5, 1, 1.5, 2, 3, 4, 6; bit 3 the sign."""
    m = code & 7
    mag = tl.where(m < 4, m.to(tl.float32) * 0.5, tl.where(m == 7, 6.0, (m - 2).to(tl.float32)))
    return tl.where((code & 8) != 0, -mag, mag)


@triton.jit
def _e2m1_code(y):
    """fp32 -> E2M1 code (int32), RNE, saturating at 6, sign kept (``numerics.e2m1_encode``)."""
    bits = y.to(tl.int32, bitcast=True)
    mag = bits & 0x7FFFFFFF
    mag = tl.where(mag > 0x7F800000, 0, mag)
    code = (mag > 0x3E800000).to(tl.int32) + (mag >= 0x3F400000).to(tl.int32) + (mag > 0x3FA00000).to(tl.int32)
    code += (mag >= 0x3FE00000).to(tl.int32) + (mag > 0x40200000).to(tl.int32) + (mag >= 0x40600000).to(tl.int32)
    code += (mag > 0x40A00000).to(tl.int32)
    return code | ((bits >> 28) & 8)


@triton.jit
def _decode_field(x, d, src, src16, data, foot, valid, scale, HW_FP8: tl.constexpr, S: tl.constexpr,
                  ALIGN: tl.constexpr,
                  OP: tl.constexpr, D0: tl.constexpr, ND: tl.constexpr, OFF: tl.constexpr, TILE: tl.constexpr,
                  SOFF: tl.constexpr):
    """``x`` ``[T, 512]`` with dims ``[D0, D0 + ND)`` replaced by one record field's decoded values."""
    seg = (d >= D0) & (d < D0 + ND)
    j = d - D0
    m = valid & seg
    at = _field_at(data, foot, OFF, S)
    if OP == 0:  # bf16 (even offsets: read through the int16 view)
        v = _bf16_to_f32(tl.load(src16 + _half_index(at, ALIGN) + j, mask=m, other=0))
    elif OP == 1:  # per-tensor E4M3
        v = _e4m3_decode(tl.load(src + at + j, mask=m, other=0).to(tl.int32), HW_FP8) * scale
    elif OP == 2:  # E4M3 tiles with UE8M0 scales
        s_at = _field_at(data, foot, SOFF, S)
        sb = tl.load(src + s_at + j // TILE, mask=m, other=127).to(tl.int32)
        v = _e4m3_decode(tl.load(src + at + j, mask=m, other=0).to(tl.int32), HW_FP8) * _ue8m0_decode(sb)
    elif OP == 5:  # E4M3 FNUZ tiles with UE8M0 scales
        s_at = _field_at(data, foot, SOFF, S)
        sb = tl.load(src + s_at + j // TILE, mask=m, other=127).to(tl.int32)
        v = _e4m3fnuz_decode(tl.load(src + at + j, mask=m, other=0).to(tl.int32)) * _ue8m0_decode(sb)
    elif OP == 7:  # E2M1 pairs with UE8M0 scales (MXFP4)
        s_at = _field_at(data, foot, SOFF, S)
        sb = tl.load(src + s_at + j // TILE, mask=m, other=127).to(tl.int32)
        byte = tl.load(src + at + j // 2, mask=m, other=0).to(tl.int32)
        v = _e2m1_value((byte >> ((j & 1) * 4)) & 0xF) * _ue8m0_decode(sb)
    elif OP == 3 or OP == 6 or OP == 9:  # E2M1 pairs with E4M3 scales (V4.1 fp4 and NVFP4 alike)
        s_at = _field_at(data, foot, SOFF, S)
        sb = tl.load(src + s_at + j // TILE, mask=m, other=0x38).to(tl.int32)
        byte = tl.load(src + at + j // 2, mask=m, other=0).to(tl.int32)
        v = _e2m1_value((byte >> ((j & 1) * 4)) & 0xF) * _e4m3_decode(sb, HW_FP8)
        if OP == 6 or OP == 9:  # NVFP4: fp32(e2m1 * scale) * g, g the global scale (``numerics.nvfp4_decode_tiles``)
            v = v * scale
    else:
        v = x
    return tl.where(seg, v, x)


@triton.jit
def _tile_amax(x, seg, BLOCK_T: tl.constexpr, TILE: tl.constexpr):
    """Per-tile max |x| over the field's dims, broadcast back to ``[T, 512]``, and per tile ``[T, 512 / TILE]``."""
    t = tl.max(tl.reshape(tl.where(seg, tl.abs(x), 0.0), [BLOCK_T, 512 // TILE, TILE]), axis=2)
    wide = tl.reshape(tl.broadcast_to(t[:, :, None], [BLOCK_T, 512 // TILE, TILE]), [BLOCK_T, 512])
    return wide, t


@triton.jit
def _tile_any(flag, BLOCK_T: tl.constexpr, TILE: tl.constexpr):
    """Per tile ``[T, 512 / TILE]``: whether any of its ``flag`` ``[T, 512]`` is set."""
    return tl.max(tl.reshape(flag.to(tl.int32), [BLOCK_T, 512 // TILE, TILE]), axis=2) > 0


@triton.jit
def _encode_field(x, d, dst, dst16, data, foot, row, valid, mult, gscale, min_exp, HW_FP8: tl.constexpr,
                  S: tl.constexpr, ALIGN: tl.constexpr, BLOCK_T: tl.constexpr, OP: tl.constexpr,
                  D0: tl.constexpr, ND: tl.constexpr, OFF: tl.constexpr, TILE: tl.constexpr, SOFF: tl.constexpr):
    """Write one record field of the values ``x`` ``[T, 512]`` (zero where not ``valid``) for rows ``row``.
    ``mult``: the per-tensor multiplier fp32(1/s); ``gscale``: s itself (NVFP4's global scale g)."""
    seg = (d >= D0) & (d < D0 + ND)
    j = d - D0
    m = row & seg
    at = _field_at(data, foot, OFF, S)
    if OP == 0:  # bf16 (even offsets: written through the int16 view)
        tl.store(dst16 + _half_index(at, ALIGN) + j, _bf16_bits(x).to(tl.int16), mask=m)
    elif OP == 1:  # per-tensor E4M3
        tl.store(dst + at + j, _e4m3_encode(x * mult, HW_FP8).to(tl.uint8), mask=m)
    elif OP == 4:  # zero bytes (d counts bytes here)
        tl.store(dst + at + d, tl.zeros_like(d).to(tl.uint8), mask=row & (d < ND))
    elif OP == 8:  # bf16 rounding of mirrored dims: applied to x before the fields (``_round_field``)
        pass
    else:
        amax, tile_amax = _tile_amax(x, seg, BLOCK_T, TILE)
        t = tl.arange(0, 512 // TILE)[None, :]
        t_seg = (t * TILE >= D0) & (t * TILE < D0 + ND)
        s_at = _field_at(data, foot, SOFF, S)
        if OP == 2:  # E4M3 tiles with UE8M0 scales 2^k
            k = _scale_exponent(amax, min_exp)
            inv = ((127 - k) << 23).to(tl.float32, bitcast=True)  # exact 2^-k
            tl.store(dst + at + j, _e4m3_encode(x * inv, HW_FP8).to(tl.uint8), mask=m)
            sb = tl.where(valid, _scale_exponent(tile_amax, min_exp) + 127, 0)
        elif OP == 5:  # E4M3 FNUZ tiles with UE8M0 scales 2^k
            k = _fnuz_exponent(amax, min_exp)
            inv = ((127 - k) << 23).to(tl.float32, bitcast=True)  # exact 2^-k
            tl.store(dst + at + j, _e4m3fnuz_bits_from_f32(x * inv).to(tl.uint8), mask=m)
            sb = tl.where(valid, _fnuz_exponent(tile_amax, min_exp) + 127, 0)
        elif OP == 6 or OP == 7 or OP == 9:  # NVFP4 / MXFP4 tiles; a NaN or Inf poisons its tile (NaN scale, codes 0)
            poison = _tile_any(((x.to(tl.int32, bitcast=True) & 0x7F800000) == 0x7F800000) & seg, BLOCK_T, TILE)
            if OP == 6 or OP == 9:  # scale e4m3(fp32(1/g) * (amax * fp32(1/6))), codes of x * fp32(1/fp32(scale * g))
                q = tl.minimum(mult * (tile_amax * _NVFP4_RCP6), 448.0)
                sb = tl.where(poison, 0x7F, _e4m3_encode(tl.where(poison, 0.0, q), HW_FP8))
                sv = tl.reshape(tl.broadcast_to(_e4m3_decode(sb, HW_FP8)[:, :, None], [BLOCK_T, 512 // TILE, TILE]),
                                [BLOCK_T, 512]) * gscale
                inv = tl.math.div_rn(tl.full(sv.shape, 1.0, tl.float32), sv)  # 1/0 = +Inf: FlashInfer's +-6
                if OP == 9:  # vLLM's writer multiplies a scale-0 tile by 0 (signed zero codes)
                    inv = tl.where(sv == 0.0, 0.0, inv)
                codes = _e2m1_code(tl.where(x == 0.0, x, x * inv))
            else:  # UE8M0 byte round(log2(amax / 6)) + 127 from amax's bits, codes of x / 2^(byte - 127)
                ab = tile_amax.to(tl.int32, bitcast=True)
                e = ab >> 23
                mant = ((ab & 0x7FFFFF) | 0x800000).to(tl.int64)
                up = (mant * mant >= _MXFP4_ROUND_UP_SQUARE).to(tl.int32)
                sb = tl.where(e == 0, 0, tl.minimum(tl.maximum(e - 3 + up, 0), 255))
                sb = tl.where(poison, 0xFF, sb)
                wide_sb = tl.reshape(tl.broadcast_to(sb[:, :, None], [BLOCK_T, 512 // TILE, TILE]), [BLOCK_T, 512])
                inv = ((254 - tl.minimum(wide_sb, 254)) << 23).to(tl.float32, bitcast=True)  # exact 2^(127 - byte)
                codes = _e2m1_code(x * inv)
            wide_poison = tl.reshape(tl.broadcast_to(poison[:, :, None], [BLOCK_T, 512 // TILE, TILE]), [BLOCK_T, 512])
            codes = tl.where(wide_poison, 0, codes)
            lo, hi = tl.split(tl.reshape(codes, [BLOCK_T, 256, 2]))
            pair = tl.arange(0, 256)[None, :]
            p_seg = (2 * pair >= D0) & (2 * pair < D0 + ND)
            tl.store(dst + at + pair - D0 // 2, (lo | (hi << 4)).to(tl.uint8), mask=row & p_seg)
            sb = tl.where(valid, sb, 0)
        else:  # E2M1 pairs with E4M3 scales e4m3(clamp(amax / 6, 2^-9, 448)), codes of x / scale
            q = tl.minimum(tl.maximum(tl.math.div_rn(tile_amax, 6.0), 0.001953125), 448.0)
            sb = _e4m3_encode(q, HW_FP8)
            sv = tl.reshape(tl.broadcast_to(_e4m3_decode(sb, HW_FP8)[:, :, None], [BLOCK_T, 512 // TILE, TILE]),
                            [BLOCK_T, 512])
            codes = _e2m1_code(tl.math.div_rn(x, sv))
            lo, hi = tl.split(tl.reshape(codes, [BLOCK_T, 256, 2]))
            pair = tl.arange(0, 256)[None, :]
            p_seg = (2 * pair >= D0) & (2 * pair < D0 + ND)
            tl.store(dst + at + pair - D0 // 2, (lo | (hi << 4)).to(tl.uint8), mask=row & p_seg)
            sb = tl.where(valid, sb, 0)
        tl.store(dst + s_at + t - D0 // TILE, sb.to(tl.uint8), mask=row & t_seg)


@triton.jit
def _round_field(x, d, OP: tl.constexpr, D0: tl.constexpr, ND: tl.constexpr):
    """``x`` with dims ``[D0, D0 + ND)`` rounded to bf16 for an ``OP_ROUND_BF16`` row (a mirror field is encoded
    from the bf16 values its first copy stores); ``x`` unchanged for any other row."""
    if OP == 8:
        seg = (d >= D0) & (d < D0 + ND)
        return tl.where(seg, ((_bf16_bits(x) & 0xFFFF) << 16).to(tl.float32, bitcast=True), x)
    else:
        return x


# ----------------------------------------------------------------------------- kernels


#: Sizes and counts change with every pool: not specialised, so one compiled kernel serves every size.
_RUNTIME_INTS = ["src_cap", "src_p", "src_pb", "dst_p", "dst_pb", "min_exp", "n_tokens", "n_rows", "n_blocks"]


@triton.jit
def _convert_rows(
    i,
    src, src16, src_slots, src_cap, src_p, src_pb, src_scale,
    dst, dst16, dst_slots, dst_p, dst_pb, dst_mult, dst_gscale, min_exp,
    flags, n_tokens, n_rows,
    SRC_PROG: tl.constexpr, SRC_NF: tl.constexpr, SRC_S: tl.constexpr, SRC_R: tl.constexpr,
    SRC_ALIGN: tl.constexpr, SRC_HAS_SLOTS: tl.constexpr,
    DST_PROG: tl.constexpr, DST_NF: tl.constexpr, DST_S: tl.constexpr, DST_R: tl.constexpr,
    DST_ALIGN: tl.constexpr, DST_HAS_SLOTS: tl.constexpr,
    CHECK: tl.constexpr, WRITE: tl.constexpr, HW_FP8: tl.constexpr,
    BLOCK_T: tl.constexpr,
):
    """Rows ``i`` (int64 ``[BLOCK_T, 1]``): decode the source token of each row, encode it into the destination.

    ``SRC_PROG``/``DST_PROG`` are the layouts' record programs (``Layout.read_segments`` / ``Layout.segments``
    flattened, 6 ints per field, ``*_NF`` fields; an empty program means dense fp32 ``[rows, 512]`` addressed by
    slot * 512). Rows ``i < n_tokens`` read source slot ``src_slots[i]`` (or i); -1 or a row past
    ``n_tokens`` has no source and is written as an all-zero record. ``CHECK`` writes ``flags[i]``
    (0, or ``FLAG_NONFINITE`` / ``FLAG_OUT_OF_RANGE``) for rows < n_tokens; ``WRITE`` writes rows < n_rows.
    """
    d = tl.arange(0, 512)[None, :]  # [1, 512] latent dim
    slot = _row_slots(src_slots, i, n_tokens, SRC_HAS_SLOTS)
    in_range = (slot >= 0) & (slot < src_cap)
    valid = (i < n_tokens) & in_range
    s = tl.where(valid, slot, 0)

    if SRC_NF == 0:
        x = tl.load(src + s * 512 + d, mask=valid, other=0.0)
    else:
        data = _data_base(s, src_p, src_pb, SRC_S, SRC_ALIGN)
        foot = _footer_base(s, src_p, src_pb, SRC_S, SRC_R)
        x = tl.zeros([BLOCK_T, 512], dtype=tl.float32)
        for k in tl.static_range(SRC_NF):
            x = _decode_field(x, d, src, src16, data, foot, valid, src_scale, HW_FP8, SRC_S, SRC_ALIGN,
                              SRC_PROG[6 * k], SRC_PROG[6 * k + 1], SRC_PROG[6 * k + 2], SRC_PROG[6 * k + 3],
                              SRC_PROG[6 * k + 4], SRC_PROG[6 * k + 5])

    if CHECK:
        bad = ((x.to(tl.int32, bitcast=True) & 0x7F800000) == 0x7F800000).to(tl.int32)  # exponent all ones
        bad_token = tl.max(bad, axis=1, keep_dims=True)
        oob = (i < n_tokens) & (slot != -1) & ~in_range
        flag = tl.where(oob, _FLAG_OUT_OF_RANGE, tl.where(valid & (bad_token > 0), _FLAG_NONFINITE, 0))
        tl.store(flags + i, flag.to(tl.uint8), mask=i < n_tokens)

    if WRITE:
        row = i < n_rows
        out = _row_slots(dst_slots, i, n_rows, DST_HAS_SLOTS)
        out = tl.where(row, out, 0)
        x = tl.where(valid, x, 0.0)
        if DST_NF == 0:
            tl.store(dst + out * 512 + d, x, mask=row)
        else:
            data = _data_base(out, dst_p, dst_pb, DST_S, DST_ALIGN)
            foot = _footer_base(out, dst_p, dst_pb, DST_S, DST_R)
            for k in tl.static_range(DST_NF):
                x = _round_field(x, d, DST_PROG[6 * k], DST_PROG[6 * k + 1], DST_PROG[6 * k + 2])
            for k in tl.static_range(DST_NF):
                _encode_field(x, d, dst, dst16, data, foot, row, valid, dst_mult, dst_gscale, min_exp, HW_FP8, DST_S,
                              DST_ALIGN,
                              BLOCK_T,
                              DST_PROG[6 * k], DST_PROG[6 * k + 1], DST_PROG[6 * k + 2], DST_PROG[6 * k + 3],
                              DST_PROG[6 * k + 4], DST_PROG[6 * k + 5])


@triton.jit(do_not_specialize=_RUNTIME_INTS)
def _convert_kernel(
    src, src16, src_slots, src_cap, src_p, src_pb, src_scale,
    dst, dst16, dst_slots, dst_p, dst_pb, dst_mult, dst_gscale, min_exp,
    flags, n_tokens, n_rows, n_blocks,
    SRC_PROG: tl.constexpr, SRC_NF: tl.constexpr, SRC_S: tl.constexpr, SRC_R: tl.constexpr,
    SRC_ALIGN: tl.constexpr, SRC_HAS_SLOTS: tl.constexpr,
    DST_PROG: tl.constexpr, DST_NF: tl.constexpr, DST_S: tl.constexpr, DST_R: tl.constexpr,
    DST_ALIGN: tl.constexpr, DST_HAS_SLOTS: tl.constexpr,
    CHECK: tl.constexpr, WRITE: tl.constexpr, HW_FP8: tl.constexpr,
    BLOCK_T: tl.constexpr, PERSISTENT: tl.constexpr,
):
    """``_convert_rows`` over ``n_blocks`` blocks of ``BLOCK_T`` rows: block ``program_id`` (one program
    per block), or with ``PERSISTENT`` every ``num_programs``-th block from ``program_id`` on."""
    rows = tl.arange(0, BLOCK_T)[:, None]
    if PERSISTENT:
        for block in tl.range(tl.program_id(0), n_blocks, tl.num_programs(0)):
            _convert_rows(
                (block * BLOCK_T + rows).to(tl.int64),  # row numbers fit int32 (the launcher's grid does too)
                src, src16, src_slots, src_cap, src_p, src_pb, src_scale,
                dst, dst16, dst_slots, dst_p, dst_pb, dst_mult, dst_gscale, min_exp, flags, n_tokens, n_rows,
                SRC_PROG, SRC_NF, SRC_S, SRC_R, SRC_ALIGN, SRC_HAS_SLOTS,
                DST_PROG, DST_NF, DST_S, DST_R, DST_ALIGN, DST_HAS_SLOTS,
                CHECK, WRITE, HW_FP8, BLOCK_T,
            )
    else:
        _convert_rows(
            tl.program_id(0).to(tl.int64) * BLOCK_T + rows,
            src, src16, src_slots, src_cap, src_p, src_pb, src_scale,
            dst, dst16, dst_slots, dst_p, dst_pb, dst_mult, dst_gscale, min_exp, flags, n_tokens, n_rows,
            SRC_PROG, SRC_NF, SRC_S, SRC_R, SRC_ALIGN, SRC_HAS_SLOTS,
            DST_PROG, DST_NF, DST_S, DST_R, DST_ALIGN, DST_HAS_SLOTS,
            CHECK, WRITE, HW_FP8, BLOCK_T,
        )


@triton.jit
def _word_at(slot, p, pw, LO: tl.constexpr, SW: tl.constexpr, RW: tl.constexpr, WA: tl.constexpr):
    """Word offset of record word ``LO`` of ``slot`` (``SW`` data words of ``RW``; data rows ``WA``-word aligned)."""
    page = _page_of(slot, p)
    row = slot - page * p
    if LO == 0:
        return tl.multiple_of(page * pw + row * SW, [WA, WA])
    elif LO < SW:
        return page * pw + row * SW + LO
    else:
        return page * pw + p * SW + row * (RW - SW) + (LO - SW)


@triton.jit(do_not_specialize=["src_cap", "src_p", "src_pw", "dst_p", "dst_pw", "n_tokens", "n_rows"])
def _copy_kernel(
    src, src_slots, src_cap, src_p, src_pw,
    dst, dst_slots, dst_p, dst_pw,
    flags, n_tokens, n_rows,
    LO: tl.constexpr, HI: tl.constexpr, W_BLOCK: tl.constexpr,
    SRC_SW: tl.constexpr, DST_SW: tl.constexpr, RW: tl.constexpr, SRC_WA: tl.constexpr, DST_WA: tl.constexpr,
    SRC_HAS_SLOTS: tl.constexpr, DST_HAS_SLOTS: tl.constexpr, CHECK: tl.constexpr, BLOCK_T: tl.constexpr,
):
    """Byte move of record words ``[LO, HI)`` (8-byte words) of identical records of ``RW`` words.

    The words lie on one side of each layout's split (``SRC_SW``/``DST_SW`` data words), so they are
    contiguous in both pools. ``src_pw``/``dst_pw`` are page sizes in words; every data row starts
    at a multiple of ``SRC_WA``/``DST_WA`` words (2 lets a thread move 16 bytes at once). Rows
    without a source become zero.
    """
    i = tl.program_id(0).to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)[:, None]  # [T, 1]
    slot = _row_slots(src_slots, i, n_tokens, SRC_HAS_SLOTS)
    valid = (i < n_tokens) & (slot >= 0) & (slot < src_cap)
    s = tl.where(valid, slot, 0)
    row = i < n_rows
    out = tl.where(row, _row_slots(dst_slots, i, n_rows, DST_HAS_SLOTS), 0)
    if CHECK:
        oob = (i < n_tokens) & (slot != -1) & ~valid
        tl.store(flags + i, tl.where(oob, _FLAG_OUT_OF_RANGE, 0).to(tl.uint8), mask=i < n_tokens)
    w = tl.arange(0, W_BLOCK)[None, :]
    src_at = _word_at(s, src_p, src_pw, LO, SRC_SW, RW, SRC_WA)
    dst_at = _word_at(out, dst_p, dst_pw, LO, DST_SW, RW, DST_WA)
    words = tl.load(src + src_at + w, mask=valid & (w < HI - LO), other=0)
    tl.store(dst + dst_at + w, words, mask=row & (w < HI - LO))


# ----------------------------------------------------------------------------- host side


def program(layout: Layout, read: bool = False) -> tuple[int, ...]:
    """``layout.segments`` (``read``: ``layout.read_segments``, what decoders execute) flattened (6 ints per
    field): the record program the kernels take as a constexpr."""
    return tuple(v for seg in (layout.read_segments if read else layout.segments) for v in seg)


def supports(*layouts: Layout) -> bool:
    """True when every layout's pages, data rows and footers are 8-byte multiples (the copy kernel's words),
    its bf16 fields start on even bytes (the int16 view) and its pad fields fit the 512-lane zero store."""
    for lay in layouts:
        if lay.record_bytes % 8 or (lay.split or 0) % 8 or lay.page_bytes(1) % 8 or lay.page_align % 8 > 1:
            return False
        for seg in lay.segments:
            if (seg.op == OP_ZERO and seg.ndims > HEAD_DIM) or (seg.op == OP_BF16 and seg.offset % 2):
                return False
    return True


def accepts(*tensors: torch.Tensor) -> bool:
    """True when every tensor is contiguous and starts on a 16-byte boundary (the kernels' word views)."""
    return aligned(*tensors)


def aligned(*tensors: torch.Tensor) -> bool:
    """True when every tensor is contiguous and starts on a 16-byte boundary (the kernels' word views)."""
    return all(t.is_contiguous() and t.data_ptr() % 16 == 0 for t in tensors)


@dataclass(frozen=True)
class Side:
    """What the kernels specialise on for one side: a layout at a page size, or dense fp32 ``[rows, 512]``.

    ``program``: the record program (empty for dense), ``read_program`` what a decode of this side runs (mirror
    fields left out); ``split``/``record``: data-row / record bytes;
    ``page_bytes``: bytes per page (padding included); ``align``: the largest power of two <= 16
    dividing every data row's byte offset.
    """

    program: tuple[int, ...] = ()
    read_program: tuple[int, ...] = ()
    split: int = 0
    record: int = 0
    page_bytes: int = 0
    align: int = 16


def side(layout: Layout | None, page_size: int = 1) -> Side:
    """The kernels' view of ``layout`` at ``page_size`` (``None``: dense fp32); ``LayoutError`` if unsupported."""
    if layout is None:
        return Side()
    if not supports(layout):
        raise LayoutError(f"layout {layout.name} has no Triton kernel (its rows are not 8-byte multiples)")
    split = layout.split if layout.split is not None else layout.record_bytes
    page_bytes = layout.page_bytes(page_size)
    return Side(program(layout), program(layout, read=True), split, layout.record_bytes, page_bytes,
                math.gcd(page_bytes, split, 16))


@dataclass(frozen=True)
class Launch:
    """One kernel launch's compile-time configuration: the constexpr arguments and ``num_warps``."""

    constexprs: dict
    num_warps: int


def convert_launch(src: Side, dst: Side, *, src_slots: bool, dst_slots: bool, check: bool, write: bool,
                   hw_fp8: bool) -> Launch:
    """The ``_convert_kernel`` specialisation of a launch from ``src`` to ``dst`` (what every launch site uses)."""
    return Launch(dict(
        SRC_PROG=src.read_program, SRC_NF=len(src.read_program) // 6, SRC_S=src.split, SRC_R=src.record,
        SRC_ALIGN=src.align, SRC_HAS_SLOTS=src_slots,
        DST_PROG=dst.program, DST_NF=len(dst.program) // 6, DST_S=dst.split, DST_R=dst.record,
        DST_ALIGN=dst.align, DST_HAS_SLOTS=dst_slots,
        CHECK=check, WRITE=write, HW_FP8=hw_fp8,
        BLOCK_T=convert_block_tokens, PERSISTENT=convert_programs_per_sm is not None,
    ), convert_warps)


def copy_launches(src: Side, dst: Side, *, src_slots: bool, dst_slots: bool, check: bool) -> list[Launch]:
    """The ``_copy_kernel`` launches of one byte move: one per word range on one side of both layouts' splits."""
    if src.record != dst.record:
        raise LayoutError("a byte move needs records of the same size on both sides")
    rw, ssw, dsw = src.record // 8, src.split // 8, dst.split // 8
    cuts = sorted({0, ssw, dsw, rw})
    return [Launch(dict(
        LO=lo, HI=hi, W_BLOCK=triton.next_power_of_2(hi - lo), SRC_SW=ssw, DST_SW=dsw, RW=rw,
        SRC_WA=math.gcd(src.align // 8, 2), DST_WA=math.gcd(dst.align // 8, 2),
        SRC_HAS_SLOTS=src_slots, DST_HAS_SLOTS=dst_slots, CHECK=check and k == 0, BLOCK_T=copy_block_tokens,
    ), copy_warps) for k, (lo, hi) in enumerate(zip(cuts[:-1], cuts[1:], strict=True))]


class _Pool:
    """Kernel arguments describing one side: a paged pool of a layout, or dense fp32 ``[rows, 512]``."""

    def __init__(self, tensor: torch.Tensor, layout: Layout | None = None, page_size: int = 1):
        if tensor.shape[0] * page_size >= 2**31:  # the kernels divide slot numbers in int32 (``_page_of``)
            raise LayoutError(f"a pool of {tensor.shape[0] * page_size} slots is over the Triton kernels' 2^31; "
                              "transcode it in parts of fewer pages")
        self.tensor = tensor
        self.page_size = page_size
        self.side = side(layout, page_size)
        self.half = tensor if layout is None else tensor.view(torch.int16)

    @property
    def capacity(self) -> int:
        return self.tensor.shape[0] * self.page_size


def hardware_fp8_available(device: torch.device) -> bool:
    """True on a CUDA device with native E4M3 conversions (compute capability 8.9 or newer)."""
    return device.type == "cuda" and not INTERPRETED and torch.cuda.get_device_capability(device) >= (8, 9)


def _sm_count(pool: _Pool) -> int:
    """Streaming multiprocessors of the pool's GPU (2 under the interpreter, to exercise the loop)."""
    if not pool.tensor.is_cuda:
        return 2
    return torch.cuda.get_device_properties(pool.tensor.device).multi_processor_count


def _device_guard(t: torch.Tensor) -> contextlib.AbstractContextManager:
    """Launch on ``t``'s GPU (a no-op for CPU tensors under the interpreter)."""
    return torch.cuda.device(t.device) if t.is_cuda else contextlib.nullcontext()


def _launch_convert(
    src: _Pool, dst: _Pool, *, n_tokens: int, n_rows: int, src_slots: torch.Tensor | None = None,
    dst_slots: torch.Tensor | None = None, src_scale: float = 1.0, dst_mult: float = 1.0,
    dst_gscale: float = 1.0, min_exp: int = 0, flags: torch.Tensor | None = None, write: bool = True,
) -> None:
    rows = n_rows if write else n_tokens
    if rows == 0:
        return
    dummy = src.tensor
    n_blocks = triton.cdiv(rows, convert_block_tokens)
    grid = (n_blocks if convert_programs_per_sm is None else min(n_blocks, convert_programs_per_sm * _sm_count(src)),)
    launch = convert_launch(src.side, dst.side, src_slots=src_slots is not None, dst_slots=dst_slots is not None,
                            check=flags is not None, write=write,
                            hw_fp8=fp8_hardware and hardware_fp8_available(src.tensor.device))
    with _device_guard(src.tensor):
        _convert_kernel[grid](
            src.tensor, src.half, dummy if src_slots is None else src_slots, src.capacity, src.page_size,
            src.side.page_bytes, src_scale,
            dst.tensor, dst.half, dummy if dst_slots is None else dst_slots, dst.page_size, dst.side.page_bytes,
            dst_mult, dst_gscale, min_exp,
            dummy if flags is None else flags, n_tokens, n_rows, n_blocks,
            **launch.constexprs, num_warps=launch.num_warps,
        )


def _launch_copy(
    src: _Pool, dst: _Pool, *, n_tokens: int, n_rows: int, src_slots: torch.Tensor | None = None,
    dst_slots: torch.Tensor | None = None, flags: torch.Tensor | None = None,
) -> None:
    if n_rows == 0:
        return
    words = src.tensor.view(torch.int64)
    launches = copy_launches(src.side, dst.side, src_slots=src_slots is not None, dst_slots=dst_slots is not None,
                             check=flags is not None)
    grid = (triton.cdiv(n_rows, copy_block_tokens),)
    with _device_guard(src.tensor):
        for launch in launches:
            _copy_kernel[grid](
                words, words if src_slots is None else src_slots, src.capacity, src.page_size,
                src.side.page_bytes // 8, dst.tensor.view(torch.int64), words if dst_slots is None else dst_slots,
                dst.page_size, dst.side.page_bytes // 8, words if flags is None else flags, n_tokens, n_rows,
                **launch.constexprs, num_warps=launch.num_warps,
            )


def _empty_pages(layout: Layout, num_tokens: int, page_size: int, device: torch.device) -> torch.Tensor:
    """Uninitialised pages for ``num_tokens`` tokens with the padding tail (past P * record) zeroed.

    The kernels write every row of every page (rows without a token as zeros), so only the tail is set here.
    """
    pages = torch.empty(layout.num_pages(num_tokens, page_size), layout.page_bytes(page_size), dtype=torch.uint8,
                        device=device)
    pages[:, page_size * layout.record_bytes :] = 0
    return pages


def _output_pages(out: torch.Tensor | None, layout: Layout, num_tokens: int, page_size: int,
                  device: torch.device) -> torch.Tensor:
    """``out`` (its padding tail zeroed) or fresh pages for the kernels to fill."""
    if out is None:
        return _empty_pages(layout, num_tokens, page_size, device)
    out[:, page_size * layout.record_bytes :] = 0
    return out


def _encode_args(layout: Layout, dialect: str | None, scale: float) -> dict:
    """Runtime encoder arguments: the per-tensor multiplier fp32(1/s), s itself (NVFP4's global scale) and the
    UE8M0 rule's exponent floor."""
    if dialect in FNUZ_DIALECT_RULES:  # a FNUZ destination: its dialect's floor also names its rule
        return {"min_exp": FNUZ_DIALECT_RULES[dialect][0], "dst_mult": 1.0, "dst_gscale": scale}
    floor = DIALECT_MIN_EXPONENT[ue8m0_dialect(dialect)]
    if floor <= -135:  # _scale_exponent sends zero / fp32-subnormal amax (k <= -135) straight to the floor
        raise LayoutError(f"dialect {dialect!r}: scale floor 2^{floor} is below what the kernel handles")
    return {"min_exp": floor, "dst_mult": tensor_multiplier(dialect, scale), "dst_gscale": scale}


def all_finite(x: torch.Tensor) -> bool:
    return not bool((~torch.isfinite(x)).any())


def _into(out: torch.Tensor | None, result: torch.Tensor) -> torch.Tensor:
    return result if out is None else out.copy_(result)


def encode_pages(x: torch.Tensor, layout: Layout, page_size: int, dialect: str | None, scale: float,
                 *, out: torch.Tensor | None = None) -> torch.Tensor:
    """fp32 or bf16 ``[N, 512]`` (finite) -> pages ``[ceil(N/P), page_bytes]`` (``reference.encode_pages``),
    written straight into ``out`` when given."""
    x = x.float().contiguous()
    n = x.shape[0]
    pages = _output_pages(out, layout, n, page_size, x.device)
    dst = _Pool(pages, layout, page_size)
    _launch_convert(_Pool(x), dst, n_tokens=n, n_rows=pages.shape[0] * page_size,
                    **_encode_args(layout, dialect, scale))
    return pages


def decode_pages(pages: torch.Tensor, layout: Layout, page_size: int, num_tokens: int | None,
                 scale: float, *, out: torch.Tensor | None = None) -> torch.Tensor:
    """Pages -> fp32 ``[num_tokens, 512]`` (``reference.decode_pages``), written straight into ``out`` when given."""
    n = layout.token_count(pages, page_size, num_tokens)
    if out is None:
        out = torch.empty(n, HEAD_DIM, dtype=torch.float32, device=pages.device)
    _launch_convert(_Pool(pages, layout, page_size), _Pool(out), n_tokens=n, n_rows=n, src_scale=scale)
    return out


def repage(pages: torch.Tensor, src: Layout, src_page_size: int, dst: Layout, dst_page_size: int,
           num_tokens: int | None, *, out: torch.Tensor | None = None) -> torch.Tensor:
    """Byte move of identical records between page geometries (``reference.repage``), into ``out`` when given."""
    n = src.token_count(pages, src_page_size, num_tokens)
    out = _output_pages(out, dst, n, dst_page_size, pages.device)
    _launch_copy(_Pool(pages, src, src_page_size), _Pool(out, dst, dst_page_size), n_tokens=n,
                 n_rows=out.shape[0] * dst_page_size)
    return out


def transcode_pages(
    pages: torch.Tensor, src: Layout, src_page_size: int, dst: Layout, dst_page_size: int,
    num_tokens: int | None, src_scale: float, dst_scale: float, dialect: str | None,
    *, out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Decode + re-encode a whole pool in one launch (``reference.transcode_pages``), into ``out`` when given.

    The kernel flags tokens that decode to NaN/Inf; if any, ``NonFiniteError`` is raised (into a
    fresh output nothing the caller holds was written; a given ``out`` may be partly written).
    """
    n = src.token_count(pages, src_page_size, num_tokens)
    out = _output_pages(out, dst, n, dst_page_size, pages.device)
    flags = torch.empty(n, dtype=torch.uint8, device=pages.device)
    _launch_convert(_Pool(pages, src, src_page_size), _Pool(out, dst, dst_page_size), n_tokens=n,
                    n_rows=out.shape[0] * dst_page_size, src_scale=src_scale, flags=flags,
                    **_encode_args(dst, dialect, dst_scale))
    if bool(flags.any()):  # error path only: the reference names the first bad token and dim
        check_finite(reference_decode(pages, src, src_page_size, n, src_scale))
    return out


def amax_pages(pages: torch.Tensor, layout: Layout, page_size: int, num_tokens: int | None,
               scale: float) -> float | None:
    """Largest |decoded value| (None when one is NaN/Inf): the torch reference, on the GPU."""
    return reference_amax(pages, layout, page_size, num_tokens, scale)


def move_spans(moves: Sequence[SpanMove], into_pool: bool = False) -> None:
    """Row copies between tensors (``reference.move_spans``): torch copies, on the GPU."""
    reference_move_spans(moves, into_pool)


def nonfinite_flags(pages: torch.Tensor, layout: Layout, page_size: int, slots: torch.Tensor,
                    scale: float) -> torch.Tensor:
    """Per-slot flags (``FLAG_NONFINITE`` or 0) of the decoded tokens at ``slots``; reads only."""
    flags = torch.empty(slots.numel(), dtype=torch.uint8, device=pages.device)
    src = _Pool(pages, layout, page_size)
    _launch_convert(src, src, n_tokens=slots.numel(), n_rows=0, src_slots=slots, src_scale=scale, flags=flags,
                    write=False)
    return flags


def transcode_slots(
    src_pages: torch.Tensor, src: Layout, src_page_size: int, dst_pages: torch.Tensor, dst: Layout,
    dst_page_size: int, src_slots: torch.Tensor, dst_slots: torch.Tensor, src_scale: float, dst_scale: float,
    dialect: str | None, byte_move: bool,
) -> None:
    """Write source slot ``src_slots[i]`` into ``dst_slots[i]`` in place, one launch (slots already
    validated, sources already checked finite by ``nonfinite_flags`` when re-encoding)."""
    n = src_slots.numel()
    s_pool, d_pool = _Pool(src_pages, src, src_page_size), _Pool(dst_pages, dst, dst_page_size)
    if byte_move:
        _launch_copy(s_pool, d_pool, n_tokens=n, n_rows=n, src_slots=src_slots, dst_slots=dst_slots)
        return
    _launch_convert(s_pool, d_pool, n_tokens=n, n_rows=n, src_slots=src_slots, dst_slots=dst_slots,
                    src_scale=src_scale, **_encode_args(dst, dialect, dst_scale))


def gather_transcode(
    pool: torch.Tensor, layout: Layout, page_size: int, indices: torch.Tensor, scale: float,
    dialect: str | None, byte_move: bool, out_page_size: int, scratch_layout: Layout,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Write the token of each flat index k (-1: zeros) as ``scratch_layout`` row k; returns ``(scratch, flags)``.

    ``flags[k]``: ``FLAG_OUT_OF_RANGE`` (nothing read) or ``FLAG_NONFINITE``; the caller raises.
    """
    n = indices.numel()
    scratch = _empty_pages(scratch_layout, n, out_page_size, pool.device)
    flags = torch.empty(n, dtype=torch.uint8, device=pool.device)
    src, dst = _Pool(pool, layout, page_size), _Pool(scratch, scratch_layout, out_page_size)
    rows = scratch.shape[0] * out_page_size
    if byte_move:
        _launch_copy(src, dst, n_tokens=n, n_rows=rows, src_slots=indices, flags=flags)
    else:
        _launch_convert(src, dst, n_tokens=n, n_rows=rows, src_slots=indices, src_scale=scale, flags=flags,
                        **_encode_args(scratch_layout, dialect, 1.0))
    return scratch, flags


#: ``dispatch.loss_stats``: both pools decoded by the Triton decoder and compared (``loss_stats.decoded_loss_stats``).
loss_stats = partial(decoded_loss_stats, decode_pages)
