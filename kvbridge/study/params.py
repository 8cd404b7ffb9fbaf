"""The accuracy study's parameters and scale rules, without torch: what the command line's options
and help are made of (``kvbridge accuracy --help`` imports only this), used by
``kvbridge.study.accuracy`` and ``kvbridge.study.synthetic``."""

from __future__ import annotations

import math
from dataclasses import dataclass

#: Layer kinds of a synthetic case: SWA-only (rope base 10000) or compressed (160000 + YaRN).
LAYERS = ("swa", "compressed")

#: Per-tensor scale rules besides plain numbers: amax/448 (``auto_scale``, never saturates) and
#: that value rounded up to a power of two (2^ceil(log2(amax/448)), exact in bf16 after decode).
CALIBRATED = "amax/448"
CALIBRATED_POW2 = "pow2(amax/448)"
#: Default fixed powers of two tried for per-tensor layouts besides 1.0 and the calibrated scales.
DEFAULT_POW2_SCALES: tuple[float, ...] = (2.0**-6, 2.0**-3, 8.0)


def scale_label(scale: float | str) -> str:
    """``1``, ``2^-6``, ``0.037`` or a calibrated rule's name."""
    if isinstance(scale, str):
        return scale
    mant, exp = math.frexp(scale)
    if mant == 0.5:
        return "1" if exp == 1 else f"2^{exp - 1}"
    return f"{scale:.4g}"


@dataclass(frozen=True)
class SyntheticParams:
    """Every parameter of a synthetic case (``kvbridge.study.synthetic``) and of its decode step.

    ``layer``: ``compressed`` (rope base 160000 + YaRN, compressed token c at position
    ``c * compress_ratio``; ``context`` cached entries, the ``topk`` highest-logit ones attended, as
    DeepSeek-V4's indexer picks them) or ``swa`` (rope base 10000; the pool holds the last
    ``window`` tokens of a ``context``-token sequence, all of them attended). ``magnitude``,
    ``rope_ratio``, ``shared_fraction``, ``gain_spread``, ``outlier_channels``, ``outlier_gain``
    shape the latents; ``batch``, ``s_q``, ``heads``, ``peakedness`` (nats; 0 = flat attention),
    ``focus_tokens``, ``logit_noise`` (nats) shape the queries; ``page_size`` is the pools' P.
    """

    layer: str = "compressed"
    context: int = 4096
    topk: int = 512
    window: int = 128
    compress_ratio: int = 4
    magnitude: float = 1.0
    rope_ratio: float = 1.0
    shared_fraction: float = 0.3
    gain_spread: float = 0.25
    outlier_channels: int = 4
    outlier_gain: float = 8.0
    batch: int = 4
    s_q: int = 1
    heads: int = 64
    peakedness: float = 8.0
    focus_tokens: int = 4
    logit_noise: float = 1.0
    page_size: int = 64


#: One-line help per ``SyntheticParams`` field (the CLI's option help).
PARAM_HELP: dict[str, str] = {
    "layer": "Layer kind: 'compressed' (rope base 160000 + YaRN, top-k of the cached entries) or 'swa' "
             "(rope base 10000, the last WINDOW tokens).",
    "context": "Cached entries before the decode step (compressed tokens for 'compressed', tokens for 'swa').",
    "topk": "Entries attended per query token on a 'compressed' layer (highest logit over heads).",
    "window": "Sliding window of an 'swa' layer (tokens attended).",
    "compress_ratio": "Compress ratio r of a 'compressed' layer (entry c sits at position c*r).",
    "magnitude": "Overall latent magnitude relative to RMSNorm output times gains.",
    "rope_ratio": "RMS of the rope part over the RMS of the nope part.",
    "shared_fraction": "Share of pre-norm variance in a direction common to all tokens, in [0, 1).",
    "gain_spread": "Sigma of the log-normal per-channel RMSNorm gains.",
    "outlier_channels": "Number of nope channels with outlier gains.",
    "outlier_gain": "Gain multiplier of the outlier channels.",
    "batch": "Batch size b of the decode step.",
    "s_q": "Query tokens per sequence.",
    "heads": "Query heads h_q (DeepSeek-V4-Flash: 64, Pro: 128).",
    "peakedness": "Logit lead, in nats, of each head's focus tokens over an average key (0 = flat attention).",
    "focus_tokens": "Keys each query head focuses on.",
    "logit_noise": "Spread, in nats, of the isotropic part of the logits.",
    "page_size": "Tokens per page P of every pool.",
}

#: Default sweep values per ``SyntheticParams`` field (each sweep varies one field from the nominal).
DEFAULT_SWEEPS: dict[str, tuple] = {
    "magnitude": (0.001, 0.003, 0.01, 0.03, 0.1, 0.3, 1.0, 3.0, 10.0, 30.0),
    "rope_ratio": (0.25, 0.5, 1.0, 2.0, 4.0),
    "context": (1024, 4096, 16384),
    "topk": (128, 512, 2048),
    "peakedness": (0.0, 2.0, 8.0, 16.0),
    "layer": ("swa", "compressed"),
}
