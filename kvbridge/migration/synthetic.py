"""Synthetic requests for tests, benchmarks and demos: source pools holding one request of a plan,
written with the source engine's own writers, and empty destination pools with room for it.
"""

from __future__ import annotations

import torch

from kvbridge.migration.ape import add_ape
from kvbridge.migration.plan import MigrationPlan
from kvbridge.migration.pools import EnginePools, RequestTables, scatter_records, table_of
from kvbridge.migration.rows import state_rows_from_f32
from kvbridge.ops import keys as ix
from kvbridge.ops import pages as page_ops


def fill_synthetic(plan: MigrationPlan, src: EnginePools, tables: RequestTables, *, seed: int = 0) -> None:
    """Write a synthetic request into source pools with the source engine's own writers.

    KV: latents ~ N(0, 1) per dim (bf16-rounded), a few tokens scaled by 2^-12 to exercise small
    tiles, encoded with ``kvbridge.encode`` in the engine's dialect and scale; indexer keys
    ~ N(0, 1) encoded by the engine's rule; state rows ~ N(0, 1) in the engine's state dtype,
    every fifth row cleared (kv 0, score -inf) as the engines clear unused rows; a source that
    stores score + APE gets the plan's APE added to the raw scores, as that engine writes them.
    """
    gen = torch.Generator().manual_seed(seed)
    for t in plan.transfers:
        st = t.src
        if st.kind == "kv":
            x = torch.randn(t.count, 512, generator=gen).bfloat16().float()
            x[::7] *= 2.0**-12
            pages = page_ops.encode(x, st.layout, page_size=t.count, dialect=st.dialect, scale=st.scale)
            rec = st.layout.pages_to_records(pages, t.count)
        elif st.kind == "indexer":
            rec = ix.encode_keys(torch.randn(t.count, t.spec.width, generator=gen), st.indexer, st.dialect or "")
        else:
            width = st.record_bytes // (2 if st.fmt.endswith("bf16") else 4)
            rows = torch.randn(t.count, width, generator=gen)
            if not st.fmt.startswith("online"):
                rows[::5, : width // 2] = 0.0
                rows[::5, width // 2 :] = float("-inf")
            if t.ape_sign < 0:  # the source stores score + APE
                rows = add_ape(rows, t.ape, t.first)
            rec = state_rows_from_f32(rows, st.fmt)
        scatter_records(src.pool(t.spec), st, table_of(tables, st), t.first, rec)


def source_request(plan: MigrationPlan, *, spare_pages: int = 0, seed: int = 0) -> tuple[EnginePools, RequestTables]:
    """Source pools holding one synthetic request of ``plan`` (scattered page ids, released SWA blocks).

    Each table has room for the pages the request holds plus ``spare_pages``.
    """
    held = plan.held_pages("src")
    pools = EnginePools.create(plan.src, plan.model, {k: v + spare_pages for k, v in held.items()},
                               include_mtp=plan.include_mtp, seed=seed)
    tables = pools.claim(plan.table_lengths("src"), plan.released("src"))
    fill_synthetic(plan, pools, tables, seed=seed)
    return pools, tables


def destination_pools(plan: MigrationPlan, *, spare_pages: int = 0, seed: int | None = 1) -> EnginePools:
    """Empty destination pools with room for the pages ``plan``'s request holds plus ``spare_pages`` per table."""
    held = plan.held_pages("dst")
    return EnginePools.create(plan.dst, plan.model, {k: v + spare_pages for k, v in held.items()},
                              include_mtp=plan.include_mtp, seed=seed)
