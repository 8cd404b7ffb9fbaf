"""``kvbridge migrate``: plan a request's migration between engines, or run one in-process."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import click
from rich import box
from rich.table import Table

from kvbridge.engines.topology import MAX_TOKENS, get_model

from .common import (
    APE_HELP,
    Name,
    ape_weights,
    console,
    engine_spec_option,
    json_option,
    model_option,
    print_json,
    print_wrapped,
)

if TYPE_CHECKING:
    from kvbridge.migration import ConvertSide, MigrationPlan

# The library modules that import torch are imported inside the commands that use them, so that
# every command's --help runs without torch.

DEFAULT_LINK_GBPS = 40.0


def _plan_options(fn):
    fn = click.option(
        "--from", "src", required=True, callback=engine_spec_option, help="Source engine spec, e.g. trtllm:fp8:tpb=128."
    )(fn)
    fn = click.option(
        "--to", "dst", required=True, callback=engine_spec_option, help="Destination engine spec, e.g. sglang or vllm."
    )(fn)
    fn = click.option(
        "--model",
        default="deepseek-v4-flash",
        show_default=True,
        callback=model_option,
        help="Preset name or a Hugging Face config.json path.",
    )(fn)
    fn = click.option("--tokens", type=click.IntRange(min=1, max=MAX_TOKENS), required=True,
                      help="Request length in tokens.")(fn)
    fn = click.option(
        "--draft-tokens",
        type=click.IntRange(min=0, max=MAX_TOKENS),
        default=0,
        show_default=True,
        help="MTP draft slots kept beyond the SWA window.",
    )(fn)
    fn = click.option("--mtp/--no-mtp", default=True, show_default=True, help="Move the MTP layers' caches too.")(fn)
    fn = click.option("--ape", "ape", multiple=True, metavar="FILE|synthetic", help=APE_HELP)(fn)
    return fn


def _mib(n: int) -> str:
    return f"{n / 2**20:,.2f}"


def _wire_seconds(nbytes: int, gbps: float) -> float:
    return nbytes / (gbps * 1e9)


def _print_plan(plan: MigrationPlan, link_gbps: float, show_transfers: bool) -> None:
    print_wrapped(f", {plan.num_tokens:,} tokens (+{plan.draft_tokens} draft): {plan.src.spec} -> {plan.dst.spec}",
                  head=plan.model.name)
    table = Table(title="bytes per cache role (MiB = 2^20 B)", box=box.SIMPLE_HEAD)
    table.add_column("role")
    for col in ("layers", "entries", "src\npayload", "dst\npayload", "src\npages", "dst\npages"):
        table.add_column(col, justify="right", no_wrap=True)
    totals = plan.totals()
    conversions: dict[str, set[str]] = {}
    for t in plan.transfers:
        conversions.setdefault(t.spec.role.value, set()).add(t.conversion)
    for role, row in totals.items():
        label = "[bold]total[/bold]" if role == "all" else role
        table.add_row(
            Name(label, markup=True),
            str(row["layers"]),
            f"{row['entries']:,}",
            _mib(row["src_bytes"]),
            _mib(row["dst_bytes"]),
            _mib(row["src_page_bytes"]),
            _mib(row["dst_page_bytes"]),
        )
    for side, prof in (("from", plan.src), ("to", plan.dst)):
        print_wrapped(f" {prof.spec} ({prof.version})", head=side)
        for c in prof.choices:
            print_wrapped(f"  {c.option}={c.value} ({'given' if c.given else 'default'}; {c.source})")
        for role, where in prof.sources.items():
            print_wrapped(f"  {role}: {where}")
    console.print(table)
    for role, names in conversions.items():
        print_wrapped(f"  {role}: {'; '.join(sorted(names))}")
    row = totals["all"]
    print_wrapped(
        f"wire time at {link_gbps:g} GB/s: {_wire_seconds(row['src_bytes'], link_gbps) * 1e3:.2f} ms "
        f"(source-format payload, receiver transcodes) / "
        f"{_wire_seconds(row['dst_bytes'], link_gbps) * 1e3:.2f} ms (destination format, sender transcodes)"
    )
    if show_transfers:
        detail = Table(title="transfers (page ranges are block-table indices, [first, stop))")
        for col in ("layer", "role", "entries", "src pages", "dst pages", "conversion"):
            detail.add_column(col)
        for t in plan.transfers:
            d = t.to_dict()
            detail.add_row(
                str(t.spec.layer),
                Name(t.spec.role.value),
                f"[{t.first}, {t.first + t.count})",
                f"{t.src.table}{d['src']['pages']}",
                f"{t.dst.table}{d['dst']['pages']}",
                Name(t.conversion),
            )
        console.print(detail)


@click.group("migrate")
def command() -> None:
    """Move a DeepSeek-V4 request's KV state from one engine's pools to another's."""


@command.command("plan")
@_plan_options
@click.option(
    "--link-gbps",
    type=click.FloatRange(min=0, min_open=True),
    default=DEFAULT_LINK_GBPS,
    show_default=True,
    help="Link bandwidth for the wire-time estimate (GB/s, 1e9 B/s).",
)
@click.option("--transfers", "show_transfers", is_flag=True, help="List every per-layer transfer.")
@json_option
def plan_command(
    src: str,
    dst: str,
    model: str,
    tokens: int,
    draft_tokens: int,
    mtp: bool,
    ape: tuple[str, ...],
    link_gbps: float,
    show_transfers: bool,
    as_json: bool,
) -> None:
    """Which entries move, from which pages to which, with which conversion, and the byte totals.

    Between SGLang and vLLM / TensorRT-LLM without --ape the plan is shown (its sizes do not depend
    on the weights' values) with a note that converting the compressor state needs them."""
    from kvbridge.engines.profiles import parse_engine
    from kvbridge.migration import plan_migration
    from kvbridge.migration.ape import synthetic_ape
    from kvbridge.migration.plan import ape_needed

    topo = get_model(model)
    missing = not ape and ape_needed(parse_engine(src), parse_engine(dst), topo, mtp)
    weights = ape_weights(ape, topo) if not missing else synthetic_ape(topo, seed=0)
    plan = plan_migration(src, dst, topo, tokens, draft_tokens=draft_tokens, include_mtp=mtp, ape=weights)
    note = ("sizes only: converting the compressor state between these engines needs the model's APE weights "
            "(--ape FILE, or --ape synthetic for stand-in weights)") if missing else None
    if as_json:
        data = plan.to_dict(transfers=show_transfers)
        if note is not None:
            data.pop("ape_sha256", None)
            data["ape"] = note
        total = data["totals"]["all"]
        data["wire_seconds"] = {
            "link_gbps": link_gbps,
            "src_payload": _wire_seconds(total["src_bytes"], link_gbps),
            "dst_payload": _wire_seconds(total["dst_bytes"], link_gbps),
        }
        print_json(data)
        return
    _print_plan(plan, link_gbps, show_transfers)
    if note is not None:
        print_wrapped(note, head="note: ")


@command.command("run")
@_plan_options
@click.option(
    "--layers",
    type=click.IntRange(min=1),
    default=None,
    help="Keep only the first N main layers (smaller, faster demo).",
)
@click.option("--convert-on", type=click.Choice(["sender", "receiver"]), default="receiver", show_default=True)
@click.option("--seed", type=int, default=0, show_default=True, help="Seed of the synthetic request.")
@click.option(
    "--loss-report/--no-loss-report",
    default=True,
    show_default=True,
    help="Measure the conversion loss (costs a decode of every converted entry).",
)
@json_option
def run_command(
    src: str,
    dst: str,
    model: str,
    tokens: int,
    draft_tokens: int,
    mtp: bool,
    ape: tuple[str, ...],
    layers: int | None,
    convert_on: str,
    seed: int,
    loss_report: bool,
    as_json: bool,
) -> None:
    """Migrate a synthetic request in-process (source and destination pools in this process)."""
    from kvbridge.migration import destination_pools, migrate_local, plan_migration, source_request

    topo = get_model(model)
    if layers is not None:
        topo = topo.with_layers(layers)
    plan = plan_migration(src, dst, topo, tokens, draft_tokens=draft_tokens, include_mtp=mtp,
                          ape=ape_weights(ape, topo))
    src_pools, src_tables = source_request(plan, seed=seed)
    dst_pools = destination_pools(plan)
    start = time.perf_counter()
    side: ConvertSide = "sender" if convert_on == "sender" else "receiver"
    tables, report = migrate_local(plan, src_pools, src_tables, dst_pools, convert_on=side, loss_report=loss_report)
    elapsed = time.perf_counter() - start
    if as_json:
        data = report.to_dict()
        data["elapsed_s"] = elapsed
        data["tables"] = tables
        print_json(data)
        return
    print_wrapped(
        f"migrated {plan.model.name}, {tokens:,} tokens, {plan.src.spec} -> {plan.dst.spec} in "
        f"{elapsed:.3f} s (pack {report.pack_s:.3f}, convert {report.convert_s:.3f}, "
        f"publish {report.publish_s:.3f}; converted on the {report.converted_on})"
    )
    if report.kv_lossless is None:
        loss = "loss not measured"
    else:
        kv = "lossless" if report.kv_lossless else f"max abs error {report.kv_max_abs_error:g}"
        loss = f"KV {kv}; indexer max abs error {report.indexer_max_abs_error:g}"
        if report.state_max_abs_error is not None:
            loss += f"; state max abs error {report.state_max_abs_error:g} (fp32 -> bf16)"
    print_wrapped(f"payload {_mib(report.payload_bytes)} MiB in {report.transfers} transfers; {loss}")


def _register_network_commands() -> None:
    from .migrate_net_cmd import COMMANDS

    for cmd in COMMANDS:
        command.add_command(cmd)


_register_network_commands()
