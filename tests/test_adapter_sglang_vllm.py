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
import time

import pytest
import torch

from kvbridge.engines.topology import from_hf_config
from kvbridge.migration import plan_migration, source_request
from tests.migration_helpers import need_sglang
from tests.test_adapter_sglang_decode import _launch, _prefill, _sglang_buffers, _stop, _until_result
from tests.test_adapter_vllm import (
    VLLM,
    _ape_file,
    _engine,
    _finish,
    _model,
    _vllm_buffer,
    _vllm_python,
    check_landed,
)
from tests.test_adapter_vllm_sglang import CONFIG5

#: The prefill's metadata rows of its rooms (``MetadataBuffers`` indices its scheduler would hand them).
ROOMS = {9001: 2, 9002: 3}
#: A third room of that prefill, which the vLLM decode holds whole in its prefix cache (its 1,300-token prompt
#: computed by vLLM itself first: a 1,280-token hit, past the room's 1,026 tokens), and its metadata row there.
WHOLE_ROOM, WHOLE_ROW, WHOLE_PROMPT = 9003, 1, 1300


class _Prefill:
    """One SGLang prefill process holding a request of ``num_tokens`` (kvbridge's fixture-checked SGLang writers'
    bytes, seeded) under each of ``rooms`` (room -> metadata row); ``cfg`` adds to its config (``die_after_pages``:
    it stalls after that many KV pages, to be killed)."""

    def __init__(self, tmp_path, model, num_tokens: int, rooms: dict[int, int], seed: int, name: str, **cfg):
        plan = plan_migration("sglang", "sglang", model, num_tokens, include_mtp=False)
        self.num_tokens, self.rooms = num_tokens, rooms
        self.src, self.src_tables = source_request(plan, seed=seed)
        pages = -(-num_tokens // 256)  # SGLang's prefill sends every page of the prompt
        # the prefill waits this long for the decode (a vLLM engine starting on a loaded machine)
        self.cfg = {"num_tokens": num_tokens, "timeout": 300, "compress_ratios": list(model.compress_ratios[:5]),
                    "pages": pages + 2,
                    "swa_pages": pages + 2, "kv_page_ids": list(range(1, 1 + pages)),
                    "swa_page_ids": list(range(1, 1 + pages - max(0, num_tokens - model.sliding_window) // 256)),
                    "requests": [{"room": room, "aux_index": row} for room, row in rooms.items()], **cfg}
        self.launched = _launch(self.cfg, tmp_path, name)
        self.tmp_path = tmp_path

    def start(self) -> str:
        """Fill SGLang's buffers and serve; the bootstrap address."""
        rows = {row: room for room, row in self.rooms.items()}
        self.proc, self.next_line, layout = _prefill(self.cfg, self.tmp_path, lambda lay: _sglang_buffers(
            self.src, self.src_tables, lay, self.num_tokens, rows, kv_pages=self.cfg["kv_page_ids"],
            swa_pages=self.cfg["swa_page_ids"]), launched=self.launched)
        self.addr = layout["bootstrap_addr"]
        return self.addr

    def specs(self) -> list[str]:
        return [f"{self.num_tokens}@{self.addr}#{room}" for room in self.rooms]


def _setup(tmp_path):
    python = _vllm_python("nixl")
    need_sglang("SGLang prefill -> vLLM decode test")
    model_dir = _model(tmp_path, CONFIG5)
    model = from_hf_config(str(model_dir / "config.json"))
    return python, model_dir, model, _ape_file(tmp_path / "ape.safetensors", model, seed=5)


def _assert_all_landed(prefills, model, ape, out, result) -> None:
    """Each prefill's rooms landed in their vLLM blocks byte for byte as ``migrate_local`` converts its SGLang
    pool (APE added to the compressor scores), and no other byte of vLLM's KV buffer was written."""
    some = plan_migration("sglang", VLLM, model, prefills[0].num_tokens, include_mtp=False, ape=ape)
    _, raw, caches = _vllm_buffer(out, some, model, num_groups=6)
    written = torch.zeros(raw.numel(), dtype=torch.bool)
    for pre in prefills:
        plan = plan_migration("sglang", VLLM, model, pre.num_tokens, include_mtp=False, ape=ape)
        for rid, (_, addr, room, _) in result["loads"].items():
            if addr == pre.addr and room in pre.rooms and rid in result["received"] and rid not in result["failed"]:
                check_landed(plan, pre.src, pre.src_tables, result["block_ids"][rid], result, caches, written)
    assert not raw[~written].any(), "bytes outside the requests' blocks of their own caches were written"


def test_sglang_prefill_feeds_a_vllm_decode_byte_exact(tmp_path, num_tokens=1026):
    """Two rooms at once from one SGLang prefill (1,026 tokens: the ratio-4 state rows 1022..1025 straddle the SWA
    page boundary at 1024, two rings): both land in their own vLLM blocks byte for byte as ``migrate_local``
    converts the SGLang pool, vLLM then computes each request's last prompt token, and the landing pages, rows
    and quarantine are empty again. A third room of the prefill, whole in vLLM's prefix cache, is declined: the
    prefill's own sender concludes it ``KVPoll.Success`` (not at its bootstrap timeout), with nothing written into
    vLLM's blocks (they stay as vLLM computed them) and no landing page or metadata row claimed for it."""
    python, model_dir, model, ape = _setup(tmp_path)
    out = tmp_path / "out"
    pre = _Prefill(tmp_path, model, num_tokens, {**ROOMS, WHOLE_ROOM: WHOLE_ROW}, seed=3, name="prefill")
    bootstrap = pre.start()
    try:
        specs = [*pre.specs()[:2], f"{pre.specs()[2]}~{WHOLE_PROMPT}"]
        _finish(_engine(python, "sglang-consumer", "sglang", str(model_dir), str(out), ",".join(specs),
                        f"ape={ape}"))
        prefill = _until_result(pre.next_line)
    finally:
        _stop(pre.proc)
    # SGLang's senders reached KVPoll.Success, all three rooms (the third without a transfer: SGLang's
    # transfer worker posts no write for a dummy decode, then concludes the room)
    assert prefill["result"] == "Success", prefill
    result = json.loads((out / "result.json").read_text())
    assert result["errors"] == [] and result["failed"] == [], result["errors"]
    assert result["received"] == ["vllm-req-0", "vllm-req-1"]
    assert result["loads"] == {"vllm-req-0": ["sglang-room-9001", bootstrap, 9001, num_tokens],
                               "vllm-req-1": ["sglang-room-9002", bootstrap, 9002, num_tokens]}
    assert result["declines"] == [[bootstrap, WHOLE_ROOM]]  # the whole hit: no load, its prefill told
    assert result["finished"] == ["FINISHED_LENGTH_CAPPED"] * 3  # two tokens each, decoded by vLLM
    # the last prompt token only; the whole hit computes its prompt past vLLM's 1,280-token hit
    assert result["scheduled_after_load"] == {"vllm-req-0": 1, "vllm-req-1": 1, "vllm-req-2": WHOLE_PROMPT - 1280}
    assert result["stats"]["recv_requests"] == 2 and result["stats"]["recv_failed"] == 0
    assert result["landing_free"] == result["landing_capacity"] and result["quarantined_after_load"] == 0
    assert result["aux_free"][0] == result["aux_free"][1]
    assert any(t.ape_sign > 0 for t in plan_migration("sglang", VLLM, model, num_tokens, include_mtp=False,
                                                      ape=ape).transfers)
    _assert_all_landed([pre], model, ape, out, result)


def test_requests_of_every_page_phase_from_four_prefills_at_once(tmp_path):
    """1, 129, 257 and 2,050 tokens (one token; past the 128-token window and a ratio-128 block; past a page;
    nine pages, the window across a page boundary), each from its own SGLang prefill, all four received at once
    (``max_inflight`` 4): each lands byte for byte and nothing else is written."""
    python, model_dir, model, ape = _setup(tmp_path)
    out = tmp_path / "out"
    prefills = [_Prefill(tmp_path, model, n, {7000 + k: k}, seed=20 + k, name=f"prefill{k}")
                for k, n in enumerate((1, 129, 257, 2050))]
    try:
        for pre in prefills:
            pre.start()
        _finish(_engine(python, "sglang-consumer", "sglang", str(model_dir), str(out),
                        ",".join(spec for pre in prefills for spec in pre.specs()), f"ape={ape}"))
        results = [_until_result(pre.next_line) for pre in prefills]
    finally:
        for pre in prefills:
            if hasattr(pre, "proc"):
                _stop(pre.proc)
    assert [r["result"] for r in results] == ["Success"] * 4, results
    result = json.loads((out / "result.json").read_text())
    assert result["errors"] == [] and result["failed"] == [], result["errors"]
    assert result["received"] == [f"vllm-req-{k}" for k in range(4)]
    assert [v[3] for v in result["loads"].values()] == [1, 129, 257, 2050]
    assert result["scheduled_after_load"] == {f"vllm-req-{k}": 1 for k in range(4)}
    assert result["finished"] == ["FINISHED_LENGTH_CAPPED"] * 4
    assert result["landing_free"] == result["landing_capacity"] and result["quarantined"] == 0
    _assert_all_landed(prefills, model, ape, out, result)


def test_a_prefill_killed_mid_transfer_fails_its_request_within_the_bound(tmp_path):
    """A prefill SIGKILLed after its first two KV pages: the connector's decode peer notices within
    ``dead_within`` (4 s: two failed ``/health`` probes a second apart) and the request fails through
    ``failed_recving`` (vLLM's ``fail`` policy ends it) while another prefill's room, received at the same time,
    lands byte for byte; the dead room's landing pages stay quarantined until a heartbeat after it was declared
    dead (its writes cannot land any more), then all landing pages are free again."""
    python, model_dir, model, ape = _setup(tmp_path)
    out = tmp_path / "out"
    dying = _Prefill(tmp_path, model, 1026, {9101: 0}, seed=30, name="dying", die_after_pages=2)
    alive = _Prefill(tmp_path, model, 129, {9102: 1}, seed=31, name="alive")
    try:
        dying.start()
        alive.start()
        engine = _engine(python, "sglang-consumer", "sglang", str(model_dir), str(out),
                         ",".join([*dying.specs(), *alive.specs()]), f"ape={ape}")
        assert dying.next_line()["event"] == "sending"
        assert dying.next_line()["event"] == "partial"
        dying.proc.kill()
        killed_at = time.time()
        _finish(engine)
        alive_result = _until_result(alive.next_line)
    finally:
        dying.proc.kill()
        _stop(alive.proc)
    assert alive_result["result"] == "Success", alive_result
    result = json.loads((out / "result.json").read_text())
    assert result["failed"] == ["vllm-req-0"] and result["received"] == ["vllm-req-0", "vllm-req-1"]
    assert len(result["errors"]) == 1 and "died mid-transfer" in result["errors"][0], result["errors"]
    # the bound, plus the engine side's step loop (50 ms) and this loaded 2-core machine's scheduling
    assert result["failed_at"]["vllm-req-0"] - killed_at <= result["dead_within"] + 2.0, result["failed_at"]
    assert result["finished"] == ["FINISHED_ERROR", "FINISHED_LENGTH_CAPPED"]
    assert result["quarantined_after_load"] == 1 and result["quarantined"] == 0
    assert result["landing_free"] == result["landing_capacity"]
    assert result["stats"]["recv_requests"] == 1 and result["stats"]["recv_failed"] == 1
    _assert_all_landed([alive], model, ape, out, result)


def test_after_a_killed_prefill_the_next_room_lands_on_its_reclaimed_pages(tmp_path):
    """A connector whose landing pools hold one 1,026-token request (``max_inflight`` 1, ``landing_tokens``
    1,026): its prefill SIGKILLed after two KV pages, the room fails within the bound and its pages (and its
    metadata row) stay quarantined; once a heartbeat passed they are reclaimed, and the next room, from a prefill
    that lives, can only land on them: it does, byte for byte, and every landing page is free again."""
    python, model_dir, model, ape = _setup(tmp_path)
    out = tmp_path / "out"
    dying = _Prefill(tmp_path, model, 1026, {9201: 0}, seed=32, name="dying", die_after_pages=2)
    nxt = _Prefill(tmp_path, model, 1026, {9202: 1}, seed=33, name="next")
    try:
        dying.start()
        nxt.start()
        engine = _engine(python, "sglang-consumer", "sglang", str(model_dir), str(out), ",".join(dying.specs()),
                         f"ape={ape}", "max_inflight=1", "landing_tokens=1026", f"then={nxt.specs()[0]}")
        assert dying.next_line()["event"] == "sending"
        assert dying.next_line()["event"] == "partial"
        dying.proc.kill()
        killed_at = time.time()
        _finish(engine)
        next_result = _until_result(nxt.next_line)
    finally:
        dying.proc.kill()
        _stop(nxt.proc)
    assert next_result["result"] == "Success", next_result
    result = json.loads((out / "result.json").read_text())
    assert result["failed"] == ["vllm-req-0"] and result["received"] == ["vllm-req-0", "vllm-req-1"]
    assert len(result["errors"]) == 1 and "died mid-transfer" in result["errors"][0], result["errors"]
    assert result["failed_at"]["vllm-req-0"] - killed_at <= result["dead_within"] + 2.0, result["failed_at"]
    # the dead room's pages were quarantined, then reclaimed: the pools held exactly one request again
    assert result["next"]["quarantined_before"] == 1 and result["next"]["quarantined"] == 0
    assert result["next"]["free"] == result["landing_capacity"] == {"full": 5, "swa": 2, "state128": 1}
    assert result["finished"] == ["FINISHED_ERROR", "FINISHED_LENGTH_CAPPED"]
    assert result["quarantined"] == 0 and result["landing_free"] == result["landing_capacity"]
    assert result["aux_free"] == [1, 1]
    assert result["stats"]["recv_requests"] == 1 and result["stats"]["recv_failed"] == 1
    _assert_all_landed([nxt], model, ape, out, result)


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
