"""kvbridge's vLLM connector under vLLM 0.33.0's own config, KV-cache grouping, allocation, connector factory
and scheduler (tests/vllm_engine_side.py, in the vLLM venv named by KVBRIDGE_VLLM_PYTHON), fed by a kvbridge
producer in this process over gloo from TensorRT-LLM-layout pools: every group's blocks must hold exactly
what vLLM's writers hold for the same latents, and every other byte of vLLM's caches must stay zero."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from kvbridge.adapters.vllm_layout import VllmCaches
from kvbridge.migration import gather_records, plan_migration, source_request, table_of
from kvbridge.migration.transport import send_request_tcp
from kvbridge.topology import from_hf_config
from tests.migration_helpers import expected_records

ROOT = Path(__file__).resolve().parent.parent
PYTHON = os.environ.get("KVBRIDGE_VLLM_PYTHON")
CONFIG = {"architectures": ["DeepseekV4ForCausalLM"], "model_type": "deepseek_v4", "hidden_size": 256,
          "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 1, "head_dim": 512,
          "qk_rope_head_dim": 64, "vocab_size": 1024, "max_position_embeddings": 4096, "intermediate_size": 512,
          "compress_ratios": [0, 0, 4, 128], "sliding_window": 128, "index_head_dim": 128, "index_n_heads": 4,
          "index_topk": 64, "num_nextn_predict_layers": 0, "torch_dtype": "bfloat16", "rms_norm_eps": 1e-6}


def _vllm_python() -> str:
    if PYTHON:
        return PYTHON
    if os.environ.get("CI") == "true":
        pytest.fail("KVBRIDGE_VLLM_PYTHON is unset: CI must run the vLLM adapter test (.ci/engine-vllm.sh)")
    pytest.skip("KVBRIDGE_VLLM_PYTHON (a vLLM 0.33.0 venv's python, see .ci/engine-vllm.sh) is unset")


@pytest.mark.parametrize("num_tokens", [600])
def test_vllm_scheduler_receives_trtllm_request(tmp_path, num_tokens):
    python = _vllm_python()
    model_dir = tmp_path / "dsv4-mini"
    model_dir.mkdir()
    (model_dir / "config.json").write_text(json.dumps(CONFIG))
    out = tmp_path / "out"
    out.mkdir()
    src = "trtllm:fp8:tpb=128:scale=0.5"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen([python, str(ROOT / "tests" / "vllm_engine_side.py"), str(model_dir), str(out), "req-7",
                             str(num_tokens), src], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        line = proc.stdout.readline()
        while line and not line.startswith("LISTEN"):
            line = proc.stdout.readline()
        assert line.startswith("LISTEN"), proc.stderr.read()[-4000:]
        _, host, port = line.split()
        model = from_hf_config(str(model_dir / "config.json"))
        plan = plan_migration(src, "vllm:block=256", model, num_tokens, include_mtp=False)
        src_pools, src_tables = source_request(plan, spare_pages=2, seed=3)
        summary = send_request_tcp(plan, src_pools, src_tables, host=host, port=int(port), request_id="req-7",
                                   timeout=120)
        stdout, stderr = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, stderr[-4000:]
    assert "DONE" in stdout
    assert summary["num_tokens"] == num_tokens
    result = json.loads((out / "result.json").read_text())
    assert result["received"] == ["vllm-req-0"]
    assert result["status_after_schedule"] == "WAITING_FOR_REMOTE_KVS"
    raw = load_file(str(out / "buffer.safetensors"))["raw"]
    assert raw.any(), "nothing was written"
    layers = result["layers"]
    assert all(info["same_buffer"] for info in layers.values())
    views = {name: raw.as_strided((result["num_blocks"], info["page_bytes"]), (info["block_stride"], 1),
                                  info["offset"]) for name, info in layers.items()}
    # vLLM's groups: per-layer SWA groups, compressed KV + indexer keys share one, the ratio-4 states one
    assert len(result["groups"]) >= 5, result["groups"]
    caches = VllmCaches(plan.dst, model, views, result["groups"])
    tables = caches.tables(result["block_ids"])
    written = torch.zeros(raw.numel(), dtype=torch.bool)
    for t in plan.transfers:
        want = expected_records(t, gather_records(src_pools.pool(t.spec), t.src, table_of(src_tables, t.src),
                                                  t.first, t.count))
        key = (t.spec.layer, t.spec.role)
        table = tables[caches.group[key]]
        got = gather_records(caches.pools.pool(t.spec), t.dst, table, t.first, t.count)
        assert torch.equal(got, want), f"layer {t.spec.layer} {t.spec.role.value}: bytes differ"
        info = layers[caches.names[key]]
        for slot in t.table_slots(t.dst):
            start = info["offset"] + table[slot] * info["block_stride"]
            written[start : start + info["page_bytes"]] = True
    assert not raw[~written].any(), "bytes outside the request's blocks of its own caches were written"
