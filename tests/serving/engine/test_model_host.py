"""ModelHost: newest loadable version, swaps between batches, corrupt versions skipped."""

from __future__ import annotations

import threading
import time

import pytest

from serving.engine.batching import BatchPolicy
from serving.engine.host import ModelHost, NoLoadableVersionError
from serving.engine.metrics import ServingMetrics
from serving.engine.state import make_batcher
from serving.types import ModelNotFoundError, UnavailableError

WAIT = 10.0


def test_start_serves_the_newest_loadable_version(tiny, repo):
    repo.publish(tiny.build(1))
    repo.publish(tiny.build(2), corrupt=True)
    metrics = ServingMetrics("demo")
    host = ModelHost(repo, "demo", poll_s=0, metrics=metrics)
    assert not host.ready
    with pytest.raises(UnavailableError):
        host.current()
    assert host.start() == 2
    assert host.ready and host.version == 2 and host.current().version == 2
    assert host.failed == {3} and host.reload_failures == 1
    assert metrics.reloads.labels("demo", "failed")._value.get() == 1
    assert metrics.version.labels("demo")._value.get() == 2


def test_no_loadable_version_refuses_to_start(tiny, empty_repo):
    empty = empty_repo
    with pytest.raises(NoLoadableVersionError, match="none found"):
        ModelHost(empty, "demo", poll_s=0).start()
    empty.publish(tiny.model, corrupt=True)
    with pytest.raises(NoLoadableVersionError, match="tried: 1"):
        ModelHost(empty, "demo", poll_s=0).start()


def test_poll_swaps_in_newer_versions_and_skips_corrupt_ones(tiny, repo):
    host = ModelHost(repo, "demo", poll_s=0)
    host.start()
    assert host.poll_once() is None  # nothing new
    repo.publish(tiny.build(1))
    assert host.poll_once() == 2 and host.version == 2
    repo.publish(tiny.build(2), corrupt=True)
    assert host.poll_once() is None and host.version == 2
    loads = len(repo.loads)
    assert host.poll_once() is None and len(repo.loads) == loads  # a failed version: no retry
    repo.publish(tiny.build(3))
    assert host.poll_once() == 4 and host.failed == {3}
    assert (host.reloads, host.reload_failures) == (2, 1)


def test_the_poll_thread_picks_up_a_new_version(tiny, repo):
    host = ModelHost(repo, "demo", poll_s=0.05)
    host.start()
    repo.publish(tiny.build(1))
    until = time.monotonic() + WAIT
    while host.version != 2 and time.monotonic() < until:
        time.sleep(0.02)
    assert host.version == 2
    host.stop(timeout=WAIT)


def test_a_swap_lands_between_batches_and_readiness_never_drops(tiny, repo):
    host = ModelHost(repo, "demo", poll_s=0)
    host.start()
    metrics = ServingMetrics("demo")
    started, release = threading.Event(), threading.Event()
    batcher = make_batcher(host, BatchPolicy(8, 0.0, 0), metrics)
    inner = batcher.run_batch

    def held(reqs):  # the first batch picks its runner, then waits while the swap happens
        runner = host.current()
        started.set()
        release.wait(WAIT)
        return runner.run(reqs)

    batcher.run_batch = held
    in_flight = batcher.submit(tiny.request(0))
    assert started.wait(WAIT)
    ready_samples: list[bool] = []
    sampling = threading.Event()

    def sample() -> None:
        while not sampling.is_set():
            ready_samples.append(host.ready)
            time.sleep(0.0005)

    sampler = threading.Thread(target=sample)
    sampler.start()
    repo.publish(tiny.build(5))
    assert host.poll_once() == 2  # swapped while the batch runs
    sampling.set()
    sampler.join()
    assert ready_samples and all(ready_samples)
    release.set()
    assert in_flight.result(WAIT).version == 1  # finished on the runner it started with
    batcher.run_batch = inner
    assert batcher.submit(tiny.request(0)).result(WAIT).version == 2  # the next batch
    batcher.stop(timeout=WAIT)


def test_check_target(tiny, repo):
    host = ModelHost(repo, "demo", poll_s=0)
    host.start()
    host.check_target("", None)
    host.check_target("demo", 1)
    with pytest.raises(ModelNotFoundError, match=r"^model"):
        host.check_target("other", None)
    with pytest.raises(ModelNotFoundError, match=r"^version"):
        host.check_target("demo", 7)


def test_the_tables_work_between_batches_after_the_answers_went_out(tiny, repo, monkeypatch):
    """A device cache admits outside the forward and after the batch's answers are delivered:
    the engine's batcher calls the runner's upkeep once a batch's futures hold their results."""
    host = ModelHost(repo, "demo", poll_s=0)
    host.start()
    events: list[str] = []
    batcher = make_batcher(host, BatchPolicy(8, 0.0, 0), ServingMetrics("demo"))
    futures = []

    def between() -> None:
        events.append("between:" + ",".join(str(f.done()) for f in futures))

    monkeypatch.setattr(host.current().model.tables, "between_batches", between)
    for i in range(2):
        futures.append(batcher.submit(tiny.request(i)))
        futures[-1].result(10.0)
        until = time.monotonic() + 10.0
        while len(events) <= i and time.monotonic() < until:
            time.sleep(0.005)
    batcher.stop()
    host.stop(timeout=10.0)
    assert events == ["between:True", "between:True,True"]
