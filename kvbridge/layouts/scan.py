"""Byte-level scan for non-finite codes in stored pages, driven by the layout's ``Field`` list.

A byte move (re-paging, ``flashmla-model1`` <-> ``trtllm-fp8-ds-mla``) never decodes, so a NaN
in the source would pass through unseen; this scan reads the stored codes instead:

- ``e4m3`` bytes: NaN is ``0x7F`` / ``0xFF`` (E4M3 has no infinity);
- ``ue8m0`` bytes: NaN is ``0xFF``;
- ``bf16`` pairs (little-endian): exponent bits all ones (NaN or +-Inf);
- ``pad`` bytes are ignored, and so is any other format.

Each field of the token record is located in the page the way ``Layout.field_offset`` does
(token-major, or block-split data rows then footer). ``scan_pages`` counts every bad code of
the first ``num_tokens`` tokens exactly and names the first one (token, field); CPU tensors run
a multi-threaded numba kernel at memory speed, others the torch reference ``scan_records``.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from kvbridge.errors import NonFiniteError
from kvbridge.layouts import Layout
from kvbridge.layouts.codec import record_codec

#: Field format -> kernel code: 1 E4M3 byte, 2 UE8M0 byte, 3 bf16 pair.
_KINDS = {"e4m3": 1, "ue8m0": 2, "bf16": 3}
#: Tokens per kernel work item.
_BLOCK = 4096


@dataclass(frozen=True)
class Scan:
    """Result of a scan: ``count`` non-finite codes; the first one's token and field name."""

    count: int
    first_token: int | None = None
    first_field: str | None = None

    def describe(self, what: str = "source") -> str:
        """One line: how many codes, and where the first one is."""
        return (
            f"{what} holds {self.count} non-finite code(s) (NaN or Inf bytes); "
            f"first at token {self.first_token}, field {self.first_field!r}"
        )


def _scanned_fields(layout: Layout):
    return [f for f in layout.fields if f.format in _KINDS]


def scan_records(records: torch.Tensor, layout: Layout) -> Scan:
    """Torch reference: scan token records ``[N, record_bytes]`` uint8 (any device)."""
    total = 0
    firsts = []
    for f in _scanned_fields(layout):
        raw = records[:, f.offset : f.offset + f.nbytes]
        if f.format == "e4m3":
            bad = (raw & 0x7F) == 0x7F
        elif f.format == "ue8m0":
            bad = raw == 0xFF
        else:
            hi = raw[:, 1::2]
            bad = (hi & 0x7F) == 0x7F
            bad &= (raw[:, 0::2] & 0x80) == 0x80
        counts = bad.sum(dim=1)
        total += int(counts.sum())
        hit = counts.nonzero()
        if hit.numel():
            firsts.append((int(hit[0, 0]), f.name))
    if total == 0:
        return Scan(0)
    token, name = min(firsts, key=lambda tf: tf[0])  # min is stable: the first listed field wins a tie
    return Scan(total, token, name)


def _kernel():
    """The numba kernel, compiled on first use (imports numba only then)."""
    global _KERNEL
    if _KERNEL is not None:
        return _KERNEL
    from numba import njit, prange

    @njit(cache=True, parallel=True, nogil=True)
    def scan(pages, n, page_size, page_bytes, split, record_bytes, starts, sizes, kinds, counts, firsts):
        nblocks = (n + 4095) // 4096
        for b in prange(nblocks):
            c = 0
            first = -1
            for t in range(b * 4096, min(n, b * 4096 + 4096)):
                page = t // page_size
                row = t - page * page_size
                for k in range(starts.shape[0]):
                    off = starts[k]
                    if split < 0:
                        at = page * page_bytes + row * record_bytes + off
                    elif off < split:
                        at = page * page_bytes + row * split + off
                    else:
                        at = page * page_bytes + page_size * split + row * (record_bytes - split) + off - split
                    kind = kinds[k]
                    bad = 0
                    if kind == 1:
                        for j in range(sizes[k]):
                            bad += (pages[at + j] & 0x7F) == 0x7F
                    elif kind == 2:
                        for j in range(sizes[k]):
                            bad += pages[at + j] == 0xFF
                    else:
                        for j in range(0, sizes[k], 2):
                            bad += ((pages[at + j + 1] & 0x7F) == 0x7F) and ((pages[at + j] & 0x80) == 0x80)
                    if bad and first < 0:
                        first = t * 64 + k
                    c += bad
            counts[b] = c
            firsts[b] = first

    _KERNEL = scan
    return scan


_KERNEL = None


def _stats_kernel():
    """The numba kernel of ``code_stats``, compiled on first use."""
    global _STATS_KERNEL
    if _STATS_KERNEL is not None:
        return _STATS_KERNEL
    from numba import njit, prange

    @njit(cache=True, parallel=True, nogil=True)
    def stats(pages, n, page_size, page_bytes, split, record_bytes, starts, sizes, kinds, counts, hist):
        nblocks = (n + 4095) // 4096
        for b in prange(nblocks):
            for t in range(b * 4096, min(n, b * 4096 + 4096)):
                page = t // page_size
                row = t - page * page_size
                for k in range(starts.shape[0]):
                    off = starts[k]
                    if split < 0:
                        at = page * page_bytes + row * record_bytes + off
                    elif off < split:
                        at = page * page_bytes + row * split + off
                    else:
                        at = page * page_bytes + page_size * split + row * (record_bytes - split) + off - split
                    kind = kinds[k]
                    if kind == 1:
                        for j in range(sizes[k]):
                            m = pages[at + j] & 0x7F
                            counts[b, 0] += m == 0x7F
                            counts[b, 1] += m == 0x7E
                    elif kind == 2:
                        for j in range(sizes[k]):
                            hist[b, pages[at + j]] += 1
                    else:
                        for j in range(0, sizes[k], 2):
                            lo = pages[at + j]
                            hi = pages[at + j + 1]
                            if (hi & 0x7F) == 0x7F and (lo & 0x80) == 0x80:
                                if (lo & 0x7F) != 0:
                                    counts[b, 2] += 1
                                else:
                                    counts[b, 3] += 1

    _STATS_KERNEL = stats
    return stats


_STATS_KERNEL = None


@dataclass(frozen=True)
class CodeStats:
    """Counts of the stored codes of some tokens, per field format (see ``code_stats``)."""

    e4m3_nan: int  # 0x7F / 0xFF
    e4m3_at_max: int  # 0x7E / 0xFE: +-448
    bf16_nan: int
    bf16_inf: int
    ue8m0: list[int]  # histogram of the 256 scale bytes (0xFF: NaN)


def code_stats(pages: torch.Tensor, layout: Layout, page_size: int, num_tokens: int | None = None) -> CodeStats:
    """Counts of E4M3 NaN and +-448 codes, bf16 NaN and Inf, and a histogram of the UE8M0 bytes of
    the first ``num_tokens`` tokens (numba kernel on CPU, torch reference elsewhere)."""
    n = layout.token_count(pages, page_size, num_tokens)
    fields = _scanned_fields(layout)
    if n == 0 or not fields:
        return CodeStats(0, 0, 0, 0, [0] * 256)
    if pages.device.type != "cpu":
        return _code_stats_records(layout.pages_to_records(pages, page_size, n), layout)
    starts = np.array([f.offset for f in fields], dtype=np.int64)
    sizes = np.array([f.nbytes for f in fields], dtype=np.int64)
    kinds = np.array([_KINDS[f.format] for f in fields], dtype=np.int64)
    nblocks = -(-n // _BLOCK)
    counts = np.zeros((nblocks, 4), dtype=np.int64)
    hist = np.zeros((nblocks, 256), dtype=np.int64)
    split = -1 if layout.split is None else layout.split
    _stats_kernel()(pages.contiguous().view(-1).numpy(), n, page_size, layout.page_bytes(page_size), split,
                    layout.record_bytes, starts, sizes, kinds, counts, hist)
    c = counts.sum(axis=0)
    return CodeStats(int(c[0]), int(c[1]), int(c[2]), int(c[3]), hist.sum(axis=0).tolist())


def _code_stats_records(records: torch.Tensor, layout: Layout) -> CodeStats:
    """Torch reference of ``code_stats`` on token records ``[N, record_bytes]``."""
    e_nan = e_max = b_nan = b_inf = 0
    hist = torch.zeros(256, dtype=torch.int64)
    for f in _scanned_fields(layout):
        raw = records[:, f.offset : f.offset + f.nbytes]
        if f.format == "e4m3":
            mag = raw & 0x7F
            e_nan += int((mag == 0x7F).sum())
            e_max += int((mag == 0x7E).sum())
        elif f.format == "ue8m0":
            hist += torch.bincount(raw.reshape(-1).to(torch.int64).cpu(), minlength=256)
        else:
            lo, hi = raw[:, 0::2], raw[:, 1::2]
            top = ((hi & 0x7F) == 0x7F) & ((lo & 0x80) == 0x80)
            b_nan += int((top & ((lo & 0x7F) != 0)).sum())
            b_inf += int((top & ((lo & 0x7F) == 0)).sum())
    return CodeStats(e_nan, e_max, b_nan, b_inf, hist.tolist())


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
    return Scan(count, max(first, 0), f"a code times the scale {scale:g}") if count else Scan(0)


def _scan_codes(pages: torch.Tensor, layout: Layout, page_size: int, num_tokens: int | None) -> Scan:
    n = layout.token_count(pages, page_size, num_tokens)
    fields = _scanned_fields(layout)
    if n == 0 or not fields:
        return Scan(0)
    if pages.device.type != "cpu" or len(fields) > 64:
        return scan_records(layout.pages_to_records(pages, page_size, n), layout)
    flat = pages.contiguous().view(-1).numpy()
    starts = np.array([f.offset for f in fields], dtype=np.int64)
    sizes = np.array([f.nbytes for f in fields], dtype=np.int64)
    kinds = np.array([_KINDS[f.format] for f in fields], dtype=np.int64)
    nblocks = -(-n // _BLOCK)
    counts = np.zeros(nblocks, dtype=np.int64)
    firsts = np.zeros(nblocks, dtype=np.int64)
    split = -1 if layout.split is None else layout.split
    _kernel()(flat, n, page_size, layout.page_bytes(page_size), split, layout.record_bytes, starts, sizes, kinds,
              counts, firsts)
    total = int(counts.sum())
    if total == 0:
        return Scan(0)
    first = int(firsts[firsts >= 0][0])
    return Scan(total, first // 64, fields[first % 64].name)


def check_pages(pages: torch.Tensor, layout: Layout, page_size: int, num_tokens: int | None = None,
                what: str = "source", scale: float | None = None) -> None:
    """Raise ``NonFiniteError`` (count, first token and field) when ``pages`` hold non-finite codes,
    or values that overflow at ``scale`` (see ``scan_pages``)."""
    scan = scan_pages(pages, layout, page_size, num_tokens, scale)
    if scan.count:
        raise NonFiniteError(scan.describe(what))


def check_records(records: torch.Tensor, layout: Layout, what: str = "source") -> Scan:
    """Raise ``NonFiniteError`` when token records ``[N, record_bytes]`` hold non-finite codes."""
    scan = scan_records(records, layout)
    if scan.count:
        raise NonFiniteError(scan.describe(what))
    return scan


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
