"""Native CPU loss statistics of a transcode: both pools decoded token by token and compared in one pass.

The kernel runs the source's and the destination's record programs (``kvbridge.native.program``,
the layouts' own descriptions), so it serves every pair of layouts: per token it gathers the
source record and the destination record, decodes each into a 512-value fp32 buffer with the
native decoder and accumulates the ``kvbridge.loss.LossStats`` of the pair; no fp32 copy of
either pool is built. The numbers are those of ``loss.compare_values`` on the decoded tensors:
maxima and counts identical, the float64 sum of squares up to its summation order (per chunk of
``native.CHUNK_TOKENS`` tokens, then over chunks). Work is split over ``native.num_threads()``
threads like the transcode kernels.
"""

from __future__ import annotations

import numpy as np
import torch
from numba import njit

from kvbridge import native
from kvbridge.codecs import HEAD_DIM, NOPE_DIM
from kvbridge.layouts import Layout
from kvbridge.loss import LossStats
from kvbridge.native import (
    _E2M1_F32,
    _E4M3_F32,
    _UE8M0_F32,
    CHUNK_TOKENS,
    _decode_record,
    _flat,
    _gather,
    _geometry,
    _locate,
    _run_chunks,
)

_E4M3_MAX = np.float32(448.0)
#: Fast-math flags of the comparison: reductions may be reordered (so they vectorize) and values are
#: finite; no contraction, so every subtraction and product is one IEEE fp32 operation as in torch.
_REDUCE = {"reassoc", "nnan", "ninf"}


@njit(cache=True, nogil=True, fastmath=_REDUCE)
def _loss_kernel(
    c0, c1, src, sprog, sp, spb, ssplit, srb, s_in, dst, dprog, dp, dpb, dsplit, drb, s_out, n,
    per_tensor, mult, e4m3, ue8m0, e2m1, maxima, sums, counts,
):
    """Per chunk of ``CHUNK_TOKENS`` tokens: ``maxima[chunk]`` = fp32 bit patterns of (max |src|,
    max |err|, nope max |err|, rope max |err|), ``sums[chunk]`` the float64 sum of err^2,
    ``counts[chunk]`` = (values unequal, flushed to zero, saturated: ``|src * mult| > 448`` when
    ``per_tensor``). Each statistic is its own simple loop over the two decoded tokens, so that
    LLVM vectorizes it; maxima of finite non-negative floats are taken on their bit patterns."""
    for chunk in range(c0, c1):
        rec_a = np.empty(srb, np.uint8)
        rec_b = np.empty(drb, np.uint8)
        a = np.empty(HEAD_DIM, np.float32)
        b = np.empty(HEAD_DIM, np.float32)
        err = np.empty(HEAD_DIM, np.float32)
        a_bits = a.view(np.uint32)
        b_bits = b.view(np.uint32)
        err_bits = err.view(np.uint32)
        amax = np.uint32(0)
        nope_max = np.uint32(0)
        rope_max = np.uint32(0)
        sq = 0.0
        unequal = 0
        flushed = 0
        saturated = 0
        for t in range(chunk * CHUNK_TOKENS, min(n, (chunk + 1) * CHUNK_TOKENS)):
            s_at, sf_at = _locate(t, sp, spb, ssplit, srb)
            _gather(src, s_at, sf_at, ssplit, srb, rec_a)
            _decode_record(sprog, rec_a, s_in, e4m3, ue8m0, e2m1, a, a_bits)
            d_at, df_at = _locate(t, dp, dpb, dsplit, drb)
            _gather(dst, d_at, df_at, dsplit, drb, rec_b)
            _decode_record(dprog, rec_b, s_out, e4m3, ue8m0, e2m1, b, b_bits)
            token_sq = 0.0
            for i in range(HEAD_DIM):
                x = a[i]
                y = b[i]
                e = abs(y - x)
                err[i] = e
                token_sq += np.float64(e) * np.float64(e)
                unequal += x != y
                flushed += (x != 0) & (y == 0)
            sq += token_sq
            for i in range(HEAD_DIM):
                amax = max(amax, np.uint32(a_bits[i] & np.uint32(0x7FFFFFFF)))
            for i in range(NOPE_DIM):
                nope_max = max(nope_max, err_bits[i])
            for i in range(NOPE_DIM, HEAD_DIM):
                rope_max = max(rope_max, err_bits[i])
            if per_tensor:
                for i in range(HEAD_DIM):
                    saturated += abs(a[i] * mult) > _E4M3_MAX
        maxima[chunk, 0] = amax
        maxima[chunk, 1] = max(nope_max, rope_max)
        maxima[chunk, 2] = nope_max
        maxima[chunk, 3] = rope_max
        sums[chunk] = sq
        counts[chunk, 0] = unequal
        counts[chunk, 1] = flushed
        counts[chunk, 2] = saturated


def loss_stats(
    src_pages: torch.Tensor, src: Layout, src_page_size: int, dst_pages: torch.Tensor, dst: Layout,
    dst_page_size: int, num_tokens: int, src_scale: float, dst_scale: float, mult: float | None,
) -> LossStats:
    """``LossStats`` of the first ``num_tokens`` tokens of ``dst_pages`` (``dst`` at ``dst_scale``)
    against the same tokens of ``src_pages`` (``src`` at ``src_scale``), both CPU pools holding
    finite values; ``mult`` is the destination's per-tensor E4M3 multiplier (None: per-tile)."""
    n = num_tokens
    if n == 0:
        return LossStats()
    nchunks = -(-n // CHUNK_TOKENS)
    maxima = np.zeros((nchunks, 4), np.uint32)
    sums = np.zeros(nchunks, np.float64)
    counts = np.zeros((nchunks, 3), np.int64)
    sp, spb, ssplit, srb = _geometry(src, src_page_size)
    dp, dpb, dsplit, drb = _geometry(dst, dst_page_size)
    _run_chunks(
        _loss_kernel, nchunks, _flat(src_pages), native.program(src), sp, spb, ssplit, srb, np.float32(src_scale),
        _flat(dst_pages), native.program(dst), dp, dpb, dsplit, drb, np.float32(dst_scale), n,
        mult is not None, np.float32(1.0 if mult is None else mult), _E4M3_F32, _UE8M0_F32, _E2M1_F32,
        maxima, sums, counts,
    )
    top = maxima.max(axis=0).view(np.float32)
    total = counts.sum(axis=0)
    return LossStats(
        num_tokens=n, src_amax=float(top[0]), max_abs=float(top[1]), nope_max=float(top[2]), rope_max=float(top[3]),
        sum_sq=float(sums.sum()), unequal=int(total[0]), flushed=int(total[1]), saturated=int(total[2]),
    )
