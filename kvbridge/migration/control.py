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
import queue
import select
import socket
import struct
import threading
import time
from collections.abc import Callable
from typing import Any

from kvbridge.errors import InputError, KVBridgeError
from kvbridge.migration.errors import MigrationError, TransferError

MAGIC = b"KVBRIDGE-MIGRATE"
#: 2: page-chunk checksums are XXH3-64 (1: CRC-32).
PROTOCOL_VERSION = 2
#: What each earlier protocol version was, for the line that refuses it.
OLD_VERSIONS = {1: "CRC-32 page-chunk checksums"}
#: JSON bodies larger than this are refused (a 128K request's largest message is about 1 MB).
MAX_JSON_BYTES = 64 << 20
MAX_BLOB_BYTES = 64 << 20
#: Longest name a sender may give (a request id, a dump's file name), in UTF-8 bytes (a file name's limit).
MAX_NAME_BYTES = 255
#: Seconds a connecting peer has to complete the handshake (magic, version, hello) before it is dropped.
DEFAULT_HANDSHAKE_S = 5.0
#: Connections a ``ConnectionServer`` serves at once; one more is refused with a one-line "busy" error.
DEFAULT_MAX_CONNECTIONS = 32


def check_name(value: object, what: str) -> str:
    """A name a peer supplies, checked before any use: a string of 1 to ``MAX_NAME_BYTES`` UTF-8 bytes,
    printable characters, no path component (no ``/``, ``\\``, NUL, no leading dot)."""
    if not isinstance(value, str) or not value:
        raise MigrationError(f"{what} must be a non-empty string, got {repr(value)[:40]}")
    size = len(value.encode("utf-8", "surrogatepass"))
    if size > MAX_NAME_BYTES:
        raise MigrationError(f"{what} is {size} bytes long, at most {MAX_NAME_BYTES} are allowed")
    if not value.isprintable() or any(c in value for c in "/\\") or value.startswith("."):
        raise MigrationError(f"{what} {value[:40]!r} is not a plain name (printable characters, no path separator, "
                             "no leading dot)")
    return value


def tp_position(value: object, what: str = "tp") -> tuple[int, int]:
    """A tensor-parallel ``(rank, size)`` (``(0, 1)``: not tensor parallel) checked: ``0 <= rank < size``."""
    ok = isinstance(value, (tuple, list)) and len(value) == 2 and \
        all(isinstance(v, int) and not isinstance(v, bool) for v in value) and 0 <= value[0] < value[1]
    if not ok:
        raise InputError(f"{what} must be a tensor-parallel (rank, size) with 0 <= rank < size, got {value!r:.40}")
    return int(value[0]), int(value[1])


def check_tp(hello: dict, mine: tuple[int, int], refuse: Callable[[str], KVBridgeError]) -> None:
    """Refuse a sender whose tensor-parallel position (hello ``tp``, ``[0, 1]`` when absent) is not this
    receiver's ``mine``: DeepSeek-V4's caches are replicated per TP rank, so rank r of a producer sends to rank r
    of a consumer of the same TP size (docs/adapters.md)."""
    try:
        theirs = tp_position(hello.get("tp", [0, 1]), "the sender's tp")
    except InputError as exc:
        raise refuse(str(exc)) from None
    if theirs != mine:
        raise refuse(f"the sender is rank {theirs[0]} of tensor parallel size {theirs[1]}, this receiver rank "
                     f"{mine[0]} of {mine[1]}; serve producer and consumer with the same -tp (rank r sends to "
                     "rank r)")


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

    def peer_gone(self) -> bool:
        """Whether the peer closed or reset the connection (checked without blocking or consuming data)."""
        try:
            ready, _, _ = select.select([self.sock], [], [], 0.0)
            return bool(ready) and not self.sock.recv(1, socket.MSG_PEEK)  # readable: EOF, or a message waits
        except (OSError, ValueError):
            return True

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
        self.sock.listen(128)
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


def handshake(chan: Channel, deadline: float, handshake_s: float) -> tuple[dict, bytes]:
    """Server side: the magic, the version and the sender's ``hello`` (JSON, blob), all within
    ``handshake_s`` seconds (and before ``deadline``); a peer that is slower is dropped."""
    bound = min(deadline, time.monotonic() + handshake_s)
    try:
        chan.accept_handshake(bound)
        return chan.expect("hello", bound, "the sender's hello")
    except TransferError:
        if time.monotonic() < bound:
            raise
        raise TransferError(f"dropped {chan.peer}: no kvbridge handshake within {handshake_s:g} s") from None


#: Serves one connection after its handshake: (channel, hello, hello blob, deadline) -> a result.
Handler = Callable[[Channel, dict, bytes, float], Any]


class ConnectionServer:
    """Serves a ``Listener``'s connections, each on its own thread, up to ``max_connections`` at once.

    Every connection gets ``timeout`` seconds from accept to verdict and ``handshake_s`` of them
    for the handshake; a connection beyond the limit is refused at once with a one-line "busy"
    error. ``next`` hands out each connection's outcome in completion order: the handler's
    result, or raises its one-line ``KVBridgeError`` (any other exception is turned into a
    ``MigrationError``); the server goes on serving either way. ``close`` stops accepting.
    """

    def __init__(self, listener: Listener, handle: Handler, *, timeout: float,
                 handshake_s: float = DEFAULT_HANDSHAKE_S, max_connections: int = DEFAULT_MAX_CONNECTIONS):
        for name, v in (("timeout", timeout), ("handshake_s", handshake_s)):
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not v > 0:
                raise MigrationError(f"{name} must be a positive number of seconds, got {v!r}")
        if isinstance(max_connections, bool) or not isinstance(max_connections, int) or max_connections < 1:
            raise MigrationError(f"max_connections must be a positive integer, got {max_connections!r}")
        self.listener, self.handle = listener, handle
        self.timeout, self.handshake_s, self.max_connections = float(timeout), float(handshake_s), max_connections
        self.outcomes: queue.Queue = queue.Queue()
        self.active = 0
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._accept_loop, name="kvbridge-accept", daemon=True)
        self._thread.start()

    def _accept_loop(self) -> None:
        while not self._stop.is_set():
            try:
                chan = self.listener.accept(0.1)
            except OSError:
                if self._stop.is_set():
                    return
                continue
            if chan is None:
                continue
            with self._lock:
                busy = self.active >= self.max_connections
                self.active += 0 if busy else 1
            if busy:
                send_error(chan, f"receiver busy: {self.max_connections} connections in progress; retry later")
                chan.close()
                self.outcomes.put(TransferError(f"refused {chan.peer}: {self.max_connections} connections in "
                                                "progress (the limit)"))
                continue
            threading.Thread(target=self._serve, args=(chan,), name=f"kvbridge-conn-{chan.peer}", daemon=True).start()

    def _serve(self, chan: Channel) -> None:
        deadline = time.monotonic() + self.timeout
        outcome: Any
        try:
            hello, blob = handshake(chan, deadline, self.handshake_s)
            outcome = self.handle(chan, hello, blob, deadline)
        except KVBridgeError as exc:
            send_error(chan, first_line(exc))
            outcome = exc
        except Exception as exc:  # one request's bug or OS error must not stop the server
            outcome = MigrationError(f"request from {chan.peer} failed in the receiver ({type(exc).__name__}: "
                                     f"{first_line(exc)}); nothing was published")
            send_error(chan, first_line(outcome))
        finally:
            chan.close()
            with self._lock:
                self.active -= 1
        self.outcomes.put(outcome)

    def next(self, wait: float | None = None) -> Any:
        """The next connection's result (raises its error), or None after ``wait`` seconds without one."""
        try:
            outcome = self.outcomes.get(timeout=wait)
        except queue.Empty:
            return None
        if isinstance(outcome, BaseException):
            raise outcome
        return outcome

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        self.listener.close()


def first_line(exc: BaseException) -> str:
    """The first line of an error's text (its type's name when it has none)."""
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def send_error(chan: Channel, text: str) -> None:
    """Tell the peer (if it still listens, for at most 1 s) why its request failed."""
    try:
        chan.send({"type": "error", "error": text}, deadline=time.monotonic() + 1.0)
    except KVBridgeError:
        pass


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


def check_room(plan: Any, dst: Any, refuse: Callable[[str], KVBridgeError]) -> None:
    """Refuse a request whose destination pages do not fit ``dst``'s free pages now, before anything moves.

    ``plan``: a ``MigrationPlan``; ``dst``: its ``EnginePools``; ``refuse`` builds the error from a reason."""
    lengths, released = plan.table_lengths("dst"), plan.released("dst")
    free = dst.num_free()
    for name, n in lengths.items():
        need = n - min(released.get(name, 0), n)
        if need > free.get(name, 0):
            raise refuse(f"it needs {need} pages of block table {name!r}, this receiver has {free.get(name, 0)} free "
                         "(serve with a larger --max-tokens)")
