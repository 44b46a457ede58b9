# ruff: noqa
# fmt: off
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class TableIds(_message.Message):
    __slots__ = ("table", "ids")
    TABLE_FIELD_NUMBER: _ClassVar[int]
    IDS_FIELD_NUMBER: _ClassVar[int]
    table: str
    ids: bytes
    def __init__(self, table: _Optional[str] = ..., ids: _Optional[bytes] = ...) -> None: ...

class LookupRequest(_message.Message):
    __slots__ = ("tables", "version")
    TABLES_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    tables: _containers.RepeatedCompositeFieldContainer[TableIds]
    version: int
    def __init__(self, tables: _Optional[_Iterable[_Union[TableIds, _Mapping]]] = ..., version: _Optional[int] = ...) -> None: ...

class TableRows(_message.Message):
    __slots__ = ("table", "dtype", "dim", "rows", "found")
    TABLE_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    DIM_FIELD_NUMBER: _ClassVar[int]
    ROWS_FIELD_NUMBER: _ClassVar[int]
    FOUND_FIELD_NUMBER: _ClassVar[int]
    table: str
    dtype: str
    dim: int
    rows: bytes
    found: bytes
    def __init__(self, table: _Optional[str] = ..., dtype: _Optional[str] = ..., dim: _Optional[int] = ..., rows: _Optional[bytes] = ..., found: _Optional[bytes] = ...) -> None: ...

class LookupResponse(_message.Message):
    __slots__ = ("tables",)
    TABLES_FIELD_NUMBER: _ClassVar[int]
    tables: _containers.RepeatedCompositeFieldContainer[TableRows]
    def __init__(self, tables: _Optional[_Iterable[_Union[TableRows, _Mapping]]] = ...) -> None: ...

class PutRequest(_message.Message):
    __slots__ = ("table", "ids", "rows", "version")
    TABLE_FIELD_NUMBER: _ClassVar[int]
    IDS_FIELD_NUMBER: _ClassVar[int]
    ROWS_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    table: str
    ids: bytes
    rows: bytes
    version: int
    def __init__(self, table: _Optional[str] = ..., ids: _Optional[bytes] = ..., rows: _Optional[bytes] = ..., version: _Optional[int] = ...) -> None: ...

class PutResponse(_message.Message):
    __slots__ = ("stored",)
    STORED_FIELD_NUMBER: _ClassVar[int]
    stored: int
    def __init__(self, stored: _Optional[int] = ...) -> None: ...

class InfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class TableInfo(_message.Message):
    __slots__ = ("name", "dtype", "dim", "partition", "row_lo", "row_hi", "keys", "bytes", "ids_served", "version", "log_bytes")
    NAME_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    DIM_FIELD_NUMBER: _ClassVar[int]
    PARTITION_FIELD_NUMBER: _ClassVar[int]
    ROW_LO_FIELD_NUMBER: _ClassVar[int]
    ROW_HI_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    IDS_SERVED_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    LOG_BYTES_FIELD_NUMBER: _ClassVar[int]
    name: str
    dtype: str
    dim: int
    partition: str
    row_lo: int
    row_hi: int
    keys: int
    bytes: int
    ids_served: int
    version: int
    log_bytes: int
    def __init__(self, name: _Optional[str] = ..., dtype: _Optional[str] = ..., dim: _Optional[int] = ..., partition: _Optional[str] = ..., row_lo: _Optional[int] = ..., row_hi: _Optional[int] = ..., keys: _Optional[int] = ..., bytes: _Optional[int] = ..., ids_served: _Optional[int] = ..., version: _Optional[int] = ..., log_bytes: _Optional[int] = ...) -> None: ...

class InfoResponse(_message.Message):
    __slots__ = ("server", "tables", "memory_budget", "bytes_used", "requests", "ids_served", "puts", "versions", "versions_refused")
    SERVER_FIELD_NUMBER: _ClassVar[int]
    TABLES_FIELD_NUMBER: _ClassVar[int]
    MEMORY_BUDGET_FIELD_NUMBER: _ClassVar[int]
    BYTES_USED_FIELD_NUMBER: _ClassVar[int]
    REQUESTS_FIELD_NUMBER: _ClassVar[int]
    IDS_SERVED_FIELD_NUMBER: _ClassVar[int]
    PUTS_FIELD_NUMBER: _ClassVar[int]
    VERSIONS_FIELD_NUMBER: _ClassVar[int]
    VERSIONS_REFUSED_FIELD_NUMBER: _ClassVar[int]
    server: str
    tables: _containers.RepeatedCompositeFieldContainer[TableInfo]
    memory_budget: int
    bytes_used: int
    requests: int
    ids_served: int
    puts: int
    versions: _containers.RepeatedScalarFieldContainer[int]
    versions_refused: int
    def __init__(self, server: _Optional[str] = ..., tables: _Optional[_Iterable[_Union[TableInfo, _Mapping]]] = ..., memory_budget: _Optional[int] = ..., bytes_used: _Optional[int] = ..., requests: _Optional[int] = ..., ids_served: _Optional[int] = ..., puts: _Optional[int] = ..., versions: _Optional[_Iterable[int]] = ..., versions_refused: _Optional[int] = ...) -> None: ...

class KeysRequest(_message.Message):
    __slots__ = ("table", "version")
    TABLE_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    table: str
    version: int
    def __init__(self, table: _Optional[str] = ..., version: _Optional[int] = ...) -> None: ...

class KeysChunk(_message.Message):
    __slots__ = ("ids",)
    IDS_FIELD_NUMBER: _ClassVar[int]
    ids: bytes
    def __init__(self, ids: _Optional[bytes] = ...) -> None: ...

class RewindRequest(_message.Message):
    __slots__ = ("table", "log_bytes", "version")
    TABLE_FIELD_NUMBER: _ClassVar[int]
    LOG_BYTES_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    table: str
    log_bytes: int
    version: int
    def __init__(self, table: _Optional[str] = ..., log_bytes: _Optional[int] = ..., version: _Optional[int] = ...) -> None: ...

class RewindResponse(_message.Message):
    __slots__ = ("keys",)
    KEYS_FIELD_NUMBER: _ClassVar[int]
    keys: int
    def __init__(self, keys: _Optional[int] = ...) -> None: ...
