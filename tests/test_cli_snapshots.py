"""Every command's human output at ``COLUMNS=80``, against snapshots in tests/snapshots/cli80/.

Each case checks that every line (stdout and stderr) fits 80 columns and, for deterministic output,
that no number is cut: the numbers printed at 80 columns are exactly those printed at 200 columns.
Timings, and every number of the benchmarks, are replaced by ``#`` in the snapshot so that it is
stable. Commands run in a temporary directory on small files named relatively (no paths to
normalise). Not covered here: ``migrate serve`` / ``send`` result lines (they need a real server:
tests/test_migrate_server.py checks their width at ``COLUMNS=80`` over gloo), the SGLang peers
(they need SGLang's processes: tests/test_adapter_sglang.py and test_adapter_sglang_decode.py run
each in human mode at ``COLUMNS=80`` against SGLang's own classes) and ``vllm-config``'s output, one JSON line meant for
``--kv-transfer-config "$(...)"`` (its --help is covered).

Regenerate the snapshots after an intended change of the output:

    KVBRIDGE_UPDATE_SNAPSHOTS=1 python -m pytest tests/test_cli_snapshots.py

and review ``git diff tests/snapshots``.
"""

from __future__ import annotations

import os
import re
from collections import Counter
from pathlib import Path

import click
import pytest
from click.testing import CliRunner

from cli.main import cli
from kvbridge.study.bench import machine
from tests.dump_helpers import seeded_trtllm_dump

SNAPSHOTS = Path(__file__).parent / "snapshots" / "cli80"
UPDATE = os.environ.get("KVBRIDGE_UPDATE_SNAPSHOTS") == "1"
WIDTH = 80
#: A number as a token: not part of a word (``model1``) nor the tail of another number.
NUMBER = re.compile(r"(?<![\w.^-])-?\d[\d,]*(?:\.\d+)?(?:e[-+]?\d+)?(?![\w.])")
#: Timings: "0.066 s", "pack 0.016", "request 1.452" (demo's seconds per step).
TIMINGS = [
    (re.compile(r"(seconds per step:)\s[\s\S]*?decode\s+\d+(?:\.\d+)?"), r"\1 <timings>"),  # wraps by their widths
    (re.compile(r"\d+\.\d+ s\b"), "# s"),
    (re.compile(r"\b(pack|convert|publish|request|verify|round_trip|decode) \d+(\.\d+)?"), r"\1 #"),
]
#: Benchmarks: the machine, the date and every number replaced, then the words rewrapped (the layout
#: depends on the widths of the numbers and of the CPU's name).
ALL_NUMBERS = [
    (re.compile(r"\s+".join(map(re.escape, machine()["cpu"].split()))), "<cpu>"),
    (re.compile(r"\d{4}-\d\d-\d\d\s+\d\d:\d\d(:\d\d)?( UTC)?"), "<date>"),
    (re.compile(r"(native MODEL1 kernels|backend): .*"), r"\1: <here>"),
    (re.compile(r"\((\d+)\s+cores[^)]*\),\s+torch\s+\S+"), r"(\1 cores), torch <version>"),  # wraps by the CPU's flags
    (NUMBER, "#"), (re.compile(r"#(?:[ ,.]*#)+"), "#"),
    (re.compile(r"\s+"), " "),
    (re.compile(r"(.{1,79})(?: |$)"), "\\1\n"),
]
#: Paths of this checkout (``verify`` names its fixtures directory in its centred title).
CHECKOUT = [(re.compile(re.escape(str(Path(__file__).resolve().parents[1]))), "<checkout>"),
            (re.compile(r"^ +(?=conformance: <checkout>)", re.M), "")]  # the title is centred on the path's length

CASES = {
    "layouts": (["layouts"], []),
    "inspect": (["inspect", "trt.safetensors"], []),
    "convert-lossless": (["convert", "trt.safetensors", "m1.safetensors", "--to", "model1", "--force"], []),
    "convert-lossy": (["convert", "m1.safetensors", "lossy.safetensors", "--to", "trtllm-fp8", "--scale", "0.05",
                       "--force"], []),
    "verify": (["verify"], CHECKOUT),
    "demo": (["demo", "--tokens", "128"], TIMINGS),
    "migrate-plan": (["migrate", "plan", "--from", "trtllm", "--to", "vllm", "--tokens", "4096"], []),
    "migrate-plan-sglang": (["migrate", "plan", "--from", "sglang", "--to", "vllm", "--tokens", "1000"], []),
    "migrate-run": (["migrate", "run", "--from", "trtllm", "--to", "vllm", "--tokens", "1024", "--layers", "4"],
                    TIMINGS),
    "migrate-bench-local": (["migrate", "bench", "--local", "--tokens", "1024", "--repeat", "1"], ALL_NUMBERS),
    "accuracy": (["accuracy", "--context", "128", "--topk", "64", "--batch", "1", "--heads", "2", "--page-size",
                  "32", "--pow2-scales", "2^-3", "--sweep", "magnitude=0.01,1"], []),
    "bench": (["bench", "--tokens", "256", "--device", "cpu", "--repeat", "1", "--threads", "1",
               "--only", "flashmla-model1 -> trtllm-fp8"], ALL_NUMBERS),
}


@pytest.fixture(scope="module")
def workdir(tmp_path_factory) -> Path:
    """The dumps the cases read: the seeded trtllm-fp8 dump of tests/dump_helpers.py, and its conversions."""
    path = tmp_path_factory.mktemp("cli80")
    seeded_trtllm_dump(path / "trt.safetensors")
    assert render(["convert", "trt.safetensors", "m1.safetensors", "--to", "model1"], WIDTH, path)[0] == 0
    return path


def render(args: list[str], columns: int, cwd: Path) -> tuple[int, str]:
    old = Path.cwd()
    os.chdir(cwd)
    try:
        result = CliRunner().invoke(cli, args, env={"COLUMNS": str(columns)}, prog_name="kvbridge")
    finally:
        os.chdir(old)
    return result.exit_code, result.stdout + ("--- stderr\n" + result.stderr if result.stderr else "")


def normalise(text: str, rules: list) -> str:
    for pattern, repl in rules:
        text = pattern.sub(repl, text)
    return "\n".join(line.rstrip() for line in text.splitlines()) + "\n"


def check_snapshot(name: str, text: str) -> None:
    path = SNAPSHOTS / f"{name}.txt"
    if UPDATE:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    assert path.exists(), f"no snapshot {path}: run with KVBRIDGE_UPDATE_SNAPSHOTS=1"
    assert text == path.read_text(), f"{name} differs from {path} (regenerate if intended)"


def check_width(name: str, text: str) -> None:
    wide = [line for line in text.splitlines() if len(line) > WIDTH]
    assert not wide, f"{name}: lines over {WIDTH} columns: {wide}"


@pytest.mark.parametrize("name", list(CASES))
def test_output_at_80_columns(name: str, workdir: Path):
    args, rules = CASES[name]
    code, text = render(args, WIDTH, workdir)
    assert code == 0, text
    check_width(name, text)
    if rules is not ALL_NUMBERS:
        code, wide = render(args, 200, workdir)
        assert code == 0, wide
        cut = Counter(NUMBER.findall(normalise(wide, rules))) - Counter(NUMBER.findall(normalise(text, rules)))
        assert not cut, f"{name}: numbers cut at {WIDTH} columns (whole at 200): {sorted(cut)}"
    check_snapshot(name, normalise(text, rules))


def _command_paths(group: click.Group, ctx: click.Context, prefix: tuple[str, ...] = ()) -> list[list[str]]:
    out = []
    for name in group.list_commands(ctx):
        command = group.get_command(ctx, name)
        out.append([*prefix, name])
        if isinstance(command, click.Group):
            out += _command_paths(command, ctx, (*prefix, name))
    return out


@pytest.mark.parametrize("path", [[], *_command_paths(cli, click.Context(cli))], ids=lambda p: " ".join(p) or "-")
def test_help_at_80_columns(path: list[str], tmp_path: Path):
    code, text = render([*path, "--help"], WIDTH, tmp_path)
    assert code == 0, text
    check_width(" ".join(path) or "kvbridge", text)
    check_snapshot("help-" + ("-".join(path) or "kvbridge"), normalise(text, []))
