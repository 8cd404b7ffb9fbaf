"""Indexer-key codecs: fp8 (per-key fp32 scale, TensorRT-LLM and SGLang rules) and fp4 (E2M1 + UE8M0).

Expected bytes are worked out by hand from the spec's rules (section 5); conversions are
checked against the E4M3 rounding bound.
"""

from __future__ import annotations

import struct

import pytest
import torch

from kvbridge import indexer as ix
from kvbridge.errors import InputError

FP8, FP4 = ix.indexer_format("fp8"), ix.indexer_format("fp4")


def _f32_bytes(value: float) -> list[int]:
    return list(struct.pack("<f", value))


def test_formats_geometry():
    assert (FP8.record_bytes, FP8.split, FP8.page_bytes(64)) == (132, 128, 64 * 132)
    assert (FP4.record_bytes, FP4.split, FP4.page_bytes(32)) == (68, 64, 32 * 68)


def test_fp8_trtllm_rule_bytes():
    x = torch.zeros(1, 128)
    x[0, 0], x[0, 1], x[0, 2] = 2.0, -0.5, 2.0**-20
    rec = ix.encode_keys(x, FP8, "amax")
    scale = struct.unpack("<f", struct.pack("<f", 2.0 / 448.0))[0]  # fp32(2) / fp32(448), rounded once
    assert rec[0, 128:].tolist() == _f32_bytes(scale)
    # 2 / scale rounds to 448 (0x7E); -0.5 / scale = -112 = -1.75 * 2^6 -> 0x80 | (13 << 3 | 6) = 0xEE;
    # 2^-20 / scale ~ 2.1e-4 < 2^-10 (half the smallest subnormal) -> +0.
    assert rec[0, :3].tolist() == [0x7E, 0xEE, 0x00]
    assert not bool(rec[0, 3:128].any())


def test_fp8_sglang_rule_floors_small_keys_and_trtllm_zero_key():
    tiny = torch.full((1, 128), 1e-6)
    sg = ix.encode_keys(tiny, FP8, "amax-1e-4")
    floor_scale = struct.unpack("<f", struct.pack("<f", 1e-4))[0] / 448.0
    assert sg[0, 128:].tolist() == _f32_bytes(floor_scale)
    tr = ix.encode_keys(tiny, FP8, "amax")
    assert tr[0, 0] == 0x7E  # TensorRT-LLM scales every key to amax: the largest value reaches 448
    zero = ix.encode_keys(torch.zeros(2, 128), FP8, "amax")
    assert not bool(zero.any())  # scale 0.0, value bytes 0 (kvbridge's choice for 0 / 0)
    assert torch.equal(ix.decode_keys(zero, FP8), torch.zeros(2, 128))


def test_fp4_bytes_ties_to_even_and_scale_exponent():
    x = torch.zeros(1, 128)
    # block 0, amax 6 -> scale 2^ceil(log2(1)) = 1 (byte 127); ties go to the even code
    x[0, :10] = torch.tensor([6.0, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -1.5, 7.0 - 1.0])
    x[0, 32] = 3.0  # block 1: amax 3 -> 2^ceil(log2(0.5)) = 2^-1 (byte 126); 3 / 0.5 = 6 -> code 7
    x[0, 64] = 6.0001  # block 2: just above 6 -> 2^1 (byte 128); 6.0001 / 2 = 3.00005 -> code 5
    rec = ix.encode_keys(x, FP4, "ue8m0")
    codes = [7, 0, 2, 2, 4, 4, 6, 6, 0x8 | 3, 7]
    packed = [codes[i] | (codes[i + 1] << 4) for i in range(0, 10, 2)]
    assert rec[0, :5].tolist() == packed
    assert rec[0, 16] == 7 and rec[0, 32] == 5
    assert rec[0, 64:].tolist() == [127, 126, 128, 0]  # an all-zero block gets 2^-127, byte 0
    back = ix.decode_keys(rec, FP4)
    assert back[0, :10].tolist() == [6.0, 0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, -1.5, 6.0]
    assert back[0, 32] == 3.0 and back[0, 64] == 6.0


def test_fp4_scale_exponent_is_exact_at_powers_of_two():
    amax = torch.tensor([6.0, 12.0, 3.0, 6.0 * (1 + 2.0**-23), 6.0 * (1 - 2.0**-24), 1e-30, 0.0])
    assert ix.fp4_scale_exponent(amax).tolist() == [0, 1, -1, 1, 0, -102, -127]


def test_fp4_round_trip_of_grid_values_is_exact():
    gen = torch.Generator().manual_seed(3)
    grid = torch.tensor(ix.E2M1_VALUES + tuple(-v for v in ix.E2M1_VALUES))
    block_scale = 2.0 ** torch.randint(-8, 8, (20, 4, 1), generator=gen).float()
    x = grid[torch.randint(0, 16, (20, 4, 32), generator=gen)] * block_scale
    x[:, :, :1] = 6.0 * block_scale  # pin each block's amax to 6 * its scale
    x = x.reshape(20, 128)
    rec = ix.encode_keys(x, FP4, "ue8m0")
    assert torch.equal(ix.decode_keys(rec, FP4), x)


@pytest.mark.parametrize(("src", "src_rule", "dst_rule"), [("fp4", "ue8m0", "amax-1e-4"), ("fp8", "amax", "amax-1e-4"),
                                                            ("fp8", "amax-1e-4", "amax")])
def test_conversion_to_fp8_is_within_e4m3_rounding(src, src_rule, dst_rule):
    fmt = ix.indexer_format(src)
    gen = torch.Generator().manual_seed(7)
    keys = torch.randn(64, 128, generator=gen) * 2.0 ** torch.randint(-6, 6, (64, 1), generator=gen)
    rec = ix.encode_keys(keys, fmt, src_rule)
    values = ix.decode_keys(rec, fmt)
    out, err = ix.transcode_keys(rec, fmt, FP8, dst_rule)
    back = ix.decode_keys(out, FP8)
    assert err == float((back - values).abs().max())
    # E4M3 keeps 4 significant bits (relative error <= 2^-4) above 2^-6 * scale and rounds to
    # multiples of 2^-9 * scale below; the fp32 scale product adds < 2^-20 relative.
    scale = values.abs().amax(dim=1, keepdim=True).clamp(min=1e-4) / 448
    bound = torch.maximum(values.abs() * 2.0**-4, scale * 2.0**-10) * (1 + 2.0**-20)
    assert bool(((back - values).abs() <= bound).all())


def test_same_rule_fp8_round_trip_keeps_values_close():
    keys = torch.randn(8, 128, generator=torch.Generator().manual_seed(1))
    rec = ix.encode_keys(keys, FP8, "amax-1e-4")
    out, err = ix.transcode_keys(rec, FP8, FP8, "amax-1e-4")
    # Re-deriving the scale from decoded values can move it by an fp32 ulp; values stay within 2^-4.
    assert err <= float(ix.decode_keys(rec, FP8).abs().max()) * 2.0**-4


def test_bad_inputs():
    with pytest.raises(InputError, match="unknown indexer format 'fp6'"):
        ix.indexer_format("fp6")
    with pytest.raises(InputError, match="multiple of 32"):
        ix.indexer_format("fp4", 100)
    with pytest.raises(InputError, match=r"indexer keys must be a tensor \[num_keys, 128\]"):
        ix.encode_keys(torch.zeros(3, 64), FP8, "amax")
    with pytest.raises(InputError, match="NaN or Inf"):
        ix.encode_keys(torch.full((1, 128), float("nan")), FP8, "amax")
    with pytest.raises(InputError, match="rule 'amax' does not apply to fp4"):
        ix.encode_keys(torch.zeros(1, 128), FP4, "amax")
    with pytest.raises(InputError, match=r"fp8 indexer records must be uint8 \[num_keys, 132\]"):
        ix.decode_keys(torch.zeros(1, 68, dtype=torch.uint8), FP8)


def test_e2m1_encode_is_round_to_nearest_even_on_a_dense_grid():
    x = torch.arange(-8 * 64, 8 * 64 + 1, dtype=torch.float32) / 64  # steps of 1/64 cover every tie
    grid = torch.tensor(ix.E2M1_VALUES, dtype=torch.float64)
    dist = (x.abs().double().clamp(max=6.0).unsqueeze(1) - grid).abs()
    best = dist.min(dim=1, keepdim=True).values
    candidates = dist == best  # one or two nearest codes; on a tie take the even one
    even = candidates & (torch.arange(8) % 2 == 0)
    want = torch.where(even.any(dim=1), even.int().argmax(dim=1), candidates.int().argmax(dim=1))
    want = want | ((x < 0) | ((x == 0) & (1 / x < 0))).int() << 3
    assert torch.equal(ix.e2m1_encode(x).int(), want.int())
