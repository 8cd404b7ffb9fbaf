"""``kvbridge inspect FILE``: what a dump holds, per entry, with NaN/saturation counts and scale histograms."""

from __future__ import annotations

from pathlib import Path

import click
from rich.table import Table

from .common import console, fmt, json_option, print_json
from kvbridge.conformance import WriterReport, identify_writer
from kvbridge.dump import Dump, entry_stats, read_dump


def identify_writers(dump: Dump, source: Dump) -> dict[str, WriterReport]:
    """``identify_writer`` for each pages entry of ``dump`` that ``source`` also holds."""
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


@click.command("inspect", short_help="Show what a dump holds: layouts, tokens, NaN/saturation, scales.")
@click.argument("file", type=click.Path(dir_okay=False, path_type=Path))
@click.option(
    "--source",
    metavar="SRC",
    type=click.Path(dir_okay=False, path_type=Path),
    help="A dump of the source values (latents or bf16 pages, same entry names): name the writer of each entry.",
)
@json_option
def command(file: Path, source: Path | None, as_json: bool) -> None:
    """Show each entry of dump FILE: layout, pages, tokens, scale, dialect, NaN and saturation counts.

    NaN counts E4M3 codes 0x7F/0xFF, UE8M0 0xFF and bf16 NaNs; "sat" counts E4M3 codes at +-448.
    Per-tile layouts also get a histogram of their tile scale exponents. With --source, each
    entry's bytes are compared with every encoder (dialect, bf16-first or fp32 input, scale)
    applied to the source values, and the exact matches are listed.
    """
    dump = read_dump(file)
    stats = [entry_stats(e) for e in dump]
    writers = identify_writers(dump, read_dump(source)) if source is not None else {}
    if as_json:
        for s in stats:
            if s["name"] in writers:
                s["writer"] = writers[s["name"]].to_dict()
        print_json({"file": str(file), "version": dump.version, "attrs": dump.attrs, "entries": stats})
        return
    table = Table(title=f"{file} (kvbridge dump v{dump.version})", box=None, pad_edge=False, header_style="bold")
    table.add_column("entry", no_wrap=True)
    table.add_column("layout / dialect", no_wrap=True)
    for col in ("pages×P", "tokens", "scale", "amax", "NaN", "sat"):
        table.add_column(col, justify="right", no_wrap=True)
    for s in stats:
        nan = sum(s["nan"].values())
        layout = s["layout"] or f"latents {s['dtype']}"
        table.add_row(
            s["name"],
            layout + (f"\n[dim]{s['dialect']}[/dim]" if s["dialect"] else ""),
            "-" if s["num_pages"] is None else f"{s['num_pages']}×{s['page_size']}",
            str(s["num_tokens"]),
            fmt(s["scale"]),
            fmt(s["abs_max"]),
            f"[red]{nan}[/red]" if nan else "0",
            str(s["saturated"]) + (f" +{s['inf']} inf" if s["inf"] else ""),
        )
    console.print(table)
    for key, value in sorted(dump.attrs.items()):
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
