"""kvbridge.study.synthetic: DeepSeek-V4-shaped latents and queries."""

from __future__ import annotations

import math

import pytest
import torch

from kvbridge import InputError
from kvbridge.study.synthetic import (
    COMPRESSED_ROPE,
    SWA_ROPE,
    apply_rope,
    channel_gains,
    latents,
    queries,
    rope_frequencies,
    topk_indices,
)


def test_deterministic_for_a_seed_and_different_across_seeds():
    a = latents(64, seed=3)
    assert torch.equal(a, latents(64, seed=3))
    assert not torch.equal(a, latents(64, seed=4))
    q = queries(a, batch=2, s_q=1, heads=4, seed=1)
    assert torch.equal(q, queries(a, batch=2, s_q=1, heads=4, seed=1))
    assert a.dtype == q.dtype == torch.float32 and q.shape == (2, 1, 4, 512)


def test_rope_frequencies_follow_deepseek_v4_settings():
    swa = rope_frequencies(SWA_ROPE)
    assert swa[0] == 1.0 and math.isclose(float(swa[1]), 10000 ** (-2 / 64), rel_tol=1e-15)
    comp = rope_frequencies(COMPRESSED_ROPE)
    plain = 1.0 / 160000.0 ** (torch.arange(0, 64, 2, dtype=torch.float64) / 64)
    # YaRN (factor 16, original context 65536, beta 32/1): fast pairs (wavelength well inside the
    # original context) keep their frequency, slow pairs are divided by 16, a ramp in between.
    assert torch.equal(comp[:15], plain[:15])
    assert torch.allclose(comp[25:], plain[25:] / 16, rtol=1e-15, atol=0)
    assert bool(((comp[15:25] <= plain[15:25]) & (comp[15:25] >= plain[15:25] / 16)).all())


def test_rope_part_is_a_rotation_at_the_given_positions():
    x = latents(8, seed=1, positions=torch.zeros(8, dtype=torch.int64))
    y = latents(8, seed=1, positions=torch.arange(8) * 1000)
    assert torch.equal(x[:, :448], y[:, :448])
    # A rotation keeps each pair's norm (fp32 rounding of the rotated values aside).
    pair_x = x[:, 448:].reshape(8, 32, 2).norm(dim=-1)
    pair_y = y[:, 448:].reshape(8, 32, 2).norm(dim=-1)
    assert torch.allclose(pair_x, pair_y, rtol=1e-6, atol=0)
    # Pair 0 of the SWA layer turns by exactly 1 radian per position.
    r = torch.zeros(1, 64)
    r[0, 0] = 1.0
    rot = apply_rope(r, torch.tensor([3]), SWA_ROPE)
    assert math.isclose(float(rot[0, 0]), math.cos(3.0), abs_tol=1e-7)
    assert math.isclose(float(rot[0, 1]), math.sin(3.0), abs_tol=1e-7)


def test_compressed_layer_positions_are_multiples_of_the_ratio():
    default = latents(16, seed=2, layer="compressed", compress_ratio=4)
    explicit = latents(16, seed=2, layer="compressed", positions=torch.arange(16) * 4)
    assert torch.equal(default, explicit)


def test_magnitude_and_rope_ratio():
    base = latents(256, seed=5)
    big = latents(256, seed=5, magnitude=10.0)
    assert torch.allclose(big, base * 10.0, rtol=1e-6, atol=0)
    for ratio in (0.1, 2.0):
        x = latents(256, seed=5, rope_ratio=ratio)
        measured = x[:, 448:].square().mean().sqrt() / x[:, :448].square().mean().sqrt()
        assert math.isclose(float(measured), ratio, rel_tol=1e-5)


def test_nope_is_rmsnormed_times_gains_with_outlier_channels():
    x = latents(512, seed=7, magnitude=1.0)
    gains = channel_gains(seed=7)
    outliers = (gains[:448] > 4.0).nonzero().flatten()
    assert outliers.numel() == 4
    per_channel = x[:, :448].abs().mean(dim=0)
    assert set(per_channel.topk(4).indices.tolist()) == set(outliers.tolist())
    # Dividing by the gains leaves unit-RMS tokens (RMSNorm before the gains, rope rescaled aside).
    ungained = x[:, :448] / gains[:448]
    rms = ungained.square().mean(dim=1).sqrt()
    assert float(rms.min()) > 0.5 and float(rms.max()) < 2.0


def test_peaked_queries_concentrate_attention_and_flat_ones_do_not():
    keys = latents(512, seed=9)
    scale = 512**-0.5

    def top4_mass(peakedness: float) -> float:
        q = queries(keys, batch=2, s_q=2, heads=8, seed=4, peakedness=peakedness)
        w = torch.softmax(torch.einsum("bshd,nd->bshn", q, keys) * scale, dim=-1)
        return float(w.topk(4, dim=-1).values.sum(dim=-1).mean())

    assert top4_mass(12.0) > 0.5
    assert top4_mass(0.0) < 0.1


def test_topk_indices_pick_the_highest_logits():
    keys = latents(100, seed=1)
    q = queries(keys, batch=1, s_q=2, heads=2, seed=2)
    idx = topk_indices(q, keys, 16)
    assert idx.dtype == torch.int32 and idx.shape == (1, 2, 16)
    best = torch.einsum("bshd,nd->bshn", q, keys).amax(dim=2)
    assert torch.equal(idx[0, 0].long(), best[0, 0].topk(16).indices)
    padded = topk_indices(q, keys[:10], 16)
    assert bool((padded[..., 10:] == -1).all()) and bool((padded[..., :10] >= 0).all())


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda: latents(4, layer="c4"), "layer must be one of"),
        (lambda: latents(4, magnitude=0.0), "magnitude must be > 0"),
        (lambda: latents(4, positions=torch.zeros(3, dtype=torch.int64)), "positions must be"),
        (lambda: latents(4, shared_fraction=1.0), "shared_fraction"),
        (lambda: queries(torch.zeros(4, 448), batch=1, s_q=1, heads=1), "keys must be"),
        (lambda: queries(torch.zeros(4, 512), batch=1, s_q=1, heads=1, focus_tokens=5), "focus_tokens"),
        (lambda: queries(torch.zeros(4, 512), batch=0, s_q=1, heads=1), "batch must be"),
    ],
)
def test_bad_parameters_are_named(call, message):
    with pytest.raises(InputError, match=message):
        call()
