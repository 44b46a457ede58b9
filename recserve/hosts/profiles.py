"""Network profiles: what ``netem`` would do to a host's links, as data for the relay
(``relay.py``) and the host's link (``netns.py``, its rate).

* **delay and jitter**: a chunk of bytes goes on ``delay_ms`` +- ``jitter_ms`` (uniform) after it
  arrived, each direction (a round trip pays it twice). A TCP stream is delivered in order, so
  a chunk never overtakes the one before it: jitter shows as head-of-line waits, as it does
  for a TCP receiver whose packets arrive reordered.
* **loss**: TCP loses no bytes; a lost segment costs its stream a retransmission. Each chunk
  counts as ``ceil(len / MSS)`` segments, each lost with probability ``loss``; a chunk with a
  lost segment is held back ``stall_ms`` (the retransmission timeout, by default Linux's
  minimum ``TCP_RTO_MIN``, doubled for each further loss of the same segment), and everything
  behind it in that direction waits too. Real stacks often recover a loss sooner (fast
  retransmit, tail loss probes a few round trips later), so this is the pessimistic case of a
  short RPC whose only segment is lost. No connection is reset and no byte is dropped: a
  partition (no packet at all) is the host's link going down (``netns.py``), not the relay.
* **rate**: a bandwidth cap, the kernel's (``tc tbf`` on the host's link, ``netns.py``); the
  profile carries it for whoever sets up the link.
"""

from __future__ import annotations

import json
import math
import random
from dataclasses import asdict, dataclass
from pathlib import Path

MSS = 1448
"""Bytes of one TCP segment on a 1500-byte Ethernet link."""
MAX_RETRIES = 6
"""Losses of one segment counted at most (then it gets through): bounds a chunk's stall."""


@dataclass(frozen=True)
class Profile:
    """The faults of a host's links (see the module docstring for what each means)."""

    delay_ms: float = 0.0
    """One-way delay of a chunk, each direction."""
    jitter_ms: float = 0.0
    """The one-way delay varies uniformly by +- this (never below 0)."""
    loss: float = 0.0
    """Probability that a segment is lost (and retransmitted after ``stall_ms``)."""
    stall_ms: float = 200.0
    """What one loss costs the stream: a retransmission timeout (Linux's ``TCP_RTO_MIN``)."""
    rate: str = ""
    """Bandwidth cap of the host's link (a tc rate, ``"10mbit"``; "" none): set by
    ``netns.HostSet.rate``, not by the relay."""

    def one_way_s(self, rng: random.Random, nbytes: int) -> float:
        """Seconds a chunk of ``nbytes`` waits before it goes on (delay, jitter, losses)."""
        d = self.delay_ms
        if self.jitter_ms > 0:
            d = max(0.0, d + rng.uniform(-self.jitter_ms, self.jitter_ms))
        if self.loss > 0:
            stall = self.stall_ms
            for _ in range(math.ceil(nbytes / MSS)):
                for _ in range(MAX_RETRIES):  # lost, and maybe its retransmissions too
                    if rng.random() >= self.loss:
                        break
                    d += stall
                    stall *= 2
        return d / 1000.0

    def to_json(self) -> dict:
        return asdict(self)

    @classmethod
    def from_json(cls, d: dict) -> Profile:
        return cls(**d)


PROFILES: dict[str, Profile] = {
    "none": Profile(),
    # one datacentre: sub-millisecond round trips
    "dc": Profile(delay_ms=0.1, jitter_ms=0.05),
    # across the zones of a region: round trips of a millisecond or two, rare losses
    "zone": Profile(delay_ms=0.75, jitter_ms=0.25, loss=0.001),
    # a bad link: round trips that vary as much as they take, frequent losses, a thin pipe
    "bad": Profile(delay_ms=2.5, jitter_ms=2.5, loss=0.01, rate="20mbit"),
}
"""The named network profiles (``recserve cluster up --network NAME``)."""


def profile_named(name: str) -> Profile:
    try:
        return PROFILES[name]
    except KeyError:
        raise ValueError(f"network profile: one of {sorted(PROFILES)}, got {name!r}") from None


def read_profile(path: Path) -> Profile:
    """The profile in ``path`` (its JSON); ``ValueError``/``OSError`` when half-written or gone."""
    return Profile.from_json(json.loads(path.read_text()))


def write_profile(path: Path, profile: Profile) -> None:
    """Writes ``profile`` where a relay watches (replaced whole: a reader never sees half)."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(profile.to_json()))
    tmp.replace(path)


__all__ = [
    "MAX_RETRIES",
    "MSS",
    "PROFILES",
    "Profile",
    "profile_named",
    "read_profile",
    "write_profile",
]
