"""kvbridge as the prefill peer of SGLang 0.5.23's own decode-side PD classes.

The decode side (``tests/sglang_decode_peer.py``) runs in SGLang's environment, a separate venv
(``.ci/engine-sglang.sh``; CI exports its python as ``KVBRIDGE_SGLANG_PYTHON``): SGLang's
``DeepSeekV4TokenToKVPool``, ``MetadataBuffers``, ``NixlKVManager`` (decode), ``NixlKVReceiver`` and,
where named, ``NixlKVBootstrapServer``, on CPU. kvbridge's ``SGLangPrefillPeer`` serves a request
from SGLang-profile pools; the receiver must reach ``Success`` and its registered buffers must hold,
at the pages it allocated, exactly the bytes of the prefill's pages (SGLang's writers' bytes, as
kvbridge's SGLang profile writes them: fixture-verified). A peer announcing another layout or page
size is refused by SGLang's own handshake; buffers that do not fit (another state dtype, which the
handshake does not see) are refused by kvbridge, and the decode reports the reason.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import zlib
from pathlib import Path

import numpy as np
import pytest
import torch

from kvbridge.engines.topology import FLASH, Role
from kvbridge.migration import plan_migration, source_request
from tests.migration_helpers import free_port, need_sglang

SGLANG_PY = os.environ.get("KVBRIDGE_SGLANG_PYTHON")
DECODE_SIDE = Path(__file__).with_name("sglang_decode_peer.py")
#: The kind the decode side registers its state buffers as here: SGLang hard-codes VRAM
#: (``nixl/conn.py`` line 2023), which the CPU decode side turns into DRAM (``host_state_kinds``);
#: SGLang does not announce it, so kvbridge is told.
STATE_MEMORY = "DRAM"
#: DeepSeek-V4-Flash cut to 5 layers (ratios 0, 0, 4, 128, 4), without its MTP layer.
MODEL = FLASH.with_layers(5)
TOKENS = 1026  # ratio-4 state rows 1022..1025 straddle the SWA page boundary at 1024: two rings


def test_pd_layout_is_sglang_buffer_order():
    """Without SGLang: the buffer list for DeepSeek-V4-Pro (no SWA-only layer) and its sizes."""
    from kvbridge.adapters.sglang_protocol import pd_layout
    from kvbridge.engines.topology import PRO
    from kvbridge.migration import EnginePools

    pools = EnginePools.create("sglang", PRO, {"full": 1, "swa": 1, "state128": 1}, include_mtp=False)
    lay = pd_layout(pools)
    r4, r128 = PRO.layers_with_ratio(4), PRO.layers_with_ratio(128)
    assert [(s.layer, s.role) for s in lay.kv] == [(i, Role.COMPRESS) for i in r4] + [
        (i, Role.INDEXER) for i in r4] + [(i, Role.COMPRESS) for i in r128]
    assert [(s.layer, s.role) for s in lay.swa_state] == [(i, Role.SWA) for i in range(61)] + [
        (i, Role.STATE) for i in r4] + [(i, Role.INDEXER_STATE) for i in r4]
    assert [s.layer for s in lay.request_state] == r128
    assert lay.kv_layout == "v4,c4:v4,c128:v4" and lay.page_size == 256
    assert set(lay.kv_item_lens) == {37440, 8448, 1728}  # 64 and 2 records of 584 B, 576-aligned; 64 fp8 keys
    assert set(lay.state_item_lens[0]) == {149760, 65536, 16384} and set(lay.state_item_lens[1]) == {524288}


def test_kv_checksum_is_sglang_digest():
    """kvbridge's KV digest equals SGLang 0.5.23's Adler-32 kernel on its golden cases (fixtures/README.md),
    from host bytes (``kv_checksum``) and reduced where the tensors are (``kv_digest``)."""
    from safetensors import safe_open

    from kvbridge.adapters.sglang_protocol import kv_checksum, kv_digest

    path = Path(__file__).parents[1] / "fixtures" / "sglang_adler32_reference.safetensors"
    with safe_open(str(path), "np") as f:
        cases = json.loads(f.metadata()["cases"])
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    assert len(cases) == 6
    for case in cases:
        items = [tensors[it["buffer"]][it["offset"] + j * it["item_len"]:][: it["item_len"]]
                 for it in case["items"] for j in tensors[it["indices"]].tolist()]
        assert kv_checksum(items) == case["digest"], case["name"]
        assert kv_digest(torch.from_numpy(np.ascontiguousarray(i)) for i in items) == case["digest"], case["name"]
    assert kv_checksum([]) == 1 == kv_digest([])


def test_wire_messages_and_refusals():
    from kvbridge.adapters.sglang import SGLangPrefillPeer
    from kvbridge.adapters.sglang_protocol import TransferInfo, _pack_lists, _unpack_lists, metadata_row
    from kvbridge.errors import InputError
    from kvbridge.migration import EnginePools

    assert _unpack_lists(_pack_lists([[1, 2], [], [7]], "i"), "i") == [[1, 2], [], [7]]
    info = TransferInfo.parse([b"9", b"10.0.0.2", b"5555", b"agent", np.array([4, 1], "<i4").tobytes(), b"3", b"1",
                               _pack_lists([[8], [2]], "i"), b"0", b"0"])
    assert (info.room, info.kv_pages, info.aux_index, info.state_indices, info.dummy) == (9, [4, 1], 3, [[8], [2]],
                                                                                          False)
    row = metadata_row(2**40 + 5, 123)
    assert [len(b) for b in row] == [64, 64, 64, 64, 512, 512, 64, 128, 64, 64]
    assert metadata_row(9, 1, kv_checksum=0x1234ABCD)[10] == (0x1234ABCD).to_bytes(8, "little") + bytes(56)
    assert row[0][:4] == (123).to_bytes(4, "little") and row[-1][:8] == (2**40 + 5).to_bytes(8, "little")
    sg = EnginePools.create("sglang", MODEL, {"full": 1, "swa": 1, "state128": 1}, include_mtp=False)
    with pytest.raises(InputError, match="exactly one of"):
        SGLangPrefillPeer(sg, bootstrap_port=0, register_with="h:1")
    with pytest.raises(InputError, match="hidden_state_bytes"):
        SGLangPrefillPeer(sg, hidden_state_bytes=0)
    with pytest.raises(InputError, match="MTP"):
        SGLangPrefillPeer(EnginePools.create("sglang", MODEL, {"full": 1, "swa": 1, "state128": 1}))
    with pytest.raises(InputError, match="SGLang-profile"):
        SGLangPrefillPeer(EnginePools.create("trtllm", FLASH.with_layers(2), {"swa": 1}, include_mtp=False))
    peer = SGLangPrefillPeer(sg)
    with pytest.raises(InputError, match="room"):
        peer.add_request(0, {"full": [0], "swa": [0], "state128": [0]}, 10, 1)
    with pytest.raises(InputError, match="block table 'state128'"):
        peer.add_request(5, {"full": [0], "swa": [0]}, 10, 1)


def _need_sglang() -> None:
    need_sglang("SGLang adapter test")


@pytest.fixture(scope="module")
def request_pools():
    """An SGLang-profile source request: pools filled by SGLang's writers (kvbridge's profile)."""
    plan = plan_migration("sglang", "sglang", MODEL, TOKENS, include_mtp=False)
    return source_request(plan, spare_pages=2, seed=3)


def _decode(cfg: dict, tmp_path: Path) -> tuple[subprocess.Popen, callable]:
    base = {"kv_cache_dtype": "fp8_e4m3", "page_size": 256, "compress_ratios": list(MODEL.compress_ratios[:5]),
            "pages": 12, "req_slots": 4, "swa_pages": 12, "sliding_window": MODEL.sliding_window, "aux_rows": 4,
            "timeout": 90, "room": 4242, "num_tokens": TOKENS, "swa_page_ids": [9, 2],
            "req_pool_idx": 2, "kv_page_ids": [7, 0, 11, 3, 5], "aux_index": 3, "dump": str(tmp_path / "decode.npz")}
    base.update(cfg)
    proc = subprocess.Popen([SGLANG_PY, str(DECODE_SIDE)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=open(tmp_path / "decode.log", "w"), text=True)
    proc.stdin.write(json.dumps(base) + "\n")
    proc.stdin.flush()

    def next_line() -> dict:
        line = proc.stdout.readline()
        if not line:
            proc.wait(30)
            log = (tmp_path / "decode.log").read_text()[-3000:]
            raise AssertionError(f"SGLang decode side ended without a result (rc {proc.returncode}):\n{log}")
        return json.loads(line)

    return proc, next_line


def _until(next_line, key: str, value: str | None = None) -> dict:
    while True:
        msg = next_line()
        if "result" in msg and key != "result":
            raise AssertionError(f"decode side ended early: {msg}")
        if key in msg and (value is None or msg[key] == value):
            return msg


def _serve(pools, tables, *, tmp_path, decode_cfg, bootstrap="sglang", max_rate=None):
    """Run one request through kvbridge's peer into SGLang's receiver; returns (events, result, peer result)."""
    from kvbridge.adapters.sglang import SGLangPrefillPeer

    port = free_port()
    cfg = {"bootstrap": bootstrap, "bootstrap_port": port, **decode_cfg}
    if bootstrap == "kvbridge":
        peer = SGLangPrefillPeer(pools, bootstrap_port=0, state_memory=STATE_MEMORY).start()
        cfg["bootstrap_addr"] = peer.bootstrap_addr
        proc, next_line = _decode(cfg, tmp_path)
        layout = _until(next_line, "event", "layout")
    else:
        proc, next_line = _decode(cfg, tmp_path)
        layout = _until(next_line, "event", "layout")
        _until(next_line, "event", "ready")
        peer = SGLangPrefillPeer(pools, bootstrap_port=None, register_with=f"127.0.0.1:{port}",
                                 state_memory=STATE_MEMORY, max_rate=max_rate).start()
    try:
        peer.add_request(cfg.get("room", 4242), tables, TOKENS, first_token=31337)
        result = _until(next_line, "result")
        sent = peer.wait(cfg.get("room", 4242), timeout=30) if result["result"] in ("Success", "Failed") else None
    finally:
        peer.close()
        proc.wait(60)
    return layout, result, sent


@pytest.mark.parametrize("kv_checksum", [False, True], ids=["plain", "kv-checksum"])
def test_sglang_decode_receives_exact_bytes(request_pools, tmp_path, kv_checksum):
    """With ``kv_checksum`` the decode runs as with ``--disaggregation-enable-kv-checksum``: its checksum
    row holds, as SGLang's own code reads it, the Adler-32 of exactly the bytes that landed, in SGLang's
    order, and signature 0 ("not comparable": SGLang 0.5.23 cannot digest DeepSeek-V4 state). That case is
    also paced (``max_rate``: about a second for the room, in chunks, the metadata rows last)."""
    _need_sglang()
    from kvbridge.adapters.sglang_protocol import CHECKSUM_ROW_BYTES, metadata_item_lens, pd_layout

    src, tables = request_pools
    layout, result, sent = _serve(src, tables, tmp_path=tmp_path, decode_cfg={"kv_checksum": kv_checksum},
                                  max_rate=3_000_000 if kv_checksum else None)
    lay = pd_layout(src)
    # SGLang's own buffer list is the one the adapter models
    assert layout["kv_layout"] == lay.kv_layout == "v4,c4:v4,c128:v4"
    assert layout["kv_item_lens"] == list(lay.kv_item_lens)
    assert layout["state_types"] == list(lay.state_types) == ["swa", "c128_state"]
    assert layout["state_item_lens"] == [list(x) for x in lay.state_item_lens]
    assert layout["aux_item_lens"] == metadata_item_lens() + [CHECKSUM_ROW_BYTES] * kv_checksum
    assert result["result"] == "Success", result
    assert sent["status"] == "Success" and sent["peers"] == 1
    if kv_checksum:  # paced: the room took its bytes' share of the rate
        assert sent["seconds"] >= 0.9 * sent["bytes"] / 3_000_000, sent
    dump = np.load(result["dump"])

    def page(name: str, item: int, i: int) -> bytes:
        return dump[name][i * item : (i + 1) * item].tobytes()  # state buffers end with spare rows

    def ours(spec, pid: int) -> bytes:
        return src.pool(spec)[pid].numpy().tobytes()

    kv_pages, checked, landed = [7, 0, 11, 3, 5], 0, []
    for i, spec in enumerate(lay.kv):
        table = tables[src.storage(spec).table]
        for j, d in enumerate(kv_pages[: len(table)]):
            assert page(f"kv{i}", lay.kv_item_lens[i], d) == ours(spec, table[j]), (spec, j)
            landed.append(page(f"kv{i}", lay.kv_item_lens[i], d))
            checked += 1
        for d in set(range(12)) - set(kv_pages):
            assert not dump[f"kv{i}"].reshape(-1, lay.kv_item_lens[i])[d].any(), "a page the decode did not allocate"
    swa_table = tables["swa"]
    first = (TOKENS - MODEL.sliding_window) // 256
    for j, spec in enumerate(lay.swa_state):
        for k, d in enumerate([9, 2]):
            assert page(f"state0_{j}", lay.state_item_lens[0][j], d) == ours(spec, swa_table[first + k]), (spec, k)
            landed.append(page(f"state0_{j}", lay.state_item_lens[0][j], d))
            checked += 1
    for j, spec in enumerate(lay.request_state):
        assert page(f"state1_{j}", lay.state_item_lens[1][j], 2) == ours(spec, tables[src.storage(spec).table][0])
        landed.append(page(f"state1_{j}", lay.state_item_lens[1][j], 2))
        checked += 1
    roles = {s.role for s in (*lay.kv, *lay.swa_state, *lay.request_state)}
    assert roles == {Role.SWA, Role.COMPRESS, Role.INDEXER, Role.STATE, Role.INDEXER_STATE}
    # the metadata row: first output token, and the room SGLang checks against corruption
    assert int(dump["aux0"].view("<i4").reshape(-1, 16)[3, 0]) == 31337
    assert int(dump["aux9"].view("<u8").reshape(-1, 8)[3, 0]) == 4242
    assert checked == 5 * 4 + 5 * 2 + 2 * 2 + 2 * 2 + 1  # KV pages, SWA pages, two state rings each, c128 ring
    assert sent["bytes"] > 0
    if not kv_checksum:
        assert sent["kv_checksum"] is None and "kv_checksum_row" not in result
        return
    digest = zlib.adler32(b"".join(landed))
    assert result["kv_checksum_row"] == [digest, 0] and sent["kv_checksum"] == digest
    assert result["layout_signature"] != 0  # so SGLang's decode compares nothing: 0 is never a layout's
    assert int(dump["aux10"].view("<u8").reshape(-1, 8)[3, 0]) == digest


@pytest.mark.parametrize("case", ["layout", "page_size"])
def test_sglang_handshake_refuses_a_wrong_peer(case, tmp_path):
    """kvbridge announces what its pools are; SGLang's decode refuses another layout or page size."""
    _need_sglang()
    if case == "layout":  # a model without ratio-128 layers announces "v4,c4:v4"
        model = dataclasses.replace(MODEL, name="flash-no-c128", compress_ratios=(0, 0, 4, 4, 4, 0))
        plan = plan_migration("sglang", "sglang", model, TOKENS, include_mtp=False)
        bootstrap, want = "kvbridge", "KV layout mismatch"
    else:
        plan = plan_migration("sglang:swa=128", "sglang:swa=128", MODEL, TOKENS, include_mtp=False)
        bootstrap, want = "sglang", "Page size mismatch"
    pools, tables = source_request(plan, spare_pages=1)
    _, result, _ = _serve(pools, tables, tmp_path=tmp_path, decode_cfg={}, bootstrap=bootstrap)
    assert result["result"] == "refused", result
    assert want in result["reason"]


def test_mismatched_buffers_fail_the_request_with_a_reason(request_pools, tmp_path):
    """A bf16-state decode has the same layout string (SGLang's handshake passes) but other state
    item lengths: kvbridge writes nothing and the receiver fails with kvbridge's reason. (Through
    kvbridge's own bootstrap route: topology, rank lookup, registration, page ids, status.)"""
    _need_sglang()
    src, tables = request_pools
    _, result, sent = _serve(src, tables, tmp_path=tmp_path, decode_cfg={"state_dtype": "bf16"}, bootstrap="kvbridge")
    assert result["result"] == "Failed", result
    assert "kvbridge prefill peer" in result["reason"] and "state" in result["reason"]
    assert sent["status"] == "Failed" and sent["bytes"] == 0


def test_cli_serves_a_tensorrt_llm_request_to_sglang(tmp_path):
    """``kvbridge serve-sglang-prefill --from trtllm``: TensorRT-LLM's 512-B SWA records, converted to
    SGLang's 584-B pages, reach SGLang's receiver byte for byte as kvbridge's SGLang writer makes them.
    (The first two Flash layers are SWA-only: a request with compressor state cannot move between
    TensorRT-LLM and SGLang, which store the score with and without the positional bias.) Run in human
    mode at ``COLUMNS=80`` (the dump case below checks ``--json``): every line the command prints fits
    80 columns, the result as key/value lines."""
    _need_sglang()
    from kvbridge.migration import destination_pools, migrate_local

    model = FLASH.with_layers(2)
    port, room = free_port(), 77
    cfg = {"bootstrap": "sglang", "bootstrap_port": port, "compress_ratios": [0, 0], "room": room}
    proc, next_line = _decode(cfg, tmp_path)
    _until(next_line, "event", "ready")
    cli = subprocess.run([sys.executable, "-m", "cli.main", "serve-sglang-prefill", "--from", "trtllm", "--layers",
                          "2", "--tokens", str(TOKENS), "--room", str(room), "--first-token", "5",
                          "--register-with", f"127.0.0.1:{port}", "--state-memory",
                          "DRAM", "--timeout", "90"],
                         capture_output=True, text=True, timeout=300, cwd=Path(__file__).parents[1],
                         env={**os.environ, "COLUMNS": "80"})
    result = _until(next_line, "result")
    proc.wait(60)
    assert cli.returncode == 0, cli.stderr[-2000:]
    lines = [*cli.stdout.splitlines(), *cli.stderr.splitlines()]
    assert all(len(line) <= 80 for line in lines), [line for line in lines if len(line) > 80]
    said = " ".join(cli.stderr.split())  # the serving line, wrapped between words at 80 columns
    assert f"serving room {room} ({TOKENS:,} tokens" in said and "layout v4" in said, cli.stderr
    assert cli.stdout.splitlines()[0] == f"room {room}: Success", cli.stdout
    assert cli.stdout.splitlines()[1].startswith("  sent:") and " B in " in cli.stdout, cli.stdout
    assert result["result"] == "Success", result
    # the same request, converted here as the command did (same seeds)
    plan = plan_migration("trtllm", "sglang", model, TOKENS, include_mtp=False)
    src, src_tables = source_request(plan, seed=0)
    dst = destination_pools(plan)
    tables, _ = migrate_local(plan, src, src_tables, dst, loss_report=False)
    dump = np.load(result["dump"])
    first = (TOKENS - MODEL.sliding_window) // 256
    for j in range(2):
        spec = model.caches(j)[0]
        item = dst.storage(spec).page_bytes
        for k, d in enumerate([9, 2]):
            assert dump[f"state0_{j}"][d * item : (d + 1) * item].tobytes() == \
                dst.pool(spec)[tables["swa"][first + k]].numpy().tobytes()


def test_a_dump_loads_into_the_peer_pools_as_its_request(tmp_path):
    """``SGLangPrefillPeer.add_dump_request``: the entries ``request_dump`` wrote (SGLang's 584-B pages)
    come back, byte for byte, as the request's live records; a TensorRT-LLM dump is converted as
    ``convert_entry`` does; a model with compressed layers (state a dump does not hold) and a dump
    of another length are refused with the remedy, before any page is taken."""
    from kvbridge.adapters.sglang import SGLangPrefillPeer, request_dump
    from kvbridge.dumps.convert import convert_entry
    from kvbridge.dumps.dumpfile import read_dump
    from kvbridge.dumps.writer import write_dump
    from kvbridge.errors import InputError
    from kvbridge.migration import destination_pools
    from kvbridge.migration.pools import gather_records, table_of

    model = FLASH.with_layers(2)
    plan = plan_migration("sglang", "sglang", model, TOKENS, include_mtp=False)
    src, src_tables = source_request(plan, seed=9)
    entries, attrs = request_dump(src, src_tables, plan)
    path = write_dump(tmp_path / "request.safetensors", entries, attrs=attrs)
    peer = SGLangPrefillPeer(destination_pools(plan), state_memory=STATE_MEMORY)
    tables = peer.add_dump_request(5, read_dump(path), TOKENS, 1)
    for t in plan.transfers:
        assert torch.equal(gather_records(peer.pools.pool(t.spec), t.dst, table_of(tables, t.dst), t.first, t.count),
                           gather_records(src.pool(t.spec), t.src, table_of(src_tables, t.src), t.first, t.count))
    # the same request as TensorRT-LLM pages: converted on loading
    trt = [convert_entry(e, "trtllm-fp8", page_size=32)[0] for e in entries]
    peer2 = SGLangPrefillPeer(destination_pools(plan), state_memory=STATE_MEMORY)
    tables2 = peer2.add_dump_request(6, read_dump(write_dump(tmp_path / "trt.safetensors", trt, attrs=attrs)),
                                     TOKENS, 1)
    for t, e in zip(plan.transfers, trt, strict=True):
        back = convert_entry(e, t.dst.layout, page_size=t.dst.page_size, dialect=t.dst.dialect, scale=t.dst.scale)[0]
        assert torch.equal(gather_records(peer2.pools.pool(t.spec), t.dst, table_of(tables2, t.dst), t.first, t.count),
                           t.dst.layout.pages_to_records(back.data, t.dst.page_size, t.count))
    free = {k: sorted(v) for k, v in peer2.pools.free.items()}
    with pytest.raises(InputError, match="keeps"):
        peer2.add_dump_request(7, read_dump(path), TOKENS + 300, 1)
    assert {k: sorted(v) for k, v in peer2.pools.free.items()} == free
    big = plan_migration("sglang", "sglang", MODEL, TOKENS, include_mtp=False)
    with pytest.raises(InputError, match="compressor state"):
        SGLangPrefillPeer(destination_pools(big)).add_dump_request(8, read_dump(path), TOKENS, 1)


def test_cli_serves_a_dump_to_sglang(tmp_path):
    """``kvbridge serve-sglang-prefill --dump``: a kvbridge dump of a request (the first two Flash layers)
    reaches SGLang's own receiver byte for byte; ``--from`` with ``--dump`` is a usage error."""
    _need_sglang()
    from kvbridge.adapters.sglang import request_dump
    from kvbridge.dumps.writer import write_dump

    model = FLASH.with_layers(2)
    plan = plan_migration("sglang", "sglang", model, TOKENS, include_mtp=False)
    src, tables = source_request(plan, seed=12)
    entries, attrs = request_dump(src, tables, plan)
    path = write_dump(tmp_path / "request.safetensors", entries, attrs=attrs)
    base = [sys.executable, "-m", "cli.main", "serve-sglang-prefill", "--dump", str(path), "--layers", "2",
            "--tokens", str(TOKENS)]
    bad = subprocess.run([*base, "--room", "1", "--from", "trtllm"], capture_output=True, text=True, timeout=120,
                         cwd=Path(__file__).parents[1])
    assert bad.returncode == 2 and "synthetic" in bad.stderr
    port, room = free_port(), 78
    proc, next_line = _decode({"bootstrap": "sglang", "bootstrap_port": port, "compress_ratios": [0, 0],
                               "room": room}, tmp_path)
    _until(next_line, "event", "ready")
    cli = subprocess.run([*base, "--room", str(room), "--first-token", "5", "--register-with", f"127.0.0.1:{port}",
                          "--state-memory", STATE_MEMORY, "--timeout", "90", "--json"],
                         capture_output=True, text=True, timeout=300, cwd=Path(__file__).parents[1])
    result = _until(next_line, "result")
    proc.wait(60)
    assert cli.returncode == 0, cli.stderr[-2000:]
    assert json.loads(cli.stdout)["status"] == "Success" and result["result"] == "Success", (cli.stdout, result)
    dump = np.load(result["dump"])
    first = (TOKENS - MODEL.sliding_window) // 256
    for j in range(2):
        spec = model.caches(j)[0]
        item = src.storage(spec).page_bytes
        for k, d in enumerate([9, 2]):  # the decode's SWA pages (_decode's swa_page_ids)
            assert dump[f"state0_{j}"][d * item : (d + 1) * item].tobytes() == \
                src.pool(spec)[tables["swa"][first + k]].numpy().tobytes()


def _start_in_daemon(out) -> None:
    """A daemonic process (a worker of vLLM's multiprocess executor) starting the peer: no child process."""
    from kvbridge.adapters.sglang import SGLangPrefillPeer
    from kvbridge.engines.profiles import parse_engine
    from kvbridge.migration.pools import EnginePools

    prof = parse_engine("sglang")
    pools = EnginePools.create(prof, MODEL, plan_migration(prof, prof, MODEL, 64, include_mtp=False).held_pages("dst"),
                               include_mtp=False)
    try:
        with SGLangPrefillPeer(pools) as peer:
            out.put(("started", type(peer._agent).__name__))
    except Exception as exc:
        out.put(("failed", repr(exc)))


def test_the_peer_starts_in_a_daemonic_process():
    """vLLM's workers are daemonic: the peer's NIXL agent runs in that process (``_new_agent``)."""
    pytest.importorskip("nixl")
    import multiprocessing

    ctx = multiprocessing.get_context("spawn")
    out = ctx.Queue()
    proc = ctx.Process(target=_start_in_daemon, args=(out,), daemon=True)
    proc.start()
    try:
        assert out.get(timeout=120) == ("started", "_LocalAgent")
    finally:
        proc.join(30)


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-v"]))
