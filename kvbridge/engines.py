"""Engine pool profiles: how TensorRT-LLM, SGLang and vLLM store a DeepSeek-V4 request's caches.

A profile says, for every cache of ``kvbridge.topology``, which storage format it uses and
how an entry index (token position for SWA and state roles, compressed-token index for
COMPRESS and INDEXER) maps to a page through a named block table of the request:

- paged: entry e is at page ``table[e // P]``, row ``e % P`` (P = entries per page);
- ring: the request owns one page of ``P`` rows (``table[0]``) and entry e is at row ``e % P``.

A table entry -1 marks a released block (TensorRT-LLM drops SWA blocks out of the window).
Profiles are written from spec sections 3-5 (facts read in the engines' code); each cites its
source. Where an engine's choice was not found in its code, the comment says it is assumed.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from kvbridge.errors import InputError
from kvbridge.indexer import IndexerFormat, indexer_format
from kvbridge.layouts import Layout, PageGeometry, get_layout
from kvbridge.topology import CacheSpec, Role

Addressing = Literal["paged", "ring"]


@dataclass(frozen=True)
class Storage:
    """Where and how one cache of one layer is stored by an engine.

    Records of ``record_bytes`` bytes sit in pages of ``page_size`` entries: token-major when
    ``split`` is None, else block-split (bytes ``[0, split)`` of row t at ``t * split``, the
    rest at ``page_size * split + t * (record_bytes - split)``); pages are ``page_bytes`` long.
    ``kind`` is ``kv`` (``fmt`` = layout name), ``indexer`` (``fmt`` = fp8/fp4) or ``state``
    (``fmt`` = fp32 rows).
    """

    kind: Literal["kv", "indexer", "state"]
    fmt: str
    record_bytes: int
    split: int | None
    page_size: int
    page_bytes: int
    table: str
    addressing: Addressing
    dialect: str | None = None  # the engine writer's dialect (kv) or scale rule (indexer)
    scale: float | None = None  # per-tensor scale (trtllm-fp8 only)

    @property
    def layout(self) -> Layout:
        return get_layout(self.fmt)

    @property
    def geometry(self) -> PageGeometry:
        """Where each record byte lies in a page (the registry's one geometry implementation)."""
        if self.kind == "kv":
            return self.layout.geometry
        return PageGeometry(self.record_bytes, self.split)

    @property
    def indexer(self) -> IndexerFormat:
        split = self.split or 0
        return indexer_format(self.fmt, split if self.fmt == "fp8" else 2 * split)


@dataclass(frozen=True)
class EngineProfile:
    """One engine's storage of DeepSeek-V4 caches.

    ``swa_page``: tokens per SWA page. ``compressed_tokens_per_page``: full tokens one
    compressed page covers (a ratio-r page holds that / r entries). ``state_addressing``:
    ``paged`` (position-addressed blocks of ``swa_page`` rows) or ``ring``.
    """

    engine: str
    spec: str
    kv_layout: str
    swa_page: int
    compressed_tokens_per_page: int
    indexer_fmt: str
    indexer_rule: str
    state_addressing: Addressing
    swa_dialect: str | None
    compress_dialect: str | None
    kv_scale: float | None
    tables: dict[Role, str] = field(default_factory=dict)
    source: str = ""

    def table_name(self, spec: CacheSpec) -> str:
        """The block table addressing ``spec``'s cache (shared by all layers of that role/ratio)."""
        base = self.tables[spec.role]
        return base if spec.role == Role.SWA or base == "full" else f"{base}{spec.ratio}"

    def storage(self, spec: CacheSpec) -> Storage:
        """Storage of one layer's cache."""
        table = self.table_name(spec)
        if spec.role in (Role.SWA, Role.COMPRESS):
            lay = get_layout(self.kv_layout)
            p = self.swa_page if spec.role == Role.SWA else self.compressed_tokens_per_page // spec.ratio
            dialect = self.swa_dialect if spec.role == Role.SWA else self.compress_dialect
            return Storage("kv", lay.name, lay.record_bytes, lay.split, p, lay.page_bytes(p), table, "paged",
                           dialect, self.kv_scale if lay.per_tensor_scale else None)
        if spec.role == Role.INDEXER:
            fmt = indexer_format(self.indexer_fmt, spec.width)
            p = self.compressed_tokens_per_page // spec.ratio
            return Storage("indexer", fmt.name, fmt.record_bytes, fmt.split, p, fmt.page_bytes(p), table, "paged",
                           self.indexer_rule)
        row = 4 * spec.width
        p = spec.window if self.state_addressing == "ring" else self.swa_page
        assert p is not None
        return Storage("state", "fp32", row, None, p, p * row, table, self.state_addressing)

    def to_dict(self) -> dict:
        return {
            "engine": self.engine,
            "spec": self.spec,
            "kv_layout": self.kv_layout,
            "swa_page": self.swa_page,
            "compressed_tokens_per_page": self.compressed_tokens_per_page,
            "indexer": f"{self.indexer_fmt} ({self.indexer_rule})",
            "state_addressing": self.state_addressing,
            "swa_dialect": self.swa_dialect,
            "compress_dialect": self.compress_dialect,
            "kv_scale": self.kv_scale,
            "source": self.source,
        }


_TRTLLM_KV = {
    # option -> (layout, SWA writer dialect, COMPRESS writer dialect); spec 3.1, 3.2, 3.4.
    "fp8": ("trtllm-fp8", "swa", "compress"),
    "fp8-ds-mla": ("trtllm-fp8-ds-mla", "amax-1e-8", "amax-1e-8"),
    "bf16": ("bf16", None, None),
}


def _options(parts: list[str], allowed: tuple[str, ...], spec: str) -> dict[str, str]:
    opts: dict[str, str] = {}
    for part in parts:
        key, sep, value = part.partition("=")
        if not sep or key not in allowed:
            raise InputError(f"engine spec {spec!r}: unknown option {part!r}; options: {', '.join(allowed)}")
        opts[key] = value
    return opts


def _int_option(opts: dict[str, str], key: str, default: int, choices: tuple[int, ...], spec: str) -> int:
    raw = opts.get(key, str(default))
    if not raw.isdigit() or int(raw) not in choices:
        raise InputError(f"engine spec {spec!r}: {key} must be one of {', '.join(map(str, choices))}, got {raw!r}")
    return int(raw)


def trtllm(kv: str = "fp8", tokens_per_block: int = 128, indexer: str = "fp4", scale: float = 1.0) -> EngineProfile:
    """TensorRT-LLM PyTorch backend (spec 3.2, 3.4, 5).

    Per-role block tables (one per role and ratio); blocks hold ``tokens_per_block`` tokens,
    compressed blocks ``tokens_per_block / r`` entries; SWA blocks out of the window are
    released (-1). Indexer: fp4 by default (68 B), or fp8 with scale amax/448 (132 B).
    The windowed COMPRESSOR_* roles are modelled as position-addressed blocks like SWA.
    """
    if kv not in _TRTLLM_KV:
        raise InputError(f"TensorRT-LLM KV dtype must be one of {', '.join(_TRTLLM_KV)}, got {kv!r}")
    layout, swa_dialect, compress_dialect = _TRTLLM_KV[kv]
    tpb = tokens_per_block
    return EngineProfile(
        engine="trtllm",
        spec=f"trtllm:{kv}:tpb={tpb}:idx={indexer}",
        kv_layout=layout,
        swa_page=tpb,
        compressed_tokens_per_page=tpb,
        indexer_fmt=indexer,
        indexer_rule="ue8m0" if indexer == "fp4" else "amax",
        state_addressing="paged",
        swa_dialect=swa_dialect,
        compress_dialect=compress_dialect,
        kv_scale=scale if layout == "trtllm-fp8" else None,
        tables={Role.SWA: "swa", Role.COMPRESS: "compress", Role.INDEXER: "indexer",
                Role.STATE: "state", Role.INDEXER_STATE: "indexer_state"},
        source="TensorRT-LLM KvCacheManager (tokens_per_block, per-role block tables, kv_cache_config.dtype); "
               "spec 3.2/3.4/5",
    )


def sglang(swa_page: int = 256, indexer: str = "fp8") -> EngineProfile:
    """SGLang DeepSeekV4TokenToKVPool (spec 3.3, 5; DSV4PoolConfigurator).

    MODEL1 pools (KVLayout.V4), writer dialect amax-1e-4 (its V4 store kernel). The request's
    full page table (256 tokens a page) addresses the C4 (64 entries), C4 indexer (64) and
    C128 (2) pools; SWA pages (256, older builds 128) have their own table. Indexer fp8 with a
    per-key fp32 scale max(amax, 1e-4)/448. Compressor state: a per-request ring of 8 (C4)
    or 128 (C128) fp32 rows, row = position % ring.
    """
    return EngineProfile(
        engine="sglang",
        spec=f"sglang:swa={swa_page}:idx={indexer}",
        kv_layout="flashmla-model1",
        swa_page=swa_page,
        compressed_tokens_per_page=256,
        indexer_fmt=indexer,
        indexer_rule="amax-1e-4" if indexer == "fp8" else "ue8m0",
        state_addressing="ring",
        swa_dialect="amax-1e-4",
        compress_dialect="amax-1e-4",
        kv_scale=None,
        tables={Role.SWA: "swa", Role.COMPRESS: "full", Role.INDEXER: "full",
                Role.STATE: "state", Role.INDEXER_STATE: "indexer_state"},
        source="SGLang mem_cache DeepSeekV4TokenToKVPool / DSV4PoolConfigurator (page_size 256, c4 ring 8); spec 3.3/5",
    )


def vllm(indexer: str = "fp8") -> EngineProfile:
    """vLLM fp8_ds_mla (spec 3.3, 5).

    MODEL1 pools, writer dialect amax-1e-4; SWA blocks of 64 tokens, compressed blocks of
    256 / r entries, one block table per KV-cache group (SWA, C4, C128). Assumed, not read
    in vLLM's code: the indexer keys share the C4 group's table with SGLang's fp8 format and
    rule, and the compressor state is a per-request ring as in SGLang.
    """
    return EngineProfile(
        engine="vllm",
        spec=f"vllm:idx={indexer}",
        kv_layout="flashmla-model1",
        swa_page=64,
        compressed_tokens_per_page=256,
        indexer_fmt=indexer,
        indexer_rule="amax-1e-4" if indexer == "fp8" else "ue8m0",
        state_addressing="ring",
        swa_dialect="amax-1e-4",
        compress_dialect="amax-1e-4",
        kv_scale=None,
        tables={Role.SWA: "swa", Role.COMPRESS: "compress", Role.INDEXER: "compress",
                Role.STATE: "state", Role.INDEXER_STATE: "indexer_state"},
        source="vLLM v1 DeepseekV4 / fp8_ds_mla KV-cache specs (block_size 64, compressed 256 / r); spec 3.3/5",
    )


ENGINES = ("trtllm", "sglang", "vllm")


def parse_engine(spec: str | EngineProfile) -> EngineProfile:
    """Parse an engine spec: ``trtllm[:fp8|fp8-ds-mla|bf16][:tpb=128|256][:idx=fp4|fp8][:scale=S]``,
    ``sglang[:swa=256|128][:idx=fp8|fp4]``, ``vllm[:idx=fp8|fp4]``."""
    if isinstance(spec, EngineProfile):
        return spec
    if not isinstance(spec, str) or not spec:
        raise InputError(f"engine spec must be a non-empty string, got {spec!r}")
    engine, *parts = spec.split(":")
    if engine == "trtllm":
        kv = "fp8"
        if parts and "=" not in parts[0]:
            kv = parts.pop(0)
        opts = _options(parts, ("tpb", "idx", "scale"), spec)
        tpb = _int_option(opts, "tpb", 128, (128, 256), spec)
        idx = opts.get("idx", "fp4")
        if idx not in ("fp4", "fp8"):
            raise InputError(f"engine spec {spec!r}: idx must be fp4 or fp8, got {idx!r}")
        try:
            scale = float(opts.get("scale", "1.0"))
        except ValueError:
            raise InputError(f"engine spec {spec!r}: scale must be a number, got {opts['scale']!r}") from None
        if not scale > 0 or scale == float("inf"):
            raise InputError(f"engine spec {spec!r}: scale must be positive and finite, got {scale}")
        return trtllm(kv, tpb, idx, scale)
    if engine in ("sglang", "vllm"):
        opts = _options(parts, ("swa", "idx") if engine == "sglang" else ("idx",), spec)
        idx = opts.get("idx", "fp8")
        if idx not in ("fp4", "fp8"):
            raise InputError(f"engine spec {spec!r}: idx must be fp8 or fp4, got {idx!r}")
        if engine == "vllm":
            return vllm(idx)
        return sglang(_int_option(opts, "swa", 256, (128, 256), spec), idx)
    raise InputError(f"unknown engine {engine!r} in spec {spec!r}; engines: {', '.join(ENGINES)}")

