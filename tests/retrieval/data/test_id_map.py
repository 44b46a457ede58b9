"""IdMap: raw ids of either type <-> dense ids, both ways vectorised; the files round-trip."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from retrieval.data.id_map import IdMap, IdMaps

RAW = st.one_of(
    st.lists(st.integers(-(2**62), 2**62), min_size=1, max_size=40),
    st.lists(st.text(min_size=0, max_size=6), min_size=1, max_size=40),
)


@settings(max_examples=60, deadline=None)
@given(RAW)
def test_dense_ids_are_0_to_n_and_map_back(values: list) -> None:
    m = IdMap.from_values("item_id", pa.array(values))
    distinct = sorted(set(values))
    assert m.raw.to_pylist() == distinct  # ascending raw order
    dense = m.to_dense(values)  # [B]
    assert dense.dtype == np.int64 and sorted(set(dense.tolist())) == list(range(len(distinct)))
    assert m.to_raw(dense).to_pylist() == values
    assert m.to_raw(torch.as_tensor(dense)).to_pylist() == values  # a tensor answer too


def test_unknown_ids_are_minus_one_or_refused_by_name() -> None:
    m = IdMap.from_values("item_id", pa.array(["b", "a"]))
    assert m.lookup(["a", "zz", "b"]).tolist() == [0, -1, 1]
    with pytest.raises(ValueError, match=r"history: 'zz' \(position 1\) is not a known item_id"):
        m.to_dense(["a", "zz"], "history")


def test_types_do_not_mix_silently() -> None:
    ints = IdMap.from_values("user_id", pa.array([7, 3]))
    assert ints.lookup(pa.array(["7"])).tolist() == [-1]  # text is no integer id
    strings = IdMap.from_values("user_id", pa.array(["7", "3"]))
    assert strings.lookup(pa.array([7])).tolist() == [1]  # an integer asked as its text
    with pytest.raises(ValueError, match="integers or strings"):
        IdMap("user_id", pa.array([1.5]))


def test_answers_keep_pads_as_nulls() -> None:
    m = IdMap.from_values("item_id", pa.array(["x", "y", "z"]))
    lists = m.to_raw_lists(np.array([[2, 0, -1], [1, -1, -1]]))  # [B=2, K=3]
    assert lists.to_pylist() == [["z", "x", None], ["y", None, None]]
    with pytest.raises(ValueError, match="dense id 3 >= 3"):
        m.to_raw(np.array([3]))


def test_duplicates_and_nulls_are_refused() -> None:
    with pytest.raises(ValueError, match="'a' appears twice"):
        IdMap("item_id", pa.array(["a", "b", "a"]))
    with pytest.raises(ValueError, match="1 nulls"):
        IdMap("item_id", pa.array(["a", None]))


def test_files_round_trip_and_a_lone_file_is_refused(tmp_path: Path) -> None:
    maps = IdMaps(
        IdMap.from_values("user_id", pa.array([10, 2])),
        IdMap.from_values("item_id", pa.array(["p", "q"])),
    )
    maps.write(tmp_path)
    back = IdMaps.read(tmp_path)
    assert back is not None
    assert back.users.raw.to_pylist() == [2, 10] and back.items.raw.to_pylist() == ["p", "q"]
    assert IdMaps.read(tmp_path / "nothing") is None
    (tmp_path / "user_ids.parquet").unlink()
    with pytest.raises(ValueError, match=r"user_ids\.parquet: missing"):
        IdMaps.read(tmp_path)
