"""Indexer-key codecs (INDEXER_COMPRESS cache of ratio-4 layers, spec section 5).

A key is ``D`` values (``index_head_dim`` = 128). Two storage formats, each a record of
``record_bytes`` stored **block-planar** in a page of P keys (all value rows first, then all
scale rows, no padding), i.e. value bytes of key t at ``t * split``, its scale bytes at
``P * split + t * (record_bytes - split)``:

- ``fp8``: D E4M3 bytes, then one little-endian fp32 scale (D = 128: 132 B). Writer rules:
  ``amax`` (TensorRT-LLM): scale = fp32(amax) / 448; ``amax-1e-4`` (SGLang):
  scale = fp32(max(amax, 1e-4)) / 448. Value byte = e4m3(x / scale) (fp32 division, RNE,
  saturating). An all-zero key under ``amax`` has scale 0 and value bytes 0 (kvbridge's
  choice: the rule itself would divide 0 by 0). Decode: fp32(e4m3) * scale.
- ``fp4`` (TensorRT-LLM's default indexer cache): D/2 bytes of E2M1 pairs (even element in
  the low nibble), then D/32 UE8M0 scales, one per 32 values, scale = 2^ceil(log2(amax/6))
  (rule ``ue8m0``; an all-zero block gets 2^-127, byte 0). Value code = E2M1 RNE of
  x / scale, saturating at 6. Decode: e2m1 value * scale (exact). D = 128: 68 B.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvbridge import numerics as nx
from kvbridge.api import encode
from kvbridge.errors import InputError
from kvbridge.layouts import PageGeometry

FP4_BLOCK = 32
#: E2M1 magnitude of codes 0..7.
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
#: (threshold, inclusive) between code k and k+1: ties go to the even code.
_E2M1_STEPS = ((0.25, False), (0.75, True), (1.25, False), (1.75, True), (2.5, False), (3.5, True), (5.0, False))


@dataclass(frozen=True)
class IndexerFormat:
    """Geometry of one indexer-key storage format for keys of ``dim`` values."""

    name: str
    dim: int
    rules: tuple[str, ...]

    @property
    def split(self) -> int:
        """Value bytes per key (the block-planar split point)."""
        return self.dim if self.name == "fp8" else self.dim // 2

    @property
    def record_bytes(self) -> int:
        return self.split + (4 if self.name == "fp8" else self.dim // FP4_BLOCK)

    @property
    def geometry(self) -> PageGeometry:
        """Block-planar pages, no padding (the registry's geometry)."""
        return PageGeometry(self.record_bytes, self.split)

    def page_bytes(self, page_size: int) -> int:
        return self.geometry.page_bytes(page_size)


FP8_RULES = ("amax", "amax-1e-4")
FP4_RULES = ("ue8m0",)


def indexer_format(name: str, dim: int = 128) -> IndexerFormat:
    """The ``fp8`` or ``fp4`` format for keys of ``dim`` values."""
    if name == "fp8":
        return IndexerFormat("fp8", dim, FP8_RULES)
    if name == "fp4":
        if dim % FP4_BLOCK:
            raise InputError(f"fp4 indexer keys need dim a multiple of {FP4_BLOCK}, got {dim}")
        return IndexerFormat("fp4", dim, FP4_RULES)
    raise InputError(f"unknown indexer format {name!r}; choose fp8 or fp4")


def _check_rule(fmt: IndexerFormat, rule: str) -> None:
    if rule not in fmt.rules:
        raise InputError(f"indexer rule {rule!r} does not apply to {fmt.name}; choose one of {', '.join(fmt.rules)}")


def _e4m3_bytes(y: torch.Tensor) -> torch.Tensor:
    """E4M3 bytes (RNE, saturating) of fp32 ``y`` ``[N, D]``, through the public encoder.

    ``trtllm-fp8`` with dialect ``compress`` stores e4m3(x) of each value with no scaling, so
    encoding the values as rows of 512 gives the same bytes as ``numerics.e4m3_encode`` and
    runs on the fastest exact path for the device.
    """
    flat = y.reshape(-1)
    if flat.numel() == 0:
        return torch.empty(y.shape, dtype=torch.uint8, device=y.device)
    pad = (-flat.numel()) % 512
    if pad:
        flat = torch.cat([flat, flat.new_zeros(pad)])
    rows = flat.view(-1, 512)
    pages = encode(rows, "trtllm-fp8", page_size=rows.shape[0], dialect="compress")
    return pages.view(-1)[: y.numel()].view(y.shape)


def _f32_le_bytes(x: torch.Tensor) -> torch.Tensor:
    """fp32 ``[N]`` -> little-endian bytes ``[N, 4]`` (torch stores fp32 little-endian)."""
    return x.contiguous().view(torch.uint8).view(-1, 4)


def _f32_from_le_bytes(b: torch.Tensor) -> torch.Tensor:
    """Little-endian bytes ``[N, 4]`` -> fp32 ``[N]``."""
    return b.contiguous().view(torch.float32).view(-1)


def e2m1_encode(x: torch.Tensor) -> torch.Tensor:
    """fp32 -> E2M1 codes (uint8 0..15, sign in bit 3), RNE, saturating at 6, signed zero kept.

    The code of |x| is the number of rounding thresholds below it; at a threshold the tie
    goes to the even code (up at 0.75, 1.75 and 3.5, down at the others). fp32 compares are exact.
    """
    mag = x.abs()
    thresholds = torch.tensor([t for t, _ in _E2M1_STEPS], dtype=torch.float32, device=x.device)
    code = torch.bucketize(mag, thresholds, out_int32=True).to(torch.uint8)  # thresholds strictly below |x|
    for t, inclusive in _E2M1_STEPS:
        if inclusive:
            code += (mag == t).to(torch.uint8)
    sign = (x.contiguous().view(torch.int32) < 0).to(torch.uint8) << 3
    return code | sign


def e2m1_decode(codes: torch.Tensor) -> torch.Tensor:
    """E2M1 codes (0..15) -> fp32."""
    table = torch.tensor(E2M1_VALUES + tuple(-v for v in E2M1_VALUES), dtype=torch.float32, device=codes.device)
    return table[codes.to(torch.int64)]


def fp4_scale_exponent(amax: torch.Tensor) -> torch.Tensor:
    """Exact ceil(log2(amax / 6)) of fp32 ``amax`` as int64, clamped to [-127, 127] (0 -> -127).

    amax = m * 2^e with m in [0.5, 1) (frexp, exact in fp64) and 6 = 0.75 * 2^3, so the
    result is e - 3, plus one when m > 0.75.
    """
    m, e = torch.frexp(amax.double())
    k = e.to(torch.int64) - 3 + (m > 0.75).to(torch.int64)
    k = torch.where(amax > 0, k, torch.full_like(k, -127))
    return k.clamp(min=-127, max=127)


def _check_keys(x: torch.Tensor, fmt: IndexerFormat) -> torch.Tensor:
    if not isinstance(x, torch.Tensor) or x.dim() != 2 or x.shape[1] != fmt.dim:
        shape = list(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
        raise InputError(f"indexer keys must be a tensor [num_keys, {fmt.dim}], got {shape}")
    xf = x.float()
    if not bool(torch.isfinite(xf).all()):
        raise InputError("indexer keys hold NaN or Inf; they cannot be quantized")
    return xf


def encode_keys(x: torch.Tensor, fmt: IndexerFormat, rule: str) -> torch.Tensor:
    """Keys ``[N, D]`` (any float dtype, finite) -> records uint8 ``[N, record_bytes]``."""
    _check_rule(fmt, rule)
    xf = _check_keys(x, fmt)
    n = xf.shape[0]
    if fmt.name == "fp8":
        amax = xf.abs().amax(dim=1) if n else torch.zeros(0)
        floor = 1e-4 if rule == "amax-1e-4" else 0.0
        scale = amax.clamp(min=floor) / torch.tensor(nx.E4M3_MAX, dtype=torch.float32)
        safe = torch.where(scale > 0, scale, torch.ones_like(scale))
        values = _e4m3_bytes(xf / safe.unsqueeze(1))
        return torch.cat([values, _f32_le_bytes(scale)], dim=1)
    blocks = xf.reshape(n, fmt.dim // FP4_BLOCK, FP4_BLOCK)
    exp = fp4_scale_exponent(blocks.abs().amax(dim=-1))
    codes = e2m1_encode(blocks * nx.pow2(-exp).unsqueeze(-1)).reshape(n, fmt.dim)
    packed = codes[:, 0::2] | (codes[:, 1::2] << 4)
    return torch.cat([packed, nx.ue8m0_byte(exp)], dim=1)


def decode_keys(records: torch.Tensor, fmt: IndexerFormat) -> torch.Tensor:
    """Records uint8 ``[N, record_bytes]`` -> fp32 keys ``[N, D]``."""
    if not isinstance(records, torch.Tensor) or records.dtype != torch.uint8 or records.dim() != 2 \
            or records.shape[1] != fmt.record_bytes:
        raise InputError(f"{fmt.name} indexer records must be uint8 [num_keys, {fmt.record_bytes}]")
    n = records.shape[0]
    if fmt.name == "fp8":
        scale = _f32_from_le_bytes(records[:, fmt.dim :])
        return nx.e4m3_decode(records[:, : fmt.dim]) * scale.unsqueeze(1)
    packed = records[:, : fmt.split]
    codes = torch.stack([packed & 0xF, packed >> 4], dim=-1).reshape(n, fmt.dim)
    exp = records[:, fmt.split :].to(torch.int64) - 127
    values = e2m1_decode(codes).reshape(n, fmt.dim // FP4_BLOCK, FP4_BLOCK)
    return (values * nx.pow2(exp).unsqueeze(-1)).reshape(n, fmt.dim)


def transcode_keys(
    records: torch.Tensor, src: IndexerFormat, dst: IndexerFormat, dst_rule: str
) -> tuple[torch.Tensor, float]:
    """Convert indexer records between formats; returns ``(records, max_abs_error)``.

    fp8 -> fp8 is decoded and rescaled by the destination's rule (a byte copy when the
    re-encoding reproduces the same bytes); fp4 -> fp8 decodes exactly then quantizes;
    fp8 -> fp4 quantizes the decoded values. The error is measured on the decoded values.
    """
    values = decode_keys(records, src)
    out = encode_keys(values, dst, dst_rule)
    back = decode_keys(out, dst)
    err = float((back - values).abs().max()) if values.numel() else 0.0
    return out, err
