"""Moving a request (or a dump) between processes or hosts with NIXL, one layer group at a time.

NIXL (``pip install 'kvbridge[nixl]'``; imported only when an agent starts) writes one-sided,
straight into the peer's registered memory. kvbridge adds a TCP control channel of its own
(``kvbridge.migration.control``) for the handshake, the agents' metadata, per-group checksums
and the verdict:

1. the sender connects and says ``hello``: what it sends (a request's engines, model and
   length, or a dump's entries), the plan fingerprint, where conversion runs, the layer groups
   (``kvbridge.migration.stream``) and its agent's metadata. The receiver rebuilds the plan
   itself and refuses a different fingerprint, a foreign peer or a full pool with one line;
2. the receiver ``accept``s: its agent's metadata and the base address of every region the
   sender may write. When the sender converts, the receiver claims the request's pages up front
   and sends their ids: the sender writes destination records by page index straight into the
   registered destination pools (one descriptor per run of rows in a page, merged where pages
   are adjacent). When the receiver converts, the sender writes the source records into the
   receiver's staging buffer, one descriptor per group;
3. per group, the sender posts one NIXL WRITE (with a notification), and once it completed
   sends the group's XXH3-64 checksums (one per page chunk). The receiver waits for both, verifies
   every chunk on the bytes that landed, and converts the group while the next one flies;
4. after the last group the receiver publishes (returns the block tables; or claims pages and
   scatters the converted records, or hands them to the caller's ``publish``, e.g. an engine writing
   them through its own block ids; or writes the dump atomically) and sends the ``result``.

Guarantees: every chunk verified before anything is published; a dead sender (connection
closed), a stalled one or a wedged agent is a ``TransferError`` within the caller's timeout;
on any failure the claimed pages are zeroed and released (``num_free`` is as before) and the
receiver keeps serving. Each side's NIXL agent runs in a child process (in a daemonic process,
which cannot have children, in the process itself) that ends with ``os._exit``: NIXL's bundled
libraries can crash a process at exit after its peer died, and after a failure the receiver
replaces its agent, so a stalled sender's late writes cannot land in pages handed to the next
request. Memory is registered once: the destination pools (moved into shared memory, in place, so
the agent process writes them) and a staging buffer that grows to the largest request. DRAM only
in this version.

This module holds the receiver and the sender; ``nixl_agent`` the agent and its process,
``nixl_wire`` where each checksummed chunk lands, ``nixl_send`` the sender's side of one transfer.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from kvbridge.dumps.convert import convert_entry
from kvbridge.dumps.dumpfile import Dump, DumpEntry, read_dump
from kvbridge.dumps.writer import write_dump
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
from kvbridge.migration.errors import ChecksumError, MigrationError, TransferError
from kvbridge.migration.execute import ConvertSide, MigrationReport, Payload, check_pools
from kvbridge.migration.nixl_agent import AGENT_CALL_S, _Agent, _LocalAgent, _new_agent
from kvbridge.migration.nixl_send import Progress, RequestStream, _Connection
from kvbridge.migration.nixl_wire import (
    _DTYPES,
    _Chunk,
    _dump_groups,
    _entry_chunk_rows,
    _entry_info,
    _entry_nbytes,
    _np,
    _pieces_of,
    _pool_chunks,
    _pool_keys,
    _staging_chunks,
    _tensor_tables,
    _xxh3_all,
    dump_fingerprint,
)
from kvbridge.migration.plan import MigrationPlan
from kvbridge.migration.pools import EnginePools, RequestTables, pool_tensors
from kvbridge.migration.rows import CHECKSUM, chunk_rows
from kvbridge.migration.stream import (
    Publish,
    RequestAssembly,
    check_groups,
    layer_groups,
    past_groups,
    wire_fingerprint,
)
from kvbridge.ops.loss import LossReport


@dataclass
class DumpTarget:
    """What a receiving side converts dumps into (the arguments of ``kvbridge convert``)."""

    layout: str
    page_size: int | None = None
    dialect: str | None = None
    scale: float | str | None = None

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


# ---------------------------------------------------------------------------------------------
# Receiver


@dataclass
class Received:
    """One finished receive: a request (``tables``, ``report``) or a dump (``path``, ``loss``)."""

    kind: str
    peer: str
    request_id: str
    report: MigrationReport | None = None
    tables: RequestTables | None = None
    path: Path | None = None
    loss: list[LossReport] = field(default_factory=list)
    payload_bytes: int = 0
    wire_s: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        data: dict[str, Any] = {"kind": self.kind, "peer": self.peer, "request_id": self.request_id,
                                "payload_bytes": self.payload_bytes, "wire_s": self.wire_s}
        if self.report is not None:
            data["report"] = self.report.to_dict()
        if self.tables is not None:
            data["tables"] = self.tables
        if self.path is not None:
            data["path"] = str(self.path)
            data["lossless"] = all(r.lossless for r in self.loss)
            data["loss"] = [r.to_dict() for r in self.loss]
        return data


PlanFor = Callable[[dict], MigrationPlan]


class NixlReceiver:
    """Decode side: listens on ``host:port`` (0: a free port) and receives one request per ``receive``.

    ``plan``: the plan every request must match, or a callable building it from the sender's
    ``request_info`` and the request id it announced (``request_id``; ``kvbridge migrate serve``
    rebuilds it with its own engine and model).
    ``dst``: the pools requests land in (moved into shared memory and registered once).
    ``dump_target``/``dump_dir``: accept dumps too, converted like ``kvbridge convert`` and
    written atomically into ``dump_dir``.
    ``computed``: called (on the receiving thread) once a request's plan is agreed, the tokens this receiver
    computed itself (its prefix-cache hit); when nonzero the accept names them and both ends move only
    ``plan.past(computed)`` (its layer groups renumbered: ``past_groups``). ``tp``: this receiver's
    tensor-parallel ``(rank, size)``; a sender at another position is refused (``check_tp``).
    """

    def __init__(self, dst: EnginePools | None = None, *, plan: MigrationPlan | PlanFor | None = None,
                 host: str = "127.0.0.1", port: int = 0, dump_target: DumpTarget | None = None,
                 dump_dir: str | os.PathLike | None = None, overwrite: bool = False, loss_report: bool = True,
                 handshake_s: float = DEFAULT_HANDSHAKE_S, computed: Callable[[], int] | None = None,
                 tp: tuple[int, int] = (0, 1)):
        if dst is None and dump_target is None:
            raise InputError("a receiver needs destination pools (requests), a dump target (dumps), or both")
        if dump_target is not None and dump_dir is None:
            raise InputError("dump_target needs dump_dir, the directory received dumps are written to")
        if dump_dir is not None and not Path(dump_dir).is_dir():
            raise InputError(f"dump directory {dump_dir} does not exist")
        if dst is not None:
            for (layer, role), pool in dst.pools.items():
                for t in pool_tensors(pool):
                    if t.device.type != "cpu" or not t.is_contiguous():
                        raise InputError(f"pool of layer {layer} {role.value} must be contiguous CPU tensors for "
                                         f"NIXL (this version registers DRAM only), got {t.device} "
                                         f"{'contiguous' if t.is_contiguous() else 'strided'}")
        self.dst, self.plan, self.computed, self.tp = dst, plan, computed, tp_position(tp)
        self.dump_target, self.overwrite, self.loss_report = dump_target, overwrite, loss_report
        self.dump_dir = None if dump_dir is None else Path(dump_dir)
        self.listener = Listener(host, port)
        self.handshake_s = handshake_s
        #: Held while a connection uses the agent, the staging buffer or the pools' free lists.
        self.lock = threading.Lock()
        self.agent: _Agent | _LocalAgent | None = None
        self.staging = torch.empty(0, dtype=torch.uint8)
        self.memory: dict[str, np.ndarray] = {}
        if dst is not None:
            for pool in dst.pools.values():
                for t in pool_tensors(pool):
                    t.share_memory_()

    @property
    def address(self) -> tuple[str, int]:
        return self.listener.host, self.listener.port

    def _ensure_agent(self) -> _Agent | _LocalAgent:
        if self.agent is not None and self.agent.alive():
            return self.agent
        agent = _new_agent(f"kvbridge-rx-{uuid.uuid4().hex[:12]}")
        try:
            if self.dst is not None:
                for (layer, role), pool in self.dst.pools.items():
                    for k, t in enumerate(pool_tensors(pool)):
                        key = f"pool.{layer}.{role.value}" + (".score" if k else "")
                        agent.register(key, t)
                        self.memory[key] = _np(t)
            if self.staging.numel():
                agent.register("staging", self.staging)
        except BaseException:
            agent.kill()
            raise
        self.agent = agent
        return agent

    def _ensure_staging(self, nbytes: int) -> None:
        if self.staging.numel() < nbytes:
            self.staging = torch.empty(nbytes, dtype=torch.uint8).share_memory_()
            self.memory["staging"] = self.staging.numpy()
            if self.agent is not None:
                self.agent.register("staging", self.staging)

    def close(self) -> None:
        self.listener.close()
        if self.agent is not None:
            self.agent.close()
            self.agent = None

    def __enter__(self) -> NixlReceiver:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def receive(self, *, timeout: float = 60.0, accept_timeout: float | None = None,
                on_group: Callable[[int, int], None] | None = None, request_id: str | None = None,
                publish: Publish | None = None) -> Received | None:
        """Wait for one sender (None after ``accept_timeout`` seconds without one) and receive its request
        within ``timeout`` seconds. ``request_id``: refuse a sender announcing another request id.
        ``publish``: where a request this side converts goes once every group is verified and converted,
        instead of claiming pages of ``dst`` (an engine writing it into its own blocks; its ``tables`` are what
        ``publish`` returns); a request the sender converted lands in ``dst``'s pages as always.
        Raises ``MigrationError``/``TransferError`` with one line; the receiver stays usable."""
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout > 0:
            raise InputError(f"timeout must be a positive number of seconds, got {timeout!r}")
        with self.lock:
            self._ensure_agent()
        chan = self.listener.accept(accept_timeout)
        if chan is None:
            return None
        deadline = time.monotonic() + timeout
        session = _Session(self, chan, deadline, on_group, request_id, publish)
        try:
            return session.serve(lambda: handshake(chan, deadline, self.handshake_s))
        finally:
            chan.close()

    def serve(self, *, timeout: float = 60.0, max_connections: int = DEFAULT_MAX_CONNECTIONS) -> ConnectionServer:
        """Serve connections concurrently: handshakes and refusals in parallel, transfers one at a time
        (they share the agent and the staging buffer; a waiting connection's ``timeout`` keeps running).
        ``next`` on the result yields each ``Received`` or raises each connection's error."""
        with self.lock:
            self._ensure_agent()

        def handle(chan: Channel, hello: dict, meta: bytes, deadline: float) -> Received:
            return _Session(self, chan, deadline, None).serve(lambda: (hello, meta))

        return ConnectionServer(self.listener, handle, timeout=timeout, handshake_s=self.handshake_s,
                                max_connections=max_connections)


class _Session:
    """One connection on the receiver."""

    def __init__(self, rx: NixlReceiver, chan: Channel, deadline: float, on_group, expect_id: str | None = None,
                 publish: Publish | None = None):
        self.rx, self.chan, self.deadline, self.on_group = rx, chan, deadline, on_group
        self.expect_id, self.publish = expect_id, publish
        self.claimed: RequestTables | None = None
        self.remote: str | None = None
        self.notifs: set[bytes] = set()
        self.plan: MigrationPlan | None = None
        self.groups: list[list[int]] = []  # the request's layer groups (of the plan past its prefix-cache hit)
        self.computed = 0  # the receiver's prefix-cache hit, in tokens
        self.request_id = "?"
        self.failed = False

    def fail(self, exc: BaseException) -> None:
        """Tell the sender (if it still listens), stop the agent if a peer could still write, undo any claim
        (once; the caller holds the receiver's lock when anything was connected or claimed)."""
        if self.failed:
            return
        self.failed = True
        msg = first_line(exc) if isinstance(exc, KVBridgeError) else f"receiver failed: {first_line(exc)}"
        send_error(self.chan, msg)
        if self.remote is not None and self.rx.agent is not None:
            self.rx.agent.kill()  # late writes from a stalled sender end here; the next receive starts a new agent
            self.rx.agent = None
        if self.claimed is not None and self.rx.dst is not None and self.plan is not None:
            dst = self.rx.dst
            for t in self.plan.transfers:
                for tensor, name in _tensor_tables(t.dst, dst.pool(t.spec)):
                    tensor[[i for i in self.claimed[name] if i >= 0]] = 0
            dst.release(self.claimed)
            self.claimed = None

    def serve(self, hello_of: Callable[[], tuple[dict, bytes]]) -> Received:
        """Check the hello (``hello_of``: the handshake) without the lock, then transfer under it; any
        failure is told to the sender and undone (``fail``), then raised as one line."""
        try:
            hello, meta = hello_of()
            check = self._prepare(hello)
            if not self.rx.lock.acquire(timeout=max(0.0, self.deadline - time.monotonic())):
                raise TransferError(f"timed out waiting for the transfer before request {self.request_id} from "
                                    f"{self.chan.peer}; nothing was published")
            try:
                return self._run(check, hello, meta)
            except BaseException as exc:
                self.fail(exc)
                raise
            finally:
                self.rx.lock.release()
        except KVBridgeError as exc:
            self.fail(exc)
            raise
        except (KeyError, TypeError, ValueError, AttributeError, IndexError) as exc:  # a malformed message
            error = MigrationError(f"refused request {self.request_id} from {self.chan.peer}: malformed control "
                                   f"message ({type(exc).__name__}: {first_line(exc)})")
            self.fail(error)
            raise error from None
        except OSError as exc:  # e.g. the dump directory went away
            error = MigrationError(f"request {self.request_id} from {self.chan.peer} failed on the receiver "
                                   f"({exc.strerror or exc}); nothing was published")
            self.fail(error)
            raise error from None

    def _prepare(self, hello: dict) -> Any:
        """What can be refused before anything moves (name, kind, plan, fingerprint, room): a plan, or a
        dump's output path."""
        self.request_id = check_name(hello.get("request_id"), f"the request id from {self.chan.peer}")
        if self.expect_id is not None and self.request_id != self.expect_id:
            raise self._refuse(f"this receiver waits for request {self.expect_id}")
        kind = hello.get("kind")
        if kind == "request":
            check_tp(hello, self.rx.tp, self._refuse)
            return self._plan(hello)
        if kind == "dump":
            return self._dump_path(hello)
        raise MigrationError(f"refused {self.chan.peer}: unknown transfer kind {kind!r}")

    def _run(self, check: Any, hello: dict, meta: bytes) -> Received:
        self.rx._ensure_agent()
        if hello["kind"] == "request":
            return self._request(check, hello, meta)
        return self._dump(check, hello, meta)

    def _refuse(self, text: str) -> MigrationError:
        return MigrationError(f"refused request {self.request_id} from {self.chan.peer}: {text}")

    def _connect(self, meta: bytes, regions: list[str], extra: dict) -> None:
        agent = self.rx._ensure_agent()
        self.remote = agent.call("adding the sender's agent", "add_remote", meta)
        mine = agent.call("reading this agent's metadata", "metadata")
        addr = {k: [agent.addresses[k], int(self.rx.memory[k].size)] for k in regions}
        self.chan.send({"type": "accept", "agent": agent.name, "regions": addr, **extra}, mine,
                       deadline=self.deadline)

    def _groups(self, hello: dict):
        """Yield (g, group header) once group g's data landed: its header arrived and its notification
        was seen. The agent is polled meanwhile (it has no progress thread: polling is what moves
        the data on this side), the connection watched for a dead sender."""
        agent = self.rx.agent
        assert agent is not None
        groups = self.groups if hello["kind"] == "request" else hello["groups"]
        for g in range(len(groups)):
            what = f"group {g + 1}/{len(groups)}'s checksums"
            tag = f"kvb:{hello['request_id']}:{g}".encode()
            head = None
            while head is None or tag not in self.notifs:
                remaining = self.deadline - time.monotonic()
                if remaining <= 0:
                    raise TransferError(f"timed out waiting for {what} from {self.chan.peer}; nothing was published")
                if head is None and self.chan.readable(0.0):
                    head, _ = self.chan.expect("group", self.deadline, what)
                    if head.get("g") != g:
                        raise MigrationError(f"{self.chan.peer} sent group {head.get('g')} where group {g} was due")
                    continue
                if tag not in self.notifs:
                    step = min(0.05, remaining)
                    self.notifs.update(agent.call("waiting for notifications", "notifs", step,
                                                  timeout=step + AGENT_CALL_S))
                else:
                    self.chan.readable(min(0.05, remaining))
            yield g, head

    def _check(self, chunks: Sequence[_Chunk], sums: Sequence[int], what: Callable[[int], str]) -> None:
        if len(sums) != len(chunks):
            raise MigrationError(f"{self.chan.peer} sent {len(sums)} checksums for {len(chunks)} chunks")
        for i, (have, want) in enumerate(zip(_xxh3_all(self.rx.memory, chunks), sums, strict=True)):
            if have != want:
                raise ChecksumError(f"checksum mismatch in {what(i)} ({CHECKSUM} {have:#018x}, sender sent "
                                    f"{want:#018x}); nothing was published")

    # -- requests -------------------------------------------------------------------------------

    def _plan(self, hello: dict) -> MigrationPlan:
        rx = self.rx
        if rx.dst is None or rx.plan is None:
            raise self._refuse("this receiver does not take requests (no destination pools)")
        try:
            plan = rx.plan({**hello["request"], "request_id": self.request_id}) if callable(rx.plan) else rx.plan
        except KVBridgeError as exc:
            raise self._refuse(f"cannot plan it here ({first_line(exc)})") from None
        if hello.get("fingerprint") != wire_fingerprint(plan):
            req = hello.get("request", {})
            raise self._refuse(f"the sender's plan ({req.get('src')} -> {req.get('dst')}, {req.get('model')}, "
                               f"{req.get('num_tokens')} tokens) differs from this receiver's ({plan.src.spec} -> "
                               f"{plan.dst.spec}, {plan.model.name}); plan fingerprints differ")
        check_pools(plan, rx.dst, "dst")
        groups = check_groups(plan, hello["groups"])
        self.computed = rx.computed() if rx.computed is not None else 0
        if self.computed:  # the receiver holds a prefix itself: both ends move the rest only
            groups, plan = past_groups(plan, groups, self.computed), plan.past(self.computed)
        self.groups = groups
        check_room(plan, rx.dst, self._refuse)  # before anything moves; the claim itself is under the lock
        return plan

    def _request(self, plan: MigrationPlan, hello: dict, meta: bytes) -> Received:
        rx, chan = self.rx, self.chan
        assert rx.dst is not None
        self.plan = plan
        groups = self.groups
        converted = hello.get("convert_on") == "sender"
        t0 = time.perf_counter()
        assembly = RequestAssembly(plan, loss_report=rx.loss_report)
        if converted:
            try:
                self.claimed = rx.dst.claim(plan.table_lengths("dst"), plan.released("dst"))
            except InputError as exc:
                raise self._refuse(first_line(exc)) from None
            regions = sorted({key for t in plan.transfers for key in _pool_keys(t)})
            self._connect(meta, regions, {"tables": self.claimed, "computed_tokens": self.computed})
            layouts = [[c for c, _ in _pool_chunks(t, self.claimed,
                                                     [x.shape[0] for x in pool_tensors(rx.dst.pool(t.spec))])]
                       for t in plan.transfers]
        else:
            bases = np.cumsum([0] + [t.src_bytes for t in plan.transfers]).tolist()
            rx._ensure_staging(int(bases[-1]))
            self._connect(meta, ["staging"], {"tables": None, "computed_tokens": self.computed})
            layouts = [_staging_chunks(chunk_rows(t, t.src), t.src.record_bytes, bases[i])
                       for i, t in enumerate(plan.transfers)]
        for g, head in self._groups(hello):
            idx = groups[g]
            chunks = [c for i in idx for c in layouts[i]]
            names = [(plan.transfers[i], k) for i in idx for k in range(len(layouts[i]))]

            def where(j: int, names=names) -> str:
                t, k = names[j]
                side = "destination page run" if converted else "source page chunk"
                return f"layer {t.spec.layer} {t.spec.role.value}, {side} {k}"

            t1 = time.perf_counter()
            self._check(chunks, head["xxh3_64"], where)
            assembly.verify_s += time.perf_counter() - t1
            if converted:
                assembly.converted_on = "sender"
                assembly.payload_bytes += sum(c.nbytes for c in chunks)
                assembly.add_loss([LossReport(**r) for r in head.get("loss", [])], head.get("indexer_max_abs_error"))
            else:
                records = [torch.from_numpy(rx.memory["staging"][bases[i] : bases[i + 1]]).view(
                    plan.transfers[i].count, plan.transfers[i].src.record_bytes) for i in idx]
                assembly.add(idx, Payload(plan.fingerprint(), False, records, [], []), verified=True)
            if self.on_group is not None:
                self.on_group(g + 1, len(groups))
        self.chan.expect("done", self.deadline, "the sender's end of request")
        t2 = time.perf_counter()
        if converted:
            tables = self.claimed
        elif self.publish is not None:
            tables = self.publish(assembly)
        else:
            tables = assembly.publish(rx.dst)
        self.claimed = None
        report = assembly.report(wire_s=t2 - t0 - assembly.convert_s - assembly.verify_s,
                                 publish_s=time.perf_counter() - t2)
        self._finish(report.to_dict())
        return Received("request", chan.peer, self.request_id, report=report, tables=tables,
                        payload_bytes=report.payload_bytes, wire_s=report.wire_s)

    def _finish(self, summary: dict) -> None:
        try:
            self.chan.send({"type": "result", "ok": True, "summary": summary}, deadline=self.deadline)
        except TransferError:
            pass  # published; the sender went away before hearing it
        if self.remote is not None and self.rx.agent is not None:
            try:
                self.rx.agent.call("dropping the sender's agent", "remove_remote", self.remote)
            except TransferError:
                self.rx.agent = None
            self.remote = None

    # -- dumps ----------------------------------------------------------------------------------

    def _dump_path(self, hello: dict) -> Path:
        rx = self.rx
        if rx.dump_target is None or rx.dump_dir is None:
            raise self._refuse("this receiver does not take dumps (no dump target)")
        try:
            name = check_name(hello.get("name"), "the dump name")
        except MigrationError as exc:
            raise self._refuse(str(exc)) from None
        out = rx.dump_dir / name
        if out.exists() and not rx.overwrite:
            raise self._refuse(f"{out} exists (serve with --force to overwrite)")
        return out

    def _dump(self, out: Path, hello: dict, meta: bytes) -> Received:
        rx = self.rx
        assert rx.dump_target is not None
        self.plan = None
        source, wire = hello["source"], hello["wire"]
        target = rx.dump_target.to_dict()
        sent_target = hello.get("target")
        converted = hello.get("convert_on") == "sender"
        if converted and sent_target is None:
            raise self._refuse("a sender that converts must name the target layout")
        if hello.get("fingerprint") != dump_fingerprint(source, target if sent_target is not None else None) or \
                (sent_target is not None and sent_target != target):
            raise self._refuse(f"the sender converts to {sent_target}, this receiver to {target}; "
                               "plan fingerprints differ")
        if len(wire) != len(source):
            raise self._refuse("the sender lists a different number of wire and source entries")
        sizes = [_entry_nbytes(w) for w in wire]
        bases = np.cumsum([0] + sizes).tolist()
        groups = hello["groups"]
        if sorted(i for g in groups for i in g) != list(range(len(wire))) or any(not g for g in groups):
            raise self._refuse("its layer groups do not cover its entries exactly once")
        rx._ensure_staging(int(bases[-1]))
        self._connect(meta, ["staging"], {"tables": None})
        t0 = time.perf_counter()
        layouts = [_staging_chunks(_entry_chunk_rows(w), sizes[i] // max(1, w["shape"][0]), bases[i])
                   for i, w in enumerate(wire)]
        for g, head in self._groups(hello):
            chunks = [c for i in groups[g] for c in layouts[i]]
            names = [(wire[i]["name"], k) for i in groups[g] for k in range(len(layouts[i]))]
            self._check(chunks, head["xxh3_64"], lambda j, names=names: f"entry {names[j][0]}, chunk {names[j][1]}")
            if self.on_group is not None:
                self.on_group(g + 1, len(groups))
        self.chan.expect("done", self.deadline, "the sender's end of dump")
        wire_s = time.perf_counter() - t0
        entries, loss = [], [LossReport(**r) for r in hello.get("loss", [])]
        try:
            for i, w in enumerate(wire):
                raw = torch.from_numpy(rx.memory["staging"][bases[i] : bases[i + 1]].copy())
                data = raw.view(_DTYPES[w["dtype"]]).view(w["shape"])
                kwargs = {k: w.get(k) for k in ("layout", "page_size", "num_tokens", "scale", "dialect",
                                                "compress_ratio")}
                entry = DumpEntry(w["layer"], w["role"], data, **kwargs)
                if not converted:
                    entry, rep = convert_entry(entry, target["layout"], page_size=target["page_size"],
                                               dialect=target["dialect"], scale=target["scale"])
                    loss.append(rep)
                entries.append(entry)
        except InputError as exc:
            raise self._refuse(f"entry does not convert ({first_line(exc)})") from None
        path = write_dump(out, Dump(entries, attrs=dict(hello.get("attrs", {}))), overwrite=rx.overwrite)
        self._finish({"path": str(path), "entries": len(entries), "lossless": all(r.lossless for r in loss)})
        return Received("dump", self.chan.peer, self.request_id, path=path, loss=loss,
                        payload_bytes=int(bases[-1]), wire_s=wire_s)


# ---------------------------------------------------------------------------------------------
# Sender


class NixlSender:
    """Prefill side: one NIXL agent process (started on first use) sending to ``host:port``.

    ``timeout`` bounds each request end to end (connect, every group, the receiver's verdict).
    """

    def __init__(self, host: str, port: int, *, timeout: float = 60.0):
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout > 0:
            raise InputError(f"timeout must be a positive number of seconds, got {timeout!r}")
        self.host, self.port, self.timeout = host, port, float(timeout)
        self.agent: _Agent | _LocalAgent | None = None
        self.staging = torch.empty(0, dtype=torch.uint8)

    def _open(self, hello: dict, nbytes: int, progress: Progress | None = None,
              request_id: str | None = None) -> _Connection:
        """Open one transfer of ``nbytes`` staged bytes, announced by ``hello``."""
        deadline = time.monotonic() + self.timeout
        # the agent first (its start takes seconds): the receiver drops a peer slower than its handshake bound
        agent = self._ensure(nbytes)
        return _Connection(agent, self.staging.numpy(), self.host, self.port, deadline, hello, nbytes, progress,
                           request_id)

    def _ensure(self, nbytes: int) -> _Agent | _LocalAgent:
        if self.agent is None or not self.agent.alive():
            self.agent = _new_agent(f"kvbridge-tx-{uuid.uuid4().hex[:12]}")
            if self.staging.numel():
                self.agent.register("staging", self.staging)
        if self.staging.numel() < nbytes:
            self.staging = torch.empty(nbytes, dtype=torch.uint8).share_memory_()
            self.agent.register("staging", self.staging)
        return self.agent

    def warm_up(self, nbytes: int = 0) -> None:
        """Start the agent process now, with a staging buffer of ``nbytes`` registered (otherwise the
        first send starts it: a second or two)."""
        self._ensure(nbytes)

    def close(self) -> None:
        if self.agent is not None:
            self.agent.close()
            self.agent = None

    def __enter__(self) -> NixlSender:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def start_request(self, plan: MigrationPlan, src: EnginePools, tables: RequestTables, *,
                      convert_on: ConvertSide = "receiver", layers_per_group: int = 1, loss_report: bool = True,
                      progress: Progress | None = None, request_id: str | None = None,
                      tp: tuple[int, int] = (0, 1)) -> RequestStream:
        """Open a request: handshake now, then ``send_group()`` once per layer group, then ``close()``.
        ``request_id`` names it to the receiver (default: a random id; up to 64 characters); ``tp``: this
        sender's tensor-parallel ``(rank, size)`` (a receiver at another position refuses it)."""
        if convert_on not in ("sender", "receiver"):
            raise InputError(f"convert_on must be 'sender' or 'receiver', got {convert_on!r}")
        if request_id is not None and (not isinstance(request_id, str) or not 0 < len(request_id) <= 64):
            raise InputError(f"request_id must be a string of 1 to 64 characters, got {repr(request_id)[:40]}")
        check_pools(plan, src, "src")
        return RequestStream(functools.partial(self._open, progress=progress, request_id=request_id), plan, src,
                             tables, convert_on == "sender", layer_groups(plan, layers_per_group), loss_report,
                             tp_position(tp))

    def send_request(self, plan: MigrationPlan, src: EnginePools, tables: RequestTables, **kwargs: Any) -> dict:
        """Send a whole request (``start_request`` options); returns the receiver's report (a dict)."""
        stream = self.start_request(plan, src, tables, **kwargs)
        try:
            for _ in stream.groups:
                stream.send_group()
            return stream.close()
        except BaseException:
            stream.abort()
            raise

    def send_dump(self, dump: Dump | str | os.PathLike, *, name: str | None = None, target: DumpTarget | None = None,
                  convert_on: ConvertSide = "receiver", progress: Progress | None = None) -> dict:
        """Send a dump's entries; the receiver converts (or, with ``convert_on="sender"``, this side
        converts to ``target``) and writes dump ``name`` (default: the file's name)."""
        if not isinstance(dump, Dump):
            path = Path(dump)
            dump = read_dump(path)
            name = name or path.name
        if not name:
            raise InputError("a dump sent without a file needs a name")
        if convert_on == "sender" and target is None:
            raise InputError("convert_on='sender' needs the target layout")
        source = [_entry_info(e) for e in dump.entries]
        tdict = None if target is None else target.to_dict()
        wire_entries, loss = list(dump.entries), []
        if convert_on == "sender":
            assert target is not None
            wire_entries = []
            for e in dump.entries:
                out, rep = convert_entry(e, target.layout, page_size=target.page_size, dialect=target.dialect,
                                         scale=target.scale)
                wire_entries.append(out)
                loss.append(rep)
        wire = [_entry_info(e) for e in wire_entries]
        groups = _dump_groups(wire)
        hello = {"kind": "dump", "name": name, "attrs": dump.attrs, "source": source, "wire": wire,
                 "target": tdict, "convert_on": convert_on, "fingerprint": dump_fingerprint(source, tdict),
                 "loss": [r.to_dict() for r in loss], "groups": groups}
        sizes = [e.data.numel() * e.data.element_size() for e in wire_entries]
        bases = np.cumsum([0] + sizes).tolist()
        conn = self._open(hello, int(bases[-1]), progress)
        try:
            for g, idx in enumerate(groups):
                sums, pieces = [], []
                for i in idx:
                    conn.staged[bases[i] : bases[i + 1]] = _np(wire_entries[i].data.contiguous())
                    layout = _staging_chunks(_entry_chunk_rows(wire[i]), sizes[i] // max(1, wire[i]["shape"][0]),
                                             bases[i])
                    pieces.extend(_pieces_of(layout, bases[i]))
                    sums.extend(_xxh3_all({"staging": conn.staged}, layout))
                conn.post(g, pieces, {"xxh3_64": sums})
            return conn.finish()
        except BaseException:
            conn.abort()
            raise



def send_request(plan: MigrationPlan, src: EnginePools, tables: RequestTables, *, host: str, port: int,
                 timeout: float = 60.0, **kwargs: Any) -> dict:
    """One request to the receiver at ``host:port`` with a sender used once; returns the receiver's report."""
    with NixlSender(host, port, timeout=timeout) as sender:
        return sender.send_request(plan, src, tables, **kwargs)

