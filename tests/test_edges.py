"""Sharp edges of issue 24: a byte move scans at the actual per-tensor scale, meta tensors are refused
with a ``KVBridgeError``."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

import kvbridge as kb
from kvbridge.dumps.dumpfile import DumpEntry
from kvbridge.dumps.writer import write_dump
from kvbridge.errors import KVBridgeError, NonFiniteError

SCALE = 3e38  # finite, but most e4m3 codes times it overflow fp32


def _pages(n: int = 100) -> torch.Tensor:
    x = torch.randn(n, 512, generator=torch.Generator().manual_seed(2))
    return kb.encode(x, "trtllm-fp8", page_size=64, scale=1.0)


def test_same_scale_repage_at_an_overflowing_scale_is_refused():
    pages = _pages()
    values = kb.decode(pages, "trtllm-fp8", page_size=64, num_tokens=100, scale=SCALE)
    bad = int((~torch.isfinite(values)).sum())
    assert bad > 0
    with pytest.raises(NonFiniteError, match=f"holds {bad} non-finite"):
        kb.transcode(pages, "trtllm-fp8", "trtllm-fp8", src_page_size=64, dst_page_size=32, num_tokens=100,
                     src_scale=SCALE, dst_scale=SCALE)
    same = kb.transcode(pages, "trtllm-fp8", "trtllm-fp8", src_page_size=64, dst_page_size=32, num_tokens=100,
                        src_scale=2.0, dst_scale=2.0)  # a scale that cannot overflow: still a byte move
    assert torch.equal(kb.decode(same, "trtllm-fp8", page_size=32, num_tokens=100, scale=2.0),
                       kb.decode(pages, "trtllm-fp8", page_size=64, num_tokens=100, scale=2.0))


@pytest.mark.parametrize("to", [["--to", "trtllm-fp8", "--page-size", "32", "--scale", "auto"], ["--to", "model1"]])
def test_convert_refuses_a_dump_that_decodes_to_inf_byte_move_included(tmp_path, to):
    from cli.main import cli

    src = write_dump(tmp_path / "in.safetensors", [DumpEntry(0, "swa", _pages(), "trtllm-fp8", 64, 100, SCALE)])
    ran = CliRunner().invoke(cli, ["convert", str(src), str(tmp_path / "out.safetensors"), *to])
    assert ran.exit_code == 1, ran.output
    assert "non-finite" in ran.output
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in.safetensors"]


def test_meta_tensors_raise_a_kvbridge_error():
    page_bytes = kb.get_layout("trtllm-fp8").page_bytes(64)
    meta_pages = torch.empty(1, page_bytes, dtype=torch.uint8, device="meta")
    calls = [lambda: kb.encode(torch.empty(4, 512, device="meta"), "model1", page_size=64),
             lambda: kb.transcode(meta_pages, "trtllm-fp8", "model1", src_page_size=64),
             lambda: kb.transcode(meta_pages, "trtllm-fp8", "trtllm-fp8", src_page_size=64, dst_page_size=32),
             lambda: kb.decode(meta_pages, "trtllm-fp8", page_size=64)]
    for call in calls:
        with pytest.raises(KVBridgeError, match="on meta"):
            call()


def test_without_the_c_extension_one_warning_line():
    """No C compiler at install time: the fallback to numba is one warning line, not Python's two."""
    child = ("import sys, importlib.abc\n"
             "class Hide(importlib.abc.MetaPathFinder):\n"
             "    def find_spec(self, name, path=None, target=None):\n"
             "        if name == 'kvbridge.backends.native._kernels':\n"
             "            raise ImportError(name)\n"
             "sys.meta_path.insert(0, Hide())\n"
             "import kvbridge.backends.native\n")
    env = {k: v for k, v in os.environ.items() if k != "KVBRIDGE_NO_CKERNELS"}
    ran = subprocess.run([sys.executable, "-c", child], capture_output=True, text=True, timeout=300, env=env,
                         cwd=Path(__file__).resolve().parents[1])
    assert ran.returncode == 0, ran.stderr
    lines = ran.stderr.strip().splitlines()
    assert len(lines) == 1 and "compiled kernels" in lines[0] and "not built" in lines[0], ran.stderr


def test_migrate_plan_without_ape_weights_shows_sizes_and_says_what_is_missing():
    from cli.main import cli

    args = ["migrate", "plan", "--from", "sglang", "--to", "vllm", "--tokens", "1000"]
    bare = CliRunner().invoke(cli, args)
    assert bare.exit_code == 0, bare.output
    assert "needs the model's APE weights" in " ".join(bare.output.split())
    synthetic = CliRunner().invoke(cli, [*args, "--ape", "synthetic", "--json"])
    assert synthetic.exit_code == 0, synthetic.output
    sized = CliRunner().invoke(cli, [*args, "--json"])
    with_weights, without = json.loads(synthetic.output), json.loads(sized.output)
    assert without["totals"] == with_weights["totals"] and "ape_sha256" in with_weights and "ape_sha256" not in without
    mixed = CliRunner().invoke(cli, [*args, "--ape", "synthetic", "--ape", "x.safetensors"])
    assert mixed.exit_code == 2 and "stands alone" in mixed.output
