"""The admin gRPC API (``recserve.admin.v1.Admin``, serving/admin.proto): live updates of the
served model, logged so that a restart replays them.

One update, on the gRPC thread that received it::

    host.updating()                   version loads and other updates wait (one at a time)
      parse the message               INVALID_ARGUMENT naming the wire field
      prepare_update(model, batch)    validate all, run the item tower, build the new index;
                                      batches keep running on the old model meanwhile
      log.append(record)              the resolved update, fsync'd: durable from here
      host.swap_updated(...)          wait for the running batch, write table rows, swap
    reply (version, sequence)         acknowledged only once durable and visible

:class:`LiveUpdates` owns the logs (``state_dir/<model>/<version>/updates.log``, see
``serving/update_log.py``) and replays a version's log when the host loads it (``on_load``),
before the version serves. A newer publish starts with an empty log; the logs of versions no
longer in the repository are deleted. The API is on only with ``state_dir`` (else every call is
FAILED_PRECONDITION saying so) and never on a router. With a token configured, a call needs
it before it gets here (``serving/security.py``: admin methods always need the token, even
with ``auth_serving`` off); the :data:`Authorizer` hook is for finer rules on top.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import shutil
import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import torch

from retrieval.index.update import REBUILD_IMBALANCE, list_imbalance
from retrieval.model import RetrievalModel
from retrieval.updates import (
    Attributes,
    RemoveItems,
    SetItemAttributes,
    UpdateBatch,
    UpdateEmbeddings,
    UpdateError,
    UpsertItems,
    apply_update,
    prepare_update,
    table_shapes,
)
from serving import admin_pb2 as pb
from serving import admin_pb2_grpc as pb_grpc
from serving.host import ModelHost
from serving.metrics import ServingMetrics
from serving.requests import (
    MalformedMessage,
    RequestError,
    UnavailableError,
    error_status,
    tolerant_deserializer,
)
from serving.state import ServingState
from serving.update_log import UpdateLog, log_path

log = logging.getLogger(__name__)

SERVICE = "recserve.admin.v1.Admin"
Authorizer = Callable[[grpc.ServicerContext, str], None]
"""``authorize(context, method)`` runs first in every admin call; raising ``PermissionError``
refuses it (PERMISSION_DENIED). Tokens are checked earlier, by the server's interceptor
(``serving/security.py``); the default admits every call that got this far."""


def allow_all(context: grpc.ServicerContext, method: str) -> None:
    """The default :data:`Authorizer`: no rule beyond the server's token check."""


MAX_VECTOR_NORM = 1e18
"""Longest item vector an update may give: the index compares squared L2 distances in float32
(at most ~3.4e38), so a much longer vector has no nearest list at all."""


class AdminUnavailableError(RuntimeError):
    """The admin API is off on this server (FAILED_PRECONDITION); the message says why."""


# ---- wire <-> update batches ------------------------------------------------------------------
def _attributes(attrs: Sequence[pb.Attribute], where: str) -> dict[str, tuple[str, ...]]:
    out: dict[str, tuple[str, ...]] = {}
    for a in attrs:
        if a.name in out:
            raise RequestError(f"{where}.{a.name}: given twice")
        out[a.name] = tuple(a.values)
    return out


def _ids(values: Sequence[int]) -> torch.Tensor:
    return torch.tensor(list(values), dtype=torch.int64)


def parse_upsert(
    msg: pb.UpsertItemsRequest, dim: int, max_norm: float | None = MAX_VECTOR_NORM
) -> UpsertItems:
    """``UpsertItems`` message -> batch; ``dim``: the model's vector width D; ``max_norm``: the
    longest vector taken (None: any, for a log's records, which were taken once)."""
    n = len(msg.items)
    vectors, given = torch.zeros(n, dim), torch.zeros(n, dtype=torch.bool)
    for i, item in enumerate(msg.items):
        if len(item.vector) not in (0, dim):
            raise RequestError(
                f"items[{i}].vector: expected {dim} floats (the model's vector width) or none "
                f"(computed by the item tower), got {len(item.vector)}"
            )
        if len(item.vector):
            vector = np.asarray(item.vector, dtype=np.float32)
            norm = float(np.linalg.norm(vector.astype(np.float64)))
            if max_norm is not None and math.isfinite(norm) and norm > max_norm:  # NaN: later
                raise RequestError(
                    f"items[{i}].vector: its length {norm:.3g} is over {max_norm:g} (the "
                    "index compares squared distances in float32)"
                )
            vectors[i] = torch.from_numpy(vector)
            given[i] = True
    attrs = [_attributes(it.attributes, f"items[{i}].attributes") for i, it in enumerate(msg.items)]
    return UpsertItems(
        _ids([it.id for it in msg.items]), attrs, vectors if bool(given.any()) else None, given
    )


def parse_set_attributes(msg: pb.SetItemAttributesRequest) -> SetItemAttributes:
    attrs = [_attributes(it.attributes, f"items[{i}].attributes") for i, it in enumerate(msg.items)]
    return SetItemAttributes(_ids([it.id for it in msg.items]), attrs)


def _widths(model: RetrievalModel) -> dict[str, int]:
    return {name: dim for name, (_, dim) in table_shapes(model).items()}


def parse_embeddings(msg: pb.UpdateEmbeddingsRequest, widths: dict[str, int]) -> UpdateEmbeddings:
    """``UpdateEmbeddings`` message -> batch; ``widths``: ``{table: E}``."""
    n = len(msg.rows)
    width = widths.get(msg.table)
    if width is None:
        known = ", ".join(widths)
        raise RequestError(f"table: unknown table {msg.table!r} (known: {known})")
    if len(msg.values) != n * width:
        raise RequestError(
            f"values: expected {n} rows x {width} (table {msg.table!r}'s width) = {n * width} "
            f"floats, got {len(msg.values)}"
        )
    values = torch.from_numpy(np.asarray(msg.values, dtype=np.float32)).view(n, width)
    return UpdateEmbeddings(msg.table, _ids(msg.rows), values)


def _attribute_messages(attrs: Attributes) -> list[pb.Attribute]:
    return [pb.Attribute(name=k, values=list(v)) for k, v in attrs.items()]


def to_record(batch: UpdateBatch, sequence: int) -> pb.LogRecord:
    """A resolved batch (every vector given) -> its log record."""
    if isinstance(batch, UpsertItems):
        assert batch.vectors is not None and bool(batch.given().all()), "log resolved batches"
        items = [
            pb.Item(id=int(i), vector=v.tolist(), attributes=_attribute_messages(a))
            for i, v, a in zip(batch.ids.tolist(), batch.vectors, batch.attributes, strict=True)
        ]
        return pb.LogRecord(sequence=sequence, upsert_items=pb.UpsertItemsRequest(items=items))
    if isinstance(batch, RemoveItems):
        return pb.LogRecord(
            sequence=sequence, remove_items=pb.RemoveItemsRequest(ids=batch.ids.tolist())
        )
    if isinstance(batch, SetItemAttributes):
        items_a = [
            pb.ItemAttributes(id=int(i), attributes=_attribute_messages(a))
            for i, a in zip(batch.ids.tolist(), batch.attributes, strict=True)
        ]
        return pb.LogRecord(
            sequence=sequence, set_item_attributes=pb.SetItemAttributesRequest(items=items_a)
        )
    return pb.LogRecord(
        sequence=sequence,
        update_embeddings=pb.UpdateEmbeddingsRequest(
            table=batch.table, rows=batch.rows.tolist(), values=batch.values.flatten().tolist()
        ),
    )


def from_record(record: pb.LogRecord, model: RetrievalModel) -> UpdateBatch:
    """A log record -> the batch it logged."""
    which = record.WhichOneof("update")
    if which == "upsert_items":
        return parse_upsert(record.upsert_items, model.index.dim, max_norm=None)
    if which == "remove_items":
        return RemoveItems(_ids(record.remove_items.ids))
    if which == "set_item_attributes":
        return parse_set_attributes(record.set_item_attributes)
    if which == "update_embeddings":
        return parse_embeddings(record.update_embeddings, _widths(model))
    raise ValueError(f"log record {record.sequence}: no update in it")


_ITEM_FIELDS = {"ids": "id", "vectors": "vector", "attributes": "attributes"}


def wire_error(kind: str, e: UpdateError) -> RequestError:
    """A model-level refusal -> INVALID_ARGUMENT naming the field of the wire message."""
    if kind in ("upsert_items", "set_item_attributes") and e.field in _ITEM_FIELDS:
        where = "items" if e.item is None else f"items[{e.item}].{_ITEM_FIELDS[e.field]}{e.sub}"
    elif e.field == "values" and e.item is not None:  # the wire's values are flat [n * E]
        where = f"values (row {e.item})"
    else:
        where = e.field + ("" if e.item is None else f"[{e.item}]") + e.sub
    return RequestError(f"{where}: {e.reason}")


# ---- the apply path ---------------------------------------------------------------------------
class LiveUpdates:
    """Update logs of one served model under ``state_dir``; applies and replays updates."""

    def __init__(
        self,
        state_dir: Path,
        model: str,
        metrics: ServingMetrics,
        versions: Callable[[], list[int]] | None = None,
    ):
        """``versions()``: the versions the repository still holds (logs of others are deleted)."""
        self.state_dir, self.model, self.metrics = Path(state_dir), model, metrics
        self.versions = versions
        self._logs: dict[int, UpdateLog] = {}
        self._rebuild = False
        self._lock = threading.Lock()

    def replay(self, loaded: Any) -> Any:
        """``ModelHost`` ``on_load``: applies ``loaded``'s log to its model (a torn last record
        is dropped); -> ``loaded`` with the updated model. Raises if a record does not apply."""
        version = int(loaded.version)
        path = log_path(self.state_dir, self.model, version)
        self._close(version)
        update_log, records = UpdateLog.open(path)
        model = loaded.model
        for seq, payload in enumerate(records, start=1):
            try:
                record = pb.LogRecord.FromString(payload)
                if record.sequence != seq:
                    raise ValueError(f"the record says it is update {record.sequence}")
                model = apply_update(model, from_record(record, model))
            except Exception as e:
                update_log.close()
                raise RuntimeError(f"{path}: update {seq} does not apply: {e}") from e
        with self._lock:
            self._logs[version] = update_log
        if records:
            log.info(
                "model %s v%d: replayed %d updates from %s", self.model, version, len(records), path
            )
        self.metrics.replayed(len(records), len(records))
        self._observe(model, version)
        self._prune(version)
        return dataclasses.replace(loaded, model=model) if records else loaded

    def apply(
        self,
        host: ModelHost,
        kind: str,
        target: tuple[str, int],
        parse: Callable[[RetrievalModel], UpdateBatch],
    ) -> pb.UpdateReply:
        """Validate -> log (fsync) -> apply between batches; -> the reply. ``target``: the
        (model, version) the message names (empty / 0: the one served)."""
        with host.updating() as served:
            host.check_target(target[0], target[1] or None)
            loaded = served.loaded
            batch = parse(loaded.model)
            try:
                prepared = prepare_update(loaded.model, batch, hold=host.gate.exclusive)
            except UpdateError as e:
                raise wire_error(kind, e) from None
            except ValueError as e:  # checks below the model level (the index's own)
                raise RequestError(str(e)) from None
            version = int(loaded.version)
            update_log = self._log(version)
            seq = update_log.count + 1
            update_log.append(to_record(prepared.resolved, seq).SerializeToString())
            host.swap_updated(dataclasses.replace(loaded, model=prepared.model), prepared.commit)
            self.metrics.update_applied(kind, seq)
            imbalance, rebuild = self._observe(prepared.model, version)
        return pb.UpdateReply(
            model=self.model,
            version=version,
            sequence=seq,
            items=prepared.model.index.ntotal,
            list_imbalance=imbalance,
            rebuild_recommended=rebuild,
        )

    def close(self) -> None:
        for version in list(self._logs):
            self._close(version)

    def _log(self, version: int) -> UpdateLog:
        with self._lock:
            found = self._logs.get(version)
        if found is None:  # a version loaded without replay (on_load not wired): refuse
            raise RuntimeError(f"model {self.model} v{version}: its update log was not replayed")
        return found

    def _close(self, version: int) -> None:
        with self._lock:
            old = self._logs.pop(version, None)
        if old is not None:
            old.close()

    def _observe(self, model: RetrievalModel, version: int) -> tuple[float, bool]:
        """Sets the list balance gauges; logs when a rebuild becomes worth it."""
        imbalance = list_imbalance(model.index)
        rebuild = imbalance > REBUILD_IMBALANCE
        self.metrics.index_balance(imbalance, rebuild)
        if rebuild and not self._rebuild:
            log.warning(
                "model %s v%d: IVF lists are unbalanced after live updates (largest list %.1fx "
                "the mean, above %.1fx): rebuild the index and publish a new version",
                self.model,
                version,
                imbalance,
                REBUILD_IMBALANCE,
            )
        self._rebuild = rebuild
        return imbalance, rebuild

    def _prune(self, serving: int) -> None:
        """Deletes the logs of versions the repository no longer holds (never served again)."""
        if self.versions is None:
            return
        try:  # housekeeping: a failure here must not refuse the version being loaded
            keep = set(self.versions()) | {serving}
            root = self.state_dir / self.model
            for d in root.iterdir() if root.is_dir() else ():
                if d.is_dir() and d.name.isdigit() and int(d.name) not in keep:
                    self._close(int(d.name))
                    shutil.rmtree(d)
                    log.info("model %s: deleted the update log of retired v%s", self.model, d.name)
        except Exception:
            log.exception("model %s: pruning old update logs failed", self.model)


# ---- the gRPC service -------------------------------------------------------------------------
class AdminServicer(pb_grpc.AdminServicer):
    """Parses each call, runs it through :meth:`LiveUpdates.apply`, maps errors to codes."""

    def __init__(self, state: ServingState, authorize: Authorizer = allow_all):
        self.state, self.authorize = state, authorize

    def UpsertItems(
        self, request: pb.UpsertItemsRequest, context: grpc.ServicerContext
    ) -> pb.UpdateReply:
        return self._call(
            context, "upsert_items", request, lambda m: parse_upsert(request, m.index.dim)
        )

    def RemoveItems(
        self, request: pb.RemoveItemsRequest, context: grpc.ServicerContext
    ) -> pb.UpdateReply:
        return self._call(
            context, "remove_items", request, lambda m: RemoveItems(_ids(request.ids))
        )

    def SetItemAttributes(
        self, request: pb.SetItemAttributesRequest, context: grpc.ServicerContext
    ) -> pb.UpdateReply:
        return self._call(
            context, "set_item_attributes", request, lambda m: parse_set_attributes(request)
        )

    def UpdateEmbeddings(
        self, request: pb.UpdateEmbeddingsRequest, context: grpc.ServicerContext
    ) -> pb.UpdateReply:
        return self._call(
            context,
            "update_embeddings",
            request,
            lambda m: parse_embeddings(request, _widths(m)),
        )

    def _updates(self) -> LiveUpdates:
        if self.state.config.router is not None:
            raise AdminUnavailableError(
                "admin: live updates are not supported on a router (document-sharded "
                "serving): publish a new version instead"
            )
        if self.state.updates is None:
            raise AdminUnavailableError(
                "admin: live updates are off: this server has no state folder (set state_dir "
                "in serve.toml, or --state-dir)"
            )
        if self.state.draining.is_set():
            raise UnavailableError("server is draining: not accepting updates")
        return self.state.updates

    def _call(
        self,
        context: grpc.ServicerContext,
        kind: str,
        request: Any,
        parse: Callable[[RetrievalModel], UpdateBatch],
    ) -> pb.UpdateReply:
        try:
            self.authorize(context, kind)
            if isinstance(request, MalformedMessage):  # see add_servicer
                raise request.error()
            updates = self._updates()
            return updates.apply(self.state.host, kind, (request.model, request.version), parse)
        except Exception as e:
            code, reason = self._status(e)
            if code == "INTERNAL":
                log.exception("admin %s failed", kind)
            self.state.metrics.update_failed(kind, reason)
            error = e
        context.abort(grpc.StatusCode[code], str(error) or type(error).__name__)
        raise AssertionError("unreachable: abort raises")

    @staticmethod
    def _status(e: Exception) -> tuple[str, str]:
        if isinstance(e, AdminUnavailableError):
            return "FAILED_PRECONDITION", "failed_precondition"
        if isinstance(e, PermissionError):
            return "PERMISSION_DENIED", "permission_denied"
        code, _, reason = error_status(e)
        return code, reason


def add_servicer(
    server: grpc.Server, state: ServingState, authorize: Authorizer = allow_all
) -> None:
    """Adds the ``Admin`` service to ``server`` (a ``serving.main`` gRPC plugin): the generated
    ``add_AdminServicer_to_server``'s handlers, but with requests parsed by
    :func:`~serving.requests.tolerant_deserializer` (bytes that are no valid message get
    INVALID_ARGUMENT; the generated deserializer makes gRPC answer INTERNAL)."""
    servicer = AdminServicer(state, authorize)
    handlers = {
        m.name: grpc.unary_unary_rpc_method_handler(
            getattr(servicer, m.name),
            request_deserializer=tolerant_deserializer(getattr(pb, m.input_type.name)),
            response_serializer=getattr(pb, m.output_type.name).SerializeToString,
        )
        for m in pb.DESCRIPTOR.services_by_name[SERVICE.split(".")[-1]].methods
    }
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, handlers),))
    server.add_registered_method_handlers(SERVICE, handlers)
