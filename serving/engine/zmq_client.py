"""The front-end process's side of the split: an :class:`~serving.engine.client.EngineClient`
over ZeroMQ to the one engine process (``serving/engine/zmq_engine.py``).

* Calls go out on a ``PUSH`` socket (any handler thread, under a lock) with
  ``ZMQ_IMMEDIATE``: with no engine connected a send fails at once (UNAVAILABLE) instead of
  queueing for an engine that may come back after the caller's deadline.
* Answers come back on a ``DEALER`` (routing id: this front end's name), read by one thread,
  which also pings the engine every :data:`PING_S`.
* Engine liveness: the engine's socket closing (ZeroMQ's monitor sees the disconnect: the
  process died or stopped), or no answer to the pings for :data:`ENGINE_TIMEOUT_S` (it hangs),
  and every call waiting on it fails with UNAVAILABLE, new ones are refused at once
  and readiness is False, until a pong comes again (the parent restarts the engine; ZeroMQ
  reconnects by itself). A pong with a new ``epoch`` (an engine restarted between two pings)
  fails what the old engine held too. So a front end never hangs on a dead engine.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from typing import Any

import zmq

from serving.engine import wire
from serving.engine.client import ModelInfo
from serving.types import RecRequest, RecResult, UnavailableError

log = logging.getLogger(__name__)

PING_S = 0.1
ENGINE_TIMEOUT_S = 3.0
"""No pong for this long: the engine is taken for hung (a forward or a version load never holds
the engine's I/O thread this long). A dead engine is noticed at once: its socket closes."""


class ZmqEngineClient:
    """The engine in another process (see the module docstring)::

    client = ZmqEngineClient("ipc:///run/e.in", "ipc:///run/e.out", name="fe-0")
    client.start(); client.wait_ready(30)
    futures = client.submit(rows)
    """

    def __init__(
        self,
        address_in: str,
        address_out: str,
        name: str,
        *,
        on_ready: Callable[[bool], None] | None = None,
    ):
        """``on_ready(ready)``: hears every change of readiness (health checking)."""
        self.name, self.on_ready = name, on_ready
        self._ctx = zmq.Context()
        self._push = self._ctx.socket(zmq.PUSH)
        self._push.setsockopt(zmq.IMMEDIATE, 1)
        self._push.setsockopt(zmq.LINGER, 0)
        self._push.setsockopt(zmq.SNDHWM, 0)
        self._push.connect(address_in)
        self._dealer = self._ctx.socket(zmq.DEALER)
        self._dealer.setsockopt(zmq.ROUTING_ID, name.encode())
        self._dealer.setsockopt(zmq.LINGER, 0)
        self._dealer.setsockopt(zmq.RCVHWM, 0)
        self._dealer.connect(address_out)
        self._send_lock = threading.Lock()
        self._lock = threading.Lock()
        self._ids = itertools.count(1)
        self._calls: dict[int, list[Future[RecResult]]] = {}
        self._updates: dict[int, Future[bytes]] = {}
        self._info: ModelInfo | None = None
        self._epoch: str | None = None
        self._last_pong = 0.0
        self._alive = False
        self._stop = threading.Event()
        self._changed = threading.Condition(self._lock)
        self._thread = threading.Thread(target=self._run, name="engine-client", daemon=True)

    # ---- EngineClient ----------------------------------------------------------------------
    @property
    def ready(self) -> bool:
        return self._alive and self._info is not None

    @property
    def version(self) -> int | None:
        info = self._info
        return info.version if self._alive and info is not None else None

    def info(self) -> ModelInfo:
        info = self._info
        if not self._alive or info is None:
            raise UnavailableError("engine: not ready (starting, or restarting after a crash)")
        return info

    def submit(self, reqs: Sequence[RecRequest]) -> list[Future[RecResult]]:
        if not self._alive:
            raise UnavailableError("engine: not answering (restarting after a crash?)")
        call = next(self._ids)
        futures: list[Future[RecResult]] = [Future() for _ in reqs]
        with self._lock:
            self._calls[call] = futures
        self._send(wire.encode_requests({"fe": self.name, "id": call}, reqs), call)
        cancelled = [False]

        def gone(f: Future[RecResult]) -> None:  # the caller gave up: the engine drops the call
            if f.cancelled() and not cancelled[0]:
                cancelled[0] = True
                with self._lock:
                    self._calls.pop(call, None)
                self._try_send(wire.message({"t": "cancel", "fe": self.name, "id": call}))

        for f in futures:
            f.add_done_callback(gone)
        return futures

    def update(
        self, kind: str, request: bytes, update_id: str, deadline: float | None
    ) -> Future[bytes]:
        if not self._alive:
            raise UnavailableError("engine: not answering (restarting after a crash?)")
        call = next(self._ids)
        out: Future[bytes] = Future()
        with self._lock:
            self._updates[call] = out
        head = {"t": "upd", "fe": self.name, "id": call, "kind": kind,
                "update_id": update_id, "deadline": deadline}  # fmt: skip
        self._send(wire.message(head, request), call)
        return out

    def pending(self) -> int:
        """Calls and updates sent and not answered yet (a draining front end waits for them)."""
        with self._lock:
            return len(self._calls) + len(self._updates)

    # ---- lifecycle -------------------------------------------------------------------------
    def start(self) -> None:
        self._thread.start()

    def wait_ready(self, timeout: float) -> bool:
        """Waits until the engine answers with a loaded version; False after ``timeout`` s."""
        until = time.monotonic() + timeout
        with self._changed:
            while not self.ready:
                left = until - time.monotonic()
                if left <= 0:
                    return False
                self._changed.wait(left)
        return True

    def close(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(2.0)
        self._fail_all(UnavailableError("engine client closed"))
        with self._send_lock:
            self._push.close()
            self._dealer.close()
        self._ctx.term()

    # ---- sending ---------------------------------------------------------------------------
    def _send(self, frames: list[Any], call: int) -> None:
        """Sends a call; UNAVAILABLE (and the call forgotten) when no engine is connected."""
        if not self._try_send(frames):
            with self._lock:
                self._calls.pop(call, None)
                self._updates.pop(call, None)
            raise UnavailableError("engine: not connected (restarting after a crash?)")

    def _try_send(self, frames: list[Any]) -> bool:
        with self._send_lock:
            if self._push.closed:
                return False
            try:
                self._push.send_multipart(frames, zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return False
        return True

    # ---- the receiving thread --------------------------------------------------------------
    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self._dealer, zmq.POLLIN)
        monitor = self._dealer.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        poller.register(monitor, zmq.POLLIN)
        next_ping = 0.0
        while not self._stop.is_set():
            now = time.monotonic()
            if now >= next_ping:
                self._try_send(wire.message({"t": "ping", "fe": self.name}))
                next_ping = now + PING_S
            events = dict(poller.poll(int(max(next_ping - time.monotonic(), 0.0) * 1000) + 1))
            if self._dealer in events or monitor in events:
                self._drain()  # first: what the engine sent before it went (a pong too)
            if monitor in events:
                self._disconnected(monitor)
            # after the answers that arrived: a pause of this thread is not the engine's silence
            if self._alive and time.monotonic() - self._last_pong > ENGINE_TIMEOUT_S:
                log.error("engine: no answer for %.1f s: calls fail UNAVAILABLE", ENGINE_TIMEOUT_S)
                self._set_alive(False)
                self._fail_all(UnavailableError("engine: stopped answering (hung?)"))
        self._dealer.disable_monitor()
        monitor.close()

    def _drain(self) -> None:
        """Handles every answer waiting on the socket."""
        while True:
            try:
                frames = self._dealer.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            try:
                self._dispatch(frames)
            except Exception:  # a bad answer must not stop the client
                log.exception("engine client: an answer failed")

    def _disconnected(self, monitor: zmq.Socket[Any]) -> None:
        """The engine's socket closed (its process died or stopped): fail what it held now,
        not after :data:`ENGINE_TIMEOUT_S`."""
        while True:
            try:
                monitor.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                break
        if self._alive:
            log.error("engine: disconnected: calls fail UNAVAILABLE until it is back")
            self._set_alive(False)
            self._fail_all(UnavailableError("engine: disconnected (crashed or stopped)"))
        self._last_pong = 0.0

    def _dispatch(self, frames: list[Any]) -> None:
        head = wire.header(frames)
        kind = head["t"]
        if kind == "pong":
            self._pong(head, frames[1])
        elif kind in ("res", "err"):
            with self._lock:
                futures = self._calls.pop(head["id"], None)
            if futures is None:
                return  # cancelled meanwhile
            if kind == "err":
                outcomes: list[Any] = [wire.exception_of(head["err"])] * len(futures)
            else:
                outcomes = wire.decode_results(head, frames)
                if (v := self._info) is not None and any(
                    isinstance(o, RecResult) and o.version != v.version for o in outcomes
                ):
                    self._try_send(wire.message({"t": "ping", "fe": self.name}))  # a swap
            for f, out in zip(futures, outcomes, strict=True):
                _complete(f, out)
        elif kind == "updr":
            with self._lock:
                fut = self._updates.pop(head["id"], None)
            if fut is not None:
                _complete(fut, wire.exception_of(head["err"]) if "err" in head else
                          bytes(frames[1].buffer))  # fmt: skip

    def _pong(self, head: dict[str, Any], config: Any) -> None:
        if self._epoch is not None and head["epoch"] != self._epoch:
            log.warning("engine: restarted; failing the calls the previous one held")
            self._fail_all(UnavailableError("engine: restarted while the call waited"))
        self._epoch = head["epoch"]
        self._last_pong = time.monotonic()
        self._info = wire.decode_info(head["info"], config) if head["ready"] else None
        self._set_alive(True)

    def _set_alive(self, alive: bool) -> None:
        was = self.ready
        with self._changed:
            self._alive = alive
            self._changed.notify_all()
        if was != self.ready and self.on_ready is not None:
            self.on_ready(self.ready)

    def _fail_all(self, exc: BaseException) -> None:
        with self._lock:
            calls, self._calls = self._calls, {}
            updates, self._updates = self._updates, {}
        for futures in calls.values():
            for f in futures:
                _complete(f, exc)
        for u in updates.values():
            _complete(u, exc)


def _complete(fut: Future[Any], out: Any) -> None:
    """Completes ``fut`` with ``out`` (a result or an exception) unless it was cancelled."""
    if not fut.set_running_or_notify_cancel():
        return
    if isinstance(out, BaseException):
        fut.set_exception(out)
    else:
        fut.set_result(out)
