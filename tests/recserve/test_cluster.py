"""`recserve cluster up/status/restart/down` with real processes on 127.0.0.1: a router, two
document shards and an embedding server holding a remote table. The routed answer equals the
unsharded model's; a shard killed under load makes answers partial within the deadline, and they
are whole again after it restarts; `down` leaves no process behind."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path

import grpc
import numpy as np
import pytest
import torch

from loadtest.workload import OWN_CONNECTION
from recserve.cluster import Cluster
from retrieval.data import SyntheticConfig, generate
from retrieval.model import RetrievalModel
from retrieval.tiering import tier_model
from retrieval.training.prepare import prepare
from serving.protos import recommend_pb2_grpc
from serving.repository.repository import ModelRepository
from sharded_tables.placement import Budgets
from sharded_tables.specs import DType, Tier
from support.tiny_model import Tiny
from support.topk_check import assert_same_topk
from support.waiting import wait_until

pytestmark = [pytest.mark.slow, pytest.mark.multiproc, pytest.mark.timeout(300)]
DEADLINE_MS = 400.0
FILTERS = [None, "category in {news, music}"]


def recserve(*args: str, timeout: float = 180) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "recserve", *args], capture_output=True, text=True, timeout=timeout
    )


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """(model, tiny helper, cluster dir): FP32 tables, the item table on the embedding server."""
    root = tmp_path_factory.mktemp("cluster")
    ds = generate(SyntheticConfig(num_users=64, num_items=12_000, seed=3))
    prep = prepare(ds, history_len=8)
    torch.manual_seed(0)
    model = RetrievalModel(prep.config)
    model.build_index(prep.train.item_features, prep.dataset.item_attributes)
    budgets = Budgets(device=0, host=1 << 20, remote_per_server=64 << 20, remote_servers=1)
    tiered, rows = tier_model(model.eval(), budgets, dtype=DType.FP32)
    plan = tiered.tables.plan  # the 1.5 MB item table does not fit the host budget
    assert any(p.tier is Tier.REMOTE for p in plan.tables)
    ModelRepository(root / "repo").publish("demo", tiered, shards=2, remote_rows=rows)
    d = root / "run"
    up = recserve(
        "cluster", "up", "--model-repo", str(root / "repo"), "--shards", "2",
        "--embedding-servers", "1", "--shard-deadline-ms", str(DEADLINE_MS), "--directory", str(d),
        "--router-processes", "2", "--shard-threads", "2",
    )  # fmt: skip
    assert up.returncode == 0, up.stderr + up.stdout
    yield model.eval(), Tiny(prep, model), d
    recserve("cluster", "down", "--directory", str(d))


def torch_threads(pid: int) -> str:
    """The ``--torch-threads`` a process of the cluster was started with."""
    argv = Path(f"/proc/{pid}/cmdline").read_bytes().decode().split("\0")
    return argv[argv.index("--torch-threads") + 1]


def test_shard_servers_get_the_threads_asked_and_the_router_its_share(cluster):
    _, _, d = cluster
    running = Cluster.load(d)
    shards = [p for p in running.processes if p.name.startswith("shard-")]
    assert len(shards) == 2 and all(torch_threads(p.pid) == "2" for p in shards)
    router = max(1, (os.cpu_count() or 1) // 3)
    assert torch_threads(running.router.pid) == str(router)


def stub(d: Path) -> recommend_pb2_grpc.RecommenderStub:
    channel = grpc.insecure_channel(Cluster.load(d).router.address)
    return recommend_pb2_grpc.RecommenderStub(channel)


@pytest.mark.parametrize("k", [10, 10_000])
@pytest.mark.parametrize("text", FILTERS)
def test_routed_answers_equal_the_unsharded_model(cluster, k, text):
    model, tiny, d = cluster
    users = np.arange(4)
    want_ids, want_scores = tiny.expected(model, users, k, [text] * len(users))
    s = stub(d)
    for row, u in enumerate(users):
        res = s.Recommend(tiny.message(int(u), k, filter=text or ""), timeout=30)
        assert not res.partial
        assert_same_topk(
            torch.tensor([list(res.item_ids)]),
            torch.tensor([list(res.scores)]),
            torch.from_numpy(want_ids[row : row + 1]),
            torch.from_numpy(want_scores[row : row + 1]),
        )


def test_the_router_is_a_group_whose_processes_both_answer(cluster):
    _, tiny, d = cluster
    router = Cluster.load(d).router
    for u in range(20):  # each call on its own connection: the kernel spreads connections
        with grpc.insecure_channel(router.address, options=[OWN_CONNECTION]) as channel:
            reply = recommend_pb2_grpc.RecommenderStub(channel).Recommend(
                tiny.message(u, 10), timeout=30
            )
            assert len(reply.item_ids) == 10 and not reply.partial
    text = urllib.request.urlopen(f"http://{router.metrics}/metrics", timeout=10).read().decode()
    counts = re.findall(
        r'^recserve_request_duration_seconds_count\{.*process="(\d)".*\} (\S+)$', text, re.M
    )
    assert {p for p, n in counts if float(n) > 0} == {"0", "1"}


def test_the_router_routes_one_batch_at_a_time_on_the_shards_cores(cluster):
    # the shards compute on the router's cores here: a second batch in flight only halves
    # the batches (more shard calls per request), RouterConfig.batches_in_flight
    _, _, d = cluster
    argv = Path(f"/proc/{Cluster.load(d).router.pid}/cmdline").read_bytes().split(b"\0")
    assert argv[argv.index(b"--batches-in-flight") + 1] == b"1"


def test_status_reports_every_process_healthy(cluster):
    _, _, d = cluster
    out = recserve("cluster", "status", "--directory", str(d))
    assert out.returncode == 0, out.stdout + out.stderr
    for name in ("router", "shard-0-0", "shard-1-0", "embed-0"):
        assert name in out.stdout


def test_a_killed_shard_gives_partial_answers_then_recovers(cluster):
    model, tiny, d = cluster
    s = stub(d)
    want_ids, _ = tiny.expected(model, np.arange(8), 20)
    seen: list[tuple[float, bool, list[str], bool]] = []  # (latency, partial, missing, correct)
    stop = threading.Event()

    def load() -> None:
        u = 0
        while not stop.is_set():
            start = time.monotonic()
            res = s.Recommend(tiny.message(u % 8, 20), timeout=10)
            whole = list(res.item_ids) == want_ids[u % 8].tolist()
            seen.append((time.monotonic() - start, res.partial, list(res.missing), whole))
            u += 1

    thread = threading.Thread(target=load)
    thread.start()
    wait_until(lambda: len(seen) >= 3, 30, "answers before the kill")
    shard = next(p for p in Cluster.load(d).processes if p.name == "shard-1-0")
    os.kill(shard.pid, signal.SIGKILL)
    killed_at = len(seen)
    wait_until(lambda: sum(x[1] for x in seen[killed_at:]) >= 3, 30, "partial answers")
    restarted = recserve("cluster", "restart", "shard-1-0", "--directory", str(d))
    assert restarted.returncode == 0, restarted.stderr
    restarted_at, recovered_at = time.monotonic(), None
    while recovered_at is None and time.monotonic() - restarted_at < 20:
        time.sleep(0.1)
        if len(seen) >= 3 and not any(x[1] for x in seen[-3:]):
            recovered_at = time.monotonic()
    stop.set()
    thread.join(30)
    partial = [x for x in seen if x[1]]
    assert partial, "no answer was partial while a shard was dead"
    assert all(m == ["shard-1"] for _, _, m, _ in partial)
    assert max(lat for lat, *_ in partial) < DEADLINE_MS / 1000 * 2 + 1.0  # never a hang
    assert all(ok for _, p, _, ok in seen if not p), "an answer not flagged partial was wrong"
    assert recovered_at is not None, "answers are whole again after the restart"
    print(f"recovered {recovered_at - restarted_at:.2f} s after the restarted shard was ready")


class Load:
    """A thread sending Recommend calls back to back; records (latency s, status, partial,
    missing shards, ids equal the unsharded model's) per call. ``fresh``: while set, each call
    has a history of random items (rows no cache holds yet; its ids are not checked)."""

    def __init__(self, cluster, k: int = 20):
        model, tiny, d = cluster
        self.stub, self.tiny, self.k = stub(d), tiny, k
        self.want = tiny.expected(model, np.arange(8), k)[0]
        self.fresh = threading.Event()
        self._rng = np.random.default_rng(0)
        self._items = model.config.num_items
        self.seen: list[tuple[float, str, bool, list[str], bool]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run)

    def _run(self) -> None:
        u = 0
        while not self._stop.is_set():
            start = time.monotonic()
            msg, fresh = self.tiny.message(u % 8, self.k), self.fresh.is_set()
            if fresh:
                msg.history[:] = self._rng.integers(0, self._items, len(msg.history)).tolist()
            try:
                res = self.stub.Recommend(msg, timeout=10)
                row = ("OK", res.partial, list(res.missing))
                whole = fresh or list(res.item_ids) == self.want[u % 8].tolist()
            except grpc.RpcError as e:
                row, whole = (e.code().name, False, []), False
            self.seen.append((time.monotonic() - start, *row, whole))
            u += 1

    def __enter__(self) -> Load:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(30)

    def since(self, n: int) -> list[tuple[float, str, bool, list[str], bool]]:
        return self.seen[n:]

    def while_paused(self, pid: int, enough: Callable[[list[tuple]], bool]) -> list[tuple]:
        """The answers that ended while ``pid`` was stopped (SIGSTOP ... SIGCONT); it stays
        stopped until those answers are ``enough`` (at most 30 s)."""
        mark = len(self.seen)
        os.kill(pid, signal.SIGSTOP)
        try:
            wait_until(lambda: enough(self.since(mark)), 30, "answers while paused")
        finally:
            os.kill(pid, signal.SIGCONT)
        return self.since(mark)

    def wait_whole(self, timeout: float) -> bool:
        """Until the last 3 answers are whole (OK, not partial)."""
        until = time.monotonic() + timeout
        while time.monotonic() < until:
            last = self.seen[-3:]
            if len(last) == 3 and all(c == "OK" and not p for _, c, p, _, _ in last):
                return True
            time.sleep(0.05)
        return False


def test_a_paused_shard_makes_answers_partial_within_the_deadline(cluster):
    """SIGSTOP: the process is alive and its socket open, but it never answers (a hung host)."""
    _, _, d = cluster
    shard = next(p for p in Cluster.load(d).processes if p.name == "shard-0-0")
    with Load(cluster) as load:
        assert load.wait_whole(20)
        paused = load.while_paused(shard.pid, lambda seen: sum(x[2] for x in seen) >= 3)
        assert load.wait_whole(20), "answers are whole again once the shard runs"
    assert paused and all(c == "OK" for _, c, *_ in paused), {c for _, c, *_ in paused}
    partial = [x for x in paused if x[2]]
    assert partial, "no answer was partial while the shard was paused"
    assert all(m == ["shard-0"] for _, _, _, m, _ in partial)
    assert max(lat for lat, *_ in paused) < DEADLINE_MS / 1000 * 2 + 1.0  # never a hang
    assert all(ok for _, c, p, _, ok in paused if not p), "a whole answer was wrong"
    print(f"{len(partial)} of {len(paused)} answers partial while paused")


def test_a_paused_embedding_server_fails_fast_and_recovers(cluster):
    """SIGSTOP of the embedding server holding a table the tower needs: each call ends within
    the embedding timeout (UNAVAILABLE or DEADLINE_EXCEEDED, or OK if it was not needed), never
    a hang, never a wrong answer; whole answers again after SIGCONT."""
    _, _, d = cluster
    embed = next(p for p in Cluster.load(d).processes if p.name == "embed-0")
    with Load(cluster) as load:
        assert load.wait_whole(20)
        load.fresh.set()  # histories of rows the router's hot-row cache does not hold
        paused = load.while_paused(embed.pid, lambda seen: sum(x[1] != "OK" for x in seen) >= 3)
        load.fresh.clear()
        assert load.wait_whole(20), "answers are whole again once the embedding server runs"
    codes = {c for _, c, *_ in paused}
    assert paused and codes <= {"OK", "UNAVAILABLE", "DEADLINE_EXCEEDED"}, codes
    assert codes - {"OK"}, "no call noticed the paused embedding server"
    # the router's 0.5 s embedding timeout (a call may wait for one failing batch ahead of it),
    # not the collection's own 1 s, nor a hang
    assert max(lat for lat, *_ in paused) < 2 * 0.5 + 0.25
    assert all(ok for _, c, p, _, ok in paused if c == "OK" and not p), "an OK answer was wrong"
    print(
        f"paused: {len(paused)} calls, codes {sorted(codes)}, max {max(x[0] for x in paused):.2f} s"
    )


def test_down_leaves_no_process_behind(cluster, tmp_path):
    _, _, d = cluster
    pids = [p.pid for p in Cluster.load(d).processes]
    out = recserve("cluster", "down", "--directory", str(d))
    assert out.returncode == 0, out.stderr
    for pid in pids:
        assert not Path(f"/proc/{pid}").exists() or "recserve" not in Path(
            f"/proc/{pid}/cmdline"
        ).read_text(errors="replace")
    assert not (d / "cluster.json").exists()
