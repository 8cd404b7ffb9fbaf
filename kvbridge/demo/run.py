"""``kvbridge demo``: a synthetic DeepSeek-V4 request moved from TensorRT-LLM FP8 to MODEL1 and back.

The request covers the first layers of DeepSeek-V4-Flash (compress ratios 0, 0, 4, 128; spec
section 5): every layer has an SWA pool (the in-window tail blocks of the last 128 tokens), the
ratio-4 and ratio-128 layers a COMPRESS pool of ``tokens // r`` compressed tokens. TensorRT-LLM's
pages hold ``tokens_per_block = 128`` tokens (compressed pools ``128 / r``).

``run_demo`` runs ``SECTIONS`` in order over one ``DemoContext``; each section returns its part
of the summary and records pass/fail checks. A new section is one function appended to ``SECTIONS``.
"""

from __future__ import annotations

import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

from kvbridge.backends import reference
from kvbridge.demo.context import DemoContext
from kvbridge.demo.decode import decode_section
from kvbridge.dumps.convert import convert_dump
from kvbridge.dumps.dumpfile import DumpEntry, read_dump
from kvbridge.dumps.writer import write_dump
from kvbridge.errors import InputError
from kvbridge.layouts import get_layout
from kvbridge.ops.pages import encode
from kvbridge.study import synthetic

#: DeepSeek-V4-Flash compress ratios of the layers the demo builds (0: SWA only).
DEMO_COMPRESS_RATIOS = (0, 0, 4, 128)
SLIDING_WINDOW = 128  # tokens
TOKENS_PER_BLOCK = 128  # TensorRT-LLM block size
SOURCE_LAYOUT = "trtllm-fp8"
TARGET_LAYOUT = "flashmla-model1"
TARGET_DIALECT = "flashmla"


def swa_window_start(tokens: int) -> int:
    """First token of the SWA pool: the start of the block holding token ``tokens - 128``."""
    return max(0, tokens - SLIDING_WINDOW) // TOKENS_PER_BLOCK * TOKENS_PER_BLOCK


def build_request(ctx: DemoContext) -> dict:
    """Synthesize the request's latents and write them as a TensorRT-LLM FP8 dump (scale 1)."""
    entries = []
    start = swa_window_start(ctx.tokens)
    for layer, ratio in enumerate(DEMO_COMPRESS_RATIOS):
        seed = ctx.seed * 100 + layer
        full = synthetic.latents(ctx.tokens, seed=seed, layer="swa")
        swa = full[start:]
        # TensorRT-LLM's SWA writer quantizes bf16 rows: e4m3(float(bf16 x) * fp32(1/s)).
        pages = encode(swa.bfloat16(), SOURCE_LAYOUT, page_size=TOKENS_PER_BLOCK, dialect="swa")
        entries.append(DumpEntry(layer, "swa", pages, SOURCE_LAYOUT, TOKENS_PER_BLOCK, swa.shape[0], 1.0, "swa", ratio))
        ctx.latents[entries[-1].name] = swa.bfloat16().float()
        if ratio:
            comp = synthetic.latents(ctx.tokens // ratio, seed=seed + 50, layer="compressed", compress_ratio=ratio)
            p = TOKENS_PER_BLOCK // ratio
            # The COMPRESS writer quantizes fp32 values at scale 1.
            pages = encode(comp, SOURCE_LAYOUT, page_size=p, dialect="compress")
            entries.append(DumpEntry(layer, "compress", pages, SOURCE_LAYOUT, p, comp.shape[0], 1.0, "compress", ratio))
            ctx.latents[entries[-1].name] = comp
    ctx.source_path = ctx.workdir / "request.trtllm-fp8.safetensors"
    attrs = {"model": "synthetic DeepSeek-V4-Flash", "request_tokens": str(ctx.tokens), "swa_first_token": str(start)}
    write_dump(ctx.source_path, entries, overwrite=True, attrs=attrs)
    return {
        "file": str(ctx.source_path),
        "file_bytes": ctx.source_path.stat().st_size,
        "entries": [
            {k: e.metadata()[k] for k in ("name", "page_size", "num_tokens", "dialect")} | {"pages": e.num_pages}
            for e in entries
        ],
    }


def convert_to_model1(ctx: DemoContext) -> dict:
    """Convert the dump to MODEL1 (same page sizes) through ``convert_dump``, as ``kvbridge convert`` does."""
    ctx.target_path = ctx.workdir / "request.model1.safetensors"
    converted = convert_dump(ctx.source_path, ctx.target_path, TARGET_LAYOUT, dialect=TARGET_DIALECT, overwrite=True)
    for c in converted:
        ctx.check(
            f"{c.name}: trtllm-fp8 -> MODEL1 lossless", c.report.lossless, f"max abs error {c.report.max_abs_error}"
        )
    return {
        "file": str(ctx.target_path),
        "file_bytes": ctx.target_path.stat().st_size,
        "max_abs_error": max(c.report.max_abs_error for c in converted),
        "lossless": all(c.report.lossless for c in converted),
    }


def verify_against_reference(ctx: DemoContext) -> dict:
    """Each MODEL1 entry equals the reference codecs' bytes for the decoded source, byte for byte."""
    src, dst = read_dump(ctx.source_path), read_dump(ctx.target_path)
    fp8, model1 = get_layout(SOURCE_LAYOUT), get_layout(TARGET_LAYOUT)
    worst = 0.0
    for s, d in zip(src, dst, strict=True):
        values = reference.decode_pages(s.data, fp8, s.page_size, s.num_tokens, s.scale)
        want = reference.encode_pages(values, model1, d.page_size, TARGET_DIALECT, 1.0)
        ctx.check(f"{d.name}: MODEL1 bytes == reference codec", torch.equal(d.data, want), f"{want.numel()} bytes")
        worst = max(worst, float((values - ctx.latents[s.name]).abs().max()))
    return {"entries_checked": len(dst), "fp8_max_abs_error_vs_latents": worst}


def round_trip(ctx: DemoContext) -> dict:
    """MODEL1 -> trtllm-fp8 (scale 1) gives back the original TensorRT-LLM pages exactly."""
    back_path = ctx.workdir / "request.roundtrip.trtllm-fp8.safetensors"
    convert_dump(ctx.target_path, back_path, SOURCE_LAYOUT, scale=1.0, overwrite=True)
    src, back = read_dump(ctx.source_path), read_dump(back_path)
    for s, b in zip(src, back, strict=True):
        ctx.check(f"{s.name}: round trip bytes equal", torch.equal(s.data, b.data), f"{s.data.numel()} bytes")
    return {"file": str(back_path)}


#: The demo's steps, in order: (summary key, section). Each returns a JSON-serialisable dict.
SECTIONS: list[tuple[str, Callable[[DemoContext], dict]]] = [
    ("request", build_request),
    ("convert", convert_to_model1),
    ("verify", verify_against_reference),
    ("round_trip", round_trip),
    ("decode", decode_section),
]


def run_demo(tokens: int = 4096, workdir: str | Path | None = None, seed: int = 0) -> dict:
    """Run every demo section; return the summary (``ok`` is True when every check passed).

    ``workdir`` keeps the dump files (default: a temporary directory removed afterwards).
    """
    if isinstance(tokens, bool) or not isinstance(tokens, int) or tokens < SLIDING_WINDOW:
        raise InputError(f"tokens must be an integer >= {SLIDING_WINDOW}, got {tokens!r}")
    with tempfile.TemporaryDirectory(prefix="kvbridge-demo-") as tmp:
        root = Path(tmp) if workdir is None else Path(workdir)
        if workdir is not None:
            root.mkdir(parents=True, exist_ok=True)
        ctx = DemoContext(tokens=tokens, workdir=root, seed=seed)
        summary: dict = {"tokens": tokens, "layers": list(DEMO_COMPRESS_RATIOS), "workdir": str(root)}
        summary["kept_files"] = workdir is not None
        seconds = {}
        for name, section in SECTIONS:
            t0 = time.perf_counter()
            summary[name] = section(ctx)
            seconds[name] = round(time.perf_counter() - t0, 3)
        summary["seconds"] = seconds
        summary["checks"] = ctx.checks
        summary["ok"] = bool(ctx.checks) and all(c["passed"] for c in ctx.checks)
    return summary
