"""``config.pbtxt``: Triton's ``ModelConfig`` protobuf, built from a retrieval model's config.

The file is protobuf text format of the real Triton message (``tritonclient.grpc.model_config_pb2``),
written and parsed with ``google.protobuf.text_format``, never by hand. The tensor interface is the
one fixed in ``serving/types.py`` (dims without the batch dimension)::

    history      TYPE_INT64   [-1]     recent item ids, newest first (-1 pads)
    categorical  TYPE_INT64   [F]      F = len(model_cfg.user_features)
    dense        TYPE_FP32    [Dd]     Dd = model_cfg.dense_dim
    k            TYPE_INT32   [1]
    filter       TYPE_STRING  [1]      optional
    seen         TYPE_INT64   [-1]     optional: every item the user consumed (-1 pads), never
                                       recommended
    user         TYPE_INT64   [1]      optional, a model with a seen store only: the user whose
                                       stored seen items are excluded too
    item_ids     TYPE_INT64   [-1]     output
    scores       TYPE_FP32    [-1]     output

A model with id maps (``raw_ids=True``) also declares, and makes ``history`` optional::

    raw_history  TYPE_STRING  [-1]     optional: the history in the user's own item ids
    raw_seen     TYPE_STRING  [-1]     optional: the seen list in the user's own item ids
    raw_item_ids TYPE_STRING  [-1]     output: the raw id of each of item_ids

Example::

    cfg = make_config("demo", model.config, max_batch_size=32)
    write_config(Path("repo/demo/config.pbtxt"), cfg)
    assert read_config(Path("repo/demo/config.pbtxt")) == cfg
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from google.protobuf import text_format
from tritonclient.grpc import model_config_pb2 as mc

from common.atomic import atomic_write_text
from retrieval.config import ModelConfig as RetrievalConfig

CONFIG_FILE = "config.pbtxt"
TritonConfig = Any
"""A ``model_config_pb2.ModelConfig`` message (the generated class carries no static types)."""


def make_config(
    name: str,
    model_cfg: RetrievalConfig,
    *,
    max_batch_size: int = 64,
    max_queue_delay_us: int = 0,
    preferred_batch_sizes: Sequence[int] = (),
    max_queue_size: int = 1024,
    versions_latest: int = 1,
    backend: str = "python",
    parameters: Mapping[str, str] | None = None,
    raw_ids: bool = False,
) -> TritonConfig:
    """The ``ModelConfig`` of a retrieval model served under ``name``.

    The defaults batch work-conservingly, as Triton's own do: no queue delay and no preferred
    sizes, so a batch starts once the model is free and takes everything waiting (a preferred
    size would only split it); ``max_queue_size`` 0 means an unbounded queue (Triton's meaning); ``versions_latest``: how
    many of the newest versions Triton loads; ``parameters``: free string pairs (Triton's
    ``parameters`` map, read by the backend); ``raw_ids``: the model has id maps, so the raw id
    tensors are declared (``serving/raw_ids.py``). Raises ``ValueError`` naming the argument.
    """
    if max_batch_size < 1:
        raise ValueError(f"max_batch_size: must be >= 1, got {max_batch_size}")
    if max_queue_delay_us < 0:
        raise ValueError(f"max_queue_delay_us: must be >= 0, got {max_queue_delay_us}")
    if max_queue_size < 0:
        raise ValueError(f"max_queue_size: must be >= 0 (0: no limit), got {max_queue_size}")
    if versions_latest < 1:
        raise ValueError(f"versions_latest: must be >= 1, got {versions_latest}")
    for p in preferred_batch_sizes:
        if not 1 <= p <= max_batch_size:
            raise ValueError(
                f"preferred_batch_sizes: {p} is not in [1, max_batch_size={max_batch_size}]"
            )
    cfg = mc.ModelConfig(name=name, backend=backend, max_batch_size=max_batch_size)
    cfg.version_policy.latest.num_versions = versions_latest
    f, dd = len(model_cfg.user_features), model_cfg.dense_dim
    inputs = (
        ("history", mc.TYPE_INT64, [-1], raw_ids),
        ("categorical", mc.TYPE_INT64, [f], False),
        ("dense", mc.TYPE_FP32, [dd], False),
        ("k", mc.TYPE_INT32, [1], False),
        ("filter", mc.TYPE_STRING, [1], True),
        ("seen", mc.TYPE_INT64, [-1], True),
        *(
            (("raw_history", mc.TYPE_STRING, [-1], True), ("raw_seen", mc.TYPE_STRING, [-1], True))
            if raw_ids
            else ()
        ),
        *((("user", mc.TYPE_INT64, [1], True),) if model_cfg.seen_store else ()),
    )
    for in_name, dtype, dims, optional in inputs:
        cfg.input.add(name=in_name, data_type=dtype, dims=dims, optional=optional)
    cfg.output.add(name="item_ids", data_type=mc.TYPE_INT64, dims=[-1])
    cfg.output.add(name="scores", data_type=mc.TYPE_FP32, dims=[-1])
    if raw_ids:
        cfg.output.add(name="raw_item_ids", data_type=mc.TYPE_STRING, dims=[-1])
    db = cfg.dynamic_batching
    db.preferred_batch_size.extend(preferred_batch_sizes)
    db.max_queue_delay_microseconds = max_queue_delay_us
    db.default_queue_policy.max_queue_size = max_queue_size
    for key, value in (parameters or {}).items():
        cfg.parameters[key].string_value = value
    return cfg


def format_config(cfg: TritonConfig) -> str:
    """The message as protobuf text (what ``config.pbtxt`` holds)."""
    return str(text_format.MessageToString(cfg))


def parse_config(text: str, source: str = CONFIG_FILE) -> TritonConfig:
    """Protobuf text -> ``ModelConfig``; ``ValueError`` naming ``source``, line, column and field."""
    cfg = mc.ModelConfig()
    try:
        text_format.Parse(text, cfg)
    except text_format.ParseError as e:
        where = f"line {e.GetLine()}, column {e.GetColumn()}" if e.GetLine() else "?"
        raise ValueError(f"{source}: {where}: {e}") from None
    if not cfg.name:
        raise ValueError(f"{source}: name: missing")
    return cfg


def write_config(path: Path, cfg: TritonConfig) -> Path:
    """Writes ``path`` atomically and durably (temp file ``.config.pbtxt.<uuid>.tmp`` beside it,
    see :mod:`common.atomic`)."""
    atomic_write_text(path, format_config(cfg))
    return path


def read_config(path: Path) -> TritonConfig:
    """Parses a ``config.pbtxt``; ``FileNotFoundError`` / ``ValueError`` naming the file."""
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no such file")
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:  # a ValueError that would not name the file
        raise ValueError(f"{path}: not UTF-8 text: {e}") from None
    return parse_config(text, str(path))


def upgrade_config(cfg: TritonConfig, raw_ids: bool) -> TritonConfig:
    """``cfg`` as :func:`make_config` writes it today: a version published before configs declared
    the optional ``seen`` input (and, with ``raw_ids``, the raw id tensors, ``history`` optional)
    gets them here, once, when it loads. ``cfg`` itself when it declares them or no inputs."""
    if not cfg.input:
        return cfg
    wanted = [("seen", mc.TYPE_INT64)]
    if raw_ids:
        wanted += [("raw_history", mc.TYPE_STRING), ("raw_seen", mc.TYPE_STRING)]
    declared = {t.name for t in cfg.input}
    missing = [(n, dtype) for n, dtype in wanted if n not in declared]
    lacks_output = raw_ids and not any(t.name == "raw_item_ids" for t in cfg.output)
    if not missing and not lacks_output:
        return cfg
    out = mc.ModelConfig()
    out.CopyFrom(cfg)
    for t in out.input:
        if raw_ids and t.name == "history":
            t.optional = True
    for in_name, dtype in missing:
        out.input.add(name=in_name, data_type=dtype, dims=[-1], optional=True)
    if lacks_output:
        out.output.add(name="raw_item_ids", data_type=mc.TYPE_STRING, dims=[-1])
    return out
