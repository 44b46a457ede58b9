"""ModelRunner: B admitted requests -> one ``RetrievalModel.forward`` -> one outcome each.

The runner is the model's edge: :meth:`ModelRunner.admit` validates one request against the
loaded model (model name and version, shapes, id ranges, K, filter text) and returns an
:class:`Admission` (the request with its parsed filter), or raises an error naming the field.
:meth:`ModelRunner.run` takes admissions (and plain requests, which it admits itself), admits
again any that another runner admitted (a hot swap landed between the edge and the batch), so a
bad request gets its error and the others still run, then stacks the good ones into one
:class:`~retrieval.features.UserBatch` and calls the model once with ``K = max k``::

    runner = ModelRunner(model, "demo", 3)
    runner.warmup()
    outcomes = runner.run([runner.admit(req_a), req_b])  # [RecResult | RequestError | ...]

Requests in one batch share the candidate budget of the largest K, so a small-K request may see
a slightly better list than it would alone; it never sees a worse one. Seen lists
(``RecRequest.seen``) go into ``UserBatch.seen`` ``[B, S]``, ``-1`` padded, and the index skips
them inside its scan, each row probing for its own list only; a batch in which no request has
one gets None, so the common path costs nothing. Likewise recall targets
(``RecRequest.recall_target``) go into ``UserBatch.recall_target`` ``[B]`` when any asks.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from retrieval.features import UserBatch
from retrieval.filters import COMPILED_FILTERS, Expr, parse_filter
from retrieval.graphed_forward import GraphedForward
from retrieval.model import RetrievalModel
from retrieval.seen import pad_lists
from serving.limits import LimitsConfig
from serving.raw_ids import dense_history
from serving.types import (
    ModelNotFoundError,
    RecRequest,
    RecResult,
    RequestError,
    UnavailableError,
    check_request,
)
from sharded_tables.interface import TablesUnavailableError

GRAPH_MAX_BATCH = 32
"""The batcher's default largest batch (``serving/app/config.py``): the largest graph bucket."""

Outcome = RecResult | RequestError | ModelNotFoundError


@dataclass(frozen=True)
class Admission:
    """A request that passed one runner's edge check (:meth:`ModelRunner.admit`): what its
    batch needs of it. The runner that admitted it runs it as it is; another one (a hot swap
    landed between the edge and the batch) admits it again, within the same ``limits``."""

    req: RecRequest
    runner: ModelRunner
    """The runner whose model the request was checked against."""
    clauses: Expr | None
    """The request's filter, parsed within ``limits`` and checked against the model's
    attributes (``[]``: no filter)."""
    limits: LimitsConfig | None = None
    """The request size limits it was admitted within (None: the parser's own bounds)."""

    @property
    def deadline(self) -> float | None:
        """The request's deadline (``time.monotonic()``): the batcher drops it once passed."""
        return self.req.deadline


def _id_limits(model: RetrievalModel, features: list[str]) -> np.ndarray:
    """``int64 [F]``: one past the largest valid id of each categorical feature (hashed tables
    take any id), so the edge check is one vectorized compare."""
    rows, table_of = model.tables.table_rows(), model.tables.table_of
    top = np.iinfo(np.int64).max
    return np.array(
        [r if (r := rows[table_of[f"user_{n}"]]) is not None else top for n in features],
        dtype=np.int64,
    )


def check_target(name: str, served: int, model: str, version: int | None) -> None:
    """Raises :class:`ModelNotFoundError` unless ``model`` / ``version`` (empty / None: any)
    name model ``name`` version ``served``."""
    if model and model != name:
        raise ModelNotFoundError(f"model: {model!r} is not served here (serving {name!r})")
    if version is not None and version != served:
        raise ModelNotFoundError(
            f"version: {name} version {version} is not loaded (serving {served})"
        )


class ModelRunner:
    """One loaded model version and the code that turns requests into its input tensors."""

    def __init__(
        self, model: RetrievalModel, name: str, version: int, max_batch: int = GRAPH_MAX_BATCH
    ):
        """``max_batch``: the largest batch the batcher sends (the largest graph's bucket)."""
        self.model = model.eval()
        self.name, self.version = name, version
        cfg = model.config
        self.history_len = cfg.history_len
        self.features = list(cfg.user_features)
        self.dense_dim = cfg.dense_dim
        self.num_items = cfg.num_items
        self.schema = model.index.schema
        self.device = model.index.centroids.device
        self.id_limits = _id_limits(model, self.features)
        self.item_map = None if model.id_maps is None else model.id_maps.items
        """The raw item ids answers are rendered with (None: a model without id maps)."""
        self._checked_filters: dict[tuple[str, tuple[int, int, int] | None], Expr] = {}
        self.graphed: GraphedForward | None = None
        """On a GPU with the device backend: the whole forward replayed per batch bucket
        (``retrieval/graphed_forward.py``; batches stay on the host until it copies them in)."""
        if self.device.type == "cuda" and model.index.executor.backend == "device":
            self.graphed = GraphedForward(model, max_batch)

    # ---- edge -------------------------------------------------------------------------------
    def check_target(self, model: str, version: int | None) -> None:
        """Raises :class:`ModelNotFoundError` unless ``model`` / ``version`` (empty / None: any)
        name this runner's model and version: the one check of both, for every caller."""
        check_target(self.name, self.version, model, version)

    def admit(self, req: RecRequest, limits: LimitsConfig | None = None) -> Admission:
        """Validates ``req`` for this model -> its :class:`Admission` (the filter parsed within
        ``limits``' clause and set-size bounds when given: the edge's one parse). Maps the raw
        ids into ``req.history`` / ``req.seen`` through this version's item map.

        Raises :class:`ModelNotFoundError` (``model`` / ``version``) or :class:`RequestError`
        naming the field.
        """
        self.check_target(req.model, req.version)
        if req.raw_history is not None:
            req.history = self._dense_history(req.raw_history)
        if req.raw_seen is not None:
            req.seen = self._dense_history(req.raw_seen, "raw_seen")
        check_request(req, len(self.features), self.dense_dim, self.num_items)
        ntotal = self.model.index.ntotal
        if req.k > ntotal:
            raise RequestError(f"k: must be in [1, {ntotal}] (items in the index), got {req.k}")
        if req.user >= 0 and self.model.seen_store is None:
            raise RequestError(
                f"user: {self.name} version {self.version} keeps no seen store "
                "(model.seen_store): send the user's seen list in seen"
            )
        if 0.0 < req.recall_target < 1.0 and not self.model.index.stats.recall_curve:
            raise RequestError(
                f"recall_target: {self.name} version {self.version} measured no recall curve at "
                "build (IVFConfig.target_recall was 0): send 0 (its settings) or 1 (exact)"
            )
        cat = req.categorical
        if ((cat < -1) | (cat >= self.id_limits)).any():
            self._check_categorical(cat)  # the tables' own check names the feature and table
        return Admission(req, self, self._clauses(req.filter, limits), limits)

    def _dense_history(self, raw: np.ndarray, where: str = "raw_history") -> np.ndarray:
        """``raw_history`` ``str [H]`` -> ``history`` ``int64 [H]`` through this version's item
        map (mapped on every check: another version may map the same ids otherwise); likewise
        ``raw_seen`` -> ``seen`` (``where``)."""
        maps = self.model.id_maps
        if maps is None:
            dense = where.removeprefix("raw_")
            raise RequestError(
                f"{where}: {self.name} version {self.version} has no id maps (it was not "
                f"trained on imported data): send {dense}, the dense item ids"
            )
        return dense_history(raw, maps.items, where)

    def _check_categorical(self, cat: np.ndarray) -> None:
        codes = torch.from_numpy(cat).view(1, -1)  # [1, F]
        try:
            self.model.tables.validate(
                {f"user_{n}": codes[:, j : j + 1] for j, n in enumerate(self.features)}
            )
        except ValueError as e:
            raise RequestError(f"categorical: {e}") from None

    def _clauses(self, text: str | None, limits: LimitsConfig | None) -> Expr | None:
        """``text``'s expression (None: no filter), checked against the limits and this model's
        attributes; a text that passed is kept (per limits), so a repeated filter is not parsed
        again."""
        if not text:
            return None
        key = (text, None if limits is None else limits.filter_limits)
        if (hit := self._checked_filters.get(key)) is not None:
            return hit
        try:
            clauses = parse_filter(text) if limits is None else limits.parse_filter(text)
            if clauses is None:
                return None
            self.schema.check(clauses)  # unknown names, what the scans cannot evaluate
        except ValueError as e:
            msg = str(e)
            raise RequestError(msg if msg.startswith("filter") else f"filter: {msg}") from None
        if len(self._checked_filters) >= COMPILED_FILTERS:
            self._checked_filters.clear()  # bounded, as the schema's compiled filters are
        self._checked_filters[key] = clauses
        return clauses

    # ---- execute ----------------------------------------------------------------------------
    def run(self, items: Sequence[Admission | RecRequest]) -> list[Outcome]:
        """One outcome per item, in order; the good requests run as ONE forward. An item
        another runner admitted, or a plain request, is admitted here first."""
        outcomes: list[Outcome | None] = [None] * len(items)
        admitted: list[tuple[int, Admission]] = []
        for i, item in enumerate(items):
            try:
                admitted.append((i, self._admitted(item)))
            except (RequestError, ModelNotFoundError) as e:
                outcomes[i] = e
        if admitted:
            good = [a.req for _, a in admitted]
            batch = self._batch(good, [a.clauses for _, a in admitted])
            k_max = max(r.k for r in good)
            deadlines = [d for r in good if (d := r.deadline) is not None]
            try:
                with torch.inference_mode():
                    ids, scores, missing = self.forward(batch, k_max, min(deadlines, default=None))
            except TablesUnavailableError as e:  # an embedding server is down or too slow
                raise UnavailableError(f"tables: {e}") from e
            ids_np, scores_np = ids.cpu().numpy(), scores.cpu().numpy()
            for row, (i, a) in enumerate(admitted):
                k = a.req.k
                outcomes[i] = RecResult(
                    ids_np[row, :k].copy(),
                    scores_np[row, :k].copy(),
                    self.name,
                    self.version,
                    partial=bool(missing),
                    missing=list(missing),
                    item_map=self.item_map,
                )
        return [o for o in outcomes if o is not None]

    def _admitted(self, item: Admission | RecRequest) -> Admission:
        """``item`` as this runner's admission (admitting it when it is not one yet)."""
        if isinstance(item, Admission):
            return item if item.runner is self else self.admit(item.req, item.limits)
        return self.admit(item)

    def forward(
        self, batch: UserBatch, k: int, deadline: float | None
    ) -> tuple[torch.Tensor, torch.Tensor, list[str]]:
        """One batch through the model -> ``(ids [B, k], scores [B, k], parts that did not
        answer)``. ``deadline``: the batch's earliest request deadline (``time.monotonic()``);
        the model runs in this process, so nothing can be missing. ``batch`` comes from
        :meth:`admit`-ted requests (the model's own validation would repeat it)."""
        if self.graphed is not None:  # the batch is on the host (:meth:`_batch`)
            ids, scores = self.graphed(batch, k)
        else:
            ids, scores = self.model(batch, k, checked=True)
        return ids, scores, []

    def between_batches(self) -> None:
        """Upkeep between forwards, after a batch's answers went out: the tables' device
        caches admit the rows the last batches missed (host work, outside any graph)."""
        self.model.tables.between_batches()

    def _batch(self, reqs: list[RecRequest], clauses: list[Expr | None]) -> UserBatch:
        """Admitted requests -> tensors on the model's device (trusted: :meth:`admit` ran)."""
        b, h = len(reqs), self.history_len
        history = np.full((b, h), -1, dtype=np.int64)  # [B, H], newest first, -1 pads
        for row, req in enumerate(reqs):
            recent = req.history[:h]
            history[row, : len(recent)] = recent
        categorical = np.stack([r.categorical for r in reqs]).reshape(b, len(self.features))
        dense = np.stack([r.dense for r in reqs]).reshape(b, self.dense_dim)
        fb = self.schema.compile(clauses)  # masks [B, C, W], negate [B, C]
        batch = UserBatch(
            torch.from_numpy(history),
            torch.from_numpy(categorical),
            torch.from_numpy(dense),
            fb.masks,
            fb.negate,
            pad_lists([r.seen for r in reqs]),  # [B, S] or None: no request has a seen list
            _targets(reqs),
            _users(reqs),
            fb.neg_masks,
            fb.verify,
        )
        if self.device.type == "cpu" or self.graphed is not None:  # the graph copies it in
            return batch
        return batch.to(self.device)  # built on the host

    def warmup(self, batch_sizes: tuple[int, ...] = (1, 8)) -> None:
        """Runs dummy batches (with and without a filter and a seen list) so the first real
        batch is not slow; raises when the model cannot answer them. With graphs: every
        bucket, unfiltered and filtered, so that each is recorded before the version serves."""
        if self.graphed is not None:
            top = self.graphed.max_bucket
            batch_sizes = tuple(1 << i for i in range(top.bit_length()) if 1 << i <= top)
        k = min(10, self.model.index.ntotal)
        some_filter = None
        for attr, values in self.schema.attribute_values.items():
            if isinstance(values, str):  # numeric
                some_filter = f"{attr} >= 0"
            else:
                some_filter = f"{attr} = {values[0]!r}" if values else None
            break
        for size, (f_every, s_every) in [
            (s, p) for s in batch_sizes for p in self._warm_patterns()
        ]:
            reqs = [
                RecRequest(
                    history=np.arange(min(self.history_len, self.num_items), dtype=np.int64),
                    categorical=np.zeros(len(self.features), dtype=np.int64),
                    dense=np.zeros(self.dense_dim, dtype=np.float32),
                    k=k,
                    filter=some_filter if _every(i, f_every) else None,
                    seen=np.arange(min(2, self.num_items), dtype=np.int64)
                    if _every(i, s_every)
                    else None,
                )
                for i in range(size)
            ]
            for out in self.run(reqs):
                if not isinstance(out, RecResult):
                    raise RuntimeError(f"warm-up of {self.name} v{self.version} failed: {out}")

    def _warm_patterns(self) -> tuple[tuple[int, int], ...]:
        """Warm-up batches per size, as ``(f, s)``: a filter on every ``f``-th request and a
        seen list on every ``s``-th (0: none). With graphs, each shape a batch takes (no
        filter, filters without and with seen lists) in every bucket."""
        half = ((2, 2),)
        return half if self.graphed is None else (*half, (0, 0), (1, 0), (1, 1))


def _every(i: int, e: int) -> bool:
    """Whether request ``i`` is an ``e``-th one (``e`` 0: none is)."""
    return e > 0 and i % e == e - 1


def _targets(reqs: list[RecRequest]) -> torch.Tensor | None:
    """The requests' recall targets ``[B] float32``, or None when none asks for one."""
    if all(r.recall_target == 0.0 for r in reqs):
        return None
    return torch.tensor([r.recall_target for r in reqs], dtype=torch.float32)


def _users(reqs: list[RecRequest]) -> torch.Tensor | None:
    """The requests' users ``[B] int64`` (``-1``: none), or None when none names one."""
    if all(r.user < 0 for r in reqs):
        return None
    return torch.tensor([r.user for r in reqs], dtype=torch.int64)
