"""HTTP/1.1 connections under uvicorn with bounded heads: ``uvicorn.Config(..., **http_options(limits))``.

uvicorn's h11 protocol bounds a head's size (h11's 16 KiB) but not the time it takes to arrive:
a client that sends ``POST /v2/models/m/infer HTTP/1.1\\r\\nHost: x\\r\\n`` and stops, or
connects and sends nothing, holds its connection (a file descriptor) forever, and bytes that
hold no ``\\r\\n\\r\\n`` are never answered. :class:`BoundedH11Protocol` adds, per connection:

- a **head timeout** (``limits.http_head_timeout_s``): a request head must arrive whole within
  it, counted from the connection's opening or, on a kept-alive connection, from the first byte
  of the next head. Past it the connection gets HTTP 408 with ``Connection: close`` (or, when
  nothing of a head arrived, is closed silently) and is closed;
- an **early refusal of a request line that cannot be one**: until its first line feed a head
  is ``method SP target SP version``, visible ASCII and spaces only (RFC 9112 section 3), so a
  byte outside those gets HTTP 400 and a close at once, where h11 would wait for a blank line
  that random bytes almost never hold;
- a **cap on open connections** (``limits.max_http_connections``): one more is answered 503 and
  closed as it opens, so a flood of connections cannot take every file descriptor the process
  needs for its model files and update logs.

The body that follows a head is bounded by ``limits.http_body_timeout_s``
(``serving/frontends/kserve_http.py``); an idle kept-alive connection by uvicorn's own
``timeout_keep_alive``. Log lines about refused connections are rate-limited (uvicorn's own
``uvicorn.error`` logger too: a client chooses how often it sends garbage).
"""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING, Any

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from common.logs import limit_rate

if TYPE_CHECKING:
    from serving.limits import LimitsConfig

log = limit_rate(logging.getLogger(__name__))
limit_rate(logging.getLogger("uvicorn.error"))

REQUEST_LINE_BYTES = b"\r" + bytes(range(0x20, 0x7F))
"""What a request line is made of up to its line feed: visible ASCII (``tchar``, URI characters,
``HTTP/1.1``), the two spaces between method, target and version, and its CR (h11 checks the
line's exact form once the head is whole)."""


def check_request_line(chunk: bytes) -> tuple[bool, bool]:
    """``chunk``: the next bytes of a head whose request line is not complete. -> (no byte
    that cannot be in a request line, the line is complete)."""
    line, lf, _ = chunk.partition(b"\n")
    return not line.translate(None, REQUEST_LINE_BYTES), bool(lf)


class BoundedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol with a head timeout, an early request-line check and a cap on
    open connections (see the module docstring); :func:`http_options` sets the two limits."""

    head_timeout_s: float = 10.0
    max_connections: int = 1024

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        self._head_timer: asyncio.TimerHandle | None = None
        self._head_bytes = 0  # of the head being waited for
        self._line_open = True  # its request line not yet complete: bytes still checked
        super().connection_made(transport)
        if len(self.connections) > self.max_connections:
            log.warning(
                "http: refused a connection: %d are open (limits.max_http_connections)",
                len(self.connections) - 1,
            )
            self._answer_and_close(503, "too many open connections (limits.max_http_connections)")
            return
        self._arm_head_timer()

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_head_timer()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self.transport.is_closing():  # refused or timed out: what follows is not read
            return
        if self.conn.their_state is h11.IDLE:
            if self._head_timer is None:  # the first byte of a kept-alive connection's next head
                self._arm_head_timer()
            self._head_bytes += len(data)
            if self._line_open:
                valid, complete = check_request_line(data)
                if not valid:
                    log.warning("http: refused a request line that is not HTTP")
                    self._answer_and_close(400, "Invalid HTTP request line.")
                    return
                self._line_open = not complete
        super().data_received(data)
        if self.conn.their_state is not h11.IDLE:  # the head arrived (or the connection failed)
            self._cancel_head_timer()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
            pending = self.conn.trailing_data[0]  # a pipelined head already (partly) here
            self._head_bytes, self._line_open = len(pending), not pending
            if pending and self._head_timer is None:
                self._arm_head_timer()

    def _arm_head_timer(self) -> None:
        self._cancel_head_timer()
        self._head_timer = self.loop.call_later(self.head_timeout_s, self._head_timed_out)

    def _cancel_head_timer(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _head_timed_out(self) -> None:
        self._head_timer = None
        if self.conn.their_state is not h11.IDLE or self.transport.is_closing():
            return
        if not self._head_bytes:  # nothing asked: nothing to answer
            self.transport.close()
            return
        log.warning(
            "http: a request head did not arrive within %g s (%d bytes came; "
            "limits.http_head_timeout_s): connection closed",
            self.head_timeout_s,
            self._head_bytes,
        )
        self._answer_and_close(
            408,
            f"request head not received within {self.head_timeout_s:g} s "
            "(limits.http_head_timeout_s)",
        )

    def _answer_and_close(self, status: int, message: str) -> None:
        """Answers ``status`` with ``message`` and ``Connection: close`` (h11 lets a server
        answer before a request arrived), then closes."""
        self._cancel_head_timer()
        body = message.encode()
        headers = [
            (b"content-type", b"text/plain; charset=utf-8"),
            (b"content-length", str(len(body)).encode()),
            (b"connection", b"close"),
        ]
        try:
            for event in (
                h11.Response(status_code=status, headers=headers),
                h11.Data(data=body),
                h11.EndOfMessage(),
            ):
                self.transport.write(self.conn.send(event))
        except h11.LocalProtocolError:  # a response already under way: only the close is left
            pass
        self.transport.close()


def http_options(limits: LimitsConfig) -> dict[str, Any]:
    """``uvicorn.Config`` keyword arguments for a listener bounded by ``limits``."""
    protocol = type(
        "BoundedH11Protocol",
        (BoundedH11Protocol,),
        {
            "head_timeout_s": limits.http_head_timeout_s,
            "max_connections": limits.max_http_connections,
        },
    )
    return {"http": protocol}
