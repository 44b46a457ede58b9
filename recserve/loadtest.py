"""``recserve loadtest``: drive a serving target with locust, headless, and judge the result.

Flow (one free function per step; :func:`run` strings them together)::

    read_model_shape(repo, model)  # the published version's config.json: what requests look like
    check_target(target, protocol) # gRPC grpc.health.v1 / GET /v2/health/ready, or TargetDownError
    run_locust(spec)               # python -m locust -f loadtest/locustfile.py --headless ... --csv
    summarize(out)                 # locust's CSVs -> Summary (requests, RPS, p50/p95/p99, failures)
    plot_history(out)              # latency.png: p50/p95/p99 and RPS over time
    problems(summary, thresholds)  # what missed --max-p99-ms / --max-failure-ratio

Only the standard library is imported at the top: ``loadtest/locustfile.py`` imports
:func:`read_model_shape` from here inside every locust process (grpc and matplotlib are imported
where they are used).
"""

from __future__ import annotations

import csv
import json
import math
import os
import subprocess
import sys
import urllib.error
import urllib.request
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import loadtest

LOCUSTFILE = Path(loadtest.__file__).parent / "locustfile.py"
PACKAGE_ROOT = Path(loadtest.__file__).parents[1]
"""Where ``loadtest`` and its siblings are importable from: locust runs in its own process."""
USER_CLASSES = {"grpc": "RecommendGrpcUser", "http": "KServeHttpUser"}
"""The locustfile's user class for each protocol."""
CSV_PREFIX = "locust"
"""locust writes ``OUT/locust_stats.csv``, ``_stats_history.csv``, ``_failures.csv``, ..."""
AGGREGATED = "Aggregated"


class TargetDownError(RuntimeError):
    """The target did not answer its health check."""


class LoadTestError(RuntimeError):
    """locust itself failed (bad arguments, a crash, no CSVs)."""


# ---- the target --------------------------------------------------------------------------------
def check_target(target: str, protocol: str, timeout_s: float = 5.0) -> None:
    """Raises :class:`TargetDownError` unless ``target`` (``HOST:PORT``) answers its health check:
    ``grpc.health.v1`` SERVING for grpc, 200 from ``GET /v2/health/ready`` for http."""
    if protocol == "grpc":
        _check_grpc(target, timeout_s)
    elif protocol == "http":
        _check_http(target, timeout_s)
    else:
        raise ValueError(f"--protocol: grpc or http, got {protocol!r}")


def _check_grpc(target: str, timeout_s: float) -> None:
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    with grpc.insecure_channel(target) as channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=""), timeout=timeout_s
            )
        except grpc.RpcError as e:
            raise TargetDownError(
                f"target {target} is down: gRPC health check failed "
                f"({e.code().name}: {e.details()})"
            ) from None
    if reply.status != health_pb2.HealthCheckResponse.SERVING:
        status = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
        raise TargetDownError(f"target {target} is not ready: gRPC health says {status}")


def http_url(target: str) -> str:
    """``HOST:PORT`` (or a URL) -> the base URL locust's HTTP user takes as ``--host``."""
    return target if target.startswith(("http://", "https://")) else f"http://{target}"


def _check_http(target: str, timeout_s: float) -> None:
    url = http_url(target) + "/v2/health/ready"
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as reply:
            status = reply.status
    except urllib.error.HTTPError as e:
        status = e.code
    except (urllib.error.URLError, OSError) as e:
        reason = getattr(e, "reason", e)
        raise TargetDownError(f"target {target} is down: GET {url} failed ({reason})") from None
    if status != 200:
        raise TargetDownError(f"target {target} is not ready: GET {url} answered {status}")


# ---- locust ------------------------------------------------------------------------------------
@dataclass(frozen=True)
class LoadTestSpec:
    """One headless locust run."""

    target: str
    """``HOST:PORT`` of the gRPC or HTTP listener."""
    protocol: str
    """``grpc`` (Recommend) or ``http`` (KServe v2 infer)."""
    model_repo: Path
    model: str
    """Model name (resolved: the locustfile gets it explicitly)."""
    users: int
    spawn_rate: float
    """Users started per second."""
    duration_s: float
    out: Path
    """Where locust's CSVs, ``locust.log``, ``summary.json`` and ``latency.png`` go."""


def locust_command(spec: LoadTestSpec) -> list[str]:
    """The ``python -m locust`` command line of ``spec`` (headless, CSV with full history);
    paths absolute, since locust runs in ``spec.out``."""
    host = spec.target if spec.protocol == "grpc" else http_url(spec.target)
    return [
        sys.executable, "-m", "locust", "-f", str(LOCUSTFILE), "--headless",
        "-u", str(spec.users), "-r", str(spec.spawn_rate), "-t", f"{math.ceil(spec.duration_s)}s",
        "--host", host, "--csv", str(spec.out.resolve() / CSV_PREFIX), "--csv-full-history",
        "--only-summary", "--exit-code-on-error", "0", "--loglevel", "WARNING",
        "--model-repo", str(spec.model_repo.resolve()), "--model", spec.model,
        USER_CLASSES[spec.protocol],
    ]  # fmt: skip


def run_locust(spec: LoadTestSpec) -> Path:
    """Runs locust (output in ``OUT/locust.log``); :class:`LoadTestError` when it fails."""
    spec.out.mkdir(parents=True, exist_ok=True)
    log = spec.out / "locust.log"
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(PACKAGE_ROOT), env.get("PYTHONPATH")]))
    with open(log, "w") as f:
        try:
            code = subprocess.run(
                locust_command(spec), stdout=f, stderr=subprocess.STDOUT, env=env, cwd=spec.out,
                timeout=spec.duration_s + 120, check=False,
            ).returncode  # fmt: skip
        except subprocess.TimeoutExpired:
            code = -1
    stats = spec.out / f"{CSV_PREFIX}_stats.csv"
    if code != 0 or not stats.is_file():
        tail = "\n".join(log.read_text(errors="replace").splitlines()[-15:])
        raise LoadTestError(f"locust failed (exit {code}); last lines of {log}:\n{tail}")
    return stats


# ---- results -----------------------------------------------------------------------------------
@dataclass
class Summary:
    """The whole run (locust's ``Aggregated`` row) and each request name's row."""

    requests: int
    failures: int
    rps: float
    p50_ms: float | None
    p95_ms: float | None
    p99_ms: float | None
    exceptions: int = 0
    """Exceptions raised inside locust users (a broken workload, not a failed request)."""
    by_name: list[dict[str, Any]] = field(default_factory=list)
    errors: list[dict[str, Any]] = field(default_factory=list)
    """Failed requests by (name, error), most frequent first."""

    @property
    def failure_ratio(self) -> float:
        return self.failures / self.requests if self.requests else 0.0


def _num(text: str) -> float | None:
    try:
        value = float(text)
    except ValueError:
        return None  # locust writes "N/A" where nothing was measured
    return value if math.isfinite(value) else None


def _row_summary(row: dict[str, str]) -> dict[str, Any]:
    return {
        "name": row["Name"],
        "requests": int(row["Request Count"]),
        "failures": int(row["Failure Count"]),
        "rps": _num(row["Requests/s"]) or 0.0,
        "p50_ms": _num(row["50%"]),
        "p95_ms": _num(row["95%"]),
        "p99_ms": _num(row["99%"]),
    }


def _read_csv(path: Path) -> list[dict[str, str]]:
    if not path.is_file():
        return []
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def summarize(out: Path) -> Summary:
    """Reads ``OUT/locust_stats.csv`` (and the failures / exceptions CSVs)."""
    rows = _read_csv(out / f"{CSV_PREFIX}_stats.csv")
    total = next((r for r in rows if r["Name"] == AGGREGATED), None)
    if total is None:
        raise LoadTestError(f"{out / CSV_PREFIX}_stats.csv: no {AGGREGATED} row")
    agg = _row_summary(total)
    del agg["name"]
    errors = [
        {"name": r["Name"], "error": r["Error"], "occurrences": int(r["Occurrences"])}
        for r in _read_csv(out / f"{CSV_PREFIX}_failures.csv")
    ]
    return Summary(
        **agg,
        exceptions=sum(int(r["Count"]) for r in _read_csv(out / f"{CSV_PREFIX}_exceptions.csv")),
        by_name=[_row_summary(r) for r in rows if r["Name"] != AGGREGATED],
        errors=sorted(errors, key=lambda e: -e["occurrences"]),
    )


@dataclass(frozen=True)
class Thresholds:
    """What a passing run must meet (``None``: not checked)."""

    max_p99_ms: float | None = None
    max_failure_ratio: float | None = None


def problems(summary: Summary, thresholds: Thresholds) -> list[str]:
    """Why the run fails (empty: it passes). No request at all, or an exception inside a locust
    user, always fails: the numbers would not describe the target."""
    out = []
    if summary.requests == 0:
        out.append("no request completed")
    if summary.exceptions:
        out.append(f"{summary.exceptions} exceptions in locust users (see locust_exceptions.csv)")
    p99, limit = summary.p99_ms, thresholds.max_p99_ms
    if limit is not None and (p99 is None or p99 > limit):
        out.append(f"p99 {_ms(p99)} is over --max-p99-ms {limit:g}")
    ratio, max_ratio = summary.failure_ratio, thresholds.max_failure_ratio
    if max_ratio is not None and ratio > max_ratio:
        out.append(f"failure ratio {ratio:.4f} is over --max-failure-ratio {max_ratio:g}")
    return out


def _ms(value: float | None) -> str:
    return "n/a" if value is None else f"{value:g} ms"


def format_summary(spec: LoadTestSpec, s: Summary) -> str:
    """A few lines for the terminal: the whole run, then each request name."""
    lines = [
        f"loadtest {spec.protocol} {spec.target} model {spec.model}: {s.requests} requests, "
        f"{s.rps:.1f} req/s, p50 {_ms(s.p50_ms)}, p95 {_ms(s.p95_ms)}, p99 {_ms(s.p99_ms)}, "
        f"failures {s.failures} ({s.failure_ratio:.2%})"
    ]
    for r in s.by_name:
        lines.append(
            f"  {r['name']:<36} {r['requests']:>7} req  p50 {_ms(r['p50_ms']):>9}  "
            f"p99 {_ms(r['p99_ms']):>9}  failures {r['failures']}"
        )
    lines += [f"  failed: {e['occurrences']} x {e['name']}: {e['error']}" for e in s.errors[:5]]
    return "\n".join(lines)


def write_summary(spec: LoadTestSpec, s: Summary, thresholds: Thresholds, found: list[str]) -> Path:
    """``OUT/summary.json``: the spec, the numbers, the thresholds and the verdict."""
    body = {
        "target": spec.target,
        "protocol": spec.protocol,
        "model": spec.model,
        "users": spec.users,
        "spawn_rate": spec.spawn_rate,
        "duration_s": spec.duration_s,
        **asdict(s),
        "failure_ratio": s.failure_ratio,
        "thresholds": asdict(thresholds),
        "passed": not found,
        "problems": found,
    }
    path = spec.out / "summary.json"
    path.write_text(json.dumps(body, indent=2))
    return path


def _per_second(t: list[float], totals: list[float]) -> list[float]:
    """Rates from cumulative counts: the first point is 0, each next one the last interval's."""
    rates = [0.0]
    for i in range(1, len(t)):
        rates.append((totals[i] - totals[i - 1]) / max(t[i] - t[i - 1], 1e-9))
    return rates[: len(t)]


def plot_history(out: Path, title: str = "") -> Path:
    """``OUT/latency.png`` from ``locust_stats_history.csv`` (one row a second): p50/p95/p99 (ms)
    over locust's sliding window, requests/s and failures/s from the running totals, and users."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    rows = [
        r for r in _read_csv(out / f"{CSV_PREFIX}_stats_history.csv") if r["Name"] == AGGREGATED
    ]
    t0 = float(rows[0]["Timestamp"]) if rows else 0.0
    t = [float(r["Timestamp"]) - t0 for r in rows]

    def column(name: str) -> list[float]:
        values = (_num(r[name]) for r in rows)
        return [math.nan if v is None else v for v in values]

    fig = Figure(figsize=(8, 6), layout="constrained")
    FigureCanvasAgg(fig)
    fig.suptitle(title)
    latency, rate = fig.subplots(2, 1, sharex=True)
    # until its window holds a request locust writes N/A or 0 (so p99 = 0) for the percentiles
    empty = [not p99 for p99 in column("99%")]
    for col in ("50%", "95%", "99%"):
        ms = [math.nan if e else v for v, e in zip(column(col), empty, strict=True)]
        latency.plot(t, ms, marker=".", label=f"p{col[:-1]}")
    latency.set_ylabel("latency (ms)")
    latency.legend(loc="upper left")
    rate.plot(t, _per_second(t, column("Total Request Count")), marker=".", label="requests/s")
    rate.plot(t, _per_second(t, column("Total Failure Count")), marker=".", label="failures/s")
    rate.set_ylabel("per second")
    rate.set_xlabel("seconds since start")
    rate.legend(loc="upper left")
    users = rate.twinx()
    users.plot(t, column("User Count"), color="grey", linestyle="--", label="users")
    users.set_ylabel("users")
    users.legend(loc="upper right")
    path = out / "latency.png"
    fig.savefig(path, dpi=100)
    return path


def run(spec: LoadTestSpec, thresholds: Thresholds) -> tuple[Summary, list[str]]:
    """Runs locust against a target already checked, then writes summary.json and latency.png;
    -> (the summary, why it fails)."""
    run_locust(spec)
    summary = summarize(spec.out)
    found = problems(summary, thresholds)
    write_summary(spec, summary, thresholds, found)
    plot_history(spec.out, f"{spec.model} over {spec.protocol} at {spec.target}")
    return summary, found
