"""The engine process's side of the split: front ends' calls off ZeroMQ into one engine.

Two sockets, each used in one direction so that no socket is shared between threads without
a lock (ZeroMQ sockets are not thread-safe):

* ``PULL`` bound at ``address_in``: every front end's ``PUSH`` sends its calls here; one I/O
  thread (:meth:`EngineLoop._run`) reads them and admits them into the batcher
  (``InProcessEngine.submit``: the edge check against the model, RESOURCE_EXHAUSTED when the
  queue is full), so every front end's rows share batches;
* ``ROUTER`` bound at ``address_out``: answers go to the front end that asked (its routing id),
  sent under a lock by whichever thread completes them (the batcher's, an update's).

A call's answer goes once all its rows are done, in one message (``serving/engine/wire.py``).
Pings are answered with the engine's epoch, readiness and the served version's
:class:`~serving.engine.client.ModelInfo`, so a front end learns a hot swap within a ping.
Live updates run on a thread of their own (they take seconds; the I/O thread must not wait).
"""

from __future__ import annotations

import logging
import threading
import uuid
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import zmq

from serving.engine import wire
from serving.engine.client import InProcessEngine, UpdateHandler
from serving.types import RecResult, UnavailableError

log = logging.getLogger(__name__)

POLL_MS = 100


class EngineLoop:
    """Serves ``engine`` to front-end processes (see the module docstring)."""

    def __init__(
        self,
        engine: InProcessEngine,
        address_in: str,
        address_out: str,
        on_update: UpdateHandler | None = None,
    ):
        self.engine, self.on_update = engine, on_update
        self.epoch = uuid.uuid4().hex
        """Names this start of the engine: a front end that sees it change fails what the
        previous engine held."""
        self._ctx = zmq.Context()
        self._in = self._ctx.socket(zmq.PULL)
        self._out = self._ctx.socket(zmq.ROUTER)
        for sock in (self._in, self._out):
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.RCVHWM, 0)
            sock.setsockopt(zmq.SNDHWM, 0)
        self._in.bind(address_in)
        self._out.bind(address_out)
        self._send_lock = threading.Lock()
        self._pending: dict[tuple[bytes, int], list[Future[RecResult]]] = {}
        self._lock = threading.Lock()
        self._updates = ThreadPoolExecutor(1, thread_name_prefix="engine-update")
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="engine-io", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        """Stops reading calls (the batcher drains what it holds; answers still go out)."""
        self._stop.set()
        self._thread.join(5.0)

    def close(self) -> None:
        self._updates.shutdown(wait=False, cancel_futures=True)
        with self._send_lock:
            self._in.close()
            self._out.close()
        self._ctx.term()

    # ---- the I/O thread ------------------------------------------------------------------------
    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self._in, zmq.POLLIN)
        while not self._stop.is_set():
            if not poller.poll(POLL_MS):
                continue
            while True:
                try:
                    frames = self._in.recv_multipart(zmq.NOBLOCK, copy=False)
                except zmq.Again:
                    break
                try:
                    self._dispatch(frames)
                except Exception:  # one bad message must not stop the engine
                    log.exception("engine: a message from a front end failed")

    def _dispatch(self, frames: list[Any]) -> None:
        head = wire.header(frames)
        kind, fe = head["t"], head["fe"].encode()
        if kind == "sub":
            self._submit(fe, head, frames)
        elif kind == "cancel":
            with self._lock:
                futures = self._pending.pop((fe, head["id"]), [])
            for f in futures:
                f.cancel()
        elif kind == "ping":
            self._pong(fe)
        elif kind == "upd":
            self._updates.submit(self._update, fe, head, bytes(frames[1].buffer))
        else:
            log.warning("engine: unknown message kind %r", kind)

    def _pong(self, fe: bytes) -> None:
        try:
            info = self.engine.info() if self.engine.ready else None
        except UnavailableError:
            info = None
        fields, config = wire.encode_info(info)
        head = {"t": "pong", "epoch": self.epoch, "ready": info is not None, "info": fields}
        self._send(fe, wire.message(head, config))

    def _submit(self, fe: bytes, head: dict[str, Any], frames: list[Any]) -> None:
        call = head["id"]
        try:
            futures = self.engine.submit(wire.decode_requests(head, frames))
        except Exception as e:  # refused at the edge: the whole call, as in process
            self._send(fe, wire.message({"t": "err", "id": call, "err": wire.error_of(e)}))
            return
        key = (fe, call)
        with self._lock:
            self._pending[key] = futures
        left = [len(futures)]

        def done(_: Future[RecResult]) -> None:
            with self._lock:
                left[0] -= 1
                if left[0]:
                    return
                self._pending.pop(key, None)
            self._answer(fe, call, futures)

        for f in futures:
            f.add_done_callback(done)

    def _answer(self, fe: bytes, call: int, futures: list[Future[RecResult]]) -> None:
        outcomes: list[RecResult | BaseException] = []
        for f in futures:
            if f.cancelled():
                return  # the front end gave up on the call: nobody waits for an answer
            exc = f.exception()
            outcomes.append(f.result() if exc is None else exc)
        self._send(fe, wire.encode_results({"id": call}, outcomes))

    def _update(self, fe: bytes, head: dict[str, Any], request: bytes) -> None:
        reply, out = b"", {"t": "updr", "id": head["id"]}
        try:
            if self.on_update is None:
                raise RuntimeError("update: live updates are off in this engine")
            reply = self.on_update(head["kind"], request, head["update_id"], head["deadline"])
        except Exception as e:
            out["err"] = wire.error_of(e)
        self._send(fe, wire.message(out, reply))

    def _send(self, fe: bytes, frames: list[Any]) -> None:
        with self._send_lock:
            if self._out.closed:
                return
            try:
                self._out.send_multipart([fe, *frames], zmq.NOBLOCK, copy=False)
            except zmq.ZMQError as e:  # the front end is gone (restarting): nobody to tell
                log.debug("engine: answer to %r dropped: %s", fe, e)
