"""GPU check for issue 5: the ``flashmla`` backend of ``sparse_decode`` against the ``reference`` backend.

Needs a CUDA device and an importable ``flash_mla`` (``sgl-flash-mla`` with its legacy kernels, or an
older FlashMLA build that reads the 584-byte MODEL1 cache). Runs FlashMLA's reference vectors
(``fixtures/model1_decode_reference.safetensors``) and random pools in every registered layout
(MODEL1 zero-copy, the others gather-transcoded), compares with FlashMLA's tolerances and prints
one line per case. Exit status 0 when every case passes, 1 otherwise, 2 when it cannot run.

    python3 scripts/gpu_check_sparse_decode.py
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import load_file

import kvbridge
from kvbridge.attention.flashmla import BackendUnavailable, import_build
from kvbridge.attention.sparse import LSE_TOLERANCE, OUT_TOLERANCE, compare

FIXTURE = Path(__file__).resolve().parent.parent / "fixtures" / "model1_decode_reference.safetensors"


def check(name: str, kwargs: dict) -> bool:
    """Decode with both backends; print and return whether out and lse agree within FlashMLA's tolerances."""
    ref_out, ref_lse = kvbridge.sparse_decode(**kwargs, backend="reference")
    out, lse = kvbridge.sparse_decode(**kwargs, backend="flashmla")
    c_out, c_lse = compare(out, ref_out, OUT_TOLERANCE), compare(lse, ref_lse, LSE_TOLERANCE)
    ok = c_out.passed and c_lse.passed
    print(f"{'PASS' if ok else 'FAIL'} {name}: out [{c_out.detail}] lse [{c_lse.detail}]")
    return ok


def fixture_cases(device: torch.device) -> list[tuple[str, dict]]:
    with safe_open(str(FIXTURE), "pt") as handle:
        cases = json.loads(handle.metadata()["cases"])
    tensors = {k: v.to(device) for k, v in load_file(str(FIXTURE)).items()}
    out = []
    for name, meta in cases.items():
        def get(key: str, case: str = name):
            return tensors.get(f"{case}.{key}")

        out.append((f"fixture {name}", dict(
            q=get("q"), k_cache=get("k_cache"), indices=get("indices"), layout="flashmla-model1",
            page_size=meta["page_size"], extra_k_cache=get("extra_k_cache"), extra_indices=get("extra_indices"),
            extra_page_size=meta["extra_page_size"], topk_length=get("topk_length"),
            extra_topk_length=get("extra_topk_length"), attn_sink=get("attn_sink"), softmax_scale=meta["sm_scale"],
        )))
    return out


def random_cases(device: torch.device) -> list[tuple[str, dict]]:
    gen = torch.Generator().manual_seed(0)
    b, s_q, h_q, tokens, topk = 4, 2, 64, 2048, 256
    x = torch.randn(tokens, 512, generator=gen) * 0.5
    cx = torch.randn(512, 512, generator=gen) * 0.5
    q = (torch.randn(b, s_q, h_q, 512, generator=gen) * 0.3).to(torch.bfloat16).to(device)
    idx = torch.randint(-1, tokens, (b, s_q, topk), generator=gen, dtype=torch.int32).to(device)
    cidx = torch.randint(-1, 512, (b, s_q, 128), generator=gen, dtype=torch.int32).to(device)
    lengths = torch.randint(1, topk + 1, (b,), generator=gen, dtype=torch.int32).to(device)
    sink = torch.randn(h_q, generator=gen)
    sink[0], sink[1] = math.inf, -math.inf
    sink = sink.to(device)
    out = []
    for layout, page_size, extra_page_size, scale in (
        ("flashmla-model1", 64, 2, None), ("flashmla-model1", 256, 64, None), ("trtllm-fp8", 128, 32, 1.0),
        ("trtllm-fp8", 256, 64, 0.0625), ("trtllm-fp8-ds-mla", 64, 16, None), ("bf16", 64, 2, None),
    ):
        enc = {} if scale is None else {"scale": scale}
        pool = kvbridge.encode(x, layout, page_size=page_size, **enc).to(device)
        extra = kvbridge.encode(cx, layout, page_size=extra_page_size, **enc).to(device)
        out.append((f"random {layout} P={page_size}/{extra_page_size}", dict(
            q=q, k_cache=pool, indices=idx, layout=layout, page_size=page_size, scale=scale,
            extra_k_cache=extra, extra_indices=cidx, extra_page_size=extra_page_size, extra_scale=scale,
            topk_length=lengths, attn_sink=sink,
        )))
        out.append((f"random {layout} P={page_size} 8 heads, no extra", dict(
            q=q[:, :, :8].contiguous(), k_cache=pool, indices=idx, layout=layout, page_size=page_size, scale=scale,
        )))
    return out


def main() -> int:
    if not torch.cuda.is_available():
        print("no CUDA device: nothing to check")
        return 2
    try:
        build = import_build()
    except BackendUnavailable as err:
        print(err)
        return 2
    print(f"flash_mla build: split_legacy={build.split_legacy} has_legacy={build.has_legacy} "
          f"takes_format={build.takes_format} problem={build.problem}")
    if build.problem is not None:
        return 2
    device = torch.device("cuda")
    results = [check(name, kwargs) for name, kwargs in fixture_cases(device) + random_cases(device)]
    print(f"{sum(results)} passed, {len(results) - sum(results)} failed")
    return 0 if all(results) else 1


if __name__ == "__main__":
    sys.exit(main())
