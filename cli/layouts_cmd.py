"""``kvbridge layouts``: the layout registry as a table (fits 80-120 columns) or JSON."""

from __future__ import annotations

from typing import TYPE_CHECKING

import click
from rich import box
from rich.table import Table

from .common import Name, console, json_option, print_json

if TYPE_CHECKING:
    from kvbridge.layouts import Layout

# The library modules that import torch are imported inside the functions that use them, so that
# every command's --help runs without torch.

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
        "experimental": lay.experimental or None,
    }


def fields_text(record: dict) -> str:
    """``name format @offset+bytes`` for each field of a token record."""
    return ", ".join(
        f"{f['name']} {f['format'] if f['format'] != f['name'] else ''} @{f['offset']}+{f['bytes']}".replace("  ", " ")
        for f in record["fields"]
    )


def layouts_table(title: str, records: list[dict]) -> Table:
    """One row per layout: name and aliases, bytes per token, example page bytes, placement, dialects."""
    sizes = "/".join(map(str, EXAMPLE_PAGE_SIZES))
    table = Table(title=title, box=box.SIMPLE_HEAD, pad_edge=False)
    table.add_column("layout (aliases)")
    table.add_column("B/tok", justify="right")
    table.add_column(f"page bytes P={sizes}", min_width=17)
    table.add_column("placement", overflow="fold")
    table.add_column("dialects", overflow="fold")
    for r in records:
        aliases = "\n".join(f"[dim]{a}[/dim]" for a in r["aliases"])
        table.add_row(
            Name(r["name"] + (f"\n{aliases}" if aliases else ""), markup=True),
            str(r["bytes_per_token"]),
            "/".join(str(v) for v in r["page_bytes"].values()),
            r["placement"] + (f",\npad to {r['page_align']} B" if r["page_align"] > 1 else ""),
            ("\n".join(r["dialects"]) or "-") + ("\n[dim](per-tensor scale)[/dim]" if r["per_tensor_scale"] else ""),
            end_section=True,
        )
    return table


@click.command("layouts", short_help="List the KV layouts: bytes per token, pages, fields, dialects.")
@json_option
def command(as_json: bool) -> None:
    """List every registered KV layout: bytes per token, page rule, fields, dialects.

    Experimental layouts (written only by open pull requests or unreleased kernels, no engine
    release yet) are listed apart, each with where it comes from."""
    from kvbridge.layouts import all_layouts

    records = [layout_record(lay) for lay in all_layouts()]
    if as_json:
        print_json(records)
        return
    shipped = [r for r in records if not r["experimental"]]
    experimental = [r for r in records if r["experimental"]]
    console.print(layouts_table("kvbridge layouts", shipped))
    if experimental:
        console.print(layouts_table("experimental layouts (no engine release writes them yet)", experimental))
        origin = Table(box=box.SIMPLE_HEAD, pad_edge=False)
        origin.add_column("experimental layout", no_wrap=True)
        origin.add_column("from", overflow="fold")
        for r in experimental:
            origin.add_row(r["name"], r["experimental"])
        console.print(origin)
    fields = Table(title="token record fields (format @byte offset+bytes)", box=box.SIMPLE_HEAD, pad_edge=False)
    fields.add_column("layout", no_wrap=True)
    fields.add_column("fields", overflow="fold")
    for r in records:
        fields.add_row(r["name"], fields_text(r))
    console.print(fields)
