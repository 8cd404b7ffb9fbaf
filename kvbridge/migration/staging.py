"""Reusable host staging memory for the records a migration packs or receives.

A 413 MB payload written into freshly allocated memory pays the kernel's first touch of every page (page faults
and zeroing: 0.16-1.1 s on the 2-vCPU AMD EPYC VM of ``docs/performance.md``, against 0.034 s for an
``np.copyto`` of the same bytes into memory already touched). ``staging_empty`` hands out blocks that earlier
payloads used instead: a block goes back to the cache only when nothing references its memory any more (the
last tensor or array viewing it is gone), so a block in use is never handed out twice. At most
``STAGING_CACHE_ENV`` bytes (default ``DEFAULT_CACHE_BYTES``) are kept while idle; ``0`` turns the cache off.
"""

from __future__ import annotations

import os
import threading
import weakref

import numpy as np
import torch

from kvbridge.errors import InputError

#: Environment variable: the most bytes of idle staging blocks kept for reuse (``0``: none, every payload is
#: freshly allocated).
STAGING_CACHE_ENV = "KVBRIDGE_STAGING_CACHE_BYTES"
DEFAULT_CACHE_BYTES = 1 << 30
#: Requests below this size are plain ``torch.empty`` (the allocator reuses small blocks itself).
MIN_CACHED_BYTES = 1 << 20


def cache_limit() -> int:
    """``STAGING_CACHE_ENV`` in bytes (``InputError`` for a value that is not a non-negative integer)."""
    raw = os.environ.get(STAGING_CACHE_ENV, "").strip()
    if not raw:
        return DEFAULT_CACHE_BYTES
    try:
        value = int(raw)
    except ValueError:
        value = -1
    if value < 0:
        raise InputError(f"{STAGING_CACHE_ENV} must be a number of bytes >= 0 (0 turns the cache off), got {raw!r}")
    return value


class _Lease:
    """One use of a cached block: the array interface of its first ``nbytes`` bytes (arrays made from it keep the
    lease, and so the block, alive; the cache takes the block back when the lease is collected)."""

    __slots__ = ("block", "__array_interface__", "__weakref__")

    def __init__(self, block: np.ndarray, nbytes: int) -> None:
        self.block = block
        self.__array_interface__ = {"shape": (nbytes,), "typestr": "|u1", "version": 3,
                                    "data": (block.ctypes.data, False)}


class _Cache:
    """Idle blocks (uint8 arrays), smallest fitting first."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.idle: list[np.ndarray] = []

    def take(self, nbytes: int, limit: int) -> np.ndarray:
        """An idle block of ``nbytes`` to ``2 * nbytes`` bytes, else a fresh one; idle blocks beyond ``limit``
        bytes are dropped (largest first)."""
        with self.lock:
            fits = [i for i, b in enumerate(self.idle) if nbytes <= b.nbytes <= 2 * nbytes]
            block = self.idle.pop(min(fits, key=lambda i: self.idle[i].nbytes)) if fits else None
            self.idle.sort(key=lambda b: b.nbytes)
            while self.idle and sum(b.nbytes for b in self.idle) > limit:
                self.idle.pop()
        return block if block is not None else np.empty(nbytes, dtype=np.uint8)

    def give_back(self, block: np.ndarray, limit: int) -> None:
        """Keep ``block`` for reuse when it fits in ``limit`` bytes (one atomic list operation: a finalizer may
        run on any thread, even inside ``take``)."""
        if block.nbytes <= limit:
            self.idle.append(block)


_CACHE = _Cache()


def staging_empty(nbytes: int) -> torch.Tensor:
    """An uninitialised uint8 CPU tensor of ``nbytes`` bytes, from the staging cache when it is at least
    ``MIN_CACHED_BYTES`` and the cache is on (its memory is then reused only after every view of it is gone)."""
    limit = cache_limit()
    if nbytes < MIN_CACHED_BYTES or limit == 0:
        return torch.empty(nbytes, dtype=torch.uint8)
    block = _CACHE.take(nbytes, limit)
    lease = _Lease(block, nbytes)
    finalizer = weakref.finalize(lease, _CACHE.give_back, block, limit)
    finalizer.atexit = False
    return torch.from_numpy(np.asarray(lease))


def joined(records: list[torch.Tensor]) -> torch.Tensor | None:
    """The bytes of ``records`` as one flat uint8 view when they lie back to back in one storage, each contiguous
    (as ``pack`` stages them; empty records hold no bytes and lie anywhere), else None (a sender then concatenates
    them)."""
    if not records or any(r.dtype != torch.uint8 or not r.is_contiguous() for r in records):
        return None
    full = [r for r in records if r.numel()]
    if not full:
        return torch.empty(0, dtype=torch.uint8, device=records[0].device)
    storage = full[0].untyped_storage().data_ptr()
    for a, b in zip(full, full[1:], strict=False):
        if b.untyped_storage().data_ptr() != storage or a.data_ptr() + a.numel() != b.data_ptr():
            return None
    return full[0].as_strided((sum(r.numel() for r in full),), (1,))
