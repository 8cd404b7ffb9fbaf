"""Per-layer streaming of a request: the sender packs and sends one group of layers at a time, the
receiver verifies (and converts) each group as it lands, and publishes all of them at once.

Both transports (``kvbridge.migration.transport`` over ``torch.distributed``, and
``kvbridge.migration.nixl``) cut a plan's transfers into the same groups: the transfers of
``layers_per_group`` consecutive layers, in plan order. A prefill engine that finishes its
layers one by one sends each group as soon as its layers are written; the decode side holds
every verified group until the last one arrived, then claims destination pages and writes
them (``RequestAssembly.publish``): a request is published whole or not at all.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from kvbridge.errors import InputError
from kvbridge.migration.errors import MigrationError
from kvbridge.migration.execute import (
    MigrationReport,
    Payload,
    build_report,
    check_pools,
    convert_payload,
    pack,
    publish,
    verify,
)
from kvbridge.migration.plan import MigrationPlan, beyond_computed
from kvbridge.migration.pools import EnginePools, RequestTables
from kvbridge.ops.loss import LossReport


def request_info(plan: MigrationPlan) -> dict[str, Any]:
    """What a receiver needs to rebuild ``plan`` with its own engine and model (sent in the handshake)."""
    return {"src": plan.src.spec, "dst": plan.dst.spec, "model": plan.model.name,
            "num_layers": plan.model.num_layers, "num_tokens": plan.num_tokens,
            "draft_tokens": plan.draft_tokens, "include_mtp": plan.include_mtp}


def wire_fingerprint(plan: MigrationPlan) -> str:
    """sha256 of what ``plan`` moves, as two peers compare it: the plan's JSON without which engine
    options were spelled out (``trtllm:fp8:tpb=128`` and its canonical ``...:idx=fp4`` are one plan), nor what
    each calls the model: a model is its shapes (two ends may read one ``config.json`` from different paths)."""
    data = plan.to_dict()
    data["model"].pop("name", None)
    for side in ("src", "dst"):
        for choice in data.get(side, {}).get("choices", []):
            choice.pop("given", None)
    return hashlib.sha256(json.dumps(data, sort_keys=True).encode()).hexdigest()


def layer_groups(plan: MigrationPlan, layers_per_group: int = 1) -> list[list[int]]:
    """Transfer indices of ``plan`` grouped by ``layers_per_group`` consecutive layers (plan order)."""
    if isinstance(layers_per_group, bool) or not isinstance(layers_per_group, int) or layers_per_group < 1:
        raise InputError(f"layers_per_group must be a positive integer, got {layers_per_group!r}")
    layers: list[int] = []
    by_layer: dict[int, list[int]] = {}
    for i, t in enumerate(plan.transfers):
        if t.spec.layer not in by_layer:
            layers.append(t.spec.layer)
        by_layer.setdefault(t.spec.layer, []).append(i)
    return [[i for layer in layers[k : k + layers_per_group] for i in by_layer[layer]]
            for k in range(0, len(layers), layers_per_group)]


def check_groups(plan: MigrationPlan, groups: Sequence[Sequence[int]]) -> list[list[int]]:
    """Refuse groups that do not cover every transfer of ``plan`` exactly once."""
    flat = [i for g in groups for i in g]
    if any(not g for g in groups) or sorted(flat) != list(range(len(plan.transfers))):
        raise MigrationError(f"the sender's {len(groups)} layer groups do not cover the plan's "
                             f"{len(plan.transfers)} transfers exactly once")
    return [list(g) for g in groups]


def past_groups(plan: MigrationPlan, groups: Sequence[Sequence[int]], computed_tokens: int) -> list[list[int]]:
    """``groups`` (of ``plan``'s transfer indices) as groups of ``plan.past(computed_tokens)``: each index
    renumbered, the transfers a destination holds whole left out, then the groups left empty; both ends of a
    transfer with a prefix-cache hit build them the same way."""
    kept = {i: k for k, (i, _, _) in enumerate(beyond_computed(plan.transfers, computed_tokens))}
    out = [[kept[i] for i in g if i in kept] for g in groups]
    return [g for g in out if g]


def group_plan(plan: MigrationPlan, indices: Sequence[int]) -> MigrationPlan:
    """The part of ``plan`` made of transfers ``indices`` (same engines, model and request)."""
    return dataclasses.replace(plan, transfers=tuple(plan.transfers[i] for i in indices))


def pack_group(plan: MigrationPlan, src: EnginePools, tables: RequestTables, indices: Sequence[int], *,
               convert: bool, loss_report: bool = True, checksum: bool = True,
               into: Sequence[torch.Tensor] | None = None) -> Payload:
    """``pack`` for the transfers ``indices`` only (``into``: one output per index); the payload carries the whole
    plan's fingerprint."""
    payload = pack(group_plan(plan, indices), src, tables, convert=convert, loss_report=loss_report,
                   checksum=checksum, into=into)
    payload.fingerprint = plan.fingerprint()
    return payload


class RequestAssembly:
    """Receiver side: verified, converted groups of one request, held until ``publish``.

    ``add`` verifies a group's page-chunk XXH3-64 checksums (``ChecksumError`` names the chunk) and
    converts it when the sender did not; ``publish`` claims the destination pages and writes
    every record, only once all groups are in.
    """

    def __init__(self, plan: MigrationPlan, *, loss_report: bool = True) -> None:
        self.plan = plan
        self.loss_report = loss_report
        self.records: list[torch.Tensor | None] = [None] * len(plan.transfers)
        self.loss: list[LossReport] = []
        self.indexer_max_abs_error: float | None = 0.0 if loss_report else None
        self.state_max_abs_error: float | None = None
        self.payload_bytes = 0
        self.converted_on: str | None = None
        self.convert_s = 0.0
        self.verify_s = 0.0

    def add(self, indices: Sequence[int], payload: Payload, *, verified: bool = False) -> None:
        """Verify (unless the transport already did) and, if needed, convert the payload of transfers
        ``indices``."""
        sub = group_plan(self.plan, indices)
        if any(self.records[i] is not None for i in indices):
            raise MigrationError("a layer group arrived twice")
        t0 = time.perf_counter()
        if not verified:
            verify(sub, dataclasses.replace(payload, fingerprint=sub.fingerprint()))
        t1 = time.perf_counter()
        side = "sender" if payload.converted else "receiver"
        if self.converted_on not in (None, side):
            raise MigrationError("the sender mixed converted and unconverted layer groups")
        self.converted_on = side
        converted = convert_payload(sub, payload, loss_report=self.loss_report)
        self.convert_s += time.perf_counter() - t1
        self.verify_s += t1 - t0
        for i, rec in zip(indices, converted.records, strict=True):
            self.records[i] = rec
        self.payload_bytes += sum(r.numel() for r in payload.records)
        self.add_loss(converted.loss, converted.indexer_max_abs_error, converted.state_max_abs_error)

    def add_loss(self, loss: Sequence[LossReport], indexer_max_abs_error: float | None,
                 state_max_abs_error: float | None = None) -> None:
        self.loss.extend(loss)
        if state_max_abs_error is not None:
            self.state_max_abs_error = max(self.state_max_abs_error or 0.0, state_max_abs_error)
        if indexer_max_abs_error is None:
            self.indexer_max_abs_error = None
        elif self.indexer_max_abs_error is not None:
            self.indexer_max_abs_error = max(self.indexer_max_abs_error, indexer_max_abs_error)

    def missing(self) -> int:
        """How many transfers have not arrived yet."""
        return sum(r is None for r in self.records)

    def publish(self, dst: EnginePools) -> RequestTables:
        """Claim destination pages and write every record (all groups must be in)."""
        check_pools(self.plan, dst, "dst")
        if self.missing():
            raise MigrationError(f"{self.missing()} of {len(self.records)} transfers never arrived; "
                                 "nothing was published")
        records = [r for r in self.records if r is not None]
        payload = Payload(self.plan.fingerprint(), True, records, [], [])
        return publish(self.plan, payload, dst)

    def report(self, *, wire_s: float, publish_s: float) -> MigrationReport:
        return build_report(self.plan, payload_bytes=self.payload_bytes, converted_on=self.converted_on or "receiver",
                            loss=self.loss, indexer_err=self.indexer_max_abs_error,
                            state_err=self.state_max_abs_error, pack_s=0.0, convert_s=self.convert_s, wire_s=wire_s,
                            publish_s=publish_s)


#: Writes a fully received, verified and converted request into its destination; returns its block tables.
Publish = Callable[[RequestAssembly], RequestTables]
