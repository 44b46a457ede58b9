"""Apply the remote part of a plan: one folder per embedding server, and the client's
routing table.

A plan names remote servers by index (``TablePlacement.servers``); deployment gives them
addresses. ``write_server_folders`` writes folder ``<out>/server-<i>`` for every server ``i`` the
plan uses (each ranged table's slice of packed rows ``[bounds[j], bounds[j+1])``, keyed tables
empty), ready for ``recserve serve embeddings --folder <out>/server-<i>``.

:func:`read_server_folders` is the way back for a process that wants no servers (offline batch
scoring): every folder's rows in memory, behind the same ``fetch`` the servers' client has.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path

import torch

from sharded_tables.planner import PlacementPlan
from sharded_tables.remote.routing import RemoteTable, server_of
from sharded_tables.remote.server_files import (
    ServerTable,
    read_server_folder,
    write_server_folder,
)
from sharded_tables.specs import DType, TableSpec, Tier

RemoteRows = dict[str, torch.Tensor | tuple[torch.Tensor, torch.Tensor]]
"""What publishing puts on embedding servers: ``{table: uint8 [rows, row_bytes]}`` for a ranged
remote table, ``{table: (keys int64 [k], uint8 [k, row_bytes])}`` for a keyed (hashed) one."""


def remote_servers(plan: PlacementPlan) -> list[int]:
    """Server indices the plan uses, ascending."""
    return sorted({s for p in plan.tables if p.tier is Tier.REMOTE for s in p.servers})


def server_folder(out: Path, server: int) -> Path:
    return Path(out) / f"server-{server}"


def write_server_folders(
    plan: PlacementPlan,
    specs: Sequence[TableSpec],
    packed: Mapping[str, torch.Tensor | tuple[torch.Tensor, torch.Tensor]],
    out: Path,
) -> dict[int, Path]:
    """Writes one folder per embedding server -> ``{server index: folder}``.

    ``packed``: :data:`RemoteRows` -- every ranged remote table's rows (what
    :meth:`TieredEmbeddingCollection.load_float` returns) and the keys and rows of keyed ones
    (``load_keyed``'s; a keyed table without them starts empty). A keyed row goes to the server
    the client's routing picks for its key.
    """
    by_name = {s.name: s for s in specs}
    per_server: dict[int, list[ServerTable]] = {i: [] for i in remote_servers(plan)}
    for p in plan.tables:
        if p.tier is not Tier.REMOTE:
            continue
        spec = by_name[p.table]
        if p.partition == "keyed":
            _add_keyed(per_server, p.table, p.dtype, spec.dim, p.servers, packed.get(p.table))
            continue
        rows = packed.get(p.table)
        if isinstance(rows, tuple):
            raise ValueError(f"ranged remote table {p.table!r}: expected packed rows, got keys")
        if rows is None:
            raise ValueError(f"no packed rows for remote table {p.table!r}")
        for j, server in enumerate(p.servers):
            lo, hi = p.row_bounds[j], p.row_bounds[j + 1]
            per_server[server].append(
                ServerTable(p.table, p.dtype, spec.dim, "range", lo, hi, rows[lo:hi].contiguous())
            )
    folders = {}
    for server, tables in per_server.items():
        folders[server] = server_folder(out, server)
        write_server_folder(folders[server], tables)
    return folders


def _add_keyed(
    per_server: dict[int, list[ServerTable]],
    table: str,
    dtype: DType,
    dim: int,
    servers: Sequence[int],
    rows: torch.Tensor | tuple[torch.Tensor, torch.Tensor] | None,
) -> None:
    """A keyed table's part on each of ``servers`` (empty without ``rows``)."""
    if rows is None:
        for server in servers:
            per_server[server].append(ServerTable(table, dtype, dim, "keyed"))
        return
    if not isinstance(rows, tuple):
        raise ValueError(f"keyed remote table {table!r}: expected (keys, packed rows)")
    keys, packed = rows
    routing = RemoteTable(table, dtype, dim, tuple(str(s) for s in servers), "keyed")
    at = torch.from_numpy(server_of(routing, keys.numpy()))
    for j, server in enumerate(servers):
        mine = at == j
        per_server[server].append(
            ServerTable(table, dtype, dim, "keyed", rows=packed[mine].contiguous(), ids=keys[mine])
        )


class ServerFolderRows:
    """The rows of embedding-server folders, held in this process: a
    :class:`~sharded_tables.tiered.RemoteFetcher` with no server behind it.

    ``fetch`` answers what the servers would: the same packed bytes (so a model's lookups and
    numbers are the served ones), zero rows for keys a keyed table never stored. Ranged tables
    must be covered from row 0 without a gap by the folders' ranges.
    """

    def __init__(self, tables: Iterable[ServerTable]):
        ranged: dict[str, list[ServerTable]] = {}
        keyed: dict[str, list[ServerTable]] = {}
        for t in tables:
            (ranged if t.partition == "range" else keyed).setdefault(t.name, []).append(t)
        self.rows: dict[str, torch.Tensor] = {}
        """Ranged table -> its packed rows ``uint8 [rows, row_bytes]``."""
        for name, parts in ranged.items():
            parts.sort(key=lambda t: t.lo)
            at = 0
            for t in parts:
                if t.lo != at:
                    raise ValueError(f"table {name!r}: the server folders miss rows [{at}, {t.lo})")
                at = t.hi
            self.rows[name] = torch.cat([t.rows for t in parts if t.rows is not None])
        self.keyed: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        """Keyed table -> (keys ``int64 [k]`` ascending, packed rows ``uint8 [k, row_bytes]``)."""
        for name, parts in keyed.items():
            keys = torch.cat([t.ids if t.ids is not None else torch.zeros(0, dtype=torch.int64)
                              for t in parts])  # fmt: skip
            rows = torch.cat([t.rows for t in parts if t.rows is not None])
            order = keys.argsort()
            self.keyed[name] = keys[order], rows[order]

    def tables(self) -> set[str]:
        return set(self.rows) | set(self.keyed)

    def fetch(
        self, ids_by_table: Mapping[str, torch.Tensor], timeout: float | None = None
    ) -> dict[str, torch.Tensor]:
        """``{table: ids int64 [n]}`` -> ``{table: packed rows uint8 [n, row_bytes]}``. The ids of
        ranged tables are trusted to be in range (the model validated its batch)."""
        out = {}
        for table, ids in ids_by_table.items():
            if table in self.rows:
                out[table] = self.rows[table][ids.cpu()]
                continue
            keys, rows = self.keyed[table]
            ids = ids.cpu()
            at = torch.searchsorted(keys, ids).clamp(max=max(len(keys) - 1, 0))
            found = keys[at] == ids if len(keys) else torch.zeros_like(ids, dtype=torch.bool)
            got = rows[at] if len(keys) else rows.new_zeros((len(ids), rows.shape[1]))
            out[table] = got * found.unsqueeze(1).to(torch.uint8)
        return out


def read_server_folders(out: Path) -> ServerFolderRows:
    """Every ``<out>/server-<i>`` folder (as :func:`write_server_folders` wrote them, checksums
    verified) -> their rows in memory. ``FileNotFoundError`` when ``out`` holds none."""
    folders = sorted(Path(out).glob("server-*"))
    if not folders:
        raise FileNotFoundError(f"{out}: no embedding-server folders (server-<i>)")
    return ServerFolderRows(t for f in folders for t in read_server_folder(f))


def remote_routing(
    plan: PlacementPlan, specs: Sequence[TableSpec], addresses: Mapping[int, str] | Sequence[str]
) -> list[RemoteTable]:
    """The client's view of the plan: each remote table's servers as addresses."""
    by_name = {s.name: s for s in specs}
    addr = dict(enumerate(addresses)) if not isinstance(addresses, Mapping) else dict(addresses)
    out = []
    for p in plan.tables:
        if p.tier is not Tier.REMOTE:
            continue
        missing = [s for s in p.servers if s not in addr]
        if missing:
            raise ValueError(f"table {p.table!r}: no address for remote servers {missing}")
        out.append(
            RemoteTable(
                p.table,
                p.dtype,
                by_name[p.table].dim,
                tuple(addr[s] for s in p.servers),
                partition="keyed" if p.partition == "keyed" else "range",
                bounds=p.row_bounds if p.partition == "range" else (),
            )
        )
    return out
