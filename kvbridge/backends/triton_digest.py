"""XXH3-64 (seed 0, the default 192-byte secret) of byte spans of a device tensor, as a Triton kernel.

The migration checksums (``kvbridge.migration.rows.CHECKSUM``: one XXH3-64 per source page chunk) computed
where the records are, so that records on a GPU are hashed without a copy to host memory. One program per
span; the hash is XXH3's published algorithm (xxHash 0.8, whose output is fixed since 0.8.0): the
0-16, 17-128 and 129-240 byte paths and the long path's stripes of 64 bytes, blocks of 16 stripes with a
scramble after each, the last stripe at ``len - 64``. All arithmetic is unsigned 64-bit in integer
operations (the 64 x 64 -> 128-bit product from 32-bit halves), so the interpreter and the GPU give the
same bits. Byte-identical to ``kvbridge.backends.native.xxh3_chunks`` (``tests/test_triton_digest.py``
compares both with the ``xxhash`` package under ``TRITON_INTERPRET=1``; ``scripts/gpu_check.py`` on a GPU).

Imported lazily (CUDA tensors, or the interpreter tests), like ``kvbridge.backends.triton_kernels``.
"""

from __future__ import annotations

import contextlib
import os

import numpy as np
import torch
import triton
import triton.language as tl

from kvbridge.errors import InputError

#: Whether the kernel was decorated for Triton's interpreter (``TRITON_INTERPRET=1`` when this module was imported).
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
#: XXH3's default secret (XXH3_kSecret, 192 bytes).
SECRET = bytes.fromhex(
    "b8fe6c3923a44bbe7c01812cf721ad1cded46de9839097db7240a4a4b7b3671fcb79e64eccc0e578825ad07dccff7221"
    "b8084674f743248ee03590e6813a264c3c2852bb91c300cb88d0658b1b532ea371644897a20df94e3819ef46a9deacd8"
    "a8fa763fe39c343ff9dcbbc7c70b4f1d8a51e04bcdb45931c89f7ec9d9787364eac5ac8334d3ebc3c581a0fffa1363eb"
    "170ddd51b7f0da49d316552629d4689e2b16be587d47a1fc8ff8b8d17ad031ce45cb3a8f95160428afd7fbcabb4b407e"
)
_P32_1, _P32_2, _P32_3 = 0x9E3779B1, 0x85EBCA77, 0xC2B2AE3D
_P64_1, _P64_2, _P64_3, _P64_4, _P64_5 = (0x9E3779B185EBCA87, 0xC2B2AE3D27D4EB4F, 0x165667B19E3779F9,
                                          0x85EBCA77C2B2AE63, 0x27D4EB2F165667C5)
_MX1, _MX2 = 0x165667919E3779F9, 0x9FB21C651E98DF25
#: The kernel's constants as one table (indices below): the long path's 8 initial accumulators, then the primes.
CONSTANTS = (_P32_3, _P64_1, _P64_2, _P64_3, _P64_4, _P32_2, _P64_5, _P32_1, _MX1, _MX2)
_C_P64_1, _C_P64_2, _C_P64_3, _C_P32_1, _C_MX1, _C_MX2 = (tl.constexpr(k) for k in (1, 2, 3, 7, 8, 9))


@triton.jit
def _u64(x):
    return x.to(tl.uint64, bitcast=True)


@triton.jit
def _le(p, off, N: tl.constexpr):
    """The little-endian unsigned ``N``-byte word at byte ``off`` of ``p`` (uint8), as uint64."""
    k = tl.arange(0, N)
    b = tl.load(p + off + k).to(tl.uint64)
    return tl.sum(b << (k.to(tl.uint64) * 8), axis=0)


@triton.jit
def _lanes(p, off, lanes):
    """The 8 little-endian uint64 words at ``off + 8 * lanes`` of ``p``."""
    k = tl.arange(0, 8)
    b = tl.load(p + off + lanes[:, None] * 8 + k[None, :]).to(tl.uint64)
    return tl.sum(b << (k.to(tl.uint64) * 8)[None, :], axis=1)


@triton.jit
def _fold(a, b):
    """XXH3_mul128_fold64: the low and high halves of the 128-bit product a * b, XORed."""
    m = tl.full((), 0xFFFFFFFF, tl.uint64)
    a0, a1, b0, b1 = a & m, a >> 32, b & m, b >> 32
    p00, p01, p10, p11 = a0 * b0, a0 * b1, a1 * b0, a1 * b1
    mid = (p00 >> 32) + (p10 & m) + (p01 & m)
    lo = (p00 & m) | (mid << 32)
    hi = p11 + (p10 >> 32) + (p01 >> 32) + (mid >> 32)
    return lo ^ hi


@triton.jit
def _mix16(p, off, secret, soff):
    return _fold(_le(p, off, 8) ^ _le(secret, soff, 8), _le(p, off + 8, 8) ^ _le(secret, soff + 8, 8))


@triton.jit
def _avalanche(h, mx1):
    h = h ^ (h >> 37)
    h = h * mx1
    return h ^ (h >> 32)


@triton.jit
def _accumulate(acc, p, off, secret, soff, lanes):
    """XXH3_accumulate_512: one 64-byte stripe at ``off`` into the 8 accumulators."""
    m = tl.full((), 0xFFFFFFFF, tl.uint64)
    value = _lanes(p, off, lanes)
    key = value ^ _lanes(secret, soff, lanes)
    return acc + _lanes(p, off, lanes ^ 1) + (key & m) * (key >> 32)


@triton.jit
def _xxh3_kernel(data, spans, secret, consts, out):
    i = tl.program_id(0)
    start = tl.load(spans + 2 * i)
    n = tl.load(spans + 2 * i + 1) - start
    p = data + start
    length = n.to(tl.uint64)
    p64_1 = _u64(tl.load(consts + _C_P64_1))
    p64_2 = _u64(tl.load(consts + _C_P64_2))
    p64_3 = _u64(tl.load(consts + _C_P64_3))
    mx1 = _u64(tl.load(consts + _C_MX1))
    h = tl.zeros((), tl.uint64)
    if n <= 16:
        if n > 8:
            lo = _le(p, 0, 8) ^ (_le(secret, 24, 8) ^ _le(secret, 32, 8))
            hi = _le(p, n - 8, 8) ^ (_le(secret, 40, 8) ^ _le(secret, 48, 8))
            swapped = tl.zeros((), tl.uint64)
            for k in tl.static_range(8):
                swapped = swapped | (((lo >> (8 * k)) & 0xFF) << (56 - 8 * k))
            h = _avalanche(length + swapped + hi + _fold(lo, hi), mx1)
        elif n >= 4:
            keyed = (_le(p, n - 4, 4) + (_le(p, 0, 4) << 32)) ^ (_le(secret, 8, 8) ^ _le(secret, 16, 8))
            mx2 = _u64(tl.load(consts + _C_MX2))
            keyed = keyed ^ (((keyed << 49) | (keyed >> 15)) ^ ((keyed << 24) | (keyed >> 40)))
            keyed = keyed * mx2
            keyed = keyed ^ ((keyed >> 35) + length)
            keyed = keyed * mx2
            h = keyed ^ (keyed >> 28)
        else:
            if n > 0:
                c1 = tl.load(p).to(tl.uint64)
                c2 = tl.load(p + (n >> 1)).to(tl.uint64)
                c3 = tl.load(p + n - 1).to(tl.uint64)
                h = ((c1 << 16) | (c2 << 24) | c3 | (length << 8)) ^ (_le(secret, 0, 4) ^ _le(secret, 4, 4))
            else:
                h = _le(secret, 56, 8) ^ _le(secret, 64, 8)
            h = h ^ (h >> 33)
            h = h * p64_2
            h = h ^ (h >> 29)
            h = h * p64_3
            h = h ^ (h >> 32)
    elif n <= 128:
        acc = length * p64_1
        if n > 32:
            if n > 64:
                if n > 96:
                    acc += _mix16(p, 48, secret, 96) + _mix16(p, n - 64, secret, 112)
                acc += _mix16(p, 32, secret, 64) + _mix16(p, n - 48, secret, 80)
            acc += _mix16(p, 16, secret, 32) + _mix16(p, n - 32, secret, 48)
        acc += _mix16(p, 0, secret, 0) + _mix16(p, n - 16, secret, 16)
        h = _avalanche(acc, mx1)
    elif n <= 240:
        acc = length * p64_1
        for k in tl.static_range(8):
            acc += _mix16(p, 16 * k, secret, 16 * k)
        acc = _avalanche(acc, mx1)
        for k in range(8, n // 16):
            acc += _mix16(p, 16 * k, secret, 16 * (k - 8) + 3)
        h = _avalanche(acc + _mix16(p, n - 16, secret, 119), mx1)
    else:
        lanes = tl.arange(0, 8)
        lanes_acc = _u64(tl.load(consts + lanes))
        p32_1 = _u64(tl.load(consts + _C_P32_1))
        blocks = (n - 1) // 1024
        for b in range(0, blocks):
            for s in range(0, 16):
                lanes_acc = _accumulate(lanes_acc, p, b * 1024 + 64 * s, secret, 8 * s, lanes)
            lanes_acc = lanes_acc ^ (lanes_acc >> 47)
            lanes_acc = (lanes_acc ^ _lanes(secret, 128, lanes)) * p32_1
        for s in range(0, ((n - 1) - 1024 * blocks) // 64):
            lanes_acc = _accumulate(lanes_acc, p, blocks * 1024 + 64 * s, secret, 8 * s, lanes)
        lanes_acc = _accumulate(lanes_acc, p, n - 64, secret, 121, lanes)
        h = length * p64_1
        for k in tl.static_range(4):
            a0 = tl.sum(tl.where(lanes == 2 * k, lanes_acc, 0), axis=0)
            a1 = tl.sum(tl.where(lanes == 2 * k + 1, lanes_acc, 0), axis=0)
            h += _fold(a0 ^ _le(secret, 11 + 16 * k, 8), a1 ^ _le(secret, 19 + 16 * k, 8))
        h = _avalanche(h, mx1)
    tl.store(out + i, h.to(tl.int64, bitcast=True))


_TABLES: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}


def _tables(device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """The secret (uint8) and the constants (int64, their bits) on ``device``, made once per device."""
    if device not in _TABLES:
        consts = np.array(CONSTANTS, dtype=np.uint64).view(np.int64)
        _TABLES[device] = (torch.tensor(list(SECRET), dtype=torch.uint8, device=device),
                           torch.from_numpy(consts.copy()).to(device))
    return _TABLES[device]


def xxh3_chunks(data: torch.Tensor, spans: np.ndarray) -> list[int]:
    """XXH3-64 (unsigned) of ``data[spans[k, 0]:spans[k, 1]]`` for every row of ``spans`` (int64 ``[S, 2]``, byte
    offsets into the contiguous uint8 tensor ``data``, on its device): one launch, one program per span.
    ``InputError`` for a span outside ``data`` or reversed."""
    spans = np.ascontiguousarray(spans, dtype=np.int64)
    if data.dtype != torch.uint8 or data.dim() != 1 or not data.is_contiguous():
        raise InputError("xxh3_chunks takes a contiguous flat uint8 tensor")
    if spans.ndim != 2 or spans.shape[1] != 2:
        raise InputError(f"xxh3_chunks spans must be int64 [S, 2], got shape {spans.shape}")
    bad = (spans[:, 0] < 0) | (spans[:, 1] < spans[:, 0]) | (spans[:, 1] > data.numel())
    if bool(bad.any()):
        k = int(np.flatnonzero(bad)[0])
        raise InputError(f"xxh3_chunks span {k} {spans[k].tolist()} lies outside the {data.numel()}-byte tensor")
    if not spans.shape[0]:
        return []
    secret, consts = _tables(data.device)
    out = torch.empty(spans.shape[0], dtype=torch.int64, device=data.device)
    with torch.cuda.device(data.device) if data.is_cuda else contextlib.nullcontext():
        _xxh3_kernel[(spans.shape[0],)](data, torch.from_numpy(spans).to(data.device), secret, consts, out,
                                        num_warps=1)
    return out.cpu().numpy().view(np.uint64).tolist()
