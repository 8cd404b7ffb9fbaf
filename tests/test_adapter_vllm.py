"""kvbridge's vLLM connector under vLLM 0.33.0's own config, KV-cache grouping, allocation, connector factory
and scheduler (tests/vllm_engine_side.py, run in the vLLM venv named by KVBRIDGE_VLLM_PYTHON), against a
kvbridge peer in this process over gloo and over NIXL (the connector's ``transport``), TensorRT-LLM-layout
pools on the kvbridge side:

- consumer: the request lands in every vLLM group's blocks exactly as vLLM's writers store the same
  latents, no other byte of vLLM's KV buffer is written, and vLLM then computes only the last
  prompt token from those blocks;
- producer: vLLM hands a finished request's blocks of every group to the connector, which sends
  it; the TensorRT-LLM pools receive exactly TensorRT-LLM's writer bytes, and vLLM frees the blocks
  only after the send.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from kvbridge.adapters.vllm_layout import VllmCaches, cache_name
from kvbridge.engines.profiles import parse_engine
from kvbridge.engines.topology import Role, from_hf_config
from kvbridge.migration import (
    MigrationError,
    destination_pools,
    gather_records,
    plan_migration,
    source_request,
    table_of,
)
from kvbridge.migration.ape import synthetic_ape
from kvbridge.migration.nixl import NixlReceiver, NixlSender
from kvbridge.migration.nixl_agent import nixl_available
from kvbridge.migration.plan import beyond_computed
from kvbridge.migration.transport import GlooServer, send_request_tcp
from tests.migration_helpers import expected_records, gpu_check_module

ROOT = Path(__file__).resolve().parent.parent
PYTHON = os.environ.get("KVBRIDGE_VLLM_PYTHON")
#: A 4-layer DeepSeek-V4 (two SWA-only layers, one ratio-4 and one ratio-128 layer) that vLLM's config accepts.
CONFIG = {"architectures": ["DeepseekV4ForCausalLM"], "model_type": "deepseek_v4", "hidden_size": 256,
          "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 1, "head_dim": 512,
          "qk_rope_head_dim": 64, "vocab_size": 1024, "max_position_embeddings": 4096, "intermediate_size": 512,
          "compress_ratios": [0, 0, 4, 128], "sliding_window": 128, "index_head_dim": 128, "index_n_heads": 4,
          "index_topk": 64, "num_nextn_predict_layers": 0, "torch_dtype": "bfloat16", "rms_norm_eps": 1e-6}
TRTLLM = "trtllm:fp8:tpb=128:scale=0.5"
VLLM = "vllm:block=256"


def _vllm_python(transport: str = "gloo") -> str:
    if transport == "nixl" and not nixl_available():
        if os.environ.get("CI") == "true":
            pytest.fail("nixl is not importable: CI must run the vLLM connector's NIXL tests")
        pytest.skip("needs nixl (pip install 'kvbridge[nixl]')")
    if PYTHON:
        return PYTHON
    if os.environ.get("CI") == "true":
        pytest.fail("KVBRIDGE_VLLM_PYTHON is unset: CI must run the vLLM adapter tests (.ci/engine-vllm.sh)")
    pytest.skip("KVBRIDGE_VLLM_PYTHON (the python of a vLLM 0.33.0 venv, see .ci/engine-vllm.sh) is unset")


def _model(tmp_path: Path, config: dict = CONFIG) -> Path:
    model_dir = tmp_path / "dsv4-mini"
    model_dir.mkdir()
    (model_dir / "config.json").write_text(json.dumps(config))
    (tmp_path / "out").mkdir()
    return model_dir


def _engine(python: str, *args: str) -> subprocess.Popen:
    return subprocess.Popen([python, str(ROOT / "tests" / "vllm_engine_side.py"), *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": str(ROOT)})


def _finish(proc: subprocess.Popen) -> str:
    try:
        stdout, stderr = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0 and "DONE" in stdout, stderr[-4000:]
    return stdout


def _vllm_buffer(out: Path, plan, model, num_groups: int = 7):
    """vLLM's KV buffer as the engine side left it, its layers as kvbridge pools, and the result JSON."""
    result = json.loads((out / "result.json").read_text())
    raw = load_file(str(out / "buffer.safetensors"))["raw"]
    layers = result["layers"]
    assert all(info["same_buffer"] for info in layers.values())
    views = {name: raw.as_strided((result["num_blocks"], info["page_bytes"]), (info["block_stride"], 1),
                                  info["offset"]) for name, info in layers.items()}
    # vLLM's own grouping: a group per SWA layer, compressed KV and indexer keys of both ratios in one,
    # the ratio-4 compressor states in one, the ratio-128 state in one
    assert len(result["groups"]) == num_groups, result["groups"]
    caches = VllmCaches(plan.dst if plan.dst.engine == "vllm" else plan.src, model, views, result["groups"],
                        include_mtp=plan.include_mtp)
    return result, raw, caches


def _consumer(tmp_path: Path, num_tokens: int, send_src: str, *options: str, transport: str = "gloo",
              convert_on: str = "receiver", ape=None, request_src: str = TRTLLM):
    """Run the consumer engine side (``options``: its load-failure policy, ``ape=PATH``) on a request whose
    ``kvbridge_src`` is ``request_src``; send it a request from ``send_src`` pools over ``transport``, converted
    on ``convert_on`` and planned with the APE weights ``ape``; returns what the sender got (its summary, or the
    receiver's error), the plan and the source pools and tables."""
    python = _vllm_python(transport)
    model_dir = _model(tmp_path)
    out = tmp_path / "out"
    proc = _engine(python, "consumer", transport, str(model_dir), str(out), "req-7", str(num_tokens),
                   request_src, *options)
    try:
        line = proc.stdout.readline()
        while line and not line.startswith("LISTEN"):
            line = proc.stdout.readline()
        assert line.startswith("LISTEN"), proc.stderr.read()[-4000:]
        _, host, port = line.split()
        model = from_hf_config(str(model_dir / "config.json"))
        plan = plan_migration(send_src, VLLM, model, num_tokens, include_mtp=False, ape=ape)
        src_pools, src_tables = source_request(plan, spare_pages=2, seed=3)
        try:
            if transport == "nixl":
                with NixlSender(host, int(port), timeout=120) as sender:
                    summary = sender.send_request(plan, src_pools, src_tables, request_id="req-7",
                                                  convert_on=convert_on)
            else:
                summary = send_request_tcp(plan, src_pools, src_tables, host=host, port=int(port),
                                           request_id="req-7", timeout=120, convert_on=convert_on)
        except MigrationError as exc:
            summary = exc
    finally:
        _finish(proc)
    return summary, plan, model, src_pools, src_tables


def _assert_landed(plan, src_pools, src_tables, result, raw, caches, block_ids=None) -> None:
    """Every transfer landed in the request's blocks of its vLLM group as the reference writers store it, and
    no other byte of vLLM's KV buffer was written; ``block_ids``: the block ids of each of several requests
    that landed, all from the same source request (default: the result's one request)."""
    written = torch.zeros(raw.numel(), dtype=torch.bool)
    for ids in block_ids or [result["block_ids"]]:
        check_landed(plan, src_pools, src_tables, ids, result, caches, written)
    assert not raw[~written].any(), "bytes outside the request's blocks of its own caches were written"


def check_landed(plan, src_pools, src_tables, block_ids, result, caches, written: torch.Tensor) -> None:
    """Every transfer of ``plan`` landed in the blocks ``block_ids`` of its vLLM group as the reference writers
    store ``src_pools``' records; marks those blocks' bytes of vLLM's KV buffer in ``written``."""
    tables = caches.tables(block_ids)
    for t in plan.transfers:
        want = expected_records(t, gather_records(src_pools.pool(t.spec), t.src, table_of(src_tables, t.src),
                                                  t.first, t.count))
        key = (t.spec.layer, t.spec.role)
        table = tables[caches.group[key]]
        got = gather_records(caches.pools.pool(t.spec), t.dst, table, t.first, t.count)
        assert torch.equal(got, want), f"layer {t.spec.layer} {t.spec.role.value}: bytes differ"
        info = result["layers"][caches.names[key]]
        for slot in t.table_slots(t.dst):
            start = info["offset"] + table[slot] * info["block_stride"]
            written[start : start + info["page_bytes"]] = True


@pytest.mark.parametrize(("transport", "convert_on", "options"), [("gloo", "receiver", ()),
                                                                  ("nixl", "receiver", ("daemonic",)),
                                                                  ("nixl", "sender", ())])
def test_vllm_consumer_receives_a_trtllm_request(tmp_path, transport, convert_on, options, num_tokens=600):
    """Over NIXL, source records land in the receiver's staging buffer and are converted and written through
    the block ids as over gloo (``NixlReceiver.receive``'s ``publish``); pages a sender converted land in the
    connector's host-memory landing area and are copied from there (``VllmCaches.write_from``). The first NIXL
    case runs the engine side in a daemonic process, as vLLM's multiprocess executor runs its workers (no child
    process: the connector's NIXL agent runs in the worker)."""
    summary, plan, model, src_pools, src_tables = _consumer(tmp_path, num_tokens, TRTLLM, *options,
                                                            transport=transport, convert_on=convert_on)
    out = tmp_path / "out"
    assert summary["num_tokens"] == num_tokens
    result, raw, caches = _vllm_buffer(out, plan, model)
    assert result["status_after_schedule"] == "WAITING_FOR_REMOTE_KVS"
    assert result["received"] == ["vllm-req-0"] and result["errors"] == []
    # vLLM takes the load: it schedules only the last prompt token (recomputed to sample the next one),
    # on the blocks kvbridge wrote (num_computed_tokens counts the scheduled token already)
    assert result["status_after_load"] == "RUNNING"
    assert result["scheduled_after_load"] == 1 and result["computed_after_load"] == num_tokens
    assert [ids[: len(b)] for ids, b in zip(result["block_ids_after_load"], result["block_ids"], strict=True)] == \
        result["block_ids"]
    assert result["finished"] == "FINISHED_LENGTH_CAPPED"
    _assert_landed(plan, src_pools, src_tables, result, raw, caches)


SGLANG = "sglang:swa=256:idx=fp8"


def _ape_file(path: Path, model, seed: int) -> Path:
    """Seeded stand-in APE weights of the model (``synthetic_ape``) under the checkpoint's names, in bf16 (as a
    checkpoint holds them)."""
    save_file({k: v.bfloat16() for k, v in synthetic_ape(model, seed=seed, include_mtp=False).items()}, str(path))
    return path


@pytest.mark.parametrize("transport", ["gloo", "nixl"])
def test_vllm_consumer_with_ape_weights_receives_an_sglang_request(tmp_path, transport, num_tokens=600):
    """SGLang stores compressor scores without the APE vLLM's include: the connector's ``ape`` key lets it take
    the request, its state rows landing as score + APE (``expected_records``), every other byte as before."""
    model = from_hf_config(CONFIG)
    ape = _ape_file(tmp_path / "ape.safetensors", model, seed=5)
    summary, plan, model, src_pools, src_tables = _consumer(tmp_path, num_tokens, SGLANG, f"ape={ape}",
                                                            transport=transport, ape=ape, request_src=SGLANG)
    assert any(t.ape_sign > 0 for t in plan.transfers)
    assert not isinstance(summary, Exception), summary
    assert summary["num_tokens"] == num_tokens
    result, raw, caches = _vllm_buffer(tmp_path / "out", plan, model)
    assert result["received"] == ["vllm-req-0"] and result["errors"] == []
    assert result["status_after_load"] == "RUNNING" and result["scheduled_after_load"] == 1
    _assert_landed(plan, src_pools, src_tables, result, raw, caches)


def test_vllm_consumer_refuses_an_sglang_request_planned_with_other_ape_weights(tmp_path):
    """Both ends must hold the same weights (the plan's fingerprint carries their digest): refused before any
    byte is written, and vLLM's default policy ends the request with an error."""
    model = from_hf_config(CONFIG)
    mine = _ape_file(tmp_path / "mine.safetensors", model, seed=5)
    theirs = _ape_file(tmp_path / "theirs.safetensors", model, seed=6)
    summary, plan, model, _, _ = _consumer(tmp_path, 600, SGLANG, f"ape={mine}", ape=theirs, request_src=SGLANG)
    assert isinstance(summary, MigrationError), summary
    result, raw, _ = _vllm_buffer(tmp_path / "out", plan, model)
    assert len(result["errors"]) == 1 and result["status_after_load"] == "FINISHED_ERROR"
    assert not raw.any(), "a refused request wrote bytes"


def test_vllm_consumer_without_ape_weights_refuses_an_sglang_request_and_says_how(tmp_path):
    model = from_hf_config(CONFIG)
    ape = _ape_file(tmp_path / "ape.safetensors", model, seed=5)
    summary, plan, model, _, _ = _consumer(tmp_path, 600, SGLANG, ape=ape, request_src=SGLANG)
    result, raw, _ = _vllm_buffer(tmp_path / "out", plan, model)
    assert isinstance(summary, MigrationError)
    assert len(result["errors"]) == 1 and "APE" in result["errors"][0] and "ape" in result["errors"][0]
    assert not raw.any(), "a refused request wrote bytes"


@pytest.mark.parametrize(("transport", "peer"), [("gloo", TRTLLM), ("nixl", TRTLLM), ("gloo", SGLANG)])
def test_vllm_producer_sends_finished_blocks_to_a_kvbridge_peer(tmp_path, transport, peer, num_tokens=600):
    """(To SGLang pools with the connector's ``ape`` key: the state rows land without the APE.)"""
    python = _vllm_python(transport)
    model_dir = _model(tmp_path)
    out = tmp_path / "out"
    model = from_hf_config(str(model_dir / "config.json"))
    ape = [str(_ape_file(tmp_path / "ape.safetensors", model, seed=5))] if peer == SGLANG else []
    plan = plan_migration(VLLM, peer, model, num_tokens, include_mtp=False, ape=ape or None)
    dst = destination_pools(plan, spare_pages=2)
    server = NixlReceiver(dst, plan=plan) if transport == "nixl" else GlooServer(dst, plan=plan)
    got: dict = {}
    stop = threading.Event()

    def receive():
        try:
            while not stop.is_set() and "result" not in got:
                got["result"] = server.receive(timeout=120, accept_timeout=0.5, request_id="req-9")
                if got["result"] is None:
                    del got["result"]
        except Exception as exc:  # reported by the assertion below
            got["error"] = exc

    thread = threading.Thread(target=receive)
    thread.start()
    try:
        host, port = server.address
        _finish(_engine(python, "producer", transport, str(model_dir), str(out), "req-9", str(num_tokens), peer,
                        f"{host}:{port}", *(f"ape={path}" for path in ape)))
    finally:
        stop.set()
        thread.join(timeout=150)
        server.close()
    assert "error" not in got, got.get("error")
    if transport == "nixl":
        rid, tables = got["result"].request_id, got["result"].tables
    else:
        _, rid, tables, _ = got["result"]
    assert rid == "req-9"
    result = json.loads((out / "result.json").read_text())
    assert result["status_after_prefill"] == "FINISHED_LENGTH_CAPPED"
    assert result["held_after_finish"] and result["sends"] == ["req-9"] and result["sent"] == ["vllm-req-0"]
    assert result["freed_after_send"]
    records = load_file(str(out / "records.safetensors"))
    _, _, caches = _vllm_buffer(out, plan, model)
    src_tables = caches.tables(result["block_ids"])
    for i, t in enumerate(plan.transfers):
        key = (t.spec.layer, t.spec.role)
        # the bytes vLLM's blocks held are the bytes the engine side wrote (its writers' records) ...
        held = gather_records(caches.pools.pool(t.spec), t.src, src_tables[caches.group[key]], t.first, t.count)
        assert torch.equal(held, records[str(i)])
        # ... and the peer's pools hold what its writers store for those latents
        landed = gather_records(dst.pool(t.spec), t.dst, table_of(tables, t.dst), t.first, t.count)
        assert torch.equal(landed, expected_records(t, held)), f"layer {t.spec.layer} {t.spec.role.value}"


@pytest.mark.parametrize(("policy", "transport"), [("fail", "gloo"), ("recompute", "gloo"), ("recompute", "nixl")])
def test_vllm_consumer_refuses_a_request_from_other_pools(tmp_path, policy, transport):
    # the producer sends under the right request id, but from TensorRT-LLM pools of 256-token blocks, not the
    # pools the request names: refused before any byte is written (over NIXL before anything moves); vLLM is
    # told the load failed and, by its kv_load_failure_policy, ends the request with an error or recomputes
    # the whole prompt
    summary, plan, model, _, _ = _consumer(tmp_path, 600, "trtllm:fp8:tpb=256:scale=0.5", policy,
                                           transport=transport)
    assert isinstance(summary, MigrationError) and "vLLM expects" in str(summary), summary
    result, raw, _ = _vllm_buffer(tmp_path / "out", plan_migration(TRTLLM, VLLM, model, 600, include_mtp=False),
                                  model)
    assert result["received"] == ["vllm-req-0"] and len(result["errors"]) == 1
    assert "vLLM expects trtllm:fp8:tpb=128" in result["errors"][0]
    if policy == "fail":
        assert result["status_after_load"] == "FINISHED_ERROR"
    else:
        assert result["status_after_load"] == "RUNNING" and result["scheduled_after_load"] == 600
    assert not raw.any(), "a refused request wrote bytes"


# ---------------------------------------------------------------------------------------------
# Several requests in one vLLM consumer (one engine process per transport, driven command by command)


class _Commands:
    """The engine side's ``commands`` mode: one vLLM consumer the test drives line by line."""

    def __init__(self, python: str, transport: str, model_dir: Path, out: Path, *options: str):
        self.stderr = open(out / "stderr.txt", "w+")  # noqa: SIM115 (read back when the engine side ends)
        self.proc = subprocess.Popen([python, str(ROOT / "tests" / "vllm_engine_side.py"), "commands", transport,
                                      str(model_dir), str(out), *options], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=self.stderr, text=True,
                                     env={**os.environ, "PYTHONPATH": str(ROOT)})
        line = self._line()
        while not line.startswith("LISTEN"):
            line = self._line()
        _, host, port = line.split()
        self.address = (host, int(port))

    def _line(self) -> str:
        line = self.proc.stdout.readline()
        if not line:
            self.proc.kill()
            self.stderr.seek(0)
            raise AssertionError(f"the engine side ended: {self.stderr.read()[-4000:]}")
        return line

    def __call__(self, command: str) -> dict:
        self.proc.stdin.write(command + "\n")
        self.proc.stdin.flush()
        line = self._line()
        while not line.startswith("OK "):
            line = self._line()
        return json.loads(line[3:])

    def close(self) -> None:
        try:
            self.proc.stdin.write("quit\n")
            self.proc.stdin.close()
        except OSError:
            pass
        try:
            self.proc.wait(120)
        finally:
            if self.proc.poll() is None:
                self.proc.kill()
            self.stderr.seek(0)
            tail = self.stderr.read()[-4000:]
            self.stderr.close()
        assert self.proc.returncode == 0, tail


def _send(sender: NixlSender | None, address, plan, src, request_id: str):
    """Send ``src`` under ``request_id`` (over NIXL with ``sender``, else over gloo); the receiver's summary,
    or its refusal."""
    try:
        if sender is not None:
            return sender.send_request(plan, *src, request_id=request_id)
        return send_request_tcp(plan, *src, host=address[0], port=address[1], request_id=request_id, timeout=120)
    except MigrationError as exc:
        return exc


def _expected(plan, src) -> list[torch.Tensor]:
    """What vLLM's writers store for each transfer's records of the source request ``src``."""
    pools, tables = src
    return [expected_records(t, gather_records(pools.pool(t.spec), t.src, table_of(tables, t.src), t.first,
                                               t.count)) for t in plan.transfers]


def _landed(out: Path, name: str, plan, want: list[torch.Tensor]) -> None:
    """The request's records in its vLLM blocks (saved by the engine side's ``wait``) are ``want``."""
    got = load_file(str(out / f"{name}.safetensors"))
    for i, t in enumerate(plan.transfers):
        assert torch.equal(got[str(i)], want[i]), f"{name}: layer {t.spec.layer} {t.spec.role.value} differs"


def _die_mid_send(transport: str, host: str, port: int, config: str, request_id: str, num_tokens: int) -> None:
    """Child process: start sending ``request_id`` and hang after the first data message or group (the test
    kills the process there)."""
    import sys
    import time

    model = from_hf_config(json.loads(config))
    plan = plan_migration(TRTLLM, VLLM, model, num_tokens, include_mtp=False)
    src, tables = source_request(plan, spare_pages=2, seed=99)

    def hang(*_):
        print("SENDING", flush=True)
        time.sleep(600)

    if transport == "nixl":
        sender = NixlSender(host, port, timeout=120)
        stream = sender.start_request(plan, src, tables, request_id=request_id)
        stream.send_group()
        hang()
    send_request_tcp(plan, src, tables, host=host, port=port, request_id=request_id, timeout=120,
                     chunk_bytes=4096, progress=hang)
    sys.exit(1)


@pytest.mark.parametrize("transport", ["gloo", "nixl"])
def test_vllm_consumer_requests_are_independent(tmp_path, transport, num_tokens=300):
    """One vLLM consumer, requests keyed by request id: four producers in each of the 24 orders all land
    byte-exact; a producer for a request vLLM does not know yet is held until it does; a request aborted
    while it waits frees its blocks, its late producer is refused, the next request lands; a producer killed
    mid-transfer fails its request (vLLM's ``fail`` policy ends it with an error) and the others land."""
    import itertools

    python = _vllm_python(transport)
    model_dir = _model(tmp_path)
    out = tmp_path / "out"
    model = from_hf_config(str(model_dir / "config.json"))
    plan = plan_migration(TRTLLM, VLLM, model, num_tokens, include_mtp=False)
    # four source requests: the i-th request of every round sends the i-th (a mix-up lands the wrong bytes)
    sources = [source_request(plan, spare_pages=2, seed=i + 1) for i in range(4)]
    wants = [_expected(plan, src) for src in sources]
    slot = {"early": 0, "gone": 1, "next": 2, "killed": 3, "kept": 3}
    sent: dict = {}

    def source(name: str):
        return sources[slot.get(name) if name in slot else int(name.rsplit("-", 1)[1])]

    def want(name: str) -> list[torch.Tensor]:
        return wants[slot.get(name) if name in slot else int(name.rsplit("-", 1)[1])]

    def producer(name: str) -> threading.Thread:
        src = source(name)
        return threading.Thread(target=lambda: sent.update({name: _send(sender, eng.address, plan, src, name)}))

    eng = _Commands(python, transport, model_dir, out)
    # over NIXL one sender (its agent process) for every request: the consumer receives one at a time anyway
    sender = NixlSender(*eng.address, timeout=120) if transport == "nixl" else None
    try:
        for k, order in enumerate(itertools.permutations(range(4))):
            names = [f"r{k}-{i}" for i in range(4)]
            for name in names:
                eng(f"add {name} {num_tokens} {TRTLLM} {name}")
            eng("step")  # the loads go out to the worker
            threads = [producer(names[i]) for i in order]
            for thread in threads:  # producers connect in this round's order
                thread.start()
                thread.join() if transport == "nixl" else time.sleep(0.05)
            state = eng("wait " + " ".join(names))
            for thread in threads:
                thread.join(120)
            assert not state["failed"] and not state["errors"], state
            for name in names:
                assert not isinstance(sent[name], Exception), sent[name]
                _landed(out, name, plan, want(name))
            state = eng("run")
            assert state["free"] == state["free_at_start"], state
        # a producer for a request vLLM does not know yet is held until it does
        thread = producer("early")
        thread.start()
        time.sleep(1.0)
        eng(f"add early {num_tokens} {TRTLLM} early")
        eng("step")
        state = eng("wait early")
        thread.join(120)
        assert "early" not in state["failed"], state
        _landed(out, "early", plan, want("early"))
        eng("run")
        # abort while waiting: released (its blocks freed), its producer refused later, the next request lands
        eng(f"add gone {num_tokens} {TRTLLM} gone")
        eng("step")
        state = eng("abort gone")
        assert "gone" in state["received"] and "gone" not in state["failed"], state
        assert state["status"]["gone"] == "FINISHED_ABORTED" and state["free"] == state["free_at_start"], state
        late = _send(sender, eng.address, plan, source("gone"), "gone")
        assert isinstance(late, MigrationError) and "was aborted" in str(late), late
        eng(f"add next {num_tokens} {TRTLLM} next")
        eng("step")
        assert not isinstance(_send(sender, eng.address, plan, source("next"), "next"), Exception)
        state = eng("wait next")
        assert "next" not in state["failed"], state
        _landed(out, "next", plan, want("next"))
        eng("run")
        # a producer killed mid-transfer: that request fails, the other lands
        for name in ("killed", "kept"):
            eng(f"add {name} {num_tokens} {TRTLLM} {name}")
        eng("step")
        child = subprocess.Popen([sys.executable, "-c", "from tests.test_adapter_vllm import _die_mid_send; "
                                  f"_die_mid_send({transport!r}, {eng.address[0]!r}, {eng.address[1]}, "
                                  f"{json.dumps(CONFIG)!r}, 'killed', {num_tokens})"],
                                 stdout=subprocess.PIPE, text=True, cwd=ROOT)
        try:
            assert child.stdout.readline().startswith("SENDING")
        finally:
            child.kill()
            child.wait(30)
        assert not isinstance(_send(sender, eng.address, plan, source("kept"), "kept"), Exception)
        state = eng("wait killed kept")
        assert state["failed"] == ["killed"] and len(state["errors"]) == 1 and "killed" in state["errors"][0], state
        _landed(out, "kept", plan, want("kept"))
        state = eng("run")
        assert state["status"]["killed"] == "FINISHED_ERROR" and state["status"]["kept"] == "FINISHED_LENGTH_CAPPED"
        # a prefix-cache hit: vLLM computed a 600-token prompt itself, its cached blocks are then filled with a
        # sentinel; a 620-token request with that prefix hits 512 tokens of it, so only the rest is written (the
        # compressed entries and SWA tokens before 512) and every cached block keeps its sentinel bytes
        eng("compute local 600")
        eng("sentinel")
        long_plan = plan_migration(TRTLLM, VLLM, model, 620, include_mtp=False)
        long_src = source_request(long_plan, spare_pages=2, seed=7)
        eng(f"add hit 620 {TRTLLM} hit hashed")
        state = eng("step")
        assert state["hits"]["hit"] == 512, state["hits"]
        summary = _send(sender, eng.address, long_plan, long_src, "hit")
        assert not isinstance(summary, Exception), summary
        rest = long_plan.past(512).transfers
        # the consumer's accept names its hit (over gloo and NIXL alike): only the rest moves
        assert summary["payload_bytes"] == sum(t.src_bytes for t in rest) < sum(
            t.src_bytes for t in long_plan.transfers), summary
        state = eng("wait hit")
        assert "hit" not in state["failed"] and not state["errors"][1:], state
        cached, intact = state["intact"]["hit"]
        assert cached >= 7 and intact, state["intact"]  # a cached block in every group
        got, want = load_file(str(out / "hit.safetensors")), _expected(long_plan, long_src)
        rest = {i: k for i, k, _ in beyond_computed(long_plan.transfers, 512)}  # transfer: entries skipped
        skipped = 0
        for i, t in enumerate(long_plan.transfers):
            k = rest.get(i, t.count)
            skipped += k
            assert torch.equal(got[str(i)][k:], want[i][k:]), f"hit: layer {t.spec.layer} {t.spec.role.value}"
            assert bool((got[str(i)][:k] == 0xA5).all()), f"hit: layer {t.spec.layer} {t.spec.role.value} written"
        assert skipped > 0
        # a request vLLM holds whole (its kvbridge_num_tokens within the hit) loads nothing: its producer is refused
        eng(f"add whole 620 {TRTLLM} whole hashed tokens=512")
        state = eng("step")
        short_plan = plan_migration(TRTLLM, VLLM, model, 512, include_mtp=False)
        late = _send(sender, eng.address, short_plan, source_request(short_plan, seed=8), "whole")
        assert isinstance(late, MigrationError) and "prefix cache" in str(late), late
        state = eng("run")
        assert state["status"]["whole"] == "FINISHED_LENGTH_CAPPED" and "whole" not in state["received"], state
        assert state["status"]["hit"] == "FINISHED_LENGTH_CAPPED", state
        # refused when vLLM creates the connector, with one line naming the remedy: PP > 1, and TP > 1 with
        # listen port 0 (rank r listens on the port + r: producers need a fixed port)
        for command, why in (("parallel 1 2", "pipeline parallel size 1, this vLLM runs 2; serve with -pp 1"),
                             ("parallel 2 1", "at tensor parallel size 2 rank r listens on its port + r")):
            eng.proc.stdin.write(command + "\n")
            eng.proc.stdin.flush()
            line = eng._line()
            while not line.startswith("REFUSED "):
                line = eng._line()
            refused = json.loads(line[8:])
            assert all(e and e.startswith("InputError") and why in e for e in refused.values()), refused
        assert state["free"] == state["free_at_start"], state
        assert state["stats"]["recv_requests"] == 24 * 4 + 4 and state["stats"]["recv_failed"] == 1, state["stats"]
        # bytes written into vLLM's blocks: every request's converted records, the hit's only past its prefix
        written = (24 * 4 + 3) * sum(t.dst_bytes for t in plan.transfers) + sum(
            t.dst_bytes for t in long_plan.past(512).transfers)
        assert state["stats"]["recv_written_MB"] == round(written / 1e6, 3), state["stats"]
        # bytes moved (the connector's metrics): the hit's only past its prefix, over gloo and NIXL alike
        moved = (24 * 4 + 3) * sum(t.src_bytes for t in plan.transfers) + sum(
            t.src_bytes for t in long_plan.past(512).transfers)
        assert state["stats"]["recv_MB"] == round(moved / 1e6, 3), state["stats"]
    finally:
        if sender is not None:
            sender.close()
        eng.close()


def _free_pair() -> int:
    """A port p such that p and p + 1 are free on 127.0.0.1 (rank r of a TP-2 end listens on p + r)."""
    import socket

    for _ in range(50):
        with socket.socket() as first, socket.socket() as second:
            first.bind(("127.0.0.1", 0))
            port = first.getsockname()[1]
            try:
                second.bind(("127.0.0.1", port + 1))
            except OSError:
                continue
            return port
    raise AssertionError("no two consecutive free ports")


def test_vllm_at_tensor_parallel_2_every_rank_moves_the_whole_request(tmp_path, num_tokens=300):
    """vLLM at TP = 2 (role ``kv_both``): one scheduler, a worker connector per rank in its own daemonic process
    inside vLLM's TP group, rank results merged by vLLM's ``KVOutputAggregator``. DeepSeek-V4's caches are
    replicated per rank, so each rank receives the whole request from its producer rank (rank r listens on
    port + r) and each rank's blocks hold it byte-exact; producers that are not at the consumer's rank and
    size are refused at the handshake, before any block is written. Then each rank sends a finished request
    to its peer rank (port + r); both peers receive TensorRT-LLM's writer bytes; vLLM frees the blocks once
    both ranks sent."""
    python = _vllm_python()
    model_dir = _model(tmp_path)
    out = tmp_path / "out"
    model = from_hf_config(str(model_dir / "config.json"))
    send_plan = plan_migration(VLLM, TRTLLM, model, num_tokens, include_mtp=False)
    peer = _free_pair()
    dsts = [destination_pools(send_plan, spare_pages=2) for _ in range(2)]
    servers = [GlooServer(dsts[r], plan=send_plan, port=peer + r, tp=(r, 2)) for r in range(2)]
    got: dict = {}

    def receive(r: int) -> None:
        try:
            got[r] = servers[r].receive(timeout=250, accept_timeout=250, request_id="req-tp-out")
        except Exception as exc:  # reported by the assertion below
            got[r] = exc

    threads = [threading.Thread(target=receive, args=(r,)) for r in range(2)]
    for thread in threads:
        thread.start()
    proc = _engine(python, "tp", "gloo", str(model_dir), str(out), "2", str(_free_pair()), str(_free_pair()),
                   str(num_tokens), TRTLLM, TRTLLM, f"127.0.0.1:{peer}")
    try:
        ports = {}
        while len(ports) < 2:
            line = proc.stdout.readline()
            assert line, proc.stderr.read()[-4000:]
            if line.startswith("LISTEN"):
                _, host, port, rank = line.split()
                ports[int(rank)] = int(port)
        assert ports[1] == ports[0] + 1
        plan = plan_migration(TRTLLM, VLLM, model, num_tokens, include_mtp=False)
        src_pools, src_tables = source_request(plan, spare_pages=2, seed=3)

        def send(rank_port: int, tp):
            try:
                return send_request_tcp(plan, src_pools, src_tables, host=host, port=rank_port, request_id="req-tp",
                                        timeout=120, tp=tp)
            except MigrationError as exc:
                return exc

        for rank_port, tp, why in ((ports[0], (0, 1), "rank 0 of tensor parallel size 1, this receiver rank 0 of 2"),
                                   (ports[1], (0, 2), "rank 0 of tensor parallel size 2, this receiver rank 1 of 2")):
            refused = send(rank_port, tp)
            assert isinstance(refused, MigrationError) and why in str(refused) and "same -tp" in str(refused), refused
        for r in range(2):
            summary = send(ports[r], (r, 2))
            assert not isinstance(summary, Exception), summary
    finally:
        _finish(proc)
        for thread in threads:
            thread.join(timeout=60)
        for server in servers:
            server.close()
    for r in range(2):
        result, raw, caches = _vllm_buffer(out / f"rank{r}" / "in", plan, model)
        assert result["received"] == ["in"] and result["errors"] == [], result
        _assert_landed(plan, src_pools, src_tables, result, raw, caches)
    result = json.loads((out / "rank0" / "out" / "result.json").read_text())
    assert result["finished"] == "FINISHED_LENGTH_CAPPED" and result["sent"] == ["out"], result
    assert result["freed_after_send"] and result["errors"] == [], result
    assert result["stats"]["recv_requests"] == 2 and result["stats"]["send_requests"] == 2, result["stats"]
    records = load_file(str(out / "records.safetensors"))
    for r in range(2):
        assert not isinstance(got.get(r), Exception) and got.get(r) is not None, got
        _, rid, tables, _ = got[r]
        assert rid == "req-tp-out"
        _, _, caches = _vllm_buffer(out / f"rank{r}" / "out", send_plan, model)
        src = caches.tables(result["out_block_ids"])
        for i, t in enumerate(send_plan.transfers):
            key = (t.spec.layer, t.spec.role)
            held = gather_records(caches.pools.pool(t.spec), t.src, src[caches.group[key]], t.first, t.count)
            assert torch.equal(held, records[str(i)]), f"rank {r}: layer {t.spec.layer} {t.spec.role.value}"
            landed = gather_records(dsts[r].pool(t.spec), t.dst, table_of(tables, t.dst), t.first, t.count)
            assert torch.equal(landed, expected_records(t, held)), f"rank {r}: layer {t.spec.layer}"


def test_vllm_producer_reports_a_failed_send(tmp_path, num_tokens=300):
    """A send that fails (here: nothing listens at the peer) is logged and counted as failed, never as sent;
    its blocks are released (vLLM has no failed-send state)."""
    import socket

    python = _vllm_python()
    model_dir = _model(tmp_path)
    out = tmp_path / "out"
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]  # closed again: connecting is refused
    _finish(_engine(python, "producer", "gloo", str(model_dir), str(out), "req-9", str(num_tokens), TRTLLM,
                    f"127.0.0.1:{port}"))
    result = json.loads((out / "result.json").read_text())
    assert len(result["errors"]) == 1 and "req-9: send to 127.0.0.1" in result["errors"][0], result["errors"]
    assert result["stats"]["send_failed"] == 1 and result["stats"]["send_requests"] == 0, result["stats"]
    assert result["freed_after_send"]


#: The 4-layer model with one MTP layer (SWA-only, as DeepSeek-V4's), which vLLM's MTP draft serves.
CONFIG_MTP = {**CONFIG, "compress_ratios": [*CONFIG["compress_ratios"], 0], "num_nextn_predict_layers": 1}


def test_vllm_with_its_mtp_draft_moves_the_mtp_layers_both_ways(tmp_path, num_tokens=300):
    """vLLM serving with the model's MTP draft (its ``SpeculativeConfig``, method ``mtp``) registers the MTP
    layer's cache too: a request planned without MTP layers is refused by name before anything is written,
    one planned with them lands byte-exact in every group, the MTP layer's included; a finished request of a
    producer with the draft reaches a kvbridge peer with its MTP layer."""
    python = _vllm_python("gloo")
    model_dir = _model(tmp_path, CONFIG_MTP)
    out = tmp_path / "out"
    model = from_hf_config(str(model_dir / "config.json"))
    assert model.num_mtp_layers == 1
    with_mtp = plan_migration(TRTLLM, VLLM, model, num_tokens, include_mtp=True)
    without = plan_migration(TRTLLM, VLLM, model, num_tokens, include_mtp=False)
    assert any(model.is_mtp(t.spec.layer) for t in with_mtp.transfers)
    src = source_request(with_mtp, spare_pages=2, seed=4)
    eng = _Commands(python, "gloo", model_dir, out, "fail", "mtp")
    try:
        eng(f"add plain {num_tokens} {TRTLLM} plain")
        eng(f"add drafted {num_tokens} {TRTLLM} drafted")
        eng("step")
        refused = _send(None, eng.address, without, src, "plain")
        assert isinstance(refused, MigrationError), refused
        assert "the producer sends no MTP layer caches" in str(refused) and "include_mtp=True" in str(refused)
        summary = _send(None, eng.address, with_mtp, src, "drafted")
        assert not isinstance(summary, Exception), summary
        state = eng("wait plain drafted")
        assert state["failed"] == ["plain"] and state["received"] == ["drafted", "plain"], state
        _landed(out, "drafted", with_mtp, _expected(with_mtp, src))
        state = eng("run")
        assert state["free"] == state["free_at_start"], state
        # vLLM's own configs: an n-gram draft has no caches; a draft model from this checkpoint is its MTP draft
        eng.proc.stdin.write("speculative ngram draft_model\n")
        eng.proc.stdin.flush()
        line = eng._line()
        while not line.startswith("SPECULATIVE "):
            line = eng._line()
        assert json.loads(line.split(" ", 1)[1]) == {"ngram": ["ngram", False], "draft_model": ["mtp", True]}
    finally:
        eng.close()

    # the producer side: vLLM with the draft sends the MTP layer to a peer planned with it
    plan = plan_migration(VLLM, TRTLLM, model, num_tokens, include_mtp=True)
    dst = destination_pools(plan, spare_pages=2)
    server = GlooServer(dst, plan=plan)
    got: dict = {}
    thread = threading.Thread(target=lambda: got.update(result=server.receive(timeout=120, request_id="req-9")))
    thread.start()
    try:
        _finish(_engine(python, "producer", "gloo", str(model_dir), str(out), "req-9", str(num_tokens), TRTLLM,
                        "{}:{}".format(*server.address), "mtp"))
    finally:
        thread.join(timeout=150)
        server.close()
    _, rid, tables, _ = got["result"]
    result = json.loads((out / "result.json").read_text())
    assert rid == "req-9" and result["sent"] == ["vllm-req-0"] and not result["errors"], result
    records = load_file(str(out / "records.safetensors"))
    _, _, caches = _vllm_buffer(out, plan, model, num_groups=8)
    src_tables = caches.tables(result["block_ids"])
    for i, t in enumerate(plan.transfers):
        held = gather_records(caches.pools.pool(t.spec), t.src, src_tables[caches.group[(t.spec.layer, t.spec.role)]],
                              t.first, t.count)
        assert torch.equal(held, records[str(i)])
        landed = gather_records(dst.pool(t.spec), t.dst, table_of(tables, t.dst), t.first, t.count)
        assert torch.equal(landed, expected_records(t, held)), f"layer {t.spec.layer} {t.spec.role.value}"


# ---------------------------------------------------------------------------------------------
# Without vLLM: the connector's view of vLLM's caches, and its configuration


def _packed_caches(model, profile, num_blocks: int = 16, pad: int = 64, include_mtp: bool = False):
    """Caches laid out as vLLM's block-outermost layouts do: per block, every layer's page, padded;
    one int8 buffer, one strided view per layer (content only, as vLLM's views show it)."""
    names = [cache_name(spec.layer, spec.role) for spec in model.all_caches(include_mtp)]
    pages = [profile.storage(spec).page_bytes for spec in model.all_caches(include_mtp)]
    stride = sum(pages) + pad
    buf = torch.zeros(num_blocks * stride, dtype=torch.int8)
    views, offset = {}, 0
    for name, page in zip(names, pages, strict=True):
        views[name] = buf.as_strided((num_blocks, page - 8), (stride, 1), offset)  # 8 B of alignment not shown
        offset += page
    return buf, views, dict(zip(names, pages, strict=True))


def _small_model():
    return from_hf_config(CONFIG)


def test_cache_names():
    from kvbridge.adapters.vllm_layout import cache_of

    assert cache_of("model.layers.3.attn") == (3, Role.COMPRESS)
    assert cache_of("model.layers.0.attn.swa_cache") == (0, Role.SWA)
    assert cache_of("model.layers.2.attn.indexer.k_cache") == (2, Role.INDEXER)
    assert cache_of("model.layers.2.attn.compressor.state_cache") == (2, Role.STATE)
    assert cache_of("model.layers.2.attn.indexer.compressor.state_cache") == (2, Role.INDEXER_STATE)
    assert cache_of("model.layers.2.mlp") is None
    assert all(cache_of(cache_name(7, role)) == (7, role) for role in Role)


def test_write_goes_through_each_groups_blocks_only():

    model, profile = _small_model(), parse_engine(VLLM)
    buf, views, pages = _packed_caches(model, profile)
    groups = [[name] for name in views]  # every cache a group of its own: block ids differ per cache
    caches = VllmCaches(profile, model, views, groups, pages)
    plan = plan_migration(TRTLLM, VLLM, model, 300, include_mtp=False)
    records = [torch.randint(0, 256, (t.count, t.dst.record_bytes), dtype=torch.uint8) for t in plan.transfers]
    block_ids = []
    for i, name in enumerate(views):
        key = next(k for k, n in caches.names.items() if n == name)
        t = next(t for t in plan.transfers if (t.spec.layer, t.spec.role) == key)
        need = t.table_slots(t.dst)[-1] + 1
        block_ids.append([0] * (need - len(t.table_slots(t.dst))) + [1 + (i + k) % 15 for k in range(
            len(t.table_slots(t.dst)))])
    caches.write(plan.transfers, records, block_ids)
    tables = caches.tables(block_ids)
    for t, rec in zip(plan.transfers, records, strict=True):
        table = tables[caches.group[(t.spec.layer, t.spec.role)]]
        assert torch.equal(gather_records(caches.pools.pool(t.spec), t.dst, table, t.first, t.count), rec)
    assert not buf.view(16, -1)[0].any(), "the null block was written"


def test_the_connectors_device_paths_on_cpu_caches():
    """``scripts/gpu_check.py``'s vLLM cases, run here on CPU caches: writes (from records and from landing
    pools) and ``request_pools`` through the same code as on CUDA (``device_order`` and ``ready_event`` order
    nothing on the CPU), the sent records on the host and equal to what was written; then a producer process
    and this one as consumer over gloo on loopback, the request landing byte for byte. The device side needs
    a GPU: the script."""
    gpu_check = gpu_check_module()
    assert gpu_check.vllm_caches_roundtrip(torch.device("cpu")) is True
    assert gpu_check.vllm_loopback(torch.device("cpu")) is True


def test_write_refuses_a_null_or_foreign_block_before_writing_anything():
    from kvbridge.errors import InputError

    model, profile = _small_model(), parse_engine(VLLM)
    buf, views, pages = _packed_caches(model, profile)
    caches = VllmCaches(profile, model, views, [list(views)], pages)
    plan = plan_migration(TRTLLM, VLLM, model, 300, include_mtp=False)
    records = [torch.full((t.count, t.dst.record_bytes), 7, dtype=torch.uint8) for t in plan.transfers]
    need = max(t.table_slots(t.dst)[-1] + 1 for t in plan.transfers)
    with pytest.raises(InputError, match="nothing was written"):
        caches.write(plan.transfers, records, [[1] * (need - 1) + [0]])  # the last block is vLLM's null block
    with pytest.raises(InputError, match="nothing was written"):
        caches.write(plan.transfers, records, [[1] * (need - 1) + [99]])  # outside the pool
    with pytest.raises(InputError, match="KV-cache groups"):
        caches.write(plan.transfers, records, [[1] * need, [2] * need])
    assert not buf.any()


def test_caches_take_the_mtp_layers_exactly_when_vllm_serves_the_mtp_draft():
    from types import SimpleNamespace

    from kvbridge.adapters.vllm_config import connector_mtp
    from kvbridge.errors import InputError

    model, profile = from_hf_config(CONFIG_MTP), parse_engine(VLLM)
    _, views, pages = _packed_caches(model, profile, include_mtp=True)
    caches = VllmCaches(profile, model, views, [list(views)], pages, include_mtp=True)
    assert caches.pools.include_mtp and (4, Role.SWA) in caches.group
    with pytest.raises(InputError, match="an MTP layer of .* but vLLM serves without its MTP draft"):
        VllmCaches(profile, model, views, [list(views)], pages)
    _, plain, plain_pages = _packed_caches(model, profile)
    with pytest.raises(InputError, match=r"no cache for layer 4 swa \(an MTP layer"):
        VllmCaches(profile, model, plain, [list(plain)], plain_pages, include_mtp=True)
    _, small, small_pages = _packed_caches(_small_model(), profile)
    beyond = {**small, "model.layers.4.attn.swa_cache": views["model.layers.4.attn.swa_cache"]}
    with pytest.raises(InputError, match="past .* 4 layers and 0 MTP layers"):
        VllmCaches(profile, _small_model(), beyond, [list(beyond)], {**small_pages, **pages})

    def draft(method, kv=True):
        return SimpleNamespace(method=method, uses_draft_kv_cache=lambda: kv)

    assert connector_mtp(None, model) is False and connector_mtp(draft("ngram", kv=False), model) is False
    assert connector_mtp(draft("mtp"), model) is True
    with pytest.raises(InputError, match="speculative method 'eagle3'.* MTP layers only"):
        connector_mtp(draft("eagle3"), model)
    with pytest.raises(InputError, match="no MTP layers"):
        connector_mtp(draft("mtp"), _small_model())


def test_caches_refuse_a_profile_that_does_not_match_vllms_pages():
    from kvbridge.errors import InputError

    model, profile = _small_model(), parse_engine(VLLM)
    _, views, pages = _packed_caches(model, profile)
    with pytest.raises(InputError, match="does not match"):
        VllmCaches(parse_engine("vllm:block=512"), model, views, [list(views)], pages)
    with pytest.raises(InputError, match="not a DeepSeek-V4 cache"):
        VllmCaches(profile, model, views, [[*views, "model.layers.0.mlp"]], pages)
    missing = dict(views)
    missing.pop("model.layers.2.attn.indexer.k_cache")
    with pytest.raises(InputError, match="registered no cache for layer 2 indexer_compress"):
        VllmCaches(profile, model, missing, [list(views)], pages)


def test_request_pools_copy_each_groups_blocks_in_table_order():

    model, profile = _small_model(), parse_engine(VLLM)
    _, views, pages = _packed_caches(model, profile)
    groups = [[name] for name in views]
    caches = VllmCaches(profile, model, views, groups, pages)
    plan = plan_migration(VLLM, TRTLLM, model, 300, include_mtp=False)
    records = [torch.randint(0, 256, (t.count, t.src.record_bytes), dtype=torch.uint8) for t in plan.transfers]
    block_ids = []
    for i, name in enumerate(views):
        key = next(k for k, n in caches.names.items() if n == name)
        t = next(t for t in plan.transfers if (t.spec.layer, t.spec.role) == key)
        slots = t.table_slots(t.src)
        block_ids.append([0] * slots[0] + [1 + (i + k) % 15 for k in range(len(slots))])
    caches.write(plan.transfers, records, block_ids, side="src")
    pools, tables = caches.request_pools(plan, block_ids)
    for t, rec in zip(plan.transfers, records, strict=True):
        assert torch.equal(gather_records(pools.pool(t.spec), t.src, table_of(tables, t.src), t.first, t.count), rec)


def test_nixl_transfers_carry_the_request_id_and_a_receiver_refuses_another():
    """What the connector relies on over NIXL: the sender names the request, and a receiver waiting for
    another refuses it before claiming a page or connecting agents."""
    if not nixl_available():
        pytest.skip("needs nixl (pip install 'kvbridge[nixl]')")
    model = _small_model()
    plan = plan_migration(TRTLLM, VLLM, model, 300, include_mtp=False)
    src, tables = source_request(plan, seed=5)
    dst = destination_pools(plan)
    free = dst.num_free()
    got: dict = {}
    with NixlReceiver(dst, plan=plan) as rx, NixlSender(*rx.address, timeout=60) as sender:
        for want in ("req-other", "req-1"):
            thread = threading.Thread(target=lambda want=want: got.update(
                {want: _outcome(lambda: rx.receive(timeout=60, accept_timeout=60, request_id=want))}))
            thread.start()
            sent = _outcome(lambda: sender.send_request(plan, src, tables, convert_on="sender", request_id="req-1"))
            thread.join(90)
            if want == "req-other":
                assert isinstance(sent, MigrationError) and "waits for request req-other" in str(sent), sent
                assert isinstance(got[want], MigrationError) and dst.num_free() == free
            else:
                assert sent["num_tokens"] == 300 and got[want].request_id == "req-1"
        for t in plan.transfers:
            landed = gather_records(dst.pool(t.spec), t.dst, table_of(got["req-1"].tables, t.dst), t.first, t.count)
            want = expected_records(t, gather_records(src.pool(t.spec), t.src, table_of(tables, t.src), t.first,
                                                      t.count))
            assert torch.equal(landed, want)


def _outcome(fn):
    try:
        return fn()
    except MigrationError as exc:
        return exc


def test_kv_transfer_config_and_cli():
    from click.testing import CliRunner

    from cli.main import cli
    from kvbridge.adapters.vllm_config import kv_transfer_config
    from kvbridge.errors import InputError

    assert kv_transfer_config("consumer") == {"kv_connector": "KVBridgeConnector",
                                              "kv_connector_module_path": "kvbridge.adapters.vllm",
                                              "kv_role": "kv_consumer"}
    cfg = kv_transfer_config("consumer", listen="0.0.0.0:7300", engine="vllm:gpu=sm100", timeout=30)
    assert cfg["kv_connector_extra_config"] == {"listen": "0.0.0.0:7300", "timeout": 30,
                                                "engine": "vllm:block=256:idx=fp8:gpu=sm100:kv=fp8_ds_mla"}
    for kwargs, match in (({"listen": "nohost"}, "host:port"), ({"engine": "sglang"}, "vLLM spec"),
                          ({"timeout": 0}, "positive"), ({"convert_on": "both"}, "sender or receiver")):
        with pytest.raises(InputError, match=match):
            kv_transfer_config("consumer", **kwargs)
    with pytest.raises(InputError, match="consumer setting"):
        kv_transfer_config("producer", listen="h:1")
    result = CliRunner().invoke(cli, ["vllm-config", "producer", "--convert-on", "sender"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.output)["kv_connector_extra_config"] == {"convert_on": "sender"}
    result = CliRunner().invoke(cli, ["vllm-config", "consumer", "--serve", "/models/v4", "--engine", "vllm:block=512"])
    assert result.exit_code == 0 and result.output.startswith("vllm serve /models/v4 --kv-cache-dtype fp8_ds_mla "
                                                              "--block-size 512 --kv-transfer-config '{")
    assert kv_transfer_config("consumer", on_load_failure="recompute")["kv_load_failure_policy"] == "recompute"
    cfg = kv_transfer_config("both", transport="nixl", landing_tokens=4096)
    assert cfg["kv_connector_extra_config"] == {"transport": "nixl", "landing_tokens": 4096}
    with pytest.raises(InputError, match="gloo or nixl"):
        kv_transfer_config("consumer", transport="rdma")
    for role, transport in (("producer", "nixl"), ("consumer", "gloo"), ("consumer", None)):
        with pytest.raises(InputError, match="landing_tokens"):
            kv_transfer_config(role, transport=transport, landing_tokens=4096)
    with pytest.raises(InputError, match="positive integer"):
        kv_transfer_config("consumer", transport="nixl", landing_tokens=0)
    result = CliRunner().invoke(cli, ["vllm-config", "producer", "--transport", "nixl"])
    assert result.exit_code == 0 and json.loads(result.output)["kv_connector_extra_config"] == {"transport": "nixl"}
    result = CliRunner().invoke(cli, ["vllm-config", "consumer", "--listen", "x"])
    assert result.exit_code == 1 and "host:port" in result.output


def test_kv_transfer_config_ape_key(tmp_path):
    from click.testing import CliRunner

    from cli.main import cli
    from kvbridge.adapters.vllm_config import kv_transfer_config
    from kvbridge.errors import InputError

    assert kv_transfer_config("consumer", ape="/m/a.safetensors")["kv_connector_extra_config"] == {
        "ape": ["/m/a.safetensors"]}
    assert kv_transfer_config("both", ape=["a", "b"])["kv_connector_extra_config"] == {"ape": ["a", "b"]}
    for bad in ([], [""], 3, ["a", 1]):
        with pytest.raises(InputError, match="ape must be a safetensors path"):
            kv_transfer_config("consumer", ape=bad)
    shard = tmp_path / "s1.safetensors"
    result = CliRunner().invoke(cli, ["vllm-config", "consumer", "--ape", str(shard), "--ape", "s2.safetensors"])
    assert result.exit_code == 0, result.output
    # paths are made absolute: vLLM may start in another directory
    assert json.loads(result.output)["kv_connector_extra_config"] == {
        "ape": [str(shard), str(Path("s2.safetensors").resolve())]}


def test_request_table_keys_loads_by_request_id():
    """The connector's worker-side table (no vLLM): a producer held until its load arrives, an aborted load
    released at once and its late producer refused by name, a load that waits too long failed, a second
    producer for one load refused, and a full holding area refusing at once."""
    from types import SimpleNamespace

    from kvbridge.adapters.vllm_requests import RequestTable
    from kvbridge.errors import InputError

    def load(req_id, rid):
        return SimpleNamespace(req_id=req_id, request_id=rid)

    table = RequestTable(hold_s=5.0, hold_limit=1)
    got: dict = {}
    thread = threading.Thread(target=lambda: got.update(p=table.claim("a")))
    thread.start()
    time.sleep(0.2)
    with pytest.raises(InputError, match="already holds 1 producers"):
        table.claim("x")  # the holding area (one place) is taken
    table.add(load("va", "a"), timeout=60)
    thread.join(5)
    assert got["p"].state == "receiving"
    with pytest.raises(InputError, match="already sending request a"):
        table.claim("a")
    table.writing(got["p"])
    table.finish(got["p"], None)
    assert table.results() == ({"va"}, set())
    table.add(load("vb", "b"), timeout=60)
    table.cancel("vb")
    assert table.results() == ({"vb"}, set())
    with pytest.raises(InputError, match="request b was aborted"):
        table.claim("b")
    table.add(load("vc", "c"), timeout=60)
    p = table.claim("c")
    table.cancel("vc")  # a producer is on it: the receiving thread refuses to write, then releases it
    assert table.results() == (set(), set())
    with pytest.raises(InputError, match="aborted on this vLLM while it was received"):
        table.writing(p)
    table.finish(p, "aborted")
    assert table.results() == ({"vc"}, set())
    table.add(load("vd", "d"), timeout=0.01)
    time.sleep(0.05)
    assert table.results() == ({"vd"}, {"vd"})
    assert "no kvbridge producer connected within 0.01 s" in table.take_outcomes()[-1][2]
    quick = RequestTable(hold_s=0.05, hold_limit=4)
    with pytest.raises(InputError, match="no request z waiting"):
        quick.claim("z")


def test_connector_profile_takes_the_gpu_family_from_the_device():
    """SM90 and SM100 pages have the same sizes, so the family is read from the device, never guessed, and a
    ``gpu=`` that contradicts the device is refused at start."""
    from kvbridge.adapters.vllm_config import connector_profile, device_gpu_family
    from kvbridge.errors import InputError

    assert connector_profile(None, 256, None).spec == "vllm:block=256:idx=fp8:gpu=sm90:kv=fp8_ds_mla"
    assert connector_profile(None, 256, "sm100").spec == "vllm:block=256:idx=fp8:gpu=sm100:kv=fp8_ds_mla"
    assert connector_profile("vllm:block=512:idx=fp4", 256, "sm100").spec.startswith("vllm:block=512:idx=fp4:gpu=sm100")
    assert connector_profile("vllm:gpu=sm100", 256, "sm100").spec.startswith("vllm:block=256:idx=fp8:gpu=sm100")
    with pytest.raises(InputError, match="gpu=sm90, but this device is sm100"):
        connector_profile("vllm:gpu=sm90", 256, "sm100")
    with pytest.raises(InputError, match="vLLM spec"):
        connector_profile("sglang", 256, None)
    assert device_gpu_family() is None if not torch.cuda.is_available() else device_gpu_family().startswith("sm")
