"""Log lines that clients cannot forge or flood.

Two helpers for every log line about a request (an unauthenticated client chooses its text and
how often it arrives), and one for every error answer:

- :func:`safe`: client-supplied text as one printable line, control characters escaped the way
  ``repr`` does (``%0A`` in a path, decoded to a newline, is logged as ``\\n``, so it cannot
  start a line that looks like the server's own), and cut to a bounded length.
- :class:`RateLimit` (added by :func:`limit_rate`): at most ``burst`` records per message
  template per ``interval_s`` on a logger; a window that left records out ends with one
  ``... repeated K times`` line (within ``interval_s`` of the last one, from a timer thread).
- :func:`safe_message`: an error message that answers a client (and may quote its text),
  escaped like :func:`safe` and cut in its middle to :data:`MAX_MESSAGE_CHARS`
  (``serving.types.error_message`` renders every serving error through it).

    log = limit_rate(logging.getLogger(__name__))
    log.warning("http: refused %s: %s", safe(path), why)

Keys are the templates (``record.msg``), not the formatted text: a flood of refusals that differ
only in the client's text is still one key, and the number of keys stays the number of log
calls in the code. Tracebacks (``log.exception``) are for our own bugs; expected refusals log
one line without one.
"""

from __future__ import annotations

import heapq
import itertools
import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

MAX_SHOWN_CHARS = 200
"""Longest client text a log line quotes (a 200 KB filter or path is cut, its length named)."""
MAX_MESSAGE_CHARS = 500
"""Longest error message an answer carries (:func:`safe_message`). gRPC sends it as metadata,
which a client refuses past 8 KiB by default (RESOURCE_EXHAUSTED instead of the error); even
escaped or percent-encoded on the wire (at most 12 bytes a character) this stays under it."""
BURST = 5
"""Records per template and interval that pass a :class:`RateLimit` by default."""
INTERVAL_S = 10.0
MAX_KEYS = 1024
"""Templates a :class:`RateLimit` tracks; past that it forgets the oldest (memory stays bounded
even if someone logs f-strings)."""


def safe(text: object, limit: int = MAX_SHOWN_CHARS) -> str:
    """``text`` fit for one log line: non-printable characters (newlines, ESC, U+2028 ...) and
    backslashes escaped as ``repr`` escapes them, and at most ``limit`` characters of it shown."""
    s = str(text)
    cut = len(s) > limit
    shown = _escaped(s[:limit] if cut else s, backslash=True)
    return f"{shown}... ({len(s)} characters)" if cut else shown


def safe_message(text: object, limit: int = MAX_MESSAGE_CHARS) -> str:
    """An error message fit for an answer (it may quote any client text): non-printable
    characters escaped as ``repr`` escapes them, and past ``limit`` characters its middle cut,
    the count named, keeping its start (the field) and its end (the row, the limit)."""
    s = str(text)
    if len(s) > limit:
        tail = limit // 4
        s = f"{s[: limit - tail]}... ({len(s) - limit} characters cut) ...{s[len(s) - tail :]}"
    return _escaped(s, backslash=False)


def _escaped(s: str, backslash: bool) -> str:
    if s.isprintable() and not (backslash and "\\" in s):
        return s
    return "".join(
        c if c.isprintable() and not (backslash and c == "\\") else repr(c)[1:-1] for c in s
    )


@dataclass
class _Window:
    start: float
    passed: int = 0
    suppressed: int = 0
    last: logging.LogRecord | None = None
    """The latest record left out (its logger, level and place name the summary line)."""


class RateLimit(logging.Filter):
    """Lets ``burst`` records of one template through per ``interval_s``; counts the rest and
    reports them in one line when the window ends (the :class:`_Flusher` thread), or before the
    next record that passes, whichever comes first: at most ``interval_s`` after the last one
    left out, even when no other record of its kind follows."""

    def __init__(
        self,
        logger: logging.Logger,
        burst: int = BURST,
        interval_s: float = INTERVAL_S,
        clock: Callable[[], float] = time.monotonic,
    ):
        super().__init__()
        self.logger, self.burst, self.interval_s, self.clock = logger, burst, interval_s, clock
        self._windows: dict[tuple[int, str], _Window] = {}
        self._lock = threading.Lock()

    def reset(self) -> None:
        """Forgets every window (tests start from a clean slate)."""
        with self._lock:
            self._windows.clear()

    def filter(self, record: logging.LogRecord) -> bool:
        key = (record.levelno, str(record.msg))
        now = self.clock()
        with self._lock:
            window = self._windows.get(key)
            if window is not None and now - window.start < self.interval_s:
                if window.passed >= self.burst:
                    window.suppressed += 1
                    window.last = record
                    if window.suppressed == 1:  # its summary is due when the window ends
                        _FLUSHER.schedule(self, window.start + self.interval_s - now)
                    return False
                window.passed += 1
                return True
            if len(self._windows) >= MAX_KEYS:
                self._windows.pop(next(iter(self._windows)))
            self._windows[key] = _Window(now, passed=1)
        if window is not None and window.suppressed:
            self._summary(record, window.suppressed, now - window.start)
        return True

    def flush(self) -> None:
        """Reports every window that has ended with records left out, and forgets it (the next
        record of its kind starts a new window)."""
        now = self.clock()
        with self._lock:
            ended = [
                (key, w)
                for key, w in self._windows.items()
                if w.suppressed and now - w.start >= self.interval_s
            ]
            for key, _ in ended:
                del self._windows[key]
        for _, w in ended:
            assert w.last is not None
            self._summary(w.last, w.suppressed, now - w.start)

    def _summary(self, record: logging.LogRecord, count: int, seconds: float) -> None:
        """One line saying how many records like ``record`` were left out (it has its own
        template, so it passes this filter once per window)."""
        summary = logging.LogRecord(
            record.name,
            record.levelno,
            record.pathname,
            record.lineno,
            "... %r repeated %d times in %.0f s (not logged)",
            (safe(record.msg), count, seconds),
            None,
        )
        self.logger.handle(summary)


class _Flusher:
    """One daemon thread for every :class:`RateLimit`: calls ``flush`` when a window that left
    records out ends (a heap of due times; the thread starts with the first one)."""

    def __init__(self) -> None:
        self._ties = itertools.count()
        self._start_over()
        # a forked child has none of the parent's threads, and maybe a lock held by one
        os.register_at_fork(after_in_child=self._start_over)

    def _start_over(self) -> None:
        self._due: list[tuple[float, int, RateLimit]] = []  # (monotonic due time, tie, limit)
        self._wake = threading.Condition()
        self._thread: threading.Thread | None = None

    def schedule(self, limit: RateLimit, after_s: float) -> None:
        with self._wake:
            due = time.monotonic() + max(after_s, 0.0) + FLUSH_LATE_S
            heapq.heappush(self._due, (due, next(self._ties), limit))
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="log-flush", daemon=True)
                self._thread.start()
            self._wake.notify()

    def _run(self) -> None:
        while True:
            with self._wake:
                while not self._due or self._due[0][0] > time.monotonic():
                    self._wake.wait(self._due[0][0] - time.monotonic() if self._due else None)
                _, _, limit = heapq.heappop(self._due)
            limit.flush()


FLUSH_LATE_S = 0.01
"""How long after a window's end the flusher looks (so that the window has ended by its own
clock too)."""
_FLUSHER = _Flusher()


_LIMITS: list[RateLimit] = []


def limit_rate(
    logger: logging.Logger, burst: int = BURST, interval_s: float = INTERVAL_S
) -> logging.Logger:
    """``logger`` with a :class:`RateLimit` (added once; returns the logger)."""
    if not any(isinstance(f, RateLimit) for f in logger.filters):
        limit = RateLimit(logger, burst, interval_s)
        logger.addFilter(limit)
        _LIMITS.append(limit)
    return logger


def reset_rate_limits() -> None:
    """Every :func:`limit_rate` filter forgets its windows (for tests)."""
    for limit in _LIMITS:
        limit.reset()
