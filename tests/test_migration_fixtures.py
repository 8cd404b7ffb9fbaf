"""Migrated indexer keys equal what the destination engine's own writer wrote, on the engines' fixtures.

Each source pool holds indexer records written by the source engine's writer (fixtures/); after
a migration, the destination's records must equal the destination writer's output for the
decoded source values (``cross_indexer_reference.safetensors``: vLLM's fp8 writer run on CPU,
golden; SGLang's C4 fp4 kernel computes DeepGEMM's ``per_token_cast_to_fp4`` rule, so DeepGEMM's
own output, run on CPU, is its golden; TensorRT-LLM's and SGLang's CUDA fp8 writers
re-implemented, derived). Both directions of each engine pair (SGLang only with SGLang: with the
others its compressor state is refused, see tests/test_engines.py).
"""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from kvbridge.conformance import default_fixtures_dir, indexer_source_records
from kvbridge.engines.topology import FLASH, Role
from kvbridge.migration import destination_pools, gather_records, migrate_local, plan_migration, source_request
from kvbridge.migration.pools import scatter_records, table_of

MODEL = FLASH.with_layers(3)  # layers 0 and 1 SWA-only, layer 2 ratio 4 (the indexer)
#: engine spec -> the fixture writer whose records its indexer pool holds
SPEC_WRITER = {
    "sglang:idx=fp4": "fp4.sglang",
    "sglang": "fp8.sglang",
    "vllm": "fp8.vllm",
    "vllm:gpu=sm100": "fp8.vllm-ue8m0",
    "trtllm": "fp4.trtllm",
    "trtllm:idx=fp8": "fp8.trtllm",
}
#: destination writer -> golden fixture writer producing its bytes
GOLDEN_DESTINATIONS = {"fp8.vllm": "fp8.vllm", "fp8.vllm-ue8m0": "fp8.vllm-ue8m0", "fp4.sglang": "fp4.deepgemm"}
PAIRS = [
    ("trtllm", "vllm"), ("vllm", "trtllm"),
    ("trtllm:idx=fp8", "vllm"), ("vllm", "trtllm:idx=fp8"),
    ("trtllm", "vllm:gpu=sm100"), ("vllm:gpu=sm100", "trtllm"),
    ("vllm", "vllm:gpu=sm100"), ("vllm:gpu=sm100", "vllm"),
    ("trtllm", "trtllm:idx=fp8"), ("trtllm:idx=fp8", "trtllm"),
    ("sglang", "sglang:idx=fp4"), ("sglang:idx=fp4", "sglang"),
]


@pytest.fixture(scope="module")
def fixtures():
    root = default_fixtures_dir()
    cross = load_file(str(root / "cross_indexer_reference.safetensors"))
    return indexer_source_records(root, torch.device("cpu")), cross


@pytest.mark.parametrize(("src_spec", "dst_spec"), PAIRS)
def test_migrated_indexer_keys_equal_the_destination_writer(fixtures, src_spec, dst_spec):
    sources, cross = fixtures
    src_key, dst_key = SPEC_WRITER[src_spec], SPEC_WRITER[dst_spec]
    records = sources[src_key]
    plan = plan_migration(src_spec, dst_spec, MODEL, 4 * records.shape[0])
    src, src_tables = source_request(plan, seed=4)
    t = next(t for t in plan.transfers if t.spec.role == Role.INDEXER)
    assert (t.first, t.count) == (0, records.shape[0])
    scatter_records(src.pool(t.spec), t.src, table_of(src_tables, t.src), 0, records)  # the source engine's bytes
    dst = destination_pools(plan)
    tables, _ = migrate_local(plan, src, src_tables, dst)
    got = gather_records(dst.pool(t.spec), t.dst, table_of(tables, t.dst), 0, t.count)
    golden = GOLDEN_DESTINATIONS.get(dst_key)
    key = f"{src_key}->{golden}" if golden else f"derived:{src_key}->{dst_key}"
    assert torch.equal(got, cross[key]), key
