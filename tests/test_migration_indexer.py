"""Indexer-key codecs: one writer rule per engine for fp8 (per-key scale) and fp4 (E2M1 + UE8M0).

Expected bytes are worked out by hand from each writer's rule (the engines' own bytes are checked
in tests/test_conformance.py against fixtures their code wrote); conversions are checked against
the E4M3 rounding bound.
"""

from __future__ import annotations

import struct

import pytest
import torch

from kvbridge import numerics as nx
from kvbridge.backends import dispatch
from kvbridge.errors import InputError, KVBridgeError
from kvbridge.ops import keys as ix

FP8, FP4 = ix.indexer_format("fp8"), ix.indexer_format("fp4")


def _f32_bytes(value: float) -> list[int]:
    return list(struct.pack("<f", value))


def test_formats_geometry():
    assert (FP8.record_bytes, FP8.split, FP8.page_bytes(64)) == (132, 128, 64 * 132)
    assert (FP4.record_bytes, FP4.split, FP4.page_bytes(32)) == (68, 64, 32 * 68)


def test_fp8_trtllm_rule_bytes():
    x = torch.zeros(1, 128)
    x[0, 0], x[0, 1], x[0, 2] = 2.0, -0.5, 2.0**-20
    rec = ix.encode_keys(x, FP8, "trtllm")
    scale = struct.unpack("<f", struct.pack("<f", 2.0 / 448.0))[0]  # fp32(2) / fp32(448), rounded once
    assert rec[0, 128:].tolist() == _f32_bytes(scale)
    # 2 * (448 / 2) = 448 (0x7E); -0.5 * 224 = -112 = -1.75 * 2^6 -> 0x80 | (13 << 3 | 6) = 0xEE;
    # 2^-20 * 224 ~ 2.1e-4 < 2^-10 (half the smallest subnormal) -> +0.
    assert rec[0, :3].tolist() == [0x7E, 0xEE, 0x00]
    assert not bool(rec[0, 3:128].any())


def test_fp8_sglang_rule_floors_small_keys_and_trtllm_zero_key():
    tiny = torch.full((1, 128), 1e-6)
    sg = ix.encode_keys(tiny, FP8, "sglang")
    floor_scale = struct.unpack("<f", struct.pack("<f", 1e-4))[0] / 448.0
    assert sg[0, 128:].tolist() == _f32_bytes(floor_scale)
    tr = ix.encode_keys(tiny, FP8, "trtllm")
    assert tr[0, 0] == 0x7E  # TensorRT-LLM scales every key to amax: the largest value reaches 448
    rocm = ix.encode_keys(tiny, FP8, "sglang-rocm")  # floor 1e-8 < amax: scaled to amax like TensorRT-LLM
    assert rocm[0, 0] == 0x7E
    zero = ix.encode_keys(torch.zeros(2, 128), FP8, "trtllm")
    assert not bool(zero.any())  # scale 0.0, value bytes 0 (TensorRT-LLM: scale 0, multiplier 1 when amax is 0)
    assert torch.equal(ix.decode_keys(zero, FP8), torch.zeros(2, 128))


def test_fp8_values_multiply_by_the_reciprocal():
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(64, 128, generator=gen) * 2.0 ** torch.randint(-6, 6, (64, 1), generator=gen).float()
    # a key whose value sits one fp32 ulp from an E4M3 midpoint: x / scale rounds to code 92,
    # x * fl(1 / scale) to 91 (the engines' bytes)
    x[0] = 0.0
    x[0, 0], x[0, 1] = 0.7654322981834412, 0.039296746253967285
    rec = ix.encode_keys(x, FP8, "sglang")
    scale = x.abs().amax(dim=1).clamp(min=1e-4) / 448
    assert torch.equal(rec[:, :128], nx.e4m3_encode(x * (1.0 / scale).unsqueeze(1)))
    assert rec[0, 1] == 91 and nx.e4m3_encode(x[0, 1:2] / scale[0])[0] == 92
    # From bf16 keys (what the engines quantize) about 0.05% of values land one code apart:
    # several per page of 64 keys, so most pages written by division would differ.
    keys = torch.randn(1024, 128, generator=gen).bfloat16().float()
    scale = keys.abs().amax(dim=1).clamp(min=1e-4) / 448
    recip = ix.encode_keys(keys, FP8, "sglang")[:, :128]
    divided = nx.e4m3_encode(keys / scale.unsqueeze(1))
    assert 0.0002 < float((recip != divided).float().mean()) < 0.001


def test_fp8_vllm_scale_is_a_power_of_two_from_bf16_keys_and_ue8m0_on_sm100():
    x = torch.zeros(2, 128)
    x[0, 0], x[0, 1] = 3.0, 1.0 + 2.0**-10  # bf16 rounds 1 + 2^-10 to 1.0
    x[1, 0] = 1e-6  # below the 1e-4 floor
    rec = ix.encode_keys(x, FP8, "vllm")
    # 3 * fl(1/448) ~ 0.0067: ceil(log2) = -7 -> scale 2^-7; 3 * 2^7 = 384 = 1.5 * 2^8 -> (15 << 3) | 4 = 0x7C
    assert rec[0, 128:].tolist() == _f32_bytes(2.0**-7) and rec[0, 0] == 0x7C
    assert rec[0, 1] == nx.e4m3_encode(torch.tensor([128.0]))[0]  # bf16(1 + 2^-10) * 2^7 = 128
    assert rec[1, 128:].tolist() == _f32_bytes(2.0**-22)  # 1e-4 / 448 ~ 2^-22.1 -> 2^-22
    mx = ix.encode_keys(x, FP8, "vllm-ue8m0")
    assert mx[0, 128:].tolist() == [127 - 7] * 4 and mx[1, 128:].tolist() == [105] * 4
    assert torch.equal(mx[:, :128], rec[:, :128])
    assert torch.equal(ix.decode_keys(mx, FP8, "vllm-ue8m0"), ix.decode_keys(rec, FP8))


def _fp4_row() -> torch.Tensor:
    x = torch.zeros(1, 128)
    # block 0, amax 6 -> scale 1: every midpoint, its negative, and a small negative
    x[0, :16] = torch.tensor([6.0, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -0.25, -0.75, -1.25, -1.75, -2.5, -3.5,
                              -5.0, -0.1])
    x[0, 32] = 3.0  # block 1: amax 3 -> scale 2^-1; 3 / 0.5 = 6 -> code 7
    x[0, 64] = 6.5  # block 2: above 6 -> scale 2^1; 3.25 -> code 5
    return x  # block 3 all zero


@pytest.mark.parametrize(
    ("rule", "codes", "zero_byte"),
    [
        # nearest-even, sign kept: ties up at 0.75, 1.75, 3.5; -0.25 and -0.1 -> 0x8
        ("trtllm", [7, 0, 2, 2, 4, 4, 6, 6, 8, 10, 10, 12, 12, 14, 14, 8], 1),
        ("vllm", [7, 0, 2, 2, 4, 4, 6, 6, 8, 10, 10, 12, 12, 14, 14, 8], 1),
        # thresholds: every tie to the smaller magnitude; no -0. SGLang's C4 pools floor amax at 1e-4
        # (zero block 2^-15, byte 112), its Triton writer floors amax / 6 at 1e-4 (2^-13, byte 114)
        ("sglang", [7, 0, 1, 2, 3, 4, 5, 6, 0, 9, 10, 11, 12, 13, 14, 0], 112),
        ("sglang-triton", [7, 0, 1, 2, 3, 4, 5, 6, 0, 9, 10, 11, 12, 13, 14, 0], 114),
        ("sglang-rne", [7, 0, 2, 2, 4, 4, 6, 6, 0, 10, 10, 12, 12, 14, 14, 0], 114),
        ("deepgemm", [7, 0, 1, 2, 3, 4, 5, 6, 0, 9, 10, 11, 12, 13, 14, 0], 112),
    ],
)
def test_fp4_writer_rules(rule, codes, zero_byte):
    rec = ix.encode_keys(_fp4_row(), FP4, rule)
    assert rec[0, :8].tolist() == [codes[i] | (codes[i + 1] << 4) for i in range(0, 16, 2)]
    assert rec[0, 16] == 7 and rec[0, 32] == 5
    assert rec[0, 64:].tolist() == [127, 126, 128, zero_byte]


def test_fp4_scale_exponents_per_rule():
    amax = torch.tensor([6.0, 12.0, 3.0, 6.0 * (1 + 2.0**-23), 6.0 * (1 - 2.0**-24), 1e-30, 0.0])
    blocks = torch.zeros(7, 32)
    blocks[:, 0] = amax
    assert ix.fp4_exponents(blocks, "trtllm").tolist() == [0, 1, -1, 1, 0, -102, -126]
    # SGLang's Triton writer floors the scale at 1e-4 (-> 2^-13); its C4 kernel and DeepGEMM floor amax at
    # 1e-4 before dividing by 6 (-> 2^-15)
    assert ix.fp4_exponents(blocks, "sglang-triton").tolist() == [0, 1, -1, 1, 0, -13, -13]
    assert ix.fp4_exponents(blocks, "sglang").tolist() == [0, 1, -1, 1, 0, -15, -15]
    assert ix.fp4_exponents(blocks, "deepgemm").tolist() == [0, 1, -1, 1, 0, -15, -15]


def test_fp4_round_trip_of_grid_values_is_exact():
    gen = torch.Generator().manual_seed(3)
    grid = torch.tensor(ix.E2M1_VALUES + tuple(-v for v in ix.E2M1_VALUES))
    block_scale = 2.0 ** torch.randint(-8, 8, (20, 4, 1), generator=gen).float()
    x = grid[torch.randint(0, 16, (20, 4, 32), generator=gen)] * block_scale
    x[:, :, :1] = 6.0 * block_scale  # pin each block's amax to 6 * its scale
    x = x.reshape(20, 128)
    for rule in ix.FP4_RULES:
        rec = ix.encode_keys(x, FP4, rule)
        assert torch.equal(ix.decode_keys(rec, FP4), x), rule


@pytest.mark.parametrize(("src", "src_rule", "dst_rule"), [
    ("fp4", "trtllm", "sglang"), ("fp8", "trtllm", "sglang"), ("fp8", "sglang", "trtllm"),
    ("fp8", "vllm-ue8m0", "sglang"),
])
def test_conversion_to_fp8_is_within_e4m3_rounding(src, src_rule, dst_rule):
    fmt = ix.indexer_format(src)
    gen = torch.Generator().manual_seed(7)
    keys = torch.randn(64, 128, generator=gen) * 2.0 ** torch.randint(-6, 6, (64, 1), generator=gen)
    rec = ix.encode_keys(keys, fmt, src_rule)
    values = ix.decode_keys(rec, fmt, src_rule)
    out, err = ix.transcode_keys(rec, fmt, FP8, dst_rule, src_rule)
    back = ix.decode_keys(out, FP8)
    assert err == float((back - values).abs().max())
    # E4M3 keeps 4 significant bits (relative error <= 2^-4) above 2^-6 * scale and rounds to
    # multiples of 2^-9 * scale below; the fp32 scale product adds < 2^-20 relative.
    scale = values.abs().amax(dim=1, keepdim=True).clamp(min=1e-4) / 448
    bound = torch.maximum(values.abs() * 2.0**-4, scale * 2.0**-10) * (1 + 2.0**-20)
    assert bool(((back - values).abs() <= bound).all())


def test_same_rule_fp8_round_trip_keeps_values_close():
    keys = torch.randn(8, 128, generator=torch.Generator().manual_seed(1))
    rec = ix.encode_keys(keys, FP8, "sglang")
    out, err = ix.transcode_keys(rec, FP8, FP8, "sglang")
    # Re-deriving the scale from decoded values can move it by an fp32 ulp; values stay within 2^-4.
    assert err <= float(ix.decode_keys(rec, FP8).abs().max()) * 2.0**-4


def test_bad_inputs():
    with pytest.raises(InputError, match="unknown indexer format 'fp6'"):
        ix.indexer_format("fp6")
    with pytest.raises(InputError, match="multiple of 32"):
        ix.indexer_format("fp4", 100)
    with pytest.raises(InputError, match=r"indexer keys must be a tensor \[num_keys, 128\]"):
        ix.encode_keys(torch.zeros(3, 64), FP8, "trtllm")
    with pytest.raises(InputError, match="NaN or Inf"):
        ix.encode_keys(torch.full((1, 128), float("nan")), FP8, "trtllm")
    with pytest.raises(InputError, match="rule 'vllm-ue8m0' does not apply to fp4"):
        ix.encode_keys(torch.zeros(1, 128), FP4, "vllm-ue8m0")
    with pytest.raises(InputError, match=r"fp8 indexer records must be uint8 \[num_keys, 132\]"):
        ix.decode_keys(torch.zeros(1, 68, dtype=torch.uint8), FP8)


@pytest.mark.parametrize(("encode", "ties_to_even", "negative_zero"), [
    (nx.e2m1_encode, True, True),
    (nx.e2m1_encode_rne_no_negative_zero, True, False),
    (nx.e2m1_encode_threshold, False, False),
])
def test_e2m1_rules_on_a_dense_grid(encode, ties_to_even, negative_zero):
    x = torch.arange(-8 * 64, 8 * 64 + 1, dtype=torch.float32) / 64  # steps of 1/64 cover every tie
    x = torch.cat([x, torch.tensor([-0.0, -1e-30])])
    grid = torch.tensor(ix.E2M1_VALUES, dtype=torch.float64)
    dist = (x.abs().double().clamp(max=6.0).unsqueeze(1) - grid).abs()
    best = dist.min(dim=1, keepdim=True).values
    candidates = dist == best  # one or two nearest codes; on a tie take the even one or the smaller
    pick = candidates & (torch.arange(8) % 2 == 0) if ties_to_even else candidates
    want = torch.where(pick.any(dim=1), pick.int().argmax(dim=1), candidates.int().argmax(dim=1))
    negative = (x < 0) | ((x == 0) & (1 / x < 0))
    if not negative_zero:
        negative &= want != 0
    want = want | negative.int() << 3
    assert torch.equal(encode(x).int(), want.int())


def test_fnuz_fp8_keys_take_the_torch_path():
    """The native fp4 -> fp8 kernel writes OCP E4M3 only: keys for an E4M3 FNUZ rule (SGLang's gfx942 store) are
    converted by the torch codec, whose bytes are the writer's (tests/test_conformance.py)."""
    src, dst = ix.indexer_format("fp4"), ix.indexer_format("fp8")
    gen = torch.Generator().manual_seed(2)
    records = torch.randint(0, 256, (64, src.record_bytes), dtype=torch.uint8, generator=gen)
    records[:, src.split :] = 120
    for rule in ix.FNUZ_RULES:
        assert not ix.native_transcode_applies(records, src, dst, rule)
        got, _ = ix.transcode_keys(records, src, dst, rule)
        assert torch.equal(got, ix.encode_keys(ix.decode_keys(records, src), dst, rule))
        assert not bool((got[:, : dst.dim] == 0x80).any())  # FNUZ's NaN code: never written for finite keys


# UE8M0 fp8 indexer scales are defined for 128-value keys only; the FNUZ rules have no native kernel (above).
@pytest.mark.parametrize(("rule", "dim"), [(r, d) for r in ix.FP8_RULES for d in (128, 64)
                                           if not (r == "vllm-ue8m0" and d != 128) and r not in ix.FNUZ_RULES])
def test_native_fp4_to_fp8_equals_the_torch_path(monkeypatch, rule, dim):
    """The native fp4 -> fp8 kernel writes the torch path's bytes and measures its error, on every fp4
    byte pattern: random codes and scale bytes (0 and 254 included), all-zero and -0 keys, and keys
    whose amax falls below the writers' floors; a NaN scale byte (0xFF) is refused like the torch path."""
    src, dst = ix.indexer_format("fp4", dim), ix.indexer_format("fp8", dim)
    g = torch.Generator().manual_seed(7)
    n = 5000  # two kernel chunks
    records = torch.randint(0, 256, (n, src.record_bytes), dtype=torch.uint8, generator=g)
    scales = records[:, src.split :]
    scales.copy_(torch.randint(90, 160, scales.shape, generator=g, dtype=torch.uint8))
    scales[:40] = torch.tensor([10, 40, 127, 252], dtype=torch.uint8).repeat(10).view(40, 1)
    records[40:50, : src.split] = 0
    records[50:60, : src.split] = 0x88  # -0.0 everywhere
    records[60:70, src.split :] = 100  # amax ~ 2^-27 * 6: below the 1e-4 floor
    assert ix.native_transcode_applies(records, src, dst, rule)
    got, got_err = ix.transcode_keys(records, src, dst, rule)
    monkeypatch.setenv("KVBRIDGE_BACKEND", "reference")
    assert not ix.native_transcode_applies(records, src, dst, rule)
    want, want_err = ix.transcode_keys(records, src, dst, rule)
    assert torch.equal(got, want)
    assert got_err == want_err
    monkeypatch.delenv("KVBRIDGE_BACKEND")
    for byte in (255, 253, 0):  # NaN; 6 * 2^126 = Inf; 448 / (6 * 2^-127) = Inf (trtllm)
        bad = records.clone()
        bad[3000, src.split :] = byte
        bad[3000, 0] = 7
        if byte == 0 and rule != "trtllm":
            continue
        with pytest.raises(KVBridgeError) as got:
            ix.transcode_keys(bad, src, dst, rule)
        monkeypatch.setenv("KVBRIDGE_BACKEND", "reference")
        with pytest.raises(KVBridgeError) as want:
            ix.transcode_keys(bad, src, dst, rule)
        monkeypatch.delenv("KVBRIDGE_BACKEND")
        assert str(got.value) == str(want.value)


@pytest.mark.parametrize("rule", ["sglang", "deepgemm", "sglang-rocm", "trtllm"])
def test_native_fp4_to_fp8_shifted_codes_at_every_block_distance(monkeypatch, rule):
    """The fp32-multiplier rules' shifted codes (a block's codes from the key's two codes C_1, C_1.5, stepping 8
    per power of two) against the torch path: every block 0..14 binades below the key's largest one (E4M3
    normals, the subnormal boundary, underflow), every code present, keys whose amax saturates at 448, both as
    records and as a page's 8-byte aligned parts."""
    g = torch.Generator().manual_seed(13)
    n = 4 * 15 * 16
    records = torch.randint(0, 256, (n, FP4.record_bytes), dtype=torch.uint8, generator=g)
    records[:, :16] = torch.arange(16, dtype=torch.uint8) * 17  # block 0: every code in both nibbles
    top = torch.randint(100, 140, (n,), generator=g)
    gap = torch.arange(n) // 64 % 15
    scales = torch.stack([top, top - gap, top - (gap + 3) % 15, top - gap // 2], dim=1)
    records[:, FP4.split :] = scales.to(torch.uint8)
    monkeypatch.setenv("KVBRIDGE_BACKEND", "reference")
    want, want_err = ix.transcode_keys(records, FP4, FP8, rule)
    monkeypatch.delenv("KVBRIDGE_BACKEND")
    got, got_err = ix.transcode_keys(records, FP4, FP8, rule)
    assert torch.equal(got, want) and got_err == want_err
    keys, key_scales = records[:, : FP4.split].contiguous(), records[:, FP4.split :].contiguous()
    out_keys, out_scales = torch.empty(n, 128, dtype=torch.uint8), torch.empty(n, 4, dtype=torch.uint8)
    flat = [x.view(-1) for x in (keys, key_scales, out_keys, out_scales)]
    for measure in (True, False):
        err = dispatch.fp4_to_fp8_key_rows(flat[0], 64, flat[1], 4, n, flat[2], 128, flat[3], 4, 128, rule,
                                           measure=measure)
        assert torch.equal(torch.cat([out_keys, out_scales], dim=1), want)
        assert err == (want_err if measure else 0.0)
