"""The package and the command as installed: wheel contents, lazy imports, the JIT cache location,
the exit-code scheme (0 / 1 / 2 / 130), one-line messages naming entry and value, 80 columns."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner, Result
from rich.console import Console
from rich.table import Table

import kvbridge as kb
from cli import convert_cmd
from cli.common import keep_numbers_whole
from cli.main import cli
from kvbridge import jitcache
from kvbridge.dumps.dumpfile import DumpEntry
from kvbridge.dumps.writer import write_dump
from kvbridge.engines.topology import FLASH
from kvbridge.errors import InputError
from kvbridge.migration import destination_pools, migrate_local, plan_migration, source_request

ROOT = Path(__file__).resolve().parent.parent


def run(*args: object) -> Result:
    return CliRunner().invoke(cli, [str(a) for a in args])


def one_line(result: Result, code: int, fragment: str) -> str:
    assert result.exit_code == code, result.output
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("Error: ") and fragment in lines[0], result.stderr
    return lines[0]


def python(code: str, **env: str) -> str:
    full = {**os.environ, "PYTHONPATH": str(ROOT), **env}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=full, timeout=300)
    assert done.returncode == 0, done.stderr
    return done.stdout


@pytest.fixture
def trt_dump(tmp_path: Path) -> Path:
    x = (torch.randn(150, 512, generator=torch.Generator().manual_seed(1)) * 2).bfloat16()
    pages = kb.encode(x, "trtllm-fp8", page_size=64)
    return write_dump(tmp_path / "trt.safetensors", [DumpEntry(0, "swa", pages, "trtllm-fp8", 64, 150, 1.0, "swa")])


# ---------------------------------------------------------------- packaging


def test_wheel_holds_only_kvbridge_with_cli_and_fixtures(tmp_path: Path):
    setuptools = pytest.importorskip("setuptools")  # the build backend, used without isolation here
    if int(setuptools.__version__.split(".")[0]) < 70:
        pytest.importorskip("wheel")
    done = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(tmp_path),
         str(ROOT)], capture_output=True, text=True, timeout=600, cwd=tmp_path,
    )
    assert done.returncode == 0, done.stderr
    (wheel,) = tmp_path.glob("kvbridge-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    dist_info = "-".join(wheel.name.split("-")[:2]) + ".dist-info"  # a platform wheel (the C extension)
    assert {n.split("/")[0] for n in names} == {"kvbridge", dist_info}
    for fixture in (ROOT / "fixtures").glob("*.safetensors"):
        assert f"kvbridge/fixtures/{fixture.name}" in names
    assert "kvbridge/cli/main.py" in names and "kvbridge/cli/convert_cmd.py" in names
    entry_points = zipfile.ZipFile(wheel).read(f"{dist_info}/entry_points.txt").decode()
    assert "kvbridge = kvbridge.cli.main:main" in entry_points


def test_cli_sources_import_each_other_relatively():
    """``cli/`` installs as ``kvbridge.cli``: an absolute ``cli.`` import would break the wheel."""
    for source in (ROOT / "cli").glob("*.py"):
        text = source.read_text()
        assert not re.search(r"^\s*(from cli[. ]|import cli\b)", text, re.M), source.name


def test_help_imports_neither_torch_nor_numba_and_layouts_no_numba():
    probe = (
        "import sys\nfrom cli.main import cli\n"
        "try:\n    cli.main([{args}], prog_name='kvbridge')\nexcept SystemExit:\n    pass\n"
        "print('LOADED', 'torch' in sys.modules, 'numba' in sys.modules)\n"
    )
    assert python(probe.format(args="'--help'")).splitlines()[-1] == "LOADED False False"
    assert python(probe.format(args="'layouts'")).splitlines()[-1] == "LOADED True False"


def test_jit_cache_goes_to_a_per_user_dir_and_unwritable_costs_only_a_compile(tmp_path: Path):
    show = "import kvbridge, os\nfrom kvbridge import jitcache\n"
    show += "print(jitcache.cache_dir, os.environ.get('NUMBA_CACHE_DIR'))"
    clean = {k: v for k, v in os.environ.items() if k not in ("KVBRIDGE_JIT_CACHE", "NUMBA_CACHE_DIR")}
    out = subprocess.run([sys.executable, "-c", show], capture_output=True, text=True, timeout=120,
                         env={**clean, "PYTHONPATH": str(ROOT), "XDG_CACHE_HOME": str(tmp_path / "xdg")}).stdout
    kernels = f"kernels-{jitcache.sources_fingerprint()}"  # one subdirectory per version of the kernel sources
    assert out.split() == [str(tmp_path / "xdg/kvbridge/numba" / kernels)] * 2
    chosen = python(show, KVBRIDGE_JIT_CACHE=str(tmp_path / "mine")).split()
    assert chosen == [str(tmp_path / "mine" / kernels)] * 2
    unwritable = python(show, KVBRIDGE_JIT_CACHE="/proc/kvbridge-cache").split()
    assert unwritable[0] == unwritable[1] and "kvbridge-numba-" in unwritable[0]  # a temporary dir instead
    scan = (
        "import torch, kvbridge\nfrom kvbridge import jitcache\nfrom kvbridge.layouts import scan\n"
        "pages = kvbridge.encode(torch.zeros(4, 512), 'bf16', page_size=4, nonfinite='zero')\n"
        "print(jitcache.cache_dir, scan.scan_pages(pages, kvbridge.get_layout('bf16'), 4).count)"
    )
    assert python(scan, KVBRIDGE_JIT_CACHE="off", KVBRIDGE_BACKEND="reference").split() == ["None", "0"]


def test_jit_cache_of_other_kernel_sources_is_never_read(tmp_path: Path):
    """numba checks a cached kernel against its own file's time stamp only, not against the modules whose
    functions it inlines: an edit of any kernel source must move the cache to another subdirectory."""
    package = Path(jitcache.__file__).resolve().parent
    copy = tmp_path / "kvbridge"
    for entry in jitcache.KERNEL_SOURCES:
        src = package / entry
        if src.is_dir():
            shutil.copytree(src, copy / entry, ignore=shutil.ignore_patterns("__pycache__", "*.so"))
        else:
            copy.mkdir(exist_ok=True)
            shutil.copy2(src, copy / entry)
    before = jitcache.sources_fingerprint(copy)
    assert before == jitcache.sources_fingerprint()
    with open(copy / "backends/native/records.py", "a") as fh:  # the decoder native.loss inlines
        fh.write("\n")
    assert jitcache.sources_fingerprint(copy) != before


# ---------------------------------------------------------------- exit codes and messages


def test_usage_errors_exit_2_on_one_line_before_reading(trt_dump: Path, tmp_path: Path):
    out = tmp_path / "o.safetensors"
    one_line(run("convert", trt_dump, out, "--to", "trtllm-fp8", "--scale", "1e-50"), 2, "positive finite")
    one_line(run("convert", trt_dump, out, "--to", "trtllm-fp8", "--scale", "0"), 2, "positive finite")
    line = one_line(run("convert", trt_dump, out, "--to", "trtllm-fp8", "--scale", "9" * 4000), 2, "positive")
    assert len(line) < 300  # the 4000-digit argument is not echoed
    one_line(run("convert", trt_dump, out, "--to", "trtllm-fp8", "--dialect", "compress"), 2, "byte move")
    one_line(run("convert", tmp_path / "missing.safetensors", out, "--to", "model1"), 2, "does not exist")
    one_line(run("inspect", tmp_path / "missing.safetensors"), 2, "does not exist")
    one_line(run("convert", trt_dump), 2, "Missing argument")
    one_line(run("frobnicate"), 2, "No such command")
    one_line(run("migrate", "plan", "--from", "trtllm", "--to", "sglang", "--tokens", 10**12), 2, "--tokens")
    if not torch.cuda.is_available():
        one_line(run("verify", "--device", "cuda"), 2, "no CUDA device")
        one_line(run("bench", "--device", "cuda"), 2, "no CUDA device")
    assert not out.exists()


def test_interrupt_exits_130_and_leaves_nothing(trt_dump: Path, tmp_path: Path, monkeypatch):
    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(convert_cmd, "convert_open_dump", interrupted)
    result = run("convert", trt_dump, tmp_path / "o.safetensors", "--to", "model1")
    one_line(result, 130, "interrupted")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["trt.safetensors"]


def test_failures_exit_1_naming_entry_and_value(trt_dump: Path, tmp_path: Path):
    pages = kb.encode(torch.zeros(4, 512), "model1", page_size=2)
    pages[1, 3] = 0xFF  # token 2: an E4M3 NaN
    nan = write_dump(tmp_path / "nan.safetensors", [DumpEntry(7, "compress", pages, "model1", 2, 4)])
    one_line(run("convert", nan, tmp_path / "o.safetensors", "--to", "trtllm-fp8-ds-mla"), 1,
             "entry layer.7.compress: 1 non-finite value(s) (decoded NaN/Inf) in the source; first at token 2")
    raw = bytearray(trt_dump.read_bytes())
    raw[-5] ^= 0x10
    (tmp_path / "flip.safetensors").write_bytes(bytes(raw))
    one_line(run("inspect", tmp_path / "flip.safetensors"), 1, "entry layer.0.swa: checksum mismatch")
    (tmp_path / "o.safetensors").write_bytes(b"keep")
    one_line(run("convert", trt_dump, tmp_path / "o.safetensors", "--to", "model1"), 1, "exists; pass --force")


def test_block_table_messages_name_table_index_and_value():
    plan = plan_migration("trtllm", "sglang", FLASH.with_layers(2), 300)
    src, tables = source_request(plan)
    name, i, j = next((k, *[n for n, p in enumerate(v) if p >= 0][:2]) for k, v in tables.items()
                      if sum(p >= 0 for p in v) >= 2)
    page = tables[name][i]
    for change, message in (
        (lambda t: t[name].__setitem__(i, -7), rf"src_tables\['{name}'\]\[{i}\] is -7: page ids are >= 0, or -1"),
        (lambda t: t[name].__setitem__(j, page), rf"names page {page} twice \(indices {i} and {j}\)"),
        (lambda t: t[name].__setitem__(i, "3"), r"is '3', not an integer page id"),
        (lambda t: t.pop(name), rf"has no block table '{name}'"),
    ):
        bad = {k: list(v) for k, v in tables.items()}
        change(bad)
        with pytest.raises(InputError, match=message):
            migrate_local(plan, src, bad, destination_pools(plan))


# ---------------------------------------------------------------- what a person reads


def test_convert_and_inspect_output(trt_dump: Path, tmp_path: Path):
    out = tmp_path / "m1.safetensors"
    result = run("convert", trt_dump, out, "--to", "model1", "--no-report", "--json")
    assert result.exit_code == 0, result.output
    info = json.loads(result.output)
    assert info["lossless"] is None and info["entries"][0]["byte_move"] is False
    text = run("inspect", out).output
    assert "crc32 verified" in text
    row = next(line for line in text.splitlines() if line.startswith("layer.0.swa"))
    assert row.split()[-1] == "-"  # no "sat" count for per-tile MODEL1
    assert max(len(line) for line in text.splitlines()) <= 80
    back = run("convert", out, tmp_path / "back.safetensors", "--to", "trtllm-fp8", "--scale", "1")
    assert back.exit_code == 0 and "lossless" in back.output


def test_tables_keep_numbers_whole_at_80_columns():
    table = Table(title="a table wider than the terminal", box=None)
    table.add_column("variant")
    for i in range(5):
        table.add_column(f"metric number {i}", justify="right")
    table.add_row("trtllm-fp8/swa s=pow2(amax/448)", *[f"{1.234567e-5 * (i + 1):.6g}" for i in range(5)])
    console = Console(width=80, record=True, file=open(os.devnull, "w"))  # noqa: SIM115
    console.print(keep_numbers_whole(table))
    text = console.export_text()
    assert "…" not in text
    for i in range(5):
        assert f"{1.234567e-5 * (i + 1):.6g}" in text
