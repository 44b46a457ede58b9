"""What crosses the serving boundary: one recommendation request and its result.

Every front end (gRPC ``Recommend``, KServe v2 gRPC and HTTP) parses its wire format into
:class:`RecRequest` (validating at the edge, errors naming the field), hands it to the batcher,
and renders the :class:`RecResult` it gets back. The model side sees only these types.

The KServe v2 / Triton tensor interface of a model (``config.pbtxt`` inputs and outputs) is
fixed here too, so the model repository, the Python backend and the servers agree:

=================  ========  ==========  ==================================================
tensor             dtype     dims        meaning
=================  ========  ==========  ==================================================
``history``        INT64     ``[-1]``    recent item ids, newest first (``-1`` pads)
``categorical``    INT64     ``[F]``     one code per categorical user feature (config order)
``dense``          FP32      ``[Dd]``    dense user features
``k``              INT32     ``[1]``     results wanted
``filter``         BYTES     ``[1]``     filter expression (empty: none), optional
``seen``           INT64     ``[-1]``    every item the user consumed, never recommended
                                         (any order, ``-1`` pads), optional
``item_ids``       INT64     ``[-1]``    output: top-K item ids (``-1`` pads)
``scores``         FP32      ``[-1]``    output: their scores
``raw_history``    BYTES     ``[-1]``    a model with id maps: the history in the user's own
                                         item ids (``""`` pads), instead of ``history``
``raw_seen``       BYTES     ``[-1]``    a model with id maps: ``seen`` in the user's own
                                         item ids (``""`` pads), instead of ``seen``
``raw_item_ids``   BYTES     ``[-1]``    a model with id maps: output, the raw id of each of
                                         ``item_ids`` (``""`` pads)
``user``           INT64     ``[1]``     a model with a seen store: the user (dense index,
                                         ``-1``: none) whose stored seen items are excluded
=================  ========  ==========  ==================================================

(dims without the batch dimension; ``max_batch_size > 0``, so every tensor is ``[B, ...]``).
A model with id maps takes ``history`` or ``raw_history`` (both optional, one of them given);
the mapping is ``serving/raw_ids.py``. ``seen`` (or ``raw_seen``) is removed exactly from the
answer (``retrieval/seen.py``); its length is bounded by ``limits.max_seen``.
"""

from __future__ import annotations

from concurrent.futures import CancelledError
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from common.logs import safe_message

if TYPE_CHECKING:
    from retrieval.data.id_map import IdMap

INPUTS = ("history", "categorical", "dense", "k", "filter", "seen")
OUTPUTS = ("item_ids", "scores")
OPTIONAL_INPUTS = ("filter", "seen")
"""Inputs a request may leave out (besides the raw ones)."""
RAW_INPUTS = ("raw_history", "raw_seen")
"""Inputs of a model with id maps only (besides ``INPUTS``)."""
RAW_OUTPUTS = ("raw_item_ids",)
"""Outputs of a model with id maps only (besides ``OUTPUTS``)."""
STORE_INPUTS = ("user",)
"""Inputs of a model with a seen store only (``retrieval/seen_store.py``), optional."""
DATATYPES = {
    "history": "INT64",
    "categorical": "INT64",
    "dense": "FP32",
    "k": "INT32",
    "filter": "BYTES",
    "seen": "INT64",
    "item_ids": "INT64",
    "scores": "FP32",
    "raw_history": "BYTES",
    "raw_seen": "BYTES",
    "raw_item_ids": "BYTES",
    "user": "INT64",
}
"""KServe v2 datatype of every tensor in the table above."""
MAX_K = 10_000
"""Largest K a request may ask for (and never more than the catalog)."""


class RequestError(ValueError):
    """A request the server refuses (INVALID_ARGUMENT / HTTP 400); the message names the field."""


class ModelNotFoundError(LookupError):
    """The request names a model or version this server does not serve (NOT_FOUND / HTTP 404)."""


class QueueFullError(RuntimeError):
    """The batcher's queue holds ``max_queue_size`` requests (RESOURCE_EXHAUSTED / HTTP 503)."""


class DeadlineExceededError(TimeoutError):
    """The request's deadline passed before it ran (DEADLINE_EXCEEDED / HTTP 504)."""


class UnavailableError(RuntimeError):
    """The server is draining or not ready (UNAVAILABLE / HTTP 503)."""


ERROR_STATUS: tuple[tuple[type[BaseException], str, int, str], ...] = (
    (RequestError, "INVALID_ARGUMENT", 400, "invalid_argument"),
    (ModelNotFoundError, "NOT_FOUND", 404, "not_found"),
    # 503, not 429: a full queue is the server's capacity, not this client's request rate,
    # and it is what Triton answers when its dynamic batcher rejects a request.
    (QueueFullError, "RESOURCE_EXHAUSTED", 503, "queue_full"),
    (DeadlineExceededError, "DEADLINE_EXCEEDED", 504, "deadline_exceeded"),
    (UnavailableError, "UNAVAILABLE", 503, "unavailable"),
    (CancelledError, "CANCELLED", 499, "cancelled"),
)
"""Serving error -> (gRPC status code name, HTTP status, metrics ``reason`` label), first match."""


def error_message(exc: BaseException) -> str:
    """What an answer says about ``exc``: its message (or its type's name), non-printable
    characters escaped and cut in its middle to ``common.logs.MAX_MESSAGE_CHARS``. Every front
    end (Recommend, KServe gRPC and HTTP, the admin API, a router's and a shard server's) answers
    errors through this one function: a message may quote client text of any length (a filter,
    a raw id, a path), and gRPC refuses metadata past 8 KiB, an error unreadable to its client."""
    return safe_message(str(exc) or type(exc).__name__)


def error_status(exc: BaseException) -> tuple[str, int, str]:
    """``(grpc code name, http status, reason)`` of an error; anything unknown is INTERNAL/500."""
    for cls, code, http, reason in ERROR_STATUS:
        if isinstance(exc, cls):
            return code, http, reason
    return "INTERNAL", 500, "internal"


@dataclass
class RecRequest:
    """One user's request, already parsed and checked at the edge."""

    history: np.ndarray
    """``int64 [H]`` recent item ids, newest first (any length; the model keeps its window)."""
    categorical: np.ndarray
    """``int64 [F]``."""
    dense: np.ndarray
    """``float32 [Dd]``."""
    k: int
    filter: str | None = None
    user_id: str = ""
    """Echoed back; free text (not used by the model)."""
    deadline: float | None = None
    """Absolute ``time.monotonic()`` after which the answer is useless (DEADLINE_EXCEEDED)."""
    model: str = ""
    """Model name asked for (empty: the server's default)."""
    version: int | None = None
    """Model version asked for (None: the latest loaded)."""
    raw_history: np.ndarray | None = None
    """``str [H]`` (object): the history in the user's own item ids, ``""`` pads, for a model
    with id maps; the runner maps it into ``history`` (``serving/raw_ids.py``)."""
    seen: np.ndarray | None = None
    """``int64 [S]`` every item the user consumed, never recommended (any order, ``-1`` pads;
    None: the history window only)."""
    raw_seen: np.ndarray | None = None
    """``str [S]`` (object): ``seen`` in the user's own item ids, ``""`` pads, for a model with id
    maps; the runner maps it into ``seen``."""
    recall_target: float = 0.0
    """Recall@K against exact search the request asks for, in (0, 1]; 0: the index's settings
    (``retrieval/index/targets.py``). KServe: the request parameter ``recall_target``."""
    user: int = -1
    """The user (dense index) whose seen items a model with a seen store excludes; -1: none."""


@dataclass
class RecResult:
    """The answer to one :class:`RecRequest`."""

    item_ids: np.ndarray
    """``int64 [K]``; ``-1`` pads when the filter admits fewer than K items."""
    scores: np.ndarray
    """``float32 [K]``; ``-inf`` where ``item_ids`` is ``-1``."""
    model: str
    version: int
    partial: bool = False
    """True when some shard or embedding server did not answer in time (sharded serving)."""
    missing: list[str] = field(default_factory=list)
    """Which parts did not answer, when ``partial``."""
    item_map: IdMap | None = field(default=None, repr=False, compare=False)
    """The answering version's raw item ids (None: a model without id maps); the front ends
    render ``item_ids`` through it (``serving.raw_ids.raw_item_ids``)."""
    raw_item_ids: np.ndarray | None = field(default=None, repr=False, compare=False)
    """``str [K]`` (object): the raw ids of ``item_ids`` already rendered (``""`` pads), by an
    engine in another process, which keeps the version's map; None: render through
    ``item_map``."""


def check_request(req: RecRequest, categorical: int, dense: int, num_items: int) -> None:
    """Shape/range checks a model needs (raises :class:`RequestError` naming the field)."""
    if req.history.dtype != np.int64 or req.history.ndim != 1:
        raise RequestError(
            f"history: expected int64 [H], got {req.history.dtype} {req.history.shape}"
        )
    if req.categorical.shape != (categorical,) or req.categorical.dtype != np.int64:
        raise RequestError(
            f"categorical: expected int64 [{categorical}], got "
            f"{req.categorical.dtype} {list(req.categorical.shape)}"
        )
    if req.dense.shape != (dense,) or req.dense.dtype != np.float32:
        raise RequestError(
            f"dense: expected float32 [{dense}], got {req.dense.dtype} {list(req.dense.shape)}"
        )
    if not np.isfinite(req.dense).all():
        raise RequestError("dense: contains NaN or infinity")
    if not 1 <= req.k <= min(MAX_K, num_items):
        raise RequestError(f"k: must be in [1, {min(MAX_K, num_items)}], got {req.k}")
    bad = req.history[(req.history < -1) | (req.history >= num_items)]
    if bad.size:
        raise RequestError(f"history: item id {int(bad[0])} is not in [0, {num_items})")
    if req.user < -1:
        raise RequestError(f"user: a user index is >= 0 (-1: none), got {req.user}")
    if not 0.0 <= req.recall_target <= 1.0:  # NaN fails too
        raise RequestError(
            f"recall_target: must be in (0, 1] (0: the index's settings), got {req.recall_target}"
        )
    if req.seen is not None:
        if req.seen.dtype != np.int64 or req.seen.ndim != 1:
            raise RequestError(f"seen: expected int64 [S], got {req.seen.dtype} {req.seen.shape}")
        bad = req.seen[(req.seen < -1) | (req.seen >= num_items)]
        if bad.size:
            raise RequestError(f"seen: item id {int(bad[0])} is not in [0, {num_items})")
