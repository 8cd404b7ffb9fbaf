"""The migration checksum (XXH3-64 per page chunk) against xxHash's published vectors, and the wire
protocols refusing a peer of the CRC-32 protocol with a line that says so."""

from __future__ import annotations

import os
import socket
import struct
import subprocess
import sys
import threading
import time
from datetime import timedelta

import numpy as np
import pytest
import torch
import torch.distributed as dist
import xxhash
from hypothesis import given, settings
from hypothesis import strategies as st

from kvbridge.backends import dispatch
from kvbridge.backends.native import accel
from kvbridge.errors import InputError
from kvbridge.migration import MigrationError
from kvbridge.migration.control import MAGIC, PROTOCOL_VERSION, Listener
from kvbridge.migration.execute import pack, verify
from kvbridge.migration.nixl_wire import _Chunk, _xxh3, _xxh3_all
from kvbridge.migration.plan import plan_migration
from kvbridge.migration.rows import CHECKSUM, xxh3_chunks
from kvbridge.migration.synthetic import destination_pools, source_request
from kvbridge.migration.transport import MAGIC as WIRE_MAGIC
from kvbridge.migration.transport import _pair_group, receive_request

#: xxHash's sanity-check vectors (tests of the reference implementation, XXH3-64 seed 0) over its
#: test buffer: byte i is the top byte of PRIME32 * PRIME64^i (mod 2^64).
SANITY_VECTORS = {0: 0x2D06800538D394C2, 1: 0xC44BDFF4074EECDB, 6: 0x27B56A84CD2D7325, 12: 0xA713DAF0DFBB77E7,
                  24: 0xA3FE70BF9D3510EB, 48: 0x397DA259ECBA1F11, 80: 0xBCDEFBBB2C47C90A,
                  195: 0xCD94217EE362EC3A, 403: 0xCDEB804D65C6DEA4, 512: 0x617E49599013CB6B,
                  2048: 0xDD59E2C3A5F038E0, 2240: 0x6E73A90539CF2948, 2367: 0xCB37AEB9E5D361ED}


def _sanity_buffer(n: int) -> torch.Tensor:
    prime32, prime64 = 2654435761, 11400714785074694797
    out, gen = bytearray(), prime32
    for _ in range(n):
        out.append(gen >> 56)
        gen = gen * prime64 % (1 << 64)
    return torch.frombuffer(out, dtype=torch.uint8) if n else torch.empty(0, dtype=torch.uint8)


def test_checksum_is_xxh3_64_on_published_vectors():
    assert CHECKSUM == "xxh3-64"
    buf = _sanity_buffer(2367)
    for n, want in SANITY_VECTORS.items():
        assert xxh3_chunks(buf[:n].reshape(n, 1), [n]) == [want], n
    text = torch.frombuffer(bytearray(b"abc"), dtype=torch.uint8)
    assert xxh3_chunks(text.reshape(1, 3), [1]) == [0x78AF5F94892F3950]


#: Chunk lengths across every XXH3-64 input class (0, 1-3, 4-8, 9-16, 17-128, 129-240, longer: stripes, blocks).
CLASS_LENGTHS = [0, 1, 3, 4, 8, 9, 16, 17, 128, 129, 240, 241, 1024, 1025, 65536, 149504]


@settings(max_examples=40, deadline=None)
@given(st.lists(st.sampled_from(CLASS_LENGTHS) | st.integers(0, 5000), max_size=40), st.integers(0, 63))
def test_native_chunk_hashes_equal_the_xxhash_package(lengths, start):
    """``dispatch.xxh3_chunks`` (one C call for every chunk where the extension is built) gives the ``xxhash``
    package's XXH3-64 of each chunk, at any byte offset and alignment."""
    data = np.random.default_rng(len(lengths)).integers(0, 256, start + sum(lengths), dtype=np.uint8)
    bounds = start + np.concatenate([[0], np.cumsum(lengths, dtype=np.int64)])
    spans = np.stack([bounds[:-1], bounds[1:]], axis=1)[::-1]  # any order, not back to back
    want = [xxhash.xxh3_64_intdigest(data[a:e]) for a, e in spans]
    assert dispatch.xxh3_chunks(data, spans) == want


def test_chunk_bounds_outside_the_data_are_refused():
    data = np.zeros(100, dtype=np.uint8)
    for span in ([0, 101], [50, 10], [-1, 5]):
        with pytest.raises(InputError, match="checksum chunks"):
            dispatch.xxh3_chunks(data, np.array([span], dtype=np.int64))


def test_with_the_extension_switched_off_chunk_hashes_are_the_same():
    """``KVBRIDGE_NO_CKERNELS=1`` (as a missing or stale build): one ``xxhash`` call per chunk, the same hashes."""
    code = ("import numpy as np; from kvbridge.backends import dispatch; from kvbridge.backends.native import accel; "
            "assert accel._SPANS is None; d = np.arange(5000, dtype=np.uint8); "
            "print(dispatch.xxh3_chunks(d, np.array([[0, 0], [0, 7], [7, 300], [300, 4999]])))")
    env = {**os.environ, accel.NO_CKERNELS_ENV: "1"}
    got = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    d = np.arange(5000, dtype=np.uint8)
    assert got.stdout.strip() == str([xxhash.xxh3_64_intdigest(d[a:e]) for a, e in ((0, 0), (0, 7), (7, 300),
                                                                                      (300, 4999))])


def test_chunks_follow_the_row_counts_of_multi_byte_records():
    buf = _sanity_buffer(2367)
    # 64-byte records: 8 rows are the first 512 B of the buffer, the next 32 rows its first 2048 B
    records = torch.cat([buf[:512], buf[:2048], buf[:0]]).reshape(-1, 64)
    assert xxh3_chunks(records, [8, 32, 0]) == [SANITY_VECTORS[512], SANITY_VECTORS[2048], SANITY_VECTORS[0]]


def test_nixl_chunk_of_several_segments_hashes_as_its_bytes_back_to_back():
    buf = _sanity_buffer(2367).numpy()
    memory = {"a": buf[:1000].copy(), "b": buf[1000:].copy()}
    whole = _Chunk(2367, (("a", 0, 1000), ("b", 0, 1367)))
    assert _xxh3(memory, whole) == SANITY_VECTORS[2367]
    split = _Chunk(403, (("a", 0, 100), ("a", 100, 300), ("a", 400, 3)))
    assert _xxh3(memory, split) == SANITY_VECTORS[403]
    assert _xxh3(memory, _Chunk(195, (("a", 0, 195),))) == SANITY_VECTORS[195]
    chunks = [whole, _Chunk(195, (("a", 0, 195),)), split, _Chunk(80, (("b", 0, 80),)), _Chunk(0, (("a", 7, 0),))]
    assert _xxh3_all(memory, chunks) == [_xxh3(memory, c) for c in chunks]  # batched per region, same hashes


def test_a_flipped_bit_names_the_checksum_and_the_chunk():
    plan = plan_migration("trtllm:fp8:tpb=128", "vllm", "deepseek-v4-flash", 1000, include_mtp=False)
    src, tables = source_request(plan, seed=3)
    payload = pack(plan, src, tables, convert=False)
    verify(plan, payload)
    payload.records[0][0, 0] ^= 0x80
    with pytest.raises(MigrationError, match=r"chunk 0 \(xxh3-64 0x[0-9a-f]{16}, sender sent 0x[0-9a-f]{16}\)"):
        verify(plan, payload)


def test_control_channel_refuses_a_protocol_1_peer_naming_the_crc32_protocol():
    assert PROTOCOL_VERSION == 2
    listener = Listener("127.0.0.1", 0)
    errors: list[Exception] = []

    def serve() -> None:
        chan = listener.accept(10)
        assert chan is not None
        try:
            chan.accept_handshake(time.monotonic() + 10)
        except MigrationError as exc:
            errors.append(exc)
        finally:
            chan.close()

    thread = threading.Thread(target=serve)
    thread.start()
    try:
        with socket.create_connection(("127.0.0.1", listener.port), timeout=10) as s:
            s.sendall(MAGIC + struct.pack(">H", 1))
            thread.join(10)
    finally:
        listener.close()
    assert len(errors) == 1
    text = str(errors[0])
    assert "protocol 1 (CRC-32 page-chunk checksums), this side 2 (XXH3-64 checksums)" in text
    assert "same kvbridge version on both sides" in text


def test_process_group_receiver_refuses_a_mig2_sender():
    assert WIRE_MAGIC == 0x4B56424D494733
    plan = plan_migration("trtllm:fp8:tpb=128", "vllm", "deepseek-v4-flash", 256, include_mtp=False)
    store = dist.TCPStore("127.0.0.1", 0, 2, True, timedelta(seconds=30), wait_for_workers=False)
    peer_store = dist.TCPStore("127.0.0.1", store.port, 2, False, timedelta(seconds=30))
    groups: dict[int, dist.ProcessGroup] = {}

    def join(rank: int, s: dist.Store) -> None:
        groups[rank] = _pair_group(s, "old-peer", rank, 30)

    threads = [threading.Thread(target=join, args=(0, peer_store)), threading.Thread(target=join, args=(1, store))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    old_meta = torch.tensor([0x4B56424D494732, 100, 1000, 1, 1 << 20], dtype=torch.int64)
    sender = threading.Thread(target=lambda: groups[0].send([old_meta], 1, 0).wait())
    sender.start()
    dst = destination_pools(plan)
    before = dst.num_free()
    with pytest.raises(MigrationError, match=r"older kvbridge migration protocol, MIG2 \(CRC-32 page-chunk "
                                             r"checksums\); this side MIG3 \(XXH3-64 checksums\)"):
        receive_request(plan, dst, src_rank=0, group=groups[1], timeout=30)
    sender.join(30)
    assert dst.num_free() == before
