"""Tests wait for a condition, not for a number of seconds: a fixed sleep is too short on a busy
machine and wasted time on an idle one. ``from support.waiting import wait_until``."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


def wait_until(predicate: Callable[[], T], timeout_s: float, what: str, poll_s: float = 0.02) -> T:
    """Calls ``predicate`` every ``poll_s`` until it returns something true, and returns that.
    Fails the test (``AssertionError`` naming ``what``) if ``timeout_s`` passes first; give a
    generous deadline, a passing test never waits it out."""
    until = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() >= until:
            raise AssertionError(f"not within {timeout_s} s: {what}")
        time.sleep(poll_s)
