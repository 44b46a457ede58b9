"""The fault relay's own cost: echo round trips through it against the same round trips direct.

One namespaced host (``recserve/hosts/netns.py``) runs an echo server and relays in front of it
(``python -m recserve.hosts.relay``, as ``recserve cluster up --hosts netns`` runs them); a load
process on this machine drives ``--concurrency`` connections, each sending ``--size`` bytes and
waiting for them back, closed loop, for ``--seconds``. Cases, in turns at each concurrency:

* ``direct``: to the echo server, no relay (the bridge and the loopback stack alone);
* ``relay-none``: through a relay with a zero profile (no delay, no loss): all it adds is its own;
* ``relay-dc``: through a relay with the ``dc`` profile: what it should add is the profile's
  delay each way (``2 * delay_ms`` on average), anything beyond is its own;
* with ``--old REV``, the same two through the relay as it was at git revision ``REV``
  (``relay-none@REV``, ``relay-dc@REV``), run from a copy of that file.

Printed per case: round trips/s, p50 / p99 ms, the relay's CPU ms per round trip (``/proc``), and
p50 beyond direct (for ``dc``, beyond direct plus the profile's mean round trip delay).

    .venv/bin/python bench/relay_cost.py --old 6930a00      # ~2 min on 2 cores

Needs root (network namespaces). Writes ``--out`` (default ``bench/results/relay_cost.json``).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import selectors
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from server_procs import ROOT, Running, start, stop, wait_ready
from timing import int_list, percentiles, pid_cpu_s

from recserve.hosts.netns import HostSet, unavailable
from recserve.hosts.relay import Profile, profile_named, write_profile

HOST = "relaycost"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--concurrency", type=int_list, default=[1, 8])
    p.add_argument("--size", type=int, default=300, help="bytes each way per round trip")
    p.add_argument("--seconds", type=float, default=4.0)
    p.add_argument("--warmup-s", type=float, default=0.5)
    p.add_argument("--old", default="", help="git revision of a relay to compare with")
    p.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "relay_cost.json")
    p.add_argument("--echo", default="", help=argparse.SUPPRESS)  # run as the echo server
    return p.parse_args(argv)


def echo_server(host: str) -> None:
    """An echo server on ``host`` (one selectors loop): the relay's target."""
    from common.ready import announce

    server = socket.create_server((host, 0), backlog=128)
    server.setblocking(False)
    sel = selectors.DefaultSelector()
    sel.register(server, selectors.EVENT_READ)
    announce("echo", grpc=f"{host}:{server.getsockname()[1]}")
    while True:
        for key, _ in sel.select():
            s = key.fileobj
            assert isinstance(s, socket.socket)
            if s is server:
                conn, _ = server.accept()
                conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                sel.register(conn, selectors.EVENT_READ)
                continue
            try:
                data = s.recv(65536)
                if data:
                    s.setblocking(True)  # tiny echoes: a blocking send never waits long
                    s.sendall(data)
                    s.setblocking(False)
                    continue
            except OSError:
                pass
            sel.unregister(s)
            s.close()


def load(address: str, concurrency: int, size: int, warmup_s: float, seconds: float) -> list[float]:
    """Round-trip seconds of ``concurrency`` closed-loop connections to ``address`` (one
    selectors loop), those that ended in the measured ``seconds`` after ``warmup_s``."""
    host, port = address.rsplit(":", 1)
    sel = selectors.DefaultSelector()
    msg = os.urandom(size)
    state: dict[socket.socket, list[Any]] = {}
    for _ in range(concurrency):
        c = socket.create_connection((host, int(port)), timeout=10)
        c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        c.setblocking(False)
        sel.register(c, selectors.EVENT_READ)
        state[c] = [0, time.perf_counter()]
        c.send(msg)
    begin = time.perf_counter()
    measure_from, end = begin + warmup_s, begin + warmup_s + seconds
    out: list[float] = []
    while time.perf_counter() < end:
        for key, _ in sel.select(0.5):
            conn = key.fileobj
            assert isinstance(conn, socket.socket)
            c = conn
            got = c.recv(65536)
            if not got:
                raise ConnectionError(f"{address} closed a connection")
            st = state[c]
            st[0] += len(got)
            if st[0] >= size:
                t = time.perf_counter()
                if st[1] >= measure_from and t < end:
                    out.append(t - st[1])
                st[0], st[1] = 0, t
                c.send(msg)  # 300 bytes into an empty buffer: sent whole
    for c in state:
        sel.unregister(c)
        c.close()
    return out


def old_relay(rev: str, into: Path) -> Path:
    """The relay module as it was at ``rev``, copied to a file of its own (run as a script)."""
    text = subprocess.run(
        ["git", "show", f"{rev}:recserve/hosts/relay.py"],
        cwd=ROOT, capture_output=True, text=True, check=True,
    ).stdout  # fmt: skip
    path = into / f"relay_{rev}.py"
    path.write_text(text)
    return path


def start_relay(
    hosts: HostSet, entry: list[str], target: str, profile: Profile, tmp: Path, tag: str
) -> Running:
    profile_file = tmp / f"{tag}.json"
    write_profile(profile_file, profile)
    cmd = [*hosts.exec_prefix(HOST), sys.executable, *entry, "--host", hosts.ip(HOST)]
    cmd += ["--to", target, "--profile-file", str(profile_file), "--seed", "1"]
    run = start(cmd, tmp / f"{tag}.log")
    wait_ready(run, 60)
    return run


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    if args.echo:
        echo_server(args.echo)
        return {}
    reason = unavailable()
    if reason is not None:
        raise SystemExit(f"bench/relay_cost.py: {reason}")
    tmp = Path(tempfile.mkdtemp(prefix="relay-cost-"))
    dc = profile_named("dc")
    entries = {"": ["-m", "recserve.hosts.relay"]}
    if args.old:
        entries[f"@{args.old}"] = [str(old_relay(args.old, tmp))]
    rows: list[dict[str, Any]] = []
    runs: list[Running] = []
    with HostSet.create([HOST]) as hosts:
        try:
            echo = start(
                [*hosts.exec_prefix(HOST), sys.executable, __file__, "--echo", hosts.ip(HOST)],
                tmp / "echo.log",
            )
            runs.append(echo)
            wait_ready(echo, 60)
            cases: list[tuple[str, str, int | None, float]] = [("direct", echo.address, None, 0.0)]
            for suffix, entry in entries.items():
                for name, profile in (("none", Profile()), ("dc", dc)):
                    relay = start_relay(hosts, entry, echo.address, profile, tmp, name + suffix)
                    runs.append(relay)
                    tag = f"relay-{name}{suffix}"
                    cases.append((tag, relay.address, relay.proc.pid, profile.delay_ms))
            for c in args.concurrency:
                for case, address, pid, delay_ms in cases:
                    cpu0 = pid_cpu_s(pid) if pid else None
                    rtts = load(address, c, args.size, args.warmup_s, args.seconds)
                    cpu1 = pid_cpu_s(pid) if pid else None
                    p50, p99 = percentiles([x * 1e3 for x in rtts])
                    total = len(rtts) / args.seconds * (args.seconds + args.warmup_s)
                    cpu = (cpu1 - cpu0) / total * 1e3 if cpu0 is not None and cpu1 else None
                    rate = len(rtts) / args.seconds
                    rows.append(
                        {"case": case, "concurrency": c, "round_trips_per_s": rate,
                         "p50_ms": p50, "p99_ms": p99, "relay_cpu_ms": cpu,
                         "profile_rtt_ms": 2 * delay_ms}
                    )  # fmt: skip
                    print(
                        f"C={c} {case:18s} {rate:8.0f} rt/s  p50 {p50:6.3f} ms"
                        f"  p99 {p99:6.3f} ms  relay CPU {cpu if cpu is not None else 0:.3f} ms/rt",
                        flush=True,
                    )
        finally:
            for run in reversed(runs):
                stop(run)
    for r in rows:  # beyond the direct round trip and the profile's delay, same concurrency
        direct = next(
            d for d in rows if d["case"] == "direct" and d["concurrency"] == r["concurrency"]
        )
        r["added_p50_ms"] = r["p50_ms"] - direct["p50_ms"] - r["profile_rtt_ms"]
    out = {
        "bench": "relay_cost",
        "meta": {
            "argv": list(argv if argv is not None else sys.argv[1:]),
            "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
            "load_avg": os.getloadavg(),
        },
        "size": args.size,
        "seconds": args.seconds,
        "cpus": os.cpu_count(),
        "dc": dc.to_json(),
        "rows": rows,
    }
    args.out.write_text(json.dumps(out, indent=1) + "\n")
    print(f"{args.out}")
    return out


if __name__ == "__main__":
    main()
