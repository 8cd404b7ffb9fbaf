"""The migration plan: which entries of a request move, from which pages to which, and how.

For a request of ``L`` tokens (``draft_tokens`` MTP draft slots beyond the window):

- SWA, every layer: tokens ``[max(0, L - window - draft), L)`` (the last window), widened to the
  start of the destination's SWA page when that engine keeps whole pages from the window's page
  (SGLang's PD sends ``[floor(start / page) * page, L)``), as far as the source still holds them;
- COMPRESS, ratio-r layers: compressed tokens ``[0, L // r)``;
- INDEXER_COMPRESS, ratio-4 layers: keys ``[0, L // 4)``;
- compressor state (and indexer-compressor state), ratio-r layers: the rows of the unfinished
  window, tokens ``[max(0, (L // r) * r - o), L)`` with o = r for the overlapping ratio 4
  (the next compressed token also reads the previous window) and o = 0 for ratio 128.
  Between SGLang (raw scores) and vLLM / TensorRT-LLM (score + APE) the rows' scores gain or
  lose the model's positional bias (``kvbridge.migration.ape``), given as ``ape=``.

Page indices in a plan are *logical*: positions in the request's block table for that cache
(``Storage.table``); execution maps them to physical pages.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from typing import Any

from kvbridge.engines.profiles import EngineProfile, Storage, parse_engine
from kvbridge.engines.topology import MAX_TOKENS, CacheSpec, ModelTopology, Role, get_model
from kvbridge.errors import InputError
from kvbridge.migration.ape import ApeWeights, load_ape
from kvbridge.ops.pages import is_byte_move


@dataclass(frozen=True)
class Transfer:
    """Entries ``[first, first + count)`` of one layer's cache, moved from ``src`` to ``dst`` storage."""

    spec: CacheSpec
    first: int
    count: int
    src: Storage
    dst: Storage
    conversion: str
    #: State rows only: fp32 ``[ratio, width / 2]`` APE added (``ape_sign`` +1) to or removed (-1) from the score.
    ape: Any = field(default=None, compare=False, repr=False)
    ape_sign: int = 0

    @property
    def src_bytes(self) -> int:
        """Payload bytes in the source format (records only, no page padding)."""
        return self.count * self.src.record_bytes

    @property
    def dst_bytes(self) -> int:
        return self.count * self.dst.record_bytes

    def table_slots(self, storage: Storage) -> list[int]:
        """Logical page indices (into ``storage.table``) the entries occupy."""
        if self.count == 0:
            return []
        if storage.addressing == "ring":
            return [0]
        span = storage.span or storage.page_size
        return list(range(self.first // span, (self.first + self.count - 1) // span + 1))

    @property
    def src_page_bytes(self) -> int:
        """Bytes of the source pages touched (what a raw page copy would send)."""
        return len(self.table_slots(self.src)) * self.src.page_bytes

    @property
    def dst_page_bytes(self) -> int:
        return len(self.table_slots(self.dst)) * self.dst.page_bytes

    def to_dict(self) -> dict[str, Any]:
        return {
            "layer": self.spec.layer,
            "role": self.spec.role.value,
            "ratio": self.spec.ratio,
            "first": self.first,
            "count": self.count,
            "src": {"format": self.src.fmt, "table": self.src.table, "page_size": self.src.page_size,
                    "pages": _ranges(self.table_slots(self.src))},
            "dst": {"format": self.dst.fmt, "table": self.dst.table, "page_size": self.dst.page_size,
                    "pages": _ranges(self.table_slots(self.dst))},
            "conversion": self.conversion,
            "src_bytes": self.src_bytes,
            "dst_bytes": self.dst_bytes,
            "src_page_bytes": self.src_page_bytes,
            "dst_page_bytes": self.dst_page_bytes,
        }


def _ranges(slots: list[int]) -> list[int]:
    """``[first, stop)`` of a contiguous list of table slots (empty list when none)."""
    return [slots[0], slots[-1] + 1] if slots else []


def live_entries(spec: CacheSpec, num_tokens: int, draft_tokens: int) -> tuple[int, int]:
    """``(first, count)`` of the entries of ``spec``'s cache a request of ``num_tokens`` holds."""
    n = num_tokens
    if spec.role == Role.SWA:
        assert spec.window is not None
        first = max(0, n - spec.window - draft_tokens)
        return first, n - first
    if spec.role in (Role.COMPRESS, Role.INDEXER):
        return 0, n // spec.ratio
    overlap = spec.ratio if spec.ratio == 4 else 0
    first = max(0, (n // spec.ratio) * spec.ratio - overlap)
    return first, n - first


def conversion_name(src: Storage, dst: Storage) -> str:
    """How entries of ``src`` become entries of ``dst`` (a short human-readable name)."""
    if src.kind == "state":
        if src.fmt == dst.fmt:
            return f"{src.fmt} rows by position"
        if src.fmt == "fp32" and dst.fmt == "bf16":
            return "fp32 -> bf16 rows by position (lossy: nearest-even)"
        return f"{src.fmt} -> {dst.fmt} rows by position (exact)"
    if src.kind == "indexer":
        if src.fmt == dst.fmt and src.dialect == dst.dialect:
            return "byte copy"
        return f"requantize {src.fmt} -> {dst.fmt} ({dst.dialect})"
    if is_byte_move(src.layout, dst.layout, src.scale or 1.0, dst.scale or 1.0):
        return "byte move"
    dialect = f", {dst.dialect}" if dst.dialect else ""
    scale = f", scale {dst.scale:g}" if dst.scale is not None else ""
    return f"transcode {src.fmt} -> {dst.fmt}{dialect}{scale}"


def swa_range(src: EngineProfile, dst: EngineProfile, first: int, num_tokens: int) -> tuple[int, int]:
    """``(first, count)`` of the SWA tokens to move for a window starting at ``first``.

    The destination's start (its page start for SGLang), but no earlier than the source's page
    holding ``first``: engines release whole SWA blocks out of the window, not single tokens.
    """
    held = first // src.swa_page * src.swa_page
    start = max(held, dst.swa_first(first))
    return start, num_tokens - start


def ape_needed(src: EngineProfile, dst: EngineProfile, model: ModelTopology,
               include_mtp: bool) -> list[tuple[int, Role]]:
    """The ``(layer, STATE | INDEXER_STATE)`` compressors whose APE the pair needs (none when both
    ends store the score the same way)."""
    if src.score_has_ape == dst.score_has_ape:
        return []
    return [(c.layer, c.role) for c in model.all_caches(include_mtp) if c.role in (Role.STATE, Role.INDEXER_STATE)]


def check_pair(src: EngineProfile, dst: EngineProfile, model: ModelTopology, include_mtp: bool,
               ape: bool = False) -> None:
    """Refuse, with a one-line reason, a pair of profiles whose state kvbridge cannot write exactly
    (``ape``: the model's APE weights are given)."""
    if ape_needed(src, dst, model, include_mtp) and not ape:
        sg, other = (src, dst) if not src.score_has_ape else (dst, src)
        raise InputError(f"{src.spec} -> {dst.spec}: {sg.version} stores compressor scores without the positional "
                         f"bias (APE) and adds it when compressing, {other.version} stores score + APE; moving the "
                         "compressor state between them needs the model's APE weights: pass ape= (a safetensors "
                         "file or shards holding layers.N.attn[.indexer].compressor.ape, or a dict of tensors) or "
                         "--ape FILE")
    if src.online_c128 != dst.online_c128 and model.layers_with_ratio(128):
        if src.online_c128:
            raise InputError(f"{src.spec} -> {dst.spec}: SGLANG_OPT_USE_ONLINE_COMPRESS keeps one running "
                             "(max, sum, kv) row per ratio-128 layer; the per-position [kv | score] rows the "
                             "destination needs cannot be recovered from it")
        raise InputError(f"{src.spec} -> {dst.spec}: SGLang's online ratio-128 state "
                         "(SGLANG_OPT_USE_ONLINE_COMPRESS=1) is a running [max | sum | kv] row accumulated with "
                         "the GPU's expf in the engine's order; kvbridge cannot write it bit for bit: run the "
                         "destination without the option")
    for prof in (src, dst):
        if include_mtp and model.num_mtp_layers and prof.engine == "trtllm" and prof.draft_tokens > 1:
            raise InputError(f"{prof.spec}: TensorRT-LLM adds max_draft_len - 1 = {prof.draft_tokens - 1} virtual "
                             "draft layers, which kvbridge does not map yet; migrate without the MTP layers "
                             "(include_mtp=False / --no-mtp)")


def request_table_lengths(profile: EngineProfile, model: ModelTopology, num_tokens: int,
                          include_mtp: bool = True) -> dict[str, int]:
    """Block-table length of every table a request of ``num_tokens`` needs on ``profile``.

    Paged tables span every entry the request ever had (pages before the window are -1
    once released); ring tables have one page.
    """
    lengths: dict[str, int] = {}
    for spec in model.all_caches(include_mtp):
        st = profile.storage(spec)
        if st.addressing == "ring":
            need = 1
        else:
            per_token = spec.role in (Role.SWA, Role.STATE, Role.INDEXER_STATE)
            entries = num_tokens if per_token else num_tokens // spec.ratio
            need = -(-entries // (st.span or st.page_size))
        for name in (st.table, st.score_table):
            if name is not None:
                lengths[name] = max(lengths.get(name, 0), need)
    return lengths


def window_released(profile: EngineProfile, model: ModelTopology, num_tokens: int, draft_tokens: int,
                    include_mtp: bool = True) -> dict[str, int]:
    """Leading table entries of ``profile``'s paged windowed tables that are out of the window.

    Engines free SWA (and TensorRT-LLM's windowed state) blocks once no token in them is in
    the window; their table entries read -1.
    """
    released: dict[str, int] = {}
    for spec in model.all_caches(include_mtp):
        st = profile.storage(spec)
        if spec.window is None or st.addressing == "ring":
            continue
        first, _ = live_entries(spec, num_tokens, draft_tokens)
        n = first // (st.span or st.page_size)
        for name in (st.table, st.score_table):
            if name is not None:
                released[name] = n if name not in released else min(released[name], n)
    return released


@dataclass(frozen=True)
class MigrationPlan:
    """Every transfer of one request from ``src`` to ``dst`` pools (see module docstring)."""

    model: ModelTopology
    src: EngineProfile
    dst: EngineProfile
    num_tokens: int
    draft_tokens: int
    include_mtp: bool
    transfers: tuple[Transfer, ...]
    #: The APE weights the state conversion uses (None when the pair needs none).
    ape: ApeWeights | None = field(default=None, compare=False, repr=False)

    def totals(self) -> dict[str, dict[str, int]]:
        """Per role, and ``all``: layers, entries, payload and page bytes on each side."""
        keys = ("layers", "entries", "src_bytes", "dst_bytes", "src_page_bytes", "dst_page_bytes")
        out: dict[str, dict[str, int]] = {}
        for t in self.transfers:
            for name in (t.spec.role.value, "all"):
                row = out.setdefault(name, dict.fromkeys(keys, 0))
                row["layers"] += 1
                row["entries"] += t.count
                row["src_bytes"] += t.src_bytes
                row["dst_bytes"] += t.dst_bytes
                row["src_page_bytes"] += t.src_page_bytes
                row["dst_page_bytes"] += t.dst_page_bytes
        if "all" in out:
            out["all"] = out.pop("all")
        return out

    def table_lengths(self, side: str) -> dict[str, int]:
        """Block-table lengths the request needs on the ``src`` or ``dst`` side."""
        profile = self.src if side == "src" else self.dst
        return request_table_lengths(profile, self.model, self.num_tokens, self.include_mtp)

    def released(self, side: str) -> dict[str, int]:
        """Leading out-of-window (-1) entries of the ``src`` or ``dst`` side's windowed tables."""
        profile = self.src if side == "src" else self.dst
        return window_released(profile, self.model, self.num_tokens, self.draft_tokens, self.include_mtp)

    def held_pages(self, side: str) -> dict[str, int]:
        """Pages the request holds per block table on the ``src`` or ``dst`` side."""
        released = self.released(side)
        return {name: n - min(released.get(name, 0), n) for name, n in self.table_lengths(side).items()}

    def to_dict(self, transfers: bool = True) -> dict[str, Any]:
        data: dict[str, Any] = {
            "model": self.model.to_dict(),
            "src": self.src.to_dict(),
            "dst": self.dst.to_dict(),
            "num_tokens": self.num_tokens,
            "draft_tokens": self.draft_tokens,
            "include_mtp": self.include_mtp,
            "totals": self.totals(),
        }
        if self.ape is not None:
            data["ape_sha256"] = self.ape.digest
        if transfers:
            data["transfers"] = [t.to_dict() for t in self.transfers]
        return data

    def fingerprint(self) -> str:
        """sha256 of the plan's JSON: both ends of a transfer must agree on it."""
        return hashlib.sha256(json.dumps(self.to_dict(), sort_keys=True).encode()).hexdigest()



def plan_migration(
    src: str | EngineProfile,
    dst: str | EngineProfile,
    model: str | ModelTopology,
    num_tokens: int,
    *,
    draft_tokens: int = 0,
    include_mtp: bool = True,
    ape: object = None,
) -> MigrationPlan:
    """Plan the migration of one request of ``num_tokens`` tokens from ``src`` to ``dst`` pools.

    ``src``/``dst`` are engine specs (``parse_engine``) or profiles; ``model`` a preset name,
    a ``config.json`` path or a ``ModelTopology``. ``draft_tokens`` widens the SWA tail by
    the MTP draft length. ``include_mtp`` moves the MTP layers' caches too. ``ape``: the model's
    compressor APE weights (``kvbridge.migration.ape.load_ape``: a safetensors path or shards, a
    dict of tensors), needed between SGLang and vLLM / TensorRT-LLM for compressed layers and
    ignored otherwise.
    """
    if isinstance(num_tokens, bool) or not isinstance(num_tokens, int) or not 1 <= num_tokens <= MAX_TOKENS:
        raise InputError(f"num_tokens must be a positive integer up to {MAX_TOKENS:,}, got {repr(num_tokens)[:40]}")
    if isinstance(draft_tokens, bool) or not isinstance(draft_tokens, int) or not 0 <= draft_tokens <= MAX_TOKENS:
        raise InputError(
            f"draft_tokens must be a non-negative integer up to {MAX_TOKENS:,}, got {repr(draft_tokens)[:40]}"
        )
    if not isinstance(model, (str, ModelTopology)):
        raise InputError(f"model must be a preset name, a config.json path or a ModelTopology, got {repr(model)[:40]}")
    src_p, dst_p = parse_engine(src), parse_engine(dst)
    topo = get_model(model)
    check_pair(src_p, dst_p, topo, include_mtp, ape is not None)
    needed = ape_needed(src_p, dst_p, topo, include_mtp)
    weights = load_ape(ape, topo, needed) if needed else None
    sign = (1 if dst_p.score_has_ape else -1) if needed else 0
    transfers = []
    for spec in topo.all_caches(include_mtp):
        first, count = live_entries(spec, num_tokens, draft_tokens)
        if spec.role == Role.SWA:
            first, count = swa_range(src_p, dst_p, first, num_tokens)
        if spec.role == Role.STATE and spec.ratio == 128 and src_p.online_c128 and count:
            first, count = num_tokens // 128, 1  # one running row for the pending block
        if count == 0:
            continue
        s, d = src_p.storage(spec), dst_p.storage(spec)
        if weights is not None and s.kind == "state":
            name = f"{conversion_name(s, d)}, score {'+' if sign > 0 else '-'} APE"
            transfers.append(Transfer(spec, first, count, s, d, name, weights.get(spec.layer, spec.role), sign))
        else:
            transfers.append(Transfer(spec, first, count, s, d, conversion_name(s, d)))
    return MigrationPlan(topo, src_p, dst_p, num_tokens, draft_tokens, include_mtp, tuple(transfers), weights)
