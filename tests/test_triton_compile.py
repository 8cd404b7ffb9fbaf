"""Every Triton specialisation the dispatcher launches compiled by the real compiler for sm_90, sm_100 and sm_120.

No GPU needed: ``scripts/triton_resources.py`` compiles the specialisations (derived from the layout
registry through ``triton_kernels.side`` / ``convert_launch`` / ``copy_launches``, the functions the
launch sites call) to PTX and cubin in a process pool and fails on a compile error, a spill, an fp64
instruction, a missing hardware E4M3 conversion or lost 16-byte accesses. This test runs it in a clean
process (the interpreter tests set ``TRITON_INTERPRET=1`` in this one) and checks that every pair of
registered layouts and every kernel kind is compiled for every target.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")

from kvbridge.layouts import all_layouts  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "scripts" / "triton_resources.py"
TARGETS = (90, 100, 120)
#: Kernel kinds compiled for every (source, destination) pair of registered layouts.
PAIR_KINDS = ("transcode", "transcode_slots", "transcode int-e4m3")
#: Kernel kinds compiled once per layout: (kind, the layout's side, the other side's names).
SINGLE_KINDS = (("encode", 1, ("fp32",)), ("decode", 0, ("fp32",)), ("gather", 0, ("flashmla-model1",
                "v41-fp8-interleaved")))


def _labels(row: dict) -> list[str]:
    return [row["label"], *row["also"]]


@pytest.fixture(scope="module")
def compiled(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("triton") / "resources.json"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, str(SCRIPT), "--json", str(out)], capture_output=True, text=True,
                          env=env, timeout=5400)
    print(done.stdout)  # the resource table (pytest -s / -rP shows it)
    assert done.returncode == 0, (done.stdout[-6000:], done.stderr[-3000:])
    return json.loads(out.read_text())


def test_every_specialisation_compiles_without_spills_and_keeps_its_instructions(compiled):
    rows = compiled["kernels"]
    assert rows and not [r for r in rows if r["violations"] or "error" in r]
    assert {r["arch"] for r in rows} == set(TARGETS)
    for r in rows:
        assert r["local"] == 0 and r["local_ops"] == 0 and r["f64"] == 0, r["label"]


def test_every_registered_layout_pair_and_kernel_kind_is_compiled_for_every_target(compiled):
    names = [lay.name for lay in all_layouts()]
    for arch in TARGETS:
        labels = {label for r in compiled["kernels"] if r["arch"] == arch for label in _labels(r)}
        for kind in PAIR_KINDS:
            missing = [f"{a} -> {b}" for a in names for b in names if f"{kind} {a} -> {b}" not in labels]
            assert not missing, f"sm_{arch}: {kind} not compiled for {missing}"
        for name in names:
            for kind, side, others in SINGLE_KINDS:
                for other in others:
                    pair = (name, other) if side == 0 else (other, name)
                    assert f"{kind} {pair[0]} -> {pair[1]}" in labels, f"sm_{arch}: no {kind} {pair}"
            assert f"nonfinite scan {name} -> {name}" in labels, f"sm_{arch}: no nonfinite scan of {name}"
        for kind in ("repage", "slots byte move", "gather byte move", "transcode persistent"):
            assert any(label.startswith(kind) for label in labels), f"sm_{arch}: no {kind} kernel"
