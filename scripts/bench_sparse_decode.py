"""Benchmark: the reference backend of ``sparse_decode`` (touched tokens only) against decoding the whole pool.

Baseline, timed in the same run: ``kvbridge.decode`` of every token of the pool, then the same fp32
attention over the indexed tokens. Prints best-of-``--repeat`` times and their ratio per layout.

    python3 scripts/bench_sparse_decode.py [--tokens 65536] [--topk 2048] [--repeat 2]
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch

import kvbridge
from kvbridge.study import synthetic

PAGE_SIZE = 128
BATCH, HEADS = 4, 64


def best_time(fn: Callable[[], object], repeat: int) -> float:
    """Fastest of ``repeat`` timed calls after one warm-up call, in seconds."""
    fn()
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=65536)
    parser.add_argument("--topk", type=int, default=2048)
    parser.add_argument("--repeat", type=int, default=2)
    opts = parser.parse_args()
    x = synthetic.latents(opts.tokens, seed=1)
    q = synthetic.queries(x[:4096], batch=BATCH, s_q=1, heads=HEADS, seed=2).to(torch.bfloat16)
    idx = torch.randint(0, opts.tokens, (BATCH, 1, opts.topk), dtype=torch.int32,
                        generator=torch.Generator().manual_seed(3))
    for layout in ("trtllm-fp8", "flashmla-model1"):
        pages = kvbridge.encode(x, layout, page_size=PAGE_SIZE)

        def touched(pages=pages, layout=layout) -> torch.Tensor:
            return kvbridge.sparse_decode(q, pages, idx, layout=layout, page_size=PAGE_SIZE, backend="reference")[0]

        def whole_pool(pages=pages, layout=layout) -> torch.Tensor:
            k = kvbridge.decode(pages, layout, page_size=PAGE_SIZE)[idx.long()]  # (b, s_q, topk, 512)
            logits = torch.einsum("bshd,bskd->bshk", q.float(), k) * 512**-0.5
            lse = torch.logsumexp(logits, dim=-1)
            return torch.einsum("bshk,bskd->bshd", torch.exp(logits - lse[..., None]), k).to(torch.bfloat16)

        fast, base = best_time(touched, opts.repeat), best_time(whole_pool, opts.repeat)
        diff = float((touched().float() - whole_pool().float()).abs().max())
        print(f"{layout}: touched-only {fast * 1e3:.0f} ms, whole-pool baseline {base * 1e3:.0f} ms, "
              f"ratio {base / fast:.1f}x, max |out difference| {diff}")


if __name__ == "__main__":
    main()
