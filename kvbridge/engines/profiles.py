"""Engine pool profiles: how TensorRT-LLM, SGLang and vLLM store a DeepSeek-V4 request's caches.

A profile names the engine version its facts were read from and, for every cache role, the
storage format, the writer rule, the addressing and the source file. An entry index (token
position for SWA and state roles, compressed-token index for COMPRESS and INDEXER) maps to a
page through a named block table of the request:

- ``paged``: entry e is at page ``table[e // P]``, row ``e % P`` (P = entries per page);
- ``ring``: the request owns one page of ``P`` rows (``table[0]``) and entry e is at row ``e % P``;
- ``page-ring``: a page of ``P`` rows belongs to each block of ``span`` positions of another
  table (SGLang's ratio-4 compressor state follows its SWA pages): entry e is at page
  ``table[e // span]``, row ``e % P``.

A table entry -1 marks a released block (engines drop windowed blocks out of the window).
Options a profile cannot honour raise ``InputError`` with a one-line reason.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property
from typing import Literal

from kvbridge.engines.topology import COMPRESS_RATIOS, CacheSpec, Role
from kvbridge.errors import InputError
from kvbridge.layouts import Layout, PageGeometry, get_layout
from kvbridge.ops.keys import IndexerFormat, indexer_format

Addressing = Literal["paged", "ring", "page-ring"]
#: Bytes per compressor-state value.
STATE_DTYPE_BYTES = {"fp32": 4, "bf16": 2}


@dataclass(frozen=True)
class Storage:
    """Where and how one cache of one layer is stored by an engine.

    Records of ``record_bytes`` bytes sit in pages of ``page_size`` entries: token-major when
    ``split`` is None, else block-split (bytes ``[0, split)`` of row t at ``t * split``, the
    rest at ``page_size * split + t * (record_bytes - split)``); pages are ``page_bytes`` long.
    ``kind`` is ``kv`` (``fmt`` = layout name), ``indexer`` (``fmt`` = fp8/fp4) or ``state``
    (``fmt`` = fp32/bf16 ``[kv | score]`` rows). ``span``: positions per table entry of a
    ``page-ring`` storage. ``separate_pools``: the two record parts (state: kv and score) live in
    two pool tensors, ``[n, P * split]`` and ``[n, P * (record_bytes - split)]``, the second
    addressed by block table ``score_table`` when it is set (else by ``table`` too).
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
    span: int | None = None
    separate_pools: bool = False
    score_table: str | None = None
    #: The KV layout (kind ``kv``: resolved from ``fmt`` once when not given; None for other kinds).
    layout: Layout | None = field(default=None, compare=False, repr=False)

    def __post_init__(self) -> None:
        if self.kind == "kv" and self.layout is None:
            object.__setattr__(self, "layout", get_layout(self.fmt))
        if self.layout is not None and self.layout.name != self.fmt:
            raise InputError(f"storage format {self.fmt!r} is not its layout {self.layout.name!r}")

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
class Choice:
    """One setting of a profile: its value, whether it was given or defaulted, and where it comes from."""

    option: str
    value: str
    given: bool
    source: str


@dataclass(frozen=True)
class EngineProfile:
    """One engine version's storage of DeepSeek-V4 caches.

    ``compress_layout``: the compressed cache's layout when it differs from ``kv_layout`` (ROCm gfx942
    vLLM: FNUZ SWA, OCP compressed). ``swa_page``: tokens per SWA page. ``compressed_tokens_per_page``: full tokens one
    compressed page covers (a ratio-r page holds that / r entries). ``state``: per ratio, the
    addressing, rows per page (ring or block) and table of the compressor state.
    ``page_align``: block strides are rounded up to a multiple of this many bytes (vLLM).
    ``draft_tokens``: speculative-decoding draft length the engine runs with (0: none).
    ``swa_send_page``: an engine whose PD sends whole SWA pages from the window's page start
    (SGLang) wants the SWA tokens of that page too. ``score_has_ape``: the stored compressor
    score already includes the positional bias (vLLM, TensorRT-LLM add it when saving a row;
    SGLang stores the raw score and adds it when compressing).
    """

    engine: str
    version: str
    spec: str
    kv_layout: str
    swa_page: int
    compressed_tokens_per_page: int
    indexer_fmt: str
    indexer_rule: str
    swa_dialect: str | None
    compress_dialect: str | None
    kv_scale: float | None
    state_dtype: str
    state: dict[int, tuple[Addressing, int, str]]
    tables: dict[Role, str] = field(default_factory=dict)
    sources: dict[str, str] = field(default_factory=dict)
    choices: tuple[Choice, ...] = ()
    page_align: int = 1
    draft_tokens: int = 0
    separate_state_pools: bool = False
    swa_send_page: bool = False
    online_c128: bool = False
    score_has_ape: bool = True
    compress_layout: str | None = None

    @cached_property
    def layout(self) -> Layout:
        """The KV layout ``kv_layout`` names (resolved once)."""
        return get_layout(self.kv_layout)

    @property
    def source(self) -> str:
        return "; ".join(f"{k}: {v}" for k, v in self.sources.items())

    def table_name(self, spec: CacheSpec) -> str:
        """The block table addressing ``spec``'s cache (shared by all layers of that role/ratio)."""
        if spec.role in (Role.STATE, Role.INDEXER_STATE):
            table = self.state[spec.ratio][2]
            if table in ("swa", "full"):
                return table
            return f"{'indexer_' if spec.role == Role.INDEXER_STATE else ''}{table}{spec.ratio}"
        base = self.tables[spec.role]
        return base if spec.role == Role.SWA or base == "full" else f"{base}{spec.ratio}"

    def _align(self, nbytes: int) -> int:
        return -(-nbytes // self.page_align) * self.page_align

    def storage(self, spec: CacheSpec) -> Storage:
        """Storage of one layer's cache."""
        table = self.table_name(spec)
        if spec.role in (Role.SWA, Role.COMPRESS):
            lay = get_layout(self.compress_layout) if spec.role == Role.COMPRESS and self.compress_layout \
                else self.layout
            p = self.swa_page if spec.role == Role.SWA else self.compressed_tokens_per_page // spec.ratio
            dialect = self.swa_dialect if spec.role == Role.SWA else self.compress_dialect
            return Storage("kv", lay.name, lay.record_bytes, lay.split, p, self._align(lay.page_bytes(p)), table,
                           "paged", dialect, self.kv_scale if lay.takes_scale else None, layout=lay)
        if spec.role == Role.INDEXER:
            fmt = indexer_format(self.indexer_fmt, spec.width)
            p = self.compressed_tokens_per_page // spec.ratio
            return Storage("indexer", fmt.name, fmt.record_bytes, fmt.split, p, self._align(fmt.page_bytes(p)), table,
                           "paged", self.indexer_rule)
        addressing, rows, _ = self.state[spec.ratio]
        if self.online_c128 and spec.ratio == 128:
            row = 3 * (spec.width // 2) * STATE_DTYPE_BYTES[self.state_dtype]
            return Storage("state", f"online-{self.state_dtype}", row, None, 1, row, table, "ring")
        row = spec.width * STATE_DTYPE_BYTES[self.state_dtype]
        split = row // 2 if self.separate_state_pools else None
        span = self.swa_page if addressing == "page-ring" else None
        score_table = f"{table}_score" if self.separate_state_pools else None
        return Storage("state", self.state_dtype, row, split, rows, self._align(rows * row), table, addressing,
                       span=span, separate_pools=self.separate_state_pools, score_table=score_table)

    def swa_first(self, first: int) -> int:
        """First SWA token this engine holds for a window starting at ``first`` (its page start when
        it sends whole pages)."""
        return first // self.swa_page * self.swa_page if self.swa_send_page else first

    def to_dict(self) -> dict:
        return {
            "engine": self.engine,
            "version": self.version,
            "spec": self.spec,
            "kv_layout": self.kv_layout,
            "compress_layout": self.compress_layout or self.kv_layout,
            "swa_page": self.swa_page,
            "compressed_tokens_per_page": self.compressed_tokens_per_page,
            "indexer": f"{self.indexer_fmt} ({self.indexer_rule})",
            "state": {str(r): {"addressing": a, "rows": n, "table": t, "dtype": self.state_dtype}
                      for r, (a, n, t) in self.state.items()},
            "swa_dialect": self.swa_dialect,
            "compress_dialect": self.compress_dialect,
            "kv_scale": self.kv_scale,
            "draft_tokens": self.draft_tokens,
            "choices": [{"option": c.option, "value": c.value, "given": c.given, "source": c.source}
                        for c in self.choices],
            "sources": dict(self.sources),
        }


SGLANG_VERSION = "SGLang 0.5.23"
VLLM_VERSION = "vLLM 0.33.0"
TRTLLM_VERSION = "TensorRT-LLM main (late 2026)"

_TRTLLM_KV = {
    # option -> (layout, SWA writer dialect, COMPRESS writer dialect)
    "fp8": ("trtllm-fp8", "swa", "compress"),
    "fp8-ds-mla": ("trtllm-fp8-ds-mla", "amax-1e-8", "amax-1e-8"),
    "bf16": ("bf16", None, None),
}


class _Options:
    """Parsed ``key=value`` options of one engine spec; records each choice and its source."""

    def __init__(self, parts: list[str], allowed: tuple[str, ...], spec: str) -> None:
        self.spec = spec
        self.given: dict[str, str] = {}
        self.choices: list[Choice] = []
        for part in parts:
            key, sep, value = part.partition("=")
            if not sep or key not in allowed:
                raise InputError(f"engine spec {spec!r}: unknown option {part!r}; options: {', '.join(allowed)}")
            self.given[key] = value

    def pick(self, key: str, default: str, choices: tuple[str, ...], source: str) -> str:
        value = self.given.get(key, default)
        if value not in choices:
            raise InputError(f"engine spec {self.spec!r}: {key} must be one of {', '.join(choices)}, got {value!r}")
        self.choices.append(Choice(key, value, key in self.given, source))
        return value

    def integer(self, key: str, default: int, lo: int, hi: int, source: str) -> int:
        raw = self.given.get(key, str(default))
        if not raw.isdigit() or not lo <= int(raw) <= hi:
            raise InputError(f"engine spec {self.spec!r}: {key} must be an integer in {lo}..{hi}, got {raw!r}")
        self.choices.append(Choice(key, raw, key in self.given, source))
        return int(raw)


#: ROCm GPU families: gfx942 (MI300X / MI325X) keeps FP8 in float8_e4m3fnuz, gfx950 (MI355X) in OCP E4M3.
ROCM_GPUS = {"mi300": "gfx942", "mi355": "gfx950"}


def _e4m3_flavour(opts: _Options, engine: str, gpu: str, source: str) -> str:
    """The ``e4m3`` option: ``fnuz`` on gfx942 (where the engine writes it), ``fn`` elsewhere; the other refused."""
    native = "fnuz" if gpu == "mi300" else "fn"
    flavour = opts.pick("e4m3", native, ("fn", "fnuz"), source)
    if flavour != native:
        where = f"on {gpu} ({ROCM_GPUS.get(gpu, 'CUDA')})"
        raise InputError(f"engine spec {opts.spec!r}: {engine} {where} writes float8_e4m3{native} pools, not "
                         f"e4m3={flavour}; " + ("float8_e4m3fnuz pools (ROCm gfx942) need gpu=mi300"
                                                 if flavour == "fnuz" else "gfx942 pools are always FNUZ"))
    return flavour


_SG = "sglang/"


def sglang(spec: str = "sglang") -> EngineProfile:
    """SGLang 0.5.23 DeepSeekV4TokenToKVPool.

    Options: ``swa=256|128`` (page size: 256, 128 on NPU / older builds; compressed and indexer
    pages hold page / r entries and share the request's page table), ``idx=fp8|fp4``,
    ``draft=N`` (``num_draft_tokens``: compressor-state rings of 16 / 256 rows),
    ``state=fp32|bf16`` (``SGLANG_DSV4_COMPRESS_STATE_DTYPE``), ``online=0|1``
    (``SGLANG_OPT_USE_ONLINE_COMPRESS``), ``e4m3=fn`` (``fnuz`` refused), ``gpu=cuda`` (``mi300`` and
    ``mi355``, SGLang's ROCm builds, refused: ``_sglang_rocm`` says why), ``attn=flashmla|trtllm``
    (``--dsv4-attn-backend``; ``trtllm``: uniform 512-B FP8 rows at unit scale, layout ``trtllm-fp8``,
    SM100 / SM103), ``unified=0|1`` (ROCm unified-KV build, refused).
    """
    _, *parts = spec.split(":")
    opts = _Options(parts, ("swa", "idx", "draft", "state", "online", "e4m3", "gpu", "attn", "unified"), spec)
    page = int(opts.pick("swa", "256", ("256", "128", "64"), "page size (DSV4PoolConfigurator forces 256; NPU 128)"))
    if page < 128:
        raise InputError(f"engine spec {spec!r}: swa={page} gives ratio-128 pages of {page / 128:g} entries; "
                         "SGLang's compressed pools need page // 128 >= 1")
    idx = opts.pick("idx", "fp8", ("fp8", "fp4"), "enable_deepseek_v4_fp4_indexer")
    draft = opts.integer("draft", 0, 0, 64, "speculative num_draft_tokens (0: no speculative decoding)")
    dtype = opts.pick("state", "fp32", ("fp32", "bf16"), "SGLANG_DSV4_COMPRESS_STATE_DTYPE")
    online = opts.pick("online", "0", ("0", "1"), "SGLANG_OPT_USE_ONLINE_COMPRESS") == "1"
    gpu = opts.pick("gpu", "cuda", ("cuda", *ROCM_GPUS), "GPU (ROCm: srt/utils is_hip, is_gfx95_supported)")
    _e4m3_flavour(opts, "SGLang", gpu, f"{_SG}kernels/ops/quantization/fp8_kernel.py is_fp8_fnuz (fp8 KV dtype)")
    attn = opts.pick("attn", "flashmla", ("flashmla", "trtllm"),
                     f"--dsv4-attn-backend ({_SG}srt/layers/attention/deepseek_v4_trtllm_backend.py)")
    unified = opts.pick("unified", "0", ("0", "1"), "SGLANG_HACK_FLASHMLA_BACKEND=unified_kv_triton (HIP)") == "1"
    _sglang_backend(spec, attn, unified, online)
    if gpu in ROCM_GPUS:
        _sglang_rocm(spec, gpu)
    if online and draft:
        raise InputError(f"engine spec {spec!r}: SGLang's online ratio-128 compressor does not support "
                         "speculative decoding (draft > 0) without SGLANG_EXPERIMENTAL_ONLINE_C128_MTP")
    ring4, ring128 = (16, 256) if draft else (8, 128)
    mem = _SG + "srt/mem_cache/deepseek_v4_memory_pool.py"
    swa_d = "amax-1e-4"
    trtllm_attn = attn == "trtllm"
    kv_source = f"{_SG}kernels/jit/csrc/deepseek_v4/store.cuh FusedStoreCacheFlashMLAKernel"
    if trtllm_attn:
        kv_source = (f"DeepSeekV4UniformFP8KVPool (512 B rows, no page pad); SWA: {_SG}kernels/ops/attention/dsv4/"
                     "kv_norm_rope_store.py _kv_norm_rope_fp8_store (bf16 rows stored as e4m3, saturating); "
                     f"compressed: {_SG}srt/layers/attention/dsv4/compressor_trtllm.py forward_compress_uniform_fp8 "
                     "-> set_key_buffer_fused (bf16 .to(float8_e4m3fn), saturating); unit scale: "
                     "deepseek_v4_trtllm_backend.py _get_trtllm_bmm_scales")
    idx_source = (f"{_SG}kernels/jit/csrc/deepseek_v4/fused_norm_rope_v2.cuh FusedNormRopeKernel::"
                  + ("forward" if idx == "fp8" else "forward_fp4")
                  + f" (via {_SG}srt/layers/attention/dsv4/compressor_v2.py compress_norm_rope_store)")
    return EngineProfile(
        engine="sglang", version=SGLANG_VERSION,
        spec=f"sglang:swa={page}:idx={idx}" + (f":draft={draft}" if draft else "")
        + (f":state={dtype}" if dtype != "fp32" else "") + (":online=1" if online else "")
        + (":attn=trtllm" if trtllm_attn else ""),
        kv_layout="trtllm-fp8" if trtllm_attn else "flashmla-model1", swa_page=page, compressed_tokens_per_page=page,
        indexer_fmt=idx, indexer_rule="sglang",
        swa_dialect="swa" if trtllm_attn else swa_d, compress_dialect="compress" if trtllm_attn else swa_d,
        kv_scale=1.0 if trtllm_attn else None, state_dtype=dtype,
        state={4: ("page-ring", ring4, "swa"), 128: ("ring", 1 if online else ring128, "state")},
        tables={Role.SWA: "swa", Role.COMPRESS: "full", Role.INDEXER: "full"},
        sources={
            "kv": f"{mem} DeepSeekV4TokenToKVPool; {kv_source}",
            "indexer": idx_source,
            "state": f"{_SG}srt/mem_cache/deepseek_v4_compress_state.py CompressStatePool "
                     "(ratio 4 page-scoped: translate_from_swa_loc_to_state_loc; ratio 128 request-scoped); "
                     f"{mem} get_compress_state_ring_size; raw scores, APE added when compressing "
                     f"({_SG}kernels/jit/csrc/deepseek_v4/c4_v2.cuh)",
            "pd": f"{mem} get_state_buf_infos (ratio-4 state travels with the SWA pages)",
        },
        choices=tuple(opts.choices), draft_tokens=draft, swa_send_page=True, online_c128=online,
        score_has_ape=False,
    )


def _sglang_backend(spec: str, attn: str, unified: bool, online: bool) -> None:
    """Refuse the SGLang attention backends kvbridge does not model, and trtllm where SGLang does not run it."""
    if unified:
        raise InputError(f"engine spec {spec!r}: SGLang's ROCm unified-KV build (SGLANG_HACK_FLASHMLA_BACKEND="
                         f"unified_kv_triton, {_SG}srt/layers/attention/dsv4/unified_kv_gate.py) keeps request-scoped "
                         f"ratio-4 compressor state ({_SG}srt/layers/attention/dsv4/compressor_v2.py use_req_ring) and "
                         "whole-latent rows, which kvbridge does not model; run SGLang without it")
    if attn == "trtllm" and online:
        raise InputError(f"engine spec {spec!r}: --dsv4-attn-backend trtllm does not support "
                         "SGLANG_OPT_USE_ONLINE_COMPRESS (deepseek_v4_trtllm_backend.py)")


def _sglang_rocm(spec: str, gpu: str) -> None:
    """Refuse SGLang's ROCm builds: their DeepSeek-V4 pools come from several writers kvbridge does not reproduce."""
    cast = ("a software E4M3 cast (OCP codes, halves rounded up, 248 and above written as 448)" if gpu == "mi300"
            else "the hardware E4M3 cast")
    raise InputError(
        f"engine spec {spec!r}: SGLang 0.5.23 on ROCm ({ROCM_GPUS[gpu]}) is not supported: its main, compressed and "
        f"indexer caches are written by JIT kernels with {cast} ({_SG}kernels/ops/attention/dsv4/norm_rope.py, "
        f"compress.py; sgl_kernel/deepseek_v4/fp8_utils.cuh pack_fp8), some paths by the Triton store "
        f"(kernels/ops/kvcache/triton_store_cache.py, float8_e4m3fnuz on gfx942), the indexer page pre-shuffled "
        "with SGLANG_USE_AITER, fp4 keys in aiter's layout; which writer ran depends on the server's flags"
    )


_VL = "vllm/"
_VLLM_KV = {
    # kv option -> (layout, SWA dialect, COMPRESS dialect, page alignment, GPU families that run it).
    # ``flashinfer`` is FLASHINFER_MLA_SPARSE_DSV4, the TRTLLM-gen sparse MLA backend (models/deepseek_v4/
    # nvidia/flashinfer_sparse.py DeepseekV4FlashInferMLAAttention). FlashInfer's per-tensor FP8
    # compressed rows are e4m3(clamp(bf16(x) * (1 / 1.0))) (its cutedsl compressor): the ``swa``
    # dialect at scale 1. Its SWA rows come from a compiled op whose source
    # is not in the wheel; kvbridge assumes the same rule there.
    "fp8_ds_mla": ("flashmla-model1", "amax-1e-4", "amax-1e-4", 576, ("sm90", "sm100", "sm120", "mi300", "mi355")),
    "flashinfer": ("trtllm-fp8", "swa", "swa", 512, ("sm100", "sm120")),
    "flashinfer-bf16": ("bf16", None, None, 512, ("sm100",)),
}


def vllm(spec: str = "vllm") -> EngineProfile:
    """vLLM 0.33.0 DeepSeek-V4 (models/deepseek_v4).

    Options: ``block=256`` (``--block-size``, a multiple of 64: compressed blocks hold
    block / r entries), ``idx=fp8|fp4``, ``gpu=sm90|sm100|sm120``,
    ``kv=fp8_ds_mla|flashinfer|flashinfer-bf16|v41`` (``flashinfer``: 512-B per-tensor FP8 rows of
    ``FLASHINFER_MLA_SPARSE_DSV4``, the TRTLLM-gen backend, on SM10x / SM120, ``flashinfer-bf16`` its
    bf16 rows on SM10x; ``v41`` refused: DeepSeek-V4.1's compressor ratios 1 / 2), ``draft=N``
    (recorded; no storage change was found for it), ``gpu=mi300|mi355``
    (ROCm: gfx942 keeps the SWA cache in ``model1-fnuz``, dialect ``amax-1e-4/224``, and the compressed
    cache in OCP ``flashmla-model1``; gfx950 is OCP throughout), ``e4m3=fn|fnuz`` (``fnuz`` on mi300 only).
    SWA blocks of 64 tokens; compressor state fp32 in
    position-paged blocks of 4 (ratio 4) / 8 (ratio 128) positions; blocks aligned to 576 B
    (``fp8_ds_mla``) or 512 B.
    """
    _, *parts = spec.split(":")
    opts = _Options(parts, ("block", "idx", "gpu", "kv", "draft", "e4m3"), spec)
    block = opts.integer("block", 256, 64, 4096, "--block-size (recipes use 256)")
    if block % 64:
        raise InputError(f"engine spec {spec!r}: block must be a multiple of 64, got {block}")
    idx = opts.pick("idx", "fp8", ("fp8", "fp4"), "indexer cache dtype")
    gpu = opts.pick("gpu", "sm90", ("sm90", "sm100", "sm120", *ROCM_GPUS),
                    "GPU family (mqa_logits_use_mx_scales on sm100; ROCm: platforms is_fp8_fnuz on mi300)")
    kv = opts.pick("kv", "fp8_ds_mla", (*_VLLM_KV, "v41"), "attention backend / cache layout")
    draft = opts.integer("draft", 0, 0, 64, "num_speculative_tokens (0: none)")
    fnuz = _e4m3_flavour(opts, "vLLM", gpu, f"{_VL}models/deepseek_v4/common/ops/cache_utils.py "
                         "quantize_and_insert_k_cache(use_fnuz=current_platform.is_fp8_fnuz())") == "fnuz"
    if kv == "v41":
        raise InputError(f"engine spec {spec!r}: vLLM's DeepSeek-V4.1 528-B MXFP8 rows (DeepseekV41ForCausalLM, "
                         "SM100: layout v41-fp8-interleaved, dialect amax-1e-4; kvbridge convert reads them) belong "
                         f"to a model whose compressed layers have ratios 1 and 2 ({_VL}models/deepseek_v41/"
                         "compressor.py), outside kvbridge's DeepSeek-V4 topologies (ratios 4 and 128), so there is "
                         "no migration profile")
    layout, swa_d, comp_d, align, gpus = _VLLM_KV[kv]
    if gpu not in gpus:
        raise InputError(f"engine spec {spec!r}: vLLM runs kv={kv} on {', '.join(gpus)} only, not {gpu}")
    rule = ("vllm-ue8m0" if gpu == "sm100" else "vllm") if idx == "fp8" else "vllm"
    compress_layout = None
    if fnuz:  # gfx942: the SWA cache follows the platform's FNUZ, the compressed cache stays OCP
        layout, swa_d, compress_layout = "model1-fnuz", "amax-1e-4/224", "flashmla-model1"
    return EngineProfile(
        engine="vllm", version=VLLM_VERSION,
        spec=f"vllm:block={block}:idx={idx}:gpu={gpu}:kv={kv}" + (f":draft={draft}" if draft else ""),
        kv_layout=layout, swa_page=64, compressed_tokens_per_page=block,
        indexer_fmt=idx, indexer_rule=rule,
        swa_dialect=swa_d, compress_dialect=comp_d, kv_scale=1.0 if layout == "trtllm-fp8" else None,
        state_dtype="fp32",
        state={4: ("paged", 4, "state"), 128: ("paged", 8, "state")},
        tables={Role.SWA: "swa", Role.COMPRESS: "compress", Role.INDEXER: "compress"},
        sources={
            "kv": f"{_VL}models/deepseek_v4/attention.py (MLAAttentionSpec, alignment 576 / 512)"
                  + (f"; TRTLLM-gen: {_VL}models/deepseek_v4/nvidia/flashinfer_sparse.py "
                     "DeepseekV4FlashInferMLAAttention" if kv.startswith("flashinfer") else "")
                  + (f"; gfx942 SWA FNUZ, compressed OCP: {_VL}models/deepseek_v4/amd/rocm.py "
                     "dequantize_and_gather_k_cache(use_fnuz=...) and common/ops/cache_utils.py "
                     "quantize_and_insert_k_cache (fp8_max 224)" if fnuz else ""),
            "indexer": f"{_VL}models/deepseek_v4/common/ops/fused_compress_quant_cache.py "
                       + ("_fused_kv_compress_norm_rope_insert_indexer_attn" if idx == "fp8" else
                          "_fused_kv_compress_norm_rope_insert_indexer_mxfp4_attn")
                       + (f"; {_VL}utils/deep_gemm.py mqa_logits_use_mx_scales" if gpu == "sm100" else ""),
            "state": f"{_VL}models/deepseek_v4/compressor.py CompressorStateCache (block_size 4 / 8, "
                     "SlidingWindowMLASpec); score + ape[position % ratio] saved "
                     f"({_VL}models/deepseek_v4/common/ops/save_partial_states.py)",
        },
        choices=tuple(opts.choices), page_align=align, draft_tokens=draft, compress_layout=compress_layout,
    )


def trtllm(spec: str = "trtllm") -> EngineProfile:
    """TensorRT-LLM PyTorch backend (main, late 2026; facts from the project's engine-storage notes).

    ``trtllm[:fp8|fp8-ds-mla|bf16]`` KV dtype, options ``tpb=128|256`` (tokens_per_block),
    ``idx=fp4|fp8``, ``scale=S`` (per-tensor FP8 scale), ``draft=N`` (``max_draft_len``),
    ``state=fp32|bf16``. Per-role block tables (one per role and ratio); compressor kv and
    score are separate pools with block tables of their own (``state4`` / ``state4_score``, ...),
    paged by position like SWA (blocks of tokens_per_block rows).
    """
    _, *parts = spec.split(":")
    kv = "fp8"
    if parts and "=" not in parts[0]:
        kv = parts.pop(0)
    if kv not in _TRTLLM_KV:
        raise InputError(f"TensorRT-LLM KV dtype must be one of {', '.join(_TRTLLM_KV)}, got {kv!r}")
    opts = _Options(parts, ("tpb", "idx", "scale", "draft", "state"), spec)
    tpb = int(opts.pick("tpb", "128", ("128", "256"), "kv_cache_config tokens_per_block"))
    idx = opts.pick("idx", "fp4", ("fp4", "fp8"), "indexer cache dtype (fp4 default)")
    raw = opts.given.get("scale", "1.0")
    try:
        scale = float(raw)
    except ValueError:
        raise InputError(f"engine spec {spec!r}: scale must be a number, got {raw!r}") from None
    if not scale > 0 or scale == float("inf"):
        raise InputError(f"engine spec {spec!r}: scale must be positive and finite, got {scale}")
    opts.choices.append(Choice("scale", f"{scale:g}", "scale" in opts.given, "kv_cache_scaling_factor (default 1.0)"))
    draft = opts.integer("draft", 0, 0, 64, "max_draft_len (0: no MTP)")
    dtype = opts.pick("state", "fp32", ("fp32", "bf16"), "compressor state dtype")
    layout, swa_dialect, compress_dialect = _TRTLLM_KV[kv]
    return EngineProfile(
        engine="trtllm", version=TRTLLM_VERSION,
        spec=f"trtllm:{kv}:tpb={tpb}:idx={idx}" + (f":scale={scale:g}" if scale != 1.0 else "")
        + (f":draft={draft}" if draft else "") + (f":state={dtype}" if dtype != "fp32" else ""),
        kv_layout=layout, swa_page=tpb, compressed_tokens_per_page=tpb,
        indexer_fmt=idx, indexer_rule="trtllm",
        swa_dialect=swa_dialect, compress_dialect=compress_dialect,
        kv_scale=scale if layout == "trtllm-fp8" else None, state_dtype=dtype,
        state={4: ("paged", tpb, "state"), 128: ("paged", tpb, "state")},
        tables={Role.SWA: "swa", Role.COMPRESS: "compress", Role.INDEXER: "indexer"},
        sources={
            "kv": "tensorrt_llm KvCacheManager (tokens_per_block, per-role block tables, kv_cache_config.dtype)",
            "indexer": "tensorrt_llm indexer cache (fp8: amax/448 via reciprocal; fp4: kMXFP4Blockwise)",
            "state": "tensorrt_llm compressorKernels.cu / compressor.py (COMPRESSOR_KV and COMPRESSOR_SCORE pools; "
                     "APE baked into the stored score)",
        },
        choices=tuple(opts.choices), draft_tokens=draft, separate_state_pools=True,
    )


ENGINES = ("trtllm", "sglang", "vllm")


def parse_engine(spec: str | EngineProfile) -> EngineProfile:
    """Parse an engine spec (see ``trtllm``, ``sglang`` and ``vllm`` for each engine's options)."""
    if isinstance(spec, EngineProfile):
        return spec
    if not isinstance(spec, str) or not spec:
        raise InputError(f"engine spec must be a non-empty string, got {spec!r}")
    engine = spec.split(":")[0]
    builders = {"trtllm": trtllm, "sglang": sglang, "vllm": vllm}
    if engine not in builders:
        raise InputError(f"unknown engine {engine!r} in spec {spec!r}; engines: {', '.join(ENGINES)}")
    profile = builders[engine](spec)
    _check_pages(profile, spec)
    return profile


def _check_pages(profile: EngineProfile, spec: str) -> None:
    """Every layer's page holds a whole number (>= 1) of records: a compressed page of ``T`` tokens
    holds ``T / r`` entries of a ratio-``r`` layer, for each ratio DeepSeek-V4 uses."""
    tokens = profile.compressed_tokens_per_page
    for r in (r for r in COMPRESS_RATIOS if r):  # 0: a layer without compression
        if tokens % r:
            raise InputError(f"engine spec {spec!r}: a compressed page covers {tokens} tokens, which ratio-{r} layers "
                             f"cannot page ({tokens} / {r} entries); use a multiple of {max(COMPRESS_RATIOS)} tokens "
                             "(e.g. vllm:block=256)")
