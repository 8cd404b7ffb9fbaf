"""The number formats in Triton ops, for the kernels of ``kvbridge.backends.triton_kernels`` (imported
only by it, so only where Triton is): E4M3 and E4M3 FNUZ codes from and to fp32 (integer bit
operations mirroring ``kvbridge.numerics``, or the GPU's conversions with ``HW_FP8``), UE8M0 scales,
bf16, and the UE8M0 scale exponents of the OCP and FNUZ rules.
"""

from __future__ import annotations

import triton
import triton.language as tl

from kvbridge.numerics import FNUZ_DIALECT_RULES

#: The two FNUZ dialects' exponent floors and writer-max mantissa bits (see ``_fnuz_exponent``).
(_A_FLOOR, _A_MAX), (_B_FLOOR, _B_MAX) = FNUZ_DIALECT_RULES.values()
FNUZ_A_FRAC = tl.constexpr(_A_MAX & 0x7FFFFF)
FNUZ_B_FLOOR = tl.constexpr(_B_FLOOR)
FNUZ_B_FRAC = tl.constexpr(_B_MAX & 0x7FFFFF)


@triton.jit
def _e4m3_rne_bits(x, BIAS: tl.constexpr):
    """The rounding core of both E4M3 encoders (``numerics._e4m3_rne``): fp32 ``x`` -> (code of ``|x|`` for
    exponent bias ``BIAS``, 7 OCP / 8 FNUZ, RNE, not saturated; the sign as bit 7; ``|x|``'s fp32 bits)."""
    bits = x.to(tl.int32, bitcast=True)
    sign = (bits >> 24) & 0x80
    mag = bits & 0x7FFFFFFF
    exp = mag >> 23
    lsb = (mag >> 20) & 1
    normal = ((mag + 0x7FFFF + lsb) >> 20) - ((127 - BIAS) << 3)
    mant24 = (mag & 0x7FFFFF) | 0x800000
    shift = tl.minimum(tl.maximum((148 - BIAS) - exp, 1), 25)  # (21 - BIAS) - (exp - 127); >= 25 rounds to 0
    q = mant24 >> shift
    rem = mant24 - (q << shift)
    half = 1 << (shift - 1)
    round_up = (rem > half) | ((rem == half) & ((q & 1) == 1))
    sub = tl.where(exp == 0, 0, q + round_up.to(tl.int32))
    return tl.where(exp >= 128 - BIAS, normal, sub), sign, mag  # 128 - BIAS: biased fp32 exponent of 2^(1 - BIAS)


@triton.jit
def _e4m3_bits_from_f32(x):
    """fp32 -> E4M3 code (int32 0..255), RNE, saturating to +-448: ``numerics.e4m3_encode`` in Triton ops."""
    code, sign, mag = _e4m3_rne_bits(x, 7)
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
def _e4m3fnuz_bits_from_f32(x):
    """fp32 -> E4M3 FNUZ code (int32 0..255): ``numerics.e4m3fnuz_encode`` in Triton ops (RNE, saturating
    at 240, NaN 0x80, a value rounding to 0 is 0x00)."""
    code, sign, mag = _e4m3_rne_bits(x, 8)
    code = tl.where(mag > 0x43680000, 0x7F, code)  # above 232 saturates to 240
    code = tl.where(code == 0, 0, code | sign)
    return tl.where(mag > 0x7F800000, 0x80, code)


@triton.jit
def _fnuz_exponent(amax, min_exp):
    """max(ceil(log2(amax / M)), min_exp) of the FNUZ dialect whose floor is ``min_exp``
    (``numerics.fnuz_scale_exponent``): M = B * 2^7, so E - 7, plus one when amax's mantissa exceeds B's."""
    bits = amax.to(tl.int32, bitcast=True)
    exp = bits >> 23
    max_frac = tl.where(min_exp == FNUZ_B_FLOOR, FNUZ_B_FRAC, FNUZ_A_FRAC)
    k = exp - 134 + ((bits & 0x7FFFFF) > max_frac).to(tl.int32)
    return tl.where(exp == 0, min_exp, tl.maximum(k, min_exp))


@triton.jit
def _e4m3fnuz_decode(code):
    """E4M3 FNUZ code (int32 0..255) -> fp32, exact (bias 8, subnormals m * 2^-10); 0x80 gives NaN."""
    e = (code >> 3) & 0xF
    m = code & 7
    normal = (((e + 119) << 23) | (m << 20)).to(tl.float32, bitcast=True)
    mag = tl.where(e == 0, m.to(tl.float32) * 0.0009765625, normal)
    mag = tl.where(code >= 128, -mag, mag)
    return tl.where(code == 0x80, float("nan"), mag)


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
