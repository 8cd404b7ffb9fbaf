"""How vLLM 0.33.0 hands a DeepSeek-V4 model's caches to a KV connector, in kvbridge's terms (no vLLM import).

``register_kv_caches`` gives one tensor per cache layer, named after the model's modules:
``model.layers.<i>.attn.swa_cache`` (SWA), ``model.layers.<i>.attn`` (compressed KV),
``...attn.indexer.k_cache`` (indexer keys), ``...attn.compressor.state_cache`` and
``...attn.indexer.compressor.state_cache`` (compressor states). Each tensor is a strided view
``[num_blocks, ...]`` into a buffer that other layers (of the same or another KV-cache group)
share: block ``b`` of a layer starts ``b * block_stride`` bytes after the view's first byte and its
page is contiguous there. vLLM groups the layers into KV-cache groups (one block table each per
request); block id 0 is vLLM's null block (a released or never-held block).
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any

import torch

from kvbridge.engines.profiles import EngineProfile
from kvbridge.engines.topology import ModelTopology, Role
from kvbridge.errors import InputError
from kvbridge.migration.plan import MigrationPlan
from kvbridge.migration.pools import EnginePools, RequestTables, copy_entries, gather_records, scatter_records, table_of

_NAME = re.compile(r"^(?:.*\.)?layers\.(\d+)\.attn(\.swa_cache|\.indexer\.k_cache|\.compressor\.state_cache"
                   r"|\.indexer\.compressor\.state_cache)?$")
_ROLE = {".swa_cache": Role.SWA, None: Role.COMPRESS, ".indexer.k_cache": Role.INDEXER,
         ".compressor.state_cache": Role.STATE, ".indexer.compressor.state_cache": Role.INDEXER_STATE}
#: vLLM's null block: what a block table holds for a block the request does not (or no longer) hold.
NULL_BLOCK = 0


def ready_event(device: torch.device) -> Any:
    """On CUDA, an event recorded on the calling thread's current stream (vLLM's, in its step): work that
    waits on it sees every cache write vLLM queued before it. None on the CPU (its writes are done)."""
    if device.type != "cuda":
        return None
    event = torch.cuda.Event()
    event.record(torch.cuda.current_stream(device))
    return event


@contextmanager
def device_order(device: torch.device, after: Any = None) -> Iterator[None]:
    """Run the enclosed device work of a transfer thread on a stream of its own, ordered after ``after``
    (a ``ready_event``) or else after the device's current stream, and finished on the device before this
    returns, raising or not (so a request reported done, or failed and freed, has no write in flight).
    On the CPU there is nothing to order: the work is done when each call returns."""
    if device.type != "cuda":
        yield
        return
    stream = torch.cuda.Stream(device)
    if after is not None:
        stream.wait_event(after)
    else:
        stream.wait_stream(torch.cuda.current_stream(device))
    try:
        with torch.cuda.stream(stream):
            yield
    finally:
        stream.synchronize()


def cache_of(layer_name: str) -> tuple[int, Role] | None:
    """(layer index, role) of a vLLM cache layer name; None for a name that is not a DeepSeek-V4 cache."""
    m = _NAME.match(layer_name)
    return None if m is None else (int(m.group(1)), _ROLE[m.group(2)])


def cache_name(layer: int, role: Role) -> str:
    """The vLLM cache layer name of a DeepSeek-V4 cache (the inverse of ``cache_of``)."""
    suffix = next(s for s, r in _ROLE.items() if r is role)
    return f"model.layers.{layer}.attn{suffix or ''}"


def block_bytes(tensor: torch.Tensor, page_bytes: int, engine_page_bytes: int | None = None) -> torch.Tensor:
    """uint8 ``[num_blocks, page_bytes]`` view of each block's page of a vLLM cache tensor (no copy).

    vLLM's per-layer view shows a block's content; its page (``engine_page_bytes``, the spec's
    ``page_size_bytes``) may extend past it to an alignment (576 B for ``fp8_ds_mla``). The page
    must be what kvbridge's profile expects, the content contiguous, the blocks a page apart or more."""
    if tensor.dim() < 1 or tensor.shape[0] < 1:
        raise InputError(f"a vLLM cache tensor needs a leading block dimension, got shape {list(tensor.shape)}")
    if engine_page_bytes is not None and engine_page_bytes != page_bytes:
        raise InputError(f"vLLM pages this cache in {engine_page_bytes}-B blocks, kvbridge's profile in {page_bytes}-B "
                         "blocks: the connector's engine spec (block size, GPU family, kv layout) does not match "
                         "this vLLM")
    size = tensor.element_size()
    block = tensor[0]
    content = block.numel() * size
    if not block.is_contiguous() or content > page_bytes or (engine_page_bytes is None and content < page_bytes):
        raise InputError(f"a block of this vLLM cache tensor ({content} B, strides {tensor.stride()}) is not one "
                         f"contiguous page of {page_bytes} B")
    stride = tensor.stride(0) * size
    if tensor.shape[0] > 1 and stride < page_bytes:
        raise InputError(f"vLLM cache blocks are {stride} B apart, less than a {page_bytes}-B page")
    raw = torch.empty(0, dtype=torch.uint8, device=tensor.device).set_(tensor.untyped_storage())
    offset = tensor.storage_offset() * size
    if offset + (tensor.shape[0] - 1) * stride + page_bytes > raw.numel():
        raise InputError(f"the last {page_bytes}-B block of this vLLM cache tensor lies past its buffer")
    return raw.as_strided((tensor.shape[0], page_bytes), (stride, 1), offset)


class VllmCaches:
    """A vLLM worker's registered DeepSeek-V4 caches as kvbridge pools, and where each cache's blocks are.

    ``group_layers[g]``: the layer names of KV-cache group g (``KVCacheConfig.kv_cache_groups``).
    ``page_bytes``: vLLM's page size per layer name (its specs' ``page_size_bytes``), checked against
    the profile. Every cache of ``model`` must be registered, its MTP layers' (``num_layers ..``) exactly
    when ``include_mtp`` (vLLM serves with the model's MTP draft); names that are not DeepSeek-V4 caches,
    or of layers the model does not have, are refused.
    """

    def __init__(self, profile: EngineProfile, model: ModelTopology, kv_caches: Mapping[str, torch.Tensor],
                 group_layers: Sequence[Sequence[str]], page_bytes: Mapping[str, int] | None = None,
                 include_mtp: bool = False):
        self.profile, self.model, self.include_mtp = profile, model, include_mtp
        self.group: dict[tuple[int, Role], int] = {}
        self.names: dict[tuple[int, Role], str] = {}
        last = model.total_layers if include_mtp else model.num_layers
        for g, names in enumerate(group_layers):
            for name in names:
                key = cache_of(name)
                if key is None:
                    raise InputError(f"vLLM cache layer {name!r} is not a DeepSeek-V4 cache kvbridge knows")
                if key[0] >= last:
                    what = (f"an MTP layer of {model.name}, but vLLM serves without its MTP draft"
                            if key[0] < model.total_layers else
                            f"past {model.name}'s {model.num_layers} layers and {model.num_mtp_layers} MTP layers")
                    raise InputError(f"vLLM cache layer {name!r} is {what}; is the model {model.name}?")
                self.group[key], self.names[key] = g, name
        pools = {}
        for spec in model.all_caches(include_mtp):
            key = (spec.layer, spec.role)
            name = self.names.get(key)
            if name is None or name not in kv_caches:
                mtp = " (an MTP layer: vLLM's MTP draft registers it)" if model.is_mtp(spec.layer) else ""
                raise InputError(f"vLLM registered no cache for layer {spec.layer} {spec.role.value}{mtp} "
                                 f"(expected {name or cache_name(spec.layer, spec.role)}); is the model "
                                 f"{model.name}?")
            pools[key] = block_bytes(kv_caches[name], profile.storage(spec).page_bytes,
                                     None if page_bytes is None else page_bytes[name])
        self.pools = EnginePools.wrap(profile, model, pools, include_mtp=include_mtp)
        self.device = next(iter(pools.values())).device

    def tables(self, block_ids: Sequence[Sequence[int]]) -> list[list[int]]:
        """A request's block ids per group, vLLM's null block read as released (-1)."""
        if len(block_ids) != 1 + max(self.group.values(), default=-1):
            raise InputError(f"vLLM gave block ids for {len(block_ids)} KV-cache groups, the model's caches "
                             f"are in {1 + max(self.group.values(), default=-1)}")
        return [[-1 if b == NULL_BLOCK else int(b) for b in ids] for ids in block_ids]

    def check(self, transfers: Sequence, block_ids: Sequence[Sequence[int]], *, side: str = "dst",
              keep: Sequence[Sequence[int]] = ()) -> list[list[int]]:
        """The request's tables (``tables``) once every live entry of ``transfers`` (in its ``side``'s
        format) has a block of this pool in its group, none of the blocks ``keep`` names for that group (the
        request's prefix-cache hit: vLLM's own bytes, possibly shared with other requests); ``InputError``
        (nothing was written) otherwise."""
        if side not in ("src", "dst"):
            raise InputError(f"side must be 'src' or 'dst', got {side!r}")
        tables = self.tables(block_ids)
        for t in transfers:
            g = self.group[(t.spec.layer, t.spec.role)]
            table, kept = tables[g], set(keep[g]) if keep else set()
            num_blocks = self.pools.pool(t.spec).shape[0]
            for slot in t.table_slots(getattr(t, side)):
                if slot >= len(table) or not 0 <= table[slot] < num_blocks or table[slot] in kept:
                    have = "missing" if slot >= len(table) else f"block {table[slot]}"
                    if slot < len(table) and table[slot] in kept:
                        have += ", a block of its prefix-cache hit"
                    raise InputError(f"layer {t.spec.layer} {t.spec.role.value}: entries need block-table index "
                                     f"{slot} of its vLLM KV-cache group, which is {have}; nothing was written")
        return tables

    def write(self, transfers: Sequence, records: Sequence[torch.Tensor], block_ids: Sequence[Sequence[int]], *,
              side: str = "dst", keep: Sequence[Sequence[int]] = ()) -> None:
        """Write each transfer's records (in its ``side``'s format: this vLLM is the plan's ``dst`` or
        ``src``) through the block ids of its layer's group.

        Every block is checked before any byte is written (``check``): a live entry in a null, missing,
        out-of-pool or kept (``keep``) block raises ``InputError`` and leaves the caches untouched."""
        tables = self.check(transfers, block_ids, side=side, keep=keep)
        pairs = list(zip(transfers, records, strict=True))
        for t, rec in pairs:
            st = getattr(t, side)
            if tuple(rec.shape) != (t.count, st.record_bytes):
                raise InputError(f"layer {t.spec.layer} {t.spec.role.value}: {list(rec.shape)} records, the plan "
                                 f"wants [{t.count}, {st.record_bytes}]; nothing was written")
        with device_order(self.device):  # one copy of each transfer's records onto the device, then scattered there
            for t, rec in pairs:
                scatter_records(self.pools.pool(t.spec), getattr(t, side),
                                tables[self.group[(t.spec.layer, t.spec.role)]], t.first, rec.to(self.device))

    def write_from(self, transfers: Sequence, src: EnginePools, src_tables: RequestTables,
                   block_ids: Sequence[Sequence[int]], *, keep: Sequence[Sequence[int]] = ()) -> None:
        """``write`` of each transfer's entries held in ``src`` (pools in this vLLM's layout, such as the NIXL
        landing area) at ``src_tables``: straight from ``src``'s pages into the blocks, one span copy per run
        in one page of each, where both are on one device; gathered first and written (``write``: one copy onto
        the device) where they are not. Checked as ``write`` checks, before any byte is written."""
        tables = self.check(transfers, block_ids, keep=keep)
        pending = []
        with device_order(self.device):
            for t in transfers:
                pool, table = src.pool(t.spec), table_of(src_tables, t.dst)
                if not copy_entries(pool, table, self.pools.pool(t.spec),
                                    tables[self.group[(t.spec.layer, t.spec.role)]], t.dst, t.first, t.count):
                    pending.append((t, gather_records(pool, t.dst, table, t.first, t.count)))
        if pending:
            self.write([t for t, _ in pending], [rec for _, rec in pending], block_ids, keep=keep)

    def request_pools(self, plan: MigrationPlan, block_ids: Sequence[Sequence[int]], ready: Any = None
                      ) -> tuple[EnginePools, RequestTables]:
        """A finished request's blocks as compact source pools for ``plan`` in host memory, where the
        transports stage (one copy of its held blocks: gathered on the device after ``ready``, the
        ``ready_event`` of the step that wrote them, then copied to the host once).

        vLLM may give caches that kvbridge addresses through one block table (e.g. every layer's
        SWA) groups of their own, with block ids of their own: each cache's held blocks are copied
        in table order, so one kvbridge table addresses them all."""
        tables = self.tables(block_ids)
        held: dict[str, set[int]] = {}
        for t in plan.transfers:
            held.setdefault(t.src.table, set()).update(t.table_slots(t.src))
        order = {name: sorted(slots) for name, slots in held.items()}
        request: RequestTables = {name: [-1] * n for name, n in plan.table_lengths("src").items()}
        for name, slots in order.items():
            for k, slot in enumerate(slots):
                request[name][slot] = k
        picks = {}
        for spec in self.model.all_caches(self.include_mtp):
            key, st = (spec.layer, spec.role), self.profile.storage(spec)
            ids, pool = tables[self.group[key]], self.pools.pool(spec)
            picked = []
            for slot in order.get(st.table, []):
                if slot >= len(ids) or not 0 <= ids[slot] < pool.shape[0]:
                    raise InputError(f"layer {spec.layer} {spec.role.value}: the request holds no vLLM block at "
                                     f"block-table index {slot} of its group")
                picked.append(ids[slot])
            picks[key] = (pool, torch.tensor(picked, dtype=torch.long, device=self.device))
        with device_order(self.device, ready):
            pools = {key: pool[idx].to("cpu") for key, (pool, idx) in picks.items()}
        return EnginePools.wrap(self.profile, self.model, pools, include_mtp=self.include_mtp), request
