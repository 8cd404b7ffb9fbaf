"""An SGLang 0.5.23 prefill engine's PD side, run in the SGLang environment (not kvbridge's).

Run by ``tests/test_adapter_sglang_decode.py`` with the SGLang venv's python. It builds SGLang's own
objects the way its prefill scheduler does, on CPU: a ``DeepSeekV4TokenToKVPool``, ``MetadataBuffers``,
the ``KVArgs`` filled by SGLang's ``get_kv_transfer_buf_infos`` / ``setup_state_kv_args`` /
``get_pd_kv_layout`` (KV and metadata buffers registered as DRAM), SGLang's ``NixlKVBootstrapServer``
(a prefill server runs it), a ``NixlKVManager`` in prefill mode (it registers itself with that
bootstrap server) and one ``NixlKVSender`` for the request.

Protocol (JSON lines): one config object on stdin (see ``run``); the script answers
``{"event": "layout", ...}`` (SGLang's buffer list: item lengths, buffer sizes, layer ids), then reads
one line ``{"fill": path}``: a ``numpy.savez`` of uint8 arrays ``kv<i>``, ``state<c>_<i>``, ``aux<i>``,
each the whole content of that buffer, which it copies into SGLang's buffers by address (what the
prefill's forward pass and ``MetadataBuffers.set_buf`` would have written). It then answers
``{"event": "ready", "bootstrap_addr": ...}``, waits for a decode to send the request's page ids
(``KVPoll.WaitingForInput``), sends the request as SGLang's prefill scheduler does
(``sender.send(page_indices, state_indices)``; ``"requests"`` serves several rooms in turn;
``"die_after_pages": k`` sends the first ``k`` KV pages as a chunk, answers ``{"event": "partial"}``
and stalls, to be SIGKILLed) and ends with ``{"result": "Success" | "Failed" | "timeout" | "error", ...}``
(the sender's final poll, the failure reason SGLang recorded, seconds).
It stays up until stdin is closed, then ends with ``os._exit``: NIXL's libraries can crash at exit.
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback

from sglang_engine_side import (  # fd 1 -> stderr
    deepseek_v4_pool,
    emit,
    host_state_kinds,
    metadata_buffers,
    nixl_kv_args,
)


def run(cfg: dict) -> None:
    import ctypes
    import logging

    logging.basicConfig(level=cfg.get("log_level", "WARNING"), stream=sys.stderr)

    import numpy as np
    from sglang.srt.runtime_context import SpawnRanks, publish
    from sglang.srt.server_args import ServerArgs

    sa = ServerArgs(model_path="dummy", disaggregation_mode="prefill", disaggregation_transfer_backend="nixl",
                    device="cpu", kv_cache_dtype=cfg["kv_cache_dtype"], page_size=cfg["page_size"],
                    disaggregation_bootstrap_port=cfg["bootstrap_port"], host="127.0.0.1")
    publish(sa, role="scheduler", ranks=SpawnRanks(world_rank=0, gpu_id=0))
    from sglang.srt.runtime_context import get_parallel

    # one prefill rank, no torch.distributed groups: the pipeline group is read only when pp_size > 1
    get_parallel().override_permanently(pp_group=None)

    from sglang.srt.disaggregation.base.conn import KVPoll
    from sglang.srt.disaggregation.nixl.conn import NixlKVBootstrapServer, NixlKVManager, NixlKVSender
    from sglang.srt.disaggregation.utils import (
        DisaggregationMode,
        is_mla_backend,
    )

    pool = deepseek_v4_pool(cfg)
    meta = metadata_buffers(cfg)
    kv_args = nixl_kv_args(cfg, pool, meta, prefill=True)
    emit(event="layout", kv_layout=kv_args.kv_layout, kv_item_lens=list(kv_args.kv_item_lens),
         kv_data_lens=list(kv_args.kv_data_lens), kv_layer_ids=list(kv_args.kv_layer_ids),
         state_types=[str(st.value) for st in kv_args.state_types],
         state_item_lens=[list(x) for x in kv_args.state_item_lens],
         state_data_lens=[list(x) for x in kv_args.state_data_lens],
         state_layer_ids=[list(x) for x in kv_args.state_layer_ids],
         aux_item_lens=list(kv_args.aux_item_lens), aux_data_lens=list(kv_args.aux_data_lens))

    fill = np.load(json.loads(sys.stdin.readline())["fill"])

    def put(name: str, ptr: int, size: int) -> None:
        data = np.ascontiguousarray(fill[name], dtype=np.uint8)
        if data.size != size:
            raise ValueError(f"{name}: {data.size} bytes for a {size}-byte buffer")
        ctypes.memmove(ptr, data.ctypes.data, size)

    for i, (p, n) in enumerate(zip(kv_args.kv_data_ptrs, kv_args.kv_data_lens, strict=True)):
        put(f"kv{i}", p, n)
    for c, (ptrs, lens) in enumerate(zip(kv_args.state_data_ptrs, kv_args.state_data_lens, strict=True)):
        for i, (p, n) in enumerate(zip(ptrs, lens, strict=True)):
            put(f"state{c}_{i}", p, n)
    for i, (p, n) in enumerate(zip(kv_args.aux_data_ptrs, kv_args.aux_data_lens, strict=True)):
        put(f"aux{i}", p, n)

    NixlKVBootstrapServer("127.0.0.1", cfg["bootstrap_port"])
    addr = f"127.0.0.1:{cfg['bootstrap_port']}"
    host_state_kinds(kv_args)  # SGLang's hard-coded VRAM state kinds, on this CPU-only machine
    mgr = NixlKVManager(kv_args, DisaggregationMode.PREFILL, sa, is_mla_backend(pool))
    # one request by default; "requests": [{"room", "aux_index"}, ...] serves several, in order, with
    # the same pages (a prefill cache hit), each through a sender of its own
    requests = cfg.get("requests") or [{"room": cfg["room"], "aux_index": cfg["aux_index"]}]
    kv_pages = np.asarray(cfg["kv_page_ids"], dtype=np.int32)
    senders = []
    for r in requests:
        senders.append(NixlKVSender(mgr, addr, r["room"]))
        senders[-1].init(len(kv_pages), r["aux_index"])
    emit(event="ready", bootstrap_addr=addr)
    # the state payloads SGLang's prefill scheduler builds (send_kv_chunk): the SWA pages of the window
    # (they also address the ratio-4 compressor-state rings), then the ratio-128 ring of the request slot
    payloads = {"swa": lambda: np.asarray(cfg["swa_page_ids"], dtype=np.int32),
                "c128_state": lambda: pool.request_state_transfer_indices(cfg["req_pool_idx"], cfg["num_tokens"])}
    state_indices = [payloads[st.value]() if st.value in payloads else None for st in kv_args.state_types]
    emit(event="sending", state_indices=[None if s is None else [int(i) for i in s] for s in state_indices])
    deadline = time.monotonic() + cfg["timeout"]
    times = []
    for r, sender in zip(requests, senders, strict=True):
        room = r["room"]
        while (status := sender.poll()) == KVPoll.Bootstrapping:  # until the decode sent its page ids
            if time.monotonic() > deadline:
                emit(result="timeout", stage="bootstrap", room=room)
                return
            time.sleep(0.002)
        if status == KVPoll.Failed:
            emit(result="Failed", stage="bootstrap", room=room, reason=mgr.failure_records.get(room, ""))
            return
        t0 = time.perf_counter()
        if cfg.get("die_after_pages"):  # a prefill killed mid-transfer: one chunk of KV pages, then it stalls
            sender.send(kv_pages[: cfg["die_after_pages"]])  # not the last chunk: no state, no status
            time.sleep(0.5)
            emit(event="partial", room=room)
            time.sleep(3600)  # the test SIGKILLs the process here
        sender.send(kv_pages, state_indices, num_kv_tokens=cfg["num_tokens"])
        while (status := sender.poll()) not in (KVPoll.Success, KVPoll.Failed):
            if time.monotonic() > deadline:
                emit(result="timeout", stage="transfer", room=room, status=int(status))
                return
            time.sleep(0.001)
        times.append(time.perf_counter() - t0)
        if status == KVPoll.Failed:
            emit(result="Failed", stage="transfer", room=room, reason=mgr.failure_records.get(room, ""),
                 seconds=times[-1])
            return
    emit(result="Success", seconds=times[0] if len(times) == 1 else times)


def main() -> None:
    cfg = json.loads(sys.stdin.readline())
    try:
        run(cfg)
    except BaseException:
        emit(result="error", traceback=traceback.format_exc())
    finally:
        sys.stderr.flush()
        # stay up, as a prefill server does, until the test closes stdin: the status message SGLang
        # pushes to the decode may still be in ZMQ's queue when the sender reports Success
        sys.stdin.read()
        os._exit(0)


if __name__ == "__main__":
    main()
