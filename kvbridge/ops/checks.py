"""Argument checks shared by the page operations (``ops.pages``) and the loss report (``ops.loss``).

They raise ``InputError`` with the remedy; both return the value the kernels take.
"""

from __future__ import annotations

import math

import torch

from kvbridge import numerics as nx
from kvbridge.errors import InputError
from kvbridge.layouts import Layout


def _check_scale(scale: float | None, layout: Layout, what: str = "scale") -> float:
    """The fp32 value of ``scale`` (1.0 when None): the per-tensor E4M3 scale, or NVFP4's global scale g,
    which must lie in [2^-117, 2^116] (``numerics.NVFP4_GLOBAL_SCALE_MIN`` / ``_MAX``)."""
    if scale is None:
        return 1.0
    if not layout.takes_scale:
        raise InputError(f"{what} applies only to per-tensor layouts; {layout.name} has per-tile scales")
    if isinstance(scale, bool) or not isinstance(scale, (int, float)):
        raise InputError(f"{what} must be a positive finite number, got {scale!r}")
    s = float(torch.tensor(float(scale), dtype=torch.float32))
    if layout.nvfp4_global_scale and not nx.NVFP4_GLOBAL_SCALE_MIN <= s <= nx.NVFP4_GLOBAL_SCALE_MAX:
        raise InputError(
            f"{what} is {layout.name}'s NVFP4 global scale and must be a finite fp32 in [2^-117, 2^116] "
            f"(as fp32 {s!r}), got {scale!r}; pass the global scale the cache was written with "
            f"(1.0 for FlashInfer's DeepSeek-V4 record)"
        )
    if not (math.isfinite(s) and s > 0):
        raise InputError(f"{what} must be a positive finite number (as fp32), got {scale!r}")
    return s


def _check_dialect(dialect: str | None, layout: Layout) -> str | None:
    if dialect is None:
        return layout.default_dialect
    if not isinstance(dialect, str) or dialect not in layout.dialects:
        if not layout.dialects:
            raise InputError(f"layout {layout.name} has no encoder dialects; got dialect={dialect!r}")
        raise InputError(
            f"dialect {dialect!r} does not apply to {layout.name}; choose one of {', '.join(layout.dialects)}"
        )
    return dialect


def _check_auto(scale: object, layout: Layout, what: str = "scale") -> bool:
    """Whether ``scale`` is ``"auto"``; ``InputError`` when it is and ``layout`` has per-tile scales."""
    if not isinstance(scale, str) or scale != "auto":
        return False
    if layout.nvfp4_global_scale and not layout.per_tensor_scale:
        raise InputError(f"{what}='auto' picks a per-tensor E4M3 scale; {layout.name}'s NVFP4 global scale is "
                         f"the writer's: pass it as a number (1.0 for FlashInfer's DeepSeek-V4 record)")
    if not layout.per_tensor_scale:
        raise InputError(f"{what}='auto' applies only to per-tensor layouts, not {layout.name}")
    return True


def _check_byte_move_dialect(src: Layout, dst: Layout, dialect: str | None) -> None:
    """``InputError`` when a ``dialect`` is given for the byte move ``src`` -> ``dst`` (nothing is re-encoded)."""
    if dialect is not None:
        raise InputError(
            f"{src.name} -> {dst.name} is a byte move that keeps the source's scales; "
            f"dialect={dialect!r} would not be applied"
        )
