"""``kvbridge accuracy`` shows its progress: the library reports each (point, variant) evaluation
through a callback; the CLI draws a rich bar on a terminal's stderr, and nothing with --json."""

from __future__ import annotations

import io
import json

import pytest
from click.testing import CliRunner
from rich.console import Console

from cli import accuracy_cmd
from cli.main import cli
from kvbridge.study import accuracy as acc

TINY = ["--context", "128", "--topk", "64", "--batch", "1", "--heads", "2", "--page-size", "32",
        "--pow2-scales", "2^-3", "--no-sweeps"]


def test_the_study_reports_every_evaluation():
    seen: list[tuple[str, int, int]] = []
    params = acc.SyntheticParams(context=128, topk=64, batch=1, heads=2, page_size=32)
    study = acc.run_study(params, sweeps={"magnitude": (0.01,)}, pow2_scales=(), progress=lambda *a: seen.append(a))
    total = 2 * len(study["variants"])
    assert [done for _, done, _ in seen] == list(range(1, total + 1))
    assert {t for _, _, t in seen} == {total}
    assert seen[0][0] == f"nominal: {study['variants'][0]}"
    assert seen[-1][0] == f"magnitude=0.01: {study['variants'][-1]}"


@pytest.fixture
def terminal(monkeypatch) -> io.StringIO:
    """stderr as a terminal (the runner's is not one)."""
    out = io.StringIO()
    monkeypatch.setattr(accuracy_cmd, "err_console", Console(file=out, force_terminal=True, width=80))
    return out


def test_a_terminal_gets_a_bar_and_json_stays_quiet(terminal):
    result = CliRunner().invoke(cli, ["accuracy", *TINY])
    assert result.exit_code == 0, result.output
    drawn = terminal.getvalue()
    variants = len(acc.registry_variants((0.125,)))
    assert f"{variants}/{variants}" in drawn and "nominal: " in drawn
    terminal.truncate(0)
    result = CliRunner().invoke(cli, ["accuracy", *TINY, "--json"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["runs"] and terminal.getvalue() == "" and result.stderr == ""
