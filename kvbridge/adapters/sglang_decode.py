"""A decode peer that an unmodified SGLang 0.5.23 prefill engine accepts (``--disaggregation-mode prefill
--disaggregation-transfer-backend nixl``): the mirror image of ``kvbridge.adapters.sglang``.

kvbridge does what an SGLang decode does for one request ("room"), and the prefill cannot tell it
from one:

1. bootstrap: ``GET /route`` on the prefill's bootstrap server (the one the prefill registered with)
   for its topology (``PrefillServerInfo``). kvbridge refuses, with a one-line ``MigrationError``,
   a prefill whose page size, KV-cache dtype or layout string (e.g. ``v4,c4:v4,c128:v4``) is not the
   one of its own pools, as SGLang's decode does; then it asks for rank 0's ZMQ endpoint;
2. it pushes, over ZMQ, a registration (its NIXL agent metadata, the base address and item length
   of every buffer, in the order of SGLang's ``DeepSeekV4TokenToKVPool`` buffer infos, and of its
   metadata buffers) and the request's page ids: full-token KV pages, the SWA pages of the window
   (they also address the ratio-4 compressor-state rings), the request-state slot of the ratio-128
   ring, and its metadata-row index. The prefill announces no compressor-state dtype and does not
   compare state item lengths for DeepSeek-V4: the peer takes fp32 state (SGLang's default) only
   and marks the request's state items, so that a prefill writing rows of another length is caught
   after its Success (``_mark_state``);
3. the prefill NIXL-WRITEs the pages into kvbridge's registered pools and the metadata row, then
   pushes ``KV_STATUS``; on Success kvbridge checks the room recorded in the row and hands back the
   request's block tables in its ``EnginePools`` (an SGLang profile), ready for
   ``kvbridge.migration.migrate_local`` into any engine's pools (``SGLangDecodePeer.migrate``).
   On Failed the request's pages are zeroed and released (SGLang reports Failed once its writes
   settled). Nothing half-written looks like a request.
4. liveness: while a request is in flight the prefill's bootstrap server is probed on SGLang's
   ``GET /health`` route every ``heartbeat`` s; ``heartbeat_failures`` failed probes in a row declare
   it dead (within ``dead_within`` s) and the request fails with one line; a live prefill that sends
   no status fails it after ``timeout``. The request's pages are then zeroed and quarantined, and
   come back (``reclaim``) once the prefill reported the room after all, or ``heartbeat`` s after
   it was declared dead: then no write of it can still land.
5. a request the decode needs nothing of (``decline``: vLLM holds it whole in its prefix cache) is
   declined as SGLang's decode declines a prefill rank it wants nothing from: page ids marked dummy
   (no KV pages, no state indices, metadata row -1, ``is_dummy`` 1). SGLang's prefill posts no
   write for a dummy decode, concludes the room ``KVPoll.Success`` once its scheduler sends it
   (``nixl/conn.py`` ``transfer_worker``) and notifies no one; nothing lands and no page or
   metadata row is claimed here. (SGLang's decode-side prefix ``decode_prefix_len`` with no KV
   pages would still have the prefill write the last partial SWA page, the ratio-128 ring and the
   metadata row.)

Every pool tensor is registered with NIXL as the kind of its memory (``memory_kind``: VRAM for CUDA,
DRAM for host), and the KV buffers' kinds are announced so; the metadata rows are host memory, as
SGLang writes them. SGLang's prefill addresses the decode's SWA and state buffers (components ``swa``
and ``c128_state``) as GPU memory (``VRAM``) whatever kind the decode registered: against a CUDA
prefill the pools must be CUDA tensors; host pools receive only from a prefill whose state writes
address host memory (NIXL finds no descriptor otherwise: ``NIXL_ERR_NOT_FOUND``).

Limits of this version: a prefill with attention TP/CP/PP/DP of 1 (one rank), no MTP/draft layers,
no decode-side prefix (``decode_prefix_len`` 0: a request is received whole or declined whole),
metadata rows without the sampling-mask and DSA top-k buffers (the KV checksum row with
``kv_checksum``). SGLang's bootstrap announces no layer count: a prefill of another
depth is not refused at bootstrap (see docs/adapters.md).
"""

from __future__ import annotations

import json
import math
import struct
import threading
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from kvbridge.adapters.sglang_protocol import (
    CHECKSUM_ROW_BYTES,
    GUARD,
    HIDDEN_STATE_BYTES,
    KV_STATUS,
    MODEL_ROUTE,
    POLL_FAILED,
    POLL_SUCCESS,
    SGLangPDLayout,
    _local_ip,
    _pack_lists,
    kv_digest,
    metadata_item_lens,
    model_info,
    pd_layout,
    start_peer,
)
from kvbridge.engines.profiles import EngineProfile
from kvbridge.engines.topology import CacheSpec, ModelTopology
from kvbridge.errors import InputError
from kvbridge.migration.errors import MigrationError, TransferError
from kvbridge.migration.execute import MigrationReport, migrate_local
from kvbridge.migration.nixl_agent import _Agent, _LocalAgent, _new_agent, memory_kind
from kvbridge.migration.plan import MigrationPlan, plan_migration
from kvbridge.migration.pools import EnginePools, RequestTables, pool_tensors

#: Byte every state item of a request is set to before the prefill writes it (see ``_mark_state``).
STATE_MARK = 0xFF
#: Rows of metadata buffers the peer registers (requests it can hold in flight at once).
AUX_ROWS = 8
#: Index of the metadata buffer holding the bootstrap room (SGLang's corruption check).
ROOM_BUFFER = len(metadata_item_lens()) - 1
#: Seconds between two health probes (``GET /health``) of a prefill's bootstrap server, and the most
#: one probe waits; SGLang's decode probes the same route (``SGLANG_DISAGGREGATION_HEARTBEAT_INTERVAL``).
HEARTBEAT_S = 1.0
#: Failed probes in a row that declare a prefill dead (SGLang's ``..._HEARTBEAT_MAX_FAILURE`` default).
HEARTBEAT_FAILURES = 2


def claimed_pages(tables: set[str], page: int, window: int, num_tokens: int) -> tuple[dict[str, int], int]:
    """The pages ``SGLangDecodePeer.receive`` claims for a request of ``num_tokens`` tokens, per block table of
    ``tables`` (SGLang's PD rule: every KV page, ``full``; the SWA pages from the first the ``window`` touches,
    which also address the ratio-4 state rings, ``swa``; the request's ratio-128 ring, ``state128``), and the
    index of that first SWA page (the pages before it are not claimed)."""
    num_pages = math.ceil(num_tokens / page)
    every = {"full": num_pages, "swa": num_pages, "state128": 1}
    return {name: every[name] for name in tables}, max(0, num_tokens - window) // page


def landing_pages(profile: EngineProfile, model: ModelTopology, num_tokens: int) -> dict[str, int]:
    """Pages per block table that one request of up to ``num_tokens`` tokens holds at most while
    ``SGLangDecodePeer.receive`` lands it in pools of SGLang ``profile`` for ``model``; ``k`` times this holds
    ``k`` requests at once."""
    tables = {profile.storage(s).table for s in model.all_caches(include_mtp=False)}
    out: dict[str, int] = {}
    for n in range(max(1, num_tokens - 2 * profile.swa_page + 1), num_tokens + 1):
        lengths, first_swa = claimed_pages(tables, profile.swa_page, model.sliding_window, n)
        for name, k in lengths.items():
            out[name] = max(out.get(name, 0), k - (first_swa if name == "swa" else 0))
    return out


@dataclass
class SGLangRequest:
    """One request received from an SGLang prefill, held in the peer's pools at ``tables``."""

    room: int
    num_tokens: int
    first_token: int  # the token id the prefill sampled (metadata row, output ids)
    tables: RequestTables
    bytes: int  # bytes the prefill wrote: KV pages, SWA pages and state rings, metadata row
    pages: dict[str, int]  # pages the prefill wrote per block table
    seconds: float  # from sending the page ids to the prefill's Success
    prefill: dict[str, Any] = field(default_factory=dict)  # its PrefillServerInfo, as served
    digest: int = 0  # kvbridge's digest (kv_digest) of the kept KV pages, window SWA/state pages and ring
    digest_verified: bool = False  # the prefill sent a digest in the checksum row and it matched

    def to_dict(self) -> dict[str, Any]:
        return {"room": self.room, "num_tokens": self.num_tokens, "first_token": self.first_token,
                "tables": {k: list(v) for k, v in self.tables.items()}, "bytes": self.bytes,
                "pages": dict(self.pages), "seconds": self.seconds, "prefill": dict(self.prefill),
                "digest": self.digest, "digest_verified": self.digest_verified}


@dataclass
class _Waiter:
    addr: str  # the prefill's bootstrap address, probed while the request is in flight
    done: threading.Event = field(default_factory=threading.Event)
    status: int | None = None
    reason: str = ""
    dead: bool = False  # the prefill's bootstrap server failed HEARTBEAT_FAILURES probes in a row


@dataclass
class _Quarantine:
    """Pages (and the metadata row) of a failed request the prefill may still write into."""

    addr: str
    tables: RequestTables
    aux_index: int
    settled: bool = False  # the prefill reported the room after all (its writes settled)
    dead_at: float | None = None  # monotonic time the prefill was declared dead


def _get_json(url: str, what: str) -> tuple[int, Any]:
    """(HTTP status, parsed body or text) of ``GET url``; raises ``OSError`` when unreachable."""
    try:
        with urllib.request.urlopen(url, timeout=5) as r:
            body = r.read().decode(errors="replace")
            return r.status, json.loads(body)
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode(errors="replace")[:300]
    except json.JSONDecodeError:
        raise TransferError(f"{what} answered with something that is not JSON") from None


class SGLangDecodePeer:
    """kvbridge as the decode server of an SGLang prefill (see the module docstring).

    ``pools``: SGLang-profile pools the requests land in (their tensors are moved to shared memory,
    in place, for the NIXL agent process); their profile must be the prefill's (page size, state
    dtype, indexer format). ``aux_rows``: metadata rows (requests in flight at once).
    ``hidden_state_bytes``: bytes per row of the hidden-state metadata buffer, as the prefill's
    (64 without speculative decoding that carries draft hidden states). ``kv_cache_dtype``: the
    prefill's ``--kv-cache-dtype`` (DeepSeek-V4 resolves ``auto`` to ``fp8_e4m3``). ``timeout``:
    seconds one request may take, bootstrap included (a stalled prefill fails the request then).
    ``heartbeat`` / ``heartbeat_failures``: the prefill's bootstrap server is probed every
    ``heartbeat`` s while a request is in flight or quarantined; that many failed probes in a row
    declare it dead, within ``dead_within`` s (``2 * heartbeat * heartbeat_failures``).
    ``kv_checksum``: also register SGLang's KV-checksum metadata row, into which kvbridge's prefill
    peer writes its digest, checked here against what landed (an SGLang prefill without
    ``--disaggregation-enable-kv-checksum`` logs that the decode has one more metadata buffer).
    """

    def __init__(self, pools: EnginePools, *, aux_rows: int = AUX_ROWS, hidden_state_bytes: int = HIDDEN_STATE_BYTES,
                 host: str = "127.0.0.1", kv_cache_dtype: str = "fp8_e4m3", timeout: float = 60.0,
                 heartbeat: float = HEARTBEAT_S, heartbeat_failures: int = HEARTBEAT_FAILURES,
                 kv_checksum: bool = False):
        if not isinstance(pools, EnginePools):
            raise InputError(f"pools must be EnginePools, got {type(pools).__name__}")
        for name, v in (("aux_rows", aux_rows), ("hidden_state_bytes", hidden_state_bytes),
                        ("heartbeat_failures", heartbeat_failures)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise InputError(f"{name} must be a positive integer, got {v!r}")
        for name, x in (("timeout", timeout), ("heartbeat", heartbeat)):
            if isinstance(x, bool) or not isinstance(x, (int, float)) or not x > 0:
                raise InputError(f"{name} must be a positive number of seconds, got {x!r}")
        if pools.profile.state_dtype != "fp32":
            raise InputError(f"{pools.profile.spec}: the SGLang decode peer takes fp32 compressor state only (SGLang's "
                             "default): SGLang's prefill announces no state dtype and writes its rows at its own "
                             "length, so an fp32 prefill would write past bf16 pools into other memory")
        self.pools, self.layout = pools, pd_layout(pools)
        self._tables = {pools.storage(s).table for s in (*self.layout.kv, *self.layout.swa_state,
                                                         *self.layout.request_state)}
        self.aux_rows, self.hidden_state_bytes = aux_rows, hidden_state_bytes
        self.host, self.kv_cache_dtype, self.timeout = host, kv_cache_dtype, float(timeout)
        self.heartbeat, self.heartbeat_failures = float(heartbeat), heartbeat_failures
        self.kv_checksum = bool(kv_checksum)
        #: Seconds within which a dead prefill is detected: each of the failed probes in a row waits at
        #: most ``heartbeat`` and follows the previous one by ``heartbeat``.
        self.dead_within = 2 * self.heartbeat * heartbeat_failures
        self._lock = threading.RLock()
        self._waiters: dict[int, _Waiter] = {}
        self._quarantine: dict[int, _Quarantine] = {}
        self._misses: dict[str, int] = {}
        self._registered: set[tuple[str, int]] = set()
        self._free_aux = list(range(aux_rows - 1, -1, -1))
        self._stop = threading.Event()
        self._agent: _Agent | _LocalAgent | None = None
        self._zmq: Any = None
        self._push: dict[tuple[str, int], Any] = {}
        self.ip = ""
        self.rank_port = 0

    # -- lifecycle -------------------------------------------------------------------------------

    def start(self) -> SGLangDecodePeer:
        """Start the NIXL agent (registering every pool and metadata buffer) and the status endpoint."""
        start_peer(self)
        return self

    def _start(self) -> None:
        import zmq

        self.ip = _local_ip(self.host)
        self._zmq = zmq.Context()
        pull = self._zmq.socket(zmq.PULL)
        self.rank_port = pull.bind_to_random_port(f"tcp://{self.ip}")
        # in this process where it is daemonic (a vLLM worker of the multiprocess executor: no children)
        self._agent = _new_agent(f"kvbridge-sglang-decode-{uuid.uuid4().hex[:12]}")
        lay = self.layout
        self._ptrs: dict[tuple[int, Any], int] = {}
        for spec in (*lay.kv, *lay.swa_state, *lay.request_state):
            (t,) = pool_tensors(self.pools.pool(spec))
            t.share_memory_()
            self._ptrs[(spec.layer, spec.role)] = self._agent.register(f"{spec.layer}.{spec.role.value}", t)
        self._aux = [torch.zeros(self.aux_rows, n, dtype=torch.uint8).share_memory_()
                     for n in metadata_item_lens(self.hidden_state_bytes) + [CHECKSUM_ROW_BYTES] * self.kv_checksum]
        self._aux_ptrs = [self._agent.register(f"aux{i}", t) for i, t in enumerate(self._aux)]
        self._metadata = self._agent.call("reading the NIXL agent metadata", "metadata")
        self._threads = [threading.Thread(target=fn, args=args, daemon=True, name=f"kvbridge-sglang-decode-{what}")
                         for fn, args, what in ((self._listen, (pull,), "status"), (self._watch, (), "heartbeat"))]
        for t in self._threads:
            t.start()

    def close(self) -> None:
        """Stop; requests still waiting fail with ``TransferError``."""
        self._stop.set()
        for t in getattr(self, "_threads", ()):
            t.join(5)
        self._threads = []
        if self._agent is not None:
            self._agent.close()
            self._agent = None
        if self._zmq is not None:
            self._zmq.destroy(linger=0)
            self._zmq = None
        with self._lock:
            for w in self._waiters.values():
                w.done.set()

    def __enter__(self) -> SGLangDecodePeer:
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # -- the request -----------------------------------------------------------------------------

    def receive(self, bootstrap_addr: str, room: int, num_tokens: int) -> SGLangRequest:
        """Fetch request ``room`` (its ``bootstrap_room``) of ``num_tokens`` prompt tokens from the SGLang
        prefill whose bootstrap server is ``bootstrap_addr`` (``host:port``); blocks until it arrived.
        Release the returned request's pages with ``release`` once done with them."""
        self._check_request(bootstrap_addr, room, num_tokens)
        deadline = time.monotonic() + self.timeout
        info = self._prefill_info(bootstrap_addr, deadline)
        rank = self._rank(bootstrap_addr)
        target = (str(rank["rank_ip"]), int(rank["rank_port"]))
        plan = plan_migration(self.pools.profile, self.pools.profile, self.pools.model, num_tokens, include_mtp=False)
        lay = self.layout
        lengths, first_swa = claimed_pages(self._tables, lay.page_size, self.pools.model.sliding_window, num_tokens)
        num_pages = lengths["swa"]
        ring = bool(lay.request_state) and num_tokens % 128 != 0
        want, released = plan.table_lengths("dst"), plan.released("dst")
        if want.get("swa", 0) != num_pages or released.get("swa", 0) != first_swa or want.get("full", 0) > num_pages:
            raise MigrationError(f"{self.pools.profile.spec} holds {want} pages ({released} released) for "
                                 f"{num_tokens} tokens, SGLang's prefill sends {num_pages} KV pages and SWA pages "
                                 f"from {first_swa}: this profile does not match SGLang's PD rule")
        self._register(target)  # once per prefill rank, before any page is allocated
        self.reclaim()
        with self._lock:
            if room in self._waiters or room in self._quarantine:
                raise InputError(f"room {room} is already being received")
            if not self._free_aux:
                raise InputError(f"all {self.aux_rows} metadata rows are in use (aux_rows)")
            tables = self.pools.claim(lengths, {"swa": first_swa})
            aux_index = self._free_aux.pop()
            waiter = self._waiters[room] = _Waiter(bootstrap_addr)
        ok = sent = False
        t0 = time.perf_counter()
        try:
            self._mark_state(tables, ring)
            self._send(target, self._metadata_message(room, tables, aux_index, first_swa, ring))
            sent = True
            self._progress(waiter, deadline)
            if waiter.status is None:
                raise TransferError(self._unfinished(room, waiter, time.perf_counter() - t0))
            seconds = time.perf_counter() - t0
            if waiter.status != POLL_SUCCESS:
                raise TransferError(f"room {room}: the SGLang prefill failed the transfer: "
                                    f"{waiter.reason or 'no reason given'}")
            first_token, meta_room = self._read_row(aux_index)
            if meta_room != room:
                raise TransferError(f"room {room}: the metadata row names room {meta_room}: corrupted or another "
                                    "request's row")
            self._check_state(room, tables, ring)
            digest, verified = self._check_digest(room, aux_index, tables, first_swa, ring, want.get("full", 0))
            pages = {k: len([i for i in v if i >= 0]) for k, v in tables.items()}
            if not ring and lay.request_state:  # no live ratio-128 rows: the ring was not sent
                pages["state128"] = 0
                self._scrub({"state128": tables["state128"]})
            kept = {name: ids[: want.get(name, 0)] for name, ids in tables.items()}
            self.pools.release({name: ids[len(kept[name]):] for name, ids in tables.items()})
            ok = True
            return SGLangRequest(room, num_tokens, first_token, kept, self._written(pages), pages, seconds, info,
                                 digest, verified)
        finally:
            with self._lock:
                self._waiters.pop(room, None)
                for t in self._aux:
                    t[aux_index].zero_()
                settled = ok or not sent or waiter.status is not None  # the prefill reports after its writes
                if settled:
                    self._free_aux.append(aux_index)
                if not ok:
                    self._scrub(tables)
                    if settled:
                        self.pools.release(tables)
                    else:  # writes may still land: keep the pages (and the row) out of use
                        self._quarantine[room] = _Quarantine(bootstrap_addr, tables, aux_index,
                                                             dead_at=time.monotonic() if waiter.dead else None)

    def decline(self, bootstrap_addr: str, room: int) -> None:
        """Tell the SGLang prefill whose bootstrap server is ``bootstrap_addr`` that this decode needs nothing
        of request ``room`` (it holds the request whole, e.g. in vLLM's prefix cache), so that the prefill
        frees the room as soon as it has computed it instead of at its bootstrap timeout: the handshake
        checks of ``receive``, then SGLang's dummy page ids (module docstring, 5.). Nothing is claimed and
        nothing lands; the prefill sends no status for a dummy decode, so this returns once sent."""
        self._check_request(bootstrap_addr, room, 1)
        with self._lock:
            if room in self._waiters or room in self._quarantine:
                raise InputError(f"room {room} is being received; it cannot be declined")
        self._prefill_info(bootstrap_addr, time.monotonic() + self.timeout)
        rank = self._rank(bootstrap_addr)
        self._send((str(rank["rank_ip"]), int(rank["rank_port"])), self._dummy_message(room))

    def _check_request(self, bootstrap_addr: str, room: int, num_tokens: int) -> None:
        """Refuse a malformed room, length or address, or a peer not started."""
        if isinstance(room, bool) or not isinstance(room, int) or not 0 <= room < 2**63:
            raise InputError(f"room must be a 63-bit non-negative integer, got {room!r}")
        if isinstance(num_tokens, bool) or not isinstance(num_tokens, int) or num_tokens < 1:
            raise InputError(f"num_tokens must be a positive integer, got {num_tokens!r}")
        if not isinstance(bootstrap_addr, str) or ":" not in bootstrap_addr:
            raise InputError(f"bootstrap_addr must be 'host:port', got {bootstrap_addr!r}")
        if self._agent is None:
            raise InputError("start the peer first (SGLangDecodePeer.start or a with block)")

    def _unfinished(self, room: int, waiter: _Waiter, seconds: float) -> str:
        """The one line a request that got no status from its prefill fails with."""
        if waiter.dead:
            return (f"room {room}: the SGLang prefill at {waiter.addr} died mid-transfer (its bootstrap server "
                    f"failed {self.heartbeat_failures} health probes in a row; noticed after {seconds:.1f} s)")
        if self._stop.is_set():
            return f"room {room}: the peer was closed"
        return (f"room {room}: the SGLang prefill at {waiter.addr} is alive but did not finish the transfer within "
                f"{self.timeout:.0f} s (stalled)")

    # -- liveness and quarantine -----------------------------------------------------------------

    @property
    def quarantined(self) -> list[RequestTables]:
        """Block tables of failed requests kept out of use because their prefill may still write
        into them: zeroed, and returned to the free lists by ``reclaim`` once no write can land."""
        with self._lock:
            return [q.tables for q in self._quarantine.values()]

    def reclaim(self) -> int:
        """Return quarantined pages to use where no write can still land: the prefill reported the
        room after all (SGLang reports a room once its writes settled), or it was declared dead at
        least ``heartbeat`` s ago (a dead process posts no write; one it had posted completes or is
        dropped with its endpoint). The pages are zeroed again first. Returns the requests reclaimed."""
        now = time.monotonic()
        with self._lock:
            done = [room for room, q in self._quarantine.items()
                    if q.settled or (q.dead_at is not None and now >= q.dead_at + self.heartbeat)]
            for room in done:
                q = self._quarantine.pop(room)
                self._scrub(q.tables)
                for t in self._aux:
                    t[q.aux_index].zero_()
                self.pools.release(q.tables)
                self._free_aux.append(q.aux_index)
        return len(done)

    def _healthy(self, addr: str) -> bool:
        """One probe of SGLang's bootstrap-server health route (what SGLang's decode heartbeat asks)."""
        try:
            with urllib.request.urlopen(f"http://{addr}/health", timeout=self.heartbeat) as r:
                return r.status == 200
        except (OSError, ValueError):
            return False

    def _watch(self) -> None:
        """Probe the prefills of requests in flight or quarantined every ``heartbeat`` s; declare one
        dead after ``heartbeat_failures`` failed probes in a row (its waiting requests fail now, its
        quarantined pages are reclaimed a ``heartbeat`` later)."""
        while not self._stop.wait(self.heartbeat):
            self._probe()
            self.reclaim()

    def _probe(self) -> None:
        """One heartbeat: probe each prefill a request waits on or is quarantined for."""
        with self._lock:
            addrs = {w.addr for w in self._waiters.values()} | {
                q.addr for q in self._quarantine.values() if q.dead_at is None}
        for addr in addrs:
            misses = 0 if self._healthy(addr) else self._misses.get(addr, 0) + 1
            self._misses[addr] = misses
            if misses < self.heartbeat_failures:
                continue
            with self._lock:
                for w in self._waiters.values():
                    if w.addr == addr and not w.done.is_set():
                        w.dead = True
                        w.done.set()
                for q in self._quarantine.values():
                    if q.addr == addr and q.dead_at is None:
                        q.dead_at = time.monotonic()

    def _progress(self, waiter: _Waiter, deadline: float) -> None:
        """Drive the NIXL agent until the prefill's status arrives: the prefill connects to it and
        writes, and an agent without a progress thread answers only while it is polled."""
        while not waiter.done.is_set() and time.monotonic() < deadline:
            agent = self._agent
            if agent is None:  # closed
                return
            agent.call("waiting for the SGLang prefill's writes", "notifs", 0.005)

    def release(self, request: SGLangRequest) -> None:
        """Return a received request's pages to the pools' free lists."""
        self.pools.release(request.tables)

    def migrate(self, request: SGLangRequest, dst: EnginePools, *, plan: MigrationPlan | None = None,
                ape: object = None, loss_report: bool = False) -> tuple[RequestTables, MigrationReport]:
        """Convert a received request into ``dst`` (any engine's pools, ``migrate_local``); returns its
        block tables there. SGLang's compressor scores lack the positional bias vLLM's and TensorRT-LLM's
        include: a model with compressed layers leaves SGLang only with the model's APE weights
        (``ape``, as ``plan_migration`` takes them; without them the planner refuses, with its reason)."""
        if plan is None:
            plan = plan_migration(self.pools.profile, dst.profile, self.pools.model, request.num_tokens,
                                  include_mtp=False, ape=ape)
        return migrate_local(plan, self.pools, request.tables, dst, loss_report=loss_report)

    # -- bootstrap -------------------------------------------------------------------------------

    def _prefill_info(self, addr: str, deadline: float) -> dict[str, Any]:
        url = f"http://{addr}/route?prefill_dp_rank=-1&prefill_cp_rank=-1&target_tp_rank=-1&target_pp_rank=-1"
        while True:
            try:
                code, body = _get_json(url, f"the SGLang bootstrap server {addr}")
            except OSError as exc:
                code, body = None, str(getattr(exc, "reason", exc))
            if code == 200 and isinstance(body, dict):
                break
            if code not in (None, 503) or time.monotonic() > deadline:
                raise TransferError(f"the SGLang bootstrap server {addr} did not describe its prefill "
                                    f"({code or 'unreachable'}: {str(body)[:200]})")
            time.sleep(0.2)
        self._check_prefill(addr, body)
        self._check_model(addr)
        return body

    def _check_model(self, addr: str) -> None:
        """Refuse a kvbridge prefill (its bootstrap server answers ``MODEL_ROUTE``) whose model differs
        in depth, per-layer ratios or buffer item bytes; SGLang's bootstrap server announces none of
        these (it answers 404) and is not checked here."""
        try:
            code, theirs = _get_json(f"http://{addr}{MODEL_ROUTE}", f"the bootstrap server {addr}")
        except (OSError, TransferError):
            return
        if code != 200 or not isinstance(theirs, dict):
            return
        ours = model_info(self.pools)
        diff = [k for k in ("num_layers", "compress_ratios", "kv_item_lens", "state_item_lens")
                if theirs.get(k) != ours[k]]
        if diff:
            raise MigrationError(f"the prefill at {addr} serves {theirs.get('model')} with {theirs.get('num_layers')} "
                                 f"layers, ratios {theirs.get('compress_ratios')}; kvbridge's pools hold "
                                 f"{ours['model']} with {ours['num_layers']} layers, ratios {ours['compress_ratios']} "
                                 f"({', '.join(diff)} differ): model mismatch")

    def _check_prefill(self, addr: str, info: dict[str, Any]) -> None:
        """SGLang's decode-side handshake checks, plus what this peer serves (one prefill rank)."""
        lay = self.layout
        if info.get("page_size") is not None and int(info["page_size"]) != lay.page_size:
            raise MigrationError(f"the SGLang prefill at {addr} has page_size={info['page_size']}, kvbridge's "
                                 f"{self.pools.profile.spec} pools {lay.page_size}: page size mismatch")
        if info.get("kv_cache_dtype") is not None and info["kv_cache_dtype"] != self.kv_cache_dtype:
            raise MigrationError(f"the SGLang prefill at {addr} has kv_cache_dtype={info['kv_cache_dtype']}, "
                                 f"kvbridge expects {self.kv_cache_dtype}: KV cache dtype mismatch")
        if info.get("kv_layout") is not None and info["kv_layout"] != lay.kv_layout:
            raise MigrationError(f"the SGLang prefill at {addr} has kv_layout={info['kv_layout']}, kvbridge's "
                                 f"{self.pools.model.name} pools {lay.kv_layout}: KV layout mismatch")
        if info.get("dsv41_spec_layout") is not None:
            raise MigrationError(f"the SGLang prefill at {addr} runs a DeepSeek-V4.1 DSpark layout, which this peer "
                                 "does not serve")
        sizes = {k: int(info.get(k, 1)) for k in ("attn_tp_size", "attn_cp_size", "pp_size", "dp_size")}
        if any(v != 1 for v in sizes.values()):
            raise MigrationError(f"the SGLang prefill at {addr} runs {sizes}; kvbridge's decode peer pairs with one "
                                 "prefill rank (all 1)")
        if info.get("decode_allocation_policy", "early") != "early":
            raise MigrationError(f"the SGLang prefill at {addr} uses decode allocation policy "
                                 f"{info['decode_allocation_policy']!r}; kvbridge allocates early")

    def _rank(self, addr: str) -> dict[str, Any]:
        url = f"http://{addr}/route?prefill_dp_rank=0&prefill_cp_rank=0&target_tp_rank=0&target_pp_rank=0"
        try:
            code, body = _get_json(url, f"the SGLang bootstrap server {addr}")
        except OSError as exc:
            raise TransferError(f"cannot reach the SGLang bootstrap server {addr}: "
                                f"{getattr(exc, 'reason', exc)}") from None
        if code != 200 or not isinstance(body, dict) or "rank_ip" not in body or "rank_port" not in body:
            raise TransferError(f"the SGLang bootstrap server {addr} has no prefill rank 0 ({code}: {str(body)[:200]})")
        return body

    # -- wire ------------------------------------------------------------------------------------

    def _send(self, target: tuple[str, int], frames: list[bytes]) -> None:
        import zmq

        with self._lock:
            sock = self._push.get(target)
            if sock is None:
                sock = self._zmq.socket(zmq.PUSH)
                sock.setsockopt(zmq.LINGER, 0)
                sock.setsockopt(zmq.SNDTIMEO, 5000)
                sock.connect(f"tcp://{target[0]}:{target[1]}")
                self._push[target] = sock
            try:
                sock.send_multipart(frames)
            except zmq.ZMQError as exc:
                raise TransferError(f"cannot reach the SGLang prefill rank {target[0]}:{target[1]}: {exc}") from None

    def _register(self, target: tuple[str, int]) -> None:
        """Announce the agent and every buffer once per prefill rank (SGLang's registration frames)."""
        if target in self._registered:
            return
        assert self._agent is not None
        lay, pools = self.layout, self.pools
        kv_ptrs = [self._ptrs[(s.layer, s.role)] for s in lay.kv]
        groups = [g for g in (lay.swa_state, lay.request_state) if g]
        state_ptrs = [[self._ptrs[(s.layer, s.role)] for s in g] for g in groups]
        state_lens = [[pool_tensors(pools.pool(s))[0].numel() for s in g] for g in groups]
        num_slots = min((pool_tensors(pools.pool(s))[0].shape[0] for s in lay.kv), default=0)
        kinds = [memory_kind(pool_tensors(pools.pool(s))[0])[0] for s in lay.kv]  # the memory each KV buffer is in
        # the device SGLang addresses VRAM descriptors on (state buffers are always VRAM to it)
        gpu = next((memory_kind(t)[1] for s in self._specs() for t in pool_tensors(pools.pool(s)) if t.is_cuda), 0)
        q = lambda xs: struct.pack(f"<{len(xs)}Q", *xs)  # noqa: E731
        frames = [GUARD, b"None", self.ip.encode(), str(self.rank_port).encode(), self._agent.name.encode(),
                  self._metadata, q(kv_ptrs), q(self._aux_ptrs), _pack_lists(state_ptrs, "Q"), str(gpu).encode(),
                  b"1", b"0",
                  str(lay.kv_item_lens[0] if lay.kv_item_lens else 0).encode(),
                  _pack_lists([list(x) for x in lay.state_item_lens], "I"), _pack_lists([[] for _ in groups], "I"),
                  b"", b"", str(num_slots).encode(), ",".join(kinds).encode(),
                  q(list(lay.kv_item_lens)), _pack_lists([[] for _ in groups], "I"), b"", b"1", b"0",
                  _pack_lists(state_lens, "Q")]
        self._send(target, frames)
        self._registered.add(target)

    def _metadata_message(self, room: int, tables: RequestTables, aux_index: int, first_swa: int,
                          ring: bool) -> list[bytes]:
        lay = self.layout
        state = [tables["swa"][first_swa:]]
        if lay.request_state:
            state.append(list(tables["state128"]) if ring else [])
        assert self._agent is not None
        return [GUARD, str(room).encode(), self.ip.encode(), str(self.rank_port).encode(), self._agent.name.encode(),
                # without compressed layers there are no KV buffers: the page ids address nothing
                np.asarray(tables.get("full", range(len(tables["swa"]))), dtype="<i4").tobytes(),
                str(aux_index).encode(), b"1",
                _pack_lists(state, "i"), b"0", b"0"]

    def _dummy_message(self, room: int) -> list[bytes]:
        """SGLang's page ids of a decode rank that needs nothing of ``room`` (``build_receiver_metadata_message``
        with ``is_dummy``): no KV pages, no state indices, metadata row -1, no prefix, dummy 1."""
        assert self._agent is not None
        return [GUARD, str(room).encode(), self.ip.encode(), str(self.rank_port).encode(), self._agent.name.encode(),
                b"", b"-1", b"1", b"", b"0", b"1"]

    def _listen(self, pull: Any) -> None:
        while not self._stop.is_set():
            try:
                if not pull.poll(100):
                    continue
                msg = pull.recv_multipart()
            except Exception:  # context destroyed by close()
                return
            if len(msg) < 4 or msg[0] != KV_STATUS:
                continue  # staging / abort-ack traffic: not used by this peer
            try:
                room, status = int(msg[1]), int(msg[2])
            except ValueError:
                continue
            reason = msg[4].decode(errors="replace") if len(msg) > 4 else ""
            if status not in (POLL_SUCCESS, POLL_FAILED):
                continue
            with self._lock:
                w, q = self._waiters.get(room), self._quarantine.get(room)
                if w is not None:
                    w.status, w.reason = status, reason
                    w.done.set()
                elif q is not None:  # a late status: the prefill's writes for the room settled
                    q.settled = True
            if q is not None and w is None:
                self.reclaim()

    # -- received bytes --------------------------------------------------------------------------

    def _read_row(self, aux_index: int) -> tuple[int, int]:
        """(first output token, bootstrap room) of metadata row ``aux_index``."""
        first = int(np.frombuffer(self._aux[0][aux_index].numpy().tobytes()[:4], "<i4")[0])
        room = int(np.frombuffer(self._aux[ROOM_BUFFER][aux_index].numpy().tobytes()[:8], "<u8")[0])
        return first, room

    def _landed(self, tables: RequestTables, first_swa: int, ring: bool, full_pages: int):
        """Every item the request keeps, in SGLang's transfer order (each KV buffer over the first
        ``full_pages`` pages, each ``swa`` component buffer over the window's pages, then the ratio-128
        ring when it travelled): what ``SGLangPrefillPeer`` digests."""
        lay = self.layout
        groups = [(lay.kv, tables.get("full", [])[:full_pages]), (lay.swa_state, tables["swa"][first_swa:])]
        if ring:
            groups.append((lay.request_state, tables["state128"][:1]))
        for specs, ids in groups:
            for spec in specs:
                for t in pool_tensors(self.pools.pool(spec)):
                    for i in ids:
                        yield t[i]

    def _check_digest(self, room: int, aux_index: int, tables: RequestTables, first_swa: int, ring: bool,
                      full_pages: int) -> tuple[int, bool]:
        """kvbridge's digest of what landed (on the pools' device) and whether it was checked: against
        the digest a prefill wrote into the checksum row (``kv_checksum``; kvbridge's prefill peer does,
        SGLang 0.5.23's cannot digest DeepSeek-V4 state and sends none). A mismatch fails the request."""
        digest = kv_digest(self._landed(tables, first_swa, ring, full_pages))
        if not self.kv_checksum:
            return digest, False
        sent = int(np.frombuffer(self._aux[-1][aux_index].numpy().tobytes()[:8], "<u8")[0])
        if sent and sent != digest:
            raise TransferError(f"room {room}: the bytes that landed digest to {digest:#010x}, the prefill's digest is "
                                f"{sent:#010x}: corrupted in transfer")
        return digest, bool(sent)

    def _written(self, pages: dict[str, int]) -> int:
        """Bytes the prefill wrote for ``pages`` (pages per block table) and one metadata row."""
        lay = self.layout
        total = pages.get("full", 0) * sum(lay.kv_item_lens) + pages["swa"] * sum(lay.state_item_lens[0])
        if lay.request_state:
            total += pages.get("state128", 0) * sum(lay.state_item_lens[1])
        return total + sum(metadata_item_lens(self.hidden_state_bytes))

    def _scrub(self, tables: RequestTables) -> None:
        """Zero every page of a request that did not arrive whole."""
        for spec in self._specs():
            ids = [i for i in tables.get(self.pools.storage(spec).table, []) if i >= 0]
            if ids:
                for t in pool_tensors(self.pools.pool(spec)):
                    t[ids] = 0

    def _state_items(self, tables: RequestTables, ring: bool):
        """(pool tensor, page id) of every state-component item SGLang's prefill writes for the request:
        the SWA pages' ``swa`` component (SWA KV and both compressor states) and, when it travels, the
        ratio-128 ring."""
        for spec in (*self.layout.swa_state, *(self.layout.request_state if ring else ())):
            for i in tables.get(self.pools.storage(spec).table, []):
                if i >= 0:
                    for t in pool_tensors(self.pools.pool(spec)):
                        yield t, i

    def _mark_state(self, tables: RequestTables, ring: bool) -> None:
        """Fill the request's state items with 0xFF. SGLang's prefill announces no state dtype and writes
        state at its own item length: a prefill with another ``SGLANG_DSV4_COMPRESS_STATE_DTYPE`` writes
        elsewhere and leaves these items as marked (``_check_state``)."""
        for t, i in self._state_items(tables, ring):
            t[i] = STATE_MARK

    def _check_state(self, room: int, tables: RequestTables, ring: bool) -> None:
        """Refuse a request whose state items were not all written (one still holds only the mark), and
        zero the state pools' free items, where the misplaced rows may have landed."""
        if all(bool((t[i] != STATE_MARK).any()) for t, i in self._state_items(tables, ring)):
            return
        for spec in (*self.layout.swa_state, *self.layout.request_state):
            free = self.pools.free.get(self.pools.storage(spec).table, [])
            if free:
                for t in pool_tensors(self.pools.pool(spec)):
                    t[sorted(free)] = 0
        raise TransferError(f"room {room}: the SGLang prefill did not write the request's compressor-state rows "
                            f"where a {self.pools.profile.state_dtype} state pool holds them: its compressor state "
                            "has another dtype (set SGLANG_DSV4_COMPRESS_STATE_DTYPE alike on both sides)")

    def _specs(self) -> Sequence[CacheSpec]:
        lay: SGLangPDLayout = self.layout
        return (*lay.kv, *lay.swa_state, *lay.request_state)


__all__ = ["AUX_ROWS", "HEARTBEAT_FAILURES", "HEARTBEAT_S", "SGLangDecodePeer", "SGLangRequest", "claimed_pages",
           "landing_pages"]
