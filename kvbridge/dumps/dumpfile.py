"""kvbridge dump files: the format, its entries, and the reader (the writer is ``kvbridge.dumps.writer``).

A dump is a safetensors file whose ``__metadata__`` carries the kvbridge header (see
``docs/format.md``): ``format`` = ``kvbridge-dump``, ``version`` (``3``; ``1`` and ``2`` still
read), ``entries``, a JSON list describing each tensor (``layer.{i}.{role}``): its kind (``pages``
of a registered layout, or raw ``latents`` ``[num_tokens, 512]``), layout, page size, token count,
per-tensor scale, encoder dialect, compress ratio and (versions 2, 3) the CRC-32 of its bytes,
and (version 3) ``header_crc32``, the CRC-32 of the header's own bytes, written first so that it
lies at a fixed offset (``HEADER_CRC_OFFSET``).

Reading verifies the header checksum before parsing the header (``DumpHeaderError`` when it fails;
version 1 and 2 headers read as ``header_verified = False``), validates every header field and
raises ``DumpFormatError`` with a one-line message naming the file and the entry; data is read
with ``pread`` (no memory map: a file truncated under a reader is an error, not SIGBUS), in chunks,
each entry's checksum verified as it is read.
"""

from __future__ import annotations

import json
import math
import os
import re
import stat
import struct
import zlib
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from kvbridge import numerics as nx
from kvbridge.errors import DumpFormatError, DumpHeaderError, InputError, KVBridgeError
from kvbridge.layouts import Layout, get_layout
from kvbridge.layouts.codec import HEAD_DIM
from kvbridge.ops.pages import decode

FORMAT_NAME = "kvbridge-dump"
FORMAT_VERSION = 3
SUPPORTED_VERSIONS = (1, 2, 3)
#: The per-tensor checksum of versions 2 and 3: CRC-32 (zlib / gzip / PNG polynomial) of the tensor's
#: bytes as stored, written as 8 lowercase hex digits (``zlib.crc32(data)``).
CHECKSUM = "crc32"
#: Version 3's ``__metadata__`` key of the header checksum (8 lowercase hex digits, see ``header_crc32``).
HEADER_CHECKSUM = "header_crc32"
#: The JSON every version-3 header begins with (file bytes 8..41); the checksum's digits follow.
HEADER_PREFIX = b'{"__metadata__":{"header_crc32":"'
#: File offset of the header checksum's 8 hex digits (bytes 41..49, then a closing quote).
HEADER_CRC_OFFSET = 8 + len(HEADER_PREFIX)
KINDS = ("pages", "latents")
#: safetensors dtype names accepted for raw latents, and the torch dtype each maps to.
LATENT_DTYPES = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32}
_DTYPE_NAMES = {torch.uint8: "U8", **{v: k for k, v in LATENT_DTYPES.items()}}
_TORCH_DTYPES = {"U8": torch.uint8, **LATENT_DTYPES}
#: Bytes per element of every safetensors dtype (a foreign dtype is still measured right).
_DTYPE_BYTES = {
    "BOOL": 1, "U8": 1, "I8": 1, "F8_E5M2": 1, "F8_E4M3": 1, "F8_E8M0": 1, "I16": 2, "U16": 2, "F16": 2,
    "BF16": 2, "I32": 4, "U32": 4, "F32": 4, "I64": 8, "U64": 8, "F64": 8,
}
_ROLE_PATTERN = re.compile(r"[a-z][a-z0-9_]*\Z")
_CRC_PATTERN = re.compile(r"[0-9a-f]{8}\Z")
_META_KEYS = (
    "name",
    "layer",
    "role",
    "kind",
    "layout",
    "page_size",
    "num_tokens",
    "scale",
    "dialect",
    "compress_ratio",
)
_ENTRY_KEYS = set(_META_KEYS)
#: ``__metadata__`` keys that are not free-form attributes.
RESERVED_KEYS = ("format", "version", "entries", HEADER_CHECKSUM)
_REQUIRED_KEYS = ("name", "layer", "role", "kind", "num_tokens")
#: safetensors headers larger than this are taken as a foreign file, not a dump.
_MAX_HEADER_BYTES = 100 * 2**20
#: Largest layer index, token count or dimension a header may state (beyond: not a real cache).
_MAX_INT = 2**48
#: Source bytes read per chunk when streaming an entry.
CHUNK_BYTES = 32 * 2**20

ProgressFn = Callable[[int, int], None]


def entry_name(layer: int, role: str) -> str:
    """Tensor name of the entry for ``layer`` and cache ``role``: ``layer.{layer}.{role}``."""
    return f"layer.{layer}.{role}"


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _short(v: Any) -> str:
    """``repr`` of a header value, cut to 40 characters (a 5000-digit number is not echoed)."""
    text = repr(v)
    return text if len(text) <= 40 else f"{text[:37]}..."


def header_crc32(head: bytes) -> int:
    """CRC-32 of a version-3 header: file bytes ``[0, 8 + N)`` (length prefix, JSON, padding) with the
    8 checksum digits at ``[HEADER_CRC_OFFSET, HEADER_CRC_OFFSET + 8)`` taken as ASCII ``0``."""
    at = HEADER_CRC_OFFSET
    return zlib.crc32(head[at + 8 :], zlib.crc32(b"0" * 8, zlib.crc32(head[:at])))


def _looks_like_v3(head: bytes) -> bool:
    """Whether a header that failed a check was written as version 3: its first bytes are (at most
    two bytes off) ``HEADER_PREFIX``, or its text says ``"version":"3"``."""
    start = head[8 : HEADER_CRC_OFFSET]
    close = sum(a != b for a, b in zip(start, HEADER_PREFIX, strict=False)) + len(HEADER_PREFIX) - len(start)
    return close <= 2 or b'"version":"3"' in head


def _fp32_scale(v: Any) -> float | None:
    """``v`` as its fp32 value when it is a positive finite fp32 number, else None."""
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return None
    try:
        s = float(torch.tensor(float(v), dtype=torch.float32))
    except (OverflowError, RuntimeError):
        return None
    return s if math.isfinite(s) and s > 0 else None


def entry_problem(meta: dict, dtype: str, shape: Sequence[int]) -> str | None:
    """What is wrong with one entry's metadata given its tensor's dtype name and shape (None: fine).

    ``meta`` is the entry's header dict; ``dtype`` a safetensors dtype name (``U8``, ``BF16``...).
    """
    unknown = sorted(str(k) for k in set(meta) - _ENTRY_KEYS)
    if unknown:
        return f"unknown key(s) {', '.join(map(_short, unknown))}"
    missing = [k for k in _REQUIRED_KEYS if k not in meta]
    if missing:
        return f"missing required key(s) {', '.join(map(repr, missing))}"
    layer, role, kind, n = meta["layer"], meta["role"], meta["kind"], meta["num_tokens"]
    if not _is_int(layer) or not 0 <= layer <= _MAX_INT:
        return f"layer must be a non-negative integer, got {_short(layer)}"
    if not isinstance(role, str) or not _ROLE_PATTERN.match(role):
        return f"role must match [a-z][a-z0-9_]*, got {_short(role)}"
    if meta["name"] != entry_name(layer, role):
        return (
            f"name {_short(meta['name'])} does not match layer {layer} and role {role!r} "
            f"(want {entry_name(layer, role)!r})"
        )
    ratio = meta.get("compress_ratio")
    if ratio is not None and (not _is_int(ratio) or not 0 <= ratio <= _MAX_INT):
        return f"compress_ratio must be a non-negative integer or null, got {_short(ratio)}"
    if not _is_int(n) or not 0 <= n <= _MAX_INT:
        return f"num_tokens must be a non-negative integer, got {_short(n)}"
    if len(shape) != 2:
        return f"tensor must be 2-D, got shape {list(shape)}"
    if kind == "latents":
        for key in ("layout", "page_size", "scale", "dialect"):
            if meta.get(key) is not None:
                return f"{key} must be null for a latents entry, got {_short(meta[key])}"
        if dtype not in LATENT_DTYPES:
            return f"latents must be {', '.join(LATENT_DTYPES)}, got dtype {dtype}"
        if shape[1] != HEAD_DIM or shape[0] != n:
            return f"latents shape {list(shape)} does not match [num_tokens={n}, {HEAD_DIM}]"
        return None
    if kind != "pages":
        return f"kind must be one of {', '.join(KINDS)}, got {_short(kind)}"
    return _pages_problem(meta, dtype, shape)


def _pages_problem(meta: dict, dtype: str, shape: Sequence[int]) -> str | None:
    name, p, n = meta.get("layout"), meta.get("page_size"), meta["num_tokens"]
    if not isinstance(name, str):
        return f"layout must be a layout name, got {_short(name)}"
    try:
        lay = get_layout(name)
    except KVBridgeError as exc:
        return str(exc)
    try:
        lay.check_page_size(p)
    except KVBridgeError as exc:
        return str(exc)
    if dtype != "U8":
        return f"{lay.name} pages must be uint8 (U8), got dtype {dtype}"
    want = lay.page_bytes(p)
    if shape[1] != want:
        return f"{lay.name} pages of {p} tokens are {want} bytes, tensor rows are {shape[1]} bytes"
    if n > shape[0] * p:
        return f"num_tokens={n} does not fit in {shape[0]} pages of {p} tokens"
    scale, dialect = meta.get("scale"), meta.get("dialect")
    if lay.per_tensor_scale:
        if isinstance(scale, bool) or not isinstance(scale, (int, float)):
            return f"{lay.name} needs a per-tensor scale (a positive finite number), got {_short(scale)}"
        if _fp32_scale(scale) is None:
            return f"scale must be a positive finite fp32 number, got {_short(scale)}"
    elif lay.nvfp4_global_scale:  # null: g = 1 (FlashInfer's DeepSeek-V4 record)
        s = _fp32_scale(scale)
        if scale is not None and (s is None or not nx.NVFP4_GLOBAL_SCALE_MIN <= s <= nx.NVFP4_GLOBAL_SCALE_MAX):
            return (f"scale of {lay.name} is its NVFP4 global scale: null (1) or an fp32 number in "
                    f"[2^-117, 2^116], got {_short(scale)}")
    elif scale is not None:
        return f"scale must be null for {lay.name} (it has per-tile scales), got {_short(scale)}"
    if dialect is not None and (not isinstance(dialect, str) or dialect not in lay.dialects):
        allowed = ", ".join(lay.dialects) or "none"
        return f"dialect {_short(dialect)} does not apply to {lay.name} (allowed: {allowed}, or null)"
    return None


@dataclass(frozen=True)
class DumpEntry:
    """One tensor of a dump: a pool of pages of ``layout``, or raw latents when ``layout`` is None.

    Pages are uint8 ``[num_pages, page_bytes(page_size)]`` holding ``num_tokens`` tokens (token t
    at page ``t // page_size``, row ``t % page_size``); latents are bf16/fp16/fp32
    ``[num_tokens, 512]``. ``scale`` is the per-tensor fp32 scale of ``trtllm-fp8`` (None for
    other layouts), stored as the fp32 value; ``dialect`` names the writer when known.
    Constructing validates everything.
    """

    layer: int
    role: str
    data: torch.Tensor
    layout: str | None = None
    page_size: int | None = None
    num_tokens: int | None = None
    scale: float | None = None
    dialect: str | None = None
    compress_ratio: int | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.data, torch.Tensor):
            raise InputError(f"data must be a torch.Tensor, got {type(self.data).__name__}")
        dtype = _DTYPE_NAMES.get(self.data.dtype)
        if dtype is None:
            raise InputError(f"data must be uint8 pages or bf16/fp16/fp32 latents, got {self.data.dtype}")
        if self.layout is not None:
            object.__setattr__(self, "layout", get_layout(self.layout).name)
            if self.num_tokens is None and self.data.dim() == 2 and _is_int(self.page_size):
                object.__setattr__(self, "num_tokens", self.data.shape[0] * self.page_size)
        elif self.num_tokens is None and self.data.dim() >= 1:
            object.__setattr__(self, "num_tokens", self.data.shape[0])
        if self.scale is None and self.layout is not None and get_layout(self.layout).per_tensor_scale:
            object.__setattr__(self, "scale", 1.0)
        elif _fp32_scale(self.scale) is not None:
            # the scale is an fp32 number (TensorRT-LLM's kv_cache_scaling_factor): store it exactly
            object.__setattr__(self, "scale", _fp32_scale(self.scale))
        problem = entry_problem(self.metadata(), dtype, list(self.data.shape))
        if problem:
            raise InputError(f"dump entry {entry_name(self.layer, self.role)}: {problem}")

    @property
    def name(self) -> str:
        return entry_name(self.layer, self.role)

    @property
    def kind(self) -> str:
        return "latents" if self.layout is None else "pages"

    @property
    def num_pages(self) -> int | None:
        return None if self.layout is None else int(self.data.shape[0])

    def metadata(self) -> dict:
        """The entry's header dict as written in the dump's ``entries`` list."""
        return {
            "name": self.name,
            "layer": self.layer,
            "role": self.role,
            "kind": self.kind,
            "layout": self.layout,
            "page_size": self.page_size,
            "num_tokens": self.num_tokens,
            "scale": self.scale,
            "dialect": self.dialect,
            "compress_ratio": self.compress_ratio,
        }

    def latents(self) -> torch.Tensor:
        """The entry's values as fp32 ``[num_tokens, 512]`` (pages are decoded exactly)."""
        if self.layout is None:
            return self.data.float()
        return decode(self.data, self.layout, page_size=self.page_size, num_tokens=self.num_tokens, scale=self.scale)


@dataclass
class Dump:
    """A dump's entries (in file order), extra string attributes, the file it came from,
    (versions 2, 3) each entry's verified CRC-32 by name, and whether its header was verified:
    True for a version-3 file (its ``header_crc32`` matched), False for versions 1 and 2 (their
    header has no checksum: an edited scale or layout reads as written), None when not read from a file."""

    entries: list[DumpEntry]
    attrs: dict[str, str] = field(default_factory=dict)
    version: int = FORMAT_VERSION
    path: Path | None = None
    checksums: dict[str, int] = field(default_factory=dict)
    header_verified: bool | None = None

    @property
    def names(self) -> list[str]:
        return [e.name for e in self.entries]

    def __getitem__(self, name: str) -> DumpEntry:
        for e in self.entries:
            if e.name == name:
                return e
        raise KeyError(f"no entry {name!r} in dump; entries: {', '.join(self.names) or 'none'}")

    def __iter__(self):
        return iter(self.entries)

    def __len__(self) -> int:
        return len(self.entries)

    def latents(self) -> dict[str, torch.Tensor]:
        """Decoded fp32 ``[num_tokens, 512]`` values of every entry, by entry name."""
        return {e.name: e.latents() for e in self.entries}


# ------------------------------------------------------------------------------------ reading


@dataclass(frozen=True)
class EntryInfo:
    """One entry as its header describes it: validated metadata, dtype, shape, where its bytes are."""

    meta: dict
    dtype: str
    shape: tuple[int, int]
    offset: int  # byte offset of the tensor data in the file
    nbytes: int
    crc32: int | None  # versions 2, 3: the stored checksum; version 1: None

    @property
    def name(self) -> str:
        return self.meta["name"]

    @property
    def layout(self) -> Layout | None:
        return None if self.meta["kind"] == "latents" else get_layout(self.meta["layout"])

    @property
    def num_tokens(self) -> int:
        return self.meta["num_tokens"]

    @property
    def row_bytes(self) -> int:
        return self.nbytes // self.shape[0] if self.shape[0] else 0


def _fail(path: Path, message: str) -> DumpFormatError:
    return DumpFormatError(f"{path}: {message}")


def _tensor_info(path: Path, name: Any, info: Any) -> tuple[str, tuple[int, ...], int, int]:
    """Validated ``(dtype, shape, begin, end)`` of one safetensors header entry."""
    if not isinstance(info, dict) or set(info) != {"dtype", "shape", "data_offsets"}:
        raise _fail(path, f"malformed safetensors header entry for tensor {_short(name)}")
    dtype, shape, offsets = info["dtype"], info["shape"], info["data_offsets"]
    ok_shape = isinstance(shape, list) and all(_is_int(d) and 0 <= d <= _MAX_INT for d in shape)
    ok_offsets = isinstance(offsets, list) and len(offsets) == 2 and all(_is_int(o) for o in offsets)
    if not (isinstance(dtype, str) and dtype in _DTYPE_BYTES and ok_shape and ok_offsets):
        raise _fail(path, f"malformed safetensors header entry for tensor {_short(name)}")
    begin, end = offsets
    want = math.prod(shape) * _DTYPE_BYTES[dtype]
    if not 0 <= begin <= end or end - begin != want:
        raise _fail(path, f"tensor {_short(name)}: data_offsets {_short(offsets)} do not hold {dtype} {shape}")
    return dtype, tuple(shape), begin, end


def _parse_json(raw: bytes | str, path: Path, what: str) -> Any:
    try:
        return json.loads(raw)
    except (UnicodeDecodeError, ValueError, RecursionError):  # JSONDecodeError, or a 5000-digit number
        raise _fail(path, f"{what} is not valid JSON") from None


class DumpFile:
    """An open dump: its validated header, and its entries' bytes read on demand with ``pread``.

    Use as a context manager (or call ``close``). ``entries`` are ``EntryInfo`` in file order;
    ``header_verified`` is True when the header's checksum (version 3) matched, False for a version 1
    or 2 header (no checksum). Every read checks that the file has not changed size or modification
    time since it was opened.
    """

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        try:
            # O_NONBLOCK: opening a FIFO or a tty does not wait for a writer; only regular files pass below
            self._fd = os.open(self.path, os.O_RDONLY | os.O_NONBLOCK)
        except FileNotFoundError:
            raise DumpFormatError(f"{self.path}: no such file") from None
        except IsADirectoryError:
            raise DumpFormatError(f"{self.path}: is a directory, not a dump file") from None
        except OSError as exc:
            raise DumpFormatError(f"{self.path}: cannot be read ({exc.strerror})") from None
        try:
            st = os.fstat(self._fd)
            if stat.S_ISDIR(st.st_mode):
                raise DumpFormatError(f"{self.path}: is a directory, not a dump file")
            if not stat.S_ISREG(st.st_mode):
                raise DumpFormatError(f"{self.path}: is {_file_kind(st.st_mode)}, not a regular file; a dump is "
                                      "read from a regular file (copy it to one first)")
            os.set_blocking(self._fd, True)
            self._stamp = (st.st_size, st.st_mtime_ns)
            self._parse(st.st_size)
        except BaseException:
            os.close(self._fd)
            raise

    # -- header
    def _parse(self, size: int) -> None:
        path = self.path
        head = self._pread(0, min(HEADER_CRC_OFFSET, size)) if size else b""
        if len(head) < 8:
            raise _fail(path, f"not a safetensors file (only {size} bytes)")
        (hlen,) = struct.unpack("<Q", head[:8])
        if hlen > _MAX_HEADER_BYTES:
            if _looks_like_v3(head):
                raise self._header_error(f"its length field says {hlen} bytes")
            raise _fail(path, "not a safetensors file (its first 8 bytes are not a plausible header length)")
        if 8 + hlen > size:
            if _looks_like_v3(head):
                raise self._header_error(f"its {hlen}-byte header does not fit in the file's {size} bytes")
            raise DumpHeaderError(f"{path}: truncated: the {hlen}-byte header does not fit in the file's {size} "
                                  "bytes (the file was cut short: copy it again from its source)")
        raw = self._pread(8, hlen)
        self.header_verified = self._check_header(head[:8] + raw)
        try:
            self._parse_header(raw, size, hlen)
        except DumpHeaderError:
            raise
        except DumpFormatError as exc:
            if not self.header_verified and _looks_like_v3(head + raw):
                raise self._header_error(str(exc).removeprefix(f"{path}: ")) from None
            raise

    def _header_error(self, problem: str) -> DumpHeaderError:
        return DumpHeaderError(
            f"{self.path}: the version-3 header fails its check ({problem}): it was edited or damaged after it "
            "was written, so its scales, layouts and sizes cannot be trusted; copy the file again from its "
            "source or write it anew"
        )

    def _check_header(self, head: bytes) -> bool:
        """Verify the header checksum when the header begins with one (``HEADER_PREFIX``); True when it
        matched, False when the header has none (versions 1, 2: checked after parsing)."""
        if not head[8:].startswith(HEADER_PREFIX):
            return False
        at = HEADER_CRC_OFFSET
        stored = head[at : at + 9]
        if len(stored) < 9 or not _CRC_PATTERN.match(stored[:8].decode("latin-1")) or stored[8:] != b'"':
            raise self._header_error(f"'{HEADER_CHECKSUM}' is not 8 lowercase hex digits")
        want, got = int(stored[:8], 16), header_crc32(head)
        if want != got:
            raise self._header_error(f"stored {HEADER_CHECKSUM} {want:08x}, the header has {got:08x}")
        return True

    def _parse_header(self, raw: bytes, size: int, hlen: int) -> None:
        path = self.path
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError:
            raise _fail(path, "not a safetensors file (header is not JSON)") from None
        try:
            header = json.loads(text)
        except (ValueError, RecursionError):
            raise _fail(path, "not a safetensors file (header is not JSON)") from None
        if not isinstance(header, dict):
            raise _fail(path, "not a safetensors file (header is not a JSON object)")
        tensors = {}
        for name, info in header.items():
            if name != "__metadata__":
                tensors[name] = _tensor_info(path, name, info)
        spans = sorted((b, e, n) for n, (_, _, b, e) in tensors.items())
        at = 0
        for begin, end, name in spans:
            if begin != at:
                raise _fail(path, f"tensor {_short(name)}: data_offsets leave a gap or overlap at byte {at}")
            at = end
        have = size - 8 - hlen
        if have < at:
            raise _fail(path, f"truncated: header promises {at} bytes of tensor data, file holds {have}")
        if have > at:
            raise _fail(path, f"{have - at} unexpected trailing bytes after the tensor data")
        self.data_bytes = at
        self.version, metas, self.attrs = self._kvbridge_header(header.get("__metadata__"))
        self.entries = self._entry_infos(metas, tensors, 8 + hlen)

    def _kvbridge_header(self, meta: Any) -> tuple[int, list[dict], dict[str, str]]:
        path = self.path
        if meta is None:
            meta = {}
        if not isinstance(meta, dict) or not all(isinstance(v, str) for v in meta.values()):
            raise _fail(path, "malformed safetensors header: __metadata__ must map strings to strings")
        if "format" not in meta:
            raise _fail(
                path, "not a kvbridge dump (a safetensors file without the kvbridge header: no 'format' metadata)"
            )
        if meta["format"] != FORMAT_NAME:
            raise _fail(path, f"not a kvbridge dump (format is {_short(meta['format'])}, expected {FORMAT_NAME!r})")
        version = meta.get("version")
        if version is None:
            raise _fail(path, "kvbridge header has no 'version'")
        if version not in {str(v) for v in SUPPORTED_VERSIONS}:
            readable = ", ".join(map(str, SUPPORTED_VERSIONS))
            raise _fail(path, f"unsupported dump version {_short(version)} (this kvbridge reads versions {readable})")
        if int(version) >= 3 and not self.header_verified:
            raise self._header_error(f"it does not begin with its '{HEADER_CHECKSUM}'")
        if HEADER_CHECKSUM in meta and not self.header_verified:
            raise self._header_error(f"'{HEADER_CHECKSUM}' is not the header's first key")
        if "entries" not in meta:
            raise _fail(path, "kvbridge header has no 'entries'")
        entries = _parse_json(meta["entries"], path, "kvbridge header 'entries'")
        if not isinstance(entries, list) or not all(isinstance(e, dict) for e in entries):
            raise _fail(path, "kvbridge header 'entries' must be a JSON list of objects")
        attrs = {k: v for k, v in meta.items() if k not in RESERVED_KEYS}
        return int(version), entries, attrs

    def _entry_infos(self, metas: list[dict], tensors: dict, data_start: int) -> list[EntryInfo]:
        path = self.path
        infos: list[EntryInfo] = []
        listed: set[str] = set()
        for i, raw_meta in enumerate(metas):
            meta = dict(raw_meta)
            name = meta.get("name")
            if not isinstance(name, str):
                raise _fail(path, f"entry {i} has no name")
            if name in listed:
                raise _fail(path, f"entry {name!r} is listed twice")
            if name not in tensors:
                raise _fail(path, f"entry {name!r} is listed in the header but the file has no such tensor")
            crc = meta.pop(CHECKSUM, None)
            if self.version >= 2:
                if not isinstance(crc, str) or not _CRC_PATTERN.match(crc):
                    raise _fail(path, f"entry {name}: '{CHECKSUM}' must be 8 lowercase hex digits, got {_short(crc)}")
            elif crc is not None:
                raise _fail(path, f"entry {name}: unknown key(s) '{CHECKSUM}' (version 1 has no checksums)")
            dtype, shape, begin, end = tensors[name]
            problem = entry_problem(meta, dtype, shape)
            if problem:
                raise _fail(path, f"entry {name}: {problem}")
            listed.add(name)
            info = EntryInfo(meta, dtype, (shape[0], shape[1]), data_start + begin, end - begin,
                             None if crc is None else int(crc, 16))
            infos.append(info)
        extra = sorted(set(tensors) - listed)
        if extra:
            raise _fail(path, f"tensor {_short(extra[0])} is not listed in the kvbridge header")
        return infos

    # -- data
    def _pread(self, offset: int, nbytes: int, into: memoryview | None = None) -> bytes | memoryview:
        buf = memoryview(bytearray(nbytes)) if into is None else into
        done = 0
        while done < nbytes:
            got = os.preadv(self._fd, [buf[done:]], offset + done)
            if got == 0:
                raise _fail(self.path, f"changed while being read: ended at byte {offset + done}")
            done += got
        return bytes(buf) if into is None else buf

    def check_unchanged(self) -> None:
        """Raise ``DumpFormatError`` when the file's size or modification time changed since opened."""
        st = os.fstat(self._fd)
        if (st.st_size, st.st_mtime_ns) != self._stamp:
            raise _fail(self.path, f"changed while being read (was {self._stamp[0]} bytes, now {st.st_size})")

    def read_rows(self, info: EntryInfo, start: int, stop: int, into: torch.Tensor | None = None) -> torch.Tensor:
        """Rows ``[start, stop)`` of ``info``'s tensor, freshly read (no checksum check), into the
        first rows of ``into`` when given (a contiguous tensor of the entry's dtype and row size)."""
        rows = max(0, stop - start)
        if into is None:
            out = torch.empty((rows, info.shape[1]), dtype=_TORCH_DTYPES.get(info.dtype, torch.uint8))
        else:
            out = into[:rows]
        nbytes = rows * info.row_bytes
        if nbytes:
            self.check_unchanged()
            view = memoryview(out.view(torch.uint8).numpy()).cast("B")
            self._pread(info.offset + start * info.row_bytes, nbytes, into=view)
        return out

    def iter_rows(self, info: EntryInfo, rows_per_chunk: int, *, reuse: bool = False
                  ) -> Iterator[tuple[int, torch.Tensor]]:
        """``(first_row, rows)`` chunks covering every row of ``info`` in order; after the last one
        the CRC-32 of all the bytes read is checked against the stored one (version 2). The next
        chunk is read (and its CRC computed) on a helper thread while the caller works on this one.
        ``reuse``: chunks are read into two buffers in turn (no fresh memory per chunk), so a chunk is
        valid only until the next one is asked for."""
        step = max(1, rows_per_chunk)
        starts = range(0, info.shape[0], step)
        crc = 0
        dtype = _TORCH_DTYPES.get(info.dtype, torch.uint8)
        buffers = [torch.empty((min(step, info.shape[0]), info.shape[1]), dtype=dtype) for _ in range(2)] if (
            reuse and starts) else None

        def read(start: int, i: int) -> torch.Tensor:
            nonlocal crc
            into = None if buffers is None else buffers[i % 2]
            rows = self.read_rows(info, start, min(info.shape[0], start + step), into=into)
            crc = zlib.crc32(rows.view(torch.uint8).numpy(), crc)  # in order: one worker
            return rows

        with ThreadPoolExecutor(1, thread_name_prefix="kvbridge-read") as pool:
            ahead = pool.submit(read, starts[0], 0) if starts else None
            for i, start in enumerate(starts):
                rows = ahead.result()
                ahead = pool.submit(read, starts[i + 1], i + 1) if i + 1 < len(starts) else None
                yield start, rows
        self.check_checksum(info, crc)

    def check_checksum(self, info: EntryInfo, crc: int) -> None:
        """Raise ``DumpFormatError`` naming the entry unless ``crc`` is its stored checksum."""
        if info.crc32 is not None and crc != info.crc32:
            raise _fail(
                self.path,
                f"entry {info.name}: checksum mismatch (stored {CHECKSUM} {info.crc32:08x}, data has {crc:08x}): "
                "the file is corrupted",
            )

    def load(self, info: EntryInfo) -> DumpEntry:
        """The whole entry in memory, its checksum verified."""
        data = self.read_rows(info, 0, info.shape[0])
        self.check_checksum(info, zlib.crc32(data.view(torch.uint8).numpy()))
        m = info.meta
        kwargs = {k: m.get(k) for k in ("layout", "page_size", "num_tokens", "scale", "dialect", "compress_ratio")}
        try:
            return DumpEntry(m["layer"], m["role"], data, **kwargs)
        except InputError as exc:
            raise _fail(self.path, str(exc)) from None

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def __enter__(self) -> DumpFile:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def open_dump(path: str | os.PathLike) -> DumpFile:
    """Open and validate dump ``path`` (header only; entries are read on demand)."""
    if not isinstance(path, (str, os.PathLike)):
        raise InputError(f"path must be a str or os.PathLike, got {type(path).__name__}")
    return DumpFile(path)


def read_dump(path: str | os.PathLike) -> Dump:
    """Read and validate a whole dump file (checksums verified); every problem raises ``DumpFormatError``
    (``DumpHeaderError`` when a version-3 header fails its checksum)."""
    with open_dump(path) as fh:
        entries = [fh.load(info) for info in fh.entries]
        checksums = {i.name: i.crc32 for i in fh.entries if i.crc32 is not None}
        return Dump(entries, attrs=fh.attrs, version=fh.version, path=fh.path, checksums=checksums,
                    header_verified=fh.header_verified)


def _file_kind(mode: int) -> str:
    """What a non-regular file is, in words (for refusals)."""
    for test, name in ((stat.S_ISFIFO, "a named pipe (FIFO)"), (stat.S_ISCHR, "a character device"),
                       (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"), (stat.S_ISLNK, "a symbolic link"),
                       (stat.S_ISDIR, "a directory")):
        if test(mode):
            return name
    return "not a regular file"


def tokens_per_chunk(row_tokens: int, row_bytes: int, multiple: int = 1) -> int:
    """Tokens per streamed chunk: about ``CHUNK_BYTES`` of source, a multiple of ``row_tokens`` and ``multiple``."""
    step = math.lcm(row_tokens, multiple)
    rows_per_step = step // row_tokens
    steps = max(1, CHUNK_BYTES // max(1, rows_per_step * row_bytes))
    return step * steps


__all__ = [
    "CHECKSUM",
    "CHUNK_BYTES",
    "FORMAT_NAME",
    "FORMAT_VERSION",
    "HEADER_CHECKSUM",
    "HEADER_CRC_OFFSET",
    "HEADER_PREFIX",
    "LATENT_DTYPES",
    "Dump",
    "DumpEntry",
    "DumpFile",
    "EntryInfo",
    "entry_name",
    "header_crc32",
    "open_dump",
    "read_dump",
    "tokens_per_chunk",
]
