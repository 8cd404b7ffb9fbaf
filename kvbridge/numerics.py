"""Exact number-format arithmetic, written from integer bit operations.

Everything here is independent of the torch version and device: fp32 values are
read as their IEEE-754 bit patterns (int32) and the target codes are computed with
integer arithmetic only. This is the single source of truth for

- E4M3 (``float8_e4m3fn``): round-to-nearest-even, saturating to +-448 (0x7E/0xFE),
  subnormals down to 2^-9, signed zero kept (-0.0 -> 0x80);
- E4M3 FNUZ (``float8_e4m3fnuz``, ROCm gfx942): bias 8, round-to-nearest-even saturating to
  +-240 (0x7F/0xFF), subnormals down to 2^-10, no negative zero (a value rounding to 0 is 0x00),
  NaN 0x80, no infinity;
- UE8M0 power-of-two scale exponents per dialect (docs/layouts.md);
- E2M1 (fp4) round-to-nearest-even with signed zero and saturation, and the fp4 record's E4M3 tile scale;
- BF16 rounding (round-to-nearest-even) of fp32 values.
"""

from __future__ import annotations

import torch

E4M3_MAX = 448.0
#: fp32 bit pattern of +Inf; larger magnitudes are NaN.
_F32_INF_BITS = 0x7F800000
#: fp32 bit pattern of 448.0 (1.75 * 2^8); |x| >= this saturates to code 0x7E.
_F32_448_BITS = 0x43E00000

#: Lower bound of the scale exponent per MODEL1 dialect: ceil(log2(floor)) of the clamp.
#: flashmla: max(amax/448, 1e-4) -> 2^-13; amax-1e-4: max(amax,1e-4)/448 -> 2^-22;
#: amax-1e-8: max(amax,1e-8)/448 -> 2^-35. Zero tiles get scale bytes 114 / 105 / 92.
DIALECT_MIN_EXPONENT: dict[str, int] = {"flashmla": -13, "amax-1e-4": -22, "amax-1e-8": -35}
DIALECTS: tuple[str, ...] = tuple(DIALECT_MIN_EXPONENT)


def f32_bits(x: torch.Tensor) -> torch.Tensor:
    """IEEE-754 bit pattern of an fp32 tensor, as int64 (no sign extension issues)."""
    if x.dtype != torch.float32:
        raise TypeError(f"expected float32, got {x.dtype}")
    return x.contiguous().view(torch.int32).to(torch.int64) & 0xFFFFFFFF


def _e4m3_rne(x: torch.Tensor, bias: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(sign bit << 7, fp32 magnitude bits, unsaturated E4M3 magnitude code) of fp32 ``x``, rounded to
    nearest even, for exponent ``bias`` 7 (OCP E4M3) or 8 (FNUZ): normal magnitudes (>= 2^(1 - bias))
    drop 20 mantissa bits and rebias (carries roll into the exponent); smaller ones are
    RNE(|x| * 2^(bias + 2)) in 0..8; fp32 zeros and subnormals give 0. The callers saturate."""
    bits = f32_bits(x)
    sign = (bits >> 31) << 7
    mag = bits & 0x7FFFFFFF
    exp = mag >> 23
    lsb = (mag >> 20) & 1
    normal = ((mag + 0x7FFFF + lsb) >> 20) - ((127 - bias) << 3)
    mant24 = (mag & 0x7FFFFF) | 0x800000
    shift = ((21 - bias) - (exp - 127)).clamp(min=1, max=40)
    q = mant24 >> shift
    rem = mant24 - (q << shift)
    half = torch.ones_like(shift) << (shift - 1)
    round_up = (rem > half) | ((rem == half) & ((q & 1) == 1))
    sub = q + round_up.to(torch.int64)
    sub = torch.where(exp == 0, torch.zeros_like(sub), sub)
    return sign, mag, torch.where(exp >= 127 + 1 - bias, normal, sub)


def _e4m3_values(bias: int) -> torch.Tensor:
    """float64 value of each of the 256 E4M3-shaped codes with exponent ``bias`` (no NaN marked)."""
    codes = torch.arange(256, dtype=torch.int64)
    sign = torch.where(codes >= 128, -1.0, 1.0).to(torch.float64)
    e = (codes >> 3) & 0xF
    m = (codes & 7).to(torch.float64)
    normal = (1.0 + m / 8.0) * torch.pow(2.0, (e - bias).to(torch.float64))
    sub = m / 8.0 * 2.0 ** (1 - bias)
    return sign * torch.where(e == 0, sub, normal)


def e4m3_encode(x: torch.Tensor) -> torch.Tensor:
    """Encode fp32 values as E4M3 bytes (uint8), RNE with saturation to +-448.

    NaN inputs must be rejected by the caller; here they would saturate.
    """
    sign, mag, code = _e4m3_rne(x, bias=7)
    code = torch.where(mag >= _F32_448_BITS, torch.full_like(code, 0x7E), code)
    return (code | sign).to(torch.uint8)


def _e4m3_table() -> torch.Tensor:
    val = _e4m3_values(7)
    val[0x7F] = val[0xFF] = float("nan")
    return val.to(torch.float32)


#: fp32 value of each E4M3 code (0x7F and 0xFF are NaN).
E4M3_TABLE = _e4m3_table()


def e4m3_decode(codes: torch.Tensor) -> torch.Tensor:
    """Decode E4M3 bytes (uint8) to fp32 through the 256-entry table."""
    table = E4M3_TABLE.to(codes.device)
    return table[codes.to(torch.int64)]


# ---------------------------------------------------------------------------------------------
# E4M3 FNUZ (float8_e4m3fnuz: the main/SWA cache of ROCm gfx942 engines)
# ---------------------------------------------------------------------------------------------

E4M3FNUZ_MAX = 240.0
#: The FNUZ NaN code (the bit pattern of -0 in OCP E4M3).
E4M3FNUZ_NAN = 0x80
#: fp32 bit pattern of 232.0, the midpoint between FNUZ 224 (0x7E) and 240 (0x7F): above it the
#: code is 0x7F (a tie goes to the even code 0x7E), and every larger finite value saturates there.
_F32_232_BITS = 0x43680000
#: FNUZ UE8M0 dialects: name -> (exponent floor, the writer's fp8 max M as fp32 bits). The scale of a
#: tile is 2^ceil(log2(max(amax, eps) / M)); the floor is ceil(log2(eps / M)).
#: ``amax-1e-4/224``: vLLM's ROCm writer (eps 1e-4, M = 224 from ``get_fp8_min_max``);
#: ``amax-1e-8/240``: SGLang's ROCm V4 store (eps 1e-8, M = torch.finfo(float8_e4m3fnuz).max = 240).
FNUZ_DIALECT_RULES: dict[str, tuple[int, int]] = {
    "amax-1e-4/224": (-21, 0x43600000),
    "amax-1e-8/240": (-34, 0x43700000),
}
FNUZ_DIALECTS: tuple[str, ...] = tuple(FNUZ_DIALECT_RULES)


def e4m3fnuz_encode(x: torch.Tensor) -> torch.Tensor:
    """Encode fp32 values as E4M3 FNUZ bytes (uint8): RNE, saturating to +-240, NaN -> 0x80.

    A value whose magnitude rounds to 0 (zero, -0.0, tiny values) is 0x00: FNUZ has no -0.
    """
    sign, mag, code = _e4m3_rne(x, bias=8)
    code = torch.where(mag > _F32_232_BITS, torch.full_like(code, 0x7F), code)
    code = torch.where(code == 0, code, code | sign)
    code = torch.where(mag > _F32_INF_BITS, torch.full_like(code, E4M3FNUZ_NAN), code)
    return code.to(torch.uint8)


def _e4m3fnuz_table() -> torch.Tensor:
    val = _e4m3_values(8)
    val[E4M3FNUZ_NAN] = float("nan")
    return val.to(torch.float32)


#: fp32 value of each E4M3 FNUZ code (0x80 is NaN; 0x7F / 0xFF are +-240).
E4M3FNUZ_TABLE = _e4m3fnuz_table()


def e4m3fnuz_decode(codes: torch.Tensor) -> torch.Tensor:
    """Decode E4M3 FNUZ bytes (uint8) to fp32 through the 256-entry table."""
    return E4M3FNUZ_TABLE.to(codes.device)[codes.to(torch.int64)]


def fnuz_scale_exponent(amax: torch.Tensor, dialect: str) -> torch.Tensor:
    """UE8M0 exponent k of each FNUZ tile for a FNUZ dialect: max(ceil(log2(amax / M)), floor) (see
    ``FNUZ_DIALECT_RULES``). At M = 224 (= 448 / 2) this is the OCP ``amax-1e-4`` exponent plus one."""
    try:
        floor, max_bits = FNUZ_DIALECT_RULES[dialect]
    except KeyError:
        raise ValueError(f"unknown FNUZ dialect {dialect!r}; known: {', '.join(FNUZ_DIALECTS)}") from None
    return ceil_log2_div(amax, max_bits).clamp(min=floor)


def ceil_log2_div(amax: torch.Tensor, max_bits: int) -> torch.Tensor:
    """Exact ceil(log2(amax / M)) for fp32 amax >= 0 and M = the positive normal fp32 of bits ``max_bits``,
    as int64; amax == 0 gives -1000.

    amax = A * 2^E and M = B * 2^F with A, B in [1, 2): the result is E - F, plus one when A > B
    (amax's mantissa bits above M's). fp32 subnormals are normalised first.
    """
    bits = f32_bits(amax) & 0x7FFFFFFF
    exp = bits >> 23
    mant = bits & 0x7FFFFF
    # Normalise subnormals: value = mant * 2^-149; find the leading bit.
    lead = sum(((mant >> k) > 0).to(torch.int64) for k in range(1, 23))  # index of top bit
    sub_exp = lead - 149
    sub_frac = (mant - (torch.ones_like(lead) << lead)) << (23 - lead).clamp(min=0)
    e = torch.where(exp == 0, sub_exp, exp - 127)
    frac = torch.where(exp == 0, sub_frac, mant)
    result = e - ((max_bits >> 23) - 127) + (frac > (max_bits & 0x7FFFFF)).to(torch.int64)
    return torch.where(bits == 0, torch.full_like(result, -1000), result)


def ceil_log2_div448(amax: torch.Tensor) -> torch.Tensor:
    """Exact ceil(log2(amax / 448)) for fp32 amax >= 0, as int64; amax == 0 gives -1000."""
    return ceil_log2_div(amax, _F32_448_BITS)


def scale_exponent(amax: torch.Tensor, dialect: str) -> torch.Tensor:
    """Power-of-two scale exponent k (scale = 2^k) of each tile for a MODEL1 dialect."""
    try:
        floor = DIALECT_MIN_EXPONENT[dialect]
    except KeyError:
        raise ValueError(f"unknown dialect {dialect!r}; known: {', '.join(DIALECTS)}") from None
    return ceil_log2_div448(amax).clamp(min=floor)


#: UE8M0 dialects whose writers' bytes for a tile holding NaN or Inf are established (``nonfinite=
#: "propagate"``, docs/layouts.md): ``flashmla``, as FlashMLA's ``tests/quant.py`` (MODEL1) and SGLang's
#: V4.1 reference write it on CUDA: the tile's amax propagates the NaN, its scale is that NaN or +Inf (the
#: UE8M0 byte 0xFF) and its codes are ``e4m3_nonfinite_tile_codes``. The other dialects' writers
#: (vLLM's Triton store, TensorRT-LLM's CUDA writer) are not established: those dialects refuse it.
UE8M0_NONFINITE_DIALECTS: tuple[str, ...] = ("flashmla",)
#: The UE8M0 byte of a NaN or infinite scale (UE8M0 has no infinity: 0xFF is NaN).
UE8M0_NAN = 0xFF


def e4m3_nonfinite_tile_codes(tiles: torch.Tensor) -> torch.Tensor:
    """E4M3 codes (uint8 ``[..., tile]``) of fp32 tiles whose amax is NaN or Inf, divided by that scale as a
    CUDA writer does: in a tile holding a NaN every element is x / NaN = NaN, code 0x7F (CUDA's canonical
    NaN 0x7FFFFFFF is positive); in a tile holding +-Inf but no NaN, a finite x / Inf is a zero of x's sign
    (0x00 / 0x80) and +-Inf / Inf is NaN (0x7F)."""
    sign = ((f32_bits(tiles) >> 31) << 7).to(torch.uint8)
    nan = torch.isnan(tiles).any(dim=-1, keepdim=True) | torch.isinf(tiles)
    return torch.where(nan, torch.full_like(sign, E4M3_NAN), sign)


def ue8m0_byte(exponent: torch.Tensor) -> torch.Tensor:
    """UE8M0 byte for scale 2^exponent (byte = exponent + 127); exponent must be in [-127, 127]."""
    if exponent.numel() and (int(exponent.min()) < -127 or int(exponent.max()) > 127):
        raise ValueError("scale exponent outside UE8M0 range [-127, 127]")
    return (exponent + 127).to(torch.uint8)


def pow2(exponent: torch.Tensor) -> torch.Tensor:
    """Exact fp32 2^exponent for int exponents in [-149, 127] (built from bits)."""
    e = exponent.to(torch.int64)
    normal_bits = (e + 127).clamp(min=1, max=254) << 23
    sub_bits = torch.ones_like(e) << (e + 149).clamp(min=0, max=22)
    bits = torch.where(e >= -126, normal_bits, sub_bits)
    return bits.to(torch.int32).view(torch.float32)


def ue8m0_decode(byte: torch.Tensor) -> torch.Tensor:
    """fp32 value of UE8M0 scale bytes: exactly 2^(byte - 127) (byte 0: the subnormal 2^-127), NaN for 0xFF."""
    b = byte.to(torch.int64)
    return torch.where(b == UE8M0_NAN, torch.nan, pow2(b - 127))


def bf16_round(x: torch.Tensor) -> torch.Tensor:
    """fp32 -> bf16 bit patterns (int16 as uint16 values in int64), round-to-nearest-even."""
    bits = f32_bits(x)
    rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
    nan = (bits & 0x7FFFFFFF) > 0x7F800000
    return torch.where(nan, (bits >> 16) | 0x40, rounded) & 0xFFFF


def bf16_bytes(x: torch.Tensor) -> torch.Tensor:
    """fp32 [..., n] -> little-endian bf16 bytes [..., 2n] (uint8)."""
    b = bf16_round(x)
    lo = (b & 0xFF).to(torch.uint8)
    hi = (b >> 8).to(torch.uint8)
    return torch.stack([lo, hi], dim=-1).flatten(-2)


def bf16_from_bytes(b: torch.Tensor) -> torch.Tensor:
    """Little-endian bf16 bytes [..., 2n] (uint8) -> fp32 [..., n] (exact)."""
    pairs = b.reshape(*b.shape[:-1], b.shape[-1] // 2, 2).to(torch.int64)
    bits = (pairs[..., 0] | (pairs[..., 1] << 8)) << 16
    bits = torch.where(bits >= 2**31, bits - 2**32, bits)
    return bits.to(torch.int32).view(torch.float32)


# ---------------------------------------------------------------------------------------------
# E2M1 (fp4) and E4M3 used as a scale (the DeepSeek-V4.1 fp4 record)
# ---------------------------------------------------------------------------------------------

#: |value| of the E2M1 codes 0..7 (bit 3 is the sign).
E2M1_MAGNITUDES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
E2M1_MAX = 6.0
#: fp32 bit patterns of the rounding thresholds between E2M1 codes k and k+1, and whether a value
#: equal to the threshold rounds up (ties go to the even code: up at 0.75, 1.75 and 3.5).
E2M1_THRESHOLDS: tuple[tuple[int, bool], ...] = (
    (0x3E800000, False),  # 0.25
    (0x3F400000, True),  # 0.75
    (0x3FA00000, False),  # 1.25
    (0x3FE00000, True),  # 1.75
    (0x40200000, False),  # 2.5
    (0x40600000, True),  # 3.5
    (0x40A00000, False),  # 5.0
)
#: The fp4 record's scale range: amax / 6 is clamped to [2^-9, 448] before E4M3 rounding.
FP4_SCALE_MIN_BITS = 0x3B000000  # 2^-9, the smallest E4M3 subnormal
E4M3_NAN = 0x7F


def _e2m1_codes(x: torch.Tensor, *, ties_to_even: bool, negative_zero: bool) -> torch.Tensor:
    """fp32 -> E2M1 codes (uint8 0..15, sign in bit 3), saturating at +-6.

    The magnitude's fp32 bit pattern is compared with the thresholds' (non-negative floats order
    like their bits). A value on a threshold goes to the even code with ``ties_to_even``, else to
    the smaller magnitude; with ``negative_zero`` a negative value that rounds to 0 keeps its sign
    (code 0x8), else it is code 0. NaN counts as magnitude 0 and +-Inf saturates (as
    ``cvt.rn.satfinite``).
    """
    bits = f32_bits(x)
    mag = bits & 0x7FFFFFFF
    mag = torch.where(mag > _F32_INF_BITS, torch.zeros_like(mag), mag)
    code = torch.zeros_like(mag)
    for threshold, up in E2M1_THRESHOLDS:
        code += ((mag >= threshold) if up and ties_to_even else (mag > threshold)).to(torch.int64)
    negative = (bits >> 31) == 1
    if not negative_zero:
        negative &= code != 0
    return (code | (negative.to(torch.int64) << 3)).to(torch.uint8)


def e2m1_encode(x: torch.Tensor) -> torch.Tensor:
    """E2M1 round-to-nearest-even, signed zero kept (the V4.1 fp4 record; TensorRT-LLM's and
    vLLM's fp4 indexer keys)."""
    return _e2m1_codes(x, ties_to_even=True, negative_zero=True)


def e2m1_encode_rne_no_negative_zero(x: torch.Tensor) -> torch.Tensor:
    """E2M1 round-to-nearest-even; a value rounding to magnitude 0 gets code 0 (no -0)."""
    return _e2m1_codes(x, ties_to_even=True, negative_zero=False)


def e2m1_encode_threshold(x: torch.Tensor) -> torch.Tensor:
    """E2M1 by thresholds: ties go to the smaller magnitude (toward zero); no -0."""
    return _e2m1_codes(x, ties_to_even=False, negative_zero=False)


def _e2m1_table() -> torch.Tensor:
    mags = torch.tensor(E2M1_MAGNITUDES, dtype=torch.float32)
    return torch.cat([mags, -mags])


#: fp32 value of each E2M1 code 0..15 (code 8 is -0.0).
E2M1_TABLE = _e2m1_table()


def e2m1_decode(codes: torch.Tensor) -> torch.Tensor:
    """E2M1 codes (uint8 0..15) -> fp32 (exact)."""
    return E2M1_TABLE.to(codes.device)[codes.to(torch.int64) & 0xF]


def e2m1_pack(codes: torch.Tensor) -> torch.Tensor:
    """E2M1 codes ``[..., 2n]`` -> bytes ``[..., n]``: element 2i in the low nibble, 2i+1 in the high one."""
    return codes[..., 0::2] | (codes[..., 1::2] << 4)


def e2m1_unpack(packed: torch.Tensor) -> torch.Tensor:
    """Bytes ``[..., n]`` -> E2M1 codes ``[..., 2n]`` (inverse of ``e2m1_pack``)."""
    return torch.stack([packed & 0xF, packed >> 4], dim=-1).flatten(-2)


def fp4_tile_amax(tiles: torch.Tensor) -> torch.Tensor:
    """amax of fp32 tiles ``[..., tile]`` as the V4.1 FP4 writers take it (FlashMLA's and SGLang's torch
    references: ``nan_to_num(|x|, nan=inf).amax``): a NaN counts as +Inf, so the tile's scale is NaN, and
    +-Inf as the largest fp32, so a tile holding one but no NaN gets the scale 448 and saturated codes."""
    return torch.nan_to_num(tiles.abs(), nan=float("inf")).amax(dim=-1)


def fp4_tile_scale(amax: torch.Tensor) -> torch.Tensor:
    """E4M3 scale byte of an fp4 tile of absolute maximum ``amax`` (fp32):
    ``e4m3_rne(clamp(amax / 6, 2^-9, 448))``; a non-finite amax (the tile holds NaN or Inf)
    gives the NaN byte 0x7F, which poisons the tile on decode.
    """
    q = amax / torch.tensor(E2M1_MAX, dtype=torch.float32, device=amax.device)
    floor = torch.tensor(FP4_SCALE_MIN_BITS, dtype=torch.int32).view(torch.float32).to(amax.device)
    q = torch.maximum(q, floor).clamp(max=E4M3_MAX)
    code = e4m3_encode(torch.nan_to_num(q, nan=0.0))
    bad = (f32_bits(amax) & 0x7FFFFFFF) >= _F32_INF_BITS
    return torch.where(bad, torch.full_like(code, E4M3_NAN), code)


def fp4_encode_tiles(x: torch.Tensor, scale_bytes: torch.Tensor) -> torch.Tensor:
    """E2M1 codes of fp32 tiles ``x`` ``[..., tiles, tile]`` with E4M3 scale bytes ``[..., tiles]``:
    ``e2m1_rne(x / scale)``, an IEEE fp32 division by the rounded scale (a multiply by its
    reciprocal can land on the other side of an E2M1 tie). A NaN scale gives code 0 for finite
    elements and keeps a NaN element's sign bit, as the division propagates the NaN operand."""
    scale = e4m3_decode(scale_bytes).unsqueeze(-1)
    return e2m1_encode(x / scale)


#: fp32 bits of RN(1/6) (0x3E2AAAAB): the NVFP4 writer's amax multiplier (it multiplies by a reciprocal of 6).
NVFP4_RCP6_BITS = 0x3E2AAAAB
#: The NVFP4 per-tensor global scales g kvbridge accepts: [2^-117, 2^116]. In that range g and fp32(1/g)
#: are normal, every nonzero tile scale times g (2^-9 g .. 448 g) is a normal fp32 with a normal reciprocal,
#: and every decoded value (up to 6 * 448 * g) is finite, so no step of the writer's arithmetic meets an fp32
#: subnormal (which its flush-to-zero reciprocals would treat as 0) or an overflow.
NVFP4_GLOBAL_SCALE_MIN = 2.0**-117
NVFP4_GLOBAL_SCALE_MAX = 2.0**116


def _f32_scalar(value: float, device: torch.device) -> torch.Tensor:
    return torch.tensor(value, dtype=torch.float32, device=device)


def nvfp4_tile_scale(amax: torch.Tensor, global_scale: float = 1.0) -> torch.Tensor:
    """E4M3 scale byte of an NVFP4 tile of absolute maximum ``amax`` (fp32) under the per-tensor fp32
    global scale g (``global_scale``): ``e4m3_rne(fp32(1/g) * (amax * fp32(1/6)))``, two fp32 products in
    that order, then saturation at 448, with no lower clamp, so a tile whose product rounds below 2^-10
    gets scale 0 (an all-zero tile too). At g = 1 the second product is exact (a multiply by 1).
    A non-finite amax gives the NaN byte 0x7F, which poisons the tile on decode.
    """
    rcp6 = torch.tensor(NVFP4_RCP6_BITS, dtype=torch.int32).view(torch.float32).to(amax.device)
    one = _f32_scalar(1.0, amax.device)
    rcp_g = one / _f32_scalar(global_scale, amax.device)  # fp32 RN(1/g)
    code = e4m3_encode(torch.nan_to_num(rcp_g * (amax * rcp6), nan=0.0))
    bad = (f32_bits(amax) & 0x7FFFFFFF) >= _F32_INF_BITS
    return torch.where(bad, torch.full_like(code, E4M3_NAN), code)


def nvfp4_encode_tiles(x: torch.Tensor, scale_bytes: torch.Tensor, global_scale: float = 1.0,
                       zero_scale_zero: bool = False) -> torch.Tensor:
    """E2M1 codes of fp32 tiles ``x`` ``[..., tiles, tile]`` with NVFP4 scale bytes ``[..., tiles]`` under the
    global scale g: ``e2m1_rne(x * fp32(1 / fp32(scale * g)))`` (a multiply by the fp32 reciprocal of the
    rounded scale times g, which can land on the other side of an E2M1 tie than a division; at g = 1 the
    scale itself); a zero element keeps its signed zero code, a nonzero one in a scale-0 tile saturates
    to +-6 (its reciprocal is +Inf; with ``zero_scale_zero``, vLLM's ``cvt_warp_fp16_to_fp4``, the multiplier is 0
    instead and it gets its signed zero code), and a poisoned tile (scale 0x7F) gets code 0 everywhere."""
    scale = e4m3_decode(scale_bytes).unsqueeze(-1) * _f32_scalar(global_scale, x.device)
    one = torch.ones((), dtype=torch.float32, device=x.device)
    inv = one / scale
    if zero_scale_zero:
        inv = torch.where(scale == 0, torch.zeros_like(inv), inv)
    y = torch.where(x == 0, x, x * inv)
    codes = e2m1_encode(y)
    return torch.where((scale_bytes == E4M3_NAN).unsqueeze(-1), torch.zeros_like(codes), codes)


def nvfp4_decode_tiles(codes: torch.Tensor, scale_bytes: torch.Tensor, global_scale: float = 1.0) -> torch.Tensor:
    """fp32 values of NVFP4 tiles: E2M1 codes ``[..., tiles, tile]`` (uint8 0..15) with scale bytes
    ``[..., tiles]`` under the global scale g: ``fp32(e2m1 * scale) * g``; the first product is exact
    (E2M1 and E4M3 mantissas fit fp32), so each value is the one fp32 rounding of e2m1 * scale * g.
    Scale 0x7F decodes as NaN (the poisoned tile)."""
    values = e2m1_decode(codes) * e4m3_decode(scale_bytes).unsqueeze(-1)
    return values * _f32_scalar(global_scale, codes.device)


#: An fp32 mantissa m in [1, 2) (24-bit integer M = m * 2^23) rounds log2(m / 6) up when m^2 >= 1.125,
#: i.e. M^2 >= 9 * 2^43 (the boundary m = 6 * 2^-2.5 is irrational, so no fp32 amax lies on it).
MXFP4_ROUND_UP_SQUARE = 9 << 43


def mxfp4_scale_byte(amax: torch.Tensor) -> torch.Tensor:
    """UE8M0 scale byte of an MXFP4 tile of absolute maximum ``amax`` (fp32): ``round(log2(amax / 6))
    + 127`` clamped to [0, 255] (SGLang's DSV4 MXFP4 writer), computed exactly from amax's bits:
    amax = M * 2^(E - 150) gives E - 3, plus 1 when M^2 >= 9 * 2^43. Zero and subnormal amax give
    byte 0; a non-finite amax (the tile holds NaN or Inf) gives 0xFF (NaN, poisoning the tile)."""
    bits = f32_bits(amax) & 0x7FFFFFFF
    exp = bits >> 23
    mant = (bits & 0x7FFFFF) | 0x800000
    byte = (exp - 3 + (mant * mant >= MXFP4_ROUND_UP_SQUARE).to(torch.int64)).clamp(0, 255)
    byte = torch.where(exp == 0, torch.zeros_like(byte), byte)
    return torch.where(bits >= _F32_INF_BITS, torch.full_like(byte, UE8M0_NAN), byte).to(torch.uint8)


def mxfp4_encode_tiles(x: torch.Tensor, scale_bytes: torch.Tensor) -> torch.Tensor:
    """E2M1 codes of fp32 tiles ``x`` ``[..., tiles, tile]`` with UE8M0 scale bytes ``[..., tiles]``:
    ``e2m1_rne(x / 2^(byte - 127))`` (exact: a power of two), saturating at +-6, sign kept; a
    poisoned tile (0xFF) gets code 0 everywhere."""
    exp = scale_bytes.to(torch.int64) - 127
    codes = e2m1_encode(x * pow2(-exp.clamp(max=127)).unsqueeze(-1))
    return torch.where((scale_bytes == UE8M0_NAN).unsqueeze(-1), torch.zeros_like(codes), codes)


def ceil_log2(x: torch.Tensor) -> torch.Tensor:
    """Exact ceil(log2(x)) of positive finite fp32 ``x`` as int64, from its bits (subnormals included)."""
    bits = f32_bits(x) & 0x7FFFFFFF
    exp = bits >> 23
    mant = bits & 0x7FFFFF
    lead = sum(((mant >> k) > 0).to(torch.int64) for k in range(1, 23))  # top bit of a subnormal mantissa
    is_pow2_sub = mant == (torch.ones_like(lead) << lead)
    sub = lead - 149 + (~is_pow2_sub).to(torch.int64)
    normal = exp - 127 + (mant != 0).to(torch.int64)
    return torch.where(exp == 0, sub, normal)
