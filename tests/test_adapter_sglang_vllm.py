"""An unmodified SGLang 0.5.23 prefill feeding the vLLM connector as its decode (transport ``sglang``, role
``kv_consumer``; issue 26 item 1).

SGLang's own prefill-side PD classes run in the SGLang venv (``tests/sglang_prefill_peer.py``:
``DeepSeekV4TokenToKVPool``, ``MetadataBuffers``, ``NixlKVBootstrapServer``, ``NixlKVManager`` in prefill mode
and one ``NixlKVSender`` per room, on CPU, rewriting only the compressor-state memory kinds SGLang hard-codes,
``sglang_engine_side.host_state_kinds``); vLLM 0.33.0's real config, KV-cache groups, allocation, connector
factory and scheduler run in the vLLM venv (``tests/vllm_engine_side.py sglang-consumer``). The requests'
``kv_transfer_params`` carry what SGLang's router sets (``bootstrap_host``, ``bootstrap_port``,
``bootstrap_room``); the connector's ``SGLangDecodePeer`` bootstraps, receives each room over NIXL into its
landing pools and writes it through vLLM's block ids. Every byte of vLLM's blocks must be kvbridge's direct
conversion of the SGLang pool (APE added to the compressor scores, as vLLM stores them), no other byte of vLLM's
KV buffer written, and the landing pages all free again.
"""

from __future__ import annotations

import json

import pytest

from kvbridge.engines.topology import from_hf_config
from kvbridge.migration import plan_migration, source_request
from tests.migration_helpers import need_sglang
from tests.test_adapter_sglang_decode import _prefill, _sglang_buffers, _stop, _until_result
from tests.test_adapter_vllm import (
    VLLM,
    _ape_file,
    _assert_landed,
    _engine,
    _finish,
    _model,
    _vllm_buffer,
    _vllm_python,
)
from tests.test_adapter_vllm_sglang import CONFIG5

#: The prefill's metadata rows of its rooms (``MetadataBuffers`` indices its scheduler would hand them).
ROOMS = {9001: 2, 9002: 3}


def _run(tmp_path, num_tokens: int, rooms: dict[int, int]):
    """SGLang's prefill holding one request of ``num_tokens`` (kvbridge's fixture-checked SGLang writers' bytes)
    under each of ``rooms`` (room -> metadata row), and a vLLM decode asking for all of them at once; returns
    the plan SGLang -> vLLM, the source pools and tables, the prefill's result and the engine side's."""
    python = _vllm_python("nixl")
    need_sglang("SGLang prefill -> vLLM decode test")
    model_dir = _model(tmp_path, CONFIG5)
    out = tmp_path / "out"
    model = from_hf_config(str(model_dir / "config.json"))
    ape = _ape_file(tmp_path / "ape.safetensors", model, seed=5)
    src, src_tables = source_request(plan_migration("sglang", "sglang", model, num_tokens, include_mtp=False), seed=3)
    pages = len(src_tables["full"])
    cfg = {"num_tokens": num_tokens, "compress_ratios": list(model.compress_ratios[:5]), "pages": pages + 2,
           "swa_pages": pages + 2, "kv_page_ids": list(range(1, 1 + len(src_tables["full"]))),
           "swa_page_ids": list(range(1, 1 + len(src_tables["swa"]) - max(0, num_tokens - 128) // 256)),
           "requests": [{"room": room, "aux_index": row} for room, row in rooms.items()]}
    rows = {row: room for room, row in rooms.items()}
    proc, next_line, layout = _prefill(cfg, tmp_path, lambda lay: _sglang_buffers(
        src, src_tables, lay, num_tokens, rows, kv_pages=cfg["kv_page_ids"], swa_pages=cfg["swa_page_ids"]))
    try:
        _finish(_engine(python, "sglang-consumer", "sglang", str(model_dir), str(out), str(num_tokens),
                        layout["bootstrap_addr"], ",".join(map(str, rooms)), f"ape={ape}"))
        prefill = _until_result(next_line)
    finally:
        _stop(proc)
    plan = plan_migration("sglang", VLLM, model, num_tokens, include_mtp=False, ape=ape)
    return plan, model, src, src_tables, prefill, layout["bootstrap_addr"], out


def test_sglang_prefill_feeds_a_vllm_decode_byte_exact(tmp_path, num_tokens=1026):
    """Two rooms at once from one SGLang prefill (1,026 tokens: the ratio-4 state rows 1022..1025 straddle the SWA
    page boundary at 1024, two rings): both land in their own vLLM blocks byte for byte as ``migrate_local``
    converts the SGLang pool, vLLM then computes each request's last prompt token, and the landing pages, rows
    and quarantine are empty again."""
    plan, model, src, src_tables, prefill, bootstrap, out = _run(tmp_path, num_tokens, ROOMS)
    assert prefill["result"] == "Success", prefill  # SGLang's senders reached KVPoll.Success, both rooms
    assert any(t.ape_sign > 0 for t in plan.transfers)
    result = json.loads((out / "result.json").read_text())
    assert result["errors"] == [] and result["failed"] == [], result["errors"]
    assert result["received"] == ["vllm-req-0", "vllm-req-1"]
    assert result["loads"] == {"vllm-req-0": ["sglang-room-9001", bootstrap, 9001, num_tokens],
                               "vllm-req-1": ["sglang-room-9002", bootstrap, 9002, num_tokens]}
    assert result["status_after_load"] == ["RUNNING", "RUNNING"]
    assert result["scheduled_after_load"] == {"vllm-req-0": 1, "vllm-req-1": 1}  # the last prompt token only
    assert result["stats"]["recv_requests"] == 2 and result["stats"]["recv_failed"] == 0
    assert result["landing_free"] == result["landing_capacity"] and result["quarantined"] == 0
    _, raw, caches = _vllm_buffer(out, plan, model, num_groups=6)
    _assert_landed(plan, src, src_tables, result, raw, caches, block_ids=list(result["block_ids"].values()))


def test_a_decode_request_names_its_prefill_as_sglang_router_does():
    """Without vLLM: the three fields SGLang's router sets (``sglang_source``), each refused by name when vLLM
    could not use it (the scheduler then logs it and vLLM computes the prompt itself)."""
    from kvbridge.adapters.vllm_config import sglang_source
    from kvbridge.errors import InputError

    good = {"bootstrap_host": "10.0.0.2", "bootstrap_port": 8998, "bootstrap_room": 2**63 - 1}
    assert sglang_source(good) == ("10.0.0.2:8998", 2**63 - 1)
    for change, field in (({"bootstrap_host": ""}, "bootstrap_host"), ({"bootstrap_port": "8998"}, "bootstrap_port"),
                          ({"bootstrap_port": 0}, "bootstrap_port"), ({"bootstrap_room": -1}, "bootstrap_room"),
                          ({"bootstrap_room": True}, "bootstrap_room"), ({"bootstrap_room": 2**63}, "bootstrap_room")):
        with pytest.raises(InputError, match=field):
            sglang_source({**good, **change})


def test_landing_pools_hold_the_pages_a_receive_claims():
    """Without SGLang: ``landing_pages`` is the most a request of up to N tokens holds while the decode peer lands
    it (every KV page, the window's SWA pages, one ratio-128 ring), the rule ``receive`` claims by."""
    from kvbridge.adapters.sglang_decode import claimed_pages, landing_pages
    from kvbridge.engines.profiles import parse_engine

    model, prof = from_hf_config(CONFIG5), parse_engine("sglang")
    assert landing_pages(prof, model, 1026) == {"full": 5, "swa": 2, "state128": 1}
    assert landing_pages(prof, model, 1) == {"full": 1, "swa": 1, "state128": 1}
    tables = {"full", "swa", "state128"}
    for n in range(1, 1300, 7):
        lengths, first_swa = claimed_pages(tables, 256, model.sliding_window, n)
        held = {k: v - (first_swa if k == "swa" else 0) for k, v in lengths.items()}
        most = landing_pages(prof, model, n)
        assert all(held[k] <= most[k] for k in held), n


if __name__ == "__main__":
    import sys

    sys.exit(pytest.main([__file__, "-v"]))
