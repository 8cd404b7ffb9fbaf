#!/usr/bin/env python3
"""Write ``fixtures/flashmla_interface.json``: the facts of an ``sgl-flash-mla`` wheel's decode interface.

    pip download --no-deps sgl-flash-mla==1.0.0 -d /tmp/wheels
    python scripts/flashmla_interface.py /tmp/wheels/sgl_flash_mla-1.0.0-*.whl > fixtures/flashmla_interface.json

Nothing is imported or executed from the wheel (it needs CUDA and torch>=2.14.1): the Python interface
file is parsed with ``ast`` (function names, parameter names, order, defaults), the package's
``__all__`` and ``has_legacy`` are read the same way, and the accepted ``kv_format`` values and the
architectures each extension's sparse decode runs on are read from the extensions' error strings.
The dtype facts are the interface docstring's statements, checked here to be present in it.
"""

from __future__ import annotations

import ast
import hashlib
import json
import re
import sys
import zipfile
from pathlib import Path

INTERFACE = "flash_mla/flash_mla_interface.py"
#: Statements of the ``flash_mla_with_kvcache`` docstring this script records (each must occur verbatim).
DOC_FACTS = {
    "q": ("q: (batch_size, seq_len_q, num_heads_q, head_dim). bfloat16", {"dtype": "bfloat16", "head_dim": 512,
                                                                        "num_heads": [64, 128]}),
    "k_cache": ("dtype must be torch.float8_e4m3fn, torch.int8 or torch.uint8",
                {"dtypes": ["float8_e4m3fn", "int8", "uint8"], "num_heads_k": 1,
                 "shape": ["num_blocks", "page_block_size", "num_heads_k", "bytes_per_token"]}),
    "indices": ("indices: (batch_size, seq_len_q, topk)", {"dtype": "int32", "invalid": -1}),
    "attn_sink": ("attn_sink: Optional[torch.Tensor], (num_heads_q, ), torch.float32", {"dtype": "float32"}),
    "topk_length": ("topk_length/extra_topk_length: (batch_size, ), torch.int32", {"dtype": "int32"}),
    "head_dim_v": ("head_dim_v: Head_dim of v. Must be 512", {"value": 512}),
    "num_splits": ("num_splits: must be None", {"value": None}),
    "causal": ("causal: bool. Must be False", {"value": False}),
    "current_formats": ("528 (V4.1 fp8) or 288 (V4.1 fp4, only valid for an extra cache next to a V4.1 fp8 main "
                        "cache)", {"main_bytes_per_token": [528], "extra_bytes_per_token": [528, 288]}),
}


def _parameters(fn: ast.FunctionDef) -> list[dict]:
    """Parameter names in order, with their default (as a Python literal) or ``required``."""
    args = fn.args
    plain = args.posonlyargs + args.args
    defaults = [None] * (len(plain) - len(args.defaults)) + list(args.defaults)
    out = [{"name": a.arg, "required": d is None, **({} if d is None else {"default": ast.literal_eval(d)})}
           for a, d in zip(plain, defaults, strict=True)]
    if args.vararg:
        out.append({"name": "*" + args.vararg.arg, "required": False})
    out += [{"name": a.arg, "required": d is None, **({} if d is None else {"default": ast.literal_eval(d)})}
            for a, d in zip(args.kwonlyargs, args.kw_defaults, strict=True)]
    if args.kwarg:
        out.append({"name": "**" + args.kwarg.arg, "required": False})
    return out


def _strings(blob: bytes) -> str:
    return "\n".join(s.decode() for s in re.findall(rb"[\x20-\x7e]{6,}", blob))


def extract(wheel: Path) -> dict:
    with zipfile.ZipFile(wheel) as zf:
        names = zf.namelist()
        source = zf.read(INTERFACE).decode()
        init = ast.parse(zf.read("flash_mla/__init__.py").decode())
        loader = ast.parse(zf.read("flash_mla/_loader.py").decode())
        version = zf.read("flash_mla/VERSION").decode().strip()
        current = _strings(zf.read(next(n for n in names if n.startswith("flash_mla/cuda."))))
        legacy = _strings(zf.read(next(n for n in names if n.startswith("flash_mla/_C_legacy."))))
    tree = ast.parse(source)
    funcs = {n.name: n for n in tree.body if isinstance(n, ast.FunctionDef)}
    exports = next(ast.literal_eval(n.value) for n in init.body if isinstance(n, ast.Assign)
                   and any(isinstance(t, ast.Name) and t.id == "__all__" for t in n.targets))
    loader_funcs = {n.name: n for n in loader.body if isinstance(n, ast.FunctionDef)}
    doc = ast.get_docstring(funcs["flash_mla_with_kvcache"]) or ""
    facts = {}
    for key, (statement, value) in DOC_FACTS.items():
        if statement not in " ".join(doc.split()):
            raise SystemExit(f"the interface docstring no longer says: {statement!r}")
        facts[key] = value
    formats = re.search(r"Expected one of ([A-Z0-9_, ]+)", legacy)
    if formats is None:
        raise SystemExit("no kv_format list in the legacy extension")
    return {
        "package": "sgl-flash-mla", "version": version, "wheel": wheel.name,
        "sha256": hashlib.sha256(wheel.read_bytes()).hexdigest(),
        "exports": exports,
        "has_legacy": {"kind": "function", "parameters": _parameters(loader_funcs["has_legacy"])},
        "get_mla_metadata": {"parameters": _parameters(funcs["get_mla_metadata"]),
                             "returns": ["FlashMLASchedMeta", None]},
        "flash_mla_with_kvcache": {"parameters": _parameters(funcs["flash_mla_with_kvcache"]), "arguments": facts},
        "kernels": {
            "current": {"use_legacy": False, "kv_format": [None], "formats_from": "k_cache.shape[-1]",
                        "arch": ["sm100f"] if "only supported on SM100f" in current else [],
                        "main_not_fp4": "model_type != ModelType::V41_FP4" in current},
            "legacy": {"use_legacy": True, "kv_format": [None] + [f.strip() for f in formats.group(1).split(",")],
                       "arch": ["sm90a", "sm100f"] if "is_sm90a || is_sm100f" in legacy else [],
                       "needs": "has_legacy()"},
        },
    }


if __name__ == "__main__":
    json.dump(extract(Path(sys.argv[1])), sys.stdout, indent=1)
    sys.stdout.write("\n")
