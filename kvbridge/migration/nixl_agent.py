"""The NIXL agent: one per side, in a child process that always ends with ``os._exit`` (NIXL's bundled
libraries can crash a process at exit after its peer died), or in this process where it is daemonic and
cannot have children (``_LocalAgent``). The parent drives it with commands (register, metadata,
add_remote, remove_remote, write, wait, notifs), each bounded by a timeout; ``kill`` stops its peers'
writes into our memory. Imported by the NIXL transport (``kvbridge.migration.nixl``) and the SGLang
adapters; ``nixl`` itself is imported only when an agent starts.
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
import time
from typing import Any

import torch
import torch.multiprocessing as tmp

from kvbridge.migration.control import first_line
from kvbridge.migration.errors import TransferError

#: Seconds an agent process gets to start (spawn + imports + UCX backend), and to answer a call.
AGENT_START_S = 60.0
AGENT_CALL_S = 30.0


def nixl_available() -> bool:
    """Whether the optional ``nixl`` package can be imported here."""
    try:
        import nixl._api  # noqa: F401
    except Exception:
        return False
    return True



def _agent_main(conn, name: str) -> None:
    """Child process: one NIXL agent, driven by commands over ``conn``; always ends with ``os._exit``."""
    try:
        os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")
        os.dup2(2, 1)  # NIXL logs to stdout; keep the parent's stdout (e.g. --json) clean
        try:
            from nixl._api import nixl_agent, nixl_agent_config

            agent = nixl_agent(name, nixl_agent_config(enable_prog_thread=False, backends=["UCX"]))
        except Exception as exc:
            conn.send(("err", f"cannot start a NIXL agent ({first_line(exc)}); install it with "
                              "pip install 'kvbridge[nixl]'"))
            return
        conn.send(("ok", None))
        regions: dict[str, tuple[torch.Tensor, Any]] = {}
        xfers: dict[int, Any] = {}
        while True:
            try:
                cmd = conn.recv()
            except (EOFError, OSError):
                return
            op, args = cmd[0], cmd[1:]
            try:
                if op == "exit":
                    conn.send(("ok", None))
                    return
                conn.send(("ok", _agent_op(agent, regions, xfers, op, args)))
            except Exception as exc:
                conn.send(("err", first_line(exc)))
    finally:
        os._exit(0)


def memory_kind(tensor: torch.Tensor) -> tuple[str, int]:
    """NIXL's memory type and device id of ``tensor``'s memory: ``("VRAM", cuda index)`` for CUDA
    memory, ``("DRAM", 0)`` for host memory."""
    return ("VRAM", tensor.device.index or 0) if tensor.is_cuda else ("DRAM", 0)


def _agent_op(agent, regions: dict, xfers: dict, op: str, args: tuple) -> Any:
    if op == "register":
        key, tensor = args
        if key in regions:
            agent.deregister_memory(regions.pop(key)[1])
        kind, dev = memory_kind(tensor)
        reg = agent.register_memory([(tensor.data_ptr(), tensor.numel() * tensor.element_size(), dev, "")], kind)
        regions[key] = (tensor, reg)
        return tensor.data_ptr()
    if op == "metadata":
        return agent.get_agent_metadata()
    if op == "add_remote":
        return agent.add_remote_agent(args[0])
    if op == "remove_remote":
        agent.remove_remote_agent(args[0])
        return None
    if op == "write":
        xid, local, remote, peer, notif, *kinds = args  # kinds: the remote memory's type, the local one (DRAM)
        remote_kind, local_kind = (*kinds, "DRAM", "DRAM")[:2]
        handle = agent.initialize_xfer("WRITE", agent.get_xfer_descs(local, local_kind),
                                       agent.get_xfer_descs(remote, remote_kind), peer, notif)
        state = agent.transfer(handle)
        if state == "ERR":
            agent.release_xfer_handle(handle)
            raise RuntimeError("NIXL refused to post the transfer")
        xfers[xid] = handle
        return None
    if op == "wait":
        xid, timeout = args
        handle = xfers[xid]
        deadline = time.monotonic() + timeout
        pause = 1e-5
        while True:
            state = agent.check_xfer_state(handle)
            if state != "PROC":
                break
            if time.monotonic() > deadline:
                return "PROC"
            time.sleep(pause)
            pause = min(2 * pause, 2e-3)
        agent.release_xfer_handle(xfers.pop(xid))
        return state
    if op == "notifs":
        (timeout,) = args
        deadline = time.monotonic() + timeout
        pause = 1e-5
        while True:
            got = agent.get_new_notifs()
            if any(got.values()) or time.monotonic() > deadline:
                return [m for msgs in got.values() for m in msgs]
            time.sleep(pause)
            pause = min(2 * pause, 2e-3)
    raise ValueError(f"unknown agent command {op!r}")


@contextlib.contextmanager
def _main_hidden():
    """Start a spawned child without re-running the user's ``__main__`` (the agent needs nothing from
    it, and a script without an ``if __name__ == "__main__"`` guard would run again in the child)."""
    main = sys.modules.get("__main__")
    saved = {k: main.__dict__[k] for k in ("__file__", "__spec__") if main is not None and k in main.__dict__}
    try:
        for k in saved:
            if k == "__spec__":
                main.__spec__ = None
            else:
                del main.__dict__[k]
        yield
    finally:
        if main is not None:
            main.__dict__.update(saved)


class _Agent:
    """The parent's handle on one agent process; every call is bounded by a timeout."""

    def __init__(self, name: str):
        ctx = tmp.get_context("spawn")
        self.name = name
        self._lock = threading.Lock()
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_agent_main, args=(child, name), daemon=True, name=f"kvbridge-nixl-{name}")
        with _main_hidden():
            self.proc.start()
        child.close()
        self._reply(AGENT_START_S, "starting")
        self.addresses: dict[str, int] = {}

    def _reply(self, timeout: float, what: str) -> Any:
        try:
            ready = self.conn.poll(max(0.0, timeout))
        except (EOFError, OSError):
            ready = True
        if not ready:
            self.kill()
            raise TransferError(f"the NIXL agent did not answer within {timeout:.0f} s while {what}; it was stopped")
        try:
            status, value = self.conn.recv()
        except (EOFError, OSError):
            self.kill()
            raise TransferError(f"the NIXL agent process died while {what}") from None
        if status != "ok":
            raise TransferError(f"NIXL failed while {what}: {value}")
        return value

    def call(self, what: str, *cmd: Any, timeout: float = AGENT_CALL_S) -> Any:
        """Run one command in the agent process; threads take turns (one pipe: a command, then its reply)."""
        with self._lock:
            if not self.alive():
                raise TransferError(f"the NIXL agent process is gone (while {what})")
            try:
                self.conn.send(cmd)
            except (OSError, ValueError):
                self.kill()
                raise TransferError(f"the NIXL agent process died while {what}") from None
            return self._reply(timeout, what)

    def register(self, key: str, tensor: torch.Tensor) -> int:
        self.addresses[key] = self.call(f"registering {key}", "register", key, tensor)
        return self.addresses[key]

    def alive(self) -> bool:
        return self.proc.is_alive()

    def kill(self) -> None:
        """Stop the agent process now (its peers' writes into our memory stop with it)."""
        if self.proc.is_alive():
            self.proc.kill()
        self.proc.join(10)
        self.conn.close()

    def close(self) -> None:
        if self.proc.is_alive():
            try:
                self.conn.send(("exit",))
                if self.conn.poll(5):
                    self.conn.recv()
            except (EOFError, OSError, ValueError):
                pass
            self.proc.join(5)
        self.kill()


class _LocalAgent:
    """A NIXL agent in this process, for where no child process may start (a daemonic process, such as a
    worker of vLLM's multiprocess executor): the same calls as ``_Agent``, run on the caller's thread one
    at a time. ``kill`` releases every transfer and registration, so a stalled peer's late writes fail
    instead of landing; the next use starts a new agent."""

    def __init__(self, name: str):
        os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")
        try:
            from nixl._api import nixl_agent, nixl_agent_config  # deferred: nixl is an optional dependency

            self.agent = nixl_agent(name, nixl_agent_config(enable_prog_thread=False, backends=["UCX"]))
        except Exception as exc:
            raise TransferError(f"cannot start a NIXL agent ({first_line(exc)}); install it with "
                                "pip install 'kvbridge[nixl]'") from None
        self.name = name
        self.regions: dict[str, tuple[torch.Tensor, Any]] = {}
        self.xfers: dict[int, Any] = {}
        self.addresses: dict[str, int] = {}
        self._lock = threading.Lock()
        self._alive = True

    def call(self, what: str, *cmd: Any, timeout: float = AGENT_CALL_S) -> Any:
        with self._lock:
            if not self._alive:
                raise TransferError(f"the NIXL agent is gone (while {what})")
            try:
                return _agent_op(self.agent, self.regions, self.xfers, cmd[0], cmd[1:])
            except Exception as exc:
                raise TransferError(f"NIXL failed while {what}: {first_line(exc)}") from None

    register = _Agent.register

    def alive(self) -> bool:
        return self._alive

    def kill(self) -> None:
        with self._lock:
            if not self._alive:
                return
            self._alive = False
            for handle in self.xfers.values():
                with contextlib.suppress(Exception):
                    self.agent.release_xfer_handle(handle)
            for _, reg in self.regions.values():
                with contextlib.suppress(Exception):
                    self.agent.deregister_memory(reg)
            self.xfers.clear()
            self.regions.clear()

    close = kill


def _new_agent(name: str) -> _Agent | _LocalAgent:
    """An agent process, or an agent in this process where this process is daemonic (it cannot have children)."""
    return _LocalAgent(name) if tmp.current_process().daemon else _Agent(name)
