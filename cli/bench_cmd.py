"""``kvbridge bench``: throughput of transcode / encode / decode next to two memory copies and the reference."""

from __future__ import annotations

from typing import TYPE_CHECKING

import click
from rich.table import Table

from .common import Name, console, json_option, print_json

if TYPE_CHECKING:
    from kvbridge.study import bench

# The library modules that import torch are imported inside the functions that use them, so that
# every command's --help runs without torch.

OUT_SUFFIX = " into out="


def _threads_option(_ctx: click.Context, param: click.Parameter, value: str | None) -> tuple[int, ...] | None:
    if value is None:
        return None
    try:
        counts = tuple(sorted({int(v) for v in value.split(",") if v.strip()}))
    except ValueError:
        counts = ()
    if not counts or min(counts) < 1:
        raise click.BadParameter(f"{value!r} is not a comma-separated list of thread counts >= 1", param=param)
    return counts


@click.command("bench")
@click.option("--tokens", type=click.IntRange(min=1), default=65536, show_default=True,
              help="Tokens per operation (the CPU target is stated for >= 65536).")
@click.option("--device", "device", type=click.Choice(["auto", "cpu", "cuda"]), default="auto", show_default=True,
              help="auto: CPU, plus CUDA when present.")
@click.option("--repeat", type=click.IntRange(min=1), default=5, show_default=True,
              help="Timed calls per path; the median is reported.")
@click.option("--threads", callback=_threads_option, metavar="N[,N...]",
              help="CPU thread counts to time kvbridge and copy_ at  [default: 1,2 and every core]")
@click.option("--reference-tokens", type=click.IntRange(min=1), default=None,
              help="Tokens the (slow) reference path is timed on  [default: --tokens]; fewer is faster but "
                   "understates the speed-up (the reference's rate per token falls with the size).")
@click.option("--reference-repeat", type=click.IntRange(min=1), default=1, show_default=True,
              help="Timed reference calls (median).")
@click.option("--only", "only", multiple=True, metavar="TEXT",
              help="Time only the operations whose name contains TEXT (repeatable), e.g. --only 'flashmla-model1 ->'.")
@json_option
def command(tokens: int, device: str, repeat: int, threads: tuple[int, ...] | None, reference_tokens: int | None,
            reference_repeat: int, only: tuple[str, ...], as_json: bool) -> None:
    """Measure transcode, encode and decode throughput (GB/s read + written) against np.copyto and
    torch copy_ of the same bytes on the same device, at 1 and 2 threads, with fresh and
    preallocated (out=) outputs, against the cost of a fresh output of the same size, and against
    the naive reference path."""
    import torch
    
    from kvbridge.study import bench

    if device == "cuda" and not torch.cuda.is_available():
        raise click.BadParameter("no CUDA device is available", param_hint="--device")
    devices = None if device == "auto" else [device]
    results = bench.run_bench(tokens=tokens, devices=devices, repeat=repeat, reference_tokens=reference_tokens,
                              threads=threads, reference_repeat=reference_repeat, only=only or None)
    if not results:
        raise click.BadParameter(f"no benchmarked operation's name contains any of {', '.join(map(repr, only))}",
                                 param_hint="--only")
    target = bench.cpu_target(results)
    machine = bench.machine()
    ref_tokens = min(tokens, reference_tokens or tokens)
    if as_json:
        print_json({"machine": machine, "tokens": tokens, "repeat": repeat, "reference_tokens": ref_tokens,
                    "reference_repeat": reference_repeat, "only": list(only),
                    "results": [r.to_dict() for r in results],
                    "cpu_target": target})
    else:
        _print_table(results, machine, tokens, repeat, ref_tokens, target)
    if not all(r.exact for r in results):
        raise click.ClickException("an operation's output differs from the reference (see the exact column)")


def _print_table(results: list[bench.CaseResult], machine: dict, tokens: int, repeat: int, ref_tokens: int,
                 target: dict | None) -> None:
    devices = sorted({r.device for r in results})
    cpu = f"{machine['cpu']} ({machine['cpu_cores']} cores" + \
        (f", {' '.join(machine['cpu_vector'])})" if machine["cpu_vector"] else ")")
    console.print(f"kvbridge bench on {', '.join(devices)}: {tokens:,} tokens, median of {repeat}", highlight=False)
    console.print(f"{cpu}" + (f", {machine['gpu']}" if machine["gpu"] else "") + f", torch {machine['torch']}",
                  highlight=False)
    console.print(f"native MODEL1 kernels: {machine['native_kernels']}", highlight=False)
    if ref_tokens < tokens:
        console.print(f"reference timed on {ref_tokens:,} tokens, capped below {tokens:,}: x ref understates\n"
                      "the speed-up (the reference's rate per token falls with the size)", highlight=False)
    else:
        console.print(f"reference timed on the same {tokens:,} tokens", highlight=False)
    console.print("x copyto, x copy_: kvbridge's rate over np.copyto (1 thread) and torch copy_\n"
                  "(thr threads) of the same bytes into preallocated memory\n"
                  "fresh outputs: ceil = x copyto of torch.empty + fill_ of the output alone (what\n"
                  "any fresh output costs here); x ceil = the ceiling's time over kvbridge's", highlight=False)
    backends = {r.backend for r in results}
    table = Table(box=None, pad_edge=False, header_style="bold")
    table.add_column("operation")
    cols = (["backend"] if len(backends) > 1 else []) + ["out", "thr", "GB/s", "x copyto", "x copy_", "ceil",
                                                         "x ceil", "x ref", "exact"]
    for col in cols:
        table.add_column(col, justify="left" if col in ("backend", "out") else "right", no_wrap=True)
    previous = None
    for r in results:
        name = r.case[: -len(OUT_SUFFIX)] if r.case.endswith(OUT_SUFFIX) else r.case
        name = f"{r.device}: {name}" if len(devices) > 1 else name
        cells = ([r.backend] if len(backends) > 1 else []) + [
            r.output, str(r.threads), f"{r.kvbridge.gb_per_s:.1f}",
            "-" if r.vs_np_copyto is None else f"{r.vs_np_copyto:.2f}", f"{r.vs_copy:.2f}",
            "-" if r.ceiling_vs_np_copyto is None else f"{r.ceiling_vs_np_copyto:.2f}",
            "-" if r.vs_fresh_ceiling is None else f"{r.vs_fresh_ceiling:.2f}",
            f"{r.vs_reference:.0f}" if r.vs_reference >= 10 else f"{r.vs_reference:.1f}",
            "yes" if r.exact else "[red]NO[/red]"]
        table.add_row(Name(name if name != previous else ""), *cells)
        previous = name
    console.print(table)
    if len(backends) == 1:
        console.print(f"backend: {backends.pop()}", highlight=False)
    if target is not None:
        verdict = "[green]met[/green]" if target["met"] else "[red]not met[/red]"
        console.print(
            f"CPU target ({target['case']}, {target['threads']} threads, >= {target['required']['tokens']:,} "
            f"tokens: >= {target['required']['vs_copy']:.0%} of copy_ and >= "
            f"{target['required']['vs_reference']:.0f}x reference): {target['vs_copy']:.0%} of copy_ "
            f"({target['vs_np_copyto']:.0%} of np.copyto), {target['vs_reference']:.0f}x reference, {verdict}"
        )
