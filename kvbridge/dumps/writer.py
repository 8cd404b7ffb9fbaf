"""Writing kvbridge dump files: the streamed, atomic ``DumpWriter`` and ``write_dump``.

Entries stream in order into kvbridge's own temp file ``.{name}.kvbridge-partial`` next to the
output (locked, space reserved first); ``commit`` rewrites the header with the checksums, fsyncs
and renames it in place: nothing half-written looks valid. The bytes are a function of the
content only (header keys in a fixed order). The format itself is ``kvbridge.dumps.dumpfile``.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import signal
import stat
import struct
import threading
import zlib
from collections import deque
from collections.abc import Iterable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from kvbridge._version import __version__
from kvbridge.dumps.dumpfile import (
    _DTYPE_BYTES,
    _DTYPE_NAMES,
    _META_KEYS,
    CHECKSUM,
    FORMAT_NAME,
    FORMAT_VERSION,
    HEADER_CHECKSUM,
    HEADER_CRC_OFFSET,
    HEADER_PREFIX,
    RESERVED_KEYS,
    Dump,
    DumpEntry,
    _file_kind,
    header_crc32,
    tokens_per_chunk,
)
from kvbridge.errors import DumpWriteError, InputError

#: Suffix of the temp file a dump is written into (``.{name}.kvbridge-partial``).
PARTIAL_SUFFIX = ".kvbridge-partial"


def _new_file_mode() -> int:
    """Permission bits a newly created file gets under the process umask (0o666 & ~umask)."""
    umask = os.umask(0o022)
    os.umask(umask)
    return 0o666 & ~umask


#: Signals held while a temp file is created: Ctrl-C, and what ``timeout``, docker or systemd (SIGTERM)
#: and a closed terminal (SIGHUP) send; the CLI turns the latter two into a clean exit like Ctrl-C.
HELD_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


@contextmanager
def _interrupts_held() -> Iterator[None]:
    """Hold Ctrl-C (SIGINT), SIGTERM and SIGHUP until the block ends, then deliver it: an interrupt arriving between the
    creation of a temp file and the recording of its descriptor would otherwise leave the file behind.
    Main thread only (signal handlers live there); elsewhere the block runs unchanged."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {sig: signal.getsignal(sig) for sig in HELD_SIGNALS}
    held: list[int] = []
    for sig, handler in previous.items():
        if handler is not None:
            signal.signal(sig, lambda signum, frame: held.append(signum))
    try:
        yield
    finally:
        for sig, handler in previous.items():
            if handler is not None:
                signal.signal(sig, handler)
    for sig in dict.fromkeys(held):
        signal.raise_signal(sig)  # now handled as the caller asked (KeyboardInterrupt for SIGINT by default)


def partial_path(path: str | os.PathLike) -> Path:
    """The temp file a dump at ``path`` is written into: ``.{name}.kvbridge-partial`` beside it."""
    path = Path(path)
    return path.parent / f".{path.name}{PARTIAL_SUFFIX}"


@dataclass(frozen=True)
class EntrySpec:
    """What an entry will hold before its bytes exist: header dict, safetensors dtype, shape."""

    meta: dict
    dtype: str
    shape: tuple[int, int]

    @property
    def nbytes(self) -> int:
        return self.shape[0] * self.shape[1] * _DTYPE_BYTES[self.dtype]


def _check_header_input(specs: Sequence[EntrySpec], attrs: dict) -> None:
    """``InputError`` unless ``attrs`` maps str to str without reserved keys and entry names are unique."""
    reserved = set(RESERVED_KEYS) & set(attrs)
    if reserved or not all(isinstance(k, str) and isinstance(v, str) for k, v in attrs.items()):
        raise InputError(f"attrs must map str to str and not use {', '.join(sorted(reserved)) or 'reserved keys'}")
    names = [s.meta["name"] for s in specs]
    dup = next((n for n in names if names.count(n) > 1), None)
    if dup is not None:
        raise InputError(f"dump entries: {dup!r} appears twice")


def _header_bytes(specs: Sequence[EntrySpec], attrs: dict[str, str], crcs: Sequence[int]) -> bytes:
    """The version-3 safetensors header (length prefix included, padded with spaces to 8 bytes):
    ``__metadata__`` first, its ``header_crc32`` first (file bytes 41..49), then its other keys sorted."""
    metas = [{**{k: s.meta.get(k) for k in _META_KEYS}, CHECKSUM: f"{c:08x}"} for s, c in zip(specs, crcs, strict=True)]
    metadata = {"created_by": f"kvbridge {__version__}", **attrs}
    metadata.update(format=FORMAT_NAME, version=str(FORMAT_VERSION), entries=json.dumps(metas, separators=(",", ":")))
    header: dict[str, Any] = {"__metadata__": {HEADER_CHECKSUM: "0" * 8, **dict(sorted(metadata.items()))}}
    at = 0
    for s in specs:
        header[s.meta["name"]] = {"dtype": s.dtype, "shape": list(s.shape), "data_offsets": [at, at + s.nbytes]}
        at += s.nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    head = bytearray(struct.pack("<Q", len(raw)) + raw)
    assert head[8:HEADER_CRC_OFFSET] == HEADER_PREFIX
    head[HEADER_CRC_OFFSET : HEADER_CRC_OFFSET + 8] = b"%08x" % header_crc32(bytes(head))
    return bytes(head)


class DumpWriter:
    """Streams a dump into its temp file and commits it atomically.

    ``DumpWriter(path, overwrite=..., reserve=bytes)`` checks the output at once, before any
    conversion work: ``path`` is not a directory, it does not exist (unless ``overwrite``), the
    directory exists and is writable, no other kvbridge process is writing it (the temp file is
    created and locked; a stale one left by a killed process is taken over) and ``reserve``
    bytes fit on the disk (they are allocated). Then ``begin(specs, attrs)``, ``write(rows)``
    for each entry's rows in order, ``commit()``; any failure, or leaving the ``with`` block
    with an exception (Ctrl-C included), removes the temp file.
    """

    def __init__(self, path: str | os.PathLike, *, overwrite: bool = False, reserve: int = 0):
        if not isinstance(path, (str, os.PathLike)):
            raise InputError(f"path must be a str or os.PathLike, got {type(path).__name__}")
        self.path = Path(path)
        self.overwrite = bool(overwrite)
        self.tmp = partial_path(self.path)
        self._fd = -1
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="kvbridge-write")
        self._pending: deque[Future] = deque()
        if self.path.is_dir():
            raise InputError(f"output {self.path} is a directory")
        self._check_exists()
        parent = self.path.parent
        if not parent.is_dir():
            raise InputError(f"output directory {parent} does not exist")
        try:
            with _interrupts_held():
                self._open_temp()
            self._reserve(reserve)
        except BaseException:
            self.abort()
            raise
        self._specs: list[EntrySpec] = []
        self._crcs: list[int] = []
        self._entry = -1
        self._left = 0

    def _check_exists(self) -> None:
        try:
            mode = os.lstat(self.path).st_mode
        except FileNotFoundError:
            return
        except OSError as exc:
            raise self._io_error(exc, "check") from None
        if not stat.S_ISREG(mode):
            raise InputError(f"output {self.path} is {_file_kind(mode)}; only a regular file is ever replaced "
                             "(choose another output path)")
        if not self.overwrite:
            raise InputError(f"output {self.path} exists; pass overwrite=True (CLI: --force) to replace it")

    def _io_error(self, exc: OSError, doing: str = "write") -> DumpWriteError:
        return DumpWriteError(f"could not {doing} {self.path}: {exc.strerror or exc}")

    def _open_temp(self) -> None:
        for _ in range(8):
            try:
                fd = os.open(self.tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
            except FileExistsError:
                try:
                    fd = os.open(self.tmp, os.O_RDWR | os.O_CLOEXEC)
                except FileNotFoundError:
                    continue  # the other writer just finished: try again
                except OSError as exc:
                    raise self._io_error(exc, "create a temp file for") from None
            except OSError as exc:
                raise self._io_error(exc, "create a temp file for") from None
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                raise DumpWriteError(
                    f"another kvbridge process is writing {self.path} (its temp file {self.tmp.name} is locked)"
                ) from None
            try:
                same = os.fstat(fd).st_ino == os.stat(self.tmp).st_ino
            except FileNotFoundError:
                same = False
            if not same:  # locked a temp file that its writer had just committed: start over
                os.close(fd)
                continue
            self._fd = fd
            os.ftruncate(fd, 0)  # a stale temp file of a killed process: taken over
            self._check_exists()  # re-checked under the lock: exactly one of two racing writers wins
            return
        raise DumpWriteError(f"could not create a temp file for {self.path}: it keeps changing")

    def _reserve(self, nbytes: int) -> None:
        try:
            vfs = os.statvfs(self.tmp.parent)
        except OSError:
            return
        free = vfs.f_bavail * vfs.f_frsize
        if nbytes > free:
            raise DumpWriteError(
                f"not enough space for {self.path}: it needs {nbytes} bytes, {free} are free in {self.tmp.parent}"
            )
        if nbytes:
            try:
                os.posix_fallocate(self._fd, 0, nbytes)
            except OSError as exc:
                if exc.errno == errno.ENOSPC:
                    raise self._io_error(exc) from None
                # filesystems without fallocate: the free-space check above stands

    def begin(self, specs: Sequence[EntrySpec], attrs: dict[str, str] | None = None) -> None:
        """Write the header for ``specs`` (checksums filled in by ``commit``)."""
        attrs = dict(attrs or {})
        _check_header_input(specs, attrs)
        self._specs, self._attrs = list(specs), attrs
        self._crcs = [0] * len(specs)
        self._write(_header_bytes(self._specs, attrs, self._crcs))
        self._next_entry()

    def _next_entry(self) -> None:
        self._entry += 1
        while self._entry < len(self._specs) and self._specs[self._entry].nbytes == 0:
            self._entry += 1
        self._left = self._specs[self._entry].nbytes if self._entry < len(self._specs) else 0

    def _write(self, data) -> None:
        view = memoryview(data).cast("B")
        try:
            while view:
                view = view[os.write(self._fd, view) :]
        except OSError as exc:
            raise self._io_error(exc) from None

    def write(self, rows: torch.Tensor) -> int:
        """Append ``rows`` (the next bytes of the current entry, in order); returns bytes written."""
        t = rows.detach().to("cpu").contiguous().view(torch.uint8).reshape(-1)
        n = t.numel()
        if n == 0:
            return 0
        if n > self._left:
            raise InputError(f"dump writer: {n} bytes given, the current entry has {self._left} left")
        while len(self._pending) >= 2:  # at most two chunks in flight
            self._pending.popleft().result()
        entry = self._entry

        def job() -> None:  # the closure keeps ``t`` alive until written
            arr = t.numpy()
            self._crcs[entry] = zlib.crc32(arr, self._crcs[entry])
            self._write(arr)

        self._pending.append(self._pool.submit(job))
        self._left -= n
        if self._left == 0:
            self._next_entry()
        return n

    def _drain(self) -> None:
        """Wait for the chunks in flight (their write errors are raised here)."""
        while self._pending:
            self._pending.popleft().result()

    def commit(self) -> Path:
        """Fill in the checksums, fsync and move the temp file to ``path``; returns ``path``."""
        if self._entry < len(self._specs):
            raise InputError(f"dump writer: entry {self._specs[self._entry].meta['name']} is incomplete")
        try:
            self._drain()
            size = os.lseek(self._fd, 0, os.SEEK_CUR)
            os.ftruncate(self._fd, size)  # drop what the reservation allocated beyond the data
            os.lseek(self._fd, 0, os.SEEK_SET)
            self._write(_header_bytes(self._specs, self._attrs, self._crcs))
            os.fchmod(self._fd, _new_file_mode())  # the dump gets the usual umask mode
            os.fsync(self._fd)
            if self.overwrite:
                os.replace(self.tmp, self.path)
            else:
                try:
                    os.link(self.tmp, self.path)  # fails if path appeared meanwhile: never replaces
                except FileExistsError:
                    raise InputError(f"output {self.path} exists; pass overwrite=True (CLI: --force)") from None
                except OSError as exc:
                    if exc.errno not in (errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EXDEV, errno.EMLINK):
                        raise
                    self._check_exists()  # a filesystem without hard links: check, then rename
                    os.rename(self.tmp, self.path)
                else:
                    os.unlink(self.tmp)
            self._sync_dir()
        except OSError as exc:
            self.abort()
            raise self._io_error(exc) from None
        except BaseException:
            self.abort()
            raise
        os.close(self._fd)
        self._fd = -1
        self._pool.shutdown(wait=True)
        return self.path

    def _sync_dir(self) -> None:
        try:
            fd = os.open(self.path.parent, os.O_RDONLY)
        except OSError:
            return
        try:
            os.fsync(fd)
        except OSError:
            pass
        finally:
            os.close(fd)

    def abort(self) -> None:
        """Remove the temp file (the output is untouched)."""
        for job in self._pending:
            job.cancel()
        self._pool.shutdown(wait=True)
        self._pending.clear()
        if self._fd >= 0:
            try:
                if os.fstat(self._fd).st_ino == os.stat(self.tmp).st_ino:
                    os.unlink(self.tmp)
            except OSError:
                pass
            os.close(self._fd)
            self._fd = -1

    def __enter__(self) -> DumpWriter:
        return self

    def __del__(self) -> None:
        # dropped uncommitted, e.g. Ctrl-C between the constructor and the ``with`` block (no ``__exit__``)
        if getattr(self, "_fd", -1) >= 0:
            self.abort()

    def __exit__(self, exc_type, exc, tb) -> None:
        if self._fd >= 0:
            self.abort()


def dump_size(specs: Sequence[EntrySpec], attrs: dict[str, str]) -> int:
    """Bytes of the dump file holding ``specs`` and ``attrs`` (header included)."""
    return sum(s.nbytes for s in specs) + len(_header_bytes(specs, attrs, [0] * len(specs)))


def write_dump(
    path: str | os.PathLike,
    entries: Dump | Iterable[DumpEntry],
    *,
    overwrite: bool = False,
    attrs: dict[str, str] | None = None,
) -> Path:
    """Write ``entries`` as a version-3 dump at ``path``, atomically (see ``DumpWriter``).

    Refuses an existing ``path`` unless ``overwrite``. ``attrs`` adds free-form string
    attributes to the header (a ``Dump``'s own ``attrs`` are kept). The same entries and
    attributes always give the same bytes.
    """
    if isinstance(entries, torch.Tensor) or not isinstance(entries, (Dump, Iterable)):
        raise InputError(f"entries must be a Dump or DumpEntry objects, got {type(entries).__name__}")
    items = list(entries)
    bad = next((e for e in items if not isinstance(e, DumpEntry)), None)
    if bad is not None:
        raise InputError(f"entries must be DumpEntry objects, got {type(bad).__name__}")
    if attrs is not None and not isinstance(attrs, dict):
        raise InputError(f"attrs must be a dict of str to str, got {type(attrs).__name__}")
    extra = dict(entries.attrs) if isinstance(entries, Dump) else {}
    extra.update(attrs or {})
    specs = [EntrySpec(e.metadata(), _DTYPE_NAMES[e.data.dtype], tuple(e.data.shape)) for e in items]
    _check_header_input(specs, extra)
    with DumpWriter(path, overwrite=overwrite, reserve=dump_size(specs, extra)) as out:
        out.begin(specs, extra)
        for e in items:
            rows = e.data.detach()
            step = tokens_per_chunk(1, rows[0].numel() * rows.element_size()) if rows.shape[0] else 1
            for start in range(0, rows.shape[0], step):
                out.write(rows[start : start + step])
        return out.commit()


__all__ = [
    "HELD_SIGNALS",
    "PARTIAL_SUFFIX",
    "dump_size",
    "DumpWriter",
    "EntrySpec",
    "partial_path",
    "write_dump",
]
