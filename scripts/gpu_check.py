#!/usr/bin/env python3
"""GPU check: every Triton kernel byte-for-byte against the reference, then timings on an H200-sized pool.

    python scripts/gpu_check.py                 # one CUDA GPU, a few minutes; exit 0 = every check passed
    python scripts/gpu_check.py --json out.json # also write every result as JSON
    python scripts/gpu_check.py --smoke         # CPU, TRITON_INTERPRET=1, tiny sizes: tests this script only

1. Validation (both E4M3 conversion paths of the kernels: the hardware cast and the integer bit
   operations): encode / decode / whole-pool transcode / repage kernels against
   ``kvbridge.backends.reference`` on random and edge-case inputs (computed on the CPU), then the public
   API on CUDA (``encode``, ``decode``, ``transcode``, ``transcode_slots``, ``gather_transcode``,
   their error paths) against the same calls on CPU tensors.
2. Timing (CUDA events, median of ``--iters``) at ``--tokens`` tokens (default 4M: 2-8 GiB per
   pool, many times the L2), each next to a device-to-device copy of the same number of bytes,
   plus gather-transcode of a 2048-token top-k for 128 requests, then a 128K-token DeepSeek-V4-Flash
   migration (TensorRT-LLM FP8 -> vLLM) with every pool on the device, stage by stage (gather, convert,
   publish, a whole ``migrate_local``), each next to a device-to-device copy of the payload.
3. Optional: FlashMLA's sparse decode over a TensorRT-LLM pool through the legacy (MODEL1 scratch, ``V41``)
   and the current V4.1 kernels, whichever the GPU runs (needs a usable ``flash_mla`` build; skipped with
   the reason otherwise).
4. SGLang PD with device memory: NIXL memory kinds of CUDA pools, ``kv_digest`` reduced on the GPU,
   and a request from kvbridge's SGLang prefill peer to its SGLang decode peer with every pool in
   VRAM (needs nixl with a CUDA-enabled UCX, and pyzmq; a failed check says why otherwise).
5. The vLLM connector's cache paths on CUDA caches laid out as vLLM registers them, against the same
   calls on CPU caches, and its consumer and producer one process each over gloo on loopback.
The summary table is printed last. See docs/gpu.md.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
#: NVFP4 per-tensor global scales g != 1 checked on the device (docs/layouts.md, ``flashinfer-nvfp4``).
NVFP4_GLOBAL_SCALES = (0.125, 0.37)


@dataclass
class Check:
    """One validation: ``name`` passed (byte-identical / same error) or not, with a one-line detail."""

    section: str
    name: str
    passed: bool
    detail: str = ""


@dataclass
class Timing:
    """One timed operation next to a device-to-device copy of the same bytes (read + written)."""

    op: str
    tokens: int
    bytes_moved: int
    ms: float
    copy_ms: float

    @property
    def gbps(self) -> float:
        return self.bytes_moved / self.ms / 1e6

    @property
    def copy_fraction(self) -> float:
        return self.copy_ms / self.ms

    @property
    def mtok_s(self) -> float:
        return self.tokens / self.ms / 1e3


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, default=1 << 22, help="pool size in tokens for timing (default 4M)")
    parser.add_argument("--iters", type=int, default=10, help="timed iterations per op (median reported)")
    parser.add_argument("--smoke", action="store_true", help="CPU interpreter run with tiny sizes (script test)")
    parser.add_argument("--json", type=Path, help="also write all results to this JSON file")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--vllm-producer"]:  # the producer process of vllm_loopback
        vllm_producer(*argv[1:3])
        return 0
    args = parse_args(argv)
    if args.smoke:
        os.environ["TRITON_INTERPRET"] = "1"  # before the kernels are decorated
        args.tokens, args.iters = min(args.tokens, 512), min(args.iters, 2)
    sys.path.insert(0, str(ROOT))
    import torch

    if not args.smoke and not torch.cuda.is_available():
        print("gpu_check: no CUDA device; run on a GPU machine (or --smoke to test the script on CPU)")
        return 2
    device = torch.device("cpu" if args.smoke else "cuda")
    started = time.perf_counter()
    checker = Validator(device, smoke=args.smoke)
    checker.run_all()
    timer = Bench(device, iters=args.iters)
    # A failing hardware E4M3 path is reported, and the rest runs on the integer path (see Validator.run_all).
    timings = timer.run_all(args.tokens) if all(c.passed for c in checker.checks if c.section != "kernels/hardware") \
        else []
    flashmla_note = flashmla_section(device, checker, timings) if not args.smoke else "skipped in --smoke"
    sglang_pd_section(device, checker)
    vllm_section(device, checker)
    digest_section(device, checker, timer, timings, args.smoke)
    report(checker.checks, timings, flashmla_note, device, time.perf_counter() - started, args)
    if args.json:
        write_json(args.json, checker.checks, timings, flashmla_note, device)
    return 0 if all(c.passed for c in checker.checks) else 1


# ----------------------------------------------------------------------------- inputs


def edge_latents():
    """fp32 [48, 512]: zero / -0 tiles, tiny amax, amax = 448*2^k and its fp32 / bf16 neighbours,
    E4M3 ties (normal, subnormal), saturating values, fp32 subnormals, bf16 ties in the rope."""
    import torch

    g = torch.Generator().manual_seed(101)
    x = torch.randn(48, 512, generator=g)
    x[0], x[1] = 0.0, -0.0
    row = 2
    for k in (-22, -14, -13, -8, -1, 0, 1, 4, 8, 20):
        amax = torch.tensor(448.0 * 2.0**k)
        near = (amax, torch.nextafter(amax, torch.tensor(1e30)), torch.nextafter(amax, torch.tensor(0.0)),
                amax.to(torch.bfloat16).float() * (1 + 2**-7), -amax, amax * 0.5, amax)
        for t, a in enumerate(near):
            x[row, 64 * t : 64 * t + 64] = torch.rand(64, generator=g) * a
            x[row, 64 * t + 5 * t] = a
        row += 1
    for t, a in enumerate((0.02734375, 0.0273437, 0.0448, 0.04480001, 1e-4, 1e-8, 3e-39)):
        x[row, 64 * t : 64 * t + 64] = torch.linspace(-a, a, 64)
    ties = torch.tensor([8.5, 9.5, 124.0, 232.0, 1.0625, 2**-10, 3 * 2**-10, 5 * 2**-10, -2**-10, -8.5, 448.0, 0.0])
    x[row + 1, :444] = ties.repeat(37)
    x[row + 2, :444] = ties.repeat(37) * 2.0**-7
    x[row + 3, :448] = torch.tensor([464.0, 465.0, 480.0, 500.0, 1e30, -1e30, 449.0, 447.0]).repeat(56)
    x[row + 4, :448] = torch.tensor([1e-40, -1e-45, 2.0**-126, 2.0**-127]).repeat(112)
    x[row + 5, 448:] = torch.tensor([1.0 + 2**-8, 1.0 + 3 * 2**-8, -(1.0 + 2**-8), 3e38]).repeat(16)
    bits = torch.randint(-(2**31), 2**31 - 1, (8, 512), generator=g, dtype=torch.int64).to(torch.int32)
    floats = bits.view(torch.float32)
    x[row + 6 : row + 14] = torch.where(torch.isfinite(floats), floats, 1.0).clamp(-1e30, 1e30)
    return x


def random_latents(n: int, seed: int):
    import torch

    g = torch.Generator().manual_seed(seed)
    mags = torch.pow(2.0, torch.randint(-20, 10, (n, 8), generator=g).float()).repeat_interleave(64, dim=1)
    return torch.randn(n, 512, generator=g) * mags


def random_pool(layout, num_pages: int, page_size: int, seed: int):
    import torch

    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (num_pages, layout.page_bytes(page_size)), dtype=torch.uint8, generator=g)


def same_floats(got, want) -> bool:
    """Bitwise equality of fp32 tensors (-0.0 != 0.0), NaN positions equal (NaN payloads are unspecified)."""
    import torch

    nan = torch.isnan(want)
    return torch.equal(torch.isnan(got), nan) and torch.equal(got[~nan].view(torch.int32), want[~nan].view(torch.int32))


# ----------------------------------------------------------------------------- validation


class Validator:
    """Runs every byte-for-byte check; results accumulate in ``checks``."""

    def __init__(self, device, smoke: bool):
        import torch

        from kvbridge.backends import triton_kernels
        from kvbridge.layouts import all_layouts, get_layout

        self.torch, self.tk, self.device, self.smoke = torch, triton_kernels, device, smoke
        self.checks: list[Check] = []
        self.model1, self.footer = get_layout("flashmla-model1"), get_layout("trtllm-fp8-ds-mla")
        self.trt, self.bf16 = get_layout("trtllm-fp8"), get_layout("bf16")
        self.layouts = tuple(all_layouts())  # every registered layout: the kernels read their descriptions
        self.writers = [(lay, d, 1.0) for lay in self.layouts if not lay.per_tensor_scale
                        for d in lay.dialects or (None,)] + [
            (self.trt, "swa", 1.0), (self.trt, "swa", 0.037), (self.trt, "swa", 2.0), (self.trt, "compress", 0.5),
        ]
        self.nvfp4 = get_layout("flashinfer-nvfp4")
        self.writers += [(self.nvfp4, None, g) for g in NVFP4_GLOBAL_SCALES]  # NVFP4 global scales g != 1
        n_random = 32 if smoke else 4096  # at least two 64-token pages
        self.x = torch.cat([edge_latents(), random_latents(n_random, seed=102)])
        self.x_bf16 = self.x.bfloat16().float()

    def record(self, section: str, name: str, check: Callable[..., bool | str], *args, **kwargs) -> None:
        """Run ``check(*args, **kwargs)``: True passes, False or a message fails, an exception fails with its text."""
        try:
            outcome = check(*args, **kwargs)
        except Exception as exc:  # a crash is a failed check, reported with its type
            outcome = f"{type(exc).__name__}: {exc}"
        passed = outcome is True
        detail = "" if passed else ("mismatch" if outcome is False else str(outcome))
        self.checks.append(Check(section, name, passed, detail))
        print(f"  [{'ok' if passed else 'FAIL'}] {section}: {name}{'' if passed else ' -- ' + detail}", flush=True)

    def kernel_matches(self, kernel: Callable, ref: Callable, *args) -> bool | str:
        """``kernel`` on this device equals ``ref`` on CPU: bytes exactly, fp32 bit for bit (NaN positions),
        or both raise the same error."""
        try:
            want = ref(*args)
        except Exception as exc:  # the kernel must then raise the same
            try:
                kernel(*(a.to(self.device) if isinstance(a, self.torch.Tensor) else a for a in args))
            except Exception as got:  # compared below
                return str(got) == str(exc) and type(got) is type(exc) or f"errors differ: {got} | {exc}"
            return f"reference raised {type(exc).__name__}: {exc}; the kernel did not"
        got = kernel(*(a.to(self.device) if isinstance(a, self.torch.Tensor) else a for a in args)).cpu()
        return same_floats(got, want) if want.dtype == self.torch.float32 else self.torch.equal(got, want)

    def run_all(self) -> None:
        default = self.tk.fp8_hardware
        # The interpreter's fp8 cast is wrong and pre-Ada GPUs have none: only the integer path there.
        paths = ("hardware", "integer") if self.tk.hardware_fp8_available(self.device) else ("integer",)
        for path in paths:
            self.tk.fp8_hardware = path == "hardware"
            print(f"validating kernels, {path} E4M3 conversion", flush=True)
            self.kernels(path)
        hardware_ok = all(c.passed for c in self.checks if c.section == "kernels/hardware")
        self.tk.fp8_hardware = default and hardware_ok
        if default and not hardware_ok:
            print("the hardware E4M3 path is NOT byte-exact here: the API checks and timings use the integer "
                  "path (set KVBRIDGE_TRITON_INT_E4M3=1 on this machine)", flush=True)
        print("validating the public API on this device against CPU", flush=True)
        self.api()

    def kernels(self, path: str) -> None:
        from kvbridge.backends import reference

        tk, section = self.tk, f"kernels/{path}"
        for lay, dialect, scale in self.writers:
            for x, xname in ((self.x, "fp32"), (self.x_bf16, "bf16-rounded")):
                for p in (61, 64, 256):
                    self.record(section, f"encode {xname} -> {lay.name} {dialect or ''} s={scale} P={p}",
                                self.kernel_matches, tk.encode_pages, reference.encode_pages, x, lay, p, dialect, scale)
        for lay in self.layouts:
            pages = random_pool(lay, 9, 61, seed=103)
            scale = 0.037 if lay.per_tensor_scale else 1.0
            self.record(section, f"decode {lay.name} random bytes P=61", self.kernel_matches, tk.decode_pages,
                        reference.decode_pages, pages, lay, 61, 500, scale)
        for g in NVFP4_GLOBAL_SCALES:  # NVFP4 at a global scale g != 1: decode, and transcodes to and from MODEL1
            pages = random_pool(self.nvfp4, 9, 61, seed=103)
            self.record(section, f"decode {self.nvfp4.name} g={g} random bytes P=61", self.kernel_matches,
                        tk.decode_pages, reference.decode_pages, pages, self.nvfp4, 61, 500, g)
            m1 = reference.encode_pages(self.x, self.model1, 64, "flashmla", 1.0)
            n = self.x.shape[0] - 3
            self.record(section, f"transcode {self.model1.name} -> {self.nvfp4.name} g={g} P=64->61",
                        self.kernel_matches, tk.transcode_pages, reference.transcode_pages,
                        m1, self.model1, 64, self.nvfp4, 61, n, 1.0, g, None)
            nv = reference.encode_pages(self.x, self.nvfp4, 64, None, g)
            self.record(section, f"transcode {self.nvfp4.name} g={g} -> {self.model1.name} P=64->61",
                        self.kernel_matches, tk.transcode_pages, reference.transcode_pages,
                        nv, self.nvfp4, 64, self.model1, 61, n, g, 1.0, "flashmla")
        for src in self.layouts:
            s_in = 0.5 if src.per_tensor_scale else 1.0
            pages = reference.encode_pages(self.x, src, 64, src.default_dialect, s_in)
            n = self.x.shape[0] - 3  # a partly filled last page
            for dst in self.layouts:
                s_out = 0.037 if dst.per_tensor_scale else 1.0
                for dialect in dst.dialects or (None,):
                    self.record(section, f"transcode {src.name} -> {dst.name} {dialect or ''} P=64->61",
                                self.kernel_matches, tk.transcode_pages, reference.transcode_pages,
                                pages, src, 64, dst, 61, n, s_in, s_out, dialect)
        for src, dst in ((a, b) for a in self.layouts for b in self.layouts if a.same_record(b)):
            pages = random_pool(src, 5, 61, seed=104)
            for n, dst_p in ((None, 256), (200, 2), (3, 61)):
                self.record(section, f"repage {src.name} -> {dst.name} P=61->{dst_p} n={n}", self.kernel_matches,
                            tk.repage, reference.repage, pages, src, 61, dst, dst_p, n)

    def same_call(self, fn: Callable, *args, **kwargs) -> bool | str:
        """``fn`` on this device and on CPU: equal outputs, or the same error type and message."""
        results = []
        for dev in (self.device, self.torch.device("cpu")):
            moved = [a.to(dev) if isinstance(a, self.torch.Tensor) else a for a in args]
            kw = {k: v.to(dev) if isinstance(v, self.torch.Tensor) else v for k, v in kwargs.items()}
            try:
                out = fn(*moved, **kw)
                results.append(("ok", out if isinstance(out, tuple) else (out,), moved))
            except Exception as exc:  # compared across devices below
                results.append(("error", f"{type(exc).__name__}: {exc}", moved))
        (kind_a, a, moved_a), (kind_b, b, moved_b) = results
        if kind_a != kind_b:
            return f"{self.device}: {a if kind_a == 'error' else 'ok'}; cpu: {b if kind_b == 'error' else 'ok'}"
        if kind_a == "error":
            return True if a == b else f"errors differ: {a} | {b}"
        outs_equal = all(self.torch.equal(u.cpu(), v) for u, v in zip(a, b, strict=True))
        inputs_equal = all(self.torch.equal(u.cpu(), v) for u, v in zip(moved_a, moved_b, strict=True)
                           if isinstance(u, self.torch.Tensor))  # in-place destinations
        return outs_equal and inputs_equal

    def api(self) -> None:
        import kvbridge as kb

        torch, section = self.torch, "api"
        x = self.x
        for lay, dialect, scale in self.writers:
            self.record(section, f"kb.encode -> {lay.name} {dialect or ''}", self.same_call,
                        kb.encode, x, lay, page_size=64, dialect=dialect, scale=scale)
        pools = {lay.name: kb.encode(x, lay, page_size=64, scale=0.5 if lay.per_tensor_scale else None)
                 for lay in self.layouts}
        for lay in self.layouts:
            s = 0.5 if lay.per_tensor_scale else None
            self.record(section, f"kb.decode {lay.name}", self.same_call,
                        kb.decode, pools[lay.name], lay, page_size=64, num_tokens=x.shape[0] - 5, scale=s)
            for dst in self.layouts:
                self.record(section, f"kb.transcode {lay.name} -> {dst.name}", self.same_call,
                            kb.transcode, pools[lay.name], lay, dst, src_page_size=64, dst_page_size=61, src_scale=s)
        g = torch.Generator().manual_seed(105)
        cap = pools["trtllm-fp8"].shape[0] * 64
        src_slots = torch.randperm(cap, generator=g)[:300].to(torch.int32)
        dst_slots = torch.randperm(9 * 61, generator=g)[:300]
        for src, dst, kwargs in (
            (self.trt, self.model1, {"src_scale": 0.5, "dialect": "amax-1e-8"}),
            (self.model1, self.trt, {"dst_scale": 2.0}),
            (self.bf16, self.footer, {}),
            (self.model1, self.footer, {}),
            (self.trt, self.trt, {"src_scale": 0.5, "dst_scale": 0.5}),
        ):
            dst_pool = random_pool(dst, 9, 61, seed=106)
            self.record(section, f"kb.transcode_slots {src.name} -> {dst.name} P=64->61", self.same_call,
                        kb.transcode_slots, pools[src.name], src, dst_pool, dst, src_page_size=64, dst_page_size=61,
                        src_slots=src_slots, dst_slots=dst_slots, **kwargs)
        indices = torch.randint(0, cap, (4, 2, 64), generator=g, dtype=torch.int32)
        indices[1, 0, 10:] = -1
        for i, lay in enumerate(self.layouts):
            s = 0.5 if lay.per_tensor_scale else None
            for out in ("flashmla-model1", "v41-fp8-interleaved"):  # both FlashMLA scratch layouts
                self.record(section, f"kb.gather_transcode {lay.name} -> {out} P=61", self.same_call,
                            kb.gather_transcode, pools[lay.name], lay, page_size=64, indices=indices, scale=s,
                            out_page_size=61, out_layout=out)
            nxt = self.layouts[(i + 1) % len(self.layouts)]  # every layout on both sides of a slot transcode
            self.record(section, f"kb.transcode_slots {lay.name} -> {nxt.name} P=64->61", self.same_call,
                        kb.transcode_slots, pools[lay.name], lay, random_pool(nxt, 9, 61, seed=108), nxt,
                        src_page_size=64, dst_page_size=61, src_slots=src_slots[:200], dst_slots=dst_slots[:200],
                        src_scale=s)
        bad = pools["trtllm-fp8"].clone()
        bad[1, 5 * 512 + 77] = 0x7F  # slot 69 decodes to NaN
        for name, fn, args, kwargs in (
            ("gather out of range", kb.gather_transcode, (pools["trtllm-fp8"], self.trt),
             {"page_size": 64, "indices": torch.tensor([[0, cap]], dtype=torch.int32)}),
            ("gather index -2", kb.gather_transcode, (pools["trtllm-fp8"], self.trt),
             {"page_size": 64, "indices": torch.tensor([[-2, 0]], dtype=torch.int32)}),
            ("gather NaN source", kb.gather_transcode, (bad, self.trt),
             {"page_size": 64, "indices": torch.tensor([[1, 69]], dtype=torch.int32)}),
            ("transcode NaN source", kb.transcode, (bad, self.trt, self.model1), {"src_page_size": 64}),
            ("transcode_slots NaN source", kb.transcode_slots,
             (bad, self.trt, random_pool(self.model1, 2, 64, seed=107), self.model1),
             {"src_page_size": 64, "dst_page_size": 64, "src_slots": torch.tensor([0, 69]),
              "dst_slots": torch.tensor([1, 2])}),
            ("transcode_slots duplicate", kb.transcode_slots,
             (bad, self.trt, random_pool(self.model1, 2, 64, seed=107), self.model1),
             {"src_page_size": 64, "dst_page_size": 64, "src_slots": torch.tensor([0, 1]),
              "dst_slots": torch.tensor([2, 2])}),
        ):
            self.record(section, f"error: {name}", self.same_call, fn, *args, **kwargs)


# ----------------------------------------------------------------------------- timing


class Bench:
    """Times operations (CUDA events; wall clock in --smoke) next to a copy of the same bytes."""

    def __init__(self, device, iters: int):
        import torch

        self.torch, self.device, self.iters = torch, device, iters

    def sync(self) -> None:
        if self.device.type == "cuda":
            self.torch.cuda.synchronize()

    def median_ms(self, fn: Callable, *args, **kwargs) -> float:
        """Median time of ``fn(*args, **kwargs)`` in ms, after two warm-up calls (compilation, caches)."""
        torch = self.torch
        for _ in range(2):
            fn(*args, **kwargs)
        self.sync()
        times = []
        for _ in range(self.iters):
            if self.device.type == "cuda":
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                fn(*args, **kwargs)
                end.record()
                end.synchronize()
                times.append(start.elapsed_time(end))
            else:
                t0 = time.perf_counter()
                fn(*args, **kwargs)
                times.append((time.perf_counter() - t0) * 1e3)
        return statistics.median(times)

    def copy_ms(self, bytes_moved: int) -> float:
        """A device-to-device copy that reads and writes ``bytes_moved`` bytes in all."""
        src = self.torch.empty(bytes_moved // 2, dtype=self.torch.uint8, device=self.device)
        dst = self.torch.empty_like(src)
        return self.median_ms(dst.copy_, src)

    def time(self, op: str, tokens: int, bytes_moved: int, fn: Callable, *args, **kwargs) -> Timing:
        ms = self.median_ms(fn, *args, **kwargs)
        t = Timing(op, tokens, bytes_moved, ms, self.copy_ms(bytes_moved))
        print(f"  {op}: {ms:.3f} ms, {t.gbps:.0f} GB/s, {100 * t.copy_fraction:.0f}% of copy", flush=True)
        return t

    def run_all(self, n: int) -> list[Timing]:
        """Time every operation at ``n`` tokens (a multiple of 256); bytes count payload read + written."""
        import kvbridge as kb
        from kvbridge.backends import reference
        from kvbridge.backends import triton_kernels as tk
        from kvbridge.layouts import get_layout

        torch, dev = self.torch, self.device
        model1, trt = get_layout("flashmla-model1"), get_layout("trtllm-fp8")
        footer, bf16 = get_layout("trtllm-fp8-ds-mla"), get_layout("bf16")
        n -= n % 256
        print(f"timing at {n} tokens on {dev}", flush=True)
        out: list[Timing] = []
        x = torch.randn(n, 512, device=dev)
        trt_pool = tk.encode_pages(x, trt, 64, "swa", 1.0)
        m1_pool = tk.encode_pages(x, model1, 64, "flashmla", 1.0)
        out.append(self.time("transcode trtllm-fp8 -> model1 (kernel)", n, n * (512 + 584),
                             tk.transcode_pages, trt_pool, trt, 64, model1, 64, None, 1.0, 1.0, "flashmla"))
        default_shape = tk.convert_block_tokens, tk.convert_warps
        for tokens, warps in ((4, 4), (16, 8), (16, 16), (32, 16)):  # other launch shapes, for tuning
            tk.convert_block_tokens, tk.convert_warps = tokens, warps
            out.append(self.time(f"  same, {tokens} tokens/program, {warps} warps", n, n * (512 + 584),
                                 tk.transcode_pages, trt_pool, trt, 64, model1, 64, None, 1.0, 1.0, "flashmla"))
        tk.convert_block_tokens, tk.convert_warps = default_shape
        for per_sm in (2, 4, 8):  # a persistent grid looping over the token blocks
            tk.convert_programs_per_sm = per_sm
            out.append(self.time(f"  same, persistent, {per_sm} programs/SM", n, n * (512 + 584),
                                 tk.transcode_pages, trt_pool, trt, 64, model1, 64, None, 1.0, 1.0, "flashmla"))
        tk.convert_programs_per_sm = None
        out.append(self.time("transcode trtllm-fp8 -> model1 (kb.transcode)", n, n * (512 + 584),
                             kb.transcode, trt_pool, trt, model1, src_page_size=64))
        out.append(self.time("transcode model1 -> trtllm-fp8 (kernel)", n, n * (584 + 512),
                             tk.transcode_pages, m1_pool, model1, 64, trt, 64, None, 1.0, 1.0, "swa"))
        out.append(self.time("repage model1 P64 -> ds-mla P256 (byte move)", n, 2 * n * 584,
                             tk.repage, m1_pool, model1, 64, footer, 256, None))
        default_shape = tk.copy_block_tokens, tk.copy_warps
        for tokens, warps in ((8, 4), (32, 8)):
            tk.copy_block_tokens, tk.copy_warps = tokens, warps
            out.append(self.time(f"  same, {tokens} tokens/program, {warps} warps", n, 2 * n * 584,
                                 tk.repage, m1_pool, model1, 64, footer, 256, None))
        tk.copy_block_tokens, tk.copy_warps = default_shape
        out.append(self.time("encode fp32 -> model1 (kernel)", n, n * (2048 + 584),
                             tk.encode_pages, x, model1, 64, "flashmla", 1.0))
        out.append(self.time("decode model1 -> fp32 (kernel)", n, n * (584 + 2048),
                             tk.decode_pages, m1_pool, model1, 64, None, 1.0))
        del x
        bf16_pool = tk.decode_pages(m1_pool, model1, 64, None, 1.0).to(torch.bfloat16).view(torch.uint8)
        bf16_pool = bf16_pool.view(-1, bf16.page_bytes(64))
        out.append(self.time("transcode bf16 -> model1 (kernel)", n, n * (1024 + 584),
                             tk.transcode_pages, bf16_pool, bf16, 64, model1, 64, None, 1.0, 1.0, "flashmla"))
        del bf16_pool
        # Scattered re-paging: 256-token TensorRT-LLM pages into 64-token MODEL1 pages in shuffled order.
        big = tk.repage(trt_pool, trt, 64, trt, 256, None)
        pages_out = n // 64
        dst_pool = torch.zeros(pages_out, model1.page_bytes(64), dtype=torch.uint8, device=dev)
        order = torch.randperm(pages_out, device=dev)
        dst_slots = (order.repeat_interleave(64) * 64 + torch.arange(64, device=dev).repeat(pages_out)).to(torch.int32)
        src_slots = torch.arange(n, device=dev, dtype=torch.int32)
        out.append(self.time("transcode_slots trtllm P256 -> model1 P64 shuffled (kernel)", n, n * (512 + 584 + 8),
                             tk.transcode_slots, big, trt, 256, dst_pool, model1, 64, src_slots, dst_slots, 1.0,
                             1.0, "flashmla", False))
        out.append(self.time("transcode_slots, same (kb.transcode_slots, validation)", n, n * (512 + 584 + 8),
                             kb.transcode_slots, big, trt, dst_pool, model1, src_page_size=256, dst_page_size=64,
                             src_slots=src_slots, dst_slots=dst_slots))
        del big, dst_pool, src_slots, dst_slots, order
        requests, topk = (8, 64) if dev.type == "cpu" else (128, 2048)
        indices = torch.randint(0, n, (requests, 1, topk), device=dev, dtype=torch.int32)
        k = indices.numel()
        out.append(self.time(f"gather-transcode {requests}x{topk} trtllm -> model1 (kernel)", k, k * (512 + 584 + 5),
                             tk.gather_transcode, trt_pool, trt, 64, indices.view(-1), 1.0, "flashmla", False, 64,
                             model1))
        out.append(self.time(f"gather-transcode {requests}x{topk} (kb.gather_transcode)", k, k * (512 + 584 + 5),
                             kb.gather_transcode, trt_pool, trt, page_size=64, indices=indices))
        ref_n = min(n, 1 << 18)
        out.append(self.time(f"transcode trtllm-fp8 -> model1, torch reference, {ref_n} tokens", ref_n,
                             ref_n * (512 + 584), reference.transcode_pages, trt_pool[: ref_n // 64], trt, 64, model1,
                             64, None, 1.0, 1.0, "flashmla"))
        del trt_pool, m1_pool
        if dev.type == "cuda":
            torch.cuda.empty_cache()
        out += self.migration(min(n, 1 << 17))
        return out

    def migration(self, n: int) -> list[Timing]:
        """A DeepSeek-V4-Flash request of ``n`` tokens migrated TensorRT-LLM FP8 -> vLLM with every pool on the device,
        stage by stage (gather, convert, publish: the transports' steps; the fused one pass of ``finish``; a whole
        ``migrate_local``), each next to a device-to-device copy of the payload; bytes count payload read + written."""
        from kvbridge.engines.topology import FLASH
        from kvbridge.migration import EnginePools, destination_pools, plan_migration, source_request
        from kvbridge.migration import execute as ex
        from kvbridge.migration.pools import gather_records, table_of

        dev = self.device
        model = FLASH if dev.type == "cuda" else FLASH.with_layers(4)  # --smoke: 4 layers
        plan = plan_migration("trtllm:fp8:tpb=128", "vllm", model, n)
        src_cpu, tables = source_request(plan, seed=2)

        def on_device(pools: EnginePools) -> EnginePools:
            moved = {key: tuple(t.to(dev) for t in pool) if isinstance(pool, tuple) else pool.to(dev)
                     for key, pool in pools.pools.items()}
            return EnginePools.wrap(pools.profile, pools.model, moved, include_mtp=pools.include_mtp)

        src, dst = on_device(src_cpu), on_device(destination_pools(plan, seed=1))
        nbytes = sum(t.src_bytes for t in plan.transfers)
        print(f"migration stages at {n} tokens ({nbytes} payload bytes) on {dev}", flush=True)

        def gather() -> list:
            return [gather_records(src.pool(t.spec), t.src, table_of(tables, t.src), t.first, t.count)
                    for t in plan.transfers]

        payload = ex.Payload(plan.fingerprint(), False, gather(), [[t.count] for t in plan.transfers],
                             [[0] for _ in plan.transfers])
        converted = ex.convert_payload(plan, payload, loss_report=False)

        def publish() -> None:
            dst.release(ex.publish(plan, converted, dst))

        def local() -> None:
            got, _ = ex.migrate_local(plan, src, tables, dst, loss_report=False)
            dst.release(got)

        out = [self.time("migration: gather (pools -> records)", n, 2 * nbytes, gather),
               self.time("migration: convert records (ops.records)", n, 2 * nbytes, ex.convert_payload, plan, payload,
                         loss_report=False),
               self.time("migration: publish (records -> pools)", n, 2 * nbytes, publish),
               self.time("migration: migrate_local, whole (staged on the device)", n, 2 * nbytes, local)]
        return out


# ----------------------------------------------------------------------------- optional FlashMLA section


def flashmla_section(device, checker: Validator, timings: list[Timing]) -> str:
    """FlashMLA sparse decode over a TensorRT-LLM pool, through each kernel set the build and GPU offer:
    the legacy V4 kernels on the pool's MODEL1 gather scratch, the pool itself (the current V4.1 kernels
    on sm_100, else the legacy ones) and a block-split V4.1 pool (legacy ``V41``). Each is compared with
    kvbridge's reference decode of the same inputs and timed next to the gather. Skipped (with the
    reason) when no usable ``flash_mla`` is installed."""
    import kvbridge as kb

    if not hasattr(kb, "sparse_decode"):
        return "skipped: kvbridge.sparse_decode is not present in this build"
    try:
        from kvbridge.attention import flashmla, sparse
        from kvbridge.attention.args import validate

        build = flashmla.import_build()
    except Exception as exc:  # no flash_mla module, no legacy kernels, wrong torch, ...
        return f"skipped: FlashMLA backend not usable ({type(exc).__name__}: {exc})"
    import torch

    print("FlashMLA section: sparse decode over a TensorRT-LLM pool", flush=True)
    n, requests, topk, heads = 1 << 20, 128, 2048, 64
    x = torch.randn(n, 512, device=device)
    pool = kb.encode(x, "trtllm-fp8", page_size=64)
    v41_pool = kb.encode(x, "v41-fp8", page_size=64)
    del x
    indices = torch.randint(0, n, (requests, 1, topk), device=device, dtype=torch.int32)
    q = torch.randn(requests, 1, heads, 512, device=device, dtype=torch.bfloat16)
    scratch, remapped = kb.gather_transcode(pool, "trtllm-fp8", page_size=64, indices=indices)
    cases = {"MODEL1 gather scratch": (scratch, remapped, "flashmla-model1"),
             "TensorRT-LLM pool": (pool, indices, "trtllm-fp8"), "V4.1 fp8 pool": (v41_pool, indices, "v41-fp8")}
    bench, notes = Bench(device, iters=10), []
    for name, (cache, idx, layout) in cases.items():
        def decode(backend: str, cache=cache, idx=idx, layout=layout):
            return kb.sparse_decode(q, cache, idx, layout=layout, page_size=64, backend=backend)

        try:
            call = flashmla.prepare(validate(q, cache, idx, layout=layout, page_size=64, extra_k_cache=None,
                                             extra_indices=None, extra_layout=None, extra_page_size=None,
                                             topk_length=None, extra_topk_length=None, attn_sink=None,
                                             softmax_scale=None, scale=None, extra_scale=None), build)
            kernels = (f"legacy kv_format={call.kwargs['kv_format']}" if call.kwargs.get("use_legacy")
                       else "current V4.1" if build.split_legacy else "unified")
            kernels += f", {call.main.layout.name}{' gathered' if call.main.gathered else ''}"
        except Exception as exc:  # this GPU / build has no kernels for the pool: reported as a failed check
            checker.record("flashmla", f"{name}: kernel routing", lambda exc=exc: f"{type(exc).__name__}: {exc}")
            continue

        def check(decode=decode) -> bool | str:
            out, lse = decode("flashmla")
            ref_out, ref_lse = decode("reference")
            a = sparse.compare(out, ref_out, sparse.OUT_TOLERANCE)
            b = sparse.compare(lse, ref_lse, sparse.LSE_TOLERANCE)
            return True if a.passed and b.passed else f"out: {a.detail}; lse: {b.detail}"

        checker.record("flashmla", f"sparse_decode(flashmla) {name} ({kernels}) == reference decode", check)
        if checker.checks[-1].passed:
            notes.append(f"{name} ({kernels}): {bench.median_ms(decode, 'flashmla'):.3f} ms")
    gather_ms = bench.median_ms(kb.gather_transcode, pool, "trtllm-fp8", page_size=64, indices=indices)
    return (f"decode {requests}x{topk}, {heads} heads: " + "; ".join(notes) +
            f"; gather-transcode of the TensorRT-LLM pool into MODEL1: {gather_ms:.3f} ms")


# ----------------------------------------------------------------------------- output


def pools_on(pools, device):
    """``pools`` (EnginePools) with every tensor moved to ``device``, in place."""
    pools.pools = {k: tuple(t.to(device) for t in v) if isinstance(v, tuple) else v.to(device)
                   for k, v in pools.pools.items()}
    return pools


def sglang_pd_roundtrip(device) -> bool | str:
    """kvbridge's SGLang prefill peer -> kvbridge's SGLang decode peer over SGLang 0.5.23's PD protocol
    (bootstrap route, ZMQ frames, NIXL writes), both with their pools on ``device``: on CUDA every pool
    is registered and announced as VRAM (the compressor state too, as SGLang addresses it), the
    metadata rows as DRAM; the request lands byte-exact and the decode's own digest, reduced on the
    device, matches the one the prefill wrote into the checksum row."""
    import torch

    from kvbridge.adapters.sglang import SGLangPrefillPeer
    from kvbridge.adapters.sglang_decode import SGLangDecodePeer
    from kvbridge.engines.topology import FLASH
    from kvbridge.migration import EnginePools, plan_migration, source_request
    from kvbridge.migration.pools import gather_records, table_of

    model, tokens, room = FLASH.with_layers(5), 1026, 31
    plan = plan_migration("sglang", "sglang", model, tokens, include_mtp=False)
    src, src_tables = source_request(plan, seed=5)
    dst = EnginePools.create("sglang", model, {"full": 8, "swa": 8, "state128": 3}, include_mtp=False, seed=2)
    src, dst = pools_on(src, device), pools_on(dst, device)
    kind = "VRAM" if device.type == "cuda" else "DRAM"
    with SGLangPrefillPeer(src, state_memory=kind) as prefill, SGLangDecodePeer(dst, kv_checksum=True) as decode:
        prefill.add_request(room, src_tables, tokens, 7)
        req = decode.receive(prefill.bootstrap_addr, room, tokens)
        sent = prefill.wait(room)
    if sent["status"] != "Success" or not req.digest_verified or req.digest != sent["digest"]:
        return f"prefill {sent['status']} {sent['reason']}; digest verified {req.digest_verified}"
    for t in plan.transfers:
        got = gather_records(dst.pool(t.spec), t.dst, table_of(req.tables, t.dst), t.first, t.count)
        want = gather_records(src.pool(t.spec), t.src, table_of(src_tables, t.src), t.first, t.count)
        if got.device != device or not torch.equal(got.cpu(), want.cpu()):
            return f"layer {t.spec.layer} {t.spec.role.value}: bytes differ (or not on {device})"
    return True


def sglang_pd_section(device, checker: Validator) -> None:
    """The SGLang PD adapters with device memory (docs/adapters.md names these as GPU-only cases):
    memory kinds, ``kv_digest`` on the device against the host digest, a kvbridge-to-kvbridge request."""
    import torch

    from kvbridge.adapters.sglang_protocol import kv_checksum, kv_digest
    from kvbridge.migration.nixl_agent import memory_kind

    section = "sglang-pd"
    t = torch.zeros(4, dtype=torch.uint8, device=device)
    checker.record(section, "memory kind of a pool tensor",
                   lambda: memory_kind(t) == (("VRAM", t.device.index or 0) if device.type == "cuda" else ("DRAM", 0)))
    g = torch.Generator().manual_seed(9)
    items = [torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g) for n in (584 * 256, 524288, 1, 4096)]
    checker.record(section, "kv_digest on the device = Adler-32 of the bytes",
                   lambda: kv_digest(i.to(device) for i in items) == kv_checksum(i.numpy().tobytes() for i in items))
    checker.record(section, "kvbridge prefill -> kvbridge decode, pools on the device (NIXL)",
                   sglang_pd_roundtrip, device)


class VllmShape:
    """vLLM-shaped caches of a 4-layer DeepSeek-V4-Flash cut (one buffer, a strided view per cache layer, as vLLM
    registers them, pages 64 B apart more than their sum) and a 700-token request's block ids in them: the
    records ``plan`` (TensorRT-LLM FP8 -> vLLM) writes, seeded, the plan back (vLLM -> TensorRT-LLM) and the
    plan between two vLLMs (``same``)."""

    def __init__(self) -> None:
        import torch

        from kvbridge.adapters.vllm_layout import cache_name
        from kvbridge.engines.profiles import parse_engine
        from kvbridge.engines.topology import FLASH
        from kvbridge.migration import plan_migration

        self.model, self.profile = FLASH.with_layers(4), parse_engine("vllm:block=256")
        specs = list(self.model.all_caches(False))
        self.names = [cache_name(spec.layer, spec.role) for spec in specs]
        self.pages = [self.profile.storage(spec).page_bytes for spec in specs]
        self.plan = plan_migration("trtllm:fp8:tpb=128:scale=0.5", "vllm:block=256", self.model, 700,
                                   include_mtp=False)
        self.back = plan_migration("vllm:block=256", "trtllm:fp8:tpb=128:scale=0.5", self.model, 700,
                                   include_mtp=False)
        self.same = plan_migration(self.profile, self.profile, self.model, 700, include_mtp=False)
        g = torch.Generator().manual_seed(4)
        self.records = [torch.randint(0, 256, (t.count, t.dst.record_bytes), dtype=torch.uint8, generator=g)
                        for t in self.plan.transfers]
        held = sorted({slot for t in self.plan.transfers for slot in t.table_slots(t.dst)})
        self.block_ids = ([1 + slot if slot in held else 0 for slot in range(held[-1] + 1)],)  # 0: vLLM's null block
        self.num_blocks = held[-1] + 2

    def caches(self, where):
        """A zeroed buffer on ``where`` and its ``VllmCaches``."""
        import torch

        from kvbridge.adapters.vllm_layout import VllmCaches

        stride = sum(self.pages) + 64
        buf = torch.zeros(self.num_blocks * stride, dtype=torch.uint8, device=where)
        views, offset = {}, 0
        for name, page in zip(self.names, self.pages, strict=True):
            views[name] = buf.as_strided((self.num_blocks, page), (stride, 1), offset)
            offset += page
        return buf, VllmCaches(self.profile, self.model, views, [self.names], dict(zip(self.names, self.pages,
                                                                                        strict=True)))

    def sent(self, pools, tables) -> list:
        """The records of ``back`` in a request's (compact, host) pools, as a producer sends them."""
        from kvbridge.migration.pools import gather_records

        return [gather_records(pools.pool(t.spec), t.src, tables[t.src.table], t.first, t.count)
                for t in self.back.transfers]


def vllm_caches_roundtrip(device) -> bool | str:
    """The vLLM connector's device paths on ``VllmShape``'s caches on ``device``: ``VllmCaches.write`` of host
    records (the consumer: one copy onto the device, scattered there on a stream of its own, finished before it
    returns), ``write_from`` of host landing pools (the consumer over NIXL: the same bytes as ``write``) and
    ``request_pools`` (the producer: gathered on the device after an event on the current stream, then copied to
    the host once) give the bytes of the same calls on CPU caches."""
    import torch

    from kvbridge.adapters.vllm_layout import ready_event
    from kvbridge.migration import EnginePools
    from kvbridge.migration.pools import scatter_records, table_of

    shape = VllmShape()
    plan, records = shape.plan, shape.records
    landing = EnginePools.create(shape.profile, shape.model, plan.held_pages("dst"), include_mtp=False, seed=3)
    landed = landing.claim(plan.table_lengths("dst"), plan.released("dst"))  # host memory, other page ids
    for t, rec in zip(plan.transfers, records, strict=True):
        scatter_records(landing.pool(t.spec), t.dst, table_of(landed, t.dst), t.first, rec)
    got = {}
    for where in (torch.device("cpu"), device):
        from_landing, caches = shape.caches(where)
        caches.write_from(plan.transfers, landing, landed, shape.block_ids)
        buf, caches = shape.caches(where)
        caches.write(plan.transfers, records, shape.block_ids)
        if not torch.equal(buf.cpu(), from_landing.cpu()):
            return f"write_from of host landing pools on {where} differs from write"
        sent = shape.sent(*caches.request_pools(shape.back, shape.block_ids, ready_event(caches.device)))
        if any(p.device.type != "cpu" for p in sent):
            return f"request_pools on {where} left records on the device"
        got[where.type] = (buf.cpu(), sent)
    (cpu_buf, cpu_sent), (dev_buf, dev_sent) = got["cpu"], got[device.type]
    if not torch.equal(cpu_buf, dev_buf):
        return f"the caches written on {device} differ from the same write on CPU"
    if not all(torch.equal(a, b) for a, b in zip(cpu_sent, dev_sent, strict=True)):
        return f"request_pools on {device} differs from CPU"
    if not all(torch.equal(r, s) for r, s in zip(records, cpu_sent, strict=True)):
        return "the records sent back are not the records written"
    return True


def vllm_producer(peer: str, device: str) -> None:
    """The producer process of ``vllm_loopback`` (``gpu_check.py --vllm-producer HOST:PORT DEVICE``): ``VllmShape``'s
    records written into caches on ``device``, then sent from them as the connector's producer sends a finished
    request (``request_pools`` after a ``ready_event``, then kvbridge's gloo transport) to another vLLM."""
    import torch

    from kvbridge.adapters.vllm_layout import ready_event
    from kvbridge.migration.transport import send_request_tcp

    shape = VllmShape()
    _, caches = shape.caches(torch.device(device))
    caches.write(shape.plan.transfers, shape.records, shape.block_ids)
    pools, tables = caches.request_pools(shape.same, shape.block_ids, ready_event(caches.device))
    host, port = peer.rsplit(":", 1)
    send_request_tcp(shape.same, pools, tables, host=host, port=int(port), request_id="gpu-check-vllm", timeout=120)


def vllm_loopback(device) -> bool | str:
    """The vLLM connector's consumer and producer paths with caches on ``device``, one process each over
    kvbridge's gloo transport on loopback: a producer process (``vllm_producer``) sends from its device caches;
    this process receives as the connector's consumer does (a ``GlooServer`` publishing through
    ``VllmCaches.write`` into device caches). The caches here then hold the producer's records byte for byte
    (vLLM to vLLM: ``VllmShape``'s records are arbitrary bytes, moved, not converted)."""
    import subprocess

    import torch

    from kvbridge.migration import EnginePools
    from kvbridge.migration.transport import GlooServer

    shape = VllmShape()
    _, caches = shape.caches(device)
    server = GlooServer(EnginePools(shape.profile, shape.model, False, {}), plan=shape.same)
    host, port = server.address
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)
    proc = subprocess.Popen([sys.executable, __file__, "--vllm-producer", f"{host}:{port}", device.type],
                            stderr=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": path})
    def publish(assembly):  # as the connector's consumer publishes
        caches.write(assembly.plan.transfers, assembly.records, shape.block_ids)
        return {}

    try:
        got = server.receive(timeout=120, publish=publish)
        _, errors = proc.communicate(timeout=120)
    finally:
        server.close()
        if proc.poll() is None:
            proc.kill()
    if got is None or proc.returncode:
        return f"the producer process failed: {(errors or '').strip().splitlines()[-1:]}"
    back = shape.sent(*caches.request_pools(shape.back, shape.block_ids))
    return all(torch.equal(r, s) for r, s in zip(shape.records, back, strict=True)) or \
        "the records received are not the producer's"


def vllm_section(device, checker: Validator) -> None:
    """The vLLM connector's cache paths with device tensors (docs/adapters.md names them as GPU-only cases)."""
    checker.record("vllm", "connector caches: write and request_pools on the device = on CPU", vllm_caches_roundtrip,
                   device)
    checker.record("vllm", "connector consumer and producer, one process each (gloo loopback), caches on the device",
                   vllm_loopback, device)


def device_digest_matches(device) -> bool | str:
    """The Triton XXH3-64 of spans of a device tensor (every length path, page-chunk sizes) = the CPU's; a migration's
    checksums of device records (``rows.xxh3_chunks``, what the senders and the verifier call) = of their host copy."""
    import numpy as np
    import torch

    from kvbridge.backends import dispatch
    from kvbridge.migration.rows import xxh3_chunks

    data = torch.from_numpy(np.random.default_rng(3).integers(0, 256, 1 << 20, dtype=np.uint8))
    lengths = [*range(300), 1023, 1024, 1025, 4096, 18688, 75776, 300000]
    spans = np.array([(7 * k, 7 * k + n) for k, n in enumerate(lengths)], dtype=np.int64)
    want = dispatch.xxh3_chunks(data.numpy(), spans)
    got = dispatch.xxh3_chunks(data.to(device), spans)
    if got != want:
        return f"{sum(a != b for a, b in zip(got, want, strict=True))} of {len(want)} spans differ"
    records = data[: 584 * 1000].view(1000, 584)
    rows = [1, 63, 64, 256, 616]
    return xxh3_chunks(records.to(device), rows) == xxh3_chunks(records, rows) or "record chunks differ"


def digest_section(device, checker: Validator, timer: Bench, timings: list[Timing], smoke: bool) -> None:
    """The migration checksums on the device (docs/adapters.md: records on a GPU are hashed where they are), and their
    speed over a 131,072-token request's worth of page chunks next to a copy of the same bytes."""
    checker.record("digest", "Triton XXH3-64 of device spans and record chunks = CPU", device_digest_matches, device)
    if smoke or not checker.checks[-1].passed:
        return
    import numpy as np
    import torch

    from kvbridge.backends import dispatch

    nbytes, chunk = 413343744, 18688  # the bench request's payload; 32 MODEL1 records of 584 B a chunk
    data = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, device=device)
    starts = np.arange(0, nbytes - chunk + 1, chunk, dtype=np.int64)
    spans = np.stack([starts, starts + chunk], axis=1)
    timings.append(timer.time(f"xxh3 digest, {len(spans)} chunks of {chunk} B (bytes read)", 0, len(spans) * chunk,
                              dispatch.xxh3_chunks, data, spans))


def report(checks: list[Check], timings: list[Timing], flashmla_note: str, device, seconds: float,
           args: argparse.Namespace) -> None:
    import torch

    failed = [c for c in checks if not c.passed]
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU (Triton interpreter)"
    print()
    print(f"gpu_check on {name}, torch {torch.__version__}, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())},"
          f" {seconds:.0f} s")
    if args.smoke:
        print("SMOKE RUN: CPU interpreter at tiny sizes; the timings below say nothing about kernel speed")
    by_section: dict[str, list[Check]] = {}
    for c in checks:
        by_section.setdefault(c.section, []).append(c)
    print(f"{'validation':<22}{'checks':>8}{'failed':>8}")
    for section, items in by_section.items():
        print(f"{section:<22}{len(items):>8}{sum(not c.passed for c in items):>8}")
    for c in failed:
        print(f"FAILED {c.section}: {c.name} -- {c.detail}")
    if timings:
        print()
        print(f"{'operation':<62}{'tokens':>10}{'ms':>10}{'GB/s':>8}{'copy ms':>9}{'% copy':>8}{'Mtok/s':>9}")
        for t in timings:
            print(f"{t.op:<62}{t.tokens:>10}{t.ms:>10.3f}{t.gbps:>8.0f}{t.copy_ms:>9.3f}"
                  f"{100 * t.copy_fraction:>7.0f}%{t.mtok_s:>9.1f}")
        print("GB/s counts bytes read + written; '% copy' = time of a device copy moving the same bytes / op time.")
    elif failed:
        print("timing skipped: fix the failed checks first")
    if not tk_hardware_used(device):
        print("timings and API checks used the integer E4M3 path")
    print(f"FlashMLA: {flashmla_note}")
    print("RESULT:", "PASS" if not failed else f"FAIL ({len(failed)} of {len(checks)} checks)")


def tk_hardware_used(device) -> bool:
    """Whether the kernels ran (and were timed) with the hardware E4M3 conversion."""
    from kvbridge.backends import triton_kernels

    return triton_kernels.fp8_hardware and triton_kernels.hardware_fp8_available(device)


def write_json(path: Path, checks: list[Check], timings: list[Timing], flashmla_note: str, device) -> None:
    """All results as JSON, written atomically (temp file + os.replace)."""
    import torch

    data = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "fp8_hardware": tk_hardware_used(device),
        "checks": [asdict(c) for c in checks],
        "timings": [{**asdict(t), "gbps": t.gbps, "copy_fraction": t.copy_fraction} for t in timings],
        "flashmla": flashmla_note,
    }
    fd, tmp = tempfile.mkstemp(dir=path.resolve().parent, prefix=f".{path.name}.")
    with os.fdopen(fd, "w") as handle:
        json.dump(data, handle, indent=1)
    os.replace(tmp, path)


if __name__ == "__main__":
    sys.exit(main())
