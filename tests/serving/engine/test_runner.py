"""ModelRunner: one forward per batch, per-request errors, K slicing, history window."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from retrieval.features import make_user_batch
from serving.engine.runner import ModelRunner
from serving.limits import LimitsConfig
from serving.types import ModelNotFoundError, RecResult, RequestError, UnavailableError
from sharded_tables.remote.client import RemoteLookupError


def forward(tiny, reqs, k, filters=None):
    """The reference: the model called directly on the requests' windowed tensors."""
    h = tiny.prep.config.history_len
    hist = np.full((len(reqs), h), -1, np.int64)
    for row, r in enumerate(reqs):
        hist[row, : len(r.history[:h])] = r.history[:h]
    batch = make_user_batch(
        hist,
        np.stack([r.categorical for r in reqs]),
        np.stack([r.dense for r in reqs]),
        tiny.model.index.schema,
        filters,
    )
    with torch.inference_mode():
        ids, scores = tiny.model(batch, k)
    return ids.numpy(), scores.numpy()


def test_results_equal_one_forward_and_are_sliced_to_each_k(tiny):
    runner = ModelRunner(tiny.model, "demo", 3)
    reqs = [tiny.request(0, k=3), tiny.request(1, k=7), tiny.request(2, k=5)]
    out = runner.run(reqs)
    ids, scores = forward(tiny, reqs, 7)
    for row, (req, res) in enumerate(zip(reqs, out, strict=True)):
        assert isinstance(res, RecResult)
        assert (res.model, res.version) == ("demo", 3)
        assert res.item_ids.shape == (req.k,) and res.item_ids.dtype == np.int64
        np.testing.assert_array_equal(res.item_ids, ids[row, : req.k])
        np.testing.assert_allclose(res.scores, scores[row, : req.k])


def test_a_bad_filter_fails_only_its_own_request(tiny):
    runner = ModelRunner(tiny.model, "demo", 1)
    good_filter = "language in {en, fr} and available"
    reqs = [
        tiny.request(0, filter=good_filter),
        tiny.request(1, filter="language in {en"),  # syntax
        tiny.request(2, filter="colour = red"),  # unknown attribute
        tiny.request(3, filter="language = klingon"),  # unknown value
        tiny.request(4),
    ]
    out = runner.run(reqs)
    for bad in out[1:4]:
        assert isinstance(bad, RequestError) and str(bad).startswith("filter")
    assert "colour" in str(out[2]) and "klingon" in str(out[3])
    ids, _ = forward(tiny, [reqs[0], reqs[4]], 10, [good_filter, None])
    np.testing.assert_array_equal(out[0].item_ids, ids[0])
    np.testing.assert_array_equal(out[4].item_ids, ids[1])


def test_history_is_trimmed_to_the_newest_and_padded(tiny):
    runner = ModelRunner(tiny.model, "demo", 1)
    h = tiny.prep.config.history_len
    long = tiny.request(5)
    long.history = np.arange(40, 40 + 3 * h, dtype=np.int64)  # newest first: keep 40..40+h
    short = tiny.request(6)
    short.history = np.array([7, 9], np.int64)
    empty = tiny.request(7)
    empty.history = np.zeros(0, np.int64)
    out = runner.run([long, short, empty])
    ids, _ = forward(tiny, [long, short, empty], 10)
    for row in range(3):
        np.testing.assert_array_equal(out[row].item_ids, ids[row])
    # the window is what counts: the trimmed history gives the same answer
    trimmed = tiny.request(5)
    trimmed.history = long.history[:h].copy()
    np.testing.assert_array_equal(runner.run([trimmed])[0].item_ids, out[0].item_ids)
    # already-seen items of the window never come back
    assert not set(out[0].item_ids.tolist()) & set(long.history[:h].tolist())


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"k": 0}, "k"),
        ({"k": 301}, "k"),
        ({"categorical": np.zeros(2, np.int64)}, "categorical"),
        ({"categorical": np.array([0, 0, 99], np.int64)}, "categorical"),
        ({"dense": np.zeros(5, np.float32)}, "dense"),
        ({"dense": np.array([np.nan, 0, 0], np.float32)}, "dense"),
        ({"history": np.array([1, 300], np.int64)}, "history"),
        ({"history": np.array([1.0, 2.0])}, "history"),
    ],
)
def test_bad_inputs_name_the_field_and_spare_the_batch(tiny, change, field):
    runner = ModelRunner(tiny.model, "demo", 1)
    bad = tiny.request(0)
    for name, value in change.items():
        setattr(bad, name, value)
    with pytest.raises(RequestError, match=f"^{field}"):
        runner.admit(bad)
    out = runner.run([bad, tiny.request(1)])
    assert isinstance(out[0], RequestError) and isinstance(out[1], RecResult)


def test_unknown_model_or_version_is_not_found(tiny):
    runner = ModelRunner(tiny.model, "demo", 2)
    with pytest.raises(ModelNotFoundError, match=r"^model: 'other' is not served here"):
        runner.admit(tiny.request(0, model="other"))
    with pytest.raises(ModelNotFoundError, match=r"^version: demo version 1 is not loaded"):
        runner.admit(tiny.request(0, version=1))
    runner.admit(tiny.request(0, model="demo", version=2))


def test_a_checked_filter_text_is_not_parsed_again_but_other_limits_check_it_afresh(
    tiny, monkeypatch
):
    import serving.engine.runner as runner_module

    runner = ModelRunner(tiny.model, "demo", 1)
    text = "language in {en, fr} and available"
    parsed = []
    real = runner_module.parse_filter
    monkeypatch.setattr(runner_module, "parse_filter", lambda t: parsed.append(t) or real(t))
    first = runner.admit(tiny.request(0, filter=text)).clauses
    assert runner.admit(tiny.request(1, filter=text)).clauses == first and parsed == [text]
    with pytest.raises(RequestError, match="max_filter_clauses"):  # its own limits: parsed again
        runner.admit(tiny.request(2, filter=text), LimitsConfig(max_filter_clauses=1))
    bad = tiny.request(3, filter="language = klingon")
    for _ in range(2):  # a refused text is not kept
        with pytest.raises(RequestError, match="klingon"):
            runner.admit(bad)
    assert parsed == [text, "language = klingon", "language = klingon"]


def test_warmup_runs(tiny):
    ModelRunner(tiny.model, "demo", 1).warmup((1, 3))


def test_an_admission_runs_on_its_runner_unchecked_and_another_runner_admits_it_again(
    tiny, monkeypatch
):
    runner, other = ModelRunner(tiny.model, "demo", 1), ModelRunner(tiny.model, "demo", 2)
    limits = LimitsConfig(max_filter_clauses=4)
    admission = runner.admit(tiny.request(3, 5, filter="available"), limits)
    assert admission.runner is runner and admission.limits is limits
    calls = []
    for r in (runner, other):
        monkeypatch.setattr(
            r,
            "admit",
            lambda q, lim=None, r=r: calls.append((r, lim)) or ModelRunner.admit(r, q, lim),
        )
    (first,) = runner.run([admission])
    (second,) = other.run([admission])  # a hot swap between the edge and the batch
    assert calls == [(other, limits)]  # admitted again, within the limits of the edge
    assert np.array_equal(first.item_ids, second.item_ids)


def test_a_request_pinned_to_a_version_swapped_out_before_its_batch_is_not_found(tiny):
    old, new = ModelRunner(tiny.model, "demo", 1), ModelRunner(tiny.model, "demo", 2)
    pinned, loose = old.admit(tiny.request(0, version=1)), old.admit(tiny.request(1))
    out = new.run([pinned, loose])
    assert isinstance(out[0], ModelNotFoundError) and str(out[0]).startswith("version: demo")
    assert isinstance(out[1], RecResult) and out[1].version == 2


def test_an_embedding_server_in_trouble_is_unavailable_and_a_caller_bug_is_not(tiny, monkeypatch):
    """The engine knows the tables' retryable error type only, not the remote client's codes."""
    import grpc

    from sharded_tables.remote.client import lookup_error

    runner = ModelRunner(tiny.model, "demo", 1)
    for code, expected in (
        (grpc.StatusCode.UNAVAILABLE, UnavailableError),
        (grpc.StatusCode.DEADLINE_EXCEEDED, UnavailableError),
        (grpc.StatusCode.INVALID_ARGUMENT, RemoteLookupError),
    ):
        error = lookup_error(code, "127.0.0.1:1", "down")

        def fail(*args, error=error):
            raise error

        monkeypatch.setattr(runner, "forward", fail)
        with pytest.raises(expected) as got:
            runner.run([tiny.request(0)])
        assert isinstance(got.value, UnavailableError) == (expected is UnavailableError)
        assert "127.0.0.1:1" in str(got.value)


@pytest.mark.gpu
def test_a_model_on_the_gpu_answers_as_on_the_cpu(tiny):
    """`serve --device cuda`: requests go up through pinned memory, the tower, tables and the
    Triton scan run on the GPU, and the answers equal the CPU model's."""
    import copy

    gpu = ModelRunner(copy.deepcopy(tiny.model).to("cuda"), "demo", 3)
    assert gpu.device.type == "cuda"
    reqs = [tiny.request(i, k=20) for i in range(8)]
    want = ModelRunner(tiny.model, "demo", 3).run(reqs)
    for got, ref in zip(gpu.run(reqs), want, strict=True):
        assert isinstance(got, RecResult) and isinstance(ref, RecResult)
        np.testing.assert_allclose(got.scores, ref.scores, rtol=1e-4, atol=1e-4)
        assert len(set(got.item_ids) & set(ref.item_ids)) >= 19


def _graphed_runner(model, version: int = 3) -> ModelRunner:
    """A runner whose forward goes through the whole-forward graphs (the CPU's eager "graph")
    on the device backend, as a runner on a GPU does."""
    import copy

    from retrieval.artifact import served_on
    from retrieval.graphed_forward import GraphedForward

    m = copy.copy(model)
    m.index = copy.copy(model.index)
    m.index.executor = copy.copy(model.index.executor)
    served_on(m.index, "cuda")  # the backend a load onto a GPU chooses
    runner = ModelRunner(m, "demo", version, max_batch=8)
    assert runner.graphed is None  # on the CPU a runner keeps the eager forward
    runner.graphed = GraphedForward(m, 8)
    return runner


def test_a_graphed_runner_warms_every_bucket_and_answers_as_the_eager_one(tiny):
    runner = _graphed_runner(tiny.model)
    runner.warmup()
    assert {key[0] for key in runner.graphed._entries} == {1, 2, 4, 8}
    recorded = runner.graphed.records
    reqs = [tiny.request(i, k=9, filter="language = en" if i % 2 else None) for i in range(6)]
    want = ModelRunner(tiny.model, "demo", 3).run(reqs)
    for got, ref in zip(runner.run(reqs), want, strict=True):
        assert isinstance(got, RecResult) and isinstance(ref, RecResult)
        np.testing.assert_array_equal(got.item_ids, ref.item_ids)
        np.testing.assert_allclose(got.scores, ref.scores, rtol=1e-5, atol=1e-5)
    assert runner.graphed.records == recorded  # a warmed bucket, K bucket and shape: no new one


@pytest.mark.gpu
def test_a_model_loaded_on_the_gpu_serves_through_the_whole_forward_graph(tiny):
    import copy

    from retrieval.artifact import served_on

    model = copy.deepcopy(tiny.model).to("cuda")
    served_on(model.index, "cuda")
    gpu = ModelRunner(model, "demo", 3)
    assert gpu.graphed is not None
    gpu.warmup()
    reqs = [tiny.request(i, k=20, filter="language = en" if i % 2 else None) for i in range(8)]
    want = ModelRunner(tiny.model, "demo", 3).run(reqs)
    for got, ref in zip(gpu.run(reqs), want, strict=True):
        assert isinstance(got, RecResult) and isinstance(ref, RecResult)
        assert len(set(got.item_ids) & set(ref.item_ids)) >= 19
