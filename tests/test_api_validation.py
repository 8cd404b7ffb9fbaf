"""Public-API arguments that used to escape as TypeError / RuntimeError / MemoryError: each is now a
specific ``KVBridgeError`` (or, where the input has an obvious meaning, just works)."""

from __future__ import annotations

import pytest
import torch

import kvbridge as kb
from kvbridge.errors import InputError, LayoutError, NonFiniteError


def latents(n: int = 10) -> torch.Tensor:
    return torch.randn(n, 512, generator=torch.Generator().manual_seed(0))


@pytest.mark.parametrize("bad", [10.5, "10", -1, True])
def test_num_tokens_must_be_an_integer(bad):
    pages = kb.encode(latents(), "model1", page_size=4)
    with pytest.raises(InputError, match="num_tokens must be a non-negative integer"):
        kb.decode(pages, "model1", page_size=4, num_tokens=bad)
    with pytest.raises(InputError, match="num_tokens must be a non-negative integer"):
        kb.transcode(pages, "model1", "trtllm-fp8", src_page_size=4, num_tokens=bad)


def test_input_that_requires_grad_is_encoded_as_its_values():
    x = latents().requires_grad_()
    assert torch.equal(kb.encode(x, "model1", page_size=4), kb.encode(x.detach(), "model1", page_size=4))
    assert kb.auto_scale(x) == kb.auto_scale(x.detach())


def test_page_size_and_layout_types():
    with pytest.raises(LayoutError, match=r"page_size must be a positive integer \(at most 1048576\)"):
        kb.encode(latents(), "model1", page_size=2**40)
    with pytest.raises(LayoutError, match="layout must be a layout name or a Layout, got list"):
        kb.encode(latents(), ["model1"], page_size=4)
    with pytest.raises(InputError, match="report must be True or False"):
        kb.transcode(kb.encode(latents(), "model1", page_size=4), "model1", "bf16", src_page_size=4, report="yes")


def test_auto_scale_refuses_what_has_no_scale():
    with pytest.raises(InputError, match="floating-point torch.Tensor"):
        kb.auto_scale([1.0, 2.0])
    with pytest.raises(NonFiniteError):
        kb.auto_scale(torch.tensor([1.0, float("inf")]))


def test_sparse_decode_of_an_empty_batch_is_empty():
    pages = kb.encode(latents(64), "model1", page_size=64)
    q = torch.zeros(0, 1, 8, 512, dtype=torch.bfloat16)
    out, lse = kb.sparse_decode(q, pages, torch.zeros(0, 1, 4, dtype=torch.int32), layout="model1", page_size=64)
    assert out.shape == (0, 1, 8, 512) and out.dtype == torch.bfloat16 and lse.shape == (0, 8, 1)


def test_plan_migration_bounds_the_request():
    with pytest.raises(InputError, match="num_tokens must be a positive integer up to 16,777,216"):
        kb.plan_migration("trtllm", "sglang", "deepseek-v4-flash", 10**12)
    with pytest.raises(InputError, match="model must be a preset name"):
        kb.plan_migration("trtllm", "sglang", 3.5, 100)
