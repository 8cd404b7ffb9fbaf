"""``sglang-mxfp4``: SGLang's DeepSeek-V4 MXFP4 record for Hopper (368 B), token-major, no padding.

Record bytes: 0-223 the 448 nope values as E2M1 pairs (even dim in the low nibble), 224-237
14 UE8M0 scales (one per 32 nope values), 238-239 zero, 240-367 the 64 rope values in bf16.

Scale rule (no dialects): byte ``round(log2(amax / 6)) + 127`` clamped to [0, 255], codes
``e2m1(x / 2^(byte - 127))`` (``numerics.mxfp4_scale_byte``). Experimental: only SGLang's open
pull requests write it (#37136, the codec; #37138, the integration).
"""

from kvbridge.layouts.registry import Field, Layout, register

SGLANG_MXFP4 = register(
    Layout(
        name="sglang-mxfp4",
        description="SGLang DeepSeek-V4 MXFP4 (Hopper), 368 B/token, token-major, no padding",
        record_bytes=368,
        fields=(
            Field("nope", 0, 224, "e2m1", (0, 448), tile=32, scale="nope_scale"),
            Field("nope_scale", 224, 14, "ue8m0"),
            Field("pad", 238, 2, "pad"),
            Field("rope", 240, 128, "bf16", (448, 512)),
        ),
        source="SGLang PR #37136 python/sglang/srt/layers/attention/dsv4/mxfp4_k_cache.py "
               "quantize_dsv4_mxfp4_k_cache_into (Triton _quantize_mxfp4_k_cache_into_kernel; CPU "
               "_quantize_mxfp4_reference), commit 07619bc2f735cb3730f478f84f3fac8806523bdf",
        loss_note="MXFP4 nope (E2M1 per 32 values with a power-of-two scale rounded to nearest, so a tile's "
                  "largest values can saturate at 6 * scale): errors up to about a quarter of a tile's maximum; "
                  "rope kept in bf16",
        experimental="SGLang #37136 (codec) and #37138 (DSV4 MXFP4 KV cache on Hopper), both open; "
                     "no engine release writes it yet",
    )
)
