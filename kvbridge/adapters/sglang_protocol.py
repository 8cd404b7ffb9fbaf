"""What kvbridge's SGLang PD peers (``kvbridge.adapters.sglang``'s prefill, ``kvbridge.adapters.sglang_decode``'s
decode) share of SGLang 0.5.23's NIXL PD protocol: the message frames and poll values, a DeepSeek-V4 pool's
buffer lists in SGLang's order, the metadata row, SGLang's KV checksum (Adler-32, also computed on the
pools' device), the registration and transfer messages, and the peers' start. The protocol itself is
described in ``kvbridge.adapters.sglang``'s docstring.
"""

from __future__ import annotations

import socket
import struct
import zlib
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from kvbridge.engines.topology import CacheSpec, Role
from kvbridge.errors import InputError
from kvbridge.migration.pools import EnginePools

#: First frame of every registration / transfer message (SGLang's ``nixl/conn.py`` ``GUARD``).
GUARD = b"NixlMsgGuard"
#: First frame of the status message the prefill pushes to the decode.
KV_STATUS = b"KV_STATUS"
#: SGLang's ``KVPoll`` values on the wire.
POLL_FAILED, POLL_SUCCESS = 0, 4
#: Rows of the metadata buffers' top-logprobs fields (``MetadataBuffers(max_top_logprobs_num=128)``).
TOP_LOGPROBS = 128
#: Bytes per row of the hidden-state metadata buffer without draft hidden states (16 fp32, RDMA padding).
HIDDEN_STATE_BYTES = 64
#: Bytes per row of the KV-checksum metadata buffer (8 uint64: digest, layout signature, 6 unused).
CHECKSUM_ROW_BYTES = 64


# ---------------------------------------------------------------------------------------------
# SGLang's buffer lists for a DeepSeek-V4 pool


@dataclass(frozen=True)
class SGLangPDLayout:
    """The buffers an SGLang decode registers for PD, in its order, for one model and profile.

    ``kv``: addressed by full-page id (one page = ``page_size`` tokens, ``page_size // r`` compressed
    entries); ``swa_state``: by SWA page id; ``request_state``: by request slot (one ring each).
    """

    kv: tuple[CacheSpec, ...]
    swa_state: tuple[CacheSpec, ...]
    request_state: tuple[CacheSpec, ...]
    page_size: int
    kv_layout: str
    kv_item_lens: tuple[int, ...]
    state_item_lens: tuple[tuple[int, ...], ...]
    state_types: tuple[str, ...]


def pd_layout(pools: EnginePools) -> SGLangPDLayout:
    """SGLang's PD buffer list for ``pools`` (an SGLang-profile ``EnginePools``)."""
    prof, model = pools.profile, pools.model
    if prof.engine != "sglang":
        raise InputError(f"the SGLang peer serves SGLang-profile pools, got {prof.spec}; convert the request "
                         "first (SGLangPrefillPeer.add_migrated_request)")
    if pools.include_mtp and model.num_mtp_layers:
        raise InputError(f"{model.name} has {model.num_mtp_layers} MTP layer(s): SGLang keeps them in a separate "
                         "draft pool, which this adapter does not serve yet; build the pools with include_mtp=False")
    layers = range(model.num_layers)
    specs = {(s.layer, s.role): s for s in model.all_caches(include_mtp=False)}
    ratio4, ratio128 = model.layers_with_ratio(4), model.layers_with_ratio(128)
    kv = tuple([specs[(i, Role.COMPRESS)] for i in ratio4] + [specs[(i, Role.INDEXER)] for i in ratio4]
               + [specs[(i, Role.COMPRESS)] for i in ratio128])
    swa_state = tuple([specs[(i, Role.SWA)] for i in layers] + [specs[(i, Role.STATE)] for i in ratio4]
                      + [specs[(i, Role.INDEXER_STATE)] for i in ratio4])
    request_state = tuple(specs[(i, Role.STATE)] for i in ratio128)
    ratios = sorted({model.compress_ratios[i] for i in layers} - {0})
    layout = ",".join(["v4", *(f"c{r}:v4" for r in ratios)])
    if prof.kv_layout != "flashmla-model1":
        raise InputError(f"{prof.spec} stores {prof.kv_layout}; the SGLang peer serves the V4 (584 B) layout")
    groups = [swa_state, request_state] if request_state else [swa_state]
    types = ("swa", "c128_state")[: len(groups)]
    return SGLangPDLayout(kv, swa_state, request_state, prof.swa_page, layout,
                          tuple(pools.storage(s).page_bytes for s in kv),
                          tuple(tuple(pools.storage(s).page_bytes for s in g) for g in groups), types)


#: Route of kvbridge's bootstrap server (not SGLang's) describing the model its pools hold, which
#: SGLang's ``PrefillServerInfo`` does not carry; SGLang's decodes never ask it.
MODEL_ROUTE = "/kvbridge/model"


def model_info(pools: EnginePools) -> dict[str, Any]:
    """What kvbridge's prefill serves on ``MODEL_ROUTE``: the model's name, depth, per-layer compression
    ratios and the item bytes of every PD buffer (they follow from the dims and dtypes)."""
    lay = pd_layout(pools)
    return {"model": pools.model.name, "num_layers": pools.model.num_layers,
            "compress_ratios": list(pools.model.compress_ratios[: pools.model.num_layers]),
            "kv_item_lens": list(lay.kv_item_lens), "state_item_lens": [list(x) for x in lay.state_item_lens]}


def metadata_item_lens(hidden_state_bytes: int = HIDDEN_STATE_BYTES) -> list[int]:
    """Bytes per row of each metadata buffer, in SGLang's order (``MetadataBuffers.get_buf_infos``):
    output ids, cached tokens, token logprob value and index (16 x 4 B each), top-logprob values and
    indices (128 x 4 B each), top-k p (16 x 4 B), top-k index (16 x 8 B), hidden states
    (``hidden_state_bytes``), bootstrap room (8 x 8 B)."""
    return [64, 64, 64, 64, 4 * TOP_LOGPROBS, 4 * TOP_LOGPROBS, 64, 128, hidden_state_bytes, 64]


def metadata_row(room: int, first_token: int, hidden_state_bytes: int = HIDDEN_STATE_BYTES,
                 kv_checksum: int | None = None) -> list[bytes]:
    """The metadata row an SGLang prefill writes for a finished request: the first output token id,
    zero cached tokens, no logprobs, zero hidden states, and the room (SGLang's corruption check);
    with ``kv_checksum``, the checksum row after them: the digest, then signature 0 (see the module
    docstring)."""
    row = [bytearray(n) for n in metadata_item_lens(hidden_state_bytes)]
    struct.pack_into("<i", row[0], 0, first_token)
    struct.pack_into("<Q", row[-1], 0, room)
    if kv_checksum is not None:
        row.append(bytearray(CHECKSUM_ROW_BYTES))
        struct.pack_into("<Q", row[-1], 0, kv_checksum)
    return [bytes(b) for b in row]


def kv_checksum(items: Iterable[Any]) -> int:
    """SGLang's KV digest of ``items`` (bytes-like, in transfer order): Adler-32 of their bytes
    concatenated (1 for none). Its CUDA kernel digests each item on its own and combines the
    per-item values in order, A = A1 + A2 - 1, B = B1 + B2 + len2 * (A1 - 1) (mod 65521), which is
    that value."""
    digest = 1
    for item in items:
        digest = zlib.adler32(item, digest)
    return digest


#: Adler-32's modulus.
ADLER_MOD = 65521


def kv_digest(items: Iterable[torch.Tensor]) -> int:
    """``kv_checksum`` of ``items`` (tensors, each one transferred item, in transfer order), computed
    where each item is: its byte sum and position-weighted byte sum (int64, exact for items below
    256 MiB) are reduced on the item's device, and only those two numbers per item come to the host,
    where they are combined in order as SGLang's kernel does (A = 1 + sum, B = n + sum((n - i) * b_i)
    for one item of n bytes)."""
    weights: dict[tuple[int, torch.device], torch.Tensor] = {}
    parts, lens = [], []
    for item in items:
        b = item.contiguous().view(torch.uint8).reshape(-1)
        n = b.numel()
        w = weights.get((n, b.device))
        if w is None:
            w = weights[(n, b.device)] = torch.arange(n, 0, -1, dtype=torch.int64, device=b.device)
        wide = b.to(torch.int64)
        parts.append(torch.stack([wide.sum(), (wide * w).sum()]))
        lens.append(n)
    same = len({p.device for p in parts}) == 1  # then one copy to the host for all items
    sums = torch.stack(parts).tolist() if same else [p.tolist() for p in parts]
    a, b_sum = 1, 0
    for (s, ws), n in zip(sums, lens, strict=True):
        a2, b2 = (1 + s) % ADLER_MOD, (n + ws) % ADLER_MOD
        a, b_sum = (a + a2 - 1) % ADLER_MOD, (b_sum + b2 + n * (a - 1)) % ADLER_MOD
    return (b_sum << 16) | a


def start_peer(peer: Any) -> None:
    """Run ``peer._start()`` (an SGLang PD peer: NIXL agent, ZMQ sockets), closing what it started when
    it fails; pyzmq is required."""
    try:
        import zmq  # noqa: F401
    except ImportError:
        raise InputError("the SGLang peer needs pyzmq: pip install 'kvbridge[sglang-pd]'") from None
    try:
        peer._start()
    except BaseException:
        peer.close()
        raise


# ---------------------------------------------------------------------------------------------
# Wire messages


def _pack_lists(lists: Sequence[Sequence[int]], fmt: str) -> bytes:
    """SGLang's ``pack_int_lists``: ``<I n, n x <I byte lengths``, then each list packed little-endian."""
    if not lists:
        return b""
    bufs = [struct.pack(f"<{len(a)}{fmt}", *a) for a in lists]
    return struct.pack(f"<{len(bufs) + 1}I", len(bufs), *(len(b) for b in bufs)) + b"".join(bufs)


def _unpack_lists(buf: bytes, fmt: str) -> list[list[int]]:
    if not buf:
        return []
    (n,) = struct.unpack_from("<I", buf)
    lens = struct.unpack_from(f"<{n}I", buf, 4)
    out, off, width = [], 4 + 4 * n, struct.calcsize(fmt)
    for length in lens:
        out.append(list(struct.unpack_from(f"<{length // width}{fmt}", buf, off)))
        off += length
    return out


def _q(buf: bytes) -> list[int]:
    return list(struct.unpack(f"<{len(buf) // 8}Q", buf))


def _frame(msg: list[bytes], i: int, default: bytes = b"") -> bytes:
    return msg[i] if len(msg) > i else default


@dataclass
class DecodePeer:
    """One decode rank's registration: its NIXL agent and registered buffers."""

    agent_name: str
    endpoint: str
    port: int
    metadata: bytes
    kv_ptrs: list[int]
    kv_item_lens: list[int]
    kv_mem_kinds: list[str]
    aux_ptrs: list[int]
    state_ptrs: list[list[int]]
    state_item_lens: list[list[int]]
    gpu_id: int
    tp_size: int
    refused: str | None = None  # why this peer's buffers do not fit the pools (reported per request)
    nixl_name: str | None = None
    kv_checksum: bool = False  # the decode registered the KV-checksum metadata row

    @classmethod
    def parse(cls, msg: list[bytes]) -> DecodePeer:
        """``msg`` without the guard frame (SGLang's ``KVArgsRegisterInfo`` frames)."""
        kv_ptrs = _q(msg[5])
        item_len = int(msg[11])
        lens = _q(msg[18]) if _frame(msg, 18) else [item_len] * len(kv_ptrs)
        kinds = msg[17].decode().split(",") if _frame(msg, 17) else ["VRAM"] * len(kv_ptrs)
        return cls(msg[3].decode(), msg[1].decode(), int(msg[2]), msg[4], kv_ptrs, lens, kinds, _q(msg[6]),
                   _unpack_lists(_frame(msg, 7), "Q"), _unpack_lists(_frame(msg, 12), "I"), int(msg[8]),
                   int(msg[9]))


@dataclass
class TransferInfo:
    """One decode rank's page ids for one request (SGLang's ``TransferInfo`` frames)."""

    room: int
    endpoint: str
    port: int
    agent_name: str
    kv_pages: list[int]
    aux_index: int
    required: int
    state_indices: list[list[int]]
    prefix_len: int
    dummy: bool

    @classmethod
    def parse(cls, msg: list[bytes]) -> TransferInfo:
        kv = np.frombuffer(msg[4], dtype="<i4").tolist()
        prefix = int(msg[8]) if _frame(msg, 8) else 0
        dummy = bool(int(msg[9])) if _frame(msg, 9) else (not kv and not prefix)
        return cls(int(msg[0]), msg[1].decode(), int(msg[2]), msg[3].decode(), kv, int(msg[5]), int(msg[6]),
                   _unpack_lists(_frame(msg, 7), "i"), prefix, dummy)


def _local_ip(host: str) -> str:
    """The address a peer announces for ``host``: itself, or this host's outbound IP for a wildcard."""
    if host not in ("", "0.0.0.0"):
        return host
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(("10.255.255.255", 1))
            return s.getsockname()[0]
        except OSError:
            return "127.0.0.1"
