"""Per-layer streaming over gloo, and the gloo path of `kvbridge migrate serve` / `send`.

Two real processes on 127.0.0.1. The receiver verifies each layer group as it lands: the
sender sends group 1 and waits until the receiver reports it verified before sending the
rest (without streaming this would time out). A bit flipped in the last group still leaves
nothing published. `GlooServer` + `send_request_tcp` form a gloo pair per request after a
kvbridge handshake, and refuse a request for a different plan.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import time

import torch
import torch.distributed as dist
from migration_helpers import free_port, init_gloo_pair

from kvbridge.engines.topology import FLASH
from kvbridge.errors import KVBridgeError
from kvbridge.migration import ChecksumError, destination_pools, gather_records, plan_migration, source_request
from kvbridge.migration import transport as tr
from kvbridge.migration.stream import layer_groups

MODEL = FLASH.with_layers(4)
TOKENS = 1100
PAIR = ("trtllm:fp8:tpb=128", "vllm")
TIMEOUT_S = 30.0
JOIN_S = 120


def _plan(dst: str = PAIR[1]):
    return plan_migration(PAIR[0], dst, MODEL, TOKENS)


def _stream_sender(port: int, first_verified, out) -> None:
    init_gloo_pair(0, port)
    plan = _plan()
    src, tables = source_request(plan, spare_pages=1, seed=21)
    sender = tr.GlooSender(plan, src, tables, dst_rank=1, convert_on="receiver", timeout=TIMEOUT_S)
    sender.send_group()
    out.put(("streamed", first_verified.wait(TIMEOUT_S)))
    for _ in sender.groups[1:]:
        sender.send_group()
    out.put(("sent", sender.close()))
    pack = tr.pack_group

    def corrupt_last(plan, src, tables, indices, **kw):
        payload = pack(plan, src, tables, indices, **kw)
        if indices == layer_groups(plan)[-1]:
            payload.records[0][0, 0] ^= 0x01  # after the checksums were taken
        return payload

    tr.pack_group = corrupt_last
    src, tables = source_request(plan, spare_pages=1, seed=22)
    tr.send_request(plan, src, tables, dst_rank=1, layers_per_group=1, convert_on="sender", timeout=TIMEOUT_S)
    dist.barrier()
    dist.destroy_process_group()


def _stream_receiver(port: int, first_verified, out) -> None:
    init_gloo_pair(1, port)
    plan = _plan()
    dst = destination_pools(plan, spare_pages=1, seed=3)
    seen = []

    def on_group(done: int, total: int) -> None:
        seen.append((done, total))
        if done == 1:
            first_verified.set()

    tables, report = tr.receive_request(plan, dst, src_rank=0, timeout=TIMEOUT_S, on_group=on_group)
    src, src_tables = source_request(plan, spare_pages=1, seed=21)
    ref = destination_pools(plan, spare_pages=1, seed=3)
    from kvbridge.migration import migrate_local

    ref_tables, _ = migrate_local(plan, src, src_tables, ref)
    same = all(torch.equal(gather_records(dst.pool(t.spec), t.dst, tables[t.dst.table], t.first, t.count),
                           gather_records(ref.pool(t.spec), t.dst, ref_tables[t.dst.table], t.first, t.count))
               for t in plan.transfers)
    out.put(("first", {"seen": seen, "same_as_local": same, "payload_bytes": report.payload_bytes}))
    dst = destination_pools(plan, spare_pages=1, seed=3)
    before = dst.num_free()
    try:
        tr.receive_request(plan, dst, src_rank=0, timeout=TIMEOUT_S)
        error = "no error"
    except ChecksumError as exc:
        error = str(exc)
    out.put(("corrupt", {"error": error, "unchanged": dst.num_free() == before,
                         "zero": not any(bool(t.any()) for t in dst.pools.values())}))
    dist.barrier()
    dist.destroy_process_group()


def _run(targets) -> dict:
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=fn, args=(*args, out)) for fn, args in targets]
    for p in procs:
        p.start()
    results: dict = {}
    try:
        deadline = time.monotonic() + JOIN_S
        for p in procs:
            p.join(max(0.0, deadline - time.monotonic()))
        while not out.empty():
            key, value = out.get()
            results[key] = value
        results["exitcodes"] = [p.exitcode for p in procs]
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(5)
    return results


def test_gloo_streams_layer_groups_and_publishes_all_or_nothing():
    ctx = mp.get_context("spawn")
    first = ctx.Event()
    port = free_port()
    res = _run([(_stream_sender, (port, first)), (_stream_receiver, (port, first))])
    assert res["exitcodes"] == [0, 0], res
    assert res["streamed"] is True  # group 1 was verified before group 2 left the sender
    groups = len(layer_groups(_plan()))
    assert res["first"]["seen"] == [(g, groups) for g in range(1, groups + 1)]
    assert res["first"]["same_as_local"] is True
    assert res["sent"] == res["first"]["payload_bytes"] == sum(t.src_bytes for t in _plan().transfers)
    corrupt = res["corrupt"]
    assert corrupt["error"].startswith("checksum mismatch in layer 4 "), corrupt["error"]  # the MTP layer, last
    assert corrupt["unchanged"] and corrupt["zero"]


def _server(port_q, out) -> None:
    plan = _plan()
    dst = destination_pools(plan, spare_pages=1, seed=3)

    def plan_for(info: dict):
        return plan_migration(info["src"], PAIR[1], MODEL, int(info["num_tokens"]))

    server = tr.GlooServer(dst, plan=plan_for)
    port_q.put(server.address[1])
    got = server.receive(timeout=TIMEOUT_S, accept_timeout=JOIN_S)
    assert got is not None
    peer, rid, tables, report = got
    out.put(("good", {"tables": json.dumps(tables), "converted_on": report.converted_on}))
    before = dst.num_free()
    try:
        server.receive(timeout=TIMEOUT_S, accept_timeout=JOIN_S)
        out.put(("other", "no error"))
    except KVBridgeError as exc:
        out.put(("other", f"{type(exc).__name__}: {exc}"))
    out.put(("other_unchanged", dst.num_free() == before))
    server.close()


def _client(port_q, out) -> None:
    port = port_q.get(timeout=JOIN_S)
    plan = _plan()
    src, tables = source_request(plan, spare_pages=1, seed=23)
    summary = tr.send_request_tcp(plan, src, tables, host="127.0.0.1", port=port, convert_on="sender",
                                  layers_per_group=2, timeout=TIMEOUT_S)
    out.put(("client_good", summary["payload_bytes"]))
    other = _plan("vllm:idx=fp4")  # the server takes vllm with fp8 indexer keys
    src, tables = source_request(other, spare_pages=1, seed=23)
    try:
        tr.send_request_tcp(other, src, tables, host="127.0.0.1", port=port, timeout=TIMEOUT_S)
        out.put(("client_other", "no error"))
    except KVBridgeError as exc:
        out.put(("client_other", f"{type(exc).__name__}: {exc}"))


def test_gloo_server_forms_a_pair_per_request_and_refuses_another_plan():
    ctx = mp.get_context("spawn")
    port_q = ctx.Queue()
    res = _run([(_server, (port_q,)), (_client, (port_q,))])
    assert res["exitcodes"] == [0, 0], res
    plan = _plan()
    assert res["good"]["converted_on"] == "sender"
    assert res["client_good"] == sum(t.dst_bytes for t in plan.transfers)
    assert res["other"].startswith("MigrationError: refused request ") and "plan fingerprints differ" in res["other"]
    assert res["client_other"].startswith("MigrationError: refused request ")
    assert res["other_unchanged"] is True
