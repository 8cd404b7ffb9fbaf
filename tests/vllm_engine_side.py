"""Engine side of tests/test_adapter_vllm.py; runs in the vLLM 0.33.0 venv (never collected by pytest).

Usage: python tests/vllm_engine_side.py MODEL_DIR OUT_DIR REQUEST_ID NUM_TOKENS SRC_SPEC

Builds vLLM's own config, DeepSeek-V4 cache specs (vLLM's cache-layer classes, one MLAAttentionSpec
built with DeepseekV4Attention.get_kv_cache_spec's arguments), vLLM's own KV-cache groups and
tensor views, the kvbridge connector through vLLM's KVConnectorFactory (both roles) and vLLM's
Scheduler, then drives one request through the consumer connector: the scheduler asks for
external tokens, allocates blocks, builds the connector metadata; the worker connector receives
the request from a kvbridge producer (the test) and writes it. Prints ``LISTEN host port`` once
the worker listens, and writes vLLM's KV buffer, each layer's place in it and the request's block ids
to OUT_DIR.
"""

from __future__ import annotations

import json
import os
import sys

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


def main() -> None:
    model_dir, out_dir, request_id, num_tokens, src = sys.argv[1:6]
    num_tokens = int(num_tokens)
    from vllm.config import (
        CacheConfig,
        DeviceConfig,
        KVTransferConfig,
        ModelConfig,
        SchedulerConfig,
        VllmConfig,
    )
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
    from vllm.models.deepseek_v4.attention import DeepseekV4IndexerBackend
    from vllm.models.deepseek_v4.compressor import CompressorBackend
    from vllm.sampling_params import SamplingParams
    from vllm.v1.attention.backends.mla.sparse_swa import DeepseekSparseSWABackend
    from vllm.v1.attention.backends.utils import get_supported_kv_cache_layouts, resolve_kv_cache_layout
    from vllm.v1.core.kv_cache_planning import get_global_kv_cache_groups, get_kv_cache_configs
    from vllm.v1.core.kv_cache_utils import generate_scheduler_kv_cache_config, resolve_kv_cache_block_sizes
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.request import Request
    from vllm.v1.structured_output import StructuredOutputManager
    from vllm.v1.worker.utils import allocate_kv_cache

    max_len = 1024
    mc = ModelConfig(model=model_dir, skip_tokenizer_init=True, max_model_len=max_len, dtype="bfloat16")
    kt = KVTransferConfig(kv_connector="KVBridgeConnector", kv_connector_module_path="kvbridge.adapters.vllm",
                          kv_role="kv_consumer", kv_connector_extra_config={"timeout": 120})
    vc = VllmConfig(model_config=mc, cache_config=CacheConfig(block_size=256, cache_dtype="fp8_ds_mla"),
                    device_config=DeviceConfig("cpu"), kv_transfer_config=kt,
                    scheduler_config=SchedulerConfig(max_num_batched_tokens=max_len, max_num_seqs=4,
                                                     max_model_len=max_len, is_encoder_decoder=False))
    # vLLM's CPU platform turns the hybrid allocator off; a GPU platform keeps it on (DeepSeek-V4 needs it)
    vc.scheduler_config.disable_hybrid_kv_cache_manager = False
    ratios = json.load(open(os.path.join(model_dir, "config.json")))["compress_ratios"]
    specs, layers = specs_for(vc, ratios)
    backends = [DeepseekSparseSWABackend, CompressorBackend, DeepseekV4IndexerBackend]
    layout = resolve_kv_cache_layout(vc, [[x.name for x in get_supported_kv_cache_layouts(backends)]],
                                     list(specs.values()))
    groups = get_global_kv_cache_groups(vc, [specs])
    config = get_kv_cache_configs(vc, [specs], [32 << 20], groups)[0]
    config.kv_cache_layout = layout.name

    # worker: vLLM's own allocation of the KV cache and its per-layer views (as its model runner does)
    kv_caches = allocate_kv_cache(config, torch.device("cpu"), layout)
    worker = KVConnectorFactory.create_connector(vc, KVConnectorRole.WORKER, config)
    worker.register_kv_caches({n: kv_caches[n] for n in specs})
    host, port = worker.server.address
    print(f"LISTEN {host} {port}", flush=True)

    sched_config = generate_scheduler_kv_cache_config([config])
    # what vLLM's engine core does between the KV-cache config and the scheduler
    vc.cache_config.num_gpu_blocks = sched_config.num_blocks
    block_size, hash_block_size = resolve_kv_cache_block_sizes(sched_config, vc)
    scheduler = Scheduler(vc, sched_config, StructuredOutputManager(vc), block_size=block_size,
                          hash_block_size=hash_block_size)
    request = Request(request_id="vllm-req-0", prompt_token_ids=list(range(1, num_tokens + 1)),
                      sampling_params=SamplingParams(max_tokens=4, extra_args={"kv_transfer_params": {
                          "kvbridge_src": src, "kvbridge_request_id": request_id}}), pooling_params=None)
    scheduler.add_request(request)
    out = scheduler.schedule()
    meta = out.kv_connector_metadata
    assert type(scheduler.connector).__name__ == "KVBridgeConnector", type(scheduler.connector)
    assert len(meta.loads) == 1, meta
    load = meta.loads[0]
    worker.bind_connector_metadata(meta)
    worker.start_load_kv(None)
    worker.clear_connector_metadata()
    sent, received = worker.get_finished(set())
    result = {"groups": [list(g.layer_names) for g in config.kv_cache_groups],
              "block_ids": [list(ids) for ids in load.block_ids], "received": sorted(received or []),
              "status_after_schedule": str(request.status), "num_blocks": config.num_blocks,
              "layout": layout.name}
    from safetensors.torch import save_file

    # the one backing buffer every group overlays, and where each layer's blocks lie in it
    first = kv_caches[next(iter(specs))]
    raw = torch.empty(0, dtype=torch.uint8).set_(first.untyped_storage())
    result["layers"] = {name: {"offset": kv_caches[name].storage_offset() * kv_caches[name].element_size(),
                               "block_stride": kv_caches[name].stride(0) * kv_caches[name].element_size(),
                               "page_bytes": specs[name].page_size_bytes,
                               "same_buffer": kv_caches[name].untyped_storage().data_ptr() == raw.data_ptr()}
                        for name in specs}
    save_file({"raw": raw.clone()}, os.path.join(out_dir, "buffer.safetensors"))
    json.dump(result, open(os.path.join(out_dir, "result.json"), "w"))
    worker.shutdown()
    print("DONE", flush=True)


if __name__ == "__main__":
    main()
