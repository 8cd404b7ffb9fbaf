"""Argument checks shared by the page operations (``ops.pages``) and the loss report (``ops.loss``).

They raise ``InputError`` with the remedy; both return the value the kernels take.
"""

from __future__ import annotations

import math

import torch

from kvbridge.errors import InputError
from kvbridge.layouts import Layout


def _check_scale(scale: float | None, layout: Layout, what: str = "scale") -> float:
    if scale is None:
        return 1.0
    if not layout.per_tensor_scale:
        raise InputError(f"{what} applies only to per-tensor layouts; {layout.name} has per-tile scales")
    if isinstance(scale, bool) or not isinstance(scale, (int, float)):
        raise InputError(f"{what} must be a positive finite number, got {scale!r}")
    s = float(torch.tensor(float(scale), dtype=torch.float32))
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
