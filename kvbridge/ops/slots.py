"""Block-table paged operations: slot-list transcode and gather-transcode into a MODEL1 scratch cache.

A token's *slot* is ``page * P + row``: it lives in page ``slot // P`` at row
``slot % P``. Both functions validate every argument before writing anything, then run on the
backend ``kvbridge.backends.dispatch`` picks (the torch reference on CPU, the Triton kernels on CUDA);
every backend is byte-identical to the reference.
"""

from __future__ import annotations

import torch

from kvbridge.backends import dispatch, reference
from kvbridge.errors import InputError, LayoutError, NonFiniteError
from kvbridge.layouts import Layout, get_layout, scan
from kvbridge.ops.pages import (
    TRANSCODE_NONFINITE_POLICIES,
    _check_dialect,
    _check_nonfinite,
    _check_scale,
    first_bad_copy,
    is_byte_move,
)

#: Layout of the scratch cache ``gather_transcode`` writes (FlashMLA's sparse decode reads it).
SCRATCH_LAYOUT = "flashmla-model1"
_INDEX_DTYPES = (torch.int32, torch.int64)


def record_byte_index(layout: Layout, page_size: int, slots: torch.Tensor) -> torch.Tensor:
    """Flat byte offsets ``[N, record_bytes]`` (int64) of each slot's record inside ``pages.view(-1)``
    (``PageGeometry.byte_index`` of the layout)."""
    return layout.geometry.byte_index(page_size, slots)


def _check_pool(pages: object, layout: Layout, page_size: int, what: str) -> torch.Tensor:
    if not isinstance(pages, torch.Tensor):
        raise InputError(f"{what} must be a torch.Tensor, got {type(pages).__name__}")
    try:
        layout.check_pages(pages, page_size)
    except LayoutError as exc:
        raise LayoutError(f"{what}: {exc}") from None
    if not pages.is_contiguous():
        raise InputError(f"{what} must be contiguous")
    return pages


def _check_slots(slots: object, what: str, pool: torch.Tensor, pool_name: str) -> torch.Tensor:
    if not isinstance(slots, torch.Tensor):
        raise InputError(f"{what} must be a torch.Tensor, got {type(slots).__name__}")
    if slots.dtype not in _INDEX_DTYPES:
        raise InputError(f"{what} must be int32 or int64, got {slots.dtype}")
    if slots.device != pool.device:
        raise InputError(f"{what} is on {slots.device}, {pool_name} on {pool.device}")
    return slots


def _first_nonfinite_code(pages: torch.Tensor, layout: Layout, page_size: int, slots: torch.Tensor) -> int | None:
    """Position in ``slots`` of the first token whose stored bytes hold a NaN/Inf code (byte moves
    decode nothing, so the codes are scanned; see ``kvbridge.layouts.scan``)."""
    for start in range(0, slots.numel(), reference.CHUNK_TOKENS):
        part = slots[start : start + reference.CHUNK_TOKENS]
        found = scan.scan_records(reference.records_at(pages, layout, page_size, part), layout)
        if found.count:
            return start + found.first_token
    return None


def _first_out_of_range(slots: torch.Tensor, capacity: int, allow_invalid: bool) -> int | None:
    """Flat position of the first slot outside ``[0, capacity)`` (``-1`` allowed if ``allow_invalid``)."""
    low = -1 if allow_invalid else 0
    bad = (slots < low) | (slots >= capacity)
    if not bool(bad.any()):
        return None
    return int(bad.reshape(-1).nonzero()[0, 0])


def _check_distinct(dst_slots: torch.Tensor) -> None:
    ordered, order = torch.sort(dst_slots.to(torch.int64), stable=True)
    same = ordered[1:] == ordered[:-1]
    if bool(same.any()):
        k = int(same.nonzero()[0, 0])
        first, second = sorted((int(order[k]), int(order[k + 1])))
        raise InputError(
            f"dst_slots holds slot {int(ordered[k])} twice (at indices {first} and {second}); "
            "destination slots must be distinct"
        )


def _shares_memory(a: torch.Tensor, b: torch.Tensor) -> bool:
    sa, sb = a.untyped_storage(), b.untyped_storage()
    return sa.data_ptr() == sb.data_ptr() and sa.device == sb.device


def transcode_slots(
    src_pages: torch.Tensor,
    src_layout: str | Layout,
    dst_pages: torch.Tensor,
    dst_layout: str | Layout,
    *,
    src_page_size: int,
    dst_page_size: int,
    src_slots: torch.Tensor,
    dst_slots: torch.Tensor,
    src_scale: float | None = None,
    dst_scale: float | None = None,
    dialect: str | None = None,
    nonfinite: str = "error",
) -> torch.Tensor:
    """Write the token at ``src_slots[i]`` of the source pool into ``dst_slots[i]`` of ``dst_pages``, in place.

    Pools are uint8 ``[num_pages, page_bytes]`` of their layout and page size; slots are 1-D
    int32/int64 of equal length, ``page * P + row``. Only the addressed destination records
    change (a record includes a 584-byte layout's scale and pad bytes in the page footer).
    Same token record in both layouts (re-paging, ``flashmla-model1`` <-> ``trtllm-fp8-ds-mla``,
    per-tensor at equal scale): the bytes are copied and ``dialect`` is refused. Otherwise each
    token is decoded (``src_scale``) and re-encoded (``dialect``, ``dst_scale``); a non-finite
    decoded source raises ``NonFiniteError`` before anything is written, unless ``nonfinite="propagate"``:
    then the tokens are re-encoded as the destination dialect's writer does (``transcode``; on the reference
    codec), and a byte move copies the source's codes as they are. A source layout with mirrors
    (``lil-nvfp4-ds-mla``) whose two copies of a token disagree raises ``CopyMismatchError`` before anything is
    written; a byte move decodes nothing and does not compare them.
    Returns ``dst_pages``.
    """
    src = get_layout(src_layout)
    dst = get_layout(dst_layout)
    src.check_page_size(src_page_size)
    dst.check_page_size(dst_page_size)
    _check_pool(src_pages, src, src_page_size, "src_pages")
    _check_pool(dst_pages, dst, dst_page_size, "dst_pages")
    device = src_pages.device
    if dst_pages.device != device:
        raise InputError(f"dst_pages is on {dst_pages.device}, src_pages on {device}")
    if _shares_memory(src_pages, dst_pages):
        raise InputError("src_pages and dst_pages share memory; transcode into a separate pool")
    _check_slots(src_slots, "src_slots", src_pages, "src_pages")
    _check_slots(dst_slots, "dst_slots", src_pages, "src_pages")
    if src_slots.dim() != 1 or dst_slots.dim() != 1 or src_slots.shape != dst_slots.shape:
        raise InputError(
            "src_slots and dst_slots must be 1-D of equal length, "
            f"got {list(src_slots.shape)} and {list(dst_slots.shape)}"
        )
    s_in = _check_scale(src_scale, src, "src_scale")
    s_out = _check_scale(dst_scale, dst, "dst_scale")
    policy = _check_nonfinite(nonfinite, None, None, TRANSCODE_NONFINITE_POLICIES)
    byte_move = is_byte_move(src, dst, s_in, s_out)
    if byte_move and dialect is not None:
        raise InputError(
            f"{src.name} -> {dst.name} is a byte move that keeps the source's scales; "
            f"dialect={dialect!r} would not be applied"
        )
    d = None if byte_move else _check_dialect(dialect, dst)
    if not byte_move:
        _check_nonfinite(policy, dst, d)
    for slots, pages, page_size, what in (
        (src_slots, src_pages, src_page_size, "src_slots"),
        (dst_slots, dst_pages, dst_page_size, "dst_slots"),
    ):
        capacity = pages.shape[0] * page_size
        bad = _first_out_of_range(slots, capacity, allow_invalid=False)
        if bad is not None:
            raise InputError(
                f"{what}[{bad}] = {int(slots[bad])} is outside the pool of {capacity} slots "
                f"({pages.shape[0]} pages of {page_size})"
            )
    _check_distinct(dst_slots)
    if src_slots.numel() == 0:
        return dst_pages
    src_slots, dst_slots = src_slots.contiguous(), dst_slots.contiguous()
    if byte_move and policy == "error":
        bad = _first_nonfinite_code(src_pages, src, src_page_size, src_slots)
        if bad is not None:
            _raise_nonfinite_slot(src_slots, bad)
    if not byte_move:  # a first pass, so that nothing is written when any source token is bad
        _check_slot_copies(src_pages, src, src_page_size, src_slots, s_in, "src_slots")
        flags = dispatch.nonfinite_flags(src_pages, src, src_page_size, src_slots, s_in)
        if bool(flags.any()):
            if policy == "error":
                _raise_nonfinite_slot(src_slots, int(flags.nonzero()[0, 0]))
            dispatch.transcode_slots_nonfinite(src_pages, src, src_page_size, dst_pages, dst, dst_page_size,
                                               src_slots, dst_slots, s_in, s_out, d)
            return dst_pages
    dispatch.transcode_slots(src_pages, src, src_page_size, dst_pages, dst, dst_page_size, src_slots, dst_slots,
                             s_in, s_out, d, byte_move)
    return dst_pages


def _check_slot_copies(pages: torch.Tensor, layout: Layout, page_size: int, slots: torch.Tensor, scale: float,
                       name: str, positions: torch.Tensor | None = None) -> None:
    """``CopyMismatchError`` naming ``name[k]`` (``k``: the slot's position, or ``positions[k]`` when given) for the
    first of the tokens at in-range ``slots`` whose two copies of some dims disagree (``ops.pages.first_bad_copy``);
    nothing is gathered for a layout without mirrors (a byte move does not call it: it decodes nothing)."""
    if not layout.mirrors:
        return
    for start in range(0, slots.numel(), reference.CHUNK_TOKENS):
        part = slots[start : start + reference.CHUNK_TOKENS]
        found = first_bad_copy(reference.records_at(pages, layout, page_size, part), layout, scale)
        if found is not None:
            k = start + found.index
            pos = k if positions is None else int(positions[k])
            raise found.error(layout, f"{name}[{pos}] = slot {int(slots[k])}")


def _raise_nonfinite_slot(slots: torch.Tensor, k: int) -> None:
    raise NonFiniteError(f"src_slots[{k}] = slot {int(slots[k])} decodes to non-finite values; nothing was written")


def gather_transcode(
    pool: torch.Tensor,
    layout: str | Layout,
    *,
    page_size: int,
    indices: torch.Tensor,
    scale: float | None = None,
    dialect: str | None = None,
    out_page_size: int = 64,
    out_layout: str | Layout = SCRATCH_LAYOUT,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Copy just the tokens ``indices`` touches into a fresh scratch cache of ``out_layout``
    (default ``flashmla-model1``; ``v41-fp8-interleaved`` feeds FlashMLA's current kernels).

    ``indices`` ``(..., topk)`` int32/int64 holds pool slots (``page * page_size + row``), -1 for
    none. Entry at flat position ``k`` of ``indices`` is written to scratch slot ``k`` (no
    deduplication: a token named twice is converted twice, which avoids a sort on the GPU and
    keeps this one launch). Returns ``(scratch_pages, remapped)``: scratch uint8
    ``[ceil(indices.numel() / out_page_size), page_bytes]`` of ``out_layout`` with page size
    ``out_page_size`` (rows of -1 entries, unused rows and the page tail are zero), and int32
    ``remapped`` of the shape of ``indices`` (``k`` where valid, -1 kept). ``scale`` is the
    source's per-tensor scale; ``dialect`` the scratch layout's encoder rule (refused when the
    source stores the same records, which are then copied). A non-finite source token raises ``NonFiniteError``;
    a source layout with mirrors whose two copies of a token disagree, ``CopyMismatchError`` (not for a byte move).
    """
    src = get_layout(layout)
    dst = get_layout(out_layout)
    src.check_page_size(page_size)
    dst.check_page_size(out_page_size)
    _check_pool(pool, src, page_size, "pool")
    _check_slots(indices, "indices", pool, "pool")
    if indices.dim() < 1:
        raise InputError("indices must have at least one dimension (..., topk)")
    s_in = _check_scale(scale, src, "scale")
    byte_move = is_byte_move(src, dst, s_in, 1.0)
    if byte_move and dialect is not None:
        raise InputError(
            f"a {src.name} pool is copied as is into the scratch cache; dialect={dialect!r} would not be applied"
        )
    d = None if byte_move else _check_dialect(dialect, dst)
    capacity = pool.shape[0] * page_size
    flat = indices.reshape(-1)
    if byte_move:
        bad = _first_out_of_range(flat, capacity, allow_invalid=True)
        if bad is not None:
            _raise_out_of_range(indices, bad, capacity)
        _check_gathered_codes(pool, src, page_size, flat, indices)
    elif src.mirrors:  # the copies compared before the kernel runs: the slots must be in range first
        bad = _first_out_of_range(flat, capacity, allow_invalid=True)
        if bad is not None:
            _raise_out_of_range(indices, bad, capacity)
        valid = (flat >= 0).nonzero()[:, 0]
        _check_slot_copies(pool, src, page_size, flat[valid], s_in, "indices (flat)", valid)
    scratch, flags = dispatch.gather_transcode(pool, src, page_size, flat.contiguous(), s_in, d, byte_move,
                                               out_page_size, dst)
    _raise_flags(flags, indices, capacity)
    positions = torch.arange(flat.numel(), dtype=torch.int32, device=pool.device)
    remapped = torch.where(flat >= 0, positions, torch.full_like(positions, -1)).view(indices.shape)
    return scratch, remapped


def _check_gathered_codes(pool: torch.Tensor, layout: Layout, page_size: int, flat: torch.Tensor,
                          indices: torch.Tensor) -> None:
    """Raise ``NonFiniteError`` when a valid entry of ``indices`` names a token with NaN/Inf codes."""
    valid = (flat >= 0).nonzero()[:, 0]
    bad = _first_nonfinite_code(pool, layout, page_size, flat[valid])
    if bad is not None:
        _raise_nonfinite_index(indices, int(valid[bad]))


def _index_text(indices: torch.Tensor, k: int) -> str:
    pos = ", ".join(str(int(v)) for v in torch.unravel_index(torch.tensor(k), tuple(indices.shape)))
    return f"indices[{pos}] = {int(indices.reshape(-1)[k])}"


def _raise_out_of_range(indices: torch.Tensor, k: int, capacity: int) -> None:
    raise InputError(
        f"{_index_text(indices, k)} is outside the pool of {capacity} slots (valid: 0..{capacity - 1} or -1)"
    )


def _raise_nonfinite_index(indices: torch.Tensor, k: int) -> None:
    raise NonFiniteError(f"{_index_text(indices, k)} decodes to non-finite values")


def _raise_flags(flags: torch.Tensor, indices: torch.Tensor, capacity: int) -> None:
    """Turn the kernel's per-index flags (1 non-finite, 2 out of range) into the reference's errors."""
    if not bool(flags.any()):
        return
    oob = flags == reference.FLAG_OUT_OF_RANGE
    if bool(oob.any()):
        _raise_out_of_range(indices, int(oob.nonzero()[0, 0]), capacity)
    _raise_nonfinite_index(indices, int((flags == reference.FLAG_NONFINITE).nonzero()[0, 0]))
