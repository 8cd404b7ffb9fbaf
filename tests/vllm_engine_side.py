"""Engine side of tests/test_adapter_vllm.py; runs in the vLLM 0.33.0 venv (never collected by pytest).

Usage: python tests/vllm_engine_side.py consumer TRANSPORT MODEL_DIR OUT_DIR REQUEST_ID NUM_TOKENS SRC_SPEC
                                          [fail|recompute] [ape=PATH] [daemonic]
       python tests/vllm_engine_side.py producer TRANSPORT MODEL_DIR OUT_DIR REQUEST_ID NUM_TOKENS DST_SPEC HOST:PORT
       python tests/vllm_engine_side.py commands TRANSPORT MODEL_DIR OUT_DIR [fail|recompute]   (see ``commands``)
       python tests/vllm_engine_side.py tp TRANSPORT MODEL_DIR OUT_DIR SIZE PORT DIST_PORT NUM_TOKENS SRC DST HOST:PORT
                                          (see ``tp``)
       python tests/vllm_engine_side.py bench TRANSPORT MODEL_DIR OUT_DIR MAX_LEN KV_MIB   (see ``bench``)
       python tests/vllm_engine_side.py sglang-producer sglang MODEL_DIR OUT_DIR NUM_TOKENS ROOM KEY=VALUE...
                                          (see ``sglang_producer``)
       python tests/vllm_engine_side.py sglang-consumer sglang MODEL_DIR OUT_DIR N@HOST:PORT#ROOM[,...] KEY=VALUE...
                                          (see ``sglang_consumer``)

TRANSPORT (gloo, nixl or sglang) is the connector's ``transport`` key.

Builds vLLM's own config, DeepSeek-V4 cache specs (vLLM's cache-layer classes, one MLAAttentionSpec
built with DeepseekV4Attention.get_kv_cache_spec's arguments), vLLM's own KV-cache groups and
tensor views, the kvbridge connector through vLLM's KVConnectorFactory (both roles) and vLLM's
Scheduler, then drives one request through it.

consumer: the scheduler asks the connector for external tokens, allocates blocks, builds the
connector metadata; the worker connector receives the request from a kvbridge producer (the
test) and writes it; the worker reports it received, the scheduler schedules the request's last
prompt token and finishes it. Prints ``LISTEN host port`` once the worker listens.
producer: a request is scheduled and its prompt "computed" (its blocks filled with records made
by kvbridge's vLLM-profile writers, saved for the test); it finishes; the scheduler hands its
blocks of every group to the connector, which sends it to the kvbridge receiver at HOST:PORT.
Both write vLLM's KV buffer, each layer's place in it and the request's block ids to OUT_DIR.
"""

from __future__ import annotations

import json
import os
import sys
import time

import torch


def specs_for(vc, ratios):
    """DeepSeek-V4 cache specs per vLLM layer name, as vLLM's DeepSeek-V4 layers make them."""
    from vllm.config import set_current_vllm_config
    from vllm.models.deepseek_v4.attention import DeepseekV4IndexerCache
    from vllm.models.deepseek_v4.compressor import CompressorStateCache
    from vllm.v1.attention.backends.mla.sparse_swa import DeepseekV4SWACache
    from vllm.v1.kv_cache_interface import MLAAttentionSpec, get_kv_quant_mode

    specs, layers = {}, {}
    with set_current_vllm_config(vc):
        for i, r in enumerate(ratios):
            a = f"model.layers.{i}.attn"
            layers[a + ".swa_cache"] = DeepseekV4SWACache(512, vc.model_config.hf_config.sliding_window, torch.uint8,
                                                          a + ".swa_cache", vc.cache_config)
            if r:
                # DeepseekV4Attention.get_kv_cache_spec for fp8_ds_mla (the whole attention layer needs its weights)
                specs[a] = MLAAttentionSpec(block_size=vc.cache_config.block_size, num_kv_heads=1, max_tp_shards=1,
                                            head_size=512, dtype=torch.uint8, tokens_per_state=r,
                                            cache_dtype_str="fp8_ds_mla", alignment=576, model_version="deepseek_v4",
                                            kv_quant_mode=get_kv_quant_mode("fp8_ds_mla"), state_content_bytes=584)
                coff = 2 if r == 4 else 1
                name = a + ".compressor.state_cache"
                layers[name] = CompressorStateCache(2 * coff * 512, torch.float32, r, name)
            if r == 4:
                name = a + ".indexer.k_cache"
                layers[name] = DeepseekV4IndexerCache(132, torch.uint8, name, vc.cache_config, 4)
                name = a + ".indexer.compressor.state_cache"
                layers[name] = CompressorStateCache(2 * 2 * 128, torch.float32, 4, name)
        for name, layer in layers.items():
            specs[name] = layer.get_kv_cache_spec(vc)
    return specs, layers


class Engine:
    """vLLM's config, KV-cache groups and allocation, the connector (both sides) and the scheduler."""

    def __init__(self, model_dir: str, role: str, transport: str, on_load_failure: str | None = None,
                 ape: str | None = None, tp: int = 1, listen: str | None = None,
                 sides: tuple[str, ...] = ("scheduler", "worker"), rank: tuple[int, int] | None = None,
                 mtp: bool = False, max_len: int = 1024, kv_bytes: int = 32 << 20,
                 chunk: int | None = None, sglang: dict | None = None) -> None:
        """``tp``: vLLM's tensor parallel size; ``sides``: the scheduler, the worker or both (at TP > 1 one
        scheduler and a worker per rank); ``rank``: a worker's (TP rank, port of vLLM's process-group store),
        its TP group formed as vLLM's workers form it before they create their connector; ``mtp``: vLLM serves
        with the model's MTP draft (its ``SpeculativeConfig``, method ``mtp``), whose layers' caches it
        registers after the model's; ``max_len``: vLLM's ``max_model_len``; ``kv_bytes``: the memory vLLM may
        give its KV cache; ``chunk``: prefill in chunks of this many tokens (vLLM's chunked prefill; otherwise
        a whole prompt per step); ``sglang``: the connector's transport-sglang keys (``kv_transfer_config``'s)."""
        from vllm.config import (
            CacheConfig,
            DeviceConfig,
            KVTransferConfig,
            ModelConfig,
            ParallelConfig,
            SchedulerConfig,
            SpeculativeConfig,
            VllmConfig,
        )
        from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
        from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
        from vllm.models.deepseek_v4.attention import DeepseekV4IndexerBackend
        from vllm.models.deepseek_v4.compressor import CompressorBackend
        from vllm.v1.attention.backends.mla.sparse_swa import DeepseekSparseSWABackend
        from vllm.v1.attention.backends.utils import get_supported_kv_cache_layouts, resolve_kv_cache_layout
        from vllm.v1.core.kv_cache_planning import get_global_kv_cache_groups, get_kv_cache_configs
        from vllm.v1.core.kv_cache_utils import generate_scheduler_kv_cache_config, resolve_kv_cache_block_sizes
        from vllm.v1.core.sched.scheduler import Scheduler
        from vllm.v1.structured_output import StructuredOutputManager
        from vllm.v1.worker.utils import allocate_kv_cache

        mc = ModelConfig(model=model_dir, skip_tokenizer_init=True, max_model_len=max_len, dtype="bfloat16")
        from kvbridge.adapters.vllm_config import kv_transfer_config

        # what ``kvbridge vllm-config`` prints
        kt = KVTransferConfig(**kv_transfer_config(role, timeout=120, on_load_failure=on_load_failure,
                                                   transport=transport, ape=[ape] if ape else None, listen=listen,
                                                   **(sglang or {})))
        pc = ParallelConfig()
        spec = SpeculativeConfig(method="mtp", num_speculative_tokens=1, target_model_config=mc,
                                 target_parallel_config=pc) if mtp else None
        vc = VllmConfig(model_config=mc, cache_config=CacheConfig(block_size=256, cache_dtype="fp8_ds_mla"),
                        device_config=DeviceConfig("cpu"), kv_transfer_config=kt, parallel_config=pc,
                        speculative_config=spec,
                        scheduler_config=SchedulerConfig(max_num_batched_tokens=chunk or max_len, max_num_seqs=8,
                                                         max_model_len=max_len, is_encoder_decoder=False,
                                                         enable_chunked_prefill=chunk is not None))
        # vLLM's CPU platform turns the hybrid allocator off; a GPU platform keeps it on (DeepSeek-V4 needs it)
        vc.scheduler_config.disable_hybrid_kv_cache_manager = False
        vc.parallel_config.tensor_parallel_size = tp
        if rank is not None:
            from vllm.config import set_current_vllm_config
            from vllm.distributed.parallel_state import init_distributed_environment, initialize_model_parallel

            with set_current_vllm_config(vc):
                init_distributed_environment(world_size=tp, rank=rank[0], local_rank=rank[0], backend="gloo",
                                             distributed_init_method=f"tcp://127.0.0.1:{rank[1]}")
                initialize_model_parallel(tp, backend="gloo")
        hf = json.load(open(os.path.join(model_dir, "config.json")))
        # the model's layers, then (with the MTP draft) its MTP layers, SWA-only
        ratios = hf["compress_ratios"][:hf["num_hidden_layers"]] + [0] * (hf["num_nextn_predict_layers"] if mtp else 0)
        self.specs, self.layers = specs_for(vc, ratios)
        backends = [DeepseekSparseSWABackend, CompressorBackend, DeepseekV4IndexerBackend]
        self.layout = resolve_kv_cache_layout(vc, [[x.name for x in get_supported_kv_cache_layouts(backends)]],
                                              list(self.specs.values()))
        groups = get_global_kv_cache_groups(vc, [self.specs])
        self.config = get_kv_cache_configs(vc, [self.specs], [kv_bytes], groups)[0]
        self.config.kv_cache_layout = self.layout.name
        self.vc = vc
        if "worker" in sides:
            # worker: vLLM's own allocation of the KV cache and its per-layer views (as its model runner does)
            self.kv_caches = allocate_kv_cache(self.config, torch.device("cpu"), self.layout)
            self.worker = KVConnectorFactory.create_connector(vc, KVConnectorRole.WORKER, self.config)
            self.worker.register_kv_caches({n: self.kv_caches[n] for n in self.specs})
        if "scheduler" not in sides:
            return
        sched_config = generate_scheduler_kv_cache_config([self.config])
        # what vLLM's engine core does between the KV-cache config and the scheduler
        vc.cache_config.num_gpu_blocks = sched_config.num_blocks
        block_size, hash_block_size = resolve_kv_cache_block_sizes(sched_config, vc)
        self.scheduler = Scheduler(vc, sched_config, StructuredOutputManager(vc), block_size=block_size,
                                   hash_block_size=hash_block_size)
        assert type(self.scheduler.connector).__name__ == "KVBridgeConnector", type(self.scheduler.connector)
        self.hash_block_size = hash_block_size

    def hasher(self):
        """vLLM's block hasher for requests, as its engine core makes it (prefix caching on)."""
        from vllm.utils.hashing import get_hash_fn_by_name
        from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash

        fn = get_hash_fn_by_name(self.vc.cache_config.prefix_caching_hash_algo)
        init_none_hash(fn)
        return get_request_block_hasher(self.hash_block_size, fn, self.vc.num_hash_lookahead_tokens)

    def request(self, num_tokens: int, params: dict, max_tokens: int, request_id: str = "vllm-req-0",
                hashed: bool = False):
        """A request whose prompt is tokens 1..num_tokens; ``hashed``: with vLLM's block hashes (its prefix
        cache sees it; the tests' other requests, all with one prompt but other KV, stay out of it)."""
        from vllm.sampling_params import SamplingParams
        from vllm.v1.request import Request

        req = Request(request_id=request_id, prompt_token_ids=list(range(1, num_tokens + 1)),
                      sampling_params=SamplingParams(max_tokens=max_tokens, ignore_eos=True,
                                                     extra_args={"kv_transfer_params": params}),
                      pooling_params=None, block_hasher=self.hasher() if hashed else None)
        self.scheduler.add_request(req)
        return req

    def step(self, out, sampled: dict[str, list[int]] | None = None, failed: set[str] | None = None):
        """Run the worker connector over one scheduler step, then report to the scheduler (adding the loads
        reported failed to ``failed``)."""
        from copy import copy

        from vllm.v1.outputs import EMPTY_MODEL_RUNNER_OUTPUT, KVConnectorOutput

        self.worker.bind_connector_metadata(out.kv_connector_metadata)
        self.worker.start_load_kv(None)
        self.worker.wait_for_save()
        self.worker.clear_connector_metadata()
        results = self.worker.get_transfer_results(set(out.finished_req_ids))  # as vLLM's model runner asks
        sent, received = results.finished_sending, results.finished_recving
        if failed is not None:
            failed.update(results.failed_recving)
        output = copy(EMPTY_MODEL_RUNNER_OUTPUT)
        if sampled:
            output.req_ids = list(sampled)
            output.req_id_to_index = {r: i for i, r in enumerate(sampled)}
            output.sampled_token_ids = list(sampled.values())
        output.kv_connector_output = KVConnectorOutput(finished_sending=sent or None, finished_recving=received or None,
                                                       failed_recving=results.failed_recving)
        self.scheduler.update_from_output(out, output)
        return sent, received

    def until_done(self, out, what: str, timeout: float = 200.0) -> tuple[set[str], set[str]]:
        """Keep stepping (as vLLM's engine loop does) until the worker reports a request sent or received."""
        deadline = time.monotonic() + timeout
        sent, received = set(), set()
        while True:
            s, r = self.step(out)
            sent |= s or set()
            received |= r or set()
            if (sent if what == "sent" else received) or time.monotonic() > deadline:
                return sent, received
            time.sleep(0.05)
            out = self.scheduler.schedule()

    def dump(self, out_dir: str, result: dict) -> None:
        from safetensors.torch import save_file

        # the one backing buffer every group overlays, and where each layer's blocks lie in it
        first = self.kv_caches[next(iter(self.specs))]
        raw = torch.empty(0, dtype=torch.uint8).set_(first.untyped_storage())
        result["groups"] = [list(g.layer_names) for g in self.config.kv_cache_groups]
        result["num_blocks"] = self.config.num_blocks
        result["layout"] = self.layout.name
        result["layers"] = {
            name: {"offset": t.storage_offset() * t.element_size(), "block_stride": t.stride(0) * t.element_size(),
                   "page_bytes": self.specs[name].page_size_bytes,
                   "same_buffer": t.untyped_storage().data_ptr() == raw.data_ptr()}
            for name, t in ((n, self.kv_caches[n]) for n in self.specs)}
        save_file({"raw": raw.clone()}, os.path.join(out_dir, "buffer.safetensors"))
        json.dump(result, open(os.path.join(out_dir, "result.json"), "w"))


def consumer(transport: str, model_dir: str, out_dir: str, request_id: str, num_tokens: int, src: str,
             *options: str) -> None:
    """``options``: vLLM's load-failure policy and ``ape=PATH`` (the connector's APE weights), either or both."""
    ape = next((o[4:] for o in options if o.startswith("ape=")), None)
    policy = next((o for o in options if not o.startswith("ape=") and o != "daemonic"), None)
    eng = Engine(model_dir, "consumer", transport, policy, ape)
    host, port = eng.worker.server.address
    print(f"LISTEN {host} {port}", flush=True)
    req = eng.request(num_tokens, {"kvbridge_src": src, "kvbridge_request_id": request_id}, max_tokens=2)
    out = eng.scheduler.schedule()
    loads = out.kv_connector_metadata.loads
    assert len(loads) == 1 and out.num_scheduled_tokens.get(req.request_id, 0) == 0, (loads, out.num_scheduled_tokens)
    result = {"block_ids": [list(ids) for ids in loads[0].block_ids], "status_after_schedule": req.status.name}
    _, received = eng.until_done(out, "received")
    result["received"] = sorted(received)
    result["errors"] = list(eng.worker.errors)
    out = eng.scheduler.schedule()  # the load is in: vLLM computes the last prompt token from the loaded blocks
    result["status_after_load"] = req.status.name
    result["scheduled_after_load"] = out.num_scheduled_tokens.get(req.request_id, 0)
    result["computed_after_load"] = req.num_computed_tokens
    result["block_ids_after_load"] = [list(ids) for ids in eng.scheduler.kv_cache_manager.get_block_ids(
        req.request_id)]
    eng.step(out, {req.request_id: [7]})
    out = eng.scheduler.schedule()
    eng.step(out, {req.request_id: [8]})
    result["finished"] = req.status.name
    eng.dump(out_dir, result)
    eng.worker.shutdown()


def producer(transport: str, model_dir: str, out_dir: str, request_id: str, num_tokens: int, dst: str,
             peer: str, *options: str) -> None:
    """``options``: ``ape=PATH`` (the connector's APE weights), ``mtp`` (vLLM serves with the MTP draft)."""
    from safetensors.torch import save_file

    from kvbridge.migration.plan import plan_migration

    ape = next((o[4:] for o in options if o.startswith("ape=")), None)
    eng = Engine(model_dir, "producer", transport, ape=ape, mtp="mtp" in options)
    req = eng.request(num_tokens, {"kvbridge_peer": peer, "kvbridge_dst": dst, "kvbridge_request_id": request_id},
                      max_tokens=1)
    out = eng.scheduler.schedule()
    assert out.num_scheduled_tokens[req.request_id] == num_tokens, out.num_scheduled_tokens
    block_ids = eng.scheduler.kv_cache_manager.get_block_ids(req.request_id)
    # the prefill "computes" the prompt: each cache's live entries as vLLM's writers store them
    plan = plan_migration(eng.worker.profile, dst, eng.worker.model, num_tokens, include_mtp=eng.worker.include_mtp,
                          ape=eng.worker.ape)
    records = synthetic_records(plan, seed=11)
    eng.worker.caches.write(plan.transfers, records, block_ids, side="src")
    save_file({str(i): r for i, r in enumerate(records)}, os.path.join(out_dir, "records.safetensors"))
    eng.step(out, {req.request_id: [5]})  # one sampled token: max_tokens reached, the request finishes
    result = {"block_ids": [list(ids) for ids in block_ids], "status_after_prefill": req.status.name,
              "held_after_finish": req.request_id in eng.scheduler.requests}
    out = eng.scheduler.schedule()  # carries the send to the worker
    result["sends"] = [s.request_id for s in out.kv_connector_metadata.sends]
    sent, _ = eng.until_done(out, "sent")
    result["sent"] = sorted(sent)
    result["errors"] = list(eng.worker.errors)
    result["stats"] = (eng.worker.get_kv_connector_stats() or eng.worker.build_kv_connector_stats()).reduce()
    eng.scheduler.schedule()
    result["freed_after_send"] = req.request_id not in eng.scheduler.requests
    eng.dump(out_dir, result)
    eng.worker.shutdown()


def sglang_producer(model_dir: str, out_dir: str, requests: list[tuple[int, int]], *options: str) -> None:
    """A vLLM prefill serving an SGLang decode (transport ``sglang``): ``options`` are ``KEY=VALUE`` connector
    keys (``register_with``, ``bootstrap``, ``state_memory``, ``max_send_rate``) and ``ape=PATH``. One request
    ``vllm-req-K`` per ``(num_tokens, room)`` of ``requests``, all added at once, whose ``kv_transfer_params``
    carry ``bootstrap_room`` ROOM; each is scheduled whole (as many a step as vLLM's token budget takes), its blocks
    filled as vLLM's writers store them (records saved for the test, ``records-vllm-req-K.safetensors``), it
    samples token 5 + K and finishes; the worker serves each until the decode took its room. Writes vLLM's KV
    buffer and the result to OUT_DIR."""
    from safetensors.torch import save_file

    from kvbridge.migration.plan import plan_migration

    keys: dict = dict(o.split("=", 1) for o in options)
    ape = keys.pop("ape", None)
    if "max_send_rate" in keys:
        keys["max_send_rate"] = int(keys["max_send_rate"])
    eng = Engine(model_dir, "producer", "sglang", ape=ape, max_len=2304, kv_bytes=128 << 20, sglang=keys)
    reqs = {f"vllm-req-{k}": eng.request(n, {"bootstrap_room": room}, max_tokens=1, request_id=f"vllm-req-{k}")
            for k, (n, room) in enumerate(requests)}
    first = {rid: 5 + k for k, rid in enumerate(reqs)}  # each request's first output token: its metadata row's
    result = {"block_ids": {}, "status_after_prefill": {}, "held_after_finish": {}, "sends": [],
              "bootstrap_addr": eng.worker.sglang_peer.bootstrap_addr}
    sent: set[str] = set()
    deadline = time.monotonic() + 200
    while sent != set(reqs) and time.monotonic() < deadline:
        out = eng.scheduler.schedule()
        result["sends"] += [[x.request_id, x.room, x.first_token, x.num_tokens]
                            for x in out.kv_connector_metadata.sends]
        for rid, n in out.num_scheduled_tokens.items():  # a prefill step: vLLM's forward writes the blocks
            req = reqs[rid]
            assert n == req.num_prompt_tokens, (rid, n)
            block_ids = eng.scheduler.kv_cache_manager.get_block_ids(rid)
            plan = plan_migration(eng.worker.profile, eng.worker.sglang_profile, eng.worker.model, n,
                                  include_mtp=False, ape=eng.worker.ape)
            records = synthetic_records(plan, seed=11 + int(rid.rsplit("-", 1)[1]))
            eng.worker.caches.write(plan.transfers, records, block_ids, side="src")
            save_file({str(i): r for i, r in enumerate(records)}, os.path.join(out_dir, f"records-{rid}.safetensors"))
            result["block_ids"][rid] = [list(ids) for ids in block_ids]
        s, _ = eng.step(out, {rid: [first[rid]] for rid in out.num_scheduled_tokens})
        sent |= s or set()
        for rid in out.num_scheduled_tokens:
            result["status_after_prefill"][rid] = reqs[rid].status.name
            result["held_after_finish"][rid] = rid in eng.scheduler.requests
        time.sleep(0.05)
    result["sent"] = sorted(sent)
    result["errors"] = list(eng.worker.errors)
    result["stats"] = (eng.worker.get_kv_connector_stats() or eng.worker.build_kv_connector_stats()).reduce()
    eng.scheduler.schedule()
    result["freed_after_send"] = {rid: rid not in eng.scheduler.requests for rid in reqs}
    peer = eng.worker.sglang_peer
    result["peer_free"] = {k: len(v) for k, v in peer.pools.free.items()}
    result["peer_capacity"] = {k: int(peer.pools.pool(s).shape[0]) for s in eng.worker.model.all_caches(False)
                               for k in [peer.pools.storage(s).table]}
    eng.dump(out_dir, result)
    eng.worker.shutdown()


def sglang_consumer(model_dir: str, out_dir: str, rooms: list[tuple[int, str, int, int | None]],
                    *options: str) -> None:
    """A vLLM decode fed by SGLang prefills (transport ``sglang``): ``options`` are ``KEY=VALUE`` connector keys
    and ``ape=PATH``. One request per ``(num_tokens, bootstrap host:port, room, prompt)`` of ``rooms``, all added
    at once, their ``kv_transfer_params`` naming the prefill's bootstrap server and the room as SGLang's router
    sets them; the scheduler allocates their blocks, the worker receives them (each failure's wall-clock time
    recorded), and the loaded ones compute their last prompt token and sample two tokens. A ``prompt`` (else
    None) makes the request's prompt that long, with ``kvbridge_num_tokens`` ``num_tokens``, in vLLM's prefix
    cache: vLLM first computes a prompt of that length itself, so the request is whole in its cache (no load,
    its prefill declined: the rooms declined are recorded). The connector's quarantined landing pages and its
    declines are waited for (10 s at most). ``then=N@HOST:PORT#ROOM``: one more request, added once those
    requests finished and the quarantine emptied (``result["next"]``: what the landing pools held then).
    Writes vLLM's KV buffer and the result to OUT_DIR."""
    keys = dict(o.split("=", 1) for o in options)
    ape = keys.pop("ape", None)
    then = keys.pop("then", None)
    eng = Engine(model_dir, "consumer", "sglang", ape=ape, max_len=2304, kv_bytes=128 << 20,
                 sglang={k: int(v) if v.isdigit() else v for k, v in keys.items()})
    for prompt in sorted({r[3] for r in rooms if r[3]}):  # vLLM computes it itself: its blocks stay cached
        req = eng.request(prompt, {}, max_tokens=1, request_id=f"vllm-cached-{prompt}", hashed=True)
        while not req.is_finished():
            out = eng.scheduler.schedule()
            eng.step(out, {rid: [7] for rid in out.num_scheduled_tokens})
    reqs = []
    for k, (num_tokens, bootstrap, room, prompt) in enumerate(rooms):
        host, port = bootstrap.rsplit(":", 1)
        params = {"bootstrap_host": host, "bootstrap_port": int(port), "bootstrap_room": room}
        if prompt:
            params["kvbridge_num_tokens"] = num_tokens
        reqs.append(eng.request(prompt or num_tokens, params, max_tokens=2, request_id=f"vllm-req-{k}",
                                hashed=bool(prompt)))
    out = eng.scheduler.schedule()
    loads = {load.req_id: load for load in out.kv_connector_metadata.loads}
    assert sorted(loads) == sorted(r.request_id for r, spec in zip(reqs, rooms, strict=True) if not spec[3]), loads
    result = {"block_ids": {rid: [list(ids) for ids in load.block_ids] for rid, load in loads.items()},
              "loads": {rid: [ld.request_id, ld.bootstrap, ld.room, ld.num_tokens] for rid, ld in loads.items()},
              "declines": [list(d) for d in out.kv_connector_metadata.declines],
              "status_after_schedule": [r.status.name for r in reqs], "failed_at": {}}
    received: set[str] = set()
    first_scheduled: dict[str, int] = {}  # tokens vLLM computes in its first step after the load

    def run(out) -> None:  # step (as vLLM's engine loop does) until every request finished
        deadline = time.monotonic() + 200
        while not all(r.is_finished() for r in reqs) and time.monotonic() < deadline:
            failed: set[str] = set()
            for rid, n in out.num_scheduled_tokens.items():
                first_scheduled.setdefault(rid, n)
            _, got = eng.step(out, {rid: [7] for rid in out.num_scheduled_tokens}, failed=failed)
            received.update(got or ())
            result["failed_at"].update(dict.fromkeys(failed, time.time()))
            time.sleep(0.05)
            out = eng.scheduler.schedule()

    run(out)
    peer = eng.worker.sglang_decode
    if then:
        result["next"] = {"quarantined_before": len(peer.quarantined)}
        until = time.monotonic() + 30
        while peer.quarantined and time.monotonic() < until:  # the watcher reclaims the dead room's pages
            time.sleep(0.1)
        result["next"].update(quarantined=len(peer.quarantined), free={k: len(v) for k, v in peer.pools.free.items()})
        n, addr, room = then.replace("#", "@").split("@")
        host, port = addr.rsplit(":", 1)
        rid = f"vllm-req-{len(reqs)}"
        reqs.append(eng.request(int(n), {"bootstrap_host": host, "bootstrap_port": int(port),
                                         "bootstrap_room": int(room)}, max_tokens=2, request_id=rid))
        out = eng.scheduler.schedule()
        (load,) = out.kv_connector_metadata.loads
        result["block_ids"][rid] = [list(ids) for ids in load.block_ids]
        result["loads"][rid] = [load.request_id, load.bootstrap, load.room, load.num_tokens]
        run(out)
    result["received"], result["failed"] = sorted(received), sorted(result["failed_at"])
    result["errors"] = list(eng.worker.errors)
    result["stats"] = (eng.worker.get_kv_connector_stats() or eng.worker.build_kv_connector_stats()).reduce()
    result["scheduled_after_load"] = first_scheduled
    result["finished"] = [r.status.name for r in reqs]
    eng.worker._recv_pool.shutdown(wait=True)  # the declines told (they run on the receive threads)
    result["quarantined_after_load"] = len(peer.quarantined)
    until = time.monotonic() + 10
    while peer.quarantined and time.monotonic() < until:
        time.sleep(0.1)
    result["quarantined"] = len(peer.quarantined)
    result["landing_free"] = {k: len(v) for k, v in peer.pools.free.items()}
    result["landing_capacity"] = {k: int(peer.pools.pool(s).shape[0]) for s in eng.worker.model.all_caches(False)
                                  for k in [peer.pools.storage(s).table]}
    result["dead_within"] = peer.dead_within
    result["aux_free"] = [len(peer._free_aux), peer.aux_rows]  # metadata rows not claimed / registered
    eng.dump(out_dir, result)
    eng.worker.shutdown()


def commands(transport: str, model_dir: str, out_dir: str, *options: str) -> None:
    """A consumer driven line by line from stdin (the test's several-request cases share this process):

    ``add NAME NUM_TOKENS SRC RID [hashed] [tokens=K]``: a request whose KV a producer sends under RID
    (``hashed``: in vLLM's prefix cache; ``tokens=K``: its ``kvbridge_num_tokens``); ``compute NAME
    NUM_TOKENS``: a hashed request vLLM computes itself, stepped until it finished (its blocks stay in the
    prefix cache); ``sentinel``: fill every block of the prefix cache, in each layer of its group, with
    0xA5; ``step``: one engine step; ``wait NAME...``: step until each named request's load was reported
    (received or failed; a received request's records in its vLLM blocks go to OUT_DIR/NAME.safetensors as
    it is reported, and whether its sentinel blocks are intact to the state); ``abort NAME``: the client
    aborts it (then one step); ``speculative METHOD...``: vLLM's ``SpeculativeConfig`` for each method (``ngram``,
    ``draft_model`` with this model) and what the connector makes of it; ``run``: step until every request
    finished; ``quit``.
    Each command answers one ``OK <json>`` line: reported loads, failures, errors, free blocks, statuses,
    the prefix-cache hit of each load (tokens) and the sentinel check of each received request."""
    from safetensors.torch import save_file
    from vllm.v1.request import RequestStatus

    from kvbridge.migration.plan import plan_migration
    from kvbridge.migration.pools import gather_records

    policy = next((o for o in options if not o.startswith("ape=") and o != "mtp"), None)
    eng = Engine(model_dir, "consumer", transport, policy, mtp="mtp" in options)
    host, port = eng.worker.server.address
    print(f"LISTEN {host} {port}", flush=True)
    from kvbridge.adapters.vllm import KVBridgeStats

    stats = KVBridgeStats()
    reqs, srcs = {}, {}
    received, failed = set(), set()
    pool = eng.scheduler.kv_cache_manager.block_pool
    free0 = pool.get_num_free_blocks()

    sentinel: dict[int, int] = {}  # block id: its KV-cache group, for the blocks filled with 0xA5
    hits, intact = {}, {}

    def layers_of(g: int):
        caches = eng.worker.caches
        return [caches.pools.pool(spec) for spec in eng.worker.model.all_caches(eng.worker.include_mtp)
                if caches.group[(spec.layer, spec.role)] == g]

    def save(name: str) -> None:
        """The request's records in its vLLM blocks (still held: saved as soon as its load is reported), and
        how many of its blocks are sentinel blocks, whether each still holds 0xA5 only."""
        req = reqs[name]
        held = [(b, sentinel[b]) for ids in eng.scheduler.kv_cache_manager.get_block_ids(name) for b in ids
                if b in sentinel]
        intact[name] = [len(held), all(bool((pool[b] == 0xA5).all()) for b, g in held for pool in layers_of(g))]
        plan = plan_migration(srcs[name], eng.worker.profile, eng.worker.model, len(req.prompt_token_ids),
                              include_mtp=eng.worker.include_mtp)
        caches = eng.worker.caches
        tables = caches.tables(eng.scheduler.kv_cache_manager.get_block_ids(name))
        save_file({str(i): gather_records(caches.pools.pool(t.spec), t.dst,
                                          tables[caches.group[(t.spec.layer, t.spec.role)]], t.first,
                                          t.count).contiguous() for i, t in enumerate(plan.transfers)},
                  os.path.join(out_dir, f"{name}.safetensors"))

    def advance():
        out = eng.scheduler.schedule()
        hits.update({load.req_id: load.computed_tokens for load in out.kv_connector_metadata.loads})
        sampled = {r: [7] for r in out.num_scheduled_tokens}
        new = set(eng.step(out, sampled, failed)[1] or ())
        received.update(new)
        for name in sorted(new - failed):
            if not reqs[name].is_finished():
                save(name)

    for line in sys.stdin:
        cmd, *args = line.split()
        if cmd == "quit":
            break
        if cmd == "add":
            name, n, src, rid, *extra = args
            params = {"kvbridge_src": src, "kvbridge_request_id": rid}
            for e in extra:
                if e.startswith("tokens="):
                    params["kvbridge_num_tokens"] = int(e[7:])
            reqs[name] = eng.request(int(n), params, max_tokens=2, request_id=name, hashed="hashed" in extra)
            srcs[name] = src
        elif cmd == "compute":
            req = eng.request(int(args[1]), {}, max_tokens=2, request_id=args[0], hashed=True)
            while not req.is_finished():
                advance()
        elif cmd == "sentinel":
            from vllm.v1.core.kv_cache_utils import get_group_id

            for block in pool.blocks:
                if block.block_hash is not None and not block.is_null:
                    sentinel[block.block_id] = get_group_id(block.block_hash)
                    for layer in layers_of(sentinel[block.block_id]):
                        layer[block.block_id] = 0xA5
        elif cmd == "step":
            advance()
        elif cmd == "wait":
            deadline = time.monotonic() + 200
            while not set(args) <= received and time.monotonic() < deadline:
                advance()
                time.sleep(0.02)
        elif cmd == "abort":
            eng.scheduler.finish_requests(args[0], RequestStatus.FINISHED_ABORTED)
            advance()
        elif cmd == "parallel":  # the connector at tensor parallel size TP, pipeline parallel size PP (both roles)
            import copy

            from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
            from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

            vc = copy.copy(eng.vc)
            vc.parallel_config = copy.copy(eng.vc.parallel_config)
            vc.parallel_config.tensor_parallel_size = int(args[0])
            vc.parallel_config.pipeline_parallel_size = int(args[1])
            refused = {}
            for role in (KVConnectorRole.SCHEDULER, KVConnectorRole.WORKER):
                try:
                    KVConnectorFactory.create_connector(vc, role, eng.config).shutdown()
                    refused[role.name] = None
                except Exception as exc:  # reported to the test
                    refused[role.name] = f"{type(exc).__name__}: {exc}"
            print("REFUSED " + json.dumps(refused), flush=True)
        elif cmd == "speculative":  # what connector_mtp makes of vLLM's own SpeculativeConfig for these methods
            from vllm.config import ParallelConfig, SpeculativeConfig

            from kvbridge.adapters.vllm_config import connector_mtp

            answers = {}
            for method in args:
                extra = {"model": model_dir} if method == "draft_model" else {"prompt_lookup_max": 3}
                spec = SpeculativeConfig(method=method, num_speculative_tokens=1,
                                         target_model_config=eng.vc.model_config,
                                         target_parallel_config=ParallelConfig(), **extra)
                answers[method] = [spec.method, connector_mtp(spec, eng.worker.model)]
            print("SPECULATIVE " + json.dumps(answers), flush=True)
        elif cmd == "run":
            deadline = time.monotonic() + 200
            while any(not r.is_finished() for r in reqs.values()) and time.monotonic() < deadline:
                advance()
            for _ in range(3):  # let delayed frees land
                advance()
        stats.aggregate(eng.worker.get_kv_connector_stats() or KVBridgeStats())
        state = {"received": sorted(received), "failed": sorted(failed), "errors": list(eng.worker.errors),
                 "stats": stats.reduce(),
                 "free": pool.get_num_free_blocks(), "free_at_start": free0, "hits": hits, "intact": intact,
                 "status": {n: r.status.name for n, r in reqs.items()}}
        print("OK " + json.dumps(state), flush=True)
    eng.worker.shutdown()


def bench(transport: str, model_dir: str, out_dir: str, max_len: str, kv_mib: str) -> None:
    """The consumer of ``scripts/bench_vllm_connector.py``: vLLM at ``max_model_len`` ``max_len`` with ``kv_mib``
    MiB of KV cache and chunked prefill (2,048 tokens a step, so that its sliding-window groups need blocks for a
    chunk, not a whole prompt), driven from stdin. ``load RID NUM_TOKENS SRC``: a request whose producer sends
    under RID; answers ``READY <vLLM's number of blocks>`` once vLLM allocated its blocks and handed the load to
    the worker, then steps (every millisecond, as a busy engine loop would) until the worker reports it and
    answers ``RECEIVED <json>`` (``at``: ``time.monotonic()`` then; the connector's stats and errors), then aborts
    it (its blocks return to the pool). ``quit``."""
    from vllm.v1.request import RequestStatus

    eng = Engine(model_dir, "consumer", transport, max_len=int(max_len), kv_bytes=int(kv_mib) << 20, chunk=2048)
    host, port = eng.worker.server.address
    print(f"LISTEN {host} {port}", flush=True)
    for line in sys.stdin:
        cmd, *args = line.split()
        if cmd == "quit":
            break
        rid, n, src = args
        req = eng.request(int(n), {"kvbridge_src": src, "kvbridge_request_id": rid}, max_tokens=1, request_id=rid)
        out = eng.scheduler.schedule()
        assert len(out.kv_connector_metadata.loads) == 1, f"vLLM could not allocate {n} tokens: raise kv_mib"
        print(f"READY {eng.config.num_blocks}", flush=True)
        failed: set[str] = set()
        while True:
            _, received = eng.step(out, None, failed)
            if received:
                done = time.monotonic()
                break
            time.sleep(0.001)
            out = eng.scheduler.schedule()
        stats = (eng.worker.get_kv_connector_stats() or eng.worker.build_kv_connector_stats()).reduce()
        print("RECEIVED " + json.dumps({"at": done, "failed": sorted(failed), "errors": list(eng.worker.errors),
                                        "stats": stats}), flush=True)
        eng.scheduler.finish_requests(req.request_id, RequestStatus.FINISHED_ABORTED)
        eng.step(eng.scheduler.schedule())
    eng.worker.shutdown()


def tp_worker(rank: int, size: int, dist_port: int, conn, transport: str, model_dir: str, listen: str) -> None:
    """One TP rank's worker (a daemonic process, as vLLM's multiprocess executor runs it): vLLM's TP group
    formed first (gloo), then its KV cache and its worker connector; it runs what ``tp`` sends through
    ``conn``: ``step`` (the worker connector over one scheduler step: its transfer results and stats),
    ``fill`` (a producer request's blocks written with the seed-11 records) and ``dump`` (vLLM's KV buffer)."""
    eng = Engine(model_dir, "both", transport, tp=size, listen=listen, sides=("worker",), rank=(rank, dist_port))
    w = eng.worker
    conn.send((w.server.address, w.tp))
    while True:
        cmd, *args = conn.recv()
        if cmd == "step":
            w.bind_connector_metadata(args[0])
            w.start_load_kv(None)
            w.wait_for_save()
            w.clear_connector_metadata()
            results = w.get_transfer_results(args[1])
            conn.send((results, w.get_kv_connector_stats(), list(w.errors)))
        elif cmd == "fill":
            from kvbridge.migration.plan import plan_migration

            plan = plan_migration(w.profile, args[1], w.model, args[2], include_mtp=False)
            w.caches.write(plan.transfers, synthetic_records(plan, seed=11), args[0], side="src")
            conn.send(None)
        elif cmd == "dump":
            os.makedirs(args[0], exist_ok=True)
            eng.dump(args[0], args[1])
            conn.send(None)
        else:
            w.shutdown()
            conn.send(None)
            return


def tp(transport: str, model_dir: str, out_dir: str, size: int, port: int, dist_port: int, num_tokens: int,
       src: str, dst: str, peer: str) -> None:
    """vLLM at tensor parallel size ``size``, role ``kv_both``: one scheduler (this process) and a worker per
    rank (daemonic processes in vLLM's TP group); rank results aggregated by vLLM's ``KVOutputAggregator``.
    Prints ``LISTEN host port rank`` per rank; receives request ``req-tp`` (from ``src`` pools, every rank
    from its producer) and dumps each rank's KV buffer to OUT_DIR/rankR/in; then sends a finished request
    ``req-tp-out`` (its blocks filled on every rank, records to OUT_DIR/records.safetensors) to ``dst``
    pools at ``peer`` (rank r to its port + r) and dumps again, to OUT_DIR/rankR/out."""
    import multiprocessing
    from copy import copy

    from safetensors.torch import save_file
    from vllm.distributed.kv_transfer.kv_connector.utils import KVOutputAggregator
    from vllm.v1.outputs import EMPTY_MODEL_RUNNER_OUTPUT

    from kvbridge.adapters.vllm import KVBridgeStats
    from kvbridge.migration.plan import plan_migration

    listen = f"127.0.0.1:{port}"
    eng = Engine(model_dir, "both", transport, tp=size, listen=listen, sides=("scheduler",))
    ctx = multiprocessing.get_context("spawn")
    conns, procs = [], []
    for rank in range(size):
        mine, theirs = ctx.Pipe()
        proc = ctx.Process(target=tp_worker, args=(rank, size, dist_port, theirs, transport, model_dir, listen),
                           daemon=True)
        proc.start()
        conns.append(mine)
        procs.append(proc)
    for rank, conn in enumerate(conns):
        (host, rank_port), position = conn.recv()
        assert tuple(position) == (rank, size), position
        print(f"LISTEN {host} {rank_port} {rank}", flush=True)
    aggregator = KVOutputAggregator(size)  # what vLLM's multiprocess executor makes for a KV connector
    stats = KVBridgeStats()
    result: dict = {"errors": []}

    def step(out, sampled: dict[str, list[int]]):
        outputs = []
        for conn in conns:
            conn.send(("step", out.kv_connector_metadata, set(out.finished_req_ids)))
        for conn in conns:
            results, rank_stats, errors = conn.recv()
            result["errors"] += errors
            output = copy(EMPTY_MODEL_RUNNER_OUTPUT)
            output.req_ids = list(sampled)
            output.req_id_to_index = {r: i for i, r in enumerate(sampled)}
            output.sampled_token_ids = list(sampled.values())
            output.kv_connector_output = KVConnectorOutput(
                finished_sending=results.finished_sending or None, finished_recving=results.finished_recving or None,
                failed_recving=results.failed_recving, kv_connector_stats=rank_stats)
            outputs.append(output)
        merged = aggregator.aggregate(outputs)
        stats.aggregate(merged.kv_connector_output.kv_connector_stats or KVBridgeStats())
        eng.scheduler.update_from_output(out, merged)
        return merged.kv_connector_output

    def until(req, what: str) -> list[str]:
        deadline, seen = time.monotonic() + 200, set()
        while time.monotonic() < deadline:
            out = eng.scheduler.schedule()
            done = step(out, {r: [7] for r in out.num_scheduled_tokens})
            seen |= (done.finished_recving if what == "received" else done.finished_sending) or set()
            seen |= done.failed_recving or set()
            if req.request_id in seen:
                break
            time.sleep(0.05)
        return sorted(seen)

    from vllm.v1.outputs import KVConnectorOutput

    req = eng.request(num_tokens, {"kvbridge_src": src, "kvbridge_request_id": "req-tp"}, max_tokens=2,
                      request_id="in")
    result["received"] = until(req, "received")
    result["block_ids"] = [list(ids) for ids in eng.scheduler.kv_cache_manager.get_block_ids("in")]
    result["status_after_load"] = req.status.name
    for rank, conn in enumerate(conns):
        conn.send(("dump", os.path.join(out_dir, f"rank{rank}", "in"), dict(result)))
        conn.recv()
    while not req.is_finished():
        out = eng.scheduler.schedule()
        step(out, {r: [7] for r in out.num_scheduled_tokens})
    result["finished"] = req.status.name
    # the producer side: a request computed on every rank, sent by every rank to its peer rank
    out_req = eng.request(num_tokens, {"kvbridge_peer": peer, "kvbridge_dst": dst, "kvbridge_request_id": "req-tp-out"},
                          max_tokens=1, request_id="out")
    out = eng.scheduler.schedule()
    block_ids = eng.scheduler.kv_cache_manager.get_block_ids("out")
    for conn in conns:
        conn.send(("fill", block_ids, dst, num_tokens))
        conn.recv()
    worker_profile = eng.scheduler.connector.profile
    plan = plan_migration(worker_profile, dst, eng.scheduler.connector.model, num_tokens, include_mtp=False)
    save_file({str(i): r for i, r in enumerate(synthetic_records(plan, seed=11))},
              os.path.join(out_dir, "records.safetensors"))
    step(out, {"out": [5]})  # the request finishes; the next schedule hands its send to every rank
    result["sent"] = until(out_req, "sent")
    eng.scheduler.schedule()
    result["freed_after_send"] = "out" not in eng.scheduler.requests
    result["out_block_ids"] = [list(ids) for ids in block_ids]
    result["stats"] = stats.reduce()
    for rank, conn in enumerate(conns):
        conn.send(("dump", os.path.join(out_dir, f"rank{rank}", "out"), dict(result)))
        conn.recv()
        conn.send(("quit",))
        conn.recv()
    for proc in procs:
        proc.join(60)
        assert proc.exitcode == 0, proc.exitcode


def synthetic_records(plan, seed: int) -> list[torch.Tensor]:
    """Each transfer's source records as the source engine's writers store them (kvbridge's profile encoders)."""
    import kvbridge
    from kvbridge.migration.ape import add_ape
    from kvbridge.migration.rows import state_rows_from_f32
    from kvbridge.ops import keys as ix

    gen = torch.Generator().manual_seed(seed)
    out = []
    for t in plan.transfers:
        st = t.src
        if st.kind == "kv":
            x = torch.randn(t.count, 512, generator=gen).bfloat16().float()
            pages = kvbridge.encode(x, st.layout, page_size=t.count, dialect=st.dialect, scale=st.scale)
            out.append(st.layout.pages_to_records(pages, t.count))
        elif st.kind == "indexer":
            out.append(ix.encode_keys(torch.randn(t.count, t.spec.width, generator=gen), st.indexer, st.dialect or ""))
        else:
            rows = torch.randn(t.count, st.record_bytes // 4, generator=gen)
            if t.ape_sign < 0:  # vLLM stores score + APE (its writer adds the APE to the raw score)
                rows = add_ape(rows, t.ape, t.first)
            out.append(state_rows_from_f32(rows, st.fmt))
    return out


def main() -> None:
    mode, transport, model_dir, out_dir, *rest = sys.argv[1:]
    if mode == "commands":
        commands(transport, model_dir, out_dir, *rest)
    elif mode == "bench":
        bench(transport, model_dir, out_dir, *rest)
    elif mode == "sglang-consumer":
        specs, *rest = rest  # N@HOST:PORT#ROOM[~PROMPT],...
        rooms = [(int(n), addr, int(room), int(prompt[0]) if prompt else None) for n, addr, room, *prompt in
                 (spec.replace("#", "@").replace("~", "@").split("@") for spec in specs.split(","))]
        sglang_consumer(model_dir, out_dir, rooms, *rest)
    elif mode == "sglang-producer":
        num_tokens, rooms, *rest = rest  # N,N,... ROOM,ROOM,...
        sglang_producer(model_dir, out_dir, [(int(n), int(r)) for n, r in
                                             zip(num_tokens.split(","), rooms.split(","), strict=True)], *rest)
    elif mode == "tp":
        size, port, dist_port, num_tokens, src, dst, peer = rest
        tp(transport, model_dir, out_dir, int(size), int(port), int(dist_port), int(num_tokens), src, dst, peer)
    elif mode == "consumer" and "daemonic" in rest:
        # as vLLM's multiprocess executor runs its workers: in a daemonic process (which cannot have children)
        import multiprocessing

        request_id, num_tokens, engine, *rest = rest
        proc = multiprocessing.get_context("spawn").Process(
            target=consumer, args=(transport, model_dir, out_dir, request_id, int(num_tokens), engine, *rest),
            daemon=True)
        proc.start()
        proc.join()
        assert proc.exitcode == 0, proc.exitcode
    elif mode == "consumer":
        request_id, num_tokens, engine, *rest = rest
        consumer(transport, model_dir, out_dir, request_id, int(num_tokens), engine, *rest)
    else:
        request_id, num_tokens, engine, *rest = rest
        producer(transport, model_dir, out_dir, request_id, int(num_tokens), engine, *rest)
    print("DONE", flush=True)


if __name__ == "__main__":
    main()
