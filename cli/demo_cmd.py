"""``kvbridge demo``: a synthetic DeepSeek-V4 request, TensorRT-LLM FP8 -> MODEL1 -> back, verified."""

from __future__ import annotations

from pathlib import Path

import click
from rich.table import Table

from .common import console, json_option, print_json, print_wrapped

# The library modules that import torch are imported inside the functions that use them, so that
# every command's --help runs without torch.


def value_text(value: object) -> str:
    """A summary value as text: floats to 4 significant digits, dicts as ``key value, ...``."""
    if isinstance(value, float):
        return f"{value:.4g}"
    if isinstance(value, dict):
        return ", ".join(f"{k} {value_text(v)}" for k, v in value.items())
    return str(value)


@click.command("demo", short_help="Synthetic DeepSeek-V4 request: TensorRT-LLM FP8 -> MODEL1 -> back, verified.")
@click.option(
    "--tokens", default=4096, show_default=True, type=click.IntRange(min=128), help="Request length in tokens."
)
@click.option("--workdir", type=click.Path(file_okay=False, path_type=Path), help="Keep the dump files here.")
@json_option
@click.pass_context
def command(ctx: click.Context, tokens: int, workdir: Path | None, as_json: bool) -> None:
    """Build a synthetic DeepSeek-V4 request (SWA, C4 and C128 caches), write it as a TensorRT-LLM FP8
    dump, convert it to MODEL1, check the bytes against the reference codecs and the round trip back.
    Exit 1 if any check fails."""
    from kvbridge.demo.run import run_demo

    summary = run_demo(tokens=tokens, workdir=workdir)
    if as_json:
        print_json(summary)
    else:
        request, convert = summary["request"], summary["convert"]
        print_wrapped(f"synthetic DeepSeek-V4-Flash request: {tokens} tokens, layers with compress ratios "
                      f"{summary['layers']}")
        table = Table(title="TensorRT-LLM FP8 dump", box=None, header_style="bold")
        for col in ("entry", "pages×P", "tokens", "writer"):
            table.add_column(col, justify="left" if col in ("entry", "writer") else "right")
        for e in request["entries"]:
            table.add_row(e["name"], f"{e['pages']}×{e['page_size']}", str(e["num_tokens"]), e["dialect"])
        console.print(table)
        print_wrapped(
            f"trtllm-fp8 dump {request['file_bytes']} B -> MODEL1 dump {convert['file_bytes']} B, "
            f"{'lossless' if convert['lossless'] else 'max abs error ' + str(convert['max_abs_error'])}"
        )
        for name, section in summary.items():
            if isinstance(section, dict) and name not in ("request", "convert", "round_trip", "seconds"):
                console.print(f"[bold]{name}[/bold]")
                for key, value in section.items():
                    print_wrapped(f"  {key}: {value_text(value)}")
        checks = summary["checks"]
        passed = sum(c["passed"] for c in checks)
        for c in checks:
            if not c["passed"]:
                console.print(f"[red]FAIL[/red] {c['check']}: {c['detail']}")
        colour = "green" if summary["ok"] else "red"
        console.print(f"[{colour}]{passed}/{len(checks)} checks passed[/{colour}]")
        print_wrapped(
            f"files: {summary['workdir'] if summary['kept_files'] else 'temporary, removed'}; "
            f"seconds per step: {value_text(summary['seconds'])}"
        )
    if not summary["ok"]:
        ctx.exit(1)
