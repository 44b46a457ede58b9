"""Namespaced hosts in tests (``recserve/hosts/``): skip with the reason where they cannot be
made, and a cluster on them that is always taken down, its namespaces removed, also when the
test fails::

    pytestmark = [needs_namespaces, pytest.mark.multiproc]

    def test_x(tmp_path):
        with netns_cluster(repo, tmp_path, network="dc", state_dir=...) as d:
            Cluster.load(d).router.reach         # through the router host's relay
"""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from recserve.hosts.netns import HostSet, unavailable

_reason = unavailable()
needs_namespaces = pytest.mark.skipif(
    _reason is not None, reason=f"no namespaced hosts here: {_reason}"
)


def recserve(*args: str, timeout: float = 180) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "recserve", *args], capture_output=True, text=True, timeout=timeout
    )


@contextlib.contextmanager
def netns_cluster(repo: Path, folder: Path, *args: str, network: str = "dc") -> Iterator[Path]:
    """``recserve cluster up --hosts netns --network NETWORK ARGS`` in ``folder/run``; yields
    that folder. Leaving: ``cluster down``, then the hosts removed even if ``down`` failed."""
    d = folder / "run"
    up = recserve(
        "cluster", "up", "--model-repo", str(repo), "--directory", str(d),
        "--hosts", "netns", "--network", network, *args,
    )  # fmt: skip
    assert up.returncode == 0, up.stderr + up.stdout
    hosts = json.loads((d / "cluster.json").read_text())["hosts"]
    try:
        yield d
    finally:
        down = recserve("cluster", "down", "--directory", str(d))
        HostSet.from_json(hosts).remove()  # idempotent: down removed them already
        assert down.returncode == 0, down.stderr + down.stdout
