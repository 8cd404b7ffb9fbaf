"""Shared CLI helpers: the rich console, JSON output, option parsers and progress display."""

from __future__ import annotations

import json
import math
from typing import Any

import click
from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

from kvbridge.errors import KVBridgeError
from kvbridge.layouts import Layout, get_layout

console = Console()
err_console = Console(stderr=True)

json_option = click.option("--json", "as_json", is_flag=True, help="Print machine-readable JSON instead of a table.")

#: Input files at least this large (bytes) get a progress bar.
LARGE_FILE_BYTES = 64 * 2**20


def print_json(data: Any) -> None:
    """Write ``data`` as indented JSON on stdout (plain, no rich markup)."""
    click.echo(json.dumps(data, indent=2, sort_keys=False))


def parse_layout(ctx: click.Context, param: click.Parameter, value: str | None) -> Layout | None:
    """Click callback: a registered layout name or alias, else a usage error (exit 2)."""
    if value is None:
        return None
    try:
        return get_layout(value)
    except KVBridgeError as exc:
        raise click.BadParameter(str(exc)) from None


def parse_scale(ctx: click.Context, param: click.Parameter, value: str | None) -> float | str | None:
    """Click callback: ``auto`` or a positive finite number, else a usage error (exit 2)."""
    if value is None or value == "auto":
        return value
    try:
        scale = float(value)
    except ValueError:
        raise click.BadParameter(f"expected a positive number or 'auto', got {value!r}") from None
    if not (math.isfinite(scale) and scale > 0):
        raise click.BadParameter(f"expected a positive finite number or 'auto', got {value!r}")
    return scale


def fmt(value: float | None) -> str:
    """Compact number for tables: '-' for None, 3 significant digits otherwise."""
    return "-" if value is None else f"{value:.3g}"


def entry_progress(visible: bool) -> Progress:
    """A progress bar over dump entries, drawn on stderr only when ``visible``."""
    return Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        TextColumn("{task.completed}/{task.total} entries"),
        TimeElapsedColumn(),
        console=err_console,
        transient=True,
        disable=not visible,
    )
