"""Native CPU loss statistics of a transcode: both pools decoded token by token and compared in one pass.

The kernel runs the source's and the destination's record programs (``kvbridge.backends.native.records.program``,
the layouts' own descriptions), so it serves every pair of layouts: per token it gathers the
source record and the destination record, decodes each into a 512-value fp32 buffer with the
native decoder and accumulates the ``kvbridge.backends.loss_stats.LossStats`` of the pair; no fp32 copy of
either pool is built. The numbers are those of ``loss.compare_values`` on the decoded tensors:
maxima and counts identical, the float64 sum of squares up to its summation order (per chunk of
``pool.CHUNK_TOKENS`` tokens, then over chunks). Work is split over ``pool.num_threads()``
threads like the transcode kernels.

Accelerators (``LOSS_ACCELERATORS``, keyed like ``accel.ACCELERATORS`` by the pair of records'
``Layout.segments``): per-tensor E4M3 (TensorRT-LLM FP8) against MODEL1, both directions, with
the records' constants compiled in. They read token-major records (and MODEL1's block-split data
and footer parts) in place and take every statistic of a 64-value tile in one fused loop: the C
kernels of ``kvbridge.backends.native._kernels`` (AVX-512: E4M3 values through exact fp16 conversions, 16 values per
instruction) where ``accel._CK`` is in use, else numba (E4M3 values in branch-free 32-bit
arithmetic, ``accel._e4m3_value``). The numbers equal the generic kernel's (maxima and counts
identical, the float64 sum of squares per token summed in another order within the token).
"""

from __future__ import annotations

import numpy as np
import torch
from numba import njit

from kvbridge.backends.loss_stats import LossStats
from kvbridge.backends.native import accel
from kvbridge.backends.native.accel import MODEL1_DATA_BYTES
from kvbridge.backends.native.pool import CHUNK_TOKENS, _flat, _run_chunks
from kvbridge.backends.native.records import (
    _E2M1_F32,
    _E4M3_F32,
    _UE8M0_F32,
    _decode_record,
    _gather,
    _geometry,
    _locate,
    program,
)
from kvbridge.layouts import Layout, get_layout
from kvbridge.layouts.codec import HEAD_DIM, NOPE_DIM

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


@njit(cache=True, inline="always")
def _e4m3_finite(c, s):
    """fp32 ``e4m3(c) * s`` of the E4M3 code ``c`` (uint32 0..255, not a NaN code) and a positive fp32
    ``s``, bit-identical to the table product (the magnitude's product, then the sign bit: IEEE
    products are sign-symmetric), in branch-free 32-bit steps as ``accel._e4m3_value``."""
    u32 = np.uint32
    a = u32(c & u32(0x7F))
    normal = u32(u32(a << u32(20)) + u32(0x3C000000)).view(np.float32)
    v = normal if a >= u32(8) else np.float32(np.int32(a)) * np.float32(2.0**-9)
    return u32(np.float32(v * s).view(u32) | u32(u32(c << u32(24)) & u32(0x80000000))).view(np.float32)


@njit(cache=True, inline="always")
def _tensor_model1_token(pt, data, foot, s_pt, ue8m0, tensor_is_src, per_tensor, mult, stats):
    """Compare one token: ``pt`` its 512 per-tensor E4M3 bytes (values ``e4m3(c) * s_pt``), ``data``
    its MODEL1 bytes [0, 576) and ``foot`` its 7 scale bytes; the source is the per-tensor side when
    ``tensor_is_src``. Adds to ``stats`` (int64 [6]: amax, nope and rope max |err| as fp32 bits,
    unequal, flushed, saturated) and returns the token's float64 sum of err^2. Every integer step
    stays 32-bit and each tile is one fused loop, which LLVM vectorizes."""
    u32 = np.uint32
    i32 = np.int32
    amax = u32(0)
    nope_max = u32(0)
    unequal = i32(0)
    flushed = i32(0)
    saturated = i32(0)
    token_sq = 0.0
    for j in range(7):
        s = ue8m0[foot[j]]
        pt_tile = pt[64 * j : 64 * j + 64]
        m1_tile = data[64 * j : 64 * j + 64]
        for i in range(64):
            p = _e4m3_finite(u32(pt_tile[i]), s_pt)
            m = _e4m3_finite(u32(m1_tile[i]), s)
            x = p if tensor_is_src else m
            y = m if tensor_is_src else p
            e = abs(y - x)
            token_sq += np.float64(e) * np.float64(e)
            amax = max(amax, u32(np.float32(x).view(u32) & u32(0x7FFFFFFF)))
            nope_max = max(nope_max, np.float32(e).view(u32))
            unequal = i32(unequal + i32(x != y))
            flushed = i32(flushed + i32((x != 0) & (y == 0)))
            if per_tensor:
                saturated = i32(saturated + i32(abs(x * mult) > _E4M3_MAX))
    rope_max = u32(0)
    pt_rope = pt[448:512]
    m1_rope = data[448:MODEL1_DATA_BYTES]
    for i in range(64):
        p = _e4m3_finite(u32(pt_rope[i]), s_pt)
        m = u32(u32(u32(m1_rope[2 * i]) | u32(u32(m1_rope[2 * i + 1]) << u32(8))) << u32(16)).view(np.float32)
        x = p if tensor_is_src else m
        y = m if tensor_is_src else p
        e = abs(y - x)
        token_sq += np.float64(e) * np.float64(e)
        amax = max(amax, u32(np.float32(x).view(u32) & u32(0x7FFFFFFF)))
        rope_max = max(rope_max, np.float32(e).view(u32))
        unequal = i32(unequal + i32(x != y))
        flushed = i32(flushed + i32((x != 0) & (y == 0)))
        if per_tensor:
            saturated = i32(saturated + i32(abs(x * mult) > _E4M3_MAX))
    stats[0] = max(stats[0], amax)
    stats[1] = max(stats[1], nope_max)
    stats[2] = max(stats[2], rope_max)
    stats[3] += unequal
    stats[4] += flushed
    stats[5] += saturated
    return token_sq


@njit(cache=True, inline="always")
def _tensor_model1_chunks(
    c0, c1, pt_pool, pp, ppb, psplit, prb, s_pt, m1_pool, mp, mpb, msplit, mrb, n, ue8m0, tensor_is_src,
    per_tensor, mult, maxima, sums, counts,
):
    """``_loss_kernel``'s per-chunk outputs for a per-tensor E4M3 pool (``pt_*``) against a MODEL1
    pool (``m1_*``); records are read in place where their geometry allows, else gathered."""
    pt_in_place = psplit == prb
    m1_in_place = msplit == MODEL1_DATA_BYTES or msplit == mrb
    for chunk in range(c0, c1):
        rec_p = np.empty(prb, np.uint8)
        rec_m = np.empty(mrb, np.uint8)
        stats = np.zeros(6, np.int64)
        sq = 0.0
        for t in range(chunk * CHUNK_TOKENS, min(n, (chunk + 1) * CHUNK_TOKENS)):
            p_at, pf_at = _locate(t, pp, ppb, psplit, prb)
            if pt_in_place:
                pt = pt_pool[p_at : p_at + 512]
            else:
                _gather(pt_pool, p_at, pf_at, psplit, prb, rec_p)
                pt = rec_p[:512]
            m_at, mf_at = _locate(t, mp, mpb, msplit, mrb)
            if m1_in_place:
                data = m1_pool[m_at : m_at + MODEL1_DATA_BYTES]
                foot = m1_pool[mf_at : mf_at + 8] if msplit == MODEL1_DATA_BYTES else m1_pool[m_at + 576 : m_at + 584]
            else:
                _gather(m1_pool, m_at, mf_at, msplit, mrb, rec_m)
                data = rec_m[:MODEL1_DATA_BYTES]
                foot = rec_m[MODEL1_DATA_BYTES:]
            sq += _tensor_model1_token(pt, data, foot, s_pt, ue8m0, tensor_is_src, per_tensor, mult, stats)
        maxima[chunk, 0] = stats[0]
        maxima[chunk, 1] = max(stats[1], stats[2])
        maxima[chunk, 2] = stats[1]
        maxima[chunk, 3] = stats[2]
        sums[chunk] = sq
        counts[chunk, 0] = stats[3]
        counts[chunk, 1] = stats[4]
        counts[chunk, 2] = stats[5]


@njit(cache=True, nogil=True, fastmath=_REDUCE)
def _fp8_model1_loss_kernel(c0, c1, src, sp, spb, ssplit, srb, s_in, dst, dp, dpb, dsplit, drb, s_out, n,
                            per_tensor, mult, ue8m0, maxima, sums, counts):
    """Per-tensor E4M3 source against a MODEL1 destination (``_loss_kernel``'s outputs)."""
    _tensor_model1_chunks(c0, c1, src, sp, spb, ssplit, srb, s_in, dst, dp, dpb, dsplit, drb, n, ue8m0, True,
                          per_tensor, mult, maxima, sums, counts)


@njit(cache=True, nogil=True, fastmath=_REDUCE)
def _model1_fp8_loss_kernel(c0, c1, src, sp, spb, ssplit, srb, s_in, dst, dp, dpb, dsplit, drb, s_out, n,
                            per_tensor, mult, ue8m0, maxima, sums, counts):
    """MODEL1 source against a per-tensor E4M3 destination (``_loss_kernel``'s outputs)."""
    _tensor_model1_chunks(c0, c1, dst, dp, dpb, dsplit, drb, s_out, src, sp, spb, ssplit, srb, n, ue8m0, False,
                          per_tensor, mult, maxima, sums, counts)


def _fp8_model1_loss(nchunks: int, *args) -> None:
    """Per-tensor E4M3 source against a MODEL1 destination: the C kernel where ``accel._CK`` holds the compiled
    kernels (``accel.kernel_implementation()``), else numba."""
    kernel = _fp8_model1_loss_kernel if accel._CK is None else accel._CK.fp8_model1_loss
    _run_chunks(kernel, nchunks, *args)


def _model1_fp8_loss(nchunks: int, *args) -> None:
    """MODEL1 source against a per-tensor E4M3 destination (C or numba, as ``_fp8_model1_loss``)."""
    kernel = _model1_fp8_loss_kernel if accel._CK is None else accel._CK.model1_fp8_loss
    _run_chunks(kernel, nchunks, *args)


#: Specialised loss statistics per (source, destination) pair of ``Layout.segments``: ``f(nchunks, *args)``
#: with ``_loss_kernel``'s arguments after the chunk range, less the record programs and the E4M3/E2M1 tables.
LOSS_ACCELERATORS = {
    (get_layout("trtllm-fp8").segments, get_layout("flashmla-model1").segments): _fp8_model1_loss,
    (get_layout("flashmla-model1").segments, get_layout("trtllm-fp8").segments): _model1_fp8_loss,
}


def loss_stats(
    src_pages: torch.Tensor, src: Layout, src_page_size: int, dst_pages: torch.Tensor, dst: Layout,
    dst_page_size: int, num_tokens: int, src_scale: float, dst_scale: float, mult: float | None,
    *, accelerated: bool = True,
) -> LossStats:
    """``LossStats`` of the first ``num_tokens`` tokens of ``dst_pages`` (``dst`` at ``dst_scale``)
    against the same tokens of ``src_pages`` (``src`` at ``src_scale``), both CPU pools holding
    finite values; ``mult`` is the destination's per-tensor E4M3 multiplier (None: per-tile).
    ``accelerated=False`` runs the generic kernel even where a ``LOSS_ACCELERATORS`` kernel is
    registered (the tests compare the two)."""
    n = num_tokens
    if n == 0:
        return LossStats()
    nchunks = -(-n // CHUNK_TOKENS)
    maxima = np.zeros((nchunks, 4), np.uint32)
    sums = np.zeros(nchunks, np.float64)
    counts = np.zeros((nchunks, 3), np.int64)
    sp, spb, ssplit, srb = _geometry(src, src_page_size)
    dp, dpb, dsplit, drb = _geometry(dst, dst_page_size)
    per_tensor, m = mult is not None, np.float32(1.0 if mult is None else mult)
    fast = LOSS_ACCELERATORS.get((src.segments, dst.segments)) if accelerated else None
    if not min(np.float32(src_scale), np.float32(dst_scale)) > 0:  # the accelerators take positive scales
        fast = None
    if fast is not None:
        fast(
            nchunks, _flat(src_pages), sp, spb, ssplit, srb, np.float32(src_scale), _flat(dst_pages), dp, dpb, dsplit,
            drb, np.float32(dst_scale), n, per_tensor, m, _UE8M0_F32, maxima, sums, counts,
        )
    else:
        _run_chunks(
            _loss_kernel, nchunks, _flat(src_pages), program(src, read=True), sp, spb, ssplit, srb,
            np.float32(src_scale), _flat(dst_pages), program(dst, read=True), dp, dpb, dsplit, drb,
            np.float32(dst_scale), n, per_tensor, m, _E4M3_F32, _UE8M0_F32, _E2M1_F32, maxima, sums, counts,
        )
    top = maxima.max(axis=0).view(np.float32)
    total = counts.sum(axis=0)
    return LossStats(
        num_tokens=n, src_amax=float(top[0]), max_abs=float(top[1]), nope_max=float(top[2]), rope_max=float(top[3]),
        sum_sq=float(sums.sum()), unequal=int(total[0]), flushed=int(total[1]), saturated=int(total[2]),
    )
