"""``kvbridge inspect FILE``: what a dump holds, per entry, with NaN/saturation counts and scale histograms."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import click
from rich.table import Table

from .common import LARGE_FILE_BYTES, Name, byte_progress, console, err_console, fmt, json_option, print_json

if TYPE_CHECKING:
    from kvbridge.conformance import WriterReport
    from kvbridge.dumps.dumpfile import Dump

# The library modules that import torch are imported inside the functions that use them, so that
# every command's --help runs without torch.


def identify_writers(dump: Dump, source: Dump) -> dict[str, WriterReport]:
    """``identify_writer`` for each pages entry of ``dump`` that ``source`` also holds."""
    from kvbridge.conformance import identify_writer

    reports = {}
    for entry in dump:
        if entry.layout is not None and entry.name in source.names:
            reports[entry.name] = identify_writer(
                entry.data,
                entry.layout,
                source[entry.name].latents(),
                page_size=entry.page_size,
                num_tokens=entry.num_tokens,
                scale=entry.scale,
            )
    return reports


def histogram_text(hist: dict[int, int]) -> str:
    """``2^k:count`` pairs, smallest exponent first."""
    return "  ".join(f"2^{k}:{c}" for k, c in sorted(hist.items()))


@click.command("inspect", short_help="Show what a dump holds: layouts, tokens, checksums, NaN, scales.")
@click.argument("file", type=click.Path(exists=True, dir_okay=False, path_type=Path))
@click.option(
    "--source",
    metavar="SRC",
    type=click.Path(exists=True, dir_okay=False, path_type=Path),
    help="A dump of the source values (latents or bf16 pages, same entry names): name the writer of each entry.",
)
@json_option
def command(file: Path, source: Path | None, as_json: bool) -> None:
    """Show each entry of dump FILE: layout, pages, tokens, scale, dialect, non-finite and saturation counts.

    Reads in chunks (bounded memory) and verifies each entry's checksum (version-2 files).
    "NaN/Inf" counts decoded values that are not finite (what convert refuses); the JSON also
    counts the codes per format (E4M3 0x7F/0xFF, UE8M0 0xFF, bf16 NaN and Inf). "sat" counts
    E4M3 codes at +-448 of per-tensor layouts (values clipped at the scale); per-tile layouts
    store each tile's maximum at 448 by design, so they show "-" and a histogram of their tile
    scale exponents instead. With --source, each entry's bytes are compared with every encoder
    (dialect, bf16-first or fp32 input, scale) applied to the source values, and the exact
    matches are listed.
    """
    from kvbridge.dumps.dumpfile import CHECKSUM, open_dump, read_dump
    from kvbridge.dumps.stats import dump_stats

    with open_dump(file) as fh:
        visible = fh.data_bytes >= LARGE_FILE_BYTES and err_console.is_terminal and not as_json
        with byte_progress(visible) as bar:
            task = bar.add_task(f"reading {file.name}", total=fh.data_bytes)
            stats = dump_stats(fh, on_progress=lambda done, total: bar.update(task, completed=done, total=total))
        version, attrs = fh.version, fh.attrs
    writers = identify_writers(read_dump(file), read_dump(source)) if source is not None else {}
    checksums = CHECKSUM if version >= 2 else None
    if as_json:
        for s in stats:
            if s["name"] in writers:
                s["writer"] = writers[s["name"]].to_dict()
        print_json({"file": str(file), "version": version, "checksums": checksums, "attrs": attrs, "entries": stats})
        return
    integrity = f"{CHECKSUM} verified" if checksums else "version 1: no checksums"
    table = Table(title=f"{file}\n(kvbridge dump v{version}, {integrity})", box=None, pad_edge=False,
                  header_style="bold")
    table.add_column("entry")
    table.add_column("layout / dialect")
    for col in ("pages×P", "tokens", "scale", "amax", "NaN/Inf", "sat"):
        table.add_column(col, justify="right", no_wrap=True)
    for s in stats:
        bad = s["nonfinite_values"]
        layout = s["layout"] or f"latents {s['dtype']}"
        table.add_row(
            Name(s["name"]),
            Name(layout + (f"\n[dim]{s['dialect']}[/dim]" if s["dialect"] else ""), markup=True),
            "-" if s["num_pages"] is None else f"{s['num_pages']}×{s['page_size']}",
            str(s["num_tokens"]),
            fmt(s["scale"]),
            fmt(s["abs_max"]),
            f"[red]{bad}[/red]" if bad else "0",
            "-" if s["saturated"] is None else str(s["saturated"]),
        )
    console.print(table)
    for key, value in sorted(attrs.items()):
        console.print(f"  [dim]{key}[/dim]: {value}")
    hists = [(s["name"], s["scale_exponents"]) for s in stats if s["scale_exponents"] is not None]
    if hists:
        console.print("[bold]tile scale exponents[/bold] (scale 2^k : tiles)")
        for name, hist in hists:
            console.print(f"  {name}: {histogram_text(hist) or 'no tokens'}")
    if writers:
        console.print(f"[bold]writers reproducing the bytes from {source}[/bold]")
        for name, rep in writers.items():
            if rep.matches:
                console.print(f"  {name}: [green]{'; '.join(rep.matches)}[/green]")
            else:
                best = min(rep.candidates, key=lambda c: c.differing_bytes)
                console.print(
                    f"  {name}: [red]none[/red] (closest: {best.writer}, {best.differing_bytes} bytes differ)"
                )
