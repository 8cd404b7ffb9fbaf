"""A PD proxy for mixed-engine prefill/decode: one HTTP endpoint that drives an SGLang and a vLLM server as
the prefill and the decode of each request (``kvbridge pd-proxy``; needs ``pip install 'kvbridge[proxy]'``).

SGLang's own router cannot drive a mixed pair: it sends the same JSON, with ``bootstrap_host``,
``bootstrap_port`` and ``bootstrap_room`` added at its top level, to the prefill and the decode
(sgl-model-gateway ``routers/http/pd_router.rs``: ``inject_bootstrap_into_value``,
``execute_dual_dispatch_internal``). vLLM 0.33.0's ``CompletionRequest`` keeps such top-level fields as
ignored extras (``OpenAIBaseModel``, ``extra="allow"``) and only ``kv_transfer_params`` reaches the
connector (``CompletionRequest.to_sampling_params``: ``extra_args["kv_transfer_params"]``), and a vLLM
prefill must be a one-token request. This proxy writes each side's own request instead.

Pairs (``PAIRS``) and what each side receives, for one request of prompt token ids ``ids`` and a room ``R``
the proxy picks (a random 63-bit integer >= 1, unique among the requests in flight):

- ``sglang-vllm`` (an SGLang prefill, the kvbridge vLLM connector as its decode, transport ``sglang``):
  client ``POST /v1/completions`` (vLLM's body, ``prompt`` as token ids). Prefill: ``POST /generate``
  ``{"input_ids": ids, "sampling_params": {"max_new_tokens": 1}, "bootstrap_host", "bootstrap_port",
  "bootstrap_room": R}``. Decode: the client's body plus ``kv_transfer_params`` ``{"bootstrap_host",
  "bootstrap_port", "bootstrap_room": R}``, as the connector reads them (``vllm_config.sglang_source``).
- ``vllm-sglang`` (a vLLM prefill with the connector, transport ``sglang``, an unmodified SGLang decode):
  client ``POST /generate`` (SGLang's body, ``input_ids``) or ``POST /v1/completions`` (token-id
  ``prompt``). Prefill: ``POST /v1/completions`` ``{"prompt": ids, "max_tokens": 1, "kv_transfer_params":
  {"bootstrap_room": R}}`` (plus ``"model"`` when given). Decode: the client's body plus top-level
  ``bootstrap_host``, ``bootstrap_port``, ``bootstrap_room`` (SGLang's ``GenerateReqInput`` fields, and
  ``PDRoutingFields`` of its OpenAI ``CompletionRequest``).

``bootstrap`` is the SGLang bootstrap address of the pair: the SGLang prefill's
``--disaggregation-bootstrap-port`` (``sglang-vllm``), or the vLLM connector's ``bootstrap`` key
(``vllm-sglang``). Both requests are sent at once (each engine holds the room until the other side
arrives); the decode's response is returned, streamed through as it comes when the client asked for
``"stream": true``. A side that fails (an HTTP error, no connection, no byte within ``timeout`` s) ends the
request with an HTTP error naming it (``{"error": {"side": ..., ...}}``: the upstream's 4xx status, else
502, 504 for a timeout; in a stream already under way, one ``data: {"error": ...}`` event) and the other
side's request is closed, which SGLang's and vLLM's servers take as a client disconnect and abort. The
room of each request is in the response header ``X-KVBridge-Room``. ``GET /health`` asks both upstreams'
``/health``.
"""

from __future__ import annotations

import asyncio
import json
import secrets
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

import aiohttp
from aiohttp import web

from kvbridge.errors import InputError, KVBridgeError

#: pair -> (prefill engine, decode engine).
PAIRS = {"sglang-vllm": ("sglang", "vllm"), "vllm-sglang": ("vllm", "sglang")}
#: pair -> the client routes it serves.
ROUTES = {"sglang-vllm": ("/v1/completions",), "vllm-sglang": ("/generate", "/v1/completions")}
#: Fields only the proxy may set: a client's would be overwritten (or, for a room, shared by two requests).
PROXY_FIELDS = ("bootstrap_host", "bootstrap_port", "bootstrap_room", "bootstrap_pair_key", "kv_transfer_params")
ROOM_HEADER = "X-KVBridge-Room"
_EXCERPT = 300  # characters of an upstream's error body kept in the proxy's message


def upstream_url(url: str, side: str) -> str:
    """``url`` as the base URL of an upstream server (``http[s]://host[:port]``, no path beyond ``/``, no
    query, no user); ``InputError`` naming ``side`` otherwise."""
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError as exc:
        raise InputError(f"--{side} {url!r} is not a URL ({exc}); give http://HOST:PORT") from None
    if parts.scheme not in ("http", "https") or not parts.hostname or parts.path not in ("", "/") \
            or parts.query or parts.fragment or parts.username or parts.password:
        raise InputError(f"--{side} {url!r} must be the server's base URL, http://HOST:PORT (no path, query or user)")
    return f"{parts.scheme}://{parts.hostname if ':' not in parts.hostname else f'[{parts.hostname}]'}" + (
        f":{port}" if port is not None else "")


def bootstrap_address(value: str, prefill: str) -> tuple[str, int]:
    """``HOST:PORT``, or ``PORT`` alone on the prefill URL's host, as (host, port); ``InputError`` otherwise."""
    host, sep, port = str(value).rpartition(":")
    if not sep:
        host = urlsplit(prefill).hostname or ""
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise InputError(f"--bootstrap must be HOST:PORT or PORT (the SGLang bootstrap server), got {value!r}")
    return host, int(port)


@dataclass(frozen=True)
class ProxyConfig:
    """What the proxy drives. ``prefill``/``decode``: the servers' base URLs; ``bootstrap``: the SGLang
    bootstrap address both requests name; ``timeout``: seconds an upstream may stay silent (connect: 10 s at
    most); ``model``: the ``model`` of a vLLM prefill's request (``vllm-sglang``; default vLLM's served model)."""

    pair: str
    prefill: str
    decode: str
    bootstrap: tuple[str, int]
    timeout: float = 600.0
    model: str | None = None

    @classmethod
    def make(cls, pair: str, prefill: str, decode: str, bootstrap: str, timeout: float = 600.0,
             model: str | None = None) -> ProxyConfig:
        """Checked config: an unknown pair, a malformed URL or address, a non-positive timeout is one line."""
        if pair not in PAIRS:
            raise InputError(f"unknown pair {pair!r}: one of {', '.join(PAIRS)} (prefill-decode)")
        if not timeout > 0:
            raise InputError(f"timeout must be positive seconds, got {timeout!r}")
        pre, dec = upstream_url(prefill, "prefill"), upstream_url(decode, "decode")
        return cls(pair, pre, dec, bootstrap_address(bootstrap, pre), float(timeout), model)


class UpstreamError(KVBridgeError):
    """One side failed: ``side`` (prefill / decode), its URL, its HTTP status (None: no answer), why."""

    def __init__(self, side: str, url: str, status: int | None, why: str, timed_out: bool = False):
        super().__init__(f"{side} {url}: {why}")
        self.side, self.url, self.status, self.why, self.timed_out = side, url, status, why, timed_out

    def http_status(self) -> int:
        """The proxy's status: the upstream's 4xx (the request was refused), 504 for a timeout, else 502."""
        if self.timed_out:
            return 504
        return self.status if self.status is not None and 400 <= self.status < 500 else 502

    def payload(self, room: int) -> dict[str, Any]:
        return {"error": {"message": str(self), "type": "upstream_error", "side": self.side, "upstream": self.url,
                          "upstream_status": self.status, "room": room}}


class _ClientError(Exception):
    """A request the proxy cannot forward (HTTP 400)."""


class Rooms:
    """The rooms of the requests in flight: each claim is a fresh random integer in [1, 2**63 - 1] (SGLang's
    router draws from [0, 2**63 - 1]; a vLLM prefill needs >= 1) that no request in flight holds."""

    def __init__(self) -> None:
        self._held: set[int] = set()

    def claim(self) -> int:
        while True:
            room = secrets.randbelow(2**63 - 1) + 1
            if room not in self._held:
                self._held.add(room)
                return room

    def release(self, room: int) -> None:
        self._held.discard(room)

    def __len__(self) -> int:
        return len(self._held)


def _token_ids(value: Any, field: str) -> list[int]:
    if not isinstance(value, list) or not value or not all(
            isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in value):
        raise _ClientError(f"{field} must be one prompt as a non-empty list of token ids: the prefill and the decode "
                           "must hold the same tokens, which text tokenized by two engines does not guarantee "
                           "(tokenize first, e.g. with the decode's /tokenize)")
    return value


def _prompt(route: str, body: dict[str, Any]) -> list[int]:
    """The prompt's token ids of a client body; ``_ClientError`` for what one room cannot serve."""
    if set(PROXY_FIELDS) & body.keys():
        raise _ClientError(f"{', '.join(sorted(set(PROXY_FIELDS) & body.keys()))}: set by the proxy, not the client")
    if route == "/generate":
        if body.get("text") is not None or body.get("input_embeds") is not None:
            raise _ClientError("give input_ids, not text or input_embeds: the prefill and the decode must hold the "
                               "same tokens")
        n = (body.get("sampling_params") or {}).get("n", 1) if isinstance(body.get("sampling_params"), dict) else 1
        ids = _token_ids(body.get("input_ids"), "input_ids")
    else:
        n = body.get("n", 1)
        ids = _token_ids(body.get("prompt"), "prompt")
    if n != 1:
        raise _ClientError(f"n must be 1 (one room per request), got {n!r}")
    return ids


def _requests(cfg: ProxyConfig, route: str, body: dict[str, Any], ids: list[int], room: int
              ) -> tuple[tuple[str, dict], tuple[str, dict]]:
    """(prefill path, body), (decode path, body) of one client request under ``room``."""
    host, port = cfg.bootstrap
    boot = {"bootstrap_host": host, "bootstrap_port": port, "bootstrap_room": room}
    if cfg.pair == "sglang-vllm":
        prefill = {"input_ids": ids, "sampling_params": {"max_new_tokens": 1}, "stream": False, **boot}
        return ("/generate", prefill), ("/v1/completions", {**body, "kv_transfer_params": boot})
    prefill = {"prompt": ids, "max_tokens": 1, "stream": False, "kv_transfer_params": {"bootstrap_room": room}}
    if cfg.model is not None:
        prefill["model"] = cfg.model
    return ("/v1/completions", prefill), (route, {**body, **boot})


def _excerpt(data: bytes) -> str:
    text = " ".join(data.decode("utf-8", "replace").split())
    return text if len(text) <= _EXCERPT else text[:_EXCERPT] + "..."


class PDProxy:
    """The proxy's aiohttp application (``app``) over one client session to both upstreams."""

    def __init__(self, cfg: ProxyConfig):
        self.cfg, self.rooms = cfg, Rooms()
        self._session: aiohttp.ClientSession | None = None
        self.app = web.Application()
        for route in ROUTES[cfg.pair]:
            self.app.router.add_post(route, self._handler(route))
        self.app.router.add_get("/health", self._health)
        self.app.on_startup.append(self._start)
        self.app.on_cleanup.append(self._stop)

    async def _start(self, app: web.Application) -> None:
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=min(10.0, self.cfg.timeout),
                                        sock_read=self.cfg.timeout)
        self._session = aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=0))

    async def _stop(self, app: web.Application) -> None:
        if self._session is not None:
            await self._session.close()

    def _url(self, side: str, path: str) -> str:
        return (self.cfg.prefill if side == "prefill" else self.cfg.decode) + path

    async def _post(self, side: str, path: str, body: dict) -> bytes:
        """POST ``body`` to one side; its 200 body, else ``UpstreamError``."""
        url = self._url(side, path)
        try:
            async with self._session.post(url, json=body) as resp:
                data = await resp.read()
                if resp.status != 200:
                    raise UpstreamError(side, url, resp.status, f"HTTP {resp.status}: {_excerpt(data)}")
                return data
        except asyncio.TimeoutError:
            raise UpstreamError(side, url, None, f"no answer within {self.cfg.timeout:g} s", timed_out=True) from None
        except aiohttp.ClientError as exc:
            raise UpstreamError(side, url, None, f"{type(exc).__name__}: {exc}") from None

    async def _open(self, side: str, path: str, body: dict) -> aiohttp.ClientResponse:
        """POST ``body`` to one side and return the open 200 response (to stream), else ``UpstreamError``."""
        url = self._url(side, path)
        try:
            resp = await self._session.post(url, json=body)
        except asyncio.TimeoutError:
            raise UpstreamError(side, url, None, f"no answer within {self.cfg.timeout:g} s", timed_out=True) from None
        except aiohttp.ClientError as exc:
            raise UpstreamError(side, url, None, f"{type(exc).__name__}: {exc}") from None
        if resp.status != 200:
            try:
                data = await resp.read()
            finally:
                resp.release()
            raise UpstreamError(side, url, resp.status, f"HTTP {resp.status}: {_excerpt(data)}")
        return resp

    def _handler(self, route: str):
        async def handle(request: web.Request) -> web.StreamResponse:
            try:
                body = await request.json()
                if not isinstance(body, dict):
                    raise _ClientError("the body must be a JSON object")
                ids = _prompt(route, body)
            except (_ClientError, ValueError) as exc:
                return web.json_response({"error": {"message": str(exc), "type": "invalid_request_error"}},
                                         status=400)
            room = self.rooms.claim()
            try:
                prefill, decode = _requests(self.cfg, route, body, ids, room)
                if body.get("stream"):
                    return await self._stream(request, room, prefill, decode)
                return await self._whole(room, prefill, decode)
            finally:
                self.rooms.release(room)
        return handle

    async def _whole(self, room: int, prefill: tuple[str, dict], decode: tuple[str, dict]) -> web.Response:
        pre = asyncio.ensure_future(self._post("prefill", *prefill))
        dec = asyncio.ensure_future(self._post("decode", *decode))
        try:
            await _both(pre, dec)
        except UpstreamError as exc:
            return web.json_response(exc.payload(room), status=exc.http_status(), headers={ROOM_HEADER: str(room)})
        return web.Response(body=dec.result(), content_type="application/json", headers={ROOM_HEADER: str(room)})

    async def _stream(self, request: web.Request, room: int, prefill: tuple[str, dict],
                      decode: tuple[str, dict]) -> web.StreamResponse:
        pre = asyncio.ensure_future(self._post("prefill", *prefill))
        opening = asyncio.ensure_future(self._open("decode", *decode))
        resp = None
        try:
            try:
                await _first_failure(pre, opening)  # the decode's headers, unless the prefill failed first
                resp = opening.result()
            except UpstreamError as exc:
                return web.json_response(exc.payload(room), status=exc.http_status(),
                                         headers={ROOM_HEADER: str(room)})
            out = web.StreamResponse(headers={"Content-Type": resp.headers.get("Content-Type", "text/event-stream"),
                                              "Cache-Control": "no-cache", ROOM_HEADER: str(room)})
            await out.prepare(request)
            while True:
                chunk = asyncio.ensure_future(self._read("decode", resp))
                try:
                    await _first_failure(pre, chunk)
                    data = chunk.result()
                except UpstreamError as exc:
                    await out.write(b"data: " + json.dumps(exc.payload(room)).encode() + b"\n\n")
                    break
                if not data:
                    break
                await out.write(data)
            await out.write_eof()
            return out
        finally:
            for task in (pre, opening):
                task.cancel()
            if resp is not None:
                resp.close()

    async def _read(self, side: str, resp: aiohttp.ClientResponse) -> bytes:
        try:
            return await resp.content.readany()
        except asyncio.TimeoutError:
            raise UpstreamError(side, str(resp.url), None, f"stream silent for {self.cfg.timeout:g} s",
                                timed_out=True) from None
        except aiohttp.ClientError as exc:
            raise UpstreamError(side, str(resp.url), None, f"stream broken: {type(exc).__name__}: {exc}") from None

    async def _health(self, request: web.Request) -> web.Response:
        async def probe(side: str) -> str:
            url = self._url(side, "/health")
            try:
                async with self._session.get(url, timeout=aiohttp.ClientTimeout(total=min(10.0, self.cfg.timeout))) \
                        as resp:
                    return "ok" if resp.status == 200 else f"{url}: HTTP {resp.status}"
            except (asyncio.TimeoutError, aiohttp.ClientError) as exc:
                return f"{url}: {type(exc).__name__}: {exc}"
        pre, dec = await asyncio.gather(probe("prefill"), probe("decode"))
        ok = pre == dec == "ok"
        return web.json_response({"status": "ok" if ok else "unavailable", "pair": self.cfg.pair, "prefill": pre,
                                  "decode": dec, "in_flight": len(self.rooms)}, status=200 if ok else 503)


async def _first_failure(pre: asyncio.Future, other: asyncio.Future) -> None:
    """Wait until ``other`` is done; an ``UpstreamError`` of ``pre`` before that is raised at once."""
    waiting = {other} if pre.done() and pre.exception() is None else {pre, other}
    while True:
        done, _ = await asyncio.wait(waiting, return_when=asyncio.FIRST_COMPLETED)
        if pre in done and pre.exception() is not None:
            raise pre.exception()
        if other in done:
            other.result()
            return
        waiting = {other}


async def _both(pre: asyncio.Future, dec: asyncio.Future) -> None:
    """Wait for both sides; the first ``UpstreamError`` is raised and the other side's request cancelled."""
    try:
        done, _ = await asyncio.wait({pre, dec}, return_when=asyncio.FIRST_EXCEPTION)
        for task in (pre, dec):
            if task in done and task.exception() is not None:
                raise task.exception()
        await asyncio.gather(pre, dec)
    finally:
        pre.cancel()
        dec.cancel()


def _runner(cfg: ProxyConfig) -> web.AppRunner:
    # handler_cancellation: a client that disconnects cancels its handler, which closes both upstream requests
    return web.AppRunner(PDProxy(cfg).app, handler_cancellation=True, access_log=None)


def serve(cfg: ProxyConfig, host: str = "127.0.0.1", port: int = 8000, ready=None) -> None:
    """Serve the proxy on ``host:port`` until interrupted; ``ready(host, port)`` is called once it listens."""
    async def main() -> None:
        runner = _runner(cfg)
        await runner.setup()
        try:
            site = web.TCPSite(runner, host, port)
            await site.start()
            if ready is not None:
                ready(*runner.addresses[0][:2])
            await asyncio.Event().wait()
        finally:
            await runner.cleanup()
    asyncio.run(main())


@contextmanager
def running(cfg: ProxyConfig, host: str = "127.0.0.1", port: int = 0) -> Iterator[str]:
    """The proxy on a thread of its own while the block runs; yields its base URL (``port`` 0: any free port)."""
    loop = asyncio.new_event_loop()
    runner = _runner(cfg)

    async def start() -> str:
        await runner.setup()
        await web.TCPSite(runner, host, port).start()
        h, p = runner.addresses[0][:2]
        return f"http://{h}:{p}"

    thread = threading.Thread(target=loop.run_forever, name="kvbridge-pd-proxy", daemon=True)
    thread.start()
    try:
        yield asyncio.run_coroutine_threadsafe(start(), loop).result(30)
    finally:
        asyncio.run_coroutine_threadsafe(runner.cleanup(), loop).result(30)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(30)
        loop.close()
