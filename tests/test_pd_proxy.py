"""The mixed-engine PD proxy (kvbridge.adapters.pd_proxy, ``kvbridge pd-proxy``) over real sockets, against
upstream servers that parse every body with the engines' own request classes (tests/pd_upstreams.py, run in
the SGLang 0.5.23 and vLLM 0.33.0 venvs named by KVBRIDGE_SGLANG_PYTHON / KVBRIDGE_VLLM_PYTHON). The
engines' servers and models are not run: the upstreams' answers are synthetic; what is checked is what each
side receives, as the engine's own classes read it, and what the client gets back."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from click.testing import CliRunner

from cli.main import cli
from kvbridge.errors import InputError
from tests.migration_helpers import free_port

ROOT = Path(__file__).resolve().parent.parent
UPSTREAMS = Path(__file__).with_name("pd_upstreams.py")
PYTHONS = {"sglang": os.environ.get("KVBRIDGE_SGLANG_PYTHON"), "vllm": os.environ.get("KVBRIDGE_VLLM_PYTHON")}
BOOT = ("10.1.2.3", 8998)  # the SGLang bootstrap address both requests name (never dialled here)


def _need() -> None:
    missing = [f"KVBRIDGE_{e.upper()}_PYTHON" for e, py in PYTHONS.items() if not py]
    try:
        import aiohttp  # noqa: F401
    except ImportError:
        missing.append("aiohttp (pip install 'kvbridge[proxy]')")
    if missing:
        if os.environ.get("CI") == "true":
            pytest.fail("CI must run the PD proxy tests; missing: " + "; ".join(missing))
        pytest.skip("needs " + "; ".join(missing))


@pytest.fixture(scope="module")
def upstreams():
    """One process per engine venv, each serving a prefill and a decode port: {engine: {role: url}}."""
    _need()
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    procs = {e: subprocess.Popen([py, str(UPSTREAMS), e], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                 stderr=subprocess.DEVNULL, env=env, text=True) for e, py in PYTHONS.items()}
    try:
        urls = {}
        for engine, proc in procs.items():
            line = proc.stdout.readline()
            assert line, f"the {engine} upstream did not start"
            urls[engine] = {role: f"http://127.0.0.1:{port}" for role, port in json.loads(line).items()}
        yield urls
    finally:
        for proc in procs.values():
            proc.stdin.close()
            proc.wait(30)


def _control(upstreams, **roles) -> None:
    """Reset both upstreams' logs and set their behaviour: ``sglang={"prefill": {...}}``, ..."""
    for engine, urls in upstreams.items():
        _post(urls["prefill"] + "/_control", roles.get(engine, {}))


def _log(upstreams, engine: str) -> list[dict]:
    with urllib.request.urlopen(upstreams[engine]["prefill"] + "/_log", timeout=10) as r:
        return json.loads(r.read())


def _post(url: str, body: dict, timeout: float = 30) -> tuple[int, dict, bytes]:
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, dict(r.headers), r.read()
    except urllib.error.HTTPError as exc:
        return exc.code, dict(exc.headers), exc.read()


def _proxy(pair: str, upstreams, **kw):
    from kvbridge.adapters.pd_proxy import PAIRS, ProxyConfig, running

    pre, dec = PAIRS[pair]
    cfg = ProxyConfig.make(pair, upstreams[pre]["prefill"], upstreams[dec]["decode"], f"{BOOT[0]}:{BOOT[1]}", **kw)
    return running(cfg)


def test_start_refuses_what_it_cannot_drive():
    """An unknown pair, a URL that is not a server's base URL, a bad bootstrap: one line, at start."""
    pytest.importorskip("aiohttp")
    from kvbridge.adapters.pd_proxy import ProxyConfig

    ok = ("http://127.0.0.1:30000", "http://127.0.0.1:8000", "8998")
    cfg = ProxyConfig.make("sglang-vllm", *ok)
    assert cfg.bootstrap == ("127.0.0.1", 8998) and cfg.prefill == "http://127.0.0.1:30000"
    cases = [(("sglang-sglang", *ok), "unknown pair 'sglang-sglang'"),
             (("sglang-vllm", "127.0.0.1:30000", *ok[1:]), "--prefill '127.0.0.1:30000' must be"),
             (("sglang-vllm", ok[0], "http://h:8000/v1", ok[2]), "--decode 'http://h:8000/v1' must be"),
             (("vllm-sglang", "ftp://h:1", *ok[1:]), "--prefill 'ftp://h:1' must be"),
             (("vllm-sglang", "http://h:99999", *ok[1:]), "is not a URL"),
             (("vllm-sglang", *ok[:2], "h:port"), "--bootstrap must be HOST:PORT or PORT")]
    for args, message in cases:
        with pytest.raises(InputError, match=message.replace("(", r"\(")) as exc:
            ProxyConfig.make(*args)
        assert "\n" not in str(exc.value)
    res = CliRunner().invoke(cli, ["pd-proxy", "--pair", "trtllm-vllm", "--prefill", ok[0], "--decode", ok[1],
                                   "--bootstrap", "8998"], prog_name="kvbridge")
    assert res.exit_code == 2 and "unknown pair 'trtllm-vllm'" in res.output
    run = subprocess.run([sys.executable, "-m", "cli.main", "pd-proxy", "--pair", "sglang-vllm", "--prefill",
                          "localhost:30000", "--decode", ok[1], "--bootstrap", "8998"], capture_output=True, text=True,
                         timeout=120, cwd=ROOT)
    assert run.returncode == 2 and run.stdout == "" and len(run.stderr.splitlines()) == 1, run.stderr
    assert "--prefill 'localhost:30000' must be the server's base URL" in run.stderr


def test_sglang_prefill_vllm_decode(upstreams):
    """/v1/completions: the SGLang prefill gets a one-token /generate naming the room; the vLLM decode gets the
    client's body with kv_transfer_params, which reach the connector as its reader takes them."""
    _control(upstreams)
    with _proxy("sglang-vllm", upstreams) as url:
        status, headers, body = _post(url + "/v1/completions", {"model": "m", "prompt": [5, 6, 7], "max_tokens": 9,
                                                                "temperature": 0.5})
    assert status == 200, body
    room = int(headers["X-KVBridge-Room"])
    assert 1 <= room < 2**63
    assert json.loads(body)["text_all"] == f"decode-{room}-0 decode-{room}-1 decode-{room}-2"
    [pre] = _log(upstreams, "sglang")
    assert pre == {"role": "prefill", "route": "/generate", "single": True, "input_ids": [5, 6, 7],
                   "sampling_params": {"max_new_tokens": 1}, "stream": False, "bootstrap_host": BOOT[0],
                   "bootstrap_port": BOOT[1], "bootstrap_room": room}
    [dec] = _log(upstreams, "vllm")
    boot = {"bootstrap_host": BOOT[0], "bootstrap_port": BOOT[1], "bootstrap_room": room}
    assert dec == {"role": "decode", "route": "/v1/completions", "prompt": [5, 6, 7], "model": "m", "max_tokens": 9,
                   "stream": False, "kv_transfer_params": boot, "connector_reads": [f"{BOOT[0]}:{BOOT[1]}", room]}


@pytest.mark.parametrize("route", ["/generate", "/v1/completions"])
def test_vllm_prefill_sglang_decode(upstreams, route):
    """The vLLM prefill gets a max_tokens-1 completion with kv_transfer_params {bootstrap_room}; the SGLang decode
    the client's body with bootstrap_host/port/room, as SGLang's classes read them."""
    _control(upstreams)
    body = {"input_ids": [1, 2, 3, 4], "sampling_params": {"max_new_tokens": 16}} if route == "/generate" else \
        {"model": "m", "prompt": [1, 2, 3, 4], "max_tokens": 16}
    with _proxy("vllm-sglang", upstreams, model="served") as url:
        status, headers, out = _post(url + route, body)
    assert status == 200, out
    room = int(headers["X-KVBridge-Room"])
    [pre] = _log(upstreams, "vllm")
    assert pre == {"role": "prefill", "route": "/v1/completions", "prompt": [1, 2, 3, 4], "model": "served",
                   "max_tokens": 1, "stream": False, "kv_transfer_params": {"bootstrap_room": room}}
    [dec] = _log(upstreams, "sglang")
    boot = {"bootstrap_host": BOOT[0], "bootstrap_port": BOOT[1], "bootstrap_room": room}
    if route == "/generate":
        assert dec == {"role": "decode", "route": route, "single": True, "input_ids": [1, 2, 3, 4],
                       "sampling_params": {"max_new_tokens": 16}, "stream": False, **boot}
    else:
        assert dec == {"role": "decode", "route": route, "prompt": [1, 2, 3, 4], "max_tokens": 16, "stream": False,
                       **boot, "routed_dp_rank": None, "disagg_prefill_dp_rank": None}


def test_concurrent_requests_get_distinct_rooms(upstreams):
    """Eight requests at once, each side stalled 0.5 s: all served together, eight rooms, each room's prefill and
    decode carrying the same prompt."""
    _control(upstreams, sglang={"prefill": {"stall": 0.5}}, vllm={"decode": {"stall": 0.5}})
    with _proxy("sglang-vllm", upstreams) as url, ThreadPoolExecutor(8) as pool:
        t0 = time.monotonic()
        results = list(pool.map(lambda i: _post(url + "/v1/completions", {"prompt": [100 + i, i], "max_tokens": 2}),
                                range(8)))
        wall = time.monotonic() - t0
    assert [s for s, _, _ in results] == [200] * 8
    rooms = [int(h["X-KVBridge-Room"]) for _, h, _ in results]
    assert len(set(rooms)) == 8 and wall < 3.0, (rooms, wall)  # serially: 8 x 0.5 s at least
    pre = {r["bootstrap_room"]: r["input_ids"] for r in _log(upstreams, "sglang")}
    dec = {r["kv_transfer_params"]["bootstrap_room"]: r["prompt"] for r in _log(upstreams, "vllm")}
    assert pre == dec == {room: [100 + i, i] for i, room in enumerate(rooms)}
    for (_, _, body), room in zip(results, rooms, strict=True):
        assert json.loads(body)["room"] == room


def _wait_cancelled(upstreams, engine: str, role: str) -> dict:
    deadline = time.monotonic() + 5
    while True:
        [rec] = [r for r in _log(upstreams, engine) if r["role"] == role]
        if rec.get("cancelled") or time.monotonic() > deadline:
            return rec
        time.sleep(0.05)


def test_a_failing_side_is_named_and_the_other_aborted(upstreams):
    """A prefill answering 500: HTTP 502 naming the prefill, and the stalled decode's request closed (the
    upstream sees its client go); a decode refusing with 400: 400 naming the decode; a decode silent past the
    timeout: 504; a decode nobody listens on: 502."""
    _control(upstreams, sglang={"prefill": {"status": 500, "message": "KV transfer failed for room"}},
             vllm={"decode": {"stall": 30}})
    with _proxy("sglang-vllm", upstreams) as url:
        t0 = time.monotonic()
        status, headers, body = _post(url + "/v1/completions", {"prompt": [1], "max_tokens": 2})
        assert time.monotonic() - t0 < 5
        err = json.loads(body)["error"]
        assert status == 502 and err["side"] == "prefill" and err["upstream_status"] == 500
        assert err["message"].startswith(f"prefill {upstreams['sglang']['prefill']}/generate: HTTP 500: ")
        assert "KV transfer failed for room" in err["message"] and err["room"] == int(headers["X-KVBridge-Room"])
        assert _wait_cancelled(upstreams, "vllm", "decode").get("cancelled")

        _control(upstreams, sglang={"prefill": {"stall": 30}}, vllm={"decode": {"status": 400, "message": "bad"}})
        status, _, body = _post(url + "/v1/completions", {"prompt": [1], "max_tokens": 2})
        err = json.loads(body)["error"]
        assert status == 400 and err["side"] == "decode" and err["upstream_status"] == 400
        assert _wait_cancelled(upstreams, "sglang", "prefill").get("cancelled")

    _control(upstreams, vllm={"decode": {"stall": 30}})
    with _proxy("sglang-vllm", upstreams, timeout=0.5) as url:
        status, _, body = _post(url + "/v1/completions", {"prompt": [1], "max_tokens": 2})
    err = json.loads(body)["error"]
    assert status == 504 and err["side"] == "decode" and "no answer within 0.5 s" in err["message"]

    from kvbridge.adapters.pd_proxy import ProxyConfig, running

    dead = f"http://127.0.0.1:{free_port()}"
    cfg = ProxyConfig.make("vllm-sglang", upstreams["vllm"]["prefill"], dead, "8998")
    _control(upstreams)
    with running(cfg) as url:
        status, _, body = _post(url + "/generate", {"input_ids": [3], "sampling_params": {}})
    err = json.loads(body)["error"]
    assert status == 502 and err["side"] == "decode" and err["upstream"] == dead + "/generate"
    assert "ClientConnectorError" in err["message"]


def _stream(url: str, body: dict) -> tuple[int, dict, list[tuple[float, bytes]]]:
    """POST and read the response as it comes: (status, headers, [(seconds since sent, line)])."""
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    t0 = time.monotonic()
    with urllib.request.urlopen(req, timeout=30) as r:
        return r.status, dict(r.headers), [(time.monotonic() - t0, line) for line in r if line.strip()]


@pytest.mark.parametrize("pair", ["sglang-vllm", "vllm-sglang"])
def test_streaming_passes_the_decode_events_through(upstreams, pair):
    """``"stream": true``: the decode's SSE events reach the client byte for byte, each as it is sent (0.4 s
    apart), the prefill's request unstreamed."""
    dec_engine = "vllm" if pair == "sglang-vllm" else "sglang"
    _control(upstreams, **{dec_engine: {"decode": {"gap": 0.4}}})
    route, body = ("/v1/completions", {"prompt": [9, 9], "max_tokens": 3, "stream": True}) if pair == "sglang-vllm" \
        else ("/generate", {"input_ids": [9, 9], "sampling_params": {"max_new_tokens": 3}, "stream": True})
    with _proxy(pair, upstreams) as url:
        status, headers, lines = _stream(url + route, body)
    assert status == 200 and headers["Content-Type"].startswith("text/event-stream")
    room = int(headers["X-KVBridge-Room"])
    events = [json.loads(line[6:]) for _, line in lines if line.startswith(b"data: {")]
    text = [e["text"] if "text" in e else e["choices"][0]["text"] for e in events]
    assert text == [f"decode-{room}-{i}" for i in range(3)]
    assert lines[-1][1] == b"data: [DONE]\n" and lines[-2][0] - lines[0][0] > 0.6, lines  # not buffered whole
    pre_engine = "sglang" if pair == "sglang-vllm" else "vllm"
    [pre] = _log(upstreams, pre_engine)
    [dec] = _log(upstreams, dec_engine)
    assert pre["stream"] is False and dec["stream"] is True


def test_a_prefill_failing_mid_stream_ends_the_stream_with_its_error(upstreams):
    """The decode's first event passes, then the prefill answers 503: one ``data: {"error": ...}`` event naming
    the prefill ends the stream, and the decode's request is closed."""
    _control(upstreams, sglang={"prefill": {"stall": 0.5, "status": 503, "message": "prefill aborted"}},
             vllm={"decode": {"gap": 2.0}})
    with _proxy("sglang-vllm", upstreams) as url:
        status, headers, lines = _stream(url + "/v1/completions", {"prompt": [4], "max_tokens": 3, "stream": True})
    room = int(headers["X-KVBridge-Room"])
    data = [line for _, line in lines if line.startswith(b"data: ")]
    assert status == 200 and len(data) == 2, lines
    assert json.loads(data[0][6:])["choices"][0]["text"] == f"decode-{room}-0"
    err = json.loads(data[1][6:])["error"]
    assert err["side"] == "prefill" and err["upstream_status"] == 503 and "prefill aborted" in err["message"]
    assert lines[-1][0] < 2.0  # ended at the prefill's failure, not after the decode's next event
    assert _wait_cancelled(upstreams, "vllm", "decode").get("cancelled")


def test_requests_one_room_cannot_serve_are_refused(upstreams):
    """Text prompts, n > 1, batches, fields only the proxy sets, a body that is no JSON object: HTTP 400, and no
    upstream is asked."""
    _control(upstreams)
    with _proxy("sglang-vllm", upstreams) as url, _proxy("vllm-sglang", upstreams) as url2:
        for u, route, body, why in [
                (url, "/v1/completions", {"prompt": "hello"}, "prompt must be one prompt as a non-empty list"),
                (url, "/v1/completions", {"prompt": [[1], [2]]}, "prompt must be one prompt"),
                (url, "/v1/completions", {"prompt": [1], "n": 2}, "n must be 1"),
                (url, "/v1/completions", {"prompt": [1], "kv_transfer_params": {}}, "kv_transfer_params: set by the"),
                (url, "/v1/completions", [1, 2], "the body must be a JSON object"),
                (url2, "/generate", {"text": "hi"}, "give input_ids, not text"),
                (url2, "/generate", {"input_ids": [1], "bootstrap_room": 3}, "bootstrap_room: set by the proxy"),
                (url2, "/generate", {"input_ids": [1], "sampling_params": {"n": 3}}, "n must be 1")]:
            status, _, out = _post(u + route, body)
            assert status == 400 and why in json.loads(out)["error"]["message"], (body, out)
        status, _, _ = _post(url + "/generate", {"input_ids": [1]})
        assert status == 404  # sglang-vllm answers in vLLM's format only
    assert _log(upstreams, "sglang") == [] and _log(upstreams, "vllm") == []


def test_health_names_the_side_that_is_down(upstreams):
    _control(upstreams)
    with _proxy("sglang-vllm", upstreams) as url:
        with urllib.request.urlopen(url + "/health", timeout=10) as r:
            assert r.status == 200 and json.loads(r.read())["status"] == "ok"
        _control(upstreams, vllm={"health": True})
        with pytest.raises(urllib.error.HTTPError) as exc:
            urllib.request.urlopen(url + "/health", timeout=10)
        info = json.loads(exc.value.read())
        assert exc.value.code == 503 and info["prefill"] == "ok"
        assert info["decode"] == f"{upstreams['vllm']['decode']}/health: HTTP 503"
    _control(upstreams)


def test_the_command_serves_until_terminated(upstreams):
    """``kvbridge pd-proxy`` as a user starts it: its ready line, one request through it, SIGTERM."""
    _control(upstreams)
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "cli.main", "pd-proxy", "--pair", "vllm-sglang",
                             "--prefill", upstreams["vllm"]["prefill"], "--decode", upstreams["sglang"]["decode"],
                             "--bootstrap", "10.1.2.3:8998", "--listen", f"127.0.0.1:{port}"],
                            stderr=subprocess.PIPE, text=True, cwd=ROOT, env={**os.environ, "COLUMNS": "80"})
    try:
        line = proc.stderr.readline()
        assert "pd-proxy vllm-sglang:" in line and f"http://127.0.0.1:{port}" in line, line
        status, headers, body = _post(f"http://127.0.0.1:{port}/generate", {"input_ids": [8]})
        assert status == 200 and json.loads(body)["meta_info"]["room"] == int(headers["X-KVBridge-Room"])
    finally:
        proc.send_signal(signal.SIGTERM)
        rc = proc.wait(30)
    assert rc == 143 and "terminated (SIGTERM)" in proc.stderr.read()
