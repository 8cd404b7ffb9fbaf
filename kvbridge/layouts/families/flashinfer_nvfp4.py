"""``flashinfer-nvfp4``: FlashInfer's DeepSeek-V4 NVFP4 sparse-MLA record (384 B), block-split at 352.

Record bytes: 0-223 the 448 nope values as E2M1 pairs (even dim in the low nibble), 224-351 the
64 rope values in bf16, 352-379 28 E4M3 scales (one per 16 nope values), 380-383 zero. A page
of P tokens is P data rows of 352 B, then P scale rows of 32 B, with no padding.

Scale rule (no dialects, global scale fixed at 1): ``e4m3(amax * fp32(1/6))`` with no lower
clamp, codes ``e2m1(x * fp32(1/scale))`` (``numerics.nvfp4_tile_scale``). Experimental: FlashInfer
merged it (#4955), no engine release writes it yet (SGLang #38646 is open).
"""

from kvbridge.layouts.registry import Field, Layout, register

FLASHINFER_NVFP4 = register(
    Layout(
        name="flashinfer-nvfp4",
        description="FlashInfer DeepSeek-V4 NVFP4 sparse MLA, 384 B/token, block-split at 352, no padding",
        record_bytes=384,
        fields=(
            Field("nope", 0, 224, "e2m1", (0, 448), tile=16, scale="nope_scale"),
            Field("rope", 224, 128, "bf16", (448, 512)),
            Field("nope_scale", 352, 28, "nvfp4-scale"),
            Field("pad", 380, 4, "pad"),
        ),
        split=352,
        aliases=("sglang-nvfp4",),
        source="FlashInfer flashinfer/mla/_sparse_mla_nvfp4_sm120.py nvfp4_quantize_pack_sparse_mla_cache / "
               "nvfp4_quantize_append_sparse_mla_cache (PR #4955, merged); tests/attention/"
               "test_sparse_mla_nvfp4_sm120.py (bytes equal nvfp4_kv_quantize with global scale 1)",
        loss_note="NVFP4 nope (E2M1, 8 magnitudes per 16-value tile, E4M3 scales): rounding errors reach "
                  "amax/6 of a tile (about 17%); tiles below amax 6 * 2^-10 decode as 0; rope kept in bf16",
        experimental="FlashInfer #4955 (merged) writes it; SGLang #38646 (open) would use it; "
                     "no engine release writes it yet",
    )
)
