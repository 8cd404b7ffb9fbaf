"""Write ``fixtures/flashinfer_nvfp4_global_scale_derived.safetensors``: ``flashinfer-nvfp4`` pages at the
per-tensor global scales g = 0.125 and g = 0.37, made by kvbridge's reference codec (derived, not a writer's
output: FlashInfer's NVFP4 quantizer is CUDA-only, SM100+, and no run of it on a CPU is available).

Inputs, per g and page size P in {3, 64}: the existing derived fixture's ``pP.input`` (fixtures/README.md)
times g (fp32 products), then five tokens of 126 nope tiles, one per nonzero E4M3 scale s: amax fp32(6 * sg)
and the E2M1 ties +-fp32(t * sg), t = 0.25, 0.75, ..., 5, where sg = fp32(s * g). Keys ``g<g>.p<P>.input``
and ``g<g>.p<P>.pages``; metadata ``derived`` and ``cases`` (JSON: input, pages, layout, page_size, scale).

    PYTHONPATH=. python3 scripts/make_nvfp4_global_scale_fixture.py
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from kvbridge import numerics as nx
from kvbridge.backends import reference
from kvbridge.layouts import get_layout

ROOT = Path(__file__).resolve().parent.parent / "fixtures"
SOURCE = ROOT / "flashinfer_nvfp4_reference.safetensors"
OUT = ROOT / "flashinfer_nvfp4_global_scale_derived.safetensors"
SCALES = (0.125, 0.37)
PAGE_SIZES = (3, 64)
TIES = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)


def tie_tokens(g: float) -> torch.Tensor:
    """fp32 ``[5, 512]``: 126 tiles of 16 (one per nonzero E4M3 scale s) with amax 6 * sg and every E2M1 tie
    +-t * sg (sg = fp32(s * g)), then zeros; the rope dims hold 1.0."""
    sg = nx.E4M3_TABLE[1:0x7F] * torch.tensor(g, dtype=torch.float32)
    ties = torch.tensor(TIES, dtype=torch.float32)
    tiles = torch.cat([(6.0 * sg)[:, None], ties[None, :] * sg[:, None], -ties[None, :] * sg[:, None],
                       torch.zeros(126, 1)], dim=1)  # [126, 16]
    nope = torch.zeros(5 * 28, 16)
    nope[:126] = tiles
    x = torch.ones(5, 512)
    x[:, :448] = nope.reshape(5, 448)
    return x


def main() -> None:
    src = load_file(str(SOURCE))
    lay = get_layout("flashinfer-nvfp4")
    tensors: dict[str, torch.Tensor] = {}
    cases = []
    for g in SCALES:
        for p in PAGE_SIZES:
            x = torch.cat([src[f"p{p}.input"] * torch.tensor(g, dtype=torch.float32), tie_tokens(g)])
            key = f"g{g}.p{p}"
            tensors[f"{key}.input"] = x.contiguous()
            tensors[f"{key}.pages"] = reference.encode_pages(x, lay, p, None, g).contiguous()
            cases.append({"input": f"{key}.input", "pages": f"{key}.pages", "layout": lay.name, "page_size": p,
                          "scale": g})
    meta = {"derived": "true", "writer": "kvbridge reference codec (kvbridge.layouts.codec), derived: no run of "
            "FlashInfer's CUDA-only NVFP4 quantizer is available on CPU", "cases": json.dumps(cases)}
    save_file(tensors, str(OUT), metadata=meta)
    print(f"wrote {OUT} ({len(cases)} cases)")


if __name__ == "__main__":
    main()
