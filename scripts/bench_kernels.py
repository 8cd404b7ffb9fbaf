"""Hot native kernels against same-run copies (``np.copyto``, ``copy_``) of the same bytes.

For each case (trtllm-fp8 <-> MODEL1 transcodes fresh and ``out=``, MODEL1 -> trtllm-fp8 with
``dst_scale="auto"`` (``kvbridge.transcode``: the code-domain amax pass, then the transcode), encode
bf16 -> MODEL1, decode MODEL1 -> fp32) and each thread count, calls of the kernel (through ``backends.dispatch``)
alternate with ``np.copyto`` (one thread) and ``torch.Tensor.copy_`` (the case's threads) of a
buffer half the size of the bytes the call reads plus writes (so the copy reads and writes the
same total); ``x copy`` / ``x copy_`` = best copy time / best kernel time (best of ``--repeat``). Cases
with a fresh output also time its first touch alone (``native_pool._empty_output`` of the output's bytes + ``fill_``
on the case's threads): ``x touch`` = that / the kernel time, the share of a fresh call the operating system's
zeroing of new pages costs on its own (1.0: the kernel is at that ceiling).
Also prints the one-thread CPU time (``time.process_time``, best of ``--repeat``) of each case at
``--cpu-tokens`` tokens, the measure of the layout-rebuild check.

``--impl both`` times the compiled C kernels (``kvbridge.backends.native._kernels``) and the numba kernels
alternately, call by call, each against its own paired copy (``c`` or ``numba``: one of them;
default ``auto``: whichever ``kvbridge.backends.native`` chose, named in the header).

    PYTHONPATH=$PWD python3 scripts/bench_kernels.py [--tokens 1048576] [--repeat 7] [--threads 1 2] \
        [--impl both] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import time
from datetime import datetime, timezone
from functools import partial

import numpy as np
import torch

import kvbridge
from kvbridge.backends import dispatch
from kvbridge.backends.native import accel as native_accel
from kvbridge.backends.native import pool as native_pool
from kvbridge.layouts import get_layout

P = 64


def _cpu_model() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return platform.processor() or "unknown"
    for line in out.splitlines():
        if line.startswith("Model name:"):
            return line.split(":", 1)[1].strip()
    return "unknown"


#: Cases whose call allocates its output (the others write into a preallocated, touched pool).
FRESH = ("fresh", "encode", "decode")


def _cases(n: int) -> dict[str, tuple]:
    """name -> (call, bytes read, bytes written)."""
    fp8, m1 = get_layout("trtllm-fp8"), get_layout("flashmla-model1")
    gen = torch.Generator().manual_seed(0)
    x = (torch.randn(n, 512, generator=gen) * 2).to(torch.bfloat16)
    src_fp8 = dispatch.encode_pages(x, fp8, P, "swa", 1.0)
    src_m1 = dispatch.encode_pages(x, m1, P, "flashmla", 1.0)
    out_m1 = torch.empty_like(src_m1)
    out_fp8 = torch.empty_like(src_fp8)
    nb = lambda t: t.numel() * t.element_size()  # noqa: E731

    def to_m1(out=None):
        return dispatch.transcode_pages(src_fp8, fp8, P, m1, P, n, 1.0, 1.0, "flashmla", out=out)

    def to_fp8(out=None):
        return dispatch.transcode_pages(src_m1, m1, P, fp8, P, n, 1.0, 1.0, "swa", out=out)

    return {
        "trtllm-fp8 -> MODEL1, out=": (lambda: to_m1(out_m1), nb(src_fp8), nb(out_m1)),
        "trtllm-fp8 -> MODEL1, fresh": (to_m1, nb(src_fp8), nb(out_m1)),
        "MODEL1 -> trtllm-fp8, out=": (lambda: to_fp8(out_fp8), nb(src_m1), nb(out_fp8)),
        "MODEL1 -> trtllm-fp8, fresh": (to_fp8, nb(src_m1), nb(out_fp8)),
        "MODEL1 -> trtllm-fp8, auto, out=": (lambda: kvbridge.transcode(src_m1, m1, fp8, src_page_size=P, num_tokens=n,
                                                                         dst_scale="auto", out=out_fp8),
                                              nb(src_m1), nb(out_fp8)),
        "encode bf16 -> MODEL1": (lambda: dispatch.encode_pages(x, m1, P, "flashmla", 1.0), nb(x), nb(src_m1)),
        "decode MODEL1 -> fp32": (lambda: dispatch.decode_pages(src_m1, m1, P, n, 1.0), nb(src_m1), n * 2048),
    }


def _wall(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def _implementations(choice: str) -> dict[str, object]:
    """Name -> value of ``native_accel._CK`` (the compiled kernels module, or None for numba) for ``--impl``."""
    compiled = native_accel._CK
    if choice == "auto":
        return {native_accel.kernel_implementation(): compiled}
    if choice != "numba" and compiled is None:
        raise SystemExit(f"--impl {choice}: the compiled kernels are not in use "
                         f"({native_accel.kernel_implementation()})")
    impls = {"c": {f"C ({compiled.isa()})" if compiled else "": compiled}, "numba": {"numba": None}}
    return {**impls["c"], **impls["numba"]} if choice == "both" else impls[choice]


def paired(cases: dict[str, tuple], threads: list[int], repeat: int, impls: dict[str, object]) -> list[dict]:
    rows = []
    saved = native_accel._CK
    try:
        for name, (fn, read, written) in cases.items():
            half = (read + written) // 2
            src, dst = np.ones(half, np.uint8), np.ones(half, np.uint8)
            t_src, t_dst = torch.from_numpy(src), torch.from_numpy(dst)
            np_copy, torch_copy = partial(np.copyto, dst, src), partial(t_dst.copy_, t_src)
            fresh = any(word in name for word in FRESH)

            def touch(nbytes=written):
                native_pool._empty_output(1, nbytes).fill_(0)

            for th in threads:
                times: dict[str, tuple[list[float], ...]] = {impl: ([], [], [], []) for impl in impls}
                for module in impls.values():  # warm-up (compile or cache load, first touch)
                    native_accel._CK = module
                    fn()
                for _ in range(repeat):
                    for impl, module in impls.items():  # alternate the implementations call by call
                        native_accel._CK = module
                        torch.set_num_threads(th)
                        times[impl][0].append(_wall(fn))
                        times[impl][2].append(_wall(torch_copy))  # torch copy_, th threads
                        if fresh:
                            times[impl][3].append(_wall(touch))  # first touch of a fresh output, th threads
                        torch.set_num_threads(1)
                        times[impl][1].append(_wall(np_copy))
                for impl, (k_times, c_times, t_times, f_times) in times.items():
                    k, c, tc = min(k_times), min(c_times), min(t_times)
                    touch_s = min(f_times) if f_times else None
                    rows.append({"case": name, "impl": impl, "threads": th, "kernel_s": k, "copy_s": c,
                                 "copy_gb_s": 2 * half / c / 1e9, "x_copy": c / k, "torch_copy_s": tc,
                                 "x_torch_copy": tc / k, "first_touch_s": touch_s,
                                 "x_touch": None if touch_s is None else touch_s / k})
    finally:
        native_accel._CK = saved
    return rows


def cpu_times(cases: dict[str, tuple], repeat: int) -> dict[str, float]:
    torch.set_num_threads(1)
    result = {}
    for name, (fn, _, _) in cases.items():
        fn()
        best = float("inf")
        for _ in range(repeat):
            t0 = time.process_time()
            fn()
            best = min(best, time.process_time() - t0)
        result[name] = best
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=1 << 20)
    ap.add_argument("--cpu-tokens", type=int, default=1 << 15)
    ap.add_argument("--repeat", type=int, default=7)
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--only", default="", help="substring of the case names to run")
    ap.add_argument("--no-cpu-time", action="store_true")
    ap.add_argument("--impl", choices=("auto", "c", "numba", "both"), default="auto",
                    help="MODEL1 kernels to time: as kvbridge chose, the compiled C ones, numba, or both alternately")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    impls = _implementations(args.impl)
    header = {"cpu": _cpu_model(), "date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
              "tokens": args.tokens, "page_size": P, "repeat": args.repeat, "load_average": os.getloadavg(),
              "native_kernels": native_accel.kernel_implementation()}
    sel = lambda cs: {k: v for k, v in cs.items() if args.only in k}  # noqa: E731
    rows = paired(sel(_cases(args.tokens)), args.threads, args.repeat, impls)
    cpu = {} if args.no_cpu_time else cpu_times(sel(_cases(args.cpu_tokens)), args.repeat)
    if args.json:
        print(json.dumps({**header, "rows": rows, "cpu_time_one_thread_s": cpu}, indent=1))
        return
    print(f"# {header['cpu']}, {header['date']}, {args.tokens} tokens, P={P}, best of {args.repeat}, "
          f"load average {' '.join(f'{x:.1f}' for x in header['load_average'])} (at start); "
          f"kvbridge's MODEL1 kernels: {header['native_kernels']}")
    print(f"{'case':32} {'kernels':16} {'thr':>3} {'kernel ms':>10} {'copy ms':>8} {'copy GB/s':>9} {'x copy':>7} "
          f"{'copy_ ms':>8} {'x copy_':>7} {'touch ms':>8} {'x touch':>7}")
    for r in rows:
        touch = "" if r["x_touch"] is None else f" {1e3 * r['first_touch_s']:8.2f} {r['x_touch']:7.3f}"
        print(f"{r['case']:32} {r['impl'][:16]:16} {r['threads']:3d} {1e3 * r['kernel_s']:10.2f} "
              f"{1e3 * r['copy_s']:8.2f} {r['copy_gb_s']:9.1f} {r['x_copy']:7.3f} {1e3 * r['torch_copy_s']:8.2f} "
              f"{r['x_torch_copy']:7.3f}{touch}")
    print(f"# load average at the end: {' '.join(f'{x:.1f}' for x in os.getloadavg())}")
    if cpu:
        print(f"# one-thread CPU time, {args.cpu_tokens} tokens, best of {args.repeat}")
        for name, s in cpu.items():
            print(f"{name:32} {1e3 * s:8.2f} ms")


if __name__ == "__main__":
    main()
