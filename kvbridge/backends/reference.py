"""Reference paged operations (readable torch), the ground truth for every fast path.

All take already-validated arguments (see ``kvbridge.ops.pages`` and ``kvbridge.ops.slots``): fp32 or bf16
contiguous latents, uint8 pages of the right shape, a resolved dialect and an fp32-representable
scale. Records are encoded and decoded by the layout's own description (``codec.record_codec``) and
placed by its geometry; this module is also the ``reference`` backend of ``kvbridge.backends.dispatch``.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import partial

import numpy as np
import torch

from kvbridge.backends.loss_stats import decoded_loss_stats
from kvbridge.errors import NonFiniteError
from kvbridge.layouts import Layout
from kvbridge.layouts.codec import record_codec

name = "reference"
#: No fused fp4 -> fp8 key, state-row or KV segment kernels here: the torch rules of ``ops.keys`` and migration,
#: and staged KV records, run.
KEY_KERNELS = STATE_KERNELS = KV_SEGMENT_KERNELS = False
#: Tokens per step of the slot operations: bounds their int64 byte-index tensors (32K x 1024 x 8 B = 256 MiB).
CHUNK_TOKENS = 1 << 15
FLAG_NONFINITE = 1
FLAG_OUT_OF_RANGE = 2


def supports(*layouts: Layout) -> bool:
    """The reference runs every layout on every device."""
    return True


def all_finite(x: torch.Tensor) -> bool:
    return not bool((~torch.isfinite(x)).any())


def _into(out: torch.Tensor | None, result: torch.Tensor) -> torch.Tensor:
    return result if out is None else out.copy_(result)


def encode_pages(x: torch.Tensor, layout: Layout, page_size: int, dialect: str | None, scale: float,
                 *, out: torch.Tensor | None = None, propagate: bool = False) -> torch.Tensor:
    """fp32 (or bf16, widened exactly) ``[N, 512]`` -> pages ``[ceil(N/P), page_bytes]`` (built, then
    copied into ``out`` when given); ``propagate``: NaN/Inf tiles as their writers store them."""
    records = record_codec(layout).encode(x.float(), dialect=dialect, scale=scale, propagate=propagate)
    return _into(out, layout.records_to_pages(records, page_size))


def decode_pages(
    pages: torch.Tensor, layout: Layout, page_size: int, num_tokens: int | None, scale: float,
    *, out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Pages -> fp32 ``[num_tokens, 512]`` (all rows when ``num_tokens`` is None; built, then copied
    into ``out`` when given)."""
    return _into(out, record_codec(layout).decode(layout.pages_to_records(pages, page_size, num_tokens), scale=scale))


def amax_pages(pages: torch.Tensor, layout: Layout, page_size: int, num_tokens: int | None,
               scale: float) -> float | None:
    """Largest |decoded value| of the first ``num_tokens`` tokens (0.0 for none); None when one is NaN/Inf."""
    values = decode_pages(pages, layout, page_size, num_tokens, scale)
    if not values.numel():
        return 0.0
    return float(values.abs().max()) if all_finite(values) else None


def repage(
    pages: torch.Tensor, src: Layout, src_page_size: int, dst: Layout, dst_page_size: int, num_tokens: int | None,
    *, out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Byte move of identical token records between two page geometries (into ``out`` when given)."""
    return _into(out, dst.records_to_pages(src.pages_to_records(pages, src_page_size, num_tokens), dst_page_size))


def check_finite(values: torch.Tensor, what: str = "source") -> None:
    bad = ~torch.isfinite(values)
    if bool(bad.any()):
        token, dim = bad.nonzero()[0].tolist()
        raise NonFiniteError(f"{what} holds non-finite values ({int(bad.sum())}; first at token {token}, dim {dim})")


def transcode_pages(
    pages: torch.Tensor, src: Layout, src_page_size: int, dst: Layout, dst_page_size: int,
    num_tokens: int | None, src_scale: float, dst_scale: float, dialect: str | None,
    *, out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Decode ``src`` pages and re-encode them as ``dst`` (NaN in the source is an error)."""
    values = decode_pages(pages, src, src_page_size, num_tokens, src_scale)
    check_finite(values)
    return _into(out, encode_pages(values, dst, dst_page_size, dialect, dst_scale))


#: One span move: (source tensor, destination tensor, int64 segments ``[k, 3]`` of (source byte offset,
#: destination byte offset, rows), source row stride, destination row stride, row width), all in bytes; both
#: tensors contiguous, on one device.
SpanMove = tuple[torch.Tensor, torch.Tensor, np.ndarray, int, int, int]


def move_spans(moves: Sequence[SpanMove], into_pool: bool = False) -> None:
    """For each move and each of its segments: copy ``rows`` rows of ``width`` bytes, the strides apart, from the
    move's source tensor into its destination tensor (the moves write disjoint bytes, so their order is free).
    ``into_pool``: the destinations are pool pages, not read again soon (a backend may store around the caches)."""
    for src, dst, segs, src_stride, dst_stride, width in moves:
        flat_src, flat_dst = src.view(-1), dst.view(-1)
        for at, to, rows in segs.tolist():
            if rows:
                part = flat_src[at : at + (rows - 1) * src_stride + width].as_strided((rows, width), (src_stride, 1))
                flat_dst[to : to + (rows - 1) * dst_stride + width].as_strided((rows, width),
                                                                               (dst_stride, 1)).copy_(part)


def records_at(pages: torch.Tensor, layout: Layout, page_size: int, slots: torch.Tensor) -> torch.Tensor:
    """Token records ``[N, record_bytes]`` of ``slots`` (a copy)."""
    return pages.view(-1)[layout.geometry.byte_index(page_size, slots)]


def nonfinite_flags(pages: torch.Tensor, layout: Layout, page_size: int, slots: torch.Tensor,
                    scale: float) -> torch.Tensor:
    """Per-slot flags (``FLAG_NONFINITE`` or 0) of the decoded tokens at in-range ``slots``; reads only."""
    flags = torch.zeros(slots.numel(), dtype=torch.uint8, device=pages.device)
    for start in range(0, slots.numel(), CHUNK_TOKENS):
        part = slots[start : start + CHUNK_TOKENS]
        values = record_codec(layout).decode(records_at(pages, layout, page_size, part), scale=scale)
        flags[start : start + part.numel()] = (~torch.isfinite(values).all(dim=1)).to(torch.uint8) * FLAG_NONFINITE
    return flags


def transcode_slots(
    src_pages: torch.Tensor, src: Layout, src_page_size: int, dst_pages: torch.Tensor, dst: Layout,
    dst_page_size: int, src_slots: torch.Tensor, dst_slots: torch.Tensor, src_scale: float, dst_scale: float,
    dialect: str | None, byte_move: bool, *, propagate: bool = False,
) -> None:
    """Write source slot ``src_slots[i]`` into ``dst_slots[i]`` in place (slots validated, sources
    already checked finite when re-encoding, unless ``propagate``: NaN/Inf re-encoded as the writers do)."""
    for start in range(0, src_slots.numel(), CHUNK_TOKENS):
        records = records_at(src_pages, src, src_page_size, src_slots[start : start + CHUNK_TOKENS])
        if not byte_move:
            values = record_codec(src).decode(records, scale=src_scale)
            records = record_codec(dst).encode(values, dialect=dialect, scale=dst_scale, propagate=propagate)
        index = dst.geometry.byte_index(dst_page_size, dst_slots[start : start + CHUNK_TOKENS])
        dst_pages.view(-1)[index] = records


def gather_transcode(
    pool: torch.Tensor, layout: Layout, page_size: int, indices: torch.Tensor, scale: float,
    dialect: str | None, byte_move: bool, out_page_size: int, scratch_layout: Layout,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Write the token of each flat index k (-1: zeros) as ``scratch_layout`` row k; returns ``(scratch, flags)``.

    ``flags[k]``: ``FLAG_OUT_OF_RANGE`` (nothing is written then) or ``FLAG_NONFINITE``; the caller raises.
    """
    n = indices.numel()
    capacity = pool.shape[0] * page_size
    flags = torch.zeros(n, dtype=torch.uint8, device=pool.device)
    oob = (indices < -1) | (indices >= capacity)
    scratch = torch.zeros(scratch_layout.num_pages(n, out_page_size), scratch_layout.page_bytes(out_page_size),
                          dtype=torch.uint8, device=pool.device)
    if bool(oob.any()):
        flags[oob] = FLAG_OUT_OF_RANGE
        return scratch, flags
    positions = (indices >= 0).nonzero()[:, 0]  # scratch slot k holds entry k
    for start in range(0, positions.numel(), CHUNK_TOKENS):
        part = positions[start : start + CHUNK_TOKENS]
        records = records_at(pool, layout, page_size, indices[part])
        if not byte_move:
            values = record_codec(layout).decode(records, scale=scale)
            bad = ~torch.isfinite(values).all(dim=1)
            if bool(bad.any()):
                flags[part[bad]] = FLAG_NONFINITE
                return scratch, flags
            records = record_codec(scratch_layout).encode(values, dialect=dialect, scale=1.0)
        scratch.view(-1)[scratch_layout.geometry.byte_index(out_page_size, part)] = records
    return scratch, flags


def accepts(*tensors: torch.Tensor) -> bool:
    """The reference takes tensors of any alignment."""
    return True


#: ``dispatch.loss_stats``: both pools decoded here and compared (``loss_stats.decoded_loss_stats``).
loss_stats = partial(decoded_loss_stats, decode_pages)
