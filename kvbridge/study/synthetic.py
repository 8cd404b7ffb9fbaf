"""Synthetic DeepSeek-V4-shaped KV latents and queries (deterministic for a seed).

A cached DeepSeek-V4 token is a 512-vector (spec section 1): dims 0..447 "nope" after the
KV RMSNorm and its learned per-channel gains, dims 448..511 "rope": 32 interleaved (re, im)
pairs (GPT-J style, pair i = dims 448+2i, 448+2i+1) rotated by ``position * freq_i`` radians.

Rope settings (DeepSeek-V4's model config):
- SWA-only layers (compress ratio 0): base ``rope_theta = 10000``, no YaRN.
- Compressed layers (ratio 4 or 128): base ``compress_rope_theta = 160000`` with YaRN
  (factor 16, original context 65536, beta_fast 32, beta_slow 1), applied since the deployed
  context exceeds 65536. Compressed token c of a ratio-r layer sits at position ``c * r``.

Units: latents are in the model's activation units (nominal RMS ~1 per nope channel before
``magnitude``); positions are token positions; logits and peakedness are in nats.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from kvbridge.errors import InputError
from kvbridge.layouts.codec import HEAD_DIM, NOPE_DIM, ROPE_DIM
from kvbridge.study.params import LAYERS


@dataclass(frozen=True)
class RopeSettings:
    """Rotary settings of one layer kind: ``base`` theta and optional YaRN parameters."""

    base: float
    yarn_factor: float | None = None
    original_context: int | None = None  # tokens
    beta_fast: float | None = None
    beta_slow: float | None = None


SWA_ROPE = RopeSettings(base=10000.0)
COMPRESSED_ROPE = RopeSettings(base=160000.0, yarn_factor=16.0, original_context=65536, beta_fast=32.0, beta_slow=1.0)


def rope_settings(layer: str) -> RopeSettings:
    """DeepSeek-V4's rope settings for ``layer`` = ``swa`` or ``compressed``."""
    if layer not in LAYERS:
        raise InputError(f"layer must be one of {', '.join(LAYERS)}, got {layer!r}")
    return SWA_ROPE if layer == "swa" else COMPRESSED_ROPE


def _yarn_correction_dim(rotations: float, dim: int, base: float, context: int) -> float:
    """Rope dim (of ``dim``) whose wavelength fits ``rotations`` full turns in ``context`` tokens."""
    return dim * math.log(context / (rotations * 2 * math.pi)) / (2 * math.log(base))


def rope_frequencies(settings: RopeSettings) -> torch.Tensor:
    """float64 [32]: rotation of pair i in radians per position, YaRN-blended when configured.

    YaRN keeps high-frequency pairs (short wavelengths) as they are, divides low-frequency
    pairs by ``yarn_factor``, and ramps linearly in between (pairs ``low``..``high``).
    """
    half = ROPE_DIM // 2
    freqs = 1.0 / settings.base ** (torch.arange(0, ROPE_DIM, 2, dtype=torch.float64) / ROPE_DIM)
    if settings.yarn_factor is None:
        return freqs
    low = math.floor(_yarn_correction_dim(settings.beta_fast, ROPE_DIM, settings.base, settings.original_context))
    high = math.ceil(_yarn_correction_dim(settings.beta_slow, ROPE_DIM, settings.base, settings.original_context))
    low, high = max(low, 0), min(high, ROPE_DIM - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(half, dtype=torch.float64) - low) / (high - low)).clamp(0.0, 1.0)
    keep = 1.0 - ramp  # 1: keep the frequency, 0: divide it by the factor
    return freqs / settings.yarn_factor * (1.0 - keep) + freqs * keep


def apply_rope(rope: torch.Tensor, positions: torch.Tensor, settings: RopeSettings) -> torch.Tensor:
    """Rotate interleaved pairs of ``rope`` [N, 64] by ``positions`` [N] (float64 math, fp32 out)."""
    angle = positions.to(torch.float64)[:, None] * rope_frequencies(settings)[None, :]
    cos, sin = torch.cos(angle), torch.sin(angle)
    pairs = rope.to(torch.float64).reshape(-1, ROPE_DIM // 2, 2)
    re, im = pairs[..., 0], pairs[..., 1]
    rotated = torch.stack([re * cos - im * sin, re * sin + im * cos], dim=-1)
    return rotated.reshape(-1, ROPE_DIM).to(torch.float32)


def channel_gains(*, seed: int, gain_spread: float = 0.25, outlier_channels: int = 4,
                  outlier_gain: float = 8.0) -> torch.Tensor:
    """float32 [512] per-channel RMSNorm gains: log-normal (sigma ``gain_spread``) around 1, with
    ``outlier_channels`` nope channels (chosen by ``seed``) at ``outlier_gain`` times that."""
    gen = torch.Generator().manual_seed(seed * 2 + 1)
    gains = torch.exp(torch.randn(HEAD_DIM, generator=gen, dtype=torch.float64) * gain_spread)
    outliers = torch.randperm(NOPE_DIM, generator=gen)[:outlier_channels]
    gains[outliers] *= outlier_gain
    return gains.to(torch.float32)


def _check_positive(name: str, value: float, allow_zero: bool = False) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise InputError(f"{name} must be a finite number, got {value!r}")
    if value < 0 or (value == 0 and not allow_zero):
        raise InputError(f"{name} must be {'>= 0' if allow_zero else '> 0'}, got {value!r}")
    return float(value)


def _check_count(name: str, value: int, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise InputError(f"{name} must be an integer >= {minimum}, got {value!r}")
    return value


def latents(
    num_tokens: int,
    *,
    seed: int = 0,
    layer: str = "swa",
    magnitude: float = 1.0,
    rope_ratio: float = 1.0,
    positions: torch.Tensor | None = None,
    compress_ratio: int = 4,
    shared_fraction: float = 0.3,
    gain_spread: float = 0.25,
    outlier_channels: int = 4,
    outlier_gain: float = 8.0,
) -> torch.Tensor:
    """float32 [num_tokens, 512] DeepSeek-V4-shaped KV latents.

    - ``seed``: all randomness (gains, outliers, tokens) follows from it.
    - ``layer``: ``swa`` (base 10000) or ``compressed`` (base 160000 + YaRN).
    - ``magnitude``: overall multiplier of the whole vector (1.0 = RMSNorm output times gains).
    - ``rope_ratio``: RMS of the rope part (before rotation, which keeps it) over the RMS of
      the nope part.
    - ``positions``: int [num_tokens] token positions; default ``0..N-1`` for ``swa`` and
      ``c * compress_ratio`` for compressed token c.
    - ``shared_fraction``: in [0, 1), share of each token's pre-norm variance in a direction
      common to all tokens (real latents are far from isotropic).
    - ``gain_spread``, ``outlier_channels``, ``outlier_gain``: see ``channel_gains``.
    """
    n = _check_count("num_tokens", num_tokens, 0)
    settings = rope_settings(layer)
    _check_positive("magnitude", magnitude)
    _check_positive("rope_ratio", rope_ratio, allow_zero=True)
    _check_count("compress_ratio", compress_ratio, 1)
    if not (isinstance(shared_fraction, (int, float)) and 0.0 <= shared_fraction < 1.0):
        raise InputError(f"shared_fraction must lie in [0, 1), got {shared_fraction!r}")
    _check_positive("gain_spread", gain_spread, allow_zero=True)
    _check_count("outlier_channels", outlier_channels, 0)
    if outlier_channels > NOPE_DIM:
        raise InputError(f"outlier_channels must be at most {NOPE_DIM}, got {outlier_channels}")
    _check_positive("outlier_gain", outlier_gain)
    if positions is None:
        positions = torch.arange(n, dtype=torch.int64) * (compress_ratio if layer == "compressed" else 1)
    elif not isinstance(positions, torch.Tensor) or tuple(positions.shape) != (n,) or positions.is_floating_point():
        raise InputError(f"positions must be an integer tensor of shape ({n},)")
    gen = torch.Generator().manual_seed(seed * 2)
    shared = torch.randn(HEAD_DIM, generator=gen, dtype=torch.float64)
    noise = torch.randn(n, HEAD_DIM, generator=gen, dtype=torch.float64)
    pre = math.sqrt(shared_fraction) * shared + math.sqrt(1.0 - shared_fraction) * noise
    normed = pre / pre.square().mean(dim=1, keepdim=True).sqrt().clamp_min(1e-30)  # RMSNorm (eps-free)
    x = normed * channel_gains(seed=seed, gain_spread=gain_spread, outlier_channels=outlier_channels,
                               outlier_gain=outlier_gain).to(torch.float64)
    nope, rope = x[:, :NOPE_DIM], x[:, NOPE_DIM:]
    nope_rms = nope.square().mean().sqrt() if n else torch.tensor(1.0, dtype=torch.float64)
    rope_rms = rope.square().mean().sqrt() if n else torch.tensor(1.0, dtype=torch.float64)
    rope = rope * (rope_ratio * nope_rms / rope_rms.clamp_min(1e-30))
    out = torch.empty(n, HEAD_DIM, dtype=torch.float32)
    out[:, :NOPE_DIM] = (nope * magnitude).to(torch.float32)
    out[:, NOPE_DIM:] = apply_rope(rope * magnitude, positions, settings)
    return out


def queries(
    keys: torch.Tensor,
    *,
    batch: int,
    s_q: int,
    heads: int,
    seed: int = 0,
    peakedness: float = 8.0,
    focus_tokens: int = 4,
    logit_noise: float = 1.0,
    softmax_scale: float = HEAD_DIM**-0.5,
) -> torch.Tensor:
    """float32 (batch, s_q, heads, 512) queries over ``keys`` [N, 512] with tunable attention.

    Each (batch, query, head) attends to ``focus_tokens`` keys drawn at random: its query points
    along the mean of their centred keys, scaled so those keys' logits exceed an average key's by
    about ``peakedness`` nats (after ``softmax_scale``), plus an isotropic part giving logits a
    spread of about ``logit_noise`` nats. ``peakedness=0`` gives flat (noise-only) attention.
    """
    if not isinstance(keys, torch.Tensor) or keys.dim() != 2 or keys.shape[1] != HEAD_DIM or keys.shape[0] < 1:
        raise InputError(f"keys must be a tensor of shape [num_tokens >= 1, {HEAD_DIM}]")
    b = _check_count("batch", batch, 1)
    sq = _check_count("s_q", s_q, 1)
    h = _check_count("heads", heads, 1)
    _check_positive("peakedness", peakedness, allow_zero=True)
    _check_positive("logit_noise", logit_noise, allow_zero=True)
    _check_positive("softmax_scale", softmax_scale)
    n = keys.shape[0]
    f = _check_count("focus_tokens", focus_tokens, 1)
    if f > n:
        raise InputError(f"focus_tokens must be at most the number of keys ({n}), got {f}")
    k = keys.to(torch.float64)
    centred = k - k.mean(dim=0)
    gen = torch.Generator().manual_seed(seed * 2 + 3)
    rows = b * sq * h
    focus = torch.rand(rows, n, generator=gen, dtype=torch.float64).argsort(dim=1)[:, :f]
    direction = centred[focus].mean(dim=1)  # [rows, 512]
    norm2 = direction.square().sum(dim=1, keepdim=True).clamp_min(1e-30)
    peak = direction * (peakedness / (softmax_scale * norm2))
    key_norm = centred.square().sum(dim=1).mean().sqrt().clamp_min(1e-30)
    noise = torch.randn(rows, HEAD_DIM, generator=gen, dtype=torch.float64) * (logit_noise / (softmax_scale * key_norm))
    return (peak + noise).to(torch.float32).reshape(b, sq, h, HEAD_DIM)


def topk_indices(
    q: torch.Tensor, keys: torch.Tensor, topk: int, *, softmax_scale: float = HEAD_DIM**-0.5
) -> torch.Tensor:
    """int32 (b, s_q, topk): per query token, the ``topk`` key slots with the highest logit
    (max over heads), best first; -1 pads when there are fewer than ``topk`` keys.

    Stands in for DeepSeek-V4's indexer: one index list shared by all heads of a query token.
    """
    if not isinstance(q, torch.Tensor) or q.dim() != 4 or q.shape[3] != HEAD_DIM:
        raise InputError(f"q must have shape (b, s_q, h_q, {HEAD_DIM})")
    if not isinstance(keys, torch.Tensor) or keys.dim() != 2 or keys.shape[1] != HEAD_DIM:
        raise InputError(f"keys must have shape [num_tokens, {HEAD_DIM}]")
    _check_count("topk", topk, 1)
    logits = torch.einsum("bshd,nd->bshn", q.to(torch.float32), keys.to(torch.float32)) * softmax_scale
    best = logits.amax(dim=2)
    take = min(topk, keys.shape[0])
    idx = best.topk(take, dim=-1).indices.to(torch.int32)
    if take < topk:
        pad = torch.full((*idx.shape[:2], topk - take), -1, dtype=torch.int32)
        idx = torch.cat([idx, pad], dim=-1)
    return idx
