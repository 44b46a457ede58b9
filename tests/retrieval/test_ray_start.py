"""The Ray engine's local start: every kind of start timeout is tried again, then fails naming
its setting; other failures are raised at once; the bounded waits reach Ray's processes and the
caller's environment is given back; a real start that times out leaves no process behind."""

from __future__ import annotations

import os

import pytest

from common.config import ConfigError
from retrieval import ray_start
from retrieval.ray_start import (
    DEFAULT_RAY_START_TIMEOUT_S,
    RAY_START_ATTEMPTS,
    RAY_START_TIMEOUT_ENV,
    RayStartTimeout,
    is_ray_start_timeout,
    start_local_ray,
)


class _FlakyRay:
    """``ray.init`` that raises ``error`` on its first ``failures`` calls, and records the Ray
    start settings each call saw in the environment."""

    __file__ = "/nowhere/ray/__init__.py"  # where Ray's processes would run from: none do

    def __init__(self, failures: int, error: Exception):
        self.failures, self.error = failures, error
        self.inits = self.shutdowns = 0
        self.seen: list[dict[str, str | None]] = []

    def init(self, **_: object) -> None:
        self.inits += 1
        self.seen.append({name: os.environ.get(name) for name in _RAY_START_VARS})
        if self.inits <= self.failures:
            raise self.error

    def shutdown(self) -> None:
        self.shutdowns += 1


_RAY_START_VARS = (
    "RAY_gcs_server_port_wait_time_s",
    "RAY_agent_register_timeout_ms",
    "RAY_worker_register_timeout_seconds",
)

# what the installed Ray raises when each part of a local start runs out of time
_RAY_START_TIMEOUTS = [
    Exception(  # node.py: the raylet did not register in its fixed 30 s
        "The current node timed out during startup. This could happen because some of the "
        "raylet failed to startup or the GCS has become overloaded."
    ),
    RuntimeError(  # _raylet.wait_for_persisted_port: the GCS did not write its port file
        "Timed out waiting for file /tmp/ray/session_2026-12-01_22-14-13_849431_14205/"
        "gcs_server_port_aca6807ea410a159b224604b5c7f93e05bac8188e770153dd3cb6995"
    ),
    RuntimeError("Failed to start GCS.  Last 0 lines of error files:\n\n.Please check ..."),
    RuntimeError(
        "No node info found matching attributes: '127.0.0.1' when trying to resolve node to "
        "connect to."
    ),
    TimeoutError("Timed out after 60 seconds while waiting for node to startup."),
]


@pytest.fixture
def no_ray_start_settings(monkeypatch):
    """No Ray start setting of the user's in the environment."""
    for name in (RAY_START_TIMEOUT_ENV, *_RAY_START_VARS):
        monkeypatch.delenv(name, raising=False)


@pytest.mark.parametrize("error", _RAY_START_TIMEOUTS, ids=lambda e: str(e)[:24])
def test_every_kind_of_ray_start_timeout_starts_the_node_again(error, no_ray_start_settings):
    ray = _FlakyRay(RAY_START_ATTEMPTS - 1, error)
    start_local_ray(ray, workers=2)
    assert (ray.inits, ray.shutdowns) == (RAY_START_ATTEMPTS, RAY_START_ATTEMPTS - 1)


@pytest.mark.parametrize("error", _RAY_START_TIMEOUTS, ids=lambda e: str(e)[:24])
def test_a_ray_start_that_keeps_timing_out_fails_naming_its_setting(error, no_ray_start_settings):
    ray = _FlakyRay(RAY_START_ATTEMPTS, error)
    with pytest.raises(RayStartTimeout) as failed:
        start_local_ray(ray, workers=2)
    assert ray.inits == RAY_START_ATTEMPTS
    assert failed.value.__cause__ is error
    message = str(failed.value)
    assert f"raise {RAY_START_TIMEOUT_ENV} (now {DEFAULT_RAY_START_TIMEOUT_S} s" in message
    assert f"RAY_gcs_server_port_wait_time_s={DEFAULT_RAY_START_TIMEOUT_S}" in message


@pytest.mark.parametrize(
    "error",
    [
        ValueError("When connecting to an existing cluster, num_cpus must not be provided."),
        RuntimeError("Version mismatch: the cluster was started with Ray 2.59.0"),
        Exception("some other failure"),
    ],
)
def test_another_ray_start_failure_is_raised_at_once(error, no_ray_start_settings):
    ray = _FlakyRay(1, error)
    with pytest.raises(type(error)) as failed:
        start_local_ray(ray, workers=2)
    assert failed.value is error
    assert (ray.inits, ray.shutdowns) == (1, 1)
    assert not is_ray_start_timeout(error)


def test_ray_starts_with_the_timeout_in_its_settings_and_keeps_the_users_own(
    monkeypatch, no_ray_start_settings
):
    monkeypatch.setenv(RAY_START_TIMEOUT_ENV, "240")
    monkeypatch.setenv("RAY_agent_register_timeout_ms", "5000")  # the user's own Ray setting
    ray = _FlakyRay(1, _RAY_START_TIMEOUTS[1])
    start_local_ray(ray, workers=1)
    expected = {
        "RAY_gcs_server_port_wait_time_s": "240",
        "RAY_agent_register_timeout_ms": "5000",
        "RAY_worker_register_timeout_seconds": "240",
    }
    assert ray.seen == [expected, expected]  # every attempt
    assert {name: os.environ.get(name) for name in _RAY_START_VARS} == {
        "RAY_gcs_server_port_wait_time_s": None,  # the caller's environment is given back
        "RAY_agent_register_timeout_ms": "5000",
        "RAY_worker_register_timeout_seconds": None,
    }


@pytest.mark.parametrize("raw", ["0", "-3", "1.5", "soon", "", "86401"])
def test_a_bad_ray_start_timeout_is_refused_naming_it(raw, monkeypatch):
    monkeypatch.setenv(RAY_START_TIMEOUT_ENV, raw)
    ray = _FlakyRay(0, RuntimeError("unused"))
    with pytest.raises(ConfigError, match=rf"^{RAY_START_TIMEOUT_ENV}: must be whole seconds"):
        start_local_ray(ray, workers=1)
    assert ray.inits == 0


@pytest.mark.multiproc  # starts Ray's GCS, which is given no time to come up
def test_a_real_ray_start_that_times_out_leaves_no_process_behind(monkeypatch):
    ray = pytest.importorskip("ray")
    psutil = pytest.importorskip("psutil")
    monkeypatch.setenv("RAY_gcs_server_port_wait_time_s", "0")  # the user's, so it is kept
    monkeypatch.setattr(ray_start, "RAY_START_ATTEMPTS", 2)
    me = psutil.Process()
    before = {p.pid for p in me.children(recursive=True)}
    try:
        with pytest.raises(RayStartTimeout, match=r"Timed out waiting for file .*gcs_server_port"):
            start_local_ray(ray, workers=1)
    finally:
        ray.shutdown()
    left = [p for p in me.children(recursive=True) if p.pid not in before]
    assert [p.cmdline() for p in left if p.is_running() and p.status() != "zombie"] == []
