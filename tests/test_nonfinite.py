"""The byte-level scan of stored codes: the numba kernels equal the torch reference on every layout
and geometry, count exactly and name the first bad token and field."""

from __future__ import annotations

import json

import pytest
import torch
from click.testing import CliRunner

import kvbridge as kb
from cli.main import cli
from kvbridge.dumps.dumpfile import DumpEntry
from kvbridge.dumps.writer import write_dump
from kvbridge.errors import NonFiniteError
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
