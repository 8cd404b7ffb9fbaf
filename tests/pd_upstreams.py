"""The upstream servers of tests/test_pd_proxy.py, run in an engine's venv: ``python tests/pd_upstreams.py
sglang|vllm`` serves a prefill and a decode port (printed as one JSON line once listening) whose request
routes parse every body with that engine's own request classes, as its HTTP server does:

- sglang (0.5.23): ``/generate`` through ``GenerateReqInput`` (pydantic, as FastAPI binds it), then
  ``normalize_batch_and_arguments``, and the scheduler's rule that a disaggregated request has a
  ``bootstrap_room`` (``Scheduler``: "Disaggregated request received without bootstrap room id");
  ``/v1/completions`` through its OpenAI ``CompletionRequest`` (``PDRoutingFields``).
- vllm (0.33.0): ``/v1/completions`` through ``CompletionRequest``, then ``to_sampling_params``, whose
  ``extra_args["kv_transfer_params"]`` is what vLLM's ``Request`` hands the connector; a decode's are read
  with the connector's own ``sglang_source``.

A field the engine would drop (FastAPI ignores unknown dataclass fields, vLLM keeps them as ignored extras)
is answered 400, so that nothing the proxy sends is silently lost. Every parsed request is recorded
(``GET /_log``); ``POST /_control`` makes a role answer an error status, stall, or stream. A request whose
client goes away is recorded as cancelled. The answers' bodies are synthetic (no model runs here).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import sys

from aiohttp import web

ENGINE = sys.argv[1]
LOG: list[dict] = []
#: role -> {"status": int, "message": str} (fail), {"stall": seconds}; cleared by POST /_control {}.
CONTROL: dict[str, dict] = {}


def bad(status: int, message: str) -> web.Response:
    return web.json_response({"error": {"message": message}}, status=status)


def sglang_generate(body: dict) -> dict:
    import pydantic
    from sglang.srt.managers.io_struct import GenerateReqInput

    unknown = body.keys() - {f.name for f in dataclasses.fields(GenerateReqInput)}
    if unknown:
        raise ValueError(f"fields GenerateReqInput does not have (FastAPI drops them): {sorted(unknown)}")
    obj = pydantic.TypeAdapter(GenerateReqInput).validate_python(body)
    obj.normalize_batch_and_arguments()
    if obj.bootstrap_room is None:
        raise ValueError("Invalid request: Disaggregated request received without bootstrap room id.")
    return {"single": obj.is_single, "input_ids": obj.input_ids, "sampling_params": obj.sampling_params,
            "stream": obj.stream, "bootstrap_host": obj.bootstrap_host, "bootstrap_port": obj.bootstrap_port,
            "bootstrap_room": obj.bootstrap_room}


def sglang_completion(body: dict) -> dict:
    from sglang.srt.entrypoints.openai.protocol import CompletionRequest

    req = CompletionRequest.model_validate(body)
    if req.model_extra:
        raise ValueError(f"fields SGLang's CompletionRequest ignores: {sorted(req.model_extra)}")
    if req.bootstrap_room is None:
        raise ValueError("Invalid request: Disaggregated request received without bootstrap room id.")
    return {"prompt": req.prompt, "max_tokens": req.max_tokens, "stream": req.stream, **req.pd_routing_kwargs()}


def vllm_completion(body: dict, role: str) -> dict:
    from vllm.entrypoints.openai.completion.protocol import CompletionRequest

    req = CompletionRequest.model_validate(body)
    if req.model_extra:
        raise ValueError(f"fields vLLM's CompletionRequest ignores (they never reach the connector): "
                         f"{sorted(req.model_extra)}")
    params = req.to_sampling_params(req.max_tokens, {})
    kv = params.extra_args.get("kv_transfer_params") if params.extra_args else None
    out = {"prompt": req.prompt, "model": req.model, "max_tokens": params.max_tokens, "stream": req.stream,
           "kv_transfer_params": kv}
    if role == "decode":
        from kvbridge.adapters.vllm_config import sglang_source

        out["connector_reads"] = list(sglang_source(kv or {}))  # the connector's reader; InputError -> 400
    return out


def reply(engine: str, route: str, role: str, rec: dict) -> dict | list[bytes]:
    """The synthetic answer: one JSON body, or SSE events when the request streams."""
    room = rec.get("bootstrap_room") or (rec.get("kv_transfer_params") or {}).get("bootstrap_room")
    words = [f"{role}-{room}-{i}" for i in range(3 if role == "decode" else 1)]
    if engine == "sglang" and route == "/generate":
        outs = [{"text": w, "output_ids": [i], "meta_info": {"id": f"r{room}", "room": room}}
                for i, w in enumerate(words)]
    else:
        outs = [{"id": f"cmpl-{room}", "object": "text_completion", "model": "m",
                 "choices": [{"index": 0, "text": w, "finish_reason": None}], "room": room} for w in words]
    if not rec.get("stream"):
        return {**outs[-1], "text_all": " ".join(words)}
    return [b"data: " + json.dumps(o).encode() + b"\n\n" for o in outs] + [b"data: [DONE]\n\n"]


def handler(role: str, route: str):
    async def handle(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        try:
            if ENGINE == "sglang":
                rec = sglang_generate(body) if route == "/generate" else sglang_completion(body)
            else:
                rec = vllm_completion(body, role)
        except Exception as exc:  # the engine's validation: pydantic, ValueError, kvbridge's InputError
            LOG.append({"role": role, "route": route, "refused": str(exc)})
            return bad(400, f"{type(exc).__name__}: {exc}")
        rec.update(role=role, route=route)
        LOG.append(rec)
        ctl = CONTROL.get(role, {})
        try:
            if "stall" in ctl:
                await asyncio.sleep(ctl["stall"])
            if "status" in ctl:
                return bad(ctl["status"], ctl.get("message", "injected failure"))
            answer = reply(ENGINE, route, role, rec)
            if isinstance(answer, dict):
                return web.json_response(answer)
            out = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await out.prepare(request)
            for event in answer:
                await out.write(event)
                await asyncio.sleep(ctl.get("gap", 0.05))
            await out.write_eof()
            return out
        except asyncio.CancelledError:
            rec["cancelled"] = True
            raise
    return handle


async def health(request: web.Request) -> web.Response:
    return web.Response(text="") if not CONTROL.get("health") else bad(503, "unhealthy")


async def log(request: web.Request) -> web.Response:
    return web.json_response(LOG)


async def control(request: web.Request) -> web.Response:
    CONTROL.clear()
    CONTROL.update(await request.json())
    LOG.clear()
    return web.json_response({})


def app(role: str) -> web.Application:
    a = web.Application()
    for route in ("/generate", "/v1/completions"):
        a.router.add_post(route, handler(role, route))
    a.router.add_get("/health", health)
    a.router.add_get("/_log", log)
    a.router.add_post("/_control", control)
    return a


async def main() -> None:
    ports = {}
    for role in ("prefill", "decode"):
        runner = web.AppRunner(app(role), handler_cancellation=True, access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        ports[role] = runner.addresses[0][1]
    # warm the engine's classes before the test's first request (their import takes seconds)
    if ENGINE == "sglang":
        import sglang.srt.entrypoints.openai.protocol  # noqa: F401
        import sglang.srt.managers.io_struct  # noqa: F401
    else:
        import vllm.entrypoints.openai.completion.protocol  # noqa: F401

        import kvbridge.adapters.vllm_config  # noqa: F401
    print(json.dumps(ports), flush=True)
    await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)  # until the test closes stdin


if __name__ == "__main__":
    asyncio.run(main())
