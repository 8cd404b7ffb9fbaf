"""``kvbridge layouts``: the layout registry as a table or JSON."""

from __future__ import annotations

import click
from rich.table import Table

from cli.common import console, json_option, print_json
from kvbridge.layouts import Layout, all_layouts

EXAMPLE_PAGE_SIZES = (2, 64, 256)


def layout_record(lay: Layout) -> dict:
    return {
        "name": lay.name,
        "aliases": list(lay.aliases),
        "description": lay.description,
        "bytes_per_token": lay.record_bytes,
        "placement": "block-split" if lay.block_split else "token-major",
        "page_align": lay.page_align,
        "page_bytes": {str(p): lay.page_bytes(p) for p in EXAMPLE_PAGE_SIZES},
        "fields": [
            {"name": f.name, "offset": f.offset, "bytes": f.nbytes, "format": f.format, "dims": f.dims}
            for f in lay.fields
        ],
        "dialects": list(lay.dialects),
        "per_tensor_scale": lay.per_tensor_scale,
        "source": lay.source,
    }


@click.command("layouts")
@json_option
def command(as_json: bool) -> None:
    """List every registered KV layout: bytes per token, page rule, fields, dialects."""
    records = [layout_record(lay) for lay in all_layouts()]
    if as_json:
        print_json(records)
        return
    table = Table(title="kvbridge layouts")
    for col in ("layout", "aliases", "B/token", "placement", "page bytes P=2/64/256", "fields", "dialects"):
        table.add_column(col)
    for r in records:
        table.add_row(
            r["name"],
            ", ".join(r["aliases"]) or "-",
            str(r["bytes_per_token"]),
            r["placement"] + (f", pad to {r['page_align']}" if r["page_align"] > 1 else ""),
            " / ".join(str(v) for v in r["page_bytes"].values()),
            " ".join(f"{f['name']}@{f['offset']}:{f['format']}x{f['bytes']}" for f in r["fields"]),
            ", ".join(r["dialects"]) or "-",
        )
    console.print(table)
