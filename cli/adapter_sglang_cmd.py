"""``kvbridge serve-sglang-prefill``: be the prefill server of an unmodified SGLang decode.

Serves one DeepSeek-V4 request to the SGLang decode that asks for ``--room``: the request held in a
kvbridge dump (``--dump``, e.g. written by ``kvbridge sglang-decode --out``), or a synthetic one
(the demo mode) written by the ``--from`` engine's writers and converted to SGLang's pools when that
is another engine. Point the decode's request at ``bootstrap_host``/``bootstrap_port`` = the printed
bootstrap address and ``bootstrap_room`` = ``--room``. Pools of a running engine are served through
the API (``kvbridge.adapters.sglang.SGLangPrefillPeer.add_request``).
"""

from __future__ import annotations

from pathlib import Path

import click
from click.core import ParameterSource

from kvbridge.errors import KVBridgeError

from .common import engine_spec_option, err_console, json_option, model_option, print_fields, print_json
from .migrate_net_cmd import Failure, _address, _require_nixl, _topology

# The library modules that import torch are imported inside the functions that use them, so that
# every command's --help runs without torch.


@click.command("serve-sglang-prefill")
@click.option("--listen", default="127.0.0.1:8998", show_default=True, callback=_address,
              help="HOST:PORT of the bootstrap route (SGLang's --disaggregation-bootstrap-port).")
@click.option("--register-with", default=None, metavar="HOST:PORT",
              help="Register with this SGLang bootstrap server instead of serving the route.")
@click.option("--dump", "dump_path", type=click.Path(exists=True, dir_okay=False, path_type=Path), default=None,
              help="Serve the request held in this kvbridge dump (its KV caches; SWA-only models: a dump holds no "
                   "compressor state) instead of a synthetic one.")
@click.option("--from", "src", default="sglang", show_default=True, callback=engine_spec_option,
              help="Synthetic mode: engine whose writers make the request (converted to SGLang's pools when not "
                   "sglang).")
@click.option("--to", "dst", default="sglang", show_default=True, callback=engine_spec_option,
              help="The decode's SGLang profile (e.g. sglang:state=bf16).")
@click.option("--model", default="deepseek-v4-flash", show_default=True, callback=model_option)
@click.option("--layers", type=click.IntRange(min=1), default=None, help="Keep only the first N main layers.")
@click.option("--tokens", type=click.IntRange(min=1), required=True, help="Request length in tokens.")
@click.option("--room", type=click.IntRange(min=1, max=2**63 - 1), required=True,
              help="The request's bootstrap_room, as the decode's request names it.")
@click.option("--first-token", type=click.IntRange(min=0, max=2**31 - 1), default=0, show_default=True,
              help="The first output token id the decode continues from.")
@click.option("--hidden-state-bytes", type=click.IntRange(min=1), default=64, show_default=True,
              help="Bytes per row of the decode's hidden-state metadata buffer (64 without speculative decoding "
                   "that carries draft hidden states).")
@click.option("--kv-cache-dtype", default="fp8_e4m3", show_default=True, help="The decode's --kv-cache-dtype.")
@click.option("--state-memory", type=click.Choice(["VRAM", "DRAM"]), default="VRAM", show_default=True,
              help="Memory kind the decode registered its state buffers as (SGLang 0.5.23: always VRAM).")
@click.option("--seed", type=int, default=0, show_default=True, help="Synthetic mode: seed of the request.")
@click.option("--timeout", type=click.FloatRange(min=0, min_open=True), default=300.0, show_default=True,
              help="Seconds to wait for the decode.")
@json_option
@click.pass_context
def command(ctx, listen, register_with, dump_path, src, dst, model, layers, tokens, room, first_token,
            hidden_state_bytes, kv_cache_dtype, state_memory, seed, timeout, as_json) -> None:
    """Serve one request to an SGLang decode, as its prefill server (NIXL)."""
    from kvbridge.migration import destination_pools, plan_migration, source_request

    _require_nixl()
    from kvbridge.adapters.sglang import SGLangPrefillPeer
    from kvbridge.dumps.dumpfile import read_dump

    if dump_path is not None:
        given = [f"--{n}" for n, p in (("from", "src"), ("seed", "seed"))
                 if ctx.get_parameter_source(p) != ParameterSource.DEFAULT]
        if given:
            raise click.UsageError(f"{' and '.join(given)} make a synthetic request; --dump serves the dump's")
    try:
        topo = _topology(model, layers)
        plan = plan_migration(dst if dump_path else src, dst, topo, tokens, include_mtp=False)
        if dump_path is None:
            src_pools, src_tables = source_request(plan, seed=seed)
        convert = dump_path is not None or plan.src.spec != plan.dst.spec
        peer = SGLangPrefillPeer(destination_pools(plan) if convert else src_pools,
                                 hidden_state_bytes=hidden_state_bytes,
                                 host=listen[0], bootstrap_port=None if register_with else listen[1],
                                 register_with=register_with, kv_cache_dtype=kv_cache_dtype, timeout=timeout,
                                 state_memory=state_memory)
        with peer:
            if dump_path is not None:
                peer.add_dump_request(room, read_dump(dump_path), tokens, first_token)
            elif convert:
                peer.add_migrated_request(room, plan, src_pools, src_tables, first_token)
            else:
                peer.add_request(room, src_tables, tokens, first_token)
            if not as_json:
                err_console.print(f"serving room {room} ({tokens:,} tokens, {plan.dst.spec}, layout "
                                  f"{peer.layout.kv_layout}) at bootstrap {peer.bootstrap_addr}")
            result = peer.wait(room, timeout)
    except KVBridgeError as exc:
        raise Failure(str(exc)) from None
    result = {"room": room, "bootstrap": peer.bootstrap_addr, "kv_layout": peer.layout.kv_layout, **result}
    if as_json:
        print_json(result)
    else:
        fields = [("room", f"{room}: {result['status']}" + (f" ({result['reason']})" if result["reason"] else "")),
                  ("sent", f"{result['bytes']:,} B in {result['seconds']:.3f} s to {result['peers']} decode rank(s)")]
        if result.get("kv_checksum") is not None:
            fields.append(("checksum", f"KV {result['kv_checksum']:#010x}"))
        print_fields(fields)
    if result["status"] != "Success":
        raise Failure(result["reason"] or "the transfer failed")
