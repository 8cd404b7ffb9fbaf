"""``trtllm-fp8``: TensorRT-LLM per-tensor FP8, 512 E4M3 per token, token-major.

One fp32 scale per layer lives outside the cache (default 1.0). Dialect ``swa`` is the
SWA writer (x * fp32(1/s)); ``compress`` is the compressed-token writer (scale 1, ignores s).
"""

from kvbridge.layouts.registry import Field, Layout, register

TRTLLM_FP8 = register(
    Layout(
        name="trtllm-fp8",
        description="TensorRT-LLM per-tensor FP8, 512 B/token, scale outside the cache",
        record_bytes=512,
        fields=(Field("nope", 0, 448, "e4m3", (0, 448)), Field("rope", 448, 64, "e4m3", (448, 512))),
        aliases=("sglang-uniform-fp8",),
        dialects=("swa", "compress"),
        per_tensor_scale=True,
        source="TensorRT-LLM PyTorch backend, DeepSeek-V4 FP8 KV (kv_cache_scaling_factor)",
        loss_note="one scale for the whole tensor: small tiles lose precision, values beyond 448*scale saturate",
    )
)
