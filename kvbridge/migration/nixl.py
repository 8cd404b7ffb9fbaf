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
   scatters the converted records; or writes the dump atomically) and sends the ``result``.

Guarantees: every chunk verified before anything is published; a dead sender (connection
closed), a stalled one or a wedged agent is a ``TransferError`` within the caller's timeout;
on any failure the claimed pages are zeroed and released (``num_free`` is as before) and the
receiver keeps serving. Each side's NIXL agent runs in a child process (in a daemonic process,
which cannot have children, in the process itself: ``_LocalAgent``) that ends with
``os._exit``: NIXL's bundled libraries can crash a process at exit after its peer died, and
after a failure the receiver replaces its agent, so a stalled sender's late writes cannot
land in pages handed to the next request. Memory is registered once: the destination pools
(moved into shared memory, in place, so the agent process writes them) and a staging buffer
that grows to the largest request. DRAM only in this version.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import os
import sys
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.multiprocessing as tmp
import xxhash

from kvbridge._version import __version__
from kvbridge.dumps.convert import convert_entry
from kvbridge.dumps.dumpfile import LATENT_DTYPES, Dump, DumpEntry, read_dump
from kvbridge.dumps.writer import write_dump
from kvbridge.engines.profiles import Storage
from kvbridge.errors import InputError, KVBridgeError
from kvbridge.migration.control import (
    DEFAULT_HANDSHAKE_S,
    DEFAULT_MAX_CONNECTIONS,
    Channel,
    ConnectionServer,
    Listener,
    check_name,
    check_room,
    first_line,
    handshake,
    send_error,
)
from kvbridge.migration.execute import (
    CHECKSUM,
    ChecksumError,
    ConvertSide,
    MigrationError,
    MigrationReport,
    Payload,
    TransferError,
    _chunk_rows,
    check_pools,
)
from kvbridge.migration.plan import MigrationPlan, Transfer
from kvbridge.migration.pools import EnginePools, Pool, RequestTables, _runs, pool_shapes, pool_tensors
from kvbridge.migration.stream import (
    RequestAssembly,
    check_groups,
    layer_groups,
    pack_group,
    request_info,
    wire_fingerprint,
)
from kvbridge.ops.loss import LossReport

#: Seconds an agent process gets to start (spawn + imports + UCX backend), and to answer a call.
AGENT_START_S = 60.0
AGENT_CALL_S = 30.0
_DTYPES = {"U8": torch.uint8, **LATENT_DTYPES}
_DTYPE_NAMES = {v: k for k, v in _DTYPES.items()}

#: Called with (bytes sent so far, total bytes) after each group.
Progress = Callable[[int, int], None]


def nixl_available() -> bool:
    """Whether the optional ``nixl`` package can be imported here."""
    try:
        import nixl._api  # noqa: F401
    except Exception:
        return False
    return True


# ---------------------------------------------------------------------------------------------
# The agent process


def _agent_main(conn, name: str) -> None:
    """Child process: one NIXL agent, driven by commands over ``conn``; always ends with ``os._exit``."""
    try:
        os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")
        os.dup2(2, 1)  # NIXL logs to stdout; keep the parent's stdout (e.g. --json) clean
        try:
            from nixl._api import nixl_agent, nixl_agent_config

            agent = nixl_agent(name, nixl_agent_config(enable_prog_thread=False, backends=["UCX"]))
        except Exception as exc:
            conn.send(("err", f"cannot start a NIXL agent ({first_line(exc)}); install it with "
                              "pip install 'kvbridge[nixl]'"))
            return
        conn.send(("ok", None))
        regions: dict[str, tuple[torch.Tensor, Any]] = {}
        xfers: dict[int, Any] = {}
        while True:
            try:
                cmd = conn.recv()
            except (EOFError, OSError):
                return
            op, args = cmd[0], cmd[1:]
            try:
                if op == "exit":
                    conn.send(("ok", None))
                    return
                conn.send(("ok", _agent_op(agent, regions, xfers, op, args)))
            except Exception as exc:
                conn.send(("err", first_line(exc)))
    finally:
        os._exit(0)


def memory_kind(tensor: torch.Tensor) -> tuple[str, int]:
    """NIXL's memory type and device id of ``tensor``'s memory: ``("VRAM", cuda index)`` for CUDA
    memory, ``("DRAM", 0)`` for host memory."""
    return ("VRAM", tensor.device.index or 0) if tensor.is_cuda else ("DRAM", 0)


def _agent_op(agent, regions: dict, xfers: dict, op: str, args: tuple) -> Any:
    if op == "register":
        key, tensor = args
        if key in regions:
            agent.deregister_memory(regions.pop(key)[1])
        kind, dev = memory_kind(tensor)
        reg = agent.register_memory([(tensor.data_ptr(), tensor.numel() * tensor.element_size(), dev, "")], kind)
        regions[key] = (tensor, reg)
        return tensor.data_ptr()
    if op == "metadata":
        return agent.get_agent_metadata()
    if op == "add_remote":
        return agent.add_remote_agent(args[0])
    if op == "remove_remote":
        agent.remove_remote_agent(args[0])
        return None
    if op == "write":
        xid, local, remote, peer, notif, *kinds = args  # kinds: the remote memory's type, the local one (DRAM)
        remote_kind, local_kind = (*kinds, "DRAM", "DRAM")[:2]
        handle = agent.initialize_xfer("WRITE", agent.get_xfer_descs(local, local_kind),
                                       agent.get_xfer_descs(remote, remote_kind), peer, notif)
        state = agent.transfer(handle)
        if state == "ERR":
            agent.release_xfer_handle(handle)
            raise RuntimeError("NIXL refused to post the transfer")
        xfers[xid] = handle
        return None
    if op == "wait":
        xid, timeout = args
        handle = xfers[xid]
        deadline = time.monotonic() + timeout
        pause = 1e-5
        while True:
            state = agent.check_xfer_state(handle)
            if state != "PROC":
                break
            if time.monotonic() > deadline:
                return "PROC"
            time.sleep(pause)
            pause = min(2 * pause, 2e-3)
        agent.release_xfer_handle(xfers.pop(xid))
        return state
    if op == "notifs":
        (timeout,) = args
        deadline = time.monotonic() + timeout
        pause = 1e-5
        while True:
            got = agent.get_new_notifs()
            if any(got.values()) or time.monotonic() > deadline:
                return [m for msgs in got.values() for m in msgs]
            time.sleep(pause)
            pause = min(2 * pause, 2e-3)
    raise ValueError(f"unknown agent command {op!r}")


@contextlib.contextmanager
def _main_hidden():
    """Start a spawned child without re-running the user's ``__main__`` (the agent needs nothing from
    it, and a script without an ``if __name__ == "__main__"`` guard would run again in the child)."""
    main = sys.modules.get("__main__")
    saved = {k: main.__dict__[k] for k in ("__file__", "__spec__") if main is not None and k in main.__dict__}
    try:
        for k in saved:
            if k == "__spec__":
                main.__spec__ = None
            else:
                del main.__dict__[k]
        yield
    finally:
        if main is not None:
            main.__dict__.update(saved)


class _Agent:
    """The parent's handle on one agent process; every call is bounded by a timeout."""

    def __init__(self, name: str):
        ctx = tmp.get_context("spawn")
        self.name = name
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_agent_main, args=(child, name), daemon=True, name=f"kvbridge-nixl-{name}")
        with _main_hidden():
            self.proc.start()
        child.close()
        self._reply(AGENT_START_S, "starting")
        self.addresses: dict[str, int] = {}

    def _reply(self, timeout: float, what: str) -> Any:
        try:
            ready = self.conn.poll(max(0.0, timeout))
        except (EOFError, OSError):
            ready = True
        if not ready:
            self.kill()
            raise TransferError(f"the NIXL agent did not answer within {timeout:.0f} s while {what}; it was stopped")
        try:
            status, value = self.conn.recv()
        except (EOFError, OSError):
            self.kill()
            raise TransferError(f"the NIXL agent process died while {what}") from None
        if status != "ok":
            raise TransferError(f"NIXL failed while {what}: {value}")
        return value

    def call(self, what: str, *cmd: Any, timeout: float = AGENT_CALL_S) -> Any:
        if not self.alive():
            raise TransferError(f"the NIXL agent process is gone (while {what})")
        try:
            self.conn.send(cmd)
        except (OSError, ValueError):
            self.kill()
            raise TransferError(f"the NIXL agent process died while {what}") from None
        return self._reply(timeout, what)

    def register(self, key: str, tensor: torch.Tensor) -> int:
        self.addresses[key] = self.call(f"registering {key}", "register", key, tensor)
        return self.addresses[key]

    def alive(self) -> bool:
        return self.proc.is_alive()

    def kill(self) -> None:
        """Stop the agent process now (its peers' writes into our memory stop with it)."""
        if self.proc.is_alive():
            self.proc.kill()
        self.proc.join(10)
        self.conn.close()

    def close(self) -> None:
        if self.proc.is_alive():
            try:
                self.conn.send(("exit",))
                if self.conn.poll(5):
                    self.conn.recv()
            except (EOFError, OSError, ValueError):
                pass
            self.proc.join(5)
        self.kill()


class _LocalAgent:
    """A NIXL agent in this process, for where no child process may start (a daemonic process, such as a
    worker of vLLM's multiprocess executor): the same calls as ``_Agent``, run on the caller's thread one
    at a time. ``kill`` releases every transfer and registration, so a stalled peer's late writes fail
    instead of landing; the next use starts a new agent."""

    def __init__(self, name: str):
        os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")
        try:
            from nixl._api import nixl_agent, nixl_agent_config  # deferred: nixl is an optional dependency

            self.agent = nixl_agent(name, nixl_agent_config(enable_prog_thread=False, backends=["UCX"]))
        except Exception as exc:
            raise TransferError(f"cannot start a NIXL agent ({first_line(exc)}); install it with "
                                "pip install 'kvbridge[nixl]'") from None
        self.name = name
        self.regions: dict[str, tuple[torch.Tensor, Any]] = {}
        self.xfers: dict[int, Any] = {}
        self.addresses: dict[str, int] = {}
        self._lock = threading.Lock()
        self._alive = True

    def call(self, what: str, *cmd: Any, timeout: float = AGENT_CALL_S) -> Any:
        with self._lock:
            if not self._alive:
                raise TransferError(f"the NIXL agent is gone (while {what})")
            try:
                return _agent_op(self.agent, self.regions, self.xfers, cmd[0], cmd[1:])
            except Exception as exc:
                raise TransferError(f"NIXL failed while {what}: {first_line(exc)}") from None

    register = _Agent.register

    def alive(self) -> bool:
        return self._alive

    def kill(self) -> None:
        with self._lock:
            if not self._alive:
                return
            self._alive = False
            for handle in self.xfers.values():
                with contextlib.suppress(Exception):
                    self.agent.release_xfer_handle(handle)
            for _, reg in self.regions.values():
                with contextlib.suppress(Exception):
                    self.agent.deregister_memory(reg)
            self.xfers.clear()
            self.regions.clear()

    close = kill


def _new_agent(name: str) -> _Agent | _LocalAgent:
    """An agent process, or an agent in this process where this process is daemonic (it cannot have children)."""
    return _LocalAgent(name) if tmp.current_process().daemon else _Agent(name)


# ---------------------------------------------------------------------------------------------
# Wire layouts: where each checksummed chunk lands


@dataclass(frozen=True)
class _Chunk:
    """One checksummed unit: ``nbytes`` consecutive staged bytes landing as ``segments``
    (region key, byte offset, length) in the receiver's memory, in order."""

    nbytes: int
    segments: tuple[tuple[str, int, int], ...]


def _pool_keys(t: Transfer) -> list[str]:
    """Region keys of the destination pool tensors of ``t`` (two for separate kv / score pools)."""
    base = f"pool.{t.spec.layer}.{t.spec.role.value}"
    return [base, f"{base}.score"] if t.dst.separate_pools else [base]


def _tensor_tables(st: Storage, pool: Pool) -> list[tuple[torch.Tensor, str]]:
    """Each tensor of a pool with the block table addressing it."""
    return [(tensor, st.score_table if k == 1 and st.score_table else st.table)
            for k, tensor in enumerate(pool_tensors(pool))]


def _pieces(rec: int, split: int | None) -> list[tuple[int, int]]:
    return [(0, rec)] if split is None else [(0, split), (split, rec)]


def _pool_chunks(t: Transfer, tables: RequestTables, pages: Sequence[int] | None = None
                 ) -> list[tuple[_Chunk, list[tuple[int, int, int, int]]]]:
    """Destination-page chunks of ``t``: per run of rows in one page, the chunk and, per record part,
    (record offset, rows, first byte, last byte) of the records it carries. ``pages``: the page
    count of each destination pool tensor (default: bounded by the page ids themselves)."""
    st = t.dst
    keys = _pool_keys(t)
    per_part = []
    for k, (lo, hi) in enumerate(_pieces(st.record_bytes, st.split)):
        ti = k if st.separate_pools else 0
        name = st.score_table if k == 1 and st.score_table else st.table
        ids = tables[name]
        page_bytes = pool_shapes(st)[ti]
        base = 0 if st.separate_pools else st.page_size * lo
        bound = pages[ti] if pages is not None else max([i for i in ids if i >= 0], default=0) + 1
        per_part.append([(keys[ti], page * page_bytes + base + row * (hi - lo), n * (hi - lo), (off, n, lo, hi))
                         for page, row, n, off in _runs(st, ids, t.first, t.count, bound, name)])
    return [(_Chunk(sum(seg[2] for seg in segs), tuple(seg[:3] for seg in segs)), [seg[3] for seg in segs])
            for segs in zip(*per_part, strict=True)]


def _stage_runs(staged: np.ndarray, off: int, rec: torch.Tensor, runs: list, page_size: int) -> None:
    """Stage records ``rec`` as their destination page runs (``_pool_chunks``), run after run from
    ``off``: each run's record parts back to back, as they lie in the page, so a whole page is one
    contiguous piece on both sides. Whole-page runs are copied together, one copy per part."""
    width = rec.shape[1]
    i = 0
    while i < len(runs):
        j = i
        while j < len(runs) and runs[j][1][0][1] == page_size:  # whole pages: rows [0, P)
            j += 1
        r0 = runs[i][1][0][0]
        if j > i:
            m = j - i
            block = torch.from_numpy(staged[off + r0 * width : off + (r0 + m * page_size) * width]).view(m, -1)
            src = rec[r0 : r0 + m * page_size].view(m, page_size, width)
            for _, _, lo, hi in runs[i][1]:
                block[:, page_size * lo : page_size * hi].view(m, page_size, hi - lo).copy_(src[:, :, lo:hi])
            i = j
        else:
            n = runs[i][1][0][1]
            base = off + r0 * width
            for _, _, lo, hi in runs[i][1]:
                torch.from_numpy(staged[base + n * lo : base + n * hi]).view(n, hi - lo).copy_(rec[r0 : r0 + n, lo:hi])
            i += 1


def _staging_chunks(rows: Sequence[int], record_bytes: int, base: int) -> list[_Chunk]:
    out, offset = [], base
    for n in rows:
        out.append(_Chunk(n * record_bytes, (("staging", offset, n * record_bytes),)))
        offset += n * record_bytes
    return out


#: A staged piece: (local staging offset, receiver region key, offset in that region, bytes).
Piece = tuple[int, str, int, int]


def _pieces_of(chunks: Sequence[_Chunk], local_offset: int) -> list[Piece]:
    """The pieces of ``chunks`` whose bytes are staged back to back from ``local_offset``."""
    out, off = [], local_offset
    for c in chunks:
        for key, roff, n in c.segments:
            out.append((off, key, roff, n))
            off += n
    return out


def _descriptors(pieces: Sequence[Piece], local_base: int, remote: dict[str, int]) -> tuple[np.ndarray, np.ndarray]:
    """Local and remote (address, length, device) descriptor arrays; pieces adjacent on both sides merge."""
    loc: list[list[int]] = []
    rem: list[list[int]] = []
    last_key = None
    for off, key, roff, n in pieces:
        a, b = local_base + off, remote[key] + roff
        if loc and key == last_key and loc[-1][0] + loc[-1][1] == a and rem[-1][0] + rem[-1][1] == b:
            loc[-1][1] += n
            rem[-1][1] += n
        else:
            loc.append([a, n, 0])
            rem.append([b, n, 0])
        last_key = key
    return np.array(loc, dtype=np.uint64).reshape(-1, 3), np.array(rem, dtype=np.uint64).reshape(-1, 3)


def _xxh3(memory: dict[str, np.ndarray], chunk: _Chunk) -> int:
    """XXH3-64 of a chunk's segments, in order (as of their bytes back to back)."""
    if len(chunk.segments) == 1:
        key, off, n = chunk.segments[0]
        return xxhash.xxh3_64_intdigest(memory[key][off : off + n])
    h = xxhash.xxh3_64()
    for key, off, n in chunk.segments:
        h.update(memory[key][off : off + n])
    return h.intdigest()


def _np(t: torch.Tensor) -> np.ndarray:
    return t.reshape(-1).view(torch.uint8).numpy()


# ---------------------------------------------------------------------------------------------
# What travels: requests and dumps


@dataclass
class DumpTarget:
    """What a receiving side converts dumps into (the arguments of ``kvbridge convert``)."""

    layout: str
    page_size: int | None = None
    dialect: str | None = None
    scale: float | str | None = None

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def _entry_info(e: DumpEntry) -> dict[str, Any]:
    return {**e.metadata(), "dtype": _DTYPE_NAMES[e.data.dtype], "shape": list(e.data.shape)}


def dump_fingerprint(entries: Sequence[dict], target: dict | None) -> str:
    """sha256 of a dump transfer's source entries (metadata, dtype, shape) and conversion target."""
    return hashlib.sha256(json.dumps({"entries": list(entries), "target": target}, sort_keys=True).encode()).hexdigest()


def _entry_chunk_rows(info: dict) -> list[int]:
    """Checksum chunks of a dump entry: one per page (pages), or per 256 tokens (latents)."""
    rows = info["shape"][0] if info["shape"] else 0
    step = 1 if info["kind"] == "pages" else 256
    return [min(step, rows - r) for r in range(0, rows, step)]


def _entry_nbytes(info: dict) -> int:
    return int(np.prod(info["shape"], dtype=np.int64)) * torch.empty(0, dtype=_DTYPES[info["dtype"]]).element_size()


def _dump_groups(infos: Sequence[dict]) -> list[list[int]]:
    groups: dict[int, list[int]] = {}
    for i, info in enumerate(infos):
        groups.setdefault(info["layer"], []).append(i)
    return list(groups.values())


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
    """

    def __init__(self, dst: EnginePools | None = None, *, plan: MigrationPlan | PlanFor | None = None,
                 host: str = "127.0.0.1", port: int = 0, dump_target: DumpTarget | None = None,
                 dump_dir: str | os.PathLike | None = None, overwrite: bool = False, loss_report: bool = True,
                 handshake_s: float = DEFAULT_HANDSHAKE_S):
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
        self.dst, self.plan = dst, plan
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
                on_group: Callable[[int, int], None] | None = None, request_id: str | None = None) -> Received | None:
        """Wait for one sender (None after ``accept_timeout`` seconds without one) and receive its request
        within ``timeout`` seconds. ``request_id``: refuse a sender announcing another request id.
        Raises ``MigrationError``/``TransferError`` with one line; the receiver stays usable."""
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout > 0:
            raise InputError(f"timeout must be a positive number of seconds, got {timeout!r}")
        with self.lock:
            self._ensure_agent()
        chan = self.listener.accept(accept_timeout)
        if chan is None:
            return None
        deadline = time.monotonic() + timeout
        session = _Session(self, chan, deadline, on_group, request_id)
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

    def __init__(self, rx: NixlReceiver, chan: Channel, deadline: float, on_group, expect_id: str | None = None):
        self.rx, self.chan, self.deadline, self.on_group = rx, chan, deadline, on_group
        self.expect_id = expect_id
        self.claimed: RequestTables | None = None
        self.remote: str | None = None
        self.notifs: set[bytes] = set()
        self.plan: MigrationPlan | None = None
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
        groups = hello["groups"]
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
        for i, (c, want) in enumerate(zip(chunks, sums, strict=True)):
            have = _xxh3(self.rx.memory, c)
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
        check_groups(plan, hello["groups"])
        check_room(plan, rx.dst, self._refuse)  # before anything moves; the claim itself is under the lock
        return plan

    def _request(self, plan: MigrationPlan, hello: dict, meta: bytes) -> Received:
        rx, chan = self.rx, self.chan
        assert rx.dst is not None
        self.plan = plan
        groups = check_groups(plan, hello["groups"])
        converted = hello.get("convert_on") == "sender"
        t0 = time.perf_counter()
        assembly = RequestAssembly(plan, loss_report=rx.loss_report)
        if converted:
            try:
                self.claimed = rx.dst.claim(plan.table_lengths("dst"), plan.released("dst"))
            except InputError as exc:
                raise self._refuse(first_line(exc)) from None
            regions = sorted({key for t in plan.transfers for key in _pool_keys(t)})
            self._connect(meta, regions, {"tables": self.claimed})
            layouts = [[c for c, _ in _pool_chunks(t, self.claimed,
                                                     [x.shape[0] for x in pool_tensors(rx.dst.pool(t.spec))])]
                       for t in plan.transfers]
        else:
            bases = np.cumsum([0] + [t.src_bytes for t in plan.transfers]).tolist()
            rx._ensure_staging(int(bases[-1]))
            self._connect(meta, ["staging"], {"tables": None})
            layouts = [_staging_chunks(_chunk_rows(t, t.src), t.src.record_bytes, bases[i])
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
                      progress: Progress | None = None, request_id: str | None = None) -> RequestStream:
        """Open a request: handshake now, then ``send_group()`` once per layer group, then ``close()``.
        ``request_id`` names it to the receiver (default: a random id; up to 64 characters)."""
        if convert_on not in ("sender", "receiver"):
            raise InputError(f"convert_on must be 'sender' or 'receiver', got {convert_on!r}")
        if request_id is not None and (not isinstance(request_id, str) or not 0 < len(request_id) <= 64):
            raise InputError(f"request_id must be a string of 1 to 64 characters, got {repr(request_id)[:40]}")
        check_pools(plan, src, "src")
        return RequestStream(self, plan, src, tables, convert_on == "sender", layer_groups(plan, layers_per_group),
                             loss_report, progress, request_id)

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
        conn = _Connection(self, hello, int(bases[-1]), progress)
        try:
            for g, idx in enumerate(groups):
                sums, pieces = [], []
                for i in idx:
                    conn.staged[bases[i] : bases[i + 1]] = _np(wire_entries[i].data.contiguous())
                    layout = _staging_chunks(_entry_chunk_rows(wire[i]), sizes[i] // max(1, wire[i]["shape"][0]),
                                             bases[i])
                    pieces.extend(_pieces_of(layout, bases[i]))
                    sums.extend(_xxh3({"staging": conn.staged}, c) for c in layout)
                conn.post(g, pieces, {"xxh3_64": sums})
            return conn.finish()
        except BaseException:
            conn.abort()
            raise


class _Connection:
    """Sender side of one transfer: handshake, then one posted WRITE per group, then the verdict."""

    def __init__(self, sender: NixlSender, hello: dict, nbytes: int, progress: Progress | None,
                 request_id: str | None = None):
        self.deadline = time.monotonic() + sender.timeout
        # the agent first (its start takes seconds): the receiver drops a peer slower than its handshake bound
        self.agent = sender._ensure(nbytes)
        self.chan = Channel.connect(sender.host, sender.port, self.deadline)
        self.remote: str | None = None
        try:
            self.staged = sender.staging.numpy()
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
    while NIXL moves them. ``close`` waits for the receiver's verdict and returns its report.
    """

    def __init__(self, sender: NixlSender, plan: MigrationPlan, src: EnginePools, tables: RequestTables,
                 convert: bool, groups: list[list[int]], loss_report: bool, progress: Progress | None,
                 request_id: str | None = None):
        self.plan, self.src, self.tables, self.convert = plan, src, tables, convert
        self.groups, self.loss_report = groups, loss_report
        self.next_group = 0
        sizes = [t.dst_bytes if convert else t.src_bytes for t in plan.transfers]
        hello = {"kind": "request", "request": request_info(plan), "fingerprint": wire_fingerprint(plan),
                 "convert_on": "sender" if convert else "receiver", "groups": groups}
        self.conn = _Connection(sender, hello, sum(sizes), progress, request_id)
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
        payload = pack_group(self.plan, self.src, self.tables, idx, convert=self.convert, loss_report=self.loss_report,
                             checksum=not self.convert)  # converted: the staged page runs are checksummed below
        staged = self.conn.staged
        pieces: list[Piece] = []
        sums: list[int] = []
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
                    sums.append(xxhash.xxh3_64_intdigest(staged[base : base + chunk.nbytes]))
            else:  # source records, into the receiver's staging buffer (the sender's checksum per source page)
                staged[off : off + rec.numel()] = rec.reshape(-1).numpy()
                pieces.extend(_pieces_of(_staging_chunks(rows, t.src.record_bytes, off), off))
                sums.extend(chunk_sums)
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


def send_request(plan: MigrationPlan, src: EnginePools, tables: RequestTables, *, host: str, port: int,
                 timeout: float = 60.0, **kwargs: Any) -> dict:
    """One request to the receiver at ``host:port`` with a sender used once; returns the receiver's report."""
    with NixlSender(host, port, timeout=timeout) as sender:
        return sender.send_request(plan, src, tables, **kwargs)

