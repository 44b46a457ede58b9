"""Starting a local Ray node for the Ray engine of offline scoring
(``retrieval/batch_scoring.py``), bounded and tried again.

A local start waits for each of its processes (the GCS, the raylet and its agents, the workers)
up to ``$RECSERVE_RAY_START_TIMEOUT_S`` (Ray's own waits are missed on a small busy machine);
a start that still times out ends what it left running (``psutil``: Ray's ``shutdown`` knows
only a node that started) and is tried again, :data:`RAY_START_ATTEMPTS` times in all, then
fails with :class:`RayStartTimeout` naming the setting. Any other failure is raised at once.
Example::

    import ray

    start_local_ray(ray, workers=2)  # ray.init(num_cpus=3, ...) with the bounded waits
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from common.config import MAX_WAIT_S, ConfigError

if TYPE_CHECKING:
    import psutil

log = logging.getLogger(__name__)

__all__ = [
    "DEFAULT_RAY_START_TIMEOUT_S",
    "RAY_START_ATTEMPTS",
    "RAY_START_TIMEOUT_ENV",
    "RayStartTimeout",
    "is_ray_start_timeout",
    "ray_start_settings",
    "ray_start_timeout_s",
    "start_local_ray",
]

RAY_START_ATTEMPTS = 3
"""Local Ray node starts tried before a start-time timeout fails the run. Ray's driver waits a
fixed 30 s for the raylet to register (``ray/_private/node.py``, no setting): on a busy small
machine one start can miss it while the next succeeds."""

RAY_START_TIMEOUT_ENV = "RECSERVE_RAY_START_TIMEOUT_S"
"""Whole seconds each local Ray start may wait for each of its processes (see
:func:`ray_start_settings`); default :data:`DEFAULT_RAY_START_TIMEOUT_S`."""
DEFAULT_RAY_START_TIMEOUT_S = 180
"""Ray's own defaults (30 s for the GCS port and the raylet's agents, 60 s for a worker) are
missed on a 2-core machine under load; a few minutes are not, and a start that does not
finish is still reported."""

_START_TIMEOUT = re.compile(
    r"timed out|deadline exceeded|failed to start gcs|no node info found", re.I
)
"""How Ray words a local start that ran out of time (it raises bare ``Exception`` /
``RuntimeError``): the raylet not registering ("The current node timed out during startup"),
a process's port file not written ("Timed out waiting for file .../gcs_server_port_..."), the
GCS not answering in its connect window ("Failed to start GCS", also said of a GCS that exited
while starting: a bounded new start is cheap beside a failed run), the driver not finding its
node ("No node info found matching ...") and a GCS request's deadline."""


class RayStartTimeout(TimeoutError):
    """A local Ray node did not start in :data:`RAY_START_ATTEMPTS` tries; the message names
    the timeouts it had and the setting that lengthens them."""


def ray_start_timeout_s() -> int:
    """``$RECSERVE_RAY_START_TIMEOUT_S`` (default 180); ConfigError naming it when bad."""
    raw = os.environ.get(RAY_START_TIMEOUT_ENV)
    if raw is None:
        return DEFAULT_RAY_START_TIMEOUT_S
    try:
        value = int(raw)  # Ray reads its waits as whole seconds or milliseconds
    except ValueError:
        value = 0
    if not 1 <= value <= MAX_WAIT_S:
        raise ConfigError(
            f"{RAY_START_TIMEOUT_ENV}: must be whole seconds, 1 to {MAX_WAIT_S:g}, got {raw!r}"
        )
    return value


def ray_start_settings(timeout_s: int) -> dict[str, str]:
    """Ray's environment variables that bound a local start, set to ``timeout_s``: the
    driver's wait for the GCS port file and its connect retries (read by ``node.py`` at each
    start), the raylet's wait for its agents' ports and a worker's (or the driver's)
    registration with the raylet (read by the processes the start spawns). One the user set
    already is kept."""
    wanted = {
        "RAY_gcs_server_port_wait_time_s": str(timeout_s),
        "RAY_agent_register_timeout_ms": str(timeout_s * 1000),
        "RAY_worker_register_timeout_seconds": str(timeout_s),
    }
    return {name: os.environ.get(name, value) for name, value in wanted.items()}


def is_ray_start_timeout(error: BaseException) -> bool:
    """Whether ``ray.init`` failed because a local start ran out of time (worth another start)
    rather than for a cause a new start keeps (a bad argument, a version mismatch)."""
    return isinstance(error, TimeoutError) or bool(_START_TIMEOUT.search(str(error)))


@contextlib.contextmanager
def _environment(settings: dict[str, str]) -> Iterator[None]:
    """``settings`` in ``os.environ`` while Ray starts (its processes inherit them), the
    caller's values back afterwards."""
    saved = {name: os.environ.get(name) for name in settings}
    os.environ.update(settings)
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def _ray_processes(package_dir: str) -> set[psutil.Process]:
    """This process's descendants that run Ray's code (the GCS, raylet, agents) or are its
    workers (which retitle themselves ``ray::...``)."""
    import psutil

    found = set()
    for child in psutil.Process().children(recursive=True):
        with contextlib.suppress(psutil.Error):  # gone, or not ours to read
            if any(package_dir in part or part.startswith("ray::") for part in child.cmdline()):
                found.add(child)
    return found


def _stop_processes(processes: set[psutil.Process]) -> None:
    """Ends what a failed start left running: Ray's ``shutdown`` knows only a node that
    started, so a GCS whose port wait timed out would keep its CPU and ports."""
    import psutil

    for p in processes:
        with contextlib.suppress(psutil.Error):
            p.terminate()
    _, alive = psutil.wait_procs(list(processes), timeout=10)
    for p in alive:
        with contextlib.suppress(psutil.Error):
            p.kill()
    psutil.wait_procs(alive, timeout=10)


def start_local_ray(ray: Any, workers: int) -> None:
    """A local Ray node for ``workers`` scoring actors (one CPU each, one more for reading and
    writing), its start timeouts at :func:`ray_start_timeout_s`, started again (after ending
    what the failed start left) when it still times out."""
    timeout_s = ray_start_timeout_s()
    settings = ray_start_settings(timeout_s)
    package_dir = os.path.dirname(ray.__file__)
    for attempt in range(1, RAY_START_ATTEMPTS + 1):
        before = _ray_processes(package_dir)
        try:
            with _environment(settings):
                ray.init(num_cpus=workers + 1, include_dashboard=False, log_to_driver=False)
            return
        except Exception as e:  # Ray raises a bare Exception for a node that did not start
            ray.shutdown()
            _stop_processes(_ray_processes(package_dir) - before)
            if not is_ray_start_timeout(e):
                raise
            if attempt == RAY_START_ATTEMPTS:
                raise RayStartTimeout(
                    f"Ray's local node did not start in {RAY_START_ATTEMPTS} attempts: {e}. "
                    f"On a busy machine raise {RAY_START_TIMEOUT_ENV} (now {timeout_s} s; Ray "
                    f"ran with {', '.join(f'{k}={v}' for k, v in settings.items())})"
                ) from e
            log.warning("Ray's local node did not start in time (%s); starting it again", e)
