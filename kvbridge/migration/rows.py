"""Per-batch record work of a migration: page-chunk checksums (XXH3-64) and the conversion of one batch of a
transfer's records (KV and indexer keys through the record operations, compressor-state rows with APE added or
removed, in torch or the dispatcher's state kernels)."""

from __future__ import annotations

import numpy as np
import torch

from kvbridge import numerics as nx
from kvbridge.backends import dispatch
from kvbridge.engines.profiles import Storage
from kvbridge.migration.ape import add_ape, nan_score, remove_ape, unreachable_score
from kvbridge.migration.errors import MigrationError
from kvbridge.migration.plan import Transfer
from kvbridge.ops import records as record_ops
from kvbridge.ops.loss import LossReport


def chunk_rows(t: Transfer, storage: Storage) -> list[int]:
    """Row counts of ``t``'s entries grouped by the page of ``storage`` they sit in."""
    if storage.addressing == "ring":
        return [t.count]
    p = storage.span or storage.page_size
    bounds = [t.first] + list(range((t.first // p + 1) * p, t.first + t.count, p)) + [t.first + t.count]
    return [b - a for a, b in zip(bounds, bounds[1:], strict=False)]


#: The per-chunk checksum, as messages and the wire protocols name it.
CHECKSUM = "xxh3-64"


def xxh3_chunks(records: torch.Tensor, rows: list[int]) -> list[int]:
    """XXH3-64 (seed 0, unsigned 64-bit) of each consecutive chunk of ``rows[k]`` records, hashed on the records'
    device (``dispatch.xxh3_chunks``)."""
    data = records.detach().contiguous().view(torch.uint8)
    return xxh3_spans(data.reshape(-1), 0, rows, data.shape[1] if data.dim() > 1 else 1)


def xxh3_spans(data: memoryview | torch.Tensor, start: int, rows: list[int], row_bytes: int) -> list[int]:
    """XXH3-64 of consecutive chunks of ``rows[k]`` rows of ``row_bytes`` in ``data`` from byte ``start``, in one
    native call (``dispatch.xxh3_chunks``: a 131,072-token request has 127,000 chunks, and one Python call per chunk
    cost more than hashing their bytes)."""
    spans = np.empty((len(rows), 2), dtype=np.int64)
    np.cumsum(np.asarray(rows, dtype=np.int64) * row_bytes, out=spans[:, 1])
    spans[:, 1] += start
    spans[:1, 0] = start
    spans[1:, 0] = spans[:-1, 1]
    return dispatch.xxh3_chunks(data, spans)


def needs_conversion(t: Transfer) -> bool:
    if t.src.kind == "state":
        return t.src.fmt != t.dst.fmt or t.ape_sign != 0
    return t.conversion not in ("byte move", "byte copy")


def state_rows_to_f32(records: torch.Tensor, fmt: str) -> torch.Tensor:
    """State rows (uint8 ``[N, row_bytes]``, little-endian fp32 or bf16) -> fp32 values."""
    if fmt.endswith("bf16"):
        return nx.bf16_from_bytes(records)
    return records.contiguous().view(torch.float32)


def state_rows_from_f32(values: torch.Tensor, fmt: str) -> torch.Tensor:
    """fp32 values -> state rows in ``fmt`` (bf16: nearest-even, as the engines' ``.to(bfloat16)``)."""
    if fmt.endswith("bf16"):
        return nx.bf16_bytes(values)
    return values.contiguous().view(torch.uint8)


def state_error(src: torch.Tensor, back: torch.Tensor) -> float:
    """Max |back - src| over finite values; +-inf scores (cleared rows) must stay the same infinity."""
    finite = torch.isfinite(src)
    if not bool((back[~finite] == src[~finite]).all()):
        raise MigrationError("a compressor-state value changed infinity on conversion")
    return float((back[finite] - src[finite]).abs().max()) if bool(finite.any()) else 0.0


def convert_state_torch(t: Transfer, records: torch.Tensor, loss_report: bool, first: int) -> tuple[
        torch.Tensor, None, float | None]:
    """``convert_batch``'s state rows (entries ``first, ...`` of ``t``) in torch: fp32 values, APE added or
    removed, the destination dtype; the max abs error of a dtype change (adding APE is exact) with ``loss_report``."""
    values = state_rows_to_f32(records, t.src.fmt)
    if t.ape_sign:
        where = f"layer {t.spec.layer} {t.spec.role.value}"
        pos = t.first + first
        values = add_ape(values, t.ape, pos) if t.ape_sign > 0 else \
            remove_ape(values, t.ape, pos, where, t.src.fmt.endswith("bf16"))
    out = state_rows_from_f32(values, t.dst.fmt)
    measure = loss_report and t.src.fmt != t.dst.fmt
    return out, None, state_error(values, state_rows_to_f32(out, t.dst.fmt)) if measure else None


def convert_state_native(t: Transfer, records: torch.Tensor, loss_report: bool, first: int) -> tuple[
        torch.Tensor, None, float | None]:
    """``convert_batch``'s state rows in one pass of the dispatcher's state kernels (``dispatch.convert_state_rows``):
    the same bytes, errors and refusals as ``convert_state_torch``."""
    measure = loss_report and t.src.fmt != t.dst.fmt
    pos = t.first + first
    src_bf16 = t.src.fmt.endswith("bf16")
    res = dispatch.convert_state_rows(records, src_bf16, t.dst.fmt.endswith("bf16"), t.ape, t.ape_sign, pos, measure)
    where = f"layer {t.spec.layer} {t.spec.role.value}"
    if t.ape_sign < 0 and res.nan_row is not None:
        raise nan_score(where, pos + res.nan_row)
    if t.ape_sign < 0 and res.unreachable is not None:
        row, col = res.unreachable
        values = state_rows_to_f32(records[row : row + 1], t.src.fmt)[0]
        raise unreachable_score(where, pos + row, col, float(values[values.shape[0] // 2 + col]),
                                float(t.ape[(pos + row) % t.ape.shape[0], col]), src_bf16)
    if res.infinity_changed:
        raise MigrationError("a compressor-state value changed infinity on conversion")
    return res.rows, None, res.max_abs_error


def convert_batch(t: Transfer, records: torch.Tensor, loss_report: bool, first: int = 0,
                   out: torch.Tensor | None = None) -> tuple[torch.Tensor, LossReport | None, float | None]:
    """Convert records of ``t``'s kind through the record operations (state rows with APE: entries ``first,
    first + 1, ...`` of ``t``); KV records are written into ``out`` when given; returns (records, KV loss report,
    indexer or state max abs error)."""
    if t.src.kind == "state":
        convert = convert_state_native if dispatch.state_kernels(records.device) else convert_state_torch
        return convert(t, records, loss_report, first)
    if t.src.kind == "indexer":
        keys, err = record_ops.convert_key_records(records, t.src.indexer, t.dst.indexer, rule=t.dst.dialect or "",
                                                   src_rule=t.src.dialect, measure=loss_report)
        return keys, None, err
    converted, report = record_ops.convert_kv_records(records, t.src.layout, t.dst.layout, src_scale=t.src.scale,
                                                      dst_scale=t.dst.scale, dialect=t.dst.dialect, out=out,
                                                      report=loss_report, what=f"layer {t.spec.layer} "
                                                      f"{t.spec.role.value} source entry", first=t.first + first)
    return converted, report, None
