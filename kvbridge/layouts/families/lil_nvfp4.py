"""``lil-nvfp4-ds-mla``: the 432 B DeepSeek-V4 NVFP4 record of local-inference-lab's vLLM fork
(``--kv-cache-dtype nvfp4_ds_mla``), token-major, no padding.

Record bytes: 0-255 all 512 dims (rope included) as E2M1 pairs (even dim in the low nibble), 32
tiles of 16; 256-287 their 32 E4M3 scales (tile i at 256 + i); 288-303 zero; 304-431 dims 448-511
again in bf16, the values tiles 28-31 were quantized from. The rope dims are stored twice: the E2M1
copy is a ``mirror`` field, encoded from the bf16 copy's values; decoders read the bf16 copy.

Scale rule (no dialects; the writer's global scale is the literal 1.0): ``flashinfer-nvfp4``'s,
``e4m3(amax * fp32(1/6))``, codes ``e2m1(x * fp32(1/scale))`` (``numerics.nvfp4_tile_scale``), except that
a tile whose scale byte is 0 is multiplied by 0 (signed zero codes), not by 1/0 (scale format
``nvfp4-scale-vllm``, vLLM's ``cvt_warp_fp16_to_fp4``).
Experimental: only the fork's open PR #632 writes it (b12x's open PR #304 reads it).
"""

from kvbridge.layouts.registry import Field, Layout, register

LIL_NVFP4_DS_MLA = register(
    Layout(
        name="lil-nvfp4-ds-mla",
        description="vLLM fork (local-inference-lab) DeepSeek-V4 NVFP4 nvfp4_ds_mla, 432 B/token "
                    "(rope twice: E2M1 and bf16), token-major, no padding",
        record_bytes=432,
        fields=(
            Field("nope", 0, 224, "e2m1", (0, 448), tile=16, scale="nope_scale"),
            Field("rope_fp4", 224, 32, "e2m1", (448, 512), tile=16, scale="rope_fp4_scale", mirror=True),
            Field("nope_scale", 256, 28, "nvfp4-scale-vllm"),
            Field("rope_fp4_scale", 284, 4, "nvfp4-scale-vllm"),
            Field("pad", 288, 16, "pad"),
            Field("rope", 304, 128, "bf16", (448, 512)),
        ),
        source="local-inference-lab/vllm csrc/libtorch_stable/nvfp4_kv_cache_kernels.cu "
               "fused_deepseek_v4_qnorm_rope_nvfp4_mla_kernel (PR #632), commit "
               "7424d54d229e9286b42cc7d86303cc824c52bec9 (CUDA sm100+ only: the fixture is derived)",
        loss_note="NVFP4 nope (E2M1, 8 magnitudes per 16-value tile, E4M3 scales): rounding errors reach "
                  "amax/6 of a tile (about 17%); tiles below amax 6 * 2^-10 decode as 0; rope kept in bf16 "
                  "(its E2M1 second copy is written, not read)",
        experimental="local-inference-lab/vllm #632 (open) writes it; local-inference-lab/b12x #304 (open) "
                     "reads it; no engine release writes it",
    )
)
