"""The DeepSeek-V4.1 family beyond the writers' fixtures: byte moves between its arrangements, loss
reports that say what is lost, the fp4 rules (E2M1 rounding, division by the rounded scale, NaN
poisoning a tile). Transcodes between every pair of the registry are in test_native.py."""

from __future__ import annotations

import itertools

import pytest
import torch

import kvbridge as kb
from kvbridge import numerics as nx
from kvbridge.layouts import get_layout
from kvbridge.layouts.codec import record_codec
from kvbridge.ops.pages import is_byte_move

V41_FP8 = ("v41-fp8", "v41-fp8-interleaved")
V41_FP4 = ("v41-fp4", "v41-fp4-pad512", "v41-fp4-interleaved")


@pytest.fixture(scope="module")
def latents() -> torch.Tensor:
    g = torch.Generator().manual_seed(41)
    return torch.randn(130, 512, generator=g) * torch.exp2(torch.randint(-8, 6, (130, 1), generator=g).float())


def test_page_geometry_of_the_family():
    assert get_layout("v41-fp8").page_bytes(64) == 33792 and get_layout("v41-fp8").page_bytes(3) == 2048
    assert get_layout("v41-fp8-interleaved").page_bytes(3) == 3 * 528
    assert get_layout("v41-fp4").page_bytes(3) == 1024 and get_layout("v41-fp4-pad512").page_bytes(3) == 1024
    assert get_layout("v41-fp4").page_bytes(2) == 768 and get_layout("v41-fp4-pad512").page_bytes(2) == 1024
    assert get_layout("v41-fp4-interleaved").page_bytes(5) == 5 * 288
    lay = get_layout("v41-fp8")
    assert lay.field_offset("rope_scale", 2, 64) == 64 * 512 + 2 * 16 + 14
    assert get_layout("v41-fp8-interleaved").field_offset("nope_scale", 2, 64) == 2 * 528 + 512


@pytest.mark.parametrize("names", [V41_FP8, V41_FP4])
def test_arrangements_of_one_record_are_byte_moves(latents, names):
    pools = {n: kb.encode(latents, n, page_size=61) for n in names}
    for a, b in itertools.permutations(names, 2):
        assert is_byte_move(get_layout(a), get_layout(b), 1.0, 1.0)
        out, rep = kb.transcode(pools[a], a, b, src_page_size=61, report=True)
        assert torch.equal(out, pools[b]) and rep.byte_move and rep.lossless and rep.note == ""


def test_loss_reports_say_what_the_destination_gives_up(latents):
    m1 = kb.encode(latents, "flashmla-model1", page_size=64)
    _, rep = kb.transcode(m1, "flashmla-model1", "v41-fp8-interleaved", src_page_size=64, report=True)
    assert not rep.lossless and rep.rope_max_abs_error > 0 and "rope quantized" in rep.note
    v41 = kb.encode(latents, "v41-fp8", page_size=64)
    _, rep = kb.transcode(v41, "v41-fp8", "v41-fp4-interleaved", src_page_size=64, report=True)
    assert not rep.lossless and "far coarser" in rep.note
    assert rep.max_rel_error > 0.02  # FP4: the report's own numbers show it
    _, exact = kb.transcode(kb.encode(latents, "trtllm-fp8", page_size=64), "trtllm-fp8", "v41-fp8",
                            src_page_size=64, report=True)
    assert exact.lossless and exact.note == ""  # every E4M3 value at scale 1 stays exact in MXFP8 tiles


def test_e2m1_rounding_matches_nearest_even_on_a_dense_grid():
    x = torch.cat([torch.linspace(-8, 8, 200001), torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -0.0, 1e30])])
    got = nx.e2m1_decode(nx.e2m1_encode(x))
    grid = torch.tensor(nx.E2M1_MAGNITUDES, dtype=torch.float64)
    dist = (x.double().abs().clamp(max=6.0).unsqueeze(1) - grid).abs()  # exact in fp64
    odd = torch.arange(8, dtype=torch.float64) % 2
    code = (dist + odd * 1e-12).argmin(dim=1)  # nearest; a tie goes to the even code
    want = (grid[code] * torch.where(torch.signbit(x), -1.0, 1.0).double()).float()
    assert torch.equal(got, want)
    assert nx.e2m1_encode(torch.tensor([-0.1, -0.0, 0.0])).tolist() == [8, 8, 0]  # signed zero


def test_fp4_divides_by_the_rounded_scale_and_nan_poisons_its_tile():
    lay = get_layout("v41-fp4-interleaved")
    x = torch.zeros(1, 512)
    x[0, :16] = torch.linspace(-1.3, 1.3, 16)
    x[0, 5] = 1.3 * 7 / 6  # amax / 6 is not an E4M3 value: the scale is rounded first
    rec = record_codec(lay).encode(x, dialect=None, scale=1.0)
    scale = nx.e4m3_decode(rec[:, 256])
    assert torch.equal(nx.e2m1_encode(x[0, :16] / scale), nx.e2m1_unpack(rec[0, :8]))
    bad = x.clone()
    bad[0, 20] = float("nan")
    rec = record_codec(lay).encode(bad, dialect=None, scale=1.0)
    assert int(rec[0, 257]) == nx.E4M3_NAN and int(rec[0, 256]) != nx.E4M3_NAN
    values = record_codec(lay).decode(rec, scale=1.0)
    assert bool(values[0, 16:32].isnan().all()) and not bool(values[0, :16].isnan().any())
    with pytest.raises(kb.NonFiniteError):
        kb.transcode(lay.records_to_pages(rec, 1), lay, "v41-fp8", src_page_size=1)
