"""The Triton Python backend without Triton: input checks, one forward per execute, and the
lifecycle driven through a stand-in ``triton_python_backend_utils``."""

from __future__ import annotations

import json
import sys
import types
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from serving.repository.repository import ModelRepository
from serving.repository.triton_python_model import (
    InputError,
    TritonPythonModel,
    check_inputs,
    run_rows,
)

USERS = np.arange(5)


def test_rows_answer_like_the_model(tiny) -> None:
    """Two requests (different K, one with a filter) in one forward == the model per request."""
    a = tiny.inputs(USERS[:3], k=4)
    b = tiny.inputs(USERS[3:], k=7)
    b["filter"] = np.array([[b"available"], [b""]], dtype=object)
    rows = [check_inputs(a, tiny.model), check_inputs(b, tiny.model)]
    (ids_a, sc_a), (ids_b, _) = run_rows(tiny.model, rows)
    assert ids_a.shape == sc_a.shape == (3, 4) and ids_b.shape == (2, 7)
    assert ids_a.dtype == np.int64 and sc_a.dtype == np.float32
    np.testing.assert_array_equal(ids_a, tiny.expected(tiny.model, USERS[:3], 4)[0])
    want_b = tiny.expected(tiny.model, USERS[3:], 7, ["available", None])[0]
    np.testing.assert_array_equal(ids_b, want_b)


def test_a_negated_category_inside_an_or_answers_like_the_model(tiny) -> None:
    """ "category != news or language = fr": a clause with a "none of these bits" part reaches
    the forward (``UserBatch.filter_none``) as the model's own batch carries it."""
    text = "category != news or language = fr"
    req = tiny.inputs(USERS[:2], k=6)
    req["filter"] = np.array([[text.encode()]] * 2, dtype=object)
    ((ids, _),) = run_rows(tiny.model, [check_inputs(req, tiny.model)])
    np.testing.assert_array_equal(ids, tiny.expected(tiny.model, USERS[:2], 6, [text] * 2)[0])


def test_rows_with_smaller_k_are_padded(tiny) -> None:
    req = tiny.inputs(USERS[:2], k=6)
    req["k"] = np.array([[6], [2]], dtype=np.int32)
    ((ids, scores),) = run_rows(tiny.model, [check_inputs(req, tiny.model)])
    assert (ids[1, 2:] == -1).all() and np.isneginf(scores[1, 2:]).all()
    np.testing.assert_array_equal(ids[1, :2], tiny.expected(tiny.model, USERS[1:2], 2)[0][0])


def test_history_is_cut_and_padded_to_the_models_window(tiny) -> None:
    h = tiny.prep.config.history_len
    req = tiny.inputs(USERS[:1])
    long = dict(req, history=np.concatenate([req["history"], np.zeros((1, 5), np.int64)], 1))
    short = dict(req, history=req["history"][:, :3])
    assert check_inputs(long, tiny.model).history.shape == (1, h)
    np.testing.assert_array_equal(check_inputs(long, tiny.model).history, req["history"])
    got = check_inputs(short, tiny.model).history
    np.testing.assert_array_equal(got[:, :3], req["history"][:, :3])
    assert (got[:, 3:] == -1).all()


def _bad(tiny) -> list[tuple[str, dict[str, Any]]]:
    req = tiny.inputs(USERS[:2])
    f, dd = len(tiny.prep.config.user_features), tiny.prep.config.dense_dim
    return [
        ("history: missing", {k: v for k, v in req.items() if k != "history"}),
        ("history: expected int64", dict(req, history=req["history"].astype(np.int32))),
        (
            "history: feature 'history': id 300 is out of range",
            dict(req, history=np.full((2, 3), 300)),
        ),
        ("categorical: missing", {k: v for k, v in req.items() if k != "categorical"}),
        (
            f"categorical: expected shape \\[2, {f}\\]",
            dict(req, categorical=np.zeros((2, f + 1), np.int64)),
        ),
        ("categorical: feature 'user_", dict(req, categorical=np.full((2, f), 99, np.int64))),
        ("dense: expected float32", dict(req, dense=req["dense"].astype(np.float64))),
        ("dense: contains NaN", dict(req, dense=np.full((2, dd), np.nan, np.float32))),
        ("k: must be in \\[1, 300\\], got 0", dict(req, k=np.zeros((2, 1), np.int32))),
        ("k: must be in \\[1, 300\\], got 301", dict(req, k=np.full((2, 1), 301, np.int32))),
        ("k: expected shape", dict(req, k=np.ones((3, 1), np.int32))),
        (
            "filter: unknown attribute 'colour'",
            dict(req, filter=np.array([[b"colour = red"]] * 2, object)),
        ),
        ("filter: dangling .and.", dict(req, filter=np.array([[b"available and"], [b""]], object))),
        ("filter: not UTF-8", dict(req, filter=np.array([[b"\xff"], [b""]], object))),
        ("filter: expected shape", dict(req, filter=np.array([[b""]], object))),
    ]


def test_seen_rows_are_never_recommended_and_requests_without_them_share_the_forward(tiny):
    """Two requests, one with seen lists of two widths (-1 pads), one without: each row answers
    like the model given the same padded seen rows."""
    a = tiny.inputs(USERS[:2], k=8)
    top, _ = tiny.expected(tiny.model, USERS[:2], 8)
    a["seen"] = np.array([top[0, :5], [top[1, 0], top[1, 3], -1, -1, -1]], dtype=np.int64)
    b = tiny.inputs(USERS[2:], k=8)
    rows = [check_inputs(a, tiny.model), check_inputs(b, tiny.model)]
    assert rows[1].seen is None
    (ids_a, _), (ids_b, _) = run_rows(tiny.model, rows)
    batch = tiny.prep.user_batch(USERS)
    seen = np.full((len(USERS), 5), -1, dtype=np.int64)  # [B, S]
    seen[:2] = a["seen"]
    batch.seen = torch.from_numpy(seen)
    with torch.inference_mode():
        want, _ = tiny.model(batch, 8)
    np.testing.assert_array_equal(np.concatenate([ids_a, ids_b]), want.numpy())
    for row in range(2):
        assert not set(ids_a[row]) & set(a["seen"][row][a["seen"][row] >= 0])
    n = tiny.prep.config.num_items
    for bad, message in (([[-3]], "item id -3"), ([[n]], f"item id {n} is not in")):
        with pytest.raises(InputError, match=f"^seen: {message}"):
            check_inputs(dict(b, seen=np.array(bad * 3, dtype=np.int64)), tiny.model)
    with pytest.raises(InputError, match=r"^seen: expected shape \[3, n\]"):
        check_inputs(dict(b, seen=np.zeros((2, 1), np.int64)), tiny.model)
    with pytest.raises(InputError, match=r"^raw_seen: the model has no id maps"):
        check_inputs(dict(b, raw_seen=np.array([[b"x"]] * 3, dtype=object)), tiny.model)


def test_bad_inputs_name_the_tensor(tiny) -> None:
    for message, arrays in _bad(tiny):
        with pytest.raises(InputError, match=f"^{message}"):
            check_inputs(arrays, tiny.model)


# ---- the lifecycle through a stand-in of Triton's utils module -----------------------------------
@dataclass
class FakeTensor:
    name: str
    array: np.ndarray

    def as_numpy(self) -> np.ndarray:
        return self.array


@dataclass
class FakeResponse:
    output_tensors: list[FakeTensor]
    error: Any = None


class FakeError:
    INVALID_ARG = 3

    def __init__(self, message: str, code: int | None = None):
        self.message, self.code = message, code


def _fake_utils() -> types.ModuleType:
    m = types.ModuleType("triton_python_backend_utils")
    m.Tensor = FakeTensor  # type: ignore[attr-defined]
    m.InferenceResponse = FakeResponse  # type: ignore[attr-defined]
    m.TritonError = FakeError  # type: ignore[attr-defined]
    m.get_input_tensor_by_name = lambda req, name: (  # type: ignore[attr-defined]
        FakeTensor(name, req[name]) if name in req else None
    )
    return m


def test_initialize_execute_finalize(tiny, tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setitem(sys.modules, "triton_python_backend_utils", _fake_utils())
    repo = ModelRepository(tmp_path)
    repo.publish("demo", tiny.model, parameters={"torch_threads": "1"})
    backend = TritonPythonModel()
    backend.initialize(
        {
            "model_config": json.dumps({"parameters": {"torch_threads": {"string_value": "1"}}}),
            "model_instance_kind": "CPU",
            "model_instance_device_id": "0",
            "model_repository": str(tmp_path / "demo"),
            "model_version": "1",
            "model_name": "demo",
        }
    )
    good = tiny.inputs(USERS[:2], k=3)
    _, bad = _bad(tiny)[8]
    other = tiny.inputs(USERS[2:], k=5)
    out = backend.execute([good, bad, other])
    assert len(out) == 3
    assert out[0].error is None and out[2].error is None
    assert out[1].error.code == FakeError.INVALID_ARG and out[1].error.message.startswith("k:")
    ids = {t.name: t.array for t in out[0].output_tensors}["item_ids"]
    np.testing.assert_array_equal(ids, tiny.expected(tiny.model, USERS[:2], 3)[0])
    ids = {t.name: t.array for t in out[2].output_tensors}["item_ids"]
    np.testing.assert_array_equal(ids, tiny.expected(tiny.model, USERS[2:], 5)[0])
    backend.finalize()


def test_named_users_are_answered_as_if_they_sent_their_lists(tiny):
    """A model with a seen store: rows naming their ``user`` (``-1``: none) equal the model
    given those users' stored lists; a model without a store refuses ``user``."""
    stored = tiny.with_seen_store()
    a = tiny.inputs(USERS[:2], k=8)
    a["user"] = np.array([[int(USERS[0])], [-1]], dtype=np.int64)
    b = tiny.inputs(USERS[2:], k=8)
    rows = [check_inputs(a, stored), check_inputs(b, stored)]
    (ids_a, _), (ids_b, _) = run_rows(stored, rows)
    batch = tiny.prep.user_batch(USERS)
    batch.user = torch.tensor([int(USERS[0])] + [-1] * (len(USERS) - 1))
    with torch.inference_mode():
        want, _ = stored(batch, 8)
    np.testing.assert_array_equal(np.concatenate([ids_a, ids_b]), want.numpy())
    with pytest.raises(InputError, match=r"^user: the model keeps no seen store"):
        check_inputs(a, tiny.model)
    with pytest.raises(InputError, match=r"^user: a user index is >= 0"):
        check_inputs(dict(a, user=np.array([[-2], [0]], dtype=np.int64)), stored)
