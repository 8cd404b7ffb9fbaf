"""Dump format version 3: the header's own checksum. An edited scale or layout, any flipped header
byte and a header cut short raise ``DumpHeaderError``; version 1 and 2 files still read, flagged
``header_verified = False`` (API, ``inspect``, ``convert``); ``convert`` writes version 3.
The files under ``fixtures/dumps/`` are described in fixtures/README.md."""

from __future__ import annotations

import json
import struct
import zlib
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

import kvbridge as kb
from cli.main import cli
from kvbridge.dumps.convert import convert_dump
from kvbridge.dumps.dumpfile import HEADER_CRC_OFFSET, HEADER_PREFIX, header_crc32, open_dump, read_dump
from kvbridge.dumps.stats import dump_stats
from kvbridge.dumps.writer import write_dump
from kvbridge.errors import DumpFormatError, DumpHeaderError, InputError

DUMPS = Path(__file__).resolve().parent.parent / "fixtures" / "dumps"
V2, V3, EDITED = DUMPS / "v2_dump.safetensors", DUMPS / "v3_dump.safetensors", DUMPS / "v3_scale_edited.safetensors"


def header_length(raw: bytes) -> int:
    return struct.unpack("<Q", raw[:8])[0]


def copy(tmp_path: Path, raw: bytes, name: str = "d.safetensors") -> Path:
    path = tmp_path / name
    path.write_bytes(raw)
    return path


def every_reader_refuses(path: Path, tmp_path: Path, match: str = "version-3 header fails its check") -> None:
    """``read_dump``, ``open_dump``, streamed statistics, ``convert_dump`` and the CLI's ``inspect`` and
    ``convert`` all refuse ``path`` with ``DumpHeaderError`` (CLI: one line, exit 1, no output)."""
    out = tmp_path / "out.safetensors"
    for action in (lambda: read_dump(path), lambda: open_dump(path).close(),
                   lambda: convert_dump(path, out, "model1", page_size=64)):
        with pytest.raises(DumpHeaderError, match=match):
            action()
    for args in (["inspect", str(path)], ["convert", str(path), str(out), "--to", "model1", "--page-size", "64"]):
        result = CliRunner().invoke(cli, args)
        lines = [line for line in result.stderr.splitlines() if line.strip()]
        assert result.exit_code == 1 and len(lines) == 1 and "header fails its check" in lines[0], result.stderr
    assert not out.exists() and not [p.name for p in tmp_path.iterdir() if p.name.endswith(".kvbridge-partial")]


def test_written_dumps_are_version_3_with_the_checksum_at_its_offset(tmp_path: Path):
    dump = read_dump(V2)
    path = write_dump(tmp_path / "d.safetensors", dump)
    raw = path.read_bytes()
    assert raw == V3.read_bytes()  # the version-3 bytes of the fixture's content are stable
    n = header_length(raw)
    assert raw[8:HEADER_CRC_OFFSET] == HEADER_PREFIX and raw[HEADER_CRC_OFFSET + 8 : HEADER_CRC_OFFSET + 9] == b'"'
    zeroed = raw[:HEADER_CRC_OFFSET] + b"0" * 8 + raw[HEADER_CRC_OFFSET + 8 : 8 + n]
    assert int(raw[HEADER_CRC_OFFSET : HEADER_CRC_OFFSET + 8], 16) == zlib.crc32(zeroed) == header_crc32(raw[: 8 + n])
    meta = json.loads(raw[8 : 8 + n])["__metadata__"]
    assert meta["version"] == "3" and next(iter(meta)) == "header_crc32"
    again = read_dump(path)
    assert again.version == 3 and again.header_verified is True and "header_crc32" not in again.attrs
    assert again.attrs == dump.attrs
    for a, b in zip(again, dump, strict=True):
        assert torch.equal(a.data, b.data) and a.metadata() == b.metadata()


def test_scale_edited_from_1_to_4_by_a_byte_edit_is_detected(tmp_path: Path):
    """The version-2 hole: ``"scale":1.0`` -> ``4.0`` in a real written file (every value x4)."""
    raw = write_dump(tmp_path / "w.safetensors", read_dump(V2)).read_bytes()
    old, new = b'\\"scale\\":1.0', b'\\"scale\\":4.0'
    assert raw.count(old) == 1
    edited = copy(tmp_path, raw.replace(old, new))
    (tmp_path / "w.safetensors").unlink()
    every_reader_refuses(edited, tmp_path, match=r"stored header_crc32 [0-9a-f]{8}, the header has [0-9a-f]{8}")
    assert EDITED.read_bytes() == V3.read_bytes().replace(old, new)  # the kept adversarial file is that edit
    with pytest.raises(DumpHeaderError, match="copy the file again from its source or write it anew"):
        read_dump(EDITED)


def test_every_flipped_header_byte_is_a_header_error(tmp_path: Path):
    """Each bit pattern 0x01, 0x80, 0xFF flipped at each header byte, the length prefix included."""
    raw = V3.read_bytes()
    for i in range(8 + header_length(raw)):
        for mask in (0x01, 0x80, 0xFF):
            buf = bytearray(raw)
            buf[i] ^= mask
            path = copy(tmp_path, bytes(buf))
            with pytest.raises(DumpHeaderError):
                open_dump(path).close()


def test_a_header_cut_short_is_a_header_error(tmp_path: Path):
    raw = V3.read_bytes()
    n = header_length(raw)
    for cut in range(8, 8 + n):
        with pytest.raises(DumpHeaderError):
            open_dump(copy(tmp_path, raw[:cut])).close()
    with pytest.raises(DumpFormatError, match="not a safetensors file"):
        open_dump(copy(tmp_path, raw[:7])).close()
    every_reader_refuses(copy(tmp_path, raw[: 8 + n // 2]), tmp_path, match="does not fit")


def rewritten(raw: bytes, change) -> bytes:
    """``raw`` with its JSON header parsed, changed by ``change(header)`` and written back (not re-signed)."""
    n = header_length(raw)
    header = json.loads(raw[8 : 8 + n])
    change(header)
    body = json.dumps(header, separators=(",", ":")).encode()
    body += b" " * (-len(body) % 8)
    return struct.pack("<Q", len(body)) + body + raw[8 + n :]


def edit_entries(header: dict, old: str, new: str) -> None:
    meta = header["__metadata__"]
    assert old in meta["entries"]
    meta["entries"] = meta["entries"].replace(old, new)


@pytest.mark.parametrize(
    ("change", "match"),
    [
        # a layout name changed (same record size: what a careless rename would do)
        (lambda h: edit_entries(h, '"layout":"flashmla-model1"', '"layout":"model1"'), "stored header_crc32"),
        (lambda h: edit_entries(h, '"num_tokens":20', '"num_tokens":19'), "stored header_crc32"),
        (lambda h: h["__metadata__"].update(model="other"), "stored header_crc32"),
        (lambda h: h["__metadata__"].update(version="2"), "stored header_crc32"),
        (lambda h: h["__metadata__"].update(header_crc32="XYZ"), "not 8 lowercase hex digits"),
        (lambda h: h["__metadata__"].pop("header_crc32"), "does not begin with its 'header_crc32'"),
        (lambda h: h.update(__metadata__={**dict(list(h["__metadata__"].items())[1:]),
                                          "header_crc32": h["__metadata__"]["header_crc32"]}),
         "does not begin with its 'header_crc32'"),
        (lambda h: h.update(__metadata__={**dict(list(h["__metadata__"].items())[1:]), "version": "2",
                                          "header_crc32": h["__metadata__"]["header_crc32"]}),
         "'header_crc32' is not the header's first key"),
    ],
)
def test_each_header_corruption_kind_is_a_header_error(tmp_path: Path, change, match: str):
    every_reader_refuses(copy(tmp_path, rewritten(V3.read_bytes(), change)), tmp_path, match=match)


def test_write_dump_reserves_the_header_checksum_key(tmp_path: Path):
    with pytest.raises(InputError, match="header_crc32"):
        write_dump(tmp_path / "d.safetensors", read_dump(V2), attrs={"header_crc32": "00000000"})


def test_version_2_fixture_still_reads_flagged_header_unverified():
    dump = read_dump(V2)
    assert dump.version == 2 and dump.header_verified is False
    assert set(dump.checksums) == {"layer.0.swa", "layer.1.compress", "layer.2.kv"}  # data still checked
    assert dump.attrs == {"created_by": "kvbridge 0.1.0", "model": "fixture"}
    x = dump["layer.2.kv"].data
    assert torch.equal(dump["layer.0.swa"].data, kb.encode(x, "trtllm-fp8", page_size=16, scale=1.0))
    assert torch.equal(dump["layer.1.compress"].data, kb.encode(x, "flashmla-model1", page_size=64))
    with open_dump(V2) as fh:
        assert fh.header_verified is False and {s["checksum"] for s in dump_stats(fh)} == {"ok"}
    with open_dump(V3) as fh:
        assert fh.header_verified is True


def test_inspect_shows_whether_the_header_was_verified():
    result = CliRunner().invoke(cli, ["inspect", str(V2)], env={"COLUMNS": "80"})
    assert result.exit_code == 0, result.output
    stdout = " ".join(result.stdout.split())
    assert "data crc32 verified" in stdout and "header unverified: version 2 has no header checksum" in stdout
    result = CliRunner().invoke(cli, ["inspect", str(V3)], env={"COLUMNS": "80"})
    assert "header and data crc32 verified" in result.stdout and "unverified" not in result.stdout
    for path, want in ((V2, False), (V3, True)):
        result = CliRunner().invoke(cli, ["inspect", str(path), "--json"])
        assert json.loads(result.stdout)["header_verified"] is want


def test_convert_of_a_version_2_dump_warns_once_and_writes_version_3(tmp_path: Path):
    out = tmp_path / "o.safetensors"
    result = CliRunner().invoke(cli, ["convert", str(V2), str(out), "--to", "model1", "--page-size", "64"])
    assert result.exit_code == 0, result.output
    stderr = " ".join(result.stderr.split())  # the console wraps at its width
    assert stderr.count("warning:") == 1, stderr
    assert stderr.startswith(f"warning: {V2}: header unverified: version 2 has no header checksum"), stderr
    converted = read_dump(out)
    assert converted.version == 3 and converted.header_verified is True
    assert converted.attrs == read_dump(V2).attrs
    result = CliRunner().invoke(cli, ["convert", str(V2), str(out), "--to", "model1", "--page-size", "64",
                                      "--force", "--json"])
    assert json.loads(result.stdout)["input_header_verified"] is False
    result = CliRunner().invoke(cli, ["convert", str(V3), str(out), "--to", "model1", "--page-size", "64",
                                      "--force", "--json"])
    assert json.loads(result.stdout)["input_header_verified"] is True and "warning" not in result.stderr
