"""Every command's ``--help`` runs without importing torch (or numba, or the C extension): the command tree
is defined from torch-free modules, and the library modules that need torch are imported inside the
commands when they run. The wall time is not asserted (machines differ); see the commit log for figures."""

from __future__ import annotations

import json
import subprocess
import sys

import click

from cli.main import cli

#: Modules a --help must not load (each costs seconds and hundreds of MB).
HEAVY = ("torch", "numba", "numpy", "kvbridge.backends.native._kernels")

#: Runs in a fresh interpreter: each command path's --help in turn, then the heavy modules loaded so far.
PROBE = """
import json, sys
from kvbridge.cli.main import cli
heavy = {heavy!r}
seen = {{}}
for path in json.loads(sys.argv[1]):
    try:
        cli.main([*path, "--help"], prog_name="kvbridge", standalone_mode=False)
    except SystemExit:
        pass
    seen[" ".join(path)] = [m for m in heavy if m in sys.modules]
print(json.dumps(seen))
"""


def command_paths(group: click.Group, ctx: click.Context, prefix: tuple[str, ...] = ()) -> list[list[str]]:
    """Every command under ``group`` (nested groups included), as argument lists."""
    out = []
    for name in group.list_commands(ctx):
        command = group.get_command(ctx, name)
        assert command is not None, name
        out.append([*prefix, name])
        if isinstance(command, click.Group):
            out += command_paths(command, ctx, (*prefix, name))
    return out


def test_every_command_is_enumerated():
    paths = command_paths(cli, click.Context(cli))
    assert ["migrate", "serve"] in paths and ["vllm-config"] in paths and len(paths) >= 16


def test_help_imports_no_torch():
    paths = [[], *command_paths(cli, click.Context(cli))]
    run = subprocess.run([sys.executable, "-c", PROBE.format(heavy=HEAVY), json.dumps(paths)],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    seen = json.loads(run.stdout.strip().splitlines()[-1])
    assert set(seen) == {" ".join(p) for p in paths}
    loaded = {path or "kvbridge": mods for path, mods in seen.items() if mods}
    assert not loaded, f"--help loaded heavy modules (first command listed loaded them): {loaded}"


def test_help_exits_zero_with_usage_text():
    for path in command_paths(cli, click.Context(cli)):
        run = subprocess.run([sys.executable, "-m", "kvbridge.cli", *path, "--help"], capture_output=True,
                             text=True, timeout=120)
        assert run.returncode == 0, (path, run.stderr[-2000:])
        assert run.stdout.startswith(f"Usage: kvbridge {' '.join(path)} "), (path, run.stdout[:200])
