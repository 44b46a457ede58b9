# ruff: noqa
# fmt: off
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Attribute(_message.Message):
    __slots__ = ("name", "values")
    NAME_FIELD_NUMBER: _ClassVar[int]
    VALUES_FIELD_NUMBER: _ClassVar[int]
    name: str
    values: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, name: _Optional[str] = ..., values: _Optional[_Iterable[str]] = ...) -> None: ...

class Item(_message.Message):
    __slots__ = ("id", "vector", "attributes")
    ID_FIELD_NUMBER: _ClassVar[int]
    VECTOR_FIELD_NUMBER: _ClassVar[int]
    ATTRIBUTES_FIELD_NUMBER: _ClassVar[int]
    id: int
    vector: _containers.RepeatedScalarFieldContainer[float]
    attributes: _containers.RepeatedCompositeFieldContainer[Attribute]
    def __init__(self, id: _Optional[int] = ..., vector: _Optional[_Iterable[float]] = ..., attributes: _Optional[_Iterable[_Union[Attribute, _Mapping]]] = ...) -> None: ...

class UpsertItemsRequest(_message.Message):
    __slots__ = ("model", "version", "items", "update_id")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    ITEMS_FIELD_NUMBER: _ClassVar[int]
    UPDATE_ID_FIELD_NUMBER: _ClassVar[int]
    model: str
    version: int
    items: _containers.RepeatedCompositeFieldContainer[Item]
    update_id: str
    def __init__(self, model: _Optional[str] = ..., version: _Optional[int] = ..., items: _Optional[_Iterable[_Union[Item, _Mapping]]] = ..., update_id: _Optional[str] = ...) -> None: ...

class RemoveItemsRequest(_message.Message):
    __slots__ = ("model", "version", "ids", "update_id")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    IDS_FIELD_NUMBER: _ClassVar[int]
    UPDATE_ID_FIELD_NUMBER: _ClassVar[int]
    model: str
    version: int
    ids: _containers.RepeatedScalarFieldContainer[int]
    update_id: str
    def __init__(self, model: _Optional[str] = ..., version: _Optional[int] = ..., ids: _Optional[_Iterable[int]] = ..., update_id: _Optional[str] = ...) -> None: ...

class ItemAttributes(_message.Message):
    __slots__ = ("id", "attributes")
    ID_FIELD_NUMBER: _ClassVar[int]
    ATTRIBUTES_FIELD_NUMBER: _ClassVar[int]
    id: int
    attributes: _containers.RepeatedCompositeFieldContainer[Attribute]
    def __init__(self, id: _Optional[int] = ..., attributes: _Optional[_Iterable[_Union[Attribute, _Mapping]]] = ...) -> None: ...

class SetItemAttributesRequest(_message.Message):
    __slots__ = ("model", "version", "items", "update_id")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    ITEMS_FIELD_NUMBER: _ClassVar[int]
    UPDATE_ID_FIELD_NUMBER: _ClassVar[int]
    model: str
    version: int
    items: _containers.RepeatedCompositeFieldContainer[ItemAttributes]
    update_id: str
    def __init__(self, model: _Optional[str] = ..., version: _Optional[int] = ..., items: _Optional[_Iterable[_Union[ItemAttributes, _Mapping]]] = ..., update_id: _Optional[str] = ...) -> None: ...

class UpdateEmbeddingsRequest(_message.Message):
    __slots__ = ("model", "version", "table", "rows", "values", "update_id")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    TABLE_FIELD_NUMBER: _ClassVar[int]
    ROWS_FIELD_NUMBER: _ClassVar[int]
    VALUES_FIELD_NUMBER: _ClassVar[int]
    UPDATE_ID_FIELD_NUMBER: _ClassVar[int]
    model: str
    version: int
    table: str
    rows: _containers.RepeatedScalarFieldContainer[int]
    values: _containers.RepeatedScalarFieldContainer[float]
    update_id: str
    def __init__(self, model: _Optional[str] = ..., version: _Optional[int] = ..., table: _Optional[str] = ..., rows: _Optional[_Iterable[int]] = ..., values: _Optional[_Iterable[float]] = ..., update_id: _Optional[str] = ...) -> None: ...

class AddSeenRequest(_message.Message):
    __slots__ = ("model", "version", "users", "items", "update_id")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    USERS_FIELD_NUMBER: _ClassVar[int]
    ITEMS_FIELD_NUMBER: _ClassVar[int]
    UPDATE_ID_FIELD_NUMBER: _ClassVar[int]
    model: str
    version: int
    users: _containers.RepeatedScalarFieldContainer[int]
    items: _containers.RepeatedScalarFieldContainer[int]
    update_id: str
    def __init__(self, model: _Optional[str] = ..., version: _Optional[int] = ..., users: _Optional[_Iterable[int]] = ..., items: _Optional[_Iterable[int]] = ..., update_id: _Optional[str] = ...) -> None: ...

class UpdateReply(_message.Message):
    __slots__ = ("model", "version", "sequence", "items", "list_imbalance", "rebuild_recommended", "update_id")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    SEQUENCE_FIELD_NUMBER: _ClassVar[int]
    ITEMS_FIELD_NUMBER: _ClassVar[int]
    LIST_IMBALANCE_FIELD_NUMBER: _ClassVar[int]
    REBUILD_RECOMMENDED_FIELD_NUMBER: _ClassVar[int]
    UPDATE_ID_FIELD_NUMBER: _ClassVar[int]
    model: str
    version: int
    sequence: int
    items: int
    list_imbalance: float
    rebuild_recommended: bool
    update_id: str
    def __init__(self, model: _Optional[str] = ..., version: _Optional[int] = ..., sequence: _Optional[int] = ..., items: _Optional[int] = ..., list_imbalance: _Optional[float] = ..., rebuild_recommended: _Optional[bool] = ..., update_id: _Optional[str] = ...) -> None: ...

class LogRecord(_message.Message):
    __slots__ = ("sequence", "upsert_items", "remove_items", "set_item_attributes", "update_embeddings", "add_seen", "list_sizes", "bit_counts", "update_id", "served")
    SEQUENCE_FIELD_NUMBER: _ClassVar[int]
    UPSERT_ITEMS_FIELD_NUMBER: _ClassVar[int]
    REMOVE_ITEMS_FIELD_NUMBER: _ClassVar[int]
    SET_ITEM_ATTRIBUTES_FIELD_NUMBER: _ClassVar[int]
    UPDATE_EMBEDDINGS_FIELD_NUMBER: _ClassVar[int]
    ADD_SEEN_FIELD_NUMBER: _ClassVar[int]
    LIST_SIZES_FIELD_NUMBER: _ClassVar[int]
    BIT_COUNTS_FIELD_NUMBER: _ClassVar[int]
    UPDATE_ID_FIELD_NUMBER: _ClassVar[int]
    SERVED_FIELD_NUMBER: _ClassVar[int]
    sequence: int
    upsert_items: UpsertItemsRequest
    remove_items: RemoveItemsRequest
    set_item_attributes: SetItemAttributesRequest
    update_embeddings: UpdateEmbeddingsRequest
    add_seen: AddSeenRequest
    list_sizes: bytes
    bit_counts: bytes
    update_id: str
    served: int
    def __init__(self, sequence: _Optional[int] = ..., upsert_items: _Optional[_Union[UpsertItemsRequest, _Mapping]] = ..., remove_items: _Optional[_Union[RemoveItemsRequest, _Mapping]] = ..., set_item_attributes: _Optional[_Union[SetItemAttributesRequest, _Mapping]] = ..., update_embeddings: _Optional[_Union[UpdateEmbeddingsRequest, _Mapping]] = ..., add_seen: _Optional[_Union[AddSeenRequest, _Mapping]] = ..., list_sizes: _Optional[bytes] = ..., bit_counts: _Optional[bytes] = ..., update_id: _Optional[str] = ..., served: _Optional[int] = ...) -> None: ...
