"""What a transcode loses: the statistics behind ``LossReport``, mergeable chunk by chunk.

``LossStats`` holds maxima, counts and one float64 sum, so statistics of the chunks of a
streamed conversion merge into exactly the maxima and counts of one pass over the whole
entry (the float64 sum only in its rounding). ``compare_values`` computes them in torch from
decoded values (any device); ``kvbridge.backends.native.loss`` computes the same numbers on CPU straight
from the two pools, with no fp32 copy of either.

Every statistic compares fp32 values ``src`` (the decoded source) and ``dst`` (the decoded
destination) with fp32 arithmetic as torch does: ``err = |dst - src|`` (one fp32 subtraction),
``saturated`` counts ``|src * mult| > 448`` for a per-tensor E4M3 destination with multiplier
``mult`` (fp32(1/s), or 1 for the ``compress`` dialect). The sum of squared errors is accumulated
in float64 over the float64 squares of the fp32 errors, so ``rms_error`` depends on the summation
order only by float64 rounding (about 1e-12 relative measured over the 5e8 values of a 1M-token
entry, far less on small inputs); torch's fp32 ``err.square().mean()``, used before by ``transcode``,
differed by about 1e-6 and overflowed to inf for errors beyond about 1e19.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from kvbridge import numerics as nx
from kvbridge.layouts.codec import HEAD_DIM, NOPE_DIM

_E4M3_MAX = 448.0


@dataclass
class LossStats:
    """Loss statistics of ``num_tokens`` tokens (512 values each); maxima are fp32 values as floats."""

    num_tokens: int = 0
    src_amax: float = 0.0  # max |src|
    max_abs: float = 0.0  # max |dst - src|
    nope_max: float = 0.0  # max |dst - src| over dims [0, 448)
    rope_max: float = 0.0  # max |dst - src| over dims [448, 512)
    sum_sq: float = 0.0  # float64 sum of |dst - src|^2
    unequal: int = 0  # values with dst != src
    flushed: int = 0  # values with src != 0 and dst == 0
    saturated: int = 0  # values with |src * mult| > 448 (per-tensor E4M3 destinations)

    def merge(self, other: LossStats) -> LossStats:
        """The statistics of both token sets together (this one updated and returned)."""
        self.num_tokens += other.num_tokens
        self.src_amax = max(self.src_amax, other.src_amax)
        self.max_abs = max(self.max_abs, other.max_abs)
        self.nope_max = max(self.nope_max, other.nope_max)
        self.rope_max = max(self.rope_max, other.rope_max)
        self.sum_sq += other.sum_sq
        self.unequal += other.unequal
        self.flushed += other.flushed
        self.saturated += other.saturated
        return self

    @property
    def lossless(self) -> bool:
        return self.unequal == 0

    @property
    def max_rel_error(self) -> float:
        return self.max_abs / self.src_amax if self.src_amax > 0 else 0.0

    @property
    def rms_error(self) -> float:
        values = self.num_tokens * HEAD_DIM
        return math.sqrt(self.sum_sq / values) if values else 0.0


def compare_values(src: torch.Tensor, dst: torch.Tensor, mult: float | None) -> LossStats:
    """``LossStats`` of decoded fp32 ``src`` against decoded fp32 ``dst`` (both ``[N, 512]``, finite);
    ``mult``: the per-tensor E4M3 multiplier of the destination, None when it has per-tile scales."""
    n = src.shape[0]
    if not src.numel():
        return LossStats(num_tokens=n)
    saturated = 0
    if mult is not None:
        saturated = int(((src * torch.tensor(mult, dtype=torch.float32, device=src.device)).abs() > _E4M3_MAX).sum())
    stats = LossStats(num_tokens=n, src_amax=float(src.abs().max()), saturated=saturated)
    if torch.equal(src, dst):  # the common lossless case: every error is 0
        return stats
    err = (dst - src).abs()
    stats.max_abs = float(err.max())
    stats.nope_max = float(err[:, :NOPE_DIM].max())
    stats.rope_max = float(err[:, NOPE_DIM:].max())
    stats.sum_sq = float(err.double().square().sum())
    stats.unequal = int((dst != src).sum())
    stats.flushed = int(((src != 0) & (dst == 0)).sum())
    return stats


#: Per-tensor scales of one entry fully checked by ``lossless_scale_candidates``' callers, at most.
MAX_LOSSLESS_CANDIDATES = 8


def lossless_scale_candidates(amax: float, sample: torch.Tensor, dialect: str | None) -> list[float]:
    """Per-tensor E4M3 scales ``s`` (largest first, 1.0 excluded) under which the finite fp32 values of an
    entry could all be stored exactly, reasoned from the codes: a value ``v`` survives
    ``e4m3(v * m) * s`` (``m`` = fp32(1/s), or 1 for the ``compress`` dialect) only if ``v == fp32(q * s)``
    for an E4M3 value ``q``; so with ``v`` = ``amax`` (the entry's largest |value|) each of the 126
    positive E4M3 values gives at most a few fp32 scales near ``amax / q`` (a MODEL1 source's
    candidates are its tile scales' powers of two times E4M3 values). Those that reproduce every
    value of ``sample`` (some of the entry's values) are returned, at most ``MAX_LOSSLESS_CANDIDATES``;
    the caller checks them on the whole entry. Largest first: the largest lossless scale is the one
    that keeps the entry's finest values at the finest codes, which is what the writer of an entry
    that came from per-tensor FP8 used. Empty for an all-zero entry."""
    if not amax > 0:
        return []
    f32 = torch.float32
    q = nx.E4M3_TABLE[1:127]  # every positive finite E4M3 value
    a = torch.tensor(amax, dtype=f32)
    s0 = a / q
    steps = torch.arange(-2, 3)
    s = s0.unsqueeze(1).expand(-1, steps.numel()).contiguous().view(torch.int32) + steps.to(torch.int32)
    s = s.view(f32).reshape(-1)
    s = s[torch.isfinite(s) & (s > 0) & ((q.repeat_interleave(steps.numel()) * s) == a) & (s != 1.0)].unique()
    mags = sample.abs().reshape(-1).unique()
    mags = torch.cat([mags[mags > 0], a.view(1)])
    mult = torch.ones_like(s) if dialect == "compress" else torch.tensor(1.0, dtype=f32) / s
    kept = []
    for i in reversed(range(s.numel())):  # unique() sorts ascending
        back = nx.E4M3_TABLE[nx.e4m3_encode(mags * mult[i]).long()] * s[i]
        if torch.equal(back, mags):
            kept.append(float(s[i]))
            if len(kept) == MAX_LOSSLESS_CANDIDATES:
                break
    return kept


def decoded_loss_stats(decode, src_pages: torch.Tensor, src, src_page_size: int, dst_pages: torch.Tensor, dst,
                       dst_page_size: int, num_tokens: int, src_scale: float, dst_scale: float,
                       mult: float | None) -> LossStats:
    """``LossStats`` of the first ``num_tokens`` tokens of both pools, decoded by ``decode`` (a backend's
    ``decode_pages``) and compared (``compare_values``): the ``loss_stats`` of the backends without a fused kernel."""
    a = decode(src_pages, src, src_page_size, num_tokens, src_scale)
    b = decode(dst_pages, dst, dst_page_size, num_tokens, dst_scale)
    return compare_values(a, b, mult)

