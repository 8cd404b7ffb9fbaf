"""Dump conversion: plan every entry's conversion before any work, then stream it into a new dump.

``plan_convert`` checks the options against every entry (``EntryPlan``); ``convert_open_dump`` runs
the plans chunk by chunk (``_Converter``) into a ``DumpWriter`` (atomic, space reserved first);
``convert_dump`` is both on a path; ``convert_entry`` converts one in-memory ``DumpEntry``.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

import torch

from kvbridge.backends import dispatch
from kvbridge.backends.loss_stats import LossStats, compare_values, lossless_scale_candidates
from kvbridge.backends.reference import check_finite
from kvbridge.dumps.dumpfile import DumpEntry, DumpFile, EntryInfo, ProgressFn, _fp32_scale, open_dump, tokens_per_chunk
from kvbridge.dumps.writer import DumpWriter, EntrySpec, dump_size
from kvbridge.errors import InputError, NonFiniteError
from kvbridge.layouts import Layout, get_layout, scan
from kvbridge.layouts.codec import tensor_multiplier
from kvbridge.ops.checks import _check_auto, _check_byte_move_dialect, _check_dialect, _check_scale
from kvbridge.ops.loss import LossReport, loss_report, transcode_loss_stats
from kvbridge.ops.pages import auto_scale, decode, encode, is_byte_move, transcode

#: Tokens of an entry's first chunk that pre-select the lossless per-tensor scales of ``scale="auto"``.
LOSSLESS_SAMPLE_TOKENS = 64


@dataclass
class ConvertedEntry:
    """What ``convert_dump`` did to one entry: its name and the loss report (None when skipped)."""

    name: str
    report: LossReport | None


@dataclass
class EntryPlan:
    """How one entry converts: source and destination geometry, scales, byte move or re-encode."""

    info: EntryInfo
    src: Layout | None  # None: raw latents
    src_page_size: int
    dst: Layout
    dst_page_size: int
    src_scale: float | None  # None: per-tile source or latents
    dst_scale: float | str | None  # a number, "auto" (settled by the first pass), or None (per-tile)
    byte_move: bool
    dialect: str | None  # the encoder dialect (None for byte moves)
    out_dialect: str | None  # the dialect recorded in the output header

    @property
    def num_tokens(self) -> int:
        return self.info.num_tokens

    @property
    def out_shape(self) -> tuple[int, int]:
        return (self.dst.num_pages(self.num_tokens, self.dst_page_size), self.dst.page_bytes(self.dst_page_size))

    def spec(self) -> EntrySpec:
        m = self.info.meta
        meta = {
            **m,
            "kind": "pages",
            "layout": self.dst.name,
            "page_size": self.dst_page_size,
            "scale": self.dst_scale if self.dst.takes_scale else None,
            "dialect": self.out_dialect,
        }
        return EntrySpec(meta, "U8", self.out_shape)


def plan_convert(
    fh: DumpFile,
    to_layout: str | Layout,
    *,
    page_size: int | None = None,
    dialect: str | None = None,
    scale: float | str | None = None,
) -> list[EntryPlan]:
    """Check the conversion of every entry of open dump ``fh`` before any work; ``InputError``
    (naming the entry) for an option that does not apply. ``scale="auto"`` keeps the source's
    scale where that is a byte move (lossless); otherwise a first pass over the entry takes s = 1
    if that reproduces every value, else another scale that does (``_Converter.settle_auto_scale``),
    else the smallest scale with no saturation."""
    dst = get_layout(to_layout)
    if page_size is not None:
        dst.check_page_size(page_size)
    auto = _check_auto(scale, dst)  # the same checks, and messages, as ``transcode``
    s_given = None if auto else _check_scale(scale, dst)
    encoder_dialect = _check_dialect(dialect, dst)
    plans = []
    for info in fh.entries:
        src = info.layout
        if src is None and page_size is None:
            raise InputError(f"entry {info.name} holds raw latents: page_size is needed to encode it")
        sp = 1 if src is None else info.meta["page_size"]
        dp = sp if page_size is None else page_size
        s_in = _fp32_scale(info.meta.get("scale"))  # None: per-tile source (or latents)
        if dst.per_tensor_scale:
            if auto and s_in is not None and is_byte_move(src, dst, s_in, s_in):
                s_out: float | str | None = s_in  # a lossless byte move exists: keep it
            else:
                s_out = "auto" if auto else s_given
        elif dst.nvfp4_global_scale:  # the NVFP4 global scale given (null in the header when not: g = 1)
            s_out = None if scale is None else s_given
        else:
            s_out = None
        move = src is not None and s_out != "auto" and is_byte_move(src, dst, s_in or 1.0, s_out or 1.0)
        if move:
            try:
                _check_byte_move_dialect(src, dst, dialect)
            except InputError as e:
                raise InputError(f"entry {info.name}: {e}") from None
        d = None if move else encoder_dialect
        out_dialect = info.meta.get("dialect") if move else d
        plans.append(EntryPlan(info, src, sp, dst, dp, s_in, s_out, move, d, out_dialect))
    return plans


def _nonfinite_error(fh: DumpFile, plan: EntryPlan, count: int, token: int, where: str) -> NonFiniteError:
    """``count``: the entry's decoded values that are NaN or Inf, as ``kvbridge inspect`` counts them."""
    return NonFiniteError(
        f"{fh.path}: entry {plan.info.name}: {count} non-finite value(s) (decoded NaN/Inf) in the source; "
        f"first at token {token}{where}"
    )


def _reproduces(values: torch.Tensor, dst: Layout, page_size: int, dialect: str | None, scale: float) -> bool:
    """Whether ``dst`` at per-tensor ``scale`` stores the decoded fp32 ``values`` exactly."""
    trial = encode(values, dst, page_size=page_size, dialect=dialect, scale=scale)
    return torch.equal(decode(trial, dst, page_size=page_size, num_tokens=values.shape[0], scale=scale), values)


def _lossless_scale(chunks: Callable[[], Iterable[torch.Tensor]], amax: float, sample: torch.Tensor, dst: Layout,
                    page_size: int, dialect: str | None, *, one_refuted: bool = False) -> float | None:
    """The per-tensor scale ``scale="auto"`` takes when one stores every value exactly, else None: s = 1
    first (unless ``one_refuted``; e.g. back to the TensorRT-LLM FP8 a MODEL1 dump came from), then the
    ``lossless_scale_candidates`` of the values' ``amax`` and ``sample``, largest first. ``chunks()`` yields
    the decoded values again for each scale tried, which stops at the first chunk it does not reproduce."""
    d = _check_dialect(dialect, dst)
    for s in [*([] if one_refuted else [1.0]), *lossless_scale_candidates(amax, sample, d)]:
        if all(_reproduces(v, dst, page_size, dialect, s) for v in chunks()):
            return s
    return None


class _Converter:
    """Streams one planned entry through the conversion, chunk by chunk, into a writer."""

    def __init__(self, fh: DumpFile, plan: EntryPlan, out: DumpWriter, report: bool, progress: Callable[[int], None]):
        self.fh, self.plan, self.out, self.report, self.progress = fh, plan, out, report, progress
        p = plan
        self.chunk_tokens = tokens_per_chunk(p.src_page_size, p.info.row_bytes, p.dst_page_size)
        self._outputs: list[torch.Tensor] = []
        self._turn = 0

    def _out_buffer(self, k: int) -> torch.Tensor:
        """Destination pages for a chunk of ``k`` tokens: three buffers in turn, so that the one
        handed out is never among the (at most two) chunks the writer still has in flight."""
        p = self.plan
        if not self._outputs:
            shape = (p.dst.num_pages(min(self.chunk_tokens, p.num_tokens), p.dst_page_size), p.out_shape[1])
            self._outputs = [torch.empty(shape, dtype=torch.uint8) for _ in range(3)]
        self._turn += 1
        return self._outputs[self._turn % 3][: p.dst.num_pages(k, p.dst_page_size)]

    def _values(self, rows: torch.Tensor, k: int) -> torch.Tensor:
        p = self.plan
        if p.src is None:
            return rows[:k].float()
        return decode(rows, p.src, page_size=p.src_page_size, num_tokens=k, scale=p.src_scale)

    def _chunks(self, counted: bool = True) -> Iterator[tuple[int, int, torch.Tensor]]:
        """``(first_token, tokens, rows)`` of each chunk holding tokens (trailing pages: checksum only);
        ``counted``: the bytes read go to the progress (not for extra checking passes)."""
        p = self.plan
        for row0, rows in self.fh.iter_rows(p.info, self.chunk_tokens // p.src_page_size, reuse=True):
            if counted:
                self.progress(rows.numel() * rows.element_size())
            t0 = row0 * p.src_page_size
            k = min(p.num_tokens - t0, rows.shape[0] * p.src_page_size)
            if k > 0:
                yield t0, k, rows

    def settle_auto_scale(self) -> None:
        """``scale="auto"`` where no byte move applies: a scale that reproduces every value when one
        exists (``_lossless_scale``), else the smallest scale with no saturation. The first pass takes
        the amax and checks s = 1; each candidate costs at most one more pass."""
        p = self.plan
        if p.dst_scale != "auto":
            return
        amax, exact_at_1, sample = 0.0, True, None
        for t0, k, rows in self._chunks():
            values = self._values(rows, k)
            self._check_finite(values, t0)
            amax = max(amax, scan.value_stats(values)[0])
            if sample is None:
                sample = values[:LOSSLESS_SAMPLE_TOKENS].clone()
            exact_at_1 = exact_at_1 and _reproduces(values, p.dst, p.dst_page_size, p.dialect, 1.0)
        if exact_at_1:
            p.dst_scale = 1.0
            return
        again = lambda: (self._values(rows, k) for _, k, rows in self._chunks(counted=False))  # noqa: E731
        found = None if sample is None else _lossless_scale(again, amax, sample, p.dst, p.dst_page_size, p.dialect,
                                                             one_refuted=True)
        p.dst_scale = auto_scale(torch.tensor([amax])) if found is None else found

    def _check_finite(self, values: torch.Tensor, t0: int) -> None:
        """``NonFiniteError`` when the decoded ``values`` of the chunk at token ``t0`` (the first with any)
        hold NaN/Inf: it names the first and counts those of the whole entry (one more pass, on failure only)."""
        if dispatch.all_finite(values):
            return
        bad = ~torch.isfinite(values)
        if bool(bad.any()):
            token, dim = (int(v) for v in bad.nonzero()[0])
            total = sum(scan.value_stats(self._values(rows, k))[1] for _, k, rows in self._chunks(counted=False))
            raise _nonfinite_error(self.fh, self.plan, total, t0 + token, f", dim {dim}")

    def run(self) -> LossReport | None:
        p = self.plan
        scale = p.dst_scale if p.dst.takes_scale else None
        mult = tensor_multiplier(p.dialect, scale) if scale is not None and p.dst.per_tensor_scale else None
        stats = LossStats()
        bad = scan.Scan(0)
        for t0, k, rows in self._chunks():
            if p.byte_move:
                bad += scan.scan_pages(rows, p.src, p.src_page_size, k, p.src_scale).shifted(t0)  # at the actual scale
                if bad.count:
                    continue  # keep scanning for the exact count; nothing more is written
                pages = transcode(rows, p.src, p.dst, src_page_size=p.src_page_size, dst_page_size=p.dst_page_size,
                                  num_tokens=k, src_scale=p.src_scale, dst_scale=scale, out=self._out_buffer(k))
                stats.num_tokens += k
            elif p.src is None:
                values = self._values(rows, k)
                self._check_finite(values, t0)
                pages = encode(values, p.dst, page_size=p.dst_page_size, dialect=p.dialect, scale=scale)
                if self.report:
                    back = decode(pages, p.dst, page_size=p.dst_page_size, num_tokens=k, scale=scale)
                    stats.merge(compare_values(values, back, mult))
            else:
                try:
                    pages = transcode(rows, p.src, p.dst, src_page_size=p.src_page_size,
                                      dst_page_size=p.dst_page_size, num_tokens=k, src_scale=p.src_scale,
                                      dst_scale=scale, dialect=p.dialect, out=self._out_buffer(k))
                except NonFiniteError:
                    self._check_finite(self._values(rows, k), t0)
                    raise
                if self.report:  # decode-and-compare of both pools in one native pass (as transcode's report)
                    stats.merge(transcode_loss_stats(rows, p.src, p.src_page_size, pages, p.dst, p.dst_page_size, k,
                                                     p.src_scale, scale, p.dialect))
            self.progress(self.out.write(pages))
        if bad.count:
            raise _nonfinite_error(self.fh, p, bad.values, bad.first_token, f", field {bad.first_field!r} (byte scan)")
        return loss_report(stats, p.src, p.dst, byte_move=p.byte_move, dst_scale=scale) if self.report else None


def convert_open_dump(
    fh: DumpFile,
    plans: list[EntryPlan],
    dst: str | os.PathLike,
    *,
    overwrite: bool = False,
    report: bool = True,
    on_progress: ProgressFn | None = None,
) -> list[ConvertedEntry]:
    """Run ``plans`` (from ``plan_convert(fh, ...)``) and write dump ``dst`` atomically.

    The output is checked (and its space reserved) before any conversion work; entries stream
    through in chunks of about ``CHUNK_BYTES``, so memory stays bounded whatever their size.
    ``on_progress(done_bytes, total_bytes)`` counts the bytes read (twice for an ``auto`` scale's
    first pass) and written. Nothing is written unless every entry converts.
    """
    specs = [p.spec() for p in plans]
    total = sum(p.info.nbytes * (2 if p.dst_scale == "auto" else 1) for p in plans)
    total += sum(s.nbytes for s in specs)
    done = 0

    def progress(nbytes: int) -> None:
        nonlocal done
        done += nbytes
        if on_progress is not None:
            on_progress(done, total)

    with DumpWriter(dst, overwrite=overwrite, reserve=dump_size(specs, fh.attrs)) as out:
        converters = [_Converter(fh, p, out, report, progress) for p in plans]
        for c in converters:
            c.settle_auto_scale()
        out.begin([p.spec() for p in plans], fh.attrs)
        results = [ConvertedEntry(c.plan.info.name, c.run()) for c in converters]
        fh.check_unchanged()
        out.commit()
    return results


def convert_dump(
    src: str | os.PathLike,
    dst: str | os.PathLike,
    to_layout: str | Layout,
    *,
    page_size: int | None = None,
    dialect: str | None = None,
    scale: float | str | None = None,
    overwrite: bool = False,
    report: bool = True,
    on_progress: ProgressFn | None = None,
) -> list[ConvertedEntry]:
    """Convert every entry of dump ``src`` to ``to_layout`` and write dump ``dst`` atomically.

    ``scale`` is the destination per-tensor scale (``"auto"``: the source's own where that is a
    lossless byte move, else s = 1 or another scale that reproduces every value, else per entry the smallest
    with no saturation). ``report=False`` skips
    the loss report (the fused transcode runs; each ``ConvertedEntry.report`` is None).
    Streams in bounded memory; see ``convert_open_dump`` for ``on_progress``.
    """
    with open_dump(src) as fh:
        plans = plan_convert(fh, to_layout, page_size=page_size, dialect=dialect, scale=scale)
        return convert_open_dump(fh, plans, dst, overwrite=overwrite, report=report, on_progress=on_progress)


def _lossless_scale_of(values: torch.Tensor, dst: Layout, page_size: int, dialect: str | None) -> float | None:
    """``_lossless_scale`` of in-memory decoded ``values`` (checked finite first)."""
    check_finite(values)
    amax = float(values.abs().max()) if values.numel() else 0.0
    return _lossless_scale(lambda: (values,), amax, values[:LOSSLESS_SAMPLE_TOKENS], dst, page_size, dialect)


def convert_entry(
    entry: DumpEntry,
    to_layout: str | Layout,
    *,
    page_size: int | None = None,
    dialect: str | None = None,
    scale: float | str | None = None,
) -> tuple[DumpEntry, LossReport]:
    """Convert one in-memory entry to ``to_layout``; ``page_size`` defaults to the entry's (required for latents)."""
    dst = get_layout(to_layout)
    if entry.layout is None:
        if page_size is None:
            raise InputError(f"entry {entry.name} holds raw latents: page_size is needed to encode it")
        values = entry.data.float()
        s = (_lossless_scale_of(values, dst, page_size, dialect) or auto_scale(values)) if scale == "auto" else scale
        pages = encode(values, dst, page_size=page_size, dialect=dialect, scale=s)
        s_out = (_fp32_scale(s) or 1.0) if dst.takes_scale else None
        back = decode(pages, dst, page_size=page_size, num_tokens=entry.num_tokens, scale=s_out)
        d = dialect or dst.default_dialect
        stats = compare_values(values, back, tensor_multiplier(d, s_out) if dst.per_tensor_scale else None)
        rep = loss_report(stats, None, dst, byte_move=False, dst_scale=s_out)
        p = page_size
    else:
        p = entry.page_size if page_size is None else page_size
        src = get_layout(entry.layout)
        if scale == "auto" and is_byte_move(src, dst, entry.scale or 1.0, entry.scale or 1.0):
            scale = entry.scale
        elif scale == "auto" and dst.per_tensor_scale:  # a lossless scale where one exists (as plan_convert)
            values = decode(entry.data, src, page_size=entry.page_size, num_tokens=entry.num_tokens, scale=entry.scale)
            scale = _lossless_scale_of(values, dst, p, dialect) or scale
        pages, rep = transcode(
            entry.data, src, dst, src_page_size=entry.page_size, dst_page_size=p, num_tokens=entry.num_tokens,
            src_scale=entry.scale, dst_scale=scale, dialect=dialect, report=True,
        )
        d = entry.dialect if rep.byte_move else (dialect or dst.default_dialect)
    out = DumpEntry(entry.layer, entry.role, pages, dst.name, p, entry.num_tokens,
                    rep.dst_scale if dst.takes_scale else None, d, entry.compress_ratio)
    return out, rep


__all__ = [
    "ConvertedEntry",
    "EntryPlan",
    "convert_dump",
    "convert_entry",
    "convert_open_dump",
    "plan_convert",
]
