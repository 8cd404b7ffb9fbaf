"""kvbridge: byte-exact DeepSeek-V4 KV-cache layouts, transcoding and migration between engines.

The public names below are imported on first use (``kvbridge.encode`` loads torch then), so
that ``import kvbridge`` itself, and ``kvbridge --help``, stay cheap. The numba JIT cache
location is set here, before anything can import numba (see ``kvbridge.jitcache``).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from kvbridge import jitcache
from kvbridge._version import __version__  # noqa: F401  (the public version)

jitcache.configure()


#: Public name -> module that defines it.
_EXPORTS = {
    "LossReport": "kvbridge.ops.loss",
    "auto_scale": "kvbridge.ops.pages",
    "decode": "kvbridge.ops.pages",
    "encode": "kvbridge.ops.pages",
    "transcode": "kvbridge.ops.pages",
    "sparse_decode": "kvbridge.attention.sparse",
    "identify_writer": "kvbridge.conformance",
    "run_conformance": "kvbridge.conformance",
    "Dump": "kvbridge.dumps.dumpfile",
    "DumpEntry": "kvbridge.dumps.dumpfile",
    "read_dump": "kvbridge.dumps.dumpfile",
    "write_dump": "kvbridge.dumps.writer",
    "CopyMismatchError": "kvbridge.errors",
    "DumpFormatError": "kvbridge.errors",
    "InputError": "kvbridge.errors",
    "KVBridgeError": "kvbridge.errors",
    "LayoutError": "kvbridge.errors",
    "NonFiniteError": "kvbridge.errors",
    "OutputBufferError": "kvbridge.errors",
    "Field": "kvbridge.layouts",
    "Layout": "kvbridge.layouts",
    "all_layouts": "kvbridge.layouts",
    "get_layout": "kvbridge.layouts",
    "register": "kvbridge.layouts",
    "migrate_local": "kvbridge.migration",
    "plan_migration": "kvbridge.migration",
    "gather_transcode": "kvbridge.ops.slots",
    "transcode_slots": "kvbridge.ops.slots",
}

__all__ = sorted([*_EXPORTS, "__version__"])

if TYPE_CHECKING:
    from kvbridge.attention.sparse import sparse_decode  # noqa: F401
    from kvbridge.conformance import identify_writer, run_conformance  # noqa: F401
    from kvbridge.dumps.dumpfile import Dump, DumpEntry, read_dump  # noqa: F401
    from kvbridge.dumps.writer import write_dump  # noqa: F401
    from kvbridge.errors import (  # noqa: F401
        CopyMismatchError,
        DumpFormatError,
        InputError,
        KVBridgeError,
        LayoutError,
        NonFiniteError,
        OutputBufferError,
    )
    from kvbridge.layouts import Field, Layout, all_layouts, get_layout, register  # noqa: F401
    from kvbridge.migration import migrate_local, plan_migration  # noqa: F401
    from kvbridge.ops.loss import LossReport  # noqa: F401
    from kvbridge.ops.pages import auto_scale, decode, encode, transcode  # noqa: F401
    from kvbridge.ops.slots import gather_transcode, transcode_slots  # noqa: F401


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'kvbridge' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_EXPORTS])
