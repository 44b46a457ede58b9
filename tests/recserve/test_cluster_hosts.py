"""``recserve cluster up``'s hosts options, checked before anything starts (no namespace made):
a network profile needs ``--hosts netns``, unknown modes and profiles are refused naming the
flag, and a command runs on its host bound to that host's address."""

from __future__ import annotations

import pytest

from recserve.cluster_hosts import host_names, make_hosts, on_host
from recserve.cluster_state import ClusterError
from recserve.hosts.netns import Host, HostSet


def test_every_server_gets_a_host_named_as_its_process():
    assert host_names(2, 2, 1) == [
        "router", "embed-0", "shard-0-0", "shard-0-1", "shard-1-0", "shard-1-1",
    ]  # fmt: skip


@pytest.mark.parametrize(
    ("mode", "network", "message"),
    [
        ("local", "dc", "--network dc: needs --hosts netns"),
        ("vm", "none", "--hosts: one of ('local', 'netns')"),
        ("netns", "lossy", "--network: network profile: one of"),
    ],
)
def test_bad_hosts_options_are_refused_naming_the_flag(mode, network, message):
    with pytest.raises(ClusterError, match=message.replace("(", r"\(").replace(")", r"\)")):
        make_hosts(mode, network, ["router"])


def test_local_runs_on_127_0_0_1_and_netns_on_the_hosts_address():
    assert make_hosts("local", "none", ["router"]) is None
    assert on_host(None, "router", ["recserve"]) == ["recserve"]
    hosts = HostSet(7, {"router": Host("router", "rsnet7-router", "10.213.7.2", "rsnet7h0")})
    assert on_host(hosts, "router", ["recserve", "serve"]) == [
        "ip", "netns", "exec", "rsnet7-router", "recserve", "serve", "--host", "10.213.7.2",
    ]  # fmt: skip
