"""Prose lines of the CLI (demo, migrate plan / run) at 80 columns: wrapped between words, with
continuation lines indented under their item, never cut, and printed as plain text (no markup)."""

from __future__ import annotations

import os

import pytest
from click.testing import CliRunner
from rich.console import Console

from cli import common
from cli.main import cli


@pytest.fixture
def console80(monkeypatch) -> Console:
    console = Console(width=80, record=True, file=open(os.devnull, "w"))  # noqa: SIM115
    monkeypatch.setattr(common, "console", console)
    return console


def test_print_wrapped_hangs_continuations_and_keeps_words_whole(console80):
    common.print_wrapped("  kv: " + " ".join(f"word{i}" for i in range(30)) + " /a/very/long/" + "x" * 90)
    common.print_wrapped(" trtllm:fp8 (TensorRT-LLM) [position % ratio]", head="from")
    lines = console80.export_text().splitlines()
    assert lines[0].startswith("  kv: word0") and all(line.startswith("      ") for line in lines[1:-1])
    assert all(len(line) <= 80 for line in lines[:-2])
    assert lines[-2] == "      /a/very/long/" + "x" * 90  # a word longer than a line stays whole
    assert lines[-1] == "from trtllm:fp8 (TensorRT-LLM) [position % ratio]"  # brackets are text, not markup


def test_migrate_plan_lines_wrap_cleanly_at_80_columns():
    result = CliRunner().invoke(cli, ["migrate", "plan", "--from", "trtllm", "--to", "vllm", "--tokens", "4096"],
                                env={"COLUMNS": "80"})
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()
    prose = [line for line in lines if "─" not in line]
    assert all(len(line) <= 80 for line in prose), [line for line in prose if len(line) > 80]
    kv = next(i for i, line in enumerate(lines) if line.startswith("  kv: tensorrt_llm"))
    assert lines[kv + 1].startswith("      ") and lines[kv + 1].strip()  # continuation under its item
    assert "ape[position % ratio]" in result.output
