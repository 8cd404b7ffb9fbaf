"""Throughput benchmark of the paged operations (library side of ``kvbridge bench``).

Each case times, on one device and in one run:

- the public API (``kvbridge.encode/decode/transcode``), which dispatches to the native CPU
  kernels or the Triton kernels, on CPU once per thread count (``threads``, default 1 and 2:
  ``torch.set_num_threads``, which the native kernels follow); every case twice, with a fresh
  output and ``into out=`` a preallocated (already touched) destination pool or latents tensor;
- two copies of as many bytes as the operation reads plus writes, into preallocated memory:
  ``np.copyto`` (one thread, whatever ``threads`` is) and ``torch.Tensor.copy_`` (torch's
  threads, the row's count). ``vs_np_copyto`` / ``vs_copy`` = kvbridge tokens/s over the copy's
  tokens/s (same bytes per token): the fraction of that copy's bandwidth the operation reaches;
- with a fresh output, the fresh-output ceiling: ``torch.empty`` of the output's bytes + ``fill_``
  (torch's threads), what any freshly allocated output of that size costs on this machine
  (first-touch page faults, which on a VM can cost more than the operation itself).
  ``vs_fresh_ceiling`` = the ceiling's time over kvbridge's (1.0: kvbridge costs what allocating and
  filling its output costs); ``ceiling_vs_np_copyto`` = np.copyto's time over the ceiling's, the
  ``vs_np_copyto`` a fresh-output operation would reach if it cost only its output;
- the naive reference path (``kvbridge.backends.reference``) on ``min(tokens, reference_tokens)`` tokens
  (default: the same size as kvbridge; its rate per token falls with the size, so a capped
  reference makes ``vs_reference`` understate the speed-up; ``reference_capped`` says so).

Rates are medians of ``repeat`` timed calls (best also kept) after one untimed warm-up call
(whose time, JIT compilation or cache load included, is reported as ``first_call_s``). kvbridge
and the copies alternate call by call, and each ``vs_*`` is the median over those rounds of the
paired ratio, so that load from other processes on a shared machine skews it least. GB/s counts
bytes read plus bytes written, 10^9 bytes. Every case also checks that the public API's output
equals the reference's on the reference's tokens (``exact``).
"""

from __future__ import annotations

import os
import platform
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass

import numpy as np
import torch

from kvbridge.backends import dispatch, reference
from kvbridge.backends.native import accel as native_accel
from kvbridge.layouts import get_layout
from kvbridge.ops import pages as page_ops

#: Source and destination page size of every case (FlashMLA / vLLM SWA pools use 64).
PAGE_SIZE = 64
#: Page size of the re-paging case's destination (a TensorRT-LLM 256-token block).
REPAGE_PAGE_SIZE = 256
#: The case issue 3's CPU target is checked on (the copy baseline writes preallocated memory, so
#: the like-for-like transcode does too), and the target itself.
TARGET_CASE = "transcode trtllm-fp8 -> flashmla-model1 into out="
TARGET_MIN_TOKENS = 65536
TARGET_VS_COPY = 0.25
TARGET_VS_REFERENCE = 20.0


@dataclass
class Timing:
    """One timed path over ``tokens`` tokens: median and best of ``repeat`` calls, in seconds."""

    tokens: int
    seconds: float  # median
    best_seconds: float
    bytes_moved: int  # read + written

    @classmethod
    def of(cls, tokens: int, times: list[float], bytes_moved: int) -> Timing:
        return cls(tokens, statistics.median(times), min(times), bytes_moved)

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds

    @property
    def best_tokens_per_s(self) -> float:
        return self.tokens / self.best_seconds

    @property
    def gb_per_s(self) -> float:
        return self.bytes_moved / self.seconds / 1e9


@dataclass
class CaseResult:
    """One operation on one device at one thread count and output mode: kvbridge, the reference
    and two memory copies of the same bytes."""

    case: str  # the operation; transcodes into a preallocated pool end with " into out="
    device: str
    backend: str  # implementation the public API dispatched to
    threads: int  # torch / native threads of the kvbridge and copy_ calls
    output: str  # "fresh" (kvbridge allocates its output) or "out=" (a preallocated destination)
    kvbridge: Timing
    reference: Timing
    copy: Timing  # torch copy_ into a preallocated tensor
    np_copy: Timing | None  # np.copyto into a preallocated array (one thread; CPU only)
    fresh_ceiling: Timing | None  # torch.empty of the output's bytes + fill_ (fresh outputs only)
    first_call_s: float
    exact: bool
    vs_copy: float  # median over rounds of kvbridge tokens/s / copy_ tokens/s (same bytes per token)
    vs_np_copyto: float | None  # the same against np.copyto (CPU only)
    vs_fresh_ceiling: float | None  # median over rounds of the ceiling's time / kvbridge's (fresh outputs only)
    ceiling_vs_np_copyto: float | None  # median over rounds of np.copyto's time / the ceiling's (CPU, fresh)

    @property
    def vs_reference(self) -> float:
        """Median kvbridge tokens/s divided by the reference's."""
        return self.kvbridge.tokens_per_s / self.reference.tokens_per_s

    @property
    def reference_capped(self) -> bool:
        """Whether the reference ran on fewer tokens than kvbridge (its rate per token is then higher
        than at kvbridge's size, and ``vs_reference`` understates the speed-up)."""
        return self.reference.tokens < self.kvbridge.tokens

    def to_dict(self) -> dict:
        out = asdict(self)
        for name in ("kvbridge", "reference", "copy", "np_copy", "fresh_ceiling"):
            timing: Timing | None = getattr(self, name)
            if timing is not None:
                out[name].update(tokens_per_s=timing.tokens_per_s, gb_per_s=timing.gb_per_s)
        out.update(vs_reference=self.vs_reference, reference_capped=self.reference_capped)
        return out


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _timed_rounds(fns: list[Callable[[], object]], repeat: int, device: torch.device) -> list[list[float]]:
    """Wall times of each function over ``repeat`` rounds. The functions alternate within a round,
    so that load from other processes on a shared machine hits each of them alike."""
    times: list[list[float]] = [[] for _ in fns]
    for _ in range(repeat):
        for fn, out in zip(fns, times, strict=True):
            _sync(device)
            start = time.perf_counter()
            fn()
            _sync(device)
            out.append(time.perf_counter() - start)
    return times


def _copy_buffers(bytes_moved: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Source and preallocated destination of a copy that reads ``bytes_moved / 2`` bytes and writes as many."""
    src = torch.randint(0, 256, (bytes_moved // 2,), dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    return src, dst


class _OutBuffer:
    """A case's preallocated output (``into out=``): allocated and touched on first use, freed after the case."""

    def __init__(self, shape: tuple[int, int], dtype: torch.dtype, device: torch.device):
        self.shape, self.dtype, self.device = shape, dtype, device
        self.tensor: torch.Tensor | None = None

    def rows(self, n: int) -> torch.Tensor:
        if self.tensor is None:
            self.tensor = torch.empty(self.shape, dtype=self.dtype, device=self.device)
            self.tensor.view(torch.uint8).fill_(0)
        return self.tensor[:n]

    def release(self) -> None:
        self.tensor = None


@dataclass
class _Case:
    name: str
    run: Callable[[int, bool], torch.Tensor]  # public API on the first n tokens (into a preallocated output: True)
    run_reference: Callable[[int], torch.Tensor]  # the reference on the first n tokens
    bytes_per_token: int  # read + written
    probe: torch.Tensor  # a tensor on the device with the case's layouts, to name the backend
    layouts: tuple
    out: _OutBuffer  # the preallocated output of the ``into out=`` runs


def _cases(latents: torch.Tensor) -> list[_Case]:
    """The benchmarked operations over ``latents`` (bf16 ``[N, 512]`` on the benchmark's device)."""
    p, rp = PAGE_SIZE, REPAGE_PAGE_SIZE
    fp8, model1, ds_mla, bf16 = (get_layout(n) for n in ("trtllm-fp8", "flashmla-model1", "trtllm-fp8-ds-mla", "bf16"))
    v41, v41i, fp4i = (get_layout(n) for n in ("v41-fp8", "v41-fp8-interleaved", "v41-fp4-interleaved"))
    x32 = latents.float()
    pools = {lay.name: page_ops.encode(latents, lay, page_size=p) for lay in (fp8, model1, bf16, v41, v41i, fp4i)}
    device, num_pages = latents.device, -(-latents.shape[0] // p)

    def head(name: str, n: int) -> torch.Tensor:
        return pools[name][: -(-n // p)]

    def transcode(src, dst, auto: bool = False) -> _Case:
        pb, db = src.page_bytes(p), dst.page_bytes(p)
        dst_pool = _OutBuffer((num_pages, db), torch.uint8, device)

        def run(n: int, into: bool) -> torch.Tensor:
            out = dst_pool.rows(-(-n // p)) if into else None
            return page_ops.transcode(head(src.name, n), src, dst, src_page_size=p, num_tokens=n, out=out,
                                 dst_scale="auto" if auto else None)

        def run_reference(n: int) -> torch.Tensor:
            if not auto:
                return reference.transcode_pages(head(src.name, n), src, p, dst, p, n, 1.0, 1.0, dst.default_dialect)
            values = reference.decode_pages(head(src.name, n), src, p, n, 1.0)
            return reference.encode_pages(values, dst, p, dst.default_dialect, page_ops.auto_scale(values))

        name = f"transcode {src.name} -> {dst.name}" + (" dst_scale=auto" if auto else "")
        return _Case(name, run, run_reference, (pb + db) // p, pools[src.name], (src, dst), dst_pool)

    def encode(dst) -> _Case:
        dst_pool = _OutBuffer((num_pages, dst.page_bytes(p)), torch.uint8, device)
        return _Case(
            f"encode bf16 latents -> {dst.name}",
            lambda n, into: page_ops.encode(
                latents[:n], dst, page_size=p, out=dst_pool.rows(-(-n // p)) if into else None
            ),
            lambda n: reference.encode_pages(x32[:n], dst, p, dst.default_dialect, 1.0),
            2 * 512 + dst.page_bytes(p) // p, latents, (dst,), dst_pool,
        )

    def decode(src) -> _Case:
        values = _OutBuffer((latents.shape[0], 512), torch.float32, device)
        return _Case(
            f"decode {src.name} -> fp32 latents",
            lambda n, into: page_ops.decode(head(src.name, n), src, page_size=p, num_tokens=n,
                                       out=values.rows(n) if into else None),
            lambda n: reference.decode_pages(head(src.name, n), src, p, n, 1.0),
            src.page_bytes(p) // p + 4 * 512, pools[src.name], (src,), values,
        )

    def repage(src, dst, dst_p: int) -> _Case:
        dst_pool = _OutBuffer((-(-num_pages * p // dst_p), dst.page_bytes(dst_p)), torch.uint8, device)

        def run(n: int, into: bool) -> torch.Tensor:
            out = dst_pool.rows(-(-n // dst_p)) if into else None
            return page_ops.transcode(head(src.name, n), src, dst, src_page_size=p, dst_page_size=dst_p, num_tokens=n,
                                 out=out)

        return _Case(
            f"repage {src.name} P={p} -> {dst.name} P={dst_p}", run,
            lambda n: reference.repage(head(src.name, n), src, p, dst, dst_p, n),
            (src.page_bytes(p) // p) + dst.record_bytes, pools[src.name], (src, dst), dst_pool,
        )

    return [
        transcode(fp8, model1), transcode(model1, fp8), transcode(model1, fp8, auto=True), transcode(bf16, model1),
        repage(model1, ds_mla, rp),
        encode(model1), encode(fp8), decode(model1), decode(fp8),
        # The DeepSeek-V4.1 family (FlashMLA's current kernels read the interleaved layouts).
        transcode(fp8, v41i), transcode(model1, v41i), transcode(v41i, model1), transcode(v41i, fp4i),
        repage(v41, v41i, p), encode(v41i), encode(fp4i), decode(v41i), decode(fp4i),
    ]


def _equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.dtype == torch.float32:  # decoded values: compare bit patterns (NaN, -0.0 included)
        return torch.equal(a.view(torch.int32), b.view(torch.int32))
    return torch.equal(a, b)


def _median_ratio(num: list[float], den: list[float]) -> float:
    """Median over rounds of ``num[i] / den[i]`` (paired times of one round)."""
    return statistics.median(a / b for a, b in zip(num, den, strict=True))


def _time_variant(case: _Case, into: bool, threads: int, tokens: int, n_ref: int, want: torch.Tensor,
                  t_ref: list[float], repeat: int, device: torch.device) -> CaseResult:
    """Time one case at one thread count and output mode against both copies of the same bytes
    (and, with a fresh output, against the fresh-output ceiling)."""
    torch.set_num_threads(threads)
    start = time.perf_counter()
    result = case.run(tokens, into)
    _sync(device)
    first = time.perf_counter() - start
    out_bytes = result.numel() * result.element_size()
    del result
    copy_src, copy_dst = _copy_buffers(case.bytes_per_token * tokens, device)
    fns: dict[str, Callable[[], object]] = {"kvbridge": lambda: case.run(tokens, into),
                                            "copy": lambda: copy_dst.copy_(copy_src)}
    if device.type == "cpu":
        np_src, np_dst = copy_src.numpy(), copy_dst.numpy()
        fns["np_copy"] = lambda: np.copyto(np_dst, np_src)
    if not into:
        fns["fresh_ceiling"] = lambda: torch.empty(out_bytes, dtype=torch.uint8, device=device).fill_(0)
    times = dict(zip(fns, _timed_rounds(list(fns.values()), repeat, device), strict=True))
    t_fast, t_np, t_ceil = times["kvbridge"], times.get("np_copy"), times.get("fresh_ceiling")
    nbytes = case.bytes_per_token * tokens
    return CaseResult(
        case=case.name + (" into out=" if into else ""), device=str(device),
        backend=dispatch.backend_name(case.probe, *case.layouts), threads=threads, output="out=" if into else "fresh",
        kvbridge=Timing.of(tokens, t_fast, nbytes),
        reference=Timing.of(n_ref, t_ref, case.bytes_per_token * n_ref),
        copy=Timing.of(tokens, times["copy"], 2 * copy_src.numel()),
        np_copy=None if t_np is None else Timing.of(tokens, t_np, 2 * copy_src.numel()),
        fresh_ceiling=None if t_ceil is None else Timing.of(tokens, t_ceil, out_bytes),
        first_call_s=first, exact=_equal(case.run(n_ref, into), want),
        vs_copy=_median_ratio(times["copy"], t_fast),
        vs_np_copyto=None if t_np is None else _median_ratio(t_np, t_fast),
        vs_fresh_ceiling=None if t_ceil is None else _median_ratio(t_ceil, t_fast),
        ceiling_vs_np_copyto=None if t_ceil is None or t_np is None else _median_ratio(t_np, t_ceil),
    )


def run_case(case: _Case, tokens: int, reference_tokens: int, repeat: int, device: torch.device, *,
             threads: Sequence[int] = (1, 2), reference_repeat: int = 1) -> list[CaseResult]:
    """Time one case: the reference once on ``min(tokens, reference_tokens)`` tokens (``reference_repeat``
    calls), then kvbridge on ``tokens`` tokens per output mode (fresh, then ``out=``) and (on CPU) per
    thread count."""
    n_ref = min(tokens, reference_tokens)
    saved = torch.get_num_threads()
    try:
        want = case.run_reference(n_ref)
        (t_ref,) = _timed_rounds([lambda: case.run_reference(n_ref)], reference_repeat, device)
        counts = list(threads) if device.type == "cpu" else [saved]
        return [_time_variant(case, into, n, tokens, n_ref, want, t_ref, repeat, device)
                for into in (False, True) for n in counts]
    finally:
        case.out.release()
        torch.set_num_threads(saved)


def available_devices() -> list[str]:
    return ["cpu", "cuda"] if torch.cuda.is_available() else ["cpu"]


def default_threads() -> tuple[int, ...]:
    """1 and 2 threads, and every core of a larger machine (``os.sched_getaffinity``)."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return tuple(sorted({1, min(2, cores), cores}))


def run_bench(
    tokens: int = 65536,
    devices: list[str] | None = None,
    repeat: int = 5,
    reference_tokens: int | None = None,
    seed: int = 0,
    threads: Sequence[int] | None = None,
    reference_repeat: int = 1,
    only: Sequence[str] | None = None,
) -> list[CaseResult]:
    """Run every case (or those whose name contains one of ``only``) on each device (default: CPU,
    plus CUDA when present); the reference on ``reference_tokens`` tokens (default: ``tokens``),
    CPU cases at each of ``threads`` (default ``default_threads()``)."""
    results = []
    counts = tuple(threads) if threads else default_threads()
    for name in devices or available_devices():
        device = torch.device(name)
        gen = torch.Generator().manual_seed(seed)
        latents = (torch.randn(tokens, 512, generator=gen) * 2).to(torch.bfloat16).to(device)
        for case in _cases(latents):
            if only and not any(part in case.name for part in only):
                continue
            results.extend(run_case(case, tokens, reference_tokens or tokens, repeat, device, threads=counts,
                                    reference_repeat=reference_repeat))
    return results


def machine() -> dict:
    """The CPU model (``/proc/cpuinfo``) with its vector extensions, cores, threads, GPU and torch, and
    which code runs the native MODEL1 kernels (``native_accel.kernel_implementation``: the compiled C
    kernels and their ISA, or numba and why)."""
    fields: dict[str, str] = {}
    try:
        with open("/proc/cpuinfo") as info:
            for line in info:
                key, _, value = line.partition(":")
                fields.setdefault(key.strip(), value.strip())
    except OSError:
        pass
    model, flags = fields.get("model name") or platform.processor() or platform.machine(), fields.get("flags", "")
    vector = [f for f in ("avx512f", "avx512bw", "avx512vbmi", "avx2") if f in flags.split()]
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    return {"cpu": model, "cpu_vector": vector, "cpu_cores": cores, "cpu_threads": torch.get_num_threads(),
            "native_kernels": native_accel.kernel_implementation(), "gpu": gpu, "torch": torch.__version__,
            "numpy": np.__version__, "python": platform.python_version()}


def cpu_target(results: list[CaseResult]) -> dict | None:
    """Issue 3's CPU target for the TensorRT-LLM FP8 -> MODEL1 transcode (at the most threads
    measured), or None if not measured."""
    rows = [r for r in results if r.case == TARGET_CASE and r.device == "cpu"]
    if not rows:
        return None
    r = max(rows, key=lambda row: row.threads)
    met = r.kvbridge.tokens >= TARGET_MIN_TOKENS and r.vs_copy >= TARGET_VS_COPY and \
        r.vs_reference >= TARGET_VS_REFERENCE
    return {
        "case": r.case, "tokens": r.kvbridge.tokens, "threads": r.threads, "vs_copy": r.vs_copy,
        "vs_np_copyto": r.vs_np_copyto, "vs_reference": r.vs_reference, "reference_tokens": r.reference.tokens,
        "required": {"tokens": TARGET_MIN_TOKENS, "vs_copy": TARGET_VS_COPY, "vs_reference": TARGET_VS_REFERENCE},
        "met": met,
    }
