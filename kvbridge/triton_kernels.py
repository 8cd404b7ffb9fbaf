"""Triton kernels for encode, decode, paged transcode through slot lists, and gather-transcode.

Imported lazily (only for CUDA tensors, or by the interpreter tests), so ``import kvbridge``
never imports Triton. Every entry point takes already-validated arguments (see
``kvbridge.api`` and ``kvbridge.paged``) and is byte-identical to ``kvbridge.reference``.

Two kernels cover everything:

- ``_convert_kernel``: one program per ``BLOCK_T`` tokens holds each token's 512 values as an
  fp32 ``[BLOCK_T, 8, 64]`` block (8 tiles of 64 dims; tile 7 is the rope). It decodes the
  source (dense fp32, ``bf16``, per-tensor E4M3, MODEL1) and encodes the destination in
  registers, so a transcode reads each source byte once and writes each destination byte once.
- ``_copy_kernel``: the byte move between layouts that store the same token record, in
  8-byte words (every built-in layout's page size, data row and footer row is a multiple of 8 B).

Source and destination rows are addressed by slot lists (``page * P + row``) or, when no list
is given, by the row index itself. E4M3 conversion uses the GPU's ``cvt.rn.satfinite`` through
``.to(tl.float8e4nv)`` after a clamp to +-448 when ``fp8_hardware`` is true, and integer bit
operations mirroring ``kvbridge.numerics.e4m3_encode`` otherwise: the interpreter's fp8 cast is
wrong (spec section 2), so ``fp8_hardware`` is false under ``TRITON_INTERPRET=1``.
"""

from __future__ import annotations

import contextlib
import math
import os

import torch
import triton
import triton.language as tl

from kvbridge.codecs import HEAD_DIM, BF16Codec, Model1Codec, PerTensorE4M3Codec, reciprocal_f32
from kvbridge.errors import LayoutError
from kvbridge.layouts import Layout
from kvbridge.numerics import DIALECT_MIN_EXPONENT
from kvbridge.reference import check_finite
from kvbridge.reference import decode_pages as reference_decode

#: True when the kernels below were decorated under ``TRITON_INTERPRET=1`` (CPU tensors then work).
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
#: Use the hardware fp32 <-> E4M3 conversions (GPU only); ``KVBRIDGE_TRITON_INT_E4M3=1`` forces the
#: integer path. ``scripts/gpu_check.py`` checks both byte-for-byte.
fp8_hardware = not INTERPRETED and os.environ.get("KVBRIDGE_TRITON_INT_E4M3") != "1"

#: Flag values of the per-token flag array: the decoded source is not finite / the slot is out of range.
FLAG_NONFINITE = 1
FLAG_OUT_OF_RANGE = 2
_FLAG_NONFINITE = tl.constexpr(FLAG_NONFINITE)  # the same values as kernel-visible globals
_FLAG_OUT_OF_RANGE = tl.constexpr(FLAG_OUT_OF_RANGE)

_KIND_F32, _KIND_BF16, _KIND_E4M3, _KIND_MODEL1 = 0, 1, 2, 3
#: Launch shape (tuning knobs; ``scripts/gpu_check.py`` times alternatives): tokens per program and warps.
#: 8 tokens on 8 warps keeps each thread at 16 values (sm_90: 70 registers, no spills, 3 programs per SM).
convert_block_tokens = 8
convert_warps = 8
#: None: one program per block of tokens; k: a persistent grid of k programs per SM looping over the blocks.
convert_programs_per_sm: int | None = None
copy_block_tokens = 16
copy_warps = 4


# ----------------------------------------------------------------------------- number formats


@triton.jit
def _e4m3_bits_from_f32(x):
    """fp32 -> E4M3 code (int32 0..255), RNE, saturating to +-448: ``numerics.e4m3_encode`` in Triton ops."""
    bits = x.to(tl.int32, bitcast=True)
    sign = (bits >> 24) & 0x80
    mag = bits & 0x7FFFFFFF
    exp = mag >> 23
    lsb = (mag >> 20) & 1
    normal = ((mag + 0x7FFFF + lsb) >> 20) - (120 << 3)
    mant24 = (mag & 0x7FFFFF) | 0x800000
    shift = tl.minimum(tl.maximum(141 - exp, 1), 25)  # 14 - (exp - 127); >= 25 always rounds to 0
    q = mant24 >> shift
    rem = mant24 - (q << shift)
    half = 1 << (shift - 1)
    round_up = (rem > half) | ((rem == half) & ((q & 1) == 1))
    sub = tl.where(exp == 0, 0, q + round_up.to(tl.int32))
    code = tl.where(exp >= 121, normal, sub)  # 121 = biased fp32 exponent of 2^-6
    code = tl.where(mag >= 0x43E00000, 0x7E, code)  # |x| >= 448 saturates
    return code | sign


@triton.jit
def _e4m3_encode(x, HW_FP8: tl.constexpr):
    """fp32 -> E4M3 byte values as int32 (0..255)."""
    if HW_FP8:
        clamped = tl.minimum(tl.maximum(x, -448.0), 448.0)
        return clamped.to(tl.float8e4nv).to(tl.uint8, bitcast=True).to(tl.int32)
    else:
        return _e4m3_bits_from_f32(x)


@triton.jit
def _e4m3_decode(code, HW_FP8: tl.constexpr):
    """E4M3 code (int32 0..255) -> fp32, exact; 0x7F / 0xFF give NaN."""
    if HW_FP8:
        return code.to(tl.uint8).to(tl.float8e4nv, bitcast=True).to(tl.float32)
    else:
        e = (code >> 3) & 0xF
        m = code & 7
        normal = (((e + 120) << 23) | (m << 20)).to(tl.float32, bitcast=True)
        mag = tl.where(e == 0, m.to(tl.float32) * 0.001953125, normal)  # subnormal: m * 2^-9
        mag = tl.where((code & 0x7F) == 0x7F, float("nan"), mag)
        return tl.where(code >= 128, -mag, mag)


@triton.jit
def _ue8m0_decode(byte):
    """UE8M0 byte (int32) -> fp32 2^(byte - 127); 0 gives the subnormal 2^-127, 0xFF NaN."""
    bits = tl.where(byte == 0, 0x00400000, byte << 23)
    bits = tl.where(byte == 255, 0x7FC00000, bits)
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _bf16_bits(x):
    """fp32 -> bf16 bit pattern (int32, low 16 bits meaningful), round-to-nearest-even; finite input."""
    bits = x.to(tl.int32, bitcast=True)
    return (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16


@triton.jit
def _bf16_to_f32(half):
    """bf16 bit pattern (int16, sign-extended to int32) -> fp32, exact."""
    return (half.to(tl.int32) << 16).to(tl.float32, bitcast=True)


@triton.jit
def _scale_exponent(amax, min_exp):
    """max(ceil(log2(amax / 448)), min_exp) for fp32 amax >= 0 (``numerics.scale_exponent``).

    amax = M * 2^E, 448 = 1.75 * 2^8: E - 8, plus one when M > 1.75. Zero and fp32-subnormal
    amax fall below every dialect's floor (>= 2^-35), so they take ``min_exp`` directly.
    """
    bits = amax.to(tl.int32, bitcast=True)
    exp = bits >> 23
    k = exp - 135 + ((bits & 0x7FFFFF) > 0x600000).to(tl.int32)
    return tl.where(exp == 0, min_exp, tl.maximum(k, min_exp))


# ----------------------------------------------------------------------------- addressing


@triton.jit
def _data_base(slot, P, PB, S: tl.constexpr, ALIGN: tl.constexpr):
    """Byte offset of a slot's data row (record bytes [0, S)): page * PB + row * S."""
    page = slot // P
    base = page * PB + (slot - page * P) * S
    return tl.multiple_of(base, [ALIGN, ALIGN, ALIGN])


@triton.jit
def _half_index(base, ALIGN: tl.constexpr):
    """A data-row byte offset (even) as an index into the pool's int16 view."""
    return tl.multiple_of(base // 2, [ALIGN // 2, ALIGN // 2, ALIGN // 2])


@triton.jit
def _footer_base(slot, P, PB, S: tl.constexpr, R: tl.constexpr):
    """Byte offset of a block-split slot's footer (record bytes [S, R)): page * PB + P * S + row * (R - S)."""
    page = slot // P
    return page * PB + P * S + (slot - page * P) * (R - S)


@triton.jit
def _row_slots(slots_ptr, i, n, HAS_SLOTS: tl.constexpr):
    """Slot of each row ``i`` (from the list, or ``i`` itself); -1 for rows at or past ``n``."""
    if HAS_SLOTS:
        return tl.load(slots_ptr + i, mask=i < n, other=-1).to(tl.int64)
    else:
        return tl.where(i < n, i, -1)


# ----------------------------------------------------------------------------- kernels


#: Sizes and counts change with every pool: not specialised, so one compiled kernel serves every size.
_RUNTIME_INTS = ["src_cap", "src_p", "src_pb", "dst_p", "dst_pb", "min_exp", "n_tokens", "n_rows", "n_blocks"]


@triton.jit
def _convert_rows(
    i,
    src, src16, src_slots, src_cap, src_p, src_pb, src_scale,
    dst, dst16, dst_slots, dst_p, dst_pb, dst_mult, min_exp,
    flags, n_tokens, n_rows,
    SRC_KIND: tl.constexpr, SRC_S: tl.constexpr, SRC_R: tl.constexpr, SRC_ALIGN: tl.constexpr,
    SRC_HAS_SLOTS: tl.constexpr,
    DST_KIND: tl.constexpr, DST_S: tl.constexpr, DST_R: tl.constexpr, DST_ALIGN: tl.constexpr,
    DST_HAS_SLOTS: tl.constexpr,
    CHECK: tl.constexpr, WRITE: tl.constexpr, HW_FP8: tl.constexpr,
    BLOCK_T: tl.constexpr,
):
    """Rows ``i`` (int64 ``[BLOCK_T, 1, 1]``): decode the source token of each row, encode it into the destination.

    Rows ``i < n_tokens`` read source slot ``src_slots[i]`` (or i); -1 or a row past ``n_tokens``
    has no source and is written as an all-zero record. ``CHECK`` writes ``flags[i]`` (0, or
    ``FLAG_NONFINITE`` / ``FLAG_OUT_OF_RANGE``) for rows < n_tokens; ``WRITE`` writes rows < n_rows.
    Dense fp32 sources/destinations are ``[rows, 512]`` addressed by slot * 512.
    """
    tile = tl.arange(0, 8)[None, :, None]  # [1, 8, 1]
    d = tile * 64 + tl.arange(0, 64)[None, None, :]  # [1, 8, 64] latent dim
    nope = d < 448
    slot = _row_slots(src_slots, i, n_tokens, SRC_HAS_SLOTS)
    in_range = (slot >= 0) & (slot < src_cap)
    valid = (i < n_tokens) & in_range
    s = tl.where(valid, slot, 0)

    if SRC_KIND == 0:
        x = tl.load(src + s * 512 + d, mask=valid, other=0.0)
    elif SRC_KIND == 1:
        base16 = _half_index(_data_base(s, src_p, src_pb, SRC_S, SRC_ALIGN), SRC_ALIGN)
        x = _bf16_to_f32(tl.load(src16 + base16 + d, mask=valid, other=0))
    elif SRC_KIND == 2:
        base = _data_base(s, src_p, src_pb, SRC_S, SRC_ALIGN)
        x = _e4m3_decode(tl.load(src + base + d, mask=valid, other=0).to(tl.int32), HW_FP8) * src_scale
    else:
        base = _data_base(s, src_p, src_pb, SRC_S, SRC_ALIGN)
        codes = tl.load(src + base + d, mask=valid & nope, other=0).to(tl.int32)
        base16 = _half_index(base, SRC_ALIGN)
        rope = tl.load(src16 + base16 + 224 + (d - 448), mask=valid & (d >= 448), other=0)
        foot = _footer_base(s, src_p, src_pb, SRC_S, SRC_R)
        scale_byte = tl.load(src + foot + tile, mask=valid & (tile < 7), other=127).to(tl.int32)
        x = tl.where(nope, _e4m3_decode(codes, HW_FP8) * _ue8m0_decode(scale_byte), _bf16_to_f32(rope))

    if CHECK:
        bad = ((x.to(tl.int32, bitcast=True) & 0x7F800000) == 0x7F800000).to(tl.int32)  # exponent all ones
        bad_token = tl.max(tl.max(bad, axis=2, keep_dims=True), axis=1, keep_dims=True)
        oob = (i < n_tokens) & (slot != -1) & ~in_range
        flag = tl.where(oob, _FLAG_OUT_OF_RANGE, tl.where(valid & (bad_token > 0), _FLAG_NONFINITE, 0))
        tl.store(flags + i, flag.to(tl.uint8), mask=i < n_tokens)

    if WRITE:
        row = i < n_rows
        out = _row_slots(dst_slots, i, n_rows, DST_HAS_SLOTS)
        out = tl.where(row, out, 0)
        x = tl.where(valid, x, 0.0)
        if DST_KIND == 0:
            tl.store(dst + out * 512 + d, x, mask=row)
        elif DST_KIND == 1:
            base16 = _half_index(_data_base(out, dst_p, dst_pb, DST_S, DST_ALIGN), DST_ALIGN)
            tl.store(dst16 + base16 + d, _bf16_bits(x).to(tl.int16), mask=row)
        elif DST_KIND == 2:
            base = _data_base(out, dst_p, dst_pb, DST_S, DST_ALIGN)
            tl.store(dst + base + d, _e4m3_encode(x * dst_mult, HW_FP8).to(tl.uint8), mask=row)
        else:
            amax = tl.max(tl.where(nope, tl.abs(x), 0.0), axis=2, keep_dims=True)  # [T, 8, 1]
            k = _scale_exponent(amax, min_exp)
            inv = ((127 - k) << 23).to(tl.float32, bitcast=True)  # exact 2^-k
            base = _data_base(out, dst_p, dst_pb, DST_S, DST_ALIGN)
            tl.store(dst + base + d, _e4m3_encode(x * inv, HW_FP8).to(tl.uint8), mask=row & nope)
            base16 = _half_index(base, DST_ALIGN)
            tl.store(dst16 + base16 + 224 + (d - 448), _bf16_bits(x).to(tl.int16), mask=row & (d >= 448))
            foot = _footer_base(out, dst_p, dst_pb, DST_S, DST_R)
            footer = tl.where(valid & (tile < 7), k + 127, 0)  # 7 UE8M0 scales, then the pad byte 0
            tl.store(dst + foot + tile, footer.to(tl.uint8), mask=row)


@triton.jit(do_not_specialize=_RUNTIME_INTS)
def _convert_kernel(
    src, src16, src_slots, src_cap, src_p, src_pb, src_scale,
    dst, dst16, dst_slots, dst_p, dst_pb, dst_mult, min_exp,
    flags, n_tokens, n_rows, n_blocks,
    SRC_KIND: tl.constexpr, SRC_S: tl.constexpr, SRC_R: tl.constexpr, SRC_ALIGN: tl.constexpr,
    SRC_HAS_SLOTS: tl.constexpr,
    DST_KIND: tl.constexpr, DST_S: tl.constexpr, DST_R: tl.constexpr, DST_ALIGN: tl.constexpr,
    DST_HAS_SLOTS: tl.constexpr,
    CHECK: tl.constexpr, WRITE: tl.constexpr, HW_FP8: tl.constexpr,
    BLOCK_T: tl.constexpr, PERSISTENT: tl.constexpr,
):
    """``_convert_rows`` over ``n_blocks`` blocks of ``BLOCK_T`` rows: block ``program_id`` (one program
    per block), or with ``PERSISTENT`` every ``num_programs``-th block from ``program_id`` on."""
    rows = tl.arange(0, BLOCK_T)[:, None, None]
    if PERSISTENT:
        for block in tl.range(tl.program_id(0), n_blocks, tl.num_programs(0)):
            _convert_rows(
                (block * BLOCK_T + rows).to(tl.int64),  # row numbers fit int32 (the launcher's grid does too)
                src, src16, src_slots, src_cap, src_p, src_pb, src_scale,
                dst, dst16, dst_slots, dst_p, dst_pb, dst_mult, min_exp, flags, n_tokens, n_rows,
                SRC_KIND, SRC_S, SRC_R, SRC_ALIGN, SRC_HAS_SLOTS, DST_KIND, DST_S, DST_R, DST_ALIGN, DST_HAS_SLOTS,
                CHECK, WRITE, HW_FP8, BLOCK_T,
            )
    else:
        _convert_rows(
            tl.program_id(0).to(tl.int64) * BLOCK_T + rows,
            src, src16, src_slots, src_cap, src_p, src_pb, src_scale,
            dst, dst16, dst_slots, dst_p, dst_pb, dst_mult, min_exp, flags, n_tokens, n_rows,
            SRC_KIND, SRC_S, SRC_R, SRC_ALIGN, SRC_HAS_SLOTS, DST_KIND, DST_S, DST_R, DST_ALIGN, DST_HAS_SLOTS,
            CHECK, WRITE, HW_FP8, BLOCK_T,
        )


@triton.jit(do_not_specialize=["src_cap", "src_p", "src_pw", "dst_p", "dst_pw", "n_tokens", "n_rows"])
def _copy_kernel(
    src, src_slots, src_cap, src_p, src_pw,
    dst, dst_slots, dst_p, dst_pw,
    flags, n_tokens, n_rows,
    SW: tl.constexpr, FW: tl.constexpr, SW_BLOCK: tl.constexpr, FW_BLOCK: tl.constexpr,
    SRC_WA: tl.constexpr, DST_WA: tl.constexpr,
    SRC_HAS_SLOTS: tl.constexpr, DST_HAS_SLOTS: tl.constexpr, CHECK: tl.constexpr, BLOCK_T: tl.constexpr,
):
    """Byte move of identical records in 8-byte words: ``SW`` data words, then ``FW`` footer words.

    ``src_pw``/``dst_pw`` are page sizes in words; every data row starts at a multiple of
    ``SRC_WA``/``DST_WA`` words (2 lets a thread move 16 bytes at once). Rows without a source
    become zero records.
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
    src_page = s // src_p
    dst_page = out // dst_p
    w = tl.arange(0, SW_BLOCK)[None, :]
    src_row = tl.multiple_of(src_page * src_pw + (s - src_page * src_p) * SW, [SRC_WA, SRC_WA])
    dst_row = tl.multiple_of(dst_page * dst_pw + (out - dst_page * dst_p) * SW, [DST_WA, DST_WA])
    data = tl.load(src + src_row + w, mask=valid & (w < SW), other=0)
    tl.store(dst + dst_row + w, data, mask=row & (w < SW))
    if FW > 0:
        f = tl.arange(0, FW_BLOCK)[None, :]
        src_foot = src_page * src_pw + src_p * SW + (s - src_page * src_p) * FW
        dst_foot = dst_page * dst_pw + dst_p * SW + (out - dst_page * dst_p) * FW
        footer = tl.load(src + src_foot + f, mask=valid & (f < FW), other=0)
        tl.store(dst + dst_foot + f, footer, mask=row & (f < FW))


# ----------------------------------------------------------------------------- host side


def layout_kind(layout: Layout) -> int | None:
    """Which decoder/encoder of ``_convert_kernel`` serves ``layout`` (None: not supported here)."""
    kinds = {BF16Codec: _KIND_BF16, PerTensorE4M3Codec: _KIND_E4M3, Model1Codec: _KIND_MODEL1}
    kind = kinds.get(type(layout.codec))
    if kind is None or layout.record_bytes % 8 or (layout.split or 0) % 8 or layout.page_bytes(1) % 8:
        return None
    if kind == _KIND_MODEL1 and (layout.split, layout.record_bytes) != (576, 584):
        return None
    return kind


def supports(*layouts: Layout) -> bool:
    """True when every layout has a kernel encoder/decoder (page bytes, rows and footers 8-byte multiples)."""
    return all(layout_kind(lay) is not None for lay in layouts)


def aligned(*tensors: torch.Tensor) -> bool:
    """True when every tensor is contiguous and starts on a 16-byte boundary (the kernels' word views)."""
    return all(t.is_contiguous() and t.data_ptr() % 16 == 0 for t in tensors)


class _Pool:
    """Kernel arguments describing one side: a paged pool of a layout, or dense fp32 ``[rows, 512]``."""

    def __init__(self, tensor: torch.Tensor, layout: Layout | None = None, page_size: int = 1):
        self.tensor = tensor
        self.page_size = page_size
        if layout is None:
            self.kind, self.split, self.record, self.page_bytes, self.align = _KIND_F32, 0, 0, 0, 16
            self.half = tensor
            return
        kind = layout_kind(layout)
        if kind is None:
            raise LayoutError(f"layout {layout.name} has no Triton kernel")
        self.kind = kind
        self.record = layout.record_bytes
        self.split = layout.split if layout.split is not None else layout.record_bytes
        self.page_bytes = layout.page_bytes(page_size)
        self.align = math.gcd(self.page_bytes, self.split, 16)
        self.half = tensor.view(torch.int16)

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
    min_exp: int = 0, flags: torch.Tensor | None = None, write: bool = True,
) -> None:
    rows = n_rows if write else n_tokens
    if rows == 0:
        return
    dummy = src.tensor
    n_blocks = triton.cdiv(rows, convert_block_tokens)
    grid = (n_blocks if convert_programs_per_sm is None else min(n_blocks, convert_programs_per_sm * _sm_count(src)),)
    with _device_guard(src.tensor):
        _convert_kernel[grid](
            src.tensor, src.half, dummy if src_slots is None else src_slots, src.capacity, src.page_size,
            src.page_bytes, src_scale,
            dst.tensor, dst.half, dummy if dst_slots is None else dst_slots, dst.page_size, dst.page_bytes, dst_mult,
            min_exp,
            dummy if flags is None else flags, n_tokens, n_rows, n_blocks,
            SRC_KIND=src.kind, SRC_S=src.split, SRC_R=src.record, SRC_ALIGN=src.align,
            SRC_HAS_SLOTS=src_slots is not None,
            DST_KIND=dst.kind, DST_S=dst.split, DST_R=dst.record, DST_ALIGN=dst.align,
            DST_HAS_SLOTS=dst_slots is not None,
            CHECK=flags is not None, WRITE=write, HW_FP8=fp8_hardware and hardware_fp8_available(src.tensor.device),
            BLOCK_T=convert_block_tokens, PERSISTENT=convert_programs_per_sm is not None, num_warps=convert_warps,
        )


def _launch_copy(
    src: _Pool, dst: _Pool, *, n_tokens: int, n_rows: int, src_slots: torch.Tensor | None = None,
    dst_slots: torch.Tensor | None = None, flags: torch.Tensor | None = None,
) -> None:
    if n_rows == 0:
        return
    if (src.split, src.record) != (dst.split, dst.record):
        raise LayoutError("a byte move needs the same record and data-row size on both sides")
    words = src.tensor.view(torch.int64)
    sw, fw = src.split // 8, (src.record - src.split) // 8
    grid = (triton.cdiv(n_rows, copy_block_tokens),)
    with _device_guard(src.tensor):
        _copy_kernel[grid](
            words, words if src_slots is None else src_slots, src.capacity, src.page_size, src.page_bytes // 8,
            dst.tensor.view(torch.int64), words if dst_slots is None else dst_slots, dst.page_size, dst.page_bytes // 8,
            words if flags is None else flags, n_tokens, n_rows,
            SW=sw, FW=fw, SW_BLOCK=triton.next_power_of_2(sw), FW_BLOCK=triton.next_power_of_2(max(fw, 1)),
            SRC_WA=math.gcd(src.align // 8, 2), DST_WA=math.gcd(dst.align // 8, 2),
            SRC_HAS_SLOTS=src_slots is not None, DST_HAS_SLOTS=dst_slots is not None, CHECK=flags is not None,
            BLOCK_T=copy_block_tokens, num_warps=copy_warps,
        )


def _empty_pages(layout: Layout, num_tokens: int, page_size: int, device: torch.device) -> torch.Tensor:
    """Uninitialised pages for ``num_tokens`` tokens with the padding tail (past P * record) zeroed.

    The kernels write every row of every page (rows without a token as zeros), so only the tail is set here.
    """
    pages = torch.empty(layout.num_pages(num_tokens, page_size), layout.page_bytes(page_size), dtype=torch.uint8,
                        device=device)
    pages[:, page_size * layout.record_bytes :] = 0
    return pages


def _dst_mult(layout: Layout, dialect: str | None, scale: float) -> float:
    """The fp32 multiplier a per-tensor E4M3 writer applies (``PerTensorE4M3Codec.encode``)."""
    if dialect == "compress":
        return 1.0
    return float(reciprocal_f32(scale))


def _encode_args(layout: Layout, dialect: str | None, scale: float) -> dict:
    kind = layout_kind(layout)
    if kind == _KIND_MODEL1:
        floor = DIALECT_MIN_EXPONENT[dialect or "flashmla"]
        if floor <= -135:  # _scale_exponent sends zero / fp32-subnormal amax (k <= -135) straight to the floor
            raise LayoutError(f"dialect {dialect!r}: scale floor 2^{floor} is below what the kernel handles")
        return {"min_exp": floor}
    if kind == _KIND_E4M3:
        return {"dst_mult": _dst_mult(layout, dialect, scale)}
    return {}


def encode_pages(x: torch.Tensor, layout: Layout, page_size: int, dialect: str | None, scale: float) -> torch.Tensor:
    """fp32 ``[N, 512]`` (contiguous, finite) -> pages ``[ceil(N/P), page_bytes]`` (``reference.encode_pages``)."""
    n = x.shape[0]
    pages = _empty_pages(layout, n, page_size, x.device)
    dst = _Pool(pages, layout, page_size)
    _launch_convert(_Pool(x), dst, n_tokens=n, n_rows=pages.shape[0] * page_size,
                    **_encode_args(layout, dialect, scale))
    return pages


def decode_pages(pages: torch.Tensor, layout: Layout, page_size: int, num_tokens: int | None,
                 scale: float) -> torch.Tensor:
    """Pages -> fp32 ``[num_tokens, 512]`` (``reference.decode_pages``)."""
    n = layout.token_count(pages, page_size, num_tokens)
    out = torch.empty(n, HEAD_DIM, dtype=torch.float32, device=pages.device)
    _launch_convert(_Pool(pages, layout, page_size), _Pool(out), n_tokens=n, n_rows=n, src_scale=scale)
    return out


def repage(pages: torch.Tensor, src: Layout, src_page_size: int, dst: Layout, dst_page_size: int,
           num_tokens: int | None) -> torch.Tensor:
    """Byte move of identical records between page geometries (``reference.repage``)."""
    n = src.token_count(pages, src_page_size, num_tokens)
    out = _empty_pages(dst, n, dst_page_size, pages.device)
    _launch_copy(_Pool(pages, src, src_page_size), _Pool(out, dst, dst_page_size), n_tokens=n,
                 n_rows=out.shape[0] * dst_page_size)
    return out


def transcode_pages(
    pages: torch.Tensor, src: Layout, src_page_size: int, dst: Layout, dst_page_size: int,
    num_tokens: int | None, src_scale: float, dst_scale: float, dialect: str | None,
) -> torch.Tensor:
    """Decode + re-encode a whole pool in one launch (``reference.transcode_pages``).

    The kernel flags tokens that decode to NaN/Inf; if any, ``NonFiniteError`` is raised (the
    output is a fresh tensor, so nothing the caller holds was written).
    """
    n = src.token_count(pages, src_page_size, num_tokens)
    out = _empty_pages(dst, n, dst_page_size, pages.device)
    flags = torch.empty(n, dtype=torch.uint8, device=pages.device)
    _launch_convert(_Pool(pages, src, src_page_size), _Pool(out, dst, dst_page_size), n_tokens=n,
                    n_rows=out.shape[0] * dst_page_size, src_scale=src_scale, flags=flags,
                    **_encode_args(dst, dialect, dst_scale))
    if bool(flags.any()):  # error path only: the reference names the first bad token and dim
        check_finite(reference_decode(pages, src, src_page_size, n, src_scale))
    return out


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
