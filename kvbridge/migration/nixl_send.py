"""The sender's side of one NIXL transfer (``kvbridge.migration.nixl``'s ``NixlSender`` opens it): the
handshake, one posted WRITE per layer group and its checksums, the receiver's verdict; and the
request stream a prefill engine drives group by group.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable, Sequence

import numpy as np
import torch

from kvbridge._version import __version__
from kvbridge.backends import dispatch
from kvbridge.errors import InputError, KVBridgeError
from kvbridge.migration.control import Channel
from kvbridge.migration.errors import MigrationError, TransferError
from kvbridge.migration.nixl_agent import AGENT_CALL_S, _Agent, _LocalAgent
from kvbridge.migration.nixl_wire import Piece, _descriptors, _pieces_of, _pool_chunks, _stage_runs, _staging_chunks
from kvbridge.migration.plan import MigrationPlan
from kvbridge.migration.pools import EnginePools, RequestTables
from kvbridge.migration.stream import pack_group, past_groups, request_info, wire_fingerprint

#: Called with (bytes sent so far, total bytes) after each group.
Progress = Callable[[int, int], None]


class _Connection:
    """Sender side of one transfer: handshake, then one posted WRITE per group, then the verdict."""

    def __init__(self, agent: _Agent | _LocalAgent, staged: np.ndarray, host: str, port: int, deadline: float,
                 hello: dict, nbytes: int, progress: Progress | None, request_id: str | None = None):
        """``agent``: this side's, with ``staged`` (at least ``nbytes``) registered as ``staging``."""
        self.deadline, self.agent = deadline, agent
        self.chan = Channel.connect(host, port, self.deadline)
        self.remote: str | None = None
        try:
            self.staged = staged
            self.base = self.agent.addresses["staging"]
            self.total, self.sent, self.progress = nbytes, 0, progress
            self.request_id = request_id or uuid.uuid4().hex[:16]
            hello = {"type": "hello", "kvbridge": __version__, "transport": "nixl", "request_id": self.request_id,
                     **hello}
            meta = self.agent.call("reading this agent's metadata", "metadata")
            self.chan.send(hello, meta, deadline=self.deadline)
            accept, their_meta = self.chan.expect("accept", self.deadline, "the receiver's accept")
            self.regions = {k: int(v[0]) for k, v in accept["regions"].items()}
            self.tables = accept.get("tables")
            #: The receiver's prefix-cache hit (tokens it computed itself: only the rest moves).
            self.computed = accept.get("computed_tokens", 0)
            self.remote = self.agent.call("adding the receiver's agent", "add_remote", their_meta)
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            self.chan.close()
            raise MigrationError(f"{self.chan.peer} sent a malformed accept ({type(exc).__name__}); is it a "
                                 "kvbridge receiver of this version?") from None
        except BaseException:
            self.chan.close()
            raise
        self.pending: tuple[int, int, dict] | None = None

    def _remaining(self) -> float:
        remaining = self.deadline - time.monotonic()
        if remaining <= 0:
            raise TransferError(f"timed out sending to {self.chan.peer}; nothing was published")
        return remaining

    def post(self, g: int, pieces: Sequence[Piece], header: dict) -> None:
        """Post group ``g``'s WRITE of staged ``pieces``, then complete the previous group."""
        local, remote = _descriptors(pieces, self.base, self.regions)
        try:
            self.agent.call(f"posting group {g + 1}", "write", g, local, remote, self.remote,
                            f"kvb:{self.request_id}:{g}".encode())
            self._complete()
        except TransferError as exc:
            self._raise_peer_error()
            self._raise_lost(exc)
        self.pending = (g, sum(p[3] for p in pieces), header)

    def _raise_lost(self, exc: TransferError) -> None:
        text = str(exc)
        if "nothing was published" in text:
            raise exc
        raise TransferError(f"{text} (sending to {self.chan.peer}); the receiver died, gave up or the link broke; "
                            "nothing was published") from None

    def _raise_peer_error(self) -> None:
        """After a failure on this side: raise the receiver's own error instead, if it sent one."""
        try:
            message, _ = self.chan.recv(min(self.deadline, time.monotonic() + 2.0), "the receiver's error")
        except KVBridgeError:
            return
        if message.get("type") in ("error", "refuse"):
            raise MigrationError(str(message.get("error", "the receiver gave no reason"))) from None

    def _complete(self) -> None:
        if self.pending is None:
            return
        g, nbytes, header = self.pending
        remaining = self._remaining()
        state = self.agent.call(f"waiting for group {g + 1}", "wait", g, remaining, timeout=remaining + AGENT_CALL_S)
        if state == "PROC":
            raise TransferError(f"group {g + 1} to {self.chan.peer} did not complete within the timeout; "
                                "nothing was published")
        if state != "DONE":
            raise TransferError(f"NIXL transfer of group {g + 1} to {self.chan.peer} failed ({state}); the peer died "
                                "or the link broke; nothing was published")
        self.chan.send({"type": "group", "g": g, **header}, deadline=self.deadline)
        self.pending = None
        self.sent += nbytes
        if self.progress is not None:
            self.progress(self.sent, self.total)

    def finish(self) -> dict:
        try:
            self._complete()
            self.chan.send({"type": "done"}, deadline=self.deadline)
        except TransferError as exc:
            self._raise_peer_error()
            self._raise_lost(exc)
        result, _ = self.chan.expect("result", self.deadline, "the receiver's verdict")
        self._drop()
        return dict(result.get("summary", {}))

    def _drop(self) -> None:
        self.chan.close()
        if self.remote is not None and self.agent.alive():
            try:
                self.agent.call("dropping the receiver's agent", "remove_remote", self.remote)
            except TransferError:
                pass
            self.remote = None

    def abort(self) -> None:
        """After a failure: close the connection (the receiver gives up) and replace this side's agent."""
        self.chan.close()
        self.agent.kill()


class RequestStream:
    """An open request on a ``NixlSender``: ``send_group()`` per layer group, in order, then ``close()``.

    Each ``send_group`` packs the group's layers from ``src`` at that moment (so a prefill
    engine calls it once those layers are written), stages them and posts one WRITE; it returns
    while NIXL moves them. ``close`` waits for the receiver's verdict and returns its report. A receiver
    that accepts with a prefix-cache hit gets ``plan.past(hit)`` only (``plan`` and ``groups`` then are those).
    """

    def __init__(self, connect: Callable[[dict, int], _Connection], plan: MigrationPlan, src: EnginePools,
                 tables: RequestTables, convert: bool, groups: list[list[int]], loss_report: bool,
                 tp: tuple[int, int] = (0, 1)):
        """``connect(hello, nbytes)``: the sender's connection for this request; ``tp``: this sender's
        tensor-parallel ``(rank, size)``."""
        self.src, self.tables, self.convert, self.loss_report = src, tables, convert, loss_report
        self.next_group = 0
        sizes = [t.dst_bytes if convert else t.src_bytes for t in plan.transfers]
        hello = {"kind": "request", "request": request_info(plan), "fingerprint": wire_fingerprint(plan),
                 "convert_on": "sender" if convert else "receiver", "groups": groups, "tp": list(tp)}
        self.conn = connect(hello, sum(sizes))
        try:  # the receiver computed a prefix itself: both ends move the rest only
            self.plan = plan.past(self.conn.computed)
            self.groups = past_groups(plan, groups, self.conn.computed)
        except (InputError, TypeError) as exc:
            self.abort()
            raise MigrationError(f"{self.conn.chan.peer} accepted with a prefix-cache hit this plan cannot skip: "
                                 f"{exc}") from None
        sizes = [t.dst_bytes if convert else t.src_bytes for t in self.plan.transfers]
        self.bases = np.cumsum([0] + sizes).tolist()
        if convert and not isinstance(self.conn.tables, dict):
            self.abort()
            raise MigrationError(f"{self.conn.chan.peer} accepted without destination pages")

    def send_group(self) -> None:
        """Pack, stage and post the next layer group."""
        if self.next_group >= len(self.groups):
            raise InputError(f"all {len(self.groups)} layer groups were already sent")
        g = self.next_group
        idx = self.groups[g]
        staged = self.conn.staged
        into = None if self.convert else [  # source records: gathered straight into the registered staging buffer
            torch.from_numpy(staged[int(self.bases[i]) : int(self.bases[i + 1])]).view(
                self.plan.transfers[i].count, self.plan.transfers[i].src.record_bytes) for i in idx]
        payload = pack_group(self.plan, self.src, self.tables, idx, convert=self.convert, loss_report=self.loss_report,
                             checksum=not self.convert, into=into)  # converted: the staged page runs are summed below
        pieces: list[Piece] = []
        sums: list[int] = []
        spans: list[tuple[int, int]] = []  # converted: the staged bytes of each destination page run, in order
        for i, rec, rows, chunk_sums in zip(idx, payload.records, payload.chunks, payload.checksums, strict=True):
            t, off = self.plan.transfers[i], int(self.bases[i])
            if self.convert:  # destination records, by page index into the receiver's pools
                dst_tables = self.conn.tables
                runs = _pool_chunks(t, dst_tables)
                _stage_runs(staged, off, rec, runs, t.dst.page_size)
                for chunk, parts in runs:
                    base = off + parts[0][0] * t.dst.record_bytes
                    pieces.extend((base + n * lo, key, roff, size)
                                  for (key, roff, size), (_, n, lo, _) in zip(chunk.segments, parts, strict=True))
                    spans.append((base, base + chunk.nbytes))
            else:  # source records, into the receiver's staging buffer (the sender's checksum per source page)
                if rec.numel() and rec.data_ptr() != staged[off:].ctypes.data:  # not gathered in place (into=)
                    staged[off : off + rec.numel()] = rec.reshape(-1).numpy()
                pieces.extend(_pieces_of(_staging_chunks(rows, t.src.record_bytes, off), off))
                sums.extend(chunk_sums)
        if spans:  # every run's checksum in one native call
            sums = dispatch.xxh3_chunks(staged, np.array(spans, dtype=np.int64))
        header = {"xxh3_64": sums, "loss": [r.to_dict() for r in payload.loss],
                  "indexer_max_abs_error": payload.indexer_max_abs_error}
        self.conn.post(g, pieces, header)
        self.next_group += 1

    def close(self) -> dict:
        """Complete the last group, tell the receiver, and return its report (raises its error)."""
        if self.next_group != len(self.groups):
            raise InputError(f"{len(self.groups) - self.next_group} of {len(self.groups)} layer groups were not sent")
        try:
            return self.conn.finish()
        except BaseException:
            self.abort()
            raise

    def abort(self) -> None:
        self.conn.abort()
