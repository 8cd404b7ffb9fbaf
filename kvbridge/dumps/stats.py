"""Dump statistics: byte-level code counts and decoded-value statistics of each entry (``kvbridge inspect``).

``entry_stats`` reads an in-memory ``DumpEntry``; ``dump_stats`` streams every entry of an open
``DumpFile`` in chunks of about ``CHUNK_BYTES`` (bounded memory), the same numbers chunk by chunk.
"""

from __future__ import annotations

import torch

from kvbridge.dumps.dumpfile import _META_KEYS, _TORCH_DTYPES, DumpEntry, DumpFile, ProgressFn, tokens_per_chunk
from kvbridge.layouts import Layout, get_layout, scan
from kvbridge.layouts.formats import get_format
from kvbridge.ops.pages import decode


class _StatsAccumulator:
    """Byte-level and decoded-value statistics of an entry, accumulated chunk by chunk."""

    def __init__(self, layout: Layout | None):
        self.layout = layout
        self.nan: dict[str, int] = {}
        self.inf = 0
        self.at_max = 0
        self.nonfinite = 0
        self.abs_max = 0.0
        self.histogram: dict[int, int] | None = None
        if layout is not None and any(get_format(f.format).exponent_bias is not None for f in layout.fields):
            self.histogram = {}

    def add_values(self, values: torch.Tensor) -> None:
        top, bad = scan.value_stats(values)
        self.abs_max = max(self.abs_max, top)
        self.nonfinite += bad

    def add_latents(self, raw: torch.Tensor) -> None:
        self.nan["latents"] = self.nan.get("latents", 0) + int(torch.isnan(raw).sum())
        self.inf += int(torch.isinf(raw).sum())
        self.add_values(raw.float())

    def add_pages(self, pages: torch.Tensor, page_size: int, num_tokens: int) -> None:
        """Count the stored codes of the first ``num_tokens`` tokens of ``pages`` per format, as the
        format table says: ``nan`` per format with non-finite codes (those not infinities), ``inf``,
        ``at_max``, and the exponent histogram of power-of-two scale formats (non-finite bytes left out)."""
        for name, c in scan.code_stats(pages, self.layout, page_size, num_tokens).items():
            fmt = get_format(name)
            if fmt.nonfinite is not None:
                self.nan[name] = self.nan.get(name, 0) + c.nonfinite - c.inf
            self.inf += c.inf
            self.at_max += c.at_max
            if fmt.exponent_bias is not None:
                for byte, count in enumerate(c.histogram):
                    if count and not fmt.nonfinite.matches(byte):
                        k = byte - fmt.exponent_bias
                        self.histogram[k] = self.histogram.get(k, 0) + count

    def result(self) -> dict:
        per_tensor = self.layout is not None and self.layout.per_tensor_scale
        return {
            "abs_max": self.abs_max,
            "nan": self.nan,
            "inf": self.inf,
            "nonfinite_values": self.nonfinite,
            "saturated": self.at_max if per_tensor else None,
            "e4m3_at_max": self.at_max,
            "scale_exponents": None if self.histogram is None else dict(sorted(self.histogram.items())),
        }


def _stats_head(meta: dict, num_pages: int | None, nbytes: int) -> dict:
    return {**{k: meta.get(k) for k in _META_KEYS}, "num_pages": num_pages, "nbytes": nbytes}


def entry_stats(entry: DumpEntry) -> dict:
    """Byte-level statistics of an entry's first ``num_tokens`` tokens.

    ``nan``: NaN codes per field format with non-finite codes in the format table
    (``layouts.formats``: E4M3 and E4M3 scale bytes 0x7F/0xFF, UE8M0 0xFF, bf16 NaN); ``inf``:
    infinite codes (bf16); ``nonfinite_values``: decoded values that are NaN or Inf, the one
    count of non-finite values ``kvbridge inspect`` shows and ``kvbridge convert`` refuses (a NaN
    scale byte spoils every value of its tile; a huge scale can overflow finite codes);
    ``saturated``: E4M3 codes at +-448 (0x7E/0xFE) of per-tensor layouts, where they mean
    clipping (None for per-tile layouts, whose tile maxima are stored at 448 by design;
    ``e4m3_at_max`` counts them for every layout); ``scale_exponents``: histogram {k: count}
    of the power-of-two tile scales 2^k (UE8M0; per-tile layouts only); ``abs_max``: the
    largest finite |decoded value|.
    """
    stats = _stats_head(entry.metadata(), entry.num_pages, entry.data.numel() * entry.data.element_size())
    if entry.layout is None:
        stats["dtype"] = str(entry.data.dtype).removeprefix("torch.")
    acc = _StatsAccumulator(None if entry.layout is None else get_layout(entry.layout))
    if entry.layout is None:
        acc.add_latents(entry.data)
    else:
        acc.add_pages(entry.data, entry.page_size, entry.num_tokens)
        acc.add_values(entry.latents())
    stats.update(acc.result())
    return stats



def dump_stats(fh: DumpFile, on_progress: ProgressFn | None = None) -> list[dict]:
    """``entry_stats`` of every entry of open dump ``fh``, streamed in chunks (bounded memory),
    with each entry's ``checksum``: ``"ok"`` (verified) or None (a version-1 file has none).
    ``on_progress(done_bytes, total_bytes)`` follows the bytes read."""
    out, done = [], 0
    for info in fh.entries:
        lay = info.layout
        stats = _stats_head(info.meta, None if lay is None else info.shape[0], info.nbytes)
        if lay is None:
            stats["dtype"] = str(_TORCH_DTYPES[info.dtype]).removeprefix("torch.")
        acc = _StatsAccumulator(lay)
        p = 1 if lay is None else info.meta["page_size"]
        n = info.num_tokens
        chunk_tokens = tokens_per_chunk(p, info.row_bytes)
        for row0, rows in fh.iter_rows(info, chunk_tokens // p):
            t0 = row0 * p
            k = min(n - t0, rows.shape[0] * p)
            if k > 0 and lay is None:
                acc.add_latents(rows[:k])
            elif k > 0:
                acc.add_pages(rows, p, k)
                acc.add_values(decode(rows, lay, page_size=p, num_tokens=k, scale=info.meta.get("scale")))
            done += rows.numel() * rows.element_size()
            if on_progress is not None:
                on_progress(done, fh.data_bytes)
        stats.update(acc.result())
        stats["checksum"] = None if info.crc32 is None else "ok"
        out.append(stats)
    return out


__all__ = [
    "dump_stats",
    "entry_stats",
]
