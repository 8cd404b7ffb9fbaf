"""What the SGLang 0.5.23 engine sides (``sglang_decode_peer.py``, ``sglang_prefill_peer.py``) build alike,
run in the SGLang environment (not kvbridge's): the JSON-lines channel, SGLang's DeepSeek-V4 pool and
metadata buffers, and the ``KVArgs`` SGLang's scheduler fills for its NIXL manager.

Importing it points fd 1 at stderr (NIXL and SGLang log there) and keeps the original stdout as the
channel ``emit`` writes to.
"""

from __future__ import annotations

import json
import os

_OUT = os.fdopen(os.dup(1), "w")
os.dup2(2, 1)


def emit(**msg) -> None:
    """One JSON line on the channel."""
    _OUT.write(json.dumps(msg) + "\n")
    _OUT.flush()


def deepseek_v4_pool(cfg: dict):
    """SGLang's ``DeepSeekV4TokenToKVPool`` on CPU for ``cfg``'s ``compress_ratios``, ``page_size``, ``pages``
    (full-token pages), ``req_slots``, ``swa_pages``, ``sliding_window`` and ``state_dtype`` (fp32 | bf16)."""
    import torch
    from sglang.srt.mem_cache.deepseek_v4_memory_pool import DeepSeekV4TokenToKVPool

    ratios, page = cfg["compress_ratios"], cfg["page_size"]
    pages, slots, swa_pages = cfg["pages"], cfg["req_slots"], cfg["swa_pages"]
    state_dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[cfg.get("state_dtype", "fp32")]
    return DeepSeekV4TokenToKVPool(
        max_num_reqs=slots - 1, num_req_slots=slots, swa_size=swa_pages * page, c4_size=pages * page // 4,
        c128_size=pages * page // 128, c4_state_pool_size=swa_pages * 8, c128_state_pool_size=slots * 128,
        page_size=page, swa_page_size=page, sliding_window=cfg["sliding_window"], dtype=torch.float8_e4m3fn,
        c4_state_dtype=state_dtype, c128_state_dtype=state_dtype, qk_nope_head_dim=448, qk_rope_head_dim=64,
        indexer_head_dim=128, layer_num=len(ratios), device="cpu", enable_memory_saver=False,
        compression_ratios=ratios, start_layer=0, end_layer=len(ratios))


def metadata_buffers(cfg: dict, kv_checksum: bool = False):
    """``MetadataBuffers`` as SGLang's scheduler builds them without speculative decoding: ``aux_rows`` rows,
    a 16-value fp32 hidden-state row; with ``kv_checksum`` the checksum row too."""
    import torch
    from sglang.srt.disaggregation.utils import MetadataBuffers

    return MetadataBuffers(cfg["aux_rows"], hidden_size=16, hidden_states_dtype=torch.float32,
                           max_sampling_mask_tokens=1, kv_checksum_enabled=kv_checksum)


def nixl_kv_args(cfg: dict, pool, meta, *, prefill: bool):
    """The ``KVArgs`` of one rank (no PP, no draft model) with every KV and metadata buffer registered as DRAM,
    as SGLang's scheduler fills them (``get_kv_transfer_buf_infos``, ``setup_state_kv_args``,
    ``get_pd_kv_layout``); a prefill also names its layer range."""
    from sglang.srt.disaggregation.utils import (
        KVClassType,
        TransferBackend,
        build_kv_layer_ids,
        get_kv_class,
        get_kv_transfer_buf_infos,
        get_pd_kv_layout,
        setup_state_kv_args,
    )

    layers = len(cfg["compress_ratios"])
    kv_args = get_kv_class(TransferBackend.NIXL, KVClassType.KVARGS)()
    kv_args.engine_rank = 0
    kv_args.pp_rank = 0
    kv_args.system_dp_rank = 0
    if prefill:
        kv_args.prefill_start_layer = 0
        kv_args.prefill_end_layer = layers
    kv_args.kv_cache_dtype_str = cfg["kv_cache_dtype"]
    kv_args.kv_layout = get_pd_kv_layout(pool)
    kv_args.kv_data_ptrs, kv_args.kv_data_lens, kv_args.kv_item_lens = get_kv_transfer_buf_infos(pool)
    kv_args.kv_data_mem_kinds = ["DRAM"] * len(kv_args.kv_data_ptrs)
    kv_args.num_draft_entries = 0
    kv_args.kv_layer_ids = build_kv_layer_ids(token_to_kv_pool=pool, draft_token_to_kv_pool=None,
                                              num_draft_entries=0, num_hidden_layers=layers)
    kv_args.page_size = pool.page_size
    kv_args.aux_data_ptrs, kv_args.aux_data_lens, kv_args.aux_item_lens = meta.get_buf_infos()
    setup_state_kv_args(kv_args, pool, None, total_kv_layers=layers, req_to_token_pool=None)
    kv_args.ib_device = None
    kv_args.gpu_id = 0
    return kv_args


def host_state_kinds(kv_args) -> None:
    """The one change these CPU runs make to SGLang 0.5.23: the memory kind it hard-codes for the
    DeepSeek-V4 compressor-state buffers, which is VRAM whatever their device, becomes DRAM, the kind
    of the host memory they are here (UCX without CUDA refuses VRAM registration, and NIXL finds no
    VRAM descriptor for a DRAM region). Two places, both in ``disaggregation/nixl/conn.py``:

    - ``register_buffer_to_engine`` (line 2023): ``self.agent.register_memory(state_addrs, "VRAM")``;
      only a call whose descriptors are all state buffers of ``kv_args`` is changed;
    - the state writes of ``send_kvcache`` (line 3214, ``self._send_kvcache_generic(...)`` for
      ``StateType.SWA`` / ``DSV4_REQUEST_STATE``), made with that function's defaults
      ``src_mem_kind="VRAM", dst_mem_kind="VRAM"`` (lines 2099-2100); only a call with a state type
      and no memory kind given is changed.

    KV and metadata buffers keep the kinds SGLang takes from ``kv_data_mem_kinds`` and the
    registration message (what the peer announced); on CUDA, SGLang's prepared state plan
    (lines 862-865, CUDA only) is VRAM too, and no rewrite is needed as the state is device memory."""
    from nixl._api import nixl_agent
    from sglang.srt.disaggregation.base.conn import StateType
    from sglang.srt.disaggregation.nixl.conn import NixlKVManager

    state_ptrs = {p for comp in kv_args.state_data_ptrs or [] for p in comp if p}
    register_memory, send = nixl_agent.register_memory, NixlKVManager._send_kvcache_generic

    def register(self, descs, mem_type=None, *a, **k):
        if mem_type == "VRAM" and descs and all(d[0] in state_ptrs for d in descs):
            mem_type = "DRAM"
        return register_memory(self, descs, mem_type, *a, **k)

    def send_state(self, *a, **k):
        if (k.get("state_type") in (StateType.SWA, StateType.DSV4_REQUEST_STATE) and "src_mem_kind" not in k
                and "dst_mem_kind" not in k):
            k.update(src_mem_kind="DRAM", dst_mem_kind="DRAM")
        return send(self, *a, **k)

    nixl_agent.register_memory = register
    NixlKVManager._send_kvcache_generic = send_state
