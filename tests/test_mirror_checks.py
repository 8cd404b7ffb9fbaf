"""Every read of a layout with a mirror field (``lil-nvfp4-ds-mla``: the rope twice, bf16 and E2M1) compares the
two copies: one flipped byte of one record's second copy is refused with ``CopyMismatchError`` naming the layout,
the first bad record and the remedy, and the destination is left as it was; valid input converts byte-exact.
No engine profile uses the layout, so migration is tested through ``convert_kv_records`` (``convert_batch``'s KV
path) directly."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import kvbridge as kb
from kvbridge.attention.sparse import _decode_slots
from kvbridge.layouts import get_layout
from kvbridge.layouts.codec import record_codec
from kvbridge.ops import records as record_ops
from kvbridge.ops import slots as slot_ops

LIL = get_layout("lil-nvfp4-ds-mla")
MODEL1 = get_layout("flashmla-model1")
FIXTURE = load_file(Path(__file__).parents[1] / "fixtures" / "lil_nvfp4_reference.safetensors")
BAD = r"\(field .rope_fp4. or its scales\) of lil-nvfp4-ds-mla disagree with dims 448..511 .* re-encode the values"


def _pool(p: int = 61) -> tuple[torch.Tensor, torch.Tensor]:
    """The fixture's P = 61 input, encoded by kvbridge (the fixture's bytes), and the same pool with one byte of
    token 77's E2M1 rope (its second copy) flipped."""
    x = FIXTURE[f"p{p}.input"]
    pages = kb.encode(x, LIL, page_size=p)
    assert torch.equal(pages, FIXTURE[f"p{p}.lil_derived"])
    bad = pages.clone()
    bad.view(-1)[77 * LIL.record_bytes + 230] ^= 0x10
    return pages, bad


def test_transcode_refuses_a_second_copy_that_disagrees_and_leaves_out_untouched():
    pages, bad = _pool()
    want = kb.transcode(pages, LIL, MODEL1, src_page_size=61, dst_page_size=64)
    assert torch.equal(want, kb.encode(kb.decode(pages, LIL, page_size=61), MODEL1, page_size=64))
    out = torch.full_like(want, 0xA5)
    for kwargs in ({}, {"report": True}):
        with pytest.raises(kb.CopyMismatchError, match=r"source token 77: record bytes 224\.\.255 " + BAD):
            kb.transcode(bad, LIL, MODEL1, src_page_size=61, dst_page_size=64, out=out, **kwargs)
        assert bool((out == 0xA5).all())
    with pytest.raises(kb.CopyMismatchError, match="source token 77"):
        kb.transcode(bad, LIL, "trtllm-fp8", src_page_size=61, dst_page_size=64, dst_scale="auto")
    moved = kb.transcode(bad, LIL, LIL, src_page_size=61, dst_page_size=64)  # a byte move: copies not compared
    assert torch.equal(LIL.pages_to_records(moved, 64, 130), LIL.pages_to_records(bad, 61, 130))


def test_a_scale_byte_of_the_second_copy_is_compared_too():
    pages, _ = _pool()
    bad = pages.clone()
    bad.view(-1)[3 * LIL.record_bytes + 285] ^= 0x01  # rope tile 1's E4M3 scale
    with pytest.raises(kb.CopyMismatchError, match="source token 3: record bytes 284..287"):
        kb.decode(bad, LIL, page_size=61)


def test_transcode_slots_refuses_before_writing():
    pages, bad = _pool()
    dst = torch.zeros(4, MODEL1.page_bytes(64), dtype=torch.uint8)
    src_slots, dst_slots = torch.tensor([5, 0, 77, 129]), torch.tensor([200, 3, 61, 0])
    slot_ops.transcode_slots(pages, LIL, dst, MODEL1, src_page_size=61, dst_page_size=64, src_slots=src_slots,
                             dst_slots=dst_slots)
    values = kb.decode(pages, LIL, page_size=61)[src_slots]
    want = record_codec(MODEL1).encode(values, dialect=MODEL1.default_dialect, scale=1.0)
    assert torch.equal(dst.view(-1)[MODEL1.geometry.byte_index(64, dst_slots)], want)
    before = dst.clone()
    with pytest.raises(kb.CopyMismatchError, match=r"src_slots\[2\] = slot 77: record bytes 224\.\.255 " + BAD):
        slot_ops.transcode_slots(bad, LIL, dst, MODEL1, src_page_size=61, dst_page_size=64, src_slots=src_slots,
                                 dst_slots=dst_slots)
    assert torch.equal(dst, before)
    moved = torch.zeros(3, LIL.page_bytes(61), dtype=torch.uint8)  # lil -> lil: a byte move, copies not compared
    slot_ops.transcode_slots(bad, LIL, moved, LIL, src_page_size=61, dst_page_size=61, src_slots=src_slots,
                             dst_slots=src_slots)
    assert torch.equal(moved.view(-1)[LIL.geometry.byte_index(61, src_slots)],
                       bad.view(-1)[LIL.geometry.byte_index(61, src_slots)])


def test_gather_transcode_and_the_reference_sparse_decode_refuse():
    pages, bad = _pool()
    indices = torch.tensor([[5, -1, 77, 77]])
    scratch, remapped = slot_ops.gather_transcode(pages, LIL, page_size=61, indices=indices)
    assert remapped.tolist() == [[0, -1, 2, 3]]
    with pytest.raises(kb.CopyMismatchError, match=r"indices \(flat\)\[2\] = slot 77: " + "record bytes 224"):
        slot_ops.gather_transcode(bad, LIL, page_size=61, indices=indices)
    with pytest.raises(kb.InputError, match="outside the pool"):
        slot_ops.gather_transcode(bad, LIL, page_size=61, indices=torch.tensor([[77, 100000]]))
    slots = torch.tensor([5, 77])
    assert torch.equal(_decode_slots(pages, LIL, 61, slots, 1.0), kb.decode(pages, LIL, page_size=61)[slots])
    with pytest.raises(kb.CopyMismatchError, match="pool slot 77: record bytes 224"):
        _decode_slots(bad, LIL, 61, slots, 1.0)


@pytest.mark.parametrize("n", [130, 300])
def test_record_conversion_checks_every_record_before_writing(n):
    """Migration's KV record conversion (``convert_batch``): the first bad record named among all (not per page of
    256 rows), ``out`` untouched; the valid records convert as ``transcode`` does."""
    p = 61 if n == 130 else 256
    pages = kb.encode(FIXTURE[f"p{p}.input"], LIL, page_size=p)
    records = LIL.pages_to_records(pages, p, n)
    model1_rb = MODEL1.record_bytes
    got, _ = record_ops.convert_kv_records(records, LIL, MODEL1, src_scale=None, dst_scale=None, dialect=None)
    want = MODEL1.pages_to_records(kb.transcode(pages, LIL, MODEL1, src_page_size=p, dst_page_size=64), 64, n)
    assert torch.equal(got, want)
    bad = records.clone()
    bad[n - 3, 240] ^= 0x01
    out = torch.full((n, model1_rb), 0x5A, dtype=torch.uint8)
    with pytest.raises(kb.CopyMismatchError, match=f"layer 7 swa source entry {100 + n - 3}: record bytes 224"):
        record_ops.convert_kv_records(bad, LIL, MODEL1, src_scale=None, dst_scale=None, dialect=None, out=out,
                                      what="layer 7 swa source entry", first=100)
    assert bool((out == 0x5A).all())
    same, _ = record_ops.convert_kv_records(bad, LIL, LIL, src_scale=None, dst_scale=None, dialect=None)
    assert torch.equal(same, bad)  # a byte move: nothing decoded, nothing compared


def test_nonfinite_tokens_are_not_compared_and_other_layouts_read_nothing(monkeypatch):
    from kvbridge.ops import pages as page_ops

    pages, _ = _pool()
    bad = pages.clone()
    bad.view(-1)[9 * LIL.record_bytes + 304 : 9 * LIL.record_bytes + 306] = torch.tensor([0x80, 0x7F],
                                                                                     dtype=torch.uint8)
    assert page_ops.first_bad_copy(LIL.pages_to_records(bad, 61, 130), LIL) is None  # bf16 NaN: not compared
    calls = []
    monkeypatch.setattr(page_ops, "first_bad_copy", lambda *a: calls.append(a))
    kb.transcode(kb.encode(FIXTURE["p61.input"], MODEL1, page_size=64), MODEL1, "bf16", src_page_size=64)
    assert not calls
