"""The control channel of a network migration: one TCP connection per request, kvbridge's own.

The connecting side (the sender) first writes ``MAGIC`` (16 bytes) and the protocol version
(uint16, big-endian); then both sides exchange messages, each an 8-byte header (uint32
big-endian JSON length, uint32 blob length), a UTF-8 JSON object with a ``type`` key, and an
optional binary blob (e.g. a NIXL agent's metadata). A peer whose first bytes are not the
magic is refused with one line naming what it sent; every read waits at most until the
caller's deadline, and a closed or reset connection is a ``TransferError``.
"""

from __future__ import annotations

import json
import select
import socket
import struct
import time

from kvbridge.migration.execute import MigrationError, TransferError

MAGIC = b"KVBRIDGE-MIGRATE"
#: 2: page-chunk checksums are XXH3-64 (1: CRC-32).
PROTOCOL_VERSION = 2
#: What each earlier protocol version was, for the line that refuses it.
OLD_VERSIONS = {1: "CRC-32 page-chunk checksums"}
#: JSON bodies larger than this are refused (a 128K request's largest message is about 1 MB).
MAX_JSON_BYTES = 64 << 20
MAX_BLOB_BYTES = 64 << 20


class Channel:
    """A framed JSON (+ blob) connection to one peer; ``peer`` is ``host:port`` for messages."""

    def __init__(self, sock: socket.socket, peer: str):
        self.sock, self.peer = sock, peer
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    @classmethod
    def connect(cls, host: str, port: int, deadline: float) -> Channel:
        """Connect to a serving peer and announce kvbridge's magic and protocol version."""
        peer = f"{host}:{port}"
        try:
            sock = socket.create_connection((host, port), timeout=max(0.01, deadline - time.monotonic()))
        except OSError as exc:
            raise TransferError(f"cannot connect to {peer} ({exc.strerror or exc}); is `kvbridge migrate serve` "
                                "running there?") from None
        chan = cls(sock, peer)
        chan._sendall(MAGIC + struct.pack(">H", PROTOCOL_VERSION), deadline)
        return chan

    def accept_handshake(self, deadline: float) -> None:
        """Server side: read the magic and version; refuse anything else with ``MigrationError``.

        Refuses as soon as the first bytes differ from the magic (a peer that sends a few
        foreign bytes and waits is not kept until the deadline)."""
        want = len(MAGIC) + 2
        got = bytearray()
        while len(got) < want:
            part = self._recv_exact(1, deadline, "the kvbridge handshake", eof_ok=bool(got))
            if not part:
                break
            got += part
            if not MAGIC.startswith(bytes(got[: len(MAGIC)])):
                break
        if bytes(got[: len(MAGIC)]) != MAGIC or len(got) < want:
            raise MigrationError(f"refused {self.peer}: not a kvbridge migration peer (it sent {bytes(got)!r})")
        (version,) = struct.unpack(">H", bytes(got[len(MAGIC) :]))
        if version in OLD_VERSIONS:
            raise MigrationError(f"refused {self.peer}: it speaks kvbridge migration protocol {version} "
                                 f"({OLD_VERSIONS[version]}), this side {PROTOCOL_VERSION} (XXH3-64 checksums): "
                                 "install the same kvbridge version on both sides")
        if version != PROTOCOL_VERSION:
            raise MigrationError(f"refused {self.peer}: kvbridge migration protocol {version}, this side speaks "
                                 f"{PROTOCOL_VERSION}")

    def send(self, message: dict, blob: bytes = b"", *, deadline: float) -> None:
        body = json.dumps(message).encode()
        self._sendall(struct.pack(">II", len(body), len(blob)) + body + blob, deadline)

    def recv(self, deadline: float, what: str) -> tuple[dict, bytes]:
        """The next message (JSON object, blob); ``what`` names it in errors."""
        n_json, n_blob = struct.unpack(">II", self._recv_exact(8, deadline, what))
        if n_json > MAX_JSON_BYTES or n_blob > MAX_BLOB_BYTES:
            raise MigrationError(f"{self.peer} sent a {n_json + n_blob} B control message for {what}; refused")
        body = self._recv_exact(n_json, deadline, what)
        blob = self._recv_exact(n_blob, deadline, what) if n_blob else b""
        try:
            message = json.loads(body)
        except ValueError:
            raise MigrationError(f"{self.peer} sent a control message that is not JSON for {what}") from None
        if not isinstance(message, dict) or not isinstance(message.get("type"), str):
            raise MigrationError(f"{self.peer} sent a control message without a type for {what}")
        return message, blob

    def expect(self, kind: str, deadline: float, what: str) -> tuple[dict, bytes]:
        """``recv`` a message of type ``kind``; a ``refuse``/``error`` message raises its text."""
        message, blob = self.recv(deadline, what)
        if message["type"] in ("refuse", "error"):
            raise MigrationError(str(message.get("error", "the peer gave no reason")))
        if message["type"] != kind:
            raise MigrationError(f"{self.peer} sent {message['type']!r} where {what} ({kind!r}) was due")
        return message, blob

    def readable(self, timeout: float) -> bool:
        """Whether a message (or the peer's close) is waiting, after at most ``timeout`` seconds."""
        try:
            ready, _, _ = select.select([self.sock], [], [], max(0.0, timeout))
        except (OSError, ValueError):
            return True  # the next read reports what broke
        return bool(ready)

    def close(self) -> None:
        try:
            self.sock.close()
        except OSError:
            pass

    def _sendall(self, data: bytes, deadline: float) -> None:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise TransferError(f"timed out talking to {self.peer}; nothing was published")
        self.sock.settimeout(remaining)
        try:
            self.sock.sendall(data)
        except TimeoutError:
            raise TransferError(f"timed out sending to {self.peer}; nothing was published") from None
        except OSError as exc:
            raise TransferError(f"the connection to {self.peer} broke ({exc.strerror or exc}); the peer died or "
                                "the link broke; nothing was published") from None

    def _recv_exact(self, n: int, deadline: float, what: str, eof_ok: bool = False) -> bytes:
        buf = bytearray()
        while len(buf) < n:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TransferError(f"timed out waiting for {what} from {self.peer}; nothing was published")
            self.sock.settimeout(remaining)
            try:
                part = self.sock.recv(min(n - len(buf), 1 << 20))
            except TimeoutError:
                continue
            except OSError as exc:
                raise TransferError(f"the connection to {self.peer} broke while waiting for {what} "
                                    f"({exc.strerror or exc}); the peer died or the link broke; "
                                    "nothing was published") from None
            if not part:
                if eof_ok:
                    return bytes(buf)
                raise TransferError(f"{self.peer} closed the connection before {what}; the peer died or gave up; "
                                    "nothing was published")
            buf += part
        return bytes(buf)


class Listener:
    """A listening TCP socket; ``accept`` hands out one ``Channel`` per connecting peer."""

    def __init__(self, host: str = "127.0.0.1", port: int = 0):
        self.sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            self.sock.bind((host, port))
        except OSError as exc:
            self.sock.close()
            raise TransferError(f"cannot listen on {host}:{port} ({exc.strerror or exc})") from None
        self.sock.listen(8)
        self.host, self.port = host, self.sock.getsockname()[1]

    def accept(self, timeout: float | None = None) -> Channel | None:
        """The next connection, or None when ``timeout`` seconds pass without one."""
        self.sock.settimeout(timeout)
        try:
            sock, addr = self.sock.accept()
        except TimeoutError:
            return None
        return Channel(sock, f"{addr[0]}:{addr[1]}")

    def close(self) -> None:
        self.sock.close()


def parse_address(text: str, default_port: int | None = None, *, listen: bool = False) -> tuple[str, int]:
    """``host:port`` (or ``[v6]:port``) -> (host, port); ``ValueError`` with a readable message.

    ``listen`` allows port 0 (any free port)."""
    host, sep, port = text.rpartition(":")
    if not sep:
        if default_port is None:
            raise ValueError(f"expected HOST:PORT, got {text!r}")
        host, port = text, str(default_port)
    host = host.strip("[]") or "127.0.0.1"
    low = 0 if listen else 1
    if not port.isdigit() or not low <= int(port) < 65536:
        raise ValueError(f"expected HOST:PORT with a port in {low}..65535, got {text!r}")
    return host, int(port)
