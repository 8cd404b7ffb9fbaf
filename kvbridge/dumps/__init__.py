"""Dump files: kvbridge's safetensors container of paged pools, its statistics and conversion."""
