"""``kvbridge convert IN OUT --to LAYOUT``: convert every entry of a dump, streamed and atomic, with a loss report."""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING

import click
from rich.table import Table

from kvbridge.errors import InputError

from .common import (
    LARGE_FILE_BYTES,
    Name,
    byte_progress,
    console,
    err_console,
    fmt,
    header_unverified,
    json_option,
    parse_layout,
    parse_scale,
    plural,
    print_json,
)

if TYPE_CHECKING:
    from kvbridge.layouts import Layout

# The library modules that import torch are imported inside the functions that use them, so that
# every command's --help runs without torch.


def convert_open_dump(*args, **kwargs):
    """``kvbridge.dumps.convert.convert_open_dump`` (torch), imported when a conversion runs."""
    from kvbridge.dumps.convert import convert_open_dump as convert

    return convert(*args, **kwargs)


@click.command("convert", short_help="Convert a dump to another layout (streamed, atomic, loss report).")
@click.argument("src", metavar="IN", type=click.Path(exists=True, dir_okay=False, path_type=Path))
@click.argument("dst", metavar="OUT", type=click.Path(dir_okay=False, path_type=Path))
@click.option(
    "--to",
    "to_layout",
    metavar="LAYOUT",
    required=True,
    callback=parse_layout,
    help="Destination layout (see `kvbridge layouts`).",
)
@click.option(
    "--page-size",
    metavar="P",
    type=click.IntRange(min=1, max=2**20),
    help="Destination tokens per page (default: each entry's own).",
)
@click.option("--dialect", metavar="D", help="Encoder dialect of the destination (default: the layout's first).")
@click.option(
    "--scale",
    metavar="S|auto",
    callback=parse_scale,
    help="Destination per-tensor scale: trtllm-fp8's (a number or 'auto') or flashinfer-nvfp4's global scale "
         "(a number).",
)
@click.option("--no-report", is_flag=True, help="Skip the loss report (faster for lossy directions).")
@click.option("--force", is_flag=True, help="Overwrite OUT if it exists.")
@json_option
def command(
    src: Path,
    dst: Path,
    to_layout: Layout,
    page_size: int | None,
    dialect: str | None,
    scale: float | str | None,
    no_report: bool,
    force: bool,
    as_json: bool,
) -> None:
    """Convert dump IN to layout --to and write dump OUT (atomically; OUT is untouched on failure).

    Entries stream through in chunks, so memory stays bounded whatever their size. Lossy
    directions (for example flashmla-model1 -> trtllm-fp8) print a loss report measured against
    the decoded source (--no-report skips it). `--scale auto` keeps a lossless path where one
    exists (the source's own scale, s = 1, or another scale that reproduces every value), and otherwise picks
    per entry the smallest scale that does not saturate. A source holding NaN or Inf is refused, byte moves included.
    """
    from kvbridge.dumps.convert import plan_convert
    from kvbridge.dumps.dumpfile import open_dump

    if not force and os.path.lexists(dst) and dst.is_file() and not dst.is_symlink():
        raise InputError(f"{dst} exists; pass --force to overwrite it")
    with open_dump(src) as fh:
        header_ok = fh.header_verified
        if not header_ok:
            err_console.print(f"[yellow]warning[/yellow]: {src}: {header_unverified(fh.version)}")
        try:
            plans = plan_convert(fh, to_layout, page_size=page_size, dialect=dialect, scale=scale)
        except InputError as exc:
            raise click.UsageError(str(exc)) from None
        visible = fh.data_bytes >= LARGE_FILE_BYTES and err_console.is_terminal and not as_json
        with byte_progress(visible) as bar:
            task = bar.add_task(f"converting {src.name}", total=None)
            converted = convert_open_dump(
                fh,
                plans,
                dst,
                overwrite=force,
                report=not no_report,
                on_progress=lambda done, total: bar.update(task, completed=done, total=total),
            )
    moved = sum(p.byte_move for p in plans)
    reports = [c.report for c in converted if c.report is not None]
    lossless = bool(moved == len(plans) or (not no_report and all(r.lossless for r in reports)))
    if as_json:
        print_json(
            {
                "input": str(src),
                "output": str(dst),
                "to": to_layout.name,
                "input_header_verified": header_ok,
                "lossless": lossless if (not no_report or moved == len(plans)) else None,
                "entries": [
                    {"name": c.name, "byte_move": p.byte_move, **(c.report.to_dict() if c.report else {})}
                    for c, p in zip(converted, plans, strict=True)
                ],
            }
        )
        return
    console.print(f"wrote {dst}")
    n = len(converted)
    console.print(f"{plural(n, 'entry', 'entries')} as {to_layout.name}: {plural(moved, 'byte move')}, "
                  f"{n - moved} re-encoded")
    if moved == len(plans) or (not no_report and lossless):
        console.print("[green]lossless[/green]: every decoded value equals the source's")
        return
    if no_report:
        console.print("loss report skipped (--no-report)")
        return
    table = Table(title="loss report (errors against the decoded source)", box=None, header_style="bold")
    table.add_column("entry")
    for col in ("scale", "max abs", "max rel", "rms", "saturated", "to zero"):
        table.add_column(col, justify="right", no_wrap=True)
    for c in converted:
        r = c.report
        table.add_row(
            Name(c.name),
            fmt(r.dst_scale),
            fmt(r.max_abs_error),
            fmt(r.max_rel_error),
            fmt(r.rms_error),
            str(r.saturated),
            str(r.flushed_to_zero),
        )
    console.print(table)
    for note in dict.fromkeys(c.report.note for c in converted if c.report.note):
        console.print(f"[dim]{to_layout.name}:[/dim] {note}")
