"""What a transcode loses: the statistics behind ``LossReport``, mergeable chunk by chunk.

``LossStats`` holds maxima, counts and one float64 sum, so statistics of the chunks of a
streamed conversion merge into exactly the maxima and counts of one pass over the whole
entry (the float64 sum only in its rounding). ``compare_values`` computes them in torch from
decoded values (any device); ``kvbridge.native_loss`` computes the same numbers on CPU straight
from the two pools, with no fp32 copy of either.

Every statistic compares fp32 values ``src`` (the decoded source) and ``dst`` (the decoded
destination) with fp32 arithmetic as torch does: ``err = |dst - src|`` (one fp32 subtraction),
``saturated`` counts ``|src * mult| > 448`` for a per-tensor E4M3 destination with multiplier
``mult`` (fp32(1/s), or 1 for the ``compress`` dialect). The sum of squared errors is accumulated
in float64 over the float64 squares of the fp32 errors, so ``rms_error`` agrees with any other
float64 summation order to about 1e-15 relative (torch's fp32 ``err.square().mean()``, used before,
to about 1e-6).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from kvbridge.codecs import HEAD_DIM, NOPE_DIM

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
