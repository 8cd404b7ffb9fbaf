"""Engine-side page pools in one process: one uint8 tensor per (layer, role), page allocation,
and record gather/scatter through a request's block tables.

Every pool addressed by the same block table (e.g. all ratio-4 COMPRESS layers) has the same
number of pages, so one page id means the same slot in each of them, as in the engines.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from kvbridge.backends import dispatch
from kvbridge.engines.profiles import EngineProfile, Storage, parse_engine
from kvbridge.engines.topology import CacheSpec, ModelTopology, Role, get_model
from kvbridge.errors import InputError

#: A request's block tables: table name -> physical page ids (-1: released / not held).
RequestTables = dict[str, list[int]]
#: One cache's pool: a uint8 ``[num_pages, page_bytes]`` tensor, or for storages with
#: ``separate_pools`` (TensorRT-LLM's compressor kv and score) a pair of them.
Pool = torch.Tensor | tuple[torch.Tensor, torch.Tensor]


def pool_shapes(storage: Storage) -> list[int]:
    """Bytes per page of each tensor of a pool of ``storage``."""
    if storage.separate_pools:
        assert storage.split is not None
        p = storage.page_size
        return [p * storage.split, p * (storage.record_bytes - storage.split)]
    return [storage.page_bytes]


def pool_tensors(pool: Pool) -> tuple[torch.Tensor, ...]:
    return pool if isinstance(pool, tuple) else (pool,)


#: The block table(s) of one storage: one page-id list, or (kv table, score table) for a storage
#: whose two pools have block tables of their own (``Storage.score_table``).
Table = Sequence[int] | tuple[Sequence[int], Sequence[int]]


def table_of(tables: RequestTables, storage: Storage) -> Table:
    """The request's block table(s) for ``storage``."""
    if storage.score_table is not None:
        return tables[storage.table], tables[storage.score_table]
    return tables[storage.table]


def _part_tables(storage: Storage, table: Table, parts: int) -> list[tuple[str, Sequence[int]]]:
    """(table name, page ids) addressing each of a storage's ``parts`` record parts."""
    if storage.score_table is not None:
        if not (isinstance(table, tuple) and len(table) == 2):
            raise InputError(f"storage of block tables {storage.table!r} and {storage.score_table!r} needs both "
                             "tables (use pools.table_of)")
        return [(storage.table, table[0]), (storage.score_table, table[1])]
    return [(storage.table, table)] * parts  # type: ignore[list-item]


def _runs(storage: Storage, table: Sequence[int], first: int, count: int, num_pages: int, name: str | None = None
          ) -> list[tuple[int, int, int, int]]:
    """Entries ``[first, first + count)`` as runs within one page: (physical page, first row, rows,
    offset into the records). Refuses released (-1) or out-of-pool pages."""
    p = storage.page_size
    name = name or storage.table
    if storage.addressing == "ring" and count > p:
        raise InputError(f"{count} entries do not fit the {p}-row ring of block table {name!r}")
    span = storage.span or p
    runs = []
    entry, end = first, first + count
    while entry < end:
        stop = min(end, (entry // p + 1) * p, (entry // span + 1) * span)
        if storage.addressing == "page-ring" and min(end, (entry // span + 1) * span) - entry > p:
            raise InputError(f"entries {entry}..{stop - 1} overflow the {p}-row ring of a {span}-position page of "
                             f"block table {name!r}")
        slot = 0 if storage.addressing == "ring" else entry // span
        if slot >= len(table):
            raise InputError(f"block table {name!r} has {len(table)} pages; entry {stop - 1} needs "
                             f"page index {slot}")
        page = table[slot]
        if page < 0:
            raise InputError(f"block table {name!r} index {slot} is released (-1) but holds live entries")
        if page >= num_pages:
            raise InputError(f"block table {name!r} index {slot} names page {page}; the pool has {num_pages}")
        runs.append((page, entry % p, stop - entry, entry - first))
        entry = stop
    return runs


def _page_views(pool: Pool, storage: Storage) -> list[tuple[torch.Tensor, int, int]]:
    """Views ``[num_pages, P, width]`` of a pool, with the record byte range each holds."""
    if isinstance(pool, tuple):  # separate kv and score pools: the record's two halves, split at ``split``
        p, rec, s = storage.page_size, storage.record_bytes, storage.split
        assert s is not None
        kv, score = pool
        return [(kv[:, : p * s].view(kv.shape[0], p, s), 0, s),
                (score[:, : p * (rec - s)].view(score.shape[0], p, rec - s), s, rec)]
    return storage.geometry.page_views(pool, storage.page_size)


def _run_array(storage: Storage, table: Sequence[int], first: int, count: int, num_pages: int, name: str
               ) -> np.ndarray:
    """``_runs`` as int64 ``[k, 4]`` (physical page, first row, rows, offset into the records); computed
    with array operations for plain paged addressing (one run per page), by ``_runs`` otherwise and
    whenever a page is missing, released or out of the pool (``_runs`` then raises its error)."""
    p = storage.page_size
    if storage.addressing != "paged" or (storage.span or p) != p or count <= 0:
        return np.array(_runs(storage, table, first, count, num_pages, name), np.int64).reshape(-1, 4)
    s0, s1 = first // p, (first + count - 1) // p + 1
    pages = np.asarray(table[s0:s1], dtype=np.int64)
    if pages.shape[0] < s1 - s0 or bool((pages < 0).any()) or bool((pages >= num_pages).any()):
        _runs(storage, table, first, count, num_pages, name)  # raises the first problem, entry by entry
        raise AssertionError("unreachable: _runs accepted a table the array check refused")
    slots = np.arange(s0, s1, dtype=np.int64)
    starts = np.maximum(slots * p, first)
    stops = np.minimum(slots * p + p, first + count)
    return np.stack([pages, starts - slots * p, stops - starts, starts - first], axis=1)


def part_bounds(pool: Pool, storage: Storage) -> list[tuple[int, int]]:
    """Record byte ranges ``[lo, hi)`` of the parts of ``pool``'s pages (one per tensor or page region)."""
    return [(lo, hi) for _, lo, hi in _page_views(pool, storage)]


#: One record part of a pool, ready to move: (pool tensor, record bytes lo, width, spans ``[k, 3]``
#: of (pool byte offset, offset into the records, rows)).
PartSpans = tuple[torch.Tensor, int, int, np.ndarray]


def _paged_bytes(tensor: torch.Tensor) -> tuple[torch.Tensor, int] | None:
    """A pool tensor ``[pages, page_bytes]`` (uint8) as one flat byte tensor from its first page's first byte to
    its last page's last, and its page stride in bytes: the tensor itself when contiguous, a view of its storage
    when its pages lie ``stride(0)`` bytes apart with other bytes between them (a vLLM cache layer's blocks in
    the buffer its layers share); None for any other striding."""
    if tensor.is_contiguous():
        return tensor, tensor.shape[1]
    if tensor.dim() != 2 or tensor.element_size() != 1 or tensor.stride(1) != 1 or tensor.stride(0) < tensor.shape[1]:
        return None
    pages, page = tensor.shape
    return tensor.as_strided(((pages - 1) * tensor.stride(0) + page if pages else 0,), (1,)), tensor.stride(0)


#: Page runs already found (``part_spans``'s ``runs``), keyed by the table's identity and what addresses it; each
#: value keeps its table, so that the identity stays its own while the cache lives.
RunCache = dict[tuple, tuple[Sequence[int], np.ndarray]]


def _cached_runs(runs: RunCache | None, storage: Storage, ids: Sequence[int], first: int, count: int, num_pages: int,
                 name: str) -> np.ndarray:
    """``_run_array``, once per table, entry range and addressing while ``runs`` (None: no cache) lives: the
    layers of a model share their block tables."""
    if runs is None:
        return _run_array(storage, ids, first, count, num_pages, name)
    key = (id(ids), name, first, count, num_pages, storage.page_size, storage.addressing, storage.span)
    hit = runs.get(key)
    if hit is None or hit[0] is not ids:
        hit = runs[key] = (ids, _run_array(storage, ids, first, count, num_pages, name))
    return hit[1]


def part_spans(pool: Pool, storage: Storage, table: Table, first: int, count: int, runs: RunCache | None = None
               ) -> list[PartSpans] | None:
    """The spans of entries ``[first, first + count)`` in each record part of ``pool`` (each run of entries
    in one page is consecutive rows of that part), or None when a pool tensor is neither contiguous nor made
    of pages a fixed stride apart (``_paged_bytes``; the spans are then offsets into that flat view).
    Refuses (``InputError``) a table that does not hold the entries. ``runs``: a cache of page runs for calls over
    tables that do not change meanwhile (one migration's)."""
    tensors = pool_tensors(pool)
    flats = [_paged_bytes(t) for t in tensors]
    if any(f is None for f in flats):
        return None
    parts = []
    runs_of: dict[str, np.ndarray] = {}
    views = _page_views(pool, storage)
    for k, ((_, lo, hi), (name, ids)) in enumerate(zip(views, _part_tables(storage, table, len(views)), strict=True)):
        i = k if isinstance(pool, tuple) else 0
        tensor, page_stride = flats[i]  # type: ignore[misc]
        width = hi - lo
        region = 0 if isinstance(pool, tuple) else storage.page_size * lo
        if name not in runs_of:
            runs_of[name] = _cached_runs(runs, storage, ids, first, count, tensors[i].shape[0], name)
        found = runs_of[name]
        spans = np.stack([found[:, 0] * page_stride + region + found[:, 1] * width, found[:, 3], found[:, 2]], axis=1)
        parts.append((tensor, lo, width, spans))
    return parts


def merge_spans(streams: list[tuple[np.ndarray, int]], count: int) -> np.ndarray:
    """Segments over records ``[0, count)`` that lie in one run of every stream: ``streams`` are (spans ``[k, 3]``
    of (byte offset, first record, rows), row stride in bytes) covering the records in order; returns int64
    ``[S, len(streams) + 1]``: each stream's byte offset of the segment's first record, then its rows."""
    first = streams[0][0]  # runs that start alike in every stream (the same page size both sides) are the segments
    if all(sp.shape == first.shape and np.array_equal(sp[:, 1], first[:, 1]) for sp, _ in streams[1:]):
        return np.stack([*(sp[:, 0] for sp, _ in streams), np.diff(np.append(first[:, 1], count))], axis=1)
    starts = np.unique(np.concatenate([sp[:, 1] for sp, _ in streams]))
    cols = []
    for sp, stride in streams:
        run = np.searchsorted(sp[:, 1], starts, side="right") - 1
        cols.append(sp[run, 0] + (starts - sp[run, 1]) * stride)
    return np.stack([*cols, np.diff(np.append(starts, count))], axis=1)


def coalesce_segments(segs: np.ndarray, src_stride: int, dst_stride: int) -> np.ndarray:
    """Move segments ``[S, 3]`` of (source byte offset, destination byte offset, rows) with each segment that
    continues the previous one on both sides (rows ``src_stride`` / ``dst_stride`` apart: adjacent pages) merged
    into it: the same bytes move, in fewer and longer copies."""
    if segs.shape[0] < 2:
        return segs
    rows = segs[:-1, 2]
    joins = (segs[1:, 0] == segs[:-1, 0] + rows * src_stride) & (segs[1:, 1] == segs[:-1, 1] + rows * dst_stride)
    if not bool(joins.any()):
        return segs
    heads = np.flatnonzero(np.concatenate([[True], ~joins]))
    out = segs[heads].copy()
    out[:, 2] = np.add.reduceat(segs[:, 2], heads)
    return out


def move_parts(spans: list[PartSpans], rows: list[tuple[torch.Tensor, int]], to_pool: bool) -> None:
    """Copy each record part between its pool spans and ``rows[k]`` = (contiguous ``[count, row_bytes]``
    tensor, byte offset of the part in a row): one span copy per run of entries in one page (all in one
    ``dispatch.move_spans`` call), the pool's rows ``width`` bytes apart, the records' ``row_bytes`` apart."""
    moves = []
    for (tensor, _, width, sp), (records, at) in zip(spans, rows, strict=True):
        row_bytes = records.shape[1]
        in_records = sp[:, 1] * row_bytes + at
        if to_pool:
            moves.append((records, tensor, np.stack([in_records, sp[:, 0], sp[:, 2]], axis=1), row_bytes, width, width))
        else:
            moves.append((tensor, records, np.stack([sp[:, 0], in_records, sp[:, 2]], axis=1), width, row_bytes, width))
    dispatch.move_spans(moves, into_pool=to_pool)


def _move(pool: Pool, storage: Storage, table: Table, first: int, records: torch.Tensor, to_pool: bool) -> bool:
    """Gather (``to_pool=False``) or scatter ``records`` with one native call per record part: each run of
    entries in one page is consecutive rows of the page, copied as whole spans. False when not applicable."""
    if not records.is_contiguous():
        return False
    spans = part_spans(pool, storage, table, first, records.shape[0])
    if spans is None:
        return False
    move_parts(spans, [(records, lo) for _, lo, _, _ in spans], to_pool)  # every run checked before any byte moves
    return True


def gather_records(pool: Pool, storage: Storage, table: Table, first: int, count: int) -> torch.Tensor:
    """Records ``[count, record_bytes]`` (uint8) of entries ``[first, first + count)``.

    Entries in one page are consecutive rows, so each run is one span copy per record part.
    ``table``: the storage's page ids (``table_of``: a pair when its two pools have two tables).
    """
    out = torch.empty(count, storage.record_bytes, dtype=torch.uint8, device=pool_tensors(pool)[0].device)
    if _move(pool, storage, table, first, out, to_pool=False):
        return out
    views = _page_views(pool, storage)
    for (view, lo, hi), (name, ids) in zip(views, _part_tables(storage, table, len(views)), strict=True):
        for page, row, n, off in _runs(storage, ids, first, count, view.shape[0], name):
            out[off : off + n, lo:hi] = view[page, row : row + n]
    return out


def scatter_records(pool: Pool, storage: Storage, table: Table, first: int, records: torch.Tensor) -> None:
    """Write records ``[count, record_bytes]`` into the pool slots of entries ``[first, first + count)``."""
    if _move(pool, storage, table, first, records, to_pool=True):
        return
    views = _page_views(pool, storage)
    for (view, lo, hi), (name, ids) in zip(views, _part_tables(storage, table, len(views)), strict=True):
        for page, row, n, off in _runs(storage, ids, first, records.shape[0], view.shape[0], name):
            view[page, row : row + n] = records[off : off + n, lo:hi]


def copy_entries(src: Pool, src_table: Table, dst: Pool, dst_table: Table, storage: Storage, first: int,
                 count: int) -> bool:
    """Copy entries ``[first, first + count)`` of ``storage`` from pool ``src`` (at ``src_table``) into pool ``dst``
    (at ``dst_table``), both in that storage: one span copy per run that lies in one page of each, no records in
    between. Both tables are checked before any byte moves. False (nothing moved) when the pools are on two
    devices or a pool tensor is neither contiguous nor page-strided (``part_spans``)."""
    if pool_tensors(src)[0].device != pool_tensors(dst)[0].device:
        return False
    src_parts = part_spans(src, storage, src_table, first, count)
    dst_parts = part_spans(dst, storage, dst_table, first, count)
    if src_parts is None or dst_parts is None:
        return False
    dispatch.move_spans([(s_tensor, d_tensor, merge_spans([(s_sp, width), (d_sp, width)], count), width, width, width)
                         for (s_tensor, _, width, s_sp), (d_tensor, _, _, d_sp) in zip(src_parts, dst_parts,
                                                                                         strict=True)], into_pool=True)
    return True


@dataclass
class EnginePools:
    """All cache pools of one engine instance (one process), with a free list per block table."""

    profile: EngineProfile
    model: ModelTopology
    include_mtp: bool
    pages_per_table: dict[str, int]
    pools: dict[tuple[int, Role], Pool] = field(default_factory=dict)
    free: dict[str, list[int]] = field(default_factory=dict)

    @classmethod
    def create(cls, profile: str | EngineProfile, model: str | ModelTopology, pages_per_table: dict[str, int], *,
               include_mtp: bool = True, seed: int | None = None) -> EnginePools:
        """Zero-filled pools; ``pages_per_table`` gives each block table's capacity in pages.

        With ``seed`` the free lists are shuffled, so requests get scattered page ids.
        """
        prof, topo = parse_engine(profile), get_model(model)
        pools: dict[tuple[int, Role], Pool] = {}
        for spec in topo.all_caches(include_mtp):
            st = prof.storage(spec)
            names = [st.table, st.score_table] if st.score_table is not None else [st.table] * len(pool_shapes(st))
            for name in names:
                if name not in pages_per_table:
                    raise InputError(f"pages_per_table lacks block table {name!r} of {prof.spec}")
            parts = tuple(torch.zeros(pages_per_table[name], b, dtype=torch.uint8)
                          for name, b in zip(names, pool_shapes(st), strict=True))
            pools[(spec.layer, spec.role)] = parts if st.separate_pools else parts[0]
        free = {name: list(range(n)) for name, n in pages_per_table.items()}
        if seed is not None:
            rng = random.Random(seed)
            for ids in free.values():
                rng.shuffle(ids)
        return cls(prof, topo, include_mtp, dict(pages_per_table), pools, free)

    @classmethod
    def wrap(cls, profile: str | EngineProfile, model: str | ModelTopology,
             pools: dict[tuple[int, Role], Pool], *, include_mtp: bool = True,
             free: dict[str, list[int]] | None = None) -> EnginePools:
        """Pools an engine already owns: uint8 ``[num_pages, page_bytes]`` tensors (e.g. views of its
        KV buffers), one per (layer, role) of the model; a ``(kv, score)`` pair of tensors for the
        compressor-state roles of a profile that keeps them apart (TensorRT-LLM). ``free`` lists
        the page ids a receiver may claim per block table (default: every page)."""
        prof, topo = parse_engine(profile), get_model(model)
        pages_per_table: dict[str, int] = {}
        for spec in topo.all_caches(include_mtp):
            key = (spec.layer, spec.role)
            st = prof.storage(spec)
            t = pools.get(key)
            what = f"pool of layer {spec.layer} {spec.role.value}"
            if t is None:
                raise InputError(f"{what} is missing")
            widths = pool_shapes(st)
            parts = t if isinstance(t, tuple) else (t,)
            want = " and ".join(f"uint8 [num_pages, {w}]" for w in widths)
            if len(parts) != len(widths) or any(
                    not isinstance(x, torch.Tensor) or x.dtype != torch.uint8 or x.dim() != 2 or x.shape[1] != w
                    for x, w in zip(parts, widths, strict=False)):
                shape = ", ".join(f"{x.dtype} {list(x.shape)}" if isinstance(x, torch.Tensor) else type(x).__name__
                                  for x in parts)
                raise InputError(f"{what} must be {want} for {prof.spec}, got {shape}")
            names = [st.table, st.score_table] if st.score_table is not None else [st.table] * len(parts)
            for name, x in zip(names, parts, strict=True):
                n = x.shape[0]
                if pages_per_table.setdefault(name, n) != n:
                    raise InputError(f"{what} has {n} pages; other pools of block table {name!r} have "
                                     f"{pages_per_table[name]}")
        extra = set(pools) - {(c.layer, c.role) for c in topo.all_caches(include_mtp)}
        if extra:
            layer, role = sorted(extra)[0]
            raise InputError(f"pools holds layer {layer} {role.value}, which {topo.name} does not have")
        free_lists = {name: list(range(n)) for name, n in pages_per_table.items()} if free is None else \
            {name: list(free.get(name, [])) for name in pages_per_table}
        return cls(prof, topo, include_mtp, pages_per_table, dict(pools), free_lists)

    def storage(self, spec: CacheSpec) -> Storage:
        return self.profile.storage(spec)

    def pool(self, spec: CacheSpec) -> Pool:
        return self.pools[(spec.layer, spec.role)]

    def num_free(self) -> dict[str, int]:
        return {name: len(ids) for name, ids in self.free.items()}

    def claim(self, lengths: dict[str, int], released: dict[str, int] | None = None) -> RequestTables:
        """Allocate block tables of ``lengths`` pages; the first ``released[name]`` entries stay -1.

        All or nothing: raises without taking any page when a table lacks free pages.
        """
        released = released or {}
        wanted = {name: n - min(released.get(name, 0), n) for name, n in lengths.items()}
        for name, n in wanted.items():
            if name not in self.free:
                raise InputError(f"{self.profile.spec} has no block table {name!r}")
            if len(self.free[name]) < n:
                raise InputError(f"block table {name!r} of {self.profile.spec} has {len(self.free[name])} free pages, "
                                 f"the request needs {n}")
        tables: RequestTables = {}
        for name, n in lengths.items():
            held = [self.free[name].pop() for _ in range(wanted[name])]
            tables[name] = [-1] * (n - wanted[name]) + held
        return tables

    def release(self, tables: RequestTables) -> None:
        """Return a request's pages to the free lists."""
        for name, ids in tables.items():
            self.free[name].extend(i for i in ids if i >= 0)

