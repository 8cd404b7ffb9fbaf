"""One long request through kvbridge's vLLM connector on CPU, next to a copy of the same bytes in the same run.

A vLLM 0.33.0 consumer (``tests/vllm_engine_side.py bench``, run with ``--vllm-python``: vLLM's own config, KV-cache
groups, allocation, connector factory and scheduler, DeepSeek-V4-Flash's 43 layers and ratios) waits for a
request of ``--tokens`` tokens; this process holds its source pools (``--src``, TensorRT-LLM FP8 by default) and
sends it to the connector over ``--transport`` (gloo, nixl or both), the receiver converting, as a prefill engine's
kvbridge producer would. Per round:

- ``np_copyto`` / ``torch_copy_``: a copy of the payload's bytes (the source records), one before and one after
  the request, their mean the round's baseline;
- ``connector``: from the send's start to the moment vLLM's scheduler learns that the request's KV is in its
  blocks (``get_transfer_results`` in the engine loop, polled every millisecond): handshake, transfer,
  checksums, conversion, the writes through the request's block ids of every KV-cache group;
- ``sender``: the send call in this process (it returns once the receiver's verdict arrived: over gloo after
  the block writes, over NIXL before them);
- the receiver's split as its report gives it (``convert_s``, ``verify_s``, ``publish_s``).

``x np.copyto`` of a row is the median over rounds of its time over the round's baseline (these machines are
shared and noisy: ratios, not seconds). The first round warms up (agents, JIT caches, first touch of vLLM's
buffer) and is left out.

    PYTHONPATH=$PWD python3 scripts/bench_vllm_connector.py --vllm-python /tmp/kvbridge-ci-venv-vllm/bin/python \\
        [--tokens 131072] [--transport both] [--repeat 3] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

import numpy as np
import torch

from kvbridge.engines.topology import FLASH, from_hf_config
from kvbridge.migration import plan_migration, source_request
from kvbridge.migration.nixl import NixlSender
from kvbridge.migration.transport import send_request_tcp
from kvbridge.study.bench import machine

ROOT = Path(__file__).resolve().parent.parent
ENGINE_SIDE = ROOT / "tests" / "vllm_engine_side.py"
#: DeepSeek-V4-Flash's attention shapes as vLLM reads them (no weights: nothing is computed), without its MTP layer.
CONFIG = {"architectures": ["DeepseekV4ForCausalLM"], "model_type": "deepseek_v4", "hidden_size": 256,
          "num_hidden_layers": FLASH.num_layers, "num_attention_heads": 4, "num_key_value_heads": 1, "head_dim": 512,
          "qk_rope_head_dim": 64, "vocab_size": 1024, "max_position_embeddings": 1 << 20, "intermediate_size": 512,
          "compress_ratios": list(FLASH.compress_ratios[:FLASH.num_layers]), "sliding_window": 128,
          "index_head_dim": 128, "index_n_heads": 4, "index_topk": 64, "num_nextn_predict_layers": 0,
          "torch_dtype": "bfloat16", "rms_norm_eps": 1e-6}


def _expect(proc: subprocess.Popen, word: str) -> str:
    """The engine side's next line starting with ``word`` (its other output is logging)."""
    while True:
        line = proc.stdout.readline()
        if not line:
            raise RuntimeError(f"the vLLM engine side ended before {word}: {proc.stderr.read()[-4000:]}")
        if line.startswith(word):
            return line[len(word):].strip()


def run(python: str, tokens: int, src: str, transport: str, repeat: int, kv_mib: int) -> dict:
    model_dir = Path(tempfile.mkdtemp(prefix="kvbridge-bench-vllm-"))
    (model_dir / "config.json").write_text(json.dumps(CONFIG))
    model = from_hf_config(str(model_dir / "config.json"))
    plan = plan_migration(src, "vllm:block=256", model, tokens, include_mtp=False)
    pools, tables = source_request(plan, seed=3)
    nbytes = sum(t.src_bytes for t in plan.transfers)
    a = np.random.default_rng(0).integers(0, 256, nbytes, dtype=np.uint8)
    b = np.empty_like(a)
    ta, tb = torch.from_numpy(a), torch.from_numpy(b)

    def timed(fn) -> float:
        t0 = time.perf_counter()
        fn()
        return time.perf_counter() - t0

    proc = subprocess.Popen([python, str(ENGINE_SIDE), "bench", transport, str(model_dir), str(model_dir),
                             str(tokens + 256), str(kv_mib)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": str(ROOT)})
    rounds = []
    sender = None
    try:
        host, port = _expect(proc, "LISTEN").split()
        if transport == "nixl":
            sender = NixlSender(host, int(port), timeout=600)
            sender.warm_up(nbytes)
        for r in range(repeat + 1):
            rid = f"bench-{r}"
            times = {"np_copyto": timed(lambda: np.copyto(b, a)), "torch_copy_": timed(lambda: tb.copy_(ta))}
            proc.stdin.write(f"load {rid} {tokens} {src}\n")
            proc.stdin.flush()
            _expect(proc, "READY")
            t0 = time.monotonic()
            if sender is not None:
                summary = sender.send_request(plan, pools, tables, request_id=rid, convert_on="receiver",
                                              loss_report=False)
            else:
                summary = send_request_tcp(plan, pools, tables, host=host, port=int(port), request_id=rid,
                                           timeout=600, convert_on="receiver", loss_report=False)
            times["sender"] = time.monotonic() - t0
            got = json.loads(_expect(proc, "RECEIVED"))
            if got["failed"] or got["errors"]:
                raise RuntimeError(f"the connector failed the request: {got['errors']}")
            times["connector"] = got["at"] - t0
            for key in ("convert_s", "verify_s", "publish_s"):
                times[key[:-2]] = float(summary.get(key, 0.0))
            times["np_copyto"] = (times["np_copyto"] + timed(lambda: np.copyto(b, a))) / 2
            times["torch_copy_"] = (times["torch_copy_"] + timed(lambda: tb.copy_(ta))) / 2
            if r:
                rounds.append(times)
        proc.stdin.write("quit\n")
        proc.stdin.flush()
        proc.wait(120)
    finally:
        if sender is not None:
            sender.close()
        if proc.poll() is None:
            proc.kill()
    rows = {key: {"seconds": statistics.median(t[key] for t in rounds),
                  "x_np_copyto": statistics.median(t[key] / t["np_copyto"] for t in rounds)}
            for key in rounds[0]}
    return {"transport": transport, "payload_bytes": nbytes, "written_bytes": sum(t.dst_bytes for t in plan.transfers),
            "rows": rows}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--vllm-python", default=os.environ.get("KVBRIDGE_VLLM_PYTHON"),
                    help="python of a vLLM 0.33.0 venv (.ci/engine-vllm.sh); default $KVBRIDGE_VLLM_PYTHON")
    ap.add_argument("--tokens", type=int, default=131072)
    ap.add_argument("--src", default="trtllm:fp8:tpb=128")
    ap.add_argument("--transport", choices=("gloo", "nixl", "both"), default="both")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--kv-mib", type=int, default=4096,
                    help="vLLM's KV-cache memory in MiB (4096: vLLM's planner wants about 3.9 GiB for one "
                         "131,072-token DeepSeek-V4-Flash request with 2,048-token prefill chunks)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    if not args.vllm_python:
        sys.exit("give --vllm-python (or set KVBRIDGE_VLLM_PYTHON): the python of a vLLM 0.33.0 venv")
    out = {"tokens": args.tokens, "src": args.src, "dst": "vllm:block=256", "model": "deepseek-v4-flash (43 layers)",
           "machine": {**machine(), "load_average": list(os.getloadavg())},
           "date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"), "repeat": args.repeat, "runs": []}
    for transport in (("gloo", "nixl") if args.transport == "both" else (args.transport,)):
        out["runs"].append(run(args.vllm_python, args.tokens, args.src, transport, args.repeat, args.kv_mib))
    if args.json:
        print(json.dumps(out, indent=2))
        return
    m = out["machine"]
    print(f"{out['model']}, {args.tokens} tokens, {args.src} -> vllm:block=256; {m['cpu']} ({m['cpu_cores']} cores, "
          f"{' '.join(m['cpu_vector'])}), native kernels: {m['native_kernels']}, torch {m['torch']}, "
          f"load {m['load_average'][0]:.1f}, {out['date']}")
    for run_ in out["runs"]:
        print(f"\n{run_['transport']}: payload {run_['payload_bytes'] / 1e6:.1f} MB, written into vLLM's blocks "
              f"{run_['written_bytes'] / 1e6:.1f} MB (medians of {args.repeat})")
        for key, row in run_["rows"].items():
            print(f"  {key:12} {row['seconds']:8.3f} s  {row['x_np_copyto']:7.1f} x np.copyto")


if __name__ == "__main__":
    main()
