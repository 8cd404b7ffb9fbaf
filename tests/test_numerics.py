"""The exact-arithmetic module: E4M3, UE8M0 exponents, bf16 rounding, from integer bits."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvbridge import numerics as nx


def all_bf16_values() -> torch.Tensor:
    x = torch.arange(0, 65536, dtype=torch.int32).to(torch.int16).view(torch.bfloat16).float()
    return x[torch.isfinite(x)]


def torch_e4m3(x: torch.Tensor) -> torch.Tensor:
    """torch's RNE cast after an explicit clamp (the clamp keeps it version independent)."""
    return x.clamp(-448, 448).to(torch.float8_e4m3fn).view(torch.uint8)


def test_e4m3_matches_clamped_cast_on_every_bf16_value():
    x = all_bf16_values()
    assert torch.equal(nx.e4m3_encode(x), torch_e4m3(x))


def test_e4m3_edge_cases():
    cases = [
        (0.0, 0x00), (-0.0, 0x80), (448.0, 0x7E), (-448.0, 0xFE), (464.0, 0x7E), (1e30, 0x7E), (-math.inf, 0xFE),
        (2.0**-9, 0x01), (2.0**-10, 0x00), (2.0**-10 * 1.0001, 0x01), (3 * 2.0**-10, 0x02),  # ties to even
        (-(2.0**-11), 0x80), (2.0**-6, 0x08), (444.0, 0x7E), (400.0, 0x7C), (432.0, 0x7E), (8.5, 0x50), (9.5, 0x52),
        (2.0**-149, 0x00),
    ]
    x = torch.tensor([v for v, _ in cases], dtype=torch.float32)
    assert nx.e4m3_encode(x).tolist() == [c for _, c in cases]


@settings(max_examples=300, deadline=None)
@given(st.lists(st.floats(width=32, allow_nan=False), min_size=1, max_size=64))
def test_e4m3_matches_clamped_cast_on_fp32(values):
    x = torch.tensor(values, dtype=torch.float32)
    assert torch.equal(nx.e4m3_encode(x), torch_e4m3(x))


def test_e4m3_table_matches_torch_decode():
    codes = torch.arange(256, dtype=torch.uint8)
    want = codes.view(torch.float8_e4m3fn).float()
    got = nx.e4m3_decode(codes)
    assert torch.equal(torch.nan_to_num(got, nan=12345.0), torch.nan_to_num(want, nan=12345.0))
    assert torch.isnan(got[[0x7F, 0xFF]]).all()


@settings(max_examples=300, deadline=None)
@given(st.floats(min_value=0, max_value=2.0**126, width=32))
def test_ceil_log2_div448_is_exact(amax):
    got = int(nx.ceil_log2_div448(torch.tensor([amax], dtype=torch.float32))[0])
    if amax == 0:
        assert got == -1000
        return
    # exact: 2^(got-1) < amax/448 <= 2^got, checked in integers via Fraction
    from fractions import Fraction

    q = Fraction(amax) / 448
    assert Fraction(2) ** (got - 1) < q <= Fraction(2) ** got


def test_ceil_log2_near_powers_of_two():
    base = torch.tensor([448.0 * 2.0**k for k in range(-20, 20)], dtype=torch.float32)
    above = torch.nextafter(base, torch.full_like(base, math.inf))
    assert torch.equal(nx.ceil_log2_div448(base), torch.arange(-20, 20))
    assert torch.equal(nx.ceil_log2_div448(above), torch.arange(-19, 21))


def test_zero_tile_scale_bytes_per_dialect():
    zero = torch.zeros(1)
    got = {d: int(nx.ue8m0_byte(nx.scale_exponent(zero, d))[0]) for d in nx.DIALECTS}
    assert got == {"flashmla": 114, "amax-1e-4": 105, "amax-1e-8": 92}


def test_dialects_differ_exactly_below_448_times_2_pow_minus_14():
    edge = 448.0 * 2.0**-14
    amax = torch.tensor([edge, float(torch.nextafter(torch.tensor(edge), torch.tensor(1.0)))])
    f = nx.scale_exponent(amax, "flashmla")
    a = nx.scale_exponent(amax, "amax-1e-4")
    assert f[0] != a[0] and f[1] == a[1]


def test_pow2_exact_including_subnormals():
    e = torch.arange(-149, 128)
    assert torch.equal(nx.pow2(e).double(), torch.pow(2.0, e.double()))


def test_bf16_round_trip_bytes():
    x = torch.randn(1000) * 100
    got = nx.bf16_from_bytes(nx.bf16_bytes(x))
    assert torch.equal(got, x.to(torch.bfloat16).float())


# ---------------------------------------------------------------------------------------------
# E4M3 FNUZ (float8_e4m3fnuz), checked against torch's own cast
# ---------------------------------------------------------------------------------------------


def torch_e4m3fnuz(x: torch.Tensor) -> torch.Tensor:
    """torch's RNE cast to float8_e4m3fnuz after an explicit clamp to +-240 (NaN stays NaN: 0x80)."""
    return x.clamp(-240, 240).to(torch.float8_e4m3fnuz).view(torch.uint8)


def fp32_bit_sample(step: int) -> torch.Tensor:
    """Every ``step``-th fp32 bit pattern (NaNs, infinities, -0 and subnormals included)."""
    bits = torch.arange(0, 2**32, step, dtype=torch.int64)
    return torch.where(bits >= 2**31, bits - 2**32, bits).to(torch.int32).view(torch.float32)


def test_e4m3fnuz_table_matches_torch_decode_on_all_256_codes():
    codes = torch.arange(256, dtype=torch.uint8)
    want = codes.view(torch.float8_e4m3fnuz).float()
    got = nx.e4m3fnuz_decode(codes)
    assert torch.equal(torch.nan_to_num(got, nan=12345.0), torch.nan_to_num(want, nan=12345.0))
    assert torch.isnan(got).nonzero().flatten().tolist() == [nx.E4M3FNUZ_NAN]
    assert got[0x7F] == nx.E4M3FNUZ_MAX and got[0xFF] == -nx.E4M3FNUZ_MAX


def test_e4m3fnuz_matches_torch_cast_on_every_bf16_value():
    x = torch.arange(0, 65536, dtype=torch.int32).to(torch.int16).view(torch.bfloat16).float()  # NaN, Inf too
    assert torch.equal(nx.e4m3fnuz_encode(x), torch_e4m3fnuz(x))


def test_e4m3fnuz_matches_torch_cast_on_a_dense_fp32_bit_sample():
    x = fp32_bit_sample(997)  # 4.3 M patterns spread over every exponent, sign and special value
    assert torch.equal(nx.e4m3fnuz_encode(x), torch_e4m3fnuz(x))


def test_e4m3fnuz_edge_cases():
    cases = [
        (0.0, 0x00), (-0.0, 0x00), (-(2.0**-12), 0x00), (240.0, 0x7F), (-240.0, 0xFF), (232.0, 0x7E),
        (232.01, 0x7F), (224.0, 0x7E), (1e30, 0x7F), (-math.inf, 0xFF), (math.nan, 0x80), (2.0**-10, 0x01),
        (2.0**-11, 0x00), (3 * 2.0**-11, 0x02), (2.0**-7, 0x08), (1.0, 0x40),
    ]
    x = torch.tensor([v for v, _ in cases], dtype=torch.float32)
    assert nx.e4m3fnuz_encode(x).tolist() == [c for _, c in cases]


@settings(max_examples=200, deadline=None)
@given(st.lists(st.floats(width=32, allow_nan=False), min_size=1, max_size=64))
def test_fnuz_tile_is_the_ocp_tile_halved(values):
    """At the ROCm writers' max of 224 a FNUZ tile's exponent is the OCP rule's plus one and its value
    codes are the OCP codes of the same tile, -0 (0x80, the FNUZ NaN) written as 0x00."""
    x = torch.tensor(values, dtype=torch.float32).clamp(-1e30, 1e30).unsqueeze(0)
    amax = x.abs().amax(dim=-1)
    k_ocp = nx.scale_exponent(amax, "amax-1e-4")
    k_fnuz = nx.fnuz_scale_exponent(amax, "amax-1e-4/224")
    assert (k_fnuz == k_ocp + 1).all()
    ocp = nx.e4m3_encode(x * nx.pow2(-k_ocp).unsqueeze(-1))
    fnuz = nx.e4m3fnuz_encode(x * nx.pow2(-k_fnuz).unsqueeze(-1))
    assert torch.equal(fnuz, torch.where(ocp == 0x80, torch.zeros_like(ocp), ocp))
    decoded = nx.e4m3fnuz_decode(fnuz) * nx.pow2(k_fnuz).unsqueeze(-1)
    assert torch.equal(decoded, nx.e4m3_decode(ocp) * nx.pow2(k_ocp).unsqueeze(-1))


@pytest.mark.parametrize("dialect", nx.FNUZ_DIALECTS)
def test_fnuz_dialect_floor_is_the_eps_exponent(dialect):
    floor, max_bits = nx.FNUZ_DIALECT_RULES[dialect]
    eps = torch.tensor([float(dialect.removeprefix("amax-").split("/")[0])], dtype=torch.float32)
    assert int(nx.ceil_log2_div(eps, max_bits)[0]) == floor


@settings(max_examples=300, deadline=None)
@given(st.floats(min_value=0, max_value=2.0**126, width=32), st.sampled_from([224.0, 240.0, 448.0]))
def test_ceil_log2_div_is_exact(amax, m):
    bits = int(torch.tensor([m]).view(torch.int32)[0])
    got = int(nx.ceil_log2_div(torch.tensor([amax], dtype=torch.float32), bits)[0])
    if amax == 0:
        assert got == -1000
    else:  # exact rational comparison: 2^(got-1) < amax / m <= 2^got
        from fractions import Fraction

        q = Fraction(amax) / Fraction(m)
        assert Fraction(2) ** (got - 1) < q <= Fraction(2) ** got
