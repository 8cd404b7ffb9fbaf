"""Dump files: round trip, validation of every header field, atomic writes, conversion, statistics."""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

import kvbridge
from kvbridge.dumps.convert import convert_dump
from kvbridge.dumps.dumpfile import FORMAT_NAME, DumpEntry, read_dump
from kvbridge.dumps.stats import entry_stats
from kvbridge.dumps.writer import write_dump
from kvbridge.errors import DumpFormatError, InputError


def latents(n: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(n, 512, generator=g) * 3).bfloat16()


def trtllm_entry(layer: int = 0, role: str = "swa", n: int = 200, page_size: int = 64, scale: float = 1.0):
    pages = kvbridge.encode(latents(n, layer), "trtllm-fp8", page_size=page_size, scale=scale)
    return DumpEntry(layer, role, pages, "trtllm-fp8", page_size, n, scale=scale, dialect="swa")


def model1_entry(layer: int = 1, role: str = "compress", n: int = 50, page_size: int = 2):
    pages = kvbridge.encode(latents(n, layer), "flashmla-model1", page_size=page_size)
    return DumpEntry(layer, role, pages, "model1", page_size, n, dialect="flashmla", compress_ratio=4)


def sample_dump() -> list[DumpEntry]:
    return [trtllm_entry(), model1_entry(), DumpEntry(2, "kv", latents(7, 2).float())]


def test_round_trip_keeps_every_tensor_and_field(tmp_path: Path):
    path = write_dump(tmp_path / "req.safetensors", sample_dump(), attrs={"model": "DeepSeek-V4-Flash"})
    dump = read_dump(path)
    assert dump.names == ["layer.0.swa", "layer.1.compress", "layer.2.kv"]
    assert dump.attrs["model"] == "DeepSeek-V4-Flash"
    for want, got in zip(sample_dump(), dump, strict=True):
        assert got.metadata() == want.metadata()
        assert got.data.dtype == want.data.dtype
        assert torch.equal(got.data, want.data)
    assert dump["layer.1.compress"].layout == "flashmla-model1"  # alias resolved to the canonical name
    assert not list(tmp_path.glob(".*.tmp")), "temp file left behind"
    umask = os.umask(0o022)
    os.umask(umask)
    assert path.stat().st_mode & 0o777 == 0o666 & ~umask  # not mkstemp's private 0600


def test_entries_sharing_memory_are_written_separately(tmp_path: Path):
    pool = trtllm_entry(n=256).data  # 4 pages of 64 tokens; entries are views of it
    entries = [DumpEntry(i, "swa", pool[2 * i : 2 * i + 2], "trtllm-fp8", 64) for i in range(2)]
    entries.append(DumpEntry(2, "swa", pool, "trtllm-fp8", 64))
    dump = read_dump(write_dump(tmp_path / "views.safetensors", entries))
    assert torch.equal(dump["layer.1.swa"].data, pool[2:4]) and torch.equal(dump["layer.2.swa"].data, pool)


def test_latents_decode_each_entry_exactly(tmp_path: Path):
    dump = read_dump(write_dump(tmp_path / "d.safetensors", sample_dump()))
    values = dump.latents()
    e = dump["layer.0.swa"]
    want = kvbridge.decode(e.data, "trtllm-fp8", page_size=64, num_tokens=200, scale=1.0)
    assert torch.equal(values["layer.0.swa"], want)
    assert values["layer.1.compress"].shape == (50, 512)
    assert torch.equal(values["layer.2.kv"], latents(7, 2).float())


def test_scale_is_kept_as_its_fp32_value(tmp_path: Path):
    entry = trtllm_entry(scale=0.037)
    assert entry.scale == float(torch.tensor(0.037, dtype=torch.float32)) != 0.037
    assert read_dump(write_dump(tmp_path / "s.safetensors", [entry]))["layer.0.swa"].scale == entry.scale


def test_write_refuses_existing_file_unless_overwrite(tmp_path: Path):
    path = tmp_path / "d.safetensors"
    write_dump(path, [trtllm_entry()])
    before = path.read_bytes()
    with pytest.raises(InputError, match="exists"):
        write_dump(path, [model1_entry()])
    assert path.read_bytes() == before
    write_dump(path, [model1_entry()], overwrite=True)
    assert read_dump(path).names == ["layer.1.compress"]


def test_write_rejects_duplicate_entries_and_reserved_attrs(tmp_path: Path):
    with pytest.raises(InputError, match="appears twice"):
        write_dump(tmp_path / "a", [trtllm_entry(), trtllm_entry()])
    with pytest.raises(InputError, match="attrs"):
        write_dump(tmp_path / "b", [trtllm_entry()], attrs={"version": "2"})
    assert not list(tmp_path.iterdir())


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"page_size": 32}, "rows are"),
        ({"num_tokens": 10_000}, "does not fit"),
        ({"scale": -1.0}, "positive finite"),
        ({"scale": float("inf")}, "positive finite"),
        ({"dialect": "flashmla"}, "does not apply"),
        ({"role": "Bad Role"}, "role must match"),
        ({"layer": -1}, "layer must be"),
    ],
)
def test_entry_construction_validates(kwargs: dict, message: str):
    args = {"layer": 0, "role": "swa", "data": trtllm_entry().data, "layout": "trtllm-fp8", "page_size": 64}
    with pytest.raises(InputError, match=message):
        DumpEntry(**{**args, **kwargs})


def test_entry_rejects_scale_on_per_tile_layout_bad_dtype_and_unknown_layout():
    with pytest.raises(kvbridge.LayoutError, match="unknown layout 'nope-layout'"):
        DumpEntry(0, "swa", model1_entry().data, "nope-layout", 2)
    with pytest.raises(InputError, match="scale must be null"):
        DumpEntry(0, "swa", model1_entry().data, "flashmla-model1", 2, scale=1.0)
    with pytest.raises(InputError, match="uint8"):
        DumpEntry(0, "swa", torch.zeros(2, 4, dtype=torch.int32))
    with pytest.raises(InputError, match="latents shape"):
        DumpEntry(0, "kv", torch.zeros(3, 448))


def write_raw(path: Path, tensors: dict[str, torch.Tensor], meta: dict[str, str] | None) -> Path:
    """A safetensors file written directly, bypassing kvbridge's validation."""
    save_file(tensors, str(path), metadata=meta)
    return path


def good_header(entries: list[DumpEntry]) -> tuple[dict[str, torch.Tensor], dict[str, str], list[dict]]:
    tensors = {e.name: e.data.contiguous() for e in entries}
    metas = [e.metadata() for e in entries]
    return tensors, {"format": FORMAT_NAME, "version": "1"}, metas


def corrupt(tmp_path: Path, change) -> Path:
    tensors, meta, metas = good_header([trtllm_entry(), model1_entry()])
    change(tensors, meta, metas)
    meta = {"entries": json.dumps(metas), **meta}
    return write_raw(tmp_path / "bad.safetensors", tensors, meta)


def _set(i: int, **kv):
    def change(tensors, meta, metas):
        metas[i].update(kv)

    return change


HEADER_CASES = [
    ("wrong format", lambda t, m, e: m.update(format="other-tool"), "not a kvbridge dump"),
    ("unknown version", lambda t, m, e: m.update(version="7"), "unsupported dump version '7'"),
    ("no version", lambda t, m, e: m.pop("version"), "no 'version'"),
    ("page size", _set(0, page_size=32), "rows are 32768 bytes"),
    ("tokens", _set(0, num_tokens=257), "num_tokens=257 does not fit in 4 pages of 64 tokens"),
    ("zero scale", _set(0, scale=0.0), "positive finite"),
    ("missing scale", _set(0, scale=None), "needs a per-tensor scale"),
    ("scale on MODEL1", _set(1, scale=2.0), "scale must be null"),
    ("bad dialect", _set(1, dialect="swa"), "dialect 'swa' does not apply"),
    ("unknown layout", _set(1, layout="model9"), "unknown layout 'model9'"),
    ("unknown key", _set(0, colour="red"), "unknown key"),
    ("name mismatch", _set(0, layer=5), "does not match layer 5"),
    ("kind", _set(0, kind="blob"), "kind must be one of"),
    ("missing key", lambda t, m, e: e[0].pop("num_tokens"), "missing required key"),
    ("tensor not listed", lambda t, m, e: e.pop(), "tensor 'layer.1.compress' is not listed"),
    ("listed twice", lambda t, m, e: e.append(dict(e[0])), "listed twice"),
    ("listed, absent", lambda t, m, e: t.pop("layer.1.compress"), "has no such tensor"),
    ("pages dtype", lambda t, m, e: t.update({"layer.0.swa": t["layer.0.swa"].to(torch.int16)}), "must be uint8"),
    ("entries not JSON", lambda t, m, e: m.update(entries="[{"), "not valid JSON"),
    ("entries not a list", lambda t, m, e: m.update(entries='{"a": 1}'), "JSON list of objects"),
]


@pytest.mark.parametrize(("what", "change", "message"), HEADER_CASES, ids=[c[0] for c in HEADER_CASES])
def test_read_rejects_inconsistent_header(tmp_path: Path, what: str, change, message: str):
    path = corrupt(tmp_path, change)
    with pytest.raises(DumpFormatError, match=message) as info:
        read_dump(path)
    assert "\n" not in str(info.value)
    assert str(path) in str(info.value)


def test_read_rejects_foreign_and_truncated_files(tmp_path: Path):
    good = write_dump(tmp_path / "good.safetensors", [trtllm_entry()])
    raw = good.read_bytes()
    cases = {
        "text.safetensors": (b"this is not a dump at all, just some text\n" * 4, "not a safetensors file"),
        "tiny.safetensors": (b"abc", "only 3 bytes"),
        "cut-data.safetensors": (raw[:-100], "truncated: header promises"),
        "cut-header.safetensors": (raw[:40], "header does not fit in the file's 40 bytes"),
        "trailing.safetensors": (raw + b"\0" * 5, "5 unexpected trailing bytes"),
        "bad-json.safetensors": (struct.pack("<Q", 4) + b"{{{{", "header is not JSON"),
    }
    for name, (data, message) in cases.items():
        (tmp_path / name).write_bytes(data)
        with pytest.raises(DumpFormatError, match=message):
            read_dump(tmp_path / name)
    plain = write_raw(tmp_path / "plain.safetensors", {"w": torch.zeros(3)}, None)
    with pytest.raises(DumpFormatError, match="without the kvbridge header"):
        read_dump(plain)
    with pytest.raises(DumpFormatError, match="no such file"):
        read_dump(tmp_path / "missing.safetensors")


def test_convert_trtllm_to_model1_and_back_is_byte_exact(tmp_path: Path):
    src = write_dump(tmp_path / "trt.safetensors", [trtllm_entry(0), trtllm_entry(2, "compress", n=50, page_size=32)])
    reports = convert_dump(src, tmp_path / "m1.safetensors", "flashmla-model1", page_size=64)
    assert [r.name for r in reports] == ["layer.0.swa", "layer.2.compress"]
    assert all(r.report.lossless for r in reports)  # E4M3 at s=1 fits MODEL1's tiles exactly
    m1 = read_dump(tmp_path / "m1.safetensors")
    assert {e.layout for e in m1} == {"flashmla-model1"} and {e.page_size for e in m1} == {64}
    assert {e.dialect for e in m1} == {"flashmla"} and {e.scale for e in m1} == {None}
    convert_dump(tmp_path / "m1.safetensors", tmp_path / "back.safetensors", "trtllm-fp8", page_size=64, scale=1.0)
    back, orig = read_dump(tmp_path / "back.safetensors"), read_dump(src)
    assert torch.equal(back["layer.0.swa"].data, orig["layer.0.swa"].data)
    assert torch.equal(back["layer.2.compress"].latents(), orig["layer.2.compress"].latents())


def test_convert_byte_move_keeps_dialect_and_reports_lossless(tmp_path: Path):
    src = write_dump(tmp_path / "m1.safetensors", [model1_entry()])
    reports = convert_dump(src, tmp_path / "ds.safetensors", "trtllm-fp8-ds-mla")
    assert reports[0].report.byte_move and reports[0].report.lossless
    out = read_dump(tmp_path / "ds.safetensors")["layer.1.compress"]
    assert out.dialect == "flashmla" and out.compress_ratio == 4
    lay_in, lay_out = kvbridge.get_layout("flashmla-model1"), kvbridge.get_layout("trtllm-fp8-ds-mla")
    assert torch.equal(lay_out.pages_to_records(out.data, 2, 50), lay_in.pages_to_records(model1_entry().data, 2, 50))


def test_convert_lossy_direction_reports_loss_and_auto_scale(tmp_path: Path):
    x = latents(64) * 100  # |x| up to ~1500: saturates trtllm-fp8 at s=1
    src = write_dump(
        tmp_path / "m1.safetensors", [DumpEntry(0, "swa", kvbridge.encode(x, "model1", page_size=64), "model1", 64)]
    )
    rep = convert_dump(src, tmp_path / "s1.safetensors", "trtllm-fp8", scale=1.0)[0].report
    assert not rep.lossless and rep.saturated > 0
    auto = convert_dump(src, tmp_path / "auto.safetensors", "trtllm-fp8", scale="auto")[0].report
    assert auto.saturated == 0 and auto.dst_scale > 1.0
    assert read_dump(tmp_path / "auto.safetensors")["layer.0.swa"].scale == auto.dst_scale


def test_convert_latents_needs_page_size_and_encodes(tmp_path: Path):
    src = write_dump(tmp_path / "lat.safetensors", [DumpEntry(0, "kv", latents(10))])
    with pytest.raises(InputError, match="page_size is needed"):
        convert_dump(src, tmp_path / "out.safetensors", "model1")
    assert not (tmp_path / "out.safetensors").exists()
    rep = convert_dump(src, tmp_path / "out.safetensors", "model1", page_size=4)[0].report
    assert rep.src_layout == "latents" and rep.rope_max_abs_error == 0.0  # bf16 rope is stored as is
    out = read_dump(tmp_path / "out.safetensors")["layer.0.kv"]
    assert torch.equal(out.data, kvbridge.encode(latents(10), "model1", page_size=4))


def test_failed_convert_leaves_no_output(tmp_path: Path):
    entry = trtllm_entry()
    pages = entry.data.clone()
    pages[1, 7] = 0x7F  # an E4M3 NaN: the transcode refuses it
    src = write_dump(tmp_path / "nan.safetensors", [DumpEntry(0, "swa", pages, "trtllm-fp8", 64, 200)])
    with pytest.raises(kvbridge.NonFiniteError):
        convert_dump(src, tmp_path / "out.safetensors", "model1")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["nan.safetensors"]


def test_stats_count_nan_saturation_and_scale_exponents():
    x = torch.zeros(3, 512)
    x[0, :64] = 1.75  # tile amax 448 * 2^-8 -> exponent -8, every value stored as code 448
    x[1, 448] = float("nan")
    m1 = kvbridge.encode(x, "model1", page_size=4, nonfinite="zero")
    lay = kvbridge.get_layout("model1")
    m1[0, lay.field_offset("rope", 1, 4)] = 0xC0  # bf16 bytes 0xC0 0x7F: NaN
    m1[0, lay.field_offset("rope", 1, 4) + 1] = 0x7F
    m1[0, lay.field_offset("nope", 2, 4)] = 0xFF
    m1[0, lay.field_offset("scale", 2, 4)] = 0xFF
    stats = entry_stats(DumpEntry(0, "swa", m1, "model1", 4, 3))
    assert stats["nan"] == {"e4m3": 1, "bf16": 1, "ue8m0": 1}
    assert stats["saturated"] is None  # per-tile: a tile's max is stored at 448 by design, not clipped
    assert stats["e4m3_at_max"] == 64
    assert stats["scale_exponents"] == {-8: 1, -13: 3 * 7 - 2}
    assert stats["num_pages"] == 1 and stats["num_tokens"] == 3
    big = torch.full((2, 512), 1000.0)
    fp8 = entry_stats(DumpEntry(0, "swa", kvbridge.encode(big, "trtllm-fp8", page_size=2), "trtllm-fp8", 2))
    assert fp8["saturated"] == 1024 and fp8["scale_exponents"] is None and fp8["abs_max"] == 448.0


def test_empty_dump_and_zero_token_entries(tmp_path: Path):
    assert read_dump(write_dump(tmp_path / "empty.safetensors", [])).names == []
    empty_pool = DumpEntry(0, "swa", torch.zeros(0, 37440, dtype=torch.uint8), "model1", 64, 0)
    unused_page = DumpEntry(1, "swa", torch.zeros(1, 37440, dtype=torch.uint8), "model1", 64, 0)
    src = write_dump(tmp_path / "zero.safetensors", [empty_pool, unused_page])
    stats = entry_stats(read_dump(src)["layer.0.swa"])
    assert (stats["num_pages"], stats["num_tokens"], stats["scale_exponents"]) == (0, 0, {})
    reports = convert_dump(src, tmp_path / "out.safetensors", "trtllm-fp8")
    assert all(r.report.num_tokens == 0 and r.report.lossless for r in reports)
    assert read_dump(tmp_path / "out.safetensors")["layer.1.swa"].latents().shape == (0, 512)
