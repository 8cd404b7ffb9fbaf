"""Where numba keeps the compiled native kernels: one per-user directory, never an error.

``configure()`` (run by ``import kvbridge``, before numba can be imported) picks the first
writable directory of

1. ``$KVBRIDGE_JIT_CACHE`` when set (an empty value, or ``off``, skips the on-disk cache);
2. ``$XDG_CACHE_HOME/kvbridge/numba``, else ``~/.cache/kvbridge/numba``;

and points numba at its subdirectory ``kernels-<fingerprint>`` (``NUMBA_CACHE_DIR``, also set on an
already imported numba). The fingerprint hashes the package's kernel sources (``KERNEL_SOURCES``):
numba checks a cached kernel only against the time stamp of its own file, not of the modules whose
functions it inlines (``native.loss`` inlines ``native.records``' decoder), so a cache written by other
sources is never read: an upgrade or an edit compiles afresh. A user's
own ``NUMBA_CACHE_DIR`` is respected when writable. When none of these can be written, the
kernels go to a fresh temporary directory for this process only (they compile on each run,
about 10-20 s), and when not even that can be written, numba's caching is turned off: an
unwritable cache costs a compile, never an error.
"""

from __future__ import annotations

import hashlib
import os
import sys
import tempfile
from pathlib import Path

#: Environment variable naming the cache directory (empty or ``off``: no on-disk cache).
CACHE_ENV = "KVBRIDGE_JIT_CACHE"

#: The directory in use after ``configure()``, or None when kernels are not cached on disk.
cache_dir: Path | None = None
_configured = False
#: The package's files whose code the numba kernels run or inline (relative to the package).
KERNEL_SOURCES = ("numerics.py", "layouts", "backends")


def sources_fingerprint(root: Path | None = None) -> str:
    """12 hex digits of sha256 over ``KERNEL_SOURCES`` of the package at ``root`` (default: this one),
    each file's relative path and bytes, in name order."""
    root = Path(__file__).resolve().parent if root is None else root
    digest = hashlib.sha256()
    for entry in KERNEL_SOURCES:
        base = root / entry
        for path in sorted(base.rglob("*.py")) if base.is_dir() else [base]:
            digest.update(str(path.relative_to(root)).encode())
            digest.update(path.read_bytes())
    return digest.hexdigest()[:12]


def default_cache_dir() -> Path:
    """``$XDG_CACHE_HOME/kvbridge/numba``, else ``~/.cache/kvbridge/numba``."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "kvbridge" / "numba"


def _writable(path: Path) -> bool:
    try:
        path.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=path):
            pass
    except (OSError, ValueError):
        return False
    return True


def _candidates() -> list[Path]:
    chosen = os.environ.get(CACHE_ENV)
    if chosen is not None:
        return [] if chosen.strip().lower() in ("", "off") else [Path(chosen).expanduser()]
    own = os.environ.get("NUMBA_CACHE_DIR")
    return ([Path(own)] if own else []) + [default_cache_dir()]


def _disable_numba_caching(always: bool) -> None:
    """Make ``@njit(cache=True)`` compile without an on-disk cache: ``always``, or when numba
    finds no usable location (instead of raising)."""
    from numba.core import caching, dispatcher

    original = dispatcher.Dispatcher.enable_caching
    if getattr(original, "_kvbridge", False):
        return

    def enable_caching(self) -> None:
        if always:
            self._cache = caching.NullCache()
            return
        try:
            original(self)
        except RuntimeError:  # "cannot cache function ...: no locator available"
            self._cache = caching.NullCache()

    enable_caching._kvbridge = True  # type: ignore[attr-defined]
    dispatcher.Dispatcher.enable_caching = enable_caching


def configure() -> Path | None:
    """Choose the cache directory (see the module doc) once per process; return it (None: no cache)."""
    global cache_dir, _configured
    if _configured:
        return cache_dir
    _configured = True
    off = os.environ.get(CACHE_ENV, "x").strip().lower() in ("", "off")
    kernels = f"kernels-{sources_fingerprint()}"
    found = next((p / kernels for p in _candidates() if _writable(p / kernels)), None)
    if found is None and not off:
        try:
            found = Path(tempfile.mkdtemp(prefix="kvbridge-numba-"))
        except OSError:
            found = None
    cache_dir = found
    if found is not None:
        os.environ["NUMBA_CACHE_DIR"] = str(found)
        if "numba" in sys.modules:
            sys.modules["numba"].config.CACHE_DIR = str(found)
    else:
        os.environ.pop("NUMBA_CACHE_DIR", None)
        if "numba" in sys.modules:
            sys.modules["numba"].config.CACHE_DIR = ""
    if found is None:
        try:
            _disable_numba_caching(always=off)
        except ImportError:  # numba is a dependency; without it there is nothing to cache
            pass
    return found
