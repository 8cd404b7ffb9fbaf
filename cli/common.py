"""Shared CLI helpers: the rich console and JSON output."""

from __future__ import annotations

import json
from typing import Any

import click
from rich.console import Console

console = Console()
err_console = Console(stderr=True)

json_option = click.option("--json", "as_json", is_flag=True, help="Print machine-readable JSON instead of a table.")


def print_json(data: Any) -> None:
    """Write ``data`` as indented JSON on stdout (plain, no rich markup)."""
    click.echo(json.dumps(data, indent=2, sort_keys=False))
