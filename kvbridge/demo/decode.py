"""The decode section of ``kvbridge demo``: FlashMLA sparse decode over the request's pools.

For one SWA-only layer and one C4 (ratio 4) layer of the demo request, DeepSeek-V4-Flash-shaped
queries (64 heads, one decode token) attend to the last 128 tokens of the SWA pool and, on the C4
layer, jointly to the top-512 compressed tokens (``extra_k_cache``). The same decode runs four
times through ``sparse_decode``: on the TensorRT-LLM FP8 pools as written, on the MODEL1 pools
``kvbridge convert`` made from them, on MODEL1 pools written straight from the latents (as an
SGLang or vLLM engine would), and on the unquantized latents stored as BF16; the section reports
the attention-output error of each FP8 variant against BF16.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvbridge.attention.sparse import OUT_TOLERANCE, compare, sparse_decode
from kvbridge.demo.context import DemoContext
from kvbridge.dumps.dumpfile import entry_name, read_dump
from kvbridge.ops.pages import encode
from kvbridge.study import synthetic

DECODE_LAYERS = (0, 2)  # layer 0: SWA only; layer 2: compress ratio 4 (CSA)
QUERY_HEADS = 64  # DeepSeek-V4-Flash
WINDOW = 128  # sliding window, tokens
COMPRESSED_TOPK = 512  # DeepSeek-V4's indexer top-k
BATCH = 2


def output_errors(out: torch.Tensor, ref: torch.Tensor) -> tuple[float, float]:
    """(relative L2 error |out - ref| / |ref|, max abs error) of an attention output, fp32, 4 significant digits."""
    diff = out.float() - ref.float()
    rel_l2 = float(diff.norm() / ref.float().norm().clamp_min(1e-30))
    return float(f"{rel_l2:.4g}"), float(f"{float(diff.abs().max()):.4g}")


@dataclass(frozen=True)
class Pool:
    """One KV pool as ``sparse_decode`` takes it: pages, layout, tokens per page, per-tensor scale."""

    pages: torch.Tensor
    layout: str
    page_size: int
    scale: float | None = None


def decode_pools(q: torch.Tensor, pools: list[Pool], swa_idx: torch.Tensor, comp_idx: torch.Tensor | None) -> tuple:
    """``sparse_decode`` over the SWA pool (``pools[0]``) and, with ``comp_idx``, the compressed one."""
    swa = pools[0]
    extra = {}
    if comp_idx is not None:
        comp = pools[1]
        extra = dict(extra_k_cache=comp.pages, extra_indices=comp_idx, extra_layout=comp.layout,
                     extra_page_size=comp.page_size, extra_scale=comp.scale)
    return sparse_decode(q, swa.pages, swa_idx, layout=swa.layout, page_size=swa.page_size,
                                  scale=swa.scale, **extra)


def decode_section(ctx: DemoContext) -> dict:
    """Decode each layer of ``DECODE_LAYERS`` from TensorRT-LLM FP8, converted and native MODEL1, and BF16 pools."""
    source, target = read_dump(ctx.source_path), read_dump(ctx.target_path)
    summary: dict = {
        "query": f"b={BATCH}, s_q=1, h_q={QUERY_HEADS}; SWA window {WINDOW}, C4 extra top-{COMPRESSED_TOPK}"
    }
    for layer in DECODE_LAYERS:
        roles = ["swa"] + (["compress"] if entry_name(layer, "compress") in source.names else [])
        keys = [ctx.latents[entry_name(layer, role)] for role in roles]
        n_swa = keys[0].shape[0]
        window = min(WINDOW, n_swa)
        q = synthetic.queries(torch.cat(keys), batch=BATCH, s_q=1, heads=QUERY_HEADS, seed=ctx.seed * 100 + layer)
        q = q.to(torch.bfloat16)
        swa_idx = torch.arange(n_swa - window, n_swa, dtype=torch.int32).expand(BATCH, 1, window).contiguous()
        comp_idx = None
        if len(roles) == 2:
            comp_idx = synthetic.topk_indices(q.float(), keys[1], min(COMPRESSED_TOPK, keys[1].shape[0]))
        src = [source[entry_name(layer, role)] for role in roles]
        fp8 = [Pool(e.data, e.layout, e.page_size, e.scale) for e in src]
        model1 = [Pool(e.data, e.layout, e.page_size) for e in (target[entry_name(layer, role)] for role in roles)]
        bf16 = [Pool(encode(k, "bf16", page_size=e.page_size), "bf16", e.page_size)
                for k, e in zip(keys, src, strict=True)]
        native = [Pool(encode(k, "flashmla-model1", page_size=e.page_size), "flashmla-model1", e.page_size)
                  for k, e in zip(keys, src, strict=True)]
        out_fp8, lse_fp8 = decode_pools(q, fp8, swa_idx, comp_idx)
        out_m1, _ = decode_pools(q, model1, swa_idx, comp_idx)
        out_native, _ = decode_pools(q, native, swa_idx, comp_idx)
        out_bf16, _ = decode_pools(q, bf16, swa_idx, comp_idx)
        same = compare(out_fp8, out_m1, OUT_TOLERANCE)
        name = f"layer.{layer} ({'C4' if comp_idx is not None else 'SWA'})"
        ctx.check(f"{name}: decode of trtllm-fp8 pools == decode of MODEL1 pools", same.passed, same.detail)
        ctx.check(f"{name}: lse finite", bool(torch.isfinite(lse_fp8).all()), "every query row has valid slots")
        errors = {label: output_errors(out, out_bf16) for label, out in
                  (("trtllm-fp8", out_fp8), ("MODEL1 converted", out_m1), ("MODEL1 native", out_native))}
        summary[f"{name} out rel L2 vs BF16"] = {label: e[0] for label, e in errors.items()}
        summary[f"{name} out max abs vs BF16"] = {label: e[1] for label, e in errors.items()}
    return summary
