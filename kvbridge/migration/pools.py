"""Engine-side page pools in one process: one uint8 tensor per (layer, role), page allocation,
and record gather/scatter through a request's block tables.

Every pool addressed by the same block table (e.g. all ratio-4 COMPRESS layers) has the same
number of pages, so one page id means the same slot in each of them, as in the engines.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from kvbridge.engines import EngineProfile, Storage, parse_engine
from kvbridge.errors import InputError
from kvbridge.topology import CacheSpec, ModelTopology, Role, get_model

#: A request's block tables: table name -> physical page ids (-1: released / not held).
RequestTables = dict[str, list[int]]


def _runs(storage: Storage, table: Sequence[int], first: int, count: int, num_pages: int
          ) -> list[tuple[int, int, int, int]]:
    """Entries ``[first, first + count)`` as runs within one page: (physical page, first row, rows,
    offset into the records). Refuses released (-1) or out-of-pool pages."""
    p = storage.page_size
    if storage.addressing == "ring" and count > p:
        raise InputError(f"{count} entries do not fit the {p}-row ring of block table {storage.table!r}")
    runs = []
    entry, end = first, first + count
    while entry < end:
        stop = min(end, (entry // p + 1) * p)
        slot = 0 if storage.addressing == "ring" else entry // p
        if slot >= len(table):
            raise InputError(f"block table {storage.table!r} has {len(table)} pages; entry {stop - 1} needs "
                             f"page index {slot}")
        page = table[slot]
        if page < 0:
            raise InputError(f"block table {storage.table!r} index {slot} is released (-1) but holds live entries")
        if page >= num_pages:
            raise InputError(f"block table {storage.table!r} index {slot} names page {page}; the pool has {num_pages}")
        runs.append((page, entry % p, stop - entry, entry - first))
        entry = stop
    return runs


def _page_views(pool: torch.Tensor, storage: Storage) -> list[tuple[torch.Tensor, int, int]]:
    """Views ``[num_pages, P, width]`` of a pool, with the record byte range each holds."""
    return storage.geometry.page_views(pool, storage.page_size)


def gather_records(pool: torch.Tensor, storage: Storage, table: Sequence[int], first: int, count: int) -> torch.Tensor:
    """Records ``[count, record_bytes]`` (uint8) of entries ``[first, first + count)``.

    Entries in one page are consecutive rows, so each run is one slice copy per record part.
    """
    out = torch.empty(count, storage.record_bytes, dtype=torch.uint8, device=pool.device)
    views = _page_views(pool, storage)
    for page, row, n, off in _runs(storage, table, first, count, pool.shape[0]):
        for view, lo, hi in views:
            out[off : off + n, lo:hi] = view[page, row : row + n]
    return out


def scatter_records(pool: torch.Tensor, storage: Storage, table: Sequence[int], first: int,
                    records: torch.Tensor) -> None:
    """Write records ``[count, record_bytes]`` into the pool slots of entries ``[first, first + count)``."""
    views = _page_views(pool, storage)
    for page, row, n, off in _runs(storage, table, first, records.shape[0], pool.shape[0]):
        for view, lo, hi in views:
            view[page, row : row + n] = records[off : off + n, lo:hi]


@dataclass
class EnginePools:
    """All cache pools of one engine instance (one process), with a free list per block table."""

    profile: EngineProfile
    model: ModelTopology
    include_mtp: bool
    pages_per_table: dict[str, int]
    pools: dict[tuple[int, Role], torch.Tensor] = field(default_factory=dict)
    free: dict[str, list[int]] = field(default_factory=dict)

    @classmethod
    def create(cls, profile: str | EngineProfile, model: str | ModelTopology, pages_per_table: dict[str, int], *,
               include_mtp: bool = True, seed: int | None = None) -> EnginePools:
        """Zero-filled pools; ``pages_per_table`` gives each block table's capacity in pages.

        With ``seed`` the free lists are shuffled, so requests get scattered page ids.
        """
        prof, topo = parse_engine(profile), get_model(model)
        pools: dict[tuple[int, Role], torch.Tensor] = {}
        for spec in topo.all_caches(include_mtp):
            st = prof.storage(spec)
            if st.table not in pages_per_table:
                raise InputError(f"pages_per_table lacks block table {st.table!r} of {prof.spec}")
            pools[(spec.layer, spec.role)] = torch.zeros(pages_per_table[st.table], st.page_bytes, dtype=torch.uint8)
        free = {name: list(range(n)) for name, n in pages_per_table.items()}
        if seed is not None:
            rng = random.Random(seed)
            for ids in free.values():
                rng.shuffle(ids)
        return cls(prof, topo, include_mtp, dict(pages_per_table), pools, free)

    @classmethod
    def wrap(cls, profile: str | EngineProfile, model: str | ModelTopology,
             pools: dict[tuple[int, Role], torch.Tensor], *, include_mtp: bool = True,
             free: dict[str, list[int]] | None = None) -> EnginePools:
        """Pools an engine already owns: uint8 ``[num_pages, page_bytes]`` tensors (e.g. views of its
        KV buffers), one per (layer, role) of the model. ``free`` lists the page ids a receiver may
        claim per block table (default: every page)."""
        prof, topo = parse_engine(profile), get_model(model)
        pages_per_table: dict[str, int] = {}
        for spec in topo.all_caches(include_mtp):
            key = (spec.layer, spec.role)
            st = prof.storage(spec)
            t = pools.get(key)
            what = f"pool of layer {spec.layer} {spec.role.value}"
            if t is None:
                raise InputError(f"{what} is missing")
            if not isinstance(t, torch.Tensor) or t.dtype != torch.uint8 or t.dim() != 2 or t.shape[1] != st.page_bytes:
                shape = f"{t.dtype} {list(t.shape)}" if isinstance(t, torch.Tensor) else type(t).__name__
                raise InputError(f"{what} must be uint8 [num_pages, {st.page_bytes}] for {prof.spec}, got {shape}")
            if pages_per_table.setdefault(st.table, t.shape[0]) != t.shape[0]:
                raise InputError(f"{what} has {t.shape[0]} pages; other pools of block table {st.table!r} have "
                                 f"{pages_per_table[st.table]}")
        extra = set(pools) - {(c.layer, c.role) for c in topo.all_caches(include_mtp)}
        if extra:
            layer, role = sorted(extra)[0]
            raise InputError(f"pools holds layer {layer} {role.value}, which {topo.name} does not have")
        free_lists = {name: list(range(n)) for name, n in pages_per_table.items()} if free is None else \
            {name: list(free.get(name, [])) for name in pages_per_table}
        return cls(prof, topo, include_mtp, pages_per_table, dict(pools), free_lists)

    def storage(self, spec: CacheSpec) -> Storage:
        return self.profile.storage(spec)

    def pool(self, spec: CacheSpec) -> torch.Tensor:
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

