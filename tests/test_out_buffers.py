"""``encode(out=)`` and ``decode(out=)``: a preallocated output, byte-identical to the fresh one, and
refused (``OutputBufferError``, nothing written) when it cannot receive the result.

Outputs start filled with garbage, so every byte (padding and unused rows included) must be written.
Decoded fp32 is compared through its bit patterns. The Triton kernels' ``out=`` is checked in
``test_triton_interpret.py``.
"""

from __future__ import annotations

import pytest
import torch

import kvbridge as kb
from kvbridge.backends import native
from kvbridge.errors import InputError, NonFiniteError, OutputBufferError
from kvbridge.layouts import all_layouts, get_layout
from tests.test_ckernels import implementation, implementations

LAYOUTS = [lay.name for lay in all_layouts()]
GARBAGE = 0xA5
P = 16


def latents(n: int, seed: int = 3) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(n, 512, generator=g) * 3).to(torch.bfloat16)


def bits(x: torch.Tensor) -> torch.Tensor:
    return x.view(torch.int32)


def garbage_like(t: torch.Tensor) -> torch.Tensor:
    """A tensor of ``t``'s shape and dtype, every byte ``GARBAGE``, at an unaligned address (4 bytes in)."""
    nbytes = t.numel() * t.element_size()
    raw = torch.full((nbytes + 4,), GARBAGE, dtype=torch.uint8)[4:]
    return raw.view(t.dtype).view(t.shape)


@pytest.mark.parametrize("backend", ["auto", "reference"])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_encode_and_decode_into_out_equal_the_fresh_output(monkeypatch, backend, layout):
    monkeypatch.setenv("KVBRIDGE_BACKEND", backend)
    lay = get_layout(layout)
    x = latents(70)  # 70 tokens in pages of 16: a partly filled last page
    for kwargs in [{}] + [{"dialect": d} for d in lay.dialects] + ([{"scale": 0.25}] if lay.per_tensor_scale else []):
        for src in (x, x.float()):
            fresh = kb.encode(src, lay, page_size=P, **kwargs)
            out = garbage_like(fresh)
            got = kb.encode(src, lay, page_size=P, out=out, **kwargs)
            assert got is out and torch.equal(out, fresh), kwargs
    pages = kb.encode(x, lay, page_size=P)
    for n in (None, 70, 33, 0):
        fresh = kb.decode(pages, lay, page_size=P, num_tokens=n)
        out = garbage_like(fresh)
        got = kb.decode(pages, lay, page_size=P, num_tokens=n, out=out)
        assert got is out and torch.equal(bits(out), bits(fresh)), n


@pytest.mark.parametrize("impl", implementations())
def test_model1_accelerators_write_every_byte_of_out(impl):
    """The compiled and numba MODEL1 encoder and decoder (non-temporal stores included) into garbage."""
    lay = get_layout("flashmla-model1")
    x = latents(300, seed=5)
    with implementation(impl):
        for src in (x, x.float()):
            fresh = native.encode_pages(src.contiguous(), lay, 64, "flashmla", 1.0, accelerated=False)
            out = garbage_like(fresh)
            assert native.encode_pages(src.contiguous(), lay, 64, "flashmla", 1.0, out=out) is out
            assert torch.equal(out, fresh), impl
        pages = native.encode_pages(x, lay, 64, "flashmla", 1.0)
        fresh = native.decode_pages(pages, lay, 64, 300, 1.0, accelerated=False)
        for out in (garbage_like(fresh), torch.full_like(fresh, float("nan"))):  # unaligned and 64-byte aligned
            assert kb.decode(pages, lay, page_size=64, num_tokens=300, out=out) is out
            assert torch.equal(bits(out), bits(fresh)), impl


def refusals(fresh: torch.Tensor, source: torch.Tensor) -> list[tuple[object, str]]:
    """(bad out, message pattern) for an output like ``fresh`` computed from ``source``."""
    wrong_dtype = torch.uint8 if fresh.dtype == torch.float32 else torch.int8
    shared = source.view(-1).view(torch.uint8)
    overlap = shared[: fresh.numel() * fresh.element_size()].view(fresh.dtype).view(fresh.shape) \
        if shared.numel() >= fresh.numel() * fresh.element_size() else None
    cases = [
        ([0] * 4, "must be a torch.Tensor"),
        (torch.zeros_like(fresh)[:-1], rf"shape \[{fresh.shape[0]}, {fresh.shape[1]}\]"),
        (torch.zeros(fresh.shape, dtype=wrong_dtype), f"must be {str(fresh.dtype).removeprefix('torch.')}"),
        (torch.zeros(fresh.shape[::-1], dtype=fresh.dtype).t(), "must be contiguous"),
        (torch.empty(fresh.shape, dtype=fresh.dtype, device="meta"), "allocate out on cpu"),
    ]
    if fresh.dtype == torch.float32:
        cases.append((torch.zeros_like(fresh).requires_grad_(), "requires grad"))
    if overlap is not None:
        cases.append((overlap, "overlaps the source"))
    return cases


def assert_refused(call, bad: object, match: str) -> None:
    before = bad.detach().clone() if isinstance(bad, torch.Tensor) and bad.device.type == "cpu" else None
    with pytest.raises(OutputBufferError, match=match) as exc:
        call(bad)
    assert isinstance(exc.value, InputError)  # an InputError too, as before out= had its own type
    if before is not None:
        as_bits = (lambda t: t.view(torch.int32)) if before.dtype == torch.float32 else (lambda t: t)
        assert torch.equal(as_bits(bad.detach()), as_bits(before))


@pytest.mark.parametrize("layout", ["flashmla-model1", "trtllm-fp8", "v41-fp4-interleaved"])
def test_a_bad_out_is_refused_before_anything_is_written(layout):
    lay = get_layout(layout)
    x = latents(70).float()
    fresh_pages = kb.encode(x, lay, page_size=P)
    for bad, match in refusals(fresh_pages, x):
        assert_refused(lambda out: kb.encode(x, lay, page_size=P, out=out), bad, match)
    fresh_values = kb.decode(fresh_pages, lay, page_size=P, num_tokens=70)
    for bad, match in refusals(fresh_values, fresh_pages):
        assert_refused(lambda out: kb.decode(fresh_pages, lay, page_size=P, num_tokens=70, out=out), bad, match)
    # A partial overlap (out starts inside the pages) is refused too.
    big = torch.zeros(fresh_pages.numel() + fresh_values.numel() * 4, dtype=torch.uint8)
    pages = big[: fresh_pages.numel()].view(fresh_pages.shape)
    pages.copy_(fresh_pages)
    inside = big[64 : 64 + fresh_values.numel() * 4].view(torch.float32).view(fresh_values.shape)
    assert_refused(lambda out: kb.decode(pages, lay, page_size=P, num_tokens=70, out=out), inside, "overlaps")
    beyond = big[fresh_pages.numel() :].view(torch.float32).view(fresh_values.shape)  # adjacent, not overlapping
    assert torch.equal(bits(kb.decode(pages, lay, page_size=P, num_tokens=70, out=beyond)), bits(fresh_values))


def test_encode_refuses_nonfinite_latents_without_touching_out():
    x = latents(20).float()
    x[7, 300] = float("inf")
    out = torch.full((2, get_layout("flashmla-model1").page_bytes(P)), GARBAGE, dtype=torch.uint8)
    with pytest.raises(NonFiniteError, match="token 7, dim 300"):
        kb.encode(x, "flashmla-model1", page_size=P, out=out)
    assert bool((out == GARBAGE).all())
    got = kb.encode(x, "flashmla-model1", page_size=P, nonfinite="zero", out=out)
    assert torch.equal(got, kb.encode(x, "flashmla-model1", page_size=P, nonfinite="zero"))


def test_transcode_refusals_are_output_buffer_errors():
    pages = kb.encode(latents(8), "trtllm-fp8", page_size=4)
    with pytest.raises(OutputBufferError, match="allocate it with torch.empty"):
        kb.transcode(pages, "trtllm-fp8", "flashmla-model1", src_page_size=4, out=torch.zeros(1, 1, dtype=torch.uint8))
    assert kb.OutputBufferError is OutputBufferError
