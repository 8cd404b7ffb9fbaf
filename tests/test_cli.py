"""The ``kvbridge`` command through click's runner: every command, JSON output, exit codes, error paths."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner, Result

import kvbridge
from cli.main import cli
from kvbridge.dumps.dumpfile import DumpEntry, read_dump
from kvbridge.dumps.writer import write_dump
from tests.dump_helpers import seeded_trtllm_dump


def run(*args: str) -> Result:
    return CliRunner().invoke(cli, [str(a) for a in args])


def one_line_error(result: Result, code: int, fragment: str) -> None:
    """The command failed with ``code`` and a single readable line containing ``fragment``."""
    assert result.exit_code == code, result.output
    assert "Traceback" not in result.output
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert lines[-1].startswith("Error: ") and fragment in lines[-1], result.stderr
    if code == 1:
        assert len(lines) == 1, result.stderr


@pytest.fixture
def trtllm_dump(tmp_path: Path) -> Path:
    return seeded_trtllm_dump(tmp_path / "trt.safetensors")


def test_layouts_table_and_json():
    result = run("layouts")
    assert result.exit_code == 0
    for name in ("bf16", "trtllm-fp8", "flashmla-model1", "trtllm-fp8-ds-mla", "vllm-fp8-ds-mla", "149760"):
        assert name in result.output
    assert max(len(line) for line in result.output.splitlines()) <= 80  # the runner's console is 80 wide
    records = json.loads(run("layouts", "--json").output)
    model1 = next(r for r in records if r["name"] == "flashmla-model1")
    assert model1["page_bytes"] == {"2": 1728, "64": 37440, "256": 149760}
    assert model1["aliases"] == ["model1", "sglang-v4", "vllm-fp8-ds-mla"]
    fnuz = next(r for r in records if r["name"] == "model1-fnuz")  # ROCm gfx942's MODEL1 with FNUZ nope
    assert fnuz["page_bytes"] == model1["page_bytes"] and "amax-1e-8/240" in json.dumps(fnuz)


def test_inspect_table_and_json(trtllm_dump: Path, tmp_path: Path):
    result = run("inspect", trtllm_dump)
    assert result.exit_code == 0, result.output
    assert "layer.0.swa" in result.output and "2×128" in result.output
    info = json.loads(run("inspect", trtllm_dump, "--json").output)
    assert [e["name"] for e in info["entries"]] == ["layer.0.swa", "layer.1.compress"]
    assert info["entries"][0]["num_tokens"] == 150 and info["entries"][0]["scale"] == 1.0
    x = torch.zeros(3, 512)
    x[0, :64] = 1.75
    m1 = kvbridge.encode(x, "model1", page_size=2)
    m1[1, 0] = 0x7F  # token 2's first nope byte: an E4M3 NaN
    path = write_dump(tmp_path / "m1.safetensors", [DumpEntry(0, "swa", m1, "model1", 2, 3, dialect="flashmla")])
    stats = json.loads(run("inspect", path, "--json").output)["entries"][0]
    assert stats["nan"]["e4m3"] == 1 and stats["e4m3_at_max"] == 64
    assert stats["saturated"] is None  # per-tile: codes at 448 are each tile's maximum, not clipping
    assert stats["nonfinite_values"] == 1 and stats["checksum"] == "ok"
    assert stats["scale_exponents"] == {"-8": 1, "-13": 20}
    table = run("inspect", path).output
    assert "tile scale exponents" in table and "2^-13:20" in table


def test_inspect_rejects_truncated_foreign_and_missing_files(trtllm_dump: Path, tmp_path: Path):
    cut = tmp_path / "cut.safetensors"
    cut.write_bytes(trtllm_dump.read_bytes()[:-10])
    one_line_error(run("inspect", cut), 1, "truncated")
    foreign = tmp_path / "notes.txt"
    foreign.write_text("hello, this is not a dump\n" * 3)
    one_line_error(run("inspect", foreign), 1, "not a safetensors file")
    one_line_error(run("inspect", tmp_path / "missing.safetensors"), 2, "does not exist")  # as for convert


def test_convert_to_model1_and_back_with_loss_report(trtllm_dump: Path, tmp_path: Path):
    m1 = tmp_path / "m1.safetensors"
    result = run("convert", trtllm_dump, m1, "--to", "model1", "--json")
    assert result.exit_code == 0, result.output
    info = json.loads(result.output)
    assert info["lossless"] and info["to"] == "flashmla-model1"
    assert {e["name"] for e in info["entries"]} == {"layer.0.swa", "layer.1.compress"}
    back = tmp_path / "back.safetensors"
    result = run("convert", m1, back, "--to", "trtllm-fp8", "--scale", "1")
    assert result.exit_code == 0 and "lossless" in result.output
    for a, b in zip(read_dump(trtllm_dump), read_dump(back), strict=True):
        assert torch.equal(a.data, b.data)
    lossy = run("convert", m1, tmp_path / "small.safetensors", "--to", "trtllm-fp8", "--scale", "0.001")
    assert lossy.exit_code == 0 and "loss report" in lossy.output and "saturated" in lossy.output
    auto = json.loads(
        run("convert", m1, tmp_path / "auto.safetensors", "--to", "trtllm-fp8", "--scale", "auto", "--json").output
    )
    assert all(e["saturated"] == 0 and e["dst_scale"] > 0 for e in auto["entries"])


def test_convert_repages_with_page_size_and_dialect(trtllm_dump: Path, tmp_path: Path):
    out = tmp_path / "p61.safetensors"
    assert (
        run("convert", trtllm_dump, out, "--to", "sglang-v4", "--page-size", "61", "--dialect", "amax-1e-8").exit_code
        == 0
    )
    entry = read_dump(out)["layer.0.swa"]
    assert (entry.page_size, entry.dialect, entry.num_pages) == (61, "amax-1e-8", 3)


def test_convert_into_a_missing_directory_is_one_line(trtllm_dump: Path, tmp_path: Path):
    one_line_error(
        run("convert", trtllm_dump, tmp_path / "no" / "out.safetensors", "--to", "model1"), 1, "does not exist"
    )


def test_convert_refuses_overwrite_without_force(trtllm_dump: Path, tmp_path: Path):
    out = tmp_path / "out.safetensors"
    out.write_bytes(b"precious")
    one_line_error(run("convert", trtllm_dump, out, "--to", "model1"), 1, "exists; pass --force")
    assert out.read_bytes() == b"precious"
    assert run("convert", trtllm_dump, out, "--to", "model1", "--force").exit_code == 0
    assert read_dump(out).names == ["layer.0.swa", "layer.1.compress"]


@pytest.mark.parametrize(
    ("args", "fragment"),
    [
        (["--to", "model9"], "unknown layout 'model9'"),
        (["--to", "trtllm-fp8", "--scale", "-2"], "positive finite"),
        (["--to", "trtllm-fp8", "--scale", "lots"], "positive number or 'auto'"),
        (["--to", "model1", "--scale", "2"], "per-tile scales"),
        (["--to", "model1", "--dialect", "swa"], "'swa' does not apply"),
        (["--to", "model1", "--page-size", "0"], "--page-size"),
        ([], "--to"),
    ],
)
def test_convert_usage_errors_exit_2_and_write_nothing(trtllm_dump: Path, tmp_path: Path, args: list, fragment: str):
    out = tmp_path / "out.safetensors"
    one_line_error(run("convert", trtllm_dump, out, *args), 2, fragment)
    assert not out.exists()


def test_failed_convert_leaves_no_output(trtllm_dump: Path, tmp_path: Path):
    raw = trtllm_dump.read_bytes()
    cases = {
        "truncated": (raw[: len(raw) // 2], "truncated"),
        "foreign": (b"GIF89a" + bytes(200), "not a safetensors file"),
        "flipped header": (raw[:8] + raw[8:40].replace(b"{", b"[") + raw[40:], "not a safetensors file"),
    }
    for name, (data, fragment) in cases.items():
        src = tmp_path / f"{name}.safetensors"
        src.write_bytes(data)
        out = tmp_path / f"{name}.out.safetensors"
        one_line_error(run("convert", src, out, "--to", "model1"), 1, fragment)
        assert not out.exists()
    nan = read_dump(trtllm_dump)["layer.0.swa"]
    pages = nan.data.clone()
    pages[0, 3] = 0xFF  # an E4M3 NaN
    src = write_dump(tmp_path / "nan.safetensors", [DumpEntry(0, "swa", pages, "trtllm-fp8", 128, 150)])
    one_line_error(run("convert", src, tmp_path / "nan.out", "--to", "model1"), 1, "non-finite")
    assert sorted(p.name for p in tmp_path.iterdir() if "out" in p.name) == []


def test_debug_shows_the_exception(tmp_path: Path):
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(b"nope")
    result = CliRunner().invoke(cli, ["--debug", "inspect", str(bad)])
    assert result.exit_code != 0 and isinstance(result.exception, kvbridge.DumpFormatError)


def test_verify_passes_on_the_repository_fixtures():
    result = run("verify")
    assert result.exit_code == 0, result.output
    assert "283/283 checks passed" in result.output and "FAIL" not in result.output
    for line in ("kvbridge codecs: 33/33", "SGLang 0.5.23: 115/115", "vLLM 0.33.0: 45/45", "TensorRT-LLM main: 22/22",
                 "DeepGEMM: 22/22", "FlashMLA: 29/29", "FlashInfer: 6/6", "SGLang PR #37136: 5/5"):
        assert line in result.output  # reported per engine
    report = json.loads(run("verify", "--json").output)
    assert report["passed"] and report["num_checks"] == 283
    assert {r["layout"] for r in report["results"]} == {"flashmla-model1", "trtllm-fp8-ds-mla", "trtllm-fp8",
                                                        "indexer-fp8", "indexer-fp4", "state-fp32", "v41-fp8",
                                                        "v41-fp8-interleaved", "v41-fp4", "v41-fp4-pad512",
                                                        "v41-fp4-interleaved", "model1-fnuz", "flashinfer-nvfp4",
                                                        "lil-nvfp4-ds-mla", "sglang-mxfp4"}


def test_verify_fails_with_exit_1_on_a_bad_fixture_dir(tmp_path: Path):
    # a device or directory that does not exist is a usage error (exit 2), as for bench and convert
    if not torch.cuda.is_available():
        one_line_error(run("verify", "--device", "cuda"), 2, "no CUDA device is available")
    one_line_error(run("verify", "--device", "tpu9"), 2, "not a torch device")
    one_line_error(run("verify", tmp_path), 1, "not found")
    one_line_error(run("verify", tmp_path / "absent"), 2, "does not exist")


def test_demo_runs_and_keeps_files_in_workdir(tmp_path: Path):
    result = run("demo", "--tokens", "512", "--workdir", tmp_path / "work", "--json")
    assert result.exit_code == 0, result.output
    summary = json.loads(result.output)
    assert summary["ok"] and summary["convert"]["lossless"] and all(c["passed"] for c in summary["checks"])
    names = [c["check"] for c in summary["checks"]]
    for kind in ("trtllm-fp8 -> MODEL1 lossless", "MODEL1 bytes == reference codec", "round trip bytes equal"):
        # 6 entries: the SWA pools of layers 0-3 and the compressed pools of layers 2 (C4) and 3 (C128)
        assert sum(name.endswith(kind) for name in names) == 6, names
    kept = sorted(p.name for p in (tmp_path / "work").iterdir())
    assert kept == [
        "request.model1.safetensors",
        "request.roundtrip.trtllm-fp8.safetensors",
        "request.trtllm-fp8.safetensors",
    ]
    table = run("demo", "--tokens", "128")
    n = len(summary["checks"])
    assert table.exit_code == 0 and f"{n}/{n} checks passed" in table.output
    one_line_error(run("demo", "--tokens", "12"), 2, "--tokens")


def test_inspect_source_names_the_writer(tmp_path: Path):
    x = torch.randn(70, 512, generator=torch.Generator().manual_seed(4))
    x[:, 64:128] *= 1e-6  # tile 1 amax < 1e-4 / 2: the three dialects write different scale bytes
    src = write_dump(tmp_path / "src.safetensors", [DumpEntry(0, "swa", x), DumpEntry(1, "swa", x)])
    m1 = kvbridge.encode(x.bfloat16(), "model1", page_size=64, dialect="amax-1e-4")
    fp8 = kvbridge.encode(x, "trtllm-fp8", page_size=64, dialect="compress")
    enc = write_dump(
        tmp_path / "enc.safetensors",
        [DumpEntry(0, "swa", m1, "model1", 64, 70), DumpEntry(1, "swa", fp8, "trtllm-fp8", 64, 70, scale=0.5)],
    )
    info = json.loads(run("inspect", enc, "--source", src, "--json").output)
    assert info["entries"][0]["writer"]["matches"] == ["amax-1e-4/bf16: vLLM writer / DeepSeek act_quant"]
    assert info["entries"][1]["writer"]["matches"] == ["compress/fp32@s=1: TensorRT-LLM COMPRESS writer"]
    table = run("inspect", enc, "--source", src)
    assert table.exit_code == 0 and "TensorRT-LLM COMPRESS writer" in table.output
    swapped = write_dump(tmp_path / "other.safetensors", [DumpEntry(0, "swa", x * 2)])
    assert "none" in run("inspect", enc, "--source", swapped).output
