"""The vLLM connector's worker-side bookkeeping of its requests (no vLLM import: tested on its own).

Loads are keyed by the kvbridge request id a producer sends under, never by arrival order: any
number may wait at once, producers may connect in any order. A producer for an id no load holds
(yet) waits in a bounded holding area (at most ``hold_limit`` producers, each at most ``hold_s``
seconds) for vLLM to schedule that request; past that it is refused. A load the scheduler
cancels (its request was aborted or finished while waiting) is released at once if no producer
is on it, or refused by the receiving thread before any byte reaches vLLM's blocks; a producer
arriving for it later is refused, naming why. Each load is reported exactly once: received,
failed (with the reason, one log line) or, cancelled, released.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

from kvbridge.errors import InputError

log = logging.getLogger("kvbridge.vllm")

#: How many ids of finished, failed or cancelled loads are remembered (to refuse a late producer by name).
GONE_KEPT = 4096


@dataclass
class Pending:
    """One load in the table: ``load`` (the connector's ``Load``), when it stops waiting for its producer
    (``timeout`` s after it was added), and its state: ``waiting`` (no producer yet), ``receiving`` (a
    producer is on it), ``writing`` (verified, being written into vLLM's blocks)."""

    load: Any
    timeout: float
    state: str = "waiting"
    cancelled: bool = False
    started: float = field(default_factory=time.monotonic)

    @property
    def deadline(self) -> float:
        return self.started + self.timeout


class RequestTable:
    """Loads by kvbridge request id, the producers held for ids not known yet, and the outcomes not yet
    reported to vLLM (``results``). Thread safe: vLLM's step thread adds, cancels and collects; the
    transfer threads claim and finish."""

    def __init__(self, hold_s: float, hold_limit: int):
        self.hold_s, self.hold_limit = hold_s, hold_limit
        self._cond = threading.Condition()
        self._pending: dict[str, Pending] = {}
        self._gone: OrderedDict[str, str] = OrderedDict()
        self._held = 0
        self._closed = False
        self._done: set[str] = set()
        self._failed: set[str] = set()
        #: Outcomes since the last ``take_outcomes``: (vLLM request id, kvbridge id, error or None, seconds).
        self._outcomes: list[tuple[str, str, str | None, float]] = []

    def add(self, load: Any, timeout: float) -> None:
        """A load vLLM scheduled: waits ``timeout`` s for its producer. A second load under an id that a
        load still holds fails at once (the producer could not say which one it sends)."""
        with self._cond:
            if load.request_id in self._pending:
                self._report(Pending(load, 0.0), f"another vLLM request waits under kvbridge request id "
                                                 f"{load.request_id}; give each its own kvbridge_request_id")
                return
            self._gone.pop(load.request_id, None)
            self._pending[load.request_id] = Pending(load, timeout)
            self._cond.notify_all()

    def claim(self, rid: str) -> Pending:
        """The load a producer sending ``rid`` fills (a transfer thread calls this before anything moves):
        waits in the holding area while no load has that id; ``InputError`` naming why otherwise."""
        held = False
        deadline = time.monotonic() + self.hold_s
        with self._cond:
            try:
                while True:
                    if rid in self._gone:
                        raise InputError(f"request {rid} was {self._gone[rid]} on this vLLM; nothing was written")
                    p = self._pending.get(rid)
                    if p is not None:
                        if p.state != "waiting":
                            raise InputError(f"another producer is already sending request {rid}")
                        p.state = "receiving"
                        return p
                    if not held:
                        if self._held >= self.hold_limit:
                            raise InputError(f"this vLLM has no request {rid} waiting for its KV and already holds "
                                             f"{self._held} producers for requests it does not know yet")
                        self._held, held = self._held + 1, True
                    left = deadline - time.monotonic()
                    if left <= 0 or self._closed:
                        raise InputError(f"this vLLM has no request {rid} waiting for its KV (held {self.hold_s:g} s "
                                         "for it; is kvbridge_request_id the same on both ends?)")
                    self._cond.wait(min(left, 1.0))
            finally:
                if held:
                    self._held -= 1

    def writing(self, p: Pending) -> None:
        """Called before the first byte goes into vLLM's blocks: ``InputError`` if the load was cancelled."""
        with self._cond:
            if p.cancelled:
                raise InputError(f"request {p.load.request_id} was aborted on this vLLM while it was received; "
                                 "nothing was written")
            p.state = "writing"

    def finish(self, p: Pending, error: str | None) -> None:
        """A transfer thread is done with ``p``: received (``error`` None) or failed (``error``, one line)."""
        with self._cond:
            if self._pending.get(p.load.request_id) is p:
                del self._pending[p.load.request_id]
            self._report(p, None if p.cancelled else error)

    def cancel(self, req_id: str) -> None:
        """vLLM finished or aborted request ``req_id`` while its load waited: release it now if no producer is
        on it (reported received: vLLM frees its blocks), else let the receiving thread refuse to write it."""
        with self._cond:
            p = next((p for p in self._pending.values() if p.load.req_id == req_id), None)
            if p is None:
                return  # already reported, or reported with the next results
            p.cancelled = True
            if p.state == "waiting":
                del self._pending[p.load.request_id]
                self._report(p, None)
            log.info("kvbridge: request %s was aborted while it waited for its KV; its load is cancelled",
                     p.load.request_id)

    def forget(self, rid: str, why: str) -> None:
        """No load will wait under ``rid`` (vLLM needs none: ``why``): its producer, held or later, is refused
        naming why."""
        with self._cond:
            if rid not in self._pending:
                self._remember(rid, why)
                self._cond.notify_all()

    def expire(self) -> None:
        """Fail the loads whose producer did not connect in time."""
        now = time.monotonic()
        with self._cond:
            for rid, p in list(self._pending.items()):
                if p.state == "waiting" and now > p.deadline:
                    del self._pending[rid]
                    self._report(p, f"no kvbridge producer connected within {p.timeout:g} s")

    def _remember(self, rid: str, what: str) -> None:
        self._gone[rid] = what
        while len(self._gone) > GONE_KEPT:
            self._gone.popitem(last=False)

    def _report(self, p: Pending, error: str | None) -> None:
        rid = p.load.request_id
        if p.load.request_id not in self._pending:
            self._remember(rid, "aborted" if p.cancelled else ("refused" if error else "received"))
        self._done.add(p.load.req_id)
        if error is not None:
            self._failed.add(p.load.req_id)
            log.error("kvbridge: request %s (vLLM %s) failed to load: %s", rid, p.load.req_id, error)
        self._outcomes.append((p.load.req_id, rid, error, time.monotonic() - p.started))
        self._cond.notify_all()

    def results(self) -> tuple[set[str], set[str]]:
        """(loads done, of which failed) since the last call, by vLLM request id."""
        self.expire()
        with self._cond:
            out = self._done, self._failed
            self._done, self._failed = set(), set()
        return out

    def take_outcomes(self) -> list[tuple[str, str, str | None, float]]:
        with self._cond:
            out, self._outcomes = self._outcomes, []
        return out

    def waiting(self) -> int:
        """Loads not reported yet."""
        with self._cond:
            return len(self._pending)

    def close(self) -> None:
        """Wake and refuse every held producer."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()


__all__ = ["GONE_KEPT", "Pending", "RequestTable"]
