"""Compressor state between SGLang (raw scores) and vLLM / TensorRT-LLM (score + APE), with the model's APE.

The golden rows are vLLM 0.33.0's own ``SavePartialStatesKernel`` (fixtures/README.md).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from safetensors.torch import load_file, save_file

from cli.main import cli
from kvbridge.engines.topology import Role, get_model
from kvbridge.errors import InputError
from kvbridge.migration import (
    destination_pools,
    gather_records,
    migrate_local,
    plan_migration,
    scatter_records,
    source_request,
    table_of,
)
from kvbridge.migration.ape import add_ape, ape_name, load_ape, remove_ape
from kvbridge.migration.rows import state_rows_from_f32, state_rows_to_f32

GOLDEN = load_file(str(Path(__file__).parent.parent / "fixtures" / "vllm_ape_state_reference.safetensors"))
CASES = [f"{c}_{d}" for c in ("c4_attn", "c128_attn", "c4_indexer") for d in ("fp32", "bf16")]
#: Layers 2 (ratio 4) and 3 (ratio 128) of a 4-layer cut of DeepSeek-V4-Flash.
MODEL = get_model("deepseek-v4-flash").with_layers(4)
#: Every golden case holds positions 1000..1018; at 1019 tokens the ratio-4 window is 1012..1018
#: and the ratio-128 one 896..1018.
TOKENS = 1019
GOLDEN_FIRST = 1000


def _case(role: Role, ratio: int, dtype: str) -> str:
    return f"{'c4' if ratio == 4 else 'c128'}_{'indexer' if role == Role.INDEXER_STATE else 'attn'}_{dtype}"


def _raw_rows(key: str) -> torch.Tensor:
    """What SGLang stores for the golden inputs: ``[kv | raw score]`` fp32 rows."""
    return torch.cat([GOLDEN[f"{key}.kv"].float(), GOLDEN[f"{key}.score"].float()], dim=1)


def _model_ape(dtype: str) -> dict[str, torch.Tensor]:
    """The golden APE tensors under the checkpoint's names for MODEL's compressed layers."""
    out = {}
    for spec in MODEL.all_caches():
        if spec.role in (Role.STATE, Role.INDEXER_STATE):
            out[ape_name(MODEL, spec.layer, spec.role)] = GOLDEN[f"{_case(spec.role, spec.ratio, dtype)}.ape"]
    return out


def _bits(x: torch.Tensor) -> torch.Tensor:
    return x.contiguous().view(torch.int32)


@pytest.mark.parametrize("key", CASES)
def test_add_ape_is_vllm_save_partial_states_byte_for_byte(key):
    rows = add_ape(_raw_rows(key), GOLDEN[f"{key}.ape"], int(GOLDEN[f"{key}.positions"][0]))
    assert torch.equal(_bits(rows), _bits(GOLDEN[f"{key}.state_rows"]))


@pytest.mark.parametrize("key", CASES)
def test_remove_ape_gives_a_score_that_sums_back_bit_for_bit(key):
    ape, first = GOLDEN[f"{key}.ape"], int(GOLDEN[f"{key}.positions"][0])
    stored = GOLDEN[f"{key}.state_rows"]
    back = remove_ape(stored, ape, first, "test")
    half = stored.shape[1] // 2
    assert torch.equal(_bits(back[:, :half]), _bits(stored[:, :half]))  # kv untouched
    assert torch.equal(_bits(add_ape(back, ape, first)), _bits(stored))  # what SGLang's compression sees
    # where the raw score is the only fp32 value that sums to the stored one, it is recovered exactly
    s, raw = back[:, half:], GOLDEN[f"{key}.score"].float()
    a = ape[torch.arange(first, first + s.shape[0]) % ape.shape[0]]
    t = stored[:, half:]
    inf = torch.full_like(s, float("inf"))
    up, down = torch.nextafter(s, inf), torch.nextafter(s, -inf)
    unique = ((up + a) != t) & ((down + a) != t)
    assert torch.equal(_bits(s[unique]), _bits(raw[unique]))
    assert bool(unique.any())
    if key.endswith("bf16"):  # vLLM's own raw scores are bf16: kvbridge writes a bf16 preimage element
        assert torch.equal(s, s.bfloat16().float())
        differ = s != raw  # only where a second bf16 value sums to the same stored score
        assert torch.equal(_bits(raw[differ] + a[differ]), _bits(t[differ]))
        normal = torch.arange(s.shape[0]) % 6 != 0  # the generator scaled every sixth row's scores by 2^-20
        assert not bool(differ[normal].any())  # every ordinary bf16 raw score is the only bf16 preimage element


def _native_remove(rows: torch.Tensor, ape: torch.Tensor, first: int):
    from kvbridge.backends.native.state import convert_state_rows

    res = convert_state_rows(rows.contiguous().view(torch.uint8), False, False, ape, -1, first, False)
    return res.rows.view(torch.float32), res.unreachable


def test_remove_ape_keeps_a_stored_negative_zero_bit_for_bit():
    # a stored -0.0 is fp32(s + a) only for s = a = -0.0; a +0.0 sum (-0.0 + +0.0, or -a + a) must not stand for it
    ape = torch.tensor([[-0.0, 0.0, 1.5, -0.0], [0.0, -0.0, -0.0, -0.0]])
    rows = torch.tensor([[7.0, 7.0, 7.0, 7.0, -0.0, 0.0, 0.0, 3.0],
                         [7.0, 7.0, 7.0, 7.0, 0.0, -0.0, float("-inf"), -0.0]])
    for back in (remove_ape(rows, ape, 0, "x"), _native_remove(rows, ape, 0)[0]):
        assert torch.equal(_bits(back[:, 4:]), _bits(torch.tensor([[-0.0, 0.0, -1.5, 3.0],
                                                                   [0.0, -0.0, float("-inf"), -0.0]])))
        assert torch.equal(_bits(add_ape(back, ape, 0)), _bits(rows))  # SGLang's fp32 sum: -0.0 where stored
    assert _native_remove(rows, ape, 0)[1] is None
    for a in (0.0, 2.0, -2.0):  # APE +0.0 or nonzero: every fp32 sum of it is +0.0 or nonzero, never -0.0
        bad_ape = torch.tensor([[a, 1.0], [1.0, 1.0]])
        bad = torch.tensor([[0.0, 0.0, -0.0, 1.0]])
        with pytest.raises(InputError, match=r"position 4 \(value 0: -0.0.*only when both addends are -0.0"):
            remove_ape(bad, bad_ape, 4, "x")
        assert _native_remove(bad, bad_ape, 4)[1] == (0, 0)


def test_remove_ape_refuses_a_score_no_sum_reaches():
    ape = torch.ones(4, 2)
    rows = torch.tensor([[0.0, 0.0, 1e-30, 0.5]])  # 1e-30 is no fp32 sum s + 1
    with pytest.raises(InputError, match="layer 7 .*position 5 .*no fp32 sum"):
        remove_ape(rows, ape, 5, "layer 7 compressor_state")
    with pytest.raises(InputError, match="position 5 is NaN"):
        remove_ape(torch.tensor([[0.0, 0.0, float("nan"), 0.5]]), ape, 5, "x")
    # a bf16 state's sum near a cancellation: the refusal says why and what to run instead
    with pytest.raises(InputError, match="bf16 state rounded score [+] APE .*fp32 compressor state"):
        remove_ape(rows, ape, 5, "layer 7 compressor_state", bf16=True)
    with pytest.raises(InputError, match="written with these APE weights"):  # an fp32 state: no rounding to blame
        remove_ape(rows, ape, 5, "x")


def test_trtllm_bf16_state_near_a_cancellation_is_refused_with_the_reason():
    plan = plan_migration("trtllm:fp8:state=bf16", "sglang", MODEL, TOKENS, ape=_model_ape("fp32"))
    pools, tables = source_request(plan, seed=5)
    t = next(t for t in plan.transfers if t.src.kind == "state")
    rows = next(rows for u, rows in _state_rows(plan, pools, tables, "src") if u is t)
    a = float(t.ape[t.first % t.ape.shape[0], 0])
    rows[0, rows.shape[1] // 2] = torch.tensor(a * 2.0**-20).bfloat16().float()  # the score cancels the APE
    scatter_records(pools.pool(t.spec), t.src, table_of(tables, t.src), t.first, state_rows_from_f32(rows, t.src.fmt))
    with pytest.raises(InputError, match=f"layer {t.spec.layer} .*position {t.first} .*bf16 state rounded"):
        migrate_local(plan, pools, tables, destination_pools(plan))


def _fill_golden(plan, src, tables, dtype: str, *, stored: bool) -> None:
    """Put the golden rows (SGLang's raw ones, or vLLM's stored ones) at their positions in the source pools."""
    for t in plan.transfers:
        if t.src.kind != "state":
            continue
        key = _case(t.spec.role, t.spec.ratio, dtype)
        rows = GOLDEN[f"{key}.state_rows"] if stored else _raw_rows(key)
        lo = max(t.first, GOLDEN_FIRST)
        part = rows[lo - GOLDEN_FIRST : t.first + t.count - GOLDEN_FIRST]
        scatter_records(src.pool(t.spec), t.src, table_of(tables, t.src), lo, state_rows_from_f32(part, t.src.fmt))


def _state_rows(plan, pools, tables, side: str):
    for t in plan.transfers:
        if t.src.kind == "state":
            st = t.dst if side == "dst" else t.src
            rec = gather_records(pools.pool(t.spec), st, table_of(tables, st), t.first, t.count)
            yield t, state_rows_to_f32(rec, st.fmt)


@pytest.mark.parametrize("src,dst,dtype", [("sglang", "vllm", "fp32"), ("sglang:state=bf16", "vllm", "bf16"),
                                           ("sglang", "trtllm", "fp32"), ("sglang", "trtllm:state=bf16", "fp32")])
def test_whole_migration_lands_the_golden_rows(src, dst, dtype):
    """TensorRT-LLM adds in fp32 as vLLM does (read in its CUDA source), then casts to its state dtype."""
    plan = plan_migration(src, dst, MODEL, TOKENS, ape=_model_ape(dtype))
    assert {t.conversion.split(", ")[-1] for t in plan.transfers if t.src.kind == "state"} == {"score + APE"}
    pools, tables = source_request(plan, seed=3)
    _fill_golden(plan, pools, tables, dtype, stored=False)
    before = {t.spec: rows for t, rows in _state_rows(plan, pools, tables, "src")}
    out = destination_pools(plan)
    dst_tables, report = migrate_local(plan, pools, tables, out)
    assert (report.state_max_abs_error is None) == (src == "sglang" and "bf16" not in dst)  # a dtype change only
    roles = set()
    for t, rows in _state_rows(plan, out, dst_tables, "dst"):
        roles.add((t.spec.role, t.spec.ratio))
        key = _case(t.spec.role, t.spec.ratio, dtype)
        golden = GOLDEN[f"{key}.state_rows"]
        lo = max(t.first, GOLDEN_FIRST) - t.first
        want = golden[t.first + lo - GOLDEN_FIRST : t.first + t.count - GOLDEN_FIRST]
        # rows before the golden positions (ratio 128's window starts at 896): the same single fp32 add
        want = torch.cat([add_ape(before[t.spec], GOLDEN[f"{key}.ape"], t.first)[:lo], want])
        if t.dst.fmt == "bf16":
            want = want.bfloat16().float()  # nearest-even, as the kernel's __float2bfloat16_rn / static_cast
        assert torch.equal(_bits(rows), _bits(want))
    assert roles == {(Role.STATE, 4), (Role.INDEXER_STATE, 4), (Role.STATE, 128)}


def _sum_fill(plan, pools, tables) -> None:
    """Make the source's state rows sums an APE add wrote (the synthetic fill is random)."""
    for t, rows in list(_state_rows(plan, pools, tables, "src")):
        ape = GOLDEN[f"{_case(t.spec.role, t.spec.ratio, 'fp32')}.ape"]
        rec = state_rows_from_f32(add_ape(rows, ape, t.first), t.src.fmt)
        scatter_records(pools.pool(t.spec), t.src, table_of(tables, t.src), t.first, rec)


@pytest.mark.parametrize("src", ["vllm", "trtllm"])
def test_migration_to_sglang_removes_the_ape(src):
    plan = plan_migration(src, "sglang", MODEL, TOKENS, ape=_model_ape("fp32"))
    pools, tables = source_request(plan, seed=4)
    _sum_fill(plan, pools, tables)
    _fill_golden(plan, pools, tables, "fp32", stored=True)
    stored = {t.spec: rows for t, rows in _state_rows(plan, pools, tables, "src")}
    out = destination_pools(plan)
    dst_tables, _ = migrate_local(plan, pools, tables, out)
    for t, rows in _state_rows(plan, out, dst_tables, "dst"):
        ape = GOLDEN[f"{_case(t.spec.role, t.spec.ratio, 'fp32')}.ape"]
        assert torch.equal(_bits(add_ape(rows, ape, t.first)), _bits(stored[t.spec]))


def test_without_ape_still_refused_and_the_message_says_how():
    with pytest.raises(InputError, match=r"needs the model's APE weights: pass ape= .*--ape FILE"):
        plan_migration("sglang", "vllm", MODEL, TOKENS)
    plan_migration("sglang", "sglang", MODEL, TOKENS, ape=None)  # no APE needed between like engines


def test_ape_from_safetensors_shards(tmp_path):
    ape = _model_ape("fp32")
    names = sorted(ape)
    save_file({names[0]: ape[names[0]], "layers.2.attn.wkv.weight": torch.zeros(2, 2)}, str(tmp_path / "a.safetensors"))
    save_file({f"model.{n}": ape[n].bfloat16() for n in names[1:]}, str(tmp_path / "b.safetensors"))
    plan = plan_migration("sglang", "vllm", MODEL, TOKENS, ape=[tmp_path / "a.safetensors", tmp_path / "b.safetensors"])
    assert plan.ape is not None and "ape_sha256" in plan.to_dict(transfers=False)
    assert torch.equal(plan.ape.get(3, Role.STATE), ape["layers.3.attn.compressor.ape"].bfloat16().float())
    keyed = {(2, "attn"): ape["layers.2.attn.compressor.ape"], (3, "attn"): ape["layers.3.attn.compressor.ape"],
             (2, "indexer"): ape["layers.2.attn.indexer.compressor.ape"]}
    assert plan_migration("sglang", "vllm", MODEL, TOKENS, ape=keyed).fingerprint() != plan.fingerprint()
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json}")
    with pytest.raises(InputError, match="not a readable safetensors file"):
        load_ape(bad, MODEL, [(2, Role.STATE)])
    with pytest.raises(InputError, match="is not a file"):
        load_ape(tmp_path / "nope.safetensors", MODEL, [(2, Role.STATE)])


@pytest.mark.parametrize("change,match", [
    (lambda a: a.pop("layers.2.attn.indexer.compressor.ape"), "missing layers.2.attn.indexer.compressor.ape"),
    (lambda a: a.__setitem__("layers.3.attn.compressor.ape", torch.zeros(4, 512)), r"shape \[4, 512\].*\[128, 512\]"),
    (lambda a: a["layers.2.attn.compressor.ape"].__setitem__((1, 7), float("nan")), "NaN or Inf"),
    (lambda a: a.__setitem__("layers.3.attn.compressor.ape", torch.zeros(128, 512, dtype=torch.half)), "fp32 or bf16"),
    (lambda a: a.__setitem__("layers.3.attn.compressor.apex", torch.zeros(1)), "not a compressor APE name"),
])
def test_bad_ape_weights_refused_before_anything_is_claimed(change, match):
    ape = {k: v.clone() for k, v in _model_ape("fp32").items()}
    change(ape)
    with pytest.raises(InputError, match=match):
        plan_migration("sglang", "vllm", MODEL, TOKENS, ape=ape)


def test_unreachable_score_releases_the_destination_pages():
    plan = plan_migration("vllm", "sglang", MODEL, TOKENS, ape=_model_ape("fp32"))
    pools, tables = source_request(plan, seed=5)
    _sum_fill(plan, pools, tables)
    t = next(t for t in plan.transfers if t.src.kind == "state")
    rows = next(rows for u, rows in _state_rows(plan, pools, tables, "src") if u is t)
    rows[0, rows.shape[1] // 2] = 1e-30  # next to |ape| ~ 4: no fp32 sum reaches it
    scatter_records(pools.pool(t.spec), t.src, table_of(tables, t.src), t.first, state_rows_from_f32(rows, t.src.fmt))
    out = destination_pools(plan)
    free = {k: sorted(v) for k, v in out.free.items()}
    with pytest.raises(InputError, match=f"layer {t.spec.layer} .*position {t.first} "):
        migrate_local(plan, pools, tables, out)
    assert {k: sorted(v) for k, v in out.free.items()} == free


def test_cli_migrate_run_with_ape(tmp_path):
    path = tmp_path / "ape.safetensors"
    save_file(_model_ape("fp32"), str(path))
    args = ["migrate", "run", "--from", "vllm", "--to", "sglang", "--tokens", str(TOKENS), "--layers", "4", "--json"]
    refused = CliRunner().invoke(cli, args)
    assert refused.exit_code != 0 and "--ape FILE" in refused.output
    result = CliRunner().invoke(cli, [*args, "--ape", str(path)])
    assert result.exit_code == 0, result.output
    assert json.loads(result.output)["transfers"] > 0
    plan = CliRunner().invoke(cli, ["migrate", "plan", "--from", "sglang", "--to", "trtllm", "--tokens", str(TOKENS),
                                    "--ape", str(path), "--json", "--transfers"])
    assert plan.exit_code != 0 and "missing layers.4.attn.compressor.ape" in plan.output  # the full model


@pytest.mark.parametrize("dst_engine", ["vllm", "trtllm"])
def test_sglang_prefill_through_the_decode_peer_converts_onward_with_ape(dst_engine, tmp_path):
    """SGLang's own prefill (its NixlKVManager, in the SGLang venv) sends a request of compressed layers to
    kvbridge's decode peer; with the APE weights it converts into vLLM's / TensorRT-LLM's pools exactly as a
    direct migration does, the state rows gaining the bias."""
    from tests import test_adapter_sglang_decode as sd

    sd._need_sglang()
    from kvbridge.adapters.sglang_decode import SGLangDecodePeer
    from kvbridge.migration import EnginePools

    model, tokens = sd.MODEL, sd.TOKENS
    g = torch.Generator().manual_seed(9)
    ape = {ape_name(model, s.layer, s.role): torch.randn(s.ratio, s.width // 2, generator=g) * 4
           for s in model.all_caches(include_mtp=False) if s.role in (Role.STATE, Role.INDEXER_STATE)}
    plan = plan_migration("sglang", "sglang", model, tokens, include_mtp=False)
    src, src_tables = source_request(plan, seed=3)
    dst = EnginePools.create("sglang", model, {"full": 8, "swa": 8, "state128": 3}, include_mtp=False, seed=11)
    proc, next_line, layout = sd._prefill({}, tmp_path, lambda lay: sd._sglang_buffers(src, src_tables, lay, tokens))
    conv = plan_migration("sglang", dst_engine, model, tokens, include_mtp=False, ape=ape)
    try:
        with SGLangDecodePeer(dst, timeout=45) as peer:
            req = peer.receive(layout["bootstrap_addr"], sd.ROOM, tokens)
            out = destination_pools(conv)
            out_tables, _ = peer.migrate(req, out, plan=conv)
        result = sd._until_result(next_line)
    finally:
        sd._stop(proc)
    assert result["result"] == "Success", result
    direct = destination_pools(conv, seed=7)
    direct_tables, _ = migrate_local(conv, src, src_tables, direct, loss_report=False)
    assert sd._records(out, out_tables, conv) == sd._records(direct, direct_tables, conv)
    before = {t.spec: rows for t, rows in _state_rows(conv, src, src_tables, "src")}
    states = list(_state_rows(conv, out, out_tables, "dst"))
    assert {t.spec.role for t, _ in states} == {Role.STATE, Role.INDEXER_STATE}
    for t, rows in states:
        assert torch.equal(_bits(rows), _bits(add_ape(before[t.spec], t.ape, t.first)))
