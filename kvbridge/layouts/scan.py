"""Byte-level scan for non-finite codes in stored pages, driven by the layout's fields and the format table.

A byte move (re-paging, ``flashmla-model1`` <-> ``trtllm-fp8-ds-mla``) never decodes, so a NaN
in the source would pass through unseen; this scan reads the stored codes instead. Which codes
are non-finite is each format's ``nonfinite`` rule in the format table (``layouts.formats``):
E4M3 values and E4M3 scale bytes ``0x7F`` / ``0xFF``, UE8M0 ``0xFF``, bf16 words with all
exponent bits set (NaN or +-Inf); formats without non-finite codes (E2M1, pad) have none.

Each field of the token record is located in the page the way ``Layout.field_offset`` does
(token-major, or block-split data rows then footer). ``scan_pages`` counts every bad code of
the first ``num_tokens`` tokens exactly and names the first one (token, field); where codes are
found it also counts the *values* they make non-finite (a NaN scale byte spoils its whole tile),
decoding only the blocks of tokens that hold one. CPU tensors run a multi-threaded numba kernel
at memory speed, others the torch reference ``scan_records``.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from kvbridge.errors import CopyMismatchError, NonFiniteError
from kvbridge.layouts.codec import record_codec
from kvbridge.layouts.formats import E2M1_E4M3_OPS, OP_BF16, OP_E2M1_UE8M0, CodeRule, Format, get_format
from kvbridge.layouts.registry import Field, Layout, Segment

#: Ops whose values are E2M1 pairs (two per byte).
_PACKED_OPS = (*E2M1_E4M3_OPS, OP_E2M1_UE8M0)
#: Tokens per kernel work item.
_BLOCK = 4096
#: A rule that never matches (``word & 0 == 1``): the kernels' stand-in for a format without that rule.
_NEVER = CodeRule(1, 0, 1)


@dataclass(frozen=True)
class Scan:
    """Result of a scan: ``count`` non-finite codes; the first one's token and field name; ``values``:
    the decoded values those codes make NaN or Inf (what ``kvbridge inspect`` counts as non-finite)."""

    count: int
    first_token: int | None = None
    first_field: str | None = None
    values: int = 0

    def describe(self, what: str = "source") -> str:
        """One line: how many non-finite values (and stored codes), and where the first one is."""
        return (
            f"{what} holds {self.values} non-finite value(s) (decoded NaN/Inf, from {self.count} NaN/Inf "
            f"stored code(s)); first at token {self.first_token}, field {self.first_field!r}"
        )

    def __add__(self, later: Scan) -> Scan:
        """This scan followed by ``later``, a scan of later tokens (its first token already shifted)."""
        if not later.count:
            return self
        if not self.count:
            return later
        return Scan(self.count + later.count, self.first_token, self.first_field, self.values + later.values)

    def shifted(self, tokens: int) -> Scan:
        """The same scan with its first token moved by ``tokens`` (a chunk starting at token ``tokens``)."""
        return self if not self.count else Scan(self.count, self.first_token + tokens, self.first_field, self.values)


def _rule_fields(layout: Layout, rule: str) -> list[tuple[Field, Format]]:
    """The fields of ``layout`` whose format has a ``rule`` (``nonfinite``, ...), with their formats."""
    out = []
    for f in layout.fields:
        fmt = get_format(f.format)
        if getattr(fmt, rule) is not None:
            out.append((f, fmt))
    return out


def _rule_arrays(fields: list[tuple[Field, Format]], *rules: str) -> list[np.ndarray]:
    """Kernel arguments: field starts, sizes, word widths, then a mask and a value array per rule."""
    arrays = [np.array([f.offset for f, _ in fields], dtype=np.int64),
              np.array([f.nbytes for f, _ in fields], dtype=np.int64),
              np.array([fmt.width for _, fmt in fields], dtype=np.int64)]
    for r in rules:
        picked = [getattr(fmt, r) or _NEVER for _, fmt in fields]
        arrays += [np.array([c.mask for c in picked], dtype=np.int64), np.array([c.value for c in picked], np.int64)]
    return arrays


def _words(raw: torch.Tensor, width: int) -> torch.Tensor:
    """Little-endian ``width``-byte words (int32) of uint8 bytes ``raw [N, nbytes]``."""
    w = raw.to(torch.int32)
    return w if width == 1 else w[:, 0::2] | (w[:, 1::2] << 8)


def _matches(words: torch.Tensor, rule: CodeRule | None) -> torch.Tensor:
    if rule is None:
        return torch.zeros_like(words, dtype=torch.bool)
    return (words & rule.mask) == rule.value


def _bad_values(records: torch.Tensor, layout: Layout) -> int:
    """Decoded values of token records ``[N, record_bytes]`` that are NaN or Inf (reference codec)."""
    if not records.shape[0]:
        return 0
    return int((~torch.isfinite(record_codec(layout).decode(records, scale=1.0))).sum())


def scan_records(records: torch.Tensor, layout: Layout) -> Scan:
    """Torch reference: scan token records ``[N, record_bytes]`` uint8 (any device)."""
    total = 0
    firsts = []
    for f, fmt in _rule_fields(layout, "nonfinite"):
        bad = _matches(_words(records[:, f.offset : f.offset + f.nbytes], fmt.width), fmt.nonfinite)
        counts = bad.sum(dim=1)
        total += int(counts.sum())
        hit = counts.nonzero()
        if hit.numel():
            firsts.append((int(hit[0, 0]), f.name))
    if total == 0:
        return Scan(0)
    token, name = min(firsts, key=lambda tf: tf[0])  # min is stable: the first listed field wins a tie
    return Scan(total, token, name, _bad_values(records, layout))


def _kernel():
    """The numba kernels of the scan and of ``code_stats``, compiled on first use (imports numba only then)."""
    global _KERNELS
    if _KERNELS is not None:
        return _KERNELS
    from numba import njit, prange

    @njit(cache=True, inline="always")
    def address(t, page_size, page_bytes, split, record_bytes, off):
        page = t // page_size
        row = t - page * page_size
        if split < 0:
            return page * page_bytes + row * record_bytes + off
        if off < split:
            return page * page_bytes + row * split + off
        return page * page_bytes + page_size * split + row * (record_bytes - split) + off - split

    @njit(cache=True, parallel=True, nogil=True)
    def scan(pages, n, page_size, page_bytes, split, record_bytes, starts, sizes, widths, masks, values, counts,
             firsts):
        nblocks = (n + 4095) // 4096
        for b in prange(nblocks):
            c = 0
            first = -1
            for t in range(b * 4096, min(n, b * 4096 + 4096)):
                for k in range(starts.shape[0]):
                    at = address(t, page_size, page_bytes, split, record_bytes, starts[k])
                    bad = 0
                    mask, value = masks[k], values[k]
                    if widths[k] == 1:
                        for j in range(sizes[k]):
                            bad += (pages[at + j] & mask) == value
                    else:
                        for j in range(0, sizes[k], 2):
                            bad += ((np.int64(pages[at + j]) | (np.int64(pages[at + j + 1]) << 8)) & mask) == value
                    if bad and first < 0:
                        first = t * 64 + k
                    c += bad
            counts[b] = c
            firsts[b] = first

    @njit(cache=True, parallel=True, nogil=True)
    def stats(pages, n, page_size, page_bytes, split, record_bytes, starts, sizes, widths, nf_mask, nf_value,
              inf_mask, inf_value, max_mask, max_value, histogram, counts, hist):
        nblocks = (n + 4095) // 4096
        for b in prange(nblocks):
            for t in range(b * 4096, min(n, b * 4096 + 4096)):
                for k in range(starts.shape[0]):
                    at = address(t, page_size, page_bytes, split, record_bytes, starts[k])
                    width, nfm, nfv, im, iv, mm, mv = widths[k], nf_mask[k], nf_value[k], inf_mask[k], inf_value[k], \
                        max_mask[k], max_value[k]
                    nf = 0
                    inf = 0
                    top = 0
                    if width == 1:  # one loop per word width: no width test per element
                        on = histogram[k]
                        for j in range(sizes[k]):
                            w = np.int64(pages[at + j])
                            if (w & nfm) == nfv:
                                nf += 1
                                inf += (w & im) == iv
                            top += (w & mm) == mv
                            if on:
                                hist[b, k, w] += 1
                    else:  # 2-byte words (formats with an exponent bias are 1-byte scale formats)
                        for j in range(0, sizes[k], 2):
                            w = np.int64(pages[at + j]) | (np.int64(pages[at + j + 1]) << 8)
                            if (w & nfm) == nfv:
                                nf += 1
                                inf += (w & im) == iv
                            top += (w & mm) == mv
                    counts[b, k, 0] += nf
                    counts[b, k, 1] += inf
                    counts[b, k, 2] += top

    _KERNELS = (scan, stats)
    return _KERNELS


_KERNELS = None


@dataclass(frozen=True)
class FormatCodes:
    """Counts of one format's stored codes over some tokens (see ``code_stats``)."""

    nonfinite: int = 0  # codes matching the format's ``nonfinite`` rule (NaN, or NaN and Inf)
    inf: int = 0  # of those, the ones the ``inf`` rule matches
    at_max: int = 0  # codes at the largest finite magnitude (``at_max`` rule)
    histogram: tuple[int, ...] | None = None  # counts of the 256 byte values (formats with an exponent bias)

    def __add__(self, other: FormatCodes) -> FormatCodes:
        hist = self.histogram
        if other.histogram is not None:
            hist = other.histogram if hist is None else tuple(a + b for a, b in zip(hist, other.histogram, strict=True))
        return FormatCodes(self.nonfinite + other.nonfinite, self.inf + other.inf, self.at_max + other.at_max, hist)


#: What ``code_stats`` counts: the fields whose format has one of these rules (or an exponent bias).
_STATS_RULES = ("nonfinite", "inf", "at_max", "exponent_bias")


def _stats_fields(layout: Layout) -> list[tuple[Field, Format]]:
    with_formats = [(f, get_format(f.format)) for f in layout.fields]
    return [(f, fmt) for f, fmt in with_formats if any(getattr(fmt, r) is not None for r in _STATS_RULES)]


def _empty_codes(fields: list[tuple[Field, Format]]) -> dict[str, FormatCodes]:
    return {fmt.name: FormatCodes(histogram=None if fmt.exponent_bias is None else (0,) * 256) for _, fmt in fields}


def code_stats(pages: torch.Tensor, layout: Layout, page_size: int,
               num_tokens: int | None = None) -> dict[str, FormatCodes]:
    """Counts of the stored codes of the first ``num_tokens`` tokens per format name (each format of the
    layout with a code rule or an exponent bias in the format table): non-finite, infinite and max-magnitude
    codes, and a histogram of the bytes of exponent-bias scale formats (numba kernel on CPU, torch elsewhere)."""
    n = layout.token_count(pages, page_size, num_tokens)
    fields = _stats_fields(layout)
    out = _empty_codes(fields)
    if n == 0 or not fields:
        return out
    if pages.device.type != "cpu":
        return _code_stats_records(layout.pages_to_records(pages, page_size, n), layout)
    arrays = _rule_arrays(fields, "nonfinite", "inf", "at_max")
    histogram = np.array([fmt.exponent_bias is not None for _, fmt in fields], dtype=np.int64)
    nblocks = -(-n // _BLOCK)
    counts = np.zeros((nblocks, len(fields), 3), dtype=np.int64)
    hist = np.zeros((nblocks, len(fields), 256), dtype=np.int64)
    split = -1 if layout.split is None else layout.split
    _kernel()[1](pages.contiguous().view(-1).numpy(), n, page_size, layout.page_bytes(page_size), split,
                 layout.record_bytes, *arrays, histogram, counts, hist)
    c, h = counts.sum(axis=0), hist.sum(axis=0)
    for k, (_, fmt) in enumerate(fields):
        out[fmt.name] += FormatCodes(int(c[k, 0]), int(c[k, 1]), int(c[k, 2]),
                                     None if fmt.exponent_bias is None else tuple(h[k].tolist()))
    return out


def _code_stats_records(records: torch.Tensor, layout: Layout) -> dict[str, FormatCodes]:
    """Torch reference of ``code_stats`` on token records ``[N, record_bytes]``."""
    fields = _stats_fields(layout)
    out = _empty_codes(fields)
    for f, fmt in fields:
        w = _words(records[:, f.offset : f.offset + f.nbytes], fmt.width)
        hist = None
        if fmt.exponent_bias is not None:
            hist = tuple(torch.bincount((w & 0xFF).reshape(-1).to(torch.int64).cpu(), minlength=256).tolist())
        bad = _matches(w, fmt.nonfinite)
        out[fmt.name] += FormatCodes(int(bad.sum()), int((bad & _matches(w, fmt.inf)).sum()),
                                     int(_matches(w, fmt.at_max).sum()), hist)
    return out


#: A per-tensor scale above this can turn the largest finite e4m3 code (448) into Inf in fp32.
OVERFLOW_SCALE = float(torch.finfo(torch.float32).max) / 448.0
#: Tokens decoded at a time when a scale can overflow (``scan_pages``).
_DECODE_TOKENS = 1 << 14


def scan_pages(pages: torch.Tensor, layout: Layout, page_size: int, num_tokens: int | None = None,
               scale: float | None = None) -> Scan:
    """Scan the first ``num_tokens`` tokens (default: every row) of ``pages`` of ``layout``.

    ``scale``: the per-tensor scale the pages decode at; one large enough to overflow a finite
    code (above ``OVERFLOW_SCALE``) makes those values non-finite too (found by decoding)."""
    found = _scan_codes(pages, layout, page_size, num_tokens)
    if found.count or scale is None or not layout.per_tensor_scale or not abs(scale) > OVERFLOW_SCALE:
        return found
    n = layout.token_count(pages, page_size, num_tokens)
    records = layout.pages_to_records(pages, page_size, n)
    codec, count, first = record_codec(layout), 0, -1
    for t0 in range(0, n, _DECODE_TOKENS):
        bad = ~torch.isfinite(codec.decode(records[t0 : t0 + _DECODE_TOKENS], scale=scale))
        hits = int(bad.sum())
        if hits and first < 0:
            first = t0 + int(bad.any(dim=1).nonzero()[0, 0])
        count += hits
    return Scan(count, max(first, 0), f"a code times the scale {scale:g}", count) if count else Scan(0)


def _scan_codes(pages: torch.Tensor, layout: Layout, page_size: int, num_tokens: int | None) -> Scan:
    n = layout.token_count(pages, page_size, num_tokens)
    fields = _rule_fields(layout, "nonfinite")
    if n == 0 or not fields:
        return Scan(0)
    if pages.device.type != "cpu" or len(fields) > 64:
        return scan_records(layout.pages_to_records(pages, page_size, n), layout)
    flat = pages.contiguous().view(-1).numpy()
    nblocks = -(-n // _BLOCK)
    counts = np.zeros(nblocks, dtype=np.int64)
    firsts = np.zeros(nblocks, dtype=np.int64)
    split = -1 if layout.split is None else layout.split
    _kernel()[0](flat, n, page_size, layout.page_bytes(page_size), split, layout.record_bytes,
                 *_rule_arrays(fields, "nonfinite"), counts, firsts)
    total = int(counts.sum())
    if total == 0:
        return Scan(0)
    first = int(firsts[firsts >= 0][0])
    records = layout.geometry.pages_to_records(pages, page_size, n)
    values = sum(_bad_values(records[b * _BLOCK : (b + 1) * _BLOCK], layout) for b in np.flatnonzero(counts))
    return Scan(total, first // 64, fields[first % 64][0].name, values)


def check_pages(pages: torch.Tensor, layout: Layout, page_size: int, num_tokens: int | None = None,
                what: str = "source", scale: float | None = None) -> None:
    """Raise ``NonFiniteError`` (values, codes, first token and field) when ``pages`` hold non-finite
    codes, or values that overflow at ``scale`` (see ``scan_pages``)."""
    scan = scan_pages(pages, layout, page_size, num_tokens, scale)
    if scan.count:
        raise NonFiniteError(scan.describe(what))


def check_records(records: torch.Tensor, layout: Layout, what: str = "source") -> Scan:
    """Raise ``NonFiniteError`` when token records ``[N, record_bytes]`` hold non-finite codes."""
    scan = scan_records(records, layout)
    if scan.count:
        raise NonFiniteError(scan.describe(what))
    return scan


def _mirror_bytes(seg: Segment) -> list[tuple[int, int]]:
    """Record byte ranges ``[lo, hi)`` a mirror segment writes: its values and, when tiled, its scale bytes."""
    width = seg.ndims // 2 if seg.op in _PACKED_OPS else seg.ndims * (2 if seg.op == OP_BF16 else 1)
    spans = [(seg.offset, seg.offset + width)]
    if seg.tile:
        spans.append((seg.scale_offset, seg.scale_offset + seg.ndims // seg.tile))
    return spans


@dataclass(frozen=True)
class CopyMismatch:
    """The first record whose second copy differs from what its writer encodes: its index among the records
    compared, the mirror field, the record bytes ``[lo, hi)`` that differ (its values or its scales) and the
    latent dims ``[dim0, dim0 + ndims)`` it stores a second time."""

    index: int
    field: str
    lo: int
    hi: int
    dim0: int
    ndims: int

    def error(self, layout: Layout, where: str) -> CopyMismatchError:
        """The ``CopyMismatchError`` for this record (``where`` names it: ``"source token 5"``), with the remedy."""
        return CopyMismatchError(
            f"{where}: record bytes {self.lo}..{self.hi - 1} (field {self.field!r} or its scales) of {layout.name} "
            f"disagree with dims {self.dim0}..{self.dim0 + self.ndims - 1} as their first copy stores them; the "
            "writer encodes both copies from the same values, so the record is corrupt or not this layout's: "
            "check the layout, page size and scale, or re-encode the values"
        )


def mirror_mismatch(records: torch.Tensor, expected: torch.Tensor, layout: Layout) -> CopyMismatch | None:
    """The first of token records ``[N, record_bytes]`` whose second copies (``Layout.mirrors``: the mirror
    fields' value and scale bytes) differ from ``expected`` ``[N, record_bytes]``, the records as their writer
    encodes them from their decoded values (each dim read from its first copy); None when all agree. Only the
    mirror bytes are compared (a caller that skips a record copies it into ``expected``)."""
    spans = [(seg, lo, hi) for seg in layout.mirrors for lo, hi in _mirror_bytes(seg)]
    if not spans:
        return None
    bad = torch.stack([(records[:, lo:hi] != expected[:, lo:hi]).any(dim=1) for _, lo, hi in spans], dim=1)
    rows = bad.any(dim=1)
    if not bool(rows.any()):
        return None
    index = int(rows.nonzero()[0, 0])
    seg, lo, hi = spans[int(bad[index].nonzero()[0, 0])]
    name = next(f.name for f in layout.fields if f.mirror and f.offset == seg.offset)
    return CopyMismatch(index, name, lo, hi, seg.dim0, seg.ndims)


def _values_kernel():
    """The numba kernel of ``value_stats``, compiled on first use."""
    global _VALUES_KERNEL
    if _VALUES_KERNEL is not None:
        return _VALUES_KERNEL
    from numba import njit, prange

    @njit(cache=True, parallel=True, nogil=True)
    def stats(bits, block, out_max, out_bad):
        n = bits.shape[0]
        for b in prange(out_max.shape[0]):
            top = 0
            bad = 0
            for i in range(b * block, min(n, b * block + block)):
                mag = bits[i] & 0x7FFFFFFF
                if mag >= 0x7F800000:
                    bad += 1
                elif mag > top:
                    top = mag
            out_max[b] = top
            out_bad[b] = bad

    _VALUES_KERNEL = stats
    return stats


_VALUES_KERNEL = None


def value_stats(values: torch.Tensor) -> tuple[float, int]:
    """``(largest finite |value|, count of NaN/Inf)`` of fp32 ``values``, in one pass (the magnitude
    bits of finite floats order like integers; numba kernel on CPU, torch elsewhere)."""
    if values.numel() == 0:
        return 0.0, 0
    if values.dtype != torch.float32 or values.device.type != "cpu":
        finite = torch.isfinite(values)
        bad = int((~finite).sum())
        return float(torch.where(finite, values, 0).abs().max()), bad
    bits = values.contiguous().view(-1).view(torch.int32).numpy()
    block = 1 << 16
    nblocks = -(-bits.shape[0] // block)
    top = np.zeros(nblocks, dtype=np.int32)
    bad = np.zeros(nblocks, dtype=np.int64)
    _values_kernel()(bits, block, top, bad)
    return float(np.array([top.max()], dtype=np.int32).view(np.float32)[0]), int(bad.sum())
