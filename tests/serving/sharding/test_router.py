"""The router over document shard servers (in this process, real gRPC on loopback): its answer
equals the unsharded model's; a missing shard makes it partial, never a hang or an error."""

from __future__ import annotations

import logging
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from retrieval.index.ivf import IVFIndex
from serving.app.config import RouterConfig, ServeConfig
from serving.app.server import Server
from serving.repository.repository import ModelRepository
from serving.sharding.shard_server import ShardServer, ShardServicer
from serving.types import RecResult, RequestError, UnavailableError
from support.topk_check import assert_same_topk

FILTERS = [None, "category in {news, music}", "language = fr and region = eu and available"]


class Cluster:
    """A published sharded version, its shard servers and a router, all in this process."""

    def __init__(self, root: Path, wide, shards: int = 2, **router: object):
        self.repo = ModelRepository(root)
        self.version = self.repo.publish("demo", wide.model, shards=shards)
        self.shards = [ShardServer(self.repo, "demo", s, poll_s=0) for s in range(shards)]
        addresses = [[s.start()] for s in self.shards]
        router = {"shard_deadline_ms": 5000.0, **router}  # a busy CI machine is no partial answer
        cfg = RouterConfig(shards=addresses, **router)  # type: ignore[arg-type]
        self.router = Server(
            ServeConfig(model_repo=root, model="demo", grpc_port=0, poll_s=0, router=cfg)
        )
        self.router.start()
        assert self.router.state is not None
        self.state = self.router.state

    def close(self) -> None:
        self.router.drain_and_stop(timeout=5)
        for s in self.shards:
            s.stop(0)


@pytest.fixture(scope="module")
def cluster(wide, tmp_path_factory):
    c = Cluster(tmp_path_factory.mktemp("repo"), wide, shards=3, shard_deadline_ms=10_000.0)
    yield c
    c.close()


@pytest.mark.parametrize("k", [10, 1000, 10_000])
@pytest.mark.parametrize("text", FILTERS)
def test_routed_top_k_equals_unsharded(cluster, wide, k, text):
    users = np.arange(6)
    want_ids, want_scores = wide.expected(wide.model, users, k, [text] * len(users))
    futures = [cluster.state.submit(wide.request(int(u), k, filter=text)) for u in users]
    for row, fut in enumerate(futures):
        res = fut.result(timeout=30)
        assert not res.partial and res.version == cluster.version
        assert_same_topk(
            torch.from_numpy(res.item_ids[None]),
            torch.from_numpy(res.scores[None]),
            torch.from_numpy(want_ids[row : row + 1]),
            torch.from_numpy(want_scores[row : row + 1]),
        )


@pytest.mark.parametrize("text", [None, FILTERS[1]])
def test_routed_answers_with_seen_lists_equal_unsharded(cluster, wide, text):
    """Every shard skips the seen items inside its scan (``FilterBatch.exclude`` on the wire):
    equal to the whole model given the same seen lists."""
    users, k, s = np.arange(6), 20, 40
    top, _ = wide.expected(wide.model, users, 2 * s, [text] * len(users))
    rng = np.random.default_rng(0)
    seen = np.stack(  # [B, S]: half from each user's own top items, half random
        [
            rng.permutation(np.r_[row[::4][: s // 2], rng.choice(1000, s // 2, replace=False)])
            for row in top
        ]
    ).astype(np.int64)
    batch = wide.prep.user_batch(users, [text] * len(users))
    batch.seen = torch.from_numpy(seen)
    with torch.inference_mode():
        want_ids, want_scores = wide.model(batch, k)
    assert not torch.equal(want_ids, torch.from_numpy(top[:, :k]))  # the seen lists matter
    futures = [
        cluster.state.submit(wide.request(int(u), k, filter=text, seen=seen[row]))
        for row, u in enumerate(users)
    ]
    for row, fut in enumerate(futures):
        res = fut.result(timeout=30)
        assert not res.partial and not set(res.item_ids.tolist()) & set(seen[row].tolist())
        assert_same_topk(
            torch.from_numpy(res.item_ids[None]),
            torch.from_numpy(res.scores[None]),
            want_ids[row : row + 1],
            want_scores[row : row + 1],
        )


def test_the_router_holds_no_items(cluster, wide):
    model = cluster.router.host.current().model
    assert model.index.item_ids.numel() == 0 and model.index.ntotal == wide.model.index.ntotal
    for checked in (False, True):  # a caller that checked its requests still hears it
        with pytest.raises(ValueError, match="router part of a document-sharded version"):
            model(wide.prep.user_batch(np.arange(2)), 5, checked=checked)


def test_a_dead_shard_makes_answers_partial_within_the_deadline(wide, tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="serving.engine.batching")
    c = Cluster(tmp_path, wide, shards=2, shard_deadline_ms=300.0)
    try:
        c.shards[1].stop(0)
        start = time.monotonic()
        res = c.state.recommend(wide.request(0, 50))
        assert time.monotonic() - start < 2.0
        assert isinstance(res, RecResult) and res.partial and res.missing == ["shard-1"]
        kept = set(c.repo.load_shard("demo", c.version, 0)[0].item_ids.tolist())
        assert set(res.item_ids[res.item_ids >= 0].tolist()) <= kept
        c.shards[0].stop(0)
        with pytest.raises(UnavailableError, match="no shard answered"):
            c.state.recommend(wide.request(0, 50))
        # an expected failure of a routed batch: one line, no traceback
        (line,) = [r for r in caplog.records if r.name == "serving.engine.batching"]
        assert line.exc_info is None and "no shard answered" in line.getMessage()
    finally:
        c.close()


def test_a_router_warms_up_on_shards_slower_than_its_deadline_and_then_holds_requests_to_it(
    wide, tmp_path, monkeypatch
):
    """A big catalog's warm-up batch can outlast the shard deadline (10M items on 2 cores): the
    warm-up waits for it, and requests after it keep the deadline."""
    real, slow = ShardServicer.Search, {0, 1}

    def search(self, request, context):
        if self.server.shard in slow:
            time.sleep(0.4)
        return real(self, request, context)

    monkeypatch.setattr(ShardServicer, "Search", search)
    c = Cluster(tmp_path, wide, shards=2, shard_deadline_ms=150.0)  # warms up on the slow one
    try:
        assert c.state.host.version == c.version
        slow.discard(0)
        start = time.monotonic()
        res = c.state.recommend(wide.request(0, 20))
        assert time.monotonic() - start < 0.4 and res.partial and res.missing == ["shard-1"]
        slow.clear()
        res = c.state.recommend(wide.request(0, 20))
        assert not res.partial
    finally:
        c.close()


def test_the_router_refuses_a_huge_filter_before_parsing_it(cluster, wide):
    huge = " and ".join(["category in {news, music}"] * 10_000)
    start = time.monotonic()
    with pytest.raises(RequestError, match=r"\(limits\.max_filter_bytes\)$"):
        cluster.state.submit(wide.request(0, 10, filter=huge))
    assert time.monotonic() - start < 0.05
    many = " and ".join(["available"] * 65)
    with pytest.raises(RequestError, match=r"more than 64 clauses \(limits\.max_filter_clauses\)"):
        cluster.state.submit(wide.request(0, 10, filter=many))


def test_a_replica_takes_over_from_a_dead_one(wide, tmp_path):
    repo = ModelRepository(tmp_path)
    repo.publish("demo", wide.model, shards=1)
    a, b = (ShardServer(repo, "demo", 0, poll_s=0) for _ in range(2))
    addresses = [a.start(), b.start()]
    router = Server(
        ServeConfig(
            model_repo=tmp_path,
            model="demo",
            grpc_port=0,
            poll_s=0,
            # a generous deadline: this is about fail-over, not timing on a busy machine
            router=RouterConfig(shards=[addresses], hedge_after_ms=20.0, shard_deadline_ms=5000.0),
        )
    )
    router.start()
    try:
        a.stop(0)
        assert router.state is not None
        for u in range(4):  # whichever replica goes first, the answer is whole
            res = router.state.recommend(wide.request(u, 20))
            assert not res.partial
    finally:
        router.drain_and_stop(timeout=5)
        b.stop(0)


def test_the_router_moves_to_a_version_only_once_every_shard_holds_it(wide, tmp_path):
    c = Cluster(tmp_path, wide, shards=2)
    try:
        v2 = c.repo.publish("demo", wide.build(1), shards=2)
        assert c.shards[0].poll_once() == v2
        assert c.router.host.poll_once() is None  # shard 1 has only the old version
        res = c.state.recommend(wide.request(0, 10))
        assert (res.version, res.partial) == (c.version, False)  # shard 0 kept the old one
        assert c.shards[1].poll_once() == v2
        assert c.router.host.poll_once() == v2
        res = c.state.recommend(wide.request(0, 10))
        assert (res.version, res.partial) == (v2, False)
    finally:
        c.close()


def test_the_router_stays_while_a_shard_has_no_replica_that_answers(wide, tmp_path):
    """A shard that cannot be asked cannot confirm a version: the router keeps the one it
    serves instead of moving to what the other shards hold."""
    c = Cluster(tmp_path, wide, shards=2)
    try:
        c.shards[1].stop(0)
        v2 = c.repo.publish("demo", wide.build(1), shards=2)
        assert c.shards[0].poll_once() == v2
        assert c.router.host.poll_once() is None
        assert c.router.host.version == c.version
    finally:
        c.close()


def test_a_routed_request_is_counted_by_every_shard_and_by_the_router(cluster, wide):
    """One unfiltered request is one round: each shard counts an OK search, and the router a
    round trip and an answer per shard (series kept per label set: two in a row count twice)."""
    router = cluster.state.metrics.registry

    def counts() -> list[tuple[float, float, float]]:
        out = []
        for s, shard in enumerate(cluster.shards):
            labels = {"model": "demo", "shard": str(s)}
            ok = {**labels, "code": "OK"}
            mine = {**labels, "replica": shard.address}
            out.append(
                (
                    shard.metrics.registry.get_sample_value(
                        "recserve_shard_search_requests_total", ok
                    )
                    or 0.0,
                    router.get_sample_value("recserve_shard_latency_seconds_count", labels) or 0.0,
                    router.get_sample_value("recserve_replica_answers_total", mine) or 0.0,
                )
            )
        return out

    before = counts()
    for _ in range(2):
        assert not cluster.state.submit(wide.request(0, 10)).result(timeout=30).partial
    assert counts() == [(a + 2, b + 2, c + 2) for a, b, c in before]


def test_a_shard_refuses_a_version_it_does_not_hold(cluster, wide):
    import grpc

    from serving.protos import shard_pb2, shard_pb2_grpc

    with (
        grpc.insecure_channel(cluster.shards[0].address) as channel,
        pytest.raises(grpc.RpcError) as err,
    ):
        shard_pb2_grpc.ShardStub(channel).Search(
            shard_pb2.SearchRequest(model="demo", version=99), timeout=5
        )
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert f"holds versions [{cluster.version}], not 99" in err.value.details()


def test_a_shard_refuses_bytes_that_are_no_request_with_invalid_argument(cluster):
    import grpc

    with (
        grpc.insecure_channel(cluster.shards[0].address) as channel,
        pytest.raises(grpc.RpcError) as err,
    ):
        search = channel.unary_unary("/recserve.shard.v1.Shard/Search")
        search(b"\xff\xff\xff\xff", timeout=5)  # a field key whose varint never ends
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT  # gRPC alone says INTERNAL
    assert err.value.details().startswith("request: not a valid recserve.shard.v1.SearchRequest")


def test_a_shard_searches_every_batch_size_before_it_reports_serving(wide, tmp_path, monkeypatch):
    repo = ModelRepository(tmp_path)
    repo.publish("demo", wide.model, shards=2)
    searched: list[tuple[int, bool]] = []
    real = IVFIndex.item_candidates

    def counted(self, q, fb, plan, with_vectors=False):
        searched.append((q.shape[0], fb.active))
        return real(self, q, fb, plan, with_vectors)

    monkeypatch.setattr(IVFIndex, "item_candidates", counted)
    server = ShardServer(repo, "demo", 0, poll_s=0)
    server.start()
    server.stop(0)
    assert set(searched) == {(1, False), (1, True), (8, False), (8, True)}


def test_a_shard_that_cannot_search_a_version_refuses_it(wide, tmp_path, monkeypatch):
    repo = ModelRepository(tmp_path)
    repo.publish("demo", wide.model, shards=2)

    def broken(*_: object, **__: object) -> None:
        raise RuntimeError("codes do not match the lists")

    monkeypatch.setattr(IVFIndex, "item_candidates", broken)
    with pytest.raises(FileNotFoundError, match="no version with a loadable shard 0"):
        ShardServer(repo, "demo", 0, poll_s=0).start()


def test_shards_listed_in_the_wrong_order_are_refused(wide, tmp_path):
    repo = ModelRepository(tmp_path)
    repo.publish("demo", wide.model, shards=2)
    shards = [ShardServer(repo, "demo", s, poll_s=0) for s in range(2)]
    a, b = (s.start() for s in shards)
    router = Server(
        ServeConfig(
            model_repo=tmp_path, grpc_port=0, poll_s=0, router=RouterConfig(shards=[[b], [a]])
        )
    )
    try:
        with pytest.raises(ValueError, match=r"serves shard 1/2 of 'demo'; expected shard 0/2"):
            router.start()
    finally:
        for s in shards:
            s.stop(0)


def test_publish_refuses_a_map_that_leaves_an_item_out(wide, tmp_path):
    assignment = torch.zeros(wide.prep.config.num_items, dtype=torch.int64)
    assignment[123] = -1
    with pytest.raises(ValueError, match="no shard in"):
        ModelRepository(tmp_path).publish("demo", wide.model, shards=2, assignment=assignment)
    assert ModelRepository(tmp_path).versions("demo") == []


@pytest.mark.parametrize("text", [None, FILTERS[1]])
def test_routed_recall_target_one_is_the_exact_answer_of_every_shard(cluster, wide, text):
    """A request asking recall 1 is planned exact by the router, and the shards' exact scans
    merge to the whole model's exact answer, batched with requests that ask nothing."""
    users, k = np.arange(6), 20
    batch = wide.prep.user_batch(users, [text] * len(users))
    with torch.inference_mode():
        exact_ids, exact_scores = wide.model(batch, k, exact=True)
        plain_ids, plain_scores = wide.model(batch, k)
    targets = [1.0 if u % 2 else 0.0 for u in users]
    futures = [
        cluster.state.submit(wide.request(int(u), k, filter=text, recall_target=t))
        for u, t in zip(users, targets, strict=True)
    ]
    for row, fut in enumerate(futures):
        res = fut.result(timeout=30)
        ids, scores = (exact_ids, exact_scores) if targets[row] else (plain_ids, plain_scores)
        assert not res.partial
        assert_same_topk(
            torch.from_numpy(res.item_ids[None]),
            torch.from_numpy(res.scores[None]),
            ids[row : row + 1],
            scores[row : row + 1],
        )
