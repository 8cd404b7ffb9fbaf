"""``kvbridge bench``: throughput of transcode / encode / decode next to a memory copy and the reference."""

from __future__ import annotations

import platform

import click
import torch
from rich.table import Table

from kvbridge import bench, native

from .common import console, json_option, print_json


def _machine() -> dict:
    model = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as info:
            model = next((line.split(":", 1)[1].strip() for line in info if line.startswith("model name")), model)
    except OSError:
        pass
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    return {"cpu": model, "cpu_threads": native.num_threads(), "gpu": gpu, "torch": torch.__version__}


@click.command("bench")
@click.option("--tokens", type=click.IntRange(min=1), default=65536, show_default=True,
              help="Tokens per operation (the CPU target is stated for >= 65536).")
@click.option("--device", "device", type=click.Choice(["auto", "cpu", "cuda"]), default="auto", show_default=True,
              help="auto: CPU, plus CUDA when present.")
@click.option("--repeat", type=click.IntRange(min=1), default=5, show_default=True,
              help="Timed calls per path; the median is reported.")
@click.option("--reference-tokens", type=click.IntRange(min=1), default=4096, show_default=True,
              help="Tokens the (slow) reference path is timed on.")
@json_option
def command(tokens: int, device: str, repeat: int, reference_tokens: int, as_json: bool) -> None:
    """Measure transcode, encode and decode throughput (tokens/s, GB/s read + written) against a
    memory copy of the same bytes on the same device and against the naive reference path."""
    if device == "cuda" and not torch.cuda.is_available():
        raise click.BadParameter("no CUDA device is available", param_hint="--device")
    devices = None if device == "auto" else [device]
    results = bench.run_bench(tokens=tokens, devices=devices, repeat=repeat, reference_tokens=reference_tokens)
    target = bench.cpu_target(results)
    if as_json:
        print_json({"machine": _machine(), "results": [r.to_dict() for r in results], "cpu_target": target})
        return
    machine = _machine()
    devices_text = ", ".join(sorted({r.device for r in results}))
    title = f"kvbridge bench on {devices_text}: {tokens} tokens, median of {repeat}\n({machine['cpu']}, "
    title += f"{machine['cpu_threads']} threads" + (f", {machine['gpu']})" if machine["gpu"] else ")")
    table = Table(title=title, box=None, pad_edge=False, header_style="bold")
    many_devices = len({r.device for r in results}) > 1
    table.add_column("operation", overflow="fold", ratio=1)
    for col in ("backend", "Mtok/s", "GB/s", "copy GB/s", "x copy", "x ref", "exact"):
        table.add_column(col, justify="left" if col == "backend" else "right", no_wrap=True)
    for r in results:
        table.add_row(
            f"{r.device}: {r.case}" if many_devices else r.case, r.backend, f"{r.kvbridge.tokens_per_s / 1e6:.2f}",
            f"{r.kvbridge.gb_per_s:.1f}", f"{r.copy.gb_per_s:.1f}", f"{r.vs_copy:.2f}", f"{r.vs_reference:.0f}",
            "yes" if r.exact else "[red]NO[/red]",
        )
    console.print(table)
    if target is not None:
        verdict = "[green]met[/green]" if target["met"] else "[red]not met[/red]"
        console.print(
            f"CPU target ({target['case']}, >= {target['required']['tokens']} tokens: >= "
            f"{target['required']['vs_copy']:.0%} of copy and >= {target['required']['vs_reference']:.0f}x reference): "
            f"{target['vs_copy']:.0%} of copy, {target['vs_reference']:.0f}x reference, {verdict}"
        )
    if not all(r.exact for r in results):
        raise click.ClickException("an operation's output differs from the reference (see the exact column)")
