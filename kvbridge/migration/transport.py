"""Moving a request between processes over a ``torch.distributed`` process group.

The sender (prefill side) packs the request's entries (converting them first when
``convert_on="sender"``) and sends, point to point to the receiver's rank:

1. a meta message, int64 ``[MAGIC, header_bytes, data_bytes, data_messages, message_bytes]``;
2. the header, UTF-8 JSON: plan fingerprint, whether records are converted, per transfer its
   row count, record size, page-chunk row counts and CRC-32 values (and the sender's loss
   reports when it converted);
3. the data: every transfer's records back to back, in messages of at most ``chunk_bytes``.

Few large messages: a 128K-token Flash request is one meta, one header and a handful of
data messages, whatever its page count. The receiver waits for each message at most until
its deadline, verifies every chunk's CRC-32, converts if needed, and only then claims and
fills destination pages. A dead sender, a broken link or a timeout raises ``TransferError``;
a corrupted chunk raises ``ChecksumError``; in both cases no destination page is claimed.
Works with gloo (CPU tensors) and NCCL (the caller moves ``device`` to CUDA).
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Callable
from datetime import timedelta

import torch
import torch.distributed as dist

from kvbridge.api import LossReport
from kvbridge.errors import InputError
from kvbridge.migration.execute import (
    ConvertSide,
    MigrationError,
    MigrationReport,
    Payload,
    TransferError,
    check_pools,
    finish,
    pack,
)
from kvbridge.migration.plan import MigrationPlan
from kvbridge.migration.pools import EnginePools, RequestTables

MAGIC = 0x4B5642_4D494752  # "KVB" "MIGR"
DEFAULT_CHUNK_BYTES = 256 << 20

#: Called after each data message with (bytes sent so far, total bytes).
Progress = Callable[[int, int], None]


def _reason(exc: BaseException) -> str:
    """The first sentence of a backend error, without gloo's ``[file:line]`` prefix."""
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    text = re.sub(r"^\[[^\]]*:\d+\]\s*", "", text)
    return text.split(". ")[0].rstrip(".")


def _wait(work: dist.Work, what: str, peer: int, deadline: float) -> None:
    remaining = deadline - time.monotonic()
    if remaining <= 0:
        raise TransferError(f"timed out before {what} from rank {peer}; nothing was published")
    try:
        work.wait(timeout=timedelta(seconds=remaining))
    except RuntimeError as exc:
        reason = _reason(exc)
        raise TransferError(
            f"{what} from rank {peer} failed ({reason}); the peer died, the link broke or the timeout passed; "
            "nothing was published"
        ) from None


def _check_timeout(timeout: float) -> float:
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout > 0:
        raise InputError(f"timeout must be a positive number of seconds, got {timeout!r}")
    return float(timeout)


def send_payload(payload: Payload, *, dst_rank: int, group: dist.ProcessGroup | None = None,
                 chunk_bytes: int = DEFAULT_CHUNK_BYTES, timeout: float = 60.0, device: torch.device | str = "cpu",
                 progress: Progress | None = None) -> int:
    """Send a packed payload to ``dst_rank``; returns the number of data bytes sent."""
    if isinstance(chunk_bytes, bool) or not isinstance(chunk_bytes, int) or chunk_bytes < 1:
        raise InputError(f"chunk_bytes must be a positive integer, got {chunk_bytes!r}")
    deadline = time.monotonic() + _check_timeout(timeout)
    header = {
        "fingerprint": payload.fingerprint,
        "converted": payload.converted,
        "items": [{"rows": int(r.shape[0]), "record_bytes": int(r.shape[1]), "chunks": c, "crc32": s}
                  for r, c, s in zip(payload.records, payload.chunks, payload.checksums, strict=True)],
        "loss": [r.to_dict() for r in payload.loss],
        "indexer_max_abs_error": payload.indexer_max_abs_error,
        "state_max_abs_error": payload.state_max_abs_error,
    }
    head = torch.frombuffer(bytearray(json.dumps(header).encode()), dtype=torch.uint8).to(device)
    data = torch.cat([r.reshape(-1) for r in payload.records]).to(device) if payload.records else \
        torch.empty(0, dtype=torch.uint8, device=device)
    total = data.numel()
    messages = -(-total // chunk_bytes)
    meta = torch.tensor([MAGIC, head.numel(), total, messages, chunk_bytes], dtype=torch.int64, device=device)
    _wait(dist.isend(meta, dst_rank, group=group), "sending the meta message", dst_rank, deadline)
    _wait(dist.isend(head, dst_rank, group=group), "sending the header", dst_rank, deadline)
    for i in range(messages):
        part = data[i * chunk_bytes : (i + 1) * chunk_bytes]
        _wait(dist.isend(part, dst_rank, group=group), f"sending data message {i + 1}/{messages}", dst_rank, deadline)
        if progress is not None:
            progress(min((i + 1) * chunk_bytes, total), total)
    return total


def receive_payload(plan: MigrationPlan, *, src_rank: int, group: dist.ProcessGroup | None = None,
                    timeout: float = 60.0, device: torch.device | str = "cpu") -> Payload:
    """Receive a payload for ``plan`` from ``src_rank`` (checksums are verified later, by ``finish``)."""
    deadline = time.monotonic() + _check_timeout(timeout)
    meta = torch.zeros(5, dtype=torch.int64, device=device)
    _wait(dist.irecv(meta, src_rank, group=group), "the meta message", src_rank, deadline)
    magic, head_len, total, messages, chunk = (int(v) for v in meta.cpu())
    if magic != MAGIC:
        raise MigrationError(f"rank {src_rank} is not a kvbridge migration sender (bad magic {magic:#x})")
    head = torch.empty(head_len, dtype=torch.uint8, device=device)
    _wait(dist.irecv(head, src_rank, group=group), "the header", src_rank, deadline)
    header = json.loads(bytes(head.cpu().numpy()).decode())
    if header["fingerprint"] != plan.fingerprint():
        raise MigrationError(f"rank {src_rank} sends a request for a different plan (plan fingerprints differ)")
    items = header["items"]
    if len(items) != len(plan.transfers):
        raise MigrationError(f"header lists {len(items)} transfers, the plan {len(plan.transfers)}")
    for t, item in zip(plan.transfers, items, strict=True):
        want = t.dst.record_bytes if header["converted"] else t.src.record_bytes
        if item["rows"] != t.count or item["record_bytes"] != want:
            raise MigrationError(f"layer {t.spec.layer} {t.spec.role.value}: header says {item['rows']} x "
                                 f"{item['record_bytes']} B, the plan {t.count} x {want} B")
    if total != sum(i["rows"] * i["record_bytes"] for i in items):
        raise MigrationError(f"header announces {total} data bytes, its transfers add up to a different size")
    if messages != (-(-total // chunk) if chunk > 0 else -1):
        raise MigrationError(f"meta message is inconsistent: {total} bytes in {messages} messages of {chunk}")
    data = torch.empty(total, dtype=torch.uint8, device=device)
    for i in range(messages):
        part = data[i * chunk : min((i + 1) * chunk, total)]
        _wait(dist.irecv(part, src_rank, group=group), f"data message {i + 1}/{messages}", src_rank, deadline)
    data = data.cpu()
    records, offset = [], 0
    for item in items:
        n = item["rows"] * item["record_bytes"]
        records.append(data[offset : offset + n].view(item["rows"], item["record_bytes"]))
        offset += n
    loss = [LossReport(**r) for r in header["loss"]]
    return Payload(header["fingerprint"], header["converted"], records, [i["chunks"] for i in items],
                   [i["crc32"] for i in items], loss, header["indexer_max_abs_error"],
                   header.get("state_max_abs_error"))


def send_request(plan: MigrationPlan, src: EnginePools, tables: RequestTables, *, dst_rank: int,
                 group: dist.ProcessGroup | None = None, convert_on: ConvertSide = "receiver",
                 chunk_bytes: int = DEFAULT_CHUNK_BYTES, timeout: float = 60.0, device: torch.device | str = "cpu",
                 progress: Progress | None = None, loss_report: bool = True) -> int:
    """Prefill side: pack the request held in ``tables`` of ``src`` and send it; returns data bytes sent.

    With ``convert_on="sender"`` the records travel in the destination format (and the loss
    report, when ``loss_report``, travels in the header).
    """
    if convert_on not in ("sender", "receiver"):
        raise InputError(f"convert_on must be 'sender' or 'receiver', got {convert_on!r}")
    payload = pack(plan, src, tables, convert=convert_on == "sender", loss_report=loss_report)
    return send_payload(payload, dst_rank=dst_rank, group=group, chunk_bytes=chunk_bytes, timeout=timeout,
                        device=device, progress=progress)


def receive_request(plan: MigrationPlan, dst: EnginePools, *, src_rank: int, group: dist.ProcessGroup | None = None,
                    timeout: float = 60.0, device: torch.device | str = "cpu", loss_report: bool = True
                    ) -> tuple[RequestTables, MigrationReport]:
    """Decode side: receive, verify every checksum, convert if the sender did not, then claim and
    fill destination pages. Returns the request's block tables and a report."""
    check_pools(plan, dst, "dst")
    t0 = time.perf_counter()
    payload = receive_payload(plan, src_rank=src_rank, group=group, timeout=timeout, device=device)
    wire_s = time.perf_counter() - t0
    side = "sender" if payload.converted else "receiver"
    return finish(plan, payload, dst, converted_on=side, pack_s=0.0, wire_s=wire_s, loss_report=loss_report)
