"""DeepSeek-V4.1 FP4 token (288 B): 512 E2M1 values packed two per byte (even dim in the low
nibble; nope bytes 0-223, rope bytes 224-255), then 32 E4M3 scales, one per 16 values (nope
tiles 0-27 at 256-283, rope tiles at 284-287).

Scale rule (no dialects): ``e4m3(clamp(amax / 6, 2^-9, 448))``, codes ``e2m1(x / scale)`` with an
IEEE division by the rounded scale; a NaN poisons its tile (scale byte 0x7F, codes 0) and a +-Inf
without NaN counts as the largest fp32 (scale 448; reached only with ``nonfinite="propagate"``).
``v41-fp4`` is block-split at 256 with pages padded to 256 B (SGLang ``v41_fp4``);
``v41-fp4-pad512`` the same bytes with pages padded to 512 B (FlashMLA's test ``V41_FP4``);
``v41-fp4-interleaved`` stores each token's scales right after its data, pages unpadded
(SGLang ``v41_fp4_new``, the extra cache of FlashMLA's current kernels).
"""

from kvbridge.layouts.registry import Field, Layout, register

V41_FP4_FIELDS = (
    Field("nope", 0, 224, "e2m1", (0, 448), tile=16, scale="nope_scale"),
    Field("rope", 224, 32, "e2m1", (448, 512), tile=16, scale="rope_scale"),
    Field("nope_scale", 256, 28, "e4m3-scale"),
    Field("rope_scale", 284, 4, "e4m3-scale"),
)
V41_FP4_NOTE = (
    "FP4 (E2M1, 8 magnitudes per 16-value tile): rounding errors reach amax/6 of a tile (about 17%), "
    "far coarser than the FP8 layouts (E4M3: about 6%); rope quantized too"
)
_SOURCE = "FlashMLA tests/quant.py KVCacheLayout.V41_FP4; SGLang KVLayout.{}; vLLM nvfp4_ds_mla compressed cache"

V41_FP4 = register(
    Layout(
        name="v41-fp4",
        description="DeepSeek-V4.1 FP4, 288 B/token, block-split at 256, page padded to 256 B",
        record_bytes=288,
        fields=V41_FP4_FIELDS,
        split=256,
        page_align=256,
        aliases=("sglang-v41-fp4",),
        source=_SOURCE.format("V41_FP4"),
        loss_note=V41_FP4_NOTE,
    )
)

V41_FP4_PAD512 = register(
    Layout(
        name="v41-fp4-pad512",
        description="DeepSeek-V4.1 FP4, 288 B/token, block-split at 256, page padded to 512 B",
        record_bytes=288,
        fields=V41_FP4_FIELDS,
        split=256,
        page_align=512,
        aliases=("flashmla-v41-fp4",),
        source="FlashMLA tests/quant.py quantize_k_cache(KVCacheLayout.V41_FP4) (pads pages to 512 B)",
        loss_note=V41_FP4_NOTE,
    )
)

V41_FP4_INTERLEAVED = register(
    Layout(
        name="v41-fp4-interleaved",
        description="DeepSeek-V4.1 FP4, 288 B/token, token-major (scales after each token's data), no padding",
        record_bytes=288,
        fields=V41_FP4_FIELDS,
        aliases=("sglang-v41-fp4-new",),
        source=_SOURCE.format("V41_FP4_NEW") + "; FlashMLA 2026.09.30 current sparse decode (extra cache)",
        loss_note=V41_FP4_NOTE,
    )
)
