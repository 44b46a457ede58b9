"""VersionWatcher: newest first, refused versions never retried, loads one at a time."""

from __future__ import annotations

import threading
import time

from serving.repository.watcher import VersionWatcher

WAIT = 10.0


class Versions:
    """A repository's version list and a loader that refuses the versions in ``bad``."""

    def __init__(self, held: list[int], bad: set[int] | None = None):
        self.held, self.bad = list(held), bad or set()
        self.loaded: list[int] = []
        self.refused: list[tuple[int, str]] = []

    def load(self, version: int) -> None:
        if version in self.bad:
            raise ValueError(f"version {version} is corrupt")
        self.loaded.append(version)

    def watcher(self, poll_s: float = 0.0) -> VersionWatcher:
        return VersionWatcher(
            lambda: self.held,
            self.load,
            lambda v, e: self.refused.append((v, str(e))),
            poll_s=poll_s,
        )


def test_the_newest_version_that_loads_is_loaded_first():
    repo = Versions([1, 2, 3], bad={3})
    w = repo.watcher()
    assert w.load_newest() == 2 and w.newest == 2
    assert repo.loaded == [2] and w.failed == {3}
    assert repo.refused == [(3, "version 3 is corrupt")]


def test_no_version_loads_leaves_every_one_refused():
    repo = Versions([1, 2], bad={1, 2})
    w = repo.watcher()
    assert w.load_newest() is None and w.newest is None and w.failed == {1, 2}


def test_a_poll_loads_only_newer_versions_and_never_retries_a_refused_one():
    repo = Versions([1], bad={3})
    w = repo.watcher()
    w.load_newest()
    assert w.poll_once() is None  # nothing newer
    repo.held += [2, 3]
    assert w.poll_once() == 2  # 3 refused, 2 loads
    assert w.poll_once() is None and repo.refused == [(3, "version 3 is corrupt")]  # not again
    repo.held.append(4)
    assert w.poll_once() == 4 and repo.loaded == [1, 2, 4]


def test_holding_keeps_loads_off_until_it_ends():
    repo = Versions([1])
    w = repo.watcher()
    w.load_newest()
    repo.held.append(2)
    done = threading.Event()
    with w.holding():
        t = threading.Thread(target=lambda: (w.poll_once(), done.set()))
        t.start()
        assert not done.wait(0.2) and repo.loaded == [1]
    assert done.wait(WAIT) and repo.loaded == [1, 2]
    t.join(WAIT)


def test_the_poll_thread_survives_a_failed_read_and_loads_what_appears():
    repo = Versions([1])
    failures: list[Exception] = []

    def versions() -> list[int]:
        if failures:
            raise failures.pop()
        return repo.held

    w = VersionWatcher(versions, repo.load, lambda v, e: None, poll_s=0.01)
    assert w.load_newest() == 1
    failures.append(RuntimeError("disk gone"))  # the first poll's read fails
    repo.held.append(2)
    w.start()
    until = time.monotonic() + WAIT
    while w.newest != 2 and time.monotonic() < until:
        time.sleep(0.01)
    w.stop(WAIT)
    assert not failures and w.newest == 2 and repo.loaded == [1, 2]
