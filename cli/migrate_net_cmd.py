"""``kvbridge migrate serve`` / ``send`` / ``bench``: a migration between two processes or hosts.

``serve`` (decode side) listens and receives requests into its engine's pools, or dumps it
converts and writes; ``send`` (prefill side) sends a synthetic request from a pool, or a dump
file. ``bench`` times NIXL and gloo on one machine next to a memory copy of the same bytes.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

import click
from rich.progress import BarColumn, DownloadColumn, Progress, TimeElapsedColumn, TransferSpeedColumn

from kvbridge.engines.topology import get_model
from kvbridge.errors import KVBridgeError

from .common import (
    APE_HELP,
    ape_weights,
    debug_log_option,
    engine_spec_option,
    err_console,
    json_option,
    model_option,
    native_logs,
    parse_layout,
    parse_scale,
    plural,
    print_fields,
)

if TYPE_CHECKING:
    from kvbridge.layouts import Layout
    from kvbridge.migration import EnginePools

# The library modules that import torch are imported inside the commands that use them, so that
# every command's --help runs without torch.

DEFAULT_PORT = 7654
#: Requests at least this large (payload bytes) get a progress bar on a terminal.
LARGE_REQUEST_BYTES = 64 * 2**20


class Failure(click.ClickException):
    """One line, exit code 1 (a transfer or verification failure)."""

    exit_code = 1


def _address(ctx: click.Context, param: click.Parameter, value: str) -> tuple[str, int]:
    from kvbridge.migration.control import parse_address

    try:
        host, port = parse_address(value, default_port=DEFAULT_PORT, listen=param.name == "listen")
    except ValueError as exc:
        raise click.BadParameter(str(exc)) from None
    return host, port


def _topology(model: str, layers: int | None):
    topo = get_model(model)
    if layers is not None:
        if not 1 <= layers <= topo.num_layers:
            raise click.BadParameter(f"must be in 1..{topo.num_layers} for {topo.name}", param_hint="--layers")
        topo = topo.with_layers(layers)
    return topo


def _bytes_progress(visible: bool) -> Progress:
    return Progress("{task.description}", BarColumn(), DownloadColumn(), TransferSpeedColumn(), TimeElapsedColumn(),
                    console=err_console, transient=True, disable=not visible)


def _require_nixl() -> None:
    from kvbridge.migration.nixl_agent import nixl_available

    if not nixl_available():
        raise Failure("the nixl package is not installed: pip install 'kvbridge[nixl]' (after a CPU or CUDA torch)")


def _describe(received) -> list[tuple[str, str]]:
    """One received request or dump as (key, value) lines."""
    if received.kind == "dump":
        loss = "lossless" if all(r.lossless for r in received.loss) else "lossy (see --json)"
        return [("dump", f"from {received.peer}"), ("wrote", str(received.path)),
                ("converted", f"{plural(len(received.loss), 'entry', 'entries')}, {loss}"),
                ("payload", f"{received.payload_bytes:,} B in {received.wire_s:.3f} s")]
    r = received.report
    if r.kv_lossless is None:
        loss = "loss not measured"
    else:
        loss = "KV lossless" if r.kv_lossless else f"KV max abs error {r.kv_max_abs_error:g}"
    return [("request", f"{received.request_id} from {received.peer}"),
            ("tokens", f"{r.num_tokens:,}"), ("payload", f"{r.payload_bytes:,} B in {r.transfers} transfers"),
            ("converted", f"on the {r.converted_on}; {loss}"),
            ("seconds", f"wire {r.wire_s:.3f}, convert {r.convert_s:.3f}, publish {r.publish_s:.3f}")]


@click.command("serve")
@click.option("--listen", "listen", default=f"127.0.0.1:{DEFAULT_PORT}", show_default=True, callback=_address,
              help="HOST:PORT to listen on (port 0: any free port, printed at start).")
@click.option("--transport", type=click.Choice(["nixl", "gloo"]), default="nixl", show_default=True)
@click.option("--engine", callback=engine_spec_option, default=None,
              help="This side's engine spec (e.g. sglang): accept requests into its pools.")
@click.option("--model", default="deepseek-v4-flash", show_default=True, callback=model_option,
              help="Preset name or a Hugging Face config.json path (requests).")
@click.option("--layers", type=click.IntRange(min=1), default=None, help="Keep only the first N main layers.")
@click.option("--max-tokens", type=click.IntRange(min=1), default=131072, show_default=True,
              help="Pool capacity: the longest request it holds (requests).")
@click.option("--to", "to_layout", metavar="LAYOUT", callback=parse_layout, default=None,
              help="Accept dumps and convert them to LAYOUT, as `kvbridge convert --to` does.")
@click.option("--page-size", metavar="P", type=click.IntRange(min=1), help="Dumps: destination tokens per page.")
@click.option("--dialect", metavar="D", help="Dumps: encoder dialect of the destination.")
@click.option("--scale", metavar="S|auto", callback=parse_scale, help="Dumps: destination per-tensor scale.")
@click.option("--out", "out_dir", type=click.Path(file_okay=False, path_type=Path), default=None,
              help="Dumps: directory received dumps are written to (atomically).")
@click.option("--force", is_flag=True, help="Dumps: overwrite an existing file of the same name.")
@click.option("--timeout", type=click.FloatRange(min=0, min_open=True), default=60.0, show_default=True,
              help="Seconds one request may take from connection to verdict.")
@click.option("--max-requests", type=click.IntRange(min=1), default=None,
              help="Exit after this many requests (default: serve until interrupted).")
@click.option("--handshake-timeout", type=click.FloatRange(min=0, min_open=True), default=5.0, show_default=True,
              help="Seconds a connection has for the kvbridge handshake before it is dropped.")
@click.option("--max-connections", type=click.IntRange(min=1), default=32, show_default=True,
              help="Connections served at once; one more is refused as busy.")
@debug_log_option
@click.option("--loss-report/--no-loss-report", default=True, show_default=True,
              help="Measure the conversion loss of requests converted here.")
@click.option("--ape", "ape", multiple=True, metavar="FILE|synthetic",
              help=f"Request (both ends pass the same): {APE_HELP}")
@json_option
def serve_command(listen: tuple[str, int], transport: str, engine: str | None, model: str, layers: int | None,
                  max_tokens: int, to_layout: Layout | None, page_size: int | None, dialect: str | None,
                  scale: float | str | None, out_dir: Path | None, force: bool, timeout: float,
                  max_requests: int | None, handshake_timeout: float, max_connections: int,
                  debug_log: Path | None, loss_report: bool, ape: tuple[str, ...], as_json: bool) -> None:
    """Receive requests (--engine) or dumps (--to, --out) from `kvbridge migrate send`.

    Connections are served concurrently (up to --max-connections; NIXL transfers one at a
    time). Each request is verified chunk by chunk before anything is published, then reported
    (one line, or one JSON object per line with --json) and released. A failed request (dead,
    stalled or silent sender, bad name, over capacity, corrupted page, different plan, foreign
    peer) is one line on stderr, claims nothing, and the server goes on. Exit status with
    --max-requests: 0 if every request succeeded, 1 otherwise; 130 when interrupted.
    """
    if engine is None and to_layout is None:
        raise click.UsageError("give --engine (receive requests) and/or --to with --out (receive dumps)")
    if to_layout is not None and out_dir is None:
        raise click.UsageError("--to needs --out, the directory received dumps are written to")
    if dialect is not None and to_layout is not None and dialect not in to_layout.dialects:
        raise click.BadParameter(f"{dialect!r} does not apply to {to_layout.name}", param_hint="--dialect")
    if transport == "gloo" and (engine is None or to_layout is not None):
        raise click.UsageError("--transport gloo receives requests (--engine); dumps travel over nixl")
    if transport == "nixl":
        _require_nixl()
    from kvbridge.migration import EnginePools, plan_migration
    from kvbridge.migration.nixl import DumpTarget, NixlReceiver, Received
    from kvbridge.migration.transport import GlooServer

    topo = _topology(model, layers)
    dst = None
    if engine is not None:
        dst = EnginePools.create(engine, topo, _capacity(engine, topo, max_tokens))
    weights = ape_weights(ape, topo)

    def plan_for(info: dict):
        return plan_migration(info["src"], engine, topo, int(info["num_tokens"]),
                              draft_tokens=int(info.get("draft_tokens", 0)),
                              include_mtp=bool(info.get("include_mtp", True)), ape=weights)

    if transport == "gloo":
        assert dst is not None
        server = GlooServer(dst, plan=plan_for, host=listen[0], port=listen[1], loss_report=loss_report,
                            handshake_s=handshake_timeout)
    else:
        target = None if to_layout is None else DumpTarget(to_layout.name, page_size, dialect, scale)
        server = NixlReceiver(dst, plan=plan_for if engine else None, host=listen[0], port=listen[1],
                              dump_target=target, dump_dir=out_dir, overwrite=force, loss_report=loss_report,
                              handshake_s=handshake_timeout)

    def received_of(got) -> Received:
        if isinstance(got, Received):
            return got
        peer, rid, tables, report = got  # a GlooServer's result
        return Received("request", peer, rid, report=report, tables=tables, payload_bytes=report.payload_bytes,
                        wire_s=report.wire_s)

    failures = served = 0
    connections = None
    try:
        with native_logs(debug_log):
            connections = server.serve(timeout=timeout, max_connections=max_connections)
            host, port = server.address
            err_console.print(f"kvbridge migrate serve: listening on {host}:{port} ({transport})", highlight=False)
            while max_requests is None or served < max_requests:
                try:
                    got = connections.next(1.0)
                except KVBridgeError as exc:
                    served += 1
                    failures += 1
                    _report_failure(exc, as_json)
                    continue
                if got is None:
                    continue
                served += 1
                received = received_of(got)
                if as_json:
                    click.echo(json.dumps(received.to_dict()))
                else:
                    print_fields(_describe(received))
                sys.stdout.flush()
                if received.tables is not None and dst is not None:
                    with server.lock:
                        _release(dst, received.tables)
    except KeyboardInterrupt:
        err_console.print("interrupted", highlight=False)
        sys.exit(130)
    finally:
        if connections is not None:
            connections.close()
        server.close()
    if failures:
        raise Failure(f"{failures} of {served} requests failed")


def _capacity(engine: str, topo, max_tokens: int) -> dict[str, int]:
    """Pages per block table that hold any one request of up to ``max_tokens`` tokens.

    Compressed tables grow with the length; windowed and state tables peak at lengths just short
    of a page or ratio boundary (all powers of two up to 512), so the last 512 lengths cover them."""
    from kvbridge.engines.profiles import parse_engine
    from kvbridge.migration.plan import request_table_lengths, window_released

    prof = parse_engine(engine)
    cap: dict[str, int] = {}
    for n in range(max(1, max_tokens - 512), max_tokens + 1):
        released = window_released(prof, topo, n, 0)
        for name, length in request_table_lengths(prof, topo, n).items():
            cap[name] = max(cap.get(name, 0), length - min(released.get(name, 0), length))
    return cap


def _report_failure(exc: KVBridgeError, as_json: bool) -> None:
    line = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
    if as_json:
        click.echo(json.dumps({"kind": "error", "error_type": type(exc).__name__, "error": line}))
    err_console.print(f"{type(exc).__name__}: {line}", highlight=False, soft_wrap=True)


def _release(dst: EnginePools, tables: dict) -> None:
    """A serving sink: zero and return the request's pages after reporting it."""
    from kvbridge.migration.nixl_wire import _tensor_tables

    for spec in dst.model.all_caches(dst.include_mtp):
        for tensor, name in _tensor_tables(dst.storage(spec), dst.pool(spec)):
            ids = [i for i in tables.get(name, []) if i >= 0]
            if ids:
                tensor[ids] = 0
    dst.release(tables)


@click.command("send")
@click.argument("dump_path", metavar="[DUMP]", required=False,
                type=click.Path(exists=True, dir_okay=False, path_type=Path))
@click.option("--peer", required=True, callback=_address, help="HOST:PORT of a `kvbridge migrate serve`.")
@click.option("--transport", type=click.Choice(["nixl", "gloo"]), default="nixl", show_default=True)
@click.option("--from", "src", callback=engine_spec_option, default=None, help="Request: the source engine spec.")
@click.option("--to", "to", default=None,
              help="Request: the destination engine spec. Dump: the layout the receiver converts to "
                   "(required with --convert-on sender; checked against the receiver's).")
@click.option("--model", default="deepseek-v4-flash", show_default=True, callback=model_option)
@click.option("--layers", type=click.IntRange(min=1), default=None, help="Keep only the first N main layers.")
@click.option("--tokens", type=click.IntRange(min=1), default=None, help="Request length in tokens.")
@click.option("--draft-tokens", type=click.IntRange(min=0), default=0, show_default=True)
@click.option("--mtp/--no-mtp", default=True, show_default=True)
@click.option("--seed", type=int, default=0, show_default=True, help="Seed of the synthetic request.")
@click.option("--page-size", metavar="P", type=click.IntRange(min=1), help="Dump: destination tokens per page.")
@click.option("--dialect", metavar="D", help="Dump: encoder dialect of the destination.")
@click.option("--scale", metavar="S|auto", callback=parse_scale, help="Dump: destination per-tensor scale.")
@click.option("--name", default=None, help="Dump: file name on the receiver (default: DUMP's name).")
@click.option("--convert-on", type=click.Choice(["sender", "receiver"]), default="receiver", show_default=True)
@click.option("--layers-per-group", type=click.IntRange(min=1), default=1, show_default=True,
              help="Request: layers sent and verified per group.")
@click.option("--timeout", type=click.FloatRange(min=0, min_open=True), default=60.0, show_default=True,
              help="Seconds the whole transfer may take, the receiver's verdict included.")
@click.option("--loss-report/--no-loss-report", default=True, show_default=True)
@click.option("--ape", "ape", multiple=True, metavar="FILE|synthetic",
              help=f"Request (both ends pass the same): {APE_HELP}")
@debug_log_option
@json_option
def send_command(dump_path: Path | None, peer: tuple[str, int], transport: str, src: str | None, to: str | None,
                 model: str, layers: int | None, tokens: int | None, draft_tokens: int, mtp: bool, seed: int,
                 page_size: int | None, dialect: str | None, scale: float | str | None, name: str | None,
                 convert_on: str, layers_per_group: int, timeout: float, loss_report: bool, ape: tuple[str, ...],
                 debug_log: Path | None, as_json: bool) -> None:
    """Send a synthetic request (--from, --to, --tokens) or a dump file (DUMP) to a serving peer.

    Prints the receiver's verdict (its report, or --json). Exit status 0 when the receiver
    published the request, 1 when the transfer or its verification failed, 2 for bad usage.
    """
    from kvbridge.migration import plan_migration, source_request

    with native_logs(debug_log):
        visible = err_console.is_terminal and not as_json
        if dump_path is not None:
            if src is not None or tokens is not None:
                raise click.UsageError("give either DUMP or a request (--from, --to, --tokens), not both")
            layout = None
            if to is not None:
                layout = parse_layout(click.get_current_context(), None, to)
            elif convert_on == "sender":
                raise click.UsageError("--convert-on sender needs --to LAYOUT for a dump")
            if transport == "gloo":
                raise click.UsageError("dumps travel over --transport nixl")
            _require_nixl()
            from kvbridge.migration.nixl import DumpTarget, NixlSender

            target = None if layout is None else DumpTarget(layout.name, page_size, dialect, scale)
            with _bytes_progress(visible and dump_path.stat().st_size >= LARGE_REQUEST_BYTES) as bar, \
                    NixlSender(*peer, timeout=timeout) as sender:
                task = bar.add_task(f"sending {dump_path.name}", total=None)
                summary = sender.send_dump(dump_path, name=name, target=target, convert_on=convert_on,
                                           progress=lambda done, total: bar.update(task, completed=done, total=total))
            if as_json:
                click.echo(json.dumps(summary, indent=2))
            else:
                print_fields([("wrote", f"{summary.get('path')} on {peer[0]}:{peer[1]}"),
                               ("entries", f"{plural(summary.get('entries', 0), 'entry', 'entries')}, "
                                           f"{'lossless' if summary.get('lossless') else 'lossy'}")])
            return
        missing = [flag for flag, v in (("--from", src), ("--to", to), ("--tokens", tokens)) if v is None]
        if missing:
            raise click.UsageError(f"a request needs {', '.join(missing)} (or give a DUMP file)")
        engine_spec_option(click.get_current_context(), None, to)
        topo = _topology(model, layers)
        plan = plan_migration(src, to, topo, tokens, draft_tokens=draft_tokens, include_mtp=mtp,
                              ape=ape_weights(ape, topo))
        pools, tables = source_request(plan, seed=seed)
        total = sum(t.dst_bytes if convert_on == "sender" else t.src_bytes for t in plan.transfers)
        start = time.perf_counter()
        with _bytes_progress(visible and total >= LARGE_REQUEST_BYTES) as bar:
            task = bar.add_task(f"sending {tokens:,} tokens", total=total)

            def progress(done: int, total: int) -> None:
                bar.update(task, completed=done, total=total)

            if transport == "gloo":
                from kvbridge.migration.transport import send_request_tcp

                summary = send_request_tcp(plan, pools, tables, host=peer[0], port=peer[1], convert_on=convert_on,
                                           layers_per_group=layers_per_group, timeout=timeout, progress=progress,
                                           loss_report=loss_report)
            else:
                _require_nixl()
                from kvbridge.migration.nixl import NixlSender

                with NixlSender(*peer, timeout=timeout) as sender:
                    summary = sender.send_request(plan, pools, tables, convert_on=convert_on,
                                                  layers_per_group=layers_per_group, loss_report=loss_report,
                                                  progress=progress)
        elapsed = time.perf_counter() - start
        if as_json:
            click.echo(json.dumps({"elapsed_s": elapsed, "receiver": summary}, indent=2))
            return
        print_fields([("sent", f"{tokens:,} tokens to {peer[0]}:{peer[1]} in {elapsed:.3f} s"),
                       ("from", plan.src.spec), ("into", plan.dst.spec),
                       ("published", f"{summary.get('payload_bytes', 0):,} B by the receiver"),
                       ("converted", f"on the {summary.get('converted_on')}"),
                       ("wire", f"{summary.get('wire_s', 0.0):.3f} s")])


@click.command("bench")
@click.option("--tokens", type=click.IntRange(min=1), default=131072, show_default=True, help="Request length.")
@click.option("--model", default="deepseek-v4-flash", show_default=True, callback=model_option)
@click.option("--from", "src", default="trtllm:fp8:tpb=128", show_default=True, callback=engine_spec_option)
@click.option("--to", "dst", default="vllm", show_default=True, callback=engine_spec_option)
@click.option("--repeat", type=click.IntRange(min=1), default=3, show_default=True, help="Timed runs; medians.")
@click.option("--gloo/--no-gloo", default=True, show_default=True, help="Time the gloo path too.")
@click.option("--request/--no-request", default=True, show_default=True,
              help="Time a whole kvbridge request over NIXL too (no conversion: --to -> --to).")
@click.option("--local", is_flag=True,
              help="Time the request migrated in this process instead, stage by stage (no NIXL needed).")
@click.option("--loss-report", is_flag=True, help="With --local: measure the conversion loss too.")
@click.option("--ape", "ape", multiple=True, metavar="FILE|synthetic",
              help="The model's compressor APE weights, needed between SGLang and vLLM / TensorRT-LLM: safetensors "
                   "file(s) holding layers.N.attn[.indexer].compressor.ape (repeat for shards), or 'synthetic' for "
                   "seeded stand-in weights of the model's shapes (no checkpoint; the output says which were used).")
@json_option
def bench_command(tokens: int, model: str, src: str, dst: str, repeat: int, gloo: bool, request: bool, local: bool,
                  loss_report: bool, ape: tuple[str, ...], as_json: bool) -> None:
    """NIXL pages/s and GB/s for one request's destination bytes, next to a memory copy of the same
    bytes (np.copyto and torch copy_), the XXH3-64 checksum over them (and zlib's CRC-32 for comparison),
    and the gloo path, in one run (GB = 1e9 B). With --local: an in-process migration's stages."""
    from kvbridge.migration.bench import SYNTHETIC_APE

    if SYNTHETIC_APE in ape and len(ape) > 1:
        raise click.UsageError(f"--ape {SYNTHETIC_APE} stands alone; it cannot be combined with files")
    weights = SYNTHETIC_APE if ape == (SYNTHETIC_APE,) else [Path(p) for p in ape] or None
    if local:
        _bench_local(tokens, model, src, dst, repeat, loss_report, weights, as_json)
        return
    if loss_report:
        raise click.UsageError("--loss-report applies to --local only")
    _require_nixl()
    from kvbridge.migration.bench import bench_transports

    res = _measure(bench_transports, as_json, tokens=tokens, model=model, src=src, dst=dst, repeat=repeat,
                   gloo=gloo, request=request, ape=weights)
    if res is None:
        return
    from rich.table import Table

    from .common import console

    req = res["request"]
    console.print(f"{req['model']}, {req['tokens']:,} tokens, {req['src']} -> {req['dst']}: {req['bytes']:,} B in "
                  f"{req['page_chunks']:,} destination page chunks, {req['layers']} layers; "
                  f"{res['machine']['cpu']}, {res['date']}; medians of {res['repeat']}{_ape_line(req['ape'])}",
                  highlight=False)
    table = Table(box=None, header_style="bold")
    for col in ("path", "seconds", "GB/s", "pages/s", "x np.copyto", "x copy_"):
        table.add_column(col, justify="right" if col != "path" else "left")
    base, base_torch = res["memcpy"]["np_copyto"]["seconds"], res["memcpy"]["torch_copy_"]["seconds"]
    rows = [("np.copyto (contiguous)", res["memcpy"]["np_copyto"]),
            ("torch copy_ (contiguous)", res["memcpy"]["torch_copy_"]),
            (f"{res['checksum']['name']} per page chunk", res["checksum"]),
            ("zlib.crc32 per page chunk (protocol 1)", res["crc32"]),
            (f"NIXL, one WRITE ({res['nixl']['one_write']['descriptors']:,} descriptors)", res["nixl"]["one_write"]),
            (f"NIXL, one WRITE per layer ({res['nixl']['per_layer']['writes']})", res["nixl"]["per_layer"])]
    if "gloo" in res:
        rows.append((f"gloo send/recv ({res['gloo']['message_bytes'] >> 20} MiB messages)", res["gloo"]))
    if "request_over_nixl" in res:
        rows.append((f"kvbridge request over NIXL ({res['request_over_nixl']['plan']})", res["request_over_nixl"]))
    for name, row in rows:
        pages = row.get("pages_per_s")
        table.add_row(name, f"{row['seconds']:.4f}", f"{row['GB_per_s']:.2f}",
                      "-" if pages is None else f"{pages:,.0f}", f"{row['seconds'] / base:.2f}",
                      f"{row['seconds'] / base_torch:.2f}")
    console.print(table)
    if not res["nixl"]["bytes_exact"]:
        raise Failure("NIXL moved bytes that differ from the staged ones")


def _measure(bench, as_json: bool, **kwargs) -> dict | None:
    """Run a migration benchmark under a spinner; with --json print its result and return None."""
    with err_console.status("benchmarking") as status:
        res = bench(progress=lambda what: status.update(f"benchmarking: {what}"), **kwargs)
    if as_json:
        click.echo(json.dumps(res, indent=2))
        return None
    return res


def _ape_line(used: dict | None) -> str:
    if used is None:
        return ""
    names = {"synthetic": f"synthetic APE weights (seed {used.get('seed')})",
             "files": f"APE weights from {', '.join(used.get('files', []))}"}
    what = names.get(used["weights"], "the given APE weights")
    return f"; {what}, sha256 {used['sha256'][:16]}"


def _bench_local(tokens: int, model: str, src: str, dst: str, repeat: int, loss_report: bool, ape: object,
                 as_json: bool) -> None:
    from kvbridge.migration.bench import bench_local

    res = _measure(bench_local, as_json, tokens=tokens, model=model, src=src, dst=dst, repeat=repeat,
                   loss_report=loss_report, ape=ape)
    if res is None:
        return
    from rich.table import Table

    from .common import console

    req = res["request"]
    console.print(f"{req['model']}, {req['tokens']:,} tokens, {req['src']} -> {req['dst']} in process, loss report "
                  f"{'on' if req['loss_report'] else 'off'}: payload {req['payload_bytes']:,} B, "
                  f"{req['transfers']} transfers; {res['machine']['cpu']}, {res['machine']['threads']} threads, "
                  f"{res['date']}; load average {res['machine']['load_average'][0]:.1f}; medians of {res['repeat']}"
                  f"{_ape_line(req['ape'])}", highlight=False)
    table = Table(box=None, header_style="bold")
    for col in ("stage", "seconds", "x np.copyto", "x copy_"):
        table.add_column(col, justify="right" if col != "stage" else "left")
    names = {"np_copyto": "np.copyto of the payload", "torch_copy_": "torch copy_ of the payload",
             "gather": "transports' path: gather",
             "checksum": "  checksum (sender, XXH3-64)", "verify": "  verify (receiver)", "convert": "  convert",
             "publish": "  publish (claim + scatter)", "transport_path": "  whole, fused (pack + finish)",
             "transport_pack": "    sender: gather + checksum",
             "transport_finish": "    receiver: verify + convert + publish",
             "migrate_local": "migrate_local (staged, no checksum)", "local_gather": "  gather",
             "local_convert": "  convert", "local_convert_kv": "    KV transcode",
             "local_convert_indexer": "    indexer keys", "local_convert_state": "    compressor state",
             "local_publish": "  publish (claim + scatter)", "byte_move": "byte move (migrate_local, same engine)"}
    for key, name in names.items():
        row = res[key]
        table.add_row(name, f"{row['seconds']:.4f}", f"{row['x_np_copyto']:.1f}", f"{row['x_torch_copy_']:.1f}")
    console.print(table)


COMMANDS = (serve_command, send_command, bench_command)
