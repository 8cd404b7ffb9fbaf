"""kvbridge as a vLLM KV connector (vLLM 0.33.0, v1 connector API with the hybrid allocator).

vLLM loads it by module path::

    --kv-transfer-config '{"kv_connector": "KVBridgeConnector",
                           "kv_connector_module_path": "kvbridge.adapters.vllm",
                           "kv_role": "kv_consumer", "kv_connector_extra_config": {"listen": "0.0.0.0:7300"}}'

(``kvbridge vllm-config`` prints this JSON.) ``kv_connector_extra_config`` keys:

- ``model``: kvbridge model (preset name or ``config.json`` path); default the served model's
  ``config.json``;
- ``engine``: kvbridge engine spec of this vLLM's pools; default ``vllm:block=<--block-size>``
  (add ``:gpu=sm100`` / ``:idx=fp4`` / ``:kv=...`` to match the GPU and backend);
- ``listen`` (consumer): ``host:port`` where kvbridge producers send requests; default
  ``127.0.0.1:0`` (an ephemeral port, logged);
- ``timeout``: seconds one transfer may take (default 120);
- ``convert_on`` (producer): ``sender`` or ``receiver`` (default ``receiver``);
- ``transport``: ``gloo`` (default: a torch.distributed gloo pair per request) or ``nixl``
  (kvbridge's NIXL transport: one-sided writes into registered host memory, XXH3-64 checksums per
  page chunk). Both sides of a transfer must use the same one. A NIXL consumer lands each request
  in a host-memory area of its own (registered once, sized by ``landing_tokens``), then writes it
  through the request's block ids;
- ``landing_tokens`` (consumer, ``nixl``): the longest request that area holds (default the
  model's ``max_model_len``);
- ``ape``: a safetensors path, or a list of a checkpoint's shards, holding the model's compressor
  APE weights (``layers.N.attn[.indexer].compressor.ape``). Needed for requests from or to SGLang
  pools, which store compressor scores without the positional bias vLLM's include; read and
  checked once when the worker starts, and both ends of a transfer must hold the same weights.

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

Transfers run on one background thread per worker, one request at a time, so vLLM keeps
stepping its other requests meanwhile; vLLM learns of finished (and failed) transfers through
``get_transfer_results``. A failed receive (producer gone, checksum mismatch, wrong request,
refused plan) writes nothing and is reported failed: vLLM recomputes the prompt. Tensor
parallel size 1 (DeepSeek-V4's latent caches are not split across ranks).
"""

from __future__ import annotations

import logging
import queue
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
    SupportsHMA,
)

from kvbridge.adapters.vllm_config import CONVERT_SIDES, TRANSPORTS, ape_paths, host_port
from kvbridge.adapters.vllm_layout import VllmCaches
from kvbridge.engines.profiles import parse_engine
from kvbridge.engines.topology import get_model
from kvbridge.errors import InputError
from kvbridge.migration.ape import ApeWeights, load_ape
from kvbridge.migration.nixl import NixlReceiver, NixlSender
from kvbridge.migration.plan import ape_needed, plan_migration
from kvbridge.migration.pools import EnginePools, gather_records, table_of
from kvbridge.migration.transport import GlooServer, send_request_tcp

log = logging.getLogger("kvbridge.vllm")


@dataclass
class Load:
    """One request the worker receives: its kvbridge source, size and block ids per KV-cache group."""

    req_id: str
    request_id: str
    src: str
    num_tokens: int
    block_ids: tuple[list[int], ...]


@dataclass
class Send:
    """One finished request the worker sends to a kvbridge peer."""

    req_id: str
    request_id: str
    peer: str
    dst: str
    num_tokens: int
    block_ids: tuple[list[int], ...]


@dataclass
class KVBridgeMetadata(KVConnectorMetadata):
    loads: list[Load] = field(default_factory=list)
    sends: list[Send] = field(default_factory=list)


class KVBridgeConnector(KVConnectorBase_V1, SupportsHMA):
    """See the module docstring: both roles, every DeepSeek-V4 KV-cache group."""

    def __init__(self, vllm_config, role: KVConnectorRole, kv_cache_config=None):
        super().__init__(vllm_config, role, kv_cache_config)
        extra = dict(self._kv_transfer_config.kv_connector_extra_config or {})
        model = extra.get("model") or str(Path(vllm_config.model_config.model) / "config.json")
        self.model = get_model(model)
        self.profile = parse_engine(extra.get("engine") or f"vllm:block={vllm_config.cache_config.block_size}")
        if self.profile.engine != "vllm":
            raise InputError(f"kv_connector_extra_config engine must be a vLLM spec, got {self.profile.spec!r}")
        self.timeout = extra.get("timeout", 120.0)
        self.convert_on = extra.get("convert_on", "receiver")
        if self.convert_on not in CONVERT_SIDES or isinstance(self.timeout, bool) or \
                not isinstance(self.timeout, (int, float)) or not self.timeout > 0:
            raise InputError(f"kv_connector_extra_config: convert_on must be sender or receiver and timeout positive, "
                             f"got {self.convert_on!r}, {self.timeout}")
        self.transport = extra.get("transport", "gloo")
        if self.transport not in TRANSPORTS:
            raise InputError(f"kv_connector_extra_config: transport must be gloo or nixl, got {self.transport!r}")
        ape = extra.get("ape")
        paths = None if ape is None else ape_paths(ape)
        #: The model's APE weights (worker side, read once), for pairs with SGLang pools.
        self.ape: ApeWeights | None = None
        if paths is not None and role == KVConnectorRole.WORKER:
            self.ape = load_ape(paths, self.model, ape_needed(parse_engine("sglang"), self.profile, self.model, False))
        self.is_consumer = self._kv_transfer_config.is_kv_consumer
        self.is_producer = self._kv_transfer_config.is_kv_producer
        # scheduler side
        self._loads: dict[str, Load] = {}
        self._sends: dict[str, Send] = {}
        self._offered: set[str] = set()  # requests whose tokens were offered as external once
        # worker side
        self.caches: VllmCaches | None = None
        self._done_recv: set[str] = set()
        self._done_send: set[str] = set()
        self._failed_recv: set[str] = set()
        self._lock = threading.Lock()
        self._jobs: queue.Queue = queue.Queue()
        self._thread: threading.Thread | None = None
        self.errors: list[str] = []  # one line per failed transfer, also logged
        self.server = None
        self._senders: dict[str, Any] = {}  # NIXL senders by peer (each keeps its agent process)
        self._receiving: Load | None = None  # the load a NIXL receive is for (its plan checks the sender)
        self._received_plan = None
        if role == KVConnectorRole.WORKER and self.is_consumer:
            host, port = host_port(extra.get("listen", "127.0.0.1:0"), "kv_connector_extra_config listen")
            if self.transport == "nixl":
                self.server = self._nixl_receiver(extra.get("landing_tokens", vllm_config.model_config.max_model_len),
                                                  host, port)
            else:
                self.server = GlooServer(EnginePools(self.profile, self.model, False, {}), plan=self._plan,
                                         host=host, port=port)
            log.info("kvbridge connector listening on %s:%d (%s)", *self.server.address, self.transport)

    def _nixl_receiver(self, landing_tokens: Any, host: str, port: int):
        """A NIXL receiver whose pools are the landing area: one request of ``landing_tokens`` tokens in this
        vLLM's layout, in host memory (kvbridge's NIXL registers host memory only)."""
        if isinstance(landing_tokens, bool) or not isinstance(landing_tokens, int) or landing_tokens < 1:
            raise InputError(f"kv_connector_extra_config: landing_tokens must be a positive integer, "
                             f"got {landing_tokens!r}")
        # the most pages a request of up to landing_tokens holds per table: the SWA window and the state
        # rings take more or fewer pages with the length's phase in a block, so over the last two blocks
        block = int(next(c.value for c in self.profile.choices if c.option == "block"))
        held: dict[str, int] = {}
        for n in range(max(1, landing_tokens - 2 * block + 1), landing_tokens + 1):
            for name, pages in plan_migration(self.profile, self.profile, self.model, n,
                                              include_mtp=False).held_pages("dst").items():
                held[name] = max(held.get(name, 0), pages)
        landing = EnginePools.create(self.profile, self.model, held, include_mtp=False)
        self.landing_tokens = landing_tokens
        return NixlReceiver(landing, plan=self._nixl_plan, host=host, port=port, loss_report=False)

    # ------------------------------------------------------------------ scheduler side

    def get_num_new_matched_tokens(self, request, num_computed_tokens: int) -> tuple[int | None, bool]:
        """The prompt tokens a kvbridge producer sends, loaded asynchronously; none for a request that was
        loaded (or failed to load) once already: a producer sends a request once, so vLLM computes what
        a preemption or a failed load lost."""
        params = request.kv_transfer_params or {}
        if not self.is_consumer or "kvbridge_src" not in params or request.request_id in self._offered:
            return 0, False
        n = self._num_tokens(request)
        return max(0, n - num_computed_tokens), n > num_computed_tokens

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
        params = request.kv_transfer_params or {}
        if num_external_tokens <= 0 or "kvbridge_src" not in params:
            return
        self._offered.add(request.request_id)  # blocks are allocated: this request's load is under way
        n = self._num_tokens(request)
        self._loads[request.request_id] = Load(request.request_id, str(params.get("kvbridge_request_id",
                                               request.request_id)), str(params["kvbridge_src"]), n,
                                               tuple(list(ids) for ids in blocks.get_block_ids()))

    def build_connector_meta(self, scheduler_output) -> KVBridgeMetadata:
        meta = KVBridgeMetadata(list(self._loads.values()), list(self._sends.values()))
        self._loads.clear()
        self._sends.clear()
        return meta

    def get_loaded_kv_cache_group_ids(self, request) -> tuple[int, ...]:
        """A kvbridge load restores the request's blocks of every group."""
        return tuple(range(len(self._kv_cache_config.kv_cache_groups)))

    def request_finished(self, request, block_ids):
        raise InputError("KVBridgeConnector needs vLLM's hybrid allocator (request_finished_all_groups)")

    def request_finished_all_groups(self, request, block_ids: tuple[list[int], ...]
                                    ) -> tuple[bool, dict[str, Any] | None]:
        """Producer: hand a finished request's blocks of every group to the worker for its kvbridge peer;
        the blocks stay held until the worker reports the send done."""
        self._offered.discard(request.request_id)
        params = request.kv_transfer_params or {}
        if not self.is_producer or "kvbridge_peer" not in params:
            return False, None
        rid = str(params.get("kvbridge_request_id", request.request_id))
        n = request.num_computed_tokens
        self._sends[request.request_id] = Send(request.request_id, rid, str(params["kvbridge_peer"]),
                                               str(params.get("kvbridge_dst", "vllm")), n,
                                               tuple(list(ids) for ids in block_ids))
        return True, {"kvbridge_src": self.profile.spec, "kvbridge_request_id": rid, "kvbridge_num_tokens": n}

    # ------------------------------------------------------------------ worker side

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]):
        groups = self._kv_cache_config.kv_cache_groups
        pages = {}
        for g in groups:
            specs = getattr(g.kv_cache_spec, "kv_cache_specs", None)
            for name in g.layer_names:
                pages[name] = (specs[name] if specs is not None else g.kv_cache_spec).page_size_bytes
        self.caches = VllmCaches(self.profile, self.model, kv_caches, [g.layer_names for g in groups], pages)
        if self.server is not None and self.transport == "gloo":  # gloo publishes straight into vLLM's blocks
            self.server.dst = self.caches.pools

    def _plan(self, info: dict):
        return plan_migration(info["src"], self.profile, self.model, int(info["num_tokens"]),
                              draft_tokens=int(info.get("draft_tokens", 0)), include_mtp=False, ape=self.ape)

    def _check_sender(self, plan, load: Load) -> None:
        if plan.src.spec != parse_engine(load.src).spec or plan.num_tokens != load.num_tokens:
            raise InputError(f"the producer sent {plan.src.spec}, {plan.num_tokens} tokens; vLLM expects "
                             f"{parse_engine(load.src).spec}, {load.num_tokens}")

    def _nixl_plan(self, info: dict):
        """The NIXL receiver's plan for a sender: refused (before anything moves) unless it is the request
        the load waits for and every live entry has a block of the request."""
        load, caches = self._receiving, self.caches
        assert load is not None and caches is not None
        plan = self._plan(info)
        self._check_sender(plan, load)
        if plan.num_tokens > self.landing_tokens:
            raise InputError(f"{plan.num_tokens} tokens do not fit the NIXL landing area ({self.landing_tokens} "
                             "tokens: kv_connector_extra_config landing_tokens)")
        caches.check(plan.transfers, load.block_ids)
        self._received_plan = plan
        return plan

    def start_load_kv(self, forward_context, **kwargs: Any) -> None:
        """Queue this step's loads for the transfer thread; they are reported by ``get_transfer_results``."""
        meta = self._get_connector_metadata()
        if isinstance(meta, KVBridgeMetadata) and meta.loads:
            if self.caches is None or self.server is None:
                raise InputError("KVBridgeConnector: start_load_kv before register_kv_caches (or not a consumer)")
            self._submit(meta.loads)

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Nothing to wait for: a request's pages are written whole, before vLLM schedules it again."""

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata, **kwargs: Any) -> None:
        """Nothing per layer: a finished request is sent whole from its blocks (``wait_for_save``)."""

    def wait_for_save(self):
        """Producer: queue this step's finished requests for the transfer thread (their blocks stay held
        until ``get_transfer_results`` reports them sent)."""
        if not self.has_connector_metadata():
            return
        meta = self._get_connector_metadata()
        if isinstance(meta, KVBridgeMetadata) and meta.sends:
            if self.caches is None:
                raise InputError("KVBridgeConnector: a send before register_kv_caches")
            self._submit(meta.sends)

    def _submit(self, jobs: list) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="kvbridge-transfers", daemon=True)
            self._thread.start()
        for job in jobs:
            self._jobs.put(job)

    def _run(self) -> None:
        """The transfer thread: one request at a time, in the order vLLM scheduled them."""
        while True:
            job = self._jobs.get()
            if job is None:
                return
            try:
                self._load(job) if isinstance(job, Load) else self._send(job)
                failed = False
            except Exception as exc:  # reported to vLLM (a failed load is recomputed), never raised in its step
                failed = True
                self.errors.append(f"request {job.request_id}: {' '.join(str(exc).split())}")
                log.error("kvbridge: %s", self.errors[-1])
            with self._lock:
                if isinstance(job, Load):
                    self._done_recv.add(job.req_id)
                    if failed:
                        self._failed_recv.add(job.req_id)
                else:
                    self._done_send.add(job.req_id)

    def _load(self, load: Load) -> None:
        caches, server = self.caches, self.server
        assert caches is not None and server is not None
        if self.transport == "nixl":
            return self._load_nixl(load)

        def publish(assembly):
            plan = assembly.plan
            self._check_sender(plan, load)
            if assembly.missing():
                raise InputError(f"{assembly.missing()} transfers never arrived")
            caches.write(plan.transfers, assembly.records, load.block_ids)
            return {}

        got = server.receive(timeout=self.timeout, accept_timeout=self.timeout, request_id=load.request_id,
                             publish=publish)
        if got is None:
            raise InputError(f"no kvbridge producer connected within {self.timeout:g} s")
        log.info("kvbridge: received request %s from %s", load.request_id, got[0])

    def _load_nixl(self, load: Load) -> None:
        """Receive into the landing area (verified there), then write through the request's block ids."""
        caches, rx = self.caches, self.server
        assert caches is not None and rx is not None
        self._receiving, self._received_plan = load, None
        try:
            got = rx.receive(timeout=self.timeout, accept_timeout=self.timeout, request_id=load.request_id)
        finally:
            self._receiving = None
        if got is None:
            raise InputError(f"no kvbridge producer connected within {self.timeout:g} s")
        plan, landing = self._received_plan, rx.dst
        try:
            records = [gather_records(landing.pool(t.spec), t.dst, table_of(got.tables, t.dst), t.first, t.count)
                       for t in plan.transfers]
            caches.write(plan.transfers, records, load.block_ids)
        finally:
            landing.release(got.tables)
        log.info("kvbridge: received request %s from %s over NIXL", load.request_id, got.peer)

    def _send(self, send: Send) -> None:
        assert self.caches is not None
        plan = plan_migration(self.profile, send.dst, self.model, send.num_tokens, include_mtp=False, ape=self.ape)
        pools, tables = self.caches.request_pools(plan, send.block_ids)
        host, port = host_port(send.peer, "kvbridge_peer")
        if self.transport == "nixl":
            sender = self._senders.get(send.peer)
            if sender is None:
                sender = self._senders[send.peer] = NixlSender(host, port, timeout=self.timeout)
            sender.send_request(plan, pools, tables, convert_on=self.convert_on, loss_report=False,
                                request_id=send.request_id)
        else:
            send_request_tcp(plan, pools, tables, host=host, port=port, convert_on=self.convert_on,
                             timeout=self.timeout, request_id=send.request_id)
        log.info("kvbridge: sent request %s to %s over %s", send.request_id, send.peer, self.transport)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        results = self.get_transfer_results(finished_req_ids)
        return results.finished_sending or None, results.finished_recving or None

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        """Requests sent, received and failed to receive since the last call (failed ones count as received,
        as vLLM wants; it recomputes them: nothing of a failed request was written)."""
        with self._lock:
            out = KVConnectorTransferResults(self._done_send, self._done_recv, self._failed_recv)
            self._done_send, self._done_recv, self._failed_recv = set(), set(), set()
        return out

    def shutdown(self):
        if self._thread is not None:
            self._jobs.put(None)
            self._thread.join(timeout=self.timeout)
            self._thread = None
        if self.server is not None:
            self.server.close()
            self.server = None
        for sender in self._senders.values():
            sender.close()
        self._senders.clear()


__all__ = ["KVBridgeConnector", "KVBridgeMetadata", "Load", "Send"]
