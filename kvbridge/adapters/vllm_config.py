"""The ``--kv-transfer-config`` that makes vLLM load kvbridge's connector (no vLLM import: the CLI uses it)."""

from __future__ import annotations

from typing import Any

import torch

from kvbridge.adapters.vllm_options import CONVERT_SIDES, LOAD_FAILURE_POLICIES, ROLES, STATE_MEMORIES, TRANSPORTS
from kvbridge.engines.profiles import EngineProfile, parse_engine
from kvbridge.engines.topology import ModelTopology
from kvbridge.errors import InputError


def host_port(value: str, what: str) -> tuple[str, int]:
    """``host:port`` (host may be empty: 127.0.0.1) as a pair; ``InputError`` naming ``what`` otherwise."""
    host, sep, port = str(value).rpartition(":")
    if not sep or not port.isdigit() or not 0 <= int(port) < 65536:
        raise InputError(f"{what} must be host:port, got {value!r}")
    return host or "127.0.0.1", int(port)


def positive_int(value: object, what: str) -> int:
    """``value`` as a positive integer; ``InputError`` naming ``what`` otherwise."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise InputError(f"{what} must be a positive integer, got {value!r:.40}")
    return value


def ape_paths(value: object) -> list[str]:
    """The ``ape`` key's safetensors paths (one path or a list of a checkpoint's shards) as a list."""
    paths = [value] if isinstance(value, str) else value
    if not isinstance(paths, list) or not paths or not all(isinstance(p, str) and p for p in paths):
        raise InputError("kv_connector_extra_config: ape must be a safetensors path or a non-empty list of them "
                         f"(the checkpoint's shards holding layers.N.attn[.indexer].compressor.ape), got {value!r:.80}")
    return list(paths)


def check_sglang_keys(kv_role: str, transport: str | None, extra: dict[str, Any]) -> None:
    """Refuse, with one line, what transport ``sglang`` cannot do: role ``kv_both`` (the connector is either
    an SGLang decode's prefill, ``kv_producer``, or an SGLang prefill's decode, ``kv_consumer``), its keys with
    another transport, a prefill's keys (``bootstrap``, ``register_with``, ``state_memory``, ``max_send_rate``) on a
    decode, both ``bootstrap`` and ``register_with``, a malformed address, a spec that is not SGLang's, an unknown
    state kind, a rate that is not a positive integer."""
    keys = [k for k in ("bootstrap", "register_with", "sglang_engine", "state_memory", "max_send_rate") if k in extra]
    if transport != "sglang":
        if keys:
            raise InputError(f"kv_connector_extra_config {', '.join(keys)}: keys of transport sglang, the transport "
                             f"is {transport or 'gloo'}")
        return
    if kv_role not in ("kv_producer", "kv_consumer"):
        raise InputError(f"transport sglang makes this vLLM an SGLang decode's prefill (kv_producer) or an SGLang "
                         f"prefill's decode (kv_consumer), one of them: got {kv_role}")
    prefill_keys = [k for k in ("bootstrap", "register_with", "state_memory", "max_send_rate") if k in extra]
    if kv_role == "kv_consumer" and prefill_keys:
        raise InputError(f"kv_connector_extra_config {', '.join(prefill_keys)}: keys of a prefill (kv_producer); a "
                         "decode finds each request's SGLang prefill in its kv_transfer_params (bootstrap_host, "
                         "bootstrap_port, bootstrap_room)")
    if "bootstrap" in extra and "register_with" in extra:
        raise InputError("give one of bootstrap (serve SGLang's bootstrap route) and register_with (an SGLang "
                         "bootstrap server), not both")
    for key in ("bootstrap", "register_with"):
        if key in extra:
            host_port(extra[key], f"kv_connector_extra_config {key}")
    if "sglang_engine" in extra and parse_engine(str(extra["sglang_engine"])).engine != "sglang":
        raise InputError("kv_connector_extra_config sglang_engine must be an SGLang spec, got "
                         f"{extra['sglang_engine']!r}")
    if "state_memory" in extra and extra["state_memory"] not in STATE_MEMORIES:
        raise InputError("kv_connector_extra_config state_memory must be VRAM or DRAM, got "
                         f"{extra['state_memory']!r}")
    if "max_send_rate" in extra:
        positive_int(extra["max_send_rate"], "kv_connector_extra_config max_send_rate (bytes per second)")


def sglang_source(params: dict[str, Any]) -> tuple[str, int]:
    """A transport-sglang decode request's prefill: (``bootstrap_host:bootstrap_port``, ``bootstrap_room``)
    from its ``kv_transfer_params``, the three fields SGLang's router sets on both ends of a PD request;
    ``InputError`` naming the field otherwise."""
    host, port, room = params.get("bootstrap_host"), params.get("bootstrap_port"), params.get("bootstrap_room")
    if not isinstance(host, str) or not host:
        raise InputError(f"bootstrap_host must be the SGLang prefill's host name or address, got {host!r:.40}")
    if isinstance(port, bool) or not isinstance(port, int) or not 0 < port < 65536:
        raise InputError(f"bootstrap_port must be the SGLang prefill's bootstrap port (1..65535), got {port!r:.40}")
    if isinstance(room, bool) or not isinstance(room, int) or not 0 <= room < 2**63:
        raise InputError(f"bootstrap_room must be a non-negative 63-bit integer, got {room!r:.40}")
    return f"{host}:{port}", room


def device_gpu_family() -> str | None:
    """``sm90`` / ``sm100`` / ``sm120`` of CUDA device 0 (``torch.cuda.get_device_capability``); None on a
    machine without CUDA."""
    if not torch.cuda.is_available():
        return None
    major, _ = torch.cuda.get_device_capability()
    return f"sm{major}0"


def connector_mtp(speculative_config: Any, model: ModelTopology) -> bool:
    """Whether the connector moves the model's MTP layers' caches: True when vLLM serves ``model`` with its own
    MTP draft (``--speculative-config '{"method": "mtp", ...}'``: vLLM then registers the caches of layers
    ``num_layers ..`` as ``model.layers.<i>.attn...``), False without a draft model's caches (no speculative
    config, or n-gram / suffix drafts); any other draft model's caches are refused by name."""
    if speculative_config is None or not speculative_config.uses_draft_kv_cache():
        return False
    method = getattr(speculative_config, "method", None)
    if method != "mtp":
        raise InputError(f"vLLM serves with speculative method {method!r}, whose draft model has KV caches of its "
                         "own: kvbridge moves DeepSeek-V4's own MTP layers only (method mtp); serve with "
                         "--speculative-config '{\"method\": \"mtp\", ...}' or without a draft model")
    if not model.num_mtp_layers:
        raise InputError(f"vLLM serves with an MTP draft, but model {model.name}'s config has no MTP layers "
                         "(num_nextn_predict_layers = 0); give kv_connector_extra_config model the served model's "
                         "config.json")
    return True


def connector_profile(spec: str | None, block_size: int, gpu: str | None) -> EngineProfile:
    """The connector's vLLM profile: ``spec`` (default ``vllm:block=<block_size>``), its GPU family the
    device's (``gpu``); a ``gpu=`` option that contradicts the device is refused (SM90 and SM100 pages
    have the same sizes: a wrong family would mis-store indexer scales silently)."""
    profile = parse_engine(spec or f"vllm:block={block_size}")
    if profile.engine != "vllm":
        raise InputError(f"kv_connector_extra_config engine must be a vLLM spec, got {profile.spec!r}")
    if gpu is None:
        return profile
    choice = next(c for c in profile.choices if c.option == "gpu")
    if choice.given and choice.value != gpu:
        raise InputError(f"kv_connector_extra_config engine says gpu={choice.value}, but this device is {gpu} "
                         f"(torch.cuda.get_device_capability); drop gpu= or give gpu={gpu}")
    return profile if choice.given else parse_engine(f"{spec or f'vllm:block={block_size}'}:gpu={gpu}")


def kv_transfer_config(role: str, *, listen: str | None = None, engine: str | None = None, model: str | None = None,
                       timeout: float | None = None, convert_on: str | None = None,
                       on_load_failure: str | None = None, transport: str | None = None,
                       landing_tokens: int | None = None, ape: list[str] | None = None,
                       max_inflight: int | None = None, hold_timeout: float | None = None,
                       bootstrap: str | None = None, register_with: str | None = None,
                       sglang_engine: str | None = None, state_memory: str | None = None,
                       max_send_rate: int | None = None) -> dict[str, Any]:
    """vLLM's ``--kv-transfer-config`` for kvbridge's connector (``kvbridge.adapters.vllm``) in ``role``.

    Only the keys given go into ``kv_connector_extra_config`` (the connector's defaults apply to
    the rest); each is checked here as the connector would check it. ``on_load_failure`` sets
    vLLM's own ``kv_load_failure_policy`` (``fail``, vLLM's default: the request ends with an
    error; ``recompute``: vLLM computes the prompt itself). ``ape``: the model's safetensors files
    (or just those holding ``...compressor.ape``) for requests to or from SGLang pools.

    Transport ``sglang``: role ``producer`` makes this vLLM the prefill of an unmodified SGLang decode,
    with ``bootstrap`` (``host:port`` where the connector serves SGLang's bootstrap route) or
    ``register_with`` (an SGLang bootstrap server's ``host:port``), ``sglang_engine`` (the decode's
    kvbridge spec, default ``sglang``) and ``state_memory`` (the kind the decode registers its
    compressor state as: ``VRAM``, SGLang's, or ``DRAM``) and ``max_send_rate`` (bytes per second a room's
    writes may take, paced; default unpaced); role ``consumer`` makes it the decode of an
    unmodified SGLang prefill (``sglang_engine``: the prefill's spec; ``landing_tokens``: the longest
    request its SGLang-layout landing pools hold); see ``check_sglang_keys``.
    """
    if role not in ROLES:
        raise InputError(f"role must be one of {', '.join(ROLES)}, got {role!r}")
    extra: dict[str, Any] = {}
    if listen is not None:
        if role == "producer":
            raise InputError("listen is a consumer setting (where kvbridge producers send); a producer sends to "
                             "each request's kvbridge_peer")
        host_port(listen, "listen")
        extra["listen"] = listen
    if engine is not None:
        profile = parse_engine(engine)
        if profile.engine != "vllm":
            raise InputError(f"engine must be a vLLM spec (vllm:block=...), got {engine!r}")
        extra["engine"] = profile.spec
    if model is not None:
        extra["model"] = model
    if timeout is not None:
        if not timeout > 0:
            raise InputError(f"timeout must be a positive number of seconds, got {timeout}")
        extra["timeout"] = timeout
    if convert_on is not None:
        if convert_on not in CONVERT_SIDES:
            raise InputError(f"convert_on must be sender or receiver, got {convert_on!r}")
        extra["convert_on"] = convert_on
    if transport is not None:
        if transport not in TRANSPORTS:
            raise InputError(f"transport must be gloo or nixl (or sglang: SGLang's PD protocol, to an SGLang decode "
                             f"or from an SGLang prefill), got {transport!r}")
        extra["transport"] = transport
    sglang = {k: v for k, v in (("bootstrap", bootstrap), ("register_with", register_with),
                                ("sglang_engine", sglang_engine), ("state_memory", state_memory),
                                ("max_send_rate", max_send_rate)) if v is not None}
    if transport == "sglang" or sglang:
        check_sglang_keys(ROLES[role], transport, sglang)
        extra.update(sglang)
    if landing_tokens is not None:
        if transport not in ("nixl", "sglang") or (transport == "nixl" and role == "producer"):
            raise InputError("landing_tokens sizes a NIXL consumer's landing area (transport nixl, role consumer or "
                             "both) or a transport-sglang connector's SGLang pools")
        if isinstance(landing_tokens, bool) or not isinstance(landing_tokens, int) or landing_tokens < 1:
            raise InputError(f"landing_tokens must be a positive integer, got {landing_tokens!r}")
        extra["landing_tokens"] = landing_tokens
    if ape is not None:
        extra["ape"] = ape_paths(ape)
    if max_inflight is not None:
        extra["max_inflight"] = positive_int(max_inflight, "max_inflight")
    if hold_timeout is not None:
        if isinstance(hold_timeout, bool) or not isinstance(hold_timeout, (int, float)) or hold_timeout < 0:
            raise InputError(f"hold_timeout must be a number of seconds >= 0, got {hold_timeout!r}")
        extra["hold_timeout"] = hold_timeout
    config: dict[str, Any] = {"kv_connector": "KVBridgeConnector", "kv_connector_module_path": "kvbridge.adapters.vllm",
                              "kv_role": ROLES[role]}
    if on_load_failure is not None:
        if on_load_failure not in LOAD_FAILURE_POLICIES:
            raise InputError(f"on_load_failure must be fail or recompute, got {on_load_failure!r}")
        config["kv_load_failure_policy"] = on_load_failure
    if extra:
        config["kv_connector_extra_config"] = extra
    return config
