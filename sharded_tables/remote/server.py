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

Following publishes (``--model-repo``): the server polls for newer complete versions and loads
their rows **beside** the held ones (at most 2 versions; ``versions.py``). ``Lookup`` and ``Put``
name the version (``version``; 0: the newest), so a router mid-rollout reads the rows of the
version it serves; ``Info.versions`` lists the versions held. A new version whose rows do not fit
the budget beside the kept version is refused (log line, ``versions_refused`` in ``Info``, the
``recserve_embedding_versions_refused_total`` counter) and the held versions keep serving.

Example::

    server = EmbeddingServer("embeddings/server-0", port=0, memory_budget=4 << 30)
    address = server.start()  # "127.0.0.1:43121"
    ...
    server.stop(grace=5.0)
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent import futures
from pathlib import Path

import grpc
import numpy as np
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from prometheus_client import Counter

from common.grpc_util import add_service, bind_port, format_address
from common.ready import ReadyLine, ready_line
from common.stop_signals import serve_then_stop
from common.torch_threads import use_process_threads
from sharded_tables.remote import embedding_pb2 as pb
from sharded_tables.remote import embedding_pb2_grpc as pb_grpc
from sharded_tables.remote.server_tables import (
    KeyedTable,
    MemoryBudgetError,
    RangedTable,
    RequestError,
    Table,
    check_budget,
    close_tables,
    load_tables,
    wire_ids,
)
from sharded_tables.remote.versions import (
    UNVERSIONED,
    HeldVersions,
    VersionNotHeldError,
    next_version,
)

log = logging.getLogger(__name__)

SERVICE = "recserve.embedding.v1.EmbeddingService"
MAX_MESSAGE_BYTES = 256 << 20
GRPC_OPTIONS = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.so_reuseport", 0),  # a second server on a taken port must fail, not share it
]
KEYS_CHUNK = 1 << 20
"""Keys per ``KeysChunk`` (8 MiB)."""


VERSIONS_REFUSED = Counter(
    "recserve_embedding_versions_refused",
    "New model versions an embedding server did not load (rows over the budget, or unreadable)",
)


class EmbeddingServicer(pb_grpc.EmbeddingServiceServicer):
    """The RPC handlers over the loaded versions' tables (thread-safe; the handlers trust loaded
    tables). ``tables``: the first version's, held as ``version`` (0: an unversioned folder)."""

    def __init__(
        self, name: str, tables: dict[str, Table], memory_budget: int | None, version: int = 0
    ):
        self.name, self.memory_budget = name, memory_budget
        self.held: HeldVersions[dict[str, Table]] = HeldVersions(keep=2)
        self.held.add(version, tables)
        self.requests = self.ids_served = self.puts = self.versions_refused = 0
        self._count_lock = threading.Lock()
        self._put_lock = threading.Lock()

    @property
    def tables(self) -> dict[str, Table]:
        """The newest version's tables."""
        return self.held.get(UNVERSIONED)

    def _table(self, name: str, version: int) -> Table:
        try:
            tables = self.held.get(version)
        except VersionNotHeldError as e:
            raise RequestError(grpc.StatusCode.NOT_FOUND, f"server {self.name}: {e}") from None
        table = tables.get(name)
        if table is None:
            raise RequestError(
                grpc.StatusCode.NOT_FOUND,
                f"table {name!r} is not on server {self.name} (it holds {sorted(tables)})",
            )
        return table

    def Lookup(self, request: pb.LookupRequest, context: grpc.ServicerContext) -> pb.LookupResponse:
        out = pb.LookupResponse()
        try:
            served = []
            for req in request.tables:
                table = self._table(req.table, request.version)
                ids = wire_ids(req.ids, req.table)
                rows, found = table.lookup(ids)
                out.tables.add(  # in place: append would copy the rows into the response
                    table=req.table, dtype=table.dtype.value, dim=table.dim, rows=rows, found=found
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
            table = self._keyed(request.table, request.version, "Put")
            ids = wire_ids(request.ids, request.table)
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
                    check_budget(need, self.memory_budget, f"put to table {request.table!r}")
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
            versions_refused=self.versions_refused,
        )
        for version, tables in self.held.items():
            if version != UNVERSIONED:
                out.versions.append(version)
            for t in tables.values():
                info = pb.TableInfo(
                    name=t.name, dtype=t.dtype.value, dim=t.dim, bytes=t.nbytes(),
                    ids_served=t.served, version=version,
                )  # fmt: skip
                if isinstance(t, RangedTable):
                    info.partition, info.row_lo, info.row_hi = "range", t.lo, t.hi
                else:
                    info.partition, info.keys = "keyed", t.nbytes() // t.rb
                    info.log_bytes = t.log_bytes
                out.tables.append(info)
        return out

    def _keyed(self, name: str, version: int, rpc: str) -> KeyedTable:
        table = self._table(name, version)
        if not isinstance(table, KeyedTable):
            raise RequestError(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"table {name!r} is ranged; {rpc} takes keyed tables only",
            )
        return table

    def Keys(
        self, request: pb.KeysRequest, context: grpc.ServicerContext
    ) -> Iterator[pb.KeysChunk]:
        try:
            keys = self._keyed(request.table, request.version, "Keys").keys()
        except RequestError as e:
            context.abort(e.code, str(e))
        for lo in range(0, len(keys), KEYS_CHUNK):
            yield pb.KeysChunk(ids=keys[lo : lo + KEYS_CHUNK].astype("<i8").tobytes())

    def Rewind(self, request: pb.RewindRequest, context: grpc.ServicerContext) -> pb.RewindResponse:
        try:
            table = self._keyed(request.table, request.version, "Rewind")
            with self._put_lock:  # no put lands between the cut and the reload
                try:
                    kept = table.rewind(request.log_bytes)
                except ValueError as e:
                    raise RequestError(grpc.StatusCode.INVALID_ARGUMENT, str(e)) from None
        except RequestError as e:
            context.abort(e.code, str(e))
        log.info("embed-server %s: table %r rewound to byte %d (%d keys)",
                 self.name, request.table, request.log_bytes, kept)  # fmt: skip
        return pb.RewindResponse(keys=kept)

    def bytes_used(self) -> int:
        """Bytes of rows of every held version."""
        return sum(t.nbytes() for _, tables in self.held.items() for t in tables.values())

    def follow(self, version: int, load: Callable[[int | None], dict[str, Table]]) -> bool:
        """Loads ``version`` beside the newest held one (dropping an older one first) with
        ``load(bytes left in the budget)``; a version that does not fit (or fails to load) is
        refused: counted, logged, and the held versions keep serving. -> whether it loaded."""
        for tables in self.held.make_room():
            close_tables(tables)
        budget = None if self.memory_budget is None else self.memory_budget - self.bytes_used()
        try:
            tables = load(budget)
        except (MemoryBudgetError, ValueError, OSError) as e:
            self.versions_refused += 1
            VERSIONS_REFUSED.inc()
            log.warning("embed-server %s: version %d refused, keeps serving %s: %s",
                        self.name, version, self.held.versions(), e)  # fmt: skip
            return False
        self.held.add(version, tables)
        log.info("embed-server %s: loaded version %d (%s), holds %s", self.name, version,
                 ", ".join(sorted(tables)), self.held.versions())  # fmt: skip
        return True


class EmbeddingServer:
    """Loads a server folder (at construction) and serves it over gRPC (:meth:`start`).

    Following a repository: ``version`` names the folder's model version and ``source()``
    returns ``{version: this server's rows folder}`` of the complete versions (the CLI builds it
    from the repository layout, which this layer does not know). Every ``poll_s`` seconds a newer
    version is loaded beside the held one (see ``versions.py``); a folder that does not exist
    means the version has no rows here (held with no tables).
    """

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
        version: int = UNVERSIONED,
        source: Callable[[], Mapping[int, Path]] | None = None,
        poll_s: float = 2.0,
    ):
        self.folder, self.host, self.port = Path(folder), host, port
        self.credentials = credentials
        self.source, self.poll_s, self._names, self._verify = source, poll_s, tables, verify
        self.refused: set[int] = set()
        self._stopping = threading.Event()
        self._poller: threading.Thread | None = None
        loaded = load_tables(self.folder, memory_budget, tables, verify)
        self.servicer = EmbeddingServicer(name or str(self.folder), loaded, memory_budget, version)
        self.health = health.HealthServicer()
        self._server = grpc.server(
            futures.ThreadPoolExecutor(max_workers=workers, initializer=use_process_threads),
            interceptors=list(interceptors),
            options=GRPC_OPTIONS,
        )
        add_service(self._server, pb, SERVICE, self.servicer)  # garbage: INVALID_ARGUMENT
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self._server)

    @property
    def tables(self) -> dict[str, Table]:
        """The newest held version's tables."""
        return self.servicer.tables

    def versions(self) -> list[int]:
        """Model versions held, ascending ([0]: an unversioned folder)."""
        return self.servicer.held.versions()

    @property
    def address(self) -> str:
        return format_address(self.host, self.port)

    def poll(self) -> int | None:
        """One look at ``source``: loads the next version if there is one; -> it, if loaded."""
        if self.source is None:
            return None
        try:
            available = self.source()
        except (ValueError, OSError) as e:  # a repository mid-publish or unreadable: next time
            log.warning("embed-server %s: cannot list versions: %s", self.servicer.name, e)
            return None
        version = next_version(available, self.versions(), self.refused)
        if version is None:
            return None
        folder = Path(available[version])

        def load(budget: int | None) -> dict[str, Table]:
            if not folder.is_dir():
                return {}
            return load_tables(folder, budget, self._names, self._verify)

        if not self.servicer.follow(version, load):
            self.refused.add(version)
            return None
        return version

    def _poll_loop(self) -> None:
        use_process_threads()  # loading a version computes
        while not self._stopping.wait(self.poll_s):
            self.poll()

    def start(self) -> str:
        """Binds, starts and reports SERVING; returns ``host:port`` (the bound port)."""
        self.port = bind_port(self._server, self.host, self.port, "--port", self.credentials)
        self._server.start()
        for service in ("", SERVICE):
            self.health.set(service, health_pb2.HealthCheckResponse.SERVING)
        if self.source is not None:
            self._poller = threading.Thread(target=self._poll_loop, name="embed-poll", daemon=True)
            self._poller.start()
        return self.address

    def stop(self, grace: float = 5.0) -> None:
        """Reports NOT_SERVING, lets in-flight calls finish (up to ``grace`` s), closes logs."""
        self._stopping.set()
        if self._poller is not None:
            self._poller.join()
        self.health.enter_graceful_shutdown()
        self._server.stop(grace).wait()
        for _, tables in self.servicer.held.items():
            close_tables(tables)


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
    version: int = UNVERSIONED,
    source: Callable[[], Mapping[int, Path]] | None = None,
    poll_s: float = 2.0,
) -> None:
    """Serves ``folder`` until SIGTERM or SIGINT, then drains (NOT_SERVING) and stops; prints
    the ready line (``common/ready.py``, role ``embeddings``) once serving. ``version``,
    ``source``, ``poll_s``: follow a repository's publishes (:class:`EmbeddingServer`)."""
    server = EmbeddingServer(
        folder, host=host, port=port, memory_budget=memory_budget, tables=tables, name=name,
        interceptors=interceptors, credentials=credentials, version=version, source=source,
        poll_s=poll_s,
    )  # fmt: skip

    def start() -> ReadyLine:
        address = server.start()
        log.info("embed-server listening on %s (folder %s: %s)", address, folder,
                 ", ".join(sorted(server.tables)))  # fmt: skip
        return ready_line(
            "embeddings", grpc=address, folder=str(folder), tables=sorted(server.tables)
        )

    serve_then_stop(start, server.stop, grace)
