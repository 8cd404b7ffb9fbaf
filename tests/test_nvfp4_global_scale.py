"""``flashinfer-nvfp4`` at a per-tensor global scale g != 1 (``scale=`` / ``src_scale=`` / ``dst_scale=``).

The rule (docs/layouts.md): tile scale byte ``e4m3(fp32(1/g) * (amax * fp32(1/6)))``, codes
``e2m1(x * fp32(1/fp32(scale * g)))``, values ``fp32(e2m1 * scale) * g``. Checked here: the derived fixture
at g = 0.125 and 0.37 (kvbridge's reference) against an independent numpy model of those steps; every CPU
backend byte for byte against the reference; round trips; transcodes to and from other layouts; the byte
move at an equal g; migration records; dumps; the refusals of a bad g. At g = 1 nothing changes (the
fixtures of ``test_layout_fixtures.py`` and ``test_fp4_records.py``). Triton: ``test_triton_interpret.py``.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import kvbridge as kb
from kvbridge import numerics as nx
from kvbridge.backends import dispatch, native, reference
from kvbridge.dumps.convert import convert_entry
from kvbridge.dumps.dumpfile import DumpEntry
from kvbridge.errors import InputError, KVBridgeError
from kvbridge.layouts import get_layout
from kvbridge.ops import records as record_ops
from kvbridge.ops.pages import is_byte_move
from tests.conftest import load_vectors

LAYOUT = get_layout("flashinfer-nvfp4")
MODEL1 = get_layout("flashmla-model1")
TRT = get_layout("trtllm-fp8")
BF16 = get_layout("bf16")
FIXTURE = "flashinfer_nvfp4_global_scale_derived"
SCALES = (0.125, 0.37)
F32 = {g: float(np.float32(g)) for g in SCALES}  # the fp32 values the scales are taken as


# --------------------------------------------------------------------------------------------- a numpy model


def _e4m3_positive_values() -> np.ndarray:
    """float64 value of the E4M3 codes 0..126 (0x7F is NaN), built from the format's definition."""
    codes = np.arange(127)
    e, m = codes >> 3, (codes & 7).astype(np.float64)
    return np.where(e == 0, m / 8 * 2.0**-6, (1 + m / 8) * 2.0 ** (e - 7.0))


E4M3 = _e4m3_positive_values()
E2M1 = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])


def _nearest_even(mag: np.ndarray, table: np.ndarray) -> np.ndarray:
    """Index of the nearest entry of the increasing ``table`` to each ``mag`` (float64 exact here), ties to the
    even index, saturating at the last."""
    hi = np.clip(np.searchsorted(table, mag), 1, len(table) - 1)
    lo = hi - 1
    dlo, dhi = mag - table[lo], table[hi] - mag
    pick = np.where(dlo < dhi, lo, np.where(dhi < dlo, hi, np.where(lo % 2 == 0, lo, hi)))
    return np.where(mag >= table[-1], len(table) - 1, pick)


def numpy_nvfp4(nope: np.ndarray, g: float) -> tuple[np.ndarray, np.ndarray]:
    """(E2M1 codes [N, 448], E4M3 scale bytes [N, 28]) of finite fp32 ``nope`` at global scale ``g``, step by
    step in numpy fp32 (not kvbridge's code)."""
    f32 = np.float32
    tiles = nope.astype(f32).reshape(-1, 28, 16)
    amax = np.abs(tiles).max(axis=-1)
    rcp6, rcp_g = f32(1) / f32(6), f32(1) / f32(g)
    q = (rcp_g * (amax * rcp6)).astype(f32)
    scale_bytes = _nearest_even(q.astype(np.float64), E4M3).astype(np.uint8)
    sg = (E4M3[scale_bytes].astype(f32) * f32(g)).astype(f32)
    with np.errstate(divide="ignore"):
        inv = (f32(1) / sg).astype(f32)
    with np.errstate(invalid="ignore"):
        y = np.where(tiles == 0, tiles, tiles * inv[..., None]).astype(f32)
    codes = _nearest_even(np.abs(y).astype(np.float64), E2M1).astype(np.uint8) | (np.signbit(y).astype(np.uint8) << 3)
    return codes.reshape(-1, 448), scale_bytes


@pytest.fixture(scope="module")
def vectors():
    return load_vectors(FIXTURE)


def _case_ids(case: dict) -> str:
    return f"g{case['scale']}-p{case['page_size']}"


CASES = load_vectors(FIXTURE)[1]


# --------------------------------------------------------------------------------------------- the fixture


def test_fixture_covers_both_scales_and_is_marked_derived(vectors):
    from safetensors import safe_open

    from tests.conftest import FIXTURES

    with safe_open(str(FIXTURES / f"{FIXTURE}.safetensors"), "pt") as fh:
        assert fh.metadata()["derived"] == "true"
    assert {c["scale"] for c in CASES} == set(SCALES) and {c["page_size"] for c in CASES} == {3, 64}


@pytest.mark.parametrize("case", CASES, ids=_case_ids)
def test_fixture_matches_the_numpy_model(vectors, case):
    tensors, _ = vectors
    x, pages, p = tensors[case["input"]], tensors[case["pages"]], case["page_size"]
    rec = LAYOUT.pages_to_records(pages, p, x.shape[0])
    codes, scale_bytes = numpy_nvfp4(x[:, :448].numpy(), case["scale"])
    assert np.array_equal(rec[:, 352:380].numpy(), scale_bytes)
    assert np.array_equal(nx.e2m1_unpack(rec[:, :224]).numpy(), codes)
    assert torch.equal(rec[:, 224:352], nx.bf16_bytes(x[:, 448:]))
    assert not rec[:, 380:].any()


@pytest.mark.parametrize("backend", ["auto", "reference"])
@pytest.mark.parametrize("case", CASES, ids=_case_ids)
def test_every_cpu_backend_reproduces_the_fixture(vectors, case, backend, monkeypatch):
    monkeypatch.setenv(dispatch.BACKEND_ENV, backend)
    tensors, _ = vectors
    x, want, p, g = tensors[case["input"]], tensors[case["pages"]], case["page_size"], case["scale"]
    assert torch.equal(kb.encode(x, LAYOUT, page_size=p, scale=g), want)
    decoded = kb.decode(want, LAYOUT, page_size=p, num_tokens=x.shape[0], scale=g)
    codes = nx.e2m1_unpack(LAYOUT.pages_to_records(want, p, x.shape[0])[:, :224]).reshape(-1, 28, 16)
    scale_bytes = LAYOUT.pages_to_records(want, p, x.shape[0])[:, 352:380]
    values = (nx.e2m1_decode(codes) * nx.e4m3_decode(scale_bytes)[..., None]) * torch.tensor(g)
    assert torch.equal(decoded[:, :448].view(torch.int32), values.reshape(-1, 448).view(torch.int32))


def test_power_of_two_scale_is_the_unit_scale_record_of_the_unscaled_values(vectors):
    """At g = 2^-3 every step scales exactly: the nope codes and tile scales of x * g at g are those of x at 1,
    which the independent derived fixture of FlashInfer's writer pins (fixtures/README.md)."""
    from safetensors.torch import load_file

    from tests.conftest import FIXTURES

    unit = load_file(str(FIXTURES / "flashinfer_nvfp4_reference.safetensors"))
    tensors, _ = vectors
    for p in (3, 64):
        x1 = unit[f"p{p}.input"]
        n = x1.shape[0]
        want = LAYOUT.pages_to_records(unit[f"p{p}.flashinfer_derived"], p, n)
        got = LAYOUT.pages_to_records(tensors[f"g0.125.p{p}.pages"], p, n)
        assert torch.equal(got[:, :224], want[:, :224]) and torch.equal(got[:, 352:], want[:, 352:])


# --------------------------------------------------------------------------------------------- backends


def latents(n: int, seed: int) -> torch.Tensor:
    """fp32 ``[n, 512]``: N(0, 1) tokens at magnitudes 2^-8 .. 2^8, a zero token, a -0 token."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 512, generator=g) * torch.pow(2.0, torch.randint(-8, 9, (n, 1), generator=g).float())
    x[0] = 0.0
    if n > 1:
        x[1] = -0.0
    return x


@settings(max_examples=40, deadline=None)
@given(st.floats(min_value=nx.NVFP4_GLOBAL_SCALE_MIN, max_value=nx.NVFP4_GLOBAL_SCALE_MAX, width=32),
       st.sampled_from([1, 3, 64]), st.integers(0, 2**16))
def test_native_kernels_equal_the_reference_at_any_global_scale(g, p, seed):
    x = latents(70, seed) * torch.tensor(g, dtype=torch.float32)  # values around the scale
    want = reference.encode_pages(x, LAYOUT, p, None, g)
    assert torch.equal(native.encode_pages(x, LAYOUT, p, None, g), want)
    ref = reference.decode_pages(want, LAYOUT, p, None, g)
    assert torch.equal(native.decode_pages(want, LAYOUT, p, None, g).view(torch.int32), ref.view(torch.int32))
    assert native.amax_pages(want, LAYOUT, p, None, g) == reference.amax_pages(want, LAYOUT, p, None, g)


@pytest.mark.parametrize("g", SCALES)
def test_native_decode_of_random_bytes_equals_the_reference(g):
    """Every code and scale byte (NaN 0x7F, subnormal scales) decodes alike."""
    gen = torch.Generator().manual_seed(5)
    pages = torch.randint(0, 256, (3, LAYOUT.page_bytes(61)), generator=gen, dtype=torch.uint8)
    ref = reference.decode_pages(pages, LAYOUT, 61, None, g)
    got = native.decode_pages(pages, LAYOUT, 61, None, g)
    assert torch.equal(torch.isnan(got), torch.isnan(ref))
    assert torch.equal(torch.nan_to_num(got).view(torch.int32), torch.nan_to_num(ref).view(torch.int32))


@pytest.mark.parametrize("g", SCALES)
@pytest.mark.parametrize("other", [MODEL1, TRT, BF16], ids=lambda lay: lay.name)
def test_native_transcodes_equal_the_reference(g, other):
    x = latents(90, 11)
    s_other = 0.037 if other.per_tensor_scale else 1.0
    src = reference.encode_pages(x, other, 64, other.default_dialect, s_other)
    want = reference.transcode_pages(src, other, 64, LAYOUT, 61, None, s_other, g, None)
    assert torch.equal(native.transcode_pages(src, other, 64, LAYOUT, 61, None, s_other, g, None), want)
    back = reference.transcode_pages(want, LAYOUT, 61, other, 64, 90, g, s_other, other.default_dialect)
    assert torch.equal(native.transcode_pages(want, LAYOUT, 61, other, 64, 90, g, s_other, other.default_dialect),
                       back)


# --------------------------------------------------------------------------------------------- public API


@pytest.mark.parametrize("backend", ["auto", "reference"])
@pytest.mark.parametrize("g", SCALES)
def test_round_trip_within_the_format_bound(g, backend, monkeypatch):
    """Each value of a tile whose scale amax / (6 g) is a normal E4M3 comes back within its tile's amax / 6 (the
    E2M1 step at the top, 2 of 6) plus the E4M3 scale's rounding (2^-4 relative): 0.18 * amax."""
    monkeypatch.setenv(dispatch.BACKEND_ENV, backend)
    x = latents(64, 3) * torch.tensor(g)
    pages = kb.encode(x, LAYOUT, page_size=64, scale=g)
    y = kb.decode(pages, LAYOUT, page_size=64, scale=g)
    tiles, back = x[:, :448].reshape(-1, 28, 16), y[:, :448].reshape(-1, 28, 16)
    amax = tiles.abs().amax(-1, keepdim=True)
    normal = amax / (6 * g) >= 2.0**-6
    assert int(normal.sum()) > 1000
    assert bool((((back - tiles).abs() <= 0.18 * amax) | ~normal).all())
    assert torch.equal(y[:, 448:], x[:, 448:].bfloat16().float())
    # decoding at another g gives other values: g is part of what the bytes mean
    assert not torch.equal(kb.decode(pages, LAYOUT, page_size=64, scale=1.0), y)


@pytest.mark.parametrize("g", SCALES)
def test_transcode_to_and_from_other_layouts(g):
    x = latents(80, 8)
    model1 = kb.encode(x, MODEL1, page_size=64)
    pages = kb.transcode(model1, MODEL1, LAYOUT, src_page_size=64, dst_page_size=61, num_tokens=80, dst_scale=g)
    values = kb.decode(model1, MODEL1, page_size=64, num_tokens=80)
    assert torch.equal(pages, kb.encode(values, LAYOUT, page_size=61, scale=g))
    # to bf16: the values decoded at g (exact products, then bf16 rounding)
    out, rep = kb.transcode(pages, LAYOUT, BF16, src_page_size=61, dst_page_size=16, num_tokens=80, src_scale=g,
                            report=True)
    nv = kb.decode(pages, LAYOUT, page_size=61, num_tokens=80, scale=g)
    assert torch.equal(kb.decode(out, BF16, page_size=16, num_tokens=80), nv.bfloat16().float())
    assert rep.dst_scale is None and not rep.byte_move
    # to trtllm-fp8 at its own per-tensor scale
    fp8 = kb.transcode(pages, LAYOUT, TRT, src_page_size=61, num_tokens=80, src_scale=g, dst_scale=0.5)
    assert torch.equal(fp8, kb.encode(nv, TRT, page_size=61, scale=0.5))
    # NVFP4 at g -> NVFP4 at another g': re-encoded, and the report keeps g'
    other, rep = kb.transcode(pages, LAYOUT, LAYOUT, src_page_size=61, num_tokens=80, src_scale=g, dst_scale=0.25,
                              report=True)
    assert torch.equal(other, kb.encode(nv, LAYOUT, page_size=61, scale=0.25))
    assert rep.dst_scale == 0.25 and not rep.byte_move


@pytest.mark.parametrize("g", SCALES)
def test_equal_global_scales_are_a_byte_move(g):
    x = latents(40, 9)
    pages = kb.encode(x, LAYOUT, page_size=64, scale=g)
    assert is_byte_move(LAYOUT, LAYOUT, g, g) and not is_byte_move(LAYOUT, LAYOUT, g, 1.0)
    out, rep = kb.transcode(pages, LAYOUT, LAYOUT, src_page_size=64, dst_page_size=3, num_tokens=40, src_scale=g,
                            dst_scale=g, report=True)
    assert rep.byte_move and rep.lossless and rep.dst_scale == F32[g]
    assert torch.equal(LAYOUT.pages_to_records(out, 3, 40), LAYOUT.pages_to_records(pages, 64, 40))


def test_unit_scale_reports_as_before():
    """At g = 1 (given or not) the loss report carries no scale, as before the global scale existed."""
    x = latents(8, 1)
    model1 = kb.encode(x, MODEL1, page_size=8)
    for s in (None, 1.0):
        _, rep = kb.transcode(model1, MODEL1, LAYOUT, src_page_size=8, dst_scale=s, report=True)
        assert rep.dst_scale is None
    assert torch.equal(kb.encode(x, LAYOUT, page_size=8, scale=1.0), kb.encode(x, LAYOUT, page_size=8))


BAD_SCALES = [float("nan"), float("inf"), -float("inf"), 0.0, -0.37, 1e-40, 2.0**-118, 2.0**117, 1e39]


@pytest.mark.parametrize("g", BAD_SCALES, ids=repr)
def test_bad_global_scales_are_refused_naming_the_remedy(g):
    x = latents(4, 2)
    pages = kb.encode(x, LAYOUT, page_size=4)
    model1 = kb.encode(x, MODEL1, page_size=4)
    calls = [
        lambda: kb.encode(x, LAYOUT, page_size=4, scale=g),
        lambda: kb.decode(pages, LAYOUT, page_size=4, scale=g),
        lambda: kb.transcode(pages, LAYOUT, MODEL1, src_page_size=4, src_scale=g),
        lambda: kb.transcode(model1, MODEL1, LAYOUT, src_page_size=4, dst_scale=g),
    ]
    for call in calls:
        with pytest.raises(InputError, match=r"NVFP4 global scale .*\[2\^-117, 2\^116\].*pass the global scale"):
            call()


def test_scale_range_edges_are_accepted():
    x = latents(4, 2)
    for g in (nx.NVFP4_GLOBAL_SCALE_MIN, nx.NVFP4_GLOBAL_SCALE_MAX):
        pages = kb.encode(x, LAYOUT, page_size=4, scale=g)
        assert bool(torch.isfinite(kb.decode(pages, LAYOUT, page_size=4, scale=g)).all())
    assert math.isfinite(6 * 448 * nx.NVFP4_GLOBAL_SCALE_MAX) and 2.0**-9 * nx.NVFP4_GLOBAL_SCALE_MIN == 2.0**-126


def test_auto_and_non_numbers_are_refused():
    x = latents(4, 2)
    model1 = kb.encode(x, MODEL1, page_size=4)
    with pytest.raises(InputError, match="global scale is the writer's: pass it as a number"):
        kb.encode(x, LAYOUT, page_size=4, scale="auto")
    with pytest.raises(InputError, match="global scale is the writer's"):
        kb.transcode(model1, MODEL1, LAYOUT, src_page_size=4, dst_scale="auto")
    for bad in (True, "0.5", [0.5]):
        with pytest.raises(KVBridgeError, match="positive finite number"):
            kb.encode(x, LAYOUT, page_size=4, scale=bad)
    # layouts of per-tile scales still refuse a scale
    with pytest.raises(InputError, match="per-tile scales"):
        kb.encode(x, MODEL1, page_size=4, scale=0.37)


# --------------------------------------------------------------------------------------------- migration, dumps


@pytest.mark.parametrize("g", SCALES)
def test_migration_records_convert_at_the_global_scale(g):
    x = latents(300, 4)
    records = LAYOUT.pages_to_records(kb.encode(x, LAYOUT, page_size=300, scale=g), 300)
    out, rep = record_ops.convert_kv_records(records, LAYOUT, MODEL1, src_scale=g, dst_scale=None, dialect=None,
                                             report=True)
    values = kb.decode(LAYOUT.records_to_pages(records, 300), LAYOUT, page_size=300, scale=g)
    assert torch.equal(out, MODEL1.pages_to_records(kb.encode(values, MODEL1, page_size=300), 300))
    back, _ = record_ops.convert_kv_records(out, MODEL1, LAYOUT, src_scale=None, dst_scale=g, dialect=None)
    model1_values = kb.decode(MODEL1.records_to_pages(out, 300), MODEL1, page_size=300)
    assert torch.equal(back, LAYOUT.pages_to_records(kb.encode(model1_values, LAYOUT, page_size=300, scale=g), 300))
    assert rep.num_tokens == 300 and not rep.byte_move


def test_engine_storage_carries_the_global_scale():
    import dataclasses

    from kvbridge.engines.profiles import sglang
    from kvbridge.engines.topology import CacheSpec, Role
    from kvbridge.migration.plan import conversion_name

    base = sglang()
    assert base.kv_layout == MODEL1.name
    nvfp4 = dataclasses.replace(base, kv_layout=LAYOUT.name, swa_dialect=None, compress_dialect=None, kv_scale=0.37)
    spec = CacheSpec(0, Role.SWA, 1, 512, None)
    st_nv, st_m1 = nvfp4.storage(spec), base.storage(spec)
    assert st_nv.scale == 0.37  # as the profile holds it (checked as fp32 where used)
    assert conversion_name(st_nv, st_m1).startswith("transcode flashinfer-nvfp4 -> flashmla-model1")
    assert conversion_name(st_nv, dataclasses.replace(st_nv, scale=0.37)) == "byte move"
    assert conversion_name(st_nv, dataclasses.replace(st_nv, scale=0.5)).endswith("scale 0.5")


@pytest.mark.parametrize("g", SCALES)
def test_dump_entries_keep_the_global_scale(g):
    x = latents(20, 6)
    pages = kb.encode(x, LAYOUT, page_size=8, scale=g)
    entry = DumpEntry(0, "swa", pages, LAYOUT.name, 8, 20, g)
    assert entry.scale == F32[g]
    assert DumpEntry(0, "swa", pages, LAYOUT.name, 8, 20).scale is None  # null: g = 1, as before
    out, rep = convert_entry(entry, BF16.name)
    values = kb.decode(pages, LAYOUT, page_size=8, num_tokens=20, scale=g)
    assert torch.equal(kb.decode(out.data, BF16, page_size=8, num_tokens=20), values.bfloat16().float())
    assert out.scale is None
    back, rep = convert_entry(out, LAYOUT.name, scale=g)
    assert back.scale == F32[g] and rep.dst_scale == F32[g]
    assert torch.equal(back.data, kb.encode(kb.decode(out.data, BF16, page_size=8, num_tokens=20), LAYOUT,
                                            page_size=8, scale=g))
    with pytest.raises(KVBridgeError, match=r"NVFP4 global scale: null \(1\) or an fp32 number in \[2\^-117"):
        DumpEntry(0, "swa", pages, LAYOUT.name, 8, 20, 2.0**120)


@pytest.mark.parametrize("g", SCALES)
def test_slot_transcodes_and_gathers_take_the_global_scale(g):
    x = latents(40, 12)
    pool = kb.encode(x, LAYOUT, page_size=8, scale=g)
    values = kb.decode(pool, LAYOUT, page_size=8, num_tokens=40, scale=g)
    slots = torch.tensor([3, 17, 39, 0])
    dst = torch.zeros(2, MODEL1.page_bytes(4), dtype=torch.uint8)
    kb.transcode_slots(pool, LAYOUT, dst, MODEL1, src_page_size=8, dst_page_size=4, src_slots=slots,
                       dst_slots=torch.tensor([0, 1, 2, 5]), src_scale=g)
    got = kb.decode(dst, MODEL1, page_size=4)[[0, 1, 2, 5]]
    assert torch.equal(got, kb.decode(kb.encode(values[slots], MODEL1, page_size=4), MODEL1, page_size=4))
    back = torch.zeros_like(pool)
    kb.transcode_slots(dst, MODEL1, back, LAYOUT, src_page_size=4, dst_page_size=8, src_slots=torch.tensor([0, 1]),
                       dst_slots=torch.tensor([3, 17]), dst_scale=g)
    want = kb.encode(kb.decode(dst, MODEL1, page_size=4)[:2], LAYOUT, page_size=1, scale=g)
    assert torch.equal(LAYOUT.pages_to_records(back, 8)[[3, 17]], LAYOUT.pages_to_records(want, 1))
    scratch, remapped = kb.gather_transcode(pool, LAYOUT, page_size=8, indices=torch.tensor([[39, 3, -1]]), scale=g)
    gathered = kb.decode(scratch, MODEL1, page_size=64)[remapped[0, :2].long()]
    assert torch.equal(gathered, kb.decode(kb.encode(values[[39, 3]], MODEL1, page_size=2), MODEL1, page_size=2))


@pytest.mark.parametrize("g", SCALES)
def test_cli_convert_reads_and_writes_the_global_scale(g, tmp_path):
    """``kvbridge convert``: the source entry's scale is its g; ``--scale`` sets the destination's."""
    from click.testing import CliRunner

    from cli.main import cli
    from kvbridge.dumps.dumpfile import read_dump
    from kvbridge.dumps.writer import write_dump

    x = latents(50, 13)
    pages = kb.encode(x, LAYOUT, page_size=16, scale=g)
    src = write_dump(tmp_path / "in.kvd", [DumpEntry(0, "swa", pages, LAYOUT.name, 16, 50, g)])
    runner = CliRunner()
    done = runner.invoke(cli, ["convert", str(src), str(tmp_path / "bf16.kvd"), "--to", "bf16", "--json"])
    assert done.exit_code == 0, done.output
    (entry,) = read_dump(tmp_path / "bf16.kvd").entries
    values = kb.decode(pages, LAYOUT, page_size=16, num_tokens=50, scale=g)
    assert torch.equal(kb.decode(entry.data, BF16, page_size=16, num_tokens=50), values.bfloat16().float())
    done = runner.invoke(cli, ["convert", str(tmp_path / "bf16.kvd"), str(tmp_path / "back.kvd"), "--to", LAYOUT.name,
                               "--scale", str(g), "--json"])
    assert done.exit_code == 0, done.output
    (back,) = read_dump(tmp_path / "back.kvd").entries
    assert back.scale == F32[g]
    bf16_values = kb.decode(entry.data, BF16, page_size=16, num_tokens=50)
    assert torch.equal(back.data, kb.encode(bf16_values, LAYOUT, page_size=16, scale=g))
    done = runner.invoke(cli, ["convert", str(tmp_path / "bf16.kvd"), str(tmp_path / "bad.kvd"), "--to", LAYOUT.name,
                               "--scale", "1e-38"])
    assert done.exit_code == 2 and "NVFP4 global scale" in done.output


def test_sparse_decode_reads_the_pool_at_its_global_scale():
    """At g = 2^-3 every decoded NVFP4 value is exact in bf16, so the pool's bf16 transcode is lossless and the
    reference sparse decode over either gives the same output; decoding at g = 1 instead does not."""
    from kvbridge.attention.sparse import sparse_decode

    g = 0.125
    x = latents(40, 14)
    pool = kb.encode(x, LAYOUT, page_size=8, scale=g)
    bf16, rep = kb.transcode(pool, LAYOUT, BF16, src_page_size=8, src_scale=g, report=True)
    assert rep.lossless
    gen = torch.Generator().manual_seed(15)
    q = (torch.randn(2, 1, 16, 512, generator=gen) * 0.3).bfloat16()
    idx = torch.randint(0, 40, (2, 1, 12), generator=gen, dtype=torch.int32)
    out_a, lse_a = sparse_decode(q, pool, idx, layout=LAYOUT, page_size=8, scale=g, backend="reference")
    out_b, lse_b = sparse_decode(q, bf16, idx, layout=BF16, page_size=8, backend="reference")
    assert torch.equal(out_a, out_b) and torch.equal(lse_a, lse_b)
    out_c, _ = sparse_decode(q, pool, idx, layout=LAYOUT, page_size=8, backend="reference")
    assert not torch.equal(out_a, out_c)
