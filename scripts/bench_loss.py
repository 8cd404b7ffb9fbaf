"""The loss statistics of a transcode (``native_loss.loss_stats``) against same-run ``np.copyto`` of the same bytes.

Two cases: a per-tensor E4M3 (``trtllm-fp8``, scale 0.01) pool of N(0, 1) values against the MODEL1 pool
transcoded from it (no saturation count), and that MODEL1 pool against the fp8 pool transcoded back
(with the ``swa`` multiplier's saturation count). Per case and implementation (``numba``: the numba
accelerators; ``c``: the compiled ones, ``kvbridge.backends.native._kernels``; ``generic``: the record-program kernel),
each timed call sits between two ``np.copyto`` (one thread) of both pools' bytes; ``x copy`` is the
median over ``--repeat`` rounds of the call's time over the mean of its two copies; also the best call
over the best copy. ``--tokens 8192`` keeps both pools in the CPU caches (a migration's staged batch),
where the best of many rounds is the steadier figure on a loaded machine.

    PYTHONPATH=$PWD python3 scripts/bench_loss.py [--tokens 1048576] [--repeat 5] [--threads 2] \
        [--impl numba c] [--json]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import time
from datetime import datetime, timezone

import numpy as np
import torch

from kvbridge.backends import native
from kvbridge.backends.native import accel as native_accel
from kvbridge.backends.native import loss as native_loss
from kvbridge.backends.native import pool as native_pool
from kvbridge.layouts import get_layout
from kvbridge.layouts.codec import tensor_multiplier

P = 64


@contextlib.contextmanager
def _implementation(name: str):
    """Run ``loss_stats`` with ``name``'s kernels (``numba`` or ``c`` switch ``native_accel._CK``)."""
    saved = native_accel._CK
    if name == "c" and saved is None:
        raise SystemExit(f"no compiled kernels here: {native_accel.kernel_implementation()}")
    if name == "numba":
        native_accel._CK = None
    try:
        yield
    finally:
        native_accel._CK = saved


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=1 << 20)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--impl", nargs="+", default=["numba", "c"], choices=["numba", "c", "generic"])
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    n = args.tokens
    fp8, m1 = get_layout("trtllm-fp8"), get_layout("flashmla-model1")
    x = torch.randn(n, 512, generator=torch.Generator().manual_seed(0))
    fp8_pages = native.encode_pages(x, fp8, P, "swa", 0.01)
    del x
    m1_pages = native.transcode_pages(fp8_pages, fp8, P, m1, P, n, 0.01, 1.0, "flashmla")
    back = native.transcode_pages(m1_pages, m1, P, fp8, P, n, 1.0, 0.01, "swa")
    cases = {
        "trtllm-fp8 -> MODEL1": (fp8_pages, fp8, P, m1_pages, m1, P, n, 0.01, 1.0, None),
        "MODEL1 -> trtllm-fp8, saturation count": (m1_pages, m1, P, back, fp8, P, n, 1.0, 0.01,
                                                   tensor_multiplier("swa", 0.01)),
    }
    a = np.concatenate([native_pool._flat(fp8_pages), native_pool._flat(m1_pages)])
    b = np.empty_like(a)
    np.copyto(b, a)  # first touch
    rows = []
    for case, call in cases.items():
        for impl in args.impl:
            with _implementation(impl):
                native_loss.loss_stats(*call, accelerated=impl != "generic")  # warm-up (JIT cache loads)
                ratios, seconds, copies = [], [], []
                for _ in range(args.repeat):
                    c0 = _timed(lambda: np.copyto(b, a))
                    t = _timed(lambda: native_loss.loss_stats(*call, accelerated=impl != "generic"))  # noqa: B023
                    c1 = _timed(lambda: np.copyto(b, a))
                    ratios.append(t / ((c0 + c1) / 2))
                    seconds.append(t)
                    copies += [c0, c1]
            rows.append({"case": case, "impl": impl, "seconds": statistics.median(seconds),
                         "ns_per_token": statistics.median(seconds) / n * 1e9, "x_np_copyto": statistics.median(ratios),
                         "x_np_copyto_all": [round(r, 3) for r in ratios], "best_ns_per_token": min(seconds) / n * 1e9,
                         "best_x_best_np_copyto": min(seconds) / min(copies)})
    head = {"tokens": n, "threads": args.threads, "bytes_copied": int(a.nbytes),
            "kernels": native_accel.kernel_implementation(), "load_average": list(os.getloadavg()),
            "date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")}
    if args.json:
        print(json.dumps({**head, "rows": rows}, indent=2))
        return
    print(f"loss statistics, {n:,} tokens, {args.threads} threads, np.copyto of both pools ({a.nbytes / 1e6:.0f} MB); "
          f"{head['kernels']}; load {head['load_average'][0]:.1f}; {head['date']}; medians of {args.repeat}")
    for r in rows:
        print(f"  {r['case']:40s} {r['impl']:8s} {r['seconds'] * 1e3:9.1f} ms {r['ns_per_token']:7.1f} ns/token "
              f"{r['x_np_copyto']:6.2f}x np.copyto {r['x_np_copyto_all']}; best {r['best_ns_per_token']:.1f} ns/token "
              f"= {r['best_x_best_np_copyto']:.2f}x the best copy")


if __name__ == "__main__":
    main()
