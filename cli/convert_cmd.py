"""``kvbridge convert IN OUT --to LAYOUT``: convert every entry of a dump, atomically, with a loss report."""

from __future__ import annotations

from pathlib import Path

import click
from rich.table import Table

from .common import (
    LARGE_FILE_BYTES,
    console,
    entry_progress,
    fmt,
    json_option,
    parse_layout,
    parse_scale,
    print_json,
)
from kvbridge.dump import DumpEntry, convert_dump
from kvbridge.errors import InputError
from kvbridge.layouts import Layout


@click.command("convert", short_help="Convert a dump to another layout (atomic, with a loss report).")
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
    type=click.IntRange(min=1),
    help="Destination tokens per page (default: each entry's own).",
)
@click.option("--dialect", metavar="D", help="Encoder dialect of the destination (default: the layout's first).")
@click.option(
    "--scale",
    metavar="S|auto",
    callback=parse_scale,
    help="Destination per-tensor scale (trtllm-fp8): a number or 'auto'.",
)
@click.option("--force", is_flag=True, help="Overwrite OUT if it exists.")
@json_option
def command(
    src: Path,
    dst: Path,
    to_layout: Layout,
    page_size: int | None,
    dialect: str | None,
    scale: float | str | None,
    force: bool,
    as_json: bool,
) -> None:
    """Convert dump IN to layout --to and write dump OUT (atomically; OUT is untouched on failure).

    Lossy directions (for example flashmla-model1 -> trtllm-fp8) print a loss report measured
    against the decoded source; `--scale auto` picks per entry the smallest scale that does not saturate.
    """
    if dialect is not None and dialect not in to_layout.dialects:
        allowed = ", ".join(to_layout.dialects) or "none"
        raise click.BadParameter(
            f"{dialect!r} does not apply to {to_layout.name} (allowed: {allowed})", param_hint="--dialect"
        )
    if scale is not None and not to_layout.per_tensor_scale:
        raise click.BadParameter(
            f"{to_layout.name} has per-tile scales; --scale applies to trtllm-fp8", param_hint="--scale"
        )
    if dst.exists() and not force:
        raise InputError(f"{dst} exists; pass --force to overwrite it")
    with entry_progress(visible=src.stat().st_size >= LARGE_FILE_BYTES and console.is_terminal) as bar:
        task = bar.add_task(f"converting {src.name}", total=None)

        def advance(done: int, total: int, entry: DumpEntry) -> None:
            bar.update(task, completed=done, total=total, description=f"converted {entry.name}")

        converted = convert_dump(
            src, dst, to_layout, page_size=page_size, dialect=dialect, scale=scale, overwrite=force, on_entry=advance
        )
    lossless = all(c.report.lossless for c in converted)
    if as_json:
        print_json(
            {
                "input": str(src),
                "output": str(dst),
                "to": to_layout.name,
                "lossless": lossless,
                "entries": [{"name": c.name, **c.report.to_dict()} for c in converted],
            }
        )
        return
    moved = sum(c.report.byte_move for c in converted)
    console.print(
        f"wrote {dst}: {len(converted)} entries as {to_layout.name} "
        f"({moved} byte moves, {len(converted) - moved} re-encoded)"
    )
    if lossless:
        console.print("[green]lossless[/green]: every decoded value equals the source's")
        return
    table = Table(title="loss report (errors against the decoded source)", box=None, header_style="bold")
    table.add_column("entry", no_wrap=True)
    for col in ("scale", "max abs", "max rel", "rms", "saturated", "to zero"):
        table.add_column(col, justify="right", no_wrap=True)
    for c in converted:
        r = c.report
        table.add_row(
            c.name,
            fmt(r.dst_scale),
            fmt(r.max_abs_error),
            fmt(r.max_rel_error),
            fmt(r.rms_error),
            str(r.saturated),
            str(r.flushed_to_zero),
        )
    console.print(table)
