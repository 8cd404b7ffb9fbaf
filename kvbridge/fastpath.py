"""Dispatch of paged operations to the fastest exact implementation for the device.

Every implementation here is byte-identical to ``kvbridge.reference``:

- CPU tensors run the native numba kernels (``kvbridge.native``, imported on first use) for
  layouts whose record codec they know;
- CUDA tensors go to the Triton kernels (``kvbridge.triton_kernels``, imported only then) when
  Triton is installed and has kernels for the layouts (``_cuda_backend``);
- everything else, and everything when the environment variable ``KVBRIDGE_BACKEND=reference``
  is set, runs the reference. ``KVBRIDGE_BACKEND=auto`` (or unset) is the default.
"""

from __future__ import annotations

import os
from types import ModuleType

import torch

from kvbridge import reference
from kvbridge.errors import InputError
from kvbridge.layouts import Layout

__all__ = ["BACKEND_ENV", "all_finite", "backend_name", "decode_pages", "encode_pages", "repage", "transcode_pages"]

#: Environment variable selecting the implementation: ``auto`` (default) or ``reference``.
BACKEND_ENV = "KVBRIDGE_BACKEND"
BACKEND_CHOICES = ("auto", "reference")


def _forced_reference() -> bool:
    choice = os.environ.get(BACKEND_ENV, "auto").strip().lower() or "auto"
    if choice not in BACKEND_CHOICES:
        raise InputError(f"{BACKEND_ENV} must be one of {', '.join(BACKEND_CHOICES)}, got {choice!r}")
    return choice == "reference"


def _cpu_backend(tensor: torch.Tensor, *layouts: Layout) -> ModuleType | None:
    """The native kernel module for a CPU ``tensor`` when it knows every layout's record codec."""
    if tensor.device.type != "cpu":
        return None
    from kvbridge import native

    return native if all(native.supports(lay) for lay in layouts) else None


def _backend(tensor: torch.Tensor, *layouts: Layout) -> ModuleType:
    """The implementation module that serves ``tensor`` and ``layouts``."""
    if _forced_reference():
        return reference
    return _cuda_backend(tensor, *layouts) or _cpu_backend(tensor, *layouts) or reference


def backend_name(tensor: torch.Tensor, *layouts: Layout) -> str:
    """Short name of the implementation a paged operation on ``tensor`` would run (for reports)."""
    return _backend(tensor, *layouts).__name__.rsplit(".", 1)[-1]


def _cuda_backend(tensor: torch.Tensor, *layouts: Layout) -> ModuleType | None:
    """The Triton kernel module for a CUDA ``tensor`` (contiguous, 16-byte aligned) whose layouts it serves."""
    if not tensor.is_cuda:
        return None
    try:
        from kvbridge import triton_kernels
    except ImportError:  # Triton not installed: the torch reference also runs on CUDA
        return None
    usable = triton_kernels.supports(*layouts) and triton_kernels.aligned(tensor)
    return triton_kernels if usable else None


def all_finite(x: torch.Tensor) -> bool:
    """True when latents ``x`` hold no NaN or Inf (native bit test for fp32/bf16 CPU tensors)."""
    if x.dtype in (torch.float32, torch.bfloat16) and _backend(x).__name__ == "kvbridge.native":
        return _backend(x).all_finite(x)
    return not bool((~torch.isfinite(x)).any())


def encode_pages(x: torch.Tensor, layout: Layout, page_size: int, dialect: str | None, scale: float) -> torch.Tensor:
    """fp32 or bf16 ``[N, 512]`` -> pages (see ``reference.encode_pages``); bf16 is read as is by
    the native kernels and widened to fp32 (exactly) for the others."""
    backend = _backend(x, layout)
    if backend.__name__ != "kvbridge.native" and x.dtype != torch.float32:
        x = x.float()
    return backend.encode_pages(x, layout, page_size, dialect, scale)


def decode_pages(pages: torch.Tensor, layout: Layout, page_size: int, num_tokens: int | None,
                 scale: float) -> torch.Tensor:
    """Pages -> fp32 ``[num_tokens, 512]`` (see ``reference.decode_pages``)."""
    return _backend(pages, layout).decode_pages(pages, layout, page_size, num_tokens, scale)


def _into(out: torch.Tensor | None, result: torch.Tensor) -> torch.Tensor:
    return result if out is None else out.copy_(result)


def repage(pages: torch.Tensor, src: Layout, src_page_size: int, dst: Layout, dst_page_size: int,
           num_tokens: int | None, *, out: torch.Tensor | None = None) -> torch.Tensor:
    """Byte move of identical records between page geometries (see ``reference.repage``), into
    ``out`` when given (the native kernels write it directly, others through a copy)."""
    backend = _backend(pages, src, dst)
    if backend.__name__ == "kvbridge.native":
        return backend.repage(pages, src, src_page_size, dst, dst_page_size, num_tokens, out=out)
    return _into(out, backend.repage(pages, src, src_page_size, dst, dst_page_size, num_tokens))


def transcode_pages(
    pages: torch.Tensor, src: Layout, src_page_size: int, dst: Layout, dst_page_size: int,
    num_tokens: int | None, src_scale: float, dst_scale: float, dialect: str | None,
    *, out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Decode + re-encode pages (see ``reference.transcode_pages``); NaN/Inf in the source raises.
    Written into ``out`` when given (the native kernels write it directly, others through a copy)."""
    backend = _backend(pages, src, dst)
    args = (pages, src, src_page_size, dst, dst_page_size, num_tokens, src_scale, dst_scale, dialect)
    if backend.__name__ == "kvbridge.native":
        return backend.transcode_pages(*args, out=out)
    return _into(out, backend.transcode_pages(*args))
