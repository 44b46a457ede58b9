"""Fuzzing the config files: ``config.pbtxt`` (parse_config / read_config, and the batching
policy the server derives from it), ``serve.toml`` (ServeConfig) and ``train.toml`` (RunConfig).

Every input is either loaded, and then usable (numbers finite and in the ranges the consumers
take: gRPC's C ints, Python's longest wait), or refused with a ``ValueError`` that names the file
or the field; never another exception.
"""

from __future__ import annotations

import json
import math
import re
import typing
from dataclasses import fields
from pathlib import Path
from types import SimpleNamespace

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from retrieval.data import SyntheticConfig
from retrieval.index.ivf import IVFConfig
from retrieval.training.config import RunConfig, TrainConfig
from serving.app.config import (
    MAX_C_INT,
    MAX_WAIT_S,
    BatchingConfig,
    ConfigError,
    RouterConfig,
    ServeConfig,
)
from serving.repository.config import format_config, make_config, parse_config, read_config

FUZZ = settings(
    max_examples=300,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
SOURCE = "demo/config.pbtxt"
VALID_PBTXT = format_config(
    make_config(
        "demo",
        SimpleNamespace(user_features={"region": 6, "age": 7}, dense_dim=3, seen_store=False),  # type: ignore[arg-type]
        max_queue_delay_us=2000,  # not 0: proto3 text leaves zeros out, and the fuzzing edits it
        parameters={"torch_threads": "1"},
    )
)


# ---- config.pbtxt ------------------------------------------------------------------------------
PBTXT_TOKENS = [
    "{", "}", ":", '"', "'", "\\", "[", "]", "<", ">", "#", "\n", " ", "-", ".", "e", "0", "x",
    "18446744073709551616", "-9223372036854775809", "1e999", "nan", "inf", "TYPE_NOPE",
    "max_batch_size: ", "dims: ", "name: ", "input {", "[inference.x] {",
    "[type.googleapis.com/inference.ModelConfig] {", "\\x", "\\u12", "\\777", "\x00", "é", "\ud800",
]  # fmt: skip
NUMBERS = ["18446744073709551615", "2147483648", "-1", "0", "18446744073709551616", "1.5", "1e9"]
PBTXT_FIELDS = [
    'parameters { key: "torch_threads" value { string_value: "x" } }',
    'input { name: "extra" data_type: TYPE_FP64 dims: [-5] }', "unknown_field: 1",
    "instance_group [{ count: -1 kind: KIND_GPU }]", "max_batch_size: 3",
]  # fmt: skip
"""Fields to append: repeated ones (the text stays well-formed), or a second max_batch_size."""


BATCHING_FIELDS = ("max_batch_size", "preferred_batch_size", "max_queue_delay_microseconds",
                   "max_queue_size")  # fmt: skip
"""The fields of config.pbtxt that the server's batching policy reads."""


@st.composite
def pbtxt_texts(draw: st.DrawFn) -> str:
    """The valid config with its batching values replaced (it still parses, mostly), or with
    1-3 random edits (cut, insert, delete, duplicate a line, append a field), or random text."""
    kind = draw(st.sampled_from(["values", "edits", "text"]))
    if kind == "text":
        return draw(st.text(max_size=200))
    text = VALID_PBTXT
    if kind == "values":  # each batching field the server reads: kept or replaced
        for name in BATCHING_FIELDS:
            m = re.search(name + r": (-?\d+)", text)
            if m and draw(st.integers(0, 2)) == 0:
                value = draw(st.sampled_from(NUMBERS) | st.integers(-1, 2**64 - 1).map(str))
                text = text[: m.start(1)] + value + text[m.end(1) :]
        return text
    for _ in range(draw(st.integers(1, 3))):
        at = draw(st.integers(0, len(text)))
        op = draw(st.sampled_from(["number", "append", "insert", "delete", "cut", "line"]))
        numbers = list(re.finditer(r"(?<=: )-?\d+", text))  # a field's value
        if op == "number" and numbers:  # syntax intact, value anywhere in (and out of) range
            m = numbers[draw(st.integers(0, len(numbers) - 1))]
            value = draw(st.sampled_from(NUMBERS) | st.integers(-(2**64), 2**64).map(str))
            text = text[: m.start()] + value + text[m.end() :]
        elif op == "append":
            text += "\n" + draw(st.sampled_from(PBTXT_FIELDS))
        elif op == "insert":
            text = text[:at] + draw(st.sampled_from(PBTXT_TOKENS) | st.text(max_size=5)) + text[at:]
        elif op == "delete":
            text = text[:at] + text[at + draw(st.integers(1, 20)) :]
        elif op == "cut":
            text = text[:at]
        else:
            lines = text.splitlines(keepends=True) or [""]
            i = draw(st.integers(0, len(lines) - 1))
            text = "".join([*lines[: i + 1], lines[i], *lines[i + 1 :]])
    return text


# protobuf's text parser decodes string escapes with Python's, which warns on "\e"
@pytest.mark.filterwarnings("ignore:invalid escape sequence:DeprecationWarning")
@FUZZ
@given(pbtxt_texts())
def test_config_pbtxt_parses_or_names_the_file(text):
    try:
        cfg = parse_config(text, SOURCE)
    except ValueError as e:
        event("refused")
        assert str(e).startswith(f"{SOURCE}: "), e
        return
    event("parsed")
    try:  # what the server derives from it (serving.app.server: cfg.batching.policy(config))
        policy = BatchingConfig().policy(cfg)
    except ConfigError as e:
        event("policy refused")
        assert str(e).startswith("config.pbtxt dynamic batching: "), e
        return
    assert policy.max_batch_size >= 1
    assert 0 <= policy.max_queue_delay_s <= MAX_WAIT_S


@pytest.mark.parametrize("delay_us", [18446744073709551615, 86_400_000_001])
def test_a_config_pbtxt_queue_delay_over_a_day_is_refused(delay_us):
    """Found while fuzzing: it became the batcher's wait, past what Python can wait
    (OverflowError in the batcher thread: no request of the model answered again)."""
    cfg = parse_config(VALID_PBTXT, SOURCE)
    cfg.dynamic_batching.max_queue_delay_microseconds = delay_us
    with pytest.raises(ConfigError, match=r"^config.pbtxt dynamic batching: max_queue_delay_mi"):
        BatchingConfig().policy(parse_config(format_config(cfg), SOURCE))


@settings(max_examples=50, deadline=None, database=None)
@given(st.binary(max_size=100))
def test_config_pbtxt_files_of_random_bytes_name_the_file(tmp_path_factory, data):
    path = tmp_path_factory.mktemp("pbtxt") / "config.pbtxt"
    path.write_bytes(data)
    try:
        read_config(path)
    except ValueError as e:
        assert str(e).startswith(f"{path}: "), e


# ---- TOML --------------------------------------------------------------------------------------
def toml_value(v: object) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, float):
        return (
            "nan" if math.isnan(v) else ("inf" if v > 0 else "-inf") if math.isinf(v) else repr(v)
        )
    if isinstance(v, int):
        return str(v)
    if isinstance(v, str):
        return json.dumps(v, ensure_ascii=False)  # a TOML basic string (mostly: not with DEL)
    if isinstance(v, list):
        return "[" + ", ".join(map(toml_value, v)) + "]"
    assert isinstance(v, dict)
    return "{" + ", ".join(f"{toml_key(k)} = {toml_value(x)}" for k, x in v.items()) + "}"


def toml_key(k: str) -> str:
    return k if re.fullmatch(r"[A-Za-z0-9_-]+", k) else json.dumps(k, ensure_ascii=False)


def toml_document(top: dict[str, object], tables: dict[str, dict[str, object]]) -> str:
    lines = [f"{toml_key(k)} = {toml_value(v)}" for k, v in top.items()]
    for name, table in tables.items():
        lines.append(f"[{toml_key(name)}]")
        lines += [f"{toml_key(k)} = {toml_value(v)}" for k, v in table.items()]
    return "\n".join(lines) + "\n"


texts = st.text(st.characters(exclude_categories=["Cs"]), max_size=10)  # no lone surrogates
JUNK = [
    "\udcff\udcfe[batching]\n",  # bytes 0xff 0xfe: not UTF-8
    "a = " + "[" * 3000,  # deeper than tomllib's recursion
    "a = " + "{b = " * 3000,
    "[batching\n",
    "x = 1\nx = 2\n",
]
"""Files that are no TOML at all."""
scalars = st.one_of(
    st.integers(-5, 70_000),
    st.sampled_from([0, -1, 2**31 - 1, 2**31, 2**63 - 1, -(2**63)]),
    st.floats(-10, 1e5),
    st.sampled_from([math.nan, math.inf, -math.inf, 1e300, -0.0, 0.5]),
    st.booleans(),
    texts,
    st.sampled_from(["", ".", "/nonexistent", "a\x00b", "h:1"]),
)
values = st.recursive(
    scalars,
    lambda kids: st.lists(kids, max_size=3) | st.dictionaries(texts, kids, max_size=2),
    max_leaves=6,
)


def keys_of(cls: type) -> list[str]:
    """Field names of a config: a pydantic model (``model_fields``) or a dataclass."""
    model_fields = getattr(cls, "model_fields", None)
    return list(model_fields) if model_fields is not None else [f.name for f in fields(cls)]


SERVE_KEYS = [k for k in keys_of(ServeConfig) if k not in ("batching", "router")]
FIELD = re.compile(
    r"(--config|[A-Za-z_][\w.]*)(\[(?:\d+|'.*?'|\".*?\")\])*(, [\w.]+)*( \(--[\w/-]+\))?: "
)
"""An error message's start: the field (or fields) it is about, and the flag that sets it."""


EDGE_INTS = st.sampled_from([2**31, 2**63 - 1, -(2**63), 2**31 - 1, 65_536, 65_535, -1, 0, 1])
EDGE_FLOATS = st.sampled_from([math.nan, math.inf, -math.inf, 1e300, 86_400.0, 86_400_001.0, -0.0])


def of_type(hint: object) -> st.SearchStrategy[object]:
    """Values of a field's type, edges first (``hint``: a ServeConfig / BatchingConfig /
    RouterConfig field type)."""
    args = typing.get_args(hint)
    if args and type(None) in args:  # X | None: TOML has no null
        return of_type(next(a for a in args if a is not type(None)))
    if typing.get_origin(hint) is list:
        return st.lists(of_type(args[0]), max_size=3)
    if hint is int:
        return EDGE_INTS | st.integers(0, 70_000)
    if hint is float:
        return EDGE_FLOATS | st.floats(0, 1e5)
    if hint is bool:
        return st.booleans()
    return st.sampled_from(["127.0.0.1:1", "", "h:1"]) | texts  # str, Path


@st.composite
def serve_tomls(draw: st.DrawFn, repo: Path) -> str:
    """serve.toml: known keys with values of their type (edges likely) or anything, unknown
    keys, or junk."""
    if draw(st.integers(0, 9)) == 0:
        return draw(st.sampled_from(JUNK) | st.text(max_size=80))

    def table(cls: type, keys: list[str]) -> dict[str, object]:
        hints = typing.get_type_hints(cls)
        return {
            k: draw(values)
            if k == "nope" or draw(st.integers(0, 4)) == 0
            else draw(of_type(hints[k]))
            for k in keys
        }

    rnd = draw(st.randoms(use_true_random=False))  # picks keys evenly (sampled_from favours
    # the first of a list)

    def some(keys: list[str]) -> list[str]:
        return rnd.sample([*keys, "nope"], k=draw(st.integers(0, 2)))

    top = table(ServeConfig, some(SERVE_KEYS))
    if draw(st.integers(0, 5)):
        top["model_repo"] = str(repo)
    tables = {}
    for name, cls in (("batching", BatchingConfig), ("router", RouterConfig)):
        if draw(st.booleans()):
            tables[name] = table(cls, some(keys_of(cls)))
            if name == "router" and draw(st.booleans()):
                tables[name]["shards"] = [["127.0.0.1:1"]]
    return toml_document(top, tables)


@FUZZ
@given(st.data())
def test_serve_toml_loads_or_names_the_field(tmp_path, data):
    repo = tmp_path / "repo"
    (repo / "demo").mkdir(parents=True, exist_ok=True)
    (repo / "demo" / "config.pbtxt").write_text('name: "demo"\n')
    path = tmp_path / "serve.toml"
    text = data.draw(serve_tomls(repo), label="serve.toml")
    path.write_bytes(text.encode("utf-8", "surrogateescape"))  # "\udcff": the byte 0xff
    try:
        cfg = ServeConfig.from_toml(path)
        cfg.validate()
        policy = cfg.batching.policy()
    except ConfigError as e:
        message = str(e).removeprefix(f"{path}: ")
        named = FIELD.match(message)
        event(f"refused: {named.group(1) if named else message[:30]}")
        assert named, f"names no field: {e}"
        return
    event("loaded")
    for name in ("poll_s", "drain_timeout_s", "close_linger_s"):
        assert 0 <= getattr(cfg, name) <= MAX_WAIT_S, name
    assert 0 < cfg.max_receive_message_bytes <= MAX_C_INT
    assert 0 <= cfg.torch_threads <= MAX_C_INT
    assert 0 <= policy.max_queue_delay_s <= MAX_WAIT_S
    if cfg.router is not None:
        for name in ("shard_deadline_ms", "embedding_timeout_ms", "hedge_after_ms"):
            assert 0 <= getattr(cfg.router, name) <= MAX_WAIT_S * 1000, name


TABLES = list(RunConfig.model_fields)
TRAIN_KEYS = {
    "data": ["source", "data_dir", *keys_of(SyntheticConfig)],
    "model": ["user_features", "history_len", "hidden", "embedding_dim", "index", "out_dim",
              "temperature", "head_tasks", "num_items", "table_plan"],
    "train": keys_of(TrainConfig),
    "evaluate": ["k", "users"],
    "publish": ["model_repo", "name", "shards", "table_dtype"],
}  # fmt: skip


@st.composite
def train_tomls(draw: st.DrawFn) -> str:
    if draw(st.integers(0, 9)) == 0:
        return draw(st.sampled_from(JUNK) | st.text(max_size=80))
    tables = {}
    for name in draw(st.lists(st.sampled_from([*TABLES, "nope"]), max_size=3, unique=True)):
        keys = draw(st.lists(st.sampled_from([*TRAIN_KEYS.get(name, []), "nope"]), max_size=3))
        table = {}
        for k in keys:
            table[k] = draw(values)
            if k == "index" and draw(st.booleans()):
                table[k] = {draw(st.sampled_from(keys_of(IVFConfig))): draw(values)}
        tables[name] = table
    return toml_document({}, tables)


@FUZZ
@given(train_tomls())
def test_train_toml_loads_or_names_the_field(tmp_path_factory, text):
    path = tmp_path_factory.mktemp("train") / "train.toml"
    path.write_bytes(text.encode("utf-8", "surrogateescape"))  # "\udcff": the byte 0xff
    try:
        cfg = RunConfig.from_toml(path)
    except ConfigError as e:
        message = str(e).removeprefix(f"{path}: ")
        named = FIELD.match(message)
        event(f"refused: {named.group(1) if named else message[:30]}")
        assert named and named.group(1).split(".")[0] in ("--config", *TABLES, "nope"), e
        return
    event("loaded")
    assert isinstance(cfg.train, TrainConfig)
    assert type(cfg.train.batch_size) is int and cfg.train.batch_size >= 1  # typed and in range
    k, users = cfg.evaluate.k, cfg.evaluate.users
    assert type(k) is int and k >= 1 and type(users) is int and users >= 0


def test_the_shipped_serve_toml_still_loads():
    cfg = ServeConfig.from_toml(Path(__file__).parents[3] / "deploy/k8s/base/serve.toml")
    assert cfg.router is not None and cfg.batching.policy().max_batch_size == 32
    cfg.router.validate()


@pytest.mark.parametrize(
    ("text", "field"),
    [
        ("poll_s = nan", "poll_s"),
        ("poll_s = inf", "poll_s"),
        ("drain_timeout_s = 1e300", "drain_timeout_s"),
        ("max_receive_message_bytes = 4294967296", "max_receive_message_bytes"),
        ("torch_threads = 2147483648", "torch_threads"),
        ("[batching]\nmax_queue_delay_ms = inf", "batching.max_queue_delay_ms"),
        ("[router]\nshards = [['h:1']]\nshard_deadline_ms = inf", "router.shard_deadline_ms"),
        ("a = " + "[" * 3000 + "]" * 3000, "--config"),
        ("\udcff = 1", "--config"),
        ("[batching]\n':' = 1", "batching[':']"),  # a key that is no identifier: quoted
    ],
)
def test_values_that_broke_the_server_are_refused_naming_the_field(tmp_path, text, field):
    """Each was loaded (and broke the server later: OverflowError in a waiting thread, in
    grpc.server or torch.set_num_threads) or raised RecursionError / UnicodeDecodeError (not
    naming the file) before these fixes."""
    (tmp_path / "demo").mkdir()
    (tmp_path / "demo" / "config.pbtxt").write_text('name: "demo"\n')
    path = tmp_path / "serve.toml"
    path.write_bytes(f'model_repo = "{tmp_path}"\n{text}\n'.encode("utf-8", "surrogateescape"))
    flag = r"( \(--[\w-]+\))?"
    with pytest.raises(
        ConfigError, match=rf"^({re.escape(str(path))}: )?{re.escape(field)}{flag}: "
    ):
        cfg = ServeConfig.from_toml(path)
        cfg.validate()
    if field == "--config":  # the training config's loader reads TOML alike
        with pytest.raises(ConfigError, match=rf"^--config: {re.escape(str(path))} is not valid"):
            RunConfig.from_toml(path)
