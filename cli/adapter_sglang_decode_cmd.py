"""``kvbridge sglang-decode``: be the decode server of an unmodified SGLang prefill, for one request.

Asks the SGLang prefill whose bootstrap server is ``--bootstrap`` for request ``--room`` (its
``bootstrap_room``) of ``--tokens`` prompt tokens, receives its DeepSeek-V4 state over NIXL into
SGLang-profile pools, optionally converts it into another engine's layout (``--to``), and reports it
(``--json``) or writes its KV caches to a kvbridge dump (``--out``).
"""

from __future__ import annotations

from pathlib import Path

import click

from kvbridge.errors import KVBridgeError

from .common import engine_spec_option, err_console, json_option, model_option, print_fields, print_json
from .migrate_net_cmd import Failure, _require_nixl, _topology


def _bootstrap(ctx: click.Context, param: click.Parameter, value: str) -> str:
    host, _, port = value.rpartition(":")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise click.BadParameter(f"must be HOST:PORT, got {value!r}")
    return value


@click.command("sglang-decode")
@click.option("--bootstrap", required=True, callback=_bootstrap, metavar="HOST:PORT",
              help="The SGLang prefill's bootstrap server (its --disaggregation-bootstrap-port).")
@click.option("--room", type=click.IntRange(min=0, max=2**63 - 1), required=True,
              help="The request's bootstrap_room, as the prefill's request names it.")
@click.option("--tokens", type=click.IntRange(min=1), required=True, help="The request's prompt length in tokens.")
@click.option("--engine", "profile", default="sglang", show_default=True, callback=engine_spec_option,
              help="The prefill's SGLang profile (e.g. sglang:idx=fp4; fp32 compressor state only).")
@click.option("--to", "dst", default=None, callback=engine_spec_option,
              help="Convert the received request into this engine's pools (e.g. vllm, trtllm).")
@click.option("--ape", "ape", multiple=True, type=click.Path(dir_okay=False, path_type=Path),
              help="With --to vllm/trtllm and compressed layers: the model's safetensors file(s) holding its "
                   "compressor APE weights (repeat for several shards).")
@click.option("--model", default="deepseek-v4-flash", show_default=True, callback=model_option)
@click.option("--layers", type=click.IntRange(min=1), default=None, help="Keep only the first N main layers.")
@click.option("--out", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="Write the request's KV caches (SWA window, compressed) to this kvbridge dump (safetensors).")
@click.option("--force", is_flag=True, help="Overwrite --out if it exists.")
@click.option("--hidden-state-bytes", type=click.IntRange(min=1), default=64, show_default=True,
              help="Bytes per row of the prefill's hidden-state metadata buffer (64 without speculative decoding "
                   "that carries draft hidden states).")
@click.option("--kv-cache-dtype", default="fp8_e4m3", show_default=True, help="The prefill's --kv-cache-dtype.")
@click.option("--timeout", type=click.FloatRange(min=0, min_open=True), default=300.0, show_default=True,
              help="Seconds to wait for the prefill (bootstrap and transfer).")
@json_option
def command(bootstrap, room, tokens, profile, dst, ape, model, layers, out, force, hidden_state_bytes,
            kv_cache_dtype, timeout, as_json) -> None:
    """Receive one request from an SGLang prefill, as its decode server (NIXL)."""
    _require_nixl()
    from kvbridge.adapters.sglang import request_dump
    from kvbridge.adapters.sglang_decode import SGLangDecodePeer
    from kvbridge.dumps.writer import write_dump
    from kvbridge.migration import EnginePools, destination_pools, plan_migration

    if out is not None and out.exists() and not force:
        raise click.UsageError(f"{out} exists (use --force to overwrite)")
    try:
        topo = _topology(model, layers)
        own = plan_migration(profile, profile, topo, tokens, include_mtp=False)
        conv = plan_migration(profile, dst, topo, tokens, include_mtp=False, ape=list(ape) or None) \
            if dst is not None else None
        pools = EnginePools.create(own.dst, topo, {k: v + 1 for k, v in own.held_pages("dst").items()},
                                   include_mtp=False)
        with SGLangDecodePeer(pools, hidden_state_bytes=hidden_state_bytes, kv_cache_dtype=kv_cache_dtype,
                              timeout=timeout) as peer:
            if not as_json:
                err_console.print(f"asking {bootstrap} for room {room} ({tokens:,} tokens, {own.dst.spec}, layout "
                                  f"{peer.layout.kv_layout})")
            req = peer.receive(bootstrap, room, tokens)
        result = {k: v for k, v in req.to_dict().items() if k != "tables"}
        result.update(engine=own.dst.spec, kv_layout=peer.layout.kv_layout)
        final, tables, plan = pools, req.tables, own
        if conv is not None:
            final = destination_pools(conv)
            tables, report = peer.migrate(req, final, plan=conv)
            result["converted"] = {"engine": conv.dst.spec, **report.to_dict()}
            plan = conv
        if out is not None:
            entries, attrs = request_dump(final, tables, plan)
            attrs.update({"kvbridge.source": f"SGLang prefill {bootstrap}", "room": str(room),
                          "first_token": str(req.first_token), "num_tokens": str(tokens),
                          "engine": plan.dst.spec, "model": topo.name})
            result["out"] = str(write_dump(out, entries, overwrite=force, attrs=attrs))
    except KVBridgeError as exc:
        raise Failure(str(exc)) from None
    if as_json:
        print_json(result)
        return
    fields = [("room", f"{room}: {tokens:,} tokens from {bootstrap}"),
              ("received", f"{req.bytes:,} B in {req.seconds:.3f} s, first token {req.first_token}")]
    if conv is not None:
        fields.append(("converted", f"to {conv.dst.spec}"))
    if out is not None:
        fields.append(("wrote", result["out"]))
    print_fields(fields)
