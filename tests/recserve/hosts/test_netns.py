"""Namespaced hosts for real: each host has its address and reaches the others and this machine
through the bridge, nothing beyond the subnet; a link down is a partition and up heals it; a
rate cap slows a transfer; removal leaves no namespace, link or state file, and a set whose
creator died is removed by the next one made."""

from __future__ import annotations

import socket
import subprocess
import sys
import textwrap
import time

import pytest

from recserve.hosts.netns import PREFIX, STATE_DIR, HostsError, HostSet
from support.netns_hosts import needs_namespaces

pytestmark = [needs_namespaces, pytest.mark.multiproc, pytest.mark.timeout(120)]

LISTEN = """
import socket, sys
s = socket.create_server((sys.argv[1], 9000))
print("listening", flush=True)
while True:
    c, _ = s.accept()
    while data := c.recv(65536):
        if data.startswith(b"dial "):  # connect onwards from this host; say what happened
            try:
                socket.create_connection((data[5:].decode(), 9), timeout=0.5).close()
                c.sendall(b"reached")
            except OSError as e:
                c.sendall(type(e).__name__.encode())
        else:
            c.sendall(data)
    c.close()
"""


def on_host(hosts: HostSet, name: str) -> subprocess.Popen[str]:
    p = subprocess.Popen(
        [*hosts.exec_prefix(name), sys.executable, "-c", LISTEN, hosts.ip(name)],
        stdout=subprocess.PIPE,
        text=True,
    )
    assert p.stdout is not None and p.stdout.readline().startswith("listening")
    return p


def ask(ip: str, msg: bytes, timeout: float = 5.0) -> bytes:
    with socket.create_connection((ip, 9000), timeout=timeout) as c:
        c.sendall(msg)
        return c.recv(65536)


def ours() -> str:
    """Our namespaces and links as ``ip`` lists them now."""
    ns = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    links = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True).stdout
    return "\n".join(x for x in (ns + links).splitlines() if PREFIX in x)


def test_hosts_reach_each_other_by_address_and_nothing_else():
    with HostSet.create(["a", "b"]) as hosts:
        servers = [on_host(hosts, n) for n in ("a", "b")]
        try:
            assert ask(hosts.ip("a"), b"hello") == b"hello"  # this machine -> a
            assert ask(hosts.ip("a"), f"dial {hosts.ip('b')}".encode()) in (
                b"reached",
                b"ConnectionRefusedError",  # b answers (nothing on port 9): reachable
            )
            # beyond the subnet there is no route: no packet leaves
            assert ask(hosts.ip("a"), b"dial 192.0.2.1") == b"OSError"
        finally:
            for s in servers:
                s.kill()
                s.wait()
    assert ours() == ""
    assert not list(STATE_DIR.glob(f"{PREFIX}*.json"))


def test_a_link_down_is_a_partition_and_up_heals_it():
    with HostSet.create(["a"]) as hosts:
        server = on_host(hosts, "a")
        try:
            held = socket.create_connection((hosts.ip("a"), 9000), timeout=5)
            held.sendall(b"1")
            assert held.recv(10) == b"1"
            hosts.link("a", up=False)
            with pytest.raises(TimeoutError):  # a new connection: no reset, no answer
                socket.create_connection((hosts.ip("a"), 9000), timeout=0.5)
            held.settimeout(0.5)
            held.sendall(b"2")
            with pytest.raises(TimeoutError):
                held.recv(10)
            hosts.link("a", up=True)
            held.settimeout(10)  # the held connection delivers once retransmitted
            assert held.recv(10) == b"2"
            held.close()  # (the listener serves one connection at a time)
            assert ask(hosts.ip("a"), b"y") == b"y"
        finally:
            server.kill()
            server.wait()


def test_a_rate_cap_slows_a_transfer():
    with HostSet.create(["a"]) as hosts:
        server = on_host(hosts, "a")
        try:
            size = 400_000
            hosts.rate("a", "4mbit")  # 400 kB: ~0.8 s each way
            with socket.create_connection((hosts.ip("a"), 9000), timeout=10) as c:
                start = time.monotonic()
                c.sendall(b"z" * size)
                got = 0
                while got < size:
                    got += len(c.recv(65536))
                took = time.monotonic() - start
            assert took > 0.6, took
            hosts.rate("a", None)
        finally:
            server.kill()
            server.wait()


def test_a_set_whose_creator_died_is_removed_by_the_next_one():
    dead = subprocess.run(
        [sys.executable, "-c", textwrap.dedent("""
            from recserve.hosts.netns import HostSet
            print(HostSet.create(["x"], cleanup_at_exit=False).k)
        """)],
        capture_output=True,
        text=True,
        check=True,
    )  # fmt: skip
    k = int(dead.stdout)
    assert f"{PREFIX}{k}-x" in ours()
    with HostSet.create(["y"]) as hosts:
        assert f"{PREFIX}{k}-x" not in ours()
        assert hosts.k == k  # its subnet is free again
    assert ours() == ""


def test_bad_host_names_are_refused_before_anything_is_made():
    with pytest.raises(HostsError, match="lower-case"):
        HostSet.create(["Shard 1"])
    with pytest.raises(HostsError, match="distinct"):
        HostSet.create(["a", "a"])
