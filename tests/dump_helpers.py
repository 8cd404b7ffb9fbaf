"""Test helpers: a version-3 dump header re-signed after a test changed it (what a writer with a bug
would produce), so that the field validation behind the header checksum is exercised; the seeded
two-entry TensorRT-LLM dump the CLI tests read."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import torch

import kvbridge
from kvbridge.dumps.dumpfile import HEADER_CHECKSUM, HEADER_CRC_OFFSET, HEADER_PREFIX, DumpEntry, header_crc32
from kvbridge.dumps.writer import write_dump


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


def seeded_trtllm_dump(path: Path) -> Path:
    """Two seeded ``trtllm-fp8`` entries (layer 0 SWA, 150 tokens at page size 128; layer 1 compressed,
    40 tokens at 32), scale 1.0, the ``swa`` dialect, written to ``path``."""
    g = torch.Generator().manual_seed(11)
    entries = []
    for layer, (role, n, p) in enumerate([("swa", 150, 128), ("compress", 40, 32)]):
        x = (torch.randn(n, 512, generator=g) * 2).bfloat16()
        pages = kvbridge.encode(x, "trtllm-fp8", page_size=p, dialect="swa")
        entries.append(DumpEntry(layer, role, pages, "trtllm-fp8", p, n, 1.0, "swa"))
    return write_dump(path, entries)
