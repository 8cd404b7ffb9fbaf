"""A prefill peer that an unmodified SGLang 0.5.23 decode engine accepts (``--disaggregation-mode decode
--disaggregation-transfer-backend nixl``).

SGLang's PD transfer backends are a closed list, so kvbridge joins as a peer speaking SGLang's own NIXL
protocol; the decode cannot tell it from an SGLang prefill:

1. bootstrap: the decode asks ``GET /route`` on the prefill's bootstrap address for the prefill's
   topology (``PrefillServerInfo``: TP/CP/DP/PP sizes 1, page size, KV-cache dtype, the layout string
   such as ``v4,c4:v4,c128:v4``) and then for rank 0's ZMQ endpoint. SGLang's decode refuses a page
   size, dtype or layout other than its own. The peer serves that route itself
   (``bootstrap_port``), or registers with an SGLang bootstrap server (``register_with``, a
   ``PUT /route`` as an SGLang prefill rank does);
2. the decode pushes, over ZMQ, a registration (its NIXL agent metadata and the base address and item
   length of every buffer it registered) and, per request ("room"), the page ids it allocated: KV
   pages, SWA pages (which also address the ratio-4 compressor-state rings) and the request-state
   slot (ratio-128 compressor ring), plus its metadata-row index;
3. the peer checks that each buffer's item length is the one its pools hold, then NIXL-WRITEs every
   page to ``dst_ptr + page_id * item_len`` in the order of the decode's buffer list, the metadata row
   (first output token, room; the KV checksum row when the decode asks for it) last, waits for
   completion and pushes ``KV_STATUS`` Success (or Failed with a one-line reason, which SGLang's decode
   reports as the request's failure).

KV checksum (a decode started with ``--disaggregation-enable-kv-checksum`` registers one more metadata
buffer, a row of 8 uint64): SGLang's digest is Adler-32 over the bytes of every transferred item
concatenated in transfer order (each KV buffer at the request's pages, then the state buffers), which
its kernel computes per item and combines in order (``kv_checksum``); the row holds the digest and, in
its second slot, a layout signature the decode compares with its own before comparing digests.
SGLang 0.5.23 has no index for DeepSeek-V4's state components in its digest: it stops on an assertion,
on a prefill whenever it digests and on a decode whose signature matches the prefill's. So the peer
writes its digest with signature 0, which that decode reads as "not comparable": it admits the request
unverified, as from a prefill that sent no digest. ``wait`` reports the digest (``kv_checksum``).

The buffer order is SGLang's ``DeepSeekV4TokenToKVPool``: KV = every ratio-4 compressed cache, every
ratio-4 indexer cache, every ratio-128 compressed cache (layer order within each); state component
``swa`` = every layer's SWA cache, then the ratio-4 attention and indexer compressor states;
component ``c128_state`` = the ratio-128 compressor states. Pools are kvbridge ``EnginePools`` of an
SGLang profile (``kvbridge.engines.profiles.sglang``); a request from another engine's pools is first
converted with ``kvbridge.migration.migrate_local`` (``SGLangPrefillPeer.add_migrated_request``).

Limits of this version: attention TP/PP/CP of 1 on the kvbridge side (any decode TP: MLA pages go
to every decode rank), no MTP/draft layers, no decode-side prefix cache (``decode_prefix_len`` 0),
metadata rows without the sampling-mask and DSA top-k buffers.
"""

from __future__ import annotations

import json
import queue
import struct
import threading
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, urlparse

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
    DecodePeer,
    TransferInfo,
    _local_ip,
    kv_digest,
    metadata_item_lens,
    metadata_row,
    model_info,
    pd_layout,
    start_peer,
)
from kvbridge.dumps.convert import convert_entry
from kvbridge.dumps.dumpfile import Dump, DumpEntry, entry_name
from kvbridge.engines.profiles import Storage
from kvbridge.engines.topology import CacheSpec, Role
from kvbridge.errors import InputError, KVBridgeError
from kvbridge.migration.errors import TransferError
from kvbridge.migration.execute import migrate_local
from kvbridge.migration.nixl_agent import _Agent, _LocalAgent, _new_agent, memory_kind
from kvbridge.migration.plan import MigrationPlan, plan_migration
from kvbridge.migration.pools import (
    EnginePools,
    Pool,
    RequestTables,
    gather_records,
    pool_tensors,
    scatter_records,
    table_of,
)

SGLANG_VERSION = "0.5.23"


def request_dump(pools: EnginePools, tables: RequestTables, plan: MigrationPlan) -> tuple[list[DumpEntry],
                                                                                     dict[str, str]]:
    """The request's SWA and compressed KV caches in ``pools`` (``plan``'s destination) as dump entries
    (pages of the pools' layout), and the first position of each SWA window as attributes
    (``layer.{i}.{role}.first_position``); ``SGLangPrefillPeer.add_dump_request`` reads them back."""
    entries, attrs = [], {}
    for t in plan.transfers:
        st = t.dst
        if st.kind != "kv":
            continue
        rec = gather_records(pools.pool(t.spec), st, table_of(tables, st), t.first, t.count)
        pages = st.layout.records_to_pages(rec, st.page_size)
        entries.append(DumpEntry(t.spec.layer, t.spec.role.value, pages, layout=st.layout.name,
                                 page_size=st.page_size, num_tokens=t.count, scale=st.scale, dialect=st.dialect,
                                 compress_ratio=t.spec.ratio or None))
        if t.first:
            attrs[f"{entry_name(t.spec.layer, t.spec.role.value)}.first_position"] = str(t.first)
    return entries, attrs


# ---------------------------------------------------------------------------------------------
# The bootstrap route


class _Bootstrap(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, host: str, port: int, info: dict, rank: dict, model: dict):
        self.info, self.rank, self.model = info, rank, model
        super().__init__((host, port), _RouteHandler)


class _RouteHandler(BaseHTTPRequestHandler):
    server: _Bootstrap

    def log_message(self, *args: Any) -> None:  # no per-request lines on stderr
        pass

    def _reply(self, code: int, body: Any) -> None:
        data = (json.dumps(body) if not isinstance(body, str) else body).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json" if not isinstance(body, str) else "text/plain")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self) -> None:  # noqa: N802 (http.server's name)
        url = urlparse(self.path)
        if url.path == "/health":
            return self._reply(200, "OK")
        if url.path == MODEL_ROUTE:
            return self._reply(200, self.server.model)
        if url.path != "/route":
            return self._reply(404, "not found")
        q = {k: v[0] for k, v in parse_qs(url.query).items()}
        keys = ("prefill_dp_rank", "prefill_cp_rank", "target_tp_rank", "target_pp_rank")
        try:
            ranks = [int(q[k]) for k in keys]
        except (KeyError, ValueError):
            return self._reply(400, "Missing inputs for bootstrap server.")
        if ranks == [-1] * 4:
            return self._reply(200, self.server.info)
        if ranks == [0] * 4:
            return self._reply(200, self.server.rank)
        return self._reply(404, f"Bootstrap info not found for ranks {ranks} (kvbridge serves rank 0 only)")

    def do_POST(self) -> None:  # noqa: N802
        length = int(self.headers.get("Content-Length") or 0)
        self.rfile.read(length)
        path = urlparse(self.path).path
        if path == "/register_dp_rank":
            return self._reply(200, "OK")
        if path == "/query_dp_ranks":
            return self._reply(200, {})
        return self._reply(404, "not found")


# ---------------------------------------------------------------------------------------------
# The peer


@dataclass
class _Request:
    tables: RequestTables
    num_tokens: int
    first_token: int
    done: threading.Event = field(default_factory=threading.Event)
    result: dict[str, Any] | None = None
    sending: bool = False  # its NIXL writes are under way (set by the worker; withdraw then refuses)


def _rewrite_pages(pool: Pool, st: Storage, tables: RequestTables, pages: Sequence[int], lo: int, hi: int) -> None:
    """Zero ``pages`` (indices into the request's block tables) of every tensor of ``pool``, each through its own
    table, keeping the request's entries ``[lo, hi)``: they are gathered first and written back."""
    rec = gather_records(pool, st, table_of(tables, st), lo, hi - lo) if hi > lo else None
    tensors = pool_tensors(pool)
    names = [st.table, st.score_table] if st.score_table is not None else [st.table] * len(tensors)
    for x, name in zip(tensors, names, strict=True):
        x[[tables[name][i] for i in pages]] = 0
    if rec is not None:
        scatter_records(pool, st, table_of(tables, st), lo, rec)


class SGLangPrefillPeer:
    """kvbridge as the prefill server of an SGLang decode (see the module docstring).

    ``pools``: SGLang-profile pools holding the requests (their tensors are moved to shared memory, in
    place, for the NIXL agent process). ``bootstrap_port``: serve the bootstrap route on this port
    (0: any free port, see ``bootstrap_addr``); ``register_with``: ``host:port`` of an SGLang bootstrap
    server to register with instead. ``kv_cache_dtype``: the string the decode runs with
    (``--kv-cache-dtype``; DeepSeek-V4 resolves ``auto`` to ``fp8_e4m3``). ``hidden_state_bytes``:
    bytes per row of the decode's hidden-state metadata buffer: 64 (16 fp32, SGLang's padding) unless
    its speculative decoding carries draft hidden states (then the draft's hidden size x its dtype).
    ``timeout``: seconds one request's transfer may take. ``state_memory``: the memory kind (``VRAM``
    or ``DRAM``) the decode registered its compressor-state buffers as, which SGLang does not announce:
    SGLang 0.5.23 always registers them as ``VRAM`` (``nixl/conn.py`` ``register_buffer_to_engine``),
    also when its KV is in host memory (hisparse), so that is the default; ``DRAM`` only for a decode
    changed to register host state as host memory (as the CPU tests do). ``max_rate``: bytes per second
    one room's writes may take (None: as fast as NIXL goes): its pages are written in chunks of a tenth of
    a second's bytes, each waited for and paced, the metadata row after the last (PD traffic sharing a
    link with other traffic).
    """

    def __init__(self, pools: EnginePools, *, hidden_state_bytes: int = HIDDEN_STATE_BYTES, host: str = "127.0.0.1",
                 bootstrap_port: int | None = 0, register_with: str | None = None,
                 kv_cache_dtype: str = "fp8_e4m3", timeout: float = 60.0, state_memory: str = "VRAM",
                 max_rate: float | None = None):
        if not isinstance(pools, EnginePools):
            raise InputError(f"pools must be EnginePools, got {type(pools).__name__}")
        if isinstance(hidden_state_bytes, bool) or not isinstance(hidden_state_bytes, int) or hidden_state_bytes < 1:
            raise InputError(f"hidden_state_bytes must be a positive integer, got {hidden_state_bytes!r}")
        if state_memory not in ("DRAM", "VRAM"):
            raise InputError(f"state_memory must be DRAM or VRAM, got {state_memory!r}")
        self.state_memory = state_memory
        if max_rate is not None and (isinstance(max_rate, bool) or not isinstance(max_rate, int | float)
                                     or not max_rate > 0):
            raise InputError(f"max_rate must be a positive number of bytes per second, got {max_rate!r}")
        self.max_rate = None if max_rate is None else float(max_rate)
        if (bootstrap_port is None) == (register_with is None):
            raise InputError("give exactly one of bootstrap_port (serve the bootstrap route) and register_with "
                             "(an SGLang bootstrap server's host:port)")
        self.pools, self.layout = pools, pd_layout(pools)
        self.hidden_state_bytes, self.kv_cache_dtype = hidden_state_bytes, kv_cache_dtype
        self.timeout = float(timeout)
        self.host = host
        self._bootstrap_port, self._register_with = bootstrap_port, register_with
        self._requests: dict[int, _Request] = {}
        self._infos: dict[int, dict[str, TransferInfo]] = {}
        self._peers: dict[str, DecodePeer] = {}
        self._lock = threading.Lock()
        self._pools_lock = threading.Lock()  # claims and releases of the pools' pages (callers' threads)
        self._work: queue.Queue = queue.Queue()
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._agent: _Agent | _LocalAgent | None = None
        self._http: _Bootstrap | None = None
        self._zmq: Any = None
        self.bootstrap_addr = ""
        self.rank_port = 0

    # -- lifecycle -------------------------------------------------------------------------------

    def start(self) -> SGLangPrefillPeer:
        """Start the NIXL agent, the ZMQ endpoint and the bootstrap route (or register with one)."""
        start_peer(self)
        return self

    def _start(self) -> None:
        import zmq

        ip = _local_ip(self.host)
        self._zmq = zmq.Context()
        pull = self._zmq.socket(zmq.PULL)
        self.rank_port = pull.bind_to_random_port(f"tcp://{ip}")
        # in this process where it is daemonic (a vLLM worker of the multiprocess executor: no children)
        self._agent = _new_agent(f"kvbridge-sglang-{uuid.uuid4().hex[:12]}")
        self._regions: dict[tuple[int, Role], int] = {}
        for specs in (self.layout.kv, self.layout.swa_state, self.layout.request_state):
            for spec in specs:
                (t,) = pool_tensors(self.pools.pool(spec))
                t.share_memory_()
                self._regions[(spec.layer, spec.role)] = self._agent.register(f"{spec.layer}.{spec.role.value}", t)
        self._aux = torch.zeros(sum(metadata_item_lens(self.hidden_state_bytes)) + CHECKSUM_ROW_BYTES,
                                dtype=torch.uint8).share_memory_()
        self._aux_addr = self._agent.register("aux", self._aux)
        info = {"attn_tp_size": 1, "attn_cp_size": 1, "dp_size": 1, "pp_size": 1,
                "page_size": self.layout.page_size, "kv_cache_dtype": self.kv_cache_dtype,
                "follow_bootstrap_room": True, "enable_dsa_cache_layer_split": False,
                "kv_layout": self.layout.kv_layout, "decode_allocation_policy": "early",
                "enable_kv_cache_sharding": False, "prefill_http_port": None}
        if self._register_with is None:
            try:
                self._http = _Bootstrap(self.host, self._bootstrap_port or 0, info,
                                        {"rank_ip": ip, "rank_port": self.rank_port}, model_info(self.pools))
            except OSError as exc:
                raise TransferError(f"cannot serve the bootstrap route on {self.host}:{self._bootstrap_port}: "
                                    f"{exc.strerror or exc}") from None
            self.bootstrap_addr = f"{ip}:{self._http.server_address[1]}"
            self._spawn(self._http.serve_forever)
        else:
            self.bootstrap_addr = self._register_with
            self._register(info, ip)
        self._spawn(self._serve, pull)
        self._spawn(self._worker)

    def _spawn(self, fn, *args: Any) -> None:
        t = threading.Thread(target=fn, args=args, daemon=True, name=f"kvbridge-sglang-{fn.__name__}")
        t.start()
        self._threads.append(t)

    def _register(self, info: dict, ip: str) -> None:
        """``PUT /route`` on an SGLang bootstrap server, as an SGLang prefill rank registers."""
        body = {"attn_tp_size": 1, "attn_tp_rank": 0, "attn_cp_size": 1, "attn_cp_rank": 0, "attn_dp_size": 1,
                "attn_dp_rank": 0, "pp_size": 1, "pp_rank": 0, "system_dp_size": 1, "system_dp_rank": 0,
                "rank_ip": ip, "rank_port": self.rank_port, "page_size": info["page_size"],
                "kv_cache_dtype": info["kv_cache_dtype"], "kv_layout": info["kv_layout"],
                "load_balance_method": "follow_bootstrap_room", "decode_allocation_policy": "early"}
        req = urllib.request.Request(f"http://{self._register_with}/route", data=json.dumps(body).encode(),
                                     method="PUT", headers={"Content-Type": "application/json"})
        deadline = time.monotonic() + self.timeout
        while True:
            try:
                with urllib.request.urlopen(req, timeout=5) as r:
                    if r.status == 200:
                        return
                    raise TransferError(f"the SGLang bootstrap server {self._register_with} answered {r.status}")
            except urllib.error.HTTPError as exc:
                raise TransferError(f"the SGLang bootstrap server {self._register_with} refused the registration: "
                                    f"{exc.code} {exc.read().decode(errors='replace')[:200]}") from None
            except OSError as exc:  # not up yet
                if time.monotonic() > deadline:
                    raise TransferError(f"cannot reach the SGLang bootstrap server {self._register_with}: "
                                        f"{exc}") from None
                time.sleep(0.2)

    def close(self) -> None:
        """Stop serving; the agent process ends (requests not yet sent fail)."""
        self._stop.set()
        self._work.put(None)
        if self._http is not None:
            self._http.shutdown()
            self._http.server_close()
        for t in self._threads:
            t.join(5)
        if self._agent is not None:
            self._agent.close()
            self._agent = None
        if self._zmq is not None:
            self._zmq.destroy(linger=0)
            self._zmq = None
        with self._lock:
            for req in self._requests.values():
                if not req.done.is_set():
                    req.result = {"status": "Failed", "reason": "the peer was closed"}
                    req.done.set()

    def __enter__(self) -> SGLangPrefillPeer:
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # -- requests --------------------------------------------------------------------------------

    def add_request(self, room: int, tables: RequestTables, num_tokens: int, first_token: int) -> None:
        """Offer a prefilled request, held in ``pools`` at ``tables``, to the decode that asks for
        ``room`` (the request's ``bootstrap_room``). ``first_token``: the token id the prefill sampled. The pages
        travel whole, as they are: bytes of them the caller's request did not write (an earlier request's, on a
        reused page) are the caller's to clear (``add_migrated_request`` and ``add_dump_request`` do it)."""
        if isinstance(room, bool) or not isinstance(room, int) or not 0 < room < 2**63:
            raise InputError(f"room must be a positive 63-bit integer, got {room!r}")
        if isinstance(num_tokens, bool) or not isinstance(num_tokens, int) or num_tokens < 1:
            raise InputError(f"num_tokens must be a positive integer, got {num_tokens!r}")
        if isinstance(first_token, bool) or not isinstance(first_token, int) or not 0 <= first_token < 2**31:
            raise InputError(f"first_token must be a token id (0 <= id < 2^31), got {first_token!r}")
        for name in {self.pools.storage(s).table for s in (*self.layout.kv, *self.layout.swa_state,
                                                           *self.layout.request_state)}:
            if name not in tables:
                raise InputError(f"tables lack block table {name!r} of {self.pools.profile.spec}")
        with self._lock:
            if room in self._requests and not self._requests[room].done.is_set():
                raise InputError(f"room {room} is already offered")
            self._requests[room] = _Request({k: list(v) for k, v in tables.items()}, num_tokens, first_token)
            ready = self._ready(room)
        if ready:
            self._work.put(room)

    def add_migrated_request(self, room: int, plan: MigrationPlan, src: EnginePools, src_tables: RequestTables,
                             first_token: int) -> RequestTables:
        """Convert a request from another engine's pools into ``pools`` (``migrate_local``), then offer it.
        Returns its block tables in ``pools`` (release them after ``wait``)."""
        if plan.dst.spec != self.pools.profile.spec:
            raise InputError(f"plan's destination is {plan.dst.spec}, the peer's pools are {self.pools.profile.spec}")
        with self._pools_lock:
            tables, _ = migrate_local(plan, src, src_tables, self.pools, loss_report=False)
            self._clean_unwritten(plan, tables)
        try:
            self.add_request(room, tables, plan.num_tokens, first_token)
        except BaseException:
            self.release_pages(tables)
            raise
        return tables

    def withdraw(self, room: int, reason: str) -> bool:
        """Stop offering ``room`` (it ends ``Failed`` with ``reason``): True when no write of it can still
        happen, so its pages may be released; False when its NIXL writes are under way (``wait`` for it)."""
        with self._lock:
            req = self._requests.get(room)
            if req is None or req.done.is_set():
                return True
            if req.sending:
                return False
            req.result = {"status": "Failed", "reason": reason, "bytes": 0, "seconds": 0.0, "peers": 0,
                          "digest": None, "kv_checksum": None}
            req.done.set()
            return True

    def forget(self, room: int) -> None:
        """Drop a room that ended (``wait`` returned or ``withdraw`` said True), so it may be offered again."""
        with self._lock:
            req = self._requests.get(room)
            if req is not None and req.done.is_set():
                del self._requests[room]

    def release_pages(self, tables: RequestTables) -> None:
        """Return a request's pages (``add_migrated_request``'s or ``add_dump_request``'s tables) to the
        pools once it ended. They are not zeroed: the next room cleans what it sends but does not write
        (``_clean_unwritten``)."""
        with self._pools_lock:
            self.pools.release(tables)

    def _clean_unwritten(self, plan: MigrationPlan, tables: RequestTables) -> None:
        """Zero every byte of the pages this room will send (``_send``) that its records do not cover, then
        write its records back: the whole page travels, and a page may hold an earlier room's bytes.

        A KV page (compressed KV, indexer keys, SWA KV) whose every entry slot is one of the room's entries
        is overwritten by them, except bytes no record covers (a page's padding, e.g. 1 byte per entry of
        SGLang's 585-byte fp8 slot, 560 bytes of a ratio-128 page), which kvbridge's writes never touch, so
        they keep the pools' zeros; only the pages holding the first or last entries, where the room's
        entries do not fill the page (the tail of each cache's last page), are rewritten. A compressor-state
        page (the window's SWA-page rings, the ratio-128 ring) holds a few rows of the room: every one it
        sends is rewritten. Cost: about two pages per cache per room, not the room's bytes."""
        lay, pools = self.layout, self.pools
        page, n = lay.page_size, plan.num_tokens
        num_pages = -(-n // page)
        first_window = max(0, n - pools.model.sliding_window) // page
        kv = {(s.layer, s.role) for s in lay.kv}
        swa = {(s.layer, s.role) for s in lay.swa_state}
        for t in plan.transfers:
            st, key = t.dst, (t.spec.layer, t.spec.role)
            if key in kv:
                sent = range(min(len(tables[st.table]), num_pages))
            elif key in swa:
                sent = range(first_window, num_pages)
            else:
                sent = range(min(1, len(tables[st.table])))
            pool, end = pools.pool(t.spec), t.first + t.count
            if st.kind == "state":  # the room's rows, wherever the ring puts them
                _rewrite_pages(pool, st, tables, sent, t.first, end)
                continue
            for i in sent:
                lo, hi = max(t.first, i * st.page_size), min(end, (i + 1) * st.page_size)
                if (lo, hi) != (i * st.page_size, (i + 1) * st.page_size):  # else every slot is the room's
                    _rewrite_pages(pool, st, tables, [i], lo, hi)

    def add_dump_request(self, room: int, dump: Dump, num_tokens: int, first_token: int) -> RequestTables:
        """Load a request from a kvbridge dump (``request_dump``'s entries: each KV cache's pages, in any
        layout, converted to the pools' by ``convert_entry`` where it differs, byte for byte where it is
        the same) into ``pools``, then offer it. A dump holds KV caches, not compressor state: a model with
        compressed layers is served from pools (``add_request``). Returns its block tables in ``pools``."""
        plan = plan_migration(self.pools.profile, self.pools.profile, self.pools.model, num_tokens, include_mtp=False)
        state = sorted({t.spec.role.value for t in plan.transfers if t.dst.kind != "kv"})
        if state:
            raise InputError(f"{self.pools.model.name} needs compressor state ({', '.join(state)}) for SGLang's "
                             "decode, which a kvbridge dump does not hold: serve the request from pools "
                             "(SGLangPrefillPeer.add_request)")
        loaded = []
        for t in plan.transfers:
            st, name = t.dst, entry_name(t.spec.layer, t.spec.role.value)
            if name not in dump.names:
                raise InputError(f"the dump has no entry {name} ({num_tokens} tokens of {self.pools.model.name} need "
                                 f"one per KV cache); entries: {', '.join(dump.names) or 'none'}")
            entry = dump[name]
            first = int(dump.attrs.get(f"{name}.first_position", 0))
            if (first, entry.num_tokens) != (t.first, t.count):
                raise InputError(f"dump entry {name} holds tokens {first}..{first + (entry.num_tokens or 0) - 1}, a "
                                 f"{num_tokens}-token request keeps {t.first}..{t.first + t.count - 1} there")
            if (entry.layout, entry.page_size) != (st.layout.name, st.page_size):
                entry, _ = convert_entry(entry, st.layout, page_size=st.page_size, dialect=st.dialect, scale=st.scale)
            loaded.append((t, st.layout.pages_to_records(entry.data, st.page_size, t.count)))
        with self._pools_lock:
            tables = self.pools.claim(plan.table_lengths("dst"), plan.released("dst"))
        with self._pools_lock:
            for t, rec in loaded:
                scatter_records(self.pools.pool(t.spec), t.dst, table_of(tables, t.dst), t.first, rec)
            self._clean_unwritten(plan, tables)
        self.add_request(room, tables, num_tokens, first_token)
        return tables

    def wait(self, room: int, timeout: float | None = None) -> dict[str, Any]:
        """Block until ``room`` was sent (or failed); returns ``{"status", "reason", "bytes", "seconds",
        "peers", "digest", "kv_checksum"}``: ``digest`` is kvbridge's digest of every page and state row
        written (``kv_digest``), ``kv_checksum`` the same value when the decode has a checksum row
        (None otherwise). Raises ``TransferError`` when it did not finish within ``timeout``."""
        with self._lock:
            req = self._requests.get(room)
        if req is None:
            raise InputError(f"room {room} was never offered")
        if not req.done.wait(self.timeout if timeout is None else timeout):
            raise TransferError(f"room {room}: no SGLang decode asked for it within the timeout")
        assert req.result is not None
        return dict(req.result)

    # -- serving ---------------------------------------------------------------------------------

    def _ready(self, room: int) -> bool:
        infos = self._infos.get(room, {})
        return room in self._requests and bool(infos) and len(infos) == next(iter(infos.values())).required

    def _serve(self, pull: Any) -> None:
        while not self._stop.is_set():
            try:
                if not pull.poll(100):
                    continue
                msg = pull.recv_multipart()
            except Exception:  # context destroyed by close()
                return
            if not msg or msg[0] != GUARD or len(msg) < 8:
                continue  # staging / abort / watermark traffic: not used by this peer
            body = msg[1:]
            try:
                if body[0] == b"None":
                    self._on_register(DecodePeer.parse(body))
                    continue
                info = TransferInfo.parse(body)
            except (ValueError, IndexError, struct.error, UnicodeDecodeError):
                continue  # malformed: SGLang's prefill asserts; this peer ignores the message
            with self._lock:
                self._infos.setdefault(info.room, {})[info.agent_name] = info
                ready = self._ready(info.room)
            if ready:
                self._work.put(info.room)

    def _on_register(self, peer: DecodePeer) -> None:
        lay = self.layout
        aux = metadata_item_lens(self.hidden_state_bytes)
        if peer.kv_item_lens != list(lay.kv_item_lens) or [list(x) for x in peer.state_item_lens] != [
                list(x) for x in lay.state_item_lens]:
            peer.refused = (f"decode buffers (KV item bytes {peer.kv_item_lens}, state {peer.state_item_lens}) are not "
                            f"the pools' (KV {list(lay.kv_item_lens)}, state {[list(x) for x in lay.state_item_lens]}) "
                            f"of {self.pools.profile.spec}, {self.pools.model.name}")
        elif len(peer.aux_ptrs) not in (len(aux), len(aux) + 1):
            peer.refused = (f"decode registered {len(peer.aux_ptrs)} metadata buffers, kvbridge writes {len(aux)}, "
                            f"or {len(aux) + 1} with the KV checksum row (no sampling mask or DSA top-k rows)")
        elif any(k not in ("DRAM", "VRAM") for k in peer.kv_mem_kinds):
            peer.refused = f"decode KV memory kinds {sorted(set(peer.kv_mem_kinds))} are not DRAM/VRAM"
        else:
            peer.kv_checksum = len(peer.aux_ptrs) == len(aux) + 1
            assert self._agent is not None
            try:
                peer.nixl_name = self._agent.call("adding the decode's NIXL agent", "add_remote", peer.metadata)
            except TransferError as exc:
                peer.refused = str(exc)
        with self._lock:
            self._peers[peer.agent_name] = peer

    def _worker(self) -> None:
        while True:
            room = self._work.get()
            if room is None:
                return
            with self._lock:
                req, infos = self._requests.get(room), dict(self._infos.pop(room, {}))
                if req is None or req.done.is_set():
                    continue
                req.sending = True
            t0 = time.perf_counter()
            sent, reason, digest, asked = 0, "", None, False
            targets = [(i.endpoint, i.port) for i in infos.values() if not i.dummy]
            try:
                for info in infos.values():
                    if not info.dummy:
                        n, digest, asked = self._send(req, info)
                        sent += n
                status = POLL_SUCCESS
            except KVBridgeError as exc:
                status, reason = POLL_FAILED, f"kvbridge prefill peer: {exc}"
            except Exception as exc:  # a decode message this version misreads: fail the request, keep serving
                status, reason = POLL_FAILED, f"kvbridge prefill peer: {type(exc).__name__}: {exc}"
            for endpoint, port in dict.fromkeys(targets):
                self._push_status(endpoint, port, room, status, reason)
            req.result = {"status": "Success" if status == POLL_SUCCESS else "Failed", "reason": reason,
                          "bytes": sent, "seconds": time.perf_counter() - t0, "peers": len(targets),
                          "digest": digest if status == POLL_SUCCESS else None,
                          "kv_checksum": digest if status == POLL_SUCCESS and asked else None}
            req.done.set()

    def _push_status(self, endpoint: str, port: int, room: int, status: int, reason: str) -> None:
        import zmq

        sock = self._zmq.socket(zmq.PUSH)
        sock.setsockopt(zmq.LINGER, 5000)
        try:
            sock.connect(f"tcp://{endpoint}:{port}")
            sock.send_multipart([KV_STATUS, str(room).encode(), str(status).encode(), b"0", reason.encode()])
        finally:
            sock.close()

    def _send(self, req: _Request, info: TransferInfo) -> tuple[int, int, bool]:
        """NIXL-write one request to one decode rank; returns the bytes written, kvbridge's digest of the
        pages and state rows written (``kv_digest``, SGLang's KV checksum) and whether the decode asked
        for it in its checksum row."""
        with self._lock:
            peer = self._peers.get(info.agent_name)
        if peer is None:
            raise TransferError(f"decode agent {info.agent_name} sent page ids before registering")
        if peer.refused:
            raise InputError(peer.refused)
        if info.prefix_len:
            raise InputError(f"decode holds a {info.prefix_len}-token prefix of its own (decode radix cache); "
                             "kvbridge sends whole requests only")
        lay, pools = self.layout, self.pools
        page = lay.page_size
        num_pages = -(-req.num_tokens // page)
        if len(info.kv_pages) != num_pages:
            raise InputError(f"decode allocated {len(info.kv_pages)} KV pages for room {info.room}; the request's "
                             f"{req.num_tokens} tokens take {num_pages}")
        # descriptors per (remote kind, local kind): each side's kind is the one of its memory
        local: dict[tuple[str, str], list[tuple[int, int, int]]] = {}
        remote: dict[tuple[str, str], list[tuple[int, int, int]]] = {}
        items: list[torch.Tensor] = []  # every page / state row written, in SGLang's transfer order

        def add(spec: CacheSpec, src_pages: Sequence[int], dst_ptr: int, dst_pages: Sequence[int], kind: str) -> None:
            st = pools.storage(spec)
            base = self._regions[(spec.layer, spec.role)]
            (tensor,) = pool_tensors(pools.pool(spec))
            n_pages = tensor.shape[0]
            dev = peer.gpu_id if kind == "VRAM" else 0
            local_kind, local_dev = memory_kind(tensor)
            key = (kind, local_kind)
            for s, d in zip(src_pages, dst_pages, strict=True):
                if s < 0:
                    raise InputError(f"layer {spec.layer} {spec.role.value}: the request's page for decode page {d} "
                                     "was released (out of the window)")
                if s >= n_pages or d < 0:
                    raise InputError(f"layer {spec.layer} {spec.role.value}: page {s} -> decode page {d} is outside "
                                     f"the pools ({n_pages} pages) or negative")
                local.setdefault(key, []).append((base + s * st.page_bytes, st.page_bytes, local_dev))
                remote.setdefault(key, []).append((dst_ptr + d * st.page_bytes, st.page_bytes, dev))
                items.append(tensor[s])

        for i, spec in enumerate(lay.kv):
            table = req.tables[pools.storage(spec).table]
            n = min(len(table), num_pages)  # pages past the table hold no complete compressed entry yet
            add(spec, table[:n], peer.kv_ptrs[i], info.kv_pages[:n], peer.kv_mem_kinds[i])
        state_kind = self.state_memory  # SGLang does not announce it (see state_memory)
        comps = [c for c in (lay.swa_state, lay.request_state) if c]
        if len(info.state_indices) != len(comps):
            raise InputError(f"decode sent {len(info.state_indices)} state index lists, the layout has {len(comps)}")
        if lay.swa_state:
            swa_ids = info.state_indices[0]
            first = max(0, req.num_tokens - pools.model.sliding_window) // page
            src = req.tables[pools.storage(lay.swa_state[0]).table][first : first + len(swa_ids)]
            if len(src) != len(swa_ids) or first + len(swa_ids) != num_pages:
                raise InputError(f"decode sent {len(swa_ids)} SWA page ids; the window of {req.num_tokens} tokens "
                                 f"spans pages {first}..{num_pages - 1}")
            for j, spec in enumerate(lay.swa_state):
                add(spec, src, peer.state_ptrs[0][j], swa_ids, state_kind)
        if lay.request_state:
            slots = info.state_indices[1]
            if len(slots) > 1:
                raise InputError(f"decode sent {len(slots)} request-state slots, SGLang uses one")
            for j, spec in enumerate(lay.request_state):
                ring = req.tables[pools.storage(spec).table][:1]
                add(spec, ring if slots else [], peer.state_ptrs[1][j], slots, state_kind)
        digest = kv_digest(items)  # on the pools' device; sent when the decode registered the checksum row
        row = metadata_row(info.room, req.first_token, self.hidden_state_bytes,
                           digest if peer.kv_checksum else None)
        aux = np.frombuffer(b"".join(row), dtype=np.uint8)
        self._aux.numpy()[: aux.size] = aux
        aux_local, aux_remote, off = [], [], 0
        for ptr, b in zip(peer.aux_ptrs, row, strict=True):  # host memory on both ends (SGLang's send_aux)
            aux_local.append((self._aux_addr + off, len(b), 0))
            aux_remote.append((ptr + info.aux_index * len(b), len(b), 0))
            off += len(b)
        if self.max_rate is None:  # every write at once, the metadata row with the host-memory ones
            local.setdefault(("DRAM", "DRAM"), []).extend(aux_local)
            remote.setdefault(("DRAM", "DRAM"), []).extend(aux_remote)
            steps = [[(key, local[key], remote[key]) for key in local]]
            return self._write(info, peer.nixl_name, steps), digest, peer.kv_checksum
        # paced: chunks of a tenth of a second's bytes (at least one page), each waited for; the row last
        chunk = max(1, int(self.max_rate / 10))
        steps = []
        for key in local:
            start, size = 0, 0
            for j, (_, n, _) in enumerate(local[key]):
                size += n
                if size >= chunk or j == len(local[key]) - 1:
                    steps.append([(key, local[key][start : j + 1], remote[key][start : j + 1])])
                    start, size = j + 1, 0
        steps.append([(("DRAM", "DRAM"), aux_local, aux_remote)])
        return self._write(info, peer.nixl_name, steps), digest, peer.kv_checksum

    def _write(self, info: TransferInfo, nixl_name: str, steps: list[list[tuple[tuple[str, str], list, list]]]
               ) -> int:
        """Post each step's writes (one NIXL transfer per (remote, local) memory kind), wait for them, then
        (``max_rate``) sleep until the bytes so far took their share of the rate; returns the bytes written."""
        assert self._agent is not None
        total, t0 = 0, time.monotonic()
        for step in steps:
            xids = []
            for key, loc_list, rem_list in step:
                xid = uuid.uuid4().int & (2**62 - 1)
                loc = np.array(loc_list, dtype=np.uint64).reshape(-1, 3)
                rem = np.array(rem_list, dtype=np.uint64).reshape(-1, 3)
                self._agent.call("posting the NIXL write", "write", xid, loc, rem, nixl_name, b"", *key)
                xids.append(xid)
                total += int(loc[:, 1].sum())
            for xid in xids:
                state = self._agent.call("waiting for the NIXL write", "wait", xid, self.timeout,
                                         timeout=self.timeout + 10)
                if state != "DONE":
                    raise TransferError(f"NIXL write to decode agent {info.agent_name} ended {state}")
            if self.max_rate is not None:
                time.sleep(max(0.0, t0 + total / self.max_rate - time.monotonic()))
        return total
