"""The format table's promise: a format registered in this file alone (no library change), and an
unregistered layout made of it, reach every consumer of the table: ``compile_segments`` (and so the
codec and every backend), the non-finite byte scan, dump statistics and the accuracy study. A
consumer that cannot take an entry refuses it by name (``LayoutError``). The table is restored
after each test."""

from __future__ import annotations

import pytest
import torch

import kvbridge as kb
from kvbridge.dumps.stats import _StatsAccumulator
from kvbridge.errors import InputError, LayoutError
from kvbridge.layouts import Field, Layout, get_layout, scan
from kvbridge.layouts import formats as F
from kvbridge.layouts.codec import record_codec
from kvbridge.study.accuracy import QuantizedKV, e4m3_stats

#: A scale format like UE8M0 under another name; a value format like E4M3 scaled only by it.
TEST_SCALE = F.Format("test-pow2", "scale", 8, nonfinite=F.CodeRule(1, 0xFF, 0xFF), exponent_bias=127)
TEST_VALUE = F.Format("test-fp8", "value", 8, nonfinite=F.E4M3_NAN, ops=(("test-pow2", F.OP_E4M3_UE8M0),),
                      at_max=F.CodeRule(1, 0x7F, 0x7E), subnormal=F.CodeRule(1, 0x78, 0), zero=F.CodeRule(1, 0x7F, 0))


def _layout(value: str, scale: str, name: str = "test-fmt-fp8") -> Layout:
    """MODEL1's record (E4M3 nope in tiles of 64, bf16 rope, 7 scale bytes, 1 pad byte), token-major."""
    return Layout(
        name=name,
        description="test only: MODEL1's record in the test formats",
        record_bytes=584,
        fields=(
            Field("nope", 0, 448, value, (0, 448), tile=64, scale="sc"),
            Field("rope", 448, 128, "bf16", (448, 512)),
            Field("sc", 576, 7, scale),
            Field("pad", 583, 1, "pad"),
        ),
        dialects=("flashmla", "amax-1e-4"),
    )


@pytest.fixture
def table():
    """The two test formats registered for one test; the table exactly as before afterwards."""
    before = list(F.all_formats())
    F.register_format(TEST_SCALE)
    F.register_format(TEST_VALUE)
    yield
    F.unregister_format(TEST_VALUE.name)
    F.unregister_format(TEST_SCALE.name)
    assert F.all_formats() == before


def latents(n: int) -> torch.Tensor:
    return (torch.randn(n, 512, generator=torch.Generator().manual_seed(3)) * 4).bfloat16().float()


def test_a_registered_format_runs_through_codec_and_every_backend(table):
    lay = _layout("test-fp8", "test-pow2")
    twin = _layout("e4m3", "ue8m0", "test-fmt-twin")  # the same record in the shipped formats
    assert lay.segments == twin.segments and lay.same_record(twin)
    x = latents(50)
    pages = kb.encode(x, lay, page_size=16)
    assert torch.equal(pages, kb.encode(x, twin, page_size=16))
    assert torch.equal(kb.decode(pages, lay, page_size=16, num_tokens=50),
                       record_codec(lay).decode(lay.pages_to_records(pages, 16, 50), scale=1.0))
    model1 = get_layout("flashmla-model1")
    out = kb.transcode(pages, lay, model1, src_page_size=16, dst_page_size=64, num_tokens=50)
    assert torch.equal(kb.decode(out, model1, page_size=64, num_tokens=50), kb.decode(pages, lay, page_size=16,
                                                                                       num_tokens=50))


def test_the_scan_and_dump_statistics_read_the_new_formats(table):
    lay = _layout("test-fp8", "test-pow2")
    pages = kb.encode(latents(40), lay, page_size=8)
    pages[2, lay.field_offset("sc", 3, 8) + 5] = 0xFF  # token 19: a NaN scale byte of the new scale format
    pages[4, lay.field_offset("nope", 1, 8) + 7] = 0xFF  # token 33: a NaN code of the new value format
    found = scan.scan_pages(pages, lay, 8, 40)
    assert (found.count, found.first_token, found.first_field, found.values) == (2, 19, "sc", 64 + 1)
    assert found == scan.scan_records(lay.pages_to_records(pages, 8, 40), lay)
    codes = scan.code_stats(pages, lay, 8, 40)
    assert set(codes) == {"test-fp8", "bf16", "test-pow2"}  # pad has no code rule
    assert codes == scan._code_stats_records(lay.pages_to_records(pages, 8, 40), lay)
    assert (codes["test-pow2"].nonfinite, codes["test-fp8"].nonfinite) == (1, 1)
    acc = _StatsAccumulator(lay)
    acc.add_pages(pages, 8, 40)
    stats = acc.result()
    assert stats["nan"] == {"test-fp8": 1, "bf16": 0, "test-pow2": 1}
    assert sum(stats["scale_exponents"].values()) == 40 * 7 - 1  # every finite scale byte, in the histogram
    with pytest.raises(kb.NonFiniteError, match=r"65 non-finite value\(s\).*2 NaN/Inf stored code\(s\).*token 19"):
        kb.transcode(pages, lay, lay, src_page_size=8, dst_page_size=16, num_tokens=40)


def test_the_accuracy_study_reads_the_new_value_format(table):
    lay = _layout("test-fp8", "test-pow2")
    twin = _layout("e4m3", "ue8m0", "test-fmt-twin")
    x = latents(32)
    got = [e4m3_stats(x, QuantizedKV(la, 8, kb.encode(x, la, page_size=8), None,
                                     kb.decode(kb.encode(x, la, page_size=8), la, page_size=8)))
           for la in (lay, twin)]
    assert got[0] == got[1] and "nope_subnormal_frac" in got[0]


def test_consumers_refuse_what_they_cannot_take_by_name(table):
    with pytest.raises(LayoutError, match=r"field nope: unknown format 'test-e5m2'"):
        _layout("test-e5m2", "test-pow2")
    with pytest.raises(LayoutError, match=r"field nope: scale field 'sc' must exist and be test-pow2"):
        _layout("test-fp8", "ue8m0")  # the new value format is scaled only by the new scale format
    unscaled = Field("nope", 0, 448, "test-fp8", (0, 448))
    with pytest.raises(LayoutError, match=r"field nope: a test-fp8 field needs a scale field \(test-pow2\)"):
        Layout("test-fmt-unscaled", "", 576, (unscaled, Field("rope", 448, 128, "bf16", (448, 512))),
               per_tensor_scale=True)
    with pytest.raises(LayoutError, match=r"format 'test-int8': op 99 is not one the backends execute"):
        F.register_format(F.Format("test-int8", "value", 8, nonfinite=None, ops=((None, 99),)))
    with pytest.raises(LayoutError, match=r"format 'test-wide': code rule .* does not fit 8-bit"):
        F.register_format(F.Format("test-wide", "value", 8, nonfinite=F.CodeRule(2, 0x7F80, 0x7F80),
                                   ops=((None, F.OP_BF16),)))
    with pytest.raises(LayoutError, match=r"format 'test-pow2': already registered"):
        F.register_format(TEST_SCALE)
    with pytest.raises(LayoutError, match=r"unknown format 'nope'"):
        F.get_format("nope")
    with pytest.raises(LayoutError, match=r"format 'test-pow2' is the scale format of another entry"):
        F.unregister_format("test-pow2")
    # a format whose elements the accuracy study cannot read one byte per dim is refused by name
    F.register_format(F.Format("test-fp16ish", "value", 16, nonfinite=None, ops=((None, F.OP_BF16),),
                               at_max=F.CodeRule(2, 0x7FFF, 0x7F7F), subnormal=F.CodeRule(2, 0x7F80, 0),
                               zero=F.CodeRule(2, 0x7FFF, 0)))
    try:
        wide = Layout("test-fmt-wide", "", 1024, (Field("all", 0, 1024, "test-fp16ish", (0, 512)),))
        x = latents(8)
        q = QuantizedKV(wide, 8, kb.encode(x, wide, page_size=8), None, x)
        with pytest.raises(InputError, match=r"field all of test-fmt-wide does not hold one test-fp16ish byte"):
            e4m3_stats(x, q)
    finally:
        F.unregister_format("test-fp16ish")


def test_every_shipped_format_is_one_entry():
    names = [f.name for f in F.all_formats()]
    assert sorted(names) == sorted({"e4m3", "e4m3-scale", "nvfp4-scale", "nvfp4-scale-vllm", "ue8m0", "e2m1", "bf16",
                                    "pad", "e4m3fnuz"})
    fnuz = F.get_format("e4m3fnuz")  # float8_e4m3fnuz: 0x80 is its one NaN; 0x7F / 0xFF are +-240
    assert fnuz.nonfinite.matches(0x80) and not fnuz.nonfinite.matches(0x7F) and not fnuz.nonfinite.matches(0xFF)
    assert fnuz.at_max.matches(0x7F) and fnuz.at_max.matches(0xFF)
    assert fnuz.zero.matches(0) and not fnuz.zero.matches(0x80)
    e4m3_scale = F.get_format("e4m3-scale")
    assert e4m3_scale.nonfinite.matches(0x7F) and e4m3_scale.nonfinite.matches(0xFF)  # the bug behind the table
    assert F.get_format("e2m1").nonfinite is None and F.get_format("pad").nonfinite is None
