"""BatchPolicy, the pure dynamic-batching rules, checked exhaustively without a model."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from serving.engine.batching import BatchPolicy


@st.composite
def policies(draw) -> BatchPolicy:
    mbs = draw(st.integers(1, 12))
    preferred = draw(st.lists(st.integers(1, mbs), max_size=3, unique=True))
    return BatchPolicy(
        max_batch_size=mbs,
        max_queue_delay_s=draw(st.sampled_from([0.0, 0.001, 0.01, 0.5])),
        max_queue_size=draw(st.integers(0, 20)),
        preferred_sizes=tuple(preferred),
    )


@st.composite
def queues(draw) -> tuple[list[tuple[float, float | None]], float]:
    """A queue (oldest first) and a time not before its last arrival."""
    times = sorted(draw(st.lists(st.floats(0, 1, allow_nan=False), max_size=30)))
    queue = [
        (t, draw(st.one_of(st.none(), st.floats(0, 2, allow_nan=False).map(lambda d, t=t: t + d))))
        for t in times
    ]
    now = max(times, default=0.0) + draw(st.floats(0, 1, allow_nan=False))
    return queue, now


@pytest.mark.slow
@settings(max_examples=600, deadline=None)
@given(policies(), queues())
def test_one_decision_follows_the_rules(policy, queue_now):
    queue, now = queue_now
    s = policy.next_batch(queue, now)
    # 1. exactly the requests whose deadline passed are dropped
    assert s.expired == tuple(i for i, (_, d) in enumerate(queue) if d is not None and d <= now)
    live = [q for i, q in enumerate(queue) if i not in set(s.expired)]
    n = len(live)
    assert 0 <= s.take <= min(n, policy.max_batch_size)
    fits = [p for p in policy.preferred_sizes if p <= n]
    due = bool(live) and now >= live[0][0] + policy.max_queue_delay_s
    if n >= policy.max_batch_size:  # 2. a full batch goes at once
        assert s.take == policy.max_batch_size
    elif fits:  # 3. the largest preferred size the queue fills
        assert s.take == max(fits)
    elif due:  # 4. the oldest has waited long enough: everything goes
        assert s.take == n
    else:
        assert s.take == 0
    if s.take:
        assert s.wait_until is None
    elif n:
        assert s.wait_until == live[0][0] + policy.max_queue_delay_s > now
    else:
        assert s.wait_until is None


@dataclass
class Sim:
    """The batcher's loop on a simulated clock: one worker, ``compute`` seconds a batch."""

    policy: BatchPolicy
    compute: float
    queue: list[tuple[int, float, float | None]] = field(default_factory=list)
    batches: list[tuple[float, list[int]]] = field(default_factory=list)
    expired: list[tuple[float, int]] = field(default_factory=list)
    rejected: list[int] = field(default_factory=list)
    longest: int = 0

    def run(self, arrivals: list[tuple[float, float | None]]) -> None:
        t, i, free_at = 0.0, 0, 0.0
        for _ in range(10_000):
            while i < len(arrivals) and arrivals[i][0] <= t:
                if self.policy.admits(len(self.queue)):
                    self.queue.append((i, *arrivals[i]))
                    self.longest = max(self.longest, len(self.queue))
                else:
                    self.rejected.append(i)
                i += 1
            wake = None
            if t >= free_at:
                s = self.policy.next_batch([(e, d) for _, e, d in self.queue], t)
                self.expired += [(t, self.queue[j][0]) for j in s.expired]
                live = [q for j, q in enumerate(self.queue) if j not in set(s.expired)]
                self.queue = live[s.take :]
                if s.take:
                    self.batches.append((t, [q[0] for q in live[: s.take]]))
                    free_at = t + self.compute
                    continue
                wake = s.wait_until
            else:
                wake = free_at
            nxt = [
                w for w in (wake, arrivals[i][0] if i < len(arrivals) else None) if w is not None
            ]
            if not nxt:
                break
            t = max(t, min(nxt))
        else:
            raise AssertionError("the simulation did not settle")


@st.composite
def arrivals(draw) -> list[tuple[float, float | None]]:
    gaps = draw(st.lists(st.sampled_from([0.0, 0.0005, 0.002, 0.02, 0.3]), max_size=40))
    out, t = [], 0.0
    for g in gaps:
        t += g
        ttl = draw(st.one_of(st.none(), st.sampled_from([0.0005, 0.005, 0.05, 1.0])))
        out.append((t, None if ttl is None else t + ttl))
    return out


@pytest.mark.slow
@settings(max_examples=300, deadline=None)
@given(policies(), arrivals(), st.sampled_from([0.0, 0.001, 0.05]))
def test_every_request_is_served_in_order_or_expires_or_is_refused(policy, arr, compute):
    sim = Sim(policy, compute)
    sim.run(arr)
    served = [r for _, b in sim.batches for r in b]
    expired = [r for _, r in sim.expired]
    # each request has exactly one fate
    assert sorted(served + expired + sim.rejected) == list(range(len(arr)))
    # FIFO: the batches, read in order, never put a later request before an earlier one
    assert served == sorted(served)
    for t, batch in sim.batches:
        assert 1 <= len(batch) <= policy.max_batch_size
        for r in batch:
            deadline = arr[r][1]
            assert deadline is None or t < deadline  # nothing runs after its deadline
            assert t >= arr[r][0]
    for t, r in sim.expired:
        assert arr[r][1] is not None and arr[r][1] <= t
    if policy.max_queue_size:  # the queue never holds more than max_queue_size
        assert sim.longest <= policy.max_queue_size
    else:
        assert not sim.rejected
    if compute == 0.0:  # an idle worker never holds a request past the delay
        for t, batch in sim.batches:
            for r in batch:
                assert t <= arr[r][0] + policy.max_queue_delay_s + 1e-12


def test_admission_stops_at_max_queue_size_and_zero_means_no_limit():
    p = BatchPolicy(4, 0.01, 3)
    assert [p.admits(n) for n in range(5)] == [True, True, True, False, False]
    assert BatchPolicy(4, 0.01, 0).admits(10**9)


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"max_batch_size": 0}, "max_batch_size"),
        ({"max_queue_delay_s": -1.0}, "max_queue_delay_s"),
        ({"max_queue_delay_s": float("nan")}, "max_queue_delay_s"),
        ({"max_queue_size": -1}, "max_queue_size"),
        ({"preferred_sizes": (9,)}, "preferred_sizes"),
    ],
)
def test_bad_policy_names_the_field(kwargs, field):
    args = {"max_batch_size": 8, "max_queue_delay_s": 0.01, "max_queue_size": 10, **kwargs}
    with pytest.raises(ValueError, match=f"^{field}"):
        BatchPolicy(**args)
