"""The one dispatcher of paged operations: picks the fastest exact backend for the tensors.

Every backend is a module with the same interface, byte-identical to ``kvbridge.backends.reference``:
``name``, ``supports(*layouts)``, ``all_finite``, ``amax_pages``, ``move_spans``, ``encode_pages(..., out=)``,
``decode_pages(..., out=)``, ``repage(..., out=)``, ``transcode_pages(..., out=)``, ``nonfinite_flags``,
``transcode_slots`` and ``gather_transcode`` (a backend whose kernel cannot write into ``out`` builds a temporary and
copies it in: the reference does) and ``loss_stats`` (one native pass on CPU, ``kvbridge.backends.native.loss``;
decoded values compared elsewhere). Backends with ``KEY_KERNELS`` / ``STATE_KERNELS`` also convert fp4 indexer keys
(``fp4_to_fp8_keys``, ``fp4_to_fp8_key_rows``) and compressor-state rows (``convert_state_rows``), those with
``KV_SEGMENT_KERNELS`` some KV pairs between record rows of any tensors (``transcode_kv_segments``). All of them
execute the layouts' own record descriptions, so every registered layout runs on every backend.

- CPU tensors: the native numba kernels (``kvbridge.backends.native``, imported on first use);
- CUDA tensors: the Triton kernels (``kvbridge.backends.triton_kernels``, imported only then) when Triton
  is installed and every tensor is contiguous and 16-byte aligned;
- everything else, and everything when the environment variable ``KVBRIDGE_BACKEND=reference``
  is set, runs the reference. ``KVBRIDGE_BACKEND=auto`` (or unset) is the default.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from types import ModuleType

import numpy as np
import torch

from kvbridge.backends import reference
from kvbridge.backends.loss_stats import LossStats
from kvbridge.backends.reference import SpanMove
from kvbridge.errors import InputError
from kvbridge.layouts import Layout

__all__ = [
    "BACKEND_ENV", "all_finite", "amax_pages", "backend", "backend_name", "convert_state_rows", "decode_pages",
    "encode_pages", "encode_pages_nonfinite", "fp4_to_fp8_key_rows", "fp4_to_fp8_key_segments", "fp4_to_fp8_keys",
    "gather_transcode", "key_kernels", "loss_stats", "move_spans", "nonfinite_flags", "repage",
    "state_kernels", "transcode_pages", "transcode_slots", "transcode_slots_nonfinite", "xxh3_chunks",
]

#: Environment variable selecting the implementation: ``auto`` (default) or ``reference``.
BACKEND_ENV = "KVBRIDGE_BACKEND"
BACKEND_CHOICES = ("auto", "reference")


def _forced_reference() -> bool:
    choice = os.environ.get(BACKEND_ENV, "auto").strip().lower() or "auto"
    if choice not in BACKEND_CHOICES:
        raise InputError(f"{BACKEND_ENV} must be one of {', '.join(BACKEND_CHOICES)}, got {choice!r}")
    return choice == "reference"


def _device_backend(device: torch.device) -> ModuleType | None:
    """The kernel module for ``device`` (imported here, lazily), or None."""
    if device.type == "cpu":
        from kvbridge.backends import native  # optional dependency: numba, loaded at the first CPU call

        return native
    if device.type == "cuda":
        try:
            from kvbridge.backends import triton_kernels  # optional dependency: triton
        except ImportError:  # Triton not installed: the torch reference also runs on CUDA
            return None
        return triton_kernels
    return None


def backend(tensors: torch.Tensor | tuple[torch.Tensor, ...], *layouts: Layout) -> ModuleType:
    """The backend module that serves ``tensors`` (the pools or latents of one call, all on one device;
    slot and index lists need no alignment) in ``layouts``."""
    group = tensors if isinstance(tensors, tuple) else (tensors,)
    if _forced_reference():
        return reference
    chosen = _device_backend(group[0].device)
    if chosen is None or not chosen.supports(*layouts) or not chosen.accepts(*group):
        return reference
    return chosen


def backend_name(tensor: torch.Tensor, *layouts: Layout) -> str:
    """Short name of the backend a paged operation on ``tensor`` would run (for reports)."""
    return backend(tensor, *layouts).name


def all_finite(x: torch.Tensor) -> bool:
    """True when latents ``x`` hold no NaN or Inf."""
    return backend(x).all_finite(x)


def encode_pages(x: torch.Tensor, layout: Layout, page_size: int, dialect: str | None, scale: float,
                 *, out: torch.Tensor | None = None) -> torch.Tensor:
    """fp32 or bf16 ``[N, 512]`` -> pages (see ``reference.encode_pages``), into ``out`` when given."""
    group = (x,) if out is None else (x, out)
    return backend(group, layout).encode_pages(x, layout, page_size, dialect, scale, out=out)


def encode_pages_nonfinite(x: torch.Tensor, layout: Layout, page_size: int, dialect: str | None, scale: float,
                           *, out: torch.Tensor | None = None) -> torch.Tensor:
    """``encode_pages`` of latents holding NaN/Inf (``nonfinite="propagate"``): always the reference codec,
    whose NaN/Inf tiles follow the dialect's writer; the numba and Triton kernels are never given them."""
    return reference.encode_pages(x, layout, page_size, dialect, scale, out=out, propagate=True)


def decode_pages(pages: torch.Tensor, layout: Layout, page_size: int, num_tokens: int | None,
                 scale: float, *, out: torch.Tensor | None = None) -> torch.Tensor:
    """Pages -> fp32 ``[num_tokens, 512]`` (see ``reference.decode_pages``), into ``out`` when given."""
    group = (pages,) if out is None else (pages, out)
    return backend(group, layout).decode_pages(pages, layout, page_size, num_tokens, scale, out=out)


def amax_pages(pages: torch.Tensor, layout: Layout, page_size: int, num_tokens: int | None,
               scale: float) -> float | None:
    """Largest |decoded value| of the first ``num_tokens`` tokens (0.0 for none), or None when a value
    decodes to NaN/Inf (the caller decodes to name it)."""
    return backend(pages, layout).amax_pages(pages, layout, page_size, num_tokens, scale)


def move_spans(moves: Sequence[SpanMove], into_pool: bool = False) -> None:
    """Copy row segments between contiguous tensors, all on one device, in one call (see ``reference.move_spans``:
    a backend may spread the moves over its threads; ``into_pool``: the destinations are pool pages)."""
    if moves:
        backend(tuple(t for m in moves for t in m[:2])).move_spans(moves, into_pool)


def xxh3_chunks(data: np.ndarray | memoryview | torch.Tensor, spans: np.ndarray) -> list[int]:
    """XXH3-64 (seed 0) of each chunk ``[start, stop)`` (the rows of int64 ``spans [n, 2]``) of the bytes ``data``
    (host bytes, or a flat contiguous uint8 tensor): on the CPU in one native call (``native.xxh3_chunks``), on a
    CUDA tensor in one Triton launch where the bytes are (``triton_digest``; without Triton, of a host copy)."""
    if isinstance(data, torch.Tensor):
        if data.device.type != "cpu":
            try:
                from kvbridge.backends import triton_digest  # optional dependency: triton
            except ImportError:
                data = data.cpu()
            else:
                return triton_digest.xxh3_chunks(data, spans)
        data = memoryview(data.contiguous().view(-1).numpy())
    return _device_backend(torch.device("cpu")).xxh3_chunks(data, spans)  # type: ignore[union-attr]


def repage(pages: torch.Tensor, src: Layout, src_page_size: int, dst: Layout, dst_page_size: int,
           num_tokens: int | None, *, out: torch.Tensor | None = None) -> torch.Tensor:
    """Byte move of identical records between page geometries (see ``reference.repage``), into ``out`` when given."""
    group = (pages,) if out is None else (pages, out)
    return backend(group, src, dst).repage(pages, src, src_page_size, dst, dst_page_size, num_tokens, out=out)


def transcode_pages(
    pages: torch.Tensor, src: Layout, src_page_size: int, dst: Layout, dst_page_size: int,
    num_tokens: int | None, src_scale: float, dst_scale: float, dialect: str | None,
    *, out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Decode + re-encode pages (see ``reference.transcode_pages``); NaN/Inf in the source raises."""
    group = (pages,) if out is None else (pages, out)
    return backend(group, src, dst).transcode_pages(
        pages, src, src_page_size, dst, dst_page_size, num_tokens, src_scale, dst_scale, dialect, out=out
    )


def transcode_slots_nonfinite(
    src_pages: torch.Tensor, src: Layout, src_page_size: int, dst_pages: torch.Tensor, dst: Layout,
    dst_page_size: int, src_slots: torch.Tensor, dst_slots: torch.Tensor, src_scale: float, dst_scale: float,
    dialect: str | None,
) -> None:
    """``transcode_slots`` of source tokens that decode to NaN/Inf (``nonfinite="propagate"``): always the
    reference codec, as ``encode_pages_nonfinite``."""
    reference.transcode_slots(src_pages, src, src_page_size, dst_pages, dst, dst_page_size, src_slots, dst_slots,
                              src_scale, dst_scale, dialect, False, propagate=True)


def nonfinite_flags(pages: torch.Tensor, layout: Layout, page_size: int, slots: torch.Tensor,
                    scale: float) -> torch.Tensor:
    """Per-slot flags (``reference.FLAG_NONFINITE`` or 0) of the decoded tokens at in-range ``slots``."""
    return backend(pages, layout).nonfinite_flags(pages, layout, page_size, slots, scale)


def transcode_slots(
    src_pages: torch.Tensor, src: Layout, src_page_size: int, dst_pages: torch.Tensor, dst: Layout,
    dst_page_size: int, src_slots: torch.Tensor, dst_slots: torch.Tensor, src_scale: float, dst_scale: float,
    dialect: str | None, byte_move: bool,
) -> None:
    """Source slot ``src_slots[i]`` -> ``dst_slots[i]`` in place (see ``reference.transcode_slots``)."""
    backend((src_pages, dst_pages), src, dst).transcode_slots(
        src_pages, src, src_page_size, dst_pages, dst, dst_page_size, src_slots, dst_slots, src_scale, dst_scale,
        dialect, byte_move,
    )


def gather_transcode(
    pool: torch.Tensor, layout: Layout, page_size: int, indices: torch.Tensor, scale: float,
    dialect: str | None, byte_move: bool, out_page_size: int, scratch_layout: Layout,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Flat ``indices`` -> a fresh ``scratch_layout`` cache and per-index flags (see ``reference.gather_transcode``)."""
    return backend(pool, layout, scratch_layout).gather_transcode(
        pool, layout, page_size, indices, scale, dialect, byte_move, out_page_size, scratch_layout
    )


def loss_stats(
    src_pages: torch.Tensor, src: Layout, src_page_size: int, dst_pages: torch.Tensor, dst: Layout,
    dst_page_size: int, num_tokens: int, src_scale: float, dst_scale: float, mult: float | None,
) -> LossStats:
    """Loss statistics of the first ``num_tokens`` tokens of ``dst_pages`` against ``src_pages`` (both
    finite; ``mult``: the destination's per-tensor E4M3 multiplier, None for per-tile scales)."""
    return backend((src_pages, dst_pages), src, dst).loss_stats(
        src_pages, src, src_page_size, dst_pages, dst, dst_page_size, num_tokens, src_scale, dst_scale, mult
    )


def _backend_on(device: torch.device) -> ModuleType:
    """The backend that serves tensors on ``device`` (every backend accepts every tensor of its device)."""
    return reference if _forced_reference() else (_device_backend(device) or reference)


def key_kernels(device: torch.device) -> bool:
    """Whether the backend for tensors on ``device`` converts fp4 indexer keys to fp8 itself
    (``fp4_to_fp8_keys``, ``fp4_to_fp8_key_rows``, ``fp4_to_fp8_key_segments``); elsewhere
    ``kvbridge.ops.keys`` runs its torch codec."""
    return _backend_on(device).KEY_KERNELS


def fp4_to_fp8_keys(records: torch.Tensor, dim: int, rule: str, *, measure: bool = True,
                    out: torch.Tensor | None = None) -> tuple[torch.Tensor, float] | None:
    """fp4 indexer records ``[N, dim / 2 + dim / 32]`` -> fp8 records ``[N, dim + 4]`` (into ``out`` when given)
    written by fp8 ``rule``, and the max |decoded fp8 - decoded fp4| (0.0 unless ``measure``), by the backend's
    kernel (``key_kernels(records.device)`` must hold); None when a value decodes to NaN/Inf (the torch codec then
    refuses the keys)."""
    return backend(records if out is None else (records, out)).fp4_to_fp8_keys(records, dim, rule, measure=measure,
                                                                               out=out)


def fp4_to_fp8_key_rows(src_keys: torch.Tensor, src_stride: int, src_scales: torch.Tensor, src_scale_stride: int,
                        n: int, dst_keys: torch.Tensor, dst_stride: int, dst_scales: torch.Tensor,
                        dst_scale_stride: int, dim: int, rule: str, *, measure: bool) -> float | None:
    """``n`` fp4 keys -> fp8 keys by ``rule`` between strided rows of flat uint8 tensors (key ``k``'s codes at
    ``keys[k * stride]``, its scale bytes at ``scales[k * scale_stride]``: records or a page's two parts), by the
    backend's kernel (``key_kernels(src_keys.device)`` must hold); the max abs error (0.0 unless ``measure``),
    None when a value decodes to NaN/Inf."""
    return backend((src_keys, dst_keys)).fp4_to_fp8_key_rows(
        src_keys, src_stride, src_scales, src_scale_stride, n, dst_keys, dst_stride, dst_scales, dst_scale_stride, dim,
        rule, measure=measure,
    )


def fp4_to_fp8_key_segments(src_keys: torch.Tensor, src_scales: torch.Tensor, dst_keys: torch.Tensor,
                            dst_scales: torch.Tensor, segs: np.ndarray, strides: tuple[int, int, int, int], dim: int,
                            rule: str, *, measure: bool) -> float | None:
    """fp4 keys -> fp8 keys by ``rule`` between strided rows of four flat uint8 tensors (fp4 codes, fp4 scales,
    fp8 codes, fp8 scales: records, page parts or whole pools), segment by segment: ``segs`` int64 ``[S, 5]`` holds
    the byte offsets of a segment's first key in each tensor and its key count, ``strides`` the four row strides.
    By the backend's kernel (``key_kernels(src_keys.device)`` must hold); the max abs error (0.0 unless
    ``measure``), None when a value decodes to NaN/Inf."""
    return backend((src_keys, dst_keys)).fp4_to_fp8_key_segments(
        src_keys, src_scales, dst_keys, dst_scales, segs, strides, dim, rule, measure=measure)


def kv_segment_split(src: Layout, dst: Layout, device: torch.device) -> tuple[int, int] | None:
    """Where the backend for tensors on ``device`` converts ``src`` KV records to ``dst`` straight between record rows
    of any tensors (``transcode_kv_segments``: a migration's source pages or records into its destination pages, no
    staging), the bytes of a source and of a destination record in their data stream (the rest of a record is its
    footer stream); None where it does not (the records then convert in staged pages, ``transcode_pages``)."""
    chosen = _backend_on(device)
    return chosen.kv_segment_split(src, dst) if chosen.KV_SEGMENT_KERNELS else None


def transcode_kv_segments(streams: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], segs: np.ndarray,
                          strides: tuple[int, int, int, int], src: Layout, dst: Layout, *, src_scale: float,
                          dst_scale: float, dialect: str | None, into_pool: bool) -> None:
    """``src`` KV records -> ``dst`` records between rows of four flat uint8 tensors (source data, source footer,
    destination data, destination footer: pool parts or records; a token-major side passes one tensor twice, its
    footer offsets ``kv_segment_split``'s data bytes further), segment by segment: ``segs`` int64 ``[S, 6]`` holds
    the four byte offsets of a segment's first row, its rows and its first record's index (what a NaN/Inf is reported
    at); ``strides`` the four row strides. Bytes identical to ``transcode_pages`` of the same records; a segment
    outside its tensors is refused before any byte is written (``InputError``), NaN/Inf in the source raises
    ``NonFiniteError`` (destination rows then partly written). ``into_pool``: the destination is pool pages (not
    read again soon: streamed past the caches where the backend can). ``kv_segment_split`` must hold."""
    backend((streams[0], streams[2])).transcode_kv_segments(streams, segs, strides, src, dst, src_scale, dst_scale,
                                                            dialect, into_pool)


def state_kernels(device: torch.device) -> bool:
    """Whether the backend for tensors on ``device`` converts compressor-state rows itself
    (``convert_state_rows``); elsewhere migration runs the torch rules (``migration.ape``)."""
    return _backend_on(device).STATE_KERNELS


def convert_state_rows(records: torch.Tensor, src_bf16: bool, dst_bf16: bool, ape: torch.Tensor | None, sign: int,
                       first: int, measure: bool):
    """State rows uint8 ``[n, row_bytes]`` -> rows in the destination dtype, APE ``[r, w / 2]`` added (``sign`` +1)
    or removed (-1) for positions ``first, ...``, in one pass by the backend's kernel (``state_kernels(records.device)``
    must hold); returns its ``StateResult`` (``kvbridge.backends.native.state``: rows, error, what it refused)."""
    return backend(records).convert_state_rows(records, src_bf16, dst_bf16, ape, sign, first, measure)
