"""What every config of ours shares: the error a bad value raises, and the longest wait."""

from __future__ import annotations

import math

MAX_WAIT_S = 86_400.0
"""Longest wait (delay, timeout, poll period) a config may ask for: one day. More is a unit
mistake, and Python's waits refuse past ~292 years (OverflowError in the thread that waits)."""


class ConfigError(ValueError):
    """A bad config value; the message names the field (``section.key``) and, where there is one,
    the flag that sets it."""


def check_wait(name: str, seconds: float, ms: bool = False) -> None:
    """A wait (its sign is checked apart) is a number of at most :data:`MAX_WAIT_S`; NaN and
    infinity are not. ``ms``: the field is in milliseconds (so is the message)."""
    if not (math.isfinite(seconds) and seconds <= MAX_WAIT_S):
        unit = 1000.0 if ms else 1.0
        raise ConfigError(
            f"{name}: must be a number <= {MAX_WAIT_S * unit:.0f} (one day), got {seconds * unit}"
        )
