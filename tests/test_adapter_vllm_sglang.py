"""The vLLM connector as the prefill of SGLang 0.5.23's own decode (transport ``sglang``; issue 26 item 2).

vLLM 0.33.0's real config, KV-cache groups, allocation and scheduler run in the vLLM venv
(``tests/vllm_engine_side.py sglang-producer``); SGLang's own decode-side PD classes run in the SGLang
venv (``tests/sglang_decode_peer.py``: ``DeepSeekV4TokenToKVPool``, ``MetadataBuffers``, ``NixlKVManager``,
``NixlKVReceiver`` and ``NixlKVBootstrapServer``, on CPU, rewriting only the compressor-state memory kinds
SGLang hard-codes, ``sglang_engine_side.host_state_kinds``). Each request's blocks in vLLM, filled as vLLM's
writers store them, must land in SGLang's registered buffers, at the pages its decode allocated, byte for
byte as kvbridge's direct conversion (``migrate_local``) of the same vLLM blocks into fresh SGLang pools
writes them, with vLLM's sampled token and the room in the request's metadata row.
"""

from __future__ import annotations

import json
import os
import subprocess
import time

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from kvbridge.engines.topology import Role, from_hf_config
from kvbridge.migration import destination_pools, gather_records, migrate_local, plan_migration
from tests.migration_helpers import free_port, need_sglang
from tests.test_adapter_sglang import STATE_MEMORY, _decode, _until
from tests.test_adapter_vllm import (
    CONFIG,
    ROOT,
    VLLM,
    _ape_file,
    _engine,
    _finish,
    _model,
    _vllm_buffer,
    _vllm_python,
)

#: Five layers as ``FLASH.with_layers(5)`` (ratios 0, 0, 4, 128, 4; a 128-token window), in vLLM's config.
CONFIG5 = {**CONFIG, "num_hidden_layers": 5, "compress_ratios": [0, 0, 4, 128, 4]}
SGLANG = "sglang"
#: The rooms SGLang's decode receives at once: (tokens, room, its KV pages, SWA pages, request slot, metadata
#: row there). 1 token; 129 (past the 128-token window and a ratio-128 block); 257 (past a page); 1,026 (the
#: ratio-4 state rows 1022..1025 straddle the SWA page boundary at 1024: two rings); 2,050 (nine pages, the
#: window across a page boundary). The page ids are scattered, page 0 included, as a busy allocator hands them.
ROOMS = ((1, 4201, [13], [4], 1, 0), (129, 4202, [1], [10], 3, 1), (257, 4203, [16, 6], [12, 8], 4, 2),
         (1026, 4242, [7, 0, 11, 3, 5], [9, 2], 2, 3),
         (2050, 4205, [18, 14, 2, 17, 9, 15, 8, 12, 10], [14, 1], 5, 4))
#: A sixth room, received at the same time from a second vLLM producer that serves its own bootstrap route, paces
#: its writes (``max_send_rate``: the room takes about ``DYING_SECONDS``) and is SIGKILLed once the decode saw the
#: first bytes of the room's first KV page: (tokens, room, KV pages, SWA pages, request slot, metadata row).
DYING = (1026, 4266, [21, 4, 19, 23, 20], [3, 11], 6, 5)
DYING_SECONDS = 4.0
#: SGLang 0.5.23's decode defaults (``environ.py``): a ``/health`` probe of each prefill's bootstrap address every
#: ``SGLANG_DISAGGREGATION_HEARTBEAT_INTERVAL`` s (5; at least 2), the prefill dead after
#: ``SGLANG_DISAGGREGATION_HEARTBEAT_MAX_FAILURE`` (2) failed probes in a row: a room is failed 5..10 s after its
#: prefill died (``common/conn.py`` ``CommonKVManager._start_heartbeat_checker_thread``, ``_handle_node_failure``).
HEARTBEAT_S, MAX_FAILURES = 5.0, 2
KV_PAGES, SWA_PAGES = 24, 16  # the decode's pool sizes, in pages


def _room_bytes(model, n: int) -> int:
    """The bytes kvbridge's prefill peer writes for an ``n``-token room: the KV pages holding a complete compressed
    entry, the window's SWA pages of every SWA-page buffer, the ratio-128 ring (``SGLangPrefillPeer._send``)."""
    from kvbridge.adapters.sglang_protocol import pd_layout

    plan = plan_migration(SGLANG, SGLANG, model, n, include_mtp=False)
    dst = destination_pools(plan, spare_pages=1)
    lay, lengths = pd_layout(dst), plan.table_lengths("dst")
    pages = -(-n // 256)
    swa = pages - max(0, n - model.sliding_window) // 256
    return (sum(item * min(lengths[dst.storage(spec).table], pages) for spec, item in zip(lay.kv, lay.kv_item_lens,
                                                                                          strict=True))
            + swa * sum(lay.state_item_lens[0]) + sum(lay.state_item_lens[1]))


def _dying_producer(python: str, model_dir, out, port: int, state_memory: str, ape, rate: int, log):
    """The second vLLM producer (``DYING``), its stderr to ``log`` (nobody reads its pipes before it is killed)."""
    out.mkdir()
    return subprocess.Popen([python, str(ROOT / "tests" / "vllm_engine_side.py"), "sglang-producer", "sglang",
                             str(model_dir), str(out), str(DYING[0]), str(DYING[1]), f"bootstrap=127.0.0.1:{port}",
                             f"state_memory={state_memory}", f"ape={ape}", f"max_send_rate={rate}"],
                            stdout=subprocess.DEVNULL, stderr=open(log, "w"),
                            env={**os.environ, "PYTHONPATH": str(ROOT)})


def test_vllm_producer_feeds_an_sglang_decode_byte_exact(tmp_path):
    """vLLM's real blocks -> SGLang's own decode classes, five rooms of every page phase at once (``ROOMS``):
    every KV page, SWA page, compressor-state ring and the ratio-128 ring of each as ``migrate_local`` converts
    them (APE removed from the state scores: SGLang stores them without it), each metadata row with its
    request's first sampled token and room, no page the decode did not allocate written; vLLM holds each
    request's blocks until the decode received its room, then frees them, and the peer's pages return to its
    pools.

    At the same time the decode receives a sixth room (``DYING``) from a second vLLM producer serving its own
    bootstrap route, SIGKILLed once the room's first bytes landed: SGLang's decode fails that room through its
    heartbeat ("Lost connection with prefill instance") within ``HEARTBEAT_S * MAX_FAILURES`` of the kill, and
    its metadata row and ratio-128 ring (written last) never arrive; the five rooms land as above."""
    python = _vllm_python("nixl")
    need_sglang("vLLM -> SGLang decode test")
    model_dir = _model(tmp_path, CONFIG5)
    out = tmp_path / "out"
    model = from_hf_config(str(model_dir / "config.json"))
    assert model.compress_ratios[:5] == (0, 0, 4, 128, 4) and model.sliding_window == 128
    ape = _ape_file(tmp_path / "ape.safetensors", model, seed=5)
    port, dying_port = free_port(), free_port()
    requests = [{"room": room, "num_tokens": n, "kv_page_ids": kv, "swa_page_ids": swa, "req_pool_idx": slot,
                 "aux_index": row} for n, room, kv, swa, slot, row in (*ROOMS, DYING)]
    requests[-1]["bootstrap_addr"] = f"127.0.0.1:{dying_port}"
    rate = int(_room_bytes(model, DYING[0]) / DYING_SECONDS)
    proc, next_line = _decode({"bootstrap": "sglang", "bootstrap_port": port, "compress_ratios": [0, 0, 4, 128, 4],
                               "pages": KV_PAGES, "swa_pages": SWA_PAGES, "req_slots": 7, "aux_rows": 6,
                               "requests": requests, "watch": DYING[1], "dump_failed": True,
                               "timeout": 300}, tmp_path)  # two vLLM engines starting on a loaded machine
    dying = None
    try:
        _until(next_line, "event", "ready")
        dying = _dying_producer(python, model_dir, tmp_path / "out-dying", dying_port, STATE_MEMORY, ape, rate,
                                tmp_path / "dying.log")
        engine = _engine(python, "sglang-producer", "sglang", str(model_dir), str(out),
                         ",".join(str(r[0]) for r in ROOMS), ",".join(str(r[1]) for r in ROOMS),
                         f"register_with=127.0.0.1:{port}", f"state_memory={STATE_MEMORY}", f"ape={ape}")
        sent_ids = _until(next_line, "event", "metadata")["state_indices"]
        _until(next_line, "event", "partial")
        dying.kill()  # the process of the connector's worker, its SGLangPrefillPeer and bootstrap route
        killed_at = time.time()
        dying.wait(30)
        _finish(engine)
        got = _until(next_line, "result")
    finally:
        if dying is not None and dying.poll() is None:
            dying.kill()
        proc.wait(60)
    assert got["result"] == "Failed", got
    assert got["rooms"] == {**{str(r[1]): "Success" for r in ROOMS}, str(DYING[1]): "Failed"}, got
    assert got["reasons"][str(DYING[1])] == f"Lost connection with prefill instance (bootstrap_addr: " \
        f"127.0.0.1:{dying_port})", got["reasons"]
    detected = got["ended_at"][str(DYING[1])] - killed_at
    print(f"dead producer's room failed {detected:.2f} s after the kill")
    # the bound, plus a probe's own time and this loaded 2-core machine's scheduling
    assert 0 < detected <= HEARTBEAT_S * MAX_FAILURES + 2.0, detected
    result = json.loads((out / "result.json").read_text())
    rids = [f"vllm-req-{k}" for k in range(len(ROOMS))]
    assert result["status_after_prefill"] == dict.fromkeys(rids, "FINISHED_LENGTH_CAPPED")
    assert result["held_after_finish"] == dict.fromkeys(rids, True)
    assert sorted(result["sends"]) == sorted([rid, r[1], 5 + k, r[0]] for k, (rid, r) in enumerate(zip(rids, ROOMS,
                                                                                                    strict=True)))
    assert result["sent"] == rids and result["errors"] == [] and result["freed_after_send"] == dict.fromkeys(rids, True)
    assert result["stats"]["send_requests"] == len(ROOMS) and result["stats"]["send_failed"] == 0
    assert result["peer_free"] == result["peer_capacity"], "the peer's pages were not returned"

    from kvbridge.adapters.sglang_protocol import pd_layout

    dump = np.load(got["dump"])

    def page(name: str, item: int, i: int) -> bytes:
        return dump[name][i * item : (i + 1) * item].tobytes()

    checked, roles = 0, set()
    for k, (n, room, kv_pages, swa_pages, _, row) in enumerate(ROOMS):
        rid = rids[k]
        # kvbridge's direct conversion of the same vLLM blocks into SGLang pools
        plan = plan_migration(VLLM, SGLANG, model, n, include_mtp=False, ape=ape)
        assert any(t.ape_sign < 0 for t in plan.transfers)
        _, _, caches = _vllm_buffer(out, plan, model, num_groups=6)
        records = load_file(str(out / f"records-{rid}.safetensors"))
        vtables = caches.tables(result["block_ids"][rid])
        for i, t in enumerate(plan.transfers):  # vLLM's blocks hold what its writers stored
            held = gather_records(caches.pools.pool(t.spec), t.src,
                                  vtables[caches.group[(t.spec.layer, t.spec.role)]], t.first, t.count)
            assert torch.equal(held, records[str(i)]), f"{n} tokens: layer {t.spec.layer} {t.spec.role.value}"
        vpools, vreq = caches.request_pools(plan, result["block_ids"][rid])
        dst = destination_pools(plan, spare_pages=2)
        tables, _ = migrate_local(plan, vpools, vreq, dst, loss_report=False)
        lay = pd_layout(dst)

        def ours(spec, pid: int) -> bytes:
            return dst.pool(spec)[pid].numpy().tobytes()  # noqa: B023 (this room's pools)

        for i, spec in enumerate(lay.kv):
            table = tables[dst.storage(spec).table]
            for j, d in enumerate(kv_pages[: len(table)]):
                assert page(f"kv{i}", lay.kv_item_lens[i], d) == ours(spec, table[j]), (n, spec, j)
                checked += 1
        first = max(0, n - model.sliding_window) // 256
        assert sent_ids[k][0] == swa_pages  # the window's SWA pages, as SGLang's decode sent them
        for j, spec in enumerate(lay.swa_state):
            for i, d in enumerate(swa_pages):
                assert page(f"state0_{j}", lay.state_item_lens[0][j], d) == ours(spec, tables["swa"][first + i]), \
                    (n, spec, i)
                checked += 1
        (ring,) = sent_ids[k][1]  # the request slot's ratio-128 ring
        for j, spec in enumerate(lay.request_state):
            want = ours(spec, tables[dst.storage(spec).table][0])
            assert page(f"state1_{j}", lay.state_item_lens[1][j], ring) == want, (n, spec)
            checked += 1
        roles |= {s.role for s in (*lay.kv, *lay.swa_state, *lay.request_state)}
        assert int(dump["aux0"].view("<i4").reshape(-1, 16)[row, 0]) == 5 + k  # vLLM's first sampled token
        assert int(dump["aux9"].view("<u8").reshape(-1, 8)[row, 0]) == room
    for i, item in enumerate(lay.kv_item_lens):
        for d in set(range(KV_PAGES)) - {p for r in (*ROOMS, DYING) for p in r[2]}:
            assert not dump[f"kv{i}"].reshape(-1, item)[d].any(), "a page the decode did not allocate"
    # the dead room: its first KV page landed, its ratio-128 ring and metadata row (written last) never did
    assert dump["kv0"].reshape(-1, lay.kv_item_lens[0])[DYING[2][0]].any()
    (ring,) = sent_ids[-1][1]
    for j, item in enumerate(lay.state_item_lens[1]):  # as SGLang's decode cleared it before asking for the room
        assert np.array_equal(dump[f"state1_{j}"].reshape(-1, item)[ring], dump[f"watch_state1_{j}"]), \
            "the dead room's ring arrived"
    for name in (k for k in dump.files if k.startswith("aux")):
        assert not dump[name].reshape(6, -1)[DYING[5]].any(), f"the dead room's metadata row arrived ({name})"
    assert roles == {Role.SWA, Role.COMPRESS, Role.INDEXER, Role.STATE, Role.INDEXER_STATE}
    # KV pages holding a complete compressed entry (none for 1 token; 5 buffers: compressed KV of layers 2..4,
    # indexer keys of layers 2 and 4), the window's SWA pages (9 buffers: the SWA KV of 5 layers, the compressor
    # and indexer-compressor state rings of layers 2 and 4), the ratio-128 ring (1 buffer: layer 3's state)
    assert checked == 5 * (0 + 1 + 1 + 4 + 8) + 9 * (1 + 1 + 2 + 2 + 2) + 1 * 5, checked


def test_kv_transfer_config_sglang_keys():
    """Without vLLM: the transport-sglang keys (``kvbridge vllm-config``), and the combinations refused at start
    with one line (the connector runs the same ``check_sglang_keys``)."""
    from click.testing import CliRunner

    from cli.main import cli
    from kvbridge.adapters.vllm_config import check_sglang_keys, kv_transfer_config
    from kvbridge.errors import InputError

    cfg = kv_transfer_config("producer", transport="sglang", register_with="10.0.0.2:8998", state_memory="DRAM")
    assert cfg["kv_role"] == "kv_producer"
    assert cfg["kv_connector_extra_config"] == {"transport": "sglang", "register_with": "10.0.0.2:8998",
                                                "state_memory": "DRAM"}
    assert kv_transfer_config("producer", transport="sglang", bootstrap="0.0.0.0:8998",
                              sglang_engine="sglang:swa=256")["kv_connector_extra_config"]["sglang_engine"] == \
        "sglang:swa=256"
    assert kv_transfer_config("producer", transport="sglang", landing_tokens=4096)["kv_connector_extra_config"] == {
        "transport": "sglang", "landing_tokens": 4096}  # the longest request its SGLang pools hold
    with pytest.raises(InputError, match="one of them: got kv_both"):
        kv_transfer_config("both", transport="sglang")
    # a decode fed by an SGLang prefill: the prefill's keys are refused, its spec and landing size taken
    cfg = kv_transfer_config("consumer", transport="sglang", sglang_engine="sglang:swa=256", landing_tokens=4096)
    assert cfg["kv_connector_extra_config"] == {"transport": "sglang", "sglang_engine": "sglang:swa=256",
                                                "landing_tokens": 4096}
    for key in ("bootstrap", "register_with", "state_memory"):
        with pytest.raises(InputError, match=f"{key}: keys of a prefill"):
            kv_transfer_config("consumer", transport="sglang", **{key: "DRAM" if key == "state_memory" else "h:1"})
    assert kv_transfer_config("producer", transport="sglang", max_send_rate=10**9)["kv_connector_extra_config"] == {
        "transport": "sglang", "max_send_rate": 10**9}
    with pytest.raises(InputError, match="max_send_rate.*must be a positive integer"):
        kv_transfer_config("producer", transport="sglang", max_send_rate=0)
    with pytest.raises(InputError, match="max_send_rate: keys of a prefill"):
        kv_transfer_config("consumer", transport="sglang", max_send_rate=5)
    with pytest.raises(InputError, match="landing_tokens sizes"):
        kv_transfer_config("producer", transport="nixl", landing_tokens=5)
    for kwargs, match in (({"bootstrap": "h:1", "register_with": "h:2"}, "not both"),
                          ({"bootstrap": "nohost"}, "host:port"), ({"sglang_engine": "trtllm"}, "SGLang spec"),
                          ({"state_memory": "HBM"}, "VRAM or DRAM")):
        with pytest.raises(InputError, match=match):
            kv_transfer_config("producer", transport="sglang", **kwargs)
    with pytest.raises(InputError, match="keys of transport sglang, the transport is nixl"):
        kv_transfer_config("producer", transport="nixl", register_with="h:1")
    with pytest.raises(InputError, match="keys of transport sglang, the transport is gloo"):
        check_sglang_keys("kv_producer", None, {"state_memory": "DRAM"})
    result = CliRunner().invoke(cli, ["vllm-config", "producer", "--transport", "sglang", "--register-with", "h:1"])
    assert result.exit_code == 0 and json.loads(result.output)["kv_connector_extra_config"] == {
        "transport": "sglang", "register_with": "h:1"}


def test_the_peer_withdraws_a_room_no_decode_asked_for():
    """Without SGLang: a room not being written is withdrawn (it ends Failed, its pages may be released and the
    room offered again); pages go back to the pools."""
    from kvbridge.adapters.sglang import SGLangPrefillPeer
    from kvbridge.engines.topology import FLASH
    from kvbridge.migration import source_request
    from kvbridge.migration.errors import TransferError

    model = FLASH.with_layers(5)
    plan = plan_migration("sglang", "sglang", model, 1026, include_mtp=False)
    src, src_tables = source_request(plan, spare_pages=1, seed=2)
    peer = SGLangPrefillPeer(destination_pools(plan, spare_pages=1), state_memory=STATE_MEMORY)
    free = {k: sorted(v) for k, v in peer.pools.free.items()}
    tables = peer.add_migrated_request(7, plan, src, src_tables, first_token=3)
    assert {k: sorted(v) for k, v in peer.pools.free.items()} != free
    with pytest.raises(TransferError, match="within the timeout"):
        peer.wait(7, timeout=0.01)
    assert peer.withdraw(7, "nobody asked")
    assert peer.wait(7, timeout=0.01)["status"] == "Failed" and peer.wait(7, 0.01)["reason"] == "nobody asked"
    peer.release_pages(tables)
    peer.forget(7)
    assert {k: sorted(v) for k, v in peer.pools.free.items()} == free
    peer.add_request(7, tables, 1026, 3)  # forgotten: the room may be offered again
    peer._requests[7].sending = True  # as the peer's worker marks a room whose writes are under way
    assert not peer.withdraw(7, "too late")


def _sent_pages(peer, plan, tables) -> dict[tuple[int, Role], list[int]]:
    """The pages of each cache ``SGLangPrefillPeer._send`` writes for a room: the KV pages of its table (at most
    one per 256 tokens), the window's SWA pages of every SWA-page buffer, the ratio-128 ring."""
    lay, n = peer.layout, plan.num_tokens
    num_pages, first = -(-n // 256), max(0, n - peer.pools.model.sliding_window) // 256
    sent = {}
    for spec in lay.kv:
        sent[(spec.layer, spec.role)] = tables[peer.pools.storage(spec).table][:num_pages]
    for spec in lay.swa_state:
        sent[(spec.layer, spec.role)] = tables[peer.pools.storage(spec).table][first:num_pages]
    for spec in lay.request_state:
        sent[(spec.layer, spec.role)] = tables[peer.pools.storage(spec).table][:1]
    return sent


def test_a_reused_page_carries_no_earlier_room():
    """Without SGLang: the peer's pages travel whole, a request fills only its entries' slots of a page (and its
    rows of a state ring), and released pages are not zeroed (``SGLangPrefillPeer._clean_unwritten`` cleans, per
    room, the pages it sends but does not fill). Rooms of 2,050, 1, 257, 1,000, 129, 1,026 and 2,050 tokens
    (every page phase: a last page of 1, 58 or 64 compressed entries, windows in one and in two SWA pages) go
    through the same pools one after another, each on pages earlier rooms left dirty: every page each one sends
    is byte-identical to its conversion into fresh pools."""
    from kvbridge.adapters.sglang import SGLangPrefillPeer
    from kvbridge.engines.topology import FLASH
    from kvbridge.migration import source_request

    model = FLASH.with_layers(5)
    lengths = (2050, 1, 257, 1000, 129, 1026, 2050)
    peer = SGLangPrefillPeer(destination_pools(plan_migration("sglang", "sglang", model, 2050, include_mtp=False),
                                               spare_pages=1), state_memory=STATE_MEMORY)
    dirty_reused = partial_dirty = 0
    for k, n in enumerate(lengths):
        plan = plan_migration("sglang", "sglang", model, n, include_mtp=False)
        dirty = {(s.layer, s.role): {i for i in range(peer.pools.pool(s).shape[0]) if peer.pools.pool(s)[i].any()}
                 for s in model.all_caches(False)}
        src, src_tables = source_request(plan, spare_pages=1, seed=40 + k)
        tables = peer.add_migrated_request(100 + k, plan, src, src_tables, first_token=3)
        fresh = destination_pools(plan, spare_pages=1)
        want, _ = migrate_local(plan, src, src_tables, fresh, loss_report=False)
        got_sent, want_sent = _sent_pages(peer, plan, tables), _sent_pages(peer, plan, want)
        for t in plan.transfers:
            key = (t.spec.layer, t.spec.role)
            for pos, (g, w) in enumerate(zip(got_sent[key], want_sent[key], strict=True)):
                assert torch.equal(peer.pools.pool(t.spec)[g], fresh.pool(t.spec)[w]), (n, key, pos)
                if g in dirty[key]:
                    dirty_reused += 1
                    partial_dirty += t.dst.kind == "state" or (pos + 1) * t.dst.page_size > t.first + t.count
        assert peer.withdraw(100 + k, "measured")
        peer.release_pages(tables)
        peer.forget(100 + k)
    # the later rooms ran on pages earlier ones had written, also as a partial last page or a state ring
    assert dirty_reused > 100 and partial_dirty > 30, (dirty_reused, partial_dirty)


if __name__ == "__main__":
    import sys

    sys.exit(pytest.main([__file__, "-v"]))
