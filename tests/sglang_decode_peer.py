"""An SGLang 0.5.23 decode engine's PD side, run in the SGLang environment (not kvbridge's).

Run by ``tests/test_adapter_sglang.py`` with the SGLang venv's python. It builds SGLang's own
objects the way its decode scheduler does, on CPU: a ``DeepSeekV4TokenToKVPool`` (the DeepSeek-V4
pools), ``MetadataBuffers`` (the per-request metadata rows), the ``KVArgs`` filled by SGLang's
``get_kv_transfer_buf_infos`` / ``setup_state_kv_args`` / ``get_pd_kv_layout`` (every buffer
registered as DRAM), a ``NixlKVManager`` in decode mode and one ``NixlKVReceiver`` per room. With
``"bootstrap": "sglang"`` it also runs SGLang's ``NixlKVBootstrapServer``, which the prefill peer
registers with.

Input: one JSON object on stdin (see ``main``; ``"requests"`` receives several rooms at once). Output:
JSON lines on stdout; the last one is ``{"result": ...}``: ``refused`` (SGLang's handshake raised, with
its message), ``Success`` (every room) or ``Failed`` (a receiver's final poll, with the room and the
failure reason), ``timeout``. ``"watch": ROOM`` emits ``{"event": "partial"}``
once a byte of that room's first KV page landed, and dumps its request-state rows as SGLang cleared them
(``watch_state<c>_<i>``); with ``"dump_failed": true`` a ``Failed`` result names every room's end (``rooms``;
``ended_at``: the wall-clock time its receiver's poll first returned it; ``reasons``) and the buffers are
dumped too. On ``Success`` every registered buffer is written to ``dump`` (``numpy.savez``: ``kv<i>``,
``state<c>_<i>``, ``aux<i>``, as uint8, in registration order). With ``"kv_checksum": true`` the decode runs as with
``--disaggregation-enable-kv-checksum`` (one more metadata buffer, the checksum row) and ``Success``
also carries what SGLang's own code reads from that row (``MetadataBuffers.get_kv_checksum``) and this
decode's layout signature (``kv_layout_signature``). Ends with ``os._exit``: NIXL's libraries can
crash at exit.
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
    import numpy as np
    from sglang.srt.runtime_context import SpawnRanks, publish
    from sglang.srt.server_args import ServerArgs

    sa = ServerArgs(model_path="dummy", disaggregation_mode="decode", disaggregation_transfer_backend="nixl",
                    device="cpu", kv_cache_dtype=cfg["kv_cache_dtype"], page_size=cfg["page_size"],
                    disaggregation_bootstrap_port=cfg.get("bootstrap_port", 8998),
                    disaggregation_enable_kv_checksum=cfg.get("kv_checksum", False))
    publish(sa, role="scheduler", ranks=SpawnRanks(world_rank=0, gpu_id=0))

    from sglang.srt.disaggregation.base.conn import KVPoll, StateType
    from sglang.srt.disaggregation.nixl.conn import NixlKVBootstrapServer, NixlKVManager, NixlKVReceiver
    from sglang.srt.disaggregation.utils import (
        DisaggregationMode,
        is_mla_backend,
        kv_layout_signature,
    )

    pool = deepseek_v4_pool(cfg)
    meta = metadata_buffers(cfg, cfg.get("kv_checksum", False))
    kv_args = nixl_kv_args(cfg, pool, meta, prefill=False)
    emit(event="layout", kv_layout=kv_args.kv_layout, kv_item_lens=list(kv_args.kv_item_lens),
         state_types=[str(st.value) for st in kv_args.state_types],
         state_item_lens=[list(x) for x in kv_args.state_item_lens], aux_item_lens=list(kv_args.aux_item_lens))

    if cfg["bootstrap"] == "sglang":
        NixlKVBootstrapServer("127.0.0.1", cfg["bootstrap_port"])
        addr = f"127.0.0.1:{cfg['bootstrap_port']}"
    else:
        addr = cfg["bootstrap_addr"]
    host_state_kinds(kv_args)  # SGLang's hard-coded VRAM state kinds, on this CPU-only machine
    mgr = NixlKVManager(kv_args, DisaggregationMode.DECODE, sa, is_mla_backend(pool))
    emit(event="ready", bootstrap_addr=addr)

    # one request by default; "requests": [{"room", "num_tokens", "kv_page_ids", "swa_page_ids", "req_pool_idx",
    # "aux_index"}, ...] receives several at once, each through a receiver of its own (a request's own
    # "bootstrap_addr": a prefill serving its bootstrap route itself)
    keys = ("room", "num_tokens", "kv_page_ids", "swa_page_ids", "req_pool_idx", "aux_index")
    requests = cfg.get("requests") or [{k: cfg[k] for k in keys}]
    deadline = time.monotonic() + cfg["timeout"]
    try:
        for where in dict.fromkeys(r.get("bootstrap_addr", addr) for r in requests):
            while not mgr.try_ensure_parallel_info(where):  # 503 until the prefill registered
                if time.monotonic() > deadline:
                    emit(result="timeout", stage="bootstrap")
                    return
                time.sleep(0.2)
    except RuntimeError as exc:  # SGLang's handshake refusing the prefill's page size, dtype or layout
        emit(result="refused", reason=str(exc))
        return

    receivers = []
    for r in requests:
        receivers.append(NixlKVReceiver(mgr, r.get("bootstrap_addr", addr), r["room"]))
        receivers[-1].init(prefill_dp_rank=0)
    for receiver in receivers:
        while receiver.poll() == KVPoll.Bootstrapping:
            if time.monotonic() > deadline:
                emit(result="timeout", stage="init")
                return
            time.sleep(0.05)
    import ctypes

    sent, cleared = [], {}
    for r, receiver in zip(requests, receivers, strict=True):
        payloads = {StateType.SWA: lambda r=r: np.asarray(r["swa_page_ids"], dtype=np.int32),
                    StateType.DSV4_REQUEST_STATE: lambda r=r: pool.request_state_transfer_indices(r["req_pool_idx"],
                                                                                              r["num_tokens"])}
        pool.clear_request_scoped_state(r["req_pool_idx"])
        state_indices = [payloads[st]() if st in payloads else None for st in kv_args.state_types]
        sent.append([None if s is None else [int(i) for i in s] for s in state_indices])
        if r["room"] == cfg.get("watch"):  # the watched room's request-state rows as SGLang cleared them
            for c, rows in enumerate(state_indices[1:], start=1):
                for i, (ptr, n) in enumerate(zip(kv_args.state_data_ptrs[c], kv_args.state_item_lens[c],
                                                 strict=True)):
                    at = ptr + int(rows[0]) * n
                    cleared[f"watch_state{c}_{i}"] = np.ctypeslib.as_array((ctypes.c_uint8 * n).from_address(at)).copy()
        receiver.send_metadata(np.asarray(r["kv_page_ids"], dtype=np.int32), r["aux_index"], state_indices)
    emit(event="metadata", state_indices=sent[0] if len(sent) == 1 else sent)
    # "watch": a room whose first KV page of the first KV buffer is watched: "partial" once a byte landed there
    watch = next((r for r in requests if r["room"] == cfg.get("watch")), None)
    if watch is not None:
        item = kv_args.kv_item_lens[0]
        first_page = np.ctypeslib.as_array((ctypes.c_uint8 * item).from_address(
            kv_args.kv_data_ptrs[0] + watch["kv_page_ids"][0] * item))
    status, ended_at = {}, {}
    while len(status) < len(receivers):
        for r, receiver in zip(requests, receivers, strict=True):
            if r["room"] not in status and (st := receiver.poll()) in (KVPoll.Success, KVPoll.Failed):
                status[r["room"]], ended_at[r["room"]] = st, time.time()
        if watch is not None and first_page.any():
            emit(event="partial", room=watch["room"], at=time.time())
            watch = None
        if time.monotonic() > deadline:
            emit(result="timeout", stage="transfer", done=sorted(status))
            return
        time.sleep(0.02)
    failed = [room for room, st in status.items() if st == KVPoll.Failed]
    if failed and not cfg.get("dump_failed"):
        emit(result="Failed", room=failed[0], reason=mgr.failure_records.get(failed[0], ""))
        return

    def raw(ptr_list, lens):  # a copy of each registered buffer, by address (what NIXL wrote into)
        return [np.ctypeslib.as_array((ctypes.c_uint8 * n).from_address(p)).copy()
                for p, n in zip(ptr_list, lens, strict=True)]

    arrays = {f"kv{i}": a for i, a in enumerate(raw(kv_args.kv_data_ptrs, kv_args.kv_data_lens))}
    for c, (ptrs, lens) in enumerate(zip(kv_args.state_data_ptrs, kv_args.state_data_lens, strict=True)):
        arrays.update({f"state{c}_{i}": a for i, a in enumerate(raw(ptrs, lens))})
    arrays.update({f"aux{i}": a for i, a in enumerate(raw(kv_args.aux_data_ptrs, kv_args.aux_data_lens))})
    arrays.update(cleared)
    tmp = cfg["dump"] + ".part.npz"
    np.savez(tmp, **arrays)
    os.replace(tmp, cfg["dump"])
    checksum = {}
    if meta.kv_checksum is not None:  # what SGLang's decode reads from the row when the request commits
        checksum = {"kv_checksum_row": list(meta.get_kv_checksum(cfg["aux_index"])),
                    "layout_signature": kv_layout_signature(kv_args)}
    if failed:  # "dump_failed": every room's end (status, wall-clock time, SGLang's failure record) and the dump
        emit(result="Failed", rooms={str(room): "Success" if st == KVPoll.Success else "Failed"
                                     for room, st in status.items()},
             ended_at={str(room): t for room, t in ended_at.items()},
             reasons={str(room): mgr.failure_records.get(room, "") for room in failed}, dump=cfg["dump"])
        return
    emit(result="Success", dump=cfg["dump"], **checksum)


def main() -> None:
    cfg = json.loads(sys.stdin.readline())
    try:
        run(cfg)
    except BaseException:
        emit(result="error", traceback=traceback.format_exc())
    finally:
        sys.stderr.flush()
        os._exit(0)


if __name__ == "__main__":
    main()
