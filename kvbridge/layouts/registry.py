"""The layout registry: each KV layout is one declarative description, read by every backend.

A layout stores each token's 512 latent values as a fixed-size *record* (``record_bytes``)
whose fields (``Field``) sit at fixed byte offsets. A value field says which latent dims it
holds, its element format and, when quantized per tile, the tile size and the scale field
holding one scale per tile. The scale rule of each tile format is chosen by the layout's
*dialect* (``numerics``). Each format is one entry of the format table (``layouts.formats``);
``Layout.segments`` compiles the fields through it into a small table of ints (``Segment``)
that the torch reference, the numba kernels and the Triton kernels all execute, so a new layout
made of existing element formats runs on every backend with no new code.

A value field marked ``mirror`` stores dims that another field (their *first copy*, a bf16 field)
already stores, a second time in its own format (vLLM ``nvfp4_ds_mla``: the rope dims in bf16 and
again as E2M1 tiles). A layout therefore compiles two programs: ``segments``, what the encoders
execute (every field; an ``OP_ROUND_BF16`` row first rounds the mirrored dims to bf16, so the second
copy is encoded from the values the first copy stores), and ``read_segments``, what the decoders
execute (mirrors left out: each dim read from its first copy, the exact one). ``ops.pages.
check_copies`` refuses records whose two copies disagree.

Records are placed in pages of ``P`` tokens by one ``PageGeometry`` (also used by migration
pools and the indexer-key formats):

- token-major (``split is None``; the V4.1 "interleaved" layouts): record t at ``t * record_bytes``;
- block-split at byte ``split``: bytes ``[0, split)`` of record t at ``t * split`` (the data
  rows), bytes ``[split, record_bytes)`` at ``P * split + t * (record_bytes - split)`` (the footer);

and each page is padded with zeros to a multiple of ``page_align`` bytes.
Adding a layout is one module that builds a ``Layout`` and calls ``register``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property
from typing import NamedTuple

import torch

from kvbridge.errors import LayoutError
from kvbridge.layouts.formats import (  # the ops are defined beside the format table; re-exported for the backends
    NVFP4_OPS,
    OP_BF16,  # noqa: F401
    OP_E2M1_E4M3,  # noqa: F401
    OP_E2M1_NVFP4,  # noqa: F401
    OP_E2M1_NVFP4Z,  # noqa: F401
    OP_E2M1_UE8M0,  # noqa: F401
    OP_E4M3_TENSOR,  # noqa: F401
    OP_E4M3_UE8M0,  # noqa: F401
    OP_E4M3FNUZ_UE8M0,  # noqa: F401
    OP_ROUND_BF16,
    OP_ZERO,
    PER_TENSOR_OPS,
    all_formats,
    get_format,
)

HEAD_DIM = 512

class Segment(NamedTuple):
    """One field as the backends execute it (all ints).

    Dims ``[dim0, dim0 + ndims)`` are stored at record byte ``offset``; quantized ops use tiles of
    ``tile`` dims whose scales are at record byte ``scale_offset`` (one byte per tile). For
    ``OP_ZERO``, ``ndims`` is the number of zero bytes at ``offset``.
    """

    op: int
    dim0: int
    ndims: int
    offset: int
    tile: int
    scale_offset: int


#: Largest tokens per page accepted anywhere (engines use 2..256; a page must fit in memory).
MAX_PAGE_SIZE = 2**20


@dataclass(frozen=True)
class Field:
    """One field of a token record: ``nbytes`` bytes at byte ``offset`` of the record.

    ``format`` names an entry of the format table (``layouts.formats``). Value fields (``e4m3``,
    ``e2m1``, ``bf16``) give ``dims`` (latent dims ``[start, stop)``); quantized ones give ``tile``
    (values per scale) and ``scale`` (the name of the scale field, ``ue8m0`` or ``e4m3-scale``, one
    byte per tile). An ``e4m3`` field without a scale field uses the layout's per-tensor scale.
    ``mirror``: the field's dims are stored by another field too (a bf16 field, their first copy); the
    encoders write this second copy from the first copy's values, the decoders read the first copy.
    """

    name: str
    offset: int
    nbytes: int
    format: str  # a name in the format table (``layouts.formats``)
    dims: tuple[int, int] | None = None
    tile: int | None = None
    scale: str | None = None
    mirror: bool = False


class Programs(NamedTuple):
    """A layout's compiled record: what the encoders execute and what the decoders execute."""

    encode: tuple[Segment, ...]
    read: tuple[Segment, ...]


class PageGeometry(NamedTuple):
    """Where each byte of each record lies in a page (see the module docstring)."""

    record_bytes: int
    split: int | None = None
    page_align: int = 1

    @property
    def data_bytes(self) -> int:
        """Bytes of a record in its data row (all of it when token-major)."""
        return self.record_bytes if self.split is None else self.split

    def page_bytes(self, page_size: int) -> int:
        """Bytes per page of ``page_size`` records, padding included."""
        raw = page_size * self.record_bytes
        return -(-raw // self.page_align) * self.page_align

    def byte_offset(self, record_byte: int, row: int, page_size: int) -> int:
        """Offset inside its page of byte ``record_byte`` of the record at ``row``."""
        s = self.data_bytes
        if record_byte < s:
            return row * s + record_byte
        return page_size * s + row * (self.record_bytes - s) + (record_byte - s)

    def byte_index(self, page_size: int, slots: torch.Tensor) -> torch.Tensor:
        """Flat byte offsets ``[N, record_bytes]`` (int64) of each slot's record in ``pages.view(-1)``;
        slot ``s`` is page ``s // P``, row ``s % P``."""
        s = slots.to(torch.int64).unsqueeze(1)
        page, row = s // page_size, s % page_size
        j = torch.arange(self.record_bytes, dtype=torch.int64, device=slots.device).unsqueeze(0)
        base = page * self.page_bytes(page_size)
        d = self.data_bytes
        return torch.where(j < d, base + row * d + j, base + page_size * d + row * (self.record_bytes - d) + (j - d))

    def part_bounds(self) -> list[tuple[int, int]]:
        """Record byte ranges ``[lo, hi)`` of the page parts, in page order: ``[(0, record_bytes)]`` token-major,
        ``[(0, split), (split, record_bytes)]`` block-split (part ``[lo, hi)`` starts at byte ``P * lo`` of a page)."""
        d = self.data_bytes
        return [(0, d)] if d == self.record_bytes else [(0, d), (d, self.record_bytes)]

    def page_views(self, pages: torch.Tensor, page_size: int) -> list[tuple[torch.Tensor, int, int]]:
        """Views ``[num_pages, P, width]`` of uint8 ``pages`` with the record byte range ``[lo, hi)`` each holds."""
        n, p = pages.shape[0], page_size
        return [(pages[:, p * lo : p * hi].view(n, p, hi - lo), lo, hi) for lo, hi in self.part_bounds()]

    def records_to_pages(self, records: torch.Tensor, page_size: int) -> torch.Tensor:
        """Records ``[N, record_bytes]`` uint8 -> pages ``[ceil(N/P), page_bytes]``; rows past N and tails are 0."""
        n = records.shape[0]
        npages = -(-n // page_size)
        pages = torch.zeros(npages, self.page_bytes(page_size), dtype=torch.uint8, device=records.device)
        padded = records
        if npages * page_size != n:
            padded = torch.zeros(npages * page_size, self.record_bytes, dtype=torch.uint8, device=records.device)
            padded[:n] = records
        for view, lo, hi in self.page_views(pages, page_size):
            view.copy_(padded[:, lo:hi].reshape(npages, page_size, hi - lo))
        return pages

    def pages_to_records(self, pages: torch.Tensor, page_size: int, num_tokens: int) -> torch.Tensor:
        """Pages -> the first ``num_tokens`` records ``[num_tokens, record_bytes]`` (a copy)."""
        cap = pages.shape[0] * page_size
        parts = [view.reshape(cap, hi - lo)[:num_tokens] for view, lo, hi in self.page_views(pages, page_size)]
        return torch.cat(parts, dim=1) if len(parts) > 1 else parts[0].clone()


def compile_segments(name: str, record_bytes: int, fields: tuple[Field, ...], split: int | None,
                     per_tensor_scale: bool) -> Programs:
    """Check a record description and compile it into ``Segment`` rows (the encode and the read program, see the
    module docstring); ``LayoutError`` names what is wrong."""

    def bad(msg: str) -> LayoutError:
        return LayoutError(f"layout {name}: {msg}")

    by_name = {f.name: f for f in fields}
    if len(by_name) != len(fields):
        raise bad("field names must be distinct")
    covered = torch.zeros(record_bytes, dtype=torch.int64)
    dims = torch.zeros(HEAD_DIM, dtype=torch.int64)
    mirrored = torch.zeros(HEAD_DIM, dtype=torch.int64)
    bf16_dims = torch.zeros(HEAD_DIM, dtype=torch.bool)  # dims whose first copy is a bf16 field
    segments = []
    mirrors: list[Segment] = []
    for f in fields:
        try:
            fmt = get_format(f.format)
        except LayoutError:
            known = ", ".join(x.name for x in all_formats())
            raise bad(f"field {f.name}: unknown format {f.format!r:.40}; known: {known}") from None
        if f.offset < 0 or f.nbytes < 1 or f.offset + f.nbytes > record_bytes:
            raise bad(f"field {f.name} [{f.offset}, {f.offset + f.nbytes}) is outside the {record_bytes}-byte record")
        if split is not None and f.offset < split < f.offset + f.nbytes:
            raise bad(f"field {f.name} straddles the block-split point {split}")
        covered[f.offset : f.offset + f.nbytes] += 1
        if f.mirror and fmt.kind != "value":
            raise bad(f"field {f.name}: only a value field can be a mirror (a second copy of dims)")
        if fmt.kind == "pad":
            segments.append(Segment(OP_ZERO, 0, f.nbytes, f.offset, 0, 0))
            continue
        if fmt.kind == "scale":
            continue
        if f.dims is None:
            raise bad(f"value field {f.name} needs dims")
        d0, d1 = f.dims
        if not 0 <= d0 < d1 <= HEAD_DIM:
            raise bad(f"field {f.name}: dims {f.dims} outside [0, {HEAD_DIM})")
        (mirrored if f.mirror else dims)[d0:d1] += 1
        n = d1 - d0
        per_byte = 8 // fmt.bits if fmt.bits < 8 else 0  # elements packed per byte (sub-byte formats)
        want = n // per_byte if per_byte else n * fmt.bits // 8
        if f.nbytes != want or (per_byte and (n % per_byte or d0 % per_byte)) or (fmt.bits > 8 and fmt.bits % 8):
            raise bad(f"field {f.name}: {n} {f.format} values need {want} bytes (whole bytes per element "
                      f"group, aligned dims), got {f.nbytes}")
        sf = None if f.scale is None else by_name.get(f.scale)
        op = fmt.op(None if sf is None else sf.format)
        if f.scale is None and (op is None or (op in PER_TENSOR_OPS and not per_tensor_scale)):
            if op is None:
                raise bad(f"field {f.name}: a {f.format} field needs a scale field "
                          f"({' or '.join(map(str, fmt.scale_formats()))})")
            raise bad(f"field {f.name}: an unscaled {f.format} field needs a per-tensor layout")
        if op == OP_BF16 and not f.mirror:
            bf16_dims[d0:d1] = True
        if f.scale is None:
            (mirrors if f.mirror else segments).append(Segment(op, d0, n, f.offset, 0, 0))
            continue
        if op is None:
            need = " or ".join(s for s in fmt.scale_formats() if s is not None) or "none (it takes no scale)"
            raise bad(f"field {f.name}: scale field {f.scale!r} must exist and be {need}")
        tile = f.tile or 0
        if tile < 1 or tile & (tile - 1) or n % tile or d0 % tile or tile < max(1, per_byte):
            raise bad(f"field {f.name}: tile {f.tile} must be a power of two dividing its dims (and their start)")
        if sf.nbytes != n // tile:
            raise bad(f"scale field {sf.name} must hold {n // tile} bytes (one per tile of {f.name}), has {sf.nbytes}")
        (mirrors if f.mirror else segments).append(Segment(op, d0, n, f.offset, tile, sf.offset))
    if bool((dims != 1).any()):
        d = int((dims != 1).nonzero()[0])
        raise bad(f"latent dim {d} is stored {int(dims[d])} times; every dim 0..511 must be stored exactly once "
                  "(a second copy is a field marked mirror)")
    if bool((mirrored > 1).any()):
        raise bad(f"latent dim {int((mirrored > 1).nonzero()[0])} is mirrored by more than one field")
    if bool((mirrored.bool() & ~bf16_dims).any()):
        d = int((mirrored.bool() & ~bf16_dims).nonzero()[0])
        raise bad(f"latent dim {d} is mirrored, but its first copy is not a bf16 field (a mirror is encoded from "
                  "the bf16 values its first copy stores)")
    if bool((covered > 1).any()):
        raise bad(f"fields overlap at record byte {int((covered > 1).nonzero()[0])}")
    if bool((covered == 0).any()):
        raise bad(f"record byte {int((covered == 0).nonzero()[0])} belongs to no field (declare it as pad)")
    rounds = [Segment(OP_ROUND_BF16, m.dim0, m.ndims, 0, 0, 0) for m in mirrors]
    return Programs(tuple(rounds + segments + mirrors), tuple(segments))


@dataclass(frozen=True)
class Layout:
    """A KV layout: the token record's fields, its page geometry and its encoder dialects.

    ``dialects``: the encoder scale rules this layout accepts (first = default): ``flashmla``,
    ``amax-1e-4``, ``amax-1e-8`` for UE8M0-scaled tiles, ``swa`` / ``compress`` for per-tensor
    E4M3; a layout of fixed rules (bf16, the fp4 record) has none.
    """

    name: str
    description: str
    record_bytes: int
    fields: tuple[Field, ...]
    split: int | None = None
    page_align: int = 1
    aliases: tuple[str, ...] = ()
    dialects: tuple[str, ...] = ()
    per_tensor_scale: bool = False
    lossless_from: tuple[str, ...] = field(default=())  # input dtypes stored exactly
    source: str = ""
    #: Said in every loss report of a transcode into this layout (how coarse it is, what it quantizes).
    loss_note: str = ""
    #: Non-empty for a layout no engine release writes yet: the open pull requests (or unreleased
    #: writer) it comes from. ``kvbridge layouts`` lists such layouts apart.
    experimental: str = ""

    def __post_init__(self) -> None:
        if self.split is not None and not 0 < self.split < self.record_bytes:
            raise LayoutError(f"layout {self.name}: split {self.split} is not inside the {self.record_bytes} B record")
        if self.page_align < 1:
            raise LayoutError(f"layout {self.name}: page_align must be >= 1")
        self.programs  # noqa: B018 - validates the description at construction

    @cached_property
    def programs(self) -> Programs:
        return compile_segments(self.name, self.record_bytes, self.fields, self.split, self.per_tensor_scale)

    @property
    def segments(self) -> tuple[Segment, ...]:
        """The record compiled for the encoders (see ``Segment``): every field, mirrors included."""
        return self.programs.encode

    @property
    def read_segments(self) -> tuple[Segment, ...]:
        """The record compiled for the decoders: each dim from its first copy (mirrors left out)."""
        return self.programs.read

    @property
    def mirrors(self) -> tuple[Segment, ...]:
        """The mirror fields' segments (second copies of dims; empty for most layouts)."""
        return tuple(s for s in self.segments if s not in self.read_segments and s.op != OP_ROUND_BF16)

    @property
    def geometry(self) -> PageGeometry:
        return PageGeometry(self.record_bytes, self.split, self.page_align)

    @property
    def block_split(self) -> bool:
        return self.split is not None

    @property
    def placement(self) -> str:
        return "token-major" if self.split is None else f"block-split at {self.split}"

    @property
    def nvfp4_global_scale(self) -> bool:
        """Whether the records hold NVFP4 tiles, whose E4M3 tile scales are relative to a per-tensor fp32
        global scale g kept outside the cache (passed as ``scale=`` / ``src_scale=`` / ``dst_scale=``)."""
        return any(seg.op in NVFP4_OPS for seg in self.segments)

    @property
    def takes_scale(self) -> bool:
        """Whether the layout's values depend on one fp32 scale outside the cache: the per-tensor E4M3 scale
        (``per_tensor_scale``) or NVFP4's global scale (``nvfp4_global_scale``)."""
        return self.per_tensor_scale or self.nvfp4_global_scale

    @property
    def default_dialect(self) -> str | None:
        return self.dialects[0] if self.dialects else None

    def same_record(self, other: Layout) -> bool:
        """True when both layouts store identical token records (only their page geometry may differ)."""
        return self.record_bytes == other.record_bytes and self.segments == other.segments

    def check_page_size(self, page_size: int) -> int:
        if isinstance(page_size, bool) or not isinstance(page_size, int) or not 1 <= page_size <= MAX_PAGE_SIZE:
            raise LayoutError(f"page_size must be a positive integer (at most {MAX_PAGE_SIZE}), got {page_size!r:.40}")
        return page_size

    def page_bytes(self, page_size: int) -> int:
        """Bytes per page of ``page_size`` tokens, padding included."""
        return self.geometry.page_bytes(self.check_page_size(page_size))

    def field(self, name: str) -> Field:
        for f in self.fields:
            if f.name == name:
                return f
        raise LayoutError(f"layout {self.name} has no field {name!r}")

    def field_offset(self, name: str, row: int, page_size: int) -> int:
        """Byte offset, inside its page, of field ``name`` of the token at ``row``."""
        f = self.field(name)
        if not 0 <= row < page_size:
            raise LayoutError(f"row {row} outside page of {page_size} tokens")
        return self.geometry.byte_offset(f.offset, row, page_size)

    def num_pages(self, num_tokens: int, page_size: int) -> int:
        return -(-num_tokens // page_size)

    def records_to_pages(self, records: torch.Tensor, page_size: int) -> torch.Tensor:
        """Token records ``[N, record_bytes]`` uint8 -> pages ``[ceil(N/P), page_bytes]``.

        Rows past N in the last page and the page tail are zero.
        """
        return self.geometry.records_to_pages(records, self.check_page_size(page_size))

    def token_count(self, pages: torch.Tensor, page_size: int, num_tokens: int | None) -> int:
        """Validated token count of ``pages``: ``num_tokens``, or every row when it is None."""
        self.check_pages(pages, page_size)
        cap = pages.shape[0] * page_size
        n = cap if num_tokens is None else num_tokens
        if not 0 <= n <= cap:
            raise LayoutError(f"num_tokens={n} does not fit in {pages.shape[0]} pages of {page_size} tokens")
        return n

    def pages_to_records(self, pages: torch.Tensor, page_size: int, num_tokens: int | None = None) -> torch.Tensor:
        """Pages ``[num_pages, page_bytes]`` uint8 -> token records ``[num_tokens, record_bytes]``."""
        n = self.token_count(pages, page_size, num_tokens)
        return self.geometry.pages_to_records(pages, page_size, n)

    def check_pages(self, pages: torch.Tensor, page_size: int) -> None:
        """Raise ``LayoutError`` unless ``pages`` is uint8 ``[num_pages, page_bytes(page_size)]``."""
        if not isinstance(pages, torch.Tensor):
            raise LayoutError(f"pages must be a torch.Tensor, got {type(pages).__name__}")
        if pages.dtype != torch.uint8:
            raise LayoutError(f"pages must be uint8, got {pages.dtype}")
        check_device(pages, "pages")
        want = self.page_bytes(page_size)
        if pages.dim() != 2 or pages.shape[1] != want:
            raise LayoutError(
                f"{self.name} pages of {page_size} tokens must have shape [num_pages, {want}], "
                f"got {list(pages.shape)}"
            )


#: Devices kvbridge encodes, decodes and transcodes on (meta tensors hold no bytes to convert).
DEVICES = ("cpu", "cuda")


def check_device(tensor: torch.Tensor, name: str) -> None:
    """Raise ``LayoutError`` unless ``tensor`` lives on a device kvbridge converts on (``DEVICES``)."""
    if tensor.device.type not in DEVICES:
        raise LayoutError(f"{name} are on {tensor.device}, which kvbridge does not convert on; move them to "
                          f"{' or '.join(DEVICES)} first")


_REGISTRY: dict[str, Layout] = {}
_ALIASES: dict[str, str] = {}


def register(layout: Layout) -> Layout:
    """Add a layout (and its aliases) to the registry."""
    for key in (layout.name, *layout.aliases):
        if key in _REGISTRY or key in _ALIASES:
            raise LayoutError(f"layout name {key!r} is already registered")
    _REGISTRY[layout.name] = layout
    for alias in layout.aliases:
        _ALIASES[alias] = layout.name
    return layout


def get_layout(name: str | Layout) -> Layout:
    """Look a layout up by name or alias (a ``Layout`` is returned as is)."""
    if isinstance(name, Layout):
        return name
    if not isinstance(name, str):
        raise LayoutError(f"layout must be a layout name or a Layout, got {type(name).__name__} {name!r:.60}")
    key = _ALIASES.get(name, name)
    try:
        return _REGISTRY[key]
    except KeyError:
        known = ", ".join(sorted([*_REGISTRY, *_ALIASES]))
        raise LayoutError(f"unknown layout {name!r}; known: {known}") from None


def all_layouts() -> list[Layout]:
    return list(_REGISTRY.values())
