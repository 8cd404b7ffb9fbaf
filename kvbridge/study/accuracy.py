"""Accuracy study: what each KV layout (and per-tensor scale) costs at the attention output.

Method, for one *case* (bf16 latents ``[N, 512]``, queries ``(b, s_q, h_q, 512)`` bf16 and top-k
slot indices ``(b, s_q, topk)``):

1. The reference is ``sparse_decode`` over the latents stored in the lossless ``bf16`` layout.
2. Each *variant* (a registry layout with one encoder dialect and, for per-tensor layouts, one
   scale rule) encodes the same latents with ``kvbridge.encode`` and is decoded by the same
   ``sparse_decode`` with the same queries and indices.
3. Metrics against the reference: relative L2, max-abs error and cosine similarity of the
   attention output; max-abs error of the lse; KL divergence and top-k overlap of the attention
   weights; the error of K itself in its nope (dims 0..447) and rope (448..511) parts; the
   fractions of E4M3-stored values that saturate, fall into E4M3 subnormals, or flush to zero.
4. Attribution: for variants whose decoded values are exactly bf16-representable (every 584-byte
   dialect, per-tensor FP8 at power-of-two scales), the output error is measured again with only
   the nope part quantized (rope from the reference) and with only the rope part quantized.

Attention weights are not returned by ``sparse_decode``; they are recomputed from the decoded K
with the kernel's formula: ``logit = softmax_scale * q . K`` in fp32 and
``log weight = logit - lse`` with the lse that ``sparse_decode`` returned.

Everything here returns plain dicts and dataclasses (JSON-serialisable), no printing.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Callable
from dataclasses import asdict, dataclass, fields, replace

import torch

from kvbridge import numerics as nx
from kvbridge.attention.args import DEFAULT_SOFTMAX_SCALE
from kvbridge.attention.sparse import sparse_decode
from kvbridge.dumps.dumpfile import read_dump
from kvbridge.errors import InputError
from kvbridge.layouts import Layout, all_layouts, get_layout
from kvbridge.layouts.codec import HEAD_DIM, NOPE_DIM
from kvbridge.layouts.formats import get_format
from kvbridge.ops.pages import auto_scale, decode, encode
from kvbridge.study import synthetic
from kvbridge.study.params import (
    CALIBRATED,
    CALIBRATED_POW2,
    DEFAULT_POW2_SCALES,
    DEFAULT_SWEEPS,
    SyntheticParams,
    scale_label,
)

REFERENCE_LAYOUT = "bf16"


@dataclass(frozen=True)
class Variant:
    """One way of storing the latents: ``layout`` with encoder ``dialect`` and per-tensor ``scale``.

    ``scale`` is ``None`` for layouts without a per-tensor scale, else a number (fp32 value of the
    per-layer ``s``), ``CALIBRATED`` or ``CALIBRATED_POW2`` (resolved per case from its amax).
    """

    layout: str
    dialect: str | None = None
    scale: float | str | None = None

    @property
    def label(self) -> str:
        text = self.layout
        if self.dialect is not None:
            text += f"/{self.dialect}"
        if self.scale is not None:
            text += f" s={scale_label(self.scale)}"
        return text


def registry_variants(pow2_scales: tuple[float, ...] = DEFAULT_POW2_SCALES) -> list[Variant]:
    """Every layout and dialect of the registry, the lossless reference layout first.

    Per-tensor layouts get scale 1.0, ``CALIBRATED``, ``CALIBRATED_POW2`` and each of
    ``pow2_scales`` for their default (scale-honouring) dialect; other dialects are written at
    scale 1 only (TensorRT-LLM's compressed-token writer ignores the scale, so its pool decodes
    correctly only at s = 1).
    """
    for s in pow2_scales:
        if not (isinstance(s, (int, float)) and s > 0 and math.frexp(s)[0] == 0.5):
            raise InputError(f"pow2_scales must hold positive powers of two, got {s!r}")
    reference = get_layout(REFERENCE_LAYOUT)
    out = [Variant(reference.name)]
    for lay in all_layouts():
        if lay.name == reference.name:
            continue
        dialects: tuple[str | None, ...] = lay.dialects or (None,)
        for dialect in dialects:
            if not lay.per_tensor_scale:
                out.append(Variant(lay.name, dialect))
            elif dialect == lay.default_dialect:
                scales: tuple[float | str, ...] = (1.0, CALIBRATED, CALIBRATED_POW2, *pow2_scales)
                out.extend(Variant(lay.name, dialect, s) for s in dict.fromkeys(scales))
            else:
                out.append(Variant(lay.name, dialect, 1.0))
    return out


def resolve_scale(scale: float | str | None, latents: torch.Tensor) -> float | None:
    """The fp32 per-tensor scale a variant uses for ``latents`` (``None`` for per-tile layouts)."""
    if scale is None:
        return None
    if isinstance(scale, (int, float)) and not isinstance(scale, bool):
        return float(scale)
    amax = latents.float().abs().amax()
    if scale == CALIBRATED:
        return auto_scale(latents.float())
    if scale == CALIBRATED_POW2:
        if float(amax) == 0.0:
            return 1.0
        return float(nx.pow2(nx.ceil_log2_div448(amax)))
    raise InputError(f"scale must be a number, {CALIBRATED!r} or {CALIBRATED_POW2!r}, got {scale!r}")


@dataclass
class QuantizedKV:
    """Latents stored by one variant: ``pages`` (uint8), the resolved ``scale`` and the decoded fp32
    ``values`` ``[N, 512]``."""

    layout: Layout
    page_size: int
    pages: torch.Tensor
    scale: float | None
    values: torch.Tensor


def quantize(latents: torch.Tensor, variant: Variant, page_size: int) -> QuantizedKV:
    """Encode bf16 ``latents`` ``[N, 512]`` as ``variant`` and decode them back (exact)."""
    lay = get_layout(variant.layout)
    s = resolve_scale(variant.scale, latents)
    pages = encode(latents, lay, page_size=page_size, dialect=variant.dialect, scale=s)
    values = decode(pages, lay, page_size=page_size, num_tokens=latents.shape[0], scale=s)
    return QuantizedKV(lay, page_size, pages, s, values)


# ---------------------------------------------------------------- metrics


def e4m3_stats(latents: torch.Tensor, q: QuantizedKV) -> dict[str, float]:
    """Fractions of the E4M3-stored values of each field (and of all of them) that saturate, fall
    into E4M3 subnormals, or flush to zero, read from the stored bytes with the format table's
    ``at_max``, ``subnormal`` and ``zero`` code rules (every format that has all three: E4M3).

    A value *saturates* when its byte is the max magnitude (0x7E) and |input| exceeds the decoded
    max; it is *subnormal* when it is nonzero and its byte's exponent bits are 0 (this includes
    flushes); it *flushes* when it is nonzero and its byte is +-0. Fractions are over all stored
    values of the field (zeros included). Layouts without E4M3 fields give 0.0 everywhere.
    """
    records = q.layout.pages_to_records(q.pages, q.page_size, latents.shape[0])
    x = latents.float()
    stats: dict[str, float] = {}
    totals = torch.zeros(4, dtype=torch.float64)  # count, saturated, subnormal, flushed
    for f in q.layout.fields:
        fmt = get_format(f.format)
        if f.dims is None or None in (fmt.at_max, fmt.subnormal, fmt.zero):
            continue  # the format table gives this format no saturation / subnormal / zero codes
        d0, d1 = f.dims
        if fmt.width != 1 or f.nbytes != d1 - d0:
            raise InputError(f"field {f.name} of {q.layout.name} does not hold one {f.format} byte per dim")
        codes = records[:, f.offset : f.offset + f.nbytes]
        xin = x[:, d0:d1].abs()
        nonzero = xin != 0
        saturated = ((codes & fmt.at_max.mask) == fmt.at_max.value) & (xin > q.values[:, d0:d1].abs())
        subnormal = nonzero & ((codes & fmt.subnormal.mask) == fmt.subnormal.value)
        flushed = nonzero & ((codes & fmt.zero.mask) == fmt.zero.value)
        counts = torch.tensor([codes.numel(), int(saturated.sum()), int(subnormal.sum()), int(flushed.sum())],
                              dtype=torch.float64)
        totals += counts
        for key, c in zip(("saturated", "subnormal", "flushed"), counts[1:], strict=True):
            stats[f"{f.name}_{key}_frac"] = float(c / counts[0]) if counts[0] else 0.0
    for key, c in zip(("saturated", "subnormal", "flushed"), totals[1:], strict=True):
        stats[f"{key}_frac"] = float(c / totals[0]) if totals[0] else 0.0
    return stats


def _rel_l2(x: torch.Tensor, ref: torch.Tensor) -> float:
    """||x - ref|| / ||ref|| (L2 over all elements, accumulated in fp64)."""
    den = float(torch.linalg.vector_norm(ref, dtype=torch.float64))
    num = float(torch.linalg.vector_norm(x - ref, dtype=torch.float64))
    return num / den if den > 0 else (0.0 if num == 0 else math.inf)


def k_error(values: torch.Tensor, reference: torch.Tensor) -> dict[str, float]:
    """Relative L2 and max-abs error (latent units) of decoded K in its nope and rope parts."""
    out = {}
    for part, sl in (("nope", slice(0, NOPE_DIM)), ("rope", slice(NOPE_DIM, HEAD_DIM))):
        diff = (values[:, sl] - reference[:, sl]).abs()
        out[f"k_{part}_rel_l2"] = _rel_l2(values[:, sl], reference[:, sl])
        out[f"k_{part}_max_abs"] = float(diff.max()) if diff.numel() else 0.0
    return out


def output_error(
    out: torch.Tensor, ref_out: torch.Tensor, lse: torch.Tensor, ref_lse: torch.Tensor
) -> dict[str, float]:
    """Errors of the attention output ``(b, s_q, h_q, 512)`` and lse ``(b, h_q, s_q)`` against the
    reference: relative L2 over the whole tensor, max abs, cosine similarity (fp64, whole tensor
    and the lowest per-row value), and the max abs lse error over rows with a finite reference lse."""
    o = out.double().reshape(-1, out.shape[-1])
    r = ref_out.double().reshape(-1, ref_out.shape[-1])
    cos = float((o * r).sum() / (o.norm() * r.norm())) if float(o.norm() * r.norm()) > 0 else 1.0
    row_norms = o.norm(dim=1) * r.norm(dim=1)
    live = row_norms > 0
    row_cos = (o * r).sum(dim=1)[live] / row_norms[live]
    finite = torch.isfinite(ref_lse)
    lse_err = (lse[finite].double() - ref_lse[finite].double()).abs()
    return {
        "out_rel_l2": _rel_l2(o, r),
        "out_max_abs": float((o - r).abs().max()) if o.numel() else 0.0,
        "out_cosine": cos,
        "out_min_row_cosine": float(row_cos.min()) if row_cos.numel() else 1.0,
        "lse_max_abs": float(lse_err.max()) if lse_err.numel() else 0.0,
    }


def attention_log_weights(
    q: torch.Tensor, values: torch.Tensor, indices: torch.Tensor, lse: torch.Tensor, softmax_scale: float
) -> torch.Tensor:
    """Natural-log attention weights ``(b, s_q, h_q, topk)`` (fp32; -inf where an index is invalid).

    ``log w = softmax_scale * q . K[idx] - lse`` with q ``(b, s_q, h_q, 512)``, decoded K ``values``
    ``[N, 512]`` fp32, slot ``indices`` ``(b, s_q, topk)`` (negative = invalid) and ``lse``
    ``(b, h_q, s_q)`` as returned by ``sparse_decode``.
    """
    valid = indices >= 0
    k = values[indices.clamp(min=0).long()]  # (b, s_q, topk, 512)
    logits = torch.einsum("bshd,bstd->bsht", q.float(), k) * softmax_scale
    logw = logits - lse.permute(0, 2, 1).unsqueeze(-1)
    return logw.masked_fill(~valid.unsqueeze(2), -math.inf)


def weight_error(logw: torch.Tensor, ref_logw: torch.Tensor, overlap_k: int) -> dict[str, float]:
    """KL(reference || variant) of the attention weights (nats; mean and max over query rows) and
    the overlap of the ``overlap_k`` highest-weight tokens (fraction; mean and min over rows).

    Rows whose reference has no valid token are skipped; ``overlap_k`` is capped at the row length.
    """
    ref = ref_logw.reshape(-1, ref_logw.shape[-1]).double()
    var = logw.reshape(-1, logw.shape[-1]).double()
    live = torch.isfinite(ref).any(dim=1)
    ref, var = ref[live], var[live]
    if ref.shape[0] == 0:
        return {"kl_mean": 0.0, "kl_max": 0.0, "topk_overlap_mean": 1.0, "topk_overlap_min": 1.0}
    p = ref.exp()
    terms = torch.where(p > 0, p * (ref - var), torch.zeros_like(p))
    kl = terms.sum(dim=1)
    k = min(overlap_k, ref.shape[1])
    top_ref = ref.topk(k, dim=1).indices
    top_var = var.topk(k, dim=1).indices
    hits = (top_ref.unsqueeze(2) == top_var.unsqueeze(1)).any(dim=2).sum(dim=1).double() / k
    return {
        "kl_mean": float(kl.mean()),
        "kl_max": float(kl.max()),
        "topk_overlap_mean": float(hits.mean()),
        "topk_overlap_min": float(hits.min()),
    }


# ---------------------------------------------------------------- evaluation


@dataclass
class Case:
    """One decode step to measure.

    ``latents`` bf16 ``[N, 512]`` (token t at slot t), ``q`` bf16 ``(b, s_q, h_q, 512)``,
    ``indices`` int32 ``(b, s_q, topk)`` slots (-1 invalid), ``page_size`` tokens per page of
    every pool built from the latents, ``softmax_scale`` (``None``: 512^-0.5).
    """

    latents: torch.Tensor
    q: torch.Tensor
    indices: torch.Tensor
    page_size: int = 64
    softmax_scale: float | None = None

    def summary(self) -> dict[str, object]:
        """Shapes and magnitudes of the case (for the study's output)."""
        x = self.latents.float()
        return {
            "tokens": x.shape[0],
            "batch": self.q.shape[0],
            "s_q": self.q.shape[1],
            "heads": self.q.shape[2],
            "topk": self.indices.shape[2],
            "page_size": self.page_size,
            "nope_rms": float(x[:, :NOPE_DIM].square().mean().sqrt()),
            "rope_rms": float(x[:, NOPE_DIM:].square().mean().sqrt()),
            "amax": float(x.abs().max()),
        }


def _check_case(case: Case) -> None:
    x = case.latents
    if not isinstance(x, torch.Tensor) or x.dtype != torch.bfloat16 or x.dim() != 2 or x.shape[1] != HEAD_DIM:
        raise InputError(f"latents must be bfloat16 [num_tokens, {HEAD_DIM}], got "
                         f"{getattr(x, 'dtype', type(x).__name__)} {list(getattr(x, 'shape', []))}")
    if not bool(torch.isfinite(x).all()):
        raise InputError("latents hold NaN or Inf; the study needs finite reference values")


def _decode_step(case: Case, pages: torch.Tensor, layout: str | Layout, scale: float | None,
                 backend: str) -> tuple[torch.Tensor, torch.Tensor]:
    return sparse_decode(case.q, pages, case.indices, layout=layout, page_size=case.page_size,
                         softmax_scale=case.softmax_scale, scale=scale, backend=backend)


def digest(t: torch.Tensor) -> str:
    """First 16 hex digits of the SHA-256 of a tensor's bytes (equal digests: identical outputs)."""
    return hashlib.sha256(t.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()[:16]


def _bf16_exact(values: torch.Tensor) -> bool:
    return bool(torch.equal(values.to(torch.bfloat16).float(), values))


#: ``progress(label, done, total)``: ``done`` of ``total`` variant evaluations are finished, the last
#: one ``label`` (e.g. ``magnitude=0.01: trtllm-fp8/swa s=1``). The study's only output while it runs.
Progress = Callable[[str, int, int], None]


def evaluate(case: Case, variants: list[Variant], *, overlap_k: int = 16, backend: str = "reference",
             on_variant: Callable[[str], None] | None = None) -> list[dict]:
    """Measure every variant of ``variants`` on ``case`` against the bf16 reference; one dict per variant.

    The reference decode always uses the ``reference`` backend (exact fp32 math); ``backend`` is
    the one the variants use. ``overlap_k`` is the number of highest-weight tokens compared.
    Keys: ``variant``, ``layout``, ``dialect``, ``scale_rule``, ``scale``, ``bytes_per_token``,
    ``out_digest`` (``digest`` of the output), the metrics of ``output_error``, ``weight_error``,
    ``k_error`` and ``e4m3_stats``, and
    ``out_rel_l2_nope_only`` / ``out_rel_l2_rope_only`` (``None`` when the decoded values are not
    exactly bf16, so a mixed pool cannot be stored losslessly). ``on_variant`` is called with each
    variant's label once it is measured.
    """
    _check_case(case)
    if isinstance(overlap_k, bool) or not isinstance(overlap_k, int) or overlap_k < 1:
        raise InputError(f"overlap_k must be a positive integer, got {overlap_k!r}")

    sm = DEFAULT_SOFTMAX_SCALE if case.softmax_scale is None else case.softmax_scale
    ref = quantize(case.latents, Variant(REFERENCE_LAYOUT), case.page_size)
    ref_out, ref_lse = _decode_step(case, ref.pages, ref.layout, None, "reference")
    ref_logw = attention_log_weights(case.q, ref.values, case.indices, ref_lse, sm)
    rows = []
    attribution_cache: dict[str, dict[str, float | None]] = {}
    for variant in variants:
        qkv = quantize(case.latents, variant, case.page_size)
        out, lse = _decode_step(case, qkv.pages, qkv.layout, qkv.scale, backend)
        logw = attention_log_weights(case.q, qkv.values, case.indices, lse, sm)
        row: dict = {
            "variant": variant.label,
            "layout": qkv.layout.name,
            "dialect": variant.dialect,
            "scale_rule": None if variant.scale is None else scale_label(variant.scale),
            "scale": qkv.scale,
            "bytes_per_token": qkv.layout.record_bytes,
        }
        row.update(output_error(out, ref_out, lse, ref_lse))
        row["out_digest"] = digest(out)
        row.update(weight_error(logw, ref_logw, overlap_k))
        row.update(k_error(qkv.values, ref.values))
        row.update(e4m3_stats(case.latents, qkv))
        row.update(_attribution(case, qkv.values, ref.values, ref_out, ref_lse, row["out_rel_l2"], backend,
                                attribution_cache))
        rows.append(row)
        if on_variant is not None:
            on_variant(variant.label)
    return rows


def _attribution(case: Case, values: torch.Tensor, ref_values: torch.Tensor, ref_out: torch.Tensor,
                 ref_lse: torch.Tensor, out_rel_l2: float, backend: str,
                 cache: dict[str, dict[str, float | None]]) -> dict[str, float | None]:
    """Output rel-L2 error with only the nope part, then only the rope part, of K quantized.

    The mixed K is stored losslessly in a ``bf16`` pool and decoded by the reference backend.
    When one part is already exact and the variant ran on the reference backend, the mixed pool
    equals the variant's values, so its error (``out_rel_l2``) is reused. ``cache`` maps a values
    digest to its result (variants that decode to the same values share it).
    """
    key = digest(values)
    if key in cache:
        return cache[key]
    parts = {"nope": slice(0, NOPE_DIM), "rope": slice(NOPE_DIM, HEAD_DIM)}
    exact = {part: torch.equal(values[:, sl], ref_values[:, sl]) for part, sl in parts.items()}
    result: dict[str, float | None] = {}
    for part, sl in parts.items():
        other = "rope" if part == "nope" else "nope"
        if exact[part]:
            result[f"out_rel_l2_{part}_only"] = 0.0
        elif exact[other] and backend == "reference":
            result[f"out_rel_l2_{part}_only"] = out_rel_l2
        elif not _bf16_exact(values):
            result[f"out_rel_l2_{part}_only"] = None
        else:
            mixed = ref_values.clone()
            mixed[:, sl] = values[:, sl]
            pages = encode(mixed.to(torch.bfloat16), REFERENCE_LAYOUT, page_size=case.page_size)
            out, lse = _decode_step(case, pages, REFERENCE_LAYOUT, None, "reference")
            result[f"out_rel_l2_{part}_only"] = output_error(out, ref_out, lse, ref_lse)["out_rel_l2"]
    cache[key] = result
    return result


# ---------------------------------------------------------------- synthetic study


def synthetic_case(params: SyntheticParams, seed: int) -> Case:
    """Build the case ``params`` describes; deterministic for ``seed``.

    Latents and queries come from ``kvbridge.study.synthetic`` and are rounded to bf16 (the reference
    the study measures against); indices are computed from the bf16 values.
    """
    p = params
    if p.layer == "swa":
        if not 1 <= p.window <= p.context:
            raise InputError(f"window must lie in [1, context={p.context}], got {p.window}")
        positions = torch.arange(p.context - p.window, p.context, dtype=torch.int64)
        x = synthetic.latents(p.window, seed=seed, layer="swa", positions=positions, **_latent_kwargs(p))
    else:
        x = synthetic.latents(p.context, seed=seed, layer=p.layer, compress_ratio=p.compress_ratio,
                              **_latent_kwargs(p))
    latents = x.to(torch.bfloat16)
    keys = latents.float()
    q = synthetic.queries(keys, batch=p.batch, s_q=p.s_q, heads=p.heads, seed=seed, peakedness=p.peakedness,
                          focus_tokens=p.focus_tokens, logit_noise=p.logit_noise).to(torch.bfloat16)
    if p.layer == "swa":
        indices = torch.arange(p.window, dtype=torch.int32).expand(p.batch, p.s_q, p.window).contiguous()
    else:
        indices = synthetic.topk_indices(q, keys, p.topk)
    return Case(latents, q, indices, page_size=p.page_size)


def _latent_kwargs(p: SyntheticParams) -> dict:
    return {"magnitude": p.magnitude, "rope_ratio": p.rope_ratio, "shared_fraction": p.shared_fraction,
            "gain_spread": p.gain_spread, "outlier_channels": p.outlier_channels, "outlier_gain": p.outlier_gain}


def _ticker(progress: Progress | None, total: int) -> Callable[[str], Callable[[str], None] | None]:
    """For a point named ``point``, the ``on_variant`` of ``evaluate`` that counts towards ``total``
    and reports to ``progress`` (None without one)."""
    done = 0

    def for_point(point: str) -> Callable[[str], None] | None:
        if progress is None:
            return None

        def on_variant(label: str) -> None:
            nonlocal done
            done += 1
            progress(f"{point}: {label}", done, total)

        return on_variant

    return for_point


def run_study(
    params: SyntheticParams | None = None,
    *,
    seed: int = 0,
    sweeps: dict[str, tuple] | None = None,
    pow2_scales: tuple[float, ...] = DEFAULT_POW2_SCALES,
    overlap_k: int = 16,
    backend: str = "reference",
    progress: Progress | None = None,
) -> dict:
    """The synthetic study: every registry variant at the nominal ``params``, then each sweep.

    ``sweeps`` maps a ``SyntheticParams`` field to the values it takes (others stay nominal;
    default ``DEFAULT_SWEEPS``; ``{}`` for the nominal point only). Every point uses the same
    ``seed``, so a sweep changes only its parameter. ``progress`` (``Progress``) is called after
    each variant of each point. Returns a JSON-serialisable dict: ``seed``, ``params``, ``sweeps``,
    ``variants``, ``runs`` (one per point: ``sweep``, ``value``, ``params``, ``case``, ``rows``
    and their ``summary``) and ``summary`` (``summarize``) of the nominal point.
    """
    params = SyntheticParams() if params is None else params
    sweeps = DEFAULT_SWEEPS if sweeps is None else sweeps
    names = {f.name for f in fields(SyntheticParams)}
    for key in sweeps:
        if key not in names:
            raise InputError(f"cannot sweep {key!r}: not a synthetic parameter ({', '.join(sorted(names))})")
    variants = registry_variants(pow2_scales)
    points: list[tuple[str, object, SyntheticParams]] = [("nominal", None, params)]
    for key, values in sweeps.items():
        points.extend((key, v, replace(params, **{key: v})) for v in values)
    runs = []
    tick = _ticker(progress, len(points) * len(variants))
    for sweep, value, p in points:
        case = synthetic_case(p, seed)
        rows = evaluate(case, variants, overlap_k=overlap_k, backend=backend,
                        on_variant=tick("nominal" if value is None else f"{sweep}={value}"))
        runs.append({"sweep": sweep, "value": value, "params": asdict(p), "case": case.summary(), "rows": rows,
                     "summary": summarize(rows)})
    return {
        "source": "synthetic",
        "seed": seed,
        "params": asdict(params),
        "sweeps": {k: list(v) for k, v in sweeps.items()},
        "pow2_scales": list(pow2_scales),
        "overlap_k": overlap_k,
        "backend": backend,
        "variants": [v.label for v in variants],
        "runs": runs,
        "summary": summarize(runs[0]["rows"]),
    }


#: The variants the headline compares (labels as ``Variant.label`` makes them).
FP8_UNIT = Variant("trtllm-fp8", "swa", 1.0)
FP8_CALIBRATED = Variant("trtllm-fp8", "swa", CALIBRATED)
FP8_CALIBRATED_POW2 = Variant("trtllm-fp8", "swa", CALIBRATED_POW2)
MODEL1_DIALECTS = tuple(Variant("flashmla-model1", d) for d in nx.DIALECTS)


def summarize(rows: list[dict]) -> dict:
    """Headline numbers from one point's rows (output relative L2 errors against bf16).

    - ``fp8_s1`` / ``model1``: per-tensor FP8 at s = 1 and MODEL1 (``flashmla`` dialect); ``ratio``.
    - ``fp8_s1_rope_only`` / ``fp8_s1_nope_only``: the same error with only that part quantized.
    - ``fp8_calibrated`` (s = amax/448), ``fp8_calibrated_pow2``, and ``calibrated_over_s1``: the
      calibrated error over the s = 1 error.
    - ``model1_dialects``: the error per dialect and whether all dialects' outputs are identical.
    """
    by = {r["variant"]: r for r in rows}
    e = {key: by[v.label]["out_rel_l2"] for key, v in
         (("fp8_s1", FP8_UNIT), ("fp8_cal", FP8_CALIBRATED), ("fp8_cal2", FP8_CALIBRATED_POW2),
          ("model1", MODEL1_DIALECTS[0]))}
    dialect_rows = [by[v.label] for v in MODEL1_DIALECTS]
    return {
        "fp8_s1": e["fp8_s1"],
        "model1": e["model1"],
        "ratio": e["fp8_s1"] / e["model1"] if e["model1"] > 0 else math.inf,
        "fp8_s1_rope_only": by[FP8_UNIT.label]["out_rel_l2_rope_only"],
        "fp8_s1_nope_only": by[FP8_UNIT.label]["out_rel_l2_nope_only"],
        "fp8_calibrated": e["fp8_cal"],
        "fp8_calibrated_pow2": e["fp8_cal2"],
        "calibrated_over_s1": e["fp8_cal"] / e["fp8_s1"] if e["fp8_s1"] > 0 else math.inf,
        "model1_dialects": {r["dialect"]: r["out_rel_l2"] for r in dialect_rows},
        "model1_dialects_identical": len({r["out_digest"] for r in dialect_rows}) == 1,
    }


# ---------------------------------------------------------------- real latents from a dump


def dump_case(keys: torch.Tensor, params: SyntheticParams, seed: int) -> Case:
    """A case over real bf16 ``keys`` ``[N, 512]``: synthetic queries (``params``' query fields) and
    the ``params.topk`` highest-logit slots per query token (-1 padded when N < topk)."""
    k = keys.float()
    q = synthetic.queries(k, batch=params.batch, s_q=params.s_q, heads=params.heads, seed=seed,
                          peakedness=params.peakedness, focus_tokens=min(params.focus_tokens, k.shape[0]),
                          logit_noise=params.logit_noise).to(torch.bfloat16)
    indices = synthetic.topk_indices(q, k, params.topk)
    return Case(keys, q, indices, page_size=params.page_size)


def run_dump_study(
    path: str,
    *,
    entries: tuple[str, ...] = (),
    params: SyntheticParams | None = None,
    seed: int = 0,
    pow2_scales: tuple[float, ...] = DEFAULT_POW2_SCALES,
    overlap_k: int = 16,
    backend: str = "reference",
    progress: Progress | None = None,
) -> dict:
    """The study over the unquantized entries of a dump file (``kvbridge.dumps.dumpfile`` format).

    Each entry holding raw latents or ``bf16`` pages is one case: its values (rounded to bf16 if
    stored as fp16/fp32) are the keys, the queries are synthetic (``params``' query fields and
    ``topk``). ``entries`` picks entries by name (default: every unquantized one); a named entry
    that holds quantized pages is an error, an unnamed one is listed under ``skipped``.
    Returns the same shape as ``run_study`` with ``source`` = the path and one run per entry.
    ``progress`` as for ``run_study``.
    """
    params = SyntheticParams() if params is None else params
    dump = read_dump(path)
    names = dump.names
    for name in entries:
        if name not in names:
            raise InputError(f"entry {name!r} is not in {path} (entries: {', '.join(names) or 'none'})")
    variants = registry_variants(pow2_scales)
    runs, skipped = [], []
    picked = [e for e in dump if not entries or e.name in entries]
    tick = _ticker(progress, len(variants) * sum(
        (e.layout is None or e.layout == REFERENCE_LAYOUT) and e.num_tokens > 0 for e in picked))
    for entry in picked:
        lossless = entry.layout is None or entry.layout == REFERENCE_LAYOUT
        if not lossless:
            if entries:
                raise InputError(f"entry {entry.name} of {path} holds {entry.layout} pages; the study needs "
                                 f"unquantized latents (raw latents or {REFERENCE_LAYOUT} pages)")
            skipped.append({"entry": entry.name, "reason": f"quantized ({entry.layout})"})
            continue
        if entry.num_tokens == 0:
            skipped.append({"entry": entry.name, "reason": "no tokens"})
            continue
        values = entry.latents()
        if not bool(torch.isfinite(values).all()):
            raise InputError(f"entry {entry.name} of {path} holds NaN or Inf")
        keys = values.to(torch.bfloat16)
        case = dump_case(keys, params, seed)
        rows = evaluate(case, variants, overlap_k=overlap_k, backend=backend, on_variant=tick(entry.name))
        runs.append({"sweep": "entry", "value": entry.name, "params": asdict(params),
                     "rounded_to_bf16": not torch.equal(keys.float(), values),
                     "case": case.summary(), "rows": rows, "summary": summarize(rows)})
    if not runs:
        raise InputError(f"{path} has no unquantized entry to study (raw latents or {REFERENCE_LAYOUT} pages)")
    return {
        "source": str(path),
        "seed": seed,
        "params": asdict(params),
        "sweeps": {},
        "pow2_scales": list(pow2_scales),
        "overlap_k": overlap_k,
        "backend": backend,
        "variants": [v.label for v in variants],
        "runs": runs,
        "skipped": skipped,
        "summary": summarize(runs[0]["rows"]),
    }
