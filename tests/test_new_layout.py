"""The registry's promise, proved: a layout defined in this file alone (no library change) runs
through encode, decode, transcode, slot operations, migration pools and the Triton kernels
(under ``TRITON_INTERPRET=1``), byte-identical to the reference on every backend.

Two layouts nobody ships, built only from existing element formats and scale rules:

- ``test-v41-fp8-tile16``: V4.1-style E4M3 nope in tiles of 16 (28 UE8M0 scales), bf16 rope,
  token-major, pages padded to 64 B;
- ``test-fp4-nope-bf16-rope``: E2M1 nope in tiles of 32 with E4M3 scales, bf16 rope, block-split
  at byte 352, pages padded to 256 B.

The registered experimental FP4 records ``flashinfer-nvfp4``, ``sglang-mxfp4`` (each with a scale
rule of its own) and ``lil-nvfp4-ds-mla`` (its rope dims stored twice, a mirror field) run through the
same tests.
"""

from __future__ import annotations

import importlib
import os

os.environ["TRITON_INTERPRET"] = "1"  # must precede the Triton kernels' decoration

import pytest  # noqa: E402
import torch  # noqa: E402

import kvbridge as kb  # noqa: E402
from kvbridge.backends import (
    dispatch,
    native,
    reference,  # noqa: E402
)
from kvbridge.engines.profiles import Storage  # noqa: E402
from kvbridge.layouts import Field, Layout, all_layouts, get_layout  # noqa: E402
from kvbridge.layouts import registry as layout_registry  # noqa: E402
from kvbridge.layouts.codec import record_codec
from kvbridge.migration.pools import gather_records, scatter_records  # noqa: E402
from kvbridge.ops import slots as slot_ops

TILE16 = Layout(
    name="test-v41-fp8-tile16",
    description="test only: E4M3 nope in tiles of 16, bf16 rope, token-major, pages padded to 64 B",
    record_bytes=608,
    fields=(
        Field("nope", 0, 448, "e4m3", (0, 448), tile=16, scale="scale"),
        Field("rope", 448, 128, "bf16", (448, 512)),
        Field("scale", 576, 28, "ue8m0"),
        Field("pad", 604, 4, "pad"),
    ),
    page_align=64,
    dialects=("amax-1e-4", "flashmla", "amax-1e-8"),
)
FP4_BF16 = Layout(
    name="test-fp4-nope-bf16-rope",
    description="test only: E2M1 nope in tiles of 32 with E4M3 scales, bf16 rope, block-split at 352",
    record_bytes=368,
    fields=(
        Field("nope", 0, 224, "e2m1", (0, 448), tile=32, scale="scale"),
        Field("rope", 224, 128, "bf16", (448, 512)),
        Field("scale", 352, 14, "e4m3-scale"),
        Field("pad", 366, 2, "pad"),
    ),
    split=352,
    page_align=256,
)
#: The registered experimental FP4 records go through the same checks (they add an op of their own).
NEW = (TILE16, FP4_BF16, get_layout("flashinfer-nvfp4"), get_layout("sglang-mxfp4"), get_layout("lil-nvfp4-ds-mla"))
ids = lambda v: getattr(v, "name", str(v))  # noqa: E731


@pytest.fixture(scope="module")
def latents() -> torch.Tensor:
    g = torch.Generator().manual_seed(5)
    x = torch.randn(150, 512, generator=g) * torch.exp2(torch.randint(-10, 8, (150, 1), generator=g).float())
    x[0] = 0.0
    x[1, :64] = -0.0
    x[2, :32] = torch.tensor([6.0, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0] * 4)  # E2M1 ties at scale 1
    return x


@pytest.mark.parametrize("layout", NEW, ids=ids)
def test_new_layout_encodes_and_decodes_on_every_cpu_backend(latents, layout, monkeypatch):
    assert dispatch.backend_name(latents, layout) == "native"
    for dialect in layout.dialects or (None,):
        want = reference.encode_pages(latents, layout, 61, dialect, 1.0)
        assert torch.equal(kb.encode(latents, layout, page_size=61, dialect=dialect), want)
        assert torch.equal(native.encode_pages(latents.bfloat16(), layout, 61, dialect, 1.0),
                           reference.encode_pages(latents.bfloat16(), layout, 61, dialect, 1.0))
    g = torch.Generator().manual_seed(6)
    pages = torch.randint(0, 256, (3, layout.page_bytes(61)), dtype=torch.uint8, generator=g)
    if layout.mirrors:  # random bytes: the second copy disagrees with the first, which decode refuses
        with pytest.raises(kb.CopyMismatchError, match="disagree with dims"):
            kb.decode(pages, layout, page_size=61)
        got = dispatch.decode_pages(pages, layout, 61, None, 1.0)
    else:
        got = kb.decode(pages, layout, page_size=61)
    ref = reference.decode_pages(pages, layout, 61, None, 1.0)
    assert torch.equal(torch.isnan(got), torch.isnan(ref))
    assert torch.equal(got.nan_to_num().view(torch.int32), ref.nan_to_num().view(torch.int32))
    monkeypatch.setenv(dispatch.BACKEND_ENV, "reference")
    assert torch.equal(kb.encode(latents, layout, page_size=61), reference.encode_pages(
        latents, layout, 61, layout.default_dialect, 1.0))


@pytest.mark.parametrize("layout", NEW, ids=ids)
def test_new_layout_transcodes_to_and_from_every_registered_layout(latents, layout):
    x = latents[:70]
    for other in all_layouts():
        s = 0.5 if other.per_tensor_scale else None
        src = kb.encode(x, other, page_size=64, scale=s)
        args = (src, other, 64, layout, 7, 70, s or 1.0, 1.0, layout.default_dialect)
        assert torch.equal(dispatch.transcode_pages(*args), reference.transcode_pages(*args)), other.name
        mine = kb.encode(x, layout, page_size=7)
        args = (mine, layout, 7, other, 64, 70, 1.0, s or 1.0, other.default_dialect)
        assert torch.equal(dispatch.transcode_pages(*args), reference.transcode_pages(*args)), other.name
    out, rep = kb.transcode(kb.encode(x, "bf16", page_size=64), "bf16", layout, src_page_size=64, report=True)
    assert not rep.lossless and rep.max_abs_error > 0
    assert torch.equal(kb.transcode(mine, layout, layout, src_page_size=7, dst_page_size=64),
                       kb.encode(x, layout, page_size=64))


@pytest.mark.parametrize("layout", NEW, ids=ids)
def test_new_layout_slot_operations(latents, layout):
    model1 = get_layout("flashmla-model1")
    src = kb.encode(latents, model1, page_size=64)
    dst = torch.zeros(4, layout.page_bytes(61), dtype=torch.uint8)
    src_slots = torch.tensor([5, 0, 149, 77, 64])
    dst_slots = torch.tensor([200, 3, 61, 0, 122])
    slot_ops.transcode_slots(src, model1, dst, layout, src_page_size=64, dst_page_size=61, src_slots=src_slots,
                          dst_slots=dst_slots)
    values = kb.decode(src, model1, page_size=64)[src_slots]
    want = record_codec(layout).encode(values, dialect=layout.default_dialect, scale=1.0)
    assert torch.equal(dst.view(-1)[layout.geometry.byte_index(61, dst_slots)], want)
    untouched = torch.ones(dst.numel(), dtype=torch.bool)
    untouched[layout.geometry.byte_index(61, dst_slots).reshape(-1)] = False
    assert not bool(dst.view(-1)[untouched].any())
    scratch, remapped = slot_ops.gather_transcode(dst, layout, page_size=61, indices=torch.tensor([[200, -1, 61]]),
                                               out_layout="v41-fp8-interleaved", out_page_size=2)
    assert remapped.tolist() == [[0, -1, 2]]
    v41 = get_layout("v41-fp8-interleaved")
    back = kb.decode(dst, layout, page_size=61)[torch.tensor([200, 61])]
    rows = scratch.view(-1)[v41.geometry.byte_index(2, torch.tensor([0, 2]))]
    assert torch.equal(rows, record_codec(v41).encode(back, dialect="flashmla", scale=1.0))


@pytest.mark.parametrize("layout", NEW, ids=ids)
def test_new_layout_in_migration_pools(latents, layout, monkeypatch):
    """Engine pools of the new layout: records scattered through a block table and gathered back."""
    monkeypatch.setitem(layout_registry._REGISTRY, layout.name, layout)  # visible to Storage.layout, undone after
    p = 16
    st = Storage("kv", layout.name, layout.record_bytes, layout.split, p, layout.page_bytes(p), "swa", "paged",
                 layout.default_dialect)
    pool = torch.zeros(5, st.page_bytes, dtype=torch.uint8)
    records = record_codec(layout).encode(latents[:40], dialect=layout.default_dialect, scale=1.0)
    table = [3, 0, 4]
    scatter_records(pool, st, table, 0, records)
    assert torch.equal(gather_records(pool, st, table, 0, 40), records)
    dense = kb.encode(latents[:40], layout, page_size=p)  # the same bytes as paged by the layout itself
    assert torch.equal(pool[torch.tensor(table)], dense)


@pytest.mark.parametrize("layout", NEW, ids=ids)
def test_new_layout_on_the_triton_kernels(latents, layout):
    from kvbridge.backends import triton_kernels as tk

    if not tk.INTERPRETED:
        tk = importlib.reload(tk)
    x = latents[:20]
    assert tk.supports(layout)
    d = layout.default_dialect
    want = reference.encode_pages(x, layout, 7, d, 1.0)
    assert torch.equal(tk.encode_pages(x, layout, 7, d, 1.0), want)
    assert torch.equal(tk.decode_pages(want, layout, 7, 20, 1.0).view(torch.int32),
                       reference.decode_pages(want, layout, 7, 20, 1.0).view(torch.int32))
    trt = get_layout("trtllm-fp8")
    fp8 = reference.encode_pages(x, trt, 64, "swa", 0.5)
    args = (fp8, trt, 64, layout, 5, 20, 0.5, 1.0, d)
    assert torch.equal(tk.transcode_pages(*args), reference.transcode_pages(*args))
    args = (want, layout, 7, get_layout("v41-fp8-interleaved"), 3, 20, 1.0, 1.0, "amax-1e-4")
    assert torch.equal(tk.transcode_pages(*args), reference.transcode_pages(*args))
    assert torch.equal(tk.repage(want, layout, 7, layout, 64, 20), reference.repage(want, layout, 7, layout, 64, 20))


def test_mirror_field_rules():
    """A mirror is a value field storing dims a bf16 field already stores; decoders read the bf16 copy only."""
    lil = get_layout("lil-nvfp4-ds-mla")
    assert [s.op for s in lil.read_segments] == [s.op for s in lil.segments[1:-1]]
    assert lil.mirrors == (lil.segments[-1],) and lil.mirrors[0].dim0 == 448 and lil.mirrors[0].offset == 224
    assert not FP4_BF16.mirrors and FP4_BF16.read_segments == FP4_BF16.segments

    def build(*fields, record_bytes=432):
        return Layout(name="test-mirror", description="test only", record_bytes=record_bytes, fields=fields)

    nope, rope4, nscale, rscale, pad, rope = lil.fields
    with pytest.raises(kb.LayoutError, match="its first copy is not a bf16 field"):
        build(nope, Field("rope_fp4", 224, 32, "e2m1", (448, 512), tile=16, scale="s2"), nscale,
              Field("s2", 284, 4, "nvfp4-scale-vllm"), Field("pad", 288, 16, "pad"),
              Field("rope", 304, 32, "e2m1", (448, 512), tile=16, scale="s3", mirror=True),
              Field("s3", 336, 4, "nvfp4-scale-vllm"), Field("pad2", 340, 92, "pad"))
    with pytest.raises(kb.LayoutError, match="only a value field can be a mirror"):
        build(nope, rope4, nscale, rscale, Field("pad", 288, 16, "pad", mirror=True), rope)
    with pytest.raises(kb.LayoutError, match="stored 2 times"):
        build(nope, Field("rope_fp4", 224, 32, "e2m1", (448, 512), tile=16, scale="rope_fp4_scale"), nscale, rscale,
              pad, rope)
    with pytest.raises(kb.LayoutError, match="mirrored by more than one field"):
        build(nope, rope4, nscale, rscale, pad, rope,
              Field("rope_fp4b", 432, 32, "e2m1", (448, 512), tile=16, scale="s4", mirror=True),
              Field("s4", 464, 4, "nvfp4-scale-vllm"), Field("pad2", 468, 4, "pad"), record_bytes=472)
