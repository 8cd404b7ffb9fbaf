"""The FP4 main-cache records ``flashinfer-nvfp4`` (FlashInfer's DeepSeek-V4 NVFP4 sparse-MLA cache,
384 B/token), ``sglang-mxfp4`` (SGLang's DeepSeek-V4 MXFP4 cache, 368 B/token) and ``lil-nvfp4-ds-mla``
(local-inference-lab's vLLM fork, 432 B/token, rope stored twice): their scale rules at the edges
the writers' own tests pin, tiles below the scale range, poisoned tiles, the second copy of the rope,
and their listing apart as experimental layouts.

Byte-exactness on every backend, transcodes and slot operations run in ``test_new_layout.py``; the
derived fixture in ``test_layout_fixtures.py``.
"""

from __future__ import annotations

import json

import pytest
import torch
from click.testing import CliRunner

import kvbridge as kb
from cli.main import cli
from kvbridge import numerics as nx
from kvbridge.layouts import all_layouts, get_layout
from kvbridge.layouts.codec import record_codec

LAYOUT = get_layout("flashinfer-nvfp4")
MXFP4 = get_layout("sglang-mxfp4")
LIL = get_layout("lil-nvfp4-ds-mla")


def _record(x: torch.Tensor) -> torch.Tensor:
    return record_codec(LAYOUT).encode(x, dialect=None, scale=1.0)


def test_known_encoding_of_flashinfer_test():
    """FlashInfer's test_nvfp4_sparse_mla_known_encoding_and_nonfinite_contract, row 0: the E2M1
    codes 0..6 with both signs at scale 1 (E4M3 0x38); zero tiles get scale byte 0."""
    x = torch.zeros(1, 512)
    x[0, :16] = torch.tensor([0.0, -0.0, 0.5, -0.5, 1, -1, 1.5, -1.5, 2, -2, 3, -3, 4, -4, 6, -6])
    x[0, 448:] = torch.linspace(-2, 2, 64).bfloat16().float()
    rec = _record(x)[0]
    assert rec[:8].tolist() == [0x80, 0x91, 0xA2, 0xB3, 0xC4, 0xD5, 0xE6, 0xF7]
    assert rec[352] == 0x38 and not rec[353:].any() and not rec[8:224].any()
    assert torch.equal(rec[224:352], x[0, 448:].bfloat16().view(torch.uint8))


def test_scale_rule_edges():
    amax = torch.tensor([0.0, 6 * 2.0**-10, 6 * 2.0**-9, 6.0, 2688.0, 1e30, float("inf"), float("nan")])
    assert nx.nvfp4_tile_scale(amax).tolist() == [0x00, 0x00, 0x01, 0x38, 0x7E, 0x7E, 0x7F, 0x7F]
    # no lower clamp, unlike the V4.1 fp4 record (2^-9): a zero tile gets scale 0, not 0x01
    assert nx.fp4_tile_scale(amax[:1]).tolist() == [0x01]


def test_tile_below_the_e4m3_range_saturates_and_decodes_to_zero():
    x = torch.zeros(1, 512)
    x[0, :4] = torch.tensor([0.005, -0.001, 0.0, -0.0])  # amax * fp32(1/6) rounds to E4M3 0
    rec = _record(x)[0]
    assert rec[352] == 0 and rec[:2].tolist() == [0xF7, 0x80]  # +-6 for nonzero values, signed zeros kept
    assert not kb.decode(LAYOUT.records_to_pages(rec[None], 1), LAYOUT, page_size=1)[0, :16].any()


def test_reciprocal_multiply_differs_from_division_at_ties():
    """Codes are of x * fp32(1/s): at some E2M1 ties that lands on the other side than x / s."""
    s = nx.e4m3_decode(torch.arange(1, 0x7F, dtype=torch.uint8))
    t = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])
    x = s[:, None] * t[None, :]
    codes = torch.arange(1, 0x7F, dtype=torch.uint8)[:, None].expand(-1, 1)
    mul = nx.nvfp4_encode_tiles(x[:, None, :], codes)
    div = nx.fp4_encode_tiles(x[:, None, :], codes)
    assert int((mul != div).sum()) == 42


def test_nonfinite_tile_is_poisoned():
    x = torch.ones(1, 1, 16)
    x[0, 0, 3] = float("nan")
    sb = nx.nvfp4_tile_scale(x.abs().amax(-1))
    assert sb.tolist() == [[0x7F]] and not nx.nvfp4_encode_tiles(x, sb).any()


def test_layouts_lists_experimental_layouts_apart():
    out = CliRunner().invoke(cli, ["layouts"], env={"COLUMNS": "80"})
    assert out.exit_code == 0, out.output
    shipped, _, rest = out.output.partition("experimental layouts")
    for name, pr in (("flashinfer-nvfp4", "#4955"), ("sglang-mxfp4", "#37136"), ("lil-nvfp4-ds-mla", "#632")):
        assert name not in shipped and name in rest and pr in rest
    records = json.loads(CliRunner().invoke(cli, ["layouts", "--json"]).output)
    marked = {r["name"]: r["experimental"] for r in records}
    assert "SGLang #38646" in marked["flashinfer-nvfp4"] and "#37138" in marked["sglang-mxfp4"]
    assert {n for n, e in marked.items() if e} == {lay.name for lay in all_layouts() if lay.experimental}
    assert marked["flashmla-model1"] is None


def test_mxfp4_scale_byte_rounds_log2_to_nearest():
    """byte = round(log2(amax / 6)) + 127: the boundary 6 * 2^(k + 1/2) lies between bf16 neighbours."""
    amax = torch.tensor([6.0, 8.4375, 8.5, 3.0, 4.2, 0.0, 1e-39, 2.0**-124, 3.0e38, float("inf"), float("nan")])
    assert nx.mxfp4_scale_byte(amax).tolist() == [127, 127, 128, 126, 126, 0, 0, 0, 252, 0xFF, 0xFF]
    exact = torch.log2(amax[:5].double() / 6).round() + 127
    assert nx.mxfp4_scale_byte(amax[:5]).double().tolist() == exact.tolist()


def test_mxfp4_codes_saturate_above_six_times_the_scale():
    """Rounding the scale to nearest lets a tile's maximum reach about 8.5 times it: those codes saturate."""
    x = torch.zeros(1, 512)
    x[0, :4] = torch.tensor([8.4375, -7.0, 6.0, -0.0])  # amax 8.4375 -> scale 1
    rec = record_codec(MXFP4).encode(x, dialect=None, scale=1.0)[0]
    assert rec[224] == 127 and rec[:2].tolist() == [0xF7, 0x87] and not rec[238:240].any()
    assert kb.decode(MXFP4.records_to_pages(rec[None], 1), MXFP4, page_size=1)[0, :4].tolist() == [6.0, -6.0, 6.0, -0.0]


def test_mxfp4_nonfinite_tile_is_poisoned():
    x = torch.ones(1, 1, 32)
    x[0, 0, 5] = float("inf")
    sb = nx.mxfp4_scale_byte(x.abs().amax(-1))
    assert sb.tolist() == [[0xFF]] and not nx.mxfp4_encode_tiles(x, sb).any()


def _lil_pages(x: torch.Tensor) -> torch.Tensor:
    return kb.encode(x, LIL, page_size=1)


def test_lil_scale_zero_tile_gets_signed_zero_codes():
    """vLLM's cvt_warp_fp16_to_fp4 multiplies a tile whose scale byte is 0 by 0 (FlashInfer's by 1/0: +-6)."""
    x = torch.zeros(1, 512)
    x[0, :4] = torch.tensor([0.005, -0.001, 0.0, -0.0])
    x[0, 448:452] = torch.tensor([0.004, -0.002, -0.0, 0.0]).bfloat16().float()  # the rope's first E2M1 tile
    rec = _lil_pages(x)[0]
    assert rec[256] == 0 and rec[:2].tolist() == [0x80, 0x80]
    assert rec[284] == 0 and rec[224:226].tolist() == [0x80, 0x08]
    assert _record(x)[0, :2].tolist() == [0xF7, 0x80]  # flashinfer-nvfp4's rule on the same tile
    assert not kb.decode(rec[None], LIL, page_size=1)[0, :16].any()


def test_lil_record_bytes():
    """0..255 codes of all 512 dims, 256..287 their scales, 288..303 zero, 304..431 the rope's bf16 bytes."""
    x = torch.zeros(1, 512)
    x[0, :16] = torch.tensor([0.0, -0.0, 0.5, -0.5, 1, -1, 1.5, -1.5, 2, -2, 3, -3, 4, -4, 6, -6])
    x[0, 448:] = torch.linspace(-2, 2, 64).bfloat16().float()
    rec = _lil_pages(x)[0]
    assert rec[:8].tolist() == [0x80, 0x91, 0xA2, 0xB3, 0xC4, 0xD5, 0xE6, 0xF7] and rec[256] == 0x38
    assert not rec[8:224].any() and not rec[257:284].any() and not rec[288:304].any()
    assert torch.equal(rec[304:], x[0, 448:].bfloat16().view(torch.uint8))
    rope = x[:, 448:].reshape(1, 4, 16)
    sb = nx.nvfp4_tile_scale(rope.abs().amax(-1))
    assert torch.equal(rec[284:288], sb[0]) and torch.equal(rec[224:256], nx.e2m1_pack(
        nx.nvfp4_encode_tiles(rope, sb).reshape(1, 64))[0])
    assert torch.equal(kb.decode(rec[None], LIL, page_size=1)[0, 448:], x[0, 448:])  # read from the bf16 copy


def test_lil_rope_tiles_are_quantized_from_the_bf16_copy():
    """fp32 rope input: both copies hold the bf16-rounded values' encodings, as the writer quantizes its bf16 row."""
    x = torch.zeros(1, 512)
    x[0, 448] = 6.0
    x[0, 449] = 1.2500001  # fp32: above the 1 / 1.5 tie (code 1.5); bf16 1.25: the tie, to even (code 1.0)
    rec = _lil_pages(x)[0]
    assert rec[284] == 0x38 and rec[224] == 0x27  # codes 6 (7) and 1.0 (2)
    assert rec[304:308].tolist() == list(torch.tensor([6.0, 1.25]).bfloat16().view(torch.uint8).tolist())


def test_lil_second_copy_that_disagrees_is_refused():
    x = torch.randn(4, 512).bfloat16().float()
    pages = _lil_pages(x)
    assert torch.equal(kb.decode(pages, LIL, page_size=1)[:, 448:], x[:, 448:])  # the writer's bytes pass
    for byte in (230, 286):  # an E2M1 rope code, a rope tile's scale
        bad = pages.clone()
        bad[2, byte] ^= 0x11
        with pytest.raises(kb.CopyMismatchError, match=r"token 2: record bytes .* of lil-nvfp4-ds-mla disagree"):
            kb.decode(bad, LIL, page_size=1)
        with pytest.raises(kb.CopyMismatchError, match="re-encode"):
            kb.transcode(bad, LIL, "bf16", src_page_size=1, dst_page_size=64)


def test_lil_nonfinite_propagate_is_refused():
    """What the writer stores for a NaN/Inf tile is not established: ``propagate`` is refused, not guessed."""
    x = torch.zeros(1, 512)
    x[0, 3] = float("nan")
    with pytest.raises(kb.InputError, match="nonfinite='propagate' is not available for lil-nvfp4-ds-mla"):
        kb.encode(x, LIL, page_size=1, nonfinite="propagate")
    with pytest.raises(kb.NonFiniteError):
        kb.encode(x, LIL, page_size=1)
