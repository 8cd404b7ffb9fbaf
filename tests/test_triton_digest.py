"""The Triton XXH3-64 (``kvbridge.backends.triton_digest``) equal to the ``xxhash`` package and the native kernel.

Run under ``TRITON_INTERPRET=1`` on CPU tensors (the interpreter runs the kernel's unsigned 64-bit integer
operations exactly, in numpy); the real compiler builds it for sm_90, sm_100 and sm_120 in a clean process;
``scripts/gpu_check.py`` runs it on CUDA tensors against the CPU.
"""

from __future__ import annotations

import os
import subprocess
import sys

os.environ["TRITON_INTERPRET"] = "1"  # must precede the kernel's @triton.jit decoration

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

pytest.importorskip("triton")
xxhash = pytest.importorskip("xxhash")

import importlib  # noqa: E402

from kvbridge.backends import dispatch  # noqa: E402
from kvbridge.backends import triton_digest as td  # noqa: E402
from kvbridge.errors import InputError  # noqa: E402

if not td.INTERPRETED:  # imported earlier in this process without the interpreter: decorate again
    td = importlib.reload(td)

# numpy warns on the uint64 products that wrap, which XXH3 intends
pytestmark = pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")

DATA = np.random.default_rng(5).integers(0, 256, 9000, dtype=np.uint8)


def _want(data: np.ndarray, spans: np.ndarray) -> list[int]:
    return [xxhash.xxh3_64_intdigest(data[a:b].tobytes()) for a, b in spans]


def test_every_length_path():
    """Every length 0-260 (the 0, 1-3, 4-8, 9-16, 17-128 and 129-240 byte paths and the long path's start), the
    long path's block edges (1,024 and 2,048 bytes and their neighbours), a last partial stripe, at odd offsets."""
    lengths = [*range(261), 1023, 1024, 1025, 1087, 1088, 2047, 2048, 2049, 3001]
    starts = (np.arange(len(lengths)) * 37) % 5000
    spans = np.array([(s, s + n) for s, n in zip(starts, lengths, strict=True)], dtype=np.int64)
    got = td.xxh3_chunks(torch.from_numpy(DATA), spans)
    assert got == _want(DATA, spans)
    assert got == dispatch.xxh3_chunks(DATA, spans)  # the native kernel (or the xxhash package without it)


@settings(max_examples=15, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 8999), st.integers(0, 1500)), min_size=1, max_size=6))
def test_random_spans(pairs):
    spans = np.array([(a, min(9000, a + n)) for a, n in pairs], dtype=np.int64)
    assert td.xxh3_chunks(torch.from_numpy(DATA), spans) == _want(DATA, spans)


def test_bad_spans_and_tensors_are_refused():
    data = torch.from_numpy(DATA)
    for spans in ([[0, 9001]], [[-1, 4]], [[10, 5]]):
        with pytest.raises(InputError, match="outside"):
            td.xxh3_chunks(data, np.array(spans, dtype=np.int64))
    with pytest.raises(InputError, match=r"\[S, 2\]"):
        td.xxh3_chunks(data, np.zeros((2, 3), dtype=np.int64))
    with pytest.raises(InputError, match="flat uint8"):
        td.xxh3_chunks(data.view(torch.int8), np.zeros((1, 2), dtype=np.int64))
    assert td.xxh3_chunks(data, np.zeros((0, 2), dtype=np.int64)) == []


def test_dispatch_hashes_a_cpu_tensor_as_its_bytes():
    spans = np.array([[0, 100], [100, 4096], [7, 7]], dtype=np.int64)
    assert dispatch.xxh3_chunks(torch.from_numpy(DATA), spans) == _want(DATA, spans)


_COMPILE = """
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from kvbridge.backends import triton_digest as td
sig = {"data": "*u8", "spans": "*i64", "secret": "*u8", "consts": "*i64", "out": "*i64"}
for arch in (90, 100, 120):
    k = triton.compile(ASTSource(fn=td._xxh3_kernel, signature=sig, constexprs={}),
                       target=GPUTarget("cuda", arch, 32), options={"num_warps": 1})
    ptx = k.asm["ptx"]
    assert k.asm["cubin"] and "ld.local" not in ptx and "st.local" not in ptx and ".f64" not in ptx, arch
    print(arch, "ok")
"""


def test_the_kernel_compiles_for_every_target():
    """The real compiler (no GPU needed) builds the kernel for sm_90, sm_100 and sm_120 with no local memory and no
    fp64 instruction."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-c", _COMPILE], capture_output=True, text=True, env=env, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split() == ["90", "ok", "100", "ok", "120", "ok"]
