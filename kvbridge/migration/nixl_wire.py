"""Where each checksummed chunk of a NIXL transfer lands: chunks (staged bytes and the receiver's
segments they land in), the staged pieces and their merged NIXL descriptors, XXH3-64 per chunk,
and a dump's entries as they travel (metadata, checksum chunks, groups, fingerprint).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import xxhash

from kvbridge.backends import dispatch
from kvbridge.dumps.dumpfile import LATENT_DTYPES, DumpEntry
from kvbridge.engines.profiles import Storage
from kvbridge.migration.plan import Transfer
from kvbridge.migration.pools import Pool, RequestTables, _runs, pool_shapes, pool_tensors

_DTYPES = {"U8": torch.uint8, **LATENT_DTYPES}
_DTYPE_NAMES = {v: k for k, v in _DTYPES.items()}


@dataclass(frozen=True)
class _Chunk:
    """One checksummed unit: ``nbytes`` consecutive staged bytes landing as ``segments``
    (region key, byte offset, length) in the receiver's memory, in order."""

    nbytes: int
    segments: tuple[tuple[str, int, int], ...]


def _pool_keys(t: Transfer) -> list[str]:
    """Region keys of the destination pool tensors of ``t`` (two for separate kv / score pools)."""
    base = f"pool.{t.spec.layer}.{t.spec.role.value}"
    return [base, f"{base}.score"] if t.dst.separate_pools else [base]


def _tensor_tables(st: Storage, pool: Pool) -> list[tuple[torch.Tensor, str]]:
    """Each tensor of a pool with the block table addressing it."""
    return [(tensor, st.score_table if k == 1 and st.score_table else st.table)
            for k, tensor in enumerate(pool_tensors(pool))]


def _pieces(rec: int, split: int | None) -> list[tuple[int, int]]:
    return [(0, rec)] if split is None else [(0, split), (split, rec)]


def _pool_chunks(t: Transfer, tables: RequestTables, pages: Sequence[int] | None = None
                 ) -> list[tuple[_Chunk, list[tuple[int, int, int, int]]]]:
    """Destination-page chunks of ``t``: per run of rows in one page, the chunk and, per record part,
    (record offset, rows, first byte, last byte) of the records it carries. ``pages``: the page
    count of each destination pool tensor (default: bounded by the page ids themselves)."""
    st = t.dst
    keys = _pool_keys(t)
    per_part = []
    for k, (lo, hi) in enumerate(_pieces(st.record_bytes, st.split)):
        ti = k if st.separate_pools else 0
        name = st.score_table if k == 1 and st.score_table else st.table
        ids = tables[name]
        page_bytes = pool_shapes(st)[ti]
        base = 0 if st.separate_pools else st.page_size * lo
        bound = pages[ti] if pages is not None else max([i for i in ids if i >= 0], default=0) + 1
        per_part.append([(keys[ti], page * page_bytes + base + row * (hi - lo), n * (hi - lo), (off, n, lo, hi))
                         for page, row, n, off in _runs(st, ids, t.first, t.count, bound, name)])
    return [(_Chunk(sum(seg[2] for seg in segs), tuple(seg[:3] for seg in segs)), [seg[3] for seg in segs])
            for segs in zip(*per_part, strict=True)]


def _stage_runs(staged: np.ndarray, off: int, rec: torch.Tensor, runs: list, page_size: int) -> None:
    """Stage records ``rec`` as their destination page runs (``_pool_chunks``), run after run from
    ``off``: each run's record parts back to back, as they lie in the page, so a whole page is one
    contiguous piece on both sides. Whole-page runs are copied together, one copy per part."""
    width = rec.shape[1]
    i = 0
    while i < len(runs):
        j = i
        while j < len(runs) and runs[j][1][0][1] == page_size:  # whole pages: rows [0, P)
            j += 1
        r0 = runs[i][1][0][0]
        if j > i:
            m = j - i
            block = torch.from_numpy(staged[off + r0 * width : off + (r0 + m * page_size) * width]).view(m, -1)
            src = rec[r0 : r0 + m * page_size].view(m, page_size, width)
            for _, _, lo, hi in runs[i][1]:
                block[:, page_size * lo : page_size * hi].view(m, page_size, hi - lo).copy_(src[:, :, lo:hi])
            i = j
        else:
            n = runs[i][1][0][1]
            base = off + r0 * width
            for _, _, lo, hi in runs[i][1]:
                torch.from_numpy(staged[base + n * lo : base + n * hi]).view(n, hi - lo).copy_(rec[r0 : r0 + n, lo:hi])
            i += 1


def _staging_chunks(rows: Sequence[int], record_bytes: int, base: int) -> list[_Chunk]:
    out, offset = [], base
    for n in rows:
        out.append(_Chunk(n * record_bytes, (("staging", offset, n * record_bytes),)))
        offset += n * record_bytes
    return out


#: A staged piece: (local staging offset, receiver region key, offset in that region, bytes).
Piece = tuple[int, str, int, int]


def _pieces_of(chunks: Sequence[_Chunk], local_offset: int) -> list[Piece]:
    """The pieces of ``chunks`` whose bytes are staged back to back from ``local_offset``."""
    out, off = [], local_offset
    for c in chunks:
        for key, roff, n in c.segments:
            out.append((off, key, roff, n))
            off += n
    return out


def _descriptors(pieces: Sequence[Piece], local_base: int, remote: dict[str, int]) -> tuple[np.ndarray, np.ndarray]:
    """Local and remote (address, length, device) descriptor arrays; pieces adjacent on both sides merge."""
    loc: list[list[int]] = []
    rem: list[list[int]] = []
    last_key = None
    for off, key, roff, n in pieces:
        a, b = local_base + off, remote[key] + roff
        if loc and key == last_key and loc[-1][0] + loc[-1][1] == a and rem[-1][0] + rem[-1][1] == b:
            loc[-1][1] += n
            rem[-1][1] += n
        else:
            loc.append([a, n, 0])
            rem.append([b, n, 0])
        last_key = key
    return np.array(loc, dtype=np.uint64).reshape(-1, 3), np.array(rem, dtype=np.uint64).reshape(-1, 3)


def _xxh3(memory: dict[str, np.ndarray], chunk: _Chunk) -> int:
    """XXH3-64 of a chunk's segments, in order (as of their bytes back to back)."""
    if len(chunk.segments) == 1:
        key, off, n = chunk.segments[0]
        return xxhash.xxh3_64_intdigest(memory[key][off : off + n])
    h = xxhash.xxh3_64()
    for key, off, n in chunk.segments:
        h.update(memory[key][off : off + n])
    return h.intdigest()


def _xxh3_all(memory: dict[str, np.ndarray], chunks: Sequence[_Chunk]) -> list[int]:
    """``_xxh3`` of every chunk: the one-segment chunks of each region in one native call
    (``dispatch.xxh3_chunks``), the others one by one."""
    out: list[int | None] = [None] * len(chunks)
    by_key: dict[str, list[int]] = {}
    for i, c in enumerate(chunks):
        if len(c.segments) == 1:
            by_key.setdefault(c.segments[0][0], []).append(i)
        else:
            out[i] = _xxh3(memory, c)
    for key, idx in by_key.items():
        spans = np.array([chunks[i].segments[0][1:] for i in idx], dtype=np.int64).reshape(-1, 2)
        spans[:, 1] += spans[:, 0]
        for i, h in zip(idx, dispatch.xxh3_chunks(memory[key].reshape(-1), spans), strict=True):
            out[i] = h
    return out  # type: ignore[return-value]


def _np(t: torch.Tensor) -> np.ndarray:
    return t.reshape(-1).view(torch.uint8).numpy()



def _entry_info(e: DumpEntry) -> dict[str, Any]:
    return {**e.metadata(), "dtype": _DTYPE_NAMES[e.data.dtype], "shape": list(e.data.shape)}


def dump_fingerprint(entries: Sequence[dict], target: dict | None) -> str:
    """sha256 of a dump transfer's source entries (metadata, dtype, shape) and conversion target."""
    return hashlib.sha256(json.dumps({"entries": list(entries), "target": target}, sort_keys=True).encode()).hexdigest()


def _entry_chunk_rows(info: dict) -> list[int]:
    """Checksum chunks of a dump entry: one per page (pages), or per 256 tokens (latents)."""
    rows = info["shape"][0] if info["shape"] else 0
    step = 1 if info["kind"] == "pages" else 256
    return [min(step, rows - r) for r in range(0, rows, step)]


def _entry_nbytes(info: dict) -> int:
    return int(np.prod(info["shape"], dtype=np.int64)) * torch.empty(0, dtype=_DTYPES[info["dtype"]]).element_size()


def _dump_groups(infos: Sequence[dict]) -> list[list[int]]:
    groups: dict[int, list[int]] = {}
    for i, info in enumerate(infos):
        groups.setdefault(info["layer"], []).append(i)
    return list(groups.values())

