"""``kvbridge pd-proxy``: one HTTP endpoint driving an SGLang and a vLLM server as the prefill and the decode
of each request (``kvbridge.adapters.pd_proxy``; docs/adapters.md, "Mixed-engine PD")."""

from __future__ import annotations

import click

from kvbridge.errors import InputError

from .common import err_console

# kvbridge.adapters.pd_proxy (aiohttp) is imported when the command runs, so that --help needs neither.


def _listen(ctx: click.Context, param: click.Parameter, value: str) -> tuple[str, int]:
    host, _, port = value.rpartition(":")
    if not host or not port.isdigit() or not 0 <= int(port) < 65536:
        raise click.BadParameter(f"must be HOST:PORT (PORT 0: any free port), got {value!r}")
    return host, int(port)


@click.command("pd-proxy")
@click.option("--pair", required=True, metavar="PREFILL-DECODE",
              help="sglang-vllm (an SGLang prefill, a vLLM decode with the kvbridge connector) or vllm-sglang "
                   "(a vLLM prefill with the connector, an SGLang decode); both with the connector's transport "
                   "sglang.")
@click.option("--prefill", required=True, metavar="URL", help="The prefill server's base URL, http://HOST:PORT.")
@click.option("--decode", required=True, metavar="URL", help="The decode server's base URL, http://HOST:PORT.")
@click.option("--bootstrap", required=True, metavar="[HOST:]PORT",
              help="The SGLang bootstrap address both requests name: sglang-vllm, the SGLang prefill's "
                   "--disaggregation-bootstrap-port (host: the prefill URL's); vllm-sglang, the vLLM connector's "
                   "bootstrap key.")
@click.option("--listen", default="127.0.0.1:8000", show_default=True, callback=_listen, metavar="HOST:PORT",
              help="HOST:PORT the proxy serves on.")
@click.option("--model", default=None, metavar="NAME",
              help="vllm-sglang: the model name of the vLLM prefill's requests (default: vLLM's served model).")
@click.option("--timeout", type=click.FloatRange(min=0, min_open=True), default=600.0, show_default=True,
              help="Seconds an upstream may stay silent before its request fails (HTTP 504).")
def command(pair, prefill, decode, bootstrap, listen, model, timeout) -> None:
    """Serve the prefill/decode proxy of a mixed SGLang + vLLM pair until interrupted."""
    try:
        from kvbridge.adapters import pd_proxy
    except ImportError as exc:
        raise click.ClickException(f"the PD proxy needs aiohttp ({exc}): pip install 'kvbridge[proxy]'") from None
    try:
        cfg = pd_proxy.ProxyConfig.make(pair, prefill, decode, bootstrap, timeout=timeout, model=model)
    except InputError as exc:
        raise click.UsageError(str(exc)) from None
    host, port = listen

    def ready(h: str, p: int) -> None:
        err_console.print(f"pd-proxy {cfg.pair}: prefill {cfg.prefill}, decode {cfg.decode}, bootstrap "
                          f"{cfg.bootstrap[0]}:{cfg.bootstrap[1]}; serving {', '.join(pd_proxy.ROUTES[cfg.pair])} "
                          f"and /health on http://{h}:{p}", soft_wrap=True)

    pd_proxy.serve(cfg, host, port, ready=ready)
