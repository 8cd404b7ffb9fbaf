"""NIXL migration between real processes over loopback (UCX, DRAM to DRAM), and its faults.

Two receiver processes serve for the whole module: one with vLLM pools, one with
TensorRT-LLM FP8 pools (tokens_per_block 128). Sender processes send them, in order:

- receiver A (vLLM): TensorRT-LLM -> vLLM converted on the receiver (staging buffer), the
  same converted on the sender (page-index writes into A's pools), a request for a different
  plan, a page corrupted in flight, a non-kvbridge peer, a sender killed mid-request, a sender
  that stalls past A's timeout, and a last good request: A keeps serving after every fault;
- receiver B (TensorRT-LLM): vLLM -> TensorRT-LLM converted on each side (its compressor state
  lands in separate kv and score pools with block tables of their own).

The request is 1100 tokens of DeepSeek-V4-Flash cut to 4 layers (+ MTP), streamed one layer
per group: ratios [0, 0, 4, 128] + [0], so 275 C4 entries and indexer keys, 8 C128 entries,
compressor state of both ratios, and a 128-token SWA window across a page boundary (1024) in
both engines. Every process runs under a hard deadline and every receive under its own timeout.
The CLI test runs `kvbridge migrate serve` / `send` as processes: a dump sent either way is
written exactly as `kvbridge convert` writes it, and a refused request shows in exit codes.
"""

from __future__ import annotations

import json
import os
import re
import socket
import struct
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as tmp
from click.testing import CliRunner
from migration_helpers import expected_records
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from kvbridge.engines.topology import FLASH
from kvbridge.errors import KVBridgeError
from kvbridge.migration import EnginePools, gather_records, plan_migration, source_request
from kvbridge.migration.control import MAGIC, PROTOCOL_VERSION
from kvbridge.migration.nixl import NixlReceiver, NixlSender
from kvbridge.migration.nixl_agent import nixl_available
from kvbridge.migration.nixl_send import _Connection
from kvbridge.migration.nixl_wire import _descriptors, _pieces_of, _pool_chunks, _pool_keys, _stage_runs, _tensor_tables
from kvbridge.migration.pools import pool_tensors, table_of

pytestmark = pytest.mark.skipif(not nixl_available(), reason="needs the nixl extra: pip install 'kvbridge[nixl]'")

MODEL = FLASH.with_layers(4)
TOKENS = 1100
TRTLLM, VLLM = "trtllm:fp8:tpb=128", "vllm"
RECV_TIMEOUT_S = 40.0
STALL_TIMEOUT_S = 6.0
#: Receiver A's requests, in order, and the timeout it gives each.
A_SCENARIOS = ["fwd-receiver", "fwd-sender", "other-plan", "corrupt", "foreign", "malformed", "killed", "stalled",
               "after-faults"]
B_SCENARIOS = ["rev-receiver", "rev-sender"]
STEP_TIMEOUT_S = 120
REPO = Path(__file__).resolve().parents[1]


def _plan(src: str, dst: str):
    return plan_migration(src, dst, MODEL, TOKENS)


def _pools(engine: str) -> EnginePools:
    cap = plan_migration(engine, engine, MODEL, TOKENS).held_pages("dst")
    return EnginePools.create(engine, MODEL, {k: v + 3 for k, v in cap.items()}, seed=5)


def _receiver_main(engine: str, timeouts: list[float], addr_q, done_q, out_dir: str, tag: str) -> None:
    dst = _pools(engine)

    def plan_for(info: dict):
        return plan_migration(info["src"], engine, MODEL, int(info["num_tokens"]))

    with NixlReceiver(dst, plan=plan_for) as rx:
        addr_q.put((tag, rx.address))
        for k, timeout in enumerate(timeouts):
            before = dst.num_free()
            meta: dict[str, str] = {"free_before": json.dumps(before)}
            tensors = {}
            verified: list[tuple[int, int]] = []
            try:
                got = rx.receive(timeout=timeout, accept_timeout=STEP_TIMEOUT_S,
                                 on_group=lambda done, total, seen=verified: seen.append((done, total)))
                assert got is not None and got.report is not None and got.tables is not None
                meta.update(tables=json.dumps(got.tables), report=json.dumps(got.report.to_dict()))
                tensors = {f"{layer}.{role.value}.{i}": t.clone() for (layer, role), v in dst.pools.items()
                           for i, t in enumerate(pool_tensors(v))}
                for v in dst.pools.values():
                    for t in pool_tensors(v):
                        t.zero_()
                dst.release(got.tables)
            except KVBridgeError as exc:
                meta["error"] = f"{type(exc).__name__}: {exc}"
                meta["all_zero"] = str(not any(bool(t.any()) for v in dst.pools.values() for t in pool_tensors(v)))
            meta["free_after"] = json.dumps(dst.num_free())
            meta["verified"] = json.dumps(verified)
            save_file(tensors, f"{out_dir}/{tag}{k}.safetensors", metadata=meta)
            done_q.put((tag, k))


def _send(addr, src: str, dst: str, seed: int, convert_on: str, sender: NixlSender | None = None) -> dict:
    plan = _plan(src, dst)
    pools, tables = source_request(plan, spare_pages=2, seed=seed)
    own = sender is None
    sender = sender or NixlSender(*addr, timeout=RECV_TIMEOUT_S)
    try:
        return sender.send_request(plan, pools, tables, convert_on=convert_on)
    finally:
        if own:
            sender.close()


def _sender_main(addr_a, addr_b, result_q) -> None:
    """Good requests both ways, a different plan, and a corrupted page, from one reused sender per peer."""
    results = {}
    with NixlSender(*addr_a, timeout=RECV_TIMEOUT_S) as to_a, NixlSender(*addr_b, timeout=RECV_TIMEOUT_S) as to_b:
        results["fwd-receiver"] = _send(addr_a, TRTLLM, VLLM, 11, "receiver", to_a)
        results["fwd-sender"] = _send(addr_a, TRTLLM, VLLM, 12, "sender", to_a)
        results["rev-receiver"] = _send(addr_b, VLLM, TRTLLM, 13, "receiver", to_b)
        results["rev-sender"] = _send(addr_b, VLLM, TRTLLM, 14, "sender", to_b)
        try:
            _send(addr_a, TRTLLM, "vllm:idx=fp4", 15, "receiver", to_a)  # A serves vllm (fp8 keys): another plan
            results["other-plan"] = "no error"
        except KVBridgeError as exc:
            results["other-plan"] = f"{type(exc).__name__}: {exc}"
        post = _Connection.post

        def corrupting_post(self, g, pieces, header):
            if g == 2:  # one bit of group 3 flips after its checksums were taken, before the wire
                self.staged[pieces[0][0] + 5] ^= 0x10
            return post(self, g, pieces, header)

        _Connection.post = corrupting_post
        try:
            _send(addr_a, TRTLLM, VLLM, 16, "sender", to_a)
            results["corrupt"] = "no error"
        except KVBridgeError as exc:
            results["corrupt"] = f"{type(exc).__name__}: {exc}"
        finally:
            _Connection.post = post
    result_q.put(results)


def _fault_sender_main(addr, go, started, result_q, mode: str) -> None:
    """Ready (request built, agent started) before ``go``; then a good request, or one that stops
    after group 3 is posted: the test kills it there ("killed") or lets it hang ("stalled")."""
    plan = _plan(TRTLLM, VLLM)
    pools, tables = source_request(plan, spare_pages=2, seed=18 if mode == "last" else 17)
    sender = NixlSender(*addr, timeout=300 if mode != "last" else RECV_TIMEOUT_S)
    sender.warm_up(sum(t.dst_bytes for t in plan.transfers))
    started.set()
    go.wait(4 * STEP_TIMEOUT_S)
    if mode == "last":
        result_q.put(sender.send_request(plan, pools, tables, convert_on="sender"))
        sender.close()
        return
    stream = sender.start_request(plan, pools, tables, convert_on="sender")
    for _ in range(3):  # the third call completes group 2: groups 1 and 2 reach the receiver
        stream.send_group()
    result_q.put(mode)
    time.sleep(300)  # killed here by the test, mid-request


def _wait(q, what: str, timeout: float = STEP_TIMEOUT_S):
    try:
        return q.get(timeout=timeout)
    except Exception:
        raise AssertionError(f"timed out waiting for {what}") from None


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    out = tmp_path_factory.mktemp("nixl")
    ctx = tmp.get_context("spawn")
    addr_q, done_q, result_q = ctx.Queue(), ctx.Queue(), ctx.Queue()
    timeouts_a = [STALL_TIMEOUT_S if s == "stalled" else RECV_TIMEOUT_S for s in A_SCENARIOS]
    procs = [ctx.Process(target=_receiver_main, args=(VLLM, timeouts_a, addr_q, done_q, str(out), "A")),
             ctx.Process(target=_receiver_main, args=(TRTLLM, [RECV_TIMEOUT_S] * 2, addr_q, done_q, str(out), "B"))]
    for p in procs:
        p.start()
    addrs = dict(_wait(addr_q, "a receiver's address") for _ in procs)
    addr_a, addr_b = addrs["A"], addrs["B"]
    done: set[tuple[str, int]] = set()

    def wait_done(tag: str, k: int) -> None:
        while (tag, k) not in done:
            done.add(_wait(done_q, f"receiver {tag} request {k}"))

    info: dict = {}
    try:
        procs.append(ctx.Process(target=_sender_main, args=(addr_a, addr_b, result_q)))
        faults = {}
        for mode in ("killed", "stalled", "last"):  # start now, send later: their start-up overlaps the rest
            go, started, q = ctx.Event(), ctx.Event(), ctx.Queue()
            faults[mode] = (ctx.Process(target=_fault_sender_main, args=(addr_a, go, started, q, mode)), go, started, q)
            procs.append(faults[mode][0])
        for p in procs[2:]:
            p.start()
        info["sender"] = _wait(result_q, "the sender's results", 4 * STEP_TIMEOUT_S)
        wait_done("A", 3)
        with socket.create_connection(addr_a, timeout=30) as s:  # a foreign peer
            s.sendall(b"GET / HTTP/1.1\r\nHost: kvbridge\r\n\r\n")
            s.settimeout(30)
            info["foreign_reply"] = s.recv(1 << 16)
        wait_done("A", 4)
        with socket.create_connection(addr_a, timeout=30) as s:  # kvbridge's magic, then a hello missing its fields
            body = json.dumps({"type": "hello", "kind": "request"}).encode()
            s.sendall(MAGIC + struct.pack(">H", PROTOCOL_VERSION) + struct.pack(">II", len(body), 0) + body)
            s.settimeout(30)
            info["malformed_reply"] = s.recv(1 << 16)
        wait_done("A", 5)
        for mode in ("killed", "stalled"):
            p, go, started, q = faults[mode]
            assert started.wait(STEP_TIMEOUT_S), f"{mode} sender never got ready"
            go.set()
            assert _wait(q, f"the {mode} sender's third group") == mode
            info[f"{mode}_at"] = time.monotonic()
            if mode == "killed":
                p.kill()
            wait_done("A", A_SCENARIOS.index(mode))
            info[f"{mode}_after_s"] = time.monotonic() - info[f"{mode}_at"]
            p.kill()
        p, go, started, q = faults["last"]
        go.set()
        info["last"] = _wait(q, "the last sender")
        wait_done("A", len(A_SCENARIOS) - 1)
        wait_done("B", len(B_SCENARIOS) - 1)
        for p in procs[:2]:
            p.join(30)
        info["exitcodes"] = [p.exitcode for p in procs[:2]]
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(5)
    return out, info


def _load(out: Path, tag: str, name: str) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    k = (A_SCENARIOS if tag == "A" else B_SCENARIOS).index(name)
    path = out / f"{tag}{k}.safetensors"
    with safe_open(str(path), "pt") as fh:
        meta = fh.metadata()
    return load_file(str(path)), meta


def _check_request(out: Path, tag: str, name: str, pair: tuple[str, str], seed: int, converted_on: str) -> dict:
    tensors, meta = _load(out, tag, name)
    assert "error" not in meta, meta.get("error")
    plan = _plan(*pair)
    groups = MODEL.num_layers + MODEL.num_mtp_layers
    assert json.loads(meta["verified"]) == [[g, groups] for g in range(1, groups + 1)]  # one layer at a time
    tables = json.loads(meta["tables"])
    report = json.loads(meta["report"])
    assert report["converted_on"] == converted_on
    assert report["payload_bytes"] == sum(t.dst_bytes if converted_on == "sender" else t.src_bytes
                                          for t in plan.transfers)
    src, src_tables = source_request(plan, spare_pages=2, seed=seed)
    shapes = _pools(pair[1])
    claimed = {name: {i for i in ids if i >= 0} for name, ids in tables.items()}
    for t in plan.transfers:
        key = f"{t.spec.layer}.{t.spec.role.value}"
        parts = tuple(tensors[f"{key}.{i}"] for i in range(len(pool_tensors(shapes.pool(t.spec)))))
        pool = parts if len(parts) > 1 else parts[0]
        src_rec = gather_records(src.pool(t.spec), t.src, table_of(src_tables, t.src), t.first, t.count)
        got = gather_records(pool, t.dst, table_of(tables, t.dst), t.first, t.count)
        assert torch.equal(got, expected_records(t, src_rec)), f"layer {t.spec.layer} {t.spec.role.value}"
        for tensor, name in _tensor_tables(t.dst, pool):
            outside = [i for i in range(tensor.shape[0]) if i not in claimed[name]]
            assert not bool(tensor[outside].any()), "bytes written outside the request's pages"
    return report


def test_receivers_exit_cleanly(results):
    _, info = results
    assert info["exitcodes"] == [0, 0]


def test_trtllm_to_vllm_converted_on_receiver_bytes_match_reference(results):
    out, info = results
    report = _check_request(out, "A", "fwd-receiver", (TRTLLM, VLLM), 11, "receiver")
    assert report["kv_lossless"] is True  # per-tensor E4M3 at scale 1 -> MODEL1 loses nothing
    assert info["sender"]["fwd-receiver"]["payload_bytes"] == report["payload_bytes"]


def test_trtllm_to_vllm_converted_on_sender_written_by_page_index(results):
    out, _ = results
    _check_request(out, "A", "fwd-sender", (TRTLLM, VLLM), 12, "sender")


@pytest.mark.parametrize(("name", "seed", "side"), [("rev-receiver", 13, "receiver"), ("rev-sender", 14, "sender")])
def test_vllm_to_trtllm_both_sides_bytes_match_reference(results, name, seed, side):
    out, _ = results
    report = _check_request(out, "B", name, (VLLM, TRTLLM), seed, side)
    # MODEL1 -> per-tensor E4M3 at scale 1 cannot hold the 2^-12-scaled tokens exactly.
    assert report["kv_lossless"] is False and report["kv_max_abs_error"] > 0


def _check_refused(out: Path, name: str) -> str:
    _, meta = _load(out, "A", name)
    error = meta.get("error", "no error")
    assert "\n" not in error
    assert meta["free_after"] == meta["free_before"], "pages stayed claimed"
    assert meta["all_zero"] == "True", "bytes of a failed request stayed in the pools"
    return error


def test_different_plan_is_refused_on_both_sides(results):
    out, info = results
    error = _check_refused(out, "other-plan")
    assert error.startswith("MigrationError: refused request "), error
    assert "plan fingerprints differ" in error and "idx=fp4" in error
    assert info["sender"]["other-plan"].startswith("MigrationError: refused request ")


def test_page_corrupted_in_flight_is_detected_and_nothing_is_claimed(results):
    out, info = results
    error = _check_refused(out, "corrupt")
    assert error.startswith("ChecksumError: checksum mismatch in layer 2 "), error
    assert "destination page run" in error and error.endswith("nothing was published")
    assert info["sender"]["corrupt"].startswith("MigrationError: checksum mismatch in layer 2 ")


def test_non_kvbridge_peer_is_refused_with_one_line(results):
    out, info = results
    error = _check_refused(out, "foreign")
    assert re.match(r"MigrationError: refused 127\.0\.0\.1:\d+: not a kvbridge migration peer \(it sent b'G'\)",
                    error), error
    assert b"not a kvbridge migration peer" in info["foreign_reply"]


def test_malformed_hello_is_refused_with_one_line(results):
    out, info = results
    error = _check_refused(out, "malformed")  # the hello lacks every field: its request id is checked first
    assert error.startswith("MigrationError: the request id from 127.0.0.1:"), error
    assert error.endswith("must be a non-empty string, got None"), error
    assert b"must be a non-empty string, got None" in info["malformed_reply"]


def test_sender_killed_mid_request_is_a_transfer_error(results):
    out, info = results
    error = _check_refused(out, "killed")
    assert error.startswith("TransferError: 127.0.0.1:") and "closed the connection before group 3/5" in error, error
    _, meta = _load(out, "A", "killed")
    assert json.loads(meta["verified"]) == [[1, 5], [2, 5]]  # streamed: verified while the sender still ran
    assert info["killed_after_s"] < RECV_TIMEOUT_S  # noticed at once, not at the timeout


def test_stalled_sender_is_a_transfer_error_within_the_timeout(results):
    out, info = results
    error = _check_refused(out, "stalled")
    assert error.startswith("TransferError: timed out waiting for group 3/5"), error
    assert info["stalled_after_s"] < STALL_TIMEOUT_S + 10


def test_receiver_keeps_serving_after_every_fault(results):
    out, info = results
    _check_request(out, "A", "after-faults", (TRTLLM, VLLM), 18, "sender")
    assert info["last"]["converted_on"] == "sender"


def test_descriptors_merge_adjacent_pages():
    """A run of whole, adjacent destination pages without padding is one descriptor."""
    plan = _plan(VLLM, TRTLLM)
    t = next(t for t in plan.transfers if t.spec.role.value == "compress" and t.spec.ratio == 4)
    pages = -(-t.count // t.dst.page_size)
    key = _pool_keys(t)[0]
    chunks = [c for c, _ in _pool_chunks(t, {t.dst.table: list(range(pages))}, [pages])]
    local, remote = _descriptors(_pieces_of(chunks, 0), 1 << 20, {key: 1 << 30})
    assert t.dst.page_bytes == t.dst.page_size * t.dst.record_bytes and t.dst.split is None
    assert len(chunks) == pages and local.shape == (1, 3) and remote.shape == (1, 3)
    assert int(local[0, 1]) == int(remote[0, 1]) == t.count * t.dst.record_bytes
    scattered = [c for c, _ in _pool_chunks(t, {t.dst.table: list(range(pages))[::-1]}, [pages])]
    assert _descriptors(_pieces_of(scattered, 0), 0, {key: 0})[0].shape == (pages, 3)
    # block-split MODEL1 pages (vLLM): both parts of a whole page are one piece (padding separates
    # pages); a partly filled last page is two, one per part
    t = next(t for t in _plan(TRTLLM, VLLM).transfers if t.spec.role.value == "compress" and t.spec.ratio == 4)
    pages = -(-t.count // t.dst.page_size)
    runs = _pool_chunks(t, {t.dst.table: list(range(pages))}, [pages])
    local, _ = _descriptors(_pieces_of([c for c, _ in runs], 0), 0, {_pool_keys(t)[0]: 0})
    assert t.dst.split is not None and len(runs) == pages and t.count % t.dst.page_size
    assert local.shape == (pages + 1, 3)


@pytest.mark.parametrize("pair", [(TRTLLM, VLLM), (VLLM, TRTLLM)])
def test_staged_runs_land_as_the_destination_pool_holds_them(pair):
    """What the sender stages for a run is byte for byte what the pool holds once the run is written
    (scattered page ids; TensorRT-LLM's compressor state in separate kv and score pools)."""
    from kvbridge.migration.pools import scatter_records

    plan = _plan(*pair)
    pools = _pools(pair[1])
    tables = pools.claim(plan.table_lengths("dst"), plan.released("dst"))
    assert any(t.dst.separate_pools for t in plan.transfers) == (pair[1] == TRTLLM)
    for t in plan.transfers:
        pool = pools.pool(t.spec)
        rec = torch.randint(0, 256, (t.count, t.dst.record_bytes), dtype=torch.uint8)
        scatter_records(pool, t.dst, table_of(tables, t.dst), t.first, rec)
        runs = _pool_chunks(t, tables, [x.shape[0] for x in pool_tensors(pool)])
        staged = torch.zeros(t.dst_bytes, dtype=torch.uint8).numpy()
        _stage_runs(staged, 0, rec, runs, t.dst.page_size)
        memory = dict(zip(_pool_keys(t), (x.reshape(-1).numpy() for x in pool_tensors(pool)), strict=True))
        for off, key, roff, n in _pieces_of([c for c, _ in runs], 0):
            assert (staged[off : off + n] == memory[key][roff : roff + n]).all(), f"{t.spec.layer} {t.spec.role}"


# --- the two commands -------------------------------------------------------------------------


def _cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "cli.main", *args]


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}


def _start_serve(*args: str) -> tuple[subprocess.Popen, int]:
    proc = subprocess.Popen(_cli("migrate", "serve", "--listen", "127.0.0.1:0", *args), cwd=REPO, env=_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    line = proc.stderr.readline() if proc.stderr else ""
    match = re.search(r"listening on 127\.0\.0\.1:(\d+)", line)
    if not match:
        proc.kill()
        raise AssertionError(f"serve did not start: {line!r}")
    return proc, int(match.group(1))


def _safetensors_parts(path: Path) -> tuple[dict, bytes]:
    """(header as JSON, data bytes): safetensors writes its metadata map in a per-process order."""
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    return json.loads(raw[8 : 8 + n]), raw[8 + n :]


def _make_dump(path: Path) -> None:
    import kvbridge
    from kvbridge.dumps.dumpfile import DumpEntry
    from kvbridge.dumps.writer import write_dump

    gen = torch.Generator().manual_seed(3)
    entries = []
    for layer in range(3):
        for role, n, ratio in (("swa", 300, None), ("compress", 75, 4)):
            x = torch.randn(n, 512, generator=gen).bfloat16().float()
            x[::7] *= 2.0**-12
            pages = kvbridge.encode(x, "trtllm-fp8", page_size=64, scale=1.0)
            entries.append(DumpEntry(layer, role, pages, "trtllm-fp8", 64, n, 1.0, None, ratio))
    entries.append(DumpEntry(9, "latent", torch.randn(100, 512, generator=gen).bfloat16()))
    write_dump(path, entries, attrs={"model": "deepseek-v4-flash", "request": "r1"})


def test_cli_dump_to_dump_reproduces_convert_bytes_and_refusals_show_in_exit_codes(tmp_path):
    from cli.main import cli

    src, reference, out = tmp_path / "in.safetensors", tmp_path / "ref.safetensors", tmp_path / "out"
    out.mkdir()
    _make_dump(src)
    ran = CliRunner().invoke(cli, ["convert", str(src), str(reference), "--to", "flashmla-model1",
                                   "--page-size", "64"])
    assert ran.exit_code == 0, ran.output
    serve, port = _start_serve("--to", "flashmla-model1", "--page-size", "64", "--out", str(out),
                               "--engine", "vllm", "--layers", "4", "--max-requests", "4", "--json")
    try:
        peer = f"127.0.0.1:{port}"
        sends = [
            _cli("migrate", "send", str(src), "--peer", peer),
            _cli("migrate", "send", str(src), "--peer", peer, "--to", "flashmla-model1", "--page-size", "64",
                 "--convert-on", "sender", "--name", "sender.safetensors"),
            _cli("migrate", "send", "--peer", peer, "--from", TRTLLM, "--to", VLLM, "--layers", "4",
                 "--tokens", str(TOKENS), "--json"),
            _cli("migrate", "send", "--peer", peer, "--from", TRTLLM, "--to", "vllm:idx=fp4", "--layers", "4",
                 "--tokens", str(TOKENS)),
        ]
        done = [subprocess.run(cmd, cwd=REPO, env=_env(), capture_output=True, text=True, timeout=STEP_TIMEOUT_S)
                for cmd in sends]
        stdout, stderr = serve.communicate(timeout=STEP_TIMEOUT_S)
    finally:
        if serve.poll() is None:
            serve.kill()
            serve.wait(5)
    assert [d.returncode for d in done] == [0, 0, 0, 1], [d.stderr for d in done]
    assert done[3].stderr.count("\n") == 1 and "plan fingerprints differ" in done[3].stderr
    assert json.loads(done[2].stdout)["receiver"]["converted_on"] == "receiver"
    assert serve.returncode == 1  # one of its four requests failed
    lines = [json.loads(line) for line in stdout.splitlines()]
    assert [line["kind"] for line in lines] == ["dump", "dump", "request", "error"]
    assert "plan fingerprints differ" in lines[3]["error"] and stderr.count("MigrationError") == 1
    want = _safetensors_parts(reference)
    for name in ("in.safetensors", "sender.safetensors"):
        got = _safetensors_parts(out / name)
        assert got[0] == want[0], name  # same header: entries, attrs, tensor offsets
        assert got[1] == want[1], name  # same tensor bytes


def _doomed_receiver_main(addr_q) -> None:
    dst = _pools(VLLM)
    with NixlReceiver(dst, plan=_plan(TRTLLM, VLLM)) as rx:
        addr_q.put(rx.address)
        rx.receive(timeout=STEP_TIMEOUT_S, accept_timeout=STEP_TIMEOUT_S)  # killed by the test meanwhile


def _orphaned_sender_main(addr_q, ready, go, out) -> None:
    plan = _plan(TRTLLM, VLLM)
    pools, tables = source_request(plan, spare_pages=2, seed=19)
    sender = NixlSender(*addr_q.get(timeout=STEP_TIMEOUT_S), timeout=RECV_TIMEOUT_S)
    stream = sender.start_request(plan, pools, tables, convert_on="sender")
    stream.send_group()
    stream.send_group()
    ready.set()
    go.wait(STEP_TIMEOUT_S)
    try:
        for _ in stream.groups[2:]:
            stream.send_group()
        stream.close()
        out.put("no error")
    except KVBridgeError as exc:
        stream.abort()
        out.put(f"{type(exc).__name__}: {exc}")
    sender.close()
    # a normal interpreter exit follows: NIXL lives in the (ended) agent process, not here


def test_sender_survives_a_receiver_that_dies_mid_request():
    ctx = tmp.get_context("spawn")
    addr_q, out = ctx.Queue(), ctx.Queue()
    ready, go = ctx.Event(), ctx.Event()
    receiver = ctx.Process(target=_doomed_receiver_main, args=(addr_q,))
    sender = ctx.Process(target=_orphaned_sender_main, args=(addr_q, ready, go, out))
    receiver.start()
    sender.start()
    try:
        assert ready.wait(STEP_TIMEOUT_S), "the sender never got going"
        receiver.kill()
        receiver.join(10)
        go.set()
        error = _wait(out, "the sender's error")
        sender.join(STEP_TIMEOUT_S)
    finally:
        for p in (receiver, sender):
            if p.is_alive():
                p.kill()
                p.join(5)
    assert error.startswith("TransferError: ") and "\n" not in error, error
    assert "nothing was published" in error
    assert sender.exitcode == 0  # the sender's own process did not die of the agent


def test_prefix_cache_hit_moves_only_the_rest_and_tp_ranks_must_match():
    """A receiver that computed tokens [0, 1088) itself (``computed``) names them in its accept: the sender
    moves ``plan.past(1088)`` only (converted on either side), its layer groups renumbered; the rest lands
    as the reference writers store it. A receiver at TP rank 1 of 2 refuses a sender at another rank or
    size before anything moves."""
    from kvbridge.migration import MigrationError, destination_pools
    from kvbridge.migration.stream import layer_groups, past_groups

    plan = _plan(TRTLLM, VLLM)
    rest = plan.past(1088)
    assert len(rest.transfers) < len(plan.transfers)  # whole transfers held (all 8 C128 entries lie before 1088)
    groups = past_groups(plan, layer_groups(plan), 1088)
    assert groups == layer_groups(rest) and sorted(i for g in groups for i in g) == list(range(len(rest.transfers)))
    src, src_tables = source_request(plan, spare_pages=2, seed=4)
    dst = destination_pools(plan, spare_pages=2)
    got: list = []
    landed: list[list[torch.Tensor]] = []
    with NixlReceiver(dst, plan=lambda info: plan, computed=lambda: 1088, tp=(1, 2)) as rx:
        import threading

        def serve(n: int) -> None:
            for _ in range(n):
                try:
                    got.append(rx.receive(timeout=RECV_TIMEOUT_S, accept_timeout=RECV_TIMEOUT_S))
                except KVBridgeError as exc:
                    got.append(exc)
                    continue
                tables = got[-1].tables  # what landed, then its pages freed for the next request
                landed.append([gather_records(dst.pool(t.spec), t.dst, table_of(tables, t.dst), t.first, t.count)
                               for t in rest.transfers])
                dst.release(tables)

        thread = threading.Thread(target=serve, args=(4,))
        thread.start()
        with NixlSender(*rx.address, timeout=RECV_TIMEOUT_S) as sender:
            for tp in ((0, 2), (0, 1)):
                with pytest.raises(MigrationError, match="tensor parallel size"):
                    sender.send_request(plan, src, src_tables, tp=tp)
            summaries = [sender.send_request(plan, src, src_tables, tp=(1, 2), convert_on=side)
                         for side in ("receiver", "sender")]
        thread.join(RECV_TIMEOUT_S)
    assert [type(g).__name__ for g in got] == ["MigrationError", "MigrationError", "Received", "Received"], got
    want_bytes = {"receiver": sum(t.src_bytes for t in rest.transfers),
                  "sender": sum(t.dst_bytes for t in rest.transfers)}
    for side, summary, records in zip(("receiver", "sender"), summaries, landed, strict=True):
        assert summary["payload_bytes"] == want_bytes[side] < sum(t.src_bytes for t in plan.transfers), summary
        for t, rec in zip(rest.transfers, records, strict=True):
            want = expected_records(t, gather_records(src.pool(t.spec), t.src, table_of(src_tables, t.src), t.first,
                                                      t.count))
            assert torch.equal(rec, want), f"{side}: layer {t.spec.layer} {t.spec.role.value}"
