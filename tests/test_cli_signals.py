"""`kvbridge convert` as real processes: SIGINT mid-convert and two converts racing for one output.

The child is the real command (``cli.main``) with ``kvbridge.dumps.dumpfile.CHUNK_BYTES`` set to 64 KiB, so
that a small dump takes hundreds of chunks and the signal or the second process lands while the
output's temp file exists.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import kvbridge as kb
from kvbridge.dumps.dumpfile import DumpEntry, read_dump
from kvbridge.dumps.writer import partial_path, write_dump

ROOT = Path(__file__).resolve().parent.parent
CHILD = (
    "import sys; import kvbridge.dumps.dumpfile as d; d.CHUNK_BYTES = 1 << 16; "
    "from cli.main import cli; cli(sys.argv[1:])"
)

pytestmark = pytest.mark.skipif(sys.platform == "win32", reason="POSIX signals")


@pytest.fixture(scope="module")
def dump(tmp_path_factory) -> Path:
    n = 16384
    x = (torch.randn(n, 512, generator=torch.Generator().manual_seed(5)) * 2).bfloat16()
    pages = kb.encode(x, "trtllm-fp8", page_size=64)
    path = tmp_path_factory.mktemp("src") / "trt.safetensors"
    return write_dump(path, [DumpEntry(0, "swa", pages, "trtllm-fp8", 64, n, 1.0, "swa")])


def convert(src: Path, out: Path) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.Popen([sys.executable, "-c", CHILD, "convert", str(src), str(out), "--to", "model1"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)


def test_two_racing_converts_exactly_one_wins(dump: Path, tmp_path: Path):
    out = tmp_path / "o.safetensors"
    procs = [convert(dump, out) for _ in range(2)]
    results = [(p.wait(timeout=300), p.stderr.read()) for p in procs]
    codes = sorted(rc for rc, _ in results)
    assert codes == [0, 1], results
    loser = next(err for rc, err in results if rc == 1)
    assert len(loser.strip().splitlines()) == 1 and str(out) in loser, loser
    assert sorted(p.name for p in tmp_path.iterdir()) == [out.name]  # no temp file left behind
    got = read_dump(out)["layer.0.swa"]
    want = kb.transcode(read_dump(dump)["layer.0.swa"].data, "trtllm-fp8", "model1", src_page_size=64)
    assert torch.equal(got.data, want)


def test_an_interrupt_as_the_temp_file_is_created_leaves_nothing_behind(tmp_path: Path, monkeypatch):
    """Ctrl-C landing just as ``os.open`` creates the temp file (before its descriptor is recorded,
    the window a loaded machine hits) is delivered once the writer can remove the file again."""
    import kvbridge.dumps.writer as writer_module

    real_open = os.open

    def open_then_interrupted(*args, **kwargs):
        fd = real_open(*args, **kwargs)
        signal.raise_signal(signal.SIGINT)
        return fd

    monkeypatch.setattr(writer_module.os, "open", open_then_interrupted)
    with pytest.raises(KeyboardInterrupt):
        writer_module.DumpWriter(tmp_path / "o.safetensors")
    monkeypatch.undo()
    assert sorted(p.name for p in tmp_path.iterdir()) == []
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_an_interrupt_before_the_with_block_leaves_nothing_behind(tmp_path: Path, monkeypatch):
    """Ctrl-C after the writer made its temp file but before the ``with`` block holds it (so no
    ``__exit__`` runs): the dropped writer removes the file."""
    import kvbridge.dumps.writer as writer_module

    def interrupted(self):
        signal.raise_signal(signal.SIGINT)
        return self

    monkeypatch.setattr(writer_module.DumpWriter, "__enter__", interrupted)
    entry = DumpEntry(0, "swa", torch.zeros(1, 64 * 512, dtype=torch.uint8), "trtllm-fp8", 64, 64, 1.0, "swa")
    with pytest.raises(KeyboardInterrupt):
        write_dump(tmp_path / "o.safetensors", [entry])
    assert sorted(p.name for p in tmp_path.iterdir()) == []


@pytest.mark.parametrize(("sig", "rc", "line"), [
    (signal.SIGINT, 130, "Error: interrupted"),
    (signal.SIGTERM, 128 + signal.SIGTERM, "Error: terminated (SIGTERM)"),
    (signal.SIGHUP, 128 + signal.SIGHUP, "Error: terminated (SIGHUP)"),
])
def test_a_signal_mid_convert_removes_the_temp_file(dump: Path, tmp_path: Path, sig: int, rc: int, line: str):
    """Ctrl-C (SIGINT), what ``timeout``, docker and systemd send (SIGTERM), and a closed terminal
    (SIGHUP): the hidden temp file is removed, one line, exit 130 / 128 + the signal's number."""
    out = tmp_path / "o.safetensors"
    proc = convert(dump, out)
    deadline = time.monotonic() + 120
    while not partial_path(out).exists() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.002)
    assert partial_path(out).exists(), f"the convert never wrote its temp file (rc {proc.poll()})"
    proc.send_signal(sig)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == rc, err
    assert err.strip().splitlines() == [line]
    assert sorted(p.name for p in tmp_path.iterdir()) == []


def test_force_replaces_only_a_regular_file(dump: Path, tmp_path: Path):
    """``--force`` onto a FIFO (or a device node, where this user may make one) is refused and the
    node stays what it was."""
    from click.testing import CliRunner

    from cli.main import cli

    nodes = [tmp_path / "fifo"]
    os.mkfifo(nodes[0])
    try:
        os.mknod(tmp_path / "null", 0o600 | 0o020000, os.makedev(1, 3))  # S_IFCHR: a copy of /dev/null
        nodes.append(tmp_path / "null")
    except (PermissionError, OSError):
        pass
    for node in nodes:
        mode = os.lstat(node).st_mode
        ran = CliRunner().invoke(cli, ["convert", str(dump), str(node), "--to", "model1", "--force"])
        assert ran.exit_code == 1 and "only a regular file is ever replaced" in ran.output, ran.output
        assert os.lstat(node).st_mode == mode
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(n.name for n in nodes)  # no temp file either


@pytest.mark.parametrize("command", ["inspect", "convert"])
def test_a_fifo_as_input_is_refused_at_once(tmp_path: Path, command: str):
    """A named pipe with no writer used to hang ``inspect`` and ``convert`` forever."""
    fifo = tmp_path / "in.safetensors"
    os.mkfifo(fifo)
    args = [str(fifo)] if command == "inspect" else [str(fifo), str(tmp_path / "out.safetensors"), "--to", "model1"]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    ran = subprocess.run([sys.executable, "-m", "cli.main", command, *args], capture_output=True, text=True,
                         env=env, timeout=120)
    assert ran.returncode == 1, ran.stderr
    assert ran.stderr.strip().splitlines() == [f"Error: {fifo}: is a named pipe (FIFO), not a regular file; a dump "
                                               "is read from a regular file (copy it to one first)"]
