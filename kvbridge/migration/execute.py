"""Executing a plan: pack source entries, convert them, verify checksums, publish into destination pools.

The transports (``kvbridge.migration.transport``, ``kvbridge.migration.nixl``) run these steps: the
sender packs (and converts, when it is the side that transcodes), the receiver verifies every page
chunk's checksum, converts if it has to, and only then claims destination pages and writes them.
Nothing is claimed when any step fails. ``migrate_local`` (one process, nothing on a wire) skips
the checksums and runs staged batches instead: each batch of source rows is gathered into a small
buffer, converted there and scattered from the converted pages' parts into the destination pools
while it is still in the CPU caches; its bytes are those of the transports' steps.

Checksums: XXH3-64 (seed 0, the ``xxhash`` package) of the record bytes of each (transfer, source
page) chunk, computed by the sender before anything leaves it. XXH3 runs faster than a memory
copy on one core (zlib's CRC-32 ran at a third of a copy); it is not a cryptographic hash and
guards against corruption, not against a malicious peer.
"""

from __future__ import annotations

import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from typing import Literal

import numpy as np
import torch
import xxhash

from kvbridge import numerics as nx
from kvbridge.backends import dispatch
from kvbridge.engines.profiles import Storage
from kvbridge.errors import InputError, KVBridgeError
from kvbridge.layouts.registry import PageGeometry
from kvbridge.migration.ape import add_ape, nan_score, remove_ape, unreachable_score
from kvbridge.migration.plan import MigrationPlan, Transfer
from kvbridge.migration.pools import (
    EnginePools,
    PartSpans,
    RequestTables,
    gather_records,
    move_parts,
    part_bounds,
    part_spans,
    pool_tensors,
    scatter_records,
    table_of,
)
from kvbridge.ops import keys as ix
from kvbridge.ops import pages as page_ops
from kvbridge.ops.loss import LossReport, transcode_loss

ConvertSide = Literal["sender", "receiver"]


class MigrationError(KVBridgeError):
    """A migration that could not complete; no destination page was claimed."""


class ChecksumError(MigrationError):
    """A page chunk whose XXH3-64 checksum on arrival differs from the sender's."""


class TransferError(MigrationError):
    """The peer died, the link broke, or a timeout passed before the transfer finished."""


@dataclass
class Payload:
    """A request's entries in flight: one record tensor per plan transfer, in plan order.

    ``converted``: records are already in the destination format. ``chunks[i]`` lists the
    row counts of transfer i's page chunks and ``checksums[i]`` their XXH3-64 values.
    ``loss`` (one report per KV conversion batch), ``indexer_max_abs_error`` and
    ``state_max_abs_error`` (compressor-state rows changing dtype, fp32 -> bf16 being lossy) are
    set by a conversion that measured its loss; they are None when none did (the state error
    also when no state row changed dtype).
    """

    fingerprint: str
    converted: bool
    records: list[torch.Tensor]
    chunks: list[list[int]]
    checksums: list[list[int]]
    loss: list[LossReport] = field(default_factory=list)
    indexer_max_abs_error: float | None = None
    state_max_abs_error: float | None = None


@dataclass
class MigrationReport:
    """Outcome of one migration: bytes moved, where conversion ran, loss and timings (seconds).

    ``kv_lossless``, ``kv_max_abs_error`` (latent units) and ``indexer_max_abs_error`` are None
    when the loss was not measured (``loss_report=False``); ``state_max_abs_error`` is also None
    when no compressor-state row changed dtype; ``loss`` holds one ``LossReport``
    per KV conversion batch (byte moves have none). ``wire_s`` is the receiver's time from
    starting to wait until the last data message arrived (it includes the sender's packing).
    """

    num_tokens: int
    transfers: int
    payload_bytes: int
    converted_on: str
    kv_lossless: bool | None
    kv_max_abs_error: float | None
    indexer_max_abs_error: float | None
    pack_s: float
    convert_s: float
    wire_s: float
    publish_s: float
    loss: list[LossReport]
    state_max_abs_error: float | None = None
    #: ``migrate_local``'s staged batches: ``convert_s`` by entry kind (``kv``, ``indexer``, ``state``); empty
    #: on the transports' path.
    convert_parts_s: dict[str, float] = field(default_factory=dict)

    def to_dict(self) -> dict:
        data = asdict(self)
        data["loss"] = [r.to_dict() for r in self.loss]
        return data


def _chunk_rows(t: Transfer, storage: Storage) -> list[int]:
    """Row counts of ``t``'s entries grouped by the page of ``storage`` they sit in."""
    if storage.addressing == "ring":
        return [t.count]
    p = storage.span or storage.page_size
    bounds = [t.first] + list(range((t.first // p + 1) * p, t.first + t.count, p)) + [t.first + t.count]
    return [b - a for a, b in zip(bounds, bounds[1:], strict=False)]


#: The per-chunk checksum, as messages and the wire protocols name it.
CHECKSUM = "xxh3-64"


def xxh3_chunks(records: torch.Tensor, rows: list[int]) -> list[int]:
    """XXH3-64 (seed 0, unsigned 64-bit) of each consecutive chunk of ``rows[i]`` records (on a host copy)."""
    data = records.detach().cpu().contiguous().view(torch.uint8).numpy()
    out, start = [], 0
    for n in rows:
        out.append(xxhash.xxh3_64_intdigest(data[start : start + n]))
        start += n
    return out


#: Entries converted per call. Batching the transfers of many layers amortises per-call work;
#: the cap bounds the codecs' temporaries (a few int64 copies of 512 values per entry).
BATCH_ENTRIES = 1 << 16
#: Pieces of at least this many entries are converted on their own, straight from the gathered
#: records (no concatenation) into the transfer's output (no copy back).
ALONE_ENTRIES = 1 << 12


def _needs_conversion(t: Transfer) -> bool:
    if t.src.kind == "state":
        return t.src.fmt != t.dst.fmt or t.ape_sign != 0
    return t.conversion not in ("byte move", "byte copy")


def state_rows_to_f32(records: torch.Tensor, fmt: str) -> torch.Tensor:
    """State rows (uint8 ``[N, row_bytes]``, little-endian fp32 or bf16) -> fp32 values."""
    if fmt.endswith("bf16"):
        return nx.bf16_from_bytes(records)
    return records.contiguous().view(torch.float32)


def state_rows_from_f32(values: torch.Tensor, fmt: str) -> torch.Tensor:
    """fp32 values -> state rows in ``fmt`` (bf16: nearest-even, as the engines' ``.to(bfloat16)``)."""
    if fmt.endswith("bf16"):
        return nx.bf16_bytes(values)
    return values.contiguous().view(torch.uint8)


def _state_error(src: torch.Tensor, back: torch.Tensor) -> float:
    """Max |back - src| over finite values; +-inf scores (cleared rows) must stay the same infinity."""
    finite = torch.isfinite(src)
    if not bool((back[~finite] == src[~finite]).all()):
        raise MigrationError("a compressor-state value changed infinity on conversion")
    return float((back[finite] - src[finite]).abs().max()) if bool(finite.any()) else 0.0


def _convert_state_torch(t: Transfer, records: torch.Tensor, loss_report: bool, first: int) -> tuple[
        torch.Tensor, None, float | None]:
    """``_convert_batch``'s state rows (entries ``first, ...`` of ``t``) in torch: fp32 values, APE added or
    removed, the destination dtype; the max abs error of a dtype change (adding APE is exact) with ``loss_report``."""
    values = state_rows_to_f32(records, t.src.fmt)
    if t.ape_sign:
        where = f"layer {t.spec.layer} {t.spec.role.value}"
        pos = t.first + first
        values = add_ape(values, t.ape, pos) if t.ape_sign > 0 else \
            remove_ape(values, t.ape, pos, where, t.src.fmt.endswith("bf16"))
    out = state_rows_from_f32(values, t.dst.fmt)
    measure = loss_report and t.src.fmt != t.dst.fmt
    return out, None, _state_error(values, state_rows_to_f32(out, t.dst.fmt)) if measure else None


def _convert_state_native(t: Transfer, records: torch.Tensor, loss_report: bool, first: int) -> tuple[
        torch.Tensor, None, float | None]:
    """``_convert_batch``'s state rows on CPU: one native pass (``kvbridge.backends.native.state``), the same bytes,
    errors and refusals as ``_convert_state_torch``."""
    measure = loss_report and t.src.fmt != t.dst.fmt
    pos = t.first + first
    src_bf16 = t.src.fmt.endswith("bf16")
    res = dispatch.convert_state_rows(records, src_bf16, t.dst.fmt.endswith("bf16"), t.ape, t.ape_sign, pos, measure)
    where = f"layer {t.spec.layer} {t.spec.role.value}"
    if t.ape_sign < 0 and res.nan_row is not None:
        raise nan_score(where, pos + res.nan_row)
    if t.ape_sign < 0 and res.unreachable is not None:
        row, col = res.unreachable
        values = state_rows_to_f32(records[row : row + 1], t.src.fmt)[0]
        raise unreachable_score(where, pos + row, col, float(values[values.shape[0] // 2 + col]),
                                float(t.ape[(pos + row) % t.ape.shape[0], col]), src_bf16)
    if res.infinity_changed:
        raise MigrationError("a compressor-state value changed infinity on conversion")
    return res.rows, None, res.max_abs_error


def _convert_batch(t: Transfer, records: torch.Tensor, loss_report: bool, first: int = 0) -> tuple[
        torch.Tensor, LossReport | None, float | None]:
    """Convert records of ``t``'s kind (state rows with APE: entries ``first, first + 1, ...`` of ``t``);
    returns (records, KV loss report, indexer or state max abs error)."""
    if t.src.kind == "state":
        convert = _convert_state_native if dispatch.state_kernels(records) else _convert_state_torch
        return convert(t, records, loss_report, first)
    if t.src.kind == "indexer":
        if loss_report or ix.native_transcode_applies(records, t.src.indexer, t.dst.indexer, t.dst.dialect or ""):
            out, err = ix.transcode_keys(records, t.src.indexer, t.dst.indexer, t.dst.dialect or "",
                                         t.src.dialect)
            return out, None, err if loss_report else None
        values = ix.decode_keys(records, t.src.indexer, t.src.dialect)
        return ix.encode_keys(values, t.dst.indexer, t.dst.dialect or ""), None, None
    src, dst, n = t.src.layout, t.dst.layout, records.shape[0]
    result = page_ops.transcode(
        _one_page(src, records), src, dst, src_page_size=n, dst_page_size=n, src_scale=t.src.scale,
        dst_scale=t.dst.scale, dialect=t.dst.dialect, report=loss_report,
    )
    pages, report = result if isinstance(result, tuple) else (result, None)
    return _page_records(dst, pages, n), report, None


#: Rows per span when copying a page's parts into records (spans are spread over the threads).
SPAN_ROWS = 1 << 12


def _page_records(layout, page: torch.Tensor, n: int) -> torch.Tensor:
    """The ``n`` records ``[n, record_bytes]`` of one page of ``n`` rows (a copy): each record part's
    rows are one run of the page, copied natively in spans of ``SPAN_ROWS`` rows (torch's copies elsewhere)."""
    if not page.is_contiguous() or page.device.type != "cpu":
        return layout.pages_to_records(page, n)
    records = torch.empty(n, layout.record_bytes, dtype=torch.uint8, device=page.device)
    for _, lo, hi in layout.geometry.page_views(page, n):
        spans = np.array([(n * lo + first * (hi - lo), first, min(SPAN_ROWS, n - first))
                          for first in range(0, n, SPAN_ROWS)], np.int64).reshape(-1, 3)
        dispatch.move_rows(page, records, spans, lo, hi - lo, False)
    return records


def _one_page(layout, records: torch.Tensor) -> torch.Tensor:
    """Records ``[N, record_bytes]`` as one page of ``N`` rows: a view when the layout is token-major
    with no page padding (the records are then the page's bytes), else a copy."""
    n = records.shape[0]
    if layout.geometry.split is None and layout.page_bytes(n) == records.numel() and records.is_contiguous():
        return records.view(1, -1)
    return layout.records_to_pages(records, n)


def _concat(parts: list[torch.Tensor]) -> torch.Tensor:
    """``torch.cat`` of record tensors; on CPU through numpy (one thread): torch's multi-threaded copies of
    many small tensors wait on every thread at each one, seconds on a loaded machine (0.6 s against numpy's
    2 ms for 64 x 64 KiB measured at load 10 on 2 cores)."""
    if all(p.device.type == "cpu" for p in parts):
        return torch.from_numpy(np.concatenate([p.numpy() for p in parts]))
    return torch.cat(parts)


def _copy_into(dst: torch.Tensor, src: torch.Tensor) -> None:
    """``dst.copy_(src)``, through numpy on CPU (see ``_concat``)."""
    if dst.device.type == "cpu" and src.device.type == "cpu":
        np.copyto(dst.numpy(), src.numpy())
    else:
        dst.copy_(src)


def convert_payload(plan: MigrationPlan, payload: Payload, *, loss_report: bool = True) -> Payload:
    """Source-format records -> destination-format records (chunks follow the source pages).

    Transfers with the same conversion are converted together, ``BATCH_ENTRIES`` entries per
    call (every entry is converted on its own, so batching does not change a byte). With
    ``loss_report`` each KV batch gets a ``LossReport`` and indexer errors are measured.
    """
    if payload.converted:
        return payload
    out: list[torch.Tensor | None] = [None if _needs_conversion(t) else rec
                                      for t, rec in zip(plan.transfers, payload.records, strict=True)]
    groups: dict[tuple, list[tuple[int, int, int]]] = {}
    for i, t in enumerate(plan.transfers):
        if _needs_conversion(t):
            key = (t.src.kind, t.src.fmt, t.src.record_bytes, t.src.scale, t.src.dialect, t.conversion,
                   i if t.ape_sign else -1)  # APE rows: one transfer per batch (the bias is per layer)
            groups.setdefault(key, []).extend(
                (i, lo, min(lo + BATCH_ENTRIES, t.count)) for lo in range(0, t.count, BATCH_ENTRIES))
            if t.count > BATCH_ENTRIES:  # converted in pieces: written into one output
                out[i] = torch.empty(t.count, t.dst.record_bytes, dtype=torch.uint8)
    loss: list[LossReport] = []
    idx_err: float | None = 0.0 if loss_report else None
    state_err: float | None = None  # set once a state batch changes dtype with loss_report
    for pieces in groups.values():
        batches: list[list[tuple[int, int, int]]] = [[p] for p in pieces if p[2] - p[1] >= ALONE_ENTRIES]
        batches.append([])
        size = 0
        for piece in pieces:
            if piece[2] - piece[1] >= ALONE_ENTRIES:
                continue
            if size + piece[2] - piece[1] > BATCH_ENTRIES and batches[-1]:
                batches.append([])
                size = 0
            batches[-1].append(piece)
            size += piece[2] - piece[1]
        for batch in filter(None, batches):
            records = payload.records[batch[0][0]][batch[0][1] : batch[0][2]] if len(batch) == 1 else \
                _concat([payload.records[i][lo:hi] for i, lo, hi in batch])
            converted, report, err = _convert_batch(plan.transfers[batch[0][0]], records, loss_report, batch[0][1])
            if report is not None:
                loss.append(report)
            if err is not None and plan.transfers[batch[0][0]].src.kind == "state":
                state_err = max(state_err or 0.0, err)
            elif err is not None and idx_err is not None:
                idx_err = max(idx_err, err)
            offset = 0
            for i, lo, hi in batch:
                if hi - lo == plan.transfers[i].count:  # the whole transfer: keep the converted rows
                    out[i] = converted[offset : offset + hi - lo]
                else:
                    _copy_into(out[i][lo:hi], converted[offset : offset + hi - lo])  # type: ignore[index]
                offset += hi - lo
    records = [r if r is not None else torch.empty(0, t.dst.record_bytes, dtype=torch.uint8)
               for t, r in zip(plan.transfers, out, strict=True)]
    return Payload(payload.fingerprint, True, records, payload.chunks, payload.checksums, loss, idx_err, state_err)


def pack(plan: MigrationPlan, src: EnginePools, tables: RequestTables, *, convert: bool,
         loss_report: bool = True, checksum: bool = True) -> Payload:
    """Gather every transfer's source records, checksum them per source page, optionally convert.

    Checksums always cover the bytes that travel: with ``convert`` they are computed on the
    converted records, chunked by the source pages the entries came from. ``checksum=False``
    leaves every transfer's checksum list empty, for a sender that checksums what it stages itself
    (NIXL's sender-converted path: the destination page runs).
    """
    check_pools(plan, src, "src")
    records, chunks = [], []
    for t in plan.transfers:
        records.append(gather_records(src.pool(t.spec), t.src, table_of(tables, t.src), t.first, t.count))
        chunks.append(_chunk_rows(t, t.src))
    payload = Payload(plan.fingerprint(), False, records, chunks, [])
    if convert:
        payload = convert_payload(plan, payload, loss_report=loss_report)
    payload.checksums = [xxh3_chunks(r, c) if checksum else [] for r, c in zip(payload.records, payload.chunks,
                                                                               strict=True)]
    return payload


def verify(plan: MigrationPlan, payload: Payload) -> None:
    """Raise ``ChecksumError`` naming the first chunk whose XXH3-64 checksum does not match."""
    if payload.fingerprint != plan.fingerprint():
        raise MigrationError("payload was packed for a different plan (plan fingerprints differ)")
    n = len(plan.transfers)
    if not len(payload.records) == len(payload.chunks) == len(payload.checksums) == n:
        raise MigrationError(f"payload holds {len(payload.records)} transfers, the plan {n}")
    for t, rec, rows, sums in zip(plan.transfers, payload.records, payload.chunks, payload.checksums, strict=True):
        if len(sums) != len(rows) or sum(rows) != rec.shape[0]:
            raise MigrationError(f"layer {t.spec.layer} {t.spec.role.value}: page chunks do not cover its records")
        got = xxh3_chunks(rec, rows)
        for i, (want, have) in enumerate(zip(sums, got, strict=True)):
            if want != have:
                raise ChecksumError(
                    f"checksum mismatch in layer {t.spec.layer} {t.spec.role.value}, source page chunk {i} "
                    f"({CHECKSUM} {have:#018x}, sender sent {want:#018x}); nothing was published"
                )


def publish(plan: MigrationPlan, payload: Payload, dst: EnginePools) -> RequestTables:
    """Claim the request's destination pages and write every converted record into them."""
    check_pools(plan, dst, "dst")
    if not payload.converted:
        raise MigrationError("publish needs converted records; call convert_payload first")
    tables = dst.claim(plan.table_lengths("dst"), plan.released("dst"))
    try:
        for t, rec in zip(plan.transfers, payload.records, strict=True):
            scatter_records(dst.pool(t.spec), t.dst, table_of(tables, t.dst), t.first, rec)
    except Exception:
        dst.release(tables)
        raise
    return tables


def check_block_tables(plan: MigrationPlan, tables: object, what: str) -> None:
    """Refuse block tables that are not ``{name: [page id, ...]}`` with every table the plan's
    source needs, page ids integers >= 0 (or -1: released), no page named twice in a table."""
    if not isinstance(tables, dict):
        raise InputError(f"{what} must map block-table names to lists of page ids, got {type(tables).__name__}")
    for name in plan.table_lengths("src"):
        if name not in tables:
            raise InputError(f"{what} has no block table {name!r} (it has: {', '.join(map(str, tables)) or 'none'})")
        table = tables[name]
        if isinstance(table, (str, bytes)) or not isinstance(table, (list, tuple)):
            raise InputError(f"{what}[{name!r}] must be a list of page ids, got {type(table).__name__}")
        seen: dict[int, int] = {}
        for i, page in enumerate(table):
            if isinstance(page, bool) or not isinstance(page, int):
                raise InputError(f"{what}[{name!r}][{i}] is {repr(page)[:40]}, not an integer page id")
            if page < -1:
                raise InputError(f"{what}[{name!r}][{i}] is {page}: page ids are >= 0, or -1 for a released block")
            if page >= 0 and page in seen:
                raise InputError(f"{what}[{name!r}] names page {page} twice (indices {seen[page]} and {i})")
            seen[page] = i


def check_pools(plan: MigrationPlan, pools: EnginePools, side: str) -> None:
    """Refuse pools of another engine profile or model than ``plan``'s ``side`` (``src``/``dst``)."""
    profile = plan.src if side == "src" else plan.dst
    if pools.profile.spec != profile.spec or pools.model.compress_ratios != plan.model.compress_ratios:
        raise InputError(f"{side} pools are {pools.profile.spec} / {pools.model.name}; the plan wants "
                         f"{profile.spec} / {plan.model.name}")


def finish(plan: MigrationPlan, payload: Payload, dst: EnginePools, *, converted_on: str, pack_s: float,
           wire_s: float, loss_report: bool = True) -> tuple[RequestTables, MigrationReport]:
    """Verify, convert (if not yet), publish; the common tail of local and remote migration."""
    verify(plan, payload)
    t0 = time.perf_counter()
    converted = convert_payload(plan, payload, loss_report=loss_report)
    t1 = time.perf_counter()
    tables = publish(plan, converted, dst)
    t2 = time.perf_counter()
    loss = converted.loss
    measured = converted.indexer_max_abs_error is not None
    report = MigrationReport(
        num_tokens=plan.num_tokens,
        transfers=len(plan.transfers),
        payload_bytes=sum(r.numel() for r in payload.records),
        converted_on=converted_on,
        kv_lossless=all(r.lossless for r in loss) if measured else None,
        kv_max_abs_error=max((r.max_abs_error for r in loss), default=0.0) if measured else None,
        indexer_max_abs_error=converted.indexer_max_abs_error,
        pack_s=pack_s,
        convert_s=t1 - t0,
        wire_s=wire_s,
        publish_s=t2 - t1,
        loss=loss,
        state_max_abs_error=converted.state_max_abs_error,
    )
    return tables, report


def migrate_local(plan: MigrationPlan, src: EnginePools, src_tables: RequestTables, dst: EnginePools, *,
                  convert_on: ConvertSide = "receiver", loss_report: bool = True
                  ) -> tuple[RequestTables, MigrationReport]:
    """Run ``plan`` in one process: returns the request's destination block tables and a report.

    Nothing crosses a wire, so nothing is checksummed: entries move in staged batches of about
    ``STAGE_BYTES`` source bytes, each gathered from the source pages, converted and scattered into
    the destination pages while it is still in the CPU caches (pools whose tensors are not contiguous
    take the transports' path: pack, verify, convert, publish). Destination pages are claimed once
    every source page was found; a conversion that fails (a NaN/Inf source) releases them again.
    ``convert_on`` only names the side in the report (``"sender"``: ``pack_s`` then includes the
    conversion, ``payload_bytes`` counts destination bytes). ``loss_report=False`` skips measuring
    the conversion loss (faster; the bytes are the same).
    """
    if convert_on not in ("sender", "receiver"):
        raise InputError(f"convert_on must be 'sender' or 'receiver', got {convert_on!r}")
    if not isinstance(plan, MigrationPlan):
        raise InputError(f"plan must be a MigrationPlan (see plan_migration), got {type(plan).__name__}")
    for pools, side in ((src, "src"), (dst, "dst")):
        if not isinstance(pools, EnginePools):
            raise InputError(f"{side} must be EnginePools, got {type(pools).__name__}")
    check_block_tables(plan, src_tables, "src_tables")
    check_pools(plan, dst, "dst")
    check_pools(plan, src, "src")
    staged = _stage(plan, src, src_tables, dst)
    if staged is None:
        t0 = time.perf_counter()
        payload = pack(plan, src, src_tables, convert=convert_on == "sender", loss_report=loss_report)
        return finish(plan, payload, dst, converted_on=convert_on, pack_s=time.perf_counter() - t0, wire_s=0.0,
                      loss_report=loss_report)
    return _run_staged(plan, staged, dst, convert_on, loss_report)


#: Source bytes per staged batch of ``migrate_local`` (KV: 8,192 entries, 4 MiB in, 4.6 MiB out), small
#: enough that a batch's gathered, converted and published rows stay in the CPU caches.
STAGE_BYTES = 4 << 20

#: A stage form: (rows ``[n, width]``, record bytes lo, hi) per part of a batch of n entries.
Form = list[tuple[torch.Tensor, int, int]]


@dataclass
class _Piece:
    """Entries ``[first, first + count)`` of transfer ``index``, at row ``offset`` of its batch."""

    index: int
    first: int
    count: int
    offset: int
    src: list[PartSpans] = field(default_factory=list)
    dst: list[PartSpans] = field(default_factory=list)


@dataclass
class _Batch:
    """Pieces converted by one call: ``rows`` entries, staged as one page of ``rows`` rows of a page geometry
    (``src_page``/``dst_page``: the parts' rows in turn), or as records (None)."""

    transfer: Transfer
    rows: int
    pieces: list[_Piece]
    src_page: PageGeometry | None
    dst_page: PageGeometry | None


@dataclass
class _Staged:
    batches: list[_Batch]
    src_buf: torch.Tensor
    dst_buf: torch.Tensor


def _bounds(geometry: PageGeometry) -> list[tuple[int, int]]:
    """Record byte ranges of the parts of a page of ``geometry``."""
    return geometry.part_bounds()


def _form(buf: torch.Tensor, geometry: PageGeometry | None, n: int, record_bytes: int) -> Form:
    """The batch's rows in ``buf``: the parts of one page of ``n`` rows of ``geometry``, or ``n`` records."""
    if geometry is None:
        return [(buf[: n * record_bytes].view(n, record_bytes), 0, record_bytes)]
    page = buf[: geometry.page_bytes(n)].view(1, -1)
    return [(view[0], lo, hi) for view, lo, hi in geometry.page_views(page, n)]


def _native_keys(t: Transfer) -> bool:
    """Whether ``t``'s indexer keys are converted by the native fp4 -> fp8 kernel (straight between page parts)."""
    probe = torch.empty(0, t.src.record_bytes, dtype=torch.uint8)
    return t.src.kind == "indexer" and _needs_conversion(t) and ix.native_transcode_applies(
        probe, t.src.indexer, t.dst.indexer, t.dst.dialect or "")


def _fits(bounds: list[tuple[int, int]], form_bounds: list[tuple[int, int]]) -> bool:
    """Whether every pool part lies inside one part of the stage form."""
    return all(any(flo <= lo and hi <= fhi for flo, fhi in form_bounds) for lo, hi in bounds)


def _rows(spans: list[PartSpans], form: Form, offset: int, count: int) -> list[tuple[torch.Tensor, int]]:
    """For each pool part: the stage rows holding it and its byte offset in them."""
    out = []
    for _, lo, width, _ in spans:
        rows, flo = next((r, flo) for r, flo, fhi in form if flo <= lo and lo + width <= fhi)
        out.append((rows[offset : offset + count], lo - flo))
    return out


def _key_streams(form: Form, key_bytes: int) -> tuple[tuple[torch.Tensor, int], tuple[torch.Tensor, int]]:
    """(flat tensor, row stride) of the key codes and of the scale bytes of staged indexer keys: a page's two
    parts, or records holding both (codes first, ``key_bytes`` of them)."""
    if len(form) == 2:
        return tuple((rows.view(-1), rows.shape[1]) for rows, _, _ in form)  # type: ignore[return-value]
    rows = form[0][0]
    flat = rows.view(-1)
    return (flat, rows.shape[1]), (flat[key_bytes:], rows.shape[1])


def _convert_key_parts(t: Transfer, src_form: Form, dst_form: Form, measure: bool) -> float:
    """fp4 -> fp8 indexer keys from the source page parts (codes, scale bytes) into the destination's; the
    max abs error (0.0 unless ``measure``). Keys that decode to NaN/Inf go to ``indexer.transcode_keys``,
    which refuses them."""
    dim = t.dst.indexer.dim
    n = src_form[0][0].shape[0]
    (src_keys, src_stride), (src_scales, src_scale_stride) = _key_streams(src_form, dim // 2)
    (dst_keys, dst_stride), (dst_scales, dst_scale_stride) = _key_streams(dst_form, dim)
    err = dispatch.fp4_to_fp8_key_rows(src_keys, src_stride, src_scales, src_scale_stride, n, dst_keys, dst_stride,
                                       dst_scales, dst_scale_stride, dim, t.dst.dialect or "", measure=measure)
    if err is None:
        records = torch.cat([rows for rows, _, _ in src_form], dim=1)
        ix.transcode_keys(records, t.src.indexer, t.dst.indexer, t.dst.dialect or "", t.src.dialect)
        raise MigrationError("indexer keys the native kernel refused were accepted by the torch path")
    return err


def _stage(plan: MigrationPlan, src: EnginePools, tables: RequestTables, dst: EnginePools) -> _Staged | None:
    """Cut the plan into staged batches and find every source page (``InputError`` for a table that does not
    hold its entries); None when a pool tensor is not contiguous or a pool part does not fit the stage form."""
    if not all(t.is_contiguous() for pools in (src, dst) for pool in pools.pools.values() for t in pool_tensors(pool)):
        return None
    groups: dict[tuple, list[tuple[int, int, int]]] = {}
    forms_of: dict[tuple, tuple] = {}
    for i, t in enumerate(plan.transfers):
        paged = (t.src.kind == "kv" and _needs_conversion(t)) or _native_keys(t)
        same_pages = t.src.kind == "kv" and not paged and _bounds(t.src.geometry) == _bounds(t.dst.geometry)
        forms = (t.src.geometry, t.dst.geometry) if paged else (t.src.geometry,) * 2 if same_pages else (None, None)
        key = (t.src.kind, t.src.fmt, t.src.record_bytes, t.src.scale, t.src.dialect, t.conversion, t.dst.fmt,
               t.dst.record_bytes, t.dst.scale, t.dst.dialect, *forms, i if t.ape_sign else -1)
        for (pool, storage), form in ((src.pool(t.spec), t.src), forms[0]), ((dst.pool(t.spec), t.dst), forms[1]):
            want = _bounds(form) if form is not None else [(0, storage.record_bytes)]
            if not _fits(part_bounds(pool, storage), want):
                return None
        step = max(1, STAGE_BYTES // t.src.record_bytes)
        groups.setdefault(key, []).extend((i, lo, min(step, t.count - lo)) for lo in range(0, t.count, step))
        forms_of[key] = (step, *forms)
    batches: list[_Batch] = []
    src_bytes = dst_bytes = 0
    for key, pieces in groups.items():
        step, src_page, dst_page = forms_of[key]
        current: _Batch | None = None
        for i, lo, count in pieces:
            if current is None or current.rows + count > step:
                current = _Batch(plan.transfers[i], 0, [], src_page, dst_page)
                batches.append(current)
            t = plan.transfers[i]
            spans = part_spans(src.pool(t.spec), t.src, table_of(tables, t.src), t.first + lo, count)
            assert spans is not None  # contiguous pools, checked above
            current.pieces.append(_Piece(i, lo, count, current.rows, spans))
            current.rows += count
    for b in batches:
        t = b.transfer
        src_bytes = max(src_bytes, b.src_page.page_bytes(b.rows) if b.src_page else b.rows * t.src.record_bytes)
        dst_bytes = max(dst_bytes, b.dst_page.page_bytes(b.rows) if b.dst_page else b.rows * t.dst.record_bytes)
    return _Staged(batches, torch.empty(src_bytes, dtype=torch.uint8), torch.empty(dst_bytes, dtype=torch.uint8))


def _run_staged(plan: MigrationPlan, staged: _Staged, dst: EnginePools, convert_on: ConvertSide,
                loss_report: bool) -> tuple[RequestTables, MigrationReport]:
    """Claim the destination pages, then gather, convert and scatter batch by batch. With ``loss_report`` a
    KV batch's loss statistics run on a worker thread (their kernels release the GIL) while the next
    batches are gathered, converted and scattered; the stage buffers alternate between two pairs so that
    a batch's are not overwritten before its statistics are done."""
    t0 = time.perf_counter()
    tables = dst.claim(plan.table_lengths("dst"), plan.released("dst"))
    idx_err: float | None = 0.0 if loss_report else None
    state_err: float | None = None
    gather_s = convert_s = 0.0
    parts: dict[str, float] = {}
    buffers = [(staged.src_buf, staged.dst_buf)]
    if loss_report:
        buffers.append((torch.empty_like(staged.src_buf), torch.empty_like(staged.dst_buf)))
    busy: list[Future | None] = [None] * len(buffers)  # the statistics still reading each pair
    reports: list[Future] = []
    try:
        for b in staged.batches:
            for piece in b.pieces:
                t = plan.transfers[piece.index]
                piece.dst = part_spans(dst.pool(t.spec), t.dst, table_of(tables, t.dst), t.first + piece.first,
                                       piece.count) or []
        publish_s = time.perf_counter() - t0
        with ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvbridge-loss") as stats:
            for i, b in enumerate(staged.batches):
                t = b.transfer
                t1 = time.perf_counter()
                k = i % len(buffers)
                if busy[k] is not None:
                    busy[k].result()
                    busy[k] = None
                src_buf, dst_buf = buffers[k]
                src_form = _form(src_buf, b.src_page, b.rows, t.src.record_bytes)
                for piece in b.pieces:
                    move_parts(piece.src, _rows(piece.src, src_form, piece.offset, piece.count), False)
                t2 = time.perf_counter()
                if not _needs_conversion(t):
                    dst_form = src_form
                elif b.dst_page is not None and t.src.kind == "kv":
                    dst_form = _form(dst_buf, b.dst_page, b.rows, t.dst.record_bytes)
                    pages = src_buf[: b.src_page.page_bytes(b.rows)].view(1, -1)
                    out = dst_buf[: b.dst_page.page_bytes(b.rows)].view(1, -1)
                    page_ops.transcode(pages, t.src.layout, t.dst.layout, src_page_size=b.rows,
                                       dst_page_size=b.rows, src_scale=t.src.scale, dst_scale=t.dst.scale,
                                       dialect=t.dst.dialect, out=out)
                    if loss_report:
                        busy[k] = stats.submit(transcode_loss, pages, t.src.layout, b.rows, out, t.dst.layout, b.rows,
                                               b.rows, t.src.scale, t.dst.scale, t.dst.dialect)
                        reports.append(busy[k])
                elif b.dst_page is not None:
                    dst_form = _form(dst_buf, b.dst_page, b.rows, t.dst.record_bytes)
                    err = _convert_key_parts(t, src_form, dst_form, loss_report)
                    if idx_err is not None:
                        idx_err = max(idx_err, err)
                else:
                    converted, _, err = _convert_batch(t, src_form[0][0], loss_report, b.pieces[0].first)
                    dst_form = [(converted.contiguous(), 0, t.dst.record_bytes)]
                    if err is not None and t.src.kind == "state":
                        state_err = max(state_err or 0.0, err)
                    elif err is not None and idx_err is not None:
                        idx_err = max(idx_err, err)
                t3 = time.perf_counter()
                for piece in b.pieces:
                    move_parts(piece.dst, _rows(piece.dst, dst_form, piece.offset, piece.count), True)
                gather_s += t2 - t1
                convert_s += t3 - t2
                if _needs_conversion(t):
                    parts[t.src.kind] = parts.get(t.src.kind, 0.0) + t3 - t2
                publish_s += time.perf_counter() - t3
            t4 = time.perf_counter()
            loss: list[LossReport] = [f.result() for f in reports]  # in batch order
            if reports:  # the statistics' time not hidden behind the batches counts as KV conversion
                waited = time.perf_counter() - t4
                convert_s += waited
                parts["kv"] = parts.get("kv", 0.0) + waited
    except Exception:
        dst.release(tables)
        raise
    sender = convert_on == "sender"
    report = MigrationReport(
        num_tokens=plan.num_tokens,
        transfers=len(plan.transfers),
        payload_bytes=sum(t.dst_bytes if sender else t.src_bytes for t in plan.transfers),
        converted_on=convert_on,
        kv_lossless=all(r.lossless for r in loss) if loss_report else None,
        kv_max_abs_error=max((r.max_abs_error for r in loss), default=0.0) if loss_report else None,
        indexer_max_abs_error=idx_err,
        pack_s=gather_s + convert_s if sender else gather_s,
        convert_s=0.0 if sender else convert_s,
        wire_s=0.0,
        publish_s=publish_s,
        loss=loss,
        state_max_abs_error=state_err,
        convert_parts_s=parts,
    )
    return tables, report


def fill_synthetic(plan: MigrationPlan, src: EnginePools, tables: RequestTables, *, seed: int = 0) -> None:
    """Write a synthetic request into source pools with the source engine's own writers.

    KV: latents ~ N(0, 1) per dim (bf16-rounded), a few tokens scaled by 2^-12 to exercise small
    tiles, encoded with ``kvbridge.encode`` in the engine's dialect and scale; indexer keys
    ~ N(0, 1) encoded by the engine's rule; state rows ~ N(0, 1) in the engine's state dtype,
    every fifth row cleared (kv 0, score -inf) as the engines clear unused rows; a source that
    stores score + APE gets the plan's APE added to the raw scores, as that engine writes them.
    """
    gen = torch.Generator().manual_seed(seed)
    for t in plan.transfers:
        st = t.src
        if st.kind == "kv":
            x = torch.randn(t.count, 512, generator=gen).bfloat16().float()
            x[::7] *= 2.0**-12
            pages = page_ops.encode(x, st.layout, page_size=t.count, dialect=st.dialect, scale=st.scale)
            rec = st.layout.pages_to_records(pages, t.count)
        elif st.kind == "indexer":
            rec = ix.encode_keys(torch.randn(t.count, t.spec.width, generator=gen), st.indexer, st.dialect or "")
        else:
            width = st.record_bytes // (2 if st.fmt.endswith("bf16") else 4)
            rows = torch.randn(t.count, width, generator=gen)
            if not st.fmt.startswith("online"):
                rows[::5, : width // 2] = 0.0
                rows[::5, width // 2 :] = float("-inf")
            if t.ape_sign < 0:  # the source stores score + APE
                rows = add_ape(rows, t.ape, t.first)
            rec = state_rows_from_f32(rows, st.fmt)
        scatter_records(src.pool(t.spec), st, table_of(tables, st), t.first, rec)


def source_request(plan: MigrationPlan, *, spare_pages: int = 0, seed: int = 0) -> tuple[EnginePools, RequestTables]:
    """Source pools holding one synthetic request of ``plan`` (scattered page ids, released SWA blocks).

    Each table has room for the pages the request holds plus ``spare_pages``.
    """
    held = plan.held_pages("src")
    pools = EnginePools.create(plan.src, plan.model, {k: v + spare_pages for k, v in held.items()},
                               include_mtp=plan.include_mtp, seed=seed)
    tables = pools.claim(plan.table_lengths("src"), plan.released("src"))
    fill_synthetic(plan, pools, tables, seed=seed)
    return pools, tables


def destination_pools(plan: MigrationPlan, *, spare_pages: int = 0, seed: int | None = 1) -> EnginePools:
    """Empty destination pools with room for the pages ``plan``'s request holds plus ``spare_pages`` per table."""
    held = plan.held_pages("dst")
    return EnginePools.create(plan.dst, plan.model, {k: v + spare_pages for k, v in held.items()},
                              include_mtp=plan.include_mtp, seed=seed)

