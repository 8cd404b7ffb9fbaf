"""Sender processes for tests/test_migrate_server.py: a sender that stops mid-request (the test then
SIGKILLs it), and raw control-channel clients. Run as ``python tests/server_peers.py MODE PORT``;
prints ``ready`` once the request is under way."""

from __future__ import annotations

import sys
import time

from kvbridge.engines.topology import FLASH
from kvbridge.migration import plan_migration, source_request

MODEL = FLASH.with_layers(3)
TOKENS = 300
SRC, DST = "trtllm:fp8:tpb=128", "vllm"


def plan():
    return plan_migration(SRC, DST, MODEL, TOKENS)


def stall_gloo(port: int) -> None:
    """Handshake, form the gloo pair, send the meta message and the header, then stop."""
    from datetime import timedelta

    import torch.distributed as dist

    from kvbridge._version import __version__
    from kvbridge.migration.control import Channel
    from kvbridge.migration.stream import request_info, wire_fingerprint
    from kvbridge.migration.transport import GlooSender, _pair_group

    p = plan()
    pools, tables = source_request(p, seed=1)
    deadline = time.monotonic() + 60
    chan = Channel.connect("127.0.0.1", port, deadline)
    chan.send({"type": "hello", "kvbridge": __version__, "transport": "gloo", "kind": "request",
               "request_id": "stalled-gloo", "request": request_info(p), "fingerprint": wire_fingerprint(p),
               "convert_on": "receiver"}, deadline=deadline)
    accept, _ = chan.expect("accept", deadline, "the receiver's accept")
    store = dist.TCPStore("127.0.0.1", int(accept["store_port"]), 2, False, timedelta(seconds=30))
    group = _pair_group(store, "stalled-gloo", 0, 30)
    GlooSender(p, pools, tables, dst_rank=1, group=group)
    print("ready", flush=True)
    time.sleep(600)


def stall_nixl(port: int) -> None:
    """Handshake and accept (the receiver's agent knows ours), one group of two written, then stop."""
    from kvbridge.migration.nixl import NixlSender

    p = plan()
    pools, tables = source_request(p, seed=1)
    sender = NixlSender("127.0.0.1", port, timeout=60)
    stream = sender.start_request(p, pools, tables, layers_per_group=1, request_id="stalled-nixl")
    stream.send_group()
    print("ready", flush=True)
    time.sleep(600)


if __name__ == "__main__":
    {"stall-gloo": stall_gloo, "stall-nixl": stall_nixl}[sys.argv[1]](int(sys.argv[2]))
