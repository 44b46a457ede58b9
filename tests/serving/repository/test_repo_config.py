"""config.pbtxt: built with Triton's ModelConfig protobuf, written and parsed as text format."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tritonclient.grpc import model_config_pb2 as mc

from serving.repository.config import (
    format_config,
    make_config,
    parse_config,
    read_config,
    upgrade_config,
    write_config,
)
from serving.types import INPUTS, OUTPUTS


def test_tensor_interface_matches_the_serving_table(tiny) -> None:
    cfg = make_config("demo", tiny.prep.config)
    assert [i.name for i in cfg.input] == list(INPUTS)
    assert [o.name for o in cfg.output] == list(OUTPUTS)
    by_name = {t.name: t for t in [*cfg.input, *cfg.output]}
    mcfg = tiny.prep.config
    expect = {
        "history": (mc.TYPE_INT64, [-1], False),
        "categorical": (mc.TYPE_INT64, [len(mcfg.user_features)], False),
        "dense": (mc.TYPE_FP32, [mcfg.dense_dim], False),
        "k": (mc.TYPE_INT32, [1], False),
        "filter": (mc.TYPE_STRING, [1], True),
        "seen": (mc.TYPE_INT64, [-1], True),
        "item_ids": (mc.TYPE_INT64, [-1], False),
        "scores": (mc.TYPE_FP32, [-1], False),
    }
    for name, (dtype, dims, optional) in expect.items():
        t = by_name[name]
        assert (t.data_type, list(t.dims)) == (dtype, dims), name
        if name in INPUTS:
            assert t.optional == optional, name
    assert cfg.backend == "python" and cfg.max_batch_size == 64
    assert cfg.version_policy.latest.num_versions == 1
    db = cfg.dynamic_batching  # work-conserving by default: no delay, no preferred sizes
    assert cfg.HasField("dynamic_batching")
    assert list(db.preferred_batch_size) == [] and db.max_queue_delay_microseconds == 0
    assert db.default_queue_policy.max_queue_size == 1024


def test_round_trip_through_a_file(tiny, tmp_path: Path) -> None:
    cfg = make_config(
        "demo",
        tiny.prep.config,
        max_batch_size=16,
        preferred_batch_sizes=(4,),
        versions_latest=2,
        parameters={"torch_threads": "1", "note": 'quote " and \\ backslash'},
    )
    path = write_config(tmp_path / "config.pbtxt", cfg)
    assert read_config(path) == cfg
    assert read_config(path).parameters["note"].string_value == 'quote " and \\ backslash'
    assert [p.name for p in tmp_path.iterdir()] == ["config.pbtxt"]  # no temp file left


@settings(max_examples=30, deadline=None)
@given(
    mbs=st.integers(1, 1024),
    delay=st.integers(0, 10**7),
    queue=st.integers(0, 10**6),
    latest=st.integers(1, 10),
    params=st.dictionaries(st.text(min_size=1, max_size=8), st.text(max_size=16), max_size=3),
)
def test_round_trip_property(tiny, mbs, delay, queue, latest, params) -> None:
    cfg = make_config(
        "m",
        tiny.prep.config,
        max_batch_size=mbs,
        max_queue_delay_us=delay,
        preferred_batch_sizes=(1, mbs),
        max_queue_size=queue,
        versions_latest=latest,
        parameters=params,
    )
    assert parse_config(format_config(cfg)) == cfg


def test_malformed_pbtxt_names_file_and_line(tmp_path: Path) -> None:
    path = tmp_path / "config.pbtxt"
    path.write_text('name: "demo"\nmax_batch_size: 8\nmax_batch_sise: 3\n')
    with pytest.raises(ValueError, match=r"config\.pbtxt: line 3, column \d+: .*max_batch_sise"):
        read_config(path)
    path.write_text('name: "demo"\ninput {\n  name: "x"\n  data_type: TYPE_NOPE\n}\n')
    with pytest.raises(ValueError, match=r"line 4.*TYPE_NOPE"):
        read_config(path)
    path.write_text("max_batch_size: 8\n")
    with pytest.raises(ValueError, match=r"config\.pbtxt: name: missing"):
        read_config(path)
    with pytest.raises(FileNotFoundError, match=r"nope\.pbtxt"):
        read_config(tmp_path / "nope.pbtxt")


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"max_batch_size": 0}, "max_batch_size"),
        ({"max_queue_delay_us": -1}, "max_queue_delay_us"),
        ({"max_queue_size": -1}, "max_queue_size"),
        ({"versions_latest": 0}, "versions_latest"),
        ({"max_batch_size": 8, "preferred_batch_sizes": (16,)}, "preferred_batch_sizes"),
    ],
)
def test_bad_arguments_name_the_field(tiny, kwargs, field) -> None:
    with pytest.raises(ValueError, match=f"^{field}:"):
        make_config("demo", tiny.prep.config, **kwargs)


def test_a_config_published_before_seen_lists_gets_them_declared_at_load(tiny) -> None:
    def older(raw_ids: bool) -> mc.ModelConfig:
        cfg = make_config("demo", tiny.prep.config, raw_ids=raw_ids)
        kept = [t for t in cfg.input if t.name not in ("seen", "raw_seen")]
        del cfg.input[:]
        cfg.input.extend(kept)
        return cfg

    plain = upgrade_config(older(False), raw_ids=False)
    assert plain == make_config("demo", tiny.prep.config)
    assert upgrade_config(plain, raw_ids=False) is plain
    mapped = upgrade_config(older(True), raw_ids=True)
    declared = {t.name: (t.data_type, t.optional) for t in mapped.input}
    today = make_config("demo", tiny.prep.config, raw_ids=True)
    assert declared == {t.name: (t.data_type, t.optional) for t in today.input}
    assert [t.name for t in mapped.output].count("raw_item_ids") == 1
    assert upgrade_config(today, raw_ids=True) is today
    assert upgrade_config(mc.ModelConfig(name="demo"), raw_ids=True) == mc.ModelConfig(name="demo")
