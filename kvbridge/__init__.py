"""kvbridge: byte-exact DeepSeek-V4 KV-cache layouts, transcoding and migration between engines."""

from kvbridge.api import LossReport, auto_scale, decode, encode, transcode
from kvbridge.attention import sparse_decode
from kvbridge.conformance import identify_writer, run_conformance
from kvbridge.dump import Dump, DumpEntry, read_dump, write_dump
from kvbridge.errors import DumpFormatError, InputError, KVBridgeError, LayoutError, NonFiniteError
from kvbridge.layouts import Field, Layout, all_layouts, get_layout, register
from kvbridge.migration import migrate_local, plan_migration
from kvbridge.paged import gather_transcode, transcode_slots

__version__ = "0.1.0"

__all__ = [
    "Dump",
    "DumpEntry",
    "DumpFormatError",
    "Field",
    "InputError",
    "KVBridgeError",
    "Layout",
    "LayoutError",
    "LossReport",
    "NonFiniteError",
    "__version__",
    "all_layouts",
    "auto_scale",
    "decode",
    "encode",
    "gather_transcode",
    "get_layout",
    "identify_writer",
    "migrate_local",
    "plan_migration",
    "read_dump",
    "register",
    "run_conformance",
    "sparse_decode",
    "transcode",
    "transcode_slots",
    "write_dump",
]
