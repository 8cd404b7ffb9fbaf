"""The flashmla backend's CPU side: build detection and kernel-argument preparation.

No kernel runs here. Build detection is checked against module objects that carry the
signatures the installed ``flash_mla`` packages expose; argument preparation is checked by
shape, stride, dtype and pointer, and by decoding the prepared (view, indices) pair with the
reference backend, which must give the decode of the original pool.
"""

from __future__ import annotations

import sys
import types

import pytest
import torch
from test_sparse_decode import LSE_TOL, OUT_TOL, assert_close_flashmla, random_problem

import kvbridge
from kvbridge import InputError, LayoutError, sparse_decode
from kvbridge.attention.args import validate
from kvbridge.attention.flashmla import (
    CURRENT_MAIN,
    SCRATCH_PAGE_SIZE,
    BackendUnavailable,
    detect_build,
    import_build,
    kernel_heads,
    prepare,
    unsupported_reason,
)
from kvbridge.layouts.codec import record_codec
from kvbridge.ops.slots import record_byte_index


def split_wheel_module(legacy: bool | None, *, legacy_as_function: bool = True) -> types.ModuleType:
    """A module exposing the sgl-flash-mla 1.0.0 surface: current + legacy kernels, ``has_legacy()``."""
    mod = types.ModuleType("flash_mla")

    def flash_mla_with_kvcache(q, k_cache, block_table, cache_seqlens, head_dim_v, tile_scheduler_metadata,
                               num_splits=None, softmax_scale=None, causal=False, is_fp8_kvcache=None,
                               indices=None, attn_sink=None, extra_k_cache=None, extra_indices_in_kvcache=None,
                               topk_length=None, extra_topk_length=None, enable_batch_invariant=False,
                               use_legacy=False, kv_format=None, descale_q=None, descale_k=None):
        raise AssertionError("detection must not call the kernel")

    mod.flash_mla_with_kvcache = flash_mla_with_kvcache
    mod.get_mla_metadata = lambda *a, **k: (object(), None)
    if legacy is not None:
        mod.has_legacy = (lambda: legacy) if legacy_as_function else legacy
    return mod


def _v4_with_format(q, k_cache, block_table, cache_seqlens, head_dim_v, tile_scheduler_metadata, num_splits=None,
                    softmax_scale=None, causal=False, is_fp8_kvcache=False, indices=None, attn_sink=None,
                    extra_k_cache=None, extra_indices_in_kvcache=None, topk_length=None, extra_topk_length=None,
                    kv_format=None):
    raise AssertionError("detection must not call the kernel")


def _v4_without_format(q, k_cache, block_table, cache_seqlens, head_dim_v, tile_scheduler_metadata, num_splits=None,
                       softmax_scale=None, causal=False, is_fp8_kvcache=False, indices=None, attn_sink=None,
                       extra_k_cache=None, extra_indices_in_kvcache=None, topk_length=None, extra_topk_length=None):
    raise AssertionError("detection must not call the kernel")


def _v32_era(q, k_cache, block_table, cache_seqlens, head_dim_v, tile_scheduler_metadata, num_splits,
             softmax_scale=None, causal=False, is_fp8_kvcache=False, indices=None):
    raise AssertionError("detection must not call the kernel")


def unified_module(kernel_entry) -> types.ModuleType:
    """A module exposing a pre-2026.09.30 surface (one set of kernels) with entry point ``kernel_entry``."""
    mod = types.ModuleType("flash_mla")
    mod.flash_mla_with_kvcache = kernel_entry
    mod.get_mla_metadata = lambda *a, **k: (object(), None)
    return mod


def test_split_wheel_with_legacy_kernels_uses_them_for_model1():
    for as_function in (True, False):
        build = detect_build(split_wheel_module(True, legacy_as_function=as_function))
        assert build.problem is None and build.split_legacy and build.has_legacy
        assert build.route(M1, None).call_kwargs == {"use_legacy": True, "kv_format": "V4"}
        # another MODEL1 geometry is byte-moved into a MODEL1 scratch for the same kernels
        assert build.route(kvbridge.get_layout("trtllm-fp8-ds-mla"), M1) == \
            build.route(M1, M1)
        # block-split V4.1 caches go to the legacy V41 kernels as they are, an fp4 extra cache too
        route = build.route(V41, kvbridge.get_layout("v41-fp4"))
        assert route.call_kwargs == {"use_legacy": True, "kv_format": "V41"} and route.extra_layout == "v41-fp4"
        # interleaved V4.1 caches and everything else go to the current kernels
        route = build.route(V41I, kvbridge.get_layout("v41-fp4-interleaved"))
        assert route.call_kwargs == {} and (route.main_layout, route.extra_layout) == (V41I.name, "v41-fp4-interleaved")
        route = build.route(kvbridge.get_layout("trtllm-fp8"), kvbridge.get_layout("bf16"))
        assert route.call_kwargs == {} and (route.main_layout, route.extra_layout) == (CURRENT_MAIN, CURRENT_MAIN)


@pytest.mark.parametrize("legacy", [False, None])
def test_split_wheel_without_legacy_kernels_reads_everything_through_the_current_kernels(legacy):
    build = detect_build(split_wheel_module(legacy))
    assert build.split_legacy and not build.has_legacy and build.problem is None
    for lay in (M1, V41, kvbridge.get_layout("trtllm-fp8")):
        route = build.route(lay, V41)
        assert route.call_kwargs == {} and (route.main_layout, route.extra_layout) == (CURRENT_MAIN, CURRENT_MAIN)


def test_unified_builds_read_model1_directly():
    assert detect_build(unified_module(_v4_with_format)).route(V41I, None).call_kwargs == {"kv_format": "V4"}
    build = detect_build(unified_module(_v4_without_format))
    assert build.problem is None and not build.split_legacy
    route = build.route(V41I, V41)
    assert route.call_kwargs == {} and (route.main_layout, route.extra_layout) == ("flashmla-model1",) * 2


def test_builds_before_deepseek_v4_are_refused():
    build = detect_build(unified_module(_v32_era))
    assert "predates DeepSeek-V4" in build.problem and "extra_k_cache" in build.problem
    assert "no flash_mla_with_kvcache" in detect_build(types.ModuleType("flash_mla")).problem


def test_import_failure_is_a_clear_error(monkeypatch):
    monkeypatch.setitem(sys.modules, "flash_mla", None)  # makes `import flash_mla` raise ImportError
    with pytest.raises(BackendUnavailable, match="needs the flash_mla package"):
        import_build()


def test_flashmla_backend_refuses_cpu_tensors_before_importing(monkeypatch):
    monkeypatch.setitem(sys.modules, "flash_mla", None)
    x, q, idx, lengths, sink = random_problem(1)
    pages = kvbridge.encode(x, "model1", page_size=64)
    with pytest.raises(BackendUnavailable, match="runs on CUDA tensors"):
        sparse_decode(q, pages, idx, layout="model1", page_size=64, backend="flashmla")


def test_unsupported_reasons_and_kernel_heads():
    x, q, idx, _, _ = random_problem(2)
    pages = kvbridge.encode(x, "model1", page_size=64)
    assert "runs on CUDA tensors" in unsupported_reason(validate(q, pages, idx, **plain_args()))
    assert kernel_heads(1) == 64 and kernel_heads(64) == 64 and kernel_heads(65) == 128
    with pytest.raises(InputError, match="at most 128 query heads"):
        kernel_heads(129)


M1 = kvbridge.get_layout("flashmla-model1")
V41 = kvbridge.get_layout("v41-fp8")
V41I = kvbridge.get_layout("v41-fp8-interleaved")


def plain_args(**over) -> dict:
    args = dict(layout="model1", page_size=64, extra_k_cache=None, extra_indices=None, extra_layout=None,
                extra_page_size=None, topk_length=None, extra_topk_length=None, attn_sink=None,
                softmax_scale=None, scale=None, extra_scale=None)
    args.update(over)
    return args


LEGACY_BUILD = detect_build(split_wheel_module(True))


def test_model1_pool_is_passed_zero_copy_with_padded_page_stride():
    x, q, idx, lengths, sink = random_problem(3, topk=100)
    pages = kvbridge.encode(x, "model1", page_size=64)
    args = validate(q, pages, idx, **plain_args(topk_length=lengths, attn_sink=sink))
    call = prepare(args, LEGACY_BUILD)
    view = call.kwargs["k_cache"]
    assert view.dtype == torch.uint8 and view.shape == (pages.shape[0], 64, 1, 584)
    assert view.stride() == (37440, 584, 584, 1) and view.stride(0) % 576 == 0
    assert view.data_ptr() == pages.data_ptr() and not call.main.gathered
    # The kernel addresses page p at base + p * stride(0): every page's bytes are the pool's.
    for p in range(pages.shape[0]):
        page = torch.as_strided(view, (view.stride(0),), (1,), view.storage_offset() + p * view.stride(0))
        assert torch.equal(page, pages[p])
    ind = call.kwargs["indices"]
    assert ind.dtype == torch.int32 and ind.shape == (2, 2, 128) and ind.is_contiguous()
    assert bool((ind[..., 100:] == -1).all())
    keep = torch.arange(100) < lengths.long()[:, None, None]
    assert torch.equal(ind[..., :100], torch.where(keep & (idx >= 0), idx, torch.full_like(idx, -1)))
    q_in = call.kwargs["q"]
    assert q_in.shape == (2, 2, 64, 512) and q_in.dtype == torch.bfloat16
    assert torch.equal(q_in[:, :, :8], q) and not bool(q_in[:, :, 8:].any())
    assert call.kwargs["attn_sink"].shape == (64,) and torch.equal(call.kwargs["attn_sink"][:8], sink)
    assert call.kwargs["use_legacy"] is True and call.kwargs["kv_format"] == "V4"
    assert call.kwargs["head_dim_v"] == 512 and call.kwargs["is_fp8_kvcache"] and not call.kwargs["causal"]
    assert call.kwargs["softmax_scale"] == 512**-0.5 and call.heads == 8


def decode_prepared(call, args) -> tuple[torch.Tensor, torch.Tensor]:
    """Decode the prepared kernel arguments with the reference backend (real heads only)."""
    kw = call.kwargs
    extra = {}
    if kw["extra_k_cache"] is not None:
        extra = dict(extra_k_cache=kw["extra_k_cache"], extra_indices=kw["extra_indices_in_kvcache"],
                     extra_page_size=kw["extra_k_cache"].shape[1], extra_topk_length=kw["extra_topk_length"])
    sink = kw["attn_sink"][: call.heads] if kw["attn_sink"] is not None else None
    if call.extra is not None:
        extra["extra_layout"] = call.extra.layout
    return sparse_decode(kw["q"][:, :, : call.heads], kw["k_cache"], kw["indices"], layout=call.main.layout,
                         page_size=kw["k_cache"].shape[1], topk_length=kw["topk_length"], attn_sink=sink,
                         softmax_scale=kw["softmax_scale"], backend="reference", **extra)


@pytest.mark.parametrize(("layout", "page_size", "scale"), [("trtllm-fp8", 128, 1.0), ("trtllm-fp8", 32, 0.5),
                                                            ("trtllm-fp8-ds-mla", 64, None), ("bf16", 16, None),
                                                            ("model1", 2, None), ("v41-fp8", 61, None),
                                                            ("v41-fp8-interleaved", 3, None)])
def test_prepared_arguments_decode_like_the_original_pool(layout, page_size, scale):
    x, q, idx, lengths, sink = random_problem(4, topk=70)
    cx = torch.randn(20, 512, generator=torch.Generator().manual_seed(5))
    cidx = torch.randint(-1, 20, (2, 2, 64), generator=torch.Generator().manual_seed(6), dtype=torch.int32)
    clen = torch.tensor([64, 9], dtype=torch.int32)
    route = LEGACY_BUILD.route(kvbridge.get_layout(layout), kvbridge.get_layout(layout))
    if layout == "bf16":
        # bf16 -> the scratch layout re-quantizes; use values it holds exactly so both hold the same numbers.
        target = route.main_layout
        x, cx = (kvbridge.decode(kvbridge.encode(v, target, page_size=64), target, page_size=64,
                                 num_tokens=v.shape[0]) for v in (x, cx))
    enc_scale = {} if scale is None else {"scale": scale}
    pool = kvbridge.encode(x, layout, page_size=page_size, **enc_scale)
    extra_pool = kvbridge.encode(cx, layout, page_size=4, **enc_scale)
    args = validate(q, pool, idx, **plain_args(
        layout=layout, page_size=page_size, topk_length=lengths, attn_sink=sink, scale=scale,
        extra_k_cache=extra_pool, extra_indices=cidx, extra_page_size=4, extra_topk_length=clen, extra_scale=scale,
    ))
    call = prepare(args, LEGACY_BUILD)
    gathered = kvbridge.get_layout(layout).name != route.main_layout
    assert call.main.gathered == gathered and call.extra.gathered == gathered
    want_layout = kvbridge.get_layout(route.main_layout)
    for cache in (call.main, call.extra):
        assert cache.layout is want_layout
        assert cache.k_cache.shape[2:] == (1, want_layout.record_bytes)
        assert cache.k_cache.stride(0) == want_layout.page_bytes(cache.k_cache.shape[1])
        assert cache.indices.dtype == torch.int32 and cache.indices.shape[-1] % 64 == 0
    if gathered:
        # Gathered scratch: one slot per counted index entry, -1 entries stay -1.
        counted = args.main.indices.reshape(-1) >= 0
        flat = call.main.indices[..., :70].reshape(-1)
        assert torch.equal(flat >= 0, counted)
        assert torch.equal(flat[counted], torch.arange(flat.numel(), dtype=torch.int32)[counted])
    want = sparse_decode(q, pool, idx, layout=layout, page_size=page_size, topk_length=lengths, attn_sink=sink,
                         scale=scale, extra_k_cache=extra_pool, extra_indices=cidx, extra_page_size=4,
                         extra_topk_length=clen, extra_scale=scale, backend="reference")
    got = decode_prepared(call, args)
    assert_close_flashmla("out", got[0], want[0], **OUT_TOL)
    assert_close_flashmla("lse", got[1], want[1], **LSE_TOL)


def test_scratch_records_hold_the_pool_values_exactly():
    """trtllm-fp8 at scale 1 -> the current kernels' 528-byte scratch is lossless: it decodes to the pool's values."""
    x, q, idx, _, _ = random_problem(8)
    pool = kvbridge.encode(x, "trtllm-fp8", page_size=128)
    args = validate(q, pool, idx, **plain_args(layout="trtllm-fp8", page_size=128))
    call = prepare(args, LEGACY_BUILD)
    view = call.kwargs["k_cache"]
    scratch = torch.as_strided(view, (view.shape[0], view.stride(0)), (view.stride(0), 1), view.storage_offset())
    remapped = call.main.indices[..., :64].reshape(-1).long()
    slots = idx.reshape(-1).long()
    ok = slots >= 0
    lay_s, lay_fp8 = call.main.layout, kvbridge.get_layout("trtllm-fp8")
    assert lay_s.name == CURRENT_MAIN and call.kwargs["k_cache"].shape[1:] == (SCRATCH_PAGE_SIZE, 1, 528)
    got = record_codec(lay_s).decode(scratch.reshape(-1)[record_byte_index(lay_s, 64, remapped[ok])], scale=1.0)
    want = record_codec(lay_fp8).decode(pool.reshape(-1)[record_byte_index(lay_fp8, 128, slots[ok])], scale=1.0)
    assert torch.equal(got, want)


def test_prepare_refuses_a_build_without_deepseek_v4_kernels():
    x, q, idx, _, _ = random_problem(9)
    pages = kvbridge.encode(x, "model1", page_size=64)
    args = validate(q, pages, idx, **plain_args())
    with pytest.raises(LayoutError, match="cannot run here: .*predates DeepSeek-V4"):
        prepare(args, detect_build(unified_module(_v32_era)))
    with pytest.raises(InputError, match="needs bfloat16 q"):
        prepare(validate(q.float(), pages, idx, **plain_args()), LEGACY_BUILD)


def test_interleaved_v41_caches_go_zero_copy_to_the_current_kernels():
    x, q, idx, lengths, _ = random_problem(10, topk=64)
    cx = torch.randn(40, 512, generator=torch.Generator().manual_seed(3))
    main = kvbridge.encode(x, "v41-fp8-interleaved", page_size=64)
    extra = kvbridge.encode(cx, "v41-fp4-interleaved", page_size=2)
    cidx = torch.randint(-1, 40, (2, 2, 64), generator=torch.Generator().manual_seed(4), dtype=torch.int32)
    args = validate(q, main, idx, **plain_args(layout="v41-fp8-interleaved", topk_length=lengths, extra_k_cache=extra,
                                                extra_indices=cidx, extra_layout="v41-fp4-interleaved",
                                                extra_page_size=2))
    for build in (LEGACY_BUILD, detect_build(split_wheel_module(False))):
        call = prepare(args, build)
        assert "use_legacy" not in call.kwargs and "kv_format" not in call.kwargs
        view, extra_view = call.kwargs["k_cache"], call.kwargs["extra_k_cache"]
        assert view.shape == (main.shape[0], 64, 1, 528) and view.stride() == (64 * 528, 528, 528, 1)
        assert extra_view.shape == (extra.shape[0], 2, 1, 288) and extra_view.stride() == (576, 288, 288, 1)
        assert view.data_ptr() == main.data_ptr() and extra_view.data_ptr() == extra.data_ptr()
        assert not call.main.gathered and not call.extra.gathered
    want = sparse_decode(q, main, idx, layout="v41-fp8-interleaved", page_size=64, topk_length=lengths,
                         extra_k_cache=extra, extra_indices=cidx, extra_layout="v41-fp4-interleaved",
                         extra_page_size=2, backend="reference")
    got = decode_prepared(call, args)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
