"""Executing a plan: gather source entries, convert them, verify checksums, publish into destination pools.

Every migration runs the same stages on records (one row per entry; ``kvbridge.ops.records`` converts them,
on the device's backend): the transports (``kvbridge.migration.transport``, ``kvbridge.migration.nixl``) call
``pack`` on the sender (gathering with the checksums in the same pass, converting when it is the side that
transcodes) and ``finish`` or ``RequestAssembly`` on the receiver; ``migrate_local`` (one process, nothing
on a wire, no checksum) runs staged batches: each batch of source rows is gathered into a small buffer,
converted there and scattered into the destination pools while it is still in the CPU caches (byte moves, fp4 ->
fp8 indexer keys and, where the backend has a segment kernel and no loss is measured, KV records go straight from
the source pages into the destination pages instead: ``_direct``). ``finish``
runs those batches straight from the payload's records, verifying each page chunk's checksum just before
its rows are converted and published. Destination pages are claimed only once every source page was found;
a refused conversion or checksum releases them again (nothing is published).

Checksums: XXH3-64 (seed 0, the ``xxhash`` package) of the record bytes of each (transfer, source
page) chunk, computed by the sender before anything leaves it. XXH3 runs faster than a memory
copy on one core (zlib's CRC-32 ran at a third of a copy); it is not a cryptographic hash and
guards against corruption, not against a malicious peer.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from typing import Literal

import numpy as np
import torch

from kvbridge.backends import dispatch
from kvbridge.backends.reference import SpanMove
from kvbridge.engines.profiles import Storage
from kvbridge.errors import InputError
from kvbridge.migration.errors import ChecksumError, MigrationError
from kvbridge.migration.plan import MigrationPlan, Transfer
from kvbridge.migration.pools import (
    EnginePools,
    PartSpans,
    RequestTables,
    RunCache,
    coalesce_segments,
    gather_records,
    merge_spans,
    move_parts,
    part_spans,
    pool_tensors,
    scatter_records,
    table_of,
)
from kvbridge.migration.rows import CHECKSUM, chunk_rows, convert_batch, needs_conversion, xxh3_chunks, xxh3_spans
from kvbridge.migration.staging import staging_empty
from kvbridge.ops import keys as ix
from kvbridge.ops import records as record_ops
from kvbridge.ops.loss import LossReport

ConvertSide = Literal["sender", "receiver"]


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


#: Entries converted per call. Batching the transfers of many layers amortises per-call work;
#: the cap bounds the codecs' temporaries (a few int64 copies of 512 values per entry).
BATCH_ENTRIES = 1 << 16
#: Pieces of at least this many entries are converted on their own, straight from the gathered
#: records (no concatenation) into the transfer's output (no copy back).
ALONE_ENTRIES = 1 << 12


def group_key(i: int, t: Transfer) -> tuple:
    """Transfers whose entries convert in one batch share this key: the same formats both sides (APE rows: one
    transfer per key, the bias is per layer)."""
    return (t.src.kind, t.src.fmt, t.src.record_bytes, t.src.scale, t.src.dialect, t.conversion, t.dst.fmt,
            t.dst.record_bytes, t.dst.scale, t.dst.dialect, i if t.ape_sign else -1)


#: A piece of a batch: entries ``[first, first + count)`` of transfer ``index``.
Piece = tuple[int, int, int]


def batches(plan: MigrationPlan, indices: list[int], rows_of: Callable[[Transfer], int],
            alone: int | None = None) -> list[list[Piece]]:
    """Transfers ``indices`` of ``plan`` cut into batches of at most ``rows_of(t)`` entries of one ``group_key``;
    pieces of at least ``alone`` entries make a batch of their own (converted straight from and into their
    transfer)."""
    groups: dict[tuple, list[Piece]] = {}
    for i in indices:
        t = plan.transfers[i]
        rows = rows_of(t)
        groups.setdefault(group_key(i, t), []).extend(
            (i, lo, min(rows, t.count - lo)) for lo in range(0, t.count, rows))
    out: list[list[Piece]] = []
    for pieces in groups.values():
        rows = rows_of(plan.transfers[pieces[0][0]])
        size = rows  # no open batch yet
        for piece in pieces:
            if alone is not None and piece[2] >= alone:
                out.append([piece])
                continue
            if size + piece[2] > rows:
                out.append([])
                size = 0
            out[-1].append(piece)
            size += piece[2]
    return out


class _Loss:
    """What conversions measured: KV loss reports, the indexer and state max abs errors (None: not measured)."""

    def __init__(self, measured: bool) -> None:
        self.reports: list[LossReport] = []
        self.measured = measured
        self.indexer: float | None = 0.0 if measured else None
        self.state: float | None = None  # set once a state batch changes dtype while measured

    def add(self, t: Transfer, report: LossReport | None, err: float | None) -> None:
        if report is not None:
            self.reports.append(report)
        if err is not None and t.src.kind == "state":
            self.state = max(self.state or 0.0, err)
        elif err is not None and self.indexer is not None:
            self.indexer = max(self.indexer, err)


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
    call (every entry is converted on its own, so batching does not change a byte); a piece of at least
    ``ALONE_ENTRIES`` entries converts straight from its records into its transfer's output. With
    ``loss_report`` each KV batch gets a ``LossReport`` and indexer errors are measured.
    """
    if payload.converted:
        return payload
    todo = [i for i, t in enumerate(plan.transfers) if needs_conversion(t)]
    out: list[torch.Tensor | None] = list(payload.records)
    for i in todo:
        t = plan.transfers[i]
        out[i] = torch.empty(t.count, t.dst.record_bytes, dtype=torch.uint8, device=payload.records[i].device) \
            if t.count > BATCH_ENTRIES else None  # converted in pieces: written into one output
    loss = _Loss(loss_report)
    for batch in batches(plan, todo, lambda _: BATCH_ENTRIES, ALONE_ENTRIES):
        i, lo, count = batch[0]
        t = plan.transfers[i]
        whole = out[i] is None and count == t.count
        if len(batch) == 1:
            target = None if whole or t.src.kind != "kv" else out[i][lo : lo + count]  # type: ignore[index]
            converted, report, err = convert_batch(t, payload.records[i][lo : lo + count], loss_report, lo, target)
        else:
            records = _concat([payload.records[j][a : a + n] for j, a, n in batch])
            converted, report, err = convert_batch(t, records, loss_report, lo)
        loss.add(t, report, err)
        offset = 0
        for j, a, n in batch:
            if out[j] is None:  # the whole transfer: keep the converted rows
                out[j] = converted[offset : offset + n]
            elif converted.data_ptr() != out[j][a:].data_ptr():  # type: ignore[index]
                _copy_into(out[j][a : a + n], converted[offset : offset + n])  # type: ignore[index]
            offset += n
    records = [r if r is not None else torch.empty(0, t.dst.record_bytes, dtype=torch.uint8)
               for t, r in zip(plan.transfers, out, strict=True)]
    return Payload(payload.fingerprint, True, records, payload.chunks, payload.checksums, loss.reports, loss.indexer,
                   loss.state)


def _gatherable(pool) -> bool:
    """Whether ``_summed_gather`` reads ``pool``: CPU tensors, all contiguous."""
    tensors = pool_tensors(pool)
    return tensors[0].device.type == "cpu" and all(x.is_contiguous() for x in tensors)


def _summed_gather(pool, storage: Storage, table, first: int, count: int, rows: list[int], out: torch.Tensor
                   ) -> list[int]:
    """Records of entries ``[first, first + count)`` into ``out`` (uint8 ``[count, record_bytes]``) and the XXH3-64
    of each chunk of ``rows[k]`` of them, in one pass: batches of whole chunks of about ``STAGE_BYTES`` are
    gathered, then checksummed while they are still in the CPU caches (a ``_gatherable`` pool)."""
    rb = storage.record_bytes
    data = memoryview(out.view(-1).numpy())
    step = max(1, STAGE_BYTES // rb)
    sums: list[int] = []
    lo = k = 0
    while k < len(rows):
        n, stop = rows[k], k + 1
        while stop < len(rows) and n + rows[stop] <= step:
            n, stop = n + rows[stop], stop + 1
        spans = part_spans(pool, storage, table, first + lo, n)
        assert spans is not None  # contiguous, checked by _gatherable
        move_parts(spans, _rows(spans, out, lo, n), False)
        sums += xxh3_spans(data, lo * rb, rows[k:stop], rb)
        lo, k = lo + n, stop
    return sums


def pack(plan: MigrationPlan, src: EnginePools, tables: RequestTables, *, convert: bool,
         loss_report: bool = True, checksum: bool = True, into: Sequence[torch.Tensor] | None = None) -> Payload:
    """Gather every transfer's source records, checksum them per source page, optionally convert.

    Checksums always cover the bytes that travel: with ``convert`` they are computed on the
    converted records, chunked by the source pages the entries came from; without, in the gathering
    pass (``_summed_gather``, every transfer's records in one block of the staging cache,
    ``kvbridge.migration.staging``). ``checksum=False`` leaves every transfer's checksum list empty, for a
    sender that checksums what it stages itself (NIXL's sender-converted path: the destination page runs).
    ``into``: per transfer, the uint8 CPU tensor ``[count, record_bytes]`` its records are gathered into on that
    fused path instead (a transport's registered staging buffer: no copy from the cache's block into it).
    """
    check_pools(plan, src, "src")
    fused = [checksum and not convert and _gatherable(src.pool(t.spec)) for t in plan.transfers]
    if into is not None:
        if len(into) != len(plan.transfers) or any(
                tuple(x.shape) != (t.count, t.src.record_bytes) or x.dtype != torch.uint8 or x.device.type != "cpu"
                or not x.is_contiguous() for t, x in zip(plan.transfers, into, strict=False)):
            raise InputError("pack's into= needs one contiguous uint8 CPU tensor [count, source record bytes] per "
                             "transfer of the plan")
    block = staging_empty(0 if into is not None else
                          sum(t.count * t.src.record_bytes for t, f in zip(plan.transfers, fused, strict=True) if f))
    records, chunks, sums = [], [], []
    at = 0
    for k, (t, f) in enumerate(zip(plan.transfers, fused, strict=True)):
        rows = chunk_rows(t, t.src)
        pool, table = src.pool(t.spec), table_of(tables, t.src)
        summed = None
        if f:
            nbytes = t.count * t.src.record_bytes
            rec = into[k] if into is not None else block[at : at + nbytes].view(t.count, t.src.record_bytes)
            summed, at = _summed_gather(pool, t.src, table, t.first, t.count, rows, rec), at + nbytes
        else:
            rec = gather_records(pool, t.src, table, t.first, t.count)
        records.append(rec)
        chunks.append(rows)
        sums.append(summed)
    payload = Payload(plan.fingerprint(), False, records, chunks, [])
    if convert:
        payload = convert_payload(plan, payload, loss_report=loss_report)
    payload.checksums = [s if s is not None else xxh3_chunks(r, c) if checksum else []
                         for r, c, s in zip(payload.records, payload.chunks, sums, strict=True)]
    return payload


def _check_payload(plan: MigrationPlan, payload: Payload) -> None:
    """Refuse a payload packed for another plan or whose page chunks do not cover its records."""
    if payload.fingerprint != plan.fingerprint():
        raise MigrationError("payload was packed for a different plan (plan fingerprints differ)")
    n = len(plan.transfers)
    if not len(payload.records) == len(payload.chunks) == len(payload.checksums) == n:
        raise MigrationError(f"payload holds {len(payload.records)} transfers, the plan {n}")
    for t, rec, rows, sums in zip(plan.transfers, payload.records, payload.chunks, payload.checksums, strict=True):
        if len(sums) != len(rows) or sum(rows) != rec.shape[0]:
            raise MigrationError(f"layer {t.spec.layer} {t.spec.role.value}: page chunks do not cover its records")


def _hashable(records: torch.Tensor) -> memoryview | torch.Tensor:
    """``records``' bytes as ``dispatch.xxh3_chunks`` reads them where they are: host bytes, or the flat device
    tensor (hashed on its device, no copy to host)."""
    flat = records.detach().contiguous().view(torch.uint8).reshape(-1)
    return memoryview(flat.numpy()) if flat.device.type == "cpu" else flat


class _Verifier:
    """Checks a payload's page-chunk checksums chunk by chunk, in the pass that reads the records (each chunk
    just before its rows are first converted or published, while they are in the CPU caches)."""

    def __init__(self, plan: MigrationPlan, payload: Payload) -> None:
        self.plan, self.payload = plan, payload
        self.data = [_hashable(r) for r in payload.records]
        self.chunk = [0] * len(plan.transfers)  # the next chunk to check, per transfer
        self.rows = [0] * len(plan.transfers)  # rows covered by the checked chunks

    def upto(self, i: int, end: int) -> None:
        """Check transfer ``i``'s chunks until its first ``end`` rows are covered; ``ChecksumError`` names the first
        chunk that differs."""
        rows, sums = self.payload.chunks[i], self.payload.checksums[i]
        rb = self.payload.records[i].shape[1]
        k0, covered, stop = self.chunk[i], self.rows[i], self.chunk[i]
        while covered < end and stop < len(rows):  # the chunks to check: until ``end`` rows are covered
            covered, stop = covered + rows[stop], stop + 1
        have = xxh3_spans(self.data[i], self.rows[i] * rb, rows[k0:stop], rb)
        if have != sums[k0:stop]:
            k = k0 + next(j for j, (a, b) in enumerate(zip(have, sums[k0:stop], strict=True)) if a != b)
            t = self.plan.transfers[i]
            raise ChecksumError(
                f"checksum mismatch in layer {t.spec.layer} {t.spec.role.value}, source page chunk {k} "
                f"({CHECKSUM} {have[k - k0]:#018x}, sender sent {sums[k]:#018x}); nothing was published"
            )
        self.chunk[i], self.rows[i] = stop, covered

    def finish(self) -> None:
        """Check every chunk not checked yet (empty chunks included)."""
        for i, rows in enumerate(self.payload.chunks):
            self.upto(i, sum(rows) + 1)


def verify(plan: MigrationPlan, payload: Payload) -> None:
    """Raise ``ChecksumError`` naming the first chunk whose XXH3-64 checksum does not match."""
    _check_payload(plan, payload)
    _Verifier(plan, payload).finish()


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
        if _plain_page_ids(table):
            continue
        seen: dict[int, int] = {}
        for i, page in enumerate(table):
            if isinstance(page, bool) or not isinstance(page, int):
                raise InputError(f"{what}[{name!r}][{i}] is {repr(page)[:40]}, not an integer page id")
            if page < -1:
                raise InputError(f"{what}[{name!r}][{i}] is {page}: page ids are >= 0, or -1 for a released block")
            if page >= 0 and page in seen:
                raise InputError(f"{what}[{name!r}] names page {page} twice (indices {seen[page]} and {i})")
            seen[page] = i


def _plain_page_ids(table: list | tuple) -> bool:
    """True when every entry is an ``int`` (not a bool) in ``[-1, 2**63)`` and no id >= 0 repeats, found with array
    operations; False means ``check_block_tables`` looks entry by entry to name the first problem."""
    if not table or set(map(type, table)) != {int}:
        return not table
    try:
        ids = np.asarray(table, dtype=np.int64)
    except OverflowError:
        return False
    if int(ids.min()) < -1:
        return False
    live = np.sort(ids[ids >= 0])
    return not bool((live[1:] == live[:-1]).any())


def check_pools(plan: MigrationPlan, pools: EnginePools, side: str) -> None:
    """Refuse pools of another engine profile or model than ``plan``'s ``side`` (``src``/``dst``)."""
    profile = plan.src if side == "src" else plan.dst
    if pools.profile.spec != profile.spec or pools.model.compress_ratios != plan.model.compress_ratios:
        raise InputError(f"{side} pools are {pools.profile.spec} / {pools.model.name}; the plan wants "
                         f"{profile.spec} / {plan.model.name}")


def build_report(plan: MigrationPlan, *, payload_bytes: int, converted_on: str, loss: list[LossReport],
                 indexer_err: float | None, state_err: float | None, pack_s: float, convert_s: float, wire_s: float,
                 publish_s: float, parts: dict[str, float] | None = None) -> MigrationReport:
    """The ``MigrationReport`` of ``plan`` (every path builds it here); the loss was measured when ``indexer_err``
    is not None."""
    measured = indexer_err is not None
    return MigrationReport(
        num_tokens=plan.num_tokens,
        transfers=len(plan.transfers),
        payload_bytes=payload_bytes,
        converted_on=converted_on,
        kv_lossless=all(r.lossless for r in loss) if measured else None,
        kv_max_abs_error=max((r.max_abs_error for r in loss), default=0.0) if measured else None,
        indexer_max_abs_error=indexer_err,
        pack_s=pack_s,
        convert_s=convert_s,
        wire_s=wire_s,
        publish_s=publish_s,
        loss=list(loss),
        state_max_abs_error=state_err,
        convert_parts_s=dict(parts or {}),
    )


def finish(plan: MigrationPlan, payload: Payload, dst: EnginePools, *, converted_on: str, pack_s: float,
           wire_s: float, loss_report: bool = True) -> tuple[RequestTables, MigrationReport]:
    """Verify, convert (if not yet), publish; the common tail of local and remote migration.

    One pass over the records (the staged batches of ``migrate_local``, sourced from the payload): each page chunk's
    checksum is verified just before its rows are converted (or, converted already, published) straight into the
    claimed destination pages; a mismatch or a refused conversion releases every claimed page (nothing is
    published). Pools whose tensors are not contiguous take the unfused steps (verify, convert, publish)."""
    check_pools(plan, dst, "dst")
    _check_payload(plan, payload)
    staged = _stage_payload(plan, payload, dst)
    if staged is not None:
        done = _run_staged(plan, staged, dst, loss_report, _Verifier(plan, payload))
        return done.tables, done.report(plan, sum(r.numel() for r in payload.records), converted_on, pack_s=pack_s,
                                        convert_s=done.gather_s + done.convert_s, wire_s=wire_s)
    verify(plan, payload)
    t0 = time.perf_counter()
    converted = convert_payload(plan, payload, loss_report=loss_report)
    t1 = time.perf_counter()
    tables = publish(plan, converted, dst)
    t2 = time.perf_counter()
    return tables, build_report(plan, payload_bytes=sum(r.numel() for r in payload.records), converted_on=converted_on,
                                loss=converted.loss, indexer_err=converted.indexer_max_abs_error,
                                state_err=converted.state_max_abs_error, pack_s=pack_s, convert_s=t1 - t0,
                                wire_s=wire_s, publish_s=t2 - t1)


def migrate_local(plan: MigrationPlan, src: EnginePools, src_tables: RequestTables, dst: EnginePools, *,
                  convert_on: ConvertSide = "receiver", loss_report: bool = True
                  ) -> tuple[RequestTables, MigrationReport]:
    """Run ``plan`` in one process: returns the request's destination block tables and a report.

    Nothing crosses a wire, so nothing is checksummed: entries move in staged batches of about
    ``STAGE_BYTES`` source bytes, each gathered from the source pages as records, converted by the same record
    operations as the transports' path (``convert_batch``) and scattered into the destination pages while it is
    still in the CPU caches (pools whose tensors are not contiguous
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
    done = _run_staged(plan, staged, dst, loss_report)
    sender = convert_on == "sender"
    nbytes = sum(t.dst_bytes if sender else t.src_bytes for t in plan.transfers)
    return done.tables, done.report(plan, nbytes, convert_on,
                                    pack_s=done.gather_s + done.convert_s if sender else done.gather_s,
                                    convert_s=0.0 if sender else done.convert_s, wire_s=0.0)


#: Source bytes per staged batch of ``migrate_local`` (KV: 8,192 entries, 4 MiB in, 4.6 MiB out), small
#: enough that a batch's gathered, converted and published rows stay in the CPU caches.
STAGE_BYTES = 4 << 20


@dataclass
class _Piece:
    """Entries ``[first, first + count)`` of transfer ``index``, at row ``offset`` of its batch."""

    index: int
    first: int
    count: int
    offset: int
    src: list[PartSpans] = field(default_factory=list)
    dst: list[PartSpans] = field(default_factory=list)
    #: The piece's source records when it comes from a payload (then ``src`` is empty).
    records: torch.Tensor | None = None


@dataclass
class _Batch:
    """Pieces staged and converted together: ``rows`` records of one ``group_key``."""

    transfer: Transfer
    rows: int
    pieces: list[_Piece]


@dataclass
class _Staged:
    """Batches to run; ``converted``: the source records are in the destination format already (a payload the
    sender converted)."""

    batches: list[_Batch]
    src_buf: torch.Tensor
    dst_buf: torch.Tensor
    converted: bool = False


@dataclass
class _Pass:
    """What a staged pass did: the claimed tables, the loss it measured and its times (seconds)."""

    tables: RequestTables
    loss: _Loss
    gather_s: float
    convert_s: float
    publish_s: float
    parts: dict[str, float]

    def report(self, plan: MigrationPlan, payload_bytes: int, converted_on: str, *, pack_s: float, convert_s: float,
               wire_s: float) -> MigrationReport:
        return build_report(plan, payload_bytes=payload_bytes, converted_on=converted_on, loss=self.loss.reports,
                            indexer_err=self.loss.indexer, state_err=self.loss.state, pack_s=pack_s,
                            convert_s=convert_s, wire_s=wire_s, publish_s=self.publish_s, parts=self.parts)


def _stage_rows(t: Transfer) -> int:
    """Rows per staged batch: ``STAGE_BYTES`` of source records, or a byte move's whole transfer (it runs straight
    from the source into the destination pages, ``_direct``: one span-move call per record part covers every page
    of the transfer, spread over the native backend's threads, with no per-batch Python work)."""
    if not needs_conversion(t):
        return max(1, t.count)
    return max(1, STAGE_BYTES // t.src.record_bytes)


def _rows(spans: list[PartSpans], records: torch.Tensor, offset: int, count: int) -> list[tuple[torch.Tensor, int]]:
    """For each pool part: rows ``[offset, offset + count)`` of the staged records and the part's byte offset."""
    return [(records[offset : offset + count], lo) for _, lo, _, _ in spans]


def _device(pools: EnginePools) -> torch.device:
    return next(t.device for pool in pools.pools.values() for t in pool_tensors(pool))


def _contiguous(*pools: EnginePools) -> bool:
    return all(t.is_contiguous() for p in pools for pool in p.pools.values() for t in pool_tensors(pool))


def _staged(plan: MigrationPlan, source: Callable[[int, int, int, int], _Piece], device: torch.device,
            converted: bool = False) -> _Staged:
    """The plan's staged batches, ``source(index, first, count, offset)`` making each piece, with stage buffers
    of the largest batch's bytes on ``device`` (the pools': the same stages run on every backend)."""
    staged: list[_Batch] = []
    src_bytes = dst_bytes = 0
    for pieces in batches(plan, list(range(len(plan.transfers))), _stage_rows):
        t = plan.transfers[pieces[0][0]]
        b = _Batch(t, 0, [])
        for i, lo, count in pieces:
            b.pieces.append(source(i, lo, count, b.rows))
            b.rows += count
        staged.append(b)
        src_bytes = max(src_bytes, b.rows * (t.dst if converted else t.src).record_bytes)
        dst_bytes = max(dst_bytes, b.rows * t.dst.record_bytes)
    return _Staged(staged, torch.empty(src_bytes, dtype=torch.uint8, device=device),
                   torch.empty(dst_bytes, dtype=torch.uint8, device=device), converted)


def _stage(plan: MigrationPlan, src: EnginePools, tables: RequestTables, dst: EnginePools) -> _Staged | None:
    """Cut the plan into staged batches of records and find every source page (``InputError`` for a table that
    does not hold its entries); None when a pool tensor is not contiguous."""
    if not _contiguous(src, dst) or _device(src) != _device(dst):
        return None

    runs: RunCache = {}

    def piece(i: int, lo: int, count: int, offset: int) -> _Piece:
        t = plan.transfers[i]
        spans = part_spans(src.pool(t.spec), t.src, table_of(tables, t.src), t.first + lo, count, runs)
        assert spans is not None  # contiguous pools, checked above
        return _Piece(i, lo, count, offset, spans)

    return _staged(plan, piece, _device(dst))


def _stage_payload(plan: MigrationPlan, payload: Payload, dst: EnginePools) -> _Staged | None:
    """Staged batches reading a payload's records (views, nothing copied); None for non-contiguous destination
    pools or records on another device than theirs."""
    if not _contiguous(dst) or any(r.device != _device(dst) for r in payload.records):
        return None
    records = [r.contiguous() for r in payload.records]
    return _staged(plan, lambda i, lo, count, offset: _Piece(i, lo, count, offset, records=records[i][lo : lo + count]),
                   _device(dst), payload.converted)


def _run_staged(plan: MigrationPlan, staged: _Staged, dst: EnginePools, loss_report: bool,
                check: _Verifier | None = None) -> _Pass:
    """Claim the destination pages, then gather, convert and scatter batch by batch (pieces read from a payload
    are used in place when a batch is one piece; ``check`` verifies their chunks first); the byte moves that need
    no staging run last, all in one span-move call (their pages are disjoint). With ``loss_report`` a
    KV batch's loss statistics run on a worker thread (their kernels release the GIL) while the next
    batches are gathered, converted and scattered; the stage buffers alternate between two pairs so that
    a batch's are not overwritten before its statistics are done."""
    t0 = time.perf_counter()
    tables = dst.claim(plan.table_lengths("dst"), plan.released("dst"))
    loss = _Loss(loss_report)
    gather_s = convert_s = 0.0
    parts: dict[str, float] = {}
    buffers = [(staged.src_buf, staged.dst_buf)]
    if loss_report:
        buffers.append((torch.empty_like(staged.src_buf), torch.empty_like(staged.dst_buf)))
    busy: list[Future | None] = [None] * len(buffers)  # the statistics still reading each pair
    reports: list[Future] = []
    moves: list[SpanMove] = []
    runs: RunCache = {}
    try:
        for b in staged.batches:
            for piece in b.pieces:
                t = plan.transfers[piece.index]
                piece.dst = part_spans(dst.pool(t.spec), t.dst, table_of(tables, t.dst), t.first + piece.first,
                                       piece.count, runs) or []
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
                if _direct(b, staged.converted, loss, check, moves):
                    t2 = time.perf_counter()
                    kind = t.src.kind if needs_conversion(t) and not staged.converted else None  # kv or indexer
                    if kind:
                        convert_s += t2 - t1
                        parts[kind] = parts.get(kind, 0.0) + t2 - t1
                    else:
                        publish_s += t2 - t1
                    continue
                src_rows = _gathered(b, src_buf, t.dst.record_bytes if staged.converted else t.src.record_bytes,
                                     check)
                t2 = time.perf_counter()
                if staged.converted or not needs_conversion(t):
                    dst_rows = src_rows
                elif t.src.kind == "kv":
                    dst_rows = dst_buf[: b.rows * t.dst.record_bytes].view(b.rows, t.dst.record_bytes)
                    convert_batch(t, src_rows, False, b.pieces[0].first, dst_rows)
                    if loss_report:
                        busy[k] = stats.submit(record_ops.kv_loss, src_rows, dst_rows, t.src.layout, t.dst.layout,
                                               src_scale=t.src.scale, dst_scale=t.dst.scale, dialect=t.dst.dialect)
                        reports.append(busy[k])
                else:
                    dst_rows, _, err = convert_batch(t, src_rows, loss_report, b.pieces[0].first)
                    loss.add(t, None, err)
                t3 = time.perf_counter()
                for piece in b.pieces:
                    move_parts(piece.dst, _rows(piece.dst, dst_rows, piece.offset, piece.count), True)
                gather_s += t2 - t1
                convert_s += t3 - t2
                if not staged.converted and needs_conversion(t):
                    parts[t.src.kind] = parts.get(t.src.kind, 0.0) + t3 - t2
                publish_s += time.perf_counter() - t3
            t4 = time.perf_counter()
            dispatch.move_spans(moves, into_pool=True)  # the direct byte moves of every batch: disjoint pages
            publish_s += time.perf_counter() - t4
            if check is not None:
                check.finish()
            t4 = time.perf_counter()
            loss.reports = [f.result() for f in reports]  # in batch order
            if reports:  # the statistics' time not hidden behind the batches counts as KV conversion
                waited = time.perf_counter() - t4
                convert_s += waited
                parts["kv"] = parts.get("kv", 0.0) + waited
    except Exception:
        dst.release(tables)
        raise
    return _Pass(tables, loss, gather_s, convert_s, publish_s, parts)


def _direct(b: _Batch, converted: bool, loss: _Loss, check: _Verifier | None, moves: list[SpanMove]) -> bool:
    """Run batch ``b`` with no staging when it can: a byte move (or records the sender converted) span by span from
    the source into the destination pages (added to ``moves``, which the caller runs in one call), fp4 -> fp8
    indexer keys by the strided kernel from the source's parts into the destination's, KV records by the backend's
    segment kernel (``dispatch.kv_segment_split``; not while measuring loss, whose statistics read staged records)
    likewise (``check`` verifies each piece's chunks first); False (nothing done) otherwise."""
    t = b.transfer
    moving = converted or not needs_conversion(t)
    first = b.pieces[0]
    device = first.records.device if first.records is not None else first.src[0][0].device
    split = None if moving or loss.measured or t.src.kind != "kv" else dispatch.kv_segment_split(
        t.src.layout, t.dst.layout, device)
    if not moving and split is None and not _direct_keys(t, device):
        return False
    work = [_move_segments(piece) if moving else _kv_segments(t, piece, split) if split else _key_segments(t, piece)
            for piece in b.pieces]
    if any(w is None for w in work):
        return False
    for piece, w in zip(b.pieces, work, strict=True):
        if check is not None:
            check.upto(piece.index, piece.first + piece.count)
        if moving:
            moves.extend(w)  # type: ignore[arg-type]
        elif split:
            flats, segs, strides = w  # type: ignore[misc]
            dispatch.transcode_kv_segments(flats, segs, strides, t.src.layout, t.dst.layout, src_scale=t.src.scale,
                                           dst_scale=t.dst.scale, dialect=t.dst.dialect, into_pool=True)
        else:
            loss.add(t, None, _convert_keys_direct(t, piece, w, loss.measured))  # type: ignore[arg-type]
    return True


def _stream(spans: list[PartSpans], at: int, nbytes: int) -> tuple[torch.Tensor, np.ndarray, int] | None:
    """The part of ``spans`` holding record bytes ``[at, at + nbytes)``: (its flat tensor, its spans with the byte
    offsets moved to ``at``, its row stride); None when no one part holds them."""
    for tensor, lo, width, sp in spans:
        if lo <= at and at + nbytes <= lo + width:
            moved = sp.copy()
            moved[:, 0] += at - lo
            return tensor.view(-1), moved, width
    return None


def _sources(piece: _Piece) -> list[PartSpans]:
    """Where a piece's source records lie: its pool spans, or its payload records as one part of one run."""
    if piece.records is None:
        return piece.src
    rec = piece.records
    return [(rec, 0, rec.shape[1], np.array([[0, 0, piece.count]], dtype=np.int64))]


def _move_segments(piece: _Piece) -> list[SpanMove] | None:
    """A piece's byte move straight from its source (pool pages or payload records) into its destination pages, one
    span copy per run that lies in one source and one destination page (runs adjacent on both sides merged); None
    when a destination part is not inside one source part."""
    src = _sources(piece)
    moves = []
    for tensor, lo, width, sp in piece.dst:
        found = _stream(src, lo, width)
        if found is None:
            return None
        flat, src_sp, stride = found
        segs = coalesce_segments(merge_spans([(src_sp, stride), (sp, width)], piece.count), stride, width)
        moves.append((flat, tensor.view(-1), segs, stride, width, width))
    return moves


#: A direct key conversion: the four flat tensors (fp4 codes, fp4 scales, fp8 codes, fp8 scales), the segments
#: (``dispatch.fp4_to_fp8_key_segments``) and the four row strides.
KeyWork = tuple[tuple[torch.Tensor, ...], np.ndarray, tuple[int, ...]]


def _split_streams(piece: _Piece, src_at: int, src_bytes: int, dst_at: int, dst_bytes: int) -> KeyWork | None:
    """A piece's records as two streams a side (record bytes ``[0, at)`` and ``[at, at + bytes)``: source pages'
    parts or payload records, destination pages' parts) with the segments that lie in one run of every stream
    (``merge_spans``); None when a part does not hold a stream whole."""
    sources = _sources(piece)
    streams = [_stream(sources, 0, src_at), _stream(sources, src_at, src_bytes),
               _stream(piece.dst, 0, dst_at), _stream(piece.dst, dst_at, dst_bytes)]
    if any(x is None for x in streams):
        return None
    flats, spans, strides = zip(*streams, strict=True)  # type: ignore[misc]
    return flats, merge_spans(list(zip(spans, strides, strict=True)), piece.count), strides


def _key_segments(t: Transfer, piece: _Piece) -> KeyWork | None:
    """Where a piece's fp4 keys are read (the source pages' two parts, or payload records) and its fp8 keys written
    (the destination pages' parts); None when a part does not hold whole codes or scales."""
    src, dst = t.src.indexer, t.dst.indexer
    return _split_streams(piece, src.split, src.record_bytes - src.split, dst.split, dst.record_bytes - dst.split)


def _kv_segments(t: Transfer, piece: _Piece, split: tuple[int, int]) -> KeyWork | None:
    """Where a piece's KV records are read and written, as ``dispatch.transcode_kv_segments`` takes them: each side's
    data and footer streams (``split``: ``dispatch.kv_segment_split``), each segment with its first record's index;
    None when a part does not hold a stream whole."""
    work = _split_streams(piece, split[0], t.src.record_bytes - split[0], split[1], t.dst.record_bytes - split[1])
    if work is None:
        return None
    flats, segs, strides = work
    first = np.concatenate([[0], np.cumsum(segs[:-1, 4])]) if segs.shape[0] else np.zeros(0, np.int64)
    return flats, np.concatenate([segs, first[:, None].astype(np.int64)], axis=1), strides


def _convert_keys_direct(t: Transfer, piece: _Piece, work: KeyWork, measure: bool) -> float:
    """fp4 -> fp8 indexer keys of a piece in one strided kernel pass from its source into its destination pages'
    parts (``work``: ``_key_segments``); the max abs error (0.0 unless ``measure``). Keys that decode to NaN/Inf
    are refused by ``kvbridge.ops.keys``' torch path."""
    flats, segs, strides = work
    err = dispatch.fp4_to_fp8_key_segments(*flats, segs, strides, t.dst.indexer.dim, t.dst.dialect or "",
                                           measure=measure)
    if err is not None:
        return err
    records = piece.records
    if records is None:
        records = torch.empty(piece.count, t.src.record_bytes, dtype=torch.uint8, device=flats[0].device)
        move_parts(piece.src, _rows(piece.src, records, 0, piece.count), False)
    ix.transcode_keys(records, t.src.indexer, t.dst.indexer, t.dst.dialect or "", t.src.dialect)
    raise MigrationError("indexer keys the native kernel refused were accepted by the torch path")


def _direct_keys(t: Transfer, device: torch.device) -> bool:
    """Whether ``t``'s indexer keys convert straight between pages (the backend's fp4 -> fp8 kernel applies)."""
    return t.src.kind == "indexer" and needs_conversion(t) and ix.key_kernel_applies(
        t.src.indexer, t.dst.indexer, t.dst.dialect or "", device)


def _gathered(b: _Batch, buf: torch.Tensor, row_bytes: int, check: _Verifier | None) -> torch.Tensor:
    """The batch's source records ``[rows, row_bytes]``: a payload piece's own records when the batch is that one
    piece, else gathered (from the pools, or copied from the payload) into ``buf``; ``check`` verifies the
    pieces' chunks before they are read."""
    if check is not None:
        for piece in b.pieces:
            check.upto(piece.index, piece.first + piece.count)
    if len(b.pieces) == 1 and b.pieces[0].records is not None:
        return b.pieces[0].records
    rows = buf[: b.rows * row_bytes].view(b.rows, row_bytes)
    for piece in b.pieces:
        if piece.records is not None:
            _copy_into(rows[piece.offset : piece.offset + piece.count], piece.records)
        else:
            move_parts(piece.src, _rows(piece.src, rows, piece.offset, piece.count), False)
    return rows
