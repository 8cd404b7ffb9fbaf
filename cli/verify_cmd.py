"""``kvbridge verify [PATH]``: run the conformance fixtures and print pass/fail per layout and dialect."""

from __future__ import annotations

from pathlib import Path

import click
from rich.table import Table

from .common import Name, console, json_option, parse_device, print_json

# The library modules that import torch are imported inside the functions that use them, so that
# every command's --help runs without torch.


@click.command("verify", short_help="Run the conformance fixtures; pass/fail per layout and dialect.")
@click.argument("path", required=False, type=click.Path(exists=True, file_okay=False, path_type=Path))
@click.option(
    "--device",
    default="cpu",
    show_default=True,
    callback=parse_device,
    help="Run the checks on this torch device (cuda: the GPU kernels).",
)
@json_option
@click.pass_context
def command(ctx: click.Context, path: Path | None, device: str, as_json: bool) -> None:
    """Check kvbridge's codecs byte-for-byte against the reference vectors in PATH.

    PATH defaults to the fixtures installed with kvbridge. Runs FlashMLA's MODEL1
    encoder/dequantizer vectors (P = 2, 64, 256), TensorRT-LLM's per-tensor FP8 writer/reader at
    each scale, the dialect zero-tile scale bytes (114 / 105 / 92), and FlashMLA's sparse-decode
    outputs (within FlashMLA's own tolerances), and the indexer-key pages written by SGLang's
    and vLLM's own writers, reported per engine. Exit 1 on any failure.
    """
    from kvbridge.conformance import run_conformance

    report = run_conformance(path, device=device)
    if as_json:
        print_json(report.to_dict())
    else:
        groups: dict[tuple[str, str, str, str], list] = {}
        for r in report.results:
            groups.setdefault((r.engine or "kvbridge codecs", r.layout, r.dialect or "-", r.check), []).append(r)
        table = Table(
            title=f"conformance: {report.fixtures_dir} on {report.device}",
            box=None,
            pad_edge=False,
            header_style="bold",
        )
        table.add_column("layout / dialect")
        table.add_column("check")
        table.add_column("cases")
        table.add_column("result", no_wrap=True)
        current = None
        for (engine, layout, dialect, check), rows in sorted(groups.items(), key=lambda kv: kv[0][:2]):
            if engine != current:  # one heading row per engine keeps the table within 80 columns
                table.add_row(f"[bold]{engine}[/bold]", "", "", "")
                current = engine
            ok = sum(r.passed for r in rows)
            colour = "green" if ok == len(rows) else "red"
            cases = ", ".join(r.case for r in rows)
            table.add_row(
                Name(f"  {layout}" + ("" if dialect == "-" else f"\n  {dialect}")),
                Name(check),
                Name(cases),
                f"[{colour}]{ok}/{len(rows)} {'PASS' if ok == len(rows) else 'FAIL'}[/{colour}]",
            )
        console.print(table)
        for r in report.failures:
            console.print(f"[red]FAIL[/red] {r.layout} {r.dialect or ''} {r.case} {r.check}: {r.detail}")
        engines: dict[str, list] = {}
        for r in report.results:
            engines.setdefault(r.engine or "kvbridge codecs", []).append(r)
        for engine, rows in engines.items():
            ok = sum(r.passed for r in rows)
            console.print(f"{engine}: {ok}/{len(rows)} checks passed")
        total, failed = len(report.results), len(report.failures)
        colour = "green" if not failed else "red"
        console.print(f"[{colour}]{total - failed}/{total} checks passed[/{colour}]")
    if not report.passed:
        ctx.exit(1)
