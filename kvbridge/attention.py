"""FlashMLA sparse MLA decode over KV pools of any registered layout.

``sparse_decode`` validates every argument, then runs one of two backends:

- ``reference``: torch on the inputs' device. Only the token records the indices touch are
  gathered, as whole records, and decoded by the dispatcher's backend (bit-identical to the layout's
  record codec), then fp32 attention.
- ``flashmla``: ``flash_mla.flash_mla_with_kvcache`` on CUDA (see ``kvbridge.flashmla_backend``).

Token slot ``s`` of a pool with page size ``P`` is page ``s // P``, row ``s % P``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from kvbridge import fastpath
from kvbridge.api import _check_scale
from kvbridge.codecs import HEAD_DIM
from kvbridge.errors import InputError, LayoutError
from kvbridge.layouts import Layout, get_layout

BACKENDS = ("auto", "reference", "flashmla")
DEFAULT_SOFTMAX_SCALE = HEAD_DIM**-0.5
_Q_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
_CACHE_DTYPES = (torch.uint8, torch.float8_e4m3fn)
# Reference backend: at most this many gathered fp32 K values are alive at once (256 MiB).
_MAX_GATHERED_VALUES = 64 * 1024 * 1024


@dataclass(frozen=True)
class CacheArg:
    """One validated KV pool: uint8 pages ``[num_pages, page_bytes]``, its indices and scale.

    ``indices`` is int64 ``(b, s_q, topk)`` with every slot past ``topk_length`` and every
    negative slot set to -1; ``valid`` marks the slots that count.
    """

    pages: torch.Tensor
    layout: Layout
    page_size: int
    scale: float
    indices: torch.Tensor
    valid: torch.Tensor
    topk_length: torch.Tensor | None


def pages_2d(k_cache: torch.Tensor, layout: Layout, page_size: int, what: str) -> torch.Tensor:
    """uint8 pages ``[num_pages, page_bytes]`` from ``k_cache`` in either accepted form.

    Accepted: pages ``[num_pages, page_bytes]`` as ``kvbridge.encode`` makes them, or the
    kernel view ``(num_pages, page_size, 1, record_bytes)`` whose dim-0 stride (in bytes) is
    ``page_bytes`` (for ``flashmla-model1`` the page padded to a multiple of 576 B).
    uint8 or float8_e4m3fn (viewed as uint8, no copy).
    """
    if not isinstance(k_cache, torch.Tensor):
        raise InputError(f"{what} must be a torch.Tensor, got {type(k_cache).__name__}")
    if k_cache.dtype not in _CACHE_DTYPES:
        raise InputError(f"{what} must be uint8 (or float8_e4m3fn) pages, got {k_cache.dtype}")
    cache = k_cache.view(torch.uint8)
    pb = layout.page_bytes(page_size)
    if cache.dim() == 2:
        if cache.shape[1] != pb:
            raise InputError(
                f"{what}: {layout.name} pages of {page_size} tokens must have shape [num_pages, {pb}], "
                f"got {list(cache.shape)}"
            )
        if cache.stride(1) != 1:
            raise InputError(f"{what}: each page's bytes must be contiguous (stride(1) == 1)")
        return cache
    if cache.dim() == 4:
        want = (page_size, 1, layout.record_bytes)
        if tuple(cache.shape[1:]) != want:
            raise InputError(
                f"{what}: a 4-D {layout.name} cache must have shape (num_pages, {page_size}, 1, "
                f"{layout.record_bytes}), got {tuple(cache.shape)}"
            )
        n = cache.shape[0]
        inner = (layout.record_bytes, layout.record_bytes, 1)
        if tuple(cache.stride()[1:]) != inner or (n > 1 and cache.stride(0) != pb):
            raise InputError(
                f"{what}: a 4-D {layout.name} cache must have strides ({pb}, {inner[0]}, {inner[1]}, 1) "
                f"(dim-0 stride = page bytes), got {cache.stride()}"
            )
        end = cache.storage_offset() + n * pb
        if cache.untyped_storage().nbytes() < end:
            raise InputError(f"{what}: its storage ends before the last page's padding ({end} bytes needed)")
        return torch.as_strided(cache, (n, pb), (pb, 1))
    raise InputError(f"{what} must be 2-D pages or a 4-D (num_pages, P, 1, record_bytes) view, got {cache.dim()}-D")


def _check_indices(indices: torch.Tensor, what: str, batch_shape: tuple[int, int], device: torch.device) -> int:
    if not isinstance(indices, torch.Tensor):
        raise InputError(f"{what} must be a torch.Tensor, got {type(indices).__name__}")
    if indices.dtype != torch.int32:
        raise InputError(f"{what} must be int32 token slots, got {indices.dtype}")
    if indices.dim() != 3 or tuple(indices.shape[:2]) != batch_shape:
        raise InputError(
            f"{what} must have shape (b, s_q, topk) = ({batch_shape[0]}, {batch_shape[1]}, topk), "
            f"got {tuple(indices.shape)}"
        )
    if indices.shape[2] < 1:
        raise InputError(f"{what} must hold at least one slot per query (topk >= 1)")
    if indices.device != device:
        raise InputError(f"{what} is on {indices.device} but q is on {device}")
    return indices.shape[2]


def _check_topk_length(topk_length: torch.Tensor | None, what: str, b: int, topk: int, device: torch.device) -> None:
    if topk_length is None:
        return
    if not isinstance(topk_length, torch.Tensor):
        raise InputError(f"{what} must be a torch.Tensor, got {type(topk_length).__name__}")
    if topk_length.dtype != torch.int32 or tuple(topk_length.shape) != (b,):
        raise InputError(f"{what} must be int32 of shape ({b},), got {topk_length.dtype} {tuple(topk_length.shape)}")
    if topk_length.device != device:
        raise InputError(f"{what} is on {topk_length.device} but q is on {device}")
    if b and (int(topk_length.min()) < 0 or int(topk_length.max()) > topk):
        lo, hi = int(topk_length.min()), int(topk_length.max())
        raise InputError(f"{what} values must lie in [0, {topk}], got [{lo}, {hi}]")


def _cache_arg(
    k_cache: torch.Tensor, indices: torch.Tensor, topk_length: torch.Tensor | None, layout: str | Layout,
    page_size: int, scale: float | None, names: tuple[str, str, str, str, str, str], q: torch.Tensor,
) -> CacheArg:
    """Validate one pool with its indices; ``names`` = the argument names used in messages."""
    cache_name, idx_name, len_name, layout_name, page_size_name, scale_name = names
    try:
        lay = get_layout(layout)
    except LayoutError as err:
        raise LayoutError(f"{layout_name}: {err}") from None
    if isinstance(page_size, bool) or not isinstance(page_size, int) or page_size < 1:
        raise InputError(f"{page_size_name} must be a positive integer, got {page_size!r}")
    pages = pages_2d(k_cache, lay, page_size, cache_name)
    if pages.device != q.device:
        raise InputError(f"{cache_name} is on {pages.device} but q is on {q.device}")
    s = _check_scale(scale, lay, scale_name)
    b, s_q = q.shape[0], q.shape[1]
    topk = _check_indices(indices, idx_name, (b, s_q), q.device)
    _check_topk_length(topk_length, len_name, b, topk, q.device)
    idx = indices.to(torch.int64)
    capacity = pages.shape[0] * page_size
    over = idx >= capacity
    if bool(over.any()):
        pos = tuple(int(v) for v in over.nonzero()[0])
        raise InputError(
            f"{idx_name}{list(pos)} = {int(idx[pos])} is outside the pool's {capacity} token slots "
            f"({pages.shape[0]} pages of {page_size}); use -1 for an unused slot"
        )
    valid = idx >= 0
    if topk_length is not None:
        valid &= torch.arange(topk, device=q.device) < topk_length.to(torch.int64)[:, None, None]
    idx = torch.where(valid, idx, torch.full_like(idx, -1))
    return CacheArg(pages, lay, page_size, s, idx, valid, topk_length)


@dataclass(frozen=True)
class DecodeArgs:
    """Everything ``sparse_decode`` validated: q, the pools, sink and softmax scale."""

    q: torch.Tensor
    main: CacheArg
    extra: CacheArg | None
    attn_sink: torch.Tensor | None
    softmax_scale: float


def validate(
    q: torch.Tensor, k_cache: torch.Tensor, indices: torch.Tensor, *, layout: str | Layout, page_size: int,
    extra_k_cache: torch.Tensor | None, extra_indices: torch.Tensor | None, extra_layout: str | Layout | None,
    extra_page_size: int | None, topk_length: torch.Tensor | None, extra_topk_length: torch.Tensor | None,
    attn_sink: torch.Tensor | None, softmax_scale: float | None, scale: float | None, extra_scale: float | None,
) -> DecodeArgs:
    """Check every ``sparse_decode`` argument (shapes, dtypes, devices, index ranges)."""
    if not isinstance(q, torch.Tensor):
        raise InputError(f"q must be a torch.Tensor, got {type(q).__name__}")
    if q.dim() != 4 or q.shape[3] != HEAD_DIM:
        raise InputError(f"q must have shape (b, s_q, h_q, {HEAD_DIM}), got {tuple(q.shape)}")
    if q.dtype not in _Q_DTYPES:
        raise InputError(f"q must be bfloat16, float16 or float32, got {q.dtype}")
    main = _cache_arg(k_cache, indices, topk_length, layout, page_size, scale,
                      ("k_cache", "indices", "topk_length", "layout", "page_size", "scale"), q)
    extra_given = {
        "extra_indices": extra_indices, "extra_page_size": extra_page_size, "extra_layout": extra_layout,
        "extra_topk_length": extra_topk_length, "extra_scale": extra_scale,
    }
    extra = None
    if extra_k_cache is None:
        stray = [name for name, value in extra_given.items() if value is not None]
        if stray:
            raise InputError(f"{stray[0]} was given without extra_k_cache")
    else:
        if extra_indices is None:
            raise InputError("extra_k_cache needs extra_indices")
        if extra_page_size is None:
            raise InputError("extra_k_cache needs extra_page_size (tokens per page of the extra cache)")
        extra = _cache_arg(
            extra_k_cache, extra_indices, extra_topk_length, layout if extra_layout is None else extra_layout,
            extra_page_size, extra_scale,
            ("extra_k_cache", "extra_indices", "extra_topk_length", "extra_layout", "extra_page_size", "extra_scale"),
            q,
        )
    if attn_sink is not None:
        if not isinstance(attn_sink, torch.Tensor):
            raise InputError(f"attn_sink must be a torch.Tensor, got {type(attn_sink).__name__}")
        if attn_sink.dtype != torch.float32 or tuple(attn_sink.shape) != (q.shape[2],):
            raise InputError(
                f"attn_sink must be float32 of shape (h_q,) = ({q.shape[2]},), "
                f"got {attn_sink.dtype} {tuple(attn_sink.shape)}"
            )
        if attn_sink.device != q.device:
            raise InputError(f"attn_sink is on {attn_sink.device} but q is on {q.device}")
        if bool(torch.isnan(attn_sink).any()):
            raise InputError("attn_sink holds NaN")
    if softmax_scale is None:
        sm = DEFAULT_SOFTMAX_SCALE
    else:
        if isinstance(softmax_scale, bool) or not isinstance(softmax_scale, (int, float)):
            raise InputError(f"softmax_scale must be a positive finite number, got {softmax_scale!r}")
        sm = float(softmax_scale)
        if not (math.isfinite(sm) and sm > 0):
            raise InputError(f"softmax_scale must be a positive finite number, got {softmax_scale!r}")
    return DecodeArgs(q, main, extra, attn_sink, sm)


def _decode_slots(pages: torch.Tensor, layout: Layout, page_size: int, slots: torch.Tensor,
                  scale: float) -> torch.Tensor:
    """fp32 values ``[U, 512]`` of the tokens at in-range ``slots``: whole records gathered per record
    part (one row index per token and part), decoded by the dispatcher's backend (bit-identical to
    the layout's codec)."""
    parts = [view.reshape(-1, hi - lo).index_select(0, slots) for view, lo, hi in layout.geometry.page_views(
        pages, page_size)]
    records = torch.cat(parts, dim=1) if len(parts) > 1 else parts[0]
    n = records.shape[0]
    if n == 0:
        return torch.zeros(0, HEAD_DIM, dtype=torch.float32, device=pages.device)
    return fastpath.decode_pages(layout.records_to_pages(records, n), layout, n, n, scale)


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
    from kvbridge import flashmla_backend

    if backend == "auto" and not flashmla_backend.available(args):
        return reference_decode(args)
    return flashmla_backend.run(args)
