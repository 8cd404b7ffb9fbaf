"""The ``flashmla`` backend of ``sparse_decode``: FlashMLA's sparse decode kernel on CUDA.

``flash_mla`` is imported lazily. What the installed build can run is read from the module
(``detect_build``), never guessed from a version string:

- Builds whose ``flash_mla_with_kvcache`` takes ``use_legacy`` (the ``sgl-flash-mla`` wheel after
  FlashMLA's 2026.09.30 release) read only the DeepSeek-V4.1 formats with their current kernels;
  the 584-byte V4 MODEL1 cache needs ``use_legacy=True`` (``kv_format="V4"``), which exists only
  when ``flash_mla.has_legacy()`` is true (spec 3.5).
- Older builds read MODEL1 directly, provided they know DeepSeek-V4's sparse decode arguments
  (``extra_k_cache``, ``topk_length``, ``attn_sink``).

``prepare`` turns validated ``sparse_decode`` arguments into the kernel's: a MODEL1 pool is passed
zero-copy as ``(num_pages, P, 1, 584)`` uint8 with dim-0 stride = padded page bytes; any other
layout is gather-transcoded (only the touched tokens) into a MODEL1 scratch cache by
``kvbridge.paged.gather_transcode`` with remapped indices. q heads are zero-padded to 64 or 128
and index lists padded with -1 to a multiple of 64, both of which leave the result unchanged.
"""

from __future__ import annotations

import importlib
import inspect
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any

import torch

from kvbridge.attention import CacheArg, DecodeArgs
from kvbridge.codecs import HEAD_DIM
from kvbridge.errors import InputError, KVBridgeError, LayoutError

MODEL1 = "flashmla-model1"
MODEL1_RECORD_BYTES = 584
KERNEL_HEADS = (64, 128)  # h_q the kernels are instantiated for
TOPK_MULTIPLE = 64  # the kernels walk index lists in blocks of 64
_V4_ARGUMENTS = (
    "indices", "attn_sink", "extra_k_cache", "extra_indices_in_kvcache", "topk_length", "extra_topk_length",
)


class BackendUnavailable(KVBridgeError, RuntimeError):
    """The ``flashmla`` backend cannot run here (no CUDA, no ``flash_mla``, or a build without MODEL1 kernels)."""


@dataclass(frozen=True)
class FlashMLABuild:
    """What an installed ``flash_mla`` offers for the 584-byte MODEL1 cache.

    ``call_kwargs`` are the extra keyword arguments its ``flash_mla_with_kvcache`` needs to reach
    the MODEL1 kernels; ``problem`` says why it cannot (``None`` when it can).
    """

    module: Any
    split_legacy: bool  # the wheel separates current (V4.1-only) and legacy kernels
    has_legacy: bool
    call_kwargs: dict = field(default_factory=dict)
    problem: str | None = None


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
        return FlashMLABuild(module, False, False, {"kv_format": "V4"} if takes_format else {})
    flag = getattr(module, "has_legacy", False)
    legacy = bool(flag() if callable(flag) else flag)
    if not legacy:
        return FlashMLABuild(
            module, True, False,
            problem="this flash_mla build's current kernels read only the V4.1 formats (528/288 B per token) and it "
            "has no legacy kernels (has_legacy() is False), so it cannot read the 584-byte MODEL1 cache",
        )
    kwargs: dict = {"use_legacy": True}
    if takes_format:
        kwargs["kv_format"] = "V4"
    return FlashMLABuild(module, True, True, kwargs)


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


def kernel_view(pages: torch.Tensor, page_size: int) -> torch.Tensor:
    """Zero-copy ``(num_pages, P, 1, 584)`` uint8 view of MODEL1 pages ``[num_pages, page_bytes]``.

    Dim-0 stride is the padded page size (a multiple of 576 B); rows of a page are 584 B apart
    in the view, as the kernel addresses them (it finds the block-split scale rows itself).
    """
    page_bytes = pages.shape[1]
    return torch.as_strided(
        pages, (pages.shape[0], page_size, 1, MODEL1_RECORD_BYTES),
        (page_bytes, MODEL1_RECORD_BYTES, MODEL1_RECORD_BYTES, 1), pages.storage_offset(),
    )


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
    """One pool as the kernel takes it: the 4-D MODEL1 view and its int32 indices (b, s_q, topk')."""

    k_cache: torch.Tensor
    indices: torch.Tensor
    topk_length: torch.Tensor | None
    gathered: bool  # True when a scratch cache was built by gather-transcode


def prepare_cache(arg: CacheArg) -> KernelCache:
    """MODEL1 pools zero-copy; other layouts gathered into a MODEL1 scratch cache (page size 64).

    ``arg.indices`` already has -1 for negative slots and for slots past ``topk_length``, so
    only tokens that count are gathered.
    """
    if arg.layout.name == MODEL1:
        return KernelCache(kernel_view(arg.pages, arg.page_size), _pad_topk(arg.indices), arg.topk_length, False)
    from kvbridge.paged import gather_transcode

    scratch_page_size = 64
    pages = arg.pages if arg.pages.is_contiguous() else arg.pages.contiguous()
    scratch, remapped = gather_transcode(
        pages, arg.layout, page_size=arg.page_size, indices=arg.indices,
        scale=arg.scale if arg.layout.per_tensor_scale else None, out_page_size=scratch_page_size,
    )
    return KernelCache(kernel_view(scratch, scratch_page_size), _pad_topk(remapped), arg.topk_length, True)


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


def prepare(args: DecodeArgs, build: FlashMLABuild) -> KernelCall:
    """Everything the kernel call needs, checked and shaped; raises instead of letting the kernel fail."""
    if build.problem is not None:
        raise LayoutError(f"flashmla backend cannot run a MODEL1 cache: {build.problem}")
    q = args.q
    if q.dtype != torch.bfloat16:
        raise InputError(f"the flashmla backend needs bfloat16 q, got {q.dtype}")
    h_q = q.shape[2]
    heads = kernel_heads(h_q)
    sink = args.attn_sink
    if heads != h_q:
        q = torch.cat([q, q.new_zeros(*q.shape[:2], heads - h_q, HEAD_DIM)], dim=2)
        if sink is not None:
            sink = torch.cat([sink, sink.new_zeros(heads - h_q)])
    main = prepare_cache(args.main)
    extra = prepare_cache(args.extra) if args.extra is not None else None
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
        **build.call_kwargs,
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
