# ruff: noqa
# fmt: off
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable
from typing import ClassVar as _ClassVar, Optional as _Optional

DESCRIPTOR: _descriptor.FileDescriptor

class RecommendRequest(_message.Message):
    __slots__ = ("user_id", "history", "categorical", "dense", "k", "filter", "model", "version", "raw_history", "seen", "raw_seen", "recall_target", "user")
    USER_ID_FIELD_NUMBER: _ClassVar[int]
    HISTORY_FIELD_NUMBER: _ClassVar[int]
    CATEGORICAL_FIELD_NUMBER: _ClassVar[int]
    DENSE_FIELD_NUMBER: _ClassVar[int]
    K_FIELD_NUMBER: _ClassVar[int]
    FILTER_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    RAW_HISTORY_FIELD_NUMBER: _ClassVar[int]
    SEEN_FIELD_NUMBER: _ClassVar[int]
    RAW_SEEN_FIELD_NUMBER: _ClassVar[int]
    RECALL_TARGET_FIELD_NUMBER: _ClassVar[int]
    USER_FIELD_NUMBER: _ClassVar[int]
    user_id: str
    history: _containers.RepeatedScalarFieldContainer[int]
    categorical: _containers.RepeatedScalarFieldContainer[int]
    dense: _containers.RepeatedScalarFieldContainer[float]
    k: int
    filter: str
    model: str
    version: int
    raw_history: _containers.RepeatedScalarFieldContainer[str]
    seen: _containers.RepeatedScalarFieldContainer[int]
    raw_seen: _containers.RepeatedScalarFieldContainer[str]
    recall_target: float
    user: int
    def __init__(self, user_id: _Optional[str] = ..., history: _Optional[_Iterable[int]] = ..., categorical: _Optional[_Iterable[int]] = ..., dense: _Optional[_Iterable[float]] = ..., k: _Optional[int] = ..., filter: _Optional[str] = ..., model: _Optional[str] = ..., version: _Optional[int] = ..., raw_history: _Optional[_Iterable[str]] = ..., seen: _Optional[_Iterable[int]] = ..., raw_seen: _Optional[_Iterable[str]] = ..., recall_target: _Optional[float] = ..., user: _Optional[int] = ...) -> None: ...

class RecommendResponse(_message.Message):
    __slots__ = ("item_ids", "scores", "model", "version", "partial", "missing", "raw_item_ids")
    ITEM_IDS_FIELD_NUMBER: _ClassVar[int]
    SCORES_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    PARTIAL_FIELD_NUMBER: _ClassVar[int]
    MISSING_FIELD_NUMBER: _ClassVar[int]
    RAW_ITEM_IDS_FIELD_NUMBER: _ClassVar[int]
    item_ids: _containers.RepeatedScalarFieldContainer[int]
    scores: _containers.RepeatedScalarFieldContainer[float]
    model: str
    version: int
    partial: bool
    missing: _containers.RepeatedScalarFieldContainer[str]
    raw_item_ids: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, item_ids: _Optional[_Iterable[int]] = ..., scores: _Optional[_Iterable[float]] = ..., model: _Optional[str] = ..., version: _Optional[int] = ..., partial: _Optional[bool] = ..., missing: _Optional[_Iterable[str]] = ..., raw_item_ids: _Optional[_Iterable[str]] = ...) -> None: ...
