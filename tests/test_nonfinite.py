"""The byte-level scan of stored codes: the numba kernels equal the torch reference on every layout
and geometry, count exactly and name the first bad token and field. ``nonfinite="propagate"``: encode
and transcode store NaN/Inf tiles byte for byte as each writer of ``fixtures/nonfinite_reference`` does."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from safetensors import safe_open
from safetensors.torch import load_file

import kvbridge as kb
from cli.main import cli
from kvbridge.backends import dispatch
from kvbridge.dumps.dumpfile import DumpEntry
from kvbridge.dumps.writer import write_dump
from kvbridge.errors import InputError, NonFiniteError
from kvbridge.layouts import all_layouts, get_layout, scan


def random_pages(layout, num_pages: int, page_size: int, seed: int, density: float) -> torch.Tensor:
    """Finite random codes with about ``density`` of the bytes set to 0xFF (NaN in every format)."""
    g = torch.Generator().manual_seed(seed)
    pages = torch.randint(0, 0x7E, (num_pages, layout.page_bytes(page_size)), dtype=torch.uint8, generator=g)
    hits = torch.rand(pages.shape, generator=g) < density
    pages[hits] = 0xFF
    return pages


@pytest.mark.parametrize("name", [lay.name for lay in all_layouts()])
@pytest.mark.parametrize(("page_size", "tokens"), [(1, 7), (61, 300), (64, 64 * 70 - 5)])
def test_kernel_equals_reference(name: str, page_size: int, tokens: int):
    lay = get_layout(name)
    num_pages = -(-tokens // page_size) + 1  # one spare page: its bytes must not count
    for seed, density in ((0, 0.0), (1, 1e-5), (2, 0.01)):
        pages = random_pages(lay, num_pages, page_size, seed, density)
        got = scan.scan_pages(pages, lay, page_size, tokens)
        want = scan.scan_records(lay.pages_to_records(pages, page_size, tokens), lay)
        assert got == want
        assert scan.code_stats(pages, lay, page_size, tokens) == scan._code_stats_records(
            lay.pages_to_records(pages, page_size, tokens), lay
        )


def test_first_token_and_field_and_pad_ignored():
    lay = get_layout("flashmla-model1")
    pages = torch.zeros(2, lay.page_bytes(4), dtype=torch.uint8)
    pages[0, lay.field_offset("pad", 1, 4)] = 0xFF  # pad bytes are not codes
    assert scan.scan_pages(pages, lay, 4).count == 0
    pages[1, lay.field_offset("scale", 2, 4) + 3] = 0xFF  # token 6: UE8M0 NaN
    pages[1, lay.field_offset("nope", 3, 4) + 9] = 0x7F  # token 7: E4M3 NaN
    rope = lay.field_offset("rope", 3, 4) + 2
    pages[1, rope : rope + 2] = torch.tensor([0x80, 0x7F], dtype=torch.uint8)  # token 7: bf16 +Inf
    found = scan.scan_pages(pages, lay, 4)
    assert (found.count, found.first_token, found.first_field) == (3, 6, "scale")
    assert found.values == 64 + 1 + 1  # the NaN scale byte spoils its whole tile of 64 values
    stats = scan.code_stats(pages, lay, 4)
    e4m3, bf16, ue8m0 = stats["e4m3"], stats["bf16"], stats["ue8m0"]
    assert (e4m3.nonfinite, bf16.nonfinite - bf16.inf, bf16.inf, ue8m0.histogram[0xFF]) == (1, 0, 1, 1)
    assert ue8m0.nonfinite == 1 and set(stats) == {"e4m3", "bf16", "ue8m0"}


def test_v41_fp4_nan_scale_byte_is_refused_by_byte_move_convert_and_inspect(tmp_path):
    """The regression behind the format table: E4M3 scale bytes were missing from the scan's own table."""
    lay, n = get_layout("v41-fp4"), 100
    x = (torch.randn(n, 512, generator=torch.Generator().manual_seed(5)) * 2).bfloat16()
    pages = kb.encode(x, lay, page_size=64)
    pages[1, lay.field_offset("nope_scale", 5, 64) + 2] = 0x7F  # token 69: an E4M3 NaN scale byte
    decoded = kb.decode(pages, lay, page_size=64, num_tokens=n)
    assert int((~torch.isfinite(decoded)).sum()) == 16  # its whole tile
    message = r"16 non-finite value\(s\) \(decoded NaN/Inf.*token 69, field 'nope_scale'"
    with pytest.raises(NonFiniteError, match=message):
        kb.transcode(pages, lay, "v41-fp4-pad512", src_page_size=64, num_tokens=n)
    src = write_dump(tmp_path / "fp4.safetensors", [DumpEntry(0, "kv", pages, "v41-fp4", 64, n)])
    out = tmp_path / "out.safetensors"
    result = CliRunner().invoke(cli, ["convert", str(src), str(out), "--to", "v41-fp4-pad512"])
    assert result.exit_code == 1 and not out.exists()
    assert "16 non-finite value(s) (decoded NaN/Inf) in the source; first at token 69" in result.output
    result = CliRunner().invoke(cli, ["inspect", str(src), "--json"])
    entry = json.loads(result.output)["entries"][0]
    assert entry["nonfinite_values"] == 16 and entry["nan"] == {"e4m3-scale": 1}


def test_value_stats_kernel_equals_torch():
    g = torch.Generator().manual_seed(4)
    x = torch.randn(70000, 3, generator=g) * 1e3
    assert scan.value_stats(x) == (float(x.abs().max()), 0)
    x[5, 1], x[60000, 2], x[7, 0] = float("nan"), float("-inf"), -3e38
    big = float(torch.tensor(3e38))  # the fp32 value stored
    assert scan.value_stats(x) == (big, 2)
    assert scan.value_stats(x.double()) == (big, 2)  # the torch path
    assert scan.value_stats(torch.zeros(0)) == (0.0, 0)


# --- nonfinite="propagate": NaN/Inf tiles as each dialect's writer stores them (fixtures/README.md) ---

NONFINITE_FIXTURE = Path(__file__).resolve().parent.parent / "fixtures" / "nonfinite_reference.safetensors"


def _fixture() -> tuple[dict[str, torch.Tensor], list[dict], list[dict]]:
    with safe_open(str(NONFINITE_FIXTURE), "pt") as f:
        meta = f.metadata()
    return load_file(str(NONFINITE_FIXTURE)), json.loads(meta["entries"]), json.loads(meta["transcodes"])


TENSORS, ENTRIES, TRANSCODES = _fixture()


def test_fixture_covers_each_writer_and_every_kind_of_tile():
    writers = {(e["writer"].split(" tests/")[0].split(" 0.5")[0], e["layout"]) for e in ENTRIES}
    assert writers == {("FlashMLA", "flashmla-model1"), ("FlashMLA", "v41-fp8"), ("FlashMLA", "v41-fp4-pad512"),
                       ("SGLang", "v41-fp8"), ("SGLang", "v41-fp4")}
    x = TENSORS["p64.input"].float()
    assert torch.isnan(x).any() and torch.isposinf(x).any() and torch.isneginf(x).any()
    tiles = x[:, :448].reshape(64, 7, 64)
    assert (torch.isnan(tiles).any(-1) & torch.isinf(tiles).any(-1)).any()  # a tile with both
    assert torch.isnan(tiles).all(-1).any()  # an all-NaN tile


@pytest.mark.parametrize("backend", ["auto", "reference"])
@pytest.mark.parametrize("entry", ENTRIES, ids=lambda e: e["pages"] + ":" + e["layout"])
def test_propagate_reproduces_each_writer(entry, backend, monkeypatch):
    monkeypatch.setenv(dispatch.BACKEND_ENV, backend)
    x = TENSORS[entry["input"]]
    got = kb.encode(x, entry["layout"], page_size=entry["page_size"], dialect=entry["dialect"], nonfinite="propagate")
    assert torch.equal(got, TENSORS[entry["pages"]]), entry["writer"]
    with pytest.raises(NonFiniteError, match="or 'propagate' to store them"):  # the default stays "error"
        kb.encode(x, entry["layout"], page_size=entry["page_size"], dialect=entry["dialect"])


def test_propagate_tile_bytes_of_the_flashmla_dialect():
    """MODEL1: a NaN tile is scale 0xFF and codes 0x7F; an Inf tile scale 0xFF, signed zeros and 0x7F at the Inf."""
    lay = get_layout("flashmla-model1")
    x = torch.randn(1, 512, generator=torch.Generator().manual_seed(3))
    x[0, 5], x[0, 64], x[0, 65], x[0, 66] = float("nan"), float("inf"), -2.0, 0.0
    rec = lay.pages_to_records(kb.encode(x, lay, page_size=1, nonfinite="propagate"), 1)[0]
    assert rec[576:578].tolist() == [0xFF, 0xFF] and rec[578:583].tolist() == kb.encode(
        torch.nan_to_num(x, nan=0.0, posinf=0.0), lay, page_size=1)[0, 578:583].tolist()
    assert set(rec[:64].tolist()) == {0x7F}
    assert rec[64:67].tolist() == [0x7F, 0x80, 0x00] and set(rec[67:128].tolist()) <= {0x00, 0x80}
    finite = x.clone()
    finite[0, :128] = 1.0
    assert torch.equal(kb.encode(finite, lay, page_size=1, nonfinite="propagate"), kb.encode(finite, lay, page_size=1))


@pytest.mark.parametrize("backend", ["auto", "reference"])
@pytest.mark.parametrize("case", TRANSCODES, ids=lambda c: c["dst"])
def test_transcode_propagate_gives_the_destination_writers_bytes(case, backend, monkeypatch):
    monkeypatch.setenv(dispatch.BACKEND_ENV, backend)
    src = TENSORS[case["src"]]
    got = kb.transcode(src, case["src_layout"], case["dst_layout"], src_page_size=case["src_page_size"],
                       dst_page_size=case["dst_page_size"], dialect=case["dialect"], nonfinite="propagate")
    assert torch.equal(got, TENSORS[case["dst"]]), case["writer"]
    with pytest.raises(NonFiniteError):  # the default stays "error"
        kb.transcode(src, case["src_layout"], case["dst_layout"], src_page_size=case["src_page_size"])


def test_transcode_propagate_byte_move_keeps_the_codes_and_refuses_report():
    src = TENSORS["p64.flashmla"]
    with pytest.raises(NonFiniteError):
        kb.transcode(src, "flashmla-model1", "trtllm-fp8-ds-mla", src_page_size=64)
    moved = kb.transcode(src, "flashmla-model1", "trtllm-fp8-ds-mla", src_page_size=64, nonfinite="propagate")
    back = kb.transcode(moved, "trtllm-fp8-ds-mla", "flashmla-model1", src_page_size=64, nonfinite="propagate")
    assert torch.equal(back, src)
    with pytest.raises(InputError, match="report=True"):
        kb.transcode(src, "flashmla-model1", "v41-fp8", src_page_size=64, nonfinite="propagate", report=True)


@pytest.mark.parametrize(("layout", "dialect"), [("flashmla-model1", "amax-1e-4"), ("trtllm-fp8-ds-mla", "amax-1e-8"),
                                                 ("v41-fp8", "amax-1e-4"), ("trtllm-fp8", None), ("model1-fnuz", None)])
def test_propagate_is_refused_where_the_writer_is_not_established(layout, dialect):
    x = torch.zeros(2, 512)
    with pytest.raises(InputError, match="nonfinite='propagate' is not available"):
        kb.encode(x, layout, page_size=2, dialect=dialect, nonfinite="propagate")
    with pytest.raises(InputError, match="nonfinite='propagate' is not available"):
        kb.transcode(kb.encode(x, "v41-fp4", page_size=2), "v41-fp4", layout, src_page_size=2, dialect=dialect,
                     nonfinite="propagate")


@pytest.mark.parametrize("bad", ["Propagate", "keep", 1, None])
def test_bad_nonfinite_names_raise_input_error(bad):
    x = torch.zeros(1, 512)
    with pytest.raises(InputError, match="nonfinite must be one of error, zero, saturate, propagate"):
        kb.encode(x, "flashmla-model1", page_size=1, nonfinite=bad)
    pages = kb.encode(x, "flashmla-model1", page_size=1)
    with pytest.raises(InputError, match="nonfinite must be one of error, propagate"):
        kb.transcode(pages, "flashmla-model1", "v41-fp8", src_page_size=1, nonfinite=bad)
    with pytest.raises(InputError, match="nonfinite must be one of error, propagate"):
        kb.transcode(pages, "flashmla-model1", "v41-fp8", src_page_size=1, nonfinite="zero")


@pytest.mark.parametrize("case", TRANSCODES, ids=lambda c: c["dst"])
def test_transcode_slots_propagate_writes_the_destination_writers_records(case):
    src_lay, dst_lay = get_layout(case["src_layout"]), get_layout(case["dst_layout"])
    src, want = TENSORS[case["src"]], TENSORS[case["dst"]]
    src_slots = torch.randperm(64, generator=torch.Generator().manual_seed(8))[:40]
    dst_slots = torch.arange(40) * 3 + 1  # a pool of 2 pages of 64
    dst = torch.full((2, dst_lay.page_bytes(64)), 0x5A, dtype=torch.uint8)
    with pytest.raises(NonFiniteError, match="nothing was written"):  # the default stays "error"
        kb.transcode_slots(src, src_lay, dst, dst_lay, src_page_size=64, dst_page_size=64, src_slots=src_slots,
                           dst_slots=dst_slots, dialect=case["dialect"])
    assert bool((dst == 0x5A).all())
    kb.transcode_slots(src, src_lay, dst, dst_lay, src_page_size=64, dst_page_size=64, src_slots=src_slots,
                       dst_slots=dst_slots, dialect=case["dialect"], nonfinite="propagate")
    got = dst_lay.pages_to_records(dst, 64)[dst_slots]
    assert torch.equal(got, dst_lay.pages_to_records(want, 64)[src_slots])
    with pytest.raises(InputError, match="nonfinite must be one of error, propagate"):
        kb.transcode_slots(src, src_lay, dst, dst_lay, src_page_size=64, dst_page_size=64, src_slots=src_slots,
                           dst_slots=dst_slots, nonfinite="zero")
