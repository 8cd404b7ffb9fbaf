"""Native CPU conversion of compressor-state rows: dtype change, APE added or removed, loss, in one pass.

A state row is ``[kv | score]``, ``w`` fp32 or bf16 values (little-endian). One numba kernel,
on the calling thread (a request's state is a few MiB at most; torch's element-wise ops on
two threads of a loaded machine took seconds for it), reads each value, adds or removes the
position's APE on the score half, writes the destination dtype and measures what the dtype
change lost, with the arithmetic of the torch rules it replaces, bit for bit:

- bf16 -> fp32: ``bits << 16`` (``numerics.bf16_from_bytes``); fp32 -> bf16: nearest-even, NaN
  quieted (``numerics.bf16_round``);
- APE added: one fp32 add (``migration.ape.add_ape``);
- APE removed (``migration.ape.remove_ape``): ``s = fp32(t - a)`` (``t`` kept where infinite),
  up to four one-ulp steps toward ``fp32(s + a) == t``, then the bf16 truncation of ``s`` or the
  next bf16 value away from zero where that one also sums to ``t``; sums compare bit for bit
  (a stored -0.0 keeps its sign: its one candidate is -0.0);
- loss (``migration.rows.state_error``): max ``|fp32(back - v)|`` over finite values ``v``; a
  non-finite ``v`` whose written value differs (NaN always does) is reported.

The kernel reports, rather than raises, what the caller refuses: the first row whose score is
NaN (removing APE), the first (row, value) no fp32 sum reaches, and a changed infinity.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from numba import njit

_TOP = np.uint32(0xFFFF0000)
_BF16_ULP = np.uint32(0x10000)
_NEG_ZERO = np.uint32(0x80000000)


@njit(cache=True, inline="always")
def _f32(bits):
    return np.uint32(bits).view(np.float32)


@njit(cache=True, inline="always")
def _bits(x):
    return np.float32(x).view(np.uint32)


@njit(cache=True, inline="always")
def _step(s, up):
    """``nextafter(s, +inf if up else -inf)`` in fp32 (an infinity toward itself stays)."""
    if s == 0:
        return _f32(np.uint32(1) if up else np.uint32(0x80000001))
    if np.isinf(s) and (s > 0) == up:
        return s
    b = _bits(s)
    return _f32(b + np.uint32(1) if (s > 0) == up else b - np.uint32(1))


@njit(cache=True, inline="always")
def _preimage(t, a):
    """(s', reached): the raw score kvbridge writes for stored score ``t`` and APE ``a`` (module docstring)."""
    if _bits(t) == _NEG_ZERO:  # -0.0 is an fp32 sum only of -0.0 + -0.0 (t - a would give +0.0)
        s = t
    else:
        s = t if np.isinf(t) else np.float32(t - a)
    for _ in range(4):
        y = np.float32(s + a)
        if y < t:
            s = _step(s, True)
        elif y > t:
            s = _step(s, False)
        else:
            break
    if _bits(np.float32(s + a)) != _bits(t):  # bit for bit: a +0.0 sum does not stand for a stored -0.0
        return s, False
    low = _bits(s) & _TOP
    lo, hi = _f32(low), _f32(low + _BF16_ULP)
    if np.isfinite(s) and np.isfinite(hi):
        if _bits(np.float32(lo + a)) == _bits(t):
            return lo, True
        if _bits(np.float32(hi + a)) == _bits(t):
            return hi, True
    return s, True


@njit(cache=True, inline="always")
def _bf16_of(bits):
    """fp32 bit pattern -> bf16 bit pattern, nearest-even; NaN quieted (``numerics.bf16_round``)."""
    if (bits & np.uint32(0x7FFFFFFF)) > np.uint32(0x7F800000):
        return np.uint16((bits >> np.uint32(16)) | np.uint32(0x40))
    return np.uint16((np.uint64(bits) + np.uint64(0x7FFF) + np.uint64((bits >> np.uint32(16)) & np.uint32(1)))
                     >> np.uint64(16))


@njit(cache=True, nogil=True)
def _state_kernel(src16, src32, n, w, dst16, dst32, ape, sign, first, measure, status):
    """Rows ``[n, w]`` of ``src16`` (bf16 bits; empty when fp32) or ``src32`` (fp32 bits) -> ``dst16`` / ``dst32``;
    score values (the second half) of row ``i`` gain (``sign`` > 0) or lose (< 0) ``ape[(first + i) % r]``.
    ``status`` = [first NaN-score row, first unreachable row, its value index, a changed infinity (0/1)], -1 for
    none; returns the max |written - v| over finite values ``v`` (0 unless ``measure``)."""
    half = w // 2
    r = ape.shape[0]
    from_bf16, to_bf16 = src16.shape[0] > 0, dst16.shape[0] > 0
    worst = np.float32(0.0)
    for i in range(n):
        arow = (first + i) % r if sign != 0 else 0
        for j in range(w):
            k = i * w + j
            bits = np.uint32(src16[k]) << np.uint32(16) if from_bf16 else src32[k]
            v = _f32(bits)
            if sign != 0 and j >= half:
                a = ape[arow, j - half]
                if sign > 0:
                    v = np.float32(v + a)
                elif np.isnan(v):
                    if status[0] < 0:
                        status[0] = i
                else:
                    v, reached = _preimage(v, a)
                    if not reached and status[1] < 0:
                        status[1] = i
                        status[2] = j - half
            if to_bf16:
                out = _bf16_of(_bits(v))
                dst16[k] = out
                back = _f32(np.uint32(out) << np.uint32(16))
            else:
                dst32[k] = _bits(v)
                back = v
            if measure:
                if not np.isfinite(v):
                    if not back == v:
                        status[3] = 1
                else:
                    worst = max(worst, abs(np.float32(back - v)))
    return worst


@dataclass(frozen=True)
class StateResult:
    """What ``convert_state_rows`` wrote and found: rows, max abs error (None unless measured) and the first
    NaN score row / unreachable (row, value) / whether an infinity changed (None and False for none)."""

    rows: torch.Tensor
    max_abs_error: float | None
    nan_row: int | None
    unreachable: tuple[int, int] | None
    infinity_changed: bool


def _words(records: torch.Tensor, dtype) -> np.ndarray:
    flat = records.reshape(-1).numpy()
    if flat.ctypes.data % np.dtype(dtype).itemsize:
        flat = flat.copy()
    return flat.view(dtype)


def convert_state_rows(records: torch.Tensor, src_bf16: bool, dst_bf16: bool, ape: torch.Tensor | None, sign: int,
                       first: int, measure: bool) -> StateResult:
    """State rows uint8 ``[n, row_bytes]`` (contiguous, CPU) -> rows in the destination dtype, APE ``[r, w / 2]``
    fp32 added (``sign`` +1) or removed (-1) for positions ``first, first + 1, ...`` (see the module docstring)."""
    n = records.shape[0]
    w = records.shape[1] // (2 if src_bf16 else 4)
    out = torch.empty(n, w * (2 if dst_bf16 else 4), dtype=torch.uint8)
    empty16, empty32 = np.zeros(0, np.uint16), np.zeros(0, np.uint32)
    src = records.contiguous()
    s16, s32 = (_words(src, np.uint16), empty32) if src_bf16 else (empty16, _words(src, np.uint32))
    d16, d32 = (out.view(-1).numpy().view(np.uint16), empty32) if dst_bf16 else \
        (empty16, out.view(-1).numpy().view(np.uint32))
    table = ape.contiguous().numpy() if sign and ape is not None else np.zeros((1, max(1, w // 2)), np.float32)
    status = np.full(4, -1, np.int64)
    err = float(_state_kernel(s16, s32, n, w, d16, d32, table, sign if ape is not None else 0, first, measure,
                              status)) if n else 0.0
    return StateResult(out, err if measure else None, None if status[0] < 0 else int(status[0]),
                       None if status[1] < 0 else (int(status[1]), int(status[2])), bool(status[3] == 1))
