"""Log lines that clients cannot forge or flood.

Two helpers for every log line about a request (an unauthenticated client chooses its text and
how often it arrives):

- :func:`safe`: client-supplied text as one printable line, control characters escaped the way
  ``repr`` does (``%0A`` in a path, decoded to a newline, is logged as ``\\n``, so it cannot
  start a line that looks like the server's own), and cut to a bounded length.
- :class:`RateLimit` (added by :func:`limit_rate`): at most ``burst`` records per message
  template per ``interval_s`` on a logger; the next record after a suppressed stretch is
  preceded by one ``... repeated K times`` line.

    log = limit_rate(logging.getLogger(__name__))
    log.warning("http: refused %s: %s", safe(path), why)

Keys are the templates (``record.msg``), not the formatted text: a flood of refusals that differ
only in the client's text is still one key, and the number of keys stays the number of log
calls in the code. Tracebacks (``log.exception``) are for our own bugs; expected refusals log
one line without one.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

MAX_SHOWN_CHARS = 200
"""Longest client text a log line quotes (a 200 KB filter or path is cut, its length named)."""
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
    shown = s[:limit] if cut else s
    if not shown.isprintable() or "\\" in shown:
        shown = "".join(c if c.isprintable() and c != "\\" else repr(c)[1:-1] for c in shown)
    return f"{shown}... ({len(s)} characters)" if cut else shown


@dataclass
class _Window:
    start: float
    passed: int = 0
    suppressed: int = 0


class RateLimit(logging.Filter):
    """Lets ``burst`` records of one template through per ``interval_s``; counts the rest and
    reports them in one line before the next record that passes."""

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
                    return False
                window.passed += 1
                return True
            if len(self._windows) >= MAX_KEYS:
                self._windows.pop(next(iter(self._windows)))
            self._windows[key] = _Window(now, passed=1)
        if window is not None and window.suppressed:
            self._summary(record, window.suppressed, now - window.start)
        return True

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
