"""Moving a request between processes over a ``torch.distributed`` process group, layer group by layer group.

The sender (prefill side) sends, point to point to the receiver's rank:

1. a meta message, int64 ``[MAGIC, header_bytes, data_bytes, groups, message_bytes]``;
2. the header, UTF-8 JSON: plan fingerprint, whether records are converted, and the layer
   groups (transfer indices of each, see ``kvbridge.migration.stream``);
3. per group, in order: a group meta message, int64 ``[group_header_bytes, group_data_bytes]``,
   the group header (JSON: per transfer its row count, record size, page-chunk row counts and
   XXH3-64 checksums, and the sender's loss reports when it converted), then the group's records
   back to back in messages of at most ``chunk_bytes``.

The sender packs (and, with ``convert_on="sender"``, converts) one group at a time, so a
prefill engine can send its first layers while it computes the last (``GlooSender``). The
receiver verifies each group's checksums and converts it as soon as it lands, and claims
and fills destination pages only after the last group verified. A dead sender, a broken
link or a timeout raises ``TransferError``; a corrupted chunk raises ``ChecksumError``; in
both cases no destination page is claimed. Few large messages: a 128K-token Flash request
sent as one group is one meta, one header and a handful of data messages, whatever its
page count. Works with gloo (CPU tensors) and NCCL (the caller moves ``device`` to CUDA).
"""

from __future__ import annotations

import json
import re
import threading
import time
import uuid
from collections.abc import Callable
from datetime import timedelta

import torch
import torch.distributed as dist

from kvbridge._version import __version__
from kvbridge.errors import InputError, KVBridgeError
from kvbridge.migration.control import (
    DEFAULT_HANDSHAKE_S,
    DEFAULT_MAX_CONNECTIONS,
    Channel,
    ConnectionServer,
    Listener,
    check_name,
    check_room,
    check_tp,
    first_line,
    handshake,
    send_error,
    tp_position,
)
from kvbridge.migration.errors import MigrationError, TransferError
from kvbridge.migration.execute import ConvertSide, MigrationReport, Payload, check_pools
from kvbridge.migration.plan import MigrationPlan
from kvbridge.migration.pools import EnginePools, RequestTables
from kvbridge.migration.staging import joined, staging_empty
from kvbridge.migration.stream import (
    Publish,
    RequestAssembly,
    check_groups,
    layer_groups,
    pack_group,
    request_info,
    wire_fingerprint,
)
from kvbridge.ops.loss import LossReport

MAGIC = 0x4B5642_4D494733  # "KVB" "MIG3": the layer-group protocol, XXH3-64 checksums
#: Magics of earlier versions of this protocol, refused with a line naming what changed.
OLD_MAGICS = {0x4B5642_4D494732: "MIG2 (CRC-32 page-chunk checksums)"}
DEFAULT_CHUNK_BYTES = 256 << 20

#: Called after each data message with (bytes sent so far, total bytes).
Progress = Callable[[int, int], None]


def _reason(exc: BaseException) -> str:
    """The first sentence of a backend error, without gloo's ``[file:line]`` prefix."""
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    text = re.sub(r"^\[[^\]]*:\d+\]\s*", "", text)
    return text.split(". ")[0].rstrip(".")


#: Called while a transfer waits; True when the peer is known gone (e.g. its control connection closed).
Watch = Callable[[], bool]


def _wait(work: dist.Work, what: str, peer: int, deadline: float, watch: Watch | None = None) -> None:
    remaining = deadline - time.monotonic()
    if remaining <= 0:
        raise TransferError(f"timed out before {what} from rank {peer}; nothing was published")
    try:
        if watch is None:
            work.wait(timeout=timedelta(seconds=remaining))
        else:
            _watched(work, what, peer, remaining, watch)
    except RuntimeError as exc:
        reason = _reason(exc)
        raise TransferError(
            f"{what} from rank {peer} failed ({reason}); the peer died, the link broke or the timeout passed; "
            "nothing was published"
        ) from None


def _watched(work: dist.Work, what: str, peer: int, remaining: float, watch: Watch) -> None:
    """Wait for ``work`` on a helper thread (a gloo wait can be neither polled nor cut short: a timed-out
    wait breaks the pair) while checking ``watch`` every 20 ms: a dead peer is noticed as soon as
    its control connection closes, not at the timeout. An abandoned wait ends at its own timeout."""
    done = threading.Event()
    failed: list[RuntimeError] = []

    def wait() -> None:
        try:
            work.wait(timeout=timedelta(seconds=remaining))
        except RuntimeError as exc:
            failed.append(exc)
        finally:
            done.set()

    threading.Thread(target=wait, name="kvbridge-gloo-wait", daemon=True).start()
    while not done.wait(0.02):
        if watch():
            raise TransferError(f"{what} from rank {peer} failed: the peer closed its control connection (it died "
                                "or gave up); nothing was published")
    if failed:
        raise failed[0]


def _check_timeout(timeout: float) -> float:
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout > 0:
        raise InputError(f"timeout must be a positive number of seconds, got {timeout!r}")
    return float(timeout)


def _check_chunk_bytes(chunk_bytes: int) -> int:
    if isinstance(chunk_bytes, bool) or not isinstance(chunk_bytes, int) or chunk_bytes < 1:
        raise InputError(f"chunk_bytes must be a positive integer, got {chunk_bytes!r}")
    return chunk_bytes


def _json_tensor(data: dict, device: torch.device | str) -> torch.Tensor:
    return torch.frombuffer(bytearray(json.dumps(data).encode()), dtype=torch.uint8).to(device)


class _Link:
    """One direction of a transfer: point-to-point sends or receives under one deadline.

    ``group`` may also be a process group made outside ``init_process_group`` (as
    ``GlooServer`` makes one per request); ``peer`` is then its rank in that group.
    """

    def __init__(self, peer: int, group: dist.ProcessGroup | None, deadline: float, device: torch.device | str,
                 watch: Watch | None = None):
        self.peer, self.group, self.deadline, self.device, self.watch = peer, group, deadline, device, watch
        self.direct = group is not None and not _registered(group)

    def send(self, tensor: torch.Tensor, what: str) -> None:
        if self.direct:
            self._wait(lambda: self.group.send([tensor], self.peer, 0), what)
        else:
            self._wait(lambda: dist.isend(tensor, self.peer, group=self.group), what)

    def recv(self, tensor: torch.Tensor, what: str) -> None:
        if self.direct:
            self._wait(lambda: self.group.recv([tensor], self.peer, 0), what)
        else:
            self._wait(lambda: dist.irecv(tensor, self.peer, group=self.group), what)

    def _wait(self, post: Callable[[], dist.Work], what: str) -> None:
        """Post an operation and wait for it; posting on a broken pair fails like the wait would."""
        try:
            work = post()
        except RuntimeError as exc:
            raise TransferError(f"{what} from rank {self.peer} failed ({_reason(exc)}); the peer died or the link "
                                "broke; nothing was published") from None
        _wait(work, what, self.peer, self.deadline, self.watch)


def _registered(group: dist.ProcessGroup) -> bool:
    """Whether ``group`` belongs to this process's ``torch.distributed`` world."""
    try:
        return dist.is_initialized() and group in dist.distributed_c10d._world.pg_group_ranks
    except AttributeError:
        return False


class GlooSender:
    """Prefill side of one request: sends it layer group by layer group (``send_group``), in order.

    ``groups`` (default: one group per layer, ``layer_groups(plan)``) lists the transfer indices
    of each group; the receiver learns them from the header sent by the constructor. Call
    ``send_group`` once per group, in order, after those layers are written into ``src``, then
    ``close``. Every send waits at most until ``timeout`` seconds after construction.
    """

    def __init__(self, plan: MigrationPlan, src: EnginePools, tables: RequestTables, *, dst_rank: int,
                 group: dist.ProcessGroup | None = None, convert_on: ConvertSide = "receiver",
                 groups: list[list[int]] | None = None, chunk_bytes: int = DEFAULT_CHUNK_BYTES, timeout: float = 60.0,
                 device: torch.device | str = "cpu", progress: Progress | None = None, loss_report: bool = True):
        if convert_on not in ("sender", "receiver"):
            raise InputError(f"convert_on must be 'sender' or 'receiver', got {convert_on!r}")
        check_pools(plan, src, "src")
        self.plan, self.src, self.tables = plan, src, tables
        self.convert = convert_on == "sender"
        self.groups = check_groups(plan, layer_groups(plan) if groups is None else groups)
        self.chunk_bytes = _check_chunk_bytes(chunk_bytes)
        self.link = _Link(dst_rank, group, time.monotonic() + _check_timeout(timeout), device)
        self.progress, self.loss_report = progress, loss_report
        self.total = sum(t.dst_bytes if self.convert else t.src_bytes for t in plan.transfers)
        self.sent = 0
        self.next_group = 0
        head = _json_tensor({"fingerprint": wire_fingerprint(plan), "converted": self.convert, "groups": self.groups},
                            device)
        meta = torch.tensor([MAGIC, head.numel(), self.total, len(self.groups), self.chunk_bytes], dtype=torch.int64,
                            device=device)
        self.link.send(meta, "sending the meta message")
        self.link.send(head, "sending the header")

    def send_group(self) -> None:
        """Pack (and convert) the next group from ``src`` and send it."""
        if self.next_group >= len(self.groups):
            raise InputError(f"all {len(self.groups)} layer groups were already sent")
        g = self.next_group
        payload = pack_group(self.plan, self.src, self.tables, self.groups[g], convert=self.convert,
                             loss_report=self.loss_report)
        _send_group(self.link, payload, self.chunk_bytes, f"group {g + 1}/{len(self.groups)}", self._advance)
        self.next_group += 1

    def _advance(self, n: int) -> None:
        self.sent += n
        if self.progress is not None:
            self.progress(self.sent, self.total)

    def close(self) -> int:
        """Check every group went out; returns the data bytes sent."""
        if self.next_group != len(self.groups):
            raise InputError(f"{len(self.groups) - self.next_group} of {len(self.groups)} layer groups were not sent")
        return self.sent


def _send_group(link: _Link, payload: Payload, chunk_bytes: int, label: str, advance: Callable[[int], None]) -> None:
    header = {
        "items": [{"rows": int(r.shape[0]), "record_bytes": int(r.shape[1]), "chunks": c, "xxh3_64": s}
                  for r, c, s in zip(payload.records, payload.chunks, payload.checksums, strict=True)],
        "loss": [r.to_dict() for r in payload.loss],
        "indexer_max_abs_error": payload.indexer_max_abs_error,
        "state_max_abs_error": payload.state_max_abs_error,
    }
    head = _json_tensor(header, link.device)
    flat = joined(payload.records)
    if flat is None:
        flat = torch.cat([r.reshape(-1) for r in payload.records]) if payload.records else \
            torch.empty(0, dtype=torch.uint8)
    data = flat.to(link.device)
    total = data.numel()
    link.send(torch.tensor([head.numel(), total], dtype=torch.int64, device=link.device), f"sending {label}'s meta")
    link.send(head, f"sending {label}'s header")
    messages = -(-total // chunk_bytes)
    for i in range(messages):
        part = data[i * chunk_bytes : (i + 1) * chunk_bytes]
        link.send(part, f"sending data message {i + 1}/{messages} of {label}")
        advance(part.numel())


def send_payload(payload: Payload, *, dst_rank: int, group: dist.ProcessGroup | None = None,
                 chunk_bytes: int = DEFAULT_CHUNK_BYTES, timeout: float = 60.0, device: torch.device | str = "cpu",
                 progress: Progress | None = None) -> int:
    """Send an already packed payload (all transfers) to ``dst_rank`` as one group; returns data bytes sent."""
    _check_chunk_bytes(chunk_bytes)
    link = _Link(dst_rank, group, time.monotonic() + _check_timeout(timeout), device)
    groups = [list(range(len(payload.records)))]
    total = sum(r.numel() for r in payload.records)
    head = _json_tensor({"fingerprint": payload.fingerprint, "converted": payload.converted, "groups": groups}, device)
    link.send(torch.tensor([MAGIC, head.numel(), total, 1, chunk_bytes], dtype=torch.int64, device=device),
              "sending the meta message")
    link.send(head, "sending the header")
    sent = [0]

    def advance(n: int) -> None:
        sent[0] += n
        if progress is not None:
            progress(sent[0], total)

    _send_group(link, payload, chunk_bytes, "group 1/1", advance)
    return sent[0]


class _Receiver:
    """Receives the meta, the header, then one group at a time, checking each against ``plan``."""

    def __init__(self, plan: MigrationPlan, link: _Link):
        self.plan, self.link = plan, link
        meta = torch.zeros(5, dtype=torch.int64, device=link.device)
        link.recv(meta, "the meta message")
        magic, head_len, self.total, groups, self.chunk = (int(v) for v in meta.cpu())
        src = link.peer
        if magic in OLD_MAGICS:
            raise MigrationError(f"rank {src} speaks an older kvbridge migration protocol, {OLD_MAGICS[magic]}; "
                                 "this side MIG3 (XXH3-64 checksums): install the same kvbridge version on both sides")
        if magic != MAGIC:
            raise MigrationError(f"rank {src} is not a kvbridge migration sender of this version (magic {magic:#x})")
        if not 0 < head_len <= _MAX_HEADER_BYTES or self.chunk < 1 or groups < 1:
            raise MigrationError(f"meta message from rank {src} is inconsistent ({head_len} B header, {groups} groups)")
        header = self._json(head_len, "the header")
        if header.get("fingerprint") not in (plan.fingerprint(), wire_fingerprint(plan)):
            raise MigrationError(f"rank {src} sends a request for a different plan (plan fingerprints differ)")
        self.converted = bool(header["converted"])
        self.groups = check_groups(plan, header["groups"])
        if len(self.groups) != groups:
            raise MigrationError(f"meta message announces {groups} groups, the header {len(self.groups)}")
        want = sum(t.dst_bytes if self.converted else t.src_bytes for t in plan.transfers)
        if self.total != want:
            raise MigrationError(f"meta message announces {self.total} data bytes, the plan {want}")

    def _json(self, n: int, what: str) -> dict:
        head = torch.empty(n, dtype=torch.uint8, device=self.link.device)
        self.link.recv(head, what)
        return json.loads(bytes(head.cpu().numpy()).decode())

    def group(self, g: int) -> Payload:
        """Receive group ``g`` (checksums are verified by the caller)."""
        label = f"group {g + 1}/{len(self.groups)}"
        meta = torch.zeros(2, dtype=torch.int64, device=self.link.device)
        self.link.recv(meta, f"{label}'s meta")
        head_len, total = (int(v) for v in meta.cpu())
        if not 0 < head_len <= _MAX_HEADER_BYTES:
            raise MigrationError(f"{label}'s meta message announces a {head_len} B header")
        header = self._json(head_len, f"{label}'s header")
        items = header["items"]
        transfers = [self.plan.transfers[i] for i in self.groups[g]]
        if len(items) != len(transfers):
            raise MigrationError(f"{label} lists {len(items)} transfers, the plan {len(transfers)}")
        for t, item in zip(transfers, items, strict=True):
            want = t.dst.record_bytes if self.converted else t.src.record_bytes
            if item["rows"] != t.count or item["record_bytes"] != want:
                raise MigrationError(f"layer {t.spec.layer} {t.spec.role.value}: header says {item['rows']} x "
                                     f"{item['record_bytes']} B, the plan {t.count} x {want} B")
        if total != sum(i["rows"] * i["record_bytes"] for i in items):
            raise MigrationError(f"{label} announces {total} data bytes, its transfers add up to a different size")
        data = staging_empty(total) if torch.device(self.link.device).type == "cpu" else \
            torch.empty(total, dtype=torch.uint8, device=self.link.device)
        messages = -(-total // self.chunk)
        for i in range(messages):
            part = data[i * self.chunk : min((i + 1) * self.chunk, total)]
            self.link.recv(part, f"data message {i + 1}/{messages} of {label}")
        data = data.cpu()
        records, offset = [], 0
        for item in items:
            n = item["rows"] * item["record_bytes"]
            records.append(data[offset : offset + n].view(item["rows"], item["record_bytes"]))
            offset += n
        loss = [LossReport(**r) for r in header["loss"]]
        return Payload(self.plan.fingerprint(), self.converted, records, [i["chunks"] for i in items],
                       [i["xxh3_64"] for i in items], loss, header["indexer_max_abs_error"],
                       header.get("state_max_abs_error"))


#: Headers larger than this are refused as garbage (a 128K request's largest is ~100 KB).
_MAX_HEADER_BYTES = 64 << 20


def receive_payload(plan: MigrationPlan, *, src_rank: int, group: dist.ProcessGroup | None = None,
                    timeout: float = 60.0, device: torch.device | str = "cpu") -> Payload:
    """Receive every group of a payload for ``plan`` from ``src_rank``, in plan order (checksums are
    verified later, by ``finish``)."""
    rx = _Receiver(plan, _Link(src_rank, group, time.monotonic() + _check_timeout(timeout), device))
    n = len(plan.transfers)
    records: list = [None] * n
    chunks: list = [None] * n
    sums: list = [None] * n
    loss: list[LossReport] = []
    idx_err: float | None = 0.0
    state_err: float | None = None
    for g, indices in enumerate(rx.groups):
        part = rx.group(g)
        for i, rec, c, s in zip(indices, part.records, part.chunks, part.checksums, strict=True):
            records[i], chunks[i], sums[i] = rec, c, s
        loss.extend(part.loss)
        idx_err = None if part.indexer_max_abs_error is None or idx_err is None else \
            max(idx_err, part.indexer_max_abs_error)
        if part.state_max_abs_error is not None:
            state_err = max(state_err or 0.0, part.state_max_abs_error)
    return Payload(plan.fingerprint(), rx.converted, records, chunks, sums, loss, idx_err, state_err)


def send_request(plan: MigrationPlan, src: EnginePools, tables: RequestTables, *, dst_rank: int,
                 group: dist.ProcessGroup | None = None, convert_on: ConvertSide = "receiver",
                 layers_per_group: int | None = None, chunk_bytes: int = DEFAULT_CHUNK_BYTES, timeout: float = 60.0,
                 device: torch.device | str = "cpu", progress: Progress | None = None, loss_report: bool = True) -> int:
    """Prefill side: pack the request held in ``tables`` of ``src`` and send it; returns data bytes sent.

    ``layers_per_group`` streams it that many layers at a time (default: the whole request as one
    group, the fewest messages). With ``convert_on="sender"`` the records travel in the
    destination format (and the loss report, when ``loss_report``, travels with them).
    """
    groups = [list(range(len(plan.transfers)))] if layers_per_group is None else layer_groups(plan, layers_per_group)
    sender = GlooSender(plan, src, tables, dst_rank=dst_rank, group=group, convert_on=convert_on, groups=groups,
                        chunk_bytes=chunk_bytes, timeout=timeout, device=device, progress=progress,
                        loss_report=loss_report)
    for _ in groups:
        sender.send_group()
    return sender.close()


#: Called after each layer group verified, with (groups verified, total groups).
GroupDone = Callable[[int, int], None]


def receive_request(plan: MigrationPlan, dst: EnginePools, *, src_rank: int, group: dist.ProcessGroup | None = None,
                    timeout: float = 60.0, device: torch.device | str = "cpu", loss_report: bool = True,
                    on_group: GroupDone | None = None, publish: Publish | None = None, watch: Watch | None = None
                    ) -> tuple[RequestTables, MigrationReport]:
    """Decode side: receive each layer group, verify its checksums and convert it (if the sender did
    not) as it lands; after the last group, claim and fill destination pages. Returns the
    request's block tables and a report. ``publish`` replaces the claim-and-fill step (an engine
    that allocated the request's blocks itself writes them through its own block ids). ``watch``:
    polled while waiting; True (the peer is gone) fails the request at once."""
    check_pools(plan, dst, "dst")
    t0 = time.perf_counter()
    rx = _Receiver(plan, _Link(src_rank, group, time.monotonic() + _check_timeout(timeout), device, watch))
    assembly = RequestAssembly(plan, loss_report=loss_report)
    for g, indices in enumerate(rx.groups):
        assembly.add(indices, rx.group(g))
        if on_group is not None:
            on_group(g + 1, len(rx.groups))
    t1 = time.perf_counter()
    tables = assembly.publish(dst) if publish is None else publish(assembly)
    report = assembly.report(wire_s=t1 - t0 - assembly.convert_s - assembly.verify_s,
                             publish_s=time.perf_counter() - t1)
    return tables, report


# ---------------------------------------------------------------------------------------------
# Without a process group: a kvbridge control channel, then a two-rank gloo group per request


def _pair_group(store: dist.Store, request_id: str, rank: int, timeout: float) -> dist.ProcessGroup:
    return dist.ProcessGroupGloo(dist.PrefixStore(f"kvbridge/{request_id}", store), rank, 2,
                                 timedelta(seconds=max(1.0, timeout)))


class GlooServer:
    """Decode side for ``kvbridge migrate serve --transport gloo``: listens on ``host:port``; per
    request, a kvbridge handshake over TCP (plan fingerprint), then a two-rank gloo group formed
    through a store this side hosts, then ``receive_request`` (streamed, verified, published at
    the end). ``plan`` is the plan or a callable building it from the sender's request info (with the
    request id it announced under ``request_id``). ``computed``: called (on the connection's thread) once
    the plan is agreed, the tokens this receiver computed itself (its prefix-cache hit); when nonzero, the
    accept message names them and both ends move only ``plan.past(computed)``. ``tp``: this receiver's
    tensor-parallel ``(rank, size)``; a sender at another position is refused at the handshake (``check_tp``).

    ``receive`` serves one connection; ``serve`` serves connections concurrently (each request
    its own gloo pair; publishing and releasing pages hold ``lock``). While data flows the
    control connection is watched: a sender that dies is noticed when its socket closes."""

    def __init__(self, dst: EnginePools, *, plan: MigrationPlan | Callable[[dict], MigrationPlan],
                 host: str = "127.0.0.1", port: int = 0, loss_report: bool = True,
                 handshake_s: float = DEFAULT_HANDSHAKE_S, computed: Callable[[], int] | None = None,
                 tp: tuple[int, int] = (0, 1)):
        self.dst, self.plan, self.loss_report, self.handshake_s = dst, plan, loss_report, handshake_s
        self.computed, self.tp = computed, tp_position(tp)
        self.listener = Listener(host, port)
        self.lock = threading.Lock()
        self.expect_id: str | None = None
        self.publish: Publish | None = None

    @property
    def address(self) -> tuple[str, int]:
        return self.listener.host, self.listener.port

    def close(self) -> None:
        self.listener.close()

    def serve(self, *, timeout: float = 60.0, max_connections: int = DEFAULT_MAX_CONNECTIONS) -> ConnectionServer:
        """Serve connections concurrently; ``next`` on the result yields (peer, request id, tables, report)."""
        return ConnectionServer(self.listener, self._handle, timeout=_check_timeout(timeout),
                                handshake_s=self.handshake_s, max_connections=max_connections)

    def receive(self, *, timeout: float = 60.0, accept_timeout: float | None = None, request_id: str | None = None,
                publish: Publish | None = None) -> tuple[str, str, RequestTables, MigrationReport] | None:
        """(peer, request id, tables, report) of one request, or None after ``accept_timeout`` s idle.

        ``request_id``: refuse a sender announcing another request id. ``publish``: see
        ``receive_request``."""
        timeout = _check_timeout(timeout)
        chan = self.listener.accept(accept_timeout)
        if chan is None:
            return None
        deadline = time.monotonic() + timeout
        self.expect_id, self.publish = request_id, publish
        try:
            hello, blob = handshake(chan, deadline, self.handshake_s)
            return self._handle(chan, hello, blob, deadline)
        except KVBridgeError as exc:
            send_error(chan, first_line(exc))
            raise
        finally:
            chan.close()

    def _handle(self, chan: Channel, hello: dict, blob: bytes, deadline: float
                ) -> tuple[str, str, RequestTables, MigrationReport]:
        try:
            return self._request(chan, hello, deadline)
        except RuntimeError as exc:  # gloo failing to form the group (peer gone, timeout)
            raise TransferError(f"could not form a gloo group with {chan.peer} ({_reason(exc)}); "
                                "nothing was published") from None
        except (KeyError, TypeError, ValueError, AttributeError, IndexError) as exc:  # a malformed message
            raise MigrationError(f"refused {chan.peer}: malformed control message ({type(exc).__name__})") from None

    def _request(self, chan: Channel, hello: dict, deadline: float) -> tuple[str, str, RequestTables, MigrationReport]:
        rid = check_name(hello.get("request_id"), f"the request id from {chan.peer}")
        if hello.get("kind") != "request" or hello.get("transport") != "gloo":
            raise MigrationError(f"refused request {rid} from {chan.peer}: this receiver takes requests over "
                                 f"gloo, the sender offers a {hello.get('kind')} over {hello.get('transport')}")
        if self.expect_id is not None and rid != self.expect_id:
            raise MigrationError(f"refused request {rid} from {chan.peer}: this receiver waits for request "
                                 f"{self.expect_id}")
        check_tp(hello, self.tp, lambda why: MigrationError(f"refused request {rid} from {chan.peer}: {why}"))
        try:
            plan = self.plan({**hello["request"], "request_id": rid}) if callable(self.plan) else self.plan
        except KVBridgeError as exc:
            raise MigrationError(f"refused request {rid} from {chan.peer}: cannot plan it here ({exc})") from None
        if hello.get("fingerprint") != wire_fingerprint(plan):
            req = hello.get("request", {})
            raise MigrationError(
                f"refused request {rid} from {chan.peer}: the sender's plan ({req.get('src')} -> "
                f"{req.get('dst')}, {req.get('model')}) differs from this receiver's ({plan.src.spec} -> "
                f"{plan.dst.spec}, {plan.model.name}); plan fingerprints differ")
        computed = self.computed() if self.computed is not None else 0
        plan = plan.past(computed)
        if self.publish is None:
            with self.lock:
                check_room(plan, self.dst, lambda why: MigrationError(f"refused request {rid} from {chan.peer}: "
                                                                      f"{why}"))
        remaining = max(1.0, deadline - time.monotonic())
        store = dist.TCPStore(self.listener.host, 0, 2, True, timedelta(seconds=remaining), wait_for_workers=False)
        chan.send({"type": "accept", "store_port": store.port, "computed_tokens": computed}, deadline=deadline)
        group = _pair_group(store, rid, 1, remaining)
        publish = self.publish or self._publish
        tables, report = receive_request(plan, self.dst, src_rank=0, group=group,
                                         timeout=max(0.01, deadline - time.monotonic()),
                                         loss_report=self.loss_report, publish=publish, watch=chan.peer_gone)
        try:
            chan.send({"type": "result", "ok": True, "summary": report.to_dict()}, deadline=deadline)
        except TransferError:
            pass  # published; the sender went away before hearing it
        return chan.peer, rid, tables, report

    def _publish(self, assembly: RequestAssembly) -> RequestTables:
        with self.lock:
            return assembly.publish(self.dst)


def send_request_tcp(plan: MigrationPlan, src: EnginePools, tables: RequestTables, *, host: str, port: int,
                     convert_on: ConvertSide = "receiver", layers_per_group: int = 1, timeout: float = 60.0,
                     progress: Progress | None = None, loss_report: bool = True,
                     chunk_bytes: int = DEFAULT_CHUNK_BYTES, request_id: str | None = None,
                     tp: tuple[int, int] = (0, 1)) -> dict:
    """Prefill side for a ``GlooServer``: handshake, form the gloo pair, stream the request; returns the
    receiver's report (a dict), or raises its error. ``request_id`` names the request to the receiver
    (default: a random id; up to 64 characters); ``tp``: this sender's tensor-parallel ``(rank, size)``."""
    tp = tp_position(tp)
    deadline = time.monotonic() + _check_timeout(timeout)
    if request_id is not None and (not isinstance(request_id, str) or not 0 < len(request_id) <= 64):
        raise InputError(f"request_id must be a string of 1 to 64 characters, got {repr(request_id)[:40]}")
    rid = request_id or uuid.uuid4().hex[:16]
    chan = Channel.connect(host, port, deadline)
    try:
        chan.send({"type": "hello", "kvbridge": __version__, "transport": "gloo", "kind": "request",
                   "request_id": rid, "request": request_info(plan), "fingerprint": wire_fingerprint(plan),
                   "convert_on": convert_on, "tp": list(tp)}, deadline=deadline)
        accept, _ = chan.expect("accept", deadline, "the receiver's accept")
        try:  # the receiver computed a prefix itself: both ends move the rest only
            plan = plan.past(accept.get("computed_tokens", 0))
        except InputError as exc:
            raise MigrationError(f"{host}:{port} accepted with a prefix-cache hit this plan cannot skip: "
                                 f"{exc}") from None
        remaining = max(1.0, deadline - time.monotonic())
        try:
            store = dist.TCPStore(host, int(accept["store_port"]), 2, False, timedelta(seconds=remaining))
            group = _pair_group(store, rid, 0, remaining)
        except RuntimeError as exc:
            raise TransferError(f"could not form a gloo group with {host}:{port} ({_reason(exc)})") from None
        try:
            send_request(plan, src, tables, dst_rank=1, group=group, convert_on=convert_on,
                         layers_per_group=layers_per_group, chunk_bytes=chunk_bytes,
                         timeout=max(0.01, deadline - time.monotonic()), progress=progress, loss_report=loss_report)
        except TransferError:
            if chan.readable(1.0):
                chan.expect("result", deadline, "the receiver's verdict")  # raises the receiver's error
            raise
        result, _ = chan.expect("result", deadline, "the receiver's verdict")
        return dict(result.get("summary", {}))
    finally:
        chan.close()
