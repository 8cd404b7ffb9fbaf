"""The ``flashmla`` backend of ``sparse_decode``: FlashMLA's sparse decode kernels on CUDA.

``flash_mla`` is imported lazily. What the installed build can run is read from the module
(``detect_build``), never guessed from a version string:

- Builds whose ``flash_mla_with_kvcache`` takes ``use_legacy`` (the ``sgl-flash-mla`` wheel after
  FlashMLA's 2026.09.30 release) have *current* kernels that read only the interleaved V4.1
  tokens (a 528-byte main cache; the extra cache 528 or 288 bytes; the format taken from
  ``k_cache.shape[-1]``, rows ``stride(-2)`` bytes apart), and, when ``flash_mla.has_legacy()`` is
  true, *legacy* kernels reached with ``use_legacy=True, kv_format=...`` that read the 584-byte
  MODEL1 cache (``V4``) and the block-split V4.1 caches (``V41``, with a ``V41_FP4`` extra cache).
  The current kernels run on sm_100-family GPUs only, the legacy ones on sm_90 and sm_100: on an
  H100/H200 every pool goes to the legacy kernels (``fixtures/flashmla_interface.json`` holds the
  wheel's interface facts a test checks these calls against).
- Older builds read MODEL1 directly, provided they know DeepSeek-V4's sparse decode arguments
  (``extra_k_cache``, ``topk_length``, ``attn_sink``); ``kv_format="V4"`` when they take it.

``prepare`` picks the kernels for the pair of pools (``FlashMLABuild.route``): a pool the chosen
kernels read is passed zero-copy as ``(num_pages, P, 1, record_bytes)`` uint8 with dim-0 stride =
page bytes; any other pool is gather-transcoded (only the touched tokens) by
``kvbridge.ops.slots.gather_transcode`` into a scratch cache of the kernels' layout (interleaved
528-byte V4.1 records for the current kernels, MODEL1 for the others) with remapped indices.
q heads are zero-padded to 64 or 128 and index lists padded with -1 to a multiple of 64, both of
which leave the result unchanged.
"""

from __future__ import annotations

import importlib
import inspect
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import torch

from kvbridge.attention.args import CacheArg, DecodeArgs
from kvbridge.errors import InputError, KVBridgeError, LayoutError
from kvbridge.layouts import Layout, get_layout
from kvbridge.layouts.codec import HEAD_DIM
from kvbridge.ops.slots import gather_transcode

MODEL1 = "flashmla-model1"
#: The current kernels' main-cache layout, and the scratch layout other pools are gathered into for them.
CURRENT_MAIN = "v41-fp8-interleaved"
#: Layouts the current kernels read as the extra cache.
CURRENT_EXTRA = ("v41-fp8-interleaved", "v41-fp4-interleaved")
#: The block-split V4.1 main cache the legacy kernels read (``kv_format="V41"``), and the extra-cache layouts
#: they read next to it.
LEGACY_V41_MAIN = "v41-fp8"
LEGACY_V41_FP4_EXTRA = ("v41-fp4", "v41-fp4-pad512")
#: Compute-capability majors each kernel set of the split wheel runs on (``sgl-flash-mla`` 1.0.0: the current
#: sparse decode is sm_100-family only, the legacy one sm_90a or sm_100-family).
CURRENT_MAJORS = (10,)
LEGACY_MAJORS = (9, 10)
KERNEL_HEADS = (64, 128)  # h_q the kernels are instantiated for
TOPK_MULTIPLE = 64  # the kernels walk index lists in blocks of 64
_V4_ARGUMENTS = (
    "indices", "attn_sink", "extra_k_cache", "extra_indices_in_kvcache", "topk_length", "extra_topk_length",
)


class BackendUnavailable(KVBridgeError, RuntimeError):
    """The ``flashmla`` backend cannot run here (no CUDA, no ``flash_mla``, or a build without DeepSeek-V4 kernels)."""


@dataclass(frozen=True)
class Route:
    """How one sparse decode call reaches the kernels: extra keyword arguments, and the layout each pool
    is handed over in (its own when read zero-copy, else the scratch layout it is gathered into)."""

    call_kwargs: dict
    main_layout: str
    extra_layout: str | None


@dataclass(frozen=True)
class FlashMLABuild:
    """What an installed ``flash_mla`` offers.

    ``split_legacy``: the wheel separates current (V4.1 interleaved) and legacy kernels;
    ``has_legacy``: the legacy ones are present; ``takes_format``: the entry point takes
    ``kv_format``; ``problem`` says why no DeepSeek-V4 sparse decode can run (``None`` when it can).
    """

    module: Any
    split_legacy: bool
    has_legacy: bool
    takes_format: bool = False
    problem: str | None = None

    def route(self, main: Layout, extra: Layout | None, capability: tuple[int, int] | None = None) -> Route:
        """The kernels for a main pool (and an optional extra pool) of these layouts (see the module docstring)
        on a GPU of compute ``capability`` (None: not known, every kernel the build has is assumed to run)."""
        if self.problem is not None:
            raise LayoutError(f"flashmla backend cannot run here: {self.problem}")
        if not self.split_legacy:  # one set of kernels, reading MODEL1
            return Route({"kv_format": "V4"} if self.takes_format else {}, MODEL1, MODEL1 if extra else None)
        current = capability is None or capability[0] in CURRENT_MAJORS
        legacy = self.has_legacy and (capability is None or capability[0] in LEGACY_MAJORS)
        if not current and not legacy:
            sm = f"sm_{capability[0]}{capability[1]}" if capability else "this GPU"
            raise LayoutError(
                f"flashmla backend cannot run on {sm}: this flash_mla build's current kernels need sm_100-family GPUs"
                + ("" if self.has_legacy else " and it has no legacy kernels (has_legacy() is false)")
                + "; the legacy kernels run on sm_90 and sm_100; use backend='reference'")
        model1, v41 = get_layout(MODEL1), get_layout(LEGACY_V41_MAIN)
        if legacy and main.same_record(model1):  # exact: other MODEL1 geometries are byte-moved
            return Route({"use_legacy": True, "kv_format": "V4"}, MODEL1, MODEL1 if extra else None)
        if legacy and main.name == LEGACY_V41_MAIN:
            fp4_extra = extra is not None and extra.name in LEGACY_V41_FP4_EXTRA
            if extra is None or extra.name == main.name or fp4_extra:
                return Route({"use_legacy": True, "kv_format": "V41"}, main.name, extra.name if extra else None)
        if current:
            extra_layout = None if extra is None else (extra.name if extra.name in CURRENT_EXTRA else CURRENT_MAIN)
            return Route({}, CURRENT_MAIN, extra_layout)
        # Legacy kernels only (sm_90): V4.1 fp8 records are byte-moved into the block-split cache, the rest
        # gathered into MODEL1 scratch caches.
        if main.same_record(v41):
            fp4 = get_layout(LEGACY_V41_FP4_EXTRA[0])
            extra_layout = None if extra is None else (fp4.name if extra.same_record(fp4) else v41.name)
            return Route({"use_legacy": True, "kv_format": "V41"}, v41.name, extra_layout)
        return Route({"use_legacy": True, "kv_format": "V4"}, MODEL1, MODEL1 if extra else None)


def detect_build(module: Any) -> FlashMLABuild:
    """Read what ``module`` (an imported ``flash_mla``) offers; see the module docstring."""
    func = getattr(module, "flash_mla_with_kvcache", None)
    if not callable(func) or not callable(getattr(module, "get_mla_metadata", None)):
        return FlashMLABuild(module, False, False, problem="flash_mla has no flash_mla_with_kvcache / get_mla_metadata")
    params = inspect.signature(func).parameters
    missing = [name for name in _V4_ARGUMENTS if name not in params]
    if missing:
        return FlashMLABuild(
            module, False, False,
            problem="this flash_mla build predates DeepSeek-V4's sparse decode "
            f"(flash_mla_with_kvcache lacks {', '.join(missing)})",
        )
    takes_format = "kv_format" in params
    if "use_legacy" not in params:
        return FlashMLABuild(module, False, False, takes_format)
    flag = getattr(module, "has_legacy", False)
    return FlashMLABuild(module, True, bool(flag() if callable(flag) else flag), takes_format)


def import_build() -> FlashMLABuild:
    """Import ``flash_mla`` and detect its build; ``BackendUnavailable`` if it does not import."""
    try:
        module: ModuleType = importlib.import_module("flash_mla")
    except Exception as err:  # noqa: BLE001 - a broken CUDA extension raises OSError/RuntimeError, not only ImportError
        raise BackendUnavailable(f"the flashmla backend needs the flash_mla package: import failed ({err})") from None
    return detect_build(module)


def unsupported_reason(args: DecodeArgs) -> str | None:
    """Why these validated arguments cannot go to the kernel (checked before any import), or None."""
    q = args.q
    if q.device.type != "cuda":
        return f"the flashmla backend runs on CUDA tensors; q is on {q.device}"
    if q.dtype != torch.bfloat16:
        return f"the flashmla backend needs bfloat16 q, got {q.dtype}"
    if q.shape[2] > max(KERNEL_HEADS):
        return f"the flashmla backend supports at most {max(KERNEL_HEADS)} query heads, got h_q={q.shape[2]}"
    return None


def available(args: DecodeArgs) -> bool:
    """True when ``backend='auto'`` should pick ``flashmla`` for these arguments."""
    if unsupported_reason(args) is not None:
        return False
    try:
        build = import_build()
    except BackendUnavailable:
        return False
    return build.problem is None


def kernel_view(pages: torch.Tensor, layout: Layout, page_size: int) -> torch.Tensor:
    """Zero-copy ``(num_pages, P, 1, record_bytes)`` uint8 view of pages ``[num_pages, page_bytes]``.

    Dim-0 stride is the page size in bytes (padding included); rows of a page are ``record_bytes``
    apart in the view, as the kernels address them (for block-split layouts they find the scale
    rows themselves; for interleaved ones that is the token stride).
    """
    page_bytes, rec = pages.shape[1], layout.record_bytes
    shape, strides = (pages.shape[0], page_size, 1, rec), (page_bytes, rec, rec, 1)
    return torch.as_strided(pages, shape, strides, pages.storage_offset())


def _pad_topk(indices: torch.Tensor) -> torch.Tensor:
    """int32 indices with -1 appended so that topk is a multiple of 64."""
    topk = indices.shape[-1]
    extra = -topk % TOPK_MULTIPLE
    idx = indices.to(torch.int32)
    if extra:
        pad = torch.full((*idx.shape[:-1], extra), -1, dtype=torch.int32, device=idx.device)
        idx = torch.cat([idx, pad], dim=-1)
    return idx.contiguous()


@dataclass(frozen=True)
class KernelCache:
    """One pool as the kernel takes it: the 4-D view, its layout and its int32 indices (b, s_q, topk')."""

    k_cache: torch.Tensor
    layout: Layout
    indices: torch.Tensor
    topk_length: torch.Tensor | None
    gathered: bool  # True when a scratch cache was built by gather-transcode


#: Page size of gather-transcode scratch caches.
SCRATCH_PAGE_SIZE = 64


def prepare_cache(arg: CacheArg, target: str) -> KernelCache:
    """The pool zero-copy when it is in ``target`` layout, else gathered into a ``target`` scratch cache.

    ``arg.indices`` already has -1 for negative slots and for slots past ``topk_length``, so
    only tokens that count are gathered.
    """
    lay = get_layout(target)
    if arg.layout.name == lay.name:
        view = kernel_view(arg.pages, lay, arg.page_size)
        return KernelCache(view, lay, _pad_topk(arg.indices), arg.topk_length, False)
    pages = arg.pages if arg.pages.is_contiguous() else arg.pages.contiguous()
    scratch, remapped = gather_transcode(
        pages, arg.layout, page_size=arg.page_size, indices=arg.indices,
        scale=arg.scale if arg.layout.takes_scale else None, out_page_size=SCRATCH_PAGE_SIZE, out_layout=lay,
    )
    view = kernel_view(scratch, lay, SCRATCH_PAGE_SIZE)
    return KernelCache(view, lay, _pad_topk(remapped), arg.topk_length, True)


@dataclass(frozen=True)
class KernelCall:
    """Keyword arguments of ``flash_mla_with_kvcache`` (``tile_scheduler_metadata`` aside) and
    the number of real query heads to keep from its output."""

    kwargs: dict
    heads: int
    main: KernelCache
    extra: KernelCache | None


def kernel_heads(h_q: int) -> int:
    """Smallest kernel head count (64 or 128) that holds ``h_q`` heads."""
    for h in KERNEL_HEADS:
        if h_q <= h:
            return h
    raise InputError(f"the flashmla backend supports at most {max(KERNEL_HEADS)} query heads, got h_q={h_q}")


def prepare(args: DecodeArgs, build: FlashMLABuild, capability: tuple[int, int] | None = None) -> KernelCall:
    """Everything the kernel call needs, checked and shaped; raises instead of letting the kernel fail.

    ``capability``: the GPU's compute capability the kernels are picked for (default: q's device's).
    """
    q = args.q
    if capability is None and q.is_cuda:
        capability = torch.cuda.get_device_capability(q.device)
    route = build.route(args.main.layout, args.extra.layout if args.extra is not None else None, capability)
    if q.dtype != torch.bfloat16:
        raise InputError(f"the flashmla backend needs bfloat16 q, got {q.dtype}")
    h_q = q.shape[2]
    heads = kernel_heads(h_q)
    sink = args.attn_sink
    if heads != h_q:
        q = torch.cat([q, q.new_zeros(*q.shape[:2], heads - h_q, HEAD_DIM)], dim=2)
        if sink is not None:
            sink = torch.cat([sink, sink.new_zeros(heads - h_q)])
    main = prepare_cache(args.main, route.main_layout)
    extra = prepare_cache(args.extra, route.extra_layout) if args.extra is not None else None
    kwargs = {
        "q": q.contiguous(),
        "k_cache": main.k_cache,
        "block_table": None,
        "cache_seqlens": None,
        "head_dim_v": HEAD_DIM,
        "softmax_scale": args.softmax_scale,
        "causal": False,
        "is_fp8_kvcache": True,
        "indices": main.indices,
        "attn_sink": sink,
        "extra_k_cache": extra.k_cache if extra else None,
        "extra_indices_in_kvcache": extra.indices if extra else None,
        "topk_length": main.topk_length,
        "extra_topk_length": extra.topk_length if extra else None,
        **route.call_kwargs,
    }
    return KernelCall(kwargs, h_q, main, extra)


def run(args: DecodeArgs) -> tuple[torch.Tensor, torch.Tensor]:
    """Run FlashMLA's sparse decode; returns (out (b, s_q, h_q, 512) bf16, lse (b, h_q, s_q) fp32)."""
    reason = unsupported_reason(args)
    if reason is not None:
        raise BackendUnavailable(reason)
    build = import_build()
    call = prepare(args, build)
    sched_meta, _ = build.module.get_mla_metadata()
    out, lse = build.module.flash_mla_with_kvcache(tile_scheduler_metadata=sched_meta, num_splits=None, **call.kwargs)
    return out[:, :, : call.heads].contiguous(), lse[:, : call.heads].contiguous()
