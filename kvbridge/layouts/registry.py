"""The layout registry: each KV layout is declarative data.

A layout stores each token as a fixed-size *record* (``record_bytes``) whose fields
(``Field``) sit at fixed offsets. Pages of ``P`` tokens place records either

- token-major (``split is None``): record t at byte ``t * record_bytes``, or
- block-split: bytes ``[0, split)`` of record t at ``t * split`` (the data rows), then
  bytes ``[split, record_bytes)`` at ``P * split + t * (record_bytes - split)`` (the footer);

and the page is padded with zeros to a multiple of ``page_align`` bytes.
Adding a layout is one module that builds a ``Layout`` and calls ``register``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from kvbridge.errors import LayoutError

if TYPE_CHECKING:
    from kvbridge.codecs import RecordCodec


#: Largest tokens per page accepted anywhere (engines use 2..256; a page must fit in memory).
MAX_PAGE_SIZE = 2**20


@dataclass(frozen=True)
class Field:
    """One field of a token record: ``nbytes`` bytes at byte ``offset`` of the record."""

    name: str
    offset: int
    nbytes: int
    format: str  # "e4m3", "bf16", "ue8m0", "pad"
    dims: tuple[int, int] | None = None  # latent dims [start, stop) the field holds


@dataclass(frozen=True)
class Layout:
    """A KV layout: token record, page placement and the codec that fills records."""

    name: str
    description: str
    record_bytes: int
    fields: tuple[Field, ...]
    codec: RecordCodec
    split: int | None = None
    page_align: int = 1
    aliases: tuple[str, ...] = ()
    dialects: tuple[str, ...] = ()
    per_tensor_scale: bool = False
    lossless_from: tuple[str, ...] = field(default=())  # input dtypes stored exactly
    source: str = ""

    @property
    def block_split(self) -> bool:
        return self.split is not None

    @property
    def default_dialect(self) -> str | None:
        return self.dialects[0] if self.dialects else None

    def check_page_size(self, page_size: int) -> int:
        if isinstance(page_size, bool) or not isinstance(page_size, int) or not 1 <= page_size <= MAX_PAGE_SIZE:
            raise LayoutError(f"page_size must be a positive integer (at most {MAX_PAGE_SIZE}), got {page_size!r:.40}")
        return page_size

    def page_bytes(self, page_size: int) -> int:
        """Bytes per page of ``page_size`` tokens, padding included."""
        raw = self.check_page_size(page_size) * self.record_bytes
        return -(-raw // self.page_align) * self.page_align

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
        if self.split is None:
            return row * self.record_bytes + f.offset
        if f.offset < self.split:
            return row * self.split + f.offset
        footer = self.record_bytes - self.split
        return page_size * self.split + row * footer + (f.offset - self.split)

    def num_pages(self, num_tokens: int, page_size: int) -> int:
        return -(-num_tokens // page_size)

    def records_to_pages(self, records: torch.Tensor, page_size: int) -> torch.Tensor:
        """Token records ``[N, record_bytes]`` uint8 -> pages ``[ceil(N/P), page_bytes]``.

        Rows past N in the last page and the page tail are zero.
        """
        n = records.shape[0]
        npages = self.num_pages(n, page_size)
        pages = torch.zeros(npages, self.page_bytes(page_size), dtype=torch.uint8, device=records.device)
        padded = records
        if npages * page_size != n:
            padded = torch.zeros(npages * page_size, self.record_bytes, dtype=torch.uint8, device=records.device)
            padded[:n] = records
        padded = padded.view(npages, page_size, self.record_bytes)
        if self.split is None:
            pages[:, : page_size * self.record_bytes] = padded.reshape(npages, page_size * self.record_bytes)
        else:
            s, p = self.split, page_size
            pages[:, : p * s] = padded[:, :, :s].reshape(npages, p * s)
            pages[:, p * s : p * self.record_bytes] = padded[:, :, s:].reshape(npages, p * (self.record_bytes - s))
        return pages

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
        npages = pages.shape[0]
        cap = npages * page_size
        p = page_size
        if self.split is None:
            rec = pages[:, : p * self.record_bytes].reshape(cap, self.record_bytes)
        else:
            s = self.split
            data = pages[:, : p * s].reshape(npages, p, s)
            foot = pages[:, p * s : p * self.record_bytes].reshape(npages, p, self.record_bytes - s)
            rec = torch.cat([data, foot], dim=-1).reshape(cap, self.record_bytes)
        return rec[:n]

    def check_pages(self, pages: torch.Tensor, page_size: int) -> None:
        """Raise ``LayoutError`` unless ``pages`` is uint8 ``[num_pages, page_bytes(page_size)]``."""
        if not isinstance(pages, torch.Tensor):
            raise LayoutError(f"pages must be a torch.Tensor, got {type(pages).__name__}")
        if pages.dtype != torch.uint8:
            raise LayoutError(f"pages must be uint8, got {pages.dtype}")
        want = self.page_bytes(page_size)
        if pages.dim() != 2 or pages.shape[1] != want:
            raise LayoutError(
                f"{self.name} pages of {page_size} tokens must have shape [num_pages, {want}], "
                f"got {list(pages.shape)}"
            )


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
