"""The receiver as a server (`kvbridge migrate serve`, gloo and NIXL), on loopback, bounded in time.

One scenario per transport, all at once against one server: an idle TCP connection, a request id
of 260 bytes, a sender SIGKILLed mid-request (`tests/server_peers.py`), 20 garbage clients, a
request over the pools' capacity and 3 real `kvbridge migrate send` processes. The server stays
up; each real sender lands within its own timeout; each bad connection is one one-line failure,
the idle one dropped after the handshake bound and the killed one noticed within seconds (not at
the timeout); every page is free again at the end (nothing claimed). The CLI test runs
`migrate serve` itself: a dump name of 260 bytes and an idle connection do not stop it.
"""

from __future__ import annotations

import json
import os
import random
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from server_peers import DST, MODEL, SRC, TOKENS, plan

from kvbridge.migration import EnginePools, plan_migration
from kvbridge.migration.control import MAGIC, PROTOCOL_VERSION, Channel
from kvbridge.migration.nixl import NixlReceiver
from kvbridge.migration.nixl_agent import nixl_available
from kvbridge.migration.transport import GlooServer

REPO = Path(__file__).resolve().parents[1]
HANDSHAKE_S = 2.0
#: The server's per-connection timeout and each real sender's own --timeout.
TIMEOUT_S = 120.0
#: Process start (imports) on a loaded two-core machine, on top of a sender's own timeout.
START_S = 60.0
GARBAGE = 20
REAL = 3


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{REPO / 'tests'}{os.pathsep}"
            f"{os.environ.get('PYTHONPATH', '')}"}


def _cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "cli.main", *args]


def _pools() -> EnginePools:
    held = plan().held_pages("dst")
    return EnginePools.create(DST, MODEL, {k: 4 * v + 2 for k, v in held.items()})


def _plan_for(info: dict):
    return plan_migration(info["src"], DST, MODEL, int(info["num_tokens"]), draft_tokens=int(info["draft_tokens"]),
                          include_mtp=bool(info["include_mtp"]))


def _garbage(port: int, kind: int) -> float:
    """One bad client; returns the seconds until the server closed the connection."""
    t0 = time.monotonic()
    with socket.create_connection(("127.0.0.1", port), timeout=30) as s:
        payloads = [b"", b"GET / HTTP/1.0\r\n\r\n", MAGIC, MAGIC + struct.pack(">H", PROTOCOL_VERSION) +
                    struct.pack(">II", 5, 0) + b"nojsn", MAGIC + struct.pack(">H", 99),
                    MAGIC + struct.pack(">H", PROTOCOL_VERSION) + struct.pack(">II", 1 << 30, 0),
                    bytes(random.Random(kind).randrange(256) for _ in range(64)),
                    MAGIC + struct.pack(">H", PROTOCOL_VERSION) + _frame({"type": "hello", "kind": "request"})]
        s.sendall(payloads[kind % len(payloads)])
        if kind % len(payloads) == 0:
            s.shutdown(socket.SHUT_WR)
        try:
            while s.recv(1 << 16):
                pass
        except ConnectionResetError:  # closed with our bytes unread
            pass
    return time.monotonic() - t0


def _frame(message: dict) -> bytes:
    body = json.dumps(message).encode()
    return struct.pack(">II", len(body), 0) + body


class _Outcomes:
    """Drains a ConnectionServer on a thread: (seconds since start, result or error)."""

    def __init__(self, connections, server, dst: EnginePools):
        self.items: list[tuple[float, object]] = []
        self.t0 = time.monotonic()
        self.stop = threading.Event()

        def drain():
            while not self.stop.is_set():
                try:
                    got = connections.next(0.1)
                except Exception as exc:  # each connection's own error: what the test checks
                    self.items.append((time.monotonic() - self.t0, exc))
                    continue
                if got is not None:
                    tables = got.tables if hasattr(got, "tables") else got[2]
                    with server.lock:
                        dst.release(tables)
                    self.items.append((time.monotonic() - self.t0, got))

        self.thread = threading.Thread(target=drain, daemon=True)
        self.thread.start()

    def wait_for(self, n: int, timeout: float) -> None:
        end = time.monotonic() + timeout
        while len(self.items) < n and time.monotonic() < end:
            time.sleep(0.1)
        self.stop.set()
        self.thread.join(5)


@pytest.mark.parametrize("transport", ["gloo", "nixl"])
def test_server_survives_bad_peers_and_serves_real_senders(transport):
    if transport == "nixl" and not nixl_available():
        pytest.skip("needs the nixl extra: pip install 'kvbridge[nixl]'")
    dst = _pools()
    free0 = dst.num_free()
    if transport == "gloo":
        server = GlooServer(dst, plan=_plan_for, handshake_s=HANDSHAKE_S)
    else:
        server = NixlReceiver(dst, plan=_plan_for, handshake_s=HANDSHAKE_S)
    connections = server.serve(timeout=TIMEOUT_S)
    procs: list[subprocess.Popen] = []
    try:
        port = server.address[1]
        outcomes = _Outcomes(connections, server, dst)
        stalled = subprocess.Popen([sys.executable, str(REPO / "tests" / "server_peers.py"), f"stall-{transport}",
                                    str(port)], cwd=REPO, env=_env(), stdout=subprocess.PIPE, text=True)
        procs.append(stalled)
        assert stalled.stdout is not None and stalled.stdout.readline().strip() == "ready"
        idle = socket.create_connection(("127.0.0.1", port))
        long_id = Channel.connect("127.0.0.1", port, time.monotonic() + 10)
        long_id.send({"type": "hello", "transport": transport, "kind": "request", "request_id": "x" * 260},
                     deadline=time.monotonic() + 10)
        send = ["migrate", "send", "--peer", f"127.0.0.1:{port}", "--transport", transport, "--from", SRC, "--to",
                DST, "--layers", str(MODEL.num_layers), "--timeout", str(TIMEOUT_S), "--json"]
        real = [subprocess.Popen(_cli(*send, "--tokens", str(TOKENS), "--seed", str(k)), cwd=REPO, env=_env(),
                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for k in range(REAL)]
        over = subprocess.Popen(_cli(*send, "--tokens", str(100 * TOKENS)), cwd=REPO, env=_env(),
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        procs += [*real, over]
        closed: list[float] = []
        clients = [threading.Thread(target=lambda k=k: closed.append(_garbage(port, k))) for k in range(GARBAGE)]
        for c in clients:
            c.start()
        time.sleep(1.0)
        stalled.send_signal(signal.SIGKILL)
        killed_at = time.monotonic() - outcomes.t0
        for c in clients:
            c.join(30)
        assert len(closed) == GARBAGE and max(closed) < HANDSHAKE_S + 5, closed  # none waits for the timeout
        reply = long_id.recv(time.monotonic() + 10, "the refusal")[0]
        assert reply["type"] == "error" and "260 bytes" in reply["error"], reply
        results = [p.communicate(timeout=TIMEOUT_S + START_S) for p in real]
        over_out = over.communicate(timeout=TIMEOUT_S + START_S)
        outcomes.wait_for(GARBAGE + REAL + 4, TIMEOUT_S)
        assert idle.recv(1 << 16) and idle.recv(1 << 16) == b""  # told why, then dropped
        idle.close()
        long_id.close()
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait(10)
        connections.close()
        server.close()
    for p, (out, err) in zip(real, results, strict=True):
        assert p.returncode == 0, err
        assert json.loads(out)["elapsed_s"] < TIMEOUT_S
    assert over.returncode == 1 and over_out[1].count("\n") == 1 and "free" in over_out[1], over_out
    oks = [o for _, o in outcomes.items if not isinstance(o, Exception)]
    errors = [(t, o) for t, o in outcomes.items if isinstance(o, Exception)]
    assert len(oks) == REAL and len(errors) == GARBAGE + 4, [str(e) for _, e in errors]
    assert all(len(str(e).splitlines()) == 1 for _, e in errors)
    texts = [str(e) for _, e in errors]
    assert sum("no kvbridge handshake within 2 s" in t for t in texts) >= 1, texts  # the idle connection
    assert sum("260 bytes" in t for t in texts) == 1, texts
    assert sum("it needs" in t and "free" in t for t in texts) == 1, texts  # over capacity, refused at plan time
    dead = [t for t, e in errors if "closed its control connection" in str(e)  # gloo's watchdog
            or "Connection closed by peer" in str(e)  # gloo's own reason, when the kill lands in a collective
            or ("closed the connection before group" in str(e))]  # NIXL: the control channel's EOF
    assert len(dead) == 1 and dead[0] - killed_at < 10.0, (dead, killed_at, texts)
    assert dst.num_free() == free0  # nothing claimed


def test_cli_serve_survives_a_long_dump_name_and_an_idle_connection(tmp_path):
    if not nixl_available():
        pytest.skip("needs the nixl extra: pip install 'kvbridge[nixl]'")
    from test_migration_nixl import _make_dump, _start_serve

    src, out = tmp_path / "in.safetensors", tmp_path / "out"
    out.mkdir()
    _make_dump(src)
    serve, port = _start_serve("--to", "flashmla-model1", "--page-size", "64", "--out", str(out),
                               "--handshake-timeout", "2", "--max-requests", "3", "--json")
    try:
        idle = socket.create_connection(("127.0.0.1", port))
        peer = f"127.0.0.1:{port}"
        long_name = subprocess.run(_cli("migrate", "send", str(src), "--peer", peer, "--name", "n" * 260),
                                   cwd=REPO, env=_env(), capture_output=True, text=True, timeout=TIMEOUT_S + START_S)
        good = subprocess.run(_cli("migrate", "send", str(src), "--peer", peer, "--name", "good.safetensors"),
                              cwd=REPO, env=_env(), capture_output=True, text=True, timeout=TIMEOUT_S + START_S)
        stdout, stderr = serve.communicate(timeout=TIMEOUT_S)
        idle.close()
    finally:
        if serve.poll() is None:
            serve.kill()
            serve.wait(5)
    assert long_name.returncode == 1 and long_name.stderr.count("\n") == 1, long_name.stderr
    assert "260 bytes" in long_name.stderr
    assert good.returncode == 0, good.stderr
    assert (out / "good.safetensors").is_file() and sorted(p.name for p in out.iterdir()) == ["good.safetensors"]
    lines = [json.loads(line) for line in stdout.splitlines()]
    assert sorted(d.get("kind") for d in lines) == ["dump", "error", "error"], lines
    assert serve.returncode == 1
    assert all(len(line) <= 80 or "Error" in line for line in stderr.splitlines()[1:]), stderr
    assert not any(w in stderr for w in ("UCX", "[W", "Warning:")), stderr  # native log lines stay out


def test_serve_and_send_human_output_fits_80_columns():
    """One request over gloo in human mode (no --json) at ``COLUMNS=80``: every line the server and the sender
    print (the listening line, the key/value result lines) fits 80 columns and names the request's numbers."""
    env = {**_env(), "COLUMNS": "80"}
    serve = subprocess.Popen(_cli("migrate", "serve", "--listen", "127.0.0.1:0", "--transport", "gloo", "--engine", DST,
                                  "--layers", str(MODEL.num_layers), "--max-tokens", str(TOKENS),
                                  "--max-requests", "1"), cwd=REPO, env=env, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True)
    try:
        first = serve.stderr.readline() if serve.stderr else ""
        port = first.rsplit(":", 1)[-1].split()[0] if "listening on" in first else None
        assert port, first
        send = subprocess.run(_cli("migrate", "send", "--peer", f"127.0.0.1:{port}", "--transport", "gloo", "--from",
                                   SRC, "--to", DST, "--layers", str(MODEL.num_layers), "--tokens", str(TOKENS),
                                   "--timeout", str(TIMEOUT_S)), cwd=REPO, env=env, capture_output=True, text=True,
                              timeout=TIMEOUT_S + START_S)
        out, err = serve.communicate(timeout=TIMEOUT_S)
    finally:
        if serve.poll() is None:
            serve.kill()
            serve.wait(5)
    assert send.returncode == 0 and serve.returncode == 0, (send.stderr, err)
    lines = [first.rstrip("\n"), *out.splitlines(), *err.splitlines(), *send.stdout.splitlines(),
             *send.stderr.splitlines()]
    assert all(len(line) <= 80 for line in lines), [line for line in lines if len(line) > 80]
    assert f"{TOKENS:,} tokens" in send.stdout, send.stdout
    assert len(out.splitlines()) >= 2, out  # the received request as key/value lines
