"""Test helper: a version-3 dump header re-signed after a test changed it (what a writer with a bug
would produce), so that the field validation behind the header checksum is exercised."""

from __future__ import annotations

import json
import struct

from kvbridge.dumps.dumpfile import HEADER_CHECKSUM, HEADER_CRC_OFFSET, HEADER_PREFIX, header_crc32


def signed_dump(header: object, data: bytes) -> bytes:
    """``header`` (a parsed safetensors header, possibly malformed) as a version-3 header with a
    matching ``header_crc32``, followed by ``data``. A header that cannot carry the checksum first
    (no ``__metadata__`` dict first) is written as it is, unsigned."""
    if isinstance(header, dict) and isinstance(header.get("__metadata__"), dict):
        meta = {k: v for k, v in header["__metadata__"].items() if k != HEADER_CHECKSUM}
        rest = {k: v for k, v in header.items() if k != "__metadata__"}
        header = {"__metadata__": {HEADER_CHECKSUM: "0" * 8, **meta}, **rest}
    body = json.dumps(header, separators=(",", ":")).encode()
    body += b" " * (-len(body) % 8)
    head = bytearray(struct.pack("<Q", len(body)) + body)
    if head[8:HEADER_CRC_OFFSET] == HEADER_PREFIX:
        head[HEADER_CRC_OFFSET : HEADER_CRC_OFFSET + 8] = b"%08x" % header_crc32(bytes(head))
    return bytes(head) + data
