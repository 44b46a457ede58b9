"""Client of the remote tier: batched, de-duplicated row fetches from embedding servers.

A routing description (:class:`~sharded_tables.remote.routing.RemoteTable`, re-exported here)
says, per table, which servers hold which ids.

:meth:`RemoteTables.fetch` takes the ids of a whole batch, de-duplicates them per table, groups
them by server and sends ONE ``Lookup`` per server (covering all tables) in parallel, each with a
deadline, then puts the packed rows back in request order. Calls are blocking stub calls: the
last server's in the caller's thread, the others' on a pool of this client's (a gRPC future
starts a channel-polling thread whenever its channel was idle, which for a lone caller is every
call: a thread's start and a hand-off each). A server that is down or misses the
deadline raises :class:`RemoteServerError` (code and address in the message; a
:class:`RemoteLookupError` and the tables' retryable
:class:`~sharded_tables.interface.TablesUnavailableError`) or, with ``fallback="zero"``,
gives zero rows for its ids and is counted (:meth:`RemoteTables.stats` and the
``recserve_remote_*`` Prometheus counters, label ``server``). Errors that are the caller's
(INVALID_ARGUMENT: an id the server does not hold; NOT_FOUND: a table it does not hold) always
raise. Ids may live on any device; rows come back on the CPU. Ranged tables of at most
``hold_bytes`` are held whole and answered from memory (``sharded_tables/remote/held.py``), so
they keep answering while their servers are down.

Example::

    routing = [
        RemoteTable("item", DType.INT8, 16, ("127.0.0.1:7001", "127.0.0.1:7002"), "range",
                    bounds=(0, 5000, 10000)),
        RemoteTable("user_hash", DType.FP16, 16, ("127.0.0.1:7001", "127.0.0.1:7002"), "keyed"),
    ]
    with RemoteTables(routing, timeout=0.5) as remote:
        rows = remote.fetch({"item": torch.tensor([7, 9000, 7])})
        rows["item"].shape  # (3, 20): uint8 packed int8 rows, rows 0 and 2 equal
"""

from __future__ import annotations

import threading
from collections.abc import Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Literal

import grpc
import numpy as np
import torch
from prometheus_client import Counter

from common.grpc_util import ClientAuth, open_channel
from common.torch_threads import use_process_threads
from sharded_tables.interface import TablesUnavailableError
from sharded_tables.remote import embedding_pb2 as pb
from sharded_tables.remote import embedding_pb2_grpc as pb_grpc
from sharded_tables.remote.held import HeldTables
from sharded_tables.remote.routing import RemoteTable, route, server_of, splitmix64
from sharded_tables.remote.server import MAX_MESSAGE_BYTES
from sharded_tables.store import RowStore

__all__ = [
    "SERVER_TROUBLE",
    "EmbeddingVersions",
    "RemoteLookupError",
    "RemoteServerError",
    "RemoteTable",
    "RemoteTables",
    "route",
    "server_of",
    "splitmix64",
]

CHANNEL_OPTIONS = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    # a restarted server is reachable again within a second, not after minutes of backoff
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 1000),
]
# Codes that mean "this server is in trouble" (zero-fill may hide them); others are caller bugs.
SERVER_TROUBLE = frozenset(
    {
        grpc.StatusCode.UNAVAILABLE,
        grpc.StatusCode.DEADLINE_EXCEEDED,
        grpc.StatusCode.RESOURCE_EXHAUSTED,
        grpc.StatusCode.CANCELLED,
        grpc.StatusCode.ABORTED,
        grpc.StatusCode.INTERNAL,
        grpc.StatusCode.UNKNOWN,
    }
)

# Module-level, so constructing many clients (tests) never registers a metric twice.
LOOKUPS = Counter("recserve_remote_lookups", "Lookup calls sent", ["server"])
LOOKUP_IDS = Counter("recserve_remote_lookup_ids", "Ids sent (after de-duplication)", ["server"])
FAILURES = Counter("recserve_remote_failures", "Failed calls", ["server", "code"])
ZERO_FILLED = Counter("recserve_remote_zero_filled_ids", "Ids answered with zero rows", ["server"])

Positions = np.ndarray | slice
"""Positions into a table's distinct ids (a slice: all of them, one server)."""


class RemoteLookupError(RuntimeError):
    """A call to an embedding server failed: ``code`` (grpc.StatusCode) at ``address``."""

    def __init__(self, code: grpc.StatusCode, address: str, details: str):
        super().__init__(f"embedding server {address}: {code.name}: {details}")
        self.code, self.address = code, address


class RemoteServerError(RemoteLookupError, TablesUnavailableError):
    """A call failed with a code of :data:`SERVER_TROUBLE`: the server is at fault, not the
    request, so a retry may succeed."""


def lookup_error(code: grpc.StatusCode, address: str, details: str) -> RemoteLookupError:
    """The error of a failed call: a :class:`RemoteServerError` when ``code`` is server trouble."""
    kind = RemoteServerError if code in SERVER_TROUBLE else RemoteLookupError
    return kind(code, address, details)


class RemoteTables(RowStore):
    """Packed rows of remote tables (any partition) and the keyed :class:`RowStore` interface.

    One channel and stub per server, kept open until :meth:`close`. ``timeout`` (seconds) is the
    default deadline of every call; ``fallback`` is ``"raise"`` or ``"zero"`` (see module doc);
    ``auth``: TLS and a bearer token for the calls (None: plaintext, no token); ``version``: the
    model version whose rows every call reads and writes (0: the servers' newest), so a router
    mid-rollout reads the rows of the version it serves; ``hold_bytes``: a ranged table of at
    most this many bytes is held whole and answered from memory, through an outage of its
    servers too (``sharded_tables/remote/held.py``; 0: none).
    """

    def __init__(
        self,
        tables: Sequence[RemoteTable],
        *,
        timeout: float = 1.0,
        fallback: Literal["raise", "zero"] = "raise",
        auth: ClientAuth | None = None,
        version: int = 0,
        hold_bytes: int = 0,
    ):
        if fallback not in ("raise", "zero"):
            raise ValueError(f"fallback must be 'raise' or 'zero', got {fallback!r}")
        if timeout <= 0:
            raise ValueError(f"timeout must be > 0 seconds, got {timeout}")
        self.tables = {t.name: t for t in tables}
        if len(self.tables) != len(tables):
            raise ValueError(f"tables: duplicate names in {[t.name for t in tables]}")
        self.timeout, self.fallback, self.version = timeout, fallback, version
        self.held = HeldTables(tables, hold_bytes)
        addresses = sorted({a for t in tables for a in t.servers})
        self._channels = {a: open_channel(a, CHANNEL_OPTIONS, auth) for a in addresses}
        self._stubs = {a: pb_grpc.EmbeddingServiceStub(c) for a, c in self._channels.items()}
        names = ("requests", "ids", "failures", "zero_filled_ids")
        self._stats: dict[str, dict[str, int]] = {k: dict.fromkeys(addresses, 0) for k in names}
        self._stats_lock = threading.Lock()
        self._metrics = {a: (LOOKUPS.labels(a), LOOKUP_IDS.labels(a)) for a in addresses}
        # calls to all servers but one run here (one call runs in the caller's thread)
        self._calls = ThreadPoolExecutor(
            max_workers=max(1, len(addresses) - 1),
            thread_name_prefix="embed-call",
            initializer=use_process_threads,
        )

    def _count(self, kind: str, address: str, n: int) -> None:
        with self._stats_lock:
            self._stats[kind][address] += n

    def _spec(self, table: str) -> RemoteTable:
        if table not in self.tables:
            raise KeyError(f"unknown table {table!r} (known: {sorted(self.tables)})")
        return self.tables[table]

    def _failed(self, address: str, e: grpc.RpcError) -> RemoteLookupError:
        code = e.code() if isinstance(e, grpc.Call) else grpc.StatusCode.UNKNOWN
        details = e.details() if isinstance(e, grpc.Call) else str(e)
        self._count("failures", address, 1)
        FAILURES.labels(address, code.name).inc()
        return lookup_error(code, address, details or "")

    def hold(self, timeout: float | None = None) -> list[str]:
        """Fetches every table this client holds whole (``hold_bytes``) that it does not hold
        yet; -> the tables held. A server that does not answer raises, as a fetch does."""
        return [n for n in sorted(self.held.names) if self._hold(n, timeout)]

    def _hold(self, name: str, timeout: float | None) -> bool:
        def fetch(ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
            return self._lookup_servers({name: torch.from_numpy(ids)}, timeout)[name]

        return self.held.load(name, fetch)

    def _lookup(
        self, ids_by_table: Mapping[str, torch.Tensor], timeout: float | None
    ) -> dict[str, tuple[np.ndarray, np.ndarray]]:
        """-> per table (rows ``uint8 [n, rb]``, found ``bool [n]``) in the order of its ids:
        held tables from memory, the others from the servers."""
        # held now, or False: its rows came back zero-filled (``fallback="zero"``), and this
        # lookup gets zero rows rather than a second call to a server that just did not answer
        held = {n: self._hold(n, timeout) for n in ids_by_table if n in self.held.names}
        if not held:
            return self._lookup_servers(ids_by_table, timeout)
        out = {n: self.held.rows(n, _id_array(n, ids_by_table[n]), ok) for n, ok in held.items()}
        rest = {n: ids for n, ids in ids_by_table.items() if n not in out}
        if rest:
            out.update(self._lookup_servers(rest, timeout))
        return out

    def _lookup_servers(
        self, ids_by_table: Mapping[str, torch.Tensor], timeout: float | None
    ) -> dict[str, tuple[np.ndarray, np.ndarray]]:
        """:meth:`_lookup` by one request per server."""
        requests: dict[str, pb.LookupRequest] = {}
        parts: dict[str, list[tuple[str, Positions]]] = {}  # address -> (table, unique positions)
        unique: dict[str, tuple[np.ndarray | None, np.ndarray, np.ndarray]] = {}
        for name, ids in ids_by_table.items():
            spec = self._spec(name)
            ids_np = _id_array(name, ids)
            inverse: np.ndarray | None = None  # None: the ids are distinct and ascending already
            if len(ids_np) > 1 and not (ids_np[1:] > ids_np[:-1]).all():
                ids_np, inverse = np.unique(ids_np, return_inverse=True)  # [u], [n]
            uniq_np = ids_np
            rows = np.zeros((len(uniq_np), spec.row_bytes), np.uint8)
            unique[name] = (inverse, rows, np.zeros(len(uniq_np), bool))
            for s, pos in self._by_server(spec, uniq_np):
                address = spec.servers[s]
                req = requests.setdefault(address, pb.LookupRequest(version=self.version))
                req.tables.add(table=name, ids=uniq_np[pos].astype("<i8").tobytes())
                parts.setdefault(address, []).append((name, pos))
        deadline = self.timeout if timeout is None else timeout
        addresses = list(requests)
        calls: dict[str, Future[pb.LookupResponse | grpc.RpcError]] = {
            a: self._calls.submit(self._call, a, requests[a], deadline) for a in addresses[:-1]
        }
        if addresses:  # the last in this thread: no hand-off when there is one server
            last = self._call(addresses[-1], requests[addresses[-1]], deadline)
            for address, call in calls.items():  # a pooled call left behind ends by its deadline
                self._collect(address, call.result(), parts[address], unique)
            self._collect(addresses[-1], last, parts[addresses[-1]], unique)
        return {
            name: (rows, found) if inverse is None else (rows[inverse], found[inverse])
            for name, (inverse, rows, found) in unique.items()
        }

    @staticmethod
    def _by_server(spec: RemoteTable, uniq: np.ndarray) -> list[tuple[int, Positions]]:
        """``[(server position, positions in uniq)]`` for the servers holding any of ``uniq``
        (ascending, distinct)."""
        if len(spec.servers) == 1:
            ranged = spec.partition == "range" and len(uniq)
            if ranged and (uniq[0] < spec.bounds[0] or uniq[-1] >= spec.bounds[-1]):
                server_of(spec, uniq[[0, -1]])  # raises, naming the id (the ends bound the rest)
            return [(0, slice(None))]
        server = server_of(spec, uniq)  # [u]
        order = np.argsort(server, kind="stable")
        counts = np.bincount(server, minlength=len(spec.servers))
        splits = np.split(order, np.cumsum(counts)[:-1])
        return [(s, pos) for s, pos in enumerate(splits) if len(pos)]

    def _call(
        self, address: str, request: pb.LookupRequest, deadline: float
    ) -> pb.LookupResponse | grpc.RpcError:
        """One blocking Lookup; a failed call's error is returned, for :meth:`_collect`."""
        try:
            response: pb.LookupResponse = self._stubs[address].Lookup(
                request, timeout=deadline, wait_for_ready=False
            )
        except grpc.RpcError as e:
            return e
        return response

    def _collect(
        self,
        address: str,
        outcome: pb.LookupResponse | grpc.RpcError,
        parts: list[tuple[str, Positions]],
        unique: dict[str, tuple[np.ndarray | None, np.ndarray, np.ndarray]],
    ) -> None:
        """Copies one server's answer into the unique-id rows of its tables.

        A failure raises, or (``fallback="zero"`` and a server-side code) leaves the rows zero.
        """
        n_ids = sum(_count(pos, len(unique[name][1])) for name, pos in parts)
        with self._stats_lock:
            self._stats["requests"][address] += 1
            self._stats["ids"][address] += n_ids
        lookups, lookup_ids = self._metrics[address]
        lookups.inc()
        lookup_ids.inc(n_ids)
        response = outcome
        if isinstance(response, grpc.RpcError):
            error = self._failed(address, response)
            if self.fallback == "raise" or error.code not in SERVER_TROUBLE:
                raise error from None
            self._count("zero_filled_ids", address, n_ids)
            ZERO_FILLED.labels(address).inc(n_ids)
            return  # rows stay zero, found stays False
        if len(response.tables) != len(parts):
            raise lookup_error(
                grpc.StatusCode.INTERNAL, address, f"{len(response.tables)} tables for {len(parts)}"
            )
        for got, (name, pos) in zip(response.tables, parts, strict=True):
            _, rows, found = unique[name]
            n = _count(pos, len(rows))
            if (
                got.table != name
                or len(got.rows) != n * rows.shape[1]
                or len(got.found) not in (0, n)
            ):
                raise lookup_error(
                    grpc.StatusCode.INTERNAL,
                    address,
                    f"table {name!r}: got {len(got.rows)} bytes and {len(got.found)} found flags "
                    f"of table {got.table!r}, expected {n} rows of {rows.shape[1]} bytes",
                )
            rows[pos] = np.frombuffer(got.rows, np.uint8).reshape(n, rows.shape[1])
            found[pos] = np.frombuffer(got.found, np.uint8).astype(bool) if got.found else True

    def fetch(
        self, ids_by_table: Mapping[str, torch.Tensor], timeout: float | None = None
    ) -> dict[str, torch.Tensor]:
        """``{table: ids int64 [n]}`` -> ``{table: packed rows uint8 [n, row_bytes]}``.

        Keyed tables give zero rows for keys never stored. ``timeout``: seconds (default: the
        client's), the deadline of the whole fetch since all servers are asked at once.
        """
        return {
            t: torch.from_numpy(rows)
            for t, (rows, _) in self._lookup(ids_by_table, timeout).items()
        }

    def get(self, table: str, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``ids int64 [n]`` -> (rows ``uint8 [n, row_bytes]``, found ``bool [n]``)."""
        rows, found = self._lookup({table: ids}, None)[table]
        return torch.from_numpy(rows), torch.from_numpy(found)

    def put(
        self, table: str, ids: torch.Tensor, rows: torch.Tensor, timeout: float | None = None
    ) -> None:
        """Stores ``rows uint8 [n, row_bytes]`` under ``ids int64 [n]`` of a keyed table.

        Returns once every server involved has made its rows durable; failures always raise.
        """
        spec = self._spec(table)
        if spec.partition != "keyed":
            raise ValueError(f"table {table!r} is ranged; put takes keyed tables only")
        if (
            ids.dtype != torch.int64
            or rows.dtype != torch.uint8
            or rows.shape != (len(ids), spec.row_bytes)
        ):
            raise ValueError(
                f"table {table!r}: expected ids int64 [n] and rows uint8 [n, {spec.row_bytes}], "
                f"got {ids.dtype} {list(ids.shape)} and {rows.dtype} {list(rows.shape)}"
            )
        ids_np, rows_np = ids.cpu().numpy(), rows.cpu().numpy()
        server = server_of(spec, ids_np)
        calls = {}
        for s, address in enumerate(spec.servers):
            sel = server == s
            if sel.any():
                req = pb.PutRequest(
                    table=table,
                    ids=ids_np[sel].astype("<i8").tobytes(),
                    rows=np.ascontiguousarray(rows_np[sel]).tobytes(),
                    version=self.version,
                )
                deadline = self.timeout if timeout is None else timeout
                calls[address] = self._stubs[address].Put.future(req, timeout=deadline)
        for address, call in calls.items():
            try:
                call.result()
            except grpc.RpcError as e:
                raise self._failed(address, e) from None

    def info(self, timeout: float | None = None) -> dict[str, pb.InfoResponse]:
        """``InfoResponse`` of every server, by address."""
        deadline = self.timeout if timeout is None else timeout
        calls = {
            a: stub.Info.future(pb.InfoRequest(), timeout=deadline)
            for a, stub in self._stubs.items()
        }
        out = {}
        for address, call in calls.items():
            try:
                out[address] = call.result()
            except grpc.RpcError as e:
                raise self._failed(address, e) from None
        return out

    def _keyed_servers(self, table: str, rpc: str) -> tuple[str, ...]:
        spec = self._spec(table)
        if spec.partition != "keyed":
            raise ValueError(f"table {table!r} is ranged; {rpc} takes keyed tables only")
        return tuple(spec.servers)

    def keys(self, table: str, timeout: float | None = None) -> torch.Tensor:
        """``int64 [k]``: every key a keyed table stores, over all its servers."""
        deadline = self.timeout if timeout is None else timeout
        parts = [np.zeros(0, np.int64)]
        for address in self._keyed_servers(table, "keys"):
            req = pb.KeysRequest(table=table, version=self.version)
            try:
                for chunk in self._stubs[address].Keys(req, timeout=deadline):
                    parts.append(np.frombuffer(chunk.ids, "<i8").astype(np.int64))
            except grpc.RpcError as e:
                raise self._failed(address, e) from None
        return torch.from_numpy(np.concatenate(parts))

    def marks(self, table: str, timeout: float | None = None) -> dict[str, int]:
        """``{server address: log bytes}`` of a keyed table now: where :meth:`rewind` returns."""
        servers = self._keyed_servers(table, "marks")
        out = {}
        for address, info in self.info(timeout).items():
            if address not in servers:
                continue
            held = [t for t in info.tables if t.name == table and t.partition == "keyed"]
            if not held:
                raise ValueError(f"server {address} holds no keyed table {table!r}")
            out[address] = held[-1].log_bytes  # the newest version's
        return out

    def rewind(self, table: str, marks: Mapping[str, int], timeout: float | None = None) -> int:
        """Cuts every server's log of ``table`` back to ``marks`` (from :meth:`marks`): the
        rows put since are forgotten. -> keys stored after, over all servers."""
        servers = self._keyed_servers(table, "rewind")
        if set(marks) != set(servers):
            raise ValueError(
                f"table {table!r}: marks name servers {sorted(marks)}, the table is on "
                f"{sorted(servers)} (a checkpoint from another set of embedding servers)"
            )
        deadline = self.timeout if timeout is None else timeout
        kept = 0
        for address in servers:
            req = pb.RewindRequest(table=table, log_bytes=marks[address], version=self.version)
            try:
                kept += self._stubs[address].Rewind(req, timeout=deadline).keys
            except grpc.RpcError as e:
                raise self._failed(address, e) from None
        return kept

    def stats(self) -> dict[str, dict[str, int]]:
        """This client's counters by server: requests, ids, failures, zero_filled_ids."""
        with self._stats_lock:
            return {k: dict(v) for k, v in self._stats.items()}

    def close(self) -> None:
        self._calls.shutdown(wait=False)
        for channel in self._channels.values():
            channel.close()

    def __enter__(self) -> RemoteTables:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class EmbeddingVersions:
    """Which model versions the embedding servers at ``addresses`` hold (their ``Info``); one
    channel per server, open until :meth:`close`. A router serves only a version they all hold."""

    def __init__(self, addresses: Sequence[str], auth: ClientAuth | None = None):
        self._channels = [open_channel(a, CHANNEL_OPTIONS, auth) for a in addresses]
        self._stubs = [pb_grpc.EmbeddingServiceStub(c) for c in self._channels]

    def held(self, timeout: float = 1.0) -> set[int] | None:
        """Versions every answering server holds; None: no constraint (no server answered, or all
        serve unversioned folders, which answer any version). A server that does not answer is
        left out: its lookups fail whatever the version."""
        calls = [s.Info.future(pb.InfoRequest(), timeout=timeout) for s in self._stubs]
        common: set[int] | None = None
        for call in calls:
            try:
                versions = set(call.result().versions)
            except grpc.RpcError:
                continue
            if versions:  # empty: an unversioned folder
                common = versions if common is None else common & versions
        return common

    def close(self) -> None:
        for c in self._channels:
            c.close()


def _id_array(table: str, ids: torch.Tensor) -> np.ndarray:
    """``ids int64 [n]`` (any device) -> the NumPy array; ``ValueError`` naming the table."""
    if ids.dtype != torch.int64 or ids.dim() != 1:
        raise ValueError(
            f"table {table!r}: ids must be int64 [n], got {ids.dtype} {list(ids.shape)}"
        )
    # numpy, not torch: torch's OpenMP workers spin after each op and starve the servers'
    # threads on a small host
    return ids.cpu().numpy()


def _count(pos: Positions, n_unique: int) -> int:
    """How many distinct ids ``pos`` names (of ``n_unique``)."""
    return n_unique if isinstance(pos, slice) else len(pos)
