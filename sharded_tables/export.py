"""Apply the remote part of a plan: one folder per embedding server, and the client's
routing table.

A plan names remote servers by index (``TablePlacement.servers``); deployment gives them
addresses. ``write_server_folders`` writes folder ``<out>/server-<i>`` for every server ``i`` the
plan uses (each ranged table's slice of packed rows ``[bounds[j], bounds[j+1])``, keyed tables
empty), ready for ``recserve serve embeddings --folder <out>/server-<i>``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

import torch

from sharded_tables.planner import PlacementPlan
from sharded_tables.remote.client import RemoteTable
from sharded_tables.remote.server_files import ServerTable, write_server_folder
from sharded_tables.specs import TableSpec, Tier


def remote_servers(plan: PlacementPlan) -> list[int]:
    """Server indices the plan uses, ascending."""
    return sorted({s for p in plan.tables if p.tier is Tier.REMOTE for s in p.servers})


def server_folder(out: Path, server: int) -> Path:
    return Path(out) / f"server-{server}"


def write_server_folders(
    plan: PlacementPlan,
    specs: Sequence[TableSpec],
    packed: Mapping[str, torch.Tensor],
    out: Path,
) -> dict[int, Path]:
    """Writes one folder per embedding server -> ``{server index: folder}``.

    ``packed``: ``{table: uint8 [rows, row_bytes]}`` for every ranged remote table (what
    :meth:`TieredEmbeddingCollection.load_float` returns).
    """
    by_name = {s.name: s for s in specs}
    per_server: dict[int, list[ServerTable]] = {i: [] for i in remote_servers(plan)}
    for p in plan.tables:
        if p.tier is not Tier.REMOTE:
            continue
        spec = by_name[p.table]
        if p.partition == "keyed":
            for server in p.servers:
                per_server[server].append(ServerTable(p.table, p.dtype, spec.dim, "keyed"))
            continue
        rows = packed.get(p.table)
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
