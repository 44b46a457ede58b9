"""``recserve test load`` against a real ``recserve serve model`` process (gRPC and HTTP), a target
that is down, and the request mix of ``loadtest/workload.py`` against the model it is read from."""

from __future__ import annotations

import collections
import importlib
import json
import random
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator
from concurrent import futures
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from types import ModuleType

import grpc
import pytest
import torch
from grpc_health.v1 import health, health_pb2_grpc

from loadtest.shape import read_model_shape
from retrieval.data import SyntheticConfig, generate
from retrieval.filter_expr import predicates
from retrieval.filters import parse_filter
from retrieval.model import RetrievalModel
from retrieval.training.prepare import prepare
from serving.protos.recommend_pb2 import RecommendResponse
from serving.protos.recommend_pb2_grpc import RecommenderServicer, add_RecommenderServicer_to_server
from serving.repository import repository
from support.process_util import STARTUP_S, serve_cmd, start_server

pytestmark = [pytest.mark.slow, pytest.mark.multiproc]


@pytest.fixture(scope="module")
def model_repo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A repository with one published tiny model (300 items, untrained weights, real index)."""
    prep = prepare(generate(SyntheticConfig(num_users=100, num_items=300, seed=1)), history_len=8)
    torch.manual_seed(0)
    model = RetrievalModel(prep.config)
    model.build_index(prep.train.item_features, prep.dataset.item_attributes)
    root = tmp_path_factory.mktemp("repo")
    repository.ModelRepository(root).publish("demo", model.eval())
    return root


@pytest.fixture(scope="module")
def served(model_repo: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, str]]:
    """``recserve serve`` on free ports -> {"grpc": HOST:PORT, "http": HOST:PORT}."""
    cmd = serve_cmd("--model-repo", model_repo, "--grpc-port", "0", "--http-port", "0",
                    "--metrics-port", "0")  # fmt: skip
    with start_server(cmd, tmp_path_factory.mktemp("serve"), "serve") as proc:
        ready = proc.wait_ready(STARTUP_S)
        assert (ready.model, ready.version) == ("demo", 1)
        assert ready.grpc and ready.http and ready.metrics
        yield {"grpc": ready.grpc, "http": ready.http}


def loadtest(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "recserve", "test", "load", *args],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip


@pytest.mark.parametrize("protocol", ["grpc", "http"])
def test_loadtest_against_serve(protocol: str, served, model_repo: Path, tmp_path: Path):
    out = tmp_path / "out"
    done = loadtest(
        "--target", served[protocol], "--protocol", protocol, "--model-repo", str(model_repo),
        "--users", "3", "--spawn-rate", "3", "--duration", "4", "--out", str(out),
        "--max-failure-ratio", "0", "--max-p99-ms", "5000",
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr + (out / "locust.log").read_text()
    summary = json.loads((out / "summary.json").read_text())
    assert summary["requests"] > 0 and summary["failures"] == 0 and summary["passed"]
    assert summary["exceptions"] == 0 and summary["p99_ms"] is not None
    # the mix reached the target: several K and filter classes, each under its own name
    names = {r["name"] for r in summary["by_name"]}
    assert len(names) >= 3 and any("filter=broad" in n for n in names), names
    assert (out / "latency.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert f"loadtest {protocol} {served[protocol]} model demo:" in done.stdout


def test_missed_threshold_exits_1(served, model_repo: Path, tmp_path: Path):
    done = loadtest(
        "--target", served["grpc"], "--model-repo", str(model_repo), "--users", "2",
        "--spawn-rate", "2", "--duration", "2", "--out", str(tmp_path), "--max-p99-ms", "0",
    )  # fmt: skip
    assert done.returncode == 1, done.stdout + done.stderr
    assert "--max-p99-ms" in done.stderr
    assert json.loads((tmp_path / "summary.json").read_text())["passed"] is False


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("protocol", ["grpc", "http"])
def test_target_down_is_a_clear_error(protocol: str, model_repo: Path, tmp_path: Path):
    target = f"127.0.0.1:{_free_port()}"
    done = loadtest(
        "--target", target, "--protocol", protocol, "--model-repo", str(model_repo),
        "--duration", "2", "--out", str(tmp_path / "out"),
    )  # fmt: skip
    assert done.returncode == 2
    assert f"loadtest: target {target} is down" in done.stderr, done.stderr
    assert not (tmp_path / "out" / "summary.json").exists()


# ---- partial answers count as failures -------------------------------------------------------
class PartialRecommender(RecommenderServicer):
    """A router whose shard 1 never answers: every reply is partial."""

    def Recommend(self, request, context):
        return RecommendResponse(item_ids=[1], scores=[0.5], partial=True, missing=["shard-1"])


class PartialKServe(BaseHTTPRequestHandler):
    """KServe v2 over HTTP, every answer partial."""

    def do_GET(self) -> None:
        self._reply({"ready": True})

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers["Content-Length"]))
        self._reply({"outputs": [], "parameters": {"partial": True, "missing": "shard-1"}})

    def _reply(self, body: dict) -> None:
        data = json.dumps(body).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args) -> None:
        pass


@pytest.fixture
def partial_targets() -> Iterator[dict[str, str]]:
    """In-process stand-ins that answer every request partially: {"grpc": ..., "http": ...}."""
    server = grpc.server(futures.ThreadPoolExecutor(4))
    add_RecommenderServicer_to_server(PartialRecommender(), server)
    health_pb2_grpc.add_HealthServicer_to_server(health.HealthServicer(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    http = ThreadingHTTPServer(("127.0.0.1", 0), PartialKServe)
    threading.Thread(target=http.serve_forever, daemon=True).start()
    try:
        yield {"grpc": f"127.0.0.1:{port}", "http": f"127.0.0.1:{http.server_address[1]}"}
    finally:
        http.shutdown()
        server.stop(0)


@pytest.mark.parametrize("protocol", ["grpc", "http"])
def test_partial_answers_are_failures(protocol, partial_targets, model_repo: Path, tmp_path: Path):
    done = loadtest(
        "--target", partial_targets[protocol], "--protocol", protocol, "--model-repo",
        str(model_repo), "--users", "2", "--spawn-rate", "2", "--duration", "2",
        "--out", str(tmp_path), "--max-failure-ratio", "0",
    )  # fmt: skip
    assert done.returncode == 1, done.stdout + done.stderr
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["requests"] > 0 and summary["failures"] == summary["requests"]
    assert all("partial answer (missing: shard-1)" in e["error"] for e in summary["errors"])
    assert "--max-failure-ratio" in done.stderr


# ---- the request mix ---------------------------------------------------------------------------
@pytest.fixture(scope="module")
def workload() -> ModuleType:
    return importlib.import_module("loadtest.workload")


def test_model_shape_is_the_published_config(model_repo: Path):
    loaded = repository.ModelRepository(model_repo).load("demo")
    cfg = loaded.model.config
    shape = read_model_shape(model_repo)
    assert (shape.name, shape.version) == ("demo", 1)
    assert shape.num_items == cfg.num_items and shape.dense_dim == cfg.dense_dim
    assert shape.user_features == cfg.user_features
    assert shape.item_attributes == cfg.item_attributes
    with pytest.raises(ValueError, match="--model: no model 'nope'"):
        read_model_shape(model_repo, "nope")


def test_request_mix_is_valid_and_skewed(workload: ModuleType, model_repo: Path):
    shape = read_model_shape(model_repo)
    mix = workload.RequestMix(shape, pool=1000, seed=3)
    rng = random.Random(0)
    reqs = [mix.draw(rng) for _ in range(2000)]
    for r in reqs:
        assert 1 <= len(r.history) <= shape.history_len
        assert all(0 <= i < shape.num_items for i in r.history)
        sizes = list(shape.user_features.values())
        assert len(r.categorical) == len(sizes)
        assert all(0 <= c < n for c, n in zip(r.categorical, sizes, strict=True))
        assert len(r.dense) == shape.dense_dim and 1 <= r.k <= shape.num_items
        for clause in predicates(parse_filter(r.filter)) if r.filter else []:
            assert set(clause.values) <= set(shape.item_attributes[clause.attribute])
    users = collections.Counter(r.user_id for r in reqs)
    assert users.most_common(1)[0][0] == "u0" and len(users) > 100  # Zipf: a head and a tail
    kinds = collections.Counter(r.label.split("filter=")[1] for r in reqs)
    assert kinds["none"] > kinds["broad"] > kinds["narrow"] > 0
    assert {r.k for r in reqs} == {10, 50, 100, 300}  # 500 capped at the 300 items
    again = workload.RequestMix(shape, pool=1000, seed=3)
    assert again.user(5) == mix.user(5)  # a user always sends the same features
    body = workload.kserve_body(reqs[0])
    assert [t["name"] for t in body["inputs"]][:4] == ["history", "categorical", "dense", "k"]


def test_locust_gets_absolute_paths_since_it_runs_in_the_output_folder(tmp_path, monkeypatch):
    """The CLI's defaults are relative (runs/loadtest, runs/demo/model_repo); locust runs with
    its output folder as working directory, so a relative path given on would point elsewhere."""
    from recserve.loadtest import LoadTestSpec, locust_command

    monkeypatch.chdir(tmp_path)
    spec = LoadTestSpec("127.0.0.1:1", "grpc", Path("repo"), "demo", 1, 1.0, 1.0, Path("out"))
    cmd = locust_command(spec)
    assert cmd[cmd.index("--model-repo") + 1] == str(tmp_path / "repo")
    assert cmd[cmd.index("--csv") + 1] == str(tmp_path / "out" / "locust")
