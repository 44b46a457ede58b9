"""The served forward on the index's device backend (the plan decided on the device, every round
in fixed shapes: ``retrieval/index/device_search.py``), run on CPU tensors: it answers what the
host-planned forward answers, it runs under the device discipline for every batch bucket with
and without filters and seen items, and it compiles as one graph (``fullgraph=True``). A copy of
the device path with a planted ``.item()`` fails, naming the op and the line. The backend follows
the device a model is loaded on; the whole forward graphed per bucket (``graphed_forward.py``, its
capture eager on the CPU) answers as the eager forward in every bucket, under the discipline, and
records anew after an update."""

from __future__ import annotations

import copy
import dataclasses
import importlib.util
import inspect
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from common.device_discipline import DeviceDiscipline, DeviceSyncError
from retrieval.artifact import load_model, save_model, served_on
from retrieval.data import SyntheticConfig, generate
from retrieval.features import UserBatch
from retrieval.graphed_forward import GraphedForward
from retrieval.index import device_search as device_module
from retrieval.index import live_index
from retrieval.index.compaction import fold
from retrieval.index.cuda_graphs import MAX_BATCH, bucket, inside_whole_graph, run_graphed
from retrieval.index.executor import BACKEND_ENV, Executor, backend_for
from retrieval.live_updates import with_index
from retrieval.model import RetrievalModel
from retrieval.seen_store import SeenStore
from retrieval.training.prepare import Prepared, prepare
from support.topk_check import assert_same_topk

BUCKETS = [bucket(b) for b in (1, 2, 3, 5, 9, 17)]
FILTER = "language in {en, fr} and available"
NARROW = "not age_rating = '18+' and language = de"


@pytest.fixture(scope="module", params=["plain", "head"])
def served(request) -> tuple[Prepared, RetrievalModel]:
    ds = generate(SyntheticConfig(num_users=64, num_items=2500, seed=5))
    prep = prepare(ds, history_len=8)
    prep.config.index.measure_costs = False  # priced as a GPU prices it (device_plan.py)
    prep.config.index.nlist = 24
    prep.config.seen_store = True
    if request.param == "head":
        prep.config.scoring_head = True
    torch.manual_seed(0)
    model = RetrievalModel(prep.config)
    model.build_index(prep.train.item_features, ds.item_attributes)
    assert prep.seen is not None
    model.seen_store = SeenStore.from_sets(prep.seen)
    return prep, model.eval()


def batch_of(prep: Prepared, b: int, filtered: bool, seen: bool) -> UserBatch:
    users = np.arange(b) % prep.dataset.num_users
    filters = [FILTER if i % 2 else NARROW for i in range(b)] if filtered else None
    batch = prep.user_batch(users, filters, seen=prep.seen if seen else None)
    return dataclasses.replace(batch, user=torch.from_numpy(users.astype(np.int64)))


def on_device(model: RetrievalModel) -> RetrievalModel:
    m = copy.copy(model)  # shares the modules; only the index's backend differs
    m.index = copy.copy(model.index)
    m.index.executor = copy.copy(model.index.executor)
    m.index.executor.backend = "device"
    return m


@pytest.mark.parametrize(("filtered", "seen"), [(False, False), (True, True)])
def test_each_bucket_under_the_discipline_answers_as_the_host(served, filtered, seen) -> None:
    prep, model = served
    device = on_device(model)
    assert max(BUCKETS) <= MAX_BATCH
    for b in BUCKETS:
        batch = batch_of(prep, b, filtered, seen)
        with torch.inference_mode():
            want = model(batch, 20)
            with DeviceDiscipline():
                got = device(batch, 20, checked=True)
        assert_same_topk(*got, *want)


@pytest.mark.parametrize("served", ["head"], indirect=True)  # the whole forward: head included
def test_the_bucketed_forward_compiles_as_one_graph(served) -> None:
    prep, model = served
    device = on_device(model)
    torch._dynamo.reset()
    forward = torch.compile(device, fullgraph=True, backend="aot_eager")
    with torch.inference_mode():
        for b, filtered in ((4, False), (4, True)):
            batch = batch_of(prep, b, filtered, True)
            assert_same_topk(*forward(batch, 10, checked=True), *model(batch, 10))


@pytest.mark.parametrize("served", ["plain"], indirect=True)
def test_a_planted_item_fails_naming_the_op_and_the_line(served, tmp_path: Path) -> None:
    """A copy of the device search with one host read planted after its plan: the discipline
    stops it there, and names the op and the copy's line."""
    prep, model = served
    source = inspect.getsource(device_module)
    anchor = "    ip = qs @ t.centroids.T  # [B, L]\n"
    assert anchor in source
    planted = "    widest = int(plan.nprobe.max().item())  # planted\n"
    path = tmp_path / "planted_device_search.py"
    path.write_text(source.replace(anchor, planted + anchor))
    spec = importlib.util.spec_from_file_location("planted_device_search", path)
    assert spec is not None and spec.loader is not None
    copy_module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = copy_module
    try:
        spec.loader.exec_module(copy_module)
        index = model.index
        q = model.user_vectors(batch_of(prep, 2, False, False))
        params = index.params(10)
        copy_module.device_search(index.tensors(), q, None, params)  # runs outside the mode
        # no_grad, not inference_mode: the mode then sees the op .item() decomposes to
        with torch.no_grad(), DeviceDiscipline(), pytest.raises(DeviceSyncError) as err:
            copy_module.device_search(index.tensors(), q, None, params)
    finally:
        del sys.modules[spec.name]
    line = path.read_text().splitlines().index(planted.rstrip("\n")) + 1
    assert "aten._local_scalar_dense" in str(err.value)
    assert f"{path}:{line} in device_search" in str(err.value)


def test_the_backend_follows_the_device_and_the_variable_overrides(monkeypatch) -> None:
    monkeypatch.delenv(BACKEND_ENV, raising=False)
    assert backend_for("cuda") == backend_for(torch.device("cuda", 0)) == "device"
    assert backend_for("cpu") == "auto"
    monkeypatch.setenv(BACKEND_ENV, "device")
    assert backend_for("cpu") == "device"
    monkeypatch.setenv(BACKEND_ENV, "auto")
    assert backend_for("cuda") == "auto"


@pytest.mark.parametrize("served", ["plain"], indirect=True)
def test_a_model_loaded_on_the_cpu_keeps_auto_and_an_update_keeps_its_backend(
    served, tmp_path: Path, monkeypatch
) -> None:
    monkeypatch.delenv(BACKEND_ENV, raising=False)
    _, model = served
    saved = on_device(model)  # saved with the device backend: the load chooses anew
    save_model(saved, tmp_path / "m")
    loaded = load_model(tmp_path / "m", "cpu")
    assert loaded.index.executor.backend == "auto"
    served_on(loaded.index, "cuda")  # what a load onto a GPU chooses (no GPU needed)
    assert loaded.index.executor.backend == "device"
    fresh = copy.copy(loaded.index)
    fresh.executor = Executor()  # an update's new index has its own executor: "auto"
    assert with_index(loaded, fresh).index.executor.backend == "device"


def disciplined(run):
    """A recorder whose "graph" runs the recorded forward under the device discipline."""

    def replay():
        with DeviceDiscipline():
            return run()

    return replay


@pytest.mark.slow
@pytest.mark.parametrize(("filtered", "seen"), [(False, False), (True, True)])
def test_the_graphed_forward_answers_as_the_eager_one_in_every_bucket(
    served, filtered, seen
) -> None:
    """Each batch padded to its bucket, the whole forward recorded once per bucket (and run
    under the discipline), the answer unpadded: the host-planned forward's answer."""
    prep, model = served
    graphed = GraphedForward(on_device(model), max_batch=32, recorder=disciplined)
    with torch.inference_mode():
        for b in (1, 2, 3, 4, 5, 9, 17):
            batch = batch_of(prep, b, filtered, seen)
            got = graphed(batch, 20)
            assert got[0].shape == (b, 20)
            assert_same_topk(*got, *model(batch, 20))
    assert graphed.records == len({bucket(b) for b in (1, 2, 3, 4, 5, 9, 17)})  # 3, 4 share one
    assert not graphed.accepts(batch_of(prep, 33, filtered, seen))  # past the largest bucket


@pytest.mark.parametrize("served", ["head"], indirect=True)
def test_an_update_records_the_served_buckets_anew(served) -> None:
    """A live update's model records the buckets the served one had, and answers as its own
    eager forward (the removed items gone); an index written in place records anew too."""
    prep, model = served
    graphed = GraphedForward(on_device(model), max_batch=8)
    with torch.inference_mode():
        for b in (1, 3):
            graphed(batch_of(prep, b, True, True), 10)
    assert graphed.records == 2
    gone = model.index.item_ids[:50].clone()
    updated = with_index(model, fold(live_index.remove(model.index, gone)))
    again = GraphedForward(on_device(updated), max_batch=8)
    again.record_like(graphed)
    assert again.records == 2
    with torch.inference_mode():
        batch = batch_of(prep, 3, True, True)
        ids, scores = again(batch, 10)
        assert again.records == 2  # recorded before the first batch
        assert_same_topk(ids, scores, *updated(batch, 10))
        assert not torch.isin(ids, gone).any()
    with torch.no_grad():
        again.model.index.list_radius.mul_(1.0)  # written in place: a new version
    with torch.inference_mode():
        again(batch, 10)
    assert again.records == 3


def test_run_graphed_inside_the_whole_graph_calls_the_search_directly() -> None:
    calls = []

    def fn(q: torch.Tensor) -> tuple[torch.Tensor]:
        calls.append(q.shape)
        return (q * 2,)

    q = torch.ones(3, 4)
    with inside_whole_graph():
        (out,) = run_graphed(object(), "k", fn, (q,), ())
    assert calls == [(3, 4)] and torch.equal(out, q * 2)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("served", ["head"], indirect=True)
def test_the_whole_forward_captures_as_a_cuda_graph(served) -> None:
    prep, model = served
    gpu = copy.deepcopy(model).to("cuda")  # its own modules: the fixture's stay on the CPU
    served_on(gpu.index, "cuda")
    graphed = GraphedForward(gpu, max_batch=8)
    with torch.inference_mode():
        for b, filtered in ((1, False), (5, True)):
            batch = batch_of(prep, b, filtered, True)
            assert_same_topk(*graphed(batch, 10), *model(batch, 10), atol=1e-3)
    assert graphed.records == 2
