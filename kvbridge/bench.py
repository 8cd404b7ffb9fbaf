"""Throughput benchmark of the paged operations (library side of ``kvbridge bench``).

Each case times, on one device and in one run:

- the public API (``kvbridge.encode/decode/transcode``), which dispatches to the native CPU
  kernels or the Triton kernels;
- the naive reference path (``kvbridge.reference``), on at most ``reference_tokens`` tokens
  (its rate per token does not depend on the size, and 64K tokens take minutes);
- a memory copy (``Tensor.copy_`` into a preallocated tensor) of as many bytes as the operation
  reads plus writes, so ``vs_copy`` = kvbridge tokens/s / copy tokens/s is the fraction of the
  device's copy bandwidth the operation reaches. kvbridge's calls allocate their output, except
  the ``into out=`` case, which writes a preallocated destination pool like the copy does.

Rates are medians of ``repeat`` timed calls (best also kept) after one untimed warm-up call
(whose time, JIT compilation or cache load included, is reported as ``first_call_s``). kvbridge
and the copy alternate call by call, and ``vs_copy`` is the median over those rounds of the
paired ratio, so that load from other processes on a shared machine skews it least. GB/s counts bytes read
plus bytes written, 10^9 bytes. Every case also checks that the public API's output equals the
reference's on the reference's tokens (``exact``).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch

from kvbridge import api, fastpath, reference
from kvbridge.layouts import get_layout

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
    """One operation on one device: kvbridge, the reference and a memory copy of the same bytes."""

    case: str
    device: str
    backend: str  # implementation the public API dispatched to
    kvbridge: Timing
    reference: Timing
    copy: Timing
    first_call_s: float
    exact: bool
    vs_copy: float  # median over rounds of kvbridge tokens/s / copy tokens/s (same bytes per token)

    @property
    def vs_reference(self) -> float:
        """Median kvbridge tokens/s divided by the reference's."""
        return self.kvbridge.tokens_per_s / self.reference.tokens_per_s

    def to_dict(self) -> dict:
        out = asdict(self)
        for name in ("kvbridge", "reference", "copy"):
            timing: Timing = getattr(self, name)
            out[name].update(tokens_per_s=timing.tokens_per_s, gb_per_s=timing.gb_per_s)
        out.update(vs_reference=self.vs_reference)
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


@dataclass
class _Case:
    name: str
    run: Callable[[int], torch.Tensor]  # public API on the first n tokens
    run_reference: Callable[[int], torch.Tensor]  # the reference on the first n tokens
    bytes_per_token: int  # read + written
    probe: torch.Tensor  # a tensor on the device with the case's layouts, to name the backend
    layouts: tuple


def _cases(latents: torch.Tensor) -> list[_Case]:
    """The benchmarked operations over ``latents`` (bf16 ``[N, 512]`` on the benchmark's device)."""
    p, rp = PAGE_SIZE, REPAGE_PAGE_SIZE
    fp8, model1, ds_mla, bf16 = (get_layout(n) for n in ("trtllm-fp8", "flashmla-model1", "trtllm-fp8-ds-mla", "bf16"))
    v41, v41i, fp4i = (get_layout(n) for n in ("v41-fp8", "v41-fp8-interleaved", "v41-fp4-interleaved"))
    x32 = latents.float()
    pools = {lay.name: api.encode(latents, lay, page_size=p) for lay in (fp8, model1, bf16, v41, v41i, fp4i)}

    def head(name: str, n: int) -> torch.Tensor:
        return pools[name][: -(-n // p)]

    def transcode(src, dst, into: bool = False, auto: bool = False) -> _Case:
        pb, db = src.page_bytes(p), dst.page_bytes(p)
        dst_pool = torch.empty(pools[src.name].shape[0], db, dtype=torch.uint8, device=latents.device)

        def run(n: int) -> torch.Tensor:
            out = dst_pool[: -(-n // p)] if into else None
            return api.transcode(head(src.name, n), src, dst, src_page_size=p, num_tokens=n, out=out,
                                 dst_scale="auto" if auto else None)

        def run_reference(n: int) -> torch.Tensor:
            if not auto:
                return reference.transcode_pages(head(src.name, n), src, p, dst, p, n, 1.0, 1.0, dst.default_dialect)
            values = reference.decode_pages(head(src.name, n), src, p, n, 1.0)
            return reference.encode_pages(values, dst, p, dst.default_dialect, api.auto_scale(values))

        name = f"transcode {src.name} -> {dst.name}" + (" dst_scale=auto" if auto else "")
        return _Case(
            name + (" into out=" if into else ""),
            run, run_reference, (pb + db) // p, pools[src.name], (src, dst),
        )

    def encode(dst) -> _Case:
        return _Case(
            f"encode bf16 latents -> {dst.name}",
            lambda n: api.encode(latents[:n], dst, page_size=p),
            lambda n: reference.encode_pages(x32[:n], dst, p, dst.default_dialect, 1.0),
            2 * 512 + dst.page_bytes(p) // p, latents, (dst,),
        )

    def decode(src) -> _Case:
        return _Case(
            f"decode {src.name} -> fp32 latents",
            lambda n: api.decode(head(src.name, n), src, page_size=p, num_tokens=n),
            lambda n: reference.decode_pages(head(src.name, n), src, p, n, 1.0),
            src.page_bytes(p) // p + 4 * 512, pools[src.name], (src,),
        )

    def repage(src, dst, dst_p: int) -> _Case:
        return _Case(
            f"repage {src.name} P={p} -> {dst.name} P={dst_p}",
            lambda n: api.transcode(head(src.name, n), src, dst, src_page_size=p, dst_page_size=dst_p, num_tokens=n),
            lambda n: reference.repage(head(src.name, n), src, p, dst, dst_p, n),
            (src.page_bytes(p) // p) + dst.record_bytes, pools[src.name], (src, dst),
        )

    return [
        transcode(fp8, model1), transcode(fp8, model1, into=True), transcode(model1, fp8),
        transcode(model1, fp8, into=True), transcode(model1, fp8, into=True, auto=True), transcode(bf16, model1),
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


def run_case(case: _Case, tokens: int, reference_tokens: int, repeat: int, device: torch.device) -> CaseResult:
    """Time one case: kvbridge on ``tokens`` tokens, the reference on ``reference_tokens``, a copy."""
    start = time.perf_counter()
    case.run(tokens)
    _sync(device)
    first = time.perf_counter() - start
    copy_src, copy_dst = _copy_buffers(case.bytes_per_token * tokens, device)
    t_fast, t_copy = _timed_rounds([lambda: case.run(tokens), lambda: copy_dst.copy_(copy_src)], repeat, device)
    n_ref = min(tokens, reference_tokens)
    want = case.run_reference(n_ref)
    exact = _equal(case.run(n_ref), want)
    (t_ref,) = _timed_rounds([lambda: case.run_reference(n_ref)], min(repeat, 3), device)
    return CaseResult(
        case=case.name, device=str(device), backend=fastpath.backend_name(case.probe, *case.layouts),
        kvbridge=Timing.of(tokens, t_fast, case.bytes_per_token * tokens),
        reference=Timing.of(n_ref, t_ref, case.bytes_per_token * n_ref),
        copy=Timing.of(tokens, t_copy, 2 * copy_src.numel()),
        first_call_s=first, exact=exact,
        vs_copy=statistics.median(c / f for f, c in zip(t_fast, t_copy, strict=True)),
    )


def available_devices() -> list[str]:
    return ["cpu", "cuda"] if torch.cuda.is_available() else ["cpu"]


def run_bench(
    tokens: int = 65536,
    devices: list[str] | None = None,
    repeat: int = 5,
    reference_tokens: int = 4096,
    seed: int = 0,
) -> list[CaseResult]:
    """Run every case on each device (default: CPU, plus CUDA when present)."""
    results = []
    for name in devices or available_devices():
        device = torch.device(name)
        gen = torch.Generator().manual_seed(seed)
        latents = (torch.randn(tokens, 512, generator=gen) * 2).to(torch.bfloat16).to(device)
        for case in _cases(latents):
            results.append(run_case(case, tokens, reference_tokens, repeat, device))
    return results


def cpu_target(results: list[CaseResult]) -> dict | None:
    """Issue 3's CPU target for the TensorRT-LLM FP8 -> MODEL1 transcode, or None if not measured."""
    for r in results:
        if r.case == TARGET_CASE and r.device == "cpu":
            met = r.kvbridge.tokens >= TARGET_MIN_TOKENS and r.vs_copy >= TARGET_VS_COPY and \
                r.vs_reference >= TARGET_VS_REFERENCE
            return {
                "case": r.case, "tokens": r.kvbridge.tokens, "vs_copy": r.vs_copy, "vs_reference": r.vs_reference,
                "required": {
                    "tokens": TARGET_MIN_TOKENS, "vs_copy": TARGET_VS_COPY, "vs_reference": TARGET_VS_REFERENCE,
                },
                "met": met,
            }
    return None
