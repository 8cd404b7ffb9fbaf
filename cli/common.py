"""Shared CLI helpers: the rich console, JSON output, option parsers and progress display."""

from __future__ import annotations

import contextlib
import json
import math
import os
import re
import struct
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click
from rich.console import Console, ConsoleOptions, RenderResult
from rich.measure import Measurement
from rich.progress import (
    BarColumn,
    DownloadColumn,
    Progress,
    TextColumn,
    TimeRemainingColumn,
    TransferSpeedColumn,
)
from rich.table import Table
from rich.text import Text

from kvbridge.errors import KVBridgeError

if TYPE_CHECKING:
    from kvbridge.layouts import Layout

class _Console(Console):
    """A rich console whose size follows ``COLUMNS`` / ``LINES`` (or the terminal) when it prints: rich fixes
    them when a console is made, and the consoles below are made when the CLI is imported, before a caller
    (a test's ``CliRunner(env=...)``, a wrapper script) sets them."""

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self._width = self._height = None  # rich then reads its environment (os.environ) at each use


console = _Console()
err_console = _Console(stderr=True)

json_option = click.option("--json", "as_json", is_flag=True, help="Print machine-readable JSON instead of a table.")
debug_log_option = click.option(
    "--debug-log", type=click.Path(dir_okay=False, path_type=Path), default=None,
    help="Append the raw log lines of torch, gloo, NIXL and UCX here (default: discarded).")


#: ``--ape`` value standing for seeded stand-in weights of the model's shapes (no checkpoint needed).
SYNTHETIC_APE = "synthetic"
APE_HELP = ("The model's compressor APE weights, needed between SGLang and vLLM / TensorRT-LLM for compressed "
            "layers: safetensors file(s) holding layers.N.attn[.indexer].compressor.ape (repeat for shards), or "
            "'synthetic' for seeded stand-in weights of the model's shapes (no checkpoint; not the model's values).")


def ape_weights(ape: tuple[str, ...], topo: Any) -> object:
    """What ``plan_migration(ape=...)`` gets for ``--ape`` values: None, the files, or synthetic weights."""
    if SYNTHETIC_APE in ape:
        if len(ape) > 1:
            raise click.UsageError(f"--ape {SYNTHETIC_APE} stands alone; it cannot be combined with files")
        from kvbridge.migration.ape import synthetic_ape

        return synthetic_ape(topo, seed=0)
    return [Path(p) for p in ape] or None


def plural(n: int, word: str, words: str | None = None) -> str:
    """``n`` and the noun agreeing with it: "1 entry", "2 entries", "1 byte move"."""
    return f"{n:,} {word if n == 1 else words or word + 's'}"


@contextlib.contextmanager
def native_logs(path: Path | None) -> Iterator[None]:
    """Native libraries' raw log lines (torch's c10 logging, gloo, UCX, NIXL: whatever writes to file
    descriptor 2, child processes included) go to ``path`` (default: discarded) while Python's
    ``sys.stderr`` stays the terminal. Does nothing when stderr is not file descriptor 2 (a test
    runner capturing it)."""
    try:
        real = sys.stderr.fileno() == 2
    except (AttributeError, OSError, ValueError):
        real = False
    if not real:
        yield
        return
    sys.stderr.flush()
    try:
        target = os.open(path if path is not None else os.devnull, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    except OSError as exc:
        raise click.BadParameter(f"cannot open {path} ({exc.strerror})", param_hint="--debug-log") from None
    saved, old = os.dup(2), sys.stderr
    os.dup2(target, 2)
    os.close(target)
    sys.stderr = os.fdopen(os.dup(saved), "w", buffering=1, encoding=old.encoding, errors="backslashreplace")
    try:
        yield
    finally:
        sys.stderr.flush()
        sys.stderr.close()
        sys.stderr = old
        os.dup2(saved, 2)
        os.close(saved)

#: Continuation lines of ``print_wrapped`` start this many columns deeper than the line's own indent.
HANGING_INDENT = 4


def print_fields(fields: list[tuple[str, str]]) -> None:
    """A result as key/value lines, the first unindented, the others under it (each well within 80 columns
    unless a value, e.g. a path, is longer itself)."""
    (key, value), rest = fields[0], fields[1:]
    click.echo(f"{key} {value}")
    for key, value in rest:
        click.echo(f"  {key + ':':<11}{value}")


def print_wrapped(text: str, *, head: str = "") -> None:
    """Print ``head`` (bold) then ``text`` as plain text, wrapped between words at the console's width
    with continuation lines indented ``HANGING_INDENT`` columns deeper than the line itself; a word
    longer than a line (a path) is kept whole."""
    line = head + text
    indent = len(line) - len(line.lstrip(" "))
    lines = textwrap.wrap(line, width=console.width, subsequent_indent=" " * (indent + HANGING_INDENT),
                          break_long_words=False, break_on_hyphens=False) or [""]
    for i, part in enumerate(lines):
        out = Text(part)
        if i == 0 and head.strip():
            out.stylize("bold", 0, len(head.rstrip()))
        console.print(out, soft_wrap=True)


def header_unverified(version: int) -> str:
    """What a version-1/2 dump's unchecked header means, for ``inspect`` and ``convert``."""
    return (f"header unverified: version {version} has no header checksum (an edited scale or layout reads as "
            "written); `kvbridge convert` writes version 3")


#: Input files at least this large (bytes) get a progress bar.
LARGE_FILE_BYTES = 64 * 2**20


def print_json(data: Any) -> None:
    """Write ``data`` as indented JSON on stdout (plain, no rich markup)."""
    click.echo(json.dumps(data, indent=2, sort_keys=False))


def parse_layout(ctx: click.Context, param: click.Parameter, value: str | None) -> Layout | None:
    """Click callback: a registered layout name or alias, else a usage error (exit 2)."""
    from kvbridge.layouts import get_layout  # torch: imported when the command runs, not for --help

    if value is None:
        return None
    try:
        return get_layout(value)
    except KVBridgeError as exc:
        raise click.BadParameter(str(exc)) from None


def shorten(text: str, limit: int = 40) -> str:
    """``text`` cut to ``limit`` characters (a 4000-digit argument is not echoed back)."""
    return text if len(text) <= limit else f"{text[: limit - 3]}..."


def parse_scale(ctx: click.Context, param: click.Parameter, value: str | None) -> float | str | None:
    """Click callback: ``auto`` or a number that is positive and finite as fp32, else a usage error (exit 2)."""
    if value is None or value == "auto":
        return value
    try:
        scale = float(value)
        scale32 = struct.unpack("<f", struct.pack("<f", scale))[0]
    except (ValueError, OverflowError):
        raise click.BadParameter(f"expected a positive number or 'auto', got {shorten(repr(value))}") from None
    if not (math.isfinite(scale32) and scale32 > 0):
        raise click.BadParameter(
            f"expected a positive finite number in fp32 range (about 1.4e-45 .. 3.4e38) "
            f"or 'auto', got {shorten(repr(value))}"
        )
    return scale


def fmt(value: float | None) -> str:
    """Compact number for tables: '-' for None, 3 significant digits otherwise."""
    return "-" if value is None else f"{value:.3g}"


def byte_progress(visible: bool) -> Progress:
    """A progress bar in bytes (read, converted and written), drawn on stderr only when ``visible``."""
    return Progress(
        TextColumn("{task.description}"),
        BarColumn(bar_width=24),
        DownloadColumn(binary_units=True),
        TransferSpeedColumn(),
        TimeRemainingColumn(),
        console=err_console,
        transient=True,
        disable=not visible,
    )


def parse_device(ctx: click.Context, param: click.Parameter, value: str) -> str:
    """Click callback: a torch device that exists here (``cuda`` needs a GPU), else a usage error (exit 2)."""
    import torch

    try:
        device = torch.device(value)
    except (RuntimeError, TypeError):
        raise click.BadParameter(f"not a torch device: {shorten(repr(value))}") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise click.BadParameter("no CUDA device is available")
    if device.type not in ("cpu", "cuda"):
        raise click.BadParameter(f"kvbridge runs on cpu or cuda, got {shorten(repr(value))}")
    return value


#: Where a name may wrap: after a separator (``-``, ``:``, ``=``, ``/``, ``,``) or a space, but not
#: in front of a digit, so that a number inside a name (``amax-1e-4``, ``s=2^-6``) stays whole.
_BREAK = re.compile(r"(?<=[-_:=/, ])(?!\d)")


class Name:
    """A table cell (a layout, variant, spec or operation name; several lines allowed; rich markup
    with ``markup=True``) that wraps only at ``_BREAK`` points, never mid-word, when its column is
    narrow; rich gives its column the width of the longest unbreakable piece where it can."""

    def __init__(self, text: str, *, markup: bool = False):
        self.text = Text.from_markup(text) if markup else Text(text)

    def _pieces(self) -> list[list[Text]]:
        out = []
        for line in self.text.split("\n"):
            cuts = [m.start() for m in _BREAK.finditer(line.plain) if 0 < m.start() < len(line.plain)]
            out.append(list(line.divide(cuts)))
        return out

    def __rich_measure__(self, console: Console, options: ConsoleOptions) -> Measurement:
        pieces = self._pieces()
        widest = max((len(p.plain.rstrip()) for line in pieces for p in line), default=0)
        whole = max((len(line.plain) for line in self.text.split("\n")), default=0)
        return Measurement(widest, whole).clamp(max_width=options.max_width)

    def __rich_console__(self, console: Console, options: ConsoleOptions) -> RenderResult:
        width = options.max_width
        lines: list[Text] = []
        for pieces in self._pieces():
            line = Text()
            for piece in pieces:
                if line.plain and len(line.plain) + len(piece.plain.rstrip()) > width:
                    line.rstrip()
                    lines.append(line)
                    line = Text()
                line.append_text(piece)
            line.rstrip()
            lines.append(line)
        yield Text("\n").join(lines)


def keep_numbers_whole(table: Table) -> Table:
    """Let ``table`` fit narrow terminals without cutting numbers: each right-aligned (number) column
    keeps the width of its widest cell, its header stacked one word per line where the words are
    wider; names and other text wrap instead (``Name`` cells at separators)."""
    for column in table.columns:
        column.overflow = "fold"
        column.no_wrap = False
        if column.justify == "right":
            widest = max((len(c) for c in column.cells if isinstance(c, str)), default=0)
            if isinstance(column.header, str):
                words = column.header.split()
                width = max(widest, *(len(w) for w in words)) if words else widest
                column.header = "\n".join(textwrap.wrap(column.header, width)) or column.header
            column.no_wrap = True
    return table


def engine_spec_option(ctx: click.Context, param: click.Parameter, value: str | None) -> str | None:
    """Click callback: an engine spec ``parse_engine`` does not understand is a usage error (exit 2)."""
    from kvbridge.engines.profiles import parse_engine

    if value is None:
        return None
    try:
        parse_engine(value)
    except KVBridgeError as exc:
        raise click.BadParameter(str(exc)) from None
    return value


def model_option(ctx: click.Context, param: click.Parameter, value: str) -> str:
    """Click callback: a model preset or config.json that does not load is a usage error (exit 2)."""
    from kvbridge.engines.topology import get_model

    try:
        get_model(value)
    except (KVBridgeError, OSError) as exc:
        raise click.BadParameter(str(exc)) from None
    return value
