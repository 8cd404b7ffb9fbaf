"""DeepSeek-V4.1 MXFP8 token (528 B): 512 E4M3 values (rope quantized too), 16 UE8M0 scales,
one per 32 values: nope tiles 0-13 at record bytes 512-525, rope tiles at 526-527.

``v41-fp8`` is block-split (all data rows of a page, then all scale rows, page padded to a
multiple of 512 B: SGLang ``v41``, FlashMLA's ``V41_FP8Sparse``); ``v41-fp8-interleaved`` stores
each token's scales right after its data, pages unpadded (SGLang ``v41_new``, what FlashMLA's
current kernels read). Dialects: ``flashmla`` (FlashMLA, SGLang) and ``amax-1e-4`` (vLLM).
"""

from kvbridge.layouts.registry import Field, Layout, register

V41_FP8_FIELDS = (
    Field("nope", 0, 448, "e4m3", (0, 448), tile=32, scale="nope_scale"),
    Field("rope", 448, 64, "e4m3", (448, 512), tile=32, scale="rope_scale"),
    Field("nope_scale", 512, 14, "ue8m0"),
    Field("rope_scale", 526, 2, "ue8m0"),
)
V41_FP8_NOTE = "E4M3 tiles of 32 with power-of-two scales; rope quantized to E4M3 too (not kept in bf16)"
_SOURCE = "FlashMLA tests/quant.py KVCacheLayout.V41_FP8Sparse; SGLang KVLayout.{}; vLLM SM100 SWA cache"

V41_FP8 = register(
    Layout(
        name="v41-fp8",
        description="DeepSeek-V4.1 MXFP8, 528 B/token, block-split at 512, page padded to 512 B",
        record_bytes=528,
        fields=V41_FP8_FIELDS,
        split=512,
        page_align=512,
        aliases=("sglang-v41", "flashmla-v41-fp8"),
        dialects=("flashmla", "amax-1e-4"),
        source=_SOURCE.format("V41"),
        loss_note=V41_FP8_NOTE,
    )
)

V41_FP8_INTERLEAVED = register(
    Layout(
        name="v41-fp8-interleaved",
        description="DeepSeek-V4.1 MXFP8, 528 B/token, token-major (scales after each token's data), no padding",
        record_bytes=528,
        fields=V41_FP8_FIELDS,
        aliases=("sglang-v41-new",),
        dialects=("flashmla", "amax-1e-4"),
        source=_SOURCE.format("V41_NEW") + "; FlashMLA 2026.09.30 current sparse decode",
        loss_note=V41_FP8_NOTE,
    )
)
