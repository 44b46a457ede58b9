"""An embedding server: one folder of packed rows (its part of the remote tables) in DRAM, over gRPC.

``EmbeddingService`` (``embedding.proto``) plus standard gRPC health checking
(``grpc.health.v1.Health``: SERVING once the folder is loaded, NOT_SERVING while draining).

* Ranged tables answer GLOBAL row ids in ``[lo, hi)`` with one ``index_select`` over the packed
  rows ``uint8 [hi - lo, row_bytes]``; an id outside the range is INVALID_ARGUMENT.
* Keyed tables map raw 64-bit keys to slots of a growable packed-row array; missing keys get a
  zero row and ``found = 0``. ``Put`` appends to the table's log (fsynced) before it answers,
  so a restarted server serves the same rows.

``interceptors`` and ``credentials`` secure the port (``common/security.py`` builds them: a
bearer-token check and TLS); the server itself knows nothing of tokens.

The folder's rows must fit ``memory_budget`` bytes: the server refuses to start (and refuses puts) with a
message saying by how many bytes it is over.

Example::

    server = EmbeddingServer("embeddings/server-0", port=0, memory_budget=4 << 30)
    address = server.start()  # "127.0.0.1:43121"
    ...
    server.stop(grace=5.0)
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from concurrent import futures
from dataclasses import dataclass
from pathlib import Path

import grpc
import numpy as np
import torch
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from common.grpc_util import add_service, bind_port, format_address, serve_until_signal
from common.ready import ReadyLine, ready_line
from sharded_tables.remote import embedding_pb2 as pb
from sharded_tables.remote import embedding_pb2_grpc as pb_grpc
from sharded_tables.remote.server_files import (
    KeyLog,
    latest_positions,
    read_manifest,
    read_table,
    replay_log,
    select_tables,
)
from sharded_tables.specs import DType, row_bytes

log = logging.getLogger(__name__)

SERVICE = "recserve.embedding.v1.EmbeddingService"
MAX_MESSAGE_BYTES = 256 << 20
GRPC_OPTIONS = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.so_reuseport", 0),  # a second server on a taken port must fail, not share it
]


class MemoryBudgetError(ValueError):
    """The folder's rows (or a put) do not fit the server's memory budget."""


class RequestError(Exception):
    """A bad request: becomes the gRPC status ``code`` with ``message``."""

    def __init__(self, code: grpc.StatusCode, message: str):
        super().__init__(message)
        self.code = code


def _ids(raw: bytes, table: str) -> np.ndarray:
    """Wire ids (little-endian int64 bytes) -> ``int64 [n]`` (read-only view)."""
    if len(raw) % 8:
        raise RequestError(
            grpc.StatusCode.INVALID_ARGUMENT,
            f"table {table!r}: ids has {len(raw)} bytes, not a multiple of 8 (int64 ids)",
        )
    return np.frombuffer(raw, "<i8")


@dataclass
class RangedTable:
    """Global rows ``[lo, hi)`` of a table: ``rows uint8 [hi - lo, row_bytes]``, read-only."""

    name: str
    dtype: DType
    dim: int
    lo: int
    hi: int
    rows: torch.Tensor
    served: int = 0

    def lookup(self, ids: np.ndarray) -> tuple[bytes, bytes]:
        """``ids int64 [n]`` (global) -> (n packed rows, b"": all found)."""
        local = ids - self.lo  # [n], a fresh writable array
        if len(ids) and (local.min() < 0 or local.max() >= self.hi - self.lo):
            bad = ids[(local < 0) | (local >= self.hi - self.lo)][0]
            raise RequestError(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"table {self.name!r}: id {bad} is outside this server's rows "
                f"[{self.lo}, {self.hi})",
            )
        # numpy, not torch.index_select: torch's OpenMP workers spin between calls and take the
        # cores from the gRPC threads of this and other servers on the host
        return np.take(self.rows.numpy(), local, axis=0).tobytes(), b""  # [n, row_bytes]

    def nbytes(self) -> int:
        return self.rows.numel()


class KeyedTable:
    """Rows under raw 64-bit keys: ``key -> slot`` dict over a growable ``uint8 [cap, rb]``."""

    def __init__(
        self, name: str, dtype: DType, dim: int, log: KeyLog, keys: np.ndarray, rows: np.ndarray
    ) -> None:
        self.name, self.dtype, self.dim = name, DType(dtype), dim
        self.rb = row_bytes(dim, self.dtype)
        self.log = log
        self.served = 0
        self._lock = threading.Lock()
        self._slot: dict[int, int] = dict(zip(keys.tolist(), range(len(keys)), strict=True))
        self._rows = np.zeros((max(1024, len(keys)), self.rb), np.uint8)
        self._rows[: len(keys)] = rows

    def lookup(self, ids: np.ndarray) -> tuple[bytes, bytes]:
        """``ids int64 [n]`` -> (n packed rows, zeros where missing; n found bytes)."""
        with self._lock:
            get = self._slot.get
            slots = np.fromiter((get(k, -1) for k in ids.tolist()), np.int64, len(ids))
            found = slots >= 0
            rows = self._rows[np.where(found, slots, 0)]  # [n, rb], a copy
        rows[~found] = 0
        return rows.tobytes(), found.astype(np.uint8).tobytes()

    def new_keys(self, ids: np.ndarray) -> int:
        """How many distinct keys of ``ids`` are not stored yet."""
        return sum(1 for k in set(ids.tolist()) if k not in self._slot)

    def put(self, ids: np.ndarray, rows: np.ndarray) -> None:
        """Logs (durably) and stores ``rows uint8 [n, rb]`` under ``ids int64 [n]``."""
        last = latest_positions(ids)  # a key repeated in one put keeps its last row
        ids, rows = ids[last], rows[last]
        with self._lock:  # log order == apply order, so a replay rebuilds exactly this table
            self.log.append(ids, rows)
            slots = np.empty(len(ids), np.int64)
            for i, k in enumerate(ids.tolist()):
                slots[i] = self._slot.setdefault(k, len(self._slot))
            if len(self._slot) > len(self._rows):
                grown = np.zeros((max(len(self._slot), 2 * len(self._rows)), self.rb), np.uint8)
                grown[: len(self._rows)] = self._rows
                self._rows = grown
            self._rows[slots] = rows

    def nbytes(self) -> int:
        return len(self._slot) * self.rb


Table = RangedTable | KeyedTable


def load_tables(
    folder: Path, memory_budget: int | None, names: list[str] | None, verify: bool
) -> dict[str, Table]:
    """Loads the folder's tables, refusing (``MemoryBudgetError``) a folder over the budget."""
    entries = select_tables(read_manifest(folder), names)
    ranged = sum(e["bytes"] for e in entries if e["partition"] == "range")
    _check_budget(ranged, memory_budget, f"folder {folder} (ranged tables)")
    tables: dict[str, Table] = {}
    for e in entries:
        if e["partition"] == "range":
            t = read_table(folder, e, verify)
            assert t.rows is not None
            tables[t.name] = RangedTable(t.name, t.dtype, t.dim, t.lo, t.hi, t.rows)
        else:
            path = folder / e["file"]
            keys, rows, valid = replay_log(path, e["row_bytes"])
            log = KeyLog(path, valid)
            tables[e["name"]] = KeyedTable(e["name"], e["dtype"], e["dim"], log, keys, rows)
    _check_budget(sum(t.nbytes() for t in tables.values()), memory_budget, f"folder {folder}")
    return tables


def _check_budget(need: int, budget: int | None, what: str) -> None:
    if budget is not None and need > budget:
        raise MemoryBudgetError(
            f"{what} needs {need} bytes, {need - budget} bytes over the memory budget of "
            f"{budget} bytes"
        )


class EmbeddingServicer(pb_grpc.EmbeddingServiceServicer):
    """The RPC handlers over loaded tables (thread-safe; the handlers trust loaded tables)."""

    def __init__(self, name: str, tables: dict[str, Table], memory_budget: int | None):
        self.name, self.tables, self.memory_budget = name, tables, memory_budget
        self.requests = self.ids_served = self.puts = 0
        self._count_lock = threading.Lock()
        self._put_lock = threading.Lock()

    def _table(self, name: str) -> Table:
        table = self.tables.get(name)
        if table is None:
            raise RequestError(
                grpc.StatusCode.NOT_FOUND,
                f"table {name!r} is not on server {self.name} (it holds {sorted(self.tables)})",
            )
        return table

    def Lookup(self, request: pb.LookupRequest, context: grpc.ServicerContext) -> pb.LookupResponse:
        out = pb.LookupResponse()
        try:
            served = []
            for req in request.tables:
                table = self._table(req.table)
                ids = _ids(req.ids, req.table)
                rows, found = table.lookup(ids)
                out.tables.append(
                    pb.TableRows(
                        table=req.table,
                        dtype=table.dtype.value,
                        dim=table.dim,
                        rows=rows,
                        found=found,
                    )
                )
                served.append((table, len(ids)))
        except RequestError as e:
            context.abort(e.code, str(e))
        with self._count_lock:
            self.requests += 1
            for table, n in served:
                table.served += n
                self.ids_served += n
        return out

    def Put(self, request: pb.PutRequest, context: grpc.ServicerContext) -> pb.PutResponse:
        try:
            table = self._table(request.table)
            if not isinstance(table, KeyedTable):
                raise RequestError(
                    grpc.StatusCode.INVALID_ARGUMENT,
                    f"table {request.table!r} is ranged; Put takes keyed tables only",
                )
            ids = _ids(request.ids, request.table)
            if len(request.rows) != len(ids) * table.rb:
                raise RequestError(
                    grpc.StatusCode.INVALID_ARGUMENT,
                    f"table {request.table!r}: rows has {len(request.rows)} bytes, expected "
                    f"{len(ids)} ids x {table.rb} bytes",
                )
            rows = np.frombuffer(request.rows, np.uint8).reshape(len(ids), table.rb)
            with self._put_lock:
                need = self.bytes_used() + table.new_keys(ids) * table.rb
                try:
                    _check_budget(need, self.memory_budget, f"put to table {request.table!r}")
                except MemoryBudgetError as e:
                    raise RequestError(grpc.StatusCode.RESOURCE_EXHAUSTED, str(e)) from None
                table.put(ids, rows)
        except RequestError as e:
            context.abort(e.code, str(e))
        with self._count_lock:
            self.puts += 1
        return pb.PutResponse(stored=len(ids))

    def Info(self, request: pb.InfoRequest, context: grpc.ServicerContext) -> pb.InfoResponse:
        out = pb.InfoResponse(
            server=self.name,
            memory_budget=self.memory_budget or 0,
            bytes_used=self.bytes_used(),
            requests=self.requests,
            ids_served=self.ids_served,
            puts=self.puts,
        )
        for t in self.tables.values():
            info = pb.TableInfo(
                name=t.name, dtype=t.dtype.value, dim=t.dim, bytes=t.nbytes(), ids_served=t.served
            )
            if isinstance(t, RangedTable):
                info.partition, info.row_lo, info.row_hi = "range", t.lo, t.hi
            else:
                info.partition, info.keys = "keyed", t.nbytes() // t.rb
            out.tables.append(info)
        return out

    def bytes_used(self) -> int:
        return sum(t.nbytes() for t in self.tables.values())


class EmbeddingServer:
    """Loads a server folder (at construction) and serves it over gRPC (:meth:`start`)."""

    def __init__(
        self,
        folder: Path | str,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        memory_budget: int | None = None,
        tables: list[str] | None = None,
        name: str | None = None,
        workers: int = 8,
        verify: bool = True,
        interceptors: Sequence[grpc.ServerInterceptor] = (),
        credentials: grpc.ServerCredentials | None = None,
    ):
        self.folder, self.host, self.port = Path(folder), host, port
        self.credentials = credentials
        self.tables = load_tables(self.folder, memory_budget, tables, verify)
        self.servicer = EmbeddingServicer(name or str(self.folder), self.tables, memory_budget)
        self.health = health.HealthServicer()
        self._server = grpc.server(
            futures.ThreadPoolExecutor(max_workers=workers),
            interceptors=list(interceptors),
            options=GRPC_OPTIONS,
        )
        add_service(self._server, pb, SERVICE, self.servicer)  # garbage: INVALID_ARGUMENT
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self._server)

    @property
    def address(self) -> str:
        return format_address(self.host, self.port)

    def start(self) -> str:
        """Binds, starts and reports SERVING; returns ``host:port`` (the bound port)."""
        self.port = bind_port(self._server, self.host, self.port, "--port", self.credentials)
        self._server.start()
        for service in ("", SERVICE):
            self.health.set(service, health_pb2.HealthCheckResponse.SERVING)
        return self.address

    def stop(self, grace: float = 5.0) -> None:
        """Reports NOT_SERVING, lets in-flight calls finish (up to ``grace`` s), closes logs."""
        self.health.enter_graceful_shutdown()
        self._server.stop(grace).wait()
        for t in self.tables.values():
            if isinstance(t, KeyedTable):
                t.log.close()


def serve(
    folder: Path | str,
    port: int,
    host: str = "127.0.0.1",
    memory_budget: int | None = None,
    tables: list[str] | None = None,
    *,
    name: str | None = None,
    grace: float = 5.0,
    interceptors: Sequence[grpc.ServerInterceptor] = (),
    credentials: grpc.ServerCredentials | None = None,
) -> None:
    """Serves ``folder`` until SIGTERM or SIGINT, then drains (NOT_SERVING) and stops; prints
    the ready line (``common/ready.py``, role ``embeddings``) once serving."""
    server = EmbeddingServer(
        folder, host=host, port=port, memory_budget=memory_budget, tables=tables, name=name,
        interceptors=interceptors, credentials=credentials,
    )  # fmt: skip

    def start() -> ReadyLine:
        address = server.start()
        log.info("embed-server listening on %s (folder %s: %s)", address, folder,
                 ", ".join(sorted(server.tables)))  # fmt: skip
        return ready_line(
            "embeddings", grpc=address, folder=str(folder), tables=sorted(server.tables)
        )

    serve_until_signal(start)
    server.stop(grace)
