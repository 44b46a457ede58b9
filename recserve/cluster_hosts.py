"""``recserve cluster up --hosts netns``: every process of the local cluster on a host of its own.

Each server (router, each shard replica, each embedding server) runs in a network namespace of
its own (``recserve/hosts/netns.py``), binds that host's address and is reached by it, as in a
deployment. With a network profile other than ``none`` (``--network dc|zone|bad``,
``recserve/hosts/relay.py``), each host also runs a relay in front of its server (its
``Proc.via``): whoever calls the server -- the router calling a shard or an embedding server, a
client calling the router -- goes through the callee's relay, which delays, jitters and stalls
the bytes as the profile says; the profile's bandwidth cap is the host link's (``tc tbf``). The
relays re-read their profile file (``net/<host>.json`` in the cluster folder), so a running
cluster's network changes with :func:`set_network`, and a host's link goes down and up with
:func:`set_link`. ``recserve cluster down`` removes the hosts after their processes. With TLS
the certificate must name the hosts' addresses (``10.213.K.N``), which the router verifies.

    hosts = make_hosts(spec)                   # None for --hosts local
    cmd = on_host(hosts, "shard-0-0", cmd)     # ip netns exec ... recserve serve shard --host IP
"""

from __future__ import annotations

from pathlib import Path

from recserve.cluster_procs import start_proc, wait_ready
from recserve.cluster_state import Cluster, ClusterError, Proc
from recserve.hosts.netns import HostsError, HostSet
from recserve.hosts.relay import Profile, profile_named, write_profile

HOSTS_MODES = ("local", "netns")
NET_DIR = "net"


def host_names(shards: int, replicas: int, embedding_servers: int) -> list[str]:
    """One host per server, named as its process: ``router``, ``embed-I``, ``shard-S-R``."""
    names = ["router", *(f"embed-{i}" for i in range(embedding_servers))]
    return names + [f"shard-{s}-{r}" for s in range(shards) for r in range(replicas)]


def make_hosts(mode: str, network: str, names: list[str]) -> HostSet | None:
    """The hosts of a cluster (None for ``local``); :class:`ClusterError` naming the flag."""
    if mode not in HOSTS_MODES:
        raise ClusterError(f"--hosts: one of {HOSTS_MODES}, got {mode!r}")
    try:
        profile_named(network)
    except ValueError as e:
        raise ClusterError(f"--network: {e}") from None
    if mode == "local":
        if network != "none":
            raise ClusterError(f"--network {network}: needs --hosts netns")
        return None
    try:  # `cluster down` removes them: not at this command's exit
        return HostSet.create(names, cleanup_at_exit=False)
    except HostsError as e:
        raise ClusterError(f"--hosts netns: {e}") from None


def on_host(hosts: HostSet | None, name: str, cmd: list[str]) -> list[str]:
    """``cmd`` run on host ``name`` and bound to its address (unchanged without hosts)."""
    if hosts is None:
        return cmd
    return [*hosts.exec_prefix(name), *cmd, "--host", hosts.ip(name)]


def relay_cmd(hosts: HostSet, server: Proc, profile_file: Path, seed: int) -> list[str]:
    import sys

    return [
        *hosts.exec_prefix(server.name),
        sys.executable,
        "-m",
        "recserve.hosts.relay",
        "--host",
        hosts.ip(server.name),
        "--grpc-port",
        "0",
        "--to",
        server.address,
        "--profile-file",
        str(profile_file),
        "--seed",
        str(seed),
    ]


def start_relays(
    hosts: HostSet, servers: list[Proc], network: str, directory: Path, timeout: float
) -> list[Proc]:
    """One relay per ready server, on its host, with ``network``'s profile; sets each server's
    ``via`` to its relay's address. Caps the hosts' links at the profile's rate."""
    profile = profile_named(network)
    net = directory / NET_DIR
    net.mkdir(parents=True, exist_ok=True)
    relays = []
    for seed, p in enumerate(servers):
        path = net / f"{p.name}.json"
        write_profile(path, profile)
        cmd = relay_cmd(hosts, p, path, seed)
        relays.append(start_proc(f"relay-{p.name}", "relay", cmd, directory / "logs"))
    for p, r in zip(servers, relays, strict=True):
        wait_ready(r, timeout)
        p.via = r.address
    _rate(hosts, [p.name for p in servers], profile)
    return relays


def _rate(hosts: HostSet, names: list[str], profile: Profile) -> None:
    try:
        for n in names:
            hosts.rate(n, profile.rate or None)
    except HostsError as e:
        raise ClusterError(str(e)) from None


def hosts_of(cluster: Cluster) -> HostSet:
    if not cluster.hosts:
        raise ClusterError("this cluster runs on 127.0.0.1 (`cluster up --hosts netns`)")
    return HostSet.from_json(cluster.hosts)


def set_network(directory: Path, profile: Profile, names: list[str] | None = None) -> None:
    """Gives the running cluster's hosts ``names`` (None: all) ``profile``: their relays apply
    it to what they read from now on, their links get its rate."""
    cluster = Cluster.load(directory)
    hosts = hosts_of(cluster)
    servers = [p for p in cluster.processes if p.via and (names is None or p.name in names)]
    if names is not None and len(servers) != len(names):
        raise ClusterError(f"hosts: {names}; with relays: {[p.name for p in servers]}")
    for p in servers:
        write_profile(directory / NET_DIR / f"{p.name}.json", profile)
    _rate(hosts, [p.name for p in servers], profile)


def set_link(directory: Path, name: str, up: bool) -> None:
    """Host ``name``'s link up or down (down: a partition, nothing reaches it nor leaves it)."""
    try:
        hosts_of(Cluster.load(directory)).link(name, up)
    except HostsError as e:
        raise ClusterError(str(e)) from None


def remove_hosts(cluster: Cluster) -> None:
    """Removes the cluster's namespaces and bridge (its processes stopped first)."""
    if cluster.hosts:
        HostSet.from_json(cluster.hosts).remove()
