"""Reference paged operations (readable torch), the ground truth for every fast path.

All take already-validated arguments (see ``kvbridge.api``): fp32 contiguous latents,
uint8 pages of the right shape, a resolved dialect and an fp32-representable scale.
"""

from __future__ import annotations

import torch

from kvbridge.errors import NonFiniteError
from kvbridge.layouts import Layout


def encode_pages(x: torch.Tensor, layout: Layout, page_size: int, dialect: str | None, scale: float) -> torch.Tensor:
    """fp32 ``[N, 512]`` -> pages ``[ceil(N/P), page_bytes]``."""
    return layout.records_to_pages(layout.codec.encode(x, dialect=dialect, scale=scale), page_size)


def decode_pages(
    pages: torch.Tensor, layout: Layout, page_size: int, num_tokens: int | None, scale: float
) -> torch.Tensor:
    """Pages -> fp32 ``[num_tokens, 512]`` (all rows when ``num_tokens`` is None)."""
    return layout.codec.decode(layout.pages_to_records(pages, page_size, num_tokens), scale=scale)


def repage(
    pages: torch.Tensor, src: Layout, src_page_size: int, dst: Layout, dst_page_size: int, num_tokens: int | None
) -> torch.Tensor:
    """Byte move of identical token records between two page geometries."""
    return dst.records_to_pages(src.pages_to_records(pages, src_page_size, num_tokens), dst_page_size)


def check_finite(values: torch.Tensor, what: str = "source") -> None:
    bad = ~torch.isfinite(values)
    if bool(bad.any()):
        token, dim = bad.nonzero()[0].tolist()
        raise NonFiniteError(f"{what} holds non-finite values ({int(bad.sum())}; first at token {token}, dim {dim})")


def transcode_pages(
    pages: torch.Tensor,
    src: Layout,
    src_page_size: int,
    dst: Layout,
    dst_page_size: int,
    num_tokens: int | None,
    src_scale: float,
    dst_scale: float,
    dialect: str | None,
) -> torch.Tensor:
    """Decode ``src`` pages and re-encode them as ``dst`` (NaN in the source is an error)."""
    values = decode_pages(pages, src, src_page_size, num_tokens, src_scale)
    check_finite(values)
    return encode_pages(values, dst, dst_page_size, dialect, dst_scale)
