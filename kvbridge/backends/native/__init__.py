"""Native CPU backend: multi-threaded numba kernels (and optional C ones), byte-identical to
``kvbridge.backends.reference``; this module is the backend interface ``kvbridge.backends.dispatch`` calls.

- ``native.records``: the record-program interpreter (generic kernels for every layout);
- ``native.accel``: the MODEL1 / FP8 / MXFP8 accelerators, the C loader (``kernel_implementation``);
- ``native.keys``: the indexer-key fp4 -> fp8 kernels; ``native.state``: compressor-state rows;
- ``native.loss``: the loss statistics of a transcode in one pass;
- ``native.pool``: work chunks, the thread pool (``num_threads``) and uninitialised outputs.

Numba compiles the kernels on first use and caches them on disk (``cache=True``); see
``docs/performance.md`` for the one-time cost.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
import xxhash

from kvbridge.backends import reference
from kvbridge.backends.native import accel
from kvbridge.backends.native import keys as key_kernels
from kvbridge.backends.native.accel import LATENTS, accelerator
from kvbridge.backends.native.keys import fp4_to_fp8_keys as fp4_to_fp8_keys
from kvbridge.backends.native.loss import loss_stats as loss_stats
from kvbridge.backends.native.pool import (
    CHUNK_TOKENS,
    _empty_output,
    _flat,
    _new_pages,
    _page_chunks,
    _run_chunks,
    _run_pieces,
    num_threads,
)
from kvbridge.backends.native.records import (
    _E2M1_F32,
    _E4M3_F32,
    _POW2_F32,
    _UE8M0_F32,
    HEAD_DIM,
    _amax_kernel,
    _decode_kernel,
    _encode_kernel,
    _encode_params,
    _geometry,
    _move_spans_kernel,
    _nonfinite_kernel,
    _raise_nonfinite,
    _repage_kernel,
    _transcode_kernel,
    _x_arrays,
    program,
)
from kvbridge.backends.native.state import convert_state_rows as convert_state_rows
from kvbridge.backends.reference import SpanMove
from kvbridge.errors import InputError
from kvbridge.layouts import Layout

name = "native"
#: This backend converts fp4 indexer keys (``fp4_to_fp8_keys``) and compressor-state rows (``convert_state_rows``),
#: and some KV pairs between record rows of any tensors (``kv_segment_split``, ``transcode_kv_segments``).
KEY_KERNELS = STATE_KERNELS = KV_SEGMENT_KERNELS = True


def supports(*layouts: Layout) -> bool:
    """Every record description compiles to ops these kernels execute."""
    return True


def accepts(*tensors: torch.Tensor) -> bool:
    """CPU tensors of any alignment (non-contiguous ones are copied)."""
    return True


def all_finite(x: torch.Tensor) -> bool:
    """True when the fp32 or bf16 CPU tensor ``x`` holds no NaN or Inf (a bit test, multi-threaded)."""
    if x.dtype == torch.bfloat16:
        words, mask = _flat(x.view(torch.int16)).view(np.uint16), np.uint16(0x7F80)
    else:
        words, mask = _flat(x.view(torch.int32)).view(np.uint32), np.uint32(0x7F800000)
    nchunks = -(-words.shape[0] // (CHUNK_TOKENS * HEAD_DIM))
    counts = np.zeros(nchunks, np.int64)
    _run_chunks(_nonfinite_kernel, nchunks, words, mask, counts)
    return not counts.any()


def encode_pages(x: torch.Tensor, layout: Layout, page_size: int, dialect: str | None, scale: float,
                 *, out: torch.Tensor | None = None, accelerated: bool = True) -> torch.Tensor:
    """fp32 or bf16 ``[N, 512]`` (CPU) -> pages ``[ceil(N/P), page_bytes]`` uint8, written straight into
    ``out`` (contiguous; every byte written) when given. ``accelerated=False`` runs the generic kernel
    even where an encoder is registered (the tests compare the two)."""
    n = x.shape[0]
    out = _new_pages(layout, n, page_size) if out is None else out
    if n == 0:
        return out
    x32, x16, from_bf16 = _x_arrays(x)
    dp, dpb, dsplit, drb = _geometry(layout, page_size)
    fast = accelerator(LATENTS, layout) if accelerated else None
    if fast is not None:
        fast(x32, x16, from_bf16, n, dialect, scale, (_flat(out), dp, dpb, dsplit, drb))
        return out
    mult, gscale, min_exp = _encode_params(dialect, scale)
    _run_chunks(
        _encode_kernel, _page_chunks(out.shape[0], dp),
        x32, x16, from_bf16, n, _flat(out), program(layout), dp, dpb, dsplit, drb, mult, gscale, min_exp, _POW2_F32,
        _E4M3_F32,
    )
    return out


def decode_pages(
    pages: torch.Tensor, layout: Layout, page_size: int, num_tokens: int | None, scale: float,
    *, out: torch.Tensor | None = None, accelerated: bool = True,
) -> torch.Tensor:
    """Pages -> fp32 ``[num_tokens, 512]`` (all rows when ``num_tokens`` is None), written straight into
    ``out`` (contiguous) when given. ``accelerated=False`` runs the generic kernel even where a decoder
    is registered (the tests compare the two)."""
    n = layout.token_count(pages, page_size, num_tokens)
    out = _empty_output(n, HEAD_DIM * 4, torch.float32) if out is None else out
    fast = accelerator(layout, LATENTS) if accelerated else None
    if n and fast is not None:
        fast(n, np.float32(scale), (_flat(pages), *_geometry(layout, page_size)), _flat(out))
    elif n:
        sp, spb, ssplit, srb = _geometry(layout, page_size)
        _run_chunks(
            _decode_kernel, -(-n // CHUNK_TOKENS),
            _flat(pages), program(layout, read=True), sp, spb, ssplit, srb, np.float32(scale), n, _flat(out),
            _E4M3_F32, _UE8M0_F32, _E2M1_F32,
        )
    return out


def amax_pages(pages: torch.Tensor, layout: Layout, page_size: int, num_tokens: int | None,
               scale: float, *, accelerated: bool = True) -> float | None:
    """Largest |decoded value| of the first ``num_tokens`` tokens (0.0 for none), from the codes and
    scale bytes in one pass with no fp32 copy; None when a value would decode to NaN/Inf. MODEL1 and
    per-tensor E4M3 (TensorRT-LLM FP8) records run the compiled kernels where they are in use;
    ``accelerated=False`` runs the generic kernel (the tests compare the two)."""
    n = layout.token_count(pages, page_size, num_tokens)
    if n == 0:
        return 0.0
    nchunks = -(-n // CHUNK_TOKENS)
    amax = np.zeros(nchunks, np.float32)
    bad = np.zeros(nchunks, np.int64)
    geometry = (_flat(pages), *_geometry(layout, page_size))
    compiled = accel._CK is not None and accelerated
    if compiled and layout.segments == accel._MODEL1_SEGMENTS:
        _run_chunks(accel._CK.model1_amax, nchunks, *geometry, n, amax, bad)
    elif compiled and layout.segments == accel._FP8_SEGMENTS:
        _run_chunks(accel._CK.fp8_amax, nchunks, *geometry, n, float(np.float32(scale)), amax, bad)
    else:
        _run_chunks(_amax_kernel, nchunks, geometry[0], program(layout, read=True), *geometry[1:],
                    np.float32(scale), n, _E4M3_F32, _UE8M0_F32, _E2M1_F32, amax, bad)
    return None if bad.any() else float(amax.max())


def repage(
    pages: torch.Tensor, src: Layout, src_page_size: int, dst: Layout, dst_page_size: int, num_tokens: int | None,
    *, out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Byte move of identical token records between two page geometries, into ``out`` (every byte
    written) when given."""
    n = src.token_count(pages, src_page_size, num_tokens)
    out = _new_pages(dst, n, dst_page_size) if out is None else out
    if n:
        sp, spb, ssplit, rb = _geometry(src, src_page_size)
        dp, dpb, dsplit, _ = _geometry(dst, dst_page_size)
        _run_chunks(
            _repage_kernel, _page_chunks(out.shape[0], dp),
            _flat(pages), sp, spb, ssplit, _flat(out), dp, dpb, dsplit, rb, n,
        )
    return out


def transcode_pages(
    pages: torch.Tensor, src: Layout, src_page_size: int, dst: Layout, dst_page_size: int,
    num_tokens: int | None, src_scale: float, dst_scale: float, dialect: str | None,
    *, out: torch.Tensor | None = None, accelerated: bool = True,
) -> torch.Tensor:
    """Decode ``src`` pages and re-encode them as ``dst``, token by token (NaN/Inf in the source is an
    error), into ``out`` (every byte written) when given. ``accelerated=False`` runs the generic
    kernel even where an accelerator is registered (the tests compare the two)."""
    n = src.token_count(pages, src_page_size, num_tokens)
    out = _new_pages(dst, n, dst_page_size) if out is None else out
    if n == 0:
        return out
    sp, spb, ssplit, srb = _geometry(src, src_page_size)
    dp, dpb, dsplit, drb = _geometry(dst, dst_page_size)
    nchunks = _page_chunks(out.shape[0], dp)
    bad_count = np.zeros(nchunks, np.int64)
    bad_first = np.full(nchunks, -1, np.int64)
    fast = accelerator(src, dst) if accelerated else None
    if fast is not None:
        geometry = (_flat(pages), sp, spb, ssplit, srb, n, _flat(out), dp, dpb, dsplit, drb)
        fast(pages, src_scale, dst_scale, dialect, geometry, bad_count, bad_first)
    else:
        mult, gscale, min_exp = _encode_params(dialect, dst_scale)
        _run_chunks(
            _transcode_kernel, nchunks, _flat(pages), program(src, read=True), sp, spb, ssplit, srb,
            np.float32(src_scale), n,
            _flat(out), program(dst), dp, dpb, dsplit, drb, mult, gscale, min_exp,
            _E4M3_F32, _UE8M0_F32, _E2M1_F32, _POW2_F32, bad_count, bad_first,
        )
    _raise_nonfinite(bad_count, bad_first)
    return out


def kv_segment_split(src: Layout, dst: Layout) -> tuple[int, int] | None:
    """``dispatch.kv_segment_split`` here: the C kernels' pairs (``accel.segment_split``)."""
    return accel.segment_split(src, dst)


def transcode_kv_segments(streams: tuple[torch.Tensor, ...], segs: np.ndarray, strides: tuple[int, ...],
                          src: Layout, dst: Layout, src_scale: float, dst_scale: float, dialect: str | None,
                          into_pool: bool) -> None:
    """``dispatch.transcode_kv_segments`` here: every segment checked against its tensors before any byte is written
    (``InputError``; the C kernel checks again), non-temporal stores into pool pages (``into_pool``) of at least
    ``STREAMING_MOVE_BYTES``, NaN/Inf in the source refused as ``transcode_pages`` refuses it."""
    split = accel.segment_split(src, dst)
    if split is None:
        raise InputError(f"no segment kernel converts {src.name} records to {dst.name} here (kv_segment_split)")
    if len(streams) != 4 or any(not x.is_contiguous() or x.dtype != torch.uint8 or x.dim() != 1 for x in streams):
        raise InputError("transcode_kv_segments takes four contiguous flat uint8 tensors")
    segs = np.ascontiguousarray(segs, dtype=np.int64)
    if segs.ndim != 2 or segs.shape[1] != 6:
        raise InputError(f"KV segments must be int64 [S, 6], got shape {segs.shape}")
    if not segs.shape[0]:
        return
    widths = (split[0], src.record_bytes - split[0], split[1], dst.record_bytes - split[1])
    rows = segs[:, 4]
    live = rows > 0
    for k, (x, stride, width) in enumerate(zip(streams, strides, widths, strict=True)):
        end = segs[:, k] + np.maximum(rows - 1, 0) * int(stride) + width
        bad = (segs[:, k] < 0) | (rows < 0) | (segs[:, 5] < 0) | (live & (end > x.numel()))
        if int(stride) < (width if k >= 2 else 0) or bool(bad.any()):
            raise InputError(f"KV segment {int(np.flatnonzero(bad)[0]) if bad.any() else 0} lies outside its "
                             f"tensors (stream {k}, stride {int(stride)}, {width} bytes a row)")
    bad_count = np.zeros(segs.shape[0], np.int64)
    bad_first = np.full(segs.shape[0], -1, np.int64)
    nbytes = int(rows.sum()) * dst.record_bytes
    try:
        accel.transcode_segments(src, dst, tuple(x.numpy() for x in streams), segs, tuple(int(s) for s in strides),
                                 src_scale, dst_scale, dialect, into_pool and nbytes >= STREAMING_MOVE_BYTES,
                                 nbytes <= INLINE_CONVERT_BYTES, bad_count, bad_first)
    except ValueError as e:  # the kernel's own check (the one above refuses what it would)
        raise InputError(str(e)) from None
    _raise_nonfinite(bad_count, bad_first)


#: Segment transcodes writing at most this many bytes run on the calling thread (handing them to the pool cost
#: more than it saved: a layer's sliding window is a few hundred records).
INLINE_CONVERT_BYTES = 1 << 20
#: Moves of at most this many bytes run on the calling thread: handing a few MiB to the thread pool cost
#: more than it saved (a 128K-token request's staged gathers took 0.4-0.9x an ``np.copyto`` of their bytes
#: on one thread, 0.5-1.6x on two, at load 4-6 on 2 cores).
INLINE_MOVE_BYTES = 8 << 20
#: Moves into pool pages (``into_pool``) of at least this many bytes in all store non-temporally where the C span
#: copy runs on AVX-512: each destination line is then written once instead of read, filled and written back (a
#: migration's destination pages are not read again on this CPU soon, while staged records are read next).
STREAMING_MOVE_BYTES = 1 << 20


def _checked_runs(moves: Sequence[SpanMove]) -> np.ndarray:
    """Every segment of ``moves`` as a ``_kernels.move_runs`` row (source address, destination address, rows,
    source stride, destination stride, width), each checked against both of its tensors' bytes first
    (``InputError``): neither kernel checks an index. Array operations over all moves at once."""
    segs = [np.asarray(m[2], dtype=np.int64).reshape(-1, 3) for m in moves]
    counts = [x.shape[0] for x in segs]
    runs = np.empty((sum(counts), 6), dtype=np.int64)
    if not runs.shape[0]:
        return runs
    runs[:, :3] = np.concatenate(segs) if len(segs) > 1 else segs[0]
    per = np.array([(src.data_ptr(), dst.data_ptr(), ss, ds, w, src.numel() * src.element_size(),
                     dst.numel() * dst.element_size(), src.is_contiguous() and dst.is_contiguous())
                    for src, dst, _, ss, ds, w in moves], dtype=np.int64)
    each = np.repeat(per, counts, axis=0)
    at, to, rows = runs[:, 0].copy(), runs[:, 1].copy(), runs[:, 2]
    ss, ds, w = each[:, 2], each[:, 3], each[:, 4]
    live = rows > 0
    bad = ((each[:, 7] == 0) | (w < 0) | (ss < w) | (ds < w) | (at < 0) | (to < 0) | (rows < 0)
           | (live & ((at + (rows - 1) * ss + w > each[:, 5]) | (to + (rows - 1) * ds + w > each[:, 6]))))
    if bool(bad.any()):
        k = int(np.flatnonzero(bad)[0])
        raise InputError(f"span move out of bounds: segment {runs[k, :3].tolist()} of {int(w[k])}-byte rows (strides "
                         f"{int(ss[k])} / {int(ds[k])}) between tensors of {int(each[k, 5])} and {int(each[k, 6])} "
                         "bytes (or a tensor not contiguous)")
    runs[:, 0], runs[:, 1] = at + each[:, 0], to + each[:, 1]
    runs[:, 3:] = each[:, 2:5]
    return runs


def _byte_pieces(runs: np.ndarray, pieces: int) -> tuple[np.ndarray, list[int]]:
    """``runs`` with each run of more than ``1 / pieces`` of their bytes cut into row ranges, and the bounds of up
    to ``pieces`` consecutive ranges of runs moving about equal bytes (one thread's work each)."""
    nbytes = runs[:, 2] * runs[:, 5]
    share = max(1, int(nbytes.sum()) // pieces)
    cut = np.maximum(1, -(-nbytes // share))
    if bool((cut > 1).any()):
        step = np.maximum(1, -(-runs[:, 2] // cut))  # rows per sub-run
        cut = -(-runs[:, 2] // step)
        at = np.repeat(runs, cut, axis=0)
        k = np.arange(at.shape[0]) - np.repeat(np.cumsum(cut) - cut, cut)  # sub-run index within its run
        lo = k * np.repeat(step, cut)
        at[:, 2] = np.minimum(at[:, 2] - lo, np.repeat(step, cut))
        at[:, 0] += lo * at[:, 3]
        at[:, 1] += lo * at[:, 4]
        runs, nbytes = at, at[:, 2] * at[:, 5]
    ends = np.searchsorted(np.cumsum(nbytes), share * np.arange(1, pieces), side="left") + 1
    bounds = sorted({0, runs.shape[0], *np.minimum(ends, runs.shape[0]).tolist()})
    return runs, bounds


def xxh3_chunks(data: np.ndarray | memoryview, spans: np.ndarray) -> list[int]:
    """XXH3-64 (seed 0, unsigned) of bytes ``[start, stop)`` of ``data`` for each row of ``spans`` (int64 ``[n, 2]``,
    inside ``data``): one C call for every chunk where the extension is built, else one ``xxhash`` call per chunk
    (the same hashes)."""
    spans = np.ascontiguousarray(spans, dtype=np.int64).reshape(-1, 2)
    if accel._SPANS is None:
        h, view = xxhash.xxh3_64_intdigest, memoryview(data).cast("B")
        if bool(((spans[:, 0] < 0) | (spans[:, 0] > spans[:, 1]) | (spans[:, 1] > len(view))).any()):
            raise InputError("checksum chunks: a chunk's span is reversed or outside the data")
        return [h(view[a:e]) for a, e in spans.tolist()]
    out = np.empty(spans.shape[0], dtype=np.uint64)
    try:
        accel._SPANS.xxh3_chunks(data, spans, out)
    except ValueError as e:  # the kernel's bounds check
        raise InputError(f"checksum chunks: {e}") from None
    return out.tolist()


def move_spans(moves: Sequence[SpanMove], into_pool: bool = False) -> None:
    """Row copies between contiguous tensors (``reference.move_spans``), in place, every segment checked before any
    byte moves. The C extension's memcpy runs them where it is built: all moves in one call, spread over the
    threads by bytes when they move more than ``INLINE_MOVE_BYTES`` (``into_pool`` and at least
    ``STREAMING_MOVE_BYTES``: non-temporal stores on AVX-512); else numba's byte loop, one call per move."""
    runs = _checked_runs(moves)
    if accel._SPANS is None:
        for src, dst, segs, src_stride, dst_stride, width in moves:
            args = (src.view(-1).numpy(), dst.view(-1).numpy(), np.ascontiguousarray(segs, dtype=np.int64),
                    src_stride, dst_stride, width)
            if int(segs[:, 2].sum()) * width <= INLINE_MOVE_BYTES:
                _move_spans_kernel(0, segs.shape[0], *args)
            else:
                _run_chunks(_move_spans_kernel, segs.shape[0], *args)
        return
    total = int((runs[:, 2] * runs[:, 5]).sum())
    streaming = into_pool and total >= STREAMING_MOVE_BYTES
    if total <= INLINE_MOVE_BYTES or num_threads() <= 1:
        accel._SPANS.move_runs(0, runs.shape[0], runs, streaming)
        return
    runs, bounds = _byte_pieces(runs, 4 * num_threads())
    _run_pieces(accel._SPANS.move_runs, bounds, runs, streaming)


def nonfinite_flags(pages: torch.Tensor, layout: Layout, page_size: int, slots: torch.Tensor,
                    scale: float) -> torch.Tensor:
    """Per-slot non-finite flags (``reference.nonfinite_flags``; torch on CPU)."""
    return reference.nonfinite_flags(pages, layout, page_size, slots, scale)


def transcode_slots(*args) -> None:
    """Slot-list transcode in place (``reference.transcode_slots``; torch on CPU)."""
    reference.transcode_slots(*args)


def gather_transcode(*args) -> tuple[torch.Tensor, torch.Tensor]:
    """Gather-transcode into a scratch cache (``reference.gather_transcode``; torch on CPU)."""
    return reference.gather_transcode(*args)


def fp4_to_fp8_key_rows(src_keys: torch.Tensor, src_stride: int, src_scales: torch.Tensor, src_scale_stride: int,
                        n: int, dst_keys: torch.Tensor, dst_stride: int, dst_scales: torch.Tensor,
                        dst_scale_stride: int, dim: int, rule: str, *, measure: bool) -> float | None:
    """``n`` fp4 keys -> fp8 keys between strided rows of flat uint8 CPU tensors (``keys.fp4_to_fp8_key_rows``:
    key ``k``'s codes at ``keys[k * stride]``, its scale bytes at ``scales[k * scale_stride]``); the max abs error
    (0.0 unless ``measure``), None when a value decodes to NaN/Inf."""
    return key_kernels.fp4_to_fp8_key_rows(src_keys.numpy(), src_stride, src_scales.numpy(), src_scale_stride, n,
                                           dst_keys.numpy(), dst_stride, dst_scales.numpy(), dst_scale_stride, dim,
                                           rule, measure=measure)


def _word_flat(t: torch.Tensor) -> tuple[np.ndarray, int]:
    """Flat contiguous uint8 ``t`` as a numpy array starting at an 8-byte boundary (the up to 7 bytes of its
    storage before it included) and the byte offset of ``t`` in it."""
    back = t.data_ptr() % 8
    if back and t.storage_offset() >= back:
        return t.as_strided((t.numel() + back,), (1,), t.storage_offset() - back).numpy(), back
    return t.numpy(), 0


def fp4_to_fp8_key_segments(src_keys: torch.Tensor, src_scales: torch.Tensor, dst_keys: torch.Tensor,
                            dst_scales: torch.Tensor, segs: np.ndarray, strides: tuple[int, int, int, int], dim: int,
                            rule: str, *, measure: bool) -> float | None:
    """fp4 keys -> fp8 keys between strided rows of flat uint8 CPU tensors, segment by segment
    (``keys.fp4_to_fp8_key_segments``: ``segs`` int64 ``[S, 5]`` of byte offsets into the four tensors and key
    counts); the max abs error (0.0 unless ``measure``), None when a value decodes to NaN/Inf."""
    arrays, shift = zip(*(_word_flat(t) for t in (src_keys, src_scales, dst_keys, dst_scales)), strict=True)
    segs = np.asarray(segs, dtype=np.int64)
    if any(shift):
        segs = np.concatenate([segs[:, :4] + np.asarray(shift, dtype=np.int64), segs[:, 4:]], axis=1)
    return key_kernels.fp4_to_fp8_key_segments(*arrays, segs, strides, dim, rule, measure=measure)
