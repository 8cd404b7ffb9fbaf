"""Seeded fuzzing: crafted dump files and public-API arguments raise ``KVBridgeError`` or work, never
another exception type.

Dump cases mutate a small valid version-3 dump (header JSON values, safetensors tensor entries,
byte flips in the header or the data, truncation, trailing bytes) and run ``read_dump``,
``inspect``'s streamed statistics and ``convert_dump`` on it; a flipped data byte must be caught
by the entry's checksum, a changed header byte or a header cut short by the header checksum
(``DumpHeaderError``). Half the JSON mutations are re-signed (a matching header checksum, as a
writer with a bug would make) so that the field validation behind the checksum is fuzzed too.
API cases call the public functions with values drawn from a pool of wrong
types, sizes and tensors. ``KVBRIDGE_FUZZ_CASES`` sets the case count of each test (CI's default
keeps the file well under a minute); ``KVBRIDGE_FUZZ_SEED`` the seed.
"""

from __future__ import annotations

import json
import math
import os
import random
import struct
from pathlib import Path

import pytest
import torch

import kvbridge as kb
from kvbridge.dumps.convert import convert_dump
from kvbridge.dumps.dumpfile import DumpEntry, open_dump, read_dump
from kvbridge.dumps.stats import dump_stats
from kvbridge.dumps.writer import write_dump
from kvbridge.engines.topology import FLASH
from kvbridge.errors import DumpFormatError, DumpHeaderError, KVBridgeError
from kvbridge.migration import destination_pools, migrate_local, plan_migration, source_request
from tests.dump_helpers import signed_dump

CASES = int(os.environ.get("KVBRIDGE_FUZZ_CASES", "2000"))
SEED = int(os.environ.get("KVBRIDGE_FUZZ_SEED", "20261201"))

#: JSON values a crafted header may hold in any field.
JSON_VALUES = [
    None, True, False, 0, -1, -7, 1, 2, 3, 64, 2**31, 2**63, 2**64 + 1, 10**400, -(10**30), 0.5, 10.5, -0.0, 1e-50,
    1e38, 1e39, 3.5e38, "1e400", "10", "", "x" * 300, "model1", "trtllm-fp8", "latents", "pages", "swa", "U8",
    "BF16", [], [1], [1, 2], ["a", "b"], [[1, 2]], [2**70, 1], [-1, 3], {}, {"a": 1}, {"dtype": "U8"},
]
#: Raw JSON texts that Python would not produce (overflowing floats, huge integers, deep nesting).
RAW_JSON = ["1e400", "-1e400", "9" * 5000, "[" * 3000 + "]" * 3000, "NaN", "Infinity", "1" + "0" * 400]


def sample_entries() -> list[DumpEntry]:
    g = torch.Generator().manual_seed(3)
    x = (torch.randn(20, 512, generator=g) * 2).bfloat16()
    return [
        DumpEntry(0, "swa", kb.encode(x, "trtllm-fp8", page_size=8, scale=0.5), "trtllm-fp8", 8, 20, 0.5, "swa"),
        DumpEntry(1, "compress", kb.encode(x[:9], "model1", page_size=4), "model1", 4, 9, dialect="flashmla",
                  compress_ratio=4),
        DumpEntry(2, "kv", x[:5].clone()),
    ]


@pytest.fixture(scope="module")
def good_dump(tmp_path_factory) -> bytes:
    path = tmp_path_factory.mktemp("fuzz") / "good.safetensors"
    write_dump(path, sample_entries())
    return path.read_bytes()


def split_dump(raw: bytes) -> tuple[dict, bytes]:
    (n,) = struct.unpack("<Q", raw[:8])
    return json.loads(raw[8 : 8 + n]), raw[8 + n :]


def join_dump(rng: random.Random, header: object, data: bytes, raw_json: bool) -> bytes:
    """``header`` and ``data`` as a dump: re-signed half the time, else with the header as it is
    (a header checksum that no longer matches); ``raw_json``: a number replaced by a raw JSON text."""
    if not raw_json and rng.random() < 0.5:
        return signed_dump(header, data)
    text = json.dumps(header)
    if raw_json:
        text = text.replace("[0,", "[" + rng.choice(RAW_JSON) + ",", 1)
    body = text.encode()
    return struct.pack("<Q", len(body)) + body + data


def mutate_value(rng: random.Random, obj, depth: int = 0):
    """``obj`` with one value somewhere replaced, removed, or added."""
    if isinstance(obj, dict) and obj and depth < 4 and rng.random() < 0.7:
        key = rng.choice(sorted(obj, key=str))
        out = dict(obj)
        roll = rng.random()
        if roll < 0.15:
            out.pop(key)
        elif roll < 0.25:
            out[rng.choice(["colour", "crc32", "name", "layout", "scale"])] = rng.choice(JSON_VALUES)
        else:
            out[key] = mutate_value(rng, obj[key], depth + 1)
        return out
    if isinstance(obj, list) and obj and depth < 4 and rng.random() < 0.7:
        out = list(obj)
        i = rng.randrange(len(out))
        if rng.random() < 0.2:
            out.pop(i)
        elif rng.random() < 0.2:
            out.append(out[i])
        else:
            out[i] = mutate_value(rng, out[i], depth + 1)
        return out
    return rng.choice(JSON_VALUES)


def crafted_dump(rng: random.Random, good: bytes) -> tuple[bytes, str]:
    """A mutation of ``good`` and its kind (``data`` flips must fail on the checksum)."""
    header, data = split_dump(good)
    roll = rng.random()
    if roll < 0.3:  # the kvbridge header: one value of the entries list or the metadata
        meta = dict(header["__metadata__"])
        if rng.random() < 0.75:
            entries = mutate_value(rng, json.loads(meta["entries"]))
            text = json.dumps(entries)
            if rng.random() < 0.2:
                text = text.replace("0.5", rng.choice(RAW_JSON), 1)
            meta["entries"] = text
        else:
            key = rng.choice(["format", "version", "entries", "created_by"])
            meta[key] = str(rng.choice(JSON_VALUES)) if rng.random() < 0.5 else rng.choice(RAW_JSON)
        header["__metadata__"] = meta
        return join_dump(rng, header, data, raw_json=False), "header"
    if roll < 0.5:  # the safetensors part: a tensor's dtype, shape or offsets
        header = mutate_value(rng, header)
        return join_dump(rng, header, data, raw_json=rng.random() < 0.2), "header"
    if roll < 0.75:  # flipped data bytes
        buf = bytearray(data)
        for _ in range(rng.randint(1, 4)):
            i = rng.randrange(len(buf))
            buf[i] ^= rng.randint(1, 255)
        n = len(good) - len(data)
        return good[:n] + bytes(buf), "data"
    if roll < 0.9:  # flipped header bytes
        buf = bytearray(good)
        for _ in range(rng.randint(1, 3)):
            i = rng.randrange(min(len(buf), len(good) - len(data)))
            buf[i] = rng.randrange(256)
        return bytes(buf), "bytes"
    cut = rng.randrange(len(good))
    return (good[:cut] if rng.random() < 0.7 else good + bytes(rng.randint(1, 9))), "size"


def only_kvbridge_errors(fn, *args, **kwargs):
    """Run ``fn``; a ``KVBridgeError`` is returned, any other exception fails the test."""
    try:
        fn(*args, **kwargs)
    except KVBridgeError as exc:
        assert "\n" not in str(exc), str(exc)
        return exc
    return None


def test_fuzzed_dump_files_raise_only_kvbridge_errors(good_dump: bytes, tmp_path: Path):
    rng = random.Random(SEED)
    path, out = tmp_path / "fuzz.safetensors", tmp_path / "out.safetensors"
    kinds: dict[str, int] = {}
    for case in range(CASES):
        raw, kind = crafted_dump(rng, good_dump)
        kinds[kind] = kinds.get(kind, 0) + 1
        path.write_bytes(raw)
        err = only_kvbridge_errors(read_dump, path)
        if kind == "data":
            assert isinstance(err, DumpFormatError) and "checksum mismatch" in str(err), (case, err)
        header_end = 8 + struct.unpack("<Q", good_dump[:8])[0]
        if (kind == "bytes" and raw != good_dump) or (kind == "size" and 8 <= len(raw) < header_end):
            assert isinstance(err, DumpHeaderError), (case, kind, err)

        def stats() -> None:
            with open_dump(path) as fh:
                dump_stats(fh)

        only_kvbridge_errors(stats)
        target = rng.choice(["model1", "trtllm-fp8", "trtllm-fp8-ds-mla", "bf16"])
        only_kvbridge_errors(convert_dump, path, out, target, page_size=rng.choice([None, 4, 8]),
                             scale=rng.choice([None, "auto"]) if target == "trtllm-fp8" else None, overwrite=True)
        leftovers = [p.name for p in tmp_path.iterdir() if p.name not in ("fuzz.safetensors", "out.safetensors")]
        assert not leftovers, (case, leftovers)
    assert set(kinds) == {"header", "data", "bytes", "size"}


def weird_values(rng: random.Random, like: object = None) -> object:
    """A value from a pool of wrong types and sizes (sometimes a tensor close to a right one)."""
    pool: list = [None, True, 0, -1, -7, 3, 10.5, "10", "model1", 2**40, 2**64, math.nan, math.inf, -math.inf, 1e-50,
                  1e308, [1, 2], {"a": 1}, (), b"x", object()]
    tensors = [
        torch.zeros(0, 512), torch.zeros(3, 512, dtype=torch.int32), torch.zeros(4, 511),
        torch.full((2, 512), math.nan), torch.zeros(2, 512, requires_grad=True), torch.zeros(3, 584, dtype=torch.uint8),
        torch.zeros(2, 37440, dtype=torch.uint8), torch.zeros(5, dtype=torch.int64), torch.tensor([-1, 7, 2**40]),
        torch.zeros(1, 1, 8, 512, dtype=torch.bfloat16), torch.zeros(0, 1, 8, 512, dtype=torch.bfloat16),
        torch.zeros(1, 1, 4, dtype=torch.int32), torch.zeros(2, 4096, dtype=torch.uint8)[:, ::2],
    ]
    if isinstance(like, torch.Tensor) and rng.random() < 0.5:
        t = like.clone()
        if t.numel() and rng.random() < 0.5:
            if t.dtype == torch.uint8:
                value = rng.choice([0x7F, 0xFF, 0xFE])
            elif t.dtype.is_floating_point:
                value = rng.choice([math.nan, math.inf, 1e30])
            else:
                value = rng.choice([-1, -7, 2**20, 2**31 - 1])
            t.view(-1)[rng.randrange(t.numel())] = value
        return t
    return rng.choice(pool + tensors)


def api_calls(x: torch.Tensor, m1: torch.Tensor, trt: torch.Tensor):
    """(name, function, valid keyword arguments) of every public entry point fuzzed."""
    slots = torch.tensor([0, 3, 5])
    return [
        ("encode", kb.encode, {"x": x, "layout": "model1", "page_size": 4, "dialect": None, "scale": None,
                               "nonfinite": "error"}),
        ("decode", kb.decode, {"pages": m1, "layout": "model1", "page_size": 4, "num_tokens": 10, "scale": None}),
        ("transcode", kb.transcode, {"pages": trt, "src_layout": "trtllm-fp8", "dst_layout": "model1",
                                     "src_page_size": 4, "dst_page_size": 8, "num_tokens": 10, "src_scale": 1.0,
                                     "dst_scale": None, "dialect": None, "report": True, "out": None}),
        ("transcode_slots", kb.transcode_slots, {
            "src_pages": m1, "src_layout": "model1", "dst_pages": torch.zeros_like(trt), "dst_layout": "trtllm-fp8",
            "src_page_size": 4, "dst_page_size": 4, "src_slots": slots, "dst_slots": slots.clone(),
            "src_scale": None, "dst_scale": None, "dialect": None}),
        ("gather_transcode", kb.gather_transcode, {"pool": trt, "layout": "trtllm-fp8", "page_size": 4,
                                                   "indices": torch.tensor([[0, 5, -1]]), "scale": 1.0,
                                                   "dialect": None, "out_page_size": 64}),
        ("sparse_decode", kb.sparse_decode, {
            "q": torch.zeros(1, 1, 8, 512, dtype=torch.bfloat16), "k_cache": m1,
            "indices": torch.tensor([[[0, 5, -1]]], dtype=torch.int32), "layout": "model1", "page_size": 4,
            "softmax_scale": None, "scale": None, "backend": "reference"}),
        ("auto_scale", kb.auto_scale, {"x": x}),
        ("get_layout", kb.get_layout, {"name": "model1"}),
        ("DumpEntry", DumpEntry, {"layer": 0, "role": "swa", "data": m1, "layout": "model1", "page_size": 4,
                                  "num_tokens": 10, "scale": None, "dialect": None, "compress_ratio": None}),
        ("plan_migration", plan_migration, {"src": "trtllm", "dst": "sglang", "model": FLASH.with_layers(2),
                                            "num_tokens": 300, "draft_tokens": 0}),
    ]


def test_fuzzed_public_api_arguments_raise_only_kvbridge_errors(tmp_path: Path):
    rng = random.Random(SEED + 1)
    g = torch.Generator().manual_seed(5)
    x = torch.randn(10, 512, generator=g)
    m1, trt = kb.encode(x, "model1", page_size=4), kb.encode(x, "trtllm-fp8", page_size=4)
    calls = api_calls(x, m1, trt)
    for case in range(CASES):
        name, fn, valid = calls[case % len(calls)]
        kwargs = dict(valid)
        for key in rng.sample(sorted(kwargs), rng.randint(1, min(2, len(kwargs)))):
            kwargs[key] = weird_values(rng, kwargs[key])
        try:
            fn(**kwargs)
        except KVBridgeError:
            pass
        except Exception as exc:  # noqa: BLE001 - the point: no other type may escape
            shown = {k: (f"tensor{tuple(v.shape)}:{v.dtype}" if isinstance(v, torch.Tensor) else repr(v)[:40])
                     for k, v in kwargs.items()}
            pytest.fail(f"case {case}: {name}({shown}) raised {type(exc).__name__}: {exc}")
    # write_dump's own arguments
    for bad in (torch.zeros(3), tmp_path, [m1], "entries", 7):
        target = tmp_path if bad is tmp_path else tmp_path / "w.safetensors"
        assert only_kvbridge_errors(write_dump, target, bad if bad is not tmp_path else []) is not None
    assert sorted(p.name for p in tmp_path.iterdir()) == []


def test_fuzzed_block_tables_raise_only_kvbridge_errors():
    rng = random.Random(SEED + 2)
    plan = plan_migration("trtllm", "sglang", FLASH.with_layers(2), 300)
    src, tables = source_request(plan)
    for _ in range(max(20, CASES // 20)):
        bad = {k: list(v) for k, v in tables.items()}
        name = rng.choice(sorted(bad))
        roll = rng.random()
        if roll < 0.2:
            bad.pop(name)
        elif roll < 0.4:
            bad[name] = rng.choice(["pages", 7, None, {"a": 1}])
        elif bad[name]:
            i = rng.randrange(len(bad[name]))
            bad[name][i] = rng.choice([-7, -2, "3", 2.0, 10**9, None, True, bad[name][0]])
        err = only_kvbridge_errors(migrate_local, plan, src, bad, destination_pools(plan))
        if roll < 0.4:
            assert err is not None
