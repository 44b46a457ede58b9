"""VersionWatcher: the newest version of a model, loaded as it appears; a refused one never again.

The one poll / load / refused-set loop of the model host (``serving/engine/host.py``) and the
document shard server (``serving/sharding/shard_server.py``); each says how it loads a version::

    watcher = VersionWatcher(lambda: repo.versions("demo"), load, refused, poll_s=1.0)
    watcher.load_newest()   # at start: the newest version that loads (None: none does)
    watcher.start()         # a thread: poll_once() every poll_s seconds
    ...
    watcher.stop()

``load(version)`` loads, checks and swaps in one version, and raises when it refuses it (corrupt,
no such shard, a failed warm-up): the watcher then adds it to :attr:`VersionWatcher.failed`,
never tries it again, and tells ``refused(version, error)`` (the owner logs and counts it), while
what serves keeps serving. Loads run one at a time; :meth:`VersionWatcher.holding` keeps them off
meanwhile (a live update builds on the version it read).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager

from common.torch_threads import use_process_threads

log = logging.getLogger(__name__)


class VersionWatcher:
    """Loads the newest version above the newest loaded one, skipping refused versions."""

    def __init__(
        self,
        versions: Callable[[], Iterable[int]],
        load: Callable[[int], object],
        refused: Callable[[int, Exception], object],
        *,
        poll_s: float = 1.0,
        thread_name: str = "version-poll",
        what: str = "model",
    ):
        """``versions()``: the version numbers the repository holds now. ``what`` names the
        watcher in the log (``"model demo"``, ``"shard 0"``)."""
        self.versions, self.load, self.refused = versions, load, refused
        self.poll_s, self.thread_name, self.what = poll_s, thread_name, what
        self.failed: set[int] = set()
        """Versions ``load`` refused; never tried again."""
        self.newest: int | None = None
        """The newest version loaded (None: none yet)."""
        self._lock = threading.Lock()  # one load at a time (poll thread vs poll_once, holding)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @contextmanager
    def holding(self) -> Iterator[None]:
        """No version loads while inside (and a load in progress finishes first)."""
        with self._lock:
            yield

    def load_newest(self) -> int | None:
        """Tries every version, newest first, until one loads; -> it, or None when every one
        was refused (they are all in :attr:`failed`)."""
        with self._lock:
            return self._load_first(sorted(self.versions(), reverse=True))

    def poll_once(self) -> int | None:
        """Loads the newest version above :attr:`newest` that loads (refused ones skipped);
        -> it, or None when nothing changed."""
        with self._lock:
            above = self.newest or 0
            newer = (v for v in self.versions() if v > above and v not in self.failed)
            return self._load_first(sorted(newer, reverse=True))

    def start(self) -> None:
        """Polls every ``poll_s`` seconds on a daemon thread (never with ``poll_s <= 0``)."""
        if self.poll_s > 0 and self._thread is None:
            self._thread = threading.Thread(target=self._loop, name=self.thread_name, daemon=True)
            self._thread.start()

    def stop(self, timeout: float | None = None) -> None:
        """Stops polling (waits up to ``timeout`` s for a load in progress)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)

    def _load_first(self, candidates: list[int]) -> int | None:
        for version in candidates:
            try:
                self.load(version)
            except Exception as e:  # whatever refused it, the version serving keeps serving
                self.failed.add(version)
                self.refused(version, e)
                continue
            self.newest = version if self.newest is None else max(self.newest, version)
            return version
        return None

    def _loop(self) -> None:
        use_process_threads()  # loading a version computes (index checks, warm-up)
        while not self._stop.wait(self.poll_s):
            try:
                self.poll_once()
            except Exception:  # a broken repository read must not kill the poll thread
                if not self._stop.is_set():  # on stop: a read cut short by closing channels
                    log.exception("%s: polling the repository failed", self.what)
