"""The native compressor-state conversion (``kvbridge.backends.native.state``) against the torch rules it replaces:
the same bytes, the same max abs error, the same refusals, on every state dtype pair and APE direction."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from kvbridge.engines.topology import Role, get_model
from kvbridge.errors import InputError, KVBridgeError
from kvbridge.migration import plan_migration
from kvbridge.migration.ape import add_ape, ape_name, remove_ape
from kvbridge.migration.rows import (
    convert_batch,
    convert_state_native,
    convert_state_torch,
    state_rows_from_f32,
    state_rows_to_f32,
)

MODEL = get_model("deepseek-v4-flash").with_layers(4)  # layer 2: ratio 4, layer 3: ratio 128
TOKENS = 1019
GOLDEN = load_file(str(Path(__file__).parent.parent / "fixtures" / "vllm_ape_state_reference.safetensors"))
PAIRS = [("sglang", "vllm"), ("sglang:state=bf16", "vllm"), ("sglang", "trtllm:state=bf16"), ("vllm", "sglang"),
         ("trtllm", "sglang"), ("trtllm:state=bf16", "sglang"), ("vllm", "sglang:state=bf16"),
         ("sglang", "sglang:state=bf16"), ("sglang:state=bf16", "sglang"), ("vllm", "trtllm:state=bf16")]


def _ape(seed: int, scale: float = 4.0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {ape_name(MODEL, s.layer, s.role): torch.randn(s.ratio, s.width // 2, generator=g) * scale
            for s in MODEL.all_caches() if s.role in (Role.STATE, Role.INDEXER_STATE)}


def _state_transfers(src: str, dst: str, ape: dict):
    plan = plan_migration(src, dst, MODEL, TOKENS, ape=ape)
    return [t for t in plan.transfers if t.src.kind == "state"]


def _edge_rows(n: int, width: int, seed: int) -> torch.Tensor:
    """fp32 ``[kv | score]`` rows: normal values, cleared rows (kv 0, score -inf), +-inf, +-0, subnormals,
    values next to the fp32 maximum and to bf16 rounding ties."""
    g = torch.Generator().manual_seed(seed)
    rows = torch.randn(n, width, generator=g)
    half = width // 2
    rows[::5, :half], rows[::5, half:] = 0.0, float("-inf")
    specials = torch.tensor([0.0, -0.0, float("inf"), float("-inf"), 1e-40, -1e-42, 3.4e38, -3.3e38, 1e-3, 2.0**-126,
                             1.0 + 2.0**-8, -(1.0 + 3 * 2.0**-8), 65504.0, 1e30])
    k = specials.numel()
    for i in range(1, n, 5):  # every fifth row from row 1: the specials in the kv half and in the score half
        rows[i, 3 * i % (half - k) :][:k] = specials
        rows[i, half + 5 * i % (half - k) :][:k] = specials.roll(i)
    rows[2::5] *= 2.0**-20
    return rows


def _records(t, rows: torch.Tensor) -> torch.Tensor:
    return state_rows_from_f32(rows, t.src.fmt)


def _outcome(convert, t, records, loss, first):
    try:
        out, _, err = convert(t, records, loss, first)
        return "ok", out.contiguous().view(-1).tolist(), err
    except KVBridgeError as exc:
        return type(exc).__name__, str(exc), None


def _source_rows(t, seed: int) -> torch.Tensor:
    """Rows a source engine writes: with score + APE (the source stores it) the scores are sums of the APE add."""
    rows = _edge_rows(t.count, t.src.record_bytes // (2 if t.src.fmt.endswith("bf16") else 4), seed)
    if t.ape_sign < 0:
        rows = add_ape(rows, t.ape, t.first)
        if t.src.fmt.endswith("bf16"):  # a bf16 sum near a cancellation may be no fp32 sum: clear such rows
            rows = state_rows_to_f32(_records(t, rows), t.src.fmt)
            for i in range(rows.shape[0]):
                try:
                    remove_ape(rows[i : i + 1], t.ape, t.first + i, "test")
                except InputError:
                    rows[i, : rows.shape[1] // 2], rows[i, rows.shape[1] // 2 :] = 0.0, float("-inf")
    return rows


@pytest.mark.parametrize("src,dst", PAIRS)
@pytest.mark.parametrize("loss", [False, True])
def test_native_state_rows_are_the_torch_rules_byte_for_byte(src, dst, loss):
    for t in _state_transfers(src, dst, _ape(1)):
        rows = _source_rows(t, seed=t.spec.layer)
        for first in (0, 3):  # a batch starting inside the transfer: the APE row follows the position
            records = _records(t, rows)[first:]
            want = _outcome(convert_state_torch, t, records, loss, first)
            assert want[0] == "ok", want
            assert _outcome(convert_state_native, t, records, loss, first) == want
            assert _outcome(convert_batch, t, records, loss, first) == want  # CPU rows take the native pass


@pytest.mark.parametrize("src,dst", [("vllm", "sglang"), ("trtllm:state=bf16", "sglang"), ("sglang", "vllm"),
                                     ("vllm", "trtllm:state=bf16"), ("vllm", "sglang:state=bf16")])
def test_native_state_rows_refuse_what_the_torch_rules_refuse(src, dst):
    t = next(t for t in _state_transfers(src, dst, _ape(2, scale=1.0)) if t.spec.ratio == 128)
    rows = _source_rows(t, seed=5)
    half = rows.shape[1] // 2
    cases = []
    nan = rows.clone()
    nan[7, half + 3] = float("nan")  # a NaN score
    nan[9, half + 1] = float("nan")
    cases.append(nan)
    kv_nan = rows.clone()
    kv_nan[4, 2] = float("nan")  # a NaN in the kv half
    cases.append(kv_nan)
    unreachable = rows.clone()
    unreachable[6, half + 11] = 1e-30  # no fp32 sum s + a (|a| ~ 1) is 1e-30
    unreachable[8, half + 2] = 1e-30
    cases.append(unreachable)
    overflow = rows.clone()
    overflow[3, 5] = torch.finfo(torch.float32).max  # rounds to bf16 +inf
    cases.append(overflow)
    for case in cases:
        records = _records(t, case)
        for loss in (False, True):
            want = _outcome(convert_state_torch, t, records, loss, 0)
            assert _outcome(convert_state_native, t, records, loss, 0) == want, (case, loss)
    nan_refused = _outcome(convert_state_torch, t, _records(t, nan), False, 0)
    assert (nan_refused[0] == "InputError") == (t.ape_sign < 0)


@pytest.mark.parametrize("key", [f"{c}_{d}" for c in ("c4_attn", "c128_attn", "c4_indexer") for d in ("fp32", "bf16")])
def test_native_state_rows_on_vllms_golden_rows(key):
    """vLLM's own stored rows (fixtures/README.md) through APE removal and back, both ways, as torch does."""
    ratio = 4 if key.startswith("c4") else 128
    role = Role.INDEXER_STATE if "indexer" in key else Role.STATE
    stored = GOLDEN[f"{key}.state_rows"]
    first = int(GOLDEN[f"{key}.positions"][0])
    for src, dst in (("vllm", "sglang"), ("sglang", "vllm"), ("vllm", "sglang:state=bf16")):
        t = next(t for t in _state_transfers(src, dst, _ape(3)) if t.spec.ratio == ratio and t.spec.role == role)
        t = dataclasses.replace(t, ape=GOLDEN[f"{key}.ape"].float(), first=first)
        records = _records(t, stored.float())
        for loss in (False, True):
            want = _outcome(convert_state_torch, t, records, loss, 0)
            assert want[0] == "ok", want
            assert _outcome(convert_state_native, t, records, loss, 0) == want


def test_native_state_rows_refusal_names_the_position():
    t = next(t for t in _state_transfers("vllm", "sglang", _ape(4, scale=1.0)) if t.spec.ratio == 4)
    rows = _source_rows(t, seed=1)
    rows[2, rows.shape[1] // 2] = float("nan")
    with pytest.raises(InputError, match=f"layer {t.spec.layer} .*position {t.first + 2} is NaN"):
        convert_batch(t, _records(t, rows)[1:], False, 1)
