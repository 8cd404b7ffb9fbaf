"""``kvbridge accuracy``: what each KV layout costs at the attention output (see docs/accuracy.md)."""

from __future__ import annotations

import dataclasses
import math
import os
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn
from rich.table import Table

from kvbridge.attention.backends import BACKENDS
from kvbridge.study import params

from .common import Name, console, err_console, fmt, json_option, keep_numbers_whole, plural, print_json

if TYPE_CHECKING:
    from kvbridge.study.accuracy import Variant

# kvbridge.study.accuracy (torch) is imported inside the functions that use it, so that --help runs
# without torch; the options are made of kvbridge.study.params (no torch).


def key_variants() -> tuple[Variant, ...]:
    """Variants shown in sweep tables and figures (the headline comparison)."""
    from kvbridge.study import accuracy as acc

    return (acc.FP8_UNIT, acc.FP8_CALIBRATED, acc.FP8_CALIBRATED_POW2, *acc.MODEL1_DIALECTS)

#: Column labels of the key variants in sweep tables (named in the table's caption).
KEY_LABELS = "ABCDEF"


def _param_options(func):
    """One ``--name`` option per ``SyntheticParams`` field, defaults and help from the library."""
    for f in reversed(dataclasses.fields(params.SyntheticParams)):
        flag = "--" + f.name.replace("_", "-")
        kind = click.Choice(params.LAYERS) if f.name == "layer" else type(f.default)
        func = click.option(flag, f.name, type=kind, default=f.default, show_default=True,
                            help=params.PARAM_HELP[f.name])(func)
    return func


def parse_pow2(text: str) -> float:
    """``2^-6`` or a plain number -> float (a usage error if it is not a positive power of two)."""
    try:
        value = 2.0 ** int(text[2:]) if text.startswith("2^") else float(text)
    except ValueError:
        raise click.BadParameter(f"expected a power of two such as 2^-6 or 0.125, got {text!r}") from None
    if not (math.isfinite(value) and value > 0 and math.frexp(value)[0] == 0.5):
        raise click.BadParameter(f"expected a positive power of two, got {text!r}")
    return value


def _pow2_list(ctx: click.Context, param: click.Parameter, value: str) -> tuple[float, ...]:
    return tuple(parse_pow2(t.strip()) for t in value.split(",") if t.strip())


def _sweeps(ctx: click.Context, param: click.Parameter, value: tuple[str, ...]) -> dict[str, tuple] | None:
    """``--sweep NAME`` or ``--sweep NAME=V1,V2`` (repeatable) -> {field: values}; None if not given."""
    if not value:
        return None
    types = {f.name: type(f.default) for f in dataclasses.fields(params.SyntheticParams)}
    out: dict[str, tuple] = {}
    for item in value:
        name, _, values = item.partition("=")
        name = name.strip().replace("-", "_")
        if name not in types:
            raise click.BadParameter(f"unknown parameter {name!r}; choose from {', '.join(types)}")
        if not values:
            if name not in params.DEFAULT_SWEEPS:
                raise click.BadParameter(f"{name} has no default sweep; give values: --sweep {name}=V1,V2")
            out[name] = params.DEFAULT_SWEEPS[name]
            continue
        try:
            out[name] = tuple(types[name](v.strip()) for v in values.split(","))
        except ValueError:
            raise click.BadParameter(f"values of {name} must be {types[name].__name__}s, got {values!r}") from None
    return out


def run_tables(run: dict, title: str) -> tuple[Table, Table]:
    """Every variant's metrics at one point: attention metrics, then K error and E4M3 range use."""
    attention = Table(title=f"{title}: attention vs bf16", box=None, header_style="bold")
    kerr = Table(title=f"{title}: K error, E4M3 range use, error with one part quantized", box=None,
                 header_style="bold")
    for table, columns in (
        (attention, ("variant", "B/tok", "scale", "out relL2", "out maxabs", "cosine", "KL", "top-k ovl")),
        (kerr, ("variant", "K nope relL2", "K rope relL2", "sat %", "subn %", "nope-only", "rope-only")),
    ):
        for col in columns:
            table.add_column(col, justify="left" if col == "variant" else "right")
    for r in run["rows"]:
        attention.add_row(Name(r["variant"]), str(r["bytes_per_token"]), fmt(r["scale"]), fmt(r["out_rel_l2"]),
                          fmt(r["out_max_abs"]), f"{r['out_cosine']:.6f}", fmt(r["kl_mean"]),
                          f"{r['topk_overlap_mean']:.3f}")
        kerr.add_row(Name(r["variant"]), fmt(r["k_nope_rel_l2"]), fmt(r["k_rope_rel_l2"]),
                     fmt(100 * r["saturated_frac"]), fmt(100 * r["subnormal_frac"]), fmt(r["out_rel_l2_nope_only"]),
                     fmt(r["out_rel_l2_rope_only"]))
    return keep_numbers_whole(attention), keep_numbers_whole(kerr)


def sweep_table(study: dict, sweep: str) -> Table:
    """Output relative L2 error of the key variants along one sweep, with FP8 s=1's E4M3 range use."""
    from kvbridge.study import accuracy as acc

    variants = dict(zip(KEY_LABELS, key_variants(), strict=True))
    legend = "; ".join(f"{label}: {v.label}" for label, v in variants.items())
    table = Table(title=f"sweep over {sweep}: attention-output relative L2 error vs bf16", box=None,
                  header_style="bold", caption_justify="left",
                  caption=f"{legend}; sat %, subn %: E4M3 codes of {acc.FP8_UNIT.label} that saturate or are "
                          "subnormal")
    table.add_column(sweep, justify="right")
    for label in (*variants, "sat %", "subn %"):
        table.add_column(label, justify="right")
    for run in study["runs"]:
        if run["sweep"] != sweep:
            continue
        by = {r["variant"]: r for r in run["rows"]}
        unit = by[acc.FP8_UNIT.label]
        table.add_row(str(run["value"]), *(fmt(by[v.label]["out_rel_l2"]) for v in variants.values()),
                      fmt(100 * unit["saturated_frac"]), fmt(100 * unit["subnormal_frac"]))
    return keep_numbers_whole(table)


def summary_lines(summary: dict) -> list[str]:
    """The headline answers, one line each."""
    d = summary["model1_dialects"]
    return [
        f"per-tensor FP8 s=1: output rel L2 {summary['fp8_s1']:.4g} vs MODEL1 {summary['model1']:.4g} "
        f"({summary['ratio']:.3g}x)",
        f"  of which rope only: {fmt(summary['fp8_s1_rope_only'])}, nope only: {fmt(summary['fp8_s1_nope_only'])}",
        f"calibrated s=amax/448: {summary['fp8_calibrated']:.4g}; s=pow2(amax/448): "
        f"{summary['fp8_calibrated_pow2']:.4g} ({summary['calibrated_over_s1']:.3g}x the s=1 error)",
        "MODEL1 dialects: " + ", ".join(f"{k} {v:.4g}" for k, v in d.items())
        + (" (bit-identical outputs)" if summary["model1_dialects_identical"] else " (outputs differ)"),
    ]


# ---------------------------------------------------------------- figures


def _atomic_savefig(fig: Any, path: Path) -> None:
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".png", dir=path.parent)
    os.close(fd)
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(tmp, 0o666 & ~umask)  # mkstemp creates 0600; a figure gets the usual file mode
    try:
        fig.savefig(tmp, dpi=90, format="png")
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _series(study: dict, sweep: str, variant: Variant, key: str) -> tuple[list, list]:
    xs, ys = [], []
    for run in study["runs"]:
        if run["sweep"] == sweep:
            row = next(r for r in run["rows"] if r["variant"] == variant.label)
            if row[key] is not None:
                xs.append(run["value"])
                ys.append(row[key])
    return xs, ys


def load_pyplot() -> Any:
    """``matplotlib.pyplot`` on the non-interactive Agg backend, or a one-line error if missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise click.ClickException("--plot needs matplotlib: pip install 'kvbridge[plot]'") from None
    return plt


def _value_ticks(ax: Any, values: list) -> None:
    """Label the x axis at the sweep's own values (no minor ticks)."""
    ax.set_xticks(values, [f"{v:g}" for v in values], fontsize=7)
    ax.minorticks_off()


def write_plots(study: dict, directory: Path, plt: Any) -> list[Path]:
    """PNG figures of a synthetic study's sweeps into ``directory`` (created) with ``plt``
    (``load_pyplot()``); returns the paths."""
    from kvbridge.study import accuracy as acc

    variants = key_variants()
    directory.mkdir(parents=True, exist_ok=True)
    written = []
    styles = {v.label: {"marker": "o^sDvx"[i % 6], "linestyle": "-" if i < 3 else "--"}
              for i, v in enumerate(variants)}
    numeric = [s for s in study["sweeps"] if s != "layer"]
    for sweep in numeric:
        fig, ax = plt.subplots(figsize=(6.4, 4.2))
        for v in variants:
            xs, ys = _series(study, sweep, v, "out_rel_l2")
            ax.plot(xs, ys, label=v.label, **styles[v.label])
        if sweep == "rope_ratio":
            xs, ys = _series(study, sweep, acc.FP8_UNIT, "out_rel_l2_rope_only")
            ax.plot(xs, ys, label=f"{acc.FP8_UNIT.label}, rope part only", color="grey", linestyle=":")
        ax.set_xscale("log" if sweep in ("magnitude", "rope_ratio", "context", "topk") else "linear")
        _value_ticks(ax, study["sweeps"][sweep])
        ax.set_yscale("log")
        ax.set_xlabel(sweep)
        ax.set_ylabel("attention output rel. L2 error vs bf16")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
        fig.tight_layout()
        path = directory / f"accuracy_{sweep}.png"
        _atomic_savefig(fig, path)
        plt.close(fig)
        written.append(path)
    if "magnitude" in study["sweeps"]:
        fig, ax = plt.subplots(figsize=(6.4, 4.2))
        for v, key, label in (
            (acc.FP8_UNIT, "saturated_frac", "FP8 s=1: saturated"),
            (acc.FP8_UNIT, "subnormal_frac", "FP8 s=1: subnormal"),
            (acc.FP8_CALIBRATED, "subnormal_frac", "FP8 s=amax/448: subnormal"),
            (acc.MODEL1_DIALECTS[0], "subnormal_frac", "MODEL1 flashmla: subnormal"),
            (acc.MODEL1_DIALECTS[1], "subnormal_frac", "MODEL1 amax-1e-4: subnormal"),
        ):
            xs, ys = _series(study, "magnitude", v, key)
            ax.plot(xs, [100 * y for y in ys], marker="o", label=label)
        ax.set_xscale("log")
        _value_ticks(ax, study["sweeps"]["magnitude"])
        ax.set_yscale("symlog", linthresh=0.01)
        ax.set_ylim(bottom=0)
        ax.set_xlabel("magnitude")
        ax.set_ylabel("% of E4M3-stored values (symlog)")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
        fig.tight_layout()
        path = directory / "accuracy_magnitude_range.png"
        _atomic_savefig(fig, path)
        plt.close(fig)
        written.append(path)
    return written


# ---------------------------------------------------------------- command


def study_progress(visible: bool) -> Progress:
    """The study's progress on stderr, drawn only when ``visible``: the point and variant last
    measured, a bar over every (point, variant) evaluation, elapsed and remaining time."""
    return Progress(TextColumn("{task.description}", style="dim"), BarColumn(bar_width=20), MofNCompleteColumn(),
                    TimeElapsedColumn(), TimeRemainingColumn(), console=err_console, transient=True,
                    disable=not visible)



@click.command("accuracy")
@_param_options
@click.option("--seed", type=int, default=0, show_default=True, help="Seed of every random draw.")
@click.option("--sweep", "sweep", multiple=True, callback=_sweeps, metavar="NAME[=V1,V2,...]",
              help="Run this sweep (repeatable; default values unless given). Default: "
                   + ", ".join(params.DEFAULT_SWEEPS) + ".")
@click.option("--no-sweeps", is_flag=True, help="Only the nominal point.")
@click.option("--pow2-scales", default=",".join(params.scale_label(s) for s in params.DEFAULT_POW2_SCALES),
              show_default=True, callback=_pow2_list, help="Fixed per-tensor scales tried besides 1 and amax/448.")
@click.option("--overlap-k", type=int, default=16, show_default=True,
              help="Highest-weight tokens compared by the top-k overlap metric.")
@click.option("--backend", type=click.Choice(BACKENDS), default="reference", show_default=True,
              help="sparse_decode backend of the quantized variants (the bf16 reference always uses 'reference').")
@click.option("--from-dump", "from_dump", type=click.Path(dir_okay=False), default=None,
              help="Study the unquantized entries of this dump (real latents, synthetic queries) instead.")
@click.option("--entry", "entries", multiple=True, help="With --from-dump: study only this entry (repeatable).")
@click.option("--plot", "plot_dir", type=click.Path(file_okay=False), default=None,
              help="Write PNG figures of the sweeps into this directory (needs matplotlib).")
@json_option
def command(seed: int, sweep: dict | None, no_sweeps: bool, pow2_scales: tuple[float, ...], overlap_k: int,
            backend: str, from_dump: str | None, entries: tuple[str, ...], plot_dir: str | None, as_json: bool,
            **param_values: Any) -> None:
    """Quantize KV latents in every layout, dialect and per-tensor scale, run sparse decode, and
    compare with bf16: output error, attention weights, K error, E4M3 range use."""
    if no_sweeps and sweep:
        raise click.UsageError("--no-sweeps and --sweep exclude each other")
    if entries and from_dump is None:
        raise click.UsageError("--entry needs --from-dump")
    if from_dump is not None and (sweep or no_sweeps):
        raise click.UsageError("--sweep/--no-sweeps apply to the synthetic study, not --from-dump")
    if plot_dir is not None and (no_sweeps or from_dump is not None):
        raise click.UsageError("--plot draws the synthetic sweeps; it cannot go with --no-sweeps or --from-dump")
    from kvbridge.study import accuracy as acc

    synthetic = params.SyntheticParams(**param_values)
    plt = None if plot_dir is None else load_pyplot()
    with study_progress(err_console.is_terminal and not as_json) as bar:
        task = bar.add_task("accuracy", total=None)

        def progress(label: str, done: int, total: int) -> None:
            bar.update(task, description=label, completed=done, total=total)

        common = {"params": synthetic, "seed": seed, "pow2_scales": pow2_scales, "overlap_k": overlap_k,
                  "backend": backend, "progress": progress}
        if from_dump is not None:
            study = acc.run_dump_study(from_dump, entries=entries, **common)
        else:
            study = acc.run_study(sweeps={} if no_sweeps else sweep, **common)
    if plot_dir is not None:
        study["figures"] = [str(p) for p in write_plots(study, Path(plot_dir), plt)]
    if as_json:
        print_json(study)
        return
    console.print(f"[bold]source[/bold] {study['source']}  [bold]seed[/bold] {seed}  [bold]backend[/bold] {backend}")
    console.print("[bold]parameters[/bold] " + " ".join(f"{k}={v}" for k, v in study["params"].items()))
    for run in study["runs"]:
        if run["sweep"] in ("nominal", "entry"):
            title = "nominal point" if run["sweep"] == "nominal" else f"entry {run['value']}"
            case = run["case"]
            label = f"{title} ({plural(case['tokens'], 'entry', 'entries')}, top-k {case['topk']}, " \
                    f"{plural(case['heads'], 'head')})"
            for table in run_tables(run, label):
                console.print(table)
            for line in summary_lines(run["summary"]):
                console.print(line)
    for name in study["sweeps"]:
        console.print(sweep_table(study, name))
    for item in study.get("skipped", []):
        console.print(f"skipped {item['entry']}: {item['reason']}")
    for path in study.get("figures", []):
        console.print(f"wrote {path}")
