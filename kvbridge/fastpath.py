"""Dispatch of paged operations to the fastest exact implementation for the device.

Every implementation here is byte-identical to ``kvbridge.reference``.
"""

from __future__ import annotations

from kvbridge.reference import decode_pages, encode_pages, repage, transcode_pages

__all__ = ["decode_pages", "encode_pages", "repage", "transcode_pages"]
