"""``recserve soak``: steady open-loop load on a local cluster, a hot reload and a shard restart
in the middle, and nothing may fail.

Timeline (``T`` = the run's seconds)::

    setup   a small synthetic model (INT8 tables, the cold ones on an embedding server), published
            as v1 with S document shards; `cluster up` with R replicas per shard
    0..T    open-loop load at a fixed rate (the load tests' request mix: Zipf users, K from 10 to
            500, filters of different selectivity), each call with a deadline
    T/3     hot reload: v2 is published; the shards load it, the router moves once all hold it
    T/2     one shard replica gets SIGTERM (it drains) and is started again
    T       sending stops; every call still in flight is waited for

Checks (each one a line of the report; any that fails makes the exit status 1):

- no call failed (any gRPC status but OK) and no answer was partial;
- p99 latency within ``max_p99_ms``;
- the router moved to v2;
- the router's own success counter (``nv_inference_request_success``) equals the number of OK
  answers the client received: the server neither lost nor invented a request;
- the generator kept the rate (achieved >= 95 % of the asked q/s), so the figures mean what
  they say.

    report = run(SoakSpec(seconds=60, qps=50, out=Path("runs/soak")))
    report["problems"]   # [] when every check held
"""

from __future__ import annotations

import random
import threading
import time
import urllib.request
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import torch
from prometheus_client.parser import text_string_to_metric_families

from common.atomic import atomic_write_json
from loadtest.shape import read_model_shape
from loadtest.workload import RequestMix, recommend_request
from recserve import cluster as local_cluster
from retrieval.data import SyntheticConfig, generate
from retrieval.model import RetrievalModel, table_specs
from retrieval.tiering import tier_model
from retrieval.training.prepare import prepare
from serving.protos.recommend_pb2 import RecommendRequest, RecommendResponse
from serving.protos.recommend_pb2_grpc import RecommenderStub
from serving.repository import ModelRepository
from sharded_tables.export import RemoteRows
from sharded_tables.placement import Budgets
from sharded_tables.specs import DType

MODEL = "soak"
EMBEDDING_SERVERS = 1
RESTARTED = "shard-0-0"
"""The replica that is restarted mid-run."""


@dataclass(frozen=True)
class SoakSpec:
    seconds: float
    qps: float
    out: Path
    items: int = 20_000
    shards: int = 2
    replicas: int = 2
    max_p99_ms: float = 250.0
    deadline_ms: float = 2000.0
    """Each call's gRPC deadline (a call past it counts as failed)."""
    shard_deadline_ms: float = 500.0
    seed: int = 0

    def validate(self) -> None:
        """Raises ``ValueError`` naming the option."""
        if not self.seconds >= 6:
            raise ValueError(
                f"--seconds: at least 6 (the reload and the restart need room), got {self.seconds}"
            )
        if not 0 < self.qps <= 2000:
            raise ValueError(f"--qps: must be in (0, 2000], got {self.qps}")
        if self.items < 1000:
            raise ValueError(f"--items: at least 1000, got {self.items}")
        if self.shards < 1 or self.replicas < 2:
            raise ValueError(
                "--shards must be >= 1 and --replicas >= 2 (a restarted replica's shard must "
                "still answer, or the answers during the restart would be partial)"
            )
        if not self.max_p99_ms > 0 or not self.deadline_ms > 0:
            raise ValueError("--max-p99-ms and --deadline-ms must be > 0")


@dataclass
class Calls:
    """What the client saw, one slot per call (filled by gRPC's callback threads)."""

    sent: list[float] = field(default_factory=list)
    done: list[float] = field(default_factory=list)
    code: list[str] = field(default_factory=list)
    partial: list[bool] = field(default_factory=list)
    version: list[int] = field(default_factory=list)

    def open(self) -> int:
        self.sent.append(time.monotonic())
        self.done.append(float("nan"))
        self.code.append("")
        self.partial.append(False)
        self.version.append(0)
        return len(self.sent) - 1


# ---- setup --------------------------------------------------------------------------------------
def publish_model(spec: SoakSpec, repo_dir: Path) -> tuple[RetrievalModel, RemoteRows]:
    """A small synthetic model, tiered like the demo's, published as v1 with ``spec.shards``
    document shards; returns what v2 republishes."""
    ds = generate(SyntheticConfig(num_users=500, num_items=spec.items, seed=spec.seed))
    prep = prepare(ds)
    torch.manual_seed(spec.seed)
    model = RetrievalModel(prep.config)
    model.build_index(prep.train.item_features, prep.dataset.item_attributes)
    # INT8 tables: the item table in this process, every other table on the embedding server
    item = next(s for s in table_specs(model.config, DType.INT8) if s.name == "item")
    budgets = Budgets(
        device=0, host=item.bytes(DType.INT8), remote_per_server=64 << 20,
        remote_servers=EMBEDDING_SERVERS,
    )  # fmt: skip
    tiered, rows = tier_model(model.eval(), budgets, dtype=DType.INT8)
    if not rows:
        raise RuntimeError("the plan put no table on the embedding server")
    ModelRepository(repo_dir).publish(MODEL, tiered, shards=spec.shards, remote_rows=rows)
    return tiered, rows


def messages(repo_dir: Path, n: int, seed: int) -> list[RecommendRequest]:
    """``n`` requests of the load tests' mix for the published model."""
    mix = RequestMix(read_model_shape(repo_dir, MODEL), pool=1000, seed=seed)
    rng = random.Random(seed)
    return [recommend_request(mix.draw(rng)) for _ in range(n)]


# ---- load ---------------------------------------------------------------------------------------
def send_steady(
    stub: RecommenderStub,
    reqs: list[RecommendRequest],
    qps: float,
    seconds: float,
    deadline_s: float,
    calls: Calls,
) -> list[grpc.Future]:
    """Open loop: call ``i`` leaves at ``start + i / qps`` whether or not earlier ones answered
    (a late answer does not slow the sender, as with real users)."""
    futures: list[grpc.Future] = []
    start = time.monotonic()
    i = 0
    while (due := start + i / qps) < start + seconds:
        if (wait := due - time.monotonic()) > 0:
            time.sleep(wait)
        slot = calls.open()
        fut = stub.Recommend.future(reqs[i % len(reqs)], timeout=deadline_s)
        fut.add_done_callback(lambda f, s=slot: _record(calls, s, f))
        futures.append(fut)
        i += 1
    return futures


def _record(calls: Calls, slot: int, fut: grpc.Future) -> None:
    calls.done[slot] = time.monotonic()
    try:
        res: RecommendResponse = fut.result()
    except grpc.RpcError as e:
        calls.code[slot] = e.code().name
        return
    calls.code[slot], calls.partial[slot], calls.version[slot] = "OK", res.partial, res.version


def disturb(
    spec: SoakSpec,
    repo_dir: Path,
    cluster_dir: Path,
    model: Any,
    rows: Any,
    t0: float,
    events: dict[str, float],
) -> None:
    """The mid-run events: publish v2 at T/3, restart one shard replica at T/2 (times in
    ``events``, seconds since the load started)."""
    time.sleep(max(t0 + spec.seconds / 3 - time.monotonic(), 0.0))
    events["publish_v2_s"] = time.monotonic() - t0
    ModelRepository(repo_dir).publish(MODEL, model, shards=spec.shards, remote_rows=rows)
    events["published_v2_s"] = time.monotonic() - t0
    time.sleep(max(t0 + spec.seconds / 2 - time.monotonic(), 0.0))
    events["stop_replica_s"] = time.monotonic() - t0
    events["replica_needed_sigkill"] = float(local_cluster.stop(cluster_dir, RESTARTED))
    local_cluster.restart(cluster_dir, RESTARTED)
    events["replica_ready_s"] = time.monotonic() - t0


def router_successes(metrics_address: str) -> float:
    """The router's ``nv_inference_request_success``, summed over versions."""
    with urllib.request.urlopen(f"http://{metrics_address}/metrics", timeout=10) as r:
        text = r.read().decode()
    return sum(
        s.value
        for fam in text_string_to_metric_families(text)
        for s in fam.samples
        if s.name == "nv_inference_request_success"
    )


# ---- the run ------------------------------------------------------------------------------------
def run(spec: SoakSpec, say: Any = print) -> dict[str, Any]:
    """Sets up, loads, disturbs, checks; returns the report (also written to ``soak.json``)."""
    spec.validate()
    work = spec.out / time.strftime("run-%Y%m%d-%H%M%S")
    repo_dir, cluster_dir = work / "repo", work / "cluster"
    say(f"building and publishing a {spec.items:,}-item model into {repo_dir}")
    model, rows = publish_model(spec, repo_dir)
    reqs = messages(repo_dir, 2000, spec.seed)
    cspec = local_cluster.ClusterSpec(
        model_repo=repo_dir, model=MODEL, shards=spec.shards, replicas=spec.replicas,
        embedding_servers=EMBEDDING_SERVERS, shard_deadline_ms=spec.shard_deadline_ms,
    )  # fmt: skip
    cluster = local_cluster.up(cspec, cluster_dir, progress=lambda m: say(f"  {m}"))
    calls, events = Calls(), dict[str, float]()
    try:
        with grpc.insecure_channel(cluster.router.address) as channel:
            stub = RecommenderStub(channel)
            t0 = time.monotonic()
            mid = threading.Thread(
                target=disturb, args=(spec, repo_dir, cluster_dir, model, rows, t0, events)
            )
            mid.start()
            say(f"load: {spec.qps:g} q/s for {spec.seconds:g} s at {cluster.router.address}")
            futures = send_steady(stub, reqs, spec.qps, spec.seconds, spec.deadline_ms / 1e3, calls)
            sent_s = time.monotonic() - t0
            for f in futures:  # every call ends: with its answer or at its deadline
                f.exception()
            mid.join()
        successes = router_successes(cluster.router.metrics)
    finally:
        local_cluster.down(cluster_dir)
    report = summarize(spec, calls, events, sent_s, successes, t0)
    report["work_dir"] = str(work)
    atomic_write_json(spec.out / "soak.json", report)
    return report


def summarize(
    spec: SoakSpec,
    calls: Calls,
    events: dict[str, float],
    sent_s: float,
    successes: float,
    t0: float,
) -> dict[str, Any]:
    """The report: counts, latency percentiles (overall and per phase), versions, the checks."""
    sent = np.array(calls.sent) - t0
    lat_ms = (np.array(calls.done) - np.array(calls.sent)) * 1e3
    ok = np.array([c == "OK" for c in calls.code], dtype=bool)
    errors: dict[str, int] = {}
    for c in calls.code:
        if c != "OK":
            errors[c or "NO_ANSWER"] = errors.get(c or "NO_ANSWER", 0) + 1
    version = np.array(calls.version)
    switched = sent[(version == 2)]
    phases = {
        "steady": (0.0, events.get("publish_v2_s", spec.seconds)),
        "reload": (events.get("publish_v2_s", 0.0), events.get("stop_replica_s", 0.0)),
        "restart": (events.get("stop_replica_s", 0.0), events.get("replica_ready_s", 0.0) + 2.0),
    }

    def pct(mask: np.ndarray) -> dict[str, float]:
        v = lat_ms[mask & ok]
        if not v.size:
            return {"n": 0}
        p50, p95, p99 = np.percentile(v, [50, 95, 99])
        return {"n": int(v.size), "p50_ms": p50, "p95_ms": p95, "p99_ms": p99, "max_ms": v.max()}

    overall = pct(np.ones_like(ok))
    report: dict[str, Any] = {
        "spec": {k: str(v) if isinstance(v, Path) else v for k, v in asdict(spec).items()},
        "requests": len(calls.sent),
        "ok": int(ok.sum()),
        "errors": errors,
        "partial": int(np.array(calls.partial, dtype=bool).sum()),
        "achieved_qps": len(calls.sent) / sent_s if sent_s > 0 else 0.0,
        "latency": overall,
        "phases": {n: pct((sent >= a) & (sent < b)) for n, (a, b) in phases.items()},
        "events": events,
        "first_v2_answer_s": float(switched.min()) if switched.size else None,
        "v1_answers_after_first_v2": int(((version == 1) & (sent > switched.min())).sum())
        if switched.size
        else None,
        "router_successes": successes,
    }
    report["problems"] = check(spec, report)
    return report


def check(spec: SoakSpec, r: dict[str, Any]) -> list[str]:
    """The soak's promises; one line per broken one."""
    problems = []
    if r["errors"]:
        problems.append(f"{sum(r['errors'].values())} calls failed: {r['errors']}")
    if r["partial"]:
        problems.append(f"{r['partial']} answers were partial")
    p99 = r["latency"].get("p99_ms")
    if p99 is None or p99 > spec.max_p99_ms:
        problems.append(f"p99 {p99} ms is over --max-p99-ms {spec.max_p99_ms:g}")
    if r["first_v2_answer_s"] is None:
        problems.append("the router never served v2 after the hot reload")
    if r["router_successes"] != r["ok"]:
        problems.append(
            f"the router counted {r['router_successes']:.0f} successes, the client {r['ok']}"
        )
    if r["achieved_qps"] < 0.95 * spec.qps:
        problems.append(
            f"the generator sent {r['achieved_qps']:.1f} q/s, under 95 % of {spec.qps:g}: "
            "the machine is too busy for this rate"
        )
    return problems


def format_report(r: dict[str, Any]) -> str:
    """A few readable lines."""
    lat = r["latency"]
    lines = [
        f"requests {r['requests']}  ok {r['ok']}  errors {sum(r['errors'].values())}  "
        f"partial {r['partial']}  achieved {r['achieved_qps']:.1f} q/s",
        "latency ms: "
        + (
            f"p50 {lat['p50_ms']:.1f}  p95 {lat['p95_ms']:.1f}  p99 {lat['p99_ms']:.1f}  "
            f"max {lat['max_ms']:.1f}"
            if lat.get("n")
            else "no answers"
        ),
    ]
    for name, p in r["phases"].items():
        if p.get("n"):
            lines.append(
                f"  {name:8s} n={p['n']:<6d} p99 {p['p99_ms']:.1f} ms  max {p['max_ms']:.1f} ms"
            )
    ev = r["events"]
    lines.append(
        f"v2 published at {ev.get('publish_v2_s', float('nan')):.1f} s, first v2 answer at "
        f"{r['first_v2_answer_s'] if r['first_v2_answer_s'] is not None else 'never'} s; "
        f"replica {RESTARTED} stopped at {ev.get('stop_replica_s', float('nan')):.1f} s, "
        f"ready again at {ev.get('replica_ready_s', float('nan')):.1f} s"
    )
    lines.append(f"router success counter {r['router_successes']:.0f} vs client OK {r['ok']}")
    return "\n".join(lines)
