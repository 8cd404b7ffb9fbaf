"""FlashMLA sparse decode over any pool: the exact CPU reference and FlashMLA's own kernels."""
