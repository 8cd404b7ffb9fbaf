"""Studies: the per-tensor FP8 versus MODEL1 accuracy study, its synthetic latents, kernel benchmarks."""
