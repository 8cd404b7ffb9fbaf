"""Transport benchmark: one request's destination bytes over NIXL and gloo, next to a memory copy.

For a request (default: 128K tokens of DeepSeek-V4-Flash, TensorRT-LLM FP8 -> vLLM) the
bytes that travel when the sender converts are the destination records, written by page index
into the receiver's pools. In one run, median of ``repeat``:

- ``memcpy``: ``np.copyto`` and ``torch.Tensor.copy_`` of the same number of bytes, contiguous;
- ``checksum``: XXH3-64 over every destination page chunk (what each side pays to verify), and
  ``crc32``: ``zlib.crc32`` over the same chunks (the checksum of protocol version 1, for comparison);
- ``nixl``: the same bytes, from a registered staging buffer into the receiver's registered
  pools, as the request's page-run descriptors (merged where adjacent), between two NIXL agent
  processes over UCX: once as one WRITE, once as one WRITE per layer (as the stream sends);
- ``gloo``: the same number of bytes between two processes on a gloo group over loopback, in
  messages of ``DEFAULT_CHUNK_BYTES`` (as ``kvbridge.migration.transport`` sends);
- ``request``: a whole kvbridge request over NIXL with no conversion (``dst`` -> ``dst``): pack,
  checksum, stage, write, verify, publish, end to end.

``bench_local`` times a request migrated in one process instead, stage by stage (no NIXL needed).
"""

from __future__ import annotations

import datetime
import multiprocessing as mp
import os
import platform
import socket
import statistics
import threading
import time
import zlib
from collections.abc import Callable

import numpy as np
import torch
import xxhash

from kvbridge.engines.topology import get_model
from kvbridge.migration.ape import synthetic_ape
from kvbridge.migration.execute import Payload, convert_payload, finish, migrate_local, pack, publish, verify
from kvbridge.migration.nixl import NixlReceiver, NixlSender
from kvbridge.migration.nixl_agent import _Agent, _main_hidden
from kvbridge.migration.nixl_wire import _descriptors, _np, _pieces_of, _pool_chunks, _xxh3
from kvbridge.migration.plan import plan_migration
from kvbridge.migration.pools import gather_records, pool_tensors, table_of
from kvbridge.migration.rows import CHECKSUM, chunk_rows, xxh3_chunks
from kvbridge.migration.stream import layer_groups
from kvbridge.migration.synthetic import destination_pools, source_request
from kvbridge.migration.transport import DEFAULT_CHUNK_BYTES


def _median(fn: Callable[[], float], repeat: int) -> float:
    return statistics.median(fn() for _ in range(repeat))


def _timed(fn: Callable[[], object]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def _rate(nbytes: int, seconds: float, pages: int | None = None) -> dict:
    out = {"seconds": seconds, "GB_per_s": nbytes / seconds / 1e9}
    if pages is not None:
        out["pages_per_s"] = pages / seconds
    return out


def _gloo_rank(rank: int, port: int, nbytes: int, chunk: int, repeat: int, out) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=300))
    buf = torch.empty(nbytes, dtype=torch.uint8)
    if rank == 0:
        buf.random_(0, 256)
    times = []
    for _ in range(repeat):
        dist.barrier()
        t0 = time.perf_counter()
        for i in range(0, nbytes, chunk):
            part = buf[i : i + chunk]
            if rank == 0:
                dist.send(part, 1)
            else:
                dist.recv(part, 0)
        times.append(time.perf_counter() - t0)
    if rank == 1:
        out.put(times)
    dist.barrier()
    dist.destroy_process_group()


def _gloo(nbytes: int, chunk: int, repeat: int) -> list[float]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=_gloo_rank, args=(r, port, nbytes, chunk, repeat, out)) for r in (0, 1)]
    for p in procs:
        p.start()
    try:
        times = out.get(timeout=600)
    finally:
        for p in procs:
            p.join(60)
            if p.is_alive():
                p.kill()
    return times


def bench_transports(*, tokens: int = 131072, model: str = "deepseek-v4-flash", src: str = "trtllm:fp8:tpb=128",
                     dst: str = "vllm", repeat: int = 3, gloo: bool = True, request: bool = True, ape: object = None,
                     progress: Callable[[str], None] | None = None) -> dict:
    """Run every measurement of the module docstring; returns a JSON-ready dict (seconds, GB/s = 1e9 B/s).
    ``ape`` as for ``bench_local``."""
    say = progress or (lambda _: None)
    plan, ape_used = _plan(src, dst, model, tokens, ape)
    pools = destination_pools(plan, seed=1)
    for pool in pools.pools.values():
        for t in pool_tensors(pool):
            t.share_memory_()
    tables = pools.claim(plan.table_lengths("dst"), plan.released("dst"))
    chunks: list = []
    for t in plan.transfers:
        chunks += [c for c, _ in _pool_chunks(t, tables)]
    nbytes = sum(c.nbytes for c in chunks)
    pages = len(chunks)
    staging = torch.empty(nbytes, dtype=torch.uint8).share_memory_()
    staging.random_(0, 256)
    staged = staging.numpy()
    result: dict = {
        "request": {"model": plan.model.name, "tokens": tokens, "src": plan.src.spec, "dst": plan.dst.spec,
                    "bytes": nbytes, "page_chunks": pages, "layers": len(layer_groups(plan)), "ape": ape_used},
        "machine": {"cpu": _cpu(), "python": platform.python_version(), "torch": torch.__version__},
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "repeat": repeat,
    }
    say("memory copy")
    result["memcpy"] = _bench_copy(staging, pages, repeat)
    offsets = np.cumsum([0] + [c.nbytes for c in chunks]).tolist()
    for key, fn in (("checksum", xxhash.xxh3_64_intdigest), ("crc32", zlib.crc32)):
        say(key)

        def every_chunk(fn=fn) -> None:
            for a, b in zip(offsets, offsets[1:], strict=False):
                fn(staged[a:b])

        result[key] = _rate(nbytes, _median(lambda: _timed(every_chunk), repeat), pages)
        result[key]["ratio_to_np_copyto"] = result[key]["seconds"] / result["memcpy"]["np_copyto"]["seconds"]
    result["checksum"]["name"] = CHECKSUM
    say("nixl")
    result["nixl"] = _bench_nixl(plan, pools, tables, staging, chunks, offsets, repeat)
    base = result["memcpy"]["np_copyto"]["seconds"]
    for mode in ("one_write", "per_layer"):
        result["nixl"][mode]["ratio_to_np_copyto"] = result["nixl"][mode]["seconds"] / base
    staging = staged = pools = None  # noqa: F841  (free ~2 x the request before the next measurements)
    if gloo:
        say("gloo")
        times = _gloo(nbytes, DEFAULT_CHUNK_BYTES, repeat)
        result["gloo"] = _rate(nbytes, statistics.median(times), pages)
        result["gloo"]["ratio_to_np_copyto"] = result["gloo"]["seconds"] / base
        result["gloo"]["message_bytes"] = DEFAULT_CHUNK_BYTES
    if request:
        say("request over nixl")
        result["request_over_nixl"] = _bench_request(dst, model, tokens)
        result["request_over_nixl"]["ratio_to_np_copyto"] = result["request_over_nixl"]["seconds"] / base
    return result


def _bench_copy(staging: torch.Tensor, pages: int, repeat: int) -> dict:
    src = staging.numpy()
    target = np.empty_like(src)
    np.copyto(target, src)
    t_target = torch.from_numpy(target)
    return {
        "np_copyto": _rate(src.size, _median(lambda: _timed(lambda: np.copyto(target, src)), repeat), pages),
        "torch_copy_": _rate(src.size, _median(lambda: _timed(lambda: t_target.copy_(staging)), repeat), pages),
    }


def _cpu() -> str:
    try:
        with open("/proc/cpuinfo") as info:
            model = next((line.split(":", 1)[1].strip() for line in info if line.startswith("model name")), None)
    except OSError:
        model = None
    return f"{model or platform.processor() or platform.machine()} ({os.cpu_count()} CPUs)"


def _bench_nixl(plan, pools, tables, staging, chunks, offsets, repeat: int) -> dict:
    rx, tx = _Agent("kvbridge-bench-rx"), _Agent("kvbridge-bench-tx")
    try:
        regions = {}
        memory = {}
        for (layer, role), pool in pools.pools.items():
            for k, t in enumerate(pool_tensors(pool)):
                key = f"pool.{layer}.{role.value}" + (".score" if k else "")
                regions[key] = rx.register(key, t)
                memory[key] = _np(t)
        base = tx.register("staging", staging)
        peer = tx.call("adding the receiver", "add_remote", rx.call("metadata", "metadata"))
        rx.call("adding the sender", "add_remote", tx.call("metadata", "metadata"))
        pieces = _pieces_of(chunks, 0)
        local, remote = _descriptors(pieces, base, regions)
        # per layer: the chunks of each layer's transfers, in plan order
        per_layer, k = [], 0
        for group in layer_groups(plan):
            n = sum(len(_pool_chunks(plan.transfers[i], tables)) for i in group)
            per_layer.append(_descriptors(_pieces_of(chunks[k : k + n], int(offsets[k])), base, regions))
            k += n
        stop = threading.Event()

        def progress_receiver() -> None:  # the receiver's agent moves data only while polled
            while not stop.is_set():
                rx.call("polling", "notifs", 0.05)

        xid = [0]

        def run(descs) -> float:
            poller = threading.Thread(target=progress_receiver)
            poller.start()
            t0 = time.perf_counter()
            try:
                ids = []
                for loc, rem in descs:
                    xid[0] += 1
                    tx.call("posting", "write", xid[0], loc, rem, peer, b"bench")
                    ids.append(xid[0])
                for i in ids:
                    state = tx.call("waiting", "wait", i, 120.0, timeout=180.0)
                    if state != "DONE":
                        raise RuntimeError(f"NIXL transfer ended {state}")
                return time.perf_counter() - t0
            finally:
                stop.set()
                poller.join()
                stop.clear()

        one = _median(lambda: run([(local, remote)]), repeat)
        layered = _median(lambda: run(per_layer), repeat)
        staged = staging.numpy()
        exact = all(_xxh3(memory, c) == xxhash.xxh3_64_intdigest(staged[a:b])
                    for c, a, b in zip(chunks, offsets, offsets[1:], strict=False))
        nbytes = int(offsets[-1])
        return {"one_write": {**_rate(nbytes, one, len(chunks)), "descriptors": int(local.shape[0])},
                "per_layer": {**_rate(nbytes, layered, len(chunks)), "writes": len(per_layer),
                              "descriptors": sum(int(d[0].shape[0]) for d in per_layer)},
                "bytes_exact": exact}
    finally:
        tx.close()
        rx.close()


def _request_receiver(engine: str, model: str, tokens: int, addr_q, out_q) -> None:
    plan = plan_migration(engine, engine, model, tokens)
    with NixlReceiver(destination_pools(plan, seed=3), plan=plan) as rx:
        rx._ensure_agent()
        addr_q.put(rx.address)
        try:
            got = rx.receive(timeout=600, accept_timeout=600)
            out_q.put(None if got is None else got.to_dict()["report"])
        except Exception as exc:  # reported by the parent
            out_q.put(f"{type(exc).__name__}: {exc}")


def _bench_request(engine: str, model: str, tokens: int) -> dict:
    """A whole request ``engine`` -> ``engine`` over NIXL (no conversion) to a receiver process;
    timed from the first group's packing to the receiver's verdict."""
    plan = plan_migration(engine, engine, model, tokens)
    src, tables = source_request(plan, seed=2)
    ctx = mp.get_context("spawn")
    addr_q, out_q = ctx.Queue(), ctx.Queue()
    proc = ctx.Process(target=_request_receiver, args=(engine, model, tokens, addr_q, out_q))
    with _main_hidden():
        proc.start()
    try:
        host, port = addr_q.get(timeout=600)
        with NixlSender(host, port, timeout=600) as tx:
            tx.warm_up(sum(t.dst_bytes for t in plan.transfers))
            t0 = time.perf_counter()
            summary = tx.send_request(plan, src, tables, convert_on="sender", loss_report=False)
            seconds = time.perf_counter() - t0
        report = out_q.get(timeout=600)
    finally:
        proc.join(60)
        if proc.is_alive():
            proc.kill()
    if not isinstance(report, dict):
        raise RuntimeError(f"the benchmark's receiver failed: {report}")
    nbytes = summary["payload_bytes"]
    return {**_rate(nbytes, seconds), "bytes": nbytes, "plan": f"{plan.src.spec} -> {plan.dst.spec}",
            "receiver_wire_s": summary["wire_s"], "receiver_publish_s": summary["publish_s"]}


#: ``ape=`` value of the benchmarks that stands for ``synthetic_ape(model, seed=0)`` (no checkpoint needed).
SYNTHETIC_APE = "synthetic"


def _plan(src: str, dst: str, model: str, tokens: int, ape: object) -> tuple:
    """The benchmarked plan and the JSON record of the APE weights it uses (None when the pair needs none)."""
    topo = get_model(model)
    weights = synthetic_ape(topo, seed=0) if ape == SYNTHETIC_APE else ape
    plan = plan_migration(src, dst, topo, tokens, ape=weights)
    if plan.ape is None:
        return plan, None
    if ape == SYNTHETIC_APE:
        used: dict = {"weights": "synthetic", "seed": 0,
                      "made_by": "kvbridge.migration.ape.synthetic_ape (fp32 ~ N(0, 1), not a model's weights)"}
    elif isinstance(ape, (str, os.PathLike, list, tuple)):
        files = [ape] if isinstance(ape, (str, os.PathLike)) else list(ape)
        used = {"weights": "files", "files": [str(f) for f in files]}
    else:
        used = {"weights": "given"}
    return plan, {**used, "sha256": plan.ape.digest}


def bench_local(*, tokens: int = 131072, model: str = "deepseek-v4-flash", src: str = "trtllm:fp8:tpb=128",
                dst: str = "vllm", repeat: int = 3, loss_report: bool = False, ape: object = None,
                progress: Callable[[str], None] | None = None) -> dict:
    """One request migrated in process, next to ``np.copyto`` and ``torch.Tensor.copy_`` of its payload's
    bytes (the source records), in one run. Each round times the transports' path stage by stage, then
    that path whole (``pack`` + ``finish``, the receiver converting: what ``migrate_local`` ran before it
    staged its batches), then a whole ``migrate_local`` (staged, no checksum), each into fresh destination
    pools, between two copies whose mean is the round's baseline; a row's ``x_np_copyto`` is the median
    over rounds of its time over that baseline. Stages of the transports' path: ``gather`` (source
    records out of the pools), ``checksum`` (the sender's XXH3-64 per source page chunk), ``verify``
    (the receiver's), ``convert`` (every conversion, with the loss report when ``loss_report``),
    ``publish`` (claiming pages and scattering the records). ``local_gather``, ``local_convert`` and
    ``local_publish`` split ``migrate_local``'s time as its report does, and ``local_convert_kv``,
    ``local_convert_indexer``, ``local_convert_state`` its conversion by entry kind. ``transport_pack`` and
    ``transport_finish`` split the transports' path whole: the sender's gather with its checksums in the same
    pass, the receiver's one pass verifying, converting and publishing. ``byte_move``: a ``migrate_local`` of the
    same request from the source engine to itself (same layout, other page ids: no conversion).

    ``ape``: the model's APE weights, for pairs between SGLang and vLLM / TensorRT-LLM (``plan_migration``'s
    ``ape=``), or ``"synthetic"`` (``SYNTHETIC_APE``) for ``synthetic_ape(model, seed=0)``; the result's
    ``request.ape`` says which were used and their sha256 (None when the pair needs none)."""
    say = progress or (lambda _: None)
    plan, ape_used = _plan(src, dst, model, tokens, ape)
    same = plan_migration(plan.src, plan.src, plan.model, tokens)  # the byte move: same engine, other pages
    say("filling the source pools")
    pools, tables = source_request(plan, seed=2)
    nbytes = sum(t.src_bytes for t in plan.transfers)
    a = np.random.default_rng(0).integers(0, 256, nbytes, dtype=np.uint8)
    b = np.empty_like(a)
    np.copyto(b, a)
    ta, tb = torch.from_numpy(a), torch.from_numpy(b)
    rounds: list[dict[str, float]] = []
    for r in range(repeat + 1):  # round 0 warms up (JIT cache loads, first-touch of the pools)
        say(f"round {r + 1}/{repeat + 1}")
        times = {"np_copyto": _timed(lambda: np.copyto(b, a)), "torch_copy_": _timed(lambda: tb.copy_(ta))}
        for key, seconds in _stages(plan, same, pools, tables, loss_report):
            times[key] = seconds
        times["np_copyto"] = (times["np_copyto"] + _timed(lambda: np.copyto(b, a))) / 2
        times["torch_copy_"] = (times["torch_copy_"] + _timed(lambda: tb.copy_(ta))) / 2
        if r:
            rounds.append(times)
    stages = ("gather", "checksum", "verify", "convert", "publish")
    out: dict = {
        "request": {"model": plan.model.name, "tokens": tokens, "src": plan.src.spec, "dst": plan.dst.spec,
                    "payload_bytes": nbytes, "transfers": len(plan.transfers), "loss_report": loss_report,
                    "ape": ape_used},
        "machine": {"cpu": _cpu(), "threads": torch.get_num_threads(), "python": platform.python_version(),
                    "torch": torch.__version__, "load_average": list(os.getloadavg())},
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "repeat": repeat,
    }
    for key in ("np_copyto", "torch_copy_", *stages, "transport_path", "transport_pack", "transport_finish",
                "migrate_local", *LOCAL_STAGES, "byte_move"):
        out[key] = {"seconds": statistics.median(t[key] for t in rounds),
                    "x_np_copyto": statistics.median(t[key] / t["np_copyto"] for t in rounds),
                    "x_torch_copy_": statistics.median(t[key] / t["torch_copy_"] for t in rounds)}
    out["stages_s"] = sum(out[k]["seconds"] for k in stages)
    return out


#: ``migrate_local``'s own split of its time (its report's ``pack_s``, ``convert_s``, ``publish_s``, then
#: ``convert_parts_s``).
LOCAL_STAGES = ("local_gather", "local_convert", "local_publish", "local_convert_kv", "local_convert_indexer",
                "local_convert_state")


def _stages(plan, same, pools, tables, loss_report: bool):
    """(row, seconds) of one migration down the transports' path taken apart, then of that path whole (and its
    two halves), then of a whole ``migrate_local`` and its report's split, then of the byte move ``same``
    (``migrate_local`` between two pools of the source engine, other page ids)."""
    target = destination_pools(plan, seed=1)
    t0 = time.perf_counter()
    records = [gather_records(pools.pool(t.spec), t.src, table_of(tables, t.src), t.first, t.count)
               for t in plan.transfers]
    t1 = time.perf_counter()
    yield "gather", t1 - t0
    chunks = [chunk_rows(t, t.src) for t in plan.transfers]
    sums = [xxh3_chunks(rec, rows) for rec, rows in zip(records, chunks, strict=True)]
    t2 = time.perf_counter()
    yield "checksum", t2 - t1
    payload = Payload(plan.fingerprint(), False, records, chunks, sums)
    t2 = time.perf_counter()
    verify(plan, payload)
    t3 = time.perf_counter()
    yield "verify", t3 - t2
    converted = convert_payload(plan, payload, loss_report=loss_report)
    t4 = time.perf_counter()
    yield "convert", t4 - t3
    publish(plan, converted, target)
    yield "publish", time.perf_counter() - t4
    del payload, converted, records, target
    target = destination_pools(plan, seed=1)
    t0 = time.perf_counter()
    packed = pack(plan, pools, tables, convert=False, loss_report=loss_report)
    t1 = time.perf_counter()
    finish(plan, packed, target, converted_on="receiver", pack_s=0.0, wire_s=0.0, loss_report=loss_report)
    t2 = time.perf_counter()
    yield "transport_path", t2 - t0
    yield "transport_pack", t1 - t0
    yield "transport_finish", t2 - t1
    del packed
    del target
    target = destination_pools(plan, seed=1)
    t0 = time.perf_counter()
    _, report = migrate_local(plan, pools, tables, target, loss_report=loss_report)
    yield "migrate_local", time.perf_counter() - t0
    yield "local_gather", report.pack_s
    yield "local_convert", report.convert_s
    yield "local_publish", report.publish_s
    for kind in ("kv", "indexer", "state"):
        yield f"local_convert_{kind}", report.convert_parts_s.get(kind, 0.0)
    del target
    target = destination_pools(same, seed=5)
    t0 = time.perf_counter()
    migrate_local(same, pools, tables, target, loss_report=False)
    yield "byte_move", time.perf_counter() - t0
