"""What cleaning the SGLang prefill peer's pages costs for one long request, next to a copy of the same bytes.

One DeepSeek-V4-Flash request (43 layers, ``--tokens`` tokens, default 131,072) held in ``SGLangPrefillPeer``
pools (KV, indexer keys, SWA, compressor-state pools), in this process, on CPU. Per round:

- ``zero_pages``: zeroing every page the request holds (the rule before: ``release_pages`` zeroed them all);
- ``clean_unwritten``: the rule now (``SGLangPrefillPeer._clean_unwritten``: only the pages the room sends but
  does not fill: a cache's last partial page, the window's SWA pages, the state rings);
- ``np_copyto`` / ``torch_copy_``: a copy of as many bytes as the request's pages hold;
- ``send`` (``--send``): the request from the peer to kvbridge's SGLang decode peer over NIXL (``wait``'s
  seconds), once.

    PYTHONPATH=$PWD python3 scripts/bench_sglang_release.py [--tokens 131072] [--repeat 3] [--send] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import numpy as np
import torch

from kvbridge.adapters.sglang import SGLangPrefillPeer
from kvbridge.engines.topology import FLASH
from kvbridge.migration import EnginePools, destination_pools, plan_migration
from kvbridge.migration.pools import pool_tensors


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=131072)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--send", action="store_true", help="also send the request to kvbridge's SGLang decode peer")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    plan = plan_migration("sglang", "sglang", FLASH, args.tokens, include_mtp=False)
    pools = destination_pools(plan, spare_pages=0)
    peer = SGLangPrefillPeer(pools, state_memory="DRAM")
    tables = pools.claim(plan.table_lengths("dst"), plan.released("dst"))
    held = []  # (tensor, page ids) of every page the request holds
    for spec in FLASH.all_caches(False):
        ids = [i for i in tables[pools.storage(spec).table] if i >= 0]
        (x,) = pool_tensors(pools.pool(spec))
        x[ids] = 7
        held.append((x, ids))
    nbytes = sum(x[0].numel() * len(ids) for x, ids in held)
    a, b = np.full(nbytes, 7, dtype=np.uint8), np.zeros(nbytes, dtype=np.uint8)
    ta, tb = torch.from_numpy(a), torch.from_numpy(b)

    def zero_pages() -> None:
        for x, ids in held:
            x[ids] = 0

    rows: dict[str, list[float]] = {"zero_pages": [], "clean_unwritten": [], "np_copyto": [], "torch_copy_": []}
    for _ in range(args.repeat + 1):
        rows["np_copyto"].append(_timed(lambda: np.copyto(b, a)))
        rows["torch_copy_"].append(_timed(lambda: tb.copy_(ta)))
        rows["zero_pages"].append(_timed(zero_pages))
        rows["clean_unwritten"].append(_timed(lambda: peer._clean_unwritten(plan, tables)))
    out = {"tokens": args.tokens, "bytes": nbytes, "load_average": os.getloadavg(),
           **{k: statistics.median(v[1:]) for k, v in rows.items()}}  # round 0 warms up (first touch)
    if args.send:
        from kvbridge.adapters.sglang_decode import SGLangDecodePeer

        dst = EnginePools.create("sglang", FLASH, plan.held_pages("dst"), include_mtp=False)
        with peer, SGLangDecodePeer(dst, timeout=300) as decode:
            peer.add_request(77, tables, args.tokens, 3)
            decode.receive(peer.bootstrap_addr, 77, args.tokens)
            sent = peer.wait(77, timeout=300)
        out["send"], out["send_bytes"] = sent["seconds"], sent["bytes"]
    if args.json:
        print(json.dumps(out))
        return
    for k, v in out.items():
        print(f"{k:>16}: {v:.4f}" if isinstance(v, float) else f"{k:>16}: {v}")


if __name__ == "__main__":
    main()
