"""Indexer-key codecs (INDEXER_COMPRESS cache of ratio-4 layers): one encoder per engine writer.

A key is ``D`` values (``index_head_dim`` = 128). Two storage formats, each a record of
``record_bytes`` stored **block-planar** in a page of P keys (all value rows first, then all
scale rows), i.e. value bytes of key t at ``t * split``, its scale bytes at
``P * split + t * (record_bytes - split)``:

- ``fp8``: D E4M3 bytes, then a 4-byte scale (D = 128: 132 B): a little-endian fp32, or (rule
  ``vllm-ue8m0``, vLLM on SM100) four UE8M0 bytes, one per 32 values. Decode: fp32(e4m3) * scale.
  The value bytes are OCP E4M3 (``float8_e4m3fn``), or E4M3 FNUZ (``float8_e4m3fnuz``: bias 8, max
  240, NaN 0x80, no -0) under the ``FNUZ_RULES`` (SGLang on ROCm gfx942).
- ``fp4``: D/2 bytes of E2M1 pairs (even element in the low nibble), then D/32 UE8M0 scales,
  one per 32 values (D = 128: 68 B). Decode: e2m1 value * 2^(byte - 127) (exact).

Writer rules, as each engine's code computes them (amax = max |x| of the key or 32-block; every
product and quotient is one fp32 operation; E4M3 is round-to-nearest-even, saturating):

| rule | fp8 scale | fp8 value |
|---|---|---|
| ``trtllm`` | amax / 448 | e4m3(x * fl(448 / amax)) |
| ``sglang``, ``deepgemm`` | max(amax, 1e-4) / 448 | e4m3(x * fl(1 / scale)) |
| ``sglang-rocm`` | max(amax, 1e-8) / 448 | e4m3(x * fl(1 / scale)) |
| ``sglang-rocm-fnuz`` | max(amax, 1e-8) / 240 | e4m3fnuz(x * fl(1 / scale)) |
| ``vllm``, ``vllm-ue8m0`` | 2^ceil(log2(max(amax_bf16, 1e-4) * fl(1/448))) | e4m3(bf16(x) * 2^-e) |

| rule | fp4 scale exponent e | codes of x * 2^-e | all-zero block |
|---|---|---|---|
| ``trtllm`` | ceil(log2(max(amax, 6 * 2^-126) * fl(1/6))) | nearest-even, sign kept (-0) | byte 1 |
| ``vllm`` | as ``trtllm``, from bf16(x) | as ``trtllm`` | byte 1 |
| ``sglang`` (its C4 pools) | ceil(log2(max(amax, 1e-4) / 6)) | ties to the smaller magnitude, no -0 | byte 112 |
| ``sglang-triton`` | ceil(log2(max(amax / 6, 1e-4))) | ties to the smaller magnitude, no -0 | byte 114 |
| ``sglang-rne`` | as ``sglang-triton`` | nearest-even, no -0 | byte 114 |
| ``deepgemm`` | ceil(log2(max(amax, 1e-4) / 6)) | ties to the smaller magnitude, no -0 | byte 112 |

SGLang writes its ratio-4 (C4) fp4 keys in its fused norm-RoPE kernel (the ``sglang`` rule, the
bytes of ``deepgemm``); its Triton ``quantize_fp4_indexer_tensor`` (``sglang-triton``,
``sglang-rne`` with ``rne=True``) serves its low-ratio pools.

An all-zero key under fp8 ``trtllm`` gets scale 0.0 and value bytes 0 (TensorRT-LLM multiplies
by 1 when amax is 0). ``trtllm`` and ``sglang*`` quantize the values as given (fp32); ``vllm*``
round them to bf16 first, as vLLM's fused writer does.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvbridge import numerics as nx
from kvbridge.backends import dispatch
from kvbridge.errors import InputError
from kvbridge.layouts import PageGeometry
from kvbridge.ops.pages import encode

FP4_BLOCK = 32
#: E2M1 magnitude of codes 0..7 (the exact-arithmetic module holds the codecs).
E2M1_VALUES = nx.E2M1_MAGNITUDES


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


#: Writer rules per format (see the module docstring); ``deepgemm`` writes the bytes of ``sglang``.
FP8_RULES = ("trtllm", "sglang", "sglang-rocm", "sglang-rocm-fnuz", "deepgemm", "vllm", "vllm-ue8m0")
FP4_RULES = ("trtllm", "vllm", "sglang", "sglang-triton", "sglang-rne", "deepgemm")
#: fp8 rules whose scale is stored as four UE8M0 bytes instead of an fp32.
UE8M0_SCALE_RULES = ("vllm-ue8m0",)
#: fp8 rules whose value bytes are E4M3 FNUZ: SGLang's ROCm store built for gfx942
#: (``triton_store_cache.py`` ``triton_fused_store_indexer``, ``FP8_MAX = finfo(float8_e4m3fnuz).max``).
FNUZ_RULES = ("sglang-rocm-fnuz",)


def indexer_format(name: str, dim: int = 128) -> IndexerFormat:
    """The ``fp8`` or ``fp4`` format for keys of ``dim`` values."""
    if name == "fp8":
        if dim % FP4_BLOCK:
            raise InputError(f"fp8 indexer keys need dim a multiple of {FP4_BLOCK}, got {dim}")
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
    uses the fastest exact path for the device.
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


def _f32(value: float, device: torch.device) -> torch.Tensor:
    return torch.tensor(value, dtype=torch.float32, device=device)


def _bf16(x: torch.Tensor) -> torch.Tensor:
    """fp32 values rounded to bf16 (nearest-even), as fp32."""
    return (nx.bf16_round(x) << 16).to(torch.int32).view(torch.float32)


def fp8_scales(xf: torch.Tensor, rule: str) -> tuple[torch.Tensor, torch.Tensor]:
    """``(scale, multiplier)`` fp32 ``[N]`` of each key under an fp8 rule: value = e4m3(x * multiplier)."""
    dev = xf.device
    amax = xf.abs().amax(dim=1) if xf.shape[0] else torch.zeros(0, device=dev)
    if rule == "trtllm":
        scale = amax / _f32(nx.E4M3_MAX, dev)
        mult = torch.where(amax > 0, _f32(nx.E4M3_MAX, dev) / torch.where(amax > 0, amax, 1.0),
                           torch.zeros_like(amax))
        return scale, mult
    if rule in ("sglang", "deepgemm", "sglang-rocm", "sglang-rocm-fnuz"):
        floor = 1e-8 if rule.startswith("sglang-rocm") else 1e-4
        top = nx.E4M3FNUZ_MAX if rule in FNUZ_RULES else nx.E4M3_MAX
        scale = amax.clamp(min=_f32(floor, dev)) / _f32(top, dev)
        return scale, _f32(1.0, dev) / scale
    exp = nx.ceil_log2(amax.clamp(min=_f32(1e-4, dev)) * _f32(1.0 / nx.E4M3_MAX, dev))
    return nx.pow2(exp).to(dev), nx.pow2(-exp).to(dev)


def fp4_exponents(blocks: torch.Tensor, rule: str) -> torch.Tensor:
    """UE8M0 scale exponent (int64) of each 32-value block ``[..., 32]`` under an fp4 rule."""
    dev = blocks.device
    amax = blocks.abs().amax(dim=-1)
    if rule in ("trtllm", "vllm"):
        q = amax.clamp(min=_f32(6.0 * 2.0**-126, dev)) * _f32(1.0 / 6.0, dev)
        return nx.ceil_log2(q).clamp(min=-127, max=127)
    if rule in ("sglang-triton", "sglang-rne"):
        return nx.ceil_log2((amax / _f32(6.0, dev)).clamp(min=_f32(1e-4, dev))).clamp(min=-126, max=127)
    return nx.ceil_log2(amax.clamp(min=_f32(1e-4, dev)) / _f32(6.0, dev)).clamp(min=-127, max=127)


_FP4_CODES = {
    "trtllm": nx.e2m1_encode,
    "vllm": nx.e2m1_encode,
    "sglang": nx.e2m1_encode_threshold,
    "sglang-triton": nx.e2m1_encode_threshold,
    "sglang-rne": nx.e2m1_encode_rne_no_negative_zero,
    "deepgemm": nx.e2m1_encode_threshold,
}


def _check_keys(x: torch.Tensor, fmt: IndexerFormat) -> torch.Tensor:
    if not isinstance(x, torch.Tensor) or x.dim() != 2 or x.shape[1] != fmt.dim:
        shape = list(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
        raise InputError(f"indexer keys must be a tensor [num_keys, {fmt.dim}], got {shape}")
    xf = x.float()
    if not bool(torch.isfinite(xf).all()):
        raise InputError("indexer keys hold NaN or Inf; they cannot be quantized")
    return xf


def encode_keys(x: torch.Tensor, fmt: IndexerFormat, rule: str) -> torch.Tensor:
    """Keys ``[N, D]`` (any float dtype, finite) -> records uint8 ``[N, record_bytes]`` by ``rule``'s writer."""
    _check_rule(fmt, rule)
    xf = _check_keys(x, fmt).contiguous()
    n = xf.shape[0]
    if rule.startswith("vllm"):
        xf = _bf16(xf)  # vLLM rounds the rotated key to bf16 before quantizing
    if fmt.name == "fp8":
        scale, mult = fp8_scales(xf, rule)
        scaled = xf * mult.unsqueeze(1)
        values = nx.e4m3fnuz_encode(scaled) if rule in FNUZ_RULES else _e4m3_bytes(scaled)
        if rule in UE8M0_SCALE_RULES:
            if fmt.dim != 128:
                raise InputError("UE8M0 fp8 indexer scales are defined for 128-value keys only")
            exp = nx.ceil_log2(scale) if n else torch.zeros(0, dtype=torch.int64, device=xf.device)
            return torch.cat([values, nx.ue8m0_byte(exp).unsqueeze(1).expand(n, 4)], dim=1)
        return torch.cat([values, _f32_le_bytes(scale)], dim=1)
    blocks = xf.reshape(n, fmt.dim // FP4_BLOCK, FP4_BLOCK)
    exp = fp4_exponents(blocks, rule)
    codes = _FP4_CODES[rule](blocks * nx.pow2(-exp).unsqueeze(-1)).reshape(n, fmt.dim)
    packed = codes[:, 0::2] | (codes[:, 1::2] << 4)
    return torch.cat([packed, nx.ue8m0_byte(exp)], dim=1)


def decode_keys(records: torch.Tensor, fmt: IndexerFormat, rule: str | None = None) -> torch.Tensor:
    """Records uint8 ``[N, record_bytes]`` -> fp32 keys ``[N, D]``.

    ``rule`` matters only for fp8 scales stored as UE8M0 bytes (``vllm-ue8m0``) and fp8 values stored as
    E4M3 FNUZ (``FNUZ_RULES``): without it, fp8 records read as OCP E4M3 with an fp32 scale.
    """
    if not isinstance(records, torch.Tensor) or records.dtype != torch.uint8 or records.dim() != 2 \
            or records.shape[1] != fmt.record_bytes:
        raise InputError(f"{fmt.name} indexer records must be uint8 [num_keys, {fmt.record_bytes}]")
    if rule is not None:
        _check_rule(fmt, rule)
    n = records.shape[0]
    if fmt.name == "fp8":
        codes = records[:, : fmt.dim]
        values = nx.e4m3fnuz_decode(codes) if rule in FNUZ_RULES else nx.e4m3_decode(codes)
        if rule in UE8M0_SCALE_RULES:
            if fmt.dim != 128:
                raise InputError("UE8M0 fp8 indexer scales are defined for 128-value keys only")
            per_block = nx.ue8m0_decode(records[:, fmt.dim :]).to(records.device)
            return (values.view(n, 4, FP4_BLOCK) * per_block.unsqueeze(-1)).view(n, fmt.dim)
        scale = _f32_from_le_bytes(records[:, fmt.dim :])
        return values * scale.unsqueeze(1)
    packed = records[:, : fmt.split]
    codes = torch.stack([packed & 0xF, packed >> 4], dim=-1).reshape(n, fmt.dim)
    values = nx.e2m1_decode(codes).reshape(n, fmt.dim // FP4_BLOCK, FP4_BLOCK)
    return (values * nx.ue8m0_decode(records[:, fmt.split :]).unsqueeze(-1)).reshape(n, fmt.dim)


def key_kernel_applies(src: IndexerFormat, dst: IndexerFormat, dst_rule: str, device: torch.device) -> bool:
    """Whether the backend's fp4 -> fp8 key kernel converts ``src`` keys on ``device`` to ``dst`` by ``dst_rule``
    (``dispatch.key_kernels``: the native backend, CPU; every OCP fp8 rule, UE8M0 scales at dim 128 only)."""
    return (src.name == "fp4" and dst.name == "fp8" and src.dim == dst.dim and dst_rule in dst.rules
            and dst_rule not in FNUZ_RULES and not (dst_rule in UE8M0_SCALE_RULES and dst.dim != 128)
            and dispatch.key_kernels(device))


def native_transcode_applies(records: torch.Tensor, src: IndexerFormat, dst: IndexerFormat, dst_rule: str) -> bool:
    """Whether ``transcode_keys`` runs the backend's fp4 -> fp8 kernel on ``records`` (uint8 ``[N, record
    bytes]``, see ``key_kernel_applies``; keys that decode to NaN/Inf are handed to the torch path, which refuses
    them)."""
    return (isinstance(records, torch.Tensor) and records.dtype == torch.uint8 and records.dim() == 2
            and records.shape[1] == src.record_bytes and key_kernel_applies(src, dst, dst_rule, records.device))


def transcode_keys(
    records: torch.Tensor, src: IndexerFormat, dst: IndexerFormat, dst_rule: str, src_rule: str | None = None
) -> tuple[torch.Tensor, float]:
    """Convert indexer records between formats and writers; returns ``(records, max_abs_error)``.

    The source records are decoded (``src_rule`` names how their scale is stored) and the
    values quantized by the destination writer's rule, as that engine would have written them
    from those values. The error is measured on the decoded values.
    """
    if native_transcode_applies(records, src, dst, dst_rule):
        if src_rule is not None:
            _check_rule(src, src_rule)
        done = dispatch.fp4_to_fp8_keys(records.contiguous(), dst.dim, dst_rule)
        if done is not None:
            return done
    values = decode_keys(records, src, src_rule)
    out = encode_keys(values, dst, dst_rule)
    back = decode_keys(out, dst, dst_rule)
    err = float((back - values).abs().max()) if values.numel() else 0.0
    return out, err
