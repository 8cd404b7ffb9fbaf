"""What a transcode lost: ``LossReport`` and ``transcode_loss`` (the statistics come from the dispatcher).

``transcode(..., report=True)`` (``ops.pages``) is ``transcode`` then ``transcode_loss``; migration and
the dump converter run ``transcode_loss`` apart.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch

from kvbridge.backends import dispatch
from kvbridge.backends.loss_stats import LossStats
from kvbridge.layouts import Layout
from kvbridge.layouts.codec import tensor_multiplier
from kvbridge.ops.checks import _check_dialect, _check_scale


@dataclass
class LossReport:
    """What a transcode lost, measured against the decoded source values.

    ``max_abs_error`` and ``rms_error`` are in latent units; ``max_rel_error`` divides the
    max abs error by the source's max |value|; ``saturated`` counts values clipped at the
    destination format's max; ``flushed_to_zero`` counts nonzero source values stored as 0.
    """

    src_layout: str
    dst_layout: str
    num_tokens: int
    lossless: bool
    byte_move: bool
    dst_scale: float | None
    max_abs_error: float
    max_rel_error: float
    rms_error: float
    saturated: int
    flushed_to_zero: int
    nope_max_abs_error: float
    rope_max_abs_error: float
    note: str = ""

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_stats(cls, stats: LossStats, *, src_layout: str, dst_layout: str, byte_move: bool,
                   dst_scale: float | None, loss_note: str = "") -> LossReport:
        """The report of ``stats``; ``loss_note`` (the destination layout's) becomes ``note`` when anything was lost."""
        return cls(
            src_layout=src_layout,
            dst_layout=dst_layout,
            num_tokens=stats.num_tokens,
            lossless=stats.lossless,
            byte_move=byte_move,
            dst_scale=dst_scale,
            max_abs_error=stats.max_abs,
            max_rel_error=stats.max_rel_error,
            rms_error=stats.rms_error,
            saturated=stats.saturated,
            flushed_to_zero=stats.flushed,
            nope_max_abs_error=stats.nope_max,
            rope_max_abs_error=stats.rope_max,
            note="" if stats.lossless else loss_note,
        )


def transcode_loss(pages: torch.Tensor, src: Layout, src_page_size: int, out: torch.Tensor, dst: Layout,
                   dst_page_size: int, num_tokens: int, src_scale: float | None, dst_scale: float | None,
                   dialect: str | None) -> LossReport:
    """The ``LossReport`` of a code-domain transcode ``pages`` -> ``out`` (not a byte move) that ``transcode``
    ran with these arguments (``dst_scale`` the scale it used, never ``"auto"``): both decoded and compared,
    nothing written. ``transcode(..., report=True)`` is ``transcode`` then this; a caller may run it apart
    (``migrate_local`` does, beside its next batch)."""
    stats = transcode_loss_stats(pages, src, src_page_size, out, dst, dst_page_size, num_tokens, src_scale,
                                 dst_scale, dialect)
    return loss_report(stats, src, dst, byte_move=False, dst_scale=_check_scale(dst_scale, dst, "dst_scale"))


def transcode_loss_stats(pages: torch.Tensor, src: Layout, src_page_size: int, out: torch.Tensor, dst: Layout,
                         dst_page_size: int, num_tokens: int, src_scale: float | None, dst_scale: float | None,
                         dialect: str | None) -> LossStats:
    """The ``LossStats`` behind ``transcode_loss`` (same arguments); statistics of chunks merge
    (``LossStats.merge``) into those of the whole, which ``loss_report`` turns into the report
    (``kvbridge convert`` does, chunk by chunk)."""
    s_in, s_out = _check_scale(src_scale, src, "src_scale"), _check_scale(dst_scale, dst, "dst_scale")
    d = _check_dialect(dialect, dst)
    mult = tensor_multiplier(d, s_out) if dst.per_tensor_scale else None
    return dispatch.loss_stats(pages, src, src_page_size, out, dst, dst_page_size, num_tokens, s_in, s_out, mult)


def _reported_scale(dst: Layout, dst_scale: float | None) -> bool:
    return dst.per_tensor_scale or (dst.nvfp4_global_scale and dst_scale is not None and dst_scale != 1.0)


def loss_report(stats: LossStats, src: Layout | None, dst: Layout, *, byte_move: bool,
                dst_scale: float | None) -> LossReport:
    """The ``LossReport`` of a conversion into ``dst`` with statistics ``stats`` (``src`` None: raw
    latents encoded); the one report build of ``transcode``, ``transcode_loss`` and ``kvbridge convert``:
    ``dst_scale`` is kept for per-tensor destinations, and for NVFP4 ones when their global scale is not 1 (at 1
    the report is the one from before NVFP4 took a global scale), ``dst.loss_note`` is its note when anything was
    lost."""
    return LossReport.from_stats(stats, src_layout="latents" if src is None else src.name, dst_layout=dst.name,
                                 byte_move=byte_move, dst_scale=dst_scale if _reported_scale(dst, dst_scale) else None,
                                 loss_note=dst.loss_note)
