"""Block-table API (``transcode_slots``, ``gather_transcode``): semantics and every error path, on CPU.

The expectations are built independently of ``kvbridge.ops.slots``: from whole-pool ``kb.decode``,
the layouts' ``pages_to_records`` and the reference record codecs.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

import kvbridge as kb
from kvbridge.errors import InputError, LayoutError, NonFiniteError
from kvbridge.layouts import get_layout
from kvbridge.layouts.codec import record_codec

MODEL1 = "flashmla-model1"
FOOTER = "trtllm-fp8-ds-mla"
TRT = "trtllm-fp8"


def latents(n: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    mags = torch.pow(2.0, torch.randint(-12, 6, (n, 1), generator=g).float())
    return torch.randn(n, 512, generator=g) * mags


def random_pool(layout: str, num_pages: int, page_size: int, seed: int) -> torch.Tensor:
    """A pool of random bytes (stands for whatever the destination engine held before)."""
    g = torch.Generator().manual_seed(seed)
    size = (num_pages, get_layout(layout).page_bytes(page_size))
    return torch.randint(0, 256, size, dtype=torch.uint8, generator=g)


def finite_codes(pool: torch.Tensor, layout: str, page_size: int) -> torch.Tensor:
    """``pool`` with every NaN/Inf code made finite (E4M3 0x7F -> 0x7E, UE8M0 0xFF -> 0xFE, bf16
    exponent all ones -> a smaller exponent); every other byte, pad included, is kept."""
    lay = get_layout(layout)
    rec = lay.pages_to_records(pool, page_size).clone()
    for f in lay.fields:
        raw = rec[:, f.offset : f.offset + f.nbytes]
        if f.format == "e4m3":
            raw[(raw & 0x7F) == 0x7F] ^= 1
        elif f.format == "ue8m0":
            raw[raw == 0xFF] = 0xFE
        elif f.format == "bf16":
            lo, hi = raw[:, 0::2], raw[:, 1::2]
            lo[((hi & 0x7F) == 0x7F) & ((lo & 0x80) == 0x80)] &= 0x7F
            raw[:, 0::2] = lo
        rec[:, f.offset : f.offset + f.nbytes] = raw
    out = pool.clone()
    out.view(-1)[record_positions(layout, page_size, pool.shape[0], torch.arange(rec.shape[0]))] = (
        lay.records_to_pages(rec, page_size).view(-1)[
            record_positions(layout, page_size, pool.shape[0], torch.arange(rec.shape[0]))
        ]
    )
    return out


def record_positions(layout: str, page_size: int, num_pages: int, slots: torch.Tensor) -> torch.Tensor:
    """Boolean mask over ``pages.view(-1)`` of the bytes the records at ``slots`` occupy."""
    lay = get_layout(layout)
    mask = torch.zeros(num_pages * lay.page_bytes(page_size), dtype=torch.bool)
    for slot in slots.tolist():
        page, row = divmod(slot, page_size)
        for f in lay.fields:
            start = page * lay.page_bytes(page_size) + lay.field_offset(f.name, row, page_size)
            mask[start : start + f.nbytes] = True
    return mask


def encoded_records(values: torch.Tensor, layout: str, dialect: str | None = None, scale: float = 1.0) -> torch.Tensor:
    lay = get_layout(layout)
    return record_codec(lay).encode(values, dialect=dialect or lay.default_dialect, scale=scale)


# ---------------------------------------------------------------- transcode_slots semantics


@pytest.mark.parametrize(
    ("src", "src_p", "dst", "dst_p", "src_scale", "dst_scale", "dialect"),
    [
        (TRT, 64, MODEL1, 61, 0.5, None, None),
        (TRT, 128, FOOTER, 64, 1.0, None, "amax-1e-8"),
        (MODEL1, 64, TRT, 3, None, 0.037, "compress"),
        ("bf16", 5, MODEL1, 2, None, None, "amax-1e-4"),
        (MODEL1, 61, "bf16", 64, None, None, None),
        (TRT, 64, TRT, 61, 1.0, 2.0, None),
    ],
)
def test_transcode_slots_writes_converted_tokens_and_nothing_else(
    src, src_p, dst, dst_p, src_scale, dst_scale, dialect
):
    x = latents(3 * src_p, seed=1)
    pool = kb.encode(x, src, page_size=src_p, scale=src_scale)
    values = kb.decode(pool, src, page_size=src_p, scale=src_scale)
    g = torch.Generator().manual_seed(2)
    n = min(40, x.shape[0])
    src_slots = torch.randperm(x.shape[0], generator=g)[:n].to(torch.int32)
    dst_pages = max(4, -(-2 * n // dst_p))
    dst_slots = torch.randperm(dst_pages * dst_p, generator=g)[:n]
    before = random_pool(dst, dst_pages, dst_p, seed=3)
    out = before.clone()
    ret = kb.transcode_slots(
        pool, src, out, dst, src_page_size=src_p, dst_page_size=dst_p, src_slots=src_slots, dst_slots=dst_slots,
        src_scale=src_scale, dst_scale=dst_scale, dialect=dialect,
    )
    assert ret is out
    want = encoded_records(values[src_slots.long()], dst, dialect, dst_scale or 1.0)
    assert torch.equal(get_layout(dst).pages_to_records(out, dst_p)[dst_slots], want)
    untouched = ~record_positions(dst, dst_p, dst_pages, dst_slots)
    assert torch.equal(out.view(-1)[untouched], before.view(-1)[untouched])


@pytest.mark.parametrize(("src", "dst", "scale"), [(MODEL1, FOOTER, None), (FOOTER, MODEL1, None), (TRT, TRT, 0.25),
                                                   ("bf16", "bf16", None)])
def test_transcode_slots_byte_move_copies_records_including_pad(src, dst, scale):
    pool = finite_codes(random_pool(src, 3, 61, seed=4), src, 61)  # random bytes: pad bytes too are copied as is
    src_slots = torch.tensor([0, 60, 61, 182, 100], dtype=torch.int64)
    dst_slots = torch.tensor([7, 0, 127, 64, 63], dtype=torch.int32)
    out = torch.zeros(2, get_layout(dst).page_bytes(64), dtype=torch.uint8)
    kb.transcode_slots(pool, src, out, dst, src_page_size=61, dst_page_size=64, src_slots=src_slots,
                       dst_slots=dst_slots, src_scale=scale, dst_scale=scale)
    src_rec = get_layout(src).pages_to_records(pool, 61)[src_slots]
    assert torch.equal(get_layout(dst).pages_to_records(out, 64)[dst_slots.long()], src_rec)
    untouched = ~record_positions(dst, 64, 2, dst_slots.long())
    assert not bool(out.view(-1)[untouched].any())


@pytest.mark.parametrize(("src", "dst", "scale"), [(MODEL1, FOOTER, None), (TRT, TRT, 0.25), ("bf16", "bf16", None)])
def test_byte_moves_refuse_nonfinite_codes(src, dst, scale):
    """A byte move decodes nothing: the stored NaN/Inf codes are scanned and refused, by slot or index."""
    pool = finite_codes(random_pool(src, 3, 61, seed=4), src, 61)
    at = get_layout(src).field_offset("nope", 5, 61)  # token 66 = page 1, row 5
    pool[1, at : at + 2] = 0xFF  # an E4M3 NaN pair, or a bf16 NaN
    out = torch.zeros(2, get_layout(dst).page_bytes(64), dtype=torch.uint8)
    with pytest.raises(NonFiniteError, match=r"src_slots\[2\] = slot 66"):
        kb.transcode_slots(pool, src, out, dst, src_page_size=61, dst_page_size=64,
                           src_slots=torch.tensor([0, 1, 66]), dst_slots=torch.tensor([0, 1, 2]),
                           src_scale=scale, dst_scale=scale)
    assert not bool(out.any())
    with pytest.raises(NonFiniteError, match="first at token 66, field 'nope'"):
        kb.transcode(pool, src, dst, src_page_size=61, dst_page_size=64, src_scale=scale, dst_scale=scale)
    if src == MODEL1:
        with pytest.raises(NonFiniteError, match=r"indices\[0, 1\] = 66"):
            kb.gather_transcode(pool, src, page_size=61, indices=torch.tensor([[3, 66]]))


def test_transcode_slots_identity_equals_whole_pool_transcode():
    x = latents(128, seed=5)
    pool = kb.encode(x, TRT, page_size=64, scale=0.5)
    out = torch.zeros(2, get_layout(MODEL1).page_bytes(64), dtype=torch.uint8)
    slots = torch.arange(128)
    kb.transcode_slots(pool, TRT, out, MODEL1, src_page_size=64, dst_page_size=64, src_slots=slots, dst_slots=slots,
                       src_scale=0.5)
    assert torch.equal(out, kb.transcode(pool, TRT, MODEL1, src_page_size=64, src_scale=0.5))


def test_transcode_slots_empty_lists_leave_destination_alone():
    pool = kb.encode(latents(4), MODEL1, page_size=2)
    before = random_pool(TRT, 2, 2, seed=6)
    out = before.clone()
    empty = torch.zeros(0, dtype=torch.int32)
    kb.transcode_slots(pool, MODEL1, out, TRT, src_page_size=2, dst_page_size=2, src_slots=empty, dst_slots=empty)
    assert torch.equal(out, before)


# ---------------------------------------------------------------- transcode_slots errors


def slots_call(**overrides):
    pool = kb.encode(latents(8), TRT, page_size=4)
    args = dict(
        src_pages=pool, src_layout=TRT, dst_pages=torch.zeros(2, get_layout(MODEL1).page_bytes(4), dtype=torch.uint8),
        dst_layout=MODEL1, src_page_size=4, dst_page_size=4, src_slots=torch.tensor([0, 1, 2]),
        dst_slots=torch.tensor([5, 6, 7]),
    )
    args.update(overrides)
    return args


@pytest.mark.parametrize(
    ("overrides", "error", "match"),
    [
        ({"src_slots": torch.tensor([0, 8, 9])}, InputError, r"src_slots\[1\] = 8 is outside the pool of 8 slots"),
        ({"src_slots": torch.tensor([0, 1, -1])}, InputError, r"src_slots\[2\] = -1 is outside"),
        ({"dst_slots": torch.tensor([5, 6, 8])}, InputError, r"dst_slots\[2\] = 8 is outside the pool of 8 slots"),
        ({"dst_slots": torch.tensor([5, 6, 5])}, InputError, r"dst_slots holds slot 5 twice \(at indices 0 and 2\)"),
        ({"dst_slots": torch.tensor([5, 6])}, InputError, "1-D of equal length"),
        ({"src_slots": torch.tensor([[0, 1, 2]])}, InputError, "1-D of equal length"),
        ({"src_slots": torch.tensor([0.0, 1.0, 2.0])}, InputError, "src_slots must be int32 or int64"),
        ({"dst_slots": [5, 6, 7]}, InputError, "dst_slots must be a torch.Tensor"),
        ({"dst_slots": torch.tensor([5, 6, 7], device="meta")}, InputError, "dst_slots is on meta, src_pages on cpu"),
        ({"dst_pages": torch.zeros(2, 2336, dtype=torch.uint8)}, LayoutError, r"dst_pages: .*\[num_pages, 2880\]"),
        ({"src_pages": torch.zeros(2, 2048, dtype=torch.int8)}, LayoutError, "src_pages: pages must be uint8"),
        ({"src_page_size": 0}, LayoutError, "page_size must be a positive integer"),
        ({"dst_layout": "nope"}, LayoutError, "unknown layout 'nope'"),
        ({"dialect": "swa"}, InputError, "dialect 'swa' does not apply to flashmla-model1"),
        ({"dst_scale": 2.0}, InputError, "dst_scale applies only to per-tensor layouts"),
        ({"src_scale": -1.0}, InputError, "src_scale must be a positive finite number"),
    ],
)
def test_transcode_slots_rejects_bad_arguments_before_writing(overrides, error, match):
    args = slots_call(**overrides)
    before = args["dst_pages"].clone() if isinstance(args["dst_pages"], torch.Tensor) else None
    with pytest.raises(error, match=match):
        kb.transcode_slots(**args)
    assert torch.equal(args["dst_pages"], before)


def test_transcode_slots_refuses_dialect_on_byte_move_and_shared_pools():
    pool = kb.encode(latents(8), MODEL1, page_size=4)
    out = torch.zeros(2, get_layout(FOOTER).page_bytes(4), dtype=torch.uint8)
    slots = torch.tensor([0, 1])
    with pytest.raises(InputError, match="byte move that keeps the source's scales"):
        kb.transcode_slots(pool, MODEL1, out, FOOTER, src_page_size=4, dst_page_size=4, src_slots=slots,
                           dst_slots=slots, dialect="flashmla")
    with pytest.raises(InputError, match="share memory"):
        kb.transcode_slots(pool, MODEL1, pool, MODEL1, src_page_size=4, dst_page_size=4, src_slots=slots,
                           dst_slots=slots + 2)


def test_transcode_slots_nonfinite_source_raises_and_writes_nothing():
    pool = kb.encode(latents(8), TRT, page_size=4)
    pool[1, 4 * 512 // 4 + 9] = 0x7F  # slot 5 (page 1, row 1) holds an E4M3 NaN at dim 9 (bytes are row-major)
    pool[1, 512 + 9] = 0x7F
    args = slots_call(src_pages=pool, src_slots=torch.tensor([0, 5, 2]))
    before = args["dst_pages"].clone()
    with pytest.raises(NonFiniteError, match=r"src_slots\[1\] = slot 5 decodes to non-finite values"):
        kb.transcode_slots(**args)
    assert torch.equal(args["dst_pages"], before)
    # A byte move decodes nothing, but the stored NaN code is found by the byte scan all the same.
    out = torch.zeros_like(pool)
    with pytest.raises(NonFiniteError, match=r"src_slots\[0\] = slot 5"):
        kb.transcode_slots(pool, TRT, out, TRT, src_page_size=4, dst_page_size=4, src_slots=torch.tensor([5]),
                           dst_slots=torch.tensor([5]))
    assert not bool(out.any())


# ---------------------------------------------------------------- gather_transcode


@pytest.mark.parametrize(
    ("layout", "page_size", "scale", "dialect", "out_p"),
    [(TRT, 64, 0.5, None, 5), (TRT, 61, 1.0, "amax-1e-8", 64), ("bf16", 3, None, "amax-1e-4", 2),
     (FOOTER, 64, None, None, 61), (MODEL1, 2, None, None, 64)],
)
def test_gather_transcode_writes_each_index_as_a_model1_row(layout, page_size, scale, dialect, out_p):
    x = latents(4 * page_size, seed=7)
    pool = kb.encode(x, layout, page_size=page_size, scale=scale)
    g = torch.Generator().manual_seed(8)
    indices = torch.randint(0, 4 * page_size, (2, 3, 8), generator=g, dtype=torch.int32)
    indices[0, 1, 2:5] = -1
    indices[1, 2, :] = -1
    indices[1, 0, 7] = indices[0, 0, 0]  # the same token twice: converted twice, into two scratch rows
    scratch, remapped = kb.gather_transcode(pool, layout, page_size=page_size, indices=indices, scale=scale,
                                            dialect=dialect, out_page_size=out_p)
    lay = get_layout(MODEL1)
    assert scratch.dtype == torch.uint8 and scratch.shape == (-(-48 // out_p), lay.page_bytes(out_p))
    assert remapped.dtype == torch.int32 and remapped.shape == indices.shape
    flat = indices.reshape(-1).long()
    valid = flat >= 0
    positions = torch.arange(48, dtype=torch.int32)
    assert torch.equal(remapped.reshape(-1), torch.where(valid, positions, -1))
    records = lay.pages_to_records(scratch, out_p)
    if get_layout(layout).record_bytes == 584:  # same record: copied byte for byte
        want = get_layout(layout).pages_to_records(pool, page_size)[flat[valid]]
    else:
        values = kb.decode(pool, layout, page_size=page_size, scale=scale)
        want = encoded_records(values[flat[valid]], MODEL1, dialect)
    assert torch.equal(records[:48][valid], want)
    assert not bool(records[:48][~valid].any()) and not bool(records[48:].any())
    tail = scratch[:, out_p * 584 :]
    assert not bool(tail.any())


def test_gather_transcode_scratch_feeds_decode_at_remapped_indices():
    pool = kb.encode(latents(256, seed=9), TRT, page_size=128)
    indices = torch.tensor([[3, 200, -1, 77]], dtype=torch.int32)
    scratch, remapped = kb.gather_transcode(pool, TRT, page_size=128, indices=indices)
    got = kb.decode(scratch, MODEL1, page_size=64)[remapped[0, [0, 1, 3]].long()]
    want = kb.decode(kb.transcode(pool, TRT, MODEL1, src_page_size=128), MODEL1, page_size=128)[[3, 200, 77]]
    assert torch.equal(got, want)


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"indices": torch.tensor([[0, 16]], dtype=torch.int32)}, InputError,
         r"indices\[0, 1\] = 16 is outside the pool of 16 slots \(valid: 0..15 or -1\)"),
        ({"indices": torch.tensor([[0, 1], [-2, 3]])}, InputError, r"indices\[1, 0\] = -2 is outside"),
        ({"indices": torch.tensor([0.0])}, InputError, "indices must be int32 or int64"),
        ({"indices": torch.tensor(3)}, InputError, "at least one dimension"),
        ({"indices": torch.tensor([1], device="meta")}, InputError, "indices is on meta, pool on cpu"),
        ({"dialect": "compress"}, InputError, "dialect 'compress' does not apply to flashmla-model1"),
        ({"out_page_size": 0}, LayoutError, "page_size must be a positive integer"),
        ({"page_size": 8}, LayoutError, r"pool: .*\[num_pages, 4096\]"),
        ({"scale": 0.0}, InputError, "scale must be a positive finite number"),
    ],
)
def test_gather_transcode_rejects_bad_arguments(kwargs, error, match):
    pool = kb.encode(latents(16), TRT, page_size=4)
    args = {"page_size": 4, "indices": torch.tensor([[0, 1]], dtype=torch.int32), **kwargs}
    with pytest.raises(error, match=match):
        kb.gather_transcode(pool, TRT, **args)


def test_gather_transcode_refuses_dialect_for_model1_pool_and_names_nonfinite_index():
    pool = kb.encode(latents(8), MODEL1, page_size=4)
    with pytest.raises(InputError, match="copied as is into the scratch cache"):
        kb.gather_transcode(pool, MODEL1, page_size=4, indices=torch.tensor([0]), dialect="flashmla")
    trt = kb.encode(latents(8), TRT, page_size=4)
    trt[1, 2 * 512 + 100] = 0xFF  # slot 6, dim 100: E4M3 NaN
    with pytest.raises(NonFiniteError, match=r"indices\[1, 0\] = 6 decodes to non-finite values$"):
        kb.gather_transcode(trt, TRT, page_size=4, indices=torch.tensor([[0, 1], [6, -1]]))


def test_importing_kvbridge_and_running_on_cpu_never_imports_triton():
    code = (
        "import sys, torch, kvbridge as kb\n"
        "pool = kb.encode(torch.randn(8, 512), 'trtllm-fp8', page_size=4)\n"
        "kb.gather_transcode(pool, 'trtllm-fp8', page_size=4, indices=torch.tensor([[0, 5, -1]]))\n"
        "out = torch.zeros(1, 2880, dtype=torch.uint8)\n"
        "kb.transcode_slots(pool, 'trtllm-fp8', out, 'flashmla-model1', src_page_size=4, dst_page_size=4,\n"
        "                   src_slots=torch.tensor([1]), dst_slots=torch.tensor([2]))\n"
        "assert 'triton' not in sys.modules, 'triton was imported'\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 0, done.stderr


def test_reference_chunking_gives_the_same_bytes_and_checks_every_chunk_before_writing(monkeypatch):
    pool = kb.encode(latents(64, seed=10), TRT, page_size=8, scale=0.5)
    src_slots = torch.randperm(64, generator=torch.Generator().manual_seed(11))[:50]
    dst_slots = torch.arange(50) + 3
    want = kb.transcode_slots(pool, TRT, random_pool(MODEL1, 5, 13, seed=12), MODEL1, src_page_size=8,
                              dst_page_size=13, src_slots=src_slots, dst_slots=dst_slots, src_scale=0.5)
    indices = torch.cat([src_slots, torch.tensor([-1, 7])]).view(2, 26)
    want_scratch, _ = kb.gather_transcode(pool, TRT, page_size=8, indices=indices, scale=0.5, out_page_size=5)
    monkeypatch.setattr("kvbridge.backends.reference.CHUNK_TOKENS", 3)
    got = kb.transcode_slots(pool, TRT, random_pool(MODEL1, 5, 13, seed=12), MODEL1, src_page_size=8,
                             dst_page_size=13, src_slots=src_slots, dst_slots=dst_slots, src_scale=0.5)
    assert torch.equal(got, want)
    got_scratch, _ = kb.gather_transcode(pool, TRT, page_size=8, indices=indices, scale=0.5, out_page_size=5)
    assert torch.equal(got_scratch, want_scratch)
    last = int(src_slots[49])
    pool[last // 8, (last % 8) * 512] = 0xFF  # the last token of the last chunk decodes to NaN
    before = random_pool(MODEL1, 5, 13, seed=12)
    out = before.clone()
    with pytest.raises(NonFiniteError, match=rf"src_slots\[49\] = slot {last} decodes to non-finite values"):
        kb.transcode_slots(pool, TRT, out, MODEL1, src_page_size=8, dst_page_size=13, src_slots=src_slots,
                           dst_slots=dst_slots, src_scale=0.5)
    assert torch.equal(out, before)


def test_gather_transcode_of_no_indices_gives_an_empty_scratch():
    pool = kb.encode(latents(8), TRT, page_size=4)
    scratch, remapped = kb.gather_transcode(pool, TRT, page_size=4, indices=torch.zeros(3, 0, dtype=torch.int32))
    assert scratch.shape == (0, get_layout(MODEL1).page_bytes(64)) and remapped.shape == (3, 0)
