"""kvbridge.adapters.trtllm: TensorRT-LLM's ``KVCachePageTable`` dict and slot ids as migration pools.

The TensorRT-LLM side is modelled as its transceiver sees it: one uint8 buffer per layer group
(block table), each slot holding every layer's page of that group at the offsets the page table
states (``base + slot * slot_bytes + offset``); the indexer group as a flat view. A migration
through the adapter must give exactly the bytes of the same migration through plain pools.
"""

from __future__ import annotations

import copy

import pytest
import torch

from kvbridge.adapters import trtllm
from kvbridge.engines.topology import FLASH, Role
from kvbridge.errors import InputError
from kvbridge.migration import EnginePools, destination_pools, migrate_local, plan_migration, source_request
from kvbridge.migration.pools import pool_tensors

MODEL = FLASH.with_layers(4)
TRT = "trtllm:fp8:tpb=128"
TOKENS = 700
NAMES = {v: k for k, v in trtllm.ROLE_NAMES.items()}
ATTN_TYPES = 5  # virtual layer ids: model layer * 5 + role index


def trtllm_memory(pools: EnginePools) -> tuple[dict, dict[int, torch.Tensor], list[str]]:
    """TensorRT-LLM-shaped buffers holding ``pools``' bytes, its page table dict and each layer group's table."""
    groups: dict[str, list[tuple[int, Role, int, torch.Tensor]]] = {}
    for spec in MODEL.all_caches(True):
        st = pools.storage(spec)
        for part, t in enumerate(pool_tensors(pools.pool(spec))):
            name = st.score_table if part == 1 else st.table
            groups.setdefault(name, []).append((spec.layer, spec.role, part, t))
    buffers, pool_groups, layer_groups, names = {}, [], [], []
    roles = list(Role)
    for j, (name, parts) in enumerate(sorted(groups.items())):
        slot_bytes = sum(t.shape[1] for *_, t in parts)
        num_slots = parts[0][3].shape[0]
        mem = torch.zeros(num_slots * slot_bytes, dtype=torch.uint8)
        slots = mem.view(num_slots, slot_bytes)
        entries, local_layers, offset = [], [], 0
        for i, (layer, role, _, t) in enumerate(parts):
            slots[:, offset : offset + t.shape[1]] = t
            local_layers.append({"local_layer_id": 100 + i, "global_layer_id": layer * ATTN_TYPES + roles.index(role)})
            entries.append([100 + i, offset, t.shape[1]])
            offset += t.shape[1]
        buffers[mem.data_ptr()] = mem
        pool_groups.append({"pools": [{"base_address": mem.data_ptr(), "slot_bytes": slot_bytes,
                                       "num_slots": num_slots}]})
        flat = name.startswith("indexer") and not name.startswith("indexer_state")
        layer, role, part, _ = parts[0]
        layer_groups.append({
            "pool_group_idx": j, "kv_head_num_per_rank": 1, "sliding_window_size": None,
            "local_layers": local_layers,
            "pool_views": [{"pool_idx": 0, "buffer_entries": [] if flat else entries,
                            "pool_role": [NAMES[(role, part)]], "mapper_kind": 1 if flat else 0}],
        })
        names.append(name)
    return {"tokens_per_block": 128, "layer_groups": layer_groups, "pool_groups": pool_groups}, buffers, names


def test_trtllm_request_migrates_to_vllm_through_the_page_table():
    plan = plan_migration(TRT, "vllm", MODEL, TOKENS)
    src, src_tables = source_request(plan)
    table, buffers, names = trtllm_memory(src)
    assert any(g["pool_views"][0]["mapper_kind"] == 1 for g in table["layer_groups"])  # the flat indexer view
    pools = trtllm.engine_pools(table, buffers, TRT, MODEL, attn_types=ATTN_TYPES)
    tables = trtllm.request_tables(table, {j: src_tables[n] for j, n in enumerate(names)}, TRT, MODEL,
                                   attn_types=ATTN_TYPES)
    assert tables == src_tables
    via, plain = destination_pools(plan), destination_pools(plan)
    got_tables, rep = migrate_local(plan, pools, tables, via)
    want_tables, _ = migrate_local(plan, src, src_tables, plain)
    assert got_tables == want_tables and rep.loss
    for key, pool in plain.pools.items():
        for a, b in zip(pool_tensors(pool), pool_tensors(via.pools[key]), strict=True):
            assert torch.equal(a, b), key


def test_vllm_request_lands_in_trtllm_slots():
    plan = plan_migration("vllm", TRT, MODEL, TOKENS)
    src, src_tables = source_request(plan)
    plain = EnginePools.create(TRT, MODEL, plan.held_pages("dst"))
    table, buffers, names = trtllm_memory(plain)  # zeros, the same geometry
    pools = trtllm.engine_pools(table, buffers, TRT, MODEL, attn_types=ATTN_TYPES)
    got_tables, _ = migrate_local(plan, src, src_tables, pools)
    want_tables, _ = migrate_local(plan, src, src_tables, plain)
    assert got_tables == want_tables
    _, want, _ = trtllm_memory(plain)  # the plain pools' bytes packed into slots the same way
    for mem, expected in zip(buffers.values(), want.values(), strict=True):
        assert torch.equal(mem, expected)


def test_without_mtp_layers():
    plan = plan_migration(TRT, "vllm", MODEL, TOKENS, include_mtp=False)
    src, src_tables = source_request(plan)
    full = EnginePools.create(TRT, MODEL, {k: v for k, v in src.pages_per_table.items()})
    for key, pool in src.pools.items():
        for a, b in zip(pool_tensors(pool), pool_tensors(full.pools[key]), strict=True):
            b.copy_(a)
    table, buffers, names = trtllm_memory(full)
    pools = trtllm.engine_pools(table, buffers, TRT, MODEL, include_mtp=False, attn_types=ATTN_TYPES)
    assert set(pools.pools) == set(src.pools)


@pytest.fixture(scope="module")
def memory():
    return trtllm_memory(EnginePools.create(TRT, MODEL, plan_migration(TRT, "vllm", MODEL, 300).held_pages("src")))


def _set(d: dict, path: list, value) -> None:
    for k in path[:-1]:
        d = d[k]
    if value is KeyError:
        del d[path[-1]]
    else:
        d[path[-1]] = value


@pytest.mark.parametrize(("path", "value", "message"), [
    (["tokens_per_block"], KeyError, "page_table.tokens_per_block is missing"),
    (["tokens_per_block"], "128", "page_table.tokens_per_block must be an integer"),
    (["pool_groups", 0, "pools", 0, "slot_bytes"], -1, "page_table.pool_groups[0].pools[0].slot_bytes"),
    (["pool_groups", 0, "pools", 0, "num_slots"], True, "page_table.pool_groups[0].pools[0].num_slots"),
    (["layer_groups", 0, "pool_group_idx"], 99, "page_table.layer_groups[0].pool_group_idx"),
    (["layer_groups", 0, "pool_views", 0, "pool_role"], ["key"], "pool_role 'key' is not a DeepSeek-V4 cache role"),
    (["layer_groups", 0, "pool_views", 0, "pool_role"], ["a", "b"], "must name exactly one role"),
    (["layer_groups", 0, "pool_views", 0, "mapper_kind"], 7, "layer_groups[0].pool_views[0].mapper_kind"),
    (["layer_groups", 0, "local_layers", 0, "local_layer_id"], 5, "names local layer 100"),
    (["layer_groups", 0, "pool_views"], {"x": 1}, "layer_groups[0].pool_views must be a list"),
    (["layer_groups", 0, "mamba_layer_offsets"], {}, "Mamba layer group"),
])
def test_page_table_is_validated_strictly(memory, path, value, message):
    table, buffers, _ = memory
    bad = copy.deepcopy(table)
    _set(bad, path, value)
    with pytest.raises(InputError, match=message.replace("[", r"\[").replace("]", r"\]")):
        trtllm.engine_pools(bad, buffers, TRT, MODEL, attn_types=ATTN_TYPES)


def test_entry_geometry_and_buffers_are_checked(memory):
    table, buffers, names = memory
    j = names.index("swa")
    bad = copy.deepcopy(table)
    bad["layer_groups"][j]["pool_views"][0]["buffer_entries"][0][2] -= 1
    with pytest.raises(InputError, match=rf"layer_groups\[{j}\].pool_views\[0\].buffer_entries\[0\] is 65535 bytes"):
        trtllm.engine_pools(bad, buffers, TRT, MODEL, attn_types=ATTN_TYPES)
    bad = copy.deepcopy(table)
    bad["layer_groups"][j]["pool_views"][0]["buffer_entries"][0][1] = 2**40
    with pytest.raises(InputError, match="spans bytes"):
        trtllm.engine_pools(bad, buffers, TRT, MODEL, attn_types=ATTN_TYPES)
    base = table["pool_groups"][0]["pools"][0]["base_address"]
    with pytest.raises(InputError, match="must be a contiguous uint8"):
        trtllm.engine_pools(table, {**buffers, base: None}, TRT, MODEL, attn_types=ATTN_TYPES)
    with pytest.raises(InputError, match="starts at"):
        trtllm.engine_pools(table, {**buffers, base: buffers[base][1:]}, TRT, MODEL, attn_types=ATTN_TYPES)
    with pytest.raises(InputError, match="tokens_per_block 64 differs"):
        trtllm.engine_pools({**table, "tokens_per_block": 64}, buffers, TRT, MODEL, attn_types=ATTN_TYPES)
    with pytest.raises(InputError, match="holds layer 16 compress, which .* does not have"):
        trtllm.engine_pools(table, buffers, TRT, MODEL)  # virtual layer ids read as model layers
    with pytest.raises(InputError, match="TensorRT-LLM spec"):
        trtllm.engine_pools(table, buffers, "vllm", MODEL, attn_types=ATTN_TYPES)


def test_slot_ids_are_checked(memory):
    table, _, names = memory
    j = names.index("swa")
    limit = table["pool_groups"][j]["pools"][0]["num_slots"]
    cases = (({j: [limit]}, rf"slot_ids\[{j}\]\[0\] must be a slot id"), ({j: [0, 0]}, "names a slot twice"),
             ({j: "0"}, "must be a list"), ({99: [0]}, "not a layer group index"), ({j: [1.0]}, "must be a slot id"))
    for ids, message in cases:
        with pytest.raises(InputError, match=message):
            trtllm.request_tables(table, ids, TRT, MODEL, attn_types=ATTN_TYPES)
    ids = [-1, limit - 1]
    assert trtllm.request_tables(table, {j: ids}, TRT, MODEL, attn_types=ATTN_TYPES) == {"swa": ids}
