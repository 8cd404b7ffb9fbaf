"""Layout registry with the built-in layouts of spec section 3 registered on import."""

from kvbridge.layouts import bf16, model1, trtllm_fp8  # noqa: F401  (registers the layouts)
from kvbridge.layouts.registry import Field, Layout, all_layouts, get_layout, register

__all__ = ["Field", "Layout", "all_layouts", "get_layout", "register"]
