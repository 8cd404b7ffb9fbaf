"""``kvbridge vllm-config``: the ``--kv-transfer-config`` that makes vLLM load kvbridge's connector."""

from __future__ import annotations

import json
import shlex
from pathlib import Path

import click

from kvbridge.adapters.vllm_options import CONVERT_SIDES, LOAD_FAILURE_POLICIES, ROLES, STATE_MEMORIES, TRANSPORTS

# The library modules that import torch are imported inside the functions that use them, so that
# every command's --help runs without torch.


@click.command("vllm-config", short_help="Print vLLM's --kv-transfer-config for the kvbridge connector.")
@click.argument("role", type=click.Choice(list(ROLES)))
@click.option("--listen", metavar="HOST:PORT",
              help="Consumer: where kvbridge producers send (default 127.0.0.1:0; TP rank r listens on PORT + r).")
@click.option("--engine", metavar="SPEC", help="kvbridge spec of these vLLM pools (default vllm:block=<--block-size>).")
@click.option("--model", metavar="MODEL", help="kvbridge model: preset or config.json (default: the served model's).")
@click.option("--timeout", type=float, help="Seconds one transfer may take (default 120).")
@click.option("--convert-on", type=click.Choice(CONVERT_SIDES), help="Producer: the side that converts.")
@click.option("--transport", type=click.Choice(TRANSPORTS),
              help="gloo (default) or nixl: kvbridge's transport to and from this vLLM (both sides must match); "
                   "sglang: SGLang's PD protocol, a producer serving an unmodified SGLang decode or a consumer fed "
                   "by an unmodified SGLang prefill.")
@click.option("--landing-tokens", type=click.IntRange(min=1), metavar="N",
              help="Consumer, nixl: the longest request its host-memory landing area holds (default max_model_len); "
                   "sglang: the longest its SGLang-layout pools hold (max_inflight of them).")
@click.option("--on-load-failure", type=click.Choice(LOAD_FAILURE_POLICIES),
              help="Consumer: vLLM fails (its default) or recomputes a request whose load failed.")
@click.option("--ape", "ape", multiple=True, type=click.Path(dir_okay=False, path_type=Path),
              help="The model's safetensors shards holding its compressor APE weights (repeatable); needed for "
                   "requests from or to SGLang pools.")
@click.option("--bootstrap", metavar="HOST:PORT",
              help="Producer, sglang: where SGLang decodes find this prefill (default 127.0.0.1:8998).")
@click.option("--register-with", metavar="HOST:PORT",
              help="Producer, sglang: register with this SGLang bootstrap server instead.")
@click.option("--sglang-engine", metavar="SPEC",
              help="sglang: the SGLang decode's (producer) or prefill's (consumer) kvbridge spec (default sglang).")
@click.option("--state-memory", type=click.Choice(STATE_MEMORIES),
              help="Producer, sglang: the kind the decode registers its compressor state as (default VRAM).")
@click.option("--serve", "serve_model", metavar="MODEL", help="Print a whole 'vllm serve MODEL ...' command instead.")
def command(role: str, listen: str | None, engine: str | None, model: str | None, timeout: float | None,
            convert_on: str | None, transport: str | None, landing_tokens: int | None, on_load_failure: str | None,
            ape: tuple[Path, ...], bootstrap: str | None, register_with: str | None, sglang_engine: str | None,
            state_memory: str | None, serve_model: str | None) -> None:
    """Print the --kv-transfer-config JSON (one line) for a kvbridge connector in ROLE.

    \b
    vllm serve MODEL --kv-cache-dtype fp8_ds_mla --block-size 256 \\
        --kv-transfer-config \\
        "$(kvbridge vllm-config consumer --listen 0.0.0.0:7300)"
    """
    from kvbridge.adapters.vllm_config import kv_transfer_config
    from kvbridge.engines.profiles import parse_engine

    config = kv_transfer_config(role, listen=listen, engine=engine, model=model, timeout=timeout,
                                convert_on=convert_on, on_load_failure=on_load_failure, transport=transport,
                                landing_tokens=landing_tokens, ape=[str(p.resolve()) for p in ape] or None,
                                bootstrap=bootstrap, register_with=register_with, sglang_engine=sglang_engine,
                                state_memory=state_memory)
    text = json.dumps(config, separators=(",", ":"))
    if serve_model is None:
        click.echo(text)
        return
    spec = parse_engine(config.get("kv_connector_extra_config", {}).get("engine", "vllm"))
    block = next(c.value for c in spec.choices if c.option == "block")
    dtype = "fp8_ds_mla" if spec.kv_layout == "flashmla-model1" else "auto"
    click.echo(f"vllm serve {shlex.quote(serve_model)} --kv-cache-dtype {dtype} --block-size {block} "
               f"--kv-transfer-config {shlex.quote(text)}")
