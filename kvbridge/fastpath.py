"""Dispatch of paged operations to the fastest exact implementation for the device.

Every implementation here is byte-identical to ``kvbridge.reference``. CUDA tensors go to the
Triton kernels (``kvbridge.triton_kernels``, imported only then) when Triton is installed and
has kernels for the layouts; everything else runs the reference.
"""

from __future__ import annotations

from types import ModuleType

import torch

from kvbridge import reference
from kvbridge.layouts import Layout

__all__ = ["decode_pages", "encode_pages", "repage", "transcode_pages"]


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


def encode_pages(x: torch.Tensor, layout: Layout, page_size: int, dialect: str | None, scale: float) -> torch.Tensor:
    """fp32 ``[N, 512]`` -> pages (see ``reference.encode_pages``)."""
    backend = _cuda_backend(x, layout)
    if backend is not None:
        return backend.encode_pages(x, layout, page_size, dialect, scale)
    return reference.encode_pages(x, layout, page_size, dialect, scale)


def decode_pages(pages: torch.Tensor, layout: Layout, page_size: int, num_tokens: int | None,
                 scale: float) -> torch.Tensor:
    """Pages -> fp32 ``[num_tokens, 512]`` (see ``reference.decode_pages``)."""
    backend = _cuda_backend(pages, layout)
    if backend is not None:
        return backend.decode_pages(pages, layout, page_size, num_tokens, scale)
    return reference.decode_pages(pages, layout, page_size, num_tokens, scale)


def repage(pages: torch.Tensor, src: Layout, src_page_size: int, dst: Layout, dst_page_size: int,
           num_tokens: int | None) -> torch.Tensor:
    """Byte move of identical records between page geometries (see ``reference.repage``)."""
    backend = _cuda_backend(pages, src, dst)
    if backend is not None:
        return backend.repage(pages, src, src_page_size, dst, dst_page_size, num_tokens)
    return reference.repage(pages, src, src_page_size, dst, dst_page_size, num_tokens)


def transcode_pages(
    pages: torch.Tensor, src: Layout, src_page_size: int, dst: Layout, dst_page_size: int,
    num_tokens: int | None, src_scale: float, dst_scale: float, dialect: str | None,
) -> torch.Tensor:
    """Decode + re-encode pages (see ``reference.transcode_pages``); NaN/Inf in the source raises."""
    backend = _cuda_backend(pages, src, dst)
    if backend is not None:
        return backend.transcode_pages(pages, src, src_page_size, dst, dst_page_size, num_tokens, src_scale,
                                       dst_scale, dialect)
    return reference.transcode_pages(pages, src, src_page_size, dst, dst_page_size, num_tokens, src_scale,
                                     dst_scale, dialect)
