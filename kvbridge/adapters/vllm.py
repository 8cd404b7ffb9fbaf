"""kvbridge as a vLLM KV connector (vLLM 0.33.0, v1 connector API with the hybrid allocator).

vLLM loads it by module path::

    --kv-transfer-config '{"kv_connector": "KVBridgeConnector",
                           "kv_connector_module_path": "kvbridge.adapters.vllm",
                           "kv_role": "kv_consumer", "kv_connector_extra_config": {"listen": "0.0.0.0:7300"}}'

(``kvbridge vllm-config`` prints this JSON; docs/adapters.md lists every ``kv_connector_extra_config``
key and the supported matrix.)

Per request, ``kv_transfer_params``:

- consumer (decode): ``kvbridge_src`` (the prefill's engine spec, e.g. ``trtllm:fp8``),
  ``kvbridge_request_id`` (the id the producer sends under) and optionally ``kvbridge_num_tokens``
  (default: the prompt length). The scheduler reports those tokens as loaded asynchronously;
  the worker receives the request (verified, converted to this vLLM's layout) and writes it
  through the request's block ids of each KV-cache group, never whole tensors.
- producer (prefill): ``kvbridge_peer`` (``host:port`` of a kvbridge receiver: ``kvbridge migrate
  serve``, another vLLM's connector, ...), ``kvbridge_dst`` (its engine spec) and optionally
  ``kvbridge_request_id``. When the request finishes, its blocks of every group stay held until
  the worker has sent them.
- producer with transport ``sglang`` (the prefill of an unmodified SGLang 0.5.23 decode): ``bootstrap_room``
  (the room the decode's request carries, as SGLang's router sets both). The request must be a prefill
  (``max_tokens`` 1): its prompt's KV and its first sampled token (the decode's metadata row) are converted
  into SGLang-layout pools in host memory and served by ``SGLangPrefillPeer`` (SGLang's PD protocol: the
  bootstrap route or a registration with an SGLang bootstrap server, ZMQ, NIXL writes); the send is done,
  and vLLM's blocks freed, once the decode has received the room (or it failed: no decode asked within
  ``timeout``, a decode refused, a NIXL write failed).

- consumer with transport ``sglang`` (the decode of an unmodified SGLang 0.5.23 prefill): ``bootstrap_host``,
  ``bootstrap_port`` and ``bootstrap_room`` (the prefill's bootstrap server and the room, the fields SGLang's
  router sets on both ends of a PD request) and optionally ``kvbridge_num_tokens``. The worker's
  ``SGLangDecodePeer`` (SGLang's decode side of the PD protocol: bootstrap, registration, page ids over ZMQ,
  the prefill's NIXL writes, the heartbeat) lands the request in SGLang-layout pools on vLLM's device (CUDA
  memory registered as VRAM where vLLM's caches are on CUDA, host memory on CPU), checks it (room in the
  metadata row, state rows, page size, layout), converts it on that device and writes it through the
  request's block ids, then frees the landing pages. A request vLLM holds whole in its prefix cache (its
  ``kvbridge_num_tokens`` within the hit: any shorter hit leaves the window's SWA tokens to move) is declined
  to its prefill (``SGLangDecodePeer.decline``: SGLang's dummy page ids), which then concludes the room
  Success without a write instead of holding it until its bootstrap timeout; nothing is claimed or written.

Requests are independent: loads are keyed by kvbridge request id (``vllm_requests.RequestTable``),
any number wait at once and producers connect in any order; over gloo up to ``max_inflight``
requests are received at once, over NIXL one at a time in the order producers connect. Sends run
on up to ``max_inflight`` threads. vLLM learns of finished and failed transfers through
``get_transfer_results``: a failed receive (producer gone, checksum mismatch, refused plan,
aborted) writes nothing and is reported in ``failed_recving``, so ``kv_load_failure_policy``
applies (DeepSeek-V4 has several KV-cache groups, where vLLM refuses block-level load errors).
A request aborted while it waits cancels its load; its blocks are released once no transfer
thread can write them. A failed send is logged as failed and counted in the connector's stats;
its blocks are released (vLLM has no failed-send state). Everything runs in threads of the
worker process (vLLM's multiprocess executor runs daemonic workers).

Tensor parallel: DeepSeek-V4's caches (compressed KV, SWA KV, indexer keys, compressor states) are
replicated on every TP rank (vLLM's cache specs say ``max_tp_shards=1``), so each rank's worker moves
the whole request on its own: rank r of a consumer listens on ``listen``'s port + r, rank r of a
producer sends to ``kvbridge_peer``'s port + r, and both ends' TP sizes must match (a sender at
another rank or size is refused at the handshake, before any block is written). vLLM reports a
transfer finished once every rank did (its ``KVOutputAggregator``); it fails if any rank's failed.
"""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import torch
from vllm.distributed import get_tensor_model_parallel_rank, get_tensor_model_parallel_world_size
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
    SupportsHMA,
)
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats
from vllm.transformers_utils.repo_utils import get_hf_file_to_dict

from kvbridge.adapters.sglang import SGLangPrefillPeer
from kvbridge.adapters.sglang_decode import SGLangDecodePeer, landing_pages
from kvbridge.adapters.sglang_protocol import HIDDEN_STATE_BYTES
from kvbridge.adapters.vllm_config import (
    CONVERT_SIDES,
    TRANSPORTS,
    ape_paths,
    check_sglang_keys,
    connector_mtp,
    connector_profile,
    device_gpu_family,
    host_port,
    positive_int,
    sglang_source,
)
from kvbridge.adapters.vllm_layout import VllmCaches, ready_event
from kvbridge.adapters.vllm_requests import Pending, RequestTable
from kvbridge.engines.profiles import parse_engine
from kvbridge.engines.topology import from_hf_config, get_model
from kvbridge.errors import InputError
from kvbridge.migration.ape import ApeWeights, load_ape
from kvbridge.migration.errors import TransferError
from kvbridge.migration.execute import pack
from kvbridge.migration.nixl import NixlReceiver, NixlSender
from kvbridge.migration.plan import ape_needed, plan_migration
from kvbridge.migration.pools import EnginePools
from kvbridge.migration.transport import GlooServer, send_request_tcp

log = logging.getLogger("kvbridge.vllm")

#: Seconds a transfer thread waits for a producer before it looks at its stop flag again.
ACCEPT_POLL_S = 0.5


@dataclass
class Load:
    """One request the worker receives: its kvbridge source, size and block ids per KV-cache group, its
    prefix-cache hit: the ``computed_tokens`` vLLM holds itself and, per group, the ids of their ``cached``
    blocks (neither received into nor written), and (transport ``sglang``) the SGLang prefill's bootstrap
    ``host:port`` and the request's ``room``."""

    req_id: str
    request_id: str
    src: str
    num_tokens: int
    block_ids: tuple[list[int], ...]
    computed_tokens: int = 0
    cached: tuple[list[int], ...] = ()
    bootstrap: str = ""
    room: int = 0


@dataclass
class Send:
    """One finished request the worker sends to a kvbridge peer (transport ``sglang``: serves to the SGLang
    decode that asks for ``room``, with ``first_token``, the token vLLM sampled, in its metadata row)."""

    req_id: str
    request_id: str
    peer: str
    dst: str
    num_tokens: int
    block_ids: tuple[list[int], ...]
    room: int = 0
    first_token: int = 0


@dataclass
class KVBridgeMetadata(KVConnectorMetadata):
    """One step's loads and sends, the vLLM request ids whose loads are cancelled (aborted or finished
    while they waited), the kvbridge request ids vLLM found whole in its prefix cache (their producers
    are refused) and, transport ``sglang``, those requests' SGLang prefills and rooms (bootstrap
    ``host:port``, room: each prefill is told the decode needs nothing of the room)."""

    loads: list[Load] = field(default_factory=list)
    sends: list[Send] = field(default_factory=list)
    cancels: list[str] = field(default_factory=list)
    cached_whole: list[str] = field(default_factory=list)
    declines: list[tuple[str, int]] = field(default_factory=list)


@dataclass
class KVBridgeStats(KVConnectorStats):
    """Per-request transfer observations of one interval (vLLM's ``KVConnectorStats``): ``data`` maps
    ``recv`` and ``send`` to lists of ``[seconds, payload bytes, conversion seconds, bytes written]`` of the
    requests that completed (bytes written: into vLLM's blocks, less than the payload's converted size by a
    prefix-cache hit; for a send, the payload), and ``recv_failed`` / ``send_failed`` to the number that
    failed."""

    def __post_init__(self):
        for key in ("recv", "send"):
            self.data.setdefault(key, [])
        for key in ("recv_failed", "send_failed"):
            self.data.setdefault(key, 0)

    def reset(self):
        self.data = {"recv": [], "send": [], "recv_failed": 0, "send_failed": 0}

    def observe(self, kind: str, seconds: float, nbytes: int, convert_s: float, written: int) -> None:
        self.data[kind].append([seconds, nbytes, convert_s, written])

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        for key in ("recv", "send"):
            self.data[key] = self.data[key] + list(other.data.get(key, []))
        for key in ("recv_failed", "send_failed"):
            self.data[key] += int(other.data.get(key, 0))
        return self

    def reduce(self) -> dict[str, int | float]:
        out: dict[str, int | float] = {}
        for key in ("recv", "send"):
            rows = self.data[key]
            secs = sum(r[0] for r in rows)
            nbytes = sum(r[1] for r in rows)
            out[f"{key}_requests"] = len(rows)
            out[f"{key}_failed"] = self.data[f"{key}_failed"]
            out[f"{key}_MB"] = round(nbytes / 1e6, 3)
            out[f"{key}_written_MB"] = round(sum(r[3] for r in rows) / 1e6, 3)
            out[f"{key}_avg_s"] = round(secs / len(rows), 4) if rows else 0.0
            out[f"{key}_convert_s"] = round(sum(r[2] for r in rows), 4)
            out[f"{key}_MB_per_s"] = round(nbytes / 1e6 / secs, 1) if secs > 0 else 0.0
        return out

    def is_empty(self) -> bool:
        return not (self.data["recv"] or self.data["send"] or self.data["recv_failed"] or self.data["send_failed"])


def _one_line(exc: BaseException) -> str:
    return " ".join(str(exc).split()) or type(exc).__name__


def connector_model(vllm_config, given: str | None):
    """The kvbridge model: ``given`` (a preset name or a ``config.json`` path), else the served model's
    ``config.json`` found the way vLLM finds it (a local directory or a Hugging Face repo id alike), named
    after its ``model_type``: two ends are matched on its shapes, not on a directory name."""
    if given:
        return get_model(given)
    mc = vllm_config.model_config
    where = getattr(mc, "hf_config_path", None) or mc.model
    data = get_hf_file_to_dict("config.json", where, getattr(mc, "revision", None))
    if not isinstance(data, dict):
        raise InputError(f"vLLM found no config.json for model {where!r}; give kv_connector_extra_config model "
                         "(a config.json path or a kvbridge preset)")
    return from_hf_config(data, name=str(data.get("model_type") or "deepseek_v4"))


class KVBridgeConnector(KVConnectorBase_V1, SupportsHMA):
    """See the module docstring: both roles, every DeepSeek-V4 KV-cache group."""

    def __init__(self, vllm_config, role: KVConnectorRole, kv_cache_config=None):
        super().__init__(vllm_config, role, kv_cache_config)
        extra = dict(self._kv_transfer_config.kv_connector_extra_config or {})
        parallel = vllm_config.parallel_config
        if parallel.pipeline_parallel_size != 1:
            raise InputError(f"KVBridgeConnector supports pipeline parallel size 1, this vLLM runs "
                             f"{parallel.pipeline_parallel_size}; serve with -pp 1 (docs/adapters.md)")
        self.is_consumer = self._kv_transfer_config.is_kv_consumer
        self.is_producer = self._kv_transfer_config.is_kv_producer
        size = parallel.tensor_parallel_size
        host, port = host_port(extra.get("listen", "127.0.0.1:0"), "kv_connector_extra_config listen")
        if self.is_consumer and size > 1 and not 0 < port <= 65536 - size:
            raise InputError(f"kv_connector_extra_config listen: at tensor parallel size {size} rank r listens on "
                             f"its port + r, so give a fixed port of 1..{65536 - size} (got {port}: producers "
                             "could not find the ranks' ports)")
        #: This worker's tensor-parallel (rank, size); the scheduler side's rank is 0.
        self.tp = self._tp_position(role, size)
        self.model = connector_model(vllm_config, extra.get("model"))
        #: Whether requests move with the MTP layers' caches (vLLM serves with the model's MTP draft).
        self.include_mtp = connector_mtp(vllm_config.speculative_config, self.model)
        gpu = device_gpu_family() if role == KVConnectorRole.WORKER else None
        self.profile = connector_profile(extra.get("engine"), vllm_config.cache_config.block_size, gpu)
        self.timeout = extra.get("timeout", 120.0)
        self.convert_on = extra.get("convert_on", "receiver")
        if self.convert_on not in CONVERT_SIDES or isinstance(self.timeout, bool) or \
                not isinstance(self.timeout, (int, float)) or not self.timeout > 0:
            raise InputError(f"kv_connector_extra_config: convert_on must be sender or receiver and timeout positive, "
                             f"got {self.convert_on!r}, {self.timeout}")
        self.transport = extra.get("transport", "gloo")
        if self.transport not in TRANSPORTS:
            raise InputError(f"kv_connector_extra_config: transport must be gloo or nixl (or sglang: SGLang's PD "
                             f"protocol, to an SGLang decode or from an SGLang prefill), got {self.transport!r}")
        check_sglang_keys(self._kv_transfer_config.kv_role, self.transport, extra)
        if self.transport == "sglang":
            if size > 1:
                raise InputError(f"transport sglang runs at tensor parallel size 1 (kvbridge's SGLang PD peers are "
                                 f"one attention rank), this vLLM runs {size}; serve with -tp 1")
            if self.include_mtp:
                raise InputError("transport sglang moves no MTP layers' caches (kvbridge's SGLang PD peers); serve "
                                 "without the MTP draft")
        #: The SGLang decode's (producer) or prefill's (consumer) pools (transport sglang).
        self.sglang_profile = parse_engine(str(extra.get("sglang_engine", "sglang")))
        self.max_inflight = positive_int(extra.get("max_inflight", 4), "kv_connector_extra_config max_inflight")
        hold = extra.get("hold_timeout", 10.0)
        if isinstance(hold, bool) or not isinstance(hold, (int, float)) or hold < 0:
            raise InputError(f"kv_connector_extra_config: hold_timeout must be a number of seconds >= 0, got {hold!r}")
        ape = extra.get("ape")
        paths = None if ape is None else ape_paths(ape)
        #: The model's APE weights (worker side, read once), for pairs with SGLang pools.
        self.ape: ApeWeights | None = None
        if paths is not None and role == KVConnectorRole.WORKER:
            self.ape = load_ape(paths, self.model, ape_needed(parse_engine("sglang"), self.profile, self.model,
                                                             self.include_mtp))
        # scheduler side
        self._loads: dict[str, Load] = {}
        self._sends: dict[str, Send] = {}
        self._cancels: list[str] = []
        self._cached_whole: list[str] = []
        self._declines: list[tuple[str, int]] = []
        self._hits: dict[str, int] = {}  # vLLM request id: its (block-aligned) local prefix-cache hit, in tokens
        self._loading: set[str] = set()  # requests whose load is out with the worker, not reported yet
        self._offered: set[str] = set()  # requests whose tokens were offered as external once
        # worker side
        self.caches: VllmCaches | None = None
        self.table = RequestTable(float(hold), self.max_inflight)
        self._lock = threading.Lock()
        self._done_send: set[str] = set()
        self._stats = KVBridgeStats()
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._local = threading.local()  # per transfer thread: the load and plan of the request it receives
        self._send_pool: ThreadPoolExecutor | None = None
        self.errors: list[str] = []  # one line per failed transfer, also logged
        self.server = None
        self._senders: dict[str, Any] = {}  # NIXL senders by peer
        self._senders_lock = threading.Lock()
        self.sglang_peer: SGLangPrefillPeer | None = None
        #: The decode peer of SGLang prefills (consumer, transport sglang), started with the KV caches' device.
        self.sglang_decode: SGLangDecodePeer | None = None
        self._recv_pool: ThreadPoolExecutor | None = None
        if role == KVConnectorRole.WORKER and self.transport == "sglang" and self.is_producer:
            self.sglang_peer = self._sglang_peer(extra, vllm_config.model_config.max_model_len)
            log.info("kvbridge connector serving SGLang decodes, bootstrap %s (%s)", self.sglang_peer.bootstrap_addr,
                     self.sglang_profile.spec)
        elif self.transport == "sglang":
            self.landing_tokens = positive_int(extra.get("landing_tokens", vllm_config.model_config.max_model_len),
                                               "kv_connector_extra_config landing_tokens")
            if role == KVConnectorRole.WORKER and self.ape is None and \
                    ape_needed(self.sglang_profile, self.profile, self.model, False):
                raise InputError(f"transport sglang: {self.sglang_profile.spec} stores compressor scores without the "
                                 "APE vLLM's include; give kv_connector_extra_config ape (the model's safetensors "
                                 "holding layers.N.attn[.indexer].compressor.ape)")
        if role == KVConnectorRole.WORKER and self.is_consumer and self.transport != "sglang":
            port += self.tp[0]
            if self.transport == "nixl":
                self.server = self._nixl_receiver(extra.get("landing_tokens", vllm_config.model_config.max_model_len),
                                                  host, port)
            else:
                self.server = GlooServer(EnginePools(self.profile, self.model, self.include_mtp, {}),
                                         plan=self._plan_for, host=host, port=port, computed=self._computed,
                                         tp=self.tp)
            log.info("kvbridge connector listening on %s:%d (%s, tensor parallel rank %d of %d)",
                     *self.server.address, self.transport, *self.tp)

    @staticmethod
    def _tp_position(role: KVConnectorRole, size: int) -> tuple[int, int]:
        """(rank, size) of this connector in vLLM's tensor-parallel group (a worker asks vLLM's group, which
        vLLM forms before its connector; the scheduler side runs once, as rank 0)."""
        if size == 1 or role != KVConnectorRole.WORKER:
            return 0, size
        rank, world = get_tensor_model_parallel_rank(), get_tensor_model_parallel_world_size()
        if world != size:
            raise InputError(f"vLLM's tensor-parallel group has {world} ranks, its config says {size}")
        return rank, size

    def _held_pages(self, dst, tokens: int) -> dict[str, int]:
        """The most pages a request of up to ``tokens`` tokens holds per block table of ``dst`` pools: the SWA
        window and the state rings take more or fewer pages with the length's phase in a block, so the most
        over the last two blocks."""
        block = int(next(c.value for c in self.profile.choices if c.option == "block"))
        held: dict[str, int] = {}
        for n in range(max(1, tokens - 2 * block + 1), tokens + 1):
            for name, pages in plan_migration(self.profile, dst, self.model, n, include_mtp=self.include_mtp,
                                              ape=self.ape).held_pages("dst").items():
                held[name] = max(held.get(name, 0), pages)
        return held

    def _sglang_peer(self, extra: dict, max_model_len: int) -> SGLangPrefillPeer:
        """The SGLang prefill peer this producer serves from: SGLang-layout pools in host memory holding
        ``max_inflight`` requests of up to ``landing_tokens`` tokens (default ``max_model_len``), its bootstrap
        route on ``bootstrap`` (default 127.0.0.1:8998, SGLang's port) or registered ``register_with``, its writes
        paced at ``max_send_rate`` bytes per second where given."""
        tokens = positive_int(extra.get("landing_tokens", max_model_len), "kv_connector_extra_config landing_tokens")
        if self.ape is None and ape_needed(self.profile, self.sglang_profile, self.model, False):
            raise InputError(f"transport sglang: {self.sglang_profile.spec} stores compressor scores without the APE "
                             "vLLM's include; give kv_connector_extra_config ape (the model's safetensors holding "
                             "layers.N.attn[.indexer].compressor.ape)")
        held = {k: v * self.max_inflight for k, v in self._held_pages(self.sglang_profile, tokens).items()}
        pools = EnginePools.create(self.sglang_profile, self.model, held, include_mtp=False)
        self.landing_tokens = tokens
        if "register_with" in extra:
            host, where = "127.0.0.1", {"bootstrap_port": None, "register_with": str(extra["register_with"])}
        else:
            host, port = host_port(extra.get("bootstrap", "127.0.0.1:8998"), "kv_connector_extra_config bootstrap")
            where = {"bootstrap_port": port}
        hidden = positive_int(extra.get("hidden_state_bytes", HIDDEN_STATE_BYTES),
                              "kv_connector_extra_config hidden_state_bytes")
        rate = extra.get("max_send_rate")
        if rate is not None:
            rate = positive_int(rate, "kv_connector_extra_config max_send_rate")
        return SGLangPrefillPeer(pools, host=host, hidden_state_bytes=hidden, timeout=self.timeout, max_rate=rate,
                                 kv_cache_dtype=str(extra.get("kv_cache_dtype", "fp8_e4m3")),
                                 state_memory=str(extra.get("state_memory", "VRAM")), **where).start()

    def _nixl_receiver(self, landing_tokens: Any, host: str, port: int):
        """A NIXL receiver whose pools are the landing area: one request of ``landing_tokens`` tokens in this
        vLLM's layout, in host memory (kvbridge's NIXL registers host memory only)."""
        landing_tokens = positive_int(landing_tokens, "kv_connector_extra_config landing_tokens")
        held = self._held_pages(self.profile, landing_tokens)
        landing = EnginePools.create(self.profile, self.model, held, include_mtp=self.include_mtp)
        self.landing_tokens = landing_tokens
        return NixlReceiver(landing, plan=self._plan_for, host=host, port=port, loss_report=False,
                            computed=self._computed, tp=self.tp)

    # ------------------------------------------------------------------ scheduler side

    def get_num_new_matched_tokens(self, request, num_computed_tokens: int) -> tuple[int | None, bool]:
        """The prompt tokens a kvbridge producer sends beyond vLLM's own prefix-cache hit
        (``num_computed_tokens``), loaded asynchronously; none for a request that was loaded (or failed to
        load) once already: a producer sends a request once, so vLLM computes what a preemption or a failed
        load lost. A request vLLM holds whole refuses its producer (transport ``sglang``: its prefill is
        told the decode needs nothing of the room, ``SGLangDecodePeer.decline``)."""
        params = request.kv_transfer_params or {}
        if not self.is_consumer or request.request_id in self._offered or not self._wants_load(request):
            return 0, False
        n = self._num_tokens(request)
        if 0 < n <= num_computed_tokens:
            self._offered.add(request.request_id)
            self._cached_whole.append(self._load_id(request, params))
            if self.transport == "sglang":
                self._declines.append(sglang_source(params))
            return 0, False
        self._hits[request.request_id] = num_computed_tokens
        return max(0, n - num_computed_tokens), n > num_computed_tokens

    def _wants_load(self, request) -> bool:
        """Whether ``request`` is loaded from a producer: its ``kv_transfer_params`` name a kvbridge source
        (``kvbridge_src``) or, transport ``sglang``, an SGLang prefill's room; a room vLLM cannot take is logged
        and read as none (vLLM computes the prompt) rather than raised in vLLM's scheduler."""
        params = request.kv_transfer_params or {}
        if self.transport != "sglang":
            return "kvbridge_src" in params
        if "bootstrap_room" not in params:
            return False
        try:
            sglang_source(params)
        except InputError as exc:
            log.error("kvbridge: request %s: %s; vLLM computes the prompt itself", request.request_id, exc)
            return False
        return True

    def _load_id(self, request, params: dict) -> str:
        """The kvbridge request id a load waits under: ``kvbridge_request_id``, else vLLM's request id (an SGLang
        prefill's room names it: ``sglang-room-<room>``)."""
        if "kvbridge_request_id" in params:
            return str(params["kvbridge_request_id"])
        return f"sglang-room-{params['bootstrap_room']}" if self.transport == "sglang" else request.request_id

    def _num_tokens(self, request) -> int:
        """``kvbridge_num_tokens`` (default the prompt length); a value vLLM cannot take is logged and read as
        0 (vLLM computes the prompt) rather than raised in vLLM's scheduler."""
        prompt = len(request.prompt_token_ids)
        raw = (request.kv_transfer_params or {}).get("kvbridge_num_tokens", prompt)
        if isinstance(raw, bool) or not isinstance(raw, int) or not 0 < raw <= prompt:
            log.error("kvbridge: request %s: kvbridge_num_tokens must be an integer in 1..%d (the prompt), got %r; "
                      "vLLM computes the prompt itself", request.request_id, prompt, raw)
            return 0
        return raw

    def update_state_after_alloc(self, request, blocks, num_external_tokens: int):
        """A request whose load is under way: its blocks per group, and those of its prefix-cache hit (the
        blocks vLLM has a hash for, as its own NixlConnector tells them apart: not received, not written)."""
        params = request.kv_transfer_params or {}
        computed = self._hits.pop(request.request_id, 0)
        if num_external_tokens <= 0 or not self._wants_load(request):
            return
        self._offered.add(request.request_id)  # blocks are allocated: this request's load is under way
        self._loading.add(request.request_id)
        n = self._num_tokens(request)
        cached = tuple([b.block_id for b in group if b.block_hash is not None and not b.is_null]
                       for group in blocks.blocks)
        bootstrap, room = sglang_source(params) if self.transport == "sglang" else ("", 0)
        src = self.sglang_profile.spec if self.transport == "sglang" else str(params["kvbridge_src"])
        self._loads[request.request_id] = Load(request.request_id, self._load_id(request, params), src, n,
                                               tuple(list(ids) for ids in blocks.get_block_ids()), computed, cached,
                                               bootstrap, room)

    def build_connector_meta(self, scheduler_output) -> KVBridgeMetadata:
        meta = KVBridgeMetadata(list(self._loads.values()), list(self._sends.values()), self._cancels,
                                self._cached_whole, self._declines)
        self._loads.clear()
        self._sends.clear()
        self._cancels, self._cached_whole, self._declines = [], [], []
        return meta

    def update_connector_output(self, connector_output) -> None:
        """A load the worker reported (received, failed or released) is no longer cancellable."""
        self._loading.difference_update(connector_output.finished_recving or ())

    def get_loaded_kv_cache_group_ids(self, request) -> tuple[int, ...]:
        """A kvbridge load restores the request's blocks of every group."""
        return tuple(range(len(self._kv_cache_config.kv_cache_groups)))

    def request_finished(self, request, block_ids):
        raise InputError("KVBridgeConnector needs vLLM's hybrid allocator (request_finished_all_groups)")

    def request_finished_all_groups(self, request, block_ids: tuple[list[int], ...]
                                    ) -> tuple[bool, dict[str, Any] | None]:
        """Consumer: a request finished or aborted while its load is out cancels the load (vLLM keeps its
        blocks until the worker reports it). Producer: hand a finished request's blocks of every group to
        the worker for its kvbridge peer; the blocks stay held until the worker reports the send done."""
        self._offered.discard(request.request_id)
        self._hits.pop(request.request_id, None)
        if request.request_id in self._loading:
            self._loading.discard(request.request_id)
            self._cancels.append(request.request_id)  # after its load in the same metadata, if not out yet
            return False, None
        params = request.kv_transfer_params or {}
        if self.is_producer and self.transport == "sglang" and "bootstrap_room" in params:
            return self._sglang_send(request, params, block_ids)
        if not self.is_producer or "kvbridge_peer" not in params:
            return False, None
        rid = str(params.get("kvbridge_request_id", request.request_id))
        n = request.num_computed_tokens
        self._sends[request.request_id] = Send(request.request_id, rid, str(params["kvbridge_peer"]),
                                               str(params.get("kvbridge_dst", "vllm")), n,
                                               tuple(list(ids) for ids in block_ids))
        return True, {"kvbridge_src": self.profile.spec, "kvbridge_request_id": rid, "kvbridge_num_tokens": n}

    def _sglang_send(self, request, params: dict, block_ids: tuple[list[int], ...]
                     ) -> tuple[bool, dict[str, Any] | None]:
        """A finished prefill for the SGLang decode asking for its ``bootstrap_room``: its prompt's blocks and
        first sampled token to the worker. One that cannot be served (a malformed room, not a finished one-token
        prefill) is logged and not sent (raised in vLLM's scheduler it would stop the engine)."""
        room, n = params["bootstrap_room"], len(request.prompt_token_ids)
        why = None
        if isinstance(room, bool) or not isinstance(room, int) or not 0 < room < 2**63:
            why = f"bootstrap_room must be a positive 63-bit integer, got {room!r:.40}"
        elif not request.output_token_ids or request.num_computed_tokens != n:
            why = (f"not a finished prefill (computed {request.num_computed_tokens} of {n} prompt tokens, "
                   f"{len(request.output_token_ids)} sampled); serve SGLang's decode from requests of max_tokens 1")
        if why is not None:
            log.error("kvbridge: request %s: not served to SGLang: %s", request.request_id, why)
            return False, None
        rid = str(params.get("kvbridge_request_id", request.request_id))
        self._sends[request.request_id] = Send(request.request_id, rid, f"SGLang room {room}",
                                               self.sglang_profile.spec, n, tuple(list(ids) for ids in block_ids),
                                               room=room, first_token=int(request.output_token_ids[0]))
        return True, {"kvbridge_src": self.profile.spec, "kvbridge_request_id": rid, "kvbridge_num_tokens": n,
                      "bootstrap_room": room}

    # ------------------------------------------------------------------ worker side

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]):
        groups = self._kv_cache_config.kv_cache_groups
        pages = {}
        for g in groups:
            specs = getattr(g.kv_cache_spec, "kv_cache_specs", None)
            for name in g.layer_names:
                pages[name] = (specs[name] if specs is not None else g.kv_cache_spec).page_size_bytes
        self.caches = VllmCaches(self.profile, self.model, kv_caches, [g.layer_names for g in groups], pages,
                                 include_mtp=self.include_mtp)
        if self.is_consumer and self.transport == "sglang" and self.sglang_decode is None:
            self.sglang_decode = self._sglang_decode_peer(self.caches.device)
            log.info("kvbridge connector receiving from SGLang prefills (%s, landing pools on %s)",
                     self.sglang_profile.spec, self.caches.device)

    def _sglang_decode_peer(self, device: torch.device) -> SGLangDecodePeer:
        """The decode peer of SGLang prefills: SGLang-layout landing pools on vLLM's ``device`` (the prefill
        writes its compressor state as GPU memory: on CUDA they are CUDA memory, registered as VRAM) holding
        ``max_inflight`` requests of up to ``landing_tokens`` tokens at once."""
        held = {k: v * self.max_inflight for k, v in landing_pages(self.sglang_profile, self.model,
                                                                    self.landing_tokens).items()}
        pools = EnginePools.create(self.sglang_profile, self.model, held, include_mtp=False)
        if device.type != "cpu":
            pools = EnginePools.wrap(pools.profile, pools.model, {key: pool.to(device) for key, pool in
                                                                  pools.pools.items()}, include_mtp=False)
        return SGLangDecodePeer(pools, timeout=self.timeout, aux_rows=self.max_inflight).start()

    def _plan(self, info: dict):
        if bool(info.get("include_mtp", False)) != self.include_mtp:
            sends, serves = (("no MTP layer caches", "with its MTP draft, whose layers would stay unfilled")
                             if self.include_mtp else ("the MTP layers' caches", "without an MTP draft"))
            raise InputError(f"the producer sends {sends}, but this vLLM serves {serves}: plan the producer's "
                             f"request with include_mtp={self.include_mtp}")
        return plan_migration(info["src"], self.profile, self.model, int(info["num_tokens"]),
                              draft_tokens=int(info.get("draft_tokens", 0)), include_mtp=self.include_mtp,
                              ape=self.ape)

    def _check_sender(self, plan, load: Load) -> None:
        if plan.src.spec != parse_engine(load.src).spec or plan.num_tokens != load.num_tokens:
            raise InputError(f"the producer sent {plan.src.spec}, {plan.num_tokens} tokens; vLLM expects "
                             f"{parse_engine(load.src).spec}, {load.num_tokens}")

    def _plan_for(self, info: dict):
        """The receiver's plan for a producer (called on its transfer thread before anything moves): the
        load waiting under its request id (``RequestTable.claim``: held a while if none is yet), checked
        against what the producer sends and the load's blocks; ``InputError`` refuses it."""
        caches = self.caches
        if caches is None:
            raise InputError("this vLLM has not registered its KV caches yet")
        p = self.table.claim(str(info.get("request_id", "")))
        self._local.pending = p
        plan = self._plan(info)
        self._check_sender(plan, p.load)
        if self.transport == "nixl" and plan.num_tokens > self.landing_tokens:
            raise InputError(f"{plan.num_tokens} tokens do not fit the NIXL landing area ({self.landing_tokens} "
                             "tokens: kv_connector_extra_config landing_tokens)")
        # vLLM's prefix-cache hit: its own bytes, maybe shared with running requests, are never written
        rest = plan.past(p.load.computed_tokens).transfers
        caches.check(rest, p.load.block_ids, keep=p.load.cached)
        self._local.plan, self._local.rest = plan, rest
        return plan

    def _computed(self) -> int:
        """The prefix-cache hit of the load this transfer thread receives (only the rest moves)."""
        return self._local.pending.load.computed_tokens

    def start_load_kv(self, forward_context, **kwargs: Any) -> None:
        """Hand this step's loads to the transfer threads and cancel the loads vLLM dropped; they are
        reported by ``get_transfer_results``. The SGLang prefills of requests vLLM holds whole are told
        it needs nothing of them (on the same threads: a bootstrap is HTTP)."""
        meta = self._get_connector_metadata()
        if not isinstance(meta, KVBridgeMetadata) or not (meta.loads or meta.cancels or meta.cached_whole
                                                          or meta.declines):
            return
        if self.caches is None or (self.server is None and self.sglang_decode is None):
            raise InputError("KVBridgeConnector: start_load_kv before register_kv_caches (or not a consumer)")
        if self.sglang_decode is not None:
            if self._recv_pool is None:
                self._recv_pool = ThreadPoolExecutor(self.max_inflight, thread_name_prefix="kvbridge-recv")
        else:
            self._start_receivers()
        for load in meta.loads:
            self.table.add(load, self.timeout)
            if self._recv_pool is not None:
                self._recv_pool.submit(self._receive_sglang, load)
        for req_id in meta.cancels:
            self.table.cancel(req_id)
        for rid in meta.cached_whole:
            self.table.forget(rid, "found whole in vLLM's prefix cache")
        for bootstrap, room in meta.declines:
            assert self._recv_pool is not None
            self._recv_pool.submit(self._decline_sglang, bootstrap, room)

    def _start_receivers(self) -> None:
        """The transfer threads (threads of this worker: vLLM's workers may be daemonic processes): over gloo
        ``max_inflight`` receive at once, over NIXL one (its landing area holds one request)."""
        if self._threads:
            return
        for k in range(self.max_inflight if self.transport == "gloo" else 1):
            thread = threading.Thread(target=self._serve, name=f"kvbridge-recv-{k}", daemon=True)
            thread.start()
            self._threads.append(thread)

    def _serve(self) -> None:
        """One transfer thread: receive whichever producer connects, into the load its request id names."""
        while not self._stop.is_set():
            self._local.pending = self._local.plan = self._local.rest = None
            t0 = time.monotonic()
            try:
                report = self._receive_one()
            except Exception as exc:  # reported to vLLM through failed_recving, never raised in its step
                self._ended(self._local.pending, _one_line(exc), None, t0)
                continue
            if report is not None:
                self._ended(self._local.pending, None, (report.payload_bytes, report.convert_s), t0)

    def _ended(self, p: Pending | None, error: str | None, report: tuple[int, float] | None, t0: float) -> None:
        """Report a receive to the table (and the stats: ``report`` is its payload bytes and conversion seconds)."""
        if p is None:  # refused before it named a load (unknown request, malformed, closed)
            if error is not None and not self._stop.is_set():
                log.warning("kvbridge: refused a producer: %s", error)
            return
        with self._lock:
            if error is None and not p.cancelled:
                written = sum(t.dst_bytes for t in self._local.rest)
                self._stats.observe("recv", time.monotonic() - t0, report[0], report[1], written)
            elif error is not None and not p.cancelled:
                self._stats.data["recv_failed"] += 1
        self.table.finish(p, error)

    def _receive_one(self):
        """Receive one request (None when no producer connected within ``ACCEPT_POLL_S``); its report. A request
        this side converts is written through its block ids as it is published (both transports); over NIXL, one
        the producer converted lands in the landing area's pages and is copied from there."""
        caches, server = self.caches, self.server
        assert caches is not None and server is not None

        def publish(assembly):
            p = self._local.pending
            if assembly.missing():
                raise InputError(f"{assembly.missing()} transfers never arrived")
            self.table.writing(p)
            caches.write(assembly.plan.transfers, assembly.records, p.load.block_ids, keep=p.load.cached)
            return {}

        got = server.receive(timeout=self.timeout, accept_timeout=ACCEPT_POLL_S, publish=publish)
        if got is None:
            return None
        if self.transport == "gloo":
            log.info("kvbridge: received request %s from %s", got[1], got[0])
            return got[3]
        if got.report.converted_on == "sender":  # verified in the landing area: copied through the block ids
            p, landing = self._local.pending, server.dst
            try:
                self.table.writing(p)
                caches.write_from(self._local.rest, landing, got.tables, p.load.block_ids, keep=p.load.cached)
            finally:
                landing.release(got.tables)
        log.info("kvbridge: received request %s from %s over NIXL", got.request_id, got.peer)
        return got.report

    def _receive_sglang(self, load: Load) -> None:
        """One load from an SGLang prefill (a thread of ``max_inflight``): planned first (a pair that cannot
        convert is refused before any page is claimed), received by the decode peer into its landing pools,
        converted on their device and written through the block ids beyond vLLM's prefix-cache hit; the landing
        pages are freed whatever happens."""
        self._local.pending = self._local.rest = None
        t0 = time.monotonic()
        try:
            p = self._local.pending = self.table.claim(load.request_id)
            self._ended(p, None, self._land_sglang(p), t0)
        except Exception as exc:  # reported to vLLM through failed_recving, never raised in its step
            self._ended(self._local.pending, _one_line(exc), None, t0)

    def _decline_sglang(self, bootstrap: str, room: int) -> None:
        """Tell the SGLang prefill at ``bootstrap`` that vLLM holds request ``room`` whole (nothing is received
        or written); one that cannot be told is an error line (it keeps the room until its bootstrap timeout)."""
        peer = self.sglang_decode
        try:
            if peer is None:
                raise InputError("the connector was shut down")
            peer.decline(bootstrap, room)
        except Exception as exc:  # logged, never raised in vLLM's step
            line = f"room {room}: could not tell the SGLang prefill at {bootstrap} that vLLM holds it whole: " \
                   f"{_one_line(exc)}"
            log.error("kvbridge: %s", line)
            with self._lock:
                self.errors.append(line)
            return
        log.info("kvbridge: room %d is whole in vLLM's prefix cache; declined to the SGLang prefill at %s", room,
                 bootstrap)

    def _land_sglang(self, p: Pending) -> tuple[int, float]:
        caches, peer, load = self.caches, self.sglang_decode, p.load
        if caches is None or peer is None:
            raise InputError("the connector was shut down")
        if load.num_tokens > self.landing_tokens:
            raise InputError(f"{load.num_tokens} tokens do not fit the SGLang landing pools ({self.landing_tokens} "
                             "tokens: kv_connector_extra_config landing_tokens)")
        plan = plan_migration(self.sglang_profile, self.profile, self.model, load.num_tokens, include_mtp=False,
                              ape=self.ape)
        rest = plan.past(load.computed_tokens)
        caches.check(rest.transfers, load.block_ids, keep=load.cached)
        self._local.rest = rest.transfers
        got = peer.receive(load.bootstrap, load.room, load.num_tokens)
        try:
            t1 = time.perf_counter()
            converted = pack(rest, peer.pools, got.tables, convert=True, loss_report=False, checksum=False)
            convert_s = time.perf_counter() - t1
            self.table.writing(p)
            caches.write(rest.transfers, converted.records, load.block_ids, keep=load.cached)
        finally:
            peer.release(got)
        log.info("kvbridge: received request %s (room %d) from the SGLang prefill at %s", load.request_id, load.room,
                 load.bootstrap)
        return got.bytes, convert_s

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Nothing to wait for: a request's pages are written whole, and on CUDA finished on the device
        (``device_order``), before it is reported to the scheduler, which only then schedules it again."""

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata, **kwargs: Any) -> None:
        """Nothing per layer: a finished request is sent whole from its blocks (``wait_for_save``)."""

    def wait_for_save(self):
        """Producer: hand this step's finished requests to the send threads (their blocks stay held until
        ``get_transfer_results`` reports them)."""
        if not self.has_connector_metadata():
            return
        meta = self._get_connector_metadata()
        if isinstance(meta, KVBridgeMetadata) and meta.sends:
            if self.caches is None:
                raise InputError("KVBridgeConnector: a send before register_kv_caches")
            if self._send_pool is None:
                self._send_pool = ThreadPoolExecutor(self.max_inflight, thread_name_prefix="kvbridge-send")
            ready = ready_event(self.caches.device)  # after this step's writes into the blocks being sent
            for send in meta.sends:
                self._send_pool.submit(self._send_reported, send, ready)

    def _send_reported(self, send: Send, ready: Any = None) -> None:
        t0 = time.monotonic()
        try:
            summary = self._send(send, ready)
        except Exception as exc:  # a failed send: logged, counted, its blocks released (vLLM has no failed send)
            line = f"request {send.request_id}: send to {send.peer} failed: {_one_line(exc)}"
            log.error("kvbridge: %s", line)
            with self._lock:
                self.errors.append(line)
                self._stats.data["send_failed"] += 1
                self._done_send.add(send.req_id)
            return
        log.info("kvbridge: sent request %s to %s over %s", send.request_id, send.peer, self.transport)
        with self._lock:
            nbytes = int(summary.get("payload_bytes", 0))
            self._stats.observe("send", time.monotonic() - t0, nbytes, float(summary.get("convert_s", 0.0)), nbytes)
            self._done_send.add(send.req_id)

    def _send(self, send: Send, ready: Any = None) -> dict:
        assert self.caches is not None
        plan = plan_migration(self.profile, send.dst, self.model, send.num_tokens, include_mtp=self.include_mtp,
                              ape=self.ape)
        pools, tables = self.caches.request_pools(plan, send.block_ids, ready)
        if self.transport == "sglang":
            return self._serve_sglang(send, plan, pools, tables)
        host, port = host_port(send.peer, "kvbridge_peer")
        port += self.tp[0]  # rank r sends to the consumer's rank r
        if self.transport == "nixl":
            with self._senders_lock:
                sender = self._senders.get(send.peer)
                if sender is None:
                    sender = self._senders[send.peer] = NixlSender(host, port, timeout=self.timeout)
                return sender.send_request(plan, pools, tables, convert_on=self.convert_on, loss_report=False,
                                           request_id=send.request_id, tp=self.tp)
        return send_request_tcp(plan, pools, tables, host=host, port=port, convert_on=self.convert_on,
                                timeout=self.timeout, request_id=send.request_id, tp=self.tp)

    def _serve_sglang(self, send: Send, plan, pools: EnginePools, tables) -> dict:
        """Convert the request into the SGLang peer's pools and serve its room until the decode received it
        (``TransferError`` when no decode asked within ``timeout`` or the decode failed it); its pages in the
        peer's pools are released once no write of them can still happen."""
        peer = self.sglang_peer
        assert peer is not None
        t0 = time.perf_counter()
        sg_tables = peer.add_migrated_request(send.room, plan, pools, tables, send.first_token)
        convert_s = time.perf_counter() - t0
        try:
            try:
                result = peer.wait(send.room, timeout=self.timeout)
            except TransferError:
                if peer.withdraw(send.room, f"no SGLang decode asked for room {send.room} within {self.timeout} s"):
                    raise TransferError(f"no SGLang decode asked for room {send.room} within {self.timeout} s; "
                                        "withdrawn") from None
                result = peer.wait(send.room, timeout=peer.timeout + 30)  # its writes are under way
        except TransferError:
            if not peer.withdraw(send.room, "withdrawn"):  # still writing: its pages stay out of use
                raise
            peer.release_pages(sg_tables)
            peer.forget(send.room)
            raise
        peer.release_pages(sg_tables)
        peer.forget(send.room)
        if result["status"] != "Success":
            raise TransferError(f"room {send.room}: {result.get('reason') or 'failed'}")
        return {"payload_bytes": result["bytes"], "convert_s": convert_s}

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        results = self.get_transfer_results(finished_req_ids)
        return results.finished_sending or None, results.finished_recving or None

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        """Requests sent, received and failed to receive since the last call (failed ones count as received,
        as vLLM wants: nothing of a failed request was written; cancelled ones as received only)."""
        done, failed = self.table.results()
        errors = [f"request {rid}: {error}" for _, rid, error, _ in self.table.take_outcomes() if error is not None]
        with self._lock:
            self.errors.extend(errors)
            sent, self._done_send = self._done_send, set()
        return KVConnectorTransferResults(sent, done, failed)

    def get_kv_connector_stats(self) -> KVBridgeStats | None:
        """This interval's per-request transfer times, bytes, conversion times and failures (then reset)."""
        with self._lock:
            if self._stats.is_empty():
                return None
            out, self._stats = self._stats, KVBridgeStats()
        return out

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KVBridgeStats | None:
        return KVBridgeStats(data=data) if data is not None else KVBridgeStats()

    def shutdown(self):
        self._stop.set()
        self.table.close()
        if self.sglang_decode is not None:  # its receives waiting on a prefill fail now
            self.sglang_decode.close()
            self.sglang_decode = None
        for thread in self._threads:
            thread.join(timeout=self.timeout)
        self._threads = []
        for attr in ("_send_pool", "_recv_pool"):
            pool = getattr(self, attr)
            if pool is not None:
                pool.shutdown(wait=True)
                setattr(self, attr, None)
        if self.server is not None:
            self.server.close()
            self.server = None
        for sender in self._senders.values():
            sender.close()
        self._senders.clear()
        if self.sglang_peer is not None:
            self.sglang_peer.close()
            self.sglang_peer = None


__all__ = ["KVBridgeConnector", "KVBridgeMetadata", "KVBridgeStats", "Load", "Send", "connector_model"]
