"""Record-level conversion: N records ``[N, record_bytes]`` (uint8) of one format -> N records of another.

Migration moves entries as records (one row per entry, every byte of the entry in it), never as pages:
KV records convert through the page kernels of ``kvbridge.backends.dispatch`` run on a token-major,
unpadded view of the layouts (``record_layout``: the same record, so the same compiled segments and the
same accelerators), so N records are pages of ``RECORD_PAGE_ROWS`` rows (and one of the rest) and nothing is
copied into or out of a page form; indexer keys convert through ``kvbridge.ops.keys``. Every record converts on
its own, so batching records of many transfers together does not change a byte.
"""

from __future__ import annotations

import torch

from kvbridge.backends import dispatch
from kvbridge.errors import InputError
from kvbridge.layouts.registry import MAX_PAGE_SIZE, Layout
from kvbridge.ops import keys as ix
from kvbridge.ops import pages as page_ops
from kvbridge.ops.checks import _check_dialect, _check_scale
from kvbridge.ops.loss import LossReport, transcode_loss
from kvbridge.ops.pages import check_copies, is_byte_move, record_layout

#: Rows per page of the record view a conversion runs on (its last page holds the rest): the native kernels'
#: unit of work (``CHUNK_TOKENS``), so that one batch of records spreads over their threads.
RECORD_PAGE_ROWS = 256


def convert_kv_records(records: torch.Tensor, src: Layout, dst: Layout, *, src_scale: float, dst_scale: float,
                       dialect: str | None, out: torch.Tensor | None = None, report: bool = False,
                       what: str = "source record", first: int = 0) -> tuple[torch.Tensor, LossReport | None]:
    """At most ``MAX_PAGE_SIZE`` KV records of ``src`` -> records of ``dst`` (into ``out``, ``[N, dst.record_bytes]``,
    when given), on the records' device's backend; with ``report`` their ``LossReport`` (else None). NaN/Inf in the
    source raises ``NonFiniteError`` (``out`` may then be partly written). A source with mirrors whose two copies
    disagree raises ``CopyMismatchError`` naming ``what`` and ``first`` + the record's row before ``out`` is touched
    (all records checked first; a byte move compares nothing)."""
    n = records.shape[0]
    if n > MAX_PAGE_SIZE:
        raise InputError(f"{n} records in one conversion; convert at most {MAX_PAGE_SIZE} per call")
    out = torch.empty(n, dst.record_bytes, dtype=torch.uint8, device=records.device) if out is None else out
    if n == 0:
        return out, None
    records = records.contiguous()
    checked = src.mirrors and not is_byte_move(src, dst, src_scale, dst_scale)
    if checked:  # every record before any is written; then the kernels directly (transcode would compare again)
        s_in, s_out = _check_scale(src_scale, src, "src_scale"), _check_scale(dst_scale, dst, "dst_scale")
        check_copies(records, src, s_in, what, first)
        d = _check_dialect(dialect, dst)
    whole = n - n % RECORD_PAGE_ROWS
    for lo, hi, rows in ((0, whole, RECORD_PAGE_ROWS), (whole, n, n - whole)):
        if hi > lo and checked:
            dispatch.transcode_pages(records[lo:hi].view(-1, rows * src.record_bytes), record_layout(src), rows,
                                     record_layout(dst), rows, None, s_in, s_out, d,
                                     out=out[lo:hi].view(-1, rows * dst.record_bytes))
        elif hi > lo:  # pages of ``rows`` records: the same bytes, in units the kernels spread over their threads
            page_ops.transcode(records[lo:hi].view(-1, rows * src.record_bytes), record_layout(src),
                               record_layout(dst), src_page_size=rows, dst_page_size=rows, src_scale=src_scale,
                               dst_scale=dst_scale, dialect=dialect, out=out[lo:hi].view(-1, rows * dst.record_bytes))
    if not report:
        return out, None
    return out, kv_loss(records, out, src, dst, src_scale=src_scale, dst_scale=dst_scale, dialect=dialect)


def kv_loss(records: torch.Tensor, converted: torch.Tensor, src: Layout, dst: Layout, *, src_scale: float,
            dst_scale: float, dialect: str | None) -> LossReport:
    """The ``LossReport`` of ``convert_kv_records(records, ...) -> converted`` (records ``[N, rb]``, contiguous; both
    decoded and compared, nothing written): the report ``kvbridge.transcode(report=True)`` gives on those entries."""
    n = records.shape[0]
    return transcode_loss(records.reshape(1, -1), record_layout(src), n, converted.reshape(1, -1), record_layout(dst),
                          n, n, src_scale, dst_scale, dialect)


def convert_key_records(records: torch.Tensor, src: ix.IndexerFormat, dst: ix.IndexerFormat, *, rule: str,
                        src_rule: str | None, measure: bool) -> tuple[torch.Tensor, float | None]:
    """Indexer key records of ``src`` -> records of ``dst`` written by ``rule``; the max |decoded error| with
    ``measure`` (None without). Keys that decode to NaN/Inf are refused (``kvbridge.ops.keys``)."""
    if not measure and ix.native_transcode_applies(records, src, dst, rule):
        done = dispatch.fp4_to_fp8_keys(records.contiguous(), dst.dim, rule, measure=False)
        if done is not None:  # else a value decodes to NaN/Inf: transcode_keys' torch path refuses it
            return done[0], None
    if measure or ix.native_transcode_applies(records, src, dst, rule):
        out, err = ix.transcode_keys(records, src, dst, rule, src_rule)
        return out, err if measure else None
    return ix.encode_keys(ix.decode_keys(records, src, src_rule), dst, rule), None
