"""Namespaced hosts: N Linux network namespaces, each a "host" with one address on a private
subnet, joined by a bridge (a switch) in this machine's namespace, which holds the subnet's
first address so that this machine reaches every host by its IP::

    with HostSet.create(["router", "shard-0-0"]) as hosts:
        hosts.ip("shard-0-0")                      # "10.213.K.3"
        cmd = hosts.exec_prefix("shard-0-0") + [sys.executable, "-m", "recserve", ...]
        hosts.link("shard-0-0", up=False)          # a partition: its switch port goes down
        hosts.rate("shard-0-0", "10mbit")          # both directions capped by tc tbf

What it touches is only what it made: namespaces and links named with :data:`PREFIX` and the
set's subnet number ``K`` (``rsnetK-<host>`` namespaces, ``rsnetKbr`` the bridge, ``rsnetKhI``
the switch ports; inside each namespace ``lo`` and ``eth0``), subnets ``10.213.K.0/24`` (no
host has a route beyond it, so no traffic leaves them), and a state file per set in
:data:`STATE_DIR`. A set is removed by :meth:`HostSet.remove` (``with``-exit, an ``atexit`` hook
of its creating process, or ``recserve cluster down``); a set whose creator is gone and in
whose namespaces no process runs any more is stale, and the next :meth:`HostSet.create` removes
it (a crashed test run leaves nothing for long). At most :data:`MAX_SETS` sets at once and
:data:`MAX_HOSTS` hosts per set.

Needs root and ``ip`` (iproute2); :func:`unavailable` says why not where it cannot work, for a
test to skip with that reason.
"""

from __future__ import annotations

import atexit
import contextlib
import fcntl
import functools
import json
import os
import re
import shutil
import subprocess
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from types import TracebackType

from common import process

PREFIX = "rsnet"
STATE_DIR = Path("/run/recserve-hosts")
MAX_SETS = 200
MAX_HOSTS = 250
"""Addresses .2 to .251 of the /24 (.1 is the bridge)."""
IP_TIMEOUT_S = 10.0
_NAME = re.compile(r"^[a-z0-9][a-z0-9-]{0,40}$")


class HostsError(RuntimeError):
    """A namespace, link or qdisc could not be made or changed (the ``ip``/``tc`` error)."""


def _run(argv: list[str], check: bool = True) -> subprocess.CompletedProcess[str]:
    out = subprocess.run(argv, capture_output=True, text=True, timeout=IP_TIMEOUT_S, check=False)
    if check and out.returncode != 0:
        raise HostsError(f"{' '.join(argv)}: {out.stderr.strip() or out.returncode}")
    return out


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return _run(["ip", *args], check)


@functools.cache
def unavailable() -> str | None:
    """Why namespaced hosts cannot be made here (None: they can): not root, no ``ip``, or the
    kernel refuses a namespace (a container without CAP_SYS_ADMIN)."""
    if os.geteuid() != 0:
        return "network namespaces need root (ip netns add)"
    if shutil.which("ip") is None or shutil.which("tc") is None:
        return "network namespaces need iproute2 (ip, tc)"
    probe = f"{PREFIX}probe-{os.getpid()}"
    try:
        made = _ip("netns", "add", probe, check=False)
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"ip netns add failed: {e}"
    if made.returncode != 0:
        return f"ip netns add failed: {made.stderr.strip()}"
    _ip("netns", "del", probe, check=False)
    return None


@dataclass
class Host:
    name: str
    """The role's name (``router``, ``shard-0-0``, ``embed-0``)."""
    netns: str
    ip: str
    port: str
    """The bridge side of its veth pair (its switch port)."""


@dataclass
class HostSet:
    """One set of hosts on subnet ``10.213.k.0/24`` (see the module docstring)."""

    k: int
    hosts: dict[str, Host] = field(default_factory=dict)
    owner_pid: int = 0
    owner_start: int | None = None

    # ---- names ------------------------------------------------------------------------------
    @property
    def bridge(self) -> str:
        return f"{PREFIX}{self.k}br"

    @property
    def gateway(self) -> str:
        """This machine's address on the subnet (the bridge's)."""
        return f"10.213.{self.k}.1"

    def ip(self, name: str) -> str:
        return self._host(name).ip

    def exec_prefix(self, name: str) -> list[str]:
        """The argv prefix that runs a command on host ``name`` (it execs: same pid)."""
        return ["ip", "netns", "exec", self._host(name).netns]

    def _host(self, name: str) -> Host:
        try:
            return self.hosts[name]
        except KeyError:
            raise HostsError(f"no host {name!r} (have: {sorted(self.hosts)})") from None

    # ---- making -----------------------------------------------------------------------------
    @classmethod
    def create(cls, names: Sequence[str], cleanup_at_exit: bool = True) -> HostSet:
        """Makes one host per name (lower-case letters, digits, '-'); removes stale sets first.
        On any failure, removes what it made and raises :class:`HostsError`."""
        if not 1 <= len(names) <= MAX_HOSTS or len(set(names)) != len(names):
            raise HostsError(f"hosts: 1 to {MAX_HOSTS} distinct names, got {list(names)}")
        bad = [n for n in names if not _NAME.match(n)]
        if bad:
            raise HostsError(f"host names: lower-case letters, digits and '-', got {bad}")
        reason = unavailable()
        if reason is not None:
            raise HostsError(reason)
        with _locked():
            remove_stale()
            used = {s.k for s in _sets()}
            free = [k for k in range(MAX_SETS) if k not in used]
            if not free:
                raise HostsError(f"{MAX_SETS} host sets exist already ({STATE_DIR})")
            me = os.getpid()
            hs = cls(free[0], owner_pid=me, owner_start=process.start_time(me))
            for i, n in enumerate(names):
                ip, port = f"10.213.{hs.k}.{i + 2}", f"{PREFIX}{hs.k}h{i}"
                hs.hosts[n] = Host(n, f"{PREFIX}{hs.k}-{n}", ip, port)
            hs._save()  # first: a crash half-way leaves a state file that remove() reads
            try:
                hs._make()
            except BaseException:
                hs.remove()
                raise
        if cleanup_at_exit:
            atexit.register(hs.remove)
        return hs

    def _make(self) -> None:
        _ip("link", "add", self.bridge, "type", "bridge")
        _ip("addr", "add", f"{self.gateway}/24", "dev", self.bridge)
        _ip("link", "set", self.bridge, "up")
        for h in self.hosts.values():
            _ip("netns", "add", h.netns)
            _ip("link", "add", h.port, "type", "veth", "peer", "name", "eth0", "netns", h.netns)
            _ip("link", "set", h.port, "master", self.bridge, "up")
            _ip("-n", h.netns, "addr", "add", f"{h.ip}/24", "dev", "eth0")
            _ip("-n", h.netns, "link", "set", "lo", "up")
            _ip("-n", h.netns, "link", "set", "eth0", "up")

    # ---- faults -----------------------------------------------------------------------------
    def link(self, name: str, up: bool) -> None:
        """Host ``name``'s switch port down (a partition: its packets are dropped both ways,
        its connections stall and new ones time out, nothing is reset) or up again."""
        _ip("link", "set", self._host(name).port, "up" if up else "down")

    def rate(self, name: str, rate: str | None) -> None:
        """Caps host ``name``'s traffic both ways to ``rate`` (a tc rate, ``"10mbit"``) with a
        token bucket (``tc tbf``: its egress, and the switch port's towards it); None: no cap."""
        h = self._host(name)
        for where, dev in ((self.exec_prefix(name), "eth0"), ([], h.port)):
            _run([*where, "tc", "qdisc", "del", "dev", dev, "root"], check=False)
            if rate is not None:  # a 32 kB bucket: bursts of a few dozen segments, then the rate
                tbf = ["tbf", "rate", rate, "burst", "32kb", "latency", "50ms"]
                _run([*where, "tc", "qdisc", "add", "dev", dev, "root", *tbf])

    # ---- removing ---------------------------------------------------------------------------
    def remove(self) -> None:
        """Deletes the namespaces (their veths go with them), the bridge and the state file.
        Idempotent; processes still running in a namespace keep it alive unnamed (stop them
        first)."""
        for h in self.hosts.values():
            _ip("netns", "del", h.netns, check=False)
            _ip("link", "del", h.port, check=False)
        _ip("link", "del", self.bridge, check=False)
        self._state_path().unlink(missing_ok=True)

    def pids(self) -> list[int]:
        """Processes running in any of the set's namespaces."""
        out: list[int] = []
        for h in self.hosts.values():
            listed = _ip("netns", "pids", h.netns, check=False)
            out += [int(p) for p in listed.stdout.split() if p.isdigit()]
        return out

    def stale(self) -> bool:
        """Its creator is gone and nothing runs in its namespaces."""
        owner = process.start_time(self.owner_pid)
        alive = owner is not None and (self.owner_start is None or owner == self.owner_start)
        return not alive and not self.pids()

    # ---- state ------------------------------------------------------------------------------
    def _state_path(self) -> Path:
        return STATE_DIR / f"{PREFIX}{self.k}.json"

    def _save(self) -> None:
        STATE_DIR.mkdir(parents=True, exist_ok=True)
        self._state_path().write_text(json.dumps(self.to_json()))

    def to_json(self) -> dict:
        return asdict(self)

    @classmethod
    def from_json(cls, d: dict) -> HostSet:
        hosts = {n: Host(**h) for n, h in d["hosts"].items()}
        return cls(int(d["k"]), hosts, int(d.get("owner_pid", 0)), d.get("owner_start"))

    def __enter__(self) -> HostSet:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.remove()


def _sets() -> list[HostSet]:
    out = []
    for path in sorted(STATE_DIR.glob(f"{PREFIX}*.json")):
        with contextlib.suppress(OSError, ValueError, KeyError, TypeError):
            out.append(HostSet.from_json(json.loads(path.read_text())))
    return out


def remove_stale() -> list[int]:
    """Removes the stale sets (see :meth:`HostSet.stale`) and any namespace or link of ours
    that no set's state file names (left by a crash before the file was written); the removed
    sets' subnet numbers."""
    sets = _sets()
    gone = [s for s in sets if s.stale()]
    for s in gone:
        s.remove()
    known = {h.netns for s in sets if s not in gone for h in s.hosts.values()}
    listed = _ip("netns", "list", check=False).stdout.split("\n")
    for line in listed:
        netns = line.split(" ", 1)[0]
        if re.match(rf"^{PREFIX}\d+-", netns) and netns not in known:
            probe = _ip("netns", "pids", netns, check=False).stdout.split()
            if not probe:
                _ip("netns", "del", netns, check=False)
    bridges = {s.bridge for s in sets if s not in gone}
    links = _ip("-o", "link", "show", "type", "bridge", check=False).stdout
    for name in re.findall(rf"^\d+: ({PREFIX}\d+br)[:@]", links, re.M):
        if name not in bridges:
            _ip("link", "del", name, check=False)
    return [s.k for s in gone]


@contextlib.contextmanager
def _locked() -> Iterator[None]:
    """One creator at a time picks a subnet (an flock the OS releases if the holder dies)."""
    STATE_DIR.mkdir(parents=True, exist_ok=True)
    fd = os.open(STATE_DIR / "lock", os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)
