"""kvbridge dump files: KV-cache pools (or raw latents) on disk, one safetensors file per request.

A dump is a safetensors file whose ``__metadata__`` carries the kvbridge header (see
``docs/format.md``): ``format`` = ``kvbridge-dump``, ``version`` = ``1`` and ``entries``, a JSON
list describing each tensor (``layer.{i}.{role}``): its kind (``pages`` of a registered layout,
or raw ``latents`` ``[num_tokens, 512]``), layout, page size, token count, per-tensor scale,
encoder dialect and compress ratio. ``read_dump`` validates all of it and raises
``DumpFormatError`` with a one-line message; ``write_dump`` writes atomically (temp file in the
same directory, then ``os.replace``).
"""

from __future__ import annotations

import json
import math
import os
import re
import struct
import uuid
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from kvbridge.api import LossReport, auto_scale, count_saturated, decode, encode, measure_loss, transcode
from kvbridge.codecs import HEAD_DIM
from kvbridge.errors import DumpFormatError, InputError, KVBridgeError
from kvbridge.layouts import Layout, get_layout

FORMAT_NAME = "kvbridge-dump"
FORMAT_VERSION = 1
SUPPORTED_VERSIONS = (1,)
KINDS = ("pages", "latents")
#: safetensors dtype names accepted for raw latents, and the torch dtype each maps to.
LATENT_DTYPES = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32}
_DTYPE_NAMES = {torch.uint8: "U8", **{v: k for k, v in LATENT_DTYPES.items()}}
_ROLE_PATTERN = re.compile(r"[a-z][a-z0-9_]*\Z")
_ENTRY_KEYS = {
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
}
_REQUIRED_KEYS = ("name", "layer", "role", "kind", "num_tokens")
#: safetensors headers larger than this are taken as a foreign file, not a dump.
_MAX_HEADER_BYTES = 100 * 2**20


def entry_name(layer: int, role: str) -> str:
    """Tensor name of the entry for ``layer`` and cache ``role``: ``layer.{layer}.{role}``."""
    return f"layer.{layer}.{role}"


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def entry_problem(meta: dict, dtype: str, shape: Sequence[int]) -> str | None:
    """What is wrong with one entry's metadata given its tensor's dtype name and shape (None: fine).

    ``meta`` is the entry's header dict; ``dtype`` a safetensors dtype name (``U8``, ``BF16``...).
    """
    unknown = sorted(set(meta) - _ENTRY_KEYS)
    if unknown:
        return f"unknown key(s) {', '.join(map(repr, unknown))}"
    missing = [k for k in _REQUIRED_KEYS if k not in meta]
    if missing:
        return f"missing required key(s) {', '.join(map(repr, missing))}"
    layer, role, kind, n = meta["layer"], meta["role"], meta["kind"], meta["num_tokens"]
    if not _is_int(layer) or layer < 0:
        return f"layer must be a non-negative integer, got {layer!r}"
    if not isinstance(role, str) or not _ROLE_PATTERN.match(role):
        return f"role must match [a-z][a-z0-9_]*, got {role!r}"
    if meta["name"] != entry_name(layer, role):
        return (
            f"name {meta['name']!r} does not match layer {layer} and role {role!r} (want {entry_name(layer, role)!r})"
        )
    ratio = meta.get("compress_ratio")
    if ratio is not None and (not _is_int(ratio) or ratio < 0):
        return f"compress_ratio must be a non-negative integer or null, got {ratio!r}"
    if not _is_int(n) or n < 0:
        return f"num_tokens must be a non-negative integer, got {n!r}"
    if len(shape) != 2:
        return f"tensor must be 2-D, got shape {list(shape)}"
    if kind == "latents":
        for key in ("layout", "page_size", "scale", "dialect"):
            if meta.get(key) is not None:
                return f"{key} must be null for a latents entry, got {meta[key]!r}"
        if dtype not in LATENT_DTYPES:
            return f"latents must be {', '.join(LATENT_DTYPES)}, got dtype {dtype}"
        if shape[1] != HEAD_DIM or shape[0] != n:
            return f"latents shape {list(shape)} does not match [num_tokens={n}, {HEAD_DIM}]"
        return None
    if kind != "pages":
        return f"kind must be one of {', '.join(KINDS)}, got {kind!r}"
    return _pages_problem(meta, dtype, shape)


def _pages_problem(meta: dict, dtype: str, shape: Sequence[int]) -> str | None:
    name, p, n = meta.get("layout"), meta.get("page_size"), meta["num_tokens"]
    if not isinstance(name, str):
        return f"layout must be a layout name, got {name!r}"
    try:
        lay = get_layout(name)
    except KVBridgeError as exc:
        return str(exc)
    if not _is_int(p) or p < 1:
        return f"page_size must be a positive integer, got {p!r}"
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
            return f"{lay.name} needs a per-tensor scale (a positive finite number), got {scale!r}"
        s32 = float(torch.tensor(float(scale), dtype=torch.float32))
        if not (math.isfinite(s32) and s32 > 0):
            return f"scale must be a positive finite fp32 number, got {scale!r}"
    elif scale is not None:
        return f"scale must be null for {lay.name} (it has per-tile scales), got {scale!r}"
    if dialect is not None and dialect not in lay.dialects:
        allowed = ", ".join(lay.dialects) or "none"
        return f"dialect {dialect!r} does not apply to {lay.name} (allowed: {allowed}, or null)"
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
        elif isinstance(self.scale, (int, float)) and not isinstance(self.scale, bool):
            # the scale is an fp32 number (TensorRT-LLM's kv_cache_scaling_factor): store it exactly
            object.__setattr__(self, "scale", float(torch.tensor(float(self.scale), dtype=torch.float32)))
        problem = entry_problem(self.metadata(), dtype, list(self.data.shape))
        if problem:
            raise InputError(f"dump entry {self.name}: {problem}")

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
    """A dump's entries (in file order), extra string attributes, and the file it came from."""

    entries: list[DumpEntry]
    attrs: dict[str, str] = field(default_factory=dict)
    version: int = FORMAT_VERSION
    path: Path | None = None

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


def _fail(path: Path, message: str) -> DumpFormatError:
    return DumpFormatError(f"{path}: {message}")


def _read_header(path: Path) -> tuple[dict, int]:
    """Parse the safetensors header of ``path``; return it and the byte count of tensor data."""
    try:
        size = path.stat().st_size
        with path.open("rb") as fh:
            head = fh.read(8)
            if len(head) < 8:
                raise _fail(path, f"not a safetensors file (only {size} bytes)")
            (hlen,) = struct.unpack("<Q", head)
            if hlen > _MAX_HEADER_BYTES:
                raise _fail(path, "not a safetensors file (its first 8 bytes are not a plausible header length)")
            if 8 + hlen > size:
                raise _fail(path, f"truncated: the {hlen}-byte header does not fit in the file's {size} bytes")
            raw = fh.read(hlen)
    except FileNotFoundError:
        raise DumpFormatError(f"{path}: no such file") from None
    except IsADirectoryError:
        raise DumpFormatError(f"{path}: is a directory, not a dump file") from None
    try:
        header = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError):
        raise _fail(path, "not a safetensors file (header is not JSON)") from None
    if not isinstance(header, dict):
        raise _fail(path, "not a safetensors file (header is not a JSON object)")
    data_bytes = 0
    for name, info in header.items():
        if name == "__metadata__":
            continue
        try:
            begin, end = info["data_offsets"]
            data_bytes = max(data_bytes, int(end))
        except (KeyError, TypeError, ValueError):
            raise _fail(path, f"malformed safetensors header entry for tensor {name!r}") from None
    have = size - 8 - hlen
    if have < data_bytes:
        raise _fail(path, f"truncated: header promises {data_bytes} bytes of tensor data, file holds {have}")
    if have > data_bytes:
        raise _fail(path, f"{have - data_bytes} unexpected trailing bytes after the tensor data")
    return header, data_bytes


def _parse_header(path: Path, header: dict) -> tuple[int, list[dict], dict[str, str]]:
    meta = header.get("__metadata__") or {}
    if not isinstance(meta, dict) or "format" not in meta:
        raise _fail(path, "not a kvbridge dump (a safetensors file without the kvbridge header: no 'format' metadata)")
    if meta["format"] != FORMAT_NAME:
        raise _fail(path, f"not a kvbridge dump (format is {meta['format']!r}, expected {FORMAT_NAME!r})")
    version = meta.get("version")
    if version is None:
        raise _fail(path, "kvbridge header has no 'version'")
    if version not in {str(v) for v in SUPPORTED_VERSIONS}:
        raise _fail(path, f"unsupported dump version {version!r} (this kvbridge reads version {FORMAT_VERSION})")
    if "entries" not in meta:
        raise _fail(path, "kvbridge header has no 'entries'")
    try:
        entries = json.loads(meta["entries"])
    except json.JSONDecodeError:
        raise _fail(path, "kvbridge header 'entries' is not valid JSON") from None
    if not isinstance(entries, list) or not all(isinstance(e, dict) for e in entries):
        raise _fail(path, "kvbridge header 'entries' must be a JSON list of objects")
    attrs = {k: v for k, v in meta.items() if k not in ("format", "version", "entries")}
    return int(version), entries, attrs


def read_dump(path: str | os.PathLike) -> Dump:
    """Read and validate a dump file; every inconsistency raises ``DumpFormatError``."""
    path = Path(path)
    header, _ = _read_header(path)
    version, metas, attrs = _parse_header(path, header)
    tensors = {k: v for k, v in header.items() if k != "__metadata__"}
    listed = []
    for i, meta in enumerate(metas):
        name = meta.get("name")
        if not isinstance(name, str):
            raise _fail(path, f"entry {i} has no name")
        if name in listed:
            raise _fail(path, f"entry {name!r} is listed twice")
        if name not in tensors:
            raise _fail(path, f"entry {name!r} is listed in the header but the file has no such tensor")
        info = tensors[name]
        problem = entry_problem(meta, info.get("dtype"), info.get("shape", []))
        if problem:
            raise _fail(path, f"entry {name}: {problem}")
        listed.append(name)
    extra = sorted(set(tensors) - set(listed))
    if extra:
        raise _fail(path, f"tensor {extra[0]!r} is not listed in the kvbridge header")
    entries = []
    try:
        with safe_open(str(path), "pt") as fh:
            for meta in metas:
                kwargs = {
                    k: meta.get(k) for k in ("layout", "page_size", "num_tokens", "scale", "dialect", "compress_ratio")
                }
                entries.append(DumpEntry(meta["layer"], meta["role"], fh.get_tensor(meta["name"]), **kwargs))
    except SafetensorError as exc:
        raise _fail(path, f"unreadable safetensors data ({exc})") from None
    except InputError as exc:
        raise _fail(path, str(exc)) from None
    return Dump(entries, attrs=attrs, version=version, path=path)


def _new_file_mode() -> int:
    """Permission bits a newly created file gets under the process umask (0o666 & ~umask)."""
    umask = os.umask(0o022)
    os.umask(umask)
    return 0o666 & ~umask


def write_dump(
    path: str | os.PathLike,
    entries: Dump | Iterable[DumpEntry],
    *,
    overwrite: bool = False,
    attrs: dict[str, str] | None = None,
) -> Path:
    """Write ``entries`` to ``path`` atomically (temp file in the same directory + ``os.replace``).

    Refuses an existing ``path`` unless ``overwrite``. ``attrs`` adds free-form string
    attributes to the header (a ``Dump``'s own ``attrs`` are kept).
    """
    path = Path(path)
    items = list(entries)
    extra = dict(entries.attrs) if isinstance(entries, Dump) else {}
    extra.update(attrs or {})
    names = [e.name for e in items]
    dup = next((n for n in names if names.count(n) > 1), None)
    if dup is not None:
        raise InputError(f"dump entries: {dup!r} appears twice")
    reserved = {"format", "version", "entries"} & set(extra)
    if reserved or not all(isinstance(k, str) and isinstance(v, str) for k, v in extra.items()):
        raise InputError(f"attrs must map str to str and not use {', '.join(sorted(reserved)) or 'reserved keys'}")
    if path.exists() and not overwrite:
        raise InputError(f"output {path} exists; pass overwrite=True (CLI: --force) to replace it")
    if not path.parent.is_dir():
        raise InputError(f"output directory {path.parent} does not exist")
    from kvbridge import __version__

    metadata = {
        "format": FORMAT_NAME,
        "version": str(FORMAT_VERSION),
        "entries": json.dumps([e.metadata() for e in items]),
        "created_by": f"kvbridge {__version__}",
        **extra,
    }
    tensors: dict[str, torch.Tensor] = {}
    storages: set[int] = set()
    for e in items:
        t = e.data.detach().to("cpu").contiguous()
        ptr = t.untyped_storage().data_ptr()
        if ptr in storages:  # safetensors refuses tensors sharing memory (e.g. slices of one pool)
            t = t.clone()
        storages.add(t.untyped_storage().data_ptr())
        tensors[e.name] = t
    # A fresh hidden name in the same directory: same filesystem, so os.replace is atomic.
    tmp = path.parent / f".{path.name}.{uuid.uuid4().hex}.tmp"
    try:
        save_file(tensors, str(tmp), metadata=metadata)
        os.chmod(tmp, _new_file_mode())  # save_file creates 0600; give the dump the usual umask mode
        with open(tmp, "rb+") as fh:
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except SafetensorError as exc:  # safetensors reports I/O failures (disk full, no permission) this way
        tmp.unlink(missing_ok=True)
        raise OSError(f"could not write {path}: {exc}") from None
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return path


def _bf16_bits(raw: torch.Tensor) -> torch.Tensor:
    pairs = raw.reshape(*raw.shape[:-1], raw.shape[-1] // 2, 2).to(torch.int32)
    return pairs[..., 0] | (pairs[..., 1] << 8)


def entry_stats(entry: DumpEntry) -> dict:
    """Byte-level statistics of an entry's first ``num_tokens`` tokens.

    ``nan``: NaN codes per field format (E4M3 0x7F/0xFF, UE8M0 0xFF, bf16 NaN); ``inf``: bf16
    infinities; ``saturated``: E4M3 codes at +-448 (0x7E/0xFE); ``scale_exponents``: histogram
    {k: count} of the UE8M0 tile scales 2^k (per-tile layouts only); ``abs_max``: the largest
    finite |decoded value|.
    """
    stats: dict[str, Any] = {
        **entry.metadata(),
        "num_pages": entry.num_pages,
        "nbytes": entry.data.numel() * entry.data.element_size(),
    }
    values = entry.latents()
    finite = values[torch.isfinite(values)]
    stats["abs_max"] = float(finite.abs().max()) if finite.numel() else 0.0
    if entry.layout is None:
        stats["dtype"] = str(entry.data.dtype).removeprefix("torch.")
        stats.update(
            nan={"latents": int(torch.isnan(values).sum())},
            inf=int(torch.isinf(values).sum()),
            saturated=0,
            scale_exponents=None,
        )
        return stats
    lay = get_layout(entry.layout)
    records = lay.pages_to_records(entry.data, entry.page_size, entry.num_tokens)
    nan: dict[str, int] = {}
    inf = saturated = 0
    histogram: dict[int, int] | None = None
    for f in lay.fields:
        raw = records[:, f.offset : f.offset + f.nbytes]
        if f.format == "e4m3":
            mag = raw & 0x7F
            nan["e4m3"] = nan.get("e4m3", 0) + int((mag == 0x7F).sum())
            saturated += int((mag == 0x7E).sum())
        elif f.format == "ue8m0":
            nan["ue8m0"] = nan.get("ue8m0", 0) + int((raw == 0xFF).sum())
            exps, counts = torch.unique(raw[raw != 0xFF].to(torch.int64) - 127, return_counts=True)
            histogram = {int(k): int(c) for k, c in zip(exps, counts, strict=True)}
        elif f.format == "bf16":
            bits = _bf16_bits(raw)
            exp_all_ones = (bits & 0x7F80) == 0x7F80
            nan["bf16"] = nan.get("bf16", 0) + int((exp_all_ones & ((bits & 0x7F) != 0)).sum())
            inf += int((exp_all_ones & ((bits & 0x7F) == 0)).sum())
    stats.update(nan=nan, inf=inf, saturated=saturated, scale_exponents=histogram)
    return stats


@dataclass
class ConvertedEntry:
    """What ``convert_dump`` did to one entry: its name and the transcode's loss report."""

    name: str
    report: LossReport


def convert_entry(
    entry: DumpEntry,
    to_layout: str | Layout,
    *,
    page_size: int | None = None,
    dialect: str | None = None,
    scale: float | str | None = None,
) -> tuple[DumpEntry, LossReport]:
    """Convert one entry to ``to_layout``; ``page_size`` defaults to the entry's (required for latents)."""
    dst = get_layout(to_layout)
    if entry.layout is None:
        if page_size is None:
            raise InputError(f"entry {entry.name} holds raw latents: page_size is needed to encode it")
        p = page_size
        values = entry.data.float()
        s = auto_scale(values) if scale == "auto" else scale
        pages = encode(values, dst, page_size=p, dialect=dialect, scale=s)
        s_out = (
            (1.0 if s is None else float(torch.tensor(float(s), dtype=torch.float32))) if dst.per_tensor_scale else None
        )
        back = decode(pages, dst, page_size=p, num_tokens=entry.num_tokens, scale=s_out)
        d = dialect or dst.default_dialect
        rep = measure_loss(
            values,
            back,
            src_layout="latents",
            dst_layout=dst.name,
            dst_scale=s_out,
            byte_move=False,
            saturated=count_saturated(values, dst, d, s_out or 1.0),
        )
    else:
        p = entry.page_size if page_size is None else page_size
        pages, rep = transcode(
            entry.data,
            entry.layout,
            dst,
            src_page_size=entry.page_size,
            dst_page_size=p,
            num_tokens=entry.num_tokens,
            src_scale=entry.scale,
            dst_scale=scale,
            dialect=dialect,
            report=True,
        )
        d = entry.dialect if rep.byte_move else (dialect or dst.default_dialect)
    out = DumpEntry(
        entry.layer,
        entry.role,
        pages,
        dst.name,
        p,
        entry.num_tokens,
        rep.dst_scale if dst.per_tensor_scale else None,
        d,
        entry.compress_ratio,
    )
    return out, rep


def convert_dump(
    src: str | os.PathLike,
    dst: str | os.PathLike,
    to_layout: str | Layout,
    *,
    page_size: int | None = None,
    dialect: str | None = None,
    scale: float | str | None = None,
    overwrite: bool = False,
    on_entry: Callable[[int, int, DumpEntry], None] | None = None,
) -> list[ConvertedEntry]:
    """Convert every entry of dump ``src`` to ``to_layout`` and write dump ``dst`` atomically.

    ``scale`` is the destination per-tensor scale (``"auto"``: per entry, no saturation).
    ``on_entry(done, total, entry)`` is called after each entry is converted (for progress display).
    Nothing is written unless every entry converts.
    """
    dst_path = Path(dst)
    if dst_path.exists() and not overwrite:
        raise InputError(f"output {dst_path} exists; pass overwrite=True (CLI: --force) to replace it")
    dump = read_dump(src)
    converted, reports = [], []
    for done, entry in enumerate(dump, start=1):
        out, rep = convert_entry(entry, to_layout, page_size=page_size, dialect=dialect, scale=scale)
        converted.append(out)
        reports.append(ConvertedEntry(entry.name, rep))
        if on_entry is not None:
            on_entry(done, len(dump), entry)
    write_dump(dst_path, Dump(converted, attrs=dump.attrs), overwrite=overwrite)
    return reports


__all__ = [
    "FORMAT_NAME",
    "FORMAT_VERSION",
    "ConvertedEntry",
    "Dump",
    "DumpEntry",
    "convert_dump",
    "convert_entry",
    "entry_name",
    "entry_stats",
    "read_dump",
    "write_dump",
]
