"""How ``recserve cluster up`` shares the cores between its router and shard servers."""

from __future__ import annotations

from pathlib import Path

import pytest

from recserve.cluster import ClusterSpec, thread_split


@pytest.mark.parametrize(
    ("cores", "shards", "replicas", "want"),
    [
        (2, 1, 1, (1, 1)),
        (2, 2, 1, (1, 1)),
        (8, 1, 1, (4, 4)),
        (8, 3, 1, (2, 2)),
        (16, 2, 2, (3, 3)),
    ],
)
def test_the_router_and_every_shard_server_share_the_cores(cores, shards, replicas, want):
    spec = ClusterSpec(Path("repo"), shards=shards, replicas=replicas)
    assert thread_split(spec, cores) == want


def test_shard_threads_gives_the_shards_their_own_count_and_leaves_the_router_its_share():
    spec = ClusterSpec(Path("repo"), shards=1, shard_threads=2)
    assert thread_split(spec, 2) == (1, 2)
    assert thread_split(ClusterSpec(Path("repo"), shards=4, shard_threads=3), 64) == (12, 3)
