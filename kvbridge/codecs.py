"""Reference record codecs (readable torch): fp32 latents <-> token records (uint8).

A record codec turns ``[N, 512]`` fp32 values into ``[N, record_bytes]`` bytes and back.
Paging (where each record byte lands in a page) is the layout's job, not the codec's.
Every fast path (native CPU, Triton) is tested byte-for-byte against these.
"""

from __future__ import annotations

from typing import Protocol

import torch

from kvbridge import numerics as nx

HEAD_DIM = 512
NOPE_DIM = 448
ROPE_DIM = 64
TILE = 64
NUM_TILES = NOPE_DIM // TILE  # 7


class RecordCodec(Protocol):
    """Encodes fp32 ``[N, 512]`` into records ``[N, record_bytes]`` and decodes them back."""

    record_bytes: int

    def encode(self, x: torch.Tensor, *, dialect: str | None, scale: float) -> torch.Tensor: ...

    def decode(self, records: torch.Tensor, *, scale: float) -> torch.Tensor: ...


class BF16Codec:
    """512 little-endian bf16 values (1024 bytes); fp32 input is rounded to nearest even."""

    record_bytes = 2 * HEAD_DIM

    def encode(self, x: torch.Tensor, *, dialect: str | None, scale: float) -> torch.Tensor:
        return nx.bf16_bytes(x)

    def decode(self, records: torch.Tensor, *, scale: float) -> torch.Tensor:
        return nx.bf16_from_bytes(records)


def reciprocal_f32(scale: float) -> torch.Tensor:
    """fp32(1 / fp32(scale)), the multiplier TensorRT-LLM's SWA writer applies."""
    s = torch.tensor(scale, dtype=torch.float32)
    return torch.tensor(1.0, dtype=torch.float32) / s


class PerTensorE4M3Codec:
    """512 E4M3 bytes, byte i = element i, one per-tensor fp32 scale ``s`` kept outside.

    Dialects: ``swa`` writes e4m3(x * fp32(1/s)); ``compress`` writes e4m3(x), ignoring s
    (TensorRT-LLM's compressed-token writer). Decode is fp32(code) * s for both.
    """

    record_bytes = HEAD_DIM

    def encode(self, x: torch.Tensor, *, dialect: str | None, scale: float) -> torch.Tensor:
        if dialect == "compress":
            return nx.e4m3_encode(x)
        return nx.e4m3_encode(x * reciprocal_f32(scale).to(x.device))

    def decode(self, records: torch.Tensor, *, scale: float) -> torch.Tensor:
        return nx.e4m3_decode(records) * torch.tensor(scale, dtype=torch.float32, device=records.device)


class Model1Codec:
    """MODEL1 record (584 bytes): nope E4M3 [0, 448), rope bf16 [448, 576),
    7 UE8M0 tile scales [576, 583), pad byte 583 (written 0).

    Tile i (dims 64i..64i+63) gets scale 2^k with k from the dialect's rule
    (``numerics.scale_exponent``); value bytes are e4m3(x / 2^k), exact division.
    """

    record_bytes = 584

    def encode(self, x: torch.Tensor, *, dialect: str | None, scale: float) -> torch.Tensor:
        n = x.shape[0]
        nope = x[:, :NOPE_DIM].reshape(n, NUM_TILES, TILE)
        amax = nope.abs().amax(dim=-1)
        exp = nx.scale_exponent(amax, dialect or "flashmla")
        values = nx.e4m3_encode(nope * nx.pow2(-exp).unsqueeze(-1)).reshape(n, NOPE_DIM)
        rope = nx.bf16_bytes(x[:, NOPE_DIM:])
        scales = nx.ue8m0_byte(exp)
        pad = torch.zeros(n, 1, dtype=torch.uint8, device=x.device)
        return torch.cat([values, rope, scales, pad], dim=1)

    def decode(self, records: torch.Tensor, *, scale: float) -> torch.Tensor:
        n = records.shape[0]
        values = nx.e4m3_decode(records[:, :NOPE_DIM]).reshape(n, NUM_TILES, TILE)
        exp = records[:, 576:583].to(torch.int64) - 127
        tile_scale = torch.where(exp == 128, torch.nan, nx.pow2(exp))  # UE8M0 0xFF is NaN
        nope = (values * tile_scale.unsqueeze(-1)).reshape(n, NOPE_DIM)
        rope = nx.bf16_from_bytes(records[:, NOPE_DIM:576])
        return torch.cat([nope, rope], dim=1)
