"""kvbridge as the decode peer of SGLang 0.5.23's own prefill-side PD classes.

The prefill side (``tests/sglang_prefill_peer.py``) runs in SGLang's environment, a separate venv
(``.ci/engine-sglang.sh``; CI exports its python as ``KVBRIDGE_SGLANG_PYTHON``): SGLang's
``DeepSeekV4TokenToKVPool``, ``MetadataBuffers``, ``NixlKVBootstrapServer``, ``NixlKVManager``
(prefill) and ``NixlKVSender``, on CPU. Its pool buffers hold, at the page ids SGLang's allocators
hand a first request (KV and SWA pages from 1, request slot 1), the bytes of kvbridge's
fixture-checked SGLang writers for known latents; kvbridge's ``SGLangDecodePeer`` asks for the
request, the sender must reach ``KVPoll.Success`` and kvbridge's pools must hold exactly those bytes
(KV, indexer, compressor state, metadata row). A decode whose page size differs is refused by
kvbridge's handshake (SGLang's decode-side rule) before anything is allocated; one whose state
buffers differ (bf16 state) is refused by SGLang's prefill, and nothing it wrote stays.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from kvbridge.adapters.sglang_protocol import pd_layout
from kvbridge.engines.topology import FLASH, Role
from kvbridge.migration import EnginePools, migrate_local, plan_migration, source_request
from kvbridge.migration.pools import gather_records, table_of
from tests.migration_helpers import free_port, gpu_check_module, need_sglang

SGLANG_PY = os.environ.get("KVBRIDGE_SGLANG_PYTHON")
PREFILL_SIDE = Path(__file__).with_name("sglang_prefill_peer.py")
#: DeepSeek-V4-Flash cut to 5 layers (ratios 0, 0, 4, 128, 4), without its MTP layer.
MODEL = FLASH.with_layers(5)
TOKENS = 1026  # ratio-4 state rows 1022..1025 straddle the SWA page boundary at 1024: two rings
ROOM, FIRST_TOKEN = 9001, 424242
#: What SGLang's allocators hand the first request: pages from 1 (0 is the padding page), slot 1.
PREFILL_KV_PAGES, PREFILL_SWA_PAGES, PREFILL_SLOT, PREFILL_AUX = [1, 2, 3, 4, 5], [4, 5], 1, 2


def _need_sglang() -> None:
    need_sglang("SGLang decode-peer test")


def test_registration_and_page_id_messages():
    """Without SGLang: the frames kvbridge sends are the ones SGLang's prefill parses (its
    ``KVArgsRegisterInfo`` / ``TransferInfo`` frame layout), and the input checks."""
    pytest.importorskip("zmq")
    from kvbridge.adapters.sglang_decode import SGLangDecodePeer
    from kvbridge.adapters.sglang_protocol import DecodePeer, TransferInfo, _unpack_lists, pd_layout
    from kvbridge.errors import InputError

    pools = EnginePools.create("sglang", MODEL, {"full": 6, "swa": 6, "state128": 2}, include_mtp=False)
    with pytest.raises(InputError, match="aux_rows"):
        SGLangDecodePeer(pools, aux_rows=0)
    with pytest.raises(InputError, match="MTP"):
        SGLangDecodePeer(EnginePools.create("sglang", MODEL, {"full": 1, "swa": 1, "state128": 1}))
    peer = SGLangDecodePeer(pools)
    with pytest.raises(InputError, match="start the peer"):
        peer.receive("127.0.0.1:1", 5, 10)
    with pytest.raises(InputError, match="num_tokens"):
        peer.receive("127.0.0.1:1", 5, 0)
    # the handshake checks SGLang's decode makes, and one prefill rank
    from kvbridge.migration import MigrationError

    good = {"attn_tp_size": 1, "attn_cp_size": 1, "dp_size": 1, "pp_size": 1, "page_size": 256,
            "kv_cache_dtype": "fp8_e4m3", "kv_layout": "v4,c4:v4,c128:v4", "decode_allocation_policy": "early"}
    peer._check_prefill("h:1", good)
    for change, want in (({"page_size": 128}, "page size mismatch"), ({"kv_cache_dtype": "bf16"}, "dtype mismatch"),
                         ({"kv_layout": "v4,c4:v4"}, "KV layout mismatch"), ({"attn_tp_size": 2}, "one prefill rank"),
                         ({"decode_allocation_policy": "prefill_complete"}, "allocates early")):
        with pytest.raises(MigrationError, match=want):
            peer._check_prefill("h:1", {**good, **change})
    # the frames, built as the peer builds them (without starting an agent)
    peer.ip, peer.rank_port = "10.0.0.7", 5123
    lay = pd_layout(pools)
    peer._ptrs = {(s.layer, s.role): 4096 * (k + 1) for k, s in enumerate((*lay.kv, *lay.swa_state,
                                                                           *lay.request_state))}
    peer._aux_ptrs, peer._metadata = [10**6 + i for i in range(10)], b"agent-md"

    class _Name:
        name = "kvbridge-agent"

    peer._agent = _Name()
    sent = []
    peer._send = lambda target, frames: sent.append(frames)  # type: ignore[method-assign]
    peer._register(("10.0.0.9", 7000))
    peer._register(("10.0.0.9", 7000))  # once per prefill rank
    reg = DecodePeer.parse(sent[0][1:])
    assert len(sent) == 1 and sent[0][0] == b"NixlMsgGuard" and len(sent[0]) == 25
    assert (reg.agent_name, reg.endpoint, reg.port, reg.metadata) == ("kvbridge-agent", "10.0.0.7", 5123, b"agent-md")
    assert reg.kv_item_lens == list(lay.kv_item_lens) and reg.kv_mem_kinds == ["DRAM"] * 5
    assert reg.state_item_lens == [list(x) for x in lay.state_item_lens] and reg.aux_ptrs == peer._aux_ptrs
    assert int(sent[0][17]) == 6  # dst_num_slots: pages of every KV buffer
    assert _unpack_lists(sent[0][24], "Q") == [[6 * n for n in lay.state_item_lens[0]], [2 * 524288]]
    tables = {"full": [3, 0, 5, 1, 2], "swa": [-1, -1, -1, 4, 2], "state128": [1]}
    info = TransferInfo.parse(peer._metadata_message(77, tables, 3, 3, True)[1:])
    assert (info.room, info.kv_pages, info.aux_index, info.required, info.state_indices, info.prefix_len,
            info.dummy) == (77, [3, 0, 5, 1, 2], 3, 1, [[4, 2], [1]], 0, False)
    # at a 128-token boundary nothing pends in the ratio-128 ring: SGLang's decode sends no slot
    assert TransferInfo.parse(peer._metadata_message(77, tables, 3, 3, False)[1:]).state_indices == [[4, 2], []]
    # a declined room: SGLang's dummy page ids (11 frames, as build_receiver_metadata_message with is_dummy)
    dummy = peer._dummy_message(78)
    info = TransferInfo.parse(dummy[1:])
    assert len(dummy) == 11 and (info.room, info.kv_pages, info.aux_index, info.required, info.state_indices,
                                 info.prefix_len, info.dummy) == (78, [], -1, 1, [], 0, True)


def test_quarantine_rule_and_heartbeat():
    """Without SGLang: quarantined pages stay out of use while the prefill may still write (it answers
    its health route, or was declared dead less than ``heartbeat`` s ago), and come back zeroed, with
    their metadata row, once it reported the room or ``heartbeat`` s after ``heartbeat_failures``
    failed probes declared it dead; a request waiting on that prefill is woken as dead."""
    import threading
    import time
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    from kvbridge.adapters.sglang_decode import SGLangDecodePeer, _Quarantine, _Waiter
    from kvbridge.adapters.sglang_protocol import metadata_item_lens

    class Health(BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802
            self.send_response(200)
            self.end_headers()

        def log_message(self, *a):
            pass

    alive = ThreadingHTTPServer(("127.0.0.1", 0), Health)
    threading.Thread(target=alive.serve_forever, daemon=True).start()
    alive_addr, dead_addr = f"127.0.0.1:{alive.server_address[1]}", f"127.0.0.1:{free_port()}"
    pools = EnginePools.create("sglang", MODEL, {"full": 15, "swa": 3, "state128": 3}, include_mtp=False)
    free = {k: sorted(v) for k, v in pools.free.items()}
    peer = SGLangDecodePeer(pools, heartbeat=0.2, heartbeat_failures=2)
    assert peer.dead_within == pytest.approx(0.8)
    peer._aux = [torch.zeros(peer.aux_rows, n, dtype=torch.uint8) for n in metadata_item_lens()]
    held = {}
    for room, addr in ((1, alive_addr), (2, dead_addr), (3, alive_addr)):
        tables = pools.claim({"full": 5, "swa": 1, "state128": 1})
        aux = peer._free_aux.pop()
        for spec in (*peer.layout.kv, *peer.layout.swa_state, *peer.layout.request_state):
            pools.pool(spec)[tables[pools.storage(spec).table]] = 7  # a late write
        peer._aux[0][aux] = 9
        peer._quarantine[room] = held[room] = _Quarantine(addr, tables, aux)
    waiter = peer._waiters[4] = _Waiter(dead_addr)
    assert peer.reclaim() == 0 and len(peer.quarantined) == 3
    peer._probe()
    assert peer.reclaim() == 0 and not waiter.done.is_set()  # one failed probe: not dead yet
    peer._probe()
    assert waiter.dead and waiter.done.is_set() and held[2].dead_at is not None and held[1].dead_at is None
    assert peer.reclaim() == 0  # declared dead, but a posted write may still land for heartbeat s
    time.sleep(0.25)
    assert peer.reclaim() == 1 and set(peer._quarantine) == {1, 3}
    held[3].settled = True  # the live prefill reported room 3 after all
    assert peer.reclaim() == 1 and set(peer._quarantine) == {1}  # room 1: alive, silent: kept
    peer._quarantine.pop(1)
    pools.release(held[1].tables)
    peer._scrub(held[1].tables)
    peer._aux[0][held[1].aux_index] = 0
    alive.shutdown()
    assert {k: sorted(v) for k, v in pools.free.items()} == free and len(peer._free_aux) == peer.aux_rows - 1
    assert not any(t.any() for p in pools.pools.values() for t in (p if isinstance(p, tuple) else (p,)))
    assert not any(t.any() for t in peer._aux)


def test_a_kvbridge_prefill_of_another_depth_is_refused_at_bootstrap():
    """kvbridge's prefill peer serves its model on ``MODEL_ROUTE`` next to SGLang's bootstrap route: a
    decode peer whose pools hold 4 layers of Flash (the same layout string ``v4,c4:v4,c128:v4`` as the
    prefill's 5) is refused at bootstrap with one line, before any page is allocated; the same model
    passes. (SGLang's own bootstrap server announces no depth: see docs/adapters.md.)"""
    pytest.importorskip("zmq")
    pytest.importorskip("nixl")
    import time

    from kvbridge.adapters.sglang import SGLangPrefillPeer
    from kvbridge.adapters.sglang_decode import SGLangDecodePeer
    from kvbridge.migration import MigrationError

    shallow = EnginePools.create("sglang", FLASH.with_layers(4), {"full": 6, "swa": 6, "state128": 2},
                                 include_mtp=False)
    same = EnginePools.create("sglang", MODEL, {"full": 6, "swa": 6, "state128": 2}, include_mtp=False)
    free = {k: sorted(v) for k, v in shallow.free.items()}
    with SGLangPrefillPeer(EnginePools.create("sglang", MODEL, {"full": 1, "swa": 1, "state128": 1},
                                              include_mtp=False)) as prefill:
        deadline = time.monotonic() + 30
        assert SGLangDecodePeer(same)._prefill_info(prefill.bootstrap_addr, deadline)["kv_layout"] == \
            "v4,c4:v4,c128:v4"
        with pytest.raises(MigrationError) as exc:
            SGLangDecodePeer(shallow)._prefill_info(prefill.bootstrap_addr, deadline)
    assert "model mismatch" in str(exc.value) and "num_layers" in str(exc.value) and "\n" not in str(exc.value)
    assert {k: sorted(v) for k, v in shallow.free.items()} == free


def _prefill(cfg: dict, tmp_path: Path, fill_for, launched=None) -> tuple[subprocess.Popen, callable, dict]:
    """Start SGLang's prefill side (or finish starting ``launched``, from ``_launch``); ``fill_for(layout)``
    returns the buffers' contents."""
    proc, log_path = launched or _launch(cfg, tmp_path)

    def next_line() -> dict:
        line = proc.stdout.readline()
        if not line:
            proc.wait(30)
            text = log_path.read_text()[-3000:]
            raise AssertionError(f"SGLang prefill side ended without a result (rc {proc.returncode}):\n{text}")
        msg = json.loads(line)
        if msg.get("result") == "error":
            raise AssertionError("SGLang prefill side failed:\n" + msg["traceback"])
        return msg

    layout = next_line()
    assert layout["event"] == "layout", layout
    path = log_path.with_suffix(".npz")
    np.savez(path, **fill_for(layout))
    proc.stdin.write(json.dumps({"fill": str(path)}) + "\n")
    proc.stdin.flush()
    ready = next_line()
    assert ready["event"] == "ready", ready
    return proc, next_line, {**layout, "bootstrap_addr": ready["bootstrap_addr"]}


def _launch(cfg: dict, tmp_path: Path, name: str = "prefill") -> tuple[subprocess.Popen, Path]:
    """Start SGLang's prefill side process with ``cfg`` (over the defaults); ``_prefill`` finishes it."""
    base = {"kv_cache_dtype": "fp8_e4m3", "page_size": 256, "compress_ratios": list(MODEL.compress_ratios[:5]),
            "pages": 8, "req_slots": 4, "swa_pages": 8, "sliding_window": MODEL.sliding_window, "aux_rows": 4,
            "timeout": 90, "room": ROOM, "num_tokens": TOKENS, "kv_page_ids": PREFILL_KV_PAGES,
            "swa_page_ids": PREFILL_SWA_PAGES, "req_pool_idx": PREFILL_SLOT, "aux_index": PREFILL_AUX,
            "bootstrap_port": free_port()}
    base.update(cfg)
    log_path = tmp_path / f"{name}.log"
    proc = subprocess.Popen([SGLANG_PY, str(PREFILL_SIDE)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=open(log_path, "w"), text=True)
    proc.stdin.write(json.dumps(base) + "\n")
    proc.stdin.flush()
    return proc, log_path


def _stop(proc: subprocess.Popen) -> None:
    """Let the prefill side end (it stays up until its stdin closes, as a server does)."""
    proc.stdin.close()
    try:
        proc.wait(60)
    except subprocess.TimeoutExpired:
        proc.kill()
        raise


def _until_result(next_line) -> dict:
    while "result" not in (msg := next_line()):
        pass
    return msg


def _sglang_buffers(src: EnginePools, tables: dict, layout: dict, num_tokens: int,
                    rows: dict[int, int] | None = None, kv_pages: list[int] = PREFILL_KV_PAGES,
                    swa_pages: list[int] = PREFILL_SWA_PAGES) -> dict[str, np.ndarray]:
    """SGLang's prefill buffers holding the request ``tables`` addresses in ``src``, at the page ids
    SGLang's allocators hand it (``kv_pages``, ``swa_pages``), and its metadata row (``rows``:
    metadata row -> room)."""
    from kvbridge.adapters.sglang_protocol import metadata_row, pd_layout

    lay = pd_layout(src)
    out = {f"kv{i}": np.zeros(n, np.uint8) for i, n in enumerate(layout["kv_data_lens"])}
    for c, lens in enumerate(layout["state_data_lens"]):
        out.update({f"state{c}_{i}": np.zeros(n, np.uint8) for i, n in enumerate(lens)})
    out.update({f"aux{i}": np.zeros(n, np.uint8) for i, n in enumerate(layout["aux_data_lens"])})

    def put(name: str, spec, src_page: int, dst_page: int) -> None:
        page = src.pool(spec)[src_page].numpy()
        out[name][dst_page * page.size : (dst_page + 1) * page.size] = page

    for i, spec in enumerate(lay.kv):
        for j, p in enumerate(tables["full"]):
            put(f"kv{i}", spec, p, kv_pages[j])
    first = max(0, num_tokens - src.model.sliding_window) // 256
    for i, spec in enumerate(lay.swa_state):
        for k, d in enumerate(swa_pages):
            put(f"state0_{i}", spec, tables["swa"][first + k], d)
    for i, spec in enumerate(lay.request_state):
        put(f"state1_{i}", spec, tables["state128"][0], PREFILL_SLOT)
    for row, room in (rows or {PREFILL_AUX: ROOM}).items():
        for i, b in enumerate(metadata_row(room, FIRST_TOKEN + row)):
            out[f"aux{i}"][row * len(b) : (row + 1) * len(b)] = np.frombuffer(b, np.uint8)
    return out


def _records(pools: EnginePools, tables: dict, plan) -> dict:
    """Every live record of the request, per cache, as bytes (independent of page ids)."""
    side = "dst" if pools.profile.spec == plan.dst.spec else "src"
    out = {}
    for t in plan.transfers:
        st = t.dst if side == "dst" else t.src
        out[(t.spec.layer, t.spec.role)] = gather_records(pools.pool(t.spec), st, table_of(tables, st), t.first,
                                                          t.count).numpy().tobytes()
    return out


@pytest.fixture(scope="module")
def request_pools():
    """An SGLang-profile request written by kvbridge's SGLang writers (fixture-checked)."""
    plan = plan_migration("sglang", "sglang", MODEL, TOKENS, include_mtp=False)
    return source_request(plan, seed=3)


def test_sglang_prefill_sends_exact_bytes_to_kvbridge(request_pools, tmp_path):
    _need_sglang()
    from kvbridge.adapters.sglang_decode import SGLangDecodePeer
    from kvbridge.adapters.sglang_protocol import pd_layout

    src, src_tables = request_pools
    dst = EnginePools.create("sglang", MODEL, {"full": 8, "swa": 8, "state128": 3}, include_mtp=False, seed=11)
    proc, next_line, layout = _prefill({}, tmp_path, lambda lay: _sglang_buffers(src, src_tables, lay, TOKENS))
    lay = pd_layout(dst)
    # SGLang's own prefill buffer list is the one kvbridge's decode registers
    assert layout["kv_layout"] == lay.kv_layout == "v4,c4:v4,c128:v4"
    assert layout["kv_item_lens"] == list(lay.kv_item_lens)
    assert layout["state_types"] == list(lay.state_types) == ["swa", "c128_state"]
    assert layout["state_item_lens"] == [list(x) for x in lay.state_item_lens]
    try:
        with SGLangDecodePeer(dst, timeout=45) as peer:
            req = peer.receive(layout["bootstrap_addr"], ROOM, TOKENS)
        result = _until_result(next_line)
    finally:
        _stop(proc)
    assert result["result"] == "Success", result  # SGLang's sender reached KVPoll.Success
    assert (req.room, req.num_tokens, req.first_token) == (ROOM, TOKENS, FIRST_TOKEN + PREFILL_AUX)
    assert req.prefill["page_size"] == 256 and req.prefill["kv_layout"] == "v4,c4:v4,c128:v4"
    assert {k: len(v) for k, v in req.tables.items()} == {"full": 4, "swa": 5, "state128": 1}
    assert req.pages == {"full": 5, "swa": 2, "state128": 1}  # what SGLang wrote: 5 KV pages (the last
    # holds no complete compressed entry), the 2 window pages, 1 ring
    assert req.bytes == 5 * sum(lay.kv_item_lens) + 2 * sum(lay.state_item_lens[0]) + 524288 + 1600
    # page by page: every KV, indexer, SWA and state page holds exactly the prefill's bytes
    checked = 0
    for spec in lay.kv:
        for j, p in enumerate(src_tables["full"]):
            assert dst.pool(spec)[req.tables["full"][j]].numpy().tobytes() == \
                src.pool(spec)[p].numpy().tobytes(), (spec, j)
            checked += 1
    for spec in lay.swa_state:
        for k in (3, 4):
            assert dst.pool(spec)[req.tables["swa"][k]].numpy().tobytes() == \
                src.pool(spec)[src_tables["swa"][k]].numpy().tobytes(), (spec, k)
            checked += 1
    for spec in lay.request_state:
        assert dst.pool(spec)[req.tables["state128"][0]].numpy().tobytes() == \
            src.pool(spec)[src_tables["state128"][0]].numpy().tobytes()
        checked += 1
    assert checked == 5 * 4 + 9 * 2 + 1
    roles = {s.role for s in (*lay.kv, *lay.swa_state, *lay.request_state)}
    assert roles == {Role.SWA, Role.COMPRESS, Role.INDEXER, Role.STATE, Role.INDEXER_STATE}
    # and the request as a whole: every live record equals the source's
    plan = plan_migration("sglang", "sglang", MODEL, TOKENS, include_mtp=False)
    assert _records(dst, req.tables, plan) == _records(src, src_tables, plan)
    # pages the decode did not keep are free and zero
    held = {n: set(v) for n, v in req.tables.items()}
    for spec in (*lay.kv, *lay.swa_state, *lay.request_state):
        name = dst.storage(spec).table
        assert set(dst.free[name]).isdisjoint(held[name])
        for p in dst.free[name]:
            assert not dst.pool(spec)[p].any(), (spec, p)
    # SGLang's compressor state cannot go to vLLM: the planner says why, as for a direct migration
    from kvbridge.engines.profiles import parse_engine
    from kvbridge.errors import InputError

    prof = parse_engine("vllm")
    vllm = EnginePools.create(prof, MODEL, {prof.storage(s).table: 8 for s in MODEL.all_caches(include_mtp=False)},
                              include_mtp=False)
    with pytest.raises(InputError, match="positional bias"):
        peer.migrate(req, vllm)


def test_one_peer_receives_requests_in_turn(request_pools, tmp_path):
    """Three requests (rooms) from the same prefill through one peer: one registration, each request
    in pages of its own, each byte-exact, its metadata row naming its room."""
    _need_sglang()
    from kvbridge.adapters.sglang_decode import SGLangDecodePeer

    src, src_tables = request_pools
    rows = {2: ROOM, 3: ROOM + 1, 0: ROOM + 2}
    dst = EnginePools.create("sglang", MODEL, {"full": 16, "swa": 16, "state128": 4}, include_mtp=False, seed=3)
    proc, next_line, layout = _prefill({"requests": [{"room": r, "aux_index": a} for a, r in rows.items()]},
                                       tmp_path, lambda lay: _sglang_buffers(src, src_tables, lay, TOKENS, rows))
    plan = plan_migration("sglang", "sglang", MODEL, TOKENS, include_mtp=False)
    want = _records(src, src_tables, plan)
    try:
        with SGLangDecodePeer(dst, timeout=45) as peer:
            reqs = [peer.receive(layout["bootstrap_addr"], room, TOKENS) for room in rows.values()]
            assert len(peer._registered) == 1
        result = _until_result(next_line)
    finally:
        _stop(proc)
    assert result["result"] == "Success" and len(result["seconds"]) == 3, result
    assert [(r.room, r.first_token) for r in reqs] == [(room, FIRST_TOKEN + a) for a, room in rows.items()]
    held = [p for r in reqs for p in r.tables["full"]]
    assert len(held) == len(set(held)) == 12
    for r in reqs:
        assert _records(dst, r.tables, plan) == want


def test_a_request_at_a_ratio_128_boundary(tmp_path):
    """4,096 tokens: no ratio-128 row pends, so no ring travels (SGLang's rule on both sides); the
    16 KV pages, the window's SWA page and the ratio-4 rings arrive byte-exact."""
    _need_sglang()
    from kvbridge.adapters.sglang_decode import SGLangDecodePeer

    tokens = 4096
    plan = plan_migration("sglang", "sglang", MODEL, tokens, include_mtp=False)
    src, src_tables = source_request(plan, seed=8)
    kv_pages, swa_pages = list(range(1, 17)), [16]
    dst = EnginePools.create("sglang", MODEL, {"full": 20, "swa": 20, "state128": 2}, include_mtp=False, seed=4)
    cfg = {"num_tokens": tokens, "pages": 20, "swa_pages": 20, "kv_page_ids": kv_pages, "swa_page_ids": swa_pages}

    proc, next_line, layout = _prefill(cfg, tmp_path, lambda lay: _sglang_buffers(
        src, src_tables, lay, tokens, kv_pages=kv_pages, swa_pages=swa_pages))
    try:
        with SGLangDecodePeer(dst, timeout=45) as peer:
            req = peer.receive(layout["bootstrap_addr"], ROOM, tokens)
        result = _until_result(next_line)
    finally:
        _stop(proc)
    assert result["result"] == "Success", result
    assert req.pages == {"full": 16, "swa": 1, "state128": 0} and len(req.tables["state128"]) == 1
    assert _records(dst, req.tables, plan) == _records(src, src_tables, plan)


@pytest.mark.parametrize("dst_engine", ["trtllm", "vllm"])
def test_received_request_converts_like_a_direct_migration(dst_engine, tmp_path):
    """The first two Flash layers (SWA-only: no compressor state) from SGLang's prefill through
    kvbridge's decode peer into TensorRT-LLM's / vLLM's layout equal kvbridge's direct conversion of
    the same request, byte for byte."""
    _need_sglang()
    from kvbridge.adapters.sglang_decode import SGLangDecodePeer
    from kvbridge.migration import destination_pools

    model = FLASH.with_layers(2)
    plan = plan_migration("sglang", "sglang", model, TOKENS, include_mtp=False)
    src, src_tables = source_request(plan, seed=4)
    dst = EnginePools.create("sglang", model, {"full": 6, "swa": 6}, include_mtp=False, seed=2)
    proc, next_line, layout = _prefill({"compress_ratios": [0, 0]}, tmp_path,
                                       lambda lay: _sglang_buffers(src, src_tables, lay, TOKENS))
    assert layout["kv_layout"] == "v4" and layout["state_types"] == ["swa"]
    try:
        with SGLangDecodePeer(dst, timeout=45) as peer:
            req = peer.receive(layout["bootstrap_addr"], ROOM, TOKENS)
            conv = plan_migration("sglang", dst_engine, model, TOKENS, include_mtp=False)
            out = destination_pools(conv)
            out_tables, report = peer.migrate(req, out, plan=conv)
        result = _until_result(next_line)
    finally:
        _stop(proc)
    assert result["result"] == "Success", result
    direct = destination_pools(conv, seed=7)
    direct_tables, _ = migrate_local(conv, src, src_tables, direct, loss_report=False)
    got, want = _records(out, out_tables, conv), _records(direct, direct_tables, conv)
    assert got == want and len(got) == 2 and all(len(v) > 0 for v in got.values())
    assert report.num_tokens == TOKENS


@pytest.mark.parametrize("case", ["page_size", "layout"])
def test_kvbridge_refuses_a_mismatching_prefill(case, tmp_path):
    """kvbridge's pools of 128-token pages (or of a model without ratio-128 layers, layout string
    ``v4,c4:v4``) against SGLang's 256-token ``v4,c4:v4,c128:v4`` prefill: a one-line refusal at the
    bootstrap, SGLang's decode-side rule, before any page is allocated or the prefill learns of the
    decode (its sender stays bootstrapping)."""
    _need_sglang()
    import dataclasses

    from kvbridge.adapters.sglang_decode import SGLangDecodePeer
    from kvbridge.migration import MigrationError

    plan = plan_migration("sglang", "sglang", MODEL, TOKENS, include_mtp=False)
    src, src_tables = source_request(plan, seed=3)
    if case == "page_size":
        dst = EnginePools.create("sglang:swa=128", MODEL, {"full": 16, "swa": 16, "state128": 2}, include_mtp=False)
        want = "page size mismatch"
    else:
        model = dataclasses.replace(MODEL, name="flash-no-c128", compress_ratios=(0, 0, 4, 4, 4, 0))
        dst = EnginePools.create("sglang", model, {"full": 8, "swa": 8}, include_mtp=False)
        want = "KV layout mismatch"
    free = {k: sorted(v) for k, v in dst.free.items()}
    proc, next_line, layout = _prefill({"timeout": 4}, tmp_path,
                                       lambda lay: _sglang_buffers(src, src_tables, lay, TOKENS))
    try:
        with SGLangDecodePeer(dst, timeout=30) as peer, pytest.raises(MigrationError) as exc:
            peer.receive(layout["bootstrap_addr"], ROOM, TOKENS)
        result = _until_result(next_line)
    finally:
        _stop(proc)
    assert want in str(exc.value) and "\n" not in str(exc.value)
    assert result["result"] == "timeout" and result["stage"] == "bootstrap", result
    assert {k: sorted(v) for k, v in dst.free.items()} == free
    assert not any(t.any() for p in dst.pools.values() for t in (p if isinstance(p, tuple) else (p,)))


def test_a_bf16_state_decode_is_refused_before_anything():
    """SGLang's prefill announces no compressor-state dtype and writes state rows at its own item length
    (its item-length check runs only when both peers announce layer ids, which DeepSeek-V4 pools do
    not): an fp32 prefill would write past bf16 pools, into whatever memory NIXL has registered next
    to them. So the peer takes fp32 state (SGLang's default) only, refused before it registers anything."""
    from kvbridge.adapters.sglang_decode import SGLangDecodePeer
    from kvbridge.errors import InputError

    dst = EnginePools.create("sglang:state=bf16", MODEL, {"full": 8, "swa": 8, "state128": 2}, include_mtp=False)
    free = {k: sorted(v) for k, v in dst.free.items()}
    with pytest.raises(InputError) as exc:
        SGLangDecodePeer(dst)
    assert "fp32 compressor state only" in str(exc.value) and "\n" not in str(exc.value)
    assert {k: sorted(v) for k, v in dst.free.items()} == free


def test_a_prefill_with_other_state_dtype_is_detected_and_leaves_nothing(tmp_path):
    """A bf16-state SGLang prefill (``SGLANG_DSV4_COMPRESS_STATE_DTYPE=bf16``) sending to kvbridge's fp32
    pools passes the bootstrap (same page size, dtype and layout string) and writes its half-length
    state rows at its own stride, inside kvbridge's state buffers but not where the request's items
    are; SGLang reports Success. kvbridge finds the request's state items still holding its mark,
    raises, and zeroes the request's pages and the state pools' free items: every pool ends zero."""
    _need_sglang()
    from kvbridge.adapters.sglang_decode import SGLangDecodePeer
    from kvbridge.migration import TransferError

    plan = plan_migration("sglang:state=bf16", "sglang:state=bf16", MODEL, TOKENS, include_mtp=False)
    src, src_tables = source_request(plan, seed=3)
    dst = EnginePools.create("sglang", MODEL, {"full": 8, "swa": 8, "state128": 2}, include_mtp=False)
    free = {k: sorted(v) for k, v in dst.free.items()}
    proc, next_line, layout = _prefill({"state_dtype": "bf16"}, tmp_path,
                                       lambda lay: _sglang_buffers(src, src_tables, lay, TOKENS))
    try:
        with SGLangDecodePeer(dst, timeout=60) as peer, pytest.raises(TransferError) as exc:
            peer.receive(layout["bootstrap_addr"], ROOM, TOKENS)
        result = _until_result(next_line)
    finally:
        _stop(proc)
    assert result["result"] == "Success", result  # SGLang cannot tell
    assert "compressor state has another dtype" in str(exc.value) and "\n" not in str(exc.value)
    assert peer.quarantined == []
    assert {k: sorted(v) for k, v in dst.free.items()} == free
    assert not any(t.any() for p in dst.pools.values() for t in (p if isinstance(p, tuple) else (p,)))


def test_a_prefill_killed_mid_transfer_is_detected_and_its_pages_come_back(request_pools, tmp_path):
    """SGLang's prefill writes a first chunk (2 of the request's 5 KV pages) and is SIGKILLed: the
    peer's heartbeat (SGLang's bootstrap ``/health`` route) declares it dead within ``dead_within``
    s of the kill, the request fails with one line, its pages stay quarantined until no write can
    land (``heartbeat`` s after the death), then come back zeroed; the pools hold one request only,
    so the next room, from a new prefill, lands in exactly those pages, byte-exact."""
    _need_sglang()
    import threading
    import time

    from kvbridge.adapters.sglang_decode import SGLangDecodePeer
    from kvbridge.migration import TransferError

    src, src_tables = request_pools
    dst = EnginePools.create("sglang", MODEL, {"full": 5, "swa": 2, "state128": 1}, include_mtp=False, seed=6)
    free = {k: sorted(v) for k, v in dst.free.items()}
    proc, next_line, layout = _prefill({"die_after_pages": 2}, tmp_path,
                                       lambda lay: _sglang_buffers(src, src_tables, lay, TOKENS))
    second = _launch({"room": ROOM + 1}, tmp_path, "prefill2")  # starts (imports SGLang) meanwhile
    with SGLangDecodePeer(dst, timeout=60, heartbeat=0.5) as peer:
        failure: list[BaseException] = []
        ended = threading.Event()

        def receive() -> None:
            try:
                peer.receive(layout["bootstrap_addr"], ROOM, TOKENS)
            except TransferError as exc:
                failure.append(exc)
            finally:
                ended.set()

        t = threading.Thread(target=receive)
        t.start()
        try:
            assert next_line()["event"] == "sending"
            assert next_line()["event"] == "partial"  # the first chunk was written
            assert any(dst.pool(s).any() for s in pd_layout(dst).kv)
            killed = time.monotonic()
            proc.kill()
            assert ended.wait(peer.dead_within + 1.0), "the dead prefill was not noticed within the bound"
            noticed = time.monotonic() - killed
        finally:
            t.join(60)
            proc.kill()
            proc.wait(30)
        assert len(failure) == 1 and "died mid-transfer" in str(failure[0]) and "\n" not in str(failure[0])
        assert noticed <= peer.dead_within + 0.5, noticed
        deadline = time.monotonic() + 5 * peer.heartbeat
        while peer.quarantined and time.monotonic() < deadline:
            time.sleep(0.05)
        assert peer.quarantined == [] and {k: sorted(v) for k, v in dst.free.items()} == free
        assert not any(t.any() for p in dst.pools.values() for t in (p if isinstance(p, tuple) else (p,)))
        # the next room, from a prefill that lives, lands in the reclaimed pages
        proc, next_line, layout = _prefill({}, tmp_path, lambda lay: _sglang_buffers(
            src, src_tables, lay, TOKENS, {PREFILL_AUX: ROOM + 1}), second)
        try:
            req = peer.receive(layout["bootstrap_addr"], ROOM + 1, TOKENS)
            result = _until_result(next_line)
        finally:
            _stop(proc)
    assert result["result"] == "Success", result
    plan = plan_migration("sglang", "sglang", MODEL, TOKENS, include_mtp=False)
    assert req.room == ROOM + 1 and _records(dst, req.tables, plan) == _records(src, src_tables, plan)


def test_a_declined_room_ends_success_with_nothing_written():
    """Both ends kvbridge (no SGLang needed): a decode that holds a request whole declines its room
    (``decline``: SGLang's dummy page ids); the prefill peer ends the room Success with no byte written
    and no decode notified, as SGLang's prefill does for a dummy decode, and the decode claims no page
    or metadata row. A room being received cannot be declined."""
    pytest.importorskip("zmq")
    pytest.importorskip("nixl")
    from kvbridge.adapters.sglang import SGLangPrefillPeer
    from kvbridge.adapters.sglang_decode import SGLangDecodePeer
    from kvbridge.errors import InputError

    plan = plan_migration("sglang", "sglang", MODEL, TOKENS, include_mtp=False)
    src, src_tables = source_request(plan, seed=6)
    dst = EnginePools.create("sglang", MODEL, {"full": 6, "swa": 6, "state128": 2}, include_mtp=False)
    free = {k: sorted(v) for k, v in dst.free.items()}
    with SGLangPrefillPeer(src) as prefill, SGLangDecodePeer(dst) as decode:
        prefill.add_request(41, src_tables, TOKENS, 7)
        decode.decline(prefill.bootstrap_addr, 41)
        sent = prefill.wait(41, timeout=30)
        decode._waiters[42] = None  # as receive holds a room in flight
        with pytest.raises(InputError, match="being received"):
            decode.decline(prefill.bootstrap_addr, 42)
        del decode._waiters[42]
        rows = len(decode._free_aux)
    assert (sent["status"], sent["bytes"], sent["peers"]) == ("Success", 0, 0), sent
    assert {k: sorted(v) for k, v in dst.free.items()} == free and rows == decode.aux_rows
    assert not any(bool(t.any()) for spec in MODEL.all_caches(include_mtp=False) for t in [dst.pool(spec)])


def test_kvbridge_prefill_to_kvbridge_decode_checks_the_digest():
    """Both ends kvbridge, over SGLang's protocol (no SGLang needed): the prefill peer writes its
    ``kv_digest`` into the checksum row, the decode peer's own digest of what landed matches it
    (``digest_verified``) and every record is byte-exact. ``scripts/gpu_check.py`` runs the same
    case with every pool in VRAM."""
    pytest.importorskip("zmq")
    pytest.importorskip("nixl")
    assert gpu_check_module().sglang_pd_roundtrip(torch.device("cpu")) is True


def test_cli_receives_converts_and_writes_a_dump(tmp_path):
    """``kvbridge sglang-decode --to trtllm --out``: SGLang's prefill sends the first two Flash
    layers, the command converts them to TensorRT-LLM's 512-B records and writes a kvbridge dump whose
    entries hold exactly the records of kvbridge's direct conversion. A second room of the same prefill
    is received in human mode at ``COLUMNS=80``: every line fits 80 columns, the result as key/value
    lines, its dump the same records."""
    _need_sglang()
    from kvbridge.dumps.dumpfile import read_dump
    from kvbridge.migration import destination_pools
    from kvbridge.migration.pools import gather_records, table_of

    model = FLASH.with_layers(2)
    plan = plan_migration("sglang", "sglang", model, TOKENS, include_mtp=False)
    src, src_tables = source_request(plan, seed=5)
    rows = {PREFILL_AUX: ROOM, 0: ROOM + 1}  # metadata row -> room
    proc, next_line, layout = _prefill({"compress_ratios": [0, 0],
                                        "requests": [{"room": r, "aux_index": a} for a, r in rows.items()]},
                                       tmp_path, lambda lay: _sglang_buffers(src, src_tables, lay, TOKENS, rows))
    out, human_out = tmp_path / "request.safetensors", tmp_path / "h.safetensors"

    def receive(room: int, path: Path, *extra: str, env: dict | None = None) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "cli.main", "sglang-decode", "--bootstrap",
                               layout["bootstrap_addr"], "--room", str(room), "--tokens", str(TOKENS), "--layers",
                               "2", "--to", "trtllm", "--out", str(path), "--timeout", "60", *extra],
                              capture_output=True, text=True, timeout=300, cwd=Path(__file__).parents[1], env=env)

    try:
        cli = receive(ROOM, out, "--json")
        human = receive(ROOM + 1, human_out, env={**os.environ, "COLUMNS": "80"})
        result = _until_result(next_line)
    finally:
        _stop(proc)
    assert cli.returncode == 0, cli.stderr[-2000:]
    assert human.returncode == 0, human.stderr[-2000:]
    assert result["result"] == "Success", result
    lines = [*human.stdout.splitlines(), *human.stderr.splitlines()]
    assert all(len(line) <= 80 or str(human_out) in line for line in lines), [x for x in lines if len(x) > 80]
    said = " ".join(human.stderr.split())  # the asking line, wrapped between words at 80 columns
    assert f"for room {ROOM + 1} ({TOKENS:,} tokens" in said and "layout v4" in said, human.stderr
    fields = human.stdout.splitlines()
    assert fields[0].startswith(f"room {ROOM + 1}: {TOKENS:,} tokens from "), human.stdout
    assert fields[1].startswith("  received:") and f"first token {FIRST_TOKEN}" in fields[1], human.stdout
    assert fields[2].startswith("  converted: to trtllm") and fields[3] == f"  wrote:     {human_out}", human.stdout
    summary = json.loads(cli.stdout)
    assert (summary["room"], summary["first_token"], summary["kv_layout"]) == (ROOM, FIRST_TOKEN + PREFILL_AUX, "v4")
    assert summary["converted"]["engine"].startswith("trtllm") and summary["out"] == str(out)
    conv = plan_migration("sglang", "trtllm", model, TOKENS, include_mtp=False)
    direct = destination_pools(conv)
    tables, _ = migrate_local(conv, src, src_tables, direct, loss_report=False)
    for room, path in ((ROOM, out), (ROOM + 1, human_out)):
        dump = read_dump(path)
        assert dump.attrs["room"] == str(room)
        assert dump.attrs["layer.0.swa.first_position"] == str(conv.transfers[0].first)
        for t in conv.transfers:
            entry = next(e for e in dump.entries if (e.layer, e.role) == (t.spec.layer, t.spec.role.value))
            want = gather_records(direct.pool(t.spec), t.dst, table_of(tables, t.dst), t.first, t.count)
            assert entry.layout == "trtllm-fp8" and entry.num_tokens == t.count
            assert torch.equal(t.dst.layout.pages_to_records(entry.data, entry.page_size, t.count), want)


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-v"]))
