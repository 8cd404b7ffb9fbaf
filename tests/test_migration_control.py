"""The migration control channel on loopback: handshake, framing limits, timeouts, addresses."""

from __future__ import annotations

import socket
import struct
import threading
import time

import pytest
import torch

from kvbridge.migration import MigrationError, TransferError
from kvbridge.migration.control import MAGIC, MAX_JSON_BYTES, PROTOCOL_VERSION, Channel, Listener, parse_address


def _serve_one(listener: Listener, timeout: float, action) -> dict:
    """Accept one connection in a thread and run ``action(channel, deadline)``; returns what happened."""
    result: dict = {}

    def run() -> None:
        chan = listener.accept(10)
        assert chan is not None
        try:
            result["value"] = action(chan, time.monotonic() + timeout)
        except Exception as exc:
            result["error"] = exc
        finally:
            chan.close()

    thread = threading.Thread(target=run)
    thread.start()
    result["thread"] = thread
    return result


def _client(port: int) -> socket.socket:
    return socket.create_connection(("127.0.0.1", port), timeout=10)


@pytest.fixture
def listener():
    lis = Listener("127.0.0.1", 0)
    yield lis
    lis.close()


def test_handshake_and_messages_round_trip(listener):
    def server(chan: Channel, deadline: float):
        chan.accept_handshake(deadline)
        message, blob = chan.expect("hello", deadline, "the hello")
        chan.send({"type": "accept", "echo": message["x"]}, blob[::-1], deadline=deadline)
        return message, blob

    res = _serve_one(listener, 10, server)
    chan = Channel.connect("127.0.0.1", listener.port, time.monotonic() + 10)
    chan.send({"type": "hello", "x": [1, 2]}, b"abc", deadline=time.monotonic() + 10)
    reply, blob = chan.expect("accept", time.monotonic() + 10, "the accept")
    chan.close()
    res["thread"].join(10)
    assert res["value"] == ({"type": "hello", "x": [1, 2]}, b"abc")
    assert reply == {"type": "accept", "echo": [1, 2]} and blob == b"cba"


def test_other_protocol_version_is_refused(listener):
    res = _serve_one(listener, 10, lambda chan, deadline: chan.accept_handshake(deadline))
    with _client(listener.port) as s:
        s.sendall(MAGIC + struct.pack(">H", PROTOCOL_VERSION + 1))
        res["thread"].join(10)
    assert isinstance(res["error"], MigrationError)
    assert f"protocol {PROTOCOL_VERSION + 1}" in str(res["error"])


def test_foreign_bytes_are_refused_at_once_not_at_the_timeout(listener):
    res = _serve_one(listener, 30, lambda chan, deadline: chan.accept_handshake(deadline))
    with _client(listener.port) as s:
        t0 = time.monotonic()
        s.sendall(b"SSH")  # then waits, as an SSH client would for a banner
        res["thread"].join(10)
        elapsed = time.monotonic() - t0
    assert isinstance(res["error"], MigrationError)
    assert str(res["error"]).endswith("not a kvbridge migration peer (it sent b'S')")
    assert elapsed < 10


def test_a_peer_that_stalls_mid_handshake_times_out(listener):
    res = _serve_one(listener, 1.0, lambda chan, deadline: chan.accept_handshake(deadline))
    with _client(listener.port) as s:
        s.sendall(MAGIC[:5])
        res["thread"].join(10)
    assert isinstance(res["error"], TransferError)
    assert str(res["error"]).startswith("timed out waiting for the kvbridge handshake from 127.0.0.1:")


def test_oversized_or_untyped_messages_are_refused(listener):
    def server(chan: Channel, deadline: float):
        errors = []
        for _ in range(2):
            try:
                chan.recv(deadline, "a message")
            except MigrationError as exc:
                errors.append(str(exc))
        return errors

    res = _serve_one(listener, 10, server)
    with _client(listener.port) as s:
        s.sendall(struct.pack(">II", MAX_JSON_BYTES + 1, 0))
        body = b"[1, 2]"
        s.sendall(struct.pack(">II", len(body), 0) + body)
        res["thread"].join(10)
    first, second = res["value"]
    assert "control message" in first and "refused" in first
    assert "without a type" in second


def test_closed_connection_is_a_transfer_error(listener):
    res = _serve_one(listener, 10, lambda chan, deadline: chan.recv(deadline, "group 2/5's checksums"))
    s = _client(listener.port)
    s.close()
    res["thread"].join(10)
    assert isinstance(res["error"], TransferError)
    assert "closed the connection before group 2/5's checksums" in str(res["error"])


def test_connect_to_nothing_names_the_address():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # bound, not listening: refused
        with pytest.raises(TransferError, match=f"cannot connect to 127.0.0.1:{port}"):
            Channel.connect("127.0.0.1", port, time.monotonic() + 5)


@pytest.mark.parametrize(("text", "listen", "want"), [
    ("10.0.0.5:7654", False, ("10.0.0.5", 7654)),
    ("decode-host", False, ("decode-host", 7600)),
    ("[::1]:9000", False, ("::1", 9000)),
    (":0", True, ("127.0.0.1", 0)),
])
def test_parse_address(text, listen, want):
    assert parse_address(text, default_port=7600, listen=listen) == want


@pytest.mark.parametrize("text", ["host:0", "host:65536", "host:http", "host:"])
def test_parse_address_refuses_bad_ports(text):
    with pytest.raises(ValueError, match="expected HOST:PORT"):
        parse_address(text)


def test_nixl_receiver_refuses_pools_it_cannot_register():
    from kvbridge.engines.topology import FLASH, Role
    from kvbridge.errors import InputError
    from kvbridge.migration import EnginePools, plan_migration
    from kvbridge.migration.nixl import NixlReceiver

    model = FLASH.with_layers(4)
    cap = plan_migration("vllm", "vllm", model, 1100).held_pages("dst")
    pools = EnginePools.create("vllm", model, cap)
    swa = pools.pools[(0, Role.SWA)]
    strided = torch.zeros(swa.shape[0], swa.shape[1] * 2, dtype=torch.uint8)[:, ::2]
    pools.pools[(0, Role.SWA)] = strided
    with pytest.raises(InputError, match="pool of layer 0 swa must be contiguous CPU tensors"):
        NixlReceiver(pools, plan=plan_migration("trtllm", "vllm", model, 1100))
