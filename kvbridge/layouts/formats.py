"""The format table: every element and scale format a ``Field.format`` can name, one entry each.

An entry says all that the code reading stored bytes needs to know about a format:

- ``kind``: ``value`` (latent dims), ``scale`` (one byte per tile of a value field) or ``pad``;
- ``bits``: bits per element (value formats: per latent dim; scale formats: per tile; pad: per byte);
- ``ops``: the ``Segment`` op a value field of this format compiles to, per scale format it names
  (``None``: no scale field); ``registry.compile_segments`` reads it, and the backends execute only
  the compiled segments, so they learn format facts only through it;
- ``nonfinite``: the stored codes that are NaN or Inf (``CodeRule``), or None when the format has
  none (E2M1, pad); the byte scan (``layouts.scan``) and dump statistics read it, so a format
  cannot be missing from either;
- ``inf``: which of those are infinities (dump statistics count them apart from NaN);
- ``at_max``: codes at the largest finite magnitude (saturation; dump statistics and the
  accuracy study), ``subnormal`` and ``zero``: codes the accuracy study counts;
- ``exponent_bias``: a power-of-two scale byte ``k + bias`` (dump statistics histogram ``k``).

A code rule reads each element as a little-endian word of ``width`` bytes and matches
``word & mask == value``. ``register_format`` adds an entry (checked: a rule must fit its
width, an op must be one the backends execute); ``get_format`` refuses an unknown name with
``LayoutError`` naming the known ones.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

from kvbridge.errors import LayoutError

# Segment operations (what one field does to its dims and bytes); the backends switch on these.
#: bf16 little-endian, 2 B per value.
OP_BF16 = 0
#: E4M3, 1 B per value, one per-tensor scale outside the cache (dialects ``swa`` / ``compress``).
OP_E4M3_TENSOR = 1
#: E4M3 per tile, scaled by 2^k with the UE8M0 byte k + 127 (dialects ``flashmla``, ``amax-*``).
OP_E4M3_UE8M0 = 2
#: E2M1 pairs (even element in the low nibble) per tile, scaled by an E4M3 scale byte
#: (``e4m3_rne(clamp(amax / 6, 2^-9, 448))``; codes of x / scale).
OP_E2M1_E4M3 = 3
#: Bytes written as zero (pad).
OP_ZERO = 4
#: E4M3 FNUZ (``float8_e4m3fnuz``, ROCm gfx942) per tile, scaled by 2^k with the UE8M0 byte k + 127;
#: k = ceil(log2(max(amax, eps) / 224)), the ROCm writers' rule (``numerics.fnuz_scale_exponent``).
OP_E4M3FNUZ_UE8M0 = 5
#: E2M1 pairs per tile with an NVFP4 E4M3 scale byte (FlashInfer's writer, global scale 1):
#: ``e4m3_rne(amax * fp32(1/6))`` with no lower clamp, codes of ``x * fp32(1/scale)``
#: (``numerics.nvfp4_tile_scale`` / ``nvfp4_encode_tiles``); decoded like ``OP_E2M1_E4M3``.
OP_E2M1_NVFP4 = 6
#: E2M1 pairs per tile with a UE8M0 scale 2^k (MXFP4, SGLang's DSV4 writer): k = round(log2(amax / 6)),
#: byte k + 127 clamped to [0, 255], codes of x / 2^k (``numerics.mxfp4_scale_byte`` / ``mxfp4_encode_tiles``).
OP_E2M1_UE8M0 = 7
#: E2M1 pairs per tile with an NVFP4 E4M3 scale byte, as vLLM's ``cvt_warp_fp16_to_fp4`` writes them
#: (local-inference-lab's ``nvfp4_ds_mla``): ``OP_E2M1_NVFP4``'s rule except that a tile whose scale byte is 0
#: gets the multiplier 0, so its codes are signed zeros (FlashInfer's writer multiplies by 1/0 = +Inf: +-6);
#: decoded like ``OP_E2M1_NVFP4``.
OP_E2M1_NVFP4Z = 9
#: Writes no bytes: the encoders round the values of dims ``[dim0, dim0 + ndims)`` to bf16 before encoding
#: the fields after it (a bf16 field stored a second time in another format, ``Field.mirror``, is encoded
#: from the bf16 values its first copy stores); only in a layout's encode program, never in its read program.
OP_ROUND_BF16 = 8
#: Every op the backends (reference codec, numba, C, Triton) execute.
SEGMENT_OPS = (OP_BF16, OP_E4M3_TENSOR, OP_E4M3_UE8M0, OP_E2M1_E4M3, OP_ZERO, OP_E4M3FNUZ_UE8M0, OP_E2M1_NVFP4,
               OP_E2M1_UE8M0, OP_ROUND_BF16, OP_E2M1_NVFP4Z)
#: Ops whose fields are E2M1 pairs scaled by one E4M3 byte per tile (decoded alike).
E2M1_E4M3_OPS = (OP_E2M1_E4M3, OP_E2M1_NVFP4, OP_E2M1_NVFP4Z)
#: Ops of NVFP4 tiles (E4M3 scales relative to a per-tensor fp32 global scale g outside the cache).
NVFP4_OPS = (OP_E2M1_NVFP4, OP_E2M1_NVFP4Z)
#: Ops that use the layout's per-tensor scale (a field compiling to one needs a per-tensor layout).
PER_TENSOR_OPS = (OP_E4M3_TENSOR,)
KINDS = ("value", "scale", "pad")


class CodeRule(NamedTuple):
    """Stored elements matching ``word & mask == value``, each read as a little-endian ``width``-byte word."""

    width: int
    mask: int
    value: int

    def matches(self, word: int) -> bool:
        return word & self.mask == self.value


@dataclass(frozen=True)
class Format:
    """One element or scale format (see the module docstring)."""

    name: str
    kind: str
    bits: int
    nonfinite: CodeRule | None
    ops: tuple[tuple[str | None, int], ...] = ()
    inf: CodeRule | None = None
    at_max: CodeRule | None = None
    subnormal: CodeRule | None = None
    zero: CodeRule | None = None
    exponent_bias: int | None = None

    @property
    def rules(self) -> tuple[CodeRule, ...]:
        return tuple(r for r in (self.nonfinite, self.inf, self.at_max, self.subnormal, self.zero) if r is not None)

    @property
    def width(self) -> int:
        """Bytes per element word that the code rules read (1 when the format has no rule)."""
        return self.rules[0].width if self.rules else 1

    def op(self, scale_format: str | None) -> int | None:
        """The op of a value field of this format scaled by ``scale_format`` (None: unscaled), or None if none."""
        return dict(self.ops).get(scale_format)

    def scale_formats(self) -> tuple[str | None, ...]:
        return tuple(s for s, _ in self.ops)


E4M3_NAN = CodeRule(1, 0x7F, 0x7F)  # S.1111.111 (E4M3 has no infinity)

_TABLE: dict[str, Format] = {}


def register_format(fmt: Format) -> Format:
    """Add ``fmt`` to the table; ``LayoutError`` when its name is taken or its description is inconsistent."""
    bad = f"format {fmt.name!r}:"
    if fmt.name in _TABLE:
        raise LayoutError(f"{bad} already registered")
    if fmt.kind not in KINDS:
        raise LayoutError(f"{bad} kind must be one of {', '.join(KINDS)}, got {fmt.kind!r}")
    if fmt.bits < 1 or (fmt.kind != "value" and fmt.bits != 8):
        raise LayoutError(f"{bad} {fmt.bits} bits per element (scale and pad formats are one byte)")
    if fmt.rules and len({r.width for r in fmt.rules}) != 1:
        raise LayoutError(f"{bad} its code rules must read words of one width")
    for r in fmt.rules:
        if r.width not in (1, 2) or r.width * 8 != fmt.bits or r.value & ~r.mask or r.mask >> (8 * r.width):
            raise LayoutError(f"{bad} code rule {r} does not fit {fmt.bits}-bit elements (1- or 2-byte words)")
    for scale, op in fmt.ops:
        if op not in SEGMENT_OPS:
            raise LayoutError(f"{bad} op {op} is not one the backends execute ({SEGMENT_OPS})")
        if scale is not None and (scale not in _TABLE or _TABLE[scale].kind != "scale"):
            raise LayoutError(f"{bad} scale format {scale!r} is not a registered scale format")
    if (fmt.kind == "value") != bool(fmt.ops):
        raise LayoutError(f"{bad} a value format compiles to at least one op; scale and pad formats to none")
    _TABLE[fmt.name] = fmt
    return fmt


def unregister_format(name: str) -> None:
    """Remove an entry (tests that add a format restore the table with this)."""
    if name not in _TABLE:
        raise LayoutError(f"format {name!r} is not registered")
    if any(name in f.scale_formats() for f in _TABLE.values() if f.name != name):
        raise LayoutError(f"format {name!r} is the scale format of another entry; remove that one first")
    del _TABLE[name]


def get_format(name: str) -> Format:
    """The table's entry for ``name``; ``LayoutError`` naming the known formats otherwise."""
    try:
        return _TABLE[name]
    except (KeyError, TypeError):
        raise LayoutError(f"unknown format {name!r:.40}; known: {', '.join(_TABLE)}") from None


def all_formats() -> list[Format]:
    return list(_TABLE.values())


register_format(Format("ue8m0", "scale", 8, nonfinite=CodeRule(1, 0xFF, 0xFF), exponent_bias=127))
register_format(Format("e4m3-scale", "scale", 8, nonfinite=E4M3_NAN))
#: NVFP4's per-16 E4M3 scale (relative to a per-tensor fp32 global scale, 1 in FlashInfer's DSV4 record).
register_format(Format("nvfp4-scale", "scale", 8, nonfinite=E4M3_NAN))
#: The same scale byte as vLLM's NVFP4 writer uses it (``OP_E2M1_NVFP4Z``: a scale-0 tile's codes are signed zeros).
register_format(Format("nvfp4-scale-vllm", "scale", 8, nonfinite=E4M3_NAN))
register_format(Format("pad", "pad", 8, nonfinite=None))
register_format(Format(
    "e4m3", "value", 8, nonfinite=E4M3_NAN, ops=((None, OP_E4M3_TENSOR), ("ue8m0", OP_E4M3_UE8M0)),
    at_max=CodeRule(1, 0x7F, 0x7E), subnormal=CodeRule(1, 0x78, 0x00), zero=CodeRule(1, 0x7F, 0x00),
))
register_format(Format(  # float8_e4m3fnuz: bias 8, max 240 (0x7F / 0xFF), NaN 0x80 only, no -0, no Inf
    "e4m3fnuz", "value", 8, nonfinite=CodeRule(1, 0xFF, 0x80), ops=(("ue8m0", OP_E4M3FNUZ_UE8M0),),
    at_max=CodeRule(1, 0x7F, 0x7F), subnormal=CodeRule(1, 0x78, 0x00), zero=CodeRule(1, 0xFF, 0x00),
))
register_format(Format(
    "e2m1", "value", 4, nonfinite=None,
    ops=(("e4m3-scale", OP_E2M1_E4M3), ("nvfp4-scale", OP_E2M1_NVFP4), ("ue8m0", OP_E2M1_UE8M0),
         ("nvfp4-scale-vllm", OP_E2M1_NVFP4Z)),
))
register_format(Format(
    "bf16", "value", 16, nonfinite=CodeRule(2, 0x7F80, 0x7F80), ops=((None, OP_BF16),),
    inf=CodeRule(2, 0x7FFF, 0x7F80),
))
