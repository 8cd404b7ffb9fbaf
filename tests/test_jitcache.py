"""Where kvbridge may create its kernel cache: never a missing home directory or its ``.cache``, and
a temporary fallback directory is removed when the process exits. Each case is a real process that
imports kvbridge and encodes a few tokens, with HOME and TMPDIR pointed at fresh directories."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from kvbridge import jitcache

ROOT = Path(__file__).resolve().parent.parent
ENCODE = (
    "import torch, kvbridge\nfrom kvbridge import jitcache\n"
    "x = torch.tensor([1.0, 2.0, -0.5, 0.0]).repeat(8, 128).bfloat16()  # exact in MODEL1's tiles\n"
    "pages = kvbridge.encode(x, 'model1', page_size=4)\n"
    "back = kvbridge.decode(pages, 'model1', page_size=4, num_tokens=8)\n"
    "print(jitcache.cache_dir, jitcache.cache_dir is not None and jitcache.cache_dir.is_dir(), "
    "bool((back == x.float()).all()))\n"
)
#: Variables that would choose the cache themselves.
CHOOSERS = ("KVBRIDGE_JIT_CACHE", "NUMBA_CACHE_DIR", "XDG_CACHE_HOME", jitcache.TEMP_ENV, "TMPDIR")


def encode_in_process(home: str, tmpdir: Path, **extra: str) -> tuple[str, bool, bool]:
    """(cache dir, whether it existed during the run, whether the encode round-tripped) of a child."""
    env = {k: v for k, v in os.environ.items() if k not in CHOOSERS}
    env.update(HOME=home, TMPDIR=str(tmpdir), PYTHONPATH=str(ROOT), **extra)
    done = subprocess.run([sys.executable, "-c", ENCODE], capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode == 0, done.stderr
    where, existed, exact = done.stdout.split()
    return where, existed == "True", exact == "True"


def test_missing_home_is_never_created_and_the_temporary_cache_is_removed(tmp_path: Path):
    home, tmpdir = tmp_path / "no-such-home", tmp_path / "tmp"
    tmpdir.mkdir()
    where, existed, exact = encode_in_process(str(home), tmpdir)
    assert exact and existed and Path(where).parent == tmpdir and Path(where).name.startswith("kvbridge-numba-")
    assert not home.exists()
    assert list(tmpdir.iterdir()) == []  # removed at exit


def test_read_only_home_gets_nothing_and_the_temporary_cache_is_removed(tmp_path: Path):
    """As root every mode bit is writable, so root's read-only home is /proc (no one can create there)."""
    tmpdir = tmp_path / "tmp"
    tmpdir.mkdir()
    if os.geteuid() == 0:
        home = Path("/proc")
    else:
        home = tmp_path / "home"
        home.mkdir()
        home.chmod(0o555)
    before = sorted(p.name for p in home.iterdir()) if home != Path("/proc") else None
    try:
        where, existed, exact = encode_in_process(str(home), tmpdir)
    finally:
        if home != Path("/proc"):
            home.chmod(0o755)
    assert exact and existed and Path(where).parent == tmpdir
    assert not (home / ".cache").exists()
    if before is not None:
        assert sorted(p.name for p in home.iterdir()) == before
    assert list(tmpdir.iterdir()) == []


def test_existing_home_gets_its_cache_and_tmpdir_stays_empty(tmp_path: Path):
    home, tmpdir = tmp_path / "home", tmp_path / "tmp"
    home.mkdir()
    tmpdir.mkdir()
    where, existed, exact = encode_in_process(str(home), tmpdir)
    kernels = f"kernels-{jitcache.sources_fingerprint()}"
    assert exact and existed and where == str(home / ".cache/kvbridge/numba" / kernels)
    assert list(tmpdir.iterdir()) == []


def test_xdg_cache_home_and_the_override_are_created_when_named(tmp_path: Path):
    """An explicitly named cache directory is created (with its parents); HOME is not touched."""
    home, tmpdir = tmp_path / "no-such-home", tmp_path / "tmp"
    tmpdir.mkdir()
    kernels = f"kernels-{jitcache.sources_fingerprint()}"
    where, existed, _ = encode_in_process(str(home), tmpdir, XDG_CACHE_HOME=str(tmp_path / "a/xdg"))
    assert existed and where == str(tmp_path / "a/xdg/kvbridge/numba" / kernels)
    where, existed, _ = encode_in_process(str(home), tmpdir, KVBRIDGE_JIT_CACHE=str(tmp_path / "b/mine"))
    assert existed and where == str(tmp_path / "b/mine" / kernels)
    assert not home.exists() and list(tmpdir.iterdir()) == []


def test_a_child_does_not_reuse_its_parents_temporary_cache(tmp_path: Path):
    """A child inheriting the parent's temporary ``NUMBA_CACHE_DIR`` makes (and removes) its own:
    the parent's is removed when the parent exits, under a child that may still run."""
    tmpdir = tmp_path / "tmp"
    tmpdir.mkdir()
    parent = tmpdir / "kvbridge-numba-parent"
    parent.mkdir()
    where, existed, _ = encode_in_process(str(tmp_path / "no-such-home"), tmpdir, NUMBA_CACHE_DIR=str(parent),
                                          **{jitcache.TEMP_ENV: str(parent)})
    assert existed and Path(where).parent == tmpdir and Path(where) != parent
    assert list(tmpdir.iterdir()) == [parent]  # the child's own is gone; the parent's is the parent's to remove
