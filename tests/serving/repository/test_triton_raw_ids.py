"""A model with id maps in the model repository: its versions' ``config.pbtxt`` declares the raw
id tensors (``history`` optional), and the Triton Python backend takes ``raw_history`` and
answers ``raw_item_ids`` like the recserve servers (without Triton: its functions directly)."""

from __future__ import annotations

import numpy as np
import pytest
from tritonclient.grpc import model_config_pb2 as mc

from serving.repository.config import make_config
from serving.repository.repository import ModelRepository
from serving.repository.triton_python_model import (
    InputError,
    check_inputs,
    raw_outputs,
    run_rows,
)
from support.raw_id_model import raw_item, with_id_maps

USERS = np.arange(4)


def tensors(cfg: mc.ModelConfig) -> dict[str, tuple[int, bool]]:
    return {t.name: (t.data_type, t.optional) for t in cfg.input} | {
        t.name: (t.data_type, False) for t in cfg.output
    }


def test_config_declares_raw_ids_only_for_a_model_with_maps(tiny, tmp_path):
    plain = tensors(make_config("demo", tiny.prep.config))
    assert "raw_history" not in plain and "raw_item_ids" not in plain
    assert "raw_seen" not in plain and plain["seen"] == (mc.TYPE_INT64, True)
    assert plain["history"] == (mc.TYPE_INT64, False)
    raw = tensors(make_config("demo", tiny.prep.config, raw_ids=True))
    assert raw["history"] == (mc.TYPE_INT64, True)
    assert raw["raw_history"] == raw["raw_seen"] == (mc.TYPE_STRING, True)
    assert raw["raw_item_ids"] == (mc.TYPE_STRING, False)
    repo = ModelRepository(tmp_path)
    version = repo.publish("demo", with_id_maps(tiny.model))
    assert tensors(repo.config("demo", version)) == raw
    assert tensors(repo.config("demo")) == raw  # the model-level copy Triton reads


@pytest.mark.parametrize("int_ids", [False, True])
def test_backend_maps_raw_history_and_answers_raw_ids(tiny, int_ids):
    model = with_id_maps(tiny.model, int_ids)
    dense = tiny.inputs(USERS, k=6)
    raw = dict(dense)
    hist = raw.pop("history")  # [B, H], -1 pads
    raw["raw_history"] = np.array(
        [[raw_item(int(i), int_ids).encode() if i >= 0 else b"" for i in row] for row in hist],
        dtype=object,
    )
    rows = check_inputs(raw, model)
    np.testing.assert_array_equal(rows.history, check_inputs(dense, model).history)
    ((ids, _),) = run_rows(model, [rows])
    np.testing.assert_array_equal(ids, tiny.expected(model, USERS, 6)[0])
    out = raw_outputs(model, ids)
    assert out is not None and out.shape == ids.shape
    assert model.id_maps is not None
    want = model.id_maps.items.to_raw(ids).cast("string").fill_null("").to_pylist()
    assert [b.decode() for b in out.reshape(-1)] == want
    assert raw_outputs(tiny.model, ids) is None  # no maps: no output


def test_backend_refuses_bad_raw_history_naming_it(tiny):
    model = with_id_maps(tiny.model)
    base = tiny.inputs(USERS[:1])
    hist = base.pop("history")
    for arrays, message in (
        (dict(base, raw_history=np.array([[b"sku-nope"]], dtype=object)), "item id 'sku-nope'"),
        (dict(base, raw_history=np.array([[b"\xff"]], dtype=object)), "not UTF-8"),
        (dict(base, history=hist, raw_history=np.array([[b""]], dtype=object)), "not both"),
    ):
        with pytest.raises(InputError, match=rf"^raw_history: .*{message}"):
            check_inputs(arrays, model)
    with pytest.raises(InputError, match=r"^raw_history: the model has no id maps"):
        check_inputs(dict(base, raw_history=np.array([[b"x"]], dtype=object)), tiny.model)


def test_backend_maps_raw_seen_like_seen(tiny):
    model = with_id_maps(tiny.model)
    dense = tiny.inputs(USERS, k=6)
    seen = np.array([[5, 9, -1], [1, 2, 3], [-1, -1, -1], [0, 299, 7]], dtype=np.int64)
    text = [[raw_item(int(i)).encode() if i >= 0 else b"" for i in row] for row in seen]
    rows = check_inputs(dict(dense, raw_seen=np.array(text, dtype=object)), model)
    np.testing.assert_array_equal(rows.seen, seen)
    ((ids, _),) = run_rows(model, [rows])
    np.testing.assert_array_equal(
        ids, run_rows(model, [check_inputs(dict(dense, seen=seen), model)])[0][0]
    )
    bad = dict(dense, raw_seen=np.array([[b"sku-nope"]] * len(USERS), dtype=object))
    with pytest.raises(InputError, match=r"^raw_seen: item id 'sku-nope'"):
        check_inputs(bad, model)
    with pytest.raises(InputError, match=r"^raw_seen: give seen or raw_seen, not both"):
        check_inputs(dict(bad, seen=seen), model)
