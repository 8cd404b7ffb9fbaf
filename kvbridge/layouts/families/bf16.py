"""``bf16``: unquantized, 512 bf16 per token (1024 B), token-major, no padding."""

from kvbridge.layouts.registry import Field, Layout, register

BF16 = register(
    Layout(
        name="bf16",
        description="unquantized bf16, 1024 B/token, token-major",
        record_bytes=1024,
        fields=(Field("nope", 0, 896, "bf16", (0, 448)), Field("rope", 896, 128, "bf16", (448, 512))),
        aliases=("trtllm-bf16",),
        lossless_from=("bfloat16",),
        source="TensorRT-LLM BF16 KV cache; DeepSeek reference inference",
    )
)
