"""The arguments of a sparse decode, validated once for every backend: ``CacheArg`` (one pool,
its indices and validity) and ``DecodeArgs`` (queries, the main and extra pools, sink, scale).

Token slot ``s`` of a pool with page size ``P`` is page ``s // P``, row ``s % P``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from kvbridge.errors import InputError, LayoutError
from kvbridge.layouts import Layout, get_layout
from kvbridge.layouts.codec import HEAD_DIM
from kvbridge.ops.pages import _check_scale

DEFAULT_SOFTMAX_SCALE = HEAD_DIM**-0.5
_Q_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
_CACHE_DTYPES = (torch.uint8, torch.float8_e4m3fn)
# Reference backend: at most this many gathered fp32 K values are alive at once (256 MiB).


@dataclass(frozen=True)
class CacheArg:
    """One validated KV pool: uint8 pages ``[num_pages, page_bytes]``, its indices and scale.

    ``indices`` is int64 ``(b, s_q, topk)`` with every slot past ``topk_length`` and every
    negative slot set to -1; ``valid`` marks the slots that count.
    """

    pages: torch.Tensor
    layout: Layout
    page_size: int
    scale: float
    indices: torch.Tensor
    valid: torch.Tensor
    topk_length: torch.Tensor | None


def pages_2d(k_cache: torch.Tensor, layout: Layout, page_size: int, what: str) -> torch.Tensor:
    """uint8 pages ``[num_pages, page_bytes]`` from ``k_cache`` in either accepted form.

    Accepted: pages ``[num_pages, page_bytes]`` as ``kvbridge.encode`` makes them, or the
    kernel view ``(num_pages, page_size, 1, record_bytes)`` whose dim-0 stride (in bytes) is
    ``page_bytes`` (for ``flashmla-model1`` the page padded to a multiple of 576 B).
    uint8 or float8_e4m3fn (viewed as uint8, no copy).
    """
    if not isinstance(k_cache, torch.Tensor):
        raise InputError(f"{what} must be a torch.Tensor, got {type(k_cache).__name__}")
    if k_cache.dtype not in _CACHE_DTYPES:
        raise InputError(f"{what} must be uint8 (or float8_e4m3fn) pages, got {k_cache.dtype}")
    cache = k_cache.view(torch.uint8)
    pb = layout.page_bytes(page_size)
    if cache.dim() == 2:
        if cache.shape[1] != pb:
            raise InputError(
                f"{what}: {layout.name} pages of {page_size} tokens must have shape [num_pages, {pb}], "
                f"got {list(cache.shape)}"
            )
        if cache.stride(1) != 1:
            raise InputError(f"{what}: each page's bytes must be contiguous (stride(1) == 1)")
        return cache
    if cache.dim() == 4:
        want = (page_size, 1, layout.record_bytes)
        if tuple(cache.shape[1:]) != want:
            raise InputError(
                f"{what}: a 4-D {layout.name} cache must have shape (num_pages, {page_size}, 1, "
                f"{layout.record_bytes}), got {tuple(cache.shape)}"
            )
        n = cache.shape[0]
        inner = (layout.record_bytes, layout.record_bytes, 1)
        if tuple(cache.stride()[1:]) != inner or (n > 1 and cache.stride(0) != pb):
            raise InputError(
                f"{what}: a 4-D {layout.name} cache must have strides ({pb}, {inner[0]}, {inner[1]}, 1) "
                f"(dim-0 stride = page bytes), got {cache.stride()}"
            )
        end = cache.storage_offset() + n * pb
        if cache.untyped_storage().nbytes() < end:
            raise InputError(f"{what}: its storage ends before the last page's padding ({end} bytes needed)")
        return torch.as_strided(cache, (n, pb), (pb, 1))
    raise InputError(f"{what} must be 2-D pages or a 4-D (num_pages, P, 1, record_bytes) view, got {cache.dim()}-D")


def _check_indices(indices: torch.Tensor, what: str, batch_shape: tuple[int, int], device: torch.device) -> int:
    if not isinstance(indices, torch.Tensor):
        raise InputError(f"{what} must be a torch.Tensor, got {type(indices).__name__}")
    if indices.dtype != torch.int32:
        raise InputError(f"{what} must be int32 token slots, got {indices.dtype}")
    if indices.dim() != 3 or tuple(indices.shape[:2]) != batch_shape:
        raise InputError(
            f"{what} must have shape (b, s_q, topk) = ({batch_shape[0]}, {batch_shape[1]}, topk), "
            f"got {tuple(indices.shape)}"
        )
    if indices.shape[2] < 1:
        raise InputError(f"{what} must hold at least one slot per query (topk >= 1)")
    if indices.device != device:
        raise InputError(f"{what} is on {indices.device} but q is on {device}")
    return indices.shape[2]


def _check_topk_length(topk_length: torch.Tensor | None, what: str, b: int, topk: int, device: torch.device) -> None:
    if topk_length is None:
        return
    if not isinstance(topk_length, torch.Tensor):
        raise InputError(f"{what} must be a torch.Tensor, got {type(topk_length).__name__}")
    if topk_length.dtype != torch.int32 or tuple(topk_length.shape) != (b,):
        raise InputError(f"{what} must be int32 of shape ({b},), got {topk_length.dtype} {tuple(topk_length.shape)}")
    if topk_length.device != device:
        raise InputError(f"{what} is on {topk_length.device} but q is on {device}")
    if b and (int(topk_length.min()) < 0 or int(topk_length.max()) > topk):
        lo, hi = int(topk_length.min()), int(topk_length.max())
        raise InputError(f"{what} values must lie in [0, {topk}], got [{lo}, {hi}]")


def _cache_arg(
    k_cache: torch.Tensor, indices: torch.Tensor, topk_length: torch.Tensor | None, layout: str | Layout,
    page_size: int, scale: float | None, names: tuple[str, str, str, str, str, str], q: torch.Tensor,
) -> CacheArg:
    """Validate one pool with its indices; ``names`` = the argument names used in messages."""
    cache_name, idx_name, len_name, layout_name, page_size_name, scale_name = names
    try:
        lay = get_layout(layout)
    except LayoutError as err:
        raise LayoutError(f"{layout_name}: {err}") from None
    if isinstance(page_size, bool) or not isinstance(page_size, int) or page_size < 1:
        raise InputError(f"{page_size_name} must be a positive integer, got {page_size!r}")
    pages = pages_2d(k_cache, lay, page_size, cache_name)
    if pages.device != q.device:
        raise InputError(f"{cache_name} is on {pages.device} but q is on {q.device}")
    s = _check_scale(scale, lay, scale_name)
    b, s_q = q.shape[0], q.shape[1]
    topk = _check_indices(indices, idx_name, (b, s_q), q.device)
    _check_topk_length(topk_length, len_name, b, topk, q.device)
    idx = indices.to(torch.int64)
    capacity = pages.shape[0] * page_size
    over = idx >= capacity
    if bool(over.any()):
        pos = tuple(int(v) for v in over.nonzero()[0])
        raise InputError(
            f"{idx_name}{list(pos)} = {int(idx[pos])} is outside the pool's {capacity} token slots "
            f"({pages.shape[0]} pages of {page_size}); use -1 for an unused slot"
        )
    valid = idx >= 0
    if topk_length is not None:
        valid &= torch.arange(topk, device=q.device) < topk_length.to(torch.int64)[:, None, None]
    idx = torch.where(valid, idx, torch.full_like(idx, -1))
    return CacheArg(pages, lay, page_size, s, idx, valid, topk_length)


@dataclass(frozen=True)
class DecodeArgs:
    """Everything ``sparse_decode`` validated: q, the pools, sink and softmax scale."""

    q: torch.Tensor
    main: CacheArg
    extra: CacheArg | None
    attn_sink: torch.Tensor | None
    softmax_scale: float


def validate(
    q: torch.Tensor, k_cache: torch.Tensor, indices: torch.Tensor, *, layout: str | Layout, page_size: int,
    extra_k_cache: torch.Tensor | None, extra_indices: torch.Tensor | None, extra_layout: str | Layout | None,
    extra_page_size: int | None, topk_length: torch.Tensor | None, extra_topk_length: torch.Tensor | None,
    attn_sink: torch.Tensor | None, softmax_scale: float | None, scale: float | None, extra_scale: float | None,
) -> DecodeArgs:
    """Check every ``sparse_decode`` argument (shapes, dtypes, devices, index ranges)."""
    if not isinstance(q, torch.Tensor):
        raise InputError(f"q must be a torch.Tensor, got {type(q).__name__}")
    if q.dim() != 4 or q.shape[3] != HEAD_DIM:
        raise InputError(f"q must have shape (b, s_q, h_q, {HEAD_DIM}), got {tuple(q.shape)}")
    if q.dtype not in _Q_DTYPES:
        raise InputError(f"q must be bfloat16, float16 or float32, got {q.dtype}")
    main = _cache_arg(k_cache, indices, topk_length, layout, page_size, scale,
                      ("k_cache", "indices", "topk_length", "layout", "page_size", "scale"), q)
    extra_given = {
        "extra_indices": extra_indices, "extra_page_size": extra_page_size, "extra_layout": extra_layout,
        "extra_topk_length": extra_topk_length, "extra_scale": extra_scale,
    }
    extra = None
    if extra_k_cache is None:
        stray = [name for name, value in extra_given.items() if value is not None]
        if stray:
            raise InputError(f"{stray[0]} was given without extra_k_cache")
    else:
        if extra_indices is None:
            raise InputError("extra_k_cache needs extra_indices")
        if extra_page_size is None:
            raise InputError("extra_k_cache needs extra_page_size (tokens per page of the extra cache)")
        extra = _cache_arg(
            extra_k_cache, extra_indices, extra_topk_length, layout if extra_layout is None else extra_layout,
            extra_page_size, extra_scale,
            ("extra_k_cache", "extra_indices", "extra_topk_length", "extra_layout", "extra_page_size", "extra_scale"),
            q,
        )
    if attn_sink is not None:
        if not isinstance(attn_sink, torch.Tensor):
            raise InputError(f"attn_sink must be a torch.Tensor, got {type(attn_sink).__name__}")
        if attn_sink.dtype != torch.float32 or tuple(attn_sink.shape) != (q.shape[2],):
            raise InputError(
                f"attn_sink must be float32 of shape (h_q,) = ({q.shape[2]},), "
                f"got {attn_sink.dtype} {tuple(attn_sink.shape)}"
            )
        if attn_sink.device != q.device:
            raise InputError(f"attn_sink is on {attn_sink.device} but q is on {q.device}")
        if bool(torch.isnan(attn_sink).any()):
            raise InputError("attn_sink holds NaN")
    if softmax_scale is None:
        sm = DEFAULT_SOFTMAX_SCALE
    else:
        if isinstance(softmax_scale, bool) or not isinstance(softmax_scale, (int, float)):
            raise InputError(f"softmax_scale must be a positive finite number, got {softmax_scale!r}")
        sm = float(softmax_scale)
        if not (math.isfinite(sm) and sm > 0):
            raise InputError(f"softmax_scale must be a positive finite number, got {softmax_scale!r}")
    return DecodeArgs(q, main, extra, attn_sink, sm)
