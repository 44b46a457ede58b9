# ruff: noqa
# fmt: off
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable
from typing import ClassVar as _ClassVar, Optional as _Optional

DESCRIPTOR: _descriptor.FileDescriptor

class SearchRequest(_message.Message):
    __slots__ = ("model", "version", "batch", "dim", "queries", "k", "r", "nprobe", "exact", "clauses", "words", "filter_masks", "filter_negate", "with_vectors", "sequence", "list_width", "lists", "exclude_width", "exclude", "floor", "least", "hold", "filter_none", "verify_rows", "verify_clauses", "verify_words", "verify_masks", "verify_negate", "verify_none", "verify_atoms", "verify_values", "verify_codes")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    BATCH_FIELD_NUMBER: _ClassVar[int]
    DIM_FIELD_NUMBER: _ClassVar[int]
    QUERIES_FIELD_NUMBER: _ClassVar[int]
    K_FIELD_NUMBER: _ClassVar[int]
    R_FIELD_NUMBER: _ClassVar[int]
    NPROBE_FIELD_NUMBER: _ClassVar[int]
    EXACT_FIELD_NUMBER: _ClassVar[int]
    CLAUSES_FIELD_NUMBER: _ClassVar[int]
    WORDS_FIELD_NUMBER: _ClassVar[int]
    FILTER_MASKS_FIELD_NUMBER: _ClassVar[int]
    FILTER_NEGATE_FIELD_NUMBER: _ClassVar[int]
    WITH_VECTORS_FIELD_NUMBER: _ClassVar[int]
    SEQUENCE_FIELD_NUMBER: _ClassVar[int]
    LIST_WIDTH_FIELD_NUMBER: _ClassVar[int]
    LISTS_FIELD_NUMBER: _ClassVar[int]
    EXCLUDE_WIDTH_FIELD_NUMBER: _ClassVar[int]
    EXCLUDE_FIELD_NUMBER: _ClassVar[int]
    FLOOR_FIELD_NUMBER: _ClassVar[int]
    LEAST_FIELD_NUMBER: _ClassVar[int]
    HOLD_FIELD_NUMBER: _ClassVar[int]
    FILTER_NONE_FIELD_NUMBER: _ClassVar[int]
    VERIFY_ROWS_FIELD_NUMBER: _ClassVar[int]
    VERIFY_CLAUSES_FIELD_NUMBER: _ClassVar[int]
    VERIFY_WORDS_FIELD_NUMBER: _ClassVar[int]
    VERIFY_MASKS_FIELD_NUMBER: _ClassVar[int]
    VERIFY_NEGATE_FIELD_NUMBER: _ClassVar[int]
    VERIFY_NONE_FIELD_NUMBER: _ClassVar[int]
    VERIFY_ATOMS_FIELD_NUMBER: _ClassVar[int]
    VERIFY_VALUES_FIELD_NUMBER: _ClassVar[int]
    VERIFY_CODES_FIELD_NUMBER: _ClassVar[int]
    model: str
    version: int
    batch: int
    dim: int
    queries: bytes
    k: int
    r: int
    nprobe: bytes
    exact: bytes
    clauses: int
    words: int
    filter_masks: bytes
    filter_negate: bytes
    with_vectors: bool
    sequence: int
    list_width: int
    lists: bytes
    exclude_width: int
    exclude: bytes
    floor: bytes
    least: bytes
    hold: bytes
    filter_none: bytes
    verify_rows: bytes
    verify_clauses: int
    verify_words: int
    verify_masks: bytes
    verify_negate: bytes
    verify_none: bytes
    verify_atoms: int
    verify_values: int
    verify_codes: bytes
    def __init__(self, model: _Optional[str] = ..., version: _Optional[int] = ..., batch: _Optional[int] = ..., dim: _Optional[int] = ..., queries: _Optional[bytes] = ..., k: _Optional[int] = ..., r: _Optional[int] = ..., nprobe: _Optional[bytes] = ..., exact: _Optional[bytes] = ..., clauses: _Optional[int] = ..., words: _Optional[int] = ..., filter_masks: _Optional[bytes] = ..., filter_negate: _Optional[bytes] = ..., with_vectors: _Optional[bool] = ..., sequence: _Optional[int] = ..., list_width: _Optional[int] = ..., lists: _Optional[bytes] = ..., exclude_width: _Optional[int] = ..., exclude: _Optional[bytes] = ..., floor: _Optional[bytes] = ..., least: _Optional[bytes] = ..., hold: _Optional[bytes] = ..., filter_none: _Optional[bytes] = ..., verify_rows: _Optional[bytes] = ..., verify_clauses: _Optional[int] = ..., verify_words: _Optional[int] = ..., verify_masks: _Optional[bytes] = ..., verify_negate: _Optional[bytes] = ..., verify_none: _Optional[bytes] = ..., verify_atoms: _Optional[int] = ..., verify_values: _Optional[int] = ..., verify_codes: _Optional[bytes] = ...) -> None: ...

class SearchResponse(_message.Message):
    __slots__ = ("shard", "version", "width", "ids", "approx", "scores", "vectors")
    SHARD_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    WIDTH_FIELD_NUMBER: _ClassVar[int]
    IDS_FIELD_NUMBER: _ClassVar[int]
    APPROX_FIELD_NUMBER: _ClassVar[int]
    SCORES_FIELD_NUMBER: _ClassVar[int]
    VECTORS_FIELD_NUMBER: _ClassVar[int]
    shard: int
    version: int
    width: int
    ids: bytes
    approx: bytes
    scores: bytes
    vectors: bytes
    def __init__(self, shard: _Optional[int] = ..., version: _Optional[int] = ..., width: _Optional[int] = ..., ids: _Optional[bytes] = ..., approx: _Optional[bytes] = ..., scores: _Optional[bytes] = ..., vectors: _Optional[bytes] = ...) -> None: ...

class InfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class InfoResponse(_message.Message):
    __slots__ = ("model", "shard", "num_shards", "versions", "sequences")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    SHARD_FIELD_NUMBER: _ClassVar[int]
    NUM_SHARDS_FIELD_NUMBER: _ClassVar[int]
    VERSIONS_FIELD_NUMBER: _ClassVar[int]
    SEQUENCES_FIELD_NUMBER: _ClassVar[int]
    model: str
    shard: int
    num_shards: int
    versions: _containers.RepeatedScalarFieldContainer[int]
    sequences: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, model: _Optional[str] = ..., shard: _Optional[int] = ..., num_shards: _Optional[int] = ..., versions: _Optional[_Iterable[int]] = ..., sequences: _Optional[_Iterable[int]] = ...) -> None: ...

class PrepareRequest(_message.Message):
    __slots__ = ("model", "version", "sequence", "record", "attempt")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    SEQUENCE_FIELD_NUMBER: _ClassVar[int]
    RECORD_FIELD_NUMBER: _ClassVar[int]
    ATTEMPT_FIELD_NUMBER: _ClassVar[int]
    model: str
    version: int
    sequence: int
    record: bytes
    attempt: str
    def __init__(self, model: _Optional[str] = ..., version: _Optional[int] = ..., sequence: _Optional[int] = ..., record: _Optional[bytes] = ..., attempt: _Optional[str] = ...) -> None: ...

class PrepareResponse(_message.Message):
    __slots__ = ("shard", "held", "list_sizes", "bit_counts", "served")
    SHARD_FIELD_NUMBER: _ClassVar[int]
    HELD_FIELD_NUMBER: _ClassVar[int]
    LIST_SIZES_FIELD_NUMBER: _ClassVar[int]
    BIT_COUNTS_FIELD_NUMBER: _ClassVar[int]
    SERVED_FIELD_NUMBER: _ClassVar[int]
    shard: int
    held: bytes
    list_sizes: bytes
    bit_counts: bytes
    served: int
    def __init__(self, shard: _Optional[int] = ..., held: _Optional[bytes] = ..., list_sizes: _Optional[bytes] = ..., bit_counts: _Optional[bytes] = ..., served: _Optional[int] = ...) -> None: ...

class CommitRequest(_message.Message):
    __slots__ = ("model", "version", "sequence", "attempt")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    SEQUENCE_FIELD_NUMBER: _ClassVar[int]
    ATTEMPT_FIELD_NUMBER: _ClassVar[int]
    model: str
    version: int
    sequence: int
    attempt: str
    def __init__(self, model: _Optional[str] = ..., version: _Optional[int] = ..., sequence: _Optional[int] = ..., attempt: _Optional[str] = ...) -> None: ...

class CommitResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...
