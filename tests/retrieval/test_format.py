"""Saved formats (``retrieval/format.py``, ``retrieval/index/format.py``): a model folder of every
earlier format loads through ``migrate`` and answers as the code that wrote it answered; this
code writes the current format, which loads unchanged; a newer format is refused naming it.

The fixtures under ``tests/fixtures/formats/`` were written by the code of commit 7aeebd7 (the
last before versions) with ``tests/fixtures/formats/make.py`` (its docstring says how to run it
and what each folder holds); each folder's ``answers.json`` has a batch and the ids that code
answered for it.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from retrieval.artifact import load_model, load_shard, load_whole_model, save_model
from retrieval.config import MODEL_FORMAT
from retrieval.features import make_user_batch
from retrieval.filters import FilterSchema
from retrieval.format import CONFIG_STEPS, STATE_STEPS, load_config, migrate_config
from retrieval.index.format import INDEX_FORMAT, MEASURED, STEPS, migrate
from retrieval.model import RetrievalModel

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "formats"


def answered(model: RetrievalModel, folder: Path) -> tuple[list[list[int]], list[list[int]]]:
    """(ids ``model`` answers for the folder's batch, ids the writing code answered)."""
    record = json.loads((folder / "answers.json").read_text())
    batch = make_user_batch(
        np.array(record["history"]),
        np.array(record["categorical"]),
        np.array(record["dense"], dtype=np.float32),
        FilterSchema(model.config.item_attributes),
        record["filters"],
    )
    with torch.inference_mode():
        ids, _ = model.eval()(batch, record["k"])
    return ids.tolist(), record["ids"]


def test_every_earlier_version_has_a_step():
    assert set(STEPS) == set(range(INDEX_FORMAT))
    assert set(CONFIG_STEPS) == set(STATE_STEPS) == set(range(MODEL_FORMAT))


@pytest.mark.parametrize("name", ["model-7aeebd7", "model-oldest"])
def test_a_folder_of_an_earlier_format_loads_and_answers_as_it_did(name, tmp_path):
    folder = FIXTURES / name
    assert "format" not in json.loads((folder / "config.json").read_text())  # version 0
    model = load_model(folder)
    got, then = answered(model, folder)
    assert got == then
    again = load_model(save_model(model, tmp_path / "now"))  # written in this format
    assert json.loads((tmp_path / "now" / "config.json").read_text())["format"] == MODEL_FORMAT
    assert torch.load(tmp_path / "now" / "model.pt", weights_only=True)["format"] == MODEL_FORMAT
    assert answered(again, folder)[0] == then


def test_the_measurements_leave_the_config_for_the_index_stats():
    saved = json.loads((FIXTURES / "model-7aeebd7" / "config.json").read_text())
    assert set(MEASURED) <= set(saved["index"])  # 7aeebd7 kept them in the config
    index = load_model(FIXTURES / "model-7aeebd7").index
    assert index.stats.recall_curve == tuple(map(tuple, saved["index"]["recall_curve"]))
    assert index.stats.plan_costs == tuple(map(tuple, saved["index"]["plan_costs"]))
    assert index.stats.filter_bound_slack == saved["index"]["filter_bound_slack"]
    assert index.config.nprobe == saved["index"]["nprobe"]  # as tuned
    assert not set(MEASURED) & set(index.config.model_dump())
    assert not set(MEASURED) & set(migrate_config(saved, 0)["index"])


def test_the_oldest_folder_loads_with_what_it_searched_with():
    model = load_model(FIXTURES / "model-oldest")
    index = model.index
    assert model.config.recent_len == 0  # written before the field: no recent pool
    assert (index.config.probe, index.config.assign) == ("ip", "l2")
    assert index.config.exact_copy == "float16" and index.exact.dtype == torch.float16
    assert index.scales.dtype == torch.bfloat16  # saved float32
    assert index.list_radius.numel() == index.list_bits.numel() == index.built_sizes.numel() == 0
    assert index.stats.filter_bound_slack == 0 and not index.stats.recall_curve


def test_a_sharded_version_of_an_earlier_format_loads_whole_and_by_shard():
    folder = FIXTURES / "sharded-7aeebd7"
    whole = load_whole_model(folder / "router", folder / "shards")
    got, then = answered(whole, folder)
    assert got == then
    shard = load_shard(folder / "shards" / "0")
    meta = json.loads((folder / "shards" / "0" / "index.json").read_text())
    assert shard.stats.plan_costs == tuple(map(tuple, meta["config"]["plan_costs"]))
    router = load_model(folder / "router").index  # the statistics-only index keeps them too
    assert router.stats.recall_curve == whole.index.stats.recall_curve != ()


def test_an_index_of_an_earlier_format_inside_this_model_format_is_migrated(tmp_path):
    """The index carries its own version: a model.pt of this model format whose index was
    saved before its ``filter_sample`` (index format 1) loads, the sample read off its
    signatures, and answers as before."""
    model = load_model(FIXTURES / "model-7aeebd7")
    folder = save_model(model, tmp_path / "now")
    state = torch.load(folder / "model.pt", weights_only=True)
    sample = state.pop("index.filter_sample")
    state["index._extra_state"] = {**state["index._extra_state"], "format": 1}
    torch.save(state, folder / "model.pt")
    again = load_model(folder)
    assert torch.equal(again.index.filter_sample, sample) and sample.shape[0] > 0
    assert (
        answered(again, FIXTURES / "model-7aeebd7")[0]
        == answered(model, FIXTURES / "model-7aeebd7")[0]
    )


def test_a_state_of_this_format_passes_unchanged():
    index = load_model(FIXTURES / "model-7aeebd7").index
    state = index.state_dict()
    assert migrate(state, INDEX_FORMAT) == state


def test_a_newer_format_is_refused_naming_it(tmp_path):
    folder = tmp_path / "future"
    shutil.copytree(FIXTURES / "model-7aeebd7", folder)
    cfg = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**cfg, "format": MODEL_FORMAT + 1}))
    with pytest.raises(ValueError, match=r"config.json: format 2 was written by a newer"):
        load_model(folder)
    index = load_model(FIXTURES / "model-7aeebd7").index
    state = index.state_dict()
    state["_extra_state"] = {**state["_extra_state"], "format": INDEX_FORMAT + 1}
    with pytest.raises(
        ValueError, match=f"index state: format {INDEX_FORMAT + 1} was written by a newer"
    ):
        index.load_state_dict(state)


def test_a_bad_saved_config_names_the_file_and_field(tmp_path):
    folder = tmp_path / "bad"
    shutil.copytree(FIXTURES / "model-7aeebd7", folder)
    cfg = json.loads((folder / "config.json").read_text())
    cfg["index"]["nprobe"] = 0
    (folder / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=r"config.json: index.nprobe: must be >= 1, got 0"):
        load_config(folder / "config.json")
