"""How each engine lays out a DeepSeek-V4 model's caches: topology and engine profiles."""
