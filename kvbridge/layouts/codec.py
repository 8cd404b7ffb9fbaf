"""The reference record codec (readable torch): fp32 latents <-> token records (uint8).

One codec serves every layout: it executes the layout's compiled record description
(``Layout.segments``), field by field. It turns ``[N, 512]`` fp32 values into
``[N, record_bytes]`` bytes and back; paging (where each record byte lands in a page) is the
layout geometry's job. Every fast path (native CPU, Triton) is tested byte-for-byte against it.
"""

from __future__ import annotations

import functools

import torch

from kvbridge import numerics as nx
from kvbridge.layouts.registry import (
    HEAD_DIM,
    OP_BF16,
    OP_E2M1_E4M3,
    OP_E2M1_NVFP4,
    OP_E2M1_NVFP4Z,
    OP_E2M1_UE8M0,
    OP_E4M3_TENSOR,
    OP_E4M3_UE8M0,
    OP_E4M3FNUZ_UE8M0,
    OP_ROUND_BF16,
    OP_ZERO,
    Layout,
)

__all__ = [
    "HEAD_DIM", "NOPE_DIM", "NUM_TILES", "ROPE_DIM", "RecordCodec",
    "reciprocal_f32", "record_codec", "tensor_multiplier",
]

NOPE_DIM = 448
ROPE_DIM = 64
#: MODEL1's nope tiles of 64 values (the accuracy study's unit).
NUM_TILES = NOPE_DIM // 64


def reciprocal_f32(scale: float) -> torch.Tensor:
    """fp32(1 / fp32(scale)), the multiplier TensorRT-LLM's SWA writer applies."""
    s = torch.tensor(scale, dtype=torch.float32)
    return torch.tensor(1.0, dtype=torch.float32) / s


def tensor_multiplier(dialect: str | None, scale: float) -> float:
    """What a per-tensor E4M3 writer multiplies by: fp32(1/s) (``swa``), or 1 (``compress``, which ignores s)."""
    return 1.0 if dialect == "compress" else float(reciprocal_f32(scale))


def ue8m0_dialect(dialect: str | None) -> str:
    """The UE8M0 scale rule a dialect names (``flashmla`` when None)."""
    return dialect if dialect in nx.DIALECT_MIN_EXPONENT else "flashmla"


def fnuz_dialect(dialect: str | None) -> str:
    """The FNUZ UE8M0 scale rule a dialect names (``amax-1e-4/224``, vLLM's ROCm writer, when None)."""
    return dialect if dialect in nx.FNUZ_DIALECTS else nx.FNUZ_DIALECTS[0]


@functools.cache
def record_codec(layout: Layout) -> RecordCodec:
    """The reference record codec of ``layout`` (one per layout, built on first use)."""
    return RecordCodec(layout)


class RecordCodec:
    """Encodes fp32 ``[N, 512]`` into records ``[N, record_bytes]`` of ``layout`` and decodes them back.

    Per field (``Segment``): bf16 is rounded to nearest even; per-tensor E4M3 is
    ``e4m3(x * m)`` with ``m = tensor_multiplier(dialect, scale)``, decoded ``e4m3 * scale``;
    UE8M0-scaled E4M3 tiles get scale 2^k with k from the dialect's rule
    (``numerics.scale_exponent``) and value bytes ``e4m3(x / 2^k)`` (exact division); a tile holding
    NaN or Inf (``nonfinite="propagate"``, dialects ``numerics.UE8M0_NONFINITE_DIALECTS``) gets the
    scale byte 0xFF and ``numerics.e4m3_nonfinite_tile_codes``; FNUZ tiles
    likewise with ``numerics.fnuz_scale_exponent`` and ``e4m3fnuz``;
    E4M3-scaled E2M1 tiles get ``numerics.fp4_tile_scale`` and codes of ``x / scale``; NVFP4 tiles
    ``numerics.nvfp4_tile_scale`` and codes of ``x * fp32(1 / fp32(scale * g))`` (``nvfp4_encode_tiles``; vLLM's
    rule, ``OP_E2M1_NVFP4Z``, multiplies a scale-0 tile by 0),
    decoded ``fp32(e2m1 * scale) * g``, where g is the per-tensor global scale (``scale``; 1 by default);
    UE8M0-scaled E2M1 (MXFP4) tiles ``numerics.mxfp4_scale_byte`` and codes of ``x / 2^k``.
    Pad bytes are 0. ``OP_ROUND_BF16`` rounds dims to bf16 before the fields after it (a mirror field is
    encoded from its bf16 first copy); decoding runs the read program (``Layout.read_segments``).
    """

    def __init__(self, layout: Layout):
        self.layout = layout
        self.record_bytes = layout.record_bytes

    def encode(self, x: torch.Tensor, *, dialect: str | None, scale: float, propagate: bool = False) -> torch.Tensor:
        """Records of ``x``; ``propagate``: tiles holding NaN/Inf as the writers store them (``nonfinite=
        "propagate"``, checked by ``ops.pages``); without it NaN/Inf run through the finite rules, as in the
        fast kernels (the public API refuses or replaces them before)."""
        n = x.shape[0]
        rec = torch.zeros(n, self.record_bytes, dtype=torch.uint8, device=x.device)
        for op, d0, nd, off, tile, soff in self.layout.segments:
            if op == OP_ZERO:
                continue
            if op == OP_ROUND_BF16:
                x = x.clone()
                x[:, d0 : d0 + nd] = nx.bf16_from_bytes(nx.bf16_bytes(x[:, d0 : d0 + nd]))  # as the bf16 field
                continue
            v = x[:, d0 : d0 + nd]
            if op == OP_BF16:
                rec[:, off : off + 2 * nd] = nx.bf16_bytes(v)
            elif op == OP_E4M3_TENSOR:
                m = torch.tensor(tensor_multiplier(dialect, scale), dtype=torch.float32, device=x.device)
                rec[:, off : off + nd] = nx.e4m3_encode(v if dialect == "compress" else v * m)
            elif op in (OP_E4M3_UE8M0, OP_E4M3FNUZ_UE8M0):
                tiles = v.reshape(n, nd // tile, tile)
                amax = tiles.abs().amax(dim=-1)  # NaN when the tile holds one, else +Inf when it holds +-Inf
                bad = ~torch.isfinite(amax) if propagate else None
                if bad is not None:
                    amax = torch.where(bad, torch.zeros_like(amax), amax)
                fnuz = op == OP_E4M3FNUZ_UE8M0
                exp = nx.fnuz_scale_exponent(amax, fnuz_dialect(dialect)) if fnuz else \
                    nx.scale_exponent(amax, ue8m0_dialect(dialect))
                encode = nx.e4m3fnuz_encode if fnuz else nx.e4m3_encode
                codes = encode(tiles * nx.pow2(-exp).unsqueeze(-1))
                scale_bytes = nx.ue8m0_byte(exp)
                if bad is not None and bool(bad.any()):  # ops.pages has checked the dialect's rule
                    codes = torch.where(bad.unsqueeze(-1), nx.e4m3_nonfinite_tile_codes(tiles), codes)
                    scale_bytes = torch.where(bad, torch.full_like(scale_bytes, nx.UE8M0_NAN), scale_bytes)
                rec[:, off : off + nd] = codes.reshape(n, nd)
                rec[:, soff : soff + nd // tile] = scale_bytes
            elif op == OP_E2M1_E4M3:
                tiles = v.reshape(n, nd // tile, tile)
                amax = nx.fp4_tile_amax(tiles) if propagate else tiles.abs().amax(dim=-1)
                scale_bytes = nx.fp4_tile_scale(amax)
                codes = nx.fp4_encode_tiles(tiles, scale_bytes)
                if propagate:  # x / NaN is CUDA's canonical NaN (sign +): code 0 in a NaN-scaled tile
                    nan_scale = torch.isnan(nx.e4m3_decode(scale_bytes)).unsqueeze(-1)
                    codes = torch.where(nan_scale, torch.zeros_like(codes), codes)
                rec[:, off : off + nd // 2] = nx.e2m1_pack(codes.reshape(n, nd))
                rec[:, soff : soff + nd // tile] = scale_bytes
            elif op in (OP_E2M1_NVFP4, OP_E2M1_NVFP4Z):
                tiles = v.reshape(n, nd // tile, tile)
                scale_bytes = nx.nvfp4_tile_scale(tiles.abs().amax(dim=-1), scale)  # scale: the global scale g
                codes = nx.nvfp4_encode_tiles(tiles, scale_bytes, scale, zero_scale_zero=op == OP_E2M1_NVFP4Z)
                codes = codes.reshape(n, nd)
                rec[:, off : off + nd // 2] = nx.e2m1_pack(codes)
                rec[:, soff : soff + nd // tile] = scale_bytes
            elif op == OP_E2M1_UE8M0:
                tiles = v.reshape(n, nd // tile, tile)
                scale_bytes = nx.mxfp4_scale_byte(tiles.abs().amax(dim=-1))
                rec[:, off : off + nd // 2] = nx.e2m1_pack(nx.mxfp4_encode_tiles(tiles, scale_bytes).reshape(n, nd))
                rec[:, soff : soff + nd // tile] = scale_bytes
        return rec

    def decode(self, records: torch.Tensor, *, scale: float) -> torch.Tensor:
        n = records.shape[0]
        out = torch.empty(n, HEAD_DIM, dtype=torch.float32, device=records.device)
        for op, d0, nd, off, tile, soff in self.layout.read_segments:
            if op == OP_BF16:
                out[:, d0 : d0 + nd] = nx.bf16_from_bytes(records[:, off : off + 2 * nd])
            elif op == OP_E4M3_TENSOR:
                s = torch.tensor(scale, dtype=torch.float32, device=records.device)
                out[:, d0 : d0 + nd] = nx.e4m3_decode(records[:, off : off + nd]) * s
            elif op in (OP_E4M3_UE8M0, OP_E4M3FNUZ_UE8M0):
                decode = nx.e4m3fnuz_decode if op == OP_E4M3FNUZ_UE8M0 else nx.e4m3_decode
                values = decode(records[:, off : off + nd]).reshape(n, nd // tile, tile)
                tile_scale = nx.ue8m0_decode(records[:, soff : soff + nd // tile])
                out[:, d0 : d0 + nd] = (values * tile_scale.unsqueeze(-1)).reshape(n, nd)
            elif op in (OP_E2M1_NVFP4, OP_E2M1_NVFP4Z):
                codes = nx.e2m1_unpack(records[:, off : off + nd // 2]).reshape(n, nd // tile, tile)
                values = nx.nvfp4_decode_tiles(codes, records[:, soff : soff + nd // tile], scale)
                out[:, d0 : d0 + nd] = values.reshape(n, nd)
            elif op in (OP_E2M1_E4M3, OP_E2M1_UE8M0):
                values = nx.e2m1_decode(nx.e2m1_unpack(records[:, off : off + nd // 2])).reshape(n, nd // tile, tile)
                scale_bytes = records[:, soff : soff + nd // tile]
                tile_scale = nx.ue8m0_decode(scale_bytes) if op == OP_E2M1_UE8M0 else nx.e4m3_decode(scale_bytes)
                out[:, d0 : d0 + nd] = (values * tile_scale.unsqueeze(-1)).reshape(n, nd)
        return out
