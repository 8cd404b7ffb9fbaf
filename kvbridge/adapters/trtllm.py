"""TensorRT-LLM's pools as kvbridge migration pools, from the transceiver's ``KVCachePageTable``.

TensorRT-LLM's disaggregation layer describes its KV memory with a ``KVCachePageTable`` whose
``to_dict()`` form is what a TensorRT-LLM-side hook hands kvbridge:

- ``tokens_per_block``;
- ``pool_groups[g]["pools"][i]``: a physical pool, ``base_address`` (bytes), ``slot_bytes`` and
  ``num_slots``; slot ``k`` of a pool starts at ``base_address + k * slot_bytes``;
- ``layer_groups[j]``: one life cycle of slots (one kvbridge block table) with
  ``pool_group_idx``, ``local_layers`` (``local_layer_id`` -> ``global_layer_id``) and
  ``pool_views``: ``pool_idx`` (into the pool group), ``pool_role`` (the cache manager's role
  names, e.g. ``deepseek_v4_swa``), ``mapper_kind`` (0 indexed, 1 flat) and ``buffer_entries``
  ``[local_layer_id, offset, size]``: where one layer's page sits inside each slot (a flat view
  has none: its layers are packed in ``local_layers`` order, ``slot_bytes // layers`` each).

``engine_pools`` turns that table plus the pool tensors themselves (keyed by base address, so
nothing is read through a raw pointer) into ``EnginePools`` whose page ``k`` of each (layer,
role) is a view of slot ``k`` at that layer's offset; ``request_tables`` turns a request's slot
ids per layer group into kvbridge block tables. Every kvbridge migration then reads or writes
those slots in place, to or from any engine. The dict is validated strictly: a missing,
mistyped or inconsistent field is an ``InputError`` naming its path.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from kvbridge.engines.profiles import EngineProfile, parse_engine
from kvbridge.engines.topology import ModelTopology, Role, get_model
from kvbridge.errors import InputError
from kvbridge.migration.pools import EnginePools, Pool, RequestTables, pool_shapes

__all__ = ["ROLE_NAMES", "PageTable", "engine_pools", "parse_page_table", "request_tables"]

#: TensorRT-LLM role name -> (kvbridge role, record part: 0 the whole record or the compressor's kv
#: rows, 1 the compressor's score rows, which TensorRT-LLM keeps in a pool of their own).
#: ``deepseek_v4_swa`` is the name TensorRT-LLM's DeepSeek-V4 cache manager uses; the others follow
#: it for the remaining caches. A hook whose manager names them otherwise passes ``roles=``.
ROLE_NAMES: dict[str, tuple[Role, int]] = {
    "deepseek_v4_swa": (Role.SWA, 0),
    "deepseek_v4_compress": (Role.COMPRESS, 0),
    "deepseek_v4_indexer_k": (Role.INDEXER, 0),
    "deepseek_v4_compressor_kv": (Role.STATE, 0),
    "deepseek_v4_compressor_score": (Role.STATE, 1),
    "deepseek_v4_indexer_compressor_kv": (Role.INDEXER_STATE, 0),
    "deepseek_v4_indexer_compressor_score": (Role.INDEXER_STATE, 1),
}
_INDEXED, _FLAT = 0, 1


@dataclass(frozen=True)
class Buffer:
    """One layer's page inside each slot of a pool: bytes ``[offset, offset + size)`` of the slot."""

    layer: int
    role: Role
    part: int
    offset: int
    size: int


@dataclass(frozen=True)
class PhysicalPool:
    base_address: int
    slot_bytes: int
    num_slots: int


@dataclass(frozen=True)
class PoolView:
    pool: PhysicalPool
    buffers: tuple[Buffer, ...]
    path: str  # where it sits in the dict, for messages


@dataclass(frozen=True)
class PageTable:
    """A validated ``KVCachePageTable`` dict: per layer group, its pool views and their buffers."""

    tokens_per_block: int
    groups: tuple[tuple[PoolView, ...], ...]


def _field(d: object, key: str, path: str) -> object:
    if not isinstance(d, Mapping):
        raise InputError(f"page table: {path} must be a dict, got {type(d).__name__}")
    if key not in d:
        raise InputError(f"page table: {path}.{key} is missing")
    return d[key]


def _int(v: object, path: str, lo: int = 0, hi: int = 2**64 - 1) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= hi:
        raise InputError(f"page table: {path} must be an integer in [{lo}, {hi}], got {repr(v)[:40]}")
    return v


def _list(v: object, path: str) -> Sequence:
    if not isinstance(v, (list, tuple)):
        raise InputError(f"page table: {path} must be a list, got {type(v).__name__}")
    return v


def _layer(global_id: int, attn_types: int | None) -> int:
    return global_id if attn_types is None else global_id // attn_types


def parse_page_table(table: Mapping, *, roles: Mapping[str, tuple[Role, int]] = ROLE_NAMES,
                     attn_types: int | None = None) -> PageTable:
    """Validate a ``KVCachePageTable.to_dict()`` and resolve every buffer to (model layer, role, part).

    ``roles``: TensorRT-LLM role name -> (kvbridge ``Role``, part), default ``ROLE_NAMES``.
    ``attn_types``: when the manager numbers layers ``model_layer * attn_types + attention type``
    (its virtual layers), the count it uses; None when ``global_layer_id`` is the model layer.
    """
    tpb = _int(_field(table, "tokens_per_block", "page_table"), "page_table.tokens_per_block", 1, 2**20)
    pool_groups = []
    for g, pg in enumerate(_list(_field(table, "pool_groups", "page_table"), "page_table.pool_groups")):
        path = f"page_table.pool_groups[{g}]"
        pools = []
        for i, p in enumerate(_list(_field(pg, "pools", path), f"{path}.pools")):
            pp = f"{path}.pools[{i}]"
            pools.append(PhysicalPool(_int(_field(p, "base_address", pp), f"{pp}.base_address"),
                                      _int(_field(p, "slot_bytes", pp), f"{pp}.slot_bytes", 1, 2**40),
                                      _int(_field(p, "num_slots", pp), f"{pp}.num_slots", 1, 2**32)))
        pool_groups.append(pools)
    groups = []
    for j, lg in enumerate(_list(_field(table, "layer_groups", "page_table"), "page_table.layer_groups")):
        path = f"page_table.layer_groups[{j}]"
        if isinstance(lg, Mapping) and "mamba_layer_offsets" in lg:
            raise InputError(f"page table: {path} is a Mamba layer group; DeepSeek-V4 has none")
        g = _int(_field(lg, "pool_group_idx", path), f"{path}.pool_group_idx", 0, max(0, len(pool_groups) - 1))
        if not pool_groups:
            raise InputError("page table: page_table.pool_groups is empty")
        local: dict[int, int] = {}
        order: list[int] = []
        for k, ll in enumerate(_list(_field(lg, "local_layers", path), f"{path}.local_layers")):
            lp = f"{path}.local_layers[{k}]"
            lid = _int(_field(ll, "local_layer_id", lp), f"{lp}.local_layer_id")
            if lid in local:
                raise InputError(f"page table: {lp}.local_layer_id {lid} appears twice")
            local[lid] = _int(_field(ll, "global_layer_id", lp), f"{lp}.global_layer_id")
            order.append(lid)
        views = []
        for v, pv in enumerate(_list(_field(lg, "pool_views", path), f"{path}.pool_views")):
            vp = f"{path}.pool_views[{v}]"
            pools = pool_groups[g]
            pool = pools[_int(_field(pv, "pool_idx", vp), f"{vp}.pool_idx", 0, max(0, len(pools) - 1))] \
                if pools else None
            if pool is None:
                raise InputError(f"page table: {vp}.pool_idx names a pool of the empty pool group {g}")
            names = _list(_field(pv, "pool_role", vp), f"{vp}.pool_role")
            if len(names) != 1 or not isinstance(names[0], str):
                raise InputError(f"page table: {vp}.pool_role must name exactly one role, got {repr(names)[:80]}")
            if names[0] not in roles:
                raise InputError(f"page table: {vp}.pool_role {names[0]!r} is not a DeepSeek-V4 cache role kvbridge "
                                 f"knows ({', '.join(sorted(roles))}); pass roles= to name it")
            role, part = roles[names[0]]
            kind = _int(_field(pv, "mapper_kind", vp), f"{vp}.mapper_kind", 0, 1)
            entries = _list(_field(pv, "buffer_entries", vp), f"{vp}.buffer_entries")
            if kind == _FLAT:
                if entries:
                    raise InputError(f"page table: {vp}.buffer_entries must be empty for a flat view (mapper_kind 1)")
                if not order:
                    raise InputError(f"page table: {path}.local_layers is empty, so flat view {vp} has no layers")
                stride = pool.slot_bytes // len(order)
                rows = [(lid, i * stride, stride) for i, lid in enumerate(order)]
            else:
                rows = []
                for e, entry in enumerate(entries):
                    ep = f"{vp}.buffer_entries[{e}]"
                    row = _list(entry, ep)
                    if len(row) != 3:
                        raise InputError(f"page table: {ep} must be [local_layer_id, offset, size], got "
                                         f"{repr(row)[:60]}")
                    rows.append(tuple(_int(x, f"{ep}[{n}]") for n, x in enumerate(row)))
            buffers = []
            for e, (lid, offset, size) in enumerate(rows):
                ep = f"{vp}.buffer_entries[{e}]"
                if lid not in local:
                    raise InputError(f"page table: {ep} names local layer {lid}, which {path}.local_layers lacks")
                if size < 1 or offset + size > pool.slot_bytes:
                    raise InputError(f"page table: {ep} spans bytes [{offset}, {offset + size}) of a "
                                     f"{pool.slot_bytes}-byte slot")
                buffers.append(Buffer(_layer(local[lid], attn_types), role, part, offset, size))
            views.append(PoolView(pool, tuple(buffers), vp))
        groups.append(tuple(views))
    return PageTable(tpb, tuple(groups))


def _table_name(profile: EngineProfile, model: ModelTopology, buf: Buffer, path: str) -> str:
    spec = next((c for c in model.all_caches(True) if c.layer == buf.layer and c.role == buf.role), None)
    if spec is None:
        raise InputError(f"page table: {path} holds layer {buf.layer} {buf.role.value}, which {model.name} "
                         "does not have")
    st = profile.storage(spec)
    if buf.part == 1 and st.score_table is None:
        raise InputError(f"page table: {path}: {profile.spec} keeps no separate score pool for {buf.role.value}")
    return st.score_table if buf.part == 1 else st.table


def _group_tables(pt: PageTable, profile: EngineProfile, model: ModelTopology) -> list[str | None]:
    """The kvbridge block table each layer group is (None for a group without buffers)."""
    names: list[str | None] = []
    for j, views in enumerate(pt.groups):
        found = {_table_name(profile, model, b, v.path) for v in views for b in v.buffers}
        if len(found) > 1:
            raise InputError(f"page table: page_table.layer_groups[{j}] holds block tables {', '.join(sorted(found))}"
                             f" of {profile.spec}; one layer group is one block table")
        names.append(found.pop() if found else None)
    return names


def _slots(tensor: object, pool: PhysicalPool, path: str) -> torch.Tensor:
    """``[num_slots, slot_bytes]`` view of the pool tensor that starts at the pool's base address."""
    what = f"the pool tensor at base_address {pool.base_address:#x} ({path})"
    if not isinstance(tensor, torch.Tensor) or tensor.dtype != torch.uint8 or not tensor.is_contiguous():
        raise InputError(f"{what} must be a contiguous uint8 torch.Tensor")
    if tensor.data_ptr() != pool.base_address:
        raise InputError(f"{what} starts at {tensor.data_ptr():#x}")
    if tensor.numel() < pool.slot_bytes * pool.num_slots:
        raise InputError(f"{what} holds {tensor.numel()} bytes; {pool.num_slots} slots of {pool.slot_bytes} bytes "
                         "need more")
    return tensor.view(-1)[: pool.slot_bytes * pool.num_slots].view(pool.num_slots, pool.slot_bytes)


def engine_pools(table: Mapping | PageTable, buffers: Mapping[int, torch.Tensor], profile: str | EngineProfile,
                 model: str | ModelTopology, *, include_mtp: bool = True,
                 roles: Mapping[str, tuple[Role, int]] = ROLE_NAMES, attn_types: int | None = None) -> EnginePools:
    """``EnginePools`` over TensorRT-LLM's own memory: ``table`` is the ``KVCachePageTable`` dict
    (or ``parse_page_table``'s result), ``buffers`` maps each pool's ``base_address`` to the uint8
    tensor that starts there (the cache manager's pool tensors, any device). ``profile`` is the
    TensorRT-LLM engine spec (e.g. ``trtllm:fp8:tpb=128``); every buffer's size must equal that
    profile's page bytes for its cache. Reads and writes go to TensorRT-LLM's slots in place."""
    pt = table if isinstance(table, PageTable) else parse_page_table(table, roles=roles, attn_types=attn_types)
    prof, topo = parse_engine(profile), get_model(model)
    if prof.engine != "trtllm":
        raise InputError(f"profile must be a TensorRT-LLM spec (trtllm:...), got {prof.spec}")
    _group_tables(pt, prof, topo)
    parts: dict[tuple[int, Role], dict[int, torch.Tensor]] = {}
    for views in pt.groups:
        for v in views:
            slots = _slots(buffers.get(v.pool.base_address), v.pool, v.path)
            for e, b in enumerate(v.buffers):
                spec = next(c for c in topo.all_caches(True) if c.layer == b.layer and c.role == b.role)
                st = prof.storage(spec)
                if b.role == Role.SWA and st.page_size != pt.tokens_per_block:
                    raise InputError(f"page table: tokens_per_block {pt.tokens_per_block} differs from "
                                     f"{prof.spec}'s {st.page_size}")
                widths = pool_shapes(st)
                if b.part >= len(widths) or b.size != widths[b.part]:
                    raise InputError(f"page table: {v.path}.buffer_entries[{e}] is {b.size} bytes; layer {b.layer} "
                                     f"{b.role.value} pages of {prof.spec} are {widths[min(b.part, len(widths) - 1)]}")
                got = parts.setdefault((b.layer, b.role), {})
                if b.part in got:
                    raise InputError(f"page table: {v.path}.buffer_entries[{e}]: layer {b.layer} {b.role.value} "
                                     "appears twice")
                got[b.part] = slots[:, b.offset : b.offset + b.size]
    pools: dict[tuple[int, Role], Pool] = {}
    for key, got in parts.items():
        if sorted(got) == [0, 1]:
            pools[key] = (got[0], got[1])
        elif sorted(got) == [0]:
            pools[key] = got[0]
        else:
            raise InputError(f"page table: layer {key[0]} {key[1].value} lacks its kv rows pool")
    if not include_mtp:
        mtp = {(c.layer, c.role) for c in topo.all_caches(True)} - {(c.layer, c.role) for c in topo.all_caches(False)}
        pools = {k: p for k, p in pools.items() if k not in mtp}
    return EnginePools.wrap(prof, topo, pools, include_mtp=include_mtp)


def request_tables(table: Mapping | PageTable, slot_ids: Mapping[int, Sequence[int]], profile: str | EngineProfile,
                   model: str | ModelTopology, *, roles: Mapping[str, tuple[Role, int]] = ROLE_NAMES,
                   attn_types: int | None = None) -> RequestTables:
    """A request's kvbridge block tables from its slot ids per layer group (``slot_ids[j]``: the
    slots of ``layer_groups[j]`` in block order, -1 for a block TensorRT-LLM has released)."""
    pt = table if isinstance(table, PageTable) else parse_page_table(table, roles=roles, attn_types=attn_types)
    prof, topo = parse_engine(profile), get_model(model)
    names = _group_tables(pt, prof, topo)
    if not isinstance(slot_ids, Mapping):
        raise InputError(f"slot_ids must map layer group index -> slot ids, got {type(slot_ids).__name__}")
    tables: RequestTables = {}
    for j, ids in slot_ids.items():
        if isinstance(j, bool) or not isinstance(j, int) or not 0 <= j < len(names):
            raise InputError(f"slot_ids: {j!r} is not a layer group index (0..{len(names) - 1})")
        if names[j] is None:
            raise InputError(f"slot_ids[{j}]: layer group {j} holds no DeepSeek-V4 cache")
        limit = min(v.pool.num_slots for v in pt.groups[j])
        if not isinstance(ids, (list, tuple)):
            raise InputError(f"slot_ids[{j}] must be a list of slot ids, got {type(ids).__name__}")
        for k, s in enumerate(ids):
            if isinstance(s, bool) or not isinstance(s, int) or not -1 <= s < limit:
                raise InputError(f"slot_ids[{j}][{k}] must be a slot id in [0, {limit}) or -1, got {repr(s)[:40]}")
        live = [s for s in ids if s >= 0]
        if len(set(live)) != len(live):
            raise InputError(f"slot_ids[{j}] names a slot twice")
        tables[names[j]] = list(ids)
    return tables
