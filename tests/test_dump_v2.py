"""Dump data checksums (versions 2 and 3) and the streaming paths: determinism, version 1, bounded-memory
conversion and statistics, output checks before work, locking, interruption, a changing input.
The header checksum of version 3 is tested in test_dump_v3.py."""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from safetensors.torch import save_file

import kvbridge as kb
from cli.main import cli
from kvbridge.dumps import convert as convert_mod
from kvbridge.dumps import dumpfile as dump_mod
from kvbridge.dumps.convert import convert_dump
from kvbridge.dumps.dumpfile import DumpEntry, open_dump, read_dump
from kvbridge.dumps.stats import dump_stats, entry_stats
from kvbridge.dumps.writer import DumpWriter, EntrySpec, partial_path, write_dump
from kvbridge.errors import DumpFormatError, DumpWriteError, InputError, NonFiniteError
from tests.dump_helpers import signed_dump


def latents(n: int, seed: int = 0, scale: float = 3.0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(n, 512, generator=g) * scale).bfloat16()


def entries(n: int = 300) -> list[DumpEntry]:
    x, k = latents(n), min(n, 77)
    return [
        DumpEntry(0, "swa", kb.encode(x, "trtllm-fp8", page_size=64), "trtllm-fp8", 64, n, 1.0, "swa"),
        DumpEntry(1, "compress", kb.encode(x[:k], "model1", page_size=8), "model1", 8, k, dialect="flashmla"),
        DumpEntry(2, "kv", x[:9].clone()),
    ]


def header_of(path: Path) -> dict:
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    return json.loads(raw[8 : 8 + n])


@pytest.fixture
def small_chunks(monkeypatch):
    """Stream in chunks of 16 KiB so that small entries take many chunks."""
    monkeypatch.setattr(dump_mod, "CHUNK_BYTES", 16 * 2**10)


def test_header_carries_a_crc32_per_tensor(tmp_path: Path):
    path = write_dump(tmp_path / "d.safetensors", entries())
    meta = header_of(path)["__metadata__"]
    assert meta["version"] == "3"
    listed = json.loads(meta["entries"])
    import zlib

    for e, m in zip(entries(), listed, strict=True):
        assert m["crc32"] == f"{zlib.crc32(e.data.contiguous().view(torch.uint8).numpy()):08x}"
    dump = read_dump(path)
    assert dump.version == 3 and set(dump.checksums) == {"layer.0.swa", "layer.1.compress", "layer.2.kv"}


def test_flipped_data_byte_names_the_entry(tmp_path: Path):
    path = write_dump(tmp_path / "d.safetensors", entries())
    info = next(i for i in open_dump(path).entries if i.name == "layer.1.compress")
    raw = bytearray(path.read_bytes())
    raw[info.offset + 1000] ^= 0x01  # one bit of one nope byte: still a valid E4M3 code
    path.write_bytes(bytes(raw))
    for action in (lambda: read_dump(path), lambda: dump_stats(open_dump(path)),
                   lambda: convert_dump(path, tmp_path / "o.safetensors", "trtllm-fp8-ds-mla", page_size=8)):
        with pytest.raises(DumpFormatError, match=r"entry layer\.1\.compress: checksum mismatch"):
            action()
    assert not (tmp_path / "o.safetensors").exists()


def test_same_content_gives_the_same_bytes(tmp_path: Path):
    a = write_dump(tmp_path / "a.safetensors", entries(), attrs={"z": "1", "a": "2"})
    b = write_dump(tmp_path / "b.safetensors", entries(), attrs={"a": "2", "z": "1"})
    assert a.read_bytes() == b.read_bytes()
    c = convert_dump(a, tmp_path / "c.safetensors", "model1", page_size=8)
    d = convert_dump(b, tmp_path / "d.safetensors", "model1", page_size=8)
    assert [x.report for x in c] == [x.report for x in d]
    assert (tmp_path / "c.safetensors").read_bytes() == (tmp_path / "d.safetensors").read_bytes()


def test_version_1_files_still_read_and_say_they_have_no_checksum(tmp_path: Path):
    es = entries()
    meta = {"format": "kvbridge-dump", "version": "1", "entries": json.dumps([e.metadata() for e in es])}
    path = tmp_path / "v1.safetensors"
    save_file({e.name: e.data.contiguous() for e in es}, str(path), metadata=meta)
    dump = read_dump(path)
    assert dump.version == 1 and dump.checksums == {} and dump.header_verified is False
    for got, want in zip(dump, es, strict=True):
        assert torch.equal(got.data, want.data)
    assert {s["checksum"] for s in dump_stats(open_dump(path))} == {None}
    convert_dump(path, tmp_path / "v3.safetensors", "model1", page_size=8)
    assert read_dump(tmp_path / "v3.safetensors").version == 3


def test_streamed_conversion_equals_whole_entry_conversion(tmp_path: Path, small_chunks):
    src = write_dump(tmp_path / "src.safetensors", entries(1000))
    for to, kwargs in (("model1", {"page_size": 64}), ("trtllm-fp8", {"page_size": 256, "scale": "auto"}),
                       ("trtllm-fp8-ds-mla", {"page_size": 24}), ("model1", {"page_size": 8, "report": False})):
        out = tmp_path / f"{to}.safetensors"
        got = convert_dump(src, out, to, overwrite=True, **kwargs)
        want = [convert_mod.convert_entry(e, to, page_size=kwargs["page_size"], scale=kwargs.get("scale"))
                for e in read_dump(src)]
        for g, (entry, rep), e in zip(got, want, read_dump(out), strict=True):
            assert torch.equal(e.data, entry.data), (to, e.name)
            assert (e.scale, e.dialect) == (entry.scale, entry.dialect)
            if kwargs.get("report", True):
                assert g.report.lossless == rep.lossless and g.report.saturated == rep.saturated
                assert g.report.max_abs_error == rep.max_abs_error
                assert g.report.rms_error == pytest.approx(rep.rms_error, rel=1e-6)  # fp64 vs fp32 sums
            else:
                assert g.report is None


def test_streamed_statistics_equal_whole_entry_statistics(tmp_path: Path, small_chunks):
    src = write_dump(tmp_path / "src.safetensors", entries(1000))
    streamed = dump_stats(open_dump(src))
    for s, e in zip(streamed, read_dump(src), strict=True):
        whole = entry_stats(e)
        assert s.pop("checksum") == "ok"
        assert s == whole


def test_auto_scale_keeps_a_lossless_byte_move(tmp_path: Path):
    x = latents(100, scale=40.0)  # |x| > 448 in places: a re-encode at amax/448 would round
    pages = kb.encode(x, "trtllm-fp8", page_size=64, scale=1.0)
    src = write_dump(tmp_path / "s.safetensors", [DumpEntry(0, "swa", pages, "trtllm-fp8", 64, 100, 1.0, "swa")])
    rep = convert_dump(src, tmp_path / "o.safetensors", "trtllm-fp8", scale="auto")[0].report
    assert rep.lossless and rep.byte_move and rep.dst_scale == 1.0
    assert torch.equal(read_dump(tmp_path / "o.safetensors")["layer.0.swa"].data, pages)


def test_auto_scale_keeps_a_lossless_round_trip_through_model1(tmp_path: Path, small_chunks):
    """TensorRT-LLM FP8 at s = 1 -> MODEL1 is lossless; back with --scale auto must be too (not amax/448)."""
    x = latents(700, scale=2.0)
    pages = kb.encode(x, "trtllm-fp8", page_size=64, scale=1.0)
    src = write_dump(tmp_path / "s.safetensors", [DumpEntry(0, "swa", pages, "trtllm-fp8", 64, 700, 1.0, "swa")])
    assert convert_dump(src, tmp_path / "m1.safetensors", "model1")[0].report.lossless
    rep = convert_dump(tmp_path / "m1.safetensors", tmp_path / "back.safetensors", "trtllm-fp8", scale="auto")[0]
    assert rep.report.lossless and rep.report.dst_scale == 1.0
    assert torch.equal(read_dump(tmp_path / "back.safetensors")["layer.0.swa"].data, pages)
    lossy = write_dump(tmp_path / "big.safetensors", [DumpEntry(0, "kv", latents(700, scale=900.0))])
    rep = convert_dump(lossy, tmp_path / "big.out", "trtllm-fp8", page_size=64, scale="auto")[0].report
    assert rep.dst_scale > 1.0 and rep.saturated == 0  # s = 1 would saturate: amax / 448


def test_nonfinite_in_a_byte_move_is_refused_naming_entry_and_token(tmp_path: Path, small_chunks):
    es = entries(1000)
    pages = es[1].data.clone()
    lay = kb.get_layout("model1")
    pages[5, lay.field_offset("rope", 3, 8) + 1] = 0x7F  # token 43: a bf16 +Inf / NaN exponent
    pages[5, lay.field_offset("rope", 3, 8)] = 0x80
    bad = DumpEntry(1, "compress", pages, "model1", 8, 77, dialect="flashmla")
    src = write_dump(tmp_path / "nan.safetensors", [es[0], bad])
    for to in ("trtllm-fp8-ds-mla", "model1"):  # a re-paging byte move and a layout byte move
        with pytest.raises(NonFiniteError, match=r"entry layer\.1\.compress: 1 non-finite value\(s\).*token 43"):
            convert_dump(src, tmp_path / "o.safetensors", to, page_size=16)
    with pytest.raises(NonFiniteError, match=r"entry layer\.1\.compress: .* token 43, dim 4\d\d"):
        convert_dump(src, tmp_path / "o.safetensors", "trtllm-fp8")  # re-encoded: the decoded value
    assert sorted(p.name for p in tmp_path.iterdir()) == ["nan.safetensors"]


def test_inspect_counts_what_convert_refuses(tmp_path: Path):
    x = torch.full((4, 512), 448.0)
    pages = kb.encode(x, "trtllm-fp8", page_size=4)
    huge = DumpEntry(0, "swa", pages, "trtllm-fp8", 4, 4, scale=3e38, dialect="swa")  # 448 * 3e38 overflows fp32
    src = write_dump(tmp_path / "huge.safetensors", [huge])
    stats = dump_stats(open_dump(src))[0]
    assert stats["nonfinite_values"] == 4 * 512 and stats["nan"] == {"e4m3": 0}
    with pytest.raises(NonFiniteError, match=r"entry layer\.0\.swa: 2048 non-finite"):
        convert_dump(src, tmp_path / "o.safetensors", "model1")


def test_output_checks_run_before_any_work(tmp_path: Path, monkeypatch):
    src = write_dump(tmp_path / "s.safetensors", entries())
    work = []
    monkeypatch.setattr(convert_mod._Converter, "run", lambda self: work.append(1))
    with pytest.raises(InputError, match="does not exist"):
        convert_dump(src, tmp_path / "missing" / "o.safetensors", "model1", page_size=8)
    with pytest.raises(InputError, match="is a directory"):
        convert_dump(src, tmp_path, "model1", page_size=8)
    monkeypatch.setattr(os, "statvfs", lambda p: os.statvfs_result((4096, 4096, 10, 1, 1, 10, 0, 0, 0, 255)))
    with pytest.raises(DumpWriteError, match=r"not enough space .* needs \d+ bytes, 4096 are free"):
        convert_dump(src, tmp_path / "o.safetensors", "model1", page_size=8)
    assert work == [] and sorted(p.name for p in tmp_path.iterdir()) == ["s.safetensors"]


@pytest.mark.skipif(not Path("/sys/kernel").is_dir(), reason="needs /sys")
def test_unwritable_output_names_the_output_not_a_temp_path():
    with pytest.raises(DumpWriteError) as info:
        write_dump("/sys/kernel/kvbridge-test.safetensors", entries(10))
    assert "kvbridge-test.safetensors" in str(info.value) and "partial" not in str(info.value)


def test_two_writers_of_one_output_exactly_one_wins(tmp_path: Path):
    out = tmp_path / "o.safetensors"
    spec = EntrySpec({"name": "layer.0.kv", "layer": 0, "role": "kv", "kind": "latents", "num_tokens": 1},
                     "F32", (1, 512))
    first = DumpWriter(out, reserve=4096)
    with pytest.raises(DumpWriteError, match="another kvbridge process is writing"):
        DumpWriter(out)  # fails before writing anything
    first.begin([spec])
    first.write(torch.zeros(1, 512))
    first.commit()
    with pytest.raises(InputError, match="exists"):
        DumpWriter(out)
    assert read_dump(out).names == ["layer.0.kv"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["o.safetensors"]


def test_stale_temp_file_of_a_killed_writer_is_taken_over(tmp_path: Path):
    out = tmp_path / "o.safetensors"
    partial_path(out).write_bytes(b"half a dump from a SIGKILLed convert")
    assert partial_path(out).name == ".o.safetensors.kvbridge-partial"
    write_dump(out, entries(10))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["o.safetensors"]


def test_interrupt_leaves_no_temp_file_and_no_output(tmp_path: Path, small_chunks):
    src = write_dump(tmp_path / "s.safetensors", entries(1000))
    seen = []

    def interrupt(done: int, total: int) -> None:
        seen.append(done)
        if len(seen) == 3:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        convert_dump(src, tmp_path / "o.safetensors", "model1", page_size=8, on_progress=interrupt)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["s.safetensors"]


def test_input_truncated_during_convert_is_an_error_not_sigbus(tmp_path: Path, small_chunks):
    src = write_dump(tmp_path / "s.safetensors", entries(1000))
    size = src.stat().st_size

    def truncate(done: int, total: int) -> None:
        if done > 100_000 and src.stat().st_size == size:
            os.truncate(src, size // 2)

    with pytest.raises(DumpFormatError, match="changed while being read"):
        convert_dump(src, tmp_path / "o.safetensors", "model1", page_size=8, on_progress=truncate)
    assert not (tmp_path / "o.safetensors").exists()


def test_progress_counts_bytes_read_and_written(tmp_path: Path, small_chunks):
    src = write_dump(tmp_path / "s.safetensors", entries(1000))
    calls: list[tuple[int, int]] = []
    convert_dump(src, tmp_path / "o.safetensors", "model1", page_size=8,
                 on_progress=lambda d, t: calls.append((d, t)))
    total = calls[-1][1]
    data_in = open_dump(src).data_bytes
    data_out = open_dump(tmp_path / "o.safetensors").data_bytes
    assert total == data_in + data_out and calls[-1][0] == total
    assert len(calls) > 20 and all(b[0] >= a[0] for a, b in zip(calls, calls[1:], strict=False))


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda m: m.update(version="[1]"), "unsupported dump version"),
        (lambda m: m.update(entries="null"), "JSON list of objects"),
        (lambda m: m.update(entries="9" * 5000), "not valid JSON"),
        (lambda m: m.update(entries=m["entries"].replace('"scale":1.0', '"scale":1e400')), "positive finite fp32"),
        (lambda m: m.update(entries=m["entries"].replace('"layer":0', '"layer":' + "7" * 4000)), r"\.\.\."),
    ],
)
def test_crafted_headers_raise_dump_format_errors(tmp_path: Path, change, message: str):
    """Crafted values behind a matching header checksum (re-signed) are still validated field by field."""
    path = write_dump(tmp_path / "d.safetensors", entries(10))
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + n])
    change(header["__metadata__"])
    path.write_bytes(signed_dump(header, raw[8 + n :]))
    with pytest.raises(DumpFormatError, match=message) as info:
        read_dump(path)
    assert len(str(info.value)) < 400


def test_crafted_tensor_shape_of_strings(tmp_path: Path):
    path = write_dump(tmp_path / "d.safetensors", entries(10))
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + n])
    header["layer.0.swa"]["shape"] = ["1", "x"]
    path.write_bytes(signed_dump(header, raw[8 + n :]))
    with pytest.raises(DumpFormatError, match="malformed safetensors header entry for tensor 'layer.0.swa'"):
        read_dump(path)


def test_write_dump_refuses_a_tensor_and_a_directory(tmp_path: Path):
    with pytest.raises(InputError, match="entries must be"):
        write_dump(tmp_path / "x.safetensors", torch.zeros(3, 512))
    with pytest.raises(InputError, match="is a directory"):
        write_dump(tmp_path, entries(10))


def test_convert_report_equals_transcode_report_note_included(tmp_path: Path):
    x = latents(300)
    pages = kb.encode(x, "model1", page_size=64)
    src = write_dump(tmp_path / "m1.safetensors", [DumpEntry(0, "swa", pages, "flashmla-model1", 64, 300)])
    for to, args in (("v41-fp4", ()), ("trtllm-fp8", ("--scale", "0.05")), ("trtllm-fp8-ds-mla", ())):
        out = tmp_path / f"{to}.safetensors"
        result = CliRunner().invoke(cli, ["convert", str(src), str(out), "--to", to, "--json", *args])
        assert result.exit_code == 0, result.output
        got = json.loads(result.output)["entries"][0]
        assert got.pop("name") == "layer.0.swa"
        scale = {"dst_scale": 0.05} if args else {}
        _, want = kb.transcode(pages, "flashmla-model1", to, src_page_size=64, num_tokens=300, report=True, **scale)
        assert got == want.to_dict(), to
        assert (want.note != "") == (not want.lossless), to  # the layout's loss note, where anything was lost
