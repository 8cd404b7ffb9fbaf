"""Where numba keeps the compiled native kernels: one per-user directory, never an error.

``configure()`` (run by ``import kvbridge``, before numba can be imported) picks the first
writable directory of

1. ``$KVBRIDGE_JIT_CACHE`` when set (an empty value, or ``off``, skips the on-disk cache);
2. ``$XDG_CACHE_HOME/kvbridge/numba``, else ``~/.cache/kvbridge/numba`` (only when the home
   directory exists: kvbridge never creates a home directory, nor ``.cache`` in a missing one);

and points numba at its subdirectory ``kernels-<fingerprint>`` (``NUMBA_CACHE_DIR``, also set on an
already imported numba). The fingerprint hashes the package's kernel sources (``KERNEL_SOURCES``):
numba checks a cached kernel only against the time stamp of its own file, not of the modules whose
functions it inlines (``native.loss`` inlines ``native.records``' decoder), so a cache written by other
sources is never read: an upgrade or an edit compiles afresh. A user's
own ``NUMBA_CACHE_DIR`` is respected when writable. When none of these can be written, the
kernels go to a fresh temporary directory (``$TMPDIR/kvbridge-numba-*``) for this process only
(they compile on each run, about 10-20 s), removed when the process exits (``atexit``; a killed
process leaves it), and when not even that can be written, numba's caching is turned off: an
unwritable cache costs a compile, never an error.
"""

from __future__ import annotations

import atexit
import hashlib
import os
import shutil
import sys
import tempfile
from pathlib import Path

#: Environment variable naming the cache directory (empty or ``off``: no on-disk cache).
CACHE_ENV = "KVBRIDGE_JIT_CACHE"
#: Set to the temporary cache directory of the process that made it: a child process that inherits
#: it as ``NUMBA_CACHE_DIR`` makes its own instead (the parent removes its directory at exit).
TEMP_ENV = "KVBRIDGE_JIT_TEMP"

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


def default_cache_dir() -> Path | None:
    """``$XDG_CACHE_HOME/kvbridge/numba``, else ``~/.cache/kvbridge/numba`` when the home directory
    exists (None: no home directory, so no default cache)."""
    xdg = os.environ.get("XDG_CACHE_HOME")
    if xdg:
        return Path(xdg) / "kvbridge" / "numba"
    home = os.path.expanduser("~")
    if home == "~" or not os.path.isdir(home):
        return None
    return Path(home) / ".cache" / "kvbridge" / "numba"


def _writable(path: Path, root: Path) -> bool:
    """Whether ``path`` is (made) a writable directory; only directories below an existing ``root``
    are created (mode 0700 for new ones, as the XDG spec asks)."""
    try:
        if not root.is_dir():
            root.mkdir(mode=0o700, parents=True)  # an explicitly named cache directory
        path.mkdir(mode=0o700, parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=path):
            pass
    except (OSError, ValueError):
        return False
    return True


def _candidates() -> list[tuple[Path, Path]]:
    """``(directory, root)`` pairs to try in order; see ``_writable``."""
    chosen = os.environ.get(CACHE_ENV)
    if chosen is not None:
        if chosen.strip().lower() in ("", "off"):
            return []
        return [(Path(chosen).expanduser(),) * 2]
    own = os.environ.get("NUMBA_CACHE_DIR")
    found = [(Path(own),) * 2] if own and own != os.environ.get(TEMP_ENV) else []
    default = default_cache_dir()
    if default is not None:
        xdg = os.environ.get("XDG_CACHE_HOME")
        found.append((default, Path(xdg) if xdg else default.parent.parent.parent))
    return found


def _temporary_dir() -> Path | None:
    """A fresh ``$TMPDIR/kvbridge-numba-*`` removed when this process exits (None: none can be made)."""
    try:
        path = tempfile.mkdtemp(prefix="kvbridge-numba-")
    except OSError:
        return None
    owner = os.getpid()

    def remove() -> None:
        if os.getpid() == owner:  # not from a forked child that inherited the handler
            shutil.rmtree(path, ignore_errors=True)

    atexit.register(remove)
    os.environ[TEMP_ENV] = path
    return Path(path)


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
    found = next((p / kernels for p, root in _candidates() if _writable(p / kernels, root)), None)
    if found is None and not off:
        found = _temporary_dir()
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
