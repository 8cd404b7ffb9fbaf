"""FlashMLA sparse MLA decode over KV pools of any registered layout.

``sparse_decode`` validates every argument, then runs one of two backends:

- ``reference``: torch on the inputs' device. Only the token records the indices touch are
  gathered, as whole records, and decoded by the dispatcher's backend (bit-identical to the layout's
  record codec), then fp32 attention.
- ``flashmla``: ``flash_mla.flash_mla_with_kvcache`` on CUDA (see ``kvbridge.attention.flashmla``).

Token slot ``s`` of a pool with page size ``P`` is page ``s // P``, row ``s % P``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from kvbridge.attention import flashmla
from kvbridge.attention.args import CacheArg, DecodeArgs, validate
from kvbridge.attention.backends import BACKENDS
from kvbridge.backends import dispatch
from kvbridge.errors import InputError
from kvbridge.layouts import Layout
from kvbridge.layouts.codec import HEAD_DIM
from kvbridge.ops.pages import first_bad_copy

#: At most this many fp32 values are gathered at once by the reference decode.
_MAX_GATHERED_VALUES = 64 * 1024 * 1024


def _decode_slots(pages: torch.Tensor, layout: Layout, page_size: int, slots: torch.Tensor,
                  scale: float) -> torch.Tensor:
    """fp32 values ``[U, 512]`` of the tokens at in-range ``slots``: whole records gathered per record
    part (one row index per token and part), decoded by the dispatcher's backend (bit-identical to
    the layout's codec); ``CopyMismatchError`` for a token whose two copies of some dims disagree (mirrors)."""
    parts = [view.reshape(-1, hi - lo).index_select(0, slots) for view, lo, hi in layout.geometry.page_views(
        pages, page_size)]
    records = torch.cat(parts, dim=1) if len(parts) > 1 else parts[0]
    n = records.shape[0]
    if n == 0:
        return torch.zeros(0, HEAD_DIM, dtype=torch.float32, device=pages.device)
    found = first_bad_copy(records, layout, scale)  # None without mirrors (nothing read)
    if found is not None:
        raise found.error(layout, f"pool slot {int(slots[found.index])}")
    return dispatch.decode_pages(layout.records_to_pages(records, n), layout, n, n, scale)


def _dequantize_touched(arg: CacheArg) -> tuple[torch.Tensor, torch.Tensor]:
    """(fp32 values ``[U, 512]`` of the U distinct valid slots, positions ``(b, s_q, topk)``).

    Position ``U`` (one past the last) stands for an invalid slot and reads a zero row.
    """
    slots, inverse = torch.unique(arg.indices, return_inverse=True)
    has_invalid = bool(slots.numel()) and int(slots[0]) < 0
    touched = slots[1:] if has_invalid else slots
    pages = arg.pages if arg.pages.is_contiguous() else arg.pages.contiguous()
    values = _decode_slots(pages, arg.layout, arg.page_size, touched, arg.scale)
    pos = inverse - 1 if has_invalid else inverse
    pos = torch.where(arg.valid, pos, torch.full_like(pos, touched.numel()))
    zero = torch.zeros(1, HEAD_DIM, dtype=torch.float32, device=values.device)
    return torch.cat([values, zero]), pos


def reference_decode(args: DecodeArgs) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact-dequantization fp32 sparse decode; returns (out bf16 (b, s_q, h_q, 512), lse fp32 (b, h_q, s_q))."""
    q = args.q
    b, s_q, h_q, _ = q.shape
    pools = [args.main] if args.extra is None else [args.main, args.extra]
    values, positions, valids = [], [], []
    for pool in pools:
        vals, pos = _dequantize_touched(pool)
        values.append(vals)
        positions.append(pos.reshape(b * s_q, -1))
        valids.append(pool.valid.reshape(b * s_q, -1))
    topk_total = sum(p.shape[1] for p in positions)
    qf = q.reshape(b * s_q, h_q, HEAD_DIM).float()
    out = torch.zeros(b * s_q, h_q, HEAD_DIM, dtype=torch.float32, device=q.device)
    lse = torch.full((b * s_q, h_q), math.inf, dtype=torch.float32, device=q.device)
    rows_per_chunk = max(1, _MAX_GATHERED_VALUES // (topk_total * HEAD_DIM))
    for start in range(0, b * s_q, rows_per_chunk):
        rows = slice(start, min(start + rows_per_chunk, b * s_q))
        k = torch.cat([vals[pos[rows]] for vals, pos in zip(values, positions, strict=True)], dim=1)
        valid = torch.cat([v[rows] for v in valids], dim=1)
        logits = torch.matmul(qf[rows], k.transpose(1, 2)) * args.softmax_scale
        logits = logits.masked_fill(~valid[:, None, :], -math.inf)
        any_valid = valid.any(dim=1)
        chunk_lse = torch.logsumexp(logits, dim=-1)
        weights = torch.exp(logits - chunk_lse[..., None])
        chunk_out = torch.matmul(weights, k)
        chunk_out = torch.where(any_valid[:, None, None], chunk_out, torch.zeros_like(chunk_out))
        out[rows] = chunk_out
        lse[rows] = torch.where(any_valid[:, None], chunk_lse, torch.full_like(chunk_lse, math.inf))
    if args.attn_sink is not None:
        out = out * torch.sigmoid(lse - args.attn_sink)[..., None]
        out = torch.where(torch.isinf(lse)[..., None], torch.zeros_like(out), out)
    out = out.reshape(b, s_q, h_q, HEAD_DIM).to(torch.bfloat16)
    return out, lse.reshape(b, s_q, h_q).permute(0, 2, 1).contiguous()


@dataclass(frozen=True)
class Tolerance:
    """FlashMLA's test tolerances: an element passes when its abs error < ``abs_tol`` or its error
    relative to |ref| + 1e-6 is < ``rel_tol``; the whole tensor's cosine difference must be
    <= ``cos_diff_tol``."""

    abs_tol: float
    rel_tol: float
    cos_diff_tol: float


#: FlashMLA's tolerances for its sparse decode against its fp32 reference (its tests' assertions).
OUT_TOLERANCE = Tolerance(1e-3, 2.01 / 128, 5e-6)
LSE_TOLERANCE = Tolerance(1e-6, 8.01 / 65536, 5e-6)


@dataclass(frozen=True)
class Comparison:
    """Result of ``compare``: ``failing`` elements, their max abs error, and the cosine difference."""

    passed: bool
    failing: int
    max_abs_error: float
    cos_diff: float
    detail: str


def compare(ans: torch.Tensor, ref: torch.Tensor, tol: Tolerance) -> Comparison:
    """Compare a decode output with a reference the way FlashMLA's tests do.

    +inf, -inf and NaN must sit at the same positions in both (they then count as 0); cosine
    difference = 1 - 2<a, r> / (|a|^2 + |r|^2) in float64, 0 when |r|^2 < 1e-12.
    """
    if ans.shape != ref.shape:
        raise InputError(f"compare: shapes differ, {tuple(ans.shape)} vs {tuple(ref.shape)}")
    a, r = ans.float().clone(), ref.float().clone()
    anomalies = []
    for name, am, rm in (
        ("+inf", a == math.inf, r == math.inf),
        ("-inf", a == -math.inf, r == -math.inf),
        ("NaN", torch.isnan(a), torch.isnan(r)),
    ):
        if not torch.equal(am, rm):
            anomalies.append(f"{name} at {int(am.sum())} places vs {int(rm.sum())}")
        a[am], r[rm] = 0.0, 0.0
    abs_err = (a - r).abs()
    rel_err = abs_err / (r.abs() + 1e-6)
    ok = (abs_err < tol.abs_tol) | (rel_err < tol.rel_tol)
    failing = int((~ok).sum())
    max_abs = float(abs_err.max()) if abs_err.numel() else 0.0
    a64, r64 = a.double(), r.double()
    rr = float((r64 * r64).sum())
    cos_diff = 0.0 if rr < 1e-12 else 1.0 - 2.0 * float((a64 * r64).sum()) / float((a64 * a64 + r64 * r64).sum())
    passed = not anomalies and failing == 0 and abs(cos_diff) <= tol.cos_diff_tol
    detail = "; ".join([*anomalies, f"{failing} of {ok.numel()} elements out of tolerance",
                        f"max abs error {max_abs:.3g}", f"cosine difference {cos_diff:.3g}"])
    return Comparison(passed, failing, max_abs, cos_diff, detail)


def sparse_decode(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    indices: torch.Tensor,
    *,
    layout: str | Layout,
    page_size: int,
    extra_k_cache: torch.Tensor | None = None,
    extra_indices: torch.Tensor | None = None,
    extra_layout: str | Layout | None = None,
    extra_page_size: int | None = None,
    topk_length: torch.Tensor | None = None,
    extra_topk_length: torch.Tensor | None = None,
    attn_sink: torch.Tensor | None = None,
    softmax_scale: float | None = None,
    scale: float | None = None,
    extra_scale: float | None = None,
    backend: str = "auto",
) -> tuple[torch.Tensor, torch.Tensor]:
    """FlashMLA sparse decode of queries ``q`` over KV pool(s) in any registered layout.

    - ``q``: (b, s_q, h_q, 512) bf16 (fp16/fp32 accepted by ``reference``).
    - ``k_cache``: pages of ``layout`` ``[num_pages, page_bytes]`` uint8 (``kvbridge.encode``
      output) or the kernel view (num_pages, page_size, 1, record_bytes), dim-0 stride = page bytes.
    - ``indices``: (b, s_q, topk) int32 token slots ``page * page_size + row``; negative = invalid
      (-1 by convention); a slot >= num_pages * page_size is an error.
    - ``extra_*``: a second pool (the compressed one; ``extra_layout`` defaults to ``layout``,
      ``extra_page_size`` is required) attended jointly: one softmax over both index lists.
    - ``topk_length`` / ``extra_topk_length``: (b,) int32, only the first n slots of a row count.
    - ``attn_sink``: (h_q,) fp32; ``out *= 1 / (1 + exp(sink - lse))``; lse excludes the sink.
    - ``softmax_scale``: logit multiplier, default 512 ** -0.5.
    - ``scale`` / ``extra_scale``: per-tensor scale of a ``trtllm-fp8`` pool (default 1.0).
    - ``backend``: ``reference``, ``flashmla`` (CUDA + ``flash_mla``) or ``auto`` (flashmla if available).

    Returns (out (b, s_q, h_q, 512) bf16, lse (b, h_q, s_q) fp32, natural log); a row with no
    valid slot gives out 0 and lse +inf.
    """
    if backend not in BACKENDS:
        raise InputError(f"backend must be one of {', '.join(BACKENDS)}, got {backend!r}")
    args = validate(
        q, k_cache, indices, layout=layout, page_size=page_size, extra_k_cache=extra_k_cache,
        extra_indices=extra_indices, extra_layout=extra_layout, extra_page_size=extra_page_size,
        topk_length=topk_length, extra_topk_length=extra_topk_length, attn_sink=attn_sink,
        softmax_scale=softmax_scale, scale=scale, extra_scale=extra_scale,
    )
    if q.shape[0] == 0:  # an empty batch: empty outputs, nothing to attend
        b, s_q, h_q, d = q.shape
        return q.new_zeros((b, s_q, h_q, d), dtype=torch.bfloat16), q.new_zeros((b, h_q, s_q), dtype=torch.float32)
    if backend == "reference":
        return reference_decode(args)
    if backend == "auto" and not flashmla.available(args):
        return reference_decode(args)
    return flashmla.run(args)
