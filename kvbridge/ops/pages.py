"""Public codec API: ``encode``, ``decode``, ``transcode`` (torch tensors in and out).

Pages are uint8 ``[num_pages, page_bytes]``; token ``t`` sits in page ``t // P`` at row
``t % P``. Latents are ``[num_tokens, 512]`` (448 nope then 64 rope dims).
Every function returns on the device of its input.
"""

from __future__ import annotations

import dataclasses
import math
from functools import cache
from typing import Literal

import torch

from kvbridge import numerics as nx
from kvbridge.backends import dispatch
from kvbridge.backends.loss_stats import LossStats
from kvbridge.backends.reference import check_finite
from kvbridge.errors import InputError, NonFiniteError, OutputBufferError
from kvbridge.layouts import Layout, get_layout, scan
from kvbridge.layouts.codec import HEAD_DIM, reciprocal_f32, ue8m0_dialect
from kvbridge.layouts.registry import OP_BF16, OP_E2M1_E4M3, OP_E4M3_UE8M0, OP_ROUND_BF16, OP_ZERO, check_device
from kvbridge.ops.checks import _check_auto, _check_byte_move_dialect, _check_dialect, _check_scale
from kvbridge.ops.loss import LossReport, loss_report, transcode_loss

NonFinitePolicy = Literal["error", "zero", "saturate", "propagate"]
NONFINITE_POLICIES = ("error", "zero", "saturate", "propagate")
#: The policies a transcode takes: the source's NaN/Inf refused, or re-encoded as the destination's writer does.
TRANSCODE_NONFINITE_POLICIES = ("error", "propagate")
_FLOAT_INPUTS = (torch.float32, torch.bfloat16, torch.float16)


def _check_num_tokens(num_tokens: object) -> int | None:
    """``num_tokens`` as given when it is None or a non-negative int, else ``InputError``."""
    if num_tokens is None:
        return None
    if isinstance(num_tokens, bool) or not isinstance(num_tokens, int) or num_tokens < 0:
        raise InputError(f"num_tokens must be a non-negative integer or None, got {repr(num_tokens)[:40]}")
    return num_tokens


def _check_latents(x: torch.Tensor) -> None:
    if not isinstance(x, torch.Tensor):
        raise InputError(f"x must be a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in _FLOAT_INPUTS:
        raise InputError(f"x must be bfloat16, float16 or float32, got {x.dtype}")
    if x.dim() != 2 or x.shape[1] != HEAD_DIM:
        raise InputError(f"x must have shape [num_tokens, {HEAD_DIM}], got {list(x.shape)}")
    check_device(x, "latents x")


def _check_nonfinite(policy: object, layout: Layout | None, dialect: str | None,
                     policies: tuple[str, ...] = NONFINITE_POLICIES) -> str:
    """``policy`` when it is one of ``policies`` and, for ``propagate`` with a ``layout``, every field of
    ``layout`` encoded with ``dialect`` has a known writer rule for NaN/Inf tiles; ``InputError`` otherwise."""
    if not isinstance(policy, str) or policy not in policies:
        raise InputError(f"nonfinite must be one of {', '.join(policies)}, got {policy!r:.40}")
    if policy == "propagate" and layout is not None:
        for op, *_ in layout.segments:
            if op in (OP_BF16, OP_ZERO, OP_ROUND_BF16, OP_E2M1_E4M3) or (
                    op == OP_E4M3_UE8M0 and ue8m0_dialect(dialect) in nx.UE8M0_NONFINITE_DIALECTS):
                continue
            raise InputError(
                f"nonfinite='propagate' is not available for {layout.name} with dialect {dialect!r}: what its "
                "writer stores for a NaN/Inf tile is not established (docs/layouts.md, non-finite values); "
                "pass nonfinite='zero' or 'saturate', or a dialect among "
                f"{', '.join(nx.UE8M0_NONFINITE_DIALECTS)} for a UE8M0 layout"
            )
    return policy


def _apply_nonfinite(x: torch.Tensor, policy: str) -> torch.Tensor:
    """Return ``x`` (fp32, or bf16 passed through unchanged) with NaN/Inf handled per the checked ``policy``
    (see ``encode``); any replacement is done, and returned, in fp32; ``propagate`` returns ``x`` as it is."""
    if policy == "propagate" or dispatch.all_finite(x):
        return x
    bad = ~torch.isfinite(x)
    if policy == "error":
        token, dim = (int(v) for v in bad.nonzero()[0])
        value = float(x[token, dim])
        raise NonFiniteError(
            f"non-finite value {value} at token {token}, dim {dim} "
            f"({int(bad.sum())} non-finite values in all); pass nonfinite='zero' or 'saturate' to encode anyway, "
            "or 'propagate' to store them as the dialect's writer does"
        )
    x = x.float()
    x = torch.where(torch.isnan(x), torch.zeros_like(x), x)
    if policy == "zero":
        return torch.where(torch.isinf(x), torch.zeros_like(x), x)
    big = torch.finfo(torch.float32).max
    return x.clamp(min=-big, max=big)


def auto_scale(x: torch.Tensor) -> float:
    """Smallest fp32 per-tensor scale with which no value of ``x`` saturates (amax / 448).

    The scale is nudged up by fp32 ulps until amax * fp32(1/s) <= 448. All-zero input gives 1.0.
    """
    if not isinstance(x, torch.Tensor) or not x.dtype.is_floating_point:
        raise InputError(f"x must be a floating-point torch.Tensor, got {getattr(x, 'dtype', type(x).__name__)}")
    x = x.detach()
    if x.numel() and not dispatch.all_finite(x.float()):
        raise NonFiniteError("x holds NaN or Inf: no finite scale avoids saturating it")
    return _scale_for_amax(float(x.abs().max()) if x.numel() else 0.0)


def _scale_for_amax(amax: float) -> float:
    """``auto_scale`` of values whose largest magnitude is the finite fp32 ``amax``."""
    if amax == 0.0:
        return 1.0
    s = torch.tensor(amax, dtype=torch.float32) / torch.tensor(nx.E4M3_MAX, dtype=torch.float32)
    amax32 = torch.tensor(amax, dtype=torch.float32)
    while float(amax32 * reciprocal_f32(float(s))) > nx.E4M3_MAX:
        s = torch.nextafter(s, torch.tensor(math.inf))
    return float(s)


def encode(
    x: torch.Tensor,
    layout: str | Layout,
    *,
    page_size: int,
    dialect: str | None = None,
    scale: float | str | None = None,
    nonfinite: NonFinitePolicy = "error",
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Encode latents ``x`` ``[num_tokens, 512]`` (bf16/fp16/fp32) into pages of ``layout``.

    Returns uint8 ``[ceil(num_tokens / page_size), page_bytes]``; rows of a partly filled
    last page and each page's padding tail are zero. ``dialect`` picks the encoder's scale
    rule (584-byte layouts: ``flashmla`` default, ``amax-1e-4``, ``amax-1e-8``;
    ``trtllm-fp8``: ``swa`` default, ``compress``). ``scale`` is the per-tensor scale of
    ``trtllm-fp8`` (default 1.0; ``"auto"`` picks ``auto_scale(x)``), or the NVFP4 global scale g of
    ``flashinfer-nvfp4`` (default 1.0; an fp32 in [2^-117, 2^116], docs/layouts.md).
    ``nonfinite``: ``error`` (default) raises naming the first bad token and dim; ``zero``
    writes NaN and +-Inf as 0; ``saturate`` writes NaN as 0 and +-Inf as the format's max;
    ``propagate`` stores each NaN/Inf tile as the dialect's own writer does (docs/layouts.md; refused with
    ``InputError`` for a layout or dialect whose writer's bytes are not established), always on the
    reference codec.
    ``out``: an existing contiguous uint8 tensor of exactly that shape, on ``x``'s device and not
    sharing memory with ``x``, to write into instead of allocating (reused across calls, it saves
    the first-touch cost of fresh memory); every byte of it is written, and it is returned. All
    arguments, NaN/Inf included, are checked before ``out`` is touched: a refusal writes nothing.
    """
    lay = get_layout(layout)
    _check_latents(x)
    x = x.detach()  # encoding is not differentiable: an input that requires grad is read as values
    lay.check_page_size(page_size)
    d = _check_dialect(dialect, lay)
    policy = _check_nonfinite(nonfinite, lay, d)
    if out is not None:
        _check_out(out, dtype=torch.uint8, shape=[lay.num_pages(x.shape[0], page_size), lay.page_bytes(page_size)],
                   source=x, what=lay.name, source_name="latents x")
    xf = _apply_nonfinite(x if x.dtype == torch.bfloat16 else x.float(), policy)  # bf16: no fp32 copy
    if _check_auto(scale, lay):
        scale = auto_scale(xf)
    s = _check_scale(scale, lay)
    if policy == "propagate" and not dispatch.all_finite(xf):
        return dispatch.encode_pages_nonfinite(xf.contiguous(), lay, page_size, d, s, out=out)
    return dispatch.encode_pages(xf.contiguous(), lay, page_size, d, s, out=out)


def decode(
    pages: torch.Tensor,
    layout: str | Layout,
    *,
    page_size: int,
    num_tokens: int | None = None,
    scale: float | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Decode pages of ``layout`` to fp32 latents ``[num_tokens, 512]``.

    ``num_tokens`` defaults to every row of every page; ``scale`` is the per-tensor scale
    of ``trtllm-fp8`` or the NVFP4 global scale of ``flashinfer-nvfp4`` (default 1.0). Exact: each
    decoded value is the stored value (NVFP4: ``fp32(e2m1 * scale) * g``, one rounding).
    ``out``: an existing contiguous fp32 ``[num_tokens, 512]`` tensor on the pages' device, not
    sharing memory with ``pages`` (and not requiring grad), to write into instead of allocating;
    every value of it is written, and it is returned. It is checked before anything is written.
    A layout storing some dims twice (a mirror field, ``lil-nvfp4-ds-mla``'s rope) decodes them from their
    first copy and raises ``CopyMismatchError`` when the second copy is not what its writer encodes from them.
    """
    lay = get_layout(layout)
    lay.check_page_size(page_size)
    lay.check_pages(pages, page_size)
    num_tokens = _check_num_tokens(num_tokens)
    s = _check_scale(scale, lay)
    if out is not None:
        _check_out(out, dtype=torch.float32, shape=[lay.token_count(pages, page_size, num_tokens), HEAD_DIM],
                   source=pages, what="decoded latents", source_name="pages")
    _check_page_copies(pages, lay, page_size, num_tokens, s)
    return dispatch.decode_pages(pages, lay, page_size, num_tokens, s, out=out)


@cache
def record_layout(layout: Layout) -> Layout:
    """``layout`` with its records stored token-major and unpadded: a page of N rows is N records ``[N, rb]``
    (the record, hence the compiled segments and the loss note, is unchanged)."""
    if layout.split is None and layout.page_align == 1:
        return layout
    return dataclasses.replace(layout, split=None, page_align=1)


#: Records per pass of the copy check (16,384 tokens: 32 MiB of fp32 values, 7 MiB of re-encoded records at 432 B).
COPY_CHECK_TOKENS = 1 << 14


def first_bad_copy(records: torch.Tensor, layout: Layout, scale: float = 1.0) -> scan.CopyMismatch | None:
    """The first of token records ``[N, record_bytes]`` of ``layout`` whose second copy of some dims (a mirror
    field) is not what its writer encodes from their first copy (``layouts.scan.mirror_mismatch``), else None.
    The records are decoded (each dim from its first copy) and re-encoded at ``scale`` with the layout's default
    dialect on the dispatcher's backend (byte-identical to the reference codec), ``COPY_CHECK_TOKENS`` at a time;
    tokens whose values are not all finite are not compared (what a writer stores in a second copy of NaN/Inf is
    not established). Always None for a layout without mirrors."""
    if not layout.mirrors:
        return None
    view = record_layout(layout)
    for t0 in range(0, records.shape[0], COPY_CHECK_TOKENS):
        part = records[t0 : t0 + COPY_CHECK_TOKENS].contiguous()
        k = part.shape[0]
        values = dispatch.decode_pages(part.view(1, -1), view, k, k, scale)
        finite = torch.isfinite(values).all(dim=1)
        skipped = not bool(finite.all())
        if skipped:
            values = values.masked_fill(~finite[:, None], 0.0)
        expected = dispatch.encode_pages(values, view, k, layout.default_dialect, scale).view(k, -1)
        if skipped:
            expected[~finite] = part[~finite]
        found = scan.mirror_mismatch(part, expected, layout)
        if found is not None:
            return dataclasses.replace(found, index=t0 + found.index)
    return None


def check_copies(records: torch.Tensor, layout: Layout, scale: float = 1.0, what: str = "source token",
                 first: int = 0) -> None:
    """Raise ``CopyMismatchError`` naming ``what`` and the index (``first`` + its row) of the first of token records
    ``[N, record_bytes]`` whose two copies of some dims disagree (``first_bad_copy``). Every operation that decodes
    records of a layout with mirrors runs it before it writes anything; nothing is read for other layouts."""
    if layout.mirrors:
        found = first_bad_copy(records, layout, scale)
        if found is not None:
            raise found.error(layout, f"{what} {first + found.index}")


def _check_page_copies(pages: torch.Tensor, layout: Layout, page_size: int, num_tokens: int | None,
                       scale: float) -> None:
    """``check_copies`` of the first ``num_tokens`` (default all) tokens of ``pages``; nothing for layouts
    without mirrors (no records gathered)."""
    if layout.mirrors:
        check_copies(layout.pages_to_records(pages, page_size, layout.token_count(pages, page_size, num_tokens)),
                     layout, scale)


def is_byte_move(src: Layout, dst: Layout, src_scale: float, dst_scale: float) -> bool:
    """True when ``src`` and ``dst`` store identical token records (only paging differs)."""
    return src.same_record(dst) and (not src.takes_scale or src_scale == dst_scale)


def _byte_span(t: torch.Tensor) -> tuple[int, int]:
    """[first, last + 1) byte addresses ``t``'s elements occupy (empty for no elements)."""
    if not t.numel():
        return 0, 0
    last = sum((size - 1) * stride for size, stride in zip(t.shape, t.stride(), strict=True))
    return t.data_ptr(), t.data_ptr() + (last + 1) * t.element_size()


def _check_out(out: object, *, dtype: torch.dtype, shape: list[int], source: torch.Tensor, what: str,
               source_name: str) -> None:
    """Raise ``OutputBufferError`` unless ``out`` can receive a ``dtype`` result of ``shape`` (``what``)
    computed from ``source`` (named ``source_name``); checked before anything is written."""
    if not isinstance(out, torch.Tensor):
        raise OutputBufferError(f"out must be a torch.Tensor, got {type(out).__name__}; pass "
                                f"torch.empty({shape}, dtype={dtype}) or leave out=None for a fresh output")
    if out.dtype != dtype or list(out.shape) != shape:
        raise OutputBufferError(f"out must be {str(dtype).removeprefix('torch.')} of shape {shape} for {what}, "
                                f"got {out.dtype} {list(out.shape)}; allocate it with torch.empty({shape}, "
                                f"dtype={dtype}, device={str(source.device)!r})")
    if out.device != source.device:
        raise OutputBufferError(f"out is on {out.device} but {source_name} are on {source.device}; "
                                f"allocate out on {source.device}")
    if not out.is_contiguous():
        raise OutputBufferError(f"out must be contiguous (row-major), got strides {tuple(out.stride())}; pass a "
                                "contiguous tensor (out.contiguous() would be a copy that never receives the result)")
    if out.requires_grad:
        raise OutputBufferError("out requires grad, and kvbridge writes it in place; pass a tensor with "
                                "requires_grad=False (out.detach() shares its memory)")
    lo, hi = _byte_span(source)
    o_lo, o_hi = _byte_span(out)
    if o_lo < hi and lo < o_hi:
        raise OutputBufferError(f"out overlaps the source {source_name}; write into separate memory")


def transcode(
    pages: torch.Tensor,
    src_layout: str | Layout,
    dst_layout: str | Layout,
    *,
    src_page_size: int,
    dst_page_size: int | None = None,
    num_tokens: int | None = None,
    src_scale: float | None = None,
    dst_scale: float | str | None = None,
    dialect: str | None = None,
    nonfinite: Literal["error", "propagate"] = "error",
    report: bool = False,
    out: torch.Tensor | None = None,
) -> torch.Tensor | tuple[torch.Tensor, LossReport]:
    """Convert pages from ``src_layout`` to ``dst_layout`` (and page size).

    When both layouts store the same token record (re-paging, ``flashmla-model1`` <->
    ``trtllm-fp8-ds-mla``, per-tensor or NVFP4 at an equal scale) this is a pure byte move, bit-exact;
    ``dialect`` is then refused since nothing is re-encoded. Otherwise the source is decoded
    and re-encoded with ``dialect`` and ``dst_scale`` (``"auto"``: no saturation).
    With ``report=True`` returns ``(pages, LossReport)``. ``out``: an existing uint8 tensor of
    exactly the destination's shape (``[ceil(num_tokens / dst_page_size), page_bytes]``, same
    device, contiguous, not overlapping ``pages``) to write into instead of allocating; every byte of
    it is written, and it is returned; one that does not fit raises ``OutputBufferError``. Arguments
    are checked before ``out`` is touched, but a source found to hold NaN/Inf while converting may
    leave ``out`` partly written. ``nonfinite``: ``error`` (default) refuses a source holding NaN/Inf codes;
    ``propagate`` decodes it and re-encodes the values as the destination dialect's writer does
    (``encode(..., nonfinite="propagate")``, on the reference codec; refused where that is not available),
    and a byte move then keeps the source's codes as they are. ``report`` is refused with ``propagate``.
    A source layout with mirrors (``lil-nvfp4-ds-mla``) whose two copies disagree raises ``CopyMismatchError``
    before ``out`` is touched (``check_copies``); a byte move decodes nothing and does not compare them.
    """
    if not isinstance(report, bool):
        raise InputError(f"report must be True or False, got {type(report).__name__}")
    src = get_layout(src_layout)
    dst = get_layout(dst_layout)
    src.check_page_size(src_page_size)
    dps = src_page_size if dst_page_size is None else dst.check_page_size(dst_page_size)
    num_tokens = _check_num_tokens(num_tokens)
    n = src.token_count(pages, src_page_size, num_tokens)
    s_in = _check_scale(src_scale, src, "src_scale")
    auto = _check_auto(dst_scale, dst, "dst_scale")
    s_out = 1.0 if auto else _check_scale(dst_scale, dst, "dst_scale")
    if out is not None:
        _check_out(out, dtype=torch.uint8, shape=[dst.num_pages(n, dps), dst.page_bytes(dps)], source=pages,
                   what=dst.name, source_name="pages")
    policy = _check_nonfinite(nonfinite, None, None, TRANSCODE_NONFINITE_POLICIES)
    if policy == "propagate" and report:
        raise InputError("report=True measures a finite conversion; it is not available with nonfinite='propagate'")
    if not auto and is_byte_move(src, dst, s_in, s_out):
        _check_byte_move_dialect(src, dst, dialect)
        if policy == "error":
            scan.check_pages(pages, src, src_page_size, n, scale=s_in)  # the stored codes, at the actual scale
        out = dispatch.repage(pages, src, src_page_size, dst, dps, num_tokens, out=out)
        if not report:
            return out
        return out, loss_report(LossStats(num_tokens=n), src, dst, byte_move=True, dst_scale=s_out)
    d = _check_dialect(dialect, dst)
    _check_page_copies(pages, src, src_page_size, num_tokens, s_in)  # a decode reads each dim's first copy only
    if policy == "propagate":  # decoded NaN/Inf re-encoded as dst's writer does (a per-tensor dst is refused)
        _check_nonfinite(policy, dst, d)
        values = dispatch.decode_pages(pages, src, src_page_size, num_tokens, s_in)
        return encode(values, dst, page_size=dps, dialect=d, nonfinite="propagate", out=out)
    if auto:  # the amax from codes and scale bytes (one read pass)
        amax = dispatch.amax_pages(pages, src, src_page_size, num_tokens, s_in)
        if amax is None:  # a value decodes to NaN/Inf: the decoded values name it
            values = dispatch.decode_pages(pages, src, src_page_size, num_tokens, s_in)
            check_finite(values)
            amax = float(values.abs().max())
        s_out = _scale_for_amax(amax)
    out = dispatch.transcode_pages(pages, src, src_page_size, dst, dps, num_tokens, s_in, s_out, d, out=out)
    if not report:
        return out
    return out, transcode_loss(pages, src, src_page_size, out, dst, dps, n, src_scale, s_out if auto else dst_scale,
                               dialect)
