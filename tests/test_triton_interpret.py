"""Every Triton kernel byte-identical to the reference, run on CPU under ``TRITON_INTERPRET=1``.

The interpreter's fp32 -> fp8 cast is wrong (spec section 2), so these runs use the kernels'
integer E4M3 path; ``scripts/gpu_check.py`` checks the hardware-cast path on a GPU.
Decoded values are compared bit for bit (``view(torch.int32)``, so -0.0 and 0.0 differ), except
that NaN payloads and signs are not part of any layout's contract: NaN positions must match.
"""

from __future__ import annotations

import importlib
import os
import subprocess
import sys

os.environ["TRITON_INTERPRET"] = "1"  # must precede the kernels' @triton.jit decoration

import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("triton")

from kvbridge.backends import reference  # noqa: E402
from kvbridge.backends import triton_kernels as tk  # noqa: E402
from kvbridge.errors import NonFiniteError  # noqa: E402
from kvbridge.layouts import all_layouts, get_layout  # noqa: E402
from kvbridge.ops import slots as slot_ops
from kvbridge.ops.pages import is_byte_move  # noqa: E402

# The interpreter runs fp32 math in numpy, which warns where a huge decoded scale overflows to inf (as on a GPU).
pytestmark = pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")

if not tk.INTERPRETED:  # imported earlier in this process without the interpreter: decorate again
    tk = importlib.reload(tk)

MODEL1 = get_layout("flashmla-model1")
FOOTER = get_layout("trtllm-fp8-ds-mla")
TRT = get_layout("trtllm-fp8")
BF16 = get_layout("bf16")
NVFP4 = get_layout("flashinfer-nvfp4")
#: NVFP4 per-tensor global scales g != 1 (docs/layouts.md, ``flashinfer-nvfp4``).
NVFP4_SCALES = (0.125, 0.37)
#: Every registered layout: the kernels read the layouts' own record descriptions.
LAYOUTS = tuple(all_layouts())
#: (layout, dialect, per-tensor scale) of every encoder variant.
WRITERS = [(lay, d, 1.0) for lay in LAYOUTS if not lay.per_tensor_scale for d in lay.dialects or (None,)] + [
    (TRT, "swa", 1.0), (TRT, "swa", 0.037), (TRT, "swa", 2.0), (TRT, "compress", 0.5),
    *((NVFP4, None, g) for g in NVFP4_SCALES),
]


def edge_case_latents() -> torch.Tensor:
    """fp32 ``[40, 512]``: zero / -0 tiles, tiny amax, amax = 448*2^k and fp32/bf16 neighbours,
    E4M3 ties (normal and subnormal), saturating values, fp32 subnormals, bf16 rounding ties."""
    g = torch.Generator().manual_seed(11)
    x = torch.randn(40, 512, generator=g)
    x[0] = 0.0
    x[1] = -0.0
    x[2, :64] = 0.0
    x[2, 64:128] = -0.0
    row = 3
    for k in (-20, -14, -13, -8, -1, 0, 1, 4, 8):  # amax = 448 * 2^k exactly, and one fp32 ulp above / below
        amax = torch.tensor(448.0 * 2.0**k)
        up, down = torch.nextafter(amax, torch.tensor(1e30)), torch.nextafter(amax, torch.tensor(0.0))
        bf_up = amax.to(torch.bfloat16).float() * (1 + 2**-7)
        for t, a in enumerate((amax, up, down, bf_up, -amax, amax, up)):
            x[row, 64 * t : 64 * t + 64] = torch.rand(64, generator=g) * a
            x[row, 64 * t + (t * 9) % 64] = a
        row += 1
    for t, a in enumerate((0.02734375, 0.0273437, 0.0448, 0.04480001, 1e-4, 1e-8, 3e-39)):  # tiny amax near the floors
        x[row, 64 * t : 64 * t + 64] = torch.linspace(-a, a, 64)
    row += 1
    ties = torch.tensor([8.5, 9.5, 124.0, 120.0, 232.0, 1.0625, 2**-10, 3 * 2**-10, 5 * 2**-10, 2**-9 + 2**-11,
                         -2**-10, -8.5, 448.0, 17.0, 0.0, -0.0])
    x[row, :448] = ties.repeat(28)
    x[row + 1, :448] = ties.repeat(28) * 2.0**-5
    x[row + 2, :448] = torch.tensor([464.0, 465.0, 480.0, 500.0, 1e30, -1e30, 449.0, 447.0]).repeat(56)  # saturation
    x[row + 3, :448] = torch.tensor([1e-40, -1e-45, 2.0**-126, 2.0**-127]).repeat(112)  # fp32 subnormals
    row += 4
    x[row, 448:] = torch.tensor([1.0 + 2**-8, 1.0 + 3 * 2**-8, -(1.0 + 2**-8), 3e38]).repeat(16)  # bf16 ties / big
    bits = torch.randint(-(2**31), 2**31 - 1, (8, 512), generator=g, dtype=torch.int64).to(torch.int32)
    x[row + 1 : row + 9] = torch.where(torch.isfinite(bits.view(torch.float32)), bits.view(torch.float32), 1.0)
    return x


def random_pool(layout, num_pages: int, page_size: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (num_pages, layout.page_bytes(page_size)), dtype=torch.uint8, generator=g)


def assert_same_floats(got: torch.Tensor, want: torch.Tensor) -> None:
    nan = torch.isnan(want)
    assert torch.equal(torch.isnan(got), nan)
    assert torch.equal(got[~nan].view(torch.int32), want[~nan].view(torch.int32))


@pytest.fixture(scope="module")
def latents() -> torch.Tensor:
    return edge_case_latents()


@pytest.mark.parametrize(("layout", "dialect", "scale"), WRITERS, ids=lambda v: getattr(v, "name", str(v)))
@pytest.mark.parametrize("page_size", [61, 2])
def test_encode_kernel_matches_reference(latents, layout, dialect, scale, page_size):
    got = tk.encode_pages(latents, layout, page_size, dialect, scale)
    assert torch.equal(got, reference.encode_pages(latents, layout, page_size, dialect, scale))


def test_encode_kernel_matches_flashmla_vectors(model1_vectors):
    tensors, _ = model1_vectors
    x = tensors["p64.input"].reshape(-1, 512)[:192].float()
    assert torch.equal(tk.encode_pages(x, MODEL1, 64, "flashmla", 1.0), tensors["p64.model1"][:3])


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda v: v.name)
def test_decode_kernel_matches_reference_on_random_bytes(layout):
    pages = random_pool(layout, 3, 61, seed=12)  # every code: NaN E4M3 / UE8M0, subnormals, huge scales
    scale = 0.037 if layout.per_tensor_scale else 1.0
    for n in (None, 100):
        want = reference.decode_pages(pages, layout, 61, n, scale)
        assert_same_floats(tk.decode_pages(pages, layout, 61, n, scale), want)


@pytest.mark.parametrize("src", LAYOUTS, ids=lambda v: v.name)
@pytest.mark.parametrize("dst", LAYOUTS, ids=lambda v: v.name)
def test_transcode_kernel_matches_reference(latents, src, dst):
    src_scale = 0.5 if src.per_tensor_scale else 1.0
    dst_scale = 0.037 if dst.per_tensor_scale else 1.0
    pages = reference.encode_pages(latents, src, 64, src.default_dialect, src_scale)
    for dialect in dst.dialects or (None,):
        want = reference.transcode_pages(pages, src, 64, dst, 61, 30, src_scale, dst_scale, dialect)
        assert torch.equal(tk.transcode_pages(pages, src, 64, dst, 61, 30, src_scale, dst_scale, dialect), want)


@pytest.mark.parametrize("g", NVFP4_SCALES)
@pytest.mark.parametrize("other", [MODEL1, TRT, BF16], ids=lambda v: v.name)
def test_nvfp4_global_scale_kernels_match_reference(latents, g, other):
    """Decode (every byte), transcodes to and from another layout and slot transcodes at a global scale g != 1."""
    pages = random_pool(NVFP4, 2, 61, seed=21)
    assert_same_floats(tk.decode_pages(pages, NVFP4, 61, None, g), reference.decode_pages(pages, NVFP4, 61, None, g))
    s = 0.5 if other.per_tensor_scale else 1.0
    src = reference.encode_pages(latents, other, 64, other.default_dialect, s)
    want = reference.transcode_pages(src, other, 64, NVFP4, 61, 30, s, g, None)
    assert torch.equal(tk.transcode_pages(src, other, 64, NVFP4, 61, 30, s, g, None), want)
    back = reference.transcode_pages(want, NVFP4, 61, other, 64, 30, g, s, other.default_dialect)
    assert torch.equal(tk.transcode_pages(want, NVFP4, 61, other, 64, 30, g, s, other.default_dialect), back)
    slots = torch.tensor([5, 0, 29, 7])
    got, ref = torch.zeros_like(want), torch.zeros_like(want)
    dst_slots = torch.tensor([1, 2, 3, 60])
    tk.transcode_slots(src, other, 64, got, NVFP4, 61, slots, dst_slots, s, g, None, False)
    reference.transcode_slots(src, other, 64, ref, NVFP4, 61, slots, dst_slots, s, g, None, False)
    assert torch.equal(got, ref)


def test_transcode_kernel_nonfinite_source_raises_like_reference():
    pages = random_pool(TRT, 1, 64, seed=13)
    pages[0, 3 * 512 + 7] = 0x7F
    with pytest.raises(NonFiniteError) as want:
        reference.transcode_pages(pages, TRT, 64, MODEL1, 64, None, 1.0, 1.0, "flashmla")
    with pytest.raises(NonFiniteError) as got:
        tk.transcode_pages(pages, TRT, 64, MODEL1, 64, None, 1.0, 1.0, "flashmla")
    assert str(got.value) == str(want.value)


BYTE_MOVES = [(src, dst) for src in LAYOUTS for dst in LAYOUTS if src.same_record(dst)]


@pytest.mark.parametrize(("src", "dst"), BYTE_MOVES, ids=lambda v: v.name)
def test_repage_kernel_matches_reference(src, dst):
    pages = random_pool(src, 3, 61, seed=14)
    for n, dst_p in ((None, 64), (150, 2), (1, 61)):
        assert torch.equal(tk.repage(pages, src, 61, dst, dst_p, n), reference.repage(pages, src, 61, dst, dst_p, n))
    assert tk.repage(pages, src, 61, dst, 64, 0).shape == (0, dst.page_bytes(64))


def slot_lists(src_cap: int, dst_cap: int, n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randperm(src_cap, generator=g)[:n].to(torch.int32), torch.randperm(dst_cap, generator=g)[:n]


@pytest.mark.parametrize(
    ("src", "src_scale", "dst", "dst_scale", "dialect"),
    [(TRT, 0.5, MODEL1, None, "amax-1e-4"), (MODEL1, None, TRT, 2.0, None), (BF16, None, FOOTER, None, "amax-1e-8"),
     (FOOTER, None, BF16, None, None), (MODEL1, None, FOOTER, None, None), (TRT, 0.5, TRT, 0.5, None)],
    ids=lambda v: getattr(v, "name", str(v)),
)
def test_transcode_slots_kernel_matches_reference(latents, src, src_scale, dst, dst_scale, dialect):
    pages = reference.encode_pages(latents, src, 7, src.default_dialect, src_scale or 1.0)
    src_slots, dst_slots = slot_lists(pages.shape[0] * 7, 3 * 61, 33, seed=15)
    want = random_pool(dst, 3, 61, seed=16)
    got = want.clone()
    slot_ops.transcode_slots(pages, src, want, dst, src_page_size=7, dst_page_size=61, src_slots=src_slots,
                          dst_slots=dst_slots, src_scale=src_scale, dst_scale=dst_scale, dialect=dialect)
    byte_move = is_byte_move(src, dst, src_scale or 1.0, dst_scale or 1.0)
    d = None if byte_move else (dialect or dst.default_dialect)
    tk.transcode_slots(pages, src, 7, got, dst, 61, src_slots, dst_slots, src_scale or 1.0, dst_scale or 1.0, d,
                       byte_move)
    assert torch.equal(got, want)


def test_persistent_grid_matches_reference(latents, monkeypatch):
    """A persistent grid (2 programs under the interpreter) looping over the blocks gives the same bytes."""
    monkeypatch.setattr(tk, "convert_programs_per_sm", 1)
    pages = reference.encode_pages(latents, TRT, 7, "swa", 0.5)
    want = reference.transcode_pages(pages, TRT, 7, MODEL1, 5, None, 0.5, 1.0, "amax-1e-8")
    assert torch.equal(tk.transcode_pages(pages, TRT, 7, MODEL1, 5, None, 0.5, 1.0, "amax-1e-8"), want)
    src_slots, dst_slots = slot_lists(pages.shape[0] * 7, 3 * 61, 33, seed=18)
    want = random_pool(MODEL1, 3, 61, seed=19)
    got = want.clone()
    slot_ops.transcode_slots(pages, TRT, want, MODEL1, src_page_size=7, dst_page_size=61, src_slots=src_slots,
                          dst_slots=dst_slots, src_scale=0.5)
    tk.transcode_slots(pages, TRT, 7, got, MODEL1, 61, src_slots, dst_slots, 0.5, 1.0, "flashmla", False)
    assert torch.equal(got, want)


def test_nonfinite_flags_kernel_names_the_bad_slots():
    pages = reference.encode_pages(edge_case_latents()[:8], MODEL1, 4, "flashmla", 1.0)
    pages[1, 4 * 576 + 2 * 8 + 2] = 0xFF  # slot 6 (page 1, row 2): UE8M0 NaN scale of tile 2
    pages[0, 2 * 576 + 449] = 0x7F  # slot 2: rope dim 448 becomes bf16 0x7F80 = +Inf (little-endian)
    pages[0, 2 * 576 + 448] = 0x80
    flags = tk.nonfinite_flags(pages, MODEL1, 4, torch.tensor([0, 6, 1, 2, 7]), 1.0)
    assert flags.tolist() == [0, tk.FLAG_NONFINITE, 0, tk.FLAG_NONFINITE, 0]


@pytest.mark.parametrize(("src", "scale", "dialect"), [(TRT, 0.037, "flashmla"), (BF16, 1.0, "amax-1e-8"),
                                                       (FOOTER, 1.0, None), (MODEL1, 1.0, None)],
                         ids=lambda v: getattr(v, "name", str(v)))
@pytest.mark.parametrize("out", ["flashmla-model1", "v41-fp8-interleaved"])
def test_gather_transcode_kernel_matches_reference(latents, src, scale, dialect, out):
    out = get_layout(out)
    pages = reference.encode_pages(latents, src, 61, src.default_dialect, scale)
    g = torch.Generator().manual_seed(17)
    indices = torch.randint(0, 40, (2, 2, 9), generator=g, dtype=torch.int32)
    indices[0, 1, :4] = -1
    s = scale if src.per_tensor_scale else None
    byte_move = src.same_record(out)
    dialect = dialect if not byte_move and dialect in out.dialects else None
    want, want_remap = slot_ops.gather_transcode(pages, src, page_size=61, indices=indices, scale=s, dialect=dialect,
                                              out_page_size=5, out_layout=out)
    d = None if byte_move else (dialect or out.default_dialect)
    got, flags = tk.gather_transcode(pages, src, 61, indices.reshape(-1), scale, d, byte_move, 5, out)
    assert not bool(flags.any())
    assert torch.equal(got, want)
    assert want_remap.shape == indices.shape


def test_gather_kernel_flags_become_the_reference_errors():
    pages = reference.encode_pages(edge_case_latents()[:16], TRT, 4, "swa", 1.0)
    pages[1, 2 * 512 + 5] = 0x7F  # slot 6 decodes to NaN
    for indices in (torch.tensor([[0, 16], [3, -1]]), torch.tensor([[0, -3]]), torch.tensor([[6, 1], [-1, 6]])):
        with pytest.raises(Exception) as want:
            slot_ops.gather_transcode(pages, TRT, page_size=4, indices=indices)
        _, flags = tk.gather_transcode(pages, TRT, 4, indices.reshape(-1), 1.0, "flashmla", False, 64, MODEL1)
        with pytest.raises(type(want.value)) as got:
            slot_ops._raise_flags(flags, indices, 16)
        assert str(got.value) == str(want.value)
    copy_flags = tk.gather_transcode(reference.encode_pages(edge_case_latents()[:8], MODEL1, 4, "flashmla", 1.0),
                                     MODEL1, 4, torch.tensor([7, 8, -1, -9]), 1.0, None, True, 64, MODEL1)[1]
    assert copy_flags.tolist() == [0, tk.FLAG_OUT_OF_RANGE, 0, tk.FLAG_OUT_OF_RANGE]


def test_interpreter_runs_the_integer_e4m3_path():
    """The interpreter's fp8 cast is wrong, so every check above must have used the bit-operation encoder."""
    assert tk.INTERPRETED and not tk.fp8_hardware


AOT_COMPILE = r'''
import re
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from kvbridge.backends import triton_kernels as tk

from kvbridge.layouts import all_layouts as tk_layouts, get_layout


def compile_ptx(fn, pointers, scalars, constexprs, num_warps):
    """PTX of ``fn`` for an H100/H200 (sm_90), with 16-byte aligned pointers as Triton's launcher assumes."""
    sig = {**pointers, **scalars, **{k: "constexpr" for k in constexprs}}
    attrs = {(fn.arg_names.index(n),): [["tt.divisibility", 16]] for n in pointers}
    src = ASTSource(fn=fn, signature=sig, constexprs=constexprs, attrs=attrs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": num_warps}).asm["ptx"]


def side(name, read=False):
    """(pointer type, record program (``read``: the decoders'), data row bytes, record bytes) of a layout, or of
    dense fp32 (None)."""
    if name is None:
        return "*fp32", (), 0, 0
    lay = get_layout(name)
    return "*u8", tk.program(lay, read=read), lay.split or lay.record_bytes, lay.record_bytes


def convert(src_name, dst_name, hw, slots, check=True, persistent=False):
    (sp, sprog, ss, sr), (dp, dprog, ds, dr) = side(src_name, read=True), side(dst_name)
    pointers = {"src": sp, "src16": "*i16", "src_slots": "*i32", "dst": dp, "dst16": "*i16",
                "dst_slots": "*i32", "flags": "*u8"}
    scalars = {"src_cap": "i64", "src_p": "i32", "src_pb": "i32", "src_scale": "fp32", "dst_p": "i32", "dst_pb": "i32",
               "dst_mult": "fp32", "dst_gscale": "fp32", "min_exp": "i32", "n_tokens": "i64", "n_rows": "i64",
               "n_blocks": "i32"}
    const = dict(SRC_PROG=sprog, SRC_NF=len(sprog) // 6, SRC_S=ss, SRC_R=sr, SRC_ALIGN=16, SRC_HAS_SLOTS=slots,
                 DST_PROG=dprog, DST_NF=len(dprog) // 6, DST_S=ds, DST_R=dr, DST_ALIGN=16, DST_HAS_SLOTS=slots,
                 CHECK=check, WRITE=True, HW_FP8=hw, BLOCK_T=tk.convert_block_tokens, PERSISTENT=persistent)
    return compile_ptx(tk._convert_kernel, pointers, scalars, const, tk.convert_warps)


def count(pattern, ptx):
    return len(re.findall(pattern, ptx))


# TensorRT-LLM FP8 -> MODEL1, hardware E4M3: 16-byte loads and stores, the saturating RNE conversion.
ptx = convert("trtllm-fp8", "flashmla-model1", hw=True, slots=False)
assert count(r"ld\.global\.v4\.b32", ptx) and not count(r"ld\.global\.b8", ptx), "source bytes not vectorised"
assert count(r"st\.global\.v4\.b32", ptx), "destination rows not vectorised"
assert count(r"cvt\.rn\.satfinite\.e4m3x2\.f32", ptx), "no hardware RNE/satfinite E4M3 conversion"
# The integer E4M3 path emits no fp8 conversion at all.
ptx = convert(None, "flashmla-model1", hw=False, slots=True)
assert not count(r"e4m3", ptx) and count(r"ld\.global\.v4\.b32", ptx)
assert count(r"ld\.global\.v4\.b32", convert("flashmla-model1", None, hw=True, slots=True)), "MODEL1 decode"
convert("bf16", "trtllm-fp8", hw=True, slots=True)
assert count(r"ld\.global\.v4\.b32", convert("trtllm-fp8", "flashmla-model1", hw=True, slots=False,
                                             persistent=True)), "persistent loop"
# Every registered layout compiles both ways (the record program as constexprs).
for lay in tk_layouts():
    convert(lay.name, "v41-fp8-interleaved", hw=True, slots=True)
    convert("trtllm-fp8", lay.name, hw=True, slots=False)
pointers = {"src": "*i64", "src_slots": "*i32", "dst": "*i64", "dst_slots": "*i32", "flags": "*u8"}
scalars = {"src_cap": "i64", "src_p": "i32", "src_pw": "i32", "dst_p": "i32", "dst_pw": "i32", "n_tokens": "i64",
           "n_rows": "i64"}
const = dict(LO=0, HI=72, W_BLOCK=128, SRC_SW=72, DST_SW=72, RW=73, SRC_WA=2, DST_WA=2, SRC_HAS_SLOTS=True,
             DST_HAS_SLOTS=False, CHECK=True, BLOCK_T=tk.copy_block_tokens)
ptx = compile_ptx(tk._copy_kernel, pointers, scalars, const, tk.copy_warps)
assert count(r"ld\.global\.v2\.b64", ptx) and count(r"st\.global\.v2\.b64", ptx), "byte move not 16 bytes per access"
print("compiled")
'''


def test_kernels_compile_for_sm90_with_vectorised_access():
    """The real compiler (not the interpreter) for an H100/H200 target, no GPU needed: catches what the
    interpreter accepts but the compiler does not, and checks the PTX for 16-byte accesses and the
    hardware E4M3 conversion the design relies on."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-c", AOT_COMPILE], capture_output=True, text=True, env=env, timeout=600)
    assert done.returncode == 0 and "compiled" in done.stdout, done.stderr[-3000:]


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda v: v.name)
def test_encode_and_decode_kernels_write_every_byte_of_out(latents, layout):
    """``out=`` (garbage-filled): the kernels write into it directly, equal to their fresh output."""
    scale = 0.037 if layout.per_tensor_scale else 1.0
    fresh = tk.encode_pages(latents, layout, 61, layout.default_dialect, scale)
    out = torch.full_like(fresh, 0xA5)
    assert tk.encode_pages(latents, layout, 61, layout.default_dialect, scale, out=out) is out
    assert torch.equal(out, fresh)
    values = tk.decode_pages(fresh, layout, 61, 30, scale)
    into = torch.full_like(values, float("nan"))
    assert tk.decode_pages(fresh, layout, 61, 30, scale, out=into) is into
    assert torch.equal(into.view(torch.int32), values.view(torch.int32))
