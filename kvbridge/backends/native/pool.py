"""Work, threads and outputs of the native kernels.

Work is split into chunks of about ``CHUNK_TOKENS`` destination tokens (whole pages), run by a
pool of ``num_threads()`` Python threads (the kernels release the GIL); every byte of every
destination page (padding tail and unused rows: zero) is written by the kernels, so outputs
start uninitialised (``_empty_output``, on transparent huge pages from ``HUGE_PAGE_OUTPUT`` bytes).
"""

from __future__ import annotations

import mmap
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch

from kvbridge.layouts import Layout

#: Outputs at least this large (bytes) go on transparent huge pages (see ``_empty_output``).
HUGE_PAGE_OUTPUT = 4 << 20
_HUGE_PAGE = 2 << 20
#: Destination tokens per unit of parallel work (~150 KiB of MODEL1 pages: L2-sized).
CHUNK_TOKENS = 256

def _flat(t: torch.Tensor) -> np.ndarray:
    return t.contiguous().view(-1).numpy()


_POOLS: dict[int, ThreadPoolExecutor] = {}


def num_threads() -> int:
    """Threads the native kernels use: ``torch.get_num_threads()`` (``OMP_NUM_THREADS`` or
    ``torch.set_num_threads`` change it)."""
    return max(1, torch.get_num_threads())


def _run_chunks(kernel, nchunks: int, *args) -> None:
    """Run ``kernel(c0, c1, *args)`` over chunks ``[0, nchunks)`` on ``num_threads()`` threads.

    The kernels release the GIL; the range is cut into up to 4 pieces per thread, taken from a
    shared queue, so a thread slowed by other load on the machine holds back little work.
    """
    threads = num_threads()
    pieces = max(1, min(nchunks, 4 * threads) if threads > 1 else 1)
    _run_pieces(kernel, [nchunks * i // pieces for i in range(pieces + 1)], *args)


def _run_pieces(kernel, bounds: list[int], *args) -> None:
    """Run ``kernel(bounds[i], bounds[i + 1], *args)`` for every piece on ``num_threads()`` threads (the calling
    thread alone for one piece or one thread)."""
    threads = min(num_threads(), len(bounds) - 1)
    if threads <= 1:
        for i in range(len(bounds) - 1):
            kernel(bounds[i], bounds[i + 1], *args)
        return
    pool = _POOLS.get(threads)
    if pool is None:
        pool = _POOLS[threads] = ThreadPoolExecutor(threads, thread_name_prefix="kvbridge-native")
    for future in [pool.submit(kernel, bounds[i], bounds[i + 1], *args) for i in range(len(bounds) - 1)]:
        future.result()


def _page_chunks(num_pages: int, page_size: int) -> int:
    """Number of work chunks over ``num_pages`` destination pages (whole pages, ~CHUNK_TOKENS tokens)."""
    per = max(1, CHUNK_TOKENS // page_size)
    return -(-num_pages // per)


def _empty_output(rows: int, row_bytes: int, dtype: torch.dtype = torch.uint8) -> torch.Tensor:
    """Uninitialised ``[rows, row_bytes / itemsize]`` CPU tensor for a kernel to fill completely.

    Outputs of ``HUGE_PAGE_OUTPUT`` bytes or more are placed on 2 MiB-aligned anonymous memory
    advised for transparent huge pages: first-touch page faults of a fresh 4 KiB-paged output
    otherwise cost more than the transcode itself (measured in docs/performance.md). The tensor
    views into a mapping up to 2 MiB larger than itself, unmapped when the tensor is freed.
    """
    nbytes = rows * row_bytes
    if nbytes < HUGE_PAGE_OUTPUT or not hasattr(mmap, "MADV_HUGEPAGE"):
        return torch.empty(nbytes, dtype=torch.uint8).view(dtype).view(rows, row_bytes // dtype.itemsize)
    mapping = mmap.mmap(-1, nbytes + _HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    mapping.madvise(mmap.MADV_HUGEPAGE)
    whole = torch.frombuffer(mapping, dtype=torch.uint8)
    start = -whole.data_ptr() % _HUGE_PAGE
    return whole[start : start + nbytes].view(dtype).view(rows, row_bytes // dtype.itemsize)


def _new_pages(layout: Layout, num_tokens: int, page_size: int) -> torch.Tensor:
    return _empty_output(layout.num_pages(num_tokens, page_size), layout.page_bytes(page_size))

