"""ModelHost: the version being served, hot reload from the repository, readiness.

Lifecycle::

    host = ModelHost(ModelRepository("model_repo"), "demo", poll_s=1.0)
    host.start()            # newest loadable version, warmed up; ready from here on
    with host.running() as runner:  # the batcher, ONCE per batch
        runner.run(requests)
    host.stop()

A poll thread watches the repository (``serving.repository.watcher.VersionWatcher``, which the
document shard servers use too). A newer version is loaded and warmed up beside the one
serving, then swapped in with one reference assignment: a batch already running finishes on the
old runner (it holds its own reference), the next batch gets the new one, so a swap lands between
batches and readiness never drops. A version that fails to load or warm up (checksum mismatch:
``CorruptVersionError``, or any other error) is logged, counted and never retried, while the
old version keeps serving.

Live updates (``serving/live/admin.py``) change the served version in place, also between batches:
under :meth:`ModelHost.updating` (no version load runs meanwhile) they build the updated model
beside the served one, then :meth:`ModelHost.swap_updated` waits for the running batches to
finish (:class:`BatchGate`: batches share it, an update takes it alone), runs the update's
in-place row writes, and swaps in a runner over the updated model. ``on_load`` prepares every
version before it serves (the admin replays the version's update log there).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Protocol

from serving.engine.metrics import ServingMetrics
from serving.engine.runner import ModelRunner
from serving.repository.repository import LoadedModel
from serving.repository.watcher import VersionWatcher
from serving.types import UnavailableError

log = logging.getLogger(__name__)


class Repository(Protocol):
    """What the host needs of ``serving.repository.ModelRepository``."""

    def latest(self, name: str) -> int | None: ...

    def versions(self, name: str) -> list[int]: ...

    def load(self, name: str, version: int | None = None) -> LoadedModel:
        """-> the verified, loaded version (``.model`` in eval mode, ``.version``, ``.config``)."""
        ...


class NoLoadableVersionError(RuntimeError):
    """The repository has no version of the model that loads (the server refuses to start)."""


@dataclass(frozen=True)
class Served:
    """One loaded version: its runner and what the repository returned (``config``, ``path``)."""

    runner: ModelRunner
    loaded: LoadedModel


class BatchGate:
    """Batches hold the gate shared (several may run at once); an update holds it alone, so it
    lands between batches. A waiting update holds new batches back (it is never starved)."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._running = 0
        self._exclusive = False
        self._waiting = 0

    @contextmanager
    def shared(self) -> Iterator[None]:
        """Held by one batch while it runs."""
        with self._cond:
            while self._exclusive or self._waiting:
                self._cond.wait()
            self._running += 1
        try:
            yield
        finally:
            with self._cond:
                self._running -= 1
                if not self._running:
                    self._cond.notify_all()

    @contextmanager
    def exclusive(self) -> Iterator[None]:
        """Held by an update: waits for the running batches, keeps new ones out."""
        with self._cond:
            self._waiting += 1
            while self._exclusive or self._running:
                self._cond.wait()
            self._waiting -= 1
            self._exclusive = True
        try:
            yield
        finally:
            with self._cond:
                self._exclusive = False
                self._cond.notify_all()


class ModelHost:
    """Serves one model name from a repository; swaps in newer versions as they appear."""

    def __init__(
        self,
        repo: Repository,
        name: str,
        poll_s: float = 1.0,
        *,
        metrics: ServingMetrics | None = None,
        warmup_sizes: tuple[int, ...] = (1, 8),
        make_runner: Callable[[LoadedModel], ModelRunner] | None = None,
        on_load: Callable[[LoadedModel], LoadedModel] | None = None,
    ):
        """``make_runner(loaded) -> runner``: how a loaded version is run (default: a
        :class:`ModelRunner` over ``loaded.model``; the router runs shards instead).
        ``on_load(loaded) -> loaded``: runs on every loaded version before its runner is made
        (the live updates replay the version's log there); raising refuses the version."""
        self.repo, self.name, self.poll_s = repo, name, poll_s
        self.make_runner = make_runner or (
            lambda loaded: ModelRunner(loaded.model, self.name, loaded.version)
        )
        self.metrics, self.warmup_sizes = metrics, warmup_sizes
        self.on_load = on_load
        self.gate = BatchGate()
        """Batches run inside ``gate.shared()`` (:meth:`running`); live updates swap inside
        ``gate.exclusive()`` (:meth:`swap_updated`)."""
        self.reloads = self.reload_failures = 0
        self._served: Served | None = None
        self.watcher = VersionWatcher(
            lambda: repo.versions(name),
            self._load,
            self._refused,
            poll_s=poll_s,
            thread_name="model-poll",
            what=f"model {name}",
        )
        """Polls the repository; loads run one at a time (live updates hold them off)."""

    # ---- what the engine reads ------------------------------------------------------------
    @property
    def ready(self) -> bool:
        return self._served is not None

    @property
    def failed(self) -> set[int]:
        """Versions that failed to load; never retried."""
        return self.watcher.failed

    def current(self) -> ModelRunner:
        """The runner of the version being served (read once per batch)."""
        served = self._served
        if served is None:
            raise UnavailableError(f"model {self.name} is not loaded yet")
        return served.runner

    @property
    def runner(self) -> ModelRunner:
        return self.current()

    @contextmanager
    def running(self) -> Iterator[ModelRunner]:
        """The runner of one batch, held for the batch's duration (a live update waits)."""
        with self.gate.shared():
            yield self.current()

    @property
    def version(self) -> int | None:
        served = self._served
        return None if served is None else served.runner.version

    @property
    def loaded(self) -> LoadedModel | None:
        """What ``repo.load`` returned for the version being served (``config``, ``path``);
        None before the first version loads."""
        served = self._served
        return None if served is None else served.loaded

    def check_target(self, model: str, version: int | None) -> None:
        """Raises :class:`ModelNotFoundError` unless the served version is ``model`` /
        ``version`` (:meth:`ModelRunner.check_target`), :class:`UnavailableError` before the
        first version loads."""
        self.current().check_target(model, version)

    # ---- lifecycle --------------------------------------------------------------------------
    def start(self, poll: bool = True) -> int:
        """Loads and warms the newest version that loads; starts polling (``poll_s > 0``).
        Returns the version; raises :class:`NoLoadableVersionError` when none loads."""
        version = self.watcher.load_newest()
        if version is None:
            tried = ", ".join(map(str, sorted(self.failed, reverse=True))) or "none found"
            raise NoLoadableVersionError(
                f"model {self.name}: no version loads (tried: {tried}); see the log for why"
            )
        if poll:
            self.watcher.start()
        return version

    def stop(self, timeout: float | None = None) -> None:
        """Stops polling (waits up to ``timeout`` s for a load in progress)."""
        self.watcher.stop(timeout)

    def poll_once(self) -> int | None:
        """Loads the newest version above the served one (skipping failed ones) and swaps it in;
        returns the new version, or None when nothing changed."""
        return self.watcher.poll_once()

    # ---- live updates -------------------------------------------------------------------------
    @contextmanager
    def updating(self) -> Iterator[Served]:
        """Yields the served version with version loads held off (and other updates: they
        queue here), so an update is built on, and swapped into, the version it read."""
        with self.watcher.holding():
            served = self._served
            if served is None:
                raise UnavailableError(f"model {self.name} is not loaded yet")
            yield served

    def swap_updated(
        self, loaded: LoadedModel, commit: Callable[[], object] | None = None
    ) -> ModelRunner:
        """Serves ``loaded`` (the served version, updated) from the next batch on: waits for
        running batches, runs ``commit`` (in-place writes; must not fail), swaps the runner.
        Call inside :meth:`updating`. No warm-up: same version, same shapes of work; with
        whole-forward graphs, the updated runner records the buckets the served one had."""
        runner = self.make_runner(loaded)
        served = self._served
        if runner.graphed is not None and served is not None and served.runner.graphed is not None:
            runner.graphed.record_like(served.runner.graphed)
        with self.gate.exclusive():
            if commit is not None:
                commit()
            self._served = Served(runner, loaded)
        return runner

    def _load(self, version: int) -> None:
        """Load + warm up ``version`` beside the served one, then swap; raises when refused."""
        loaded = self.repo.load(self.name, version)
        if self.on_load is not None:
            loaded = self.on_load(loaded)
        runner = self.make_runner(loaded)
        runner.warmup(self.warmup_sizes)
        first = self._served is None
        self._served = Served(runner, loaded)  # the swap: one reference assignment
        if not first:
            self.reloads += 1
        if self.metrics is not None:
            self.metrics.model_loaded(runner.version)
            if not first:
                self.metrics.reload(ok=True)
        log.info("model %s: serving version %d", self.name, runner.version)

    def _refused(self, version: int, error: Exception) -> None:
        self.reload_failures += 1
        if self.metrics is not None:
            self.metrics.reload(ok=False)
        log.error(
            "model %s: version %d refused, keeping %s: %s", self.name, version, self.version, error
        )
