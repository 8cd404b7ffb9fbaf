"""The 584-byte MODEL1 token (448 E4M3 nope, 64 bf16 rope, 7 UE8M0 scales, 1 pad), block-split at 576,
and its ROCm gfx942 variant ``model1-fnuz`` (the nope bytes in float8_e4m3fnuz).

``flashmla-model1`` pads pages to a multiple of 576 B; ``trtllm-fp8-ds-mla`` stores the same
bytes with page stride exactly P * 584.
"""

from kvbridge.layouts.registry import Field, Layout, register
from kvbridge.numerics import DIALECTS, FNUZ_DIALECTS

MODEL1_FIELDS = (
    Field("nope", 0, 448, "e4m3", (0, 448), tile=64, scale="scale"),
    Field("rope", 448, 128, "bf16", (448, 512)),
    Field("scale", 576, 7, "ue8m0"),
    Field("pad", 583, 1, "pad"),
)
MODEL1_NOTE = "nope in E4M3 tiles of 64 with power-of-two scales; rope kept in bf16"

FLASHMLA_MODEL1 = register(
    Layout(
        name="flashmla-model1",
        description="FlashMLA MODEL1 FP8 sparse, 584 B/token, block-split, page padded to 576 B",
        record_bytes=584,
        fields=MODEL1_FIELDS,
        split=576,
        page_align=576,
        aliases=("model1", "sglang-v4", "vllm-fp8-ds-mla"),
        dialects=DIALECTS,
        source="FlashMLA tests/quant.py; SGLang KVLayout.V4; vLLM fp8_ds_mla",
        loss_note=MODEL1_NOTE,
    )
)

TRTLLM_FP8_DS_MLA = register(
    Layout(
        name="trtllm-fp8-ds-mla",
        description="TensorRT-LLM fp8_ds_mla footer-scale, 584 B/token, block-split, no padding",
        record_bytes=584,
        fields=MODEL1_FIELDS,
        split=576,
        page_align=1,
        dialects=DIALECTS,  # its own writer is amax-1e-8; the default follows FlashMLA
        source="TensorRT-LLM kv_cache_config.dtype='fp8_ds_mla'",
        loss_note=MODEL1_NOTE,
    )
)

MODEL1_FNUZ_FIELDS = (
    Field("nope", 0, 448, "e4m3fnuz", (0, 448), tile=64, scale="scale"),
    *MODEL1_FIELDS[1:],
)

MODEL1_FNUZ = register(
    Layout(
        name="model1-fnuz",
        description="MODEL1 with float8_e4m3fnuz nope (ROCm gfx942), 584 B/token, block-split, page padded to 576 B",
        record_bytes=584,
        fields=MODEL1_FNUZ_FIELDS,
        split=576,
        page_align=576,
        aliases=("vllm-fp8-ds-mla-fnuz",),
        dialects=FNUZ_DIALECTS,
        source="vLLM 0.33.0 vllm/models/deepseek_v4/common/ops/cache_utils.py "
               "quantize_and_insert_k_cache(use_fnuz=True) (the gfx942 SWA cache; dequantize_and_gather_k_cache "
               "reads it with use_fnuz); SGLang 0.5.23 sglang/kernels/ops/kvcache/triton_store_cache.py "
               "triton_fused_store_flashmla (HIP, float8_e4m3fnuz build)",
        loss_note=MODEL1_NOTE + "; FNUZ tiles are scaled to a maximum of 224 (half of OCP's 448), no -0",
    )
)
