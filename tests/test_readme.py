"""README.md's examples run as written: every fenced ``python`` block in one interpreter, every
fenced ``bash`` block as a script (``set -e``, in a scratch directory, with this interpreter's
``kvbridge`` first on PATH). A block right after ``<!-- readme-test: skip (REASON) -->`` is not
run; the skipped blocks and their reasons are listed in the test output (``-rs`` shows them, and
``test_skipped_blocks_say_why`` pins which ones may be skipped)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[1] / "README.md"
#: A fenced block, with the skip marker (and its reason) when one stands on the line before it.
BLOCK = re.compile(r"(?:<!-- readme-test: skip \((?P<reason>[^)]*)\) -->\n)?```(?P<lang>\w+)\n(?P<code>.*?)```",
                   re.S)


def blocks() -> list[tuple[str, str, str | None, int]]:
    """(language, code, skip reason or None, line number) of every fenced block."""
    text = README.read_text()
    return [(m["lang"], m["code"], m["reason"], text.count("\n", 0, m.start()) + 1) for m in BLOCK.finditer(text)]


def cases(lang: str) -> list:
    out = []
    for kind, code, reason, line in blocks():
        if kind == lang:
            marks = [pytest.mark.skip(reason=f"README line {line}: {reason}")] if reason else []
            out.append(pytest.param(code, id=f"line{line}", marks=marks))
    return out


def test_skipped_blocks_say_why():
    skipped = [(lang, reason) for lang, _, reason, _ in blocks() if reason]
    assert all(lang == "bash" for lang, _ in skipped), "the Python examples always run"
    assert all(re.search(r"installs packages|starts a server", r) for _, r in skipped), skipped
    ran = [code for lang, code, reason, _ in blocks() if lang == "bash" and not reason]
    assert any("kvbridge demo" in code for code in ran), "the CLI quick start must run"
    assert sum(lang == "python" for lang, _, _, _ in blocks()) >= 1


@pytest.mark.parametrize("code", cases("python"))
def test_python_example(code: str, tmp_path: Path):
    run = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-4000:]


@pytest.mark.parametrize("code", cases("bash"))
def test_shell_example(code: str, tmp_path: Path):
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"}
    run = subprocess.run(["bash", "-euo", "pipefail", "-c", code], cwd=tmp_path, capture_output=True, text=True,
                         env=env, timeout=900)
    assert run.returncode == 0, (run.stdout[-3000:], run.stderr[-3000:])
