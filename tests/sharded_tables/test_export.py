"""Server folders read back into this process: the rows a plan wrote, no server needed."""

from __future__ import annotations

import pytest
import torch

from sharded_tables.export import ServerFolderRows, read_server_folders, server_folder
from sharded_tables.remote.server_files import ServerTable, write_server_folder
from sharded_tables.specs import DType, row_bytes

RB = row_bytes(8, DType.INT8)


def _rows(n: int, seed: int) -> torch.Tensor:
    return torch.randint(0, 256, (n, RB), generator=torch.Generator().manual_seed(seed)).to(
        torch.uint8
    )


def test_ranged_and_keyed_rows_come_back_as_the_servers_give_them(tmp_path):
    item = _rows(100, 0)
    keyed = _rows(3, 1)
    keys = torch.tensor([40, 7, 1 << 40])
    write_server_folder(server_folder(tmp_path, 0), [
        ServerTable("item", DType.INT8, 8, "range", 0, 60, item[:60]),
        ServerTable("user", DType.INT8, 8, "keyed", rows=keyed[:2], ids=keys[:2]),
    ])  # fmt: skip
    write_server_folder(server_folder(tmp_path, 1), [
        ServerTable("item", DType.INT8, 8, "range", 60, 100, item[60:]),
        ServerTable("user", DType.INT8, 8, "keyed", rows=keyed[2:], ids=keys[2:]),
    ])  # fmt: skip
    rows = read_server_folders(tmp_path)
    assert rows.tables() == {"item", "user"}
    ids = torch.tensor([99, 0, 59, 60, 59])
    assert torch.equal(rows.fetch({"item": ids})["item"], item[ids])
    got = rows.fetch({"user": torch.tensor([1 << 40, 3, 40, 7])})["user"]
    assert torch.equal(got, torch.stack([keyed[2], torch.zeros(RB, dtype=torch.uint8), *keyed[:2]]))


def test_a_gap_between_the_folders_ranges_is_refused():
    item = _rows(10, 0)
    with pytest.raises(ValueError, match=r"miss rows \[4, 6\)"):
        ServerFolderRows([
            ServerTable("item", DType.INT8, 8, "range", 6, 10, item[6:]),
            ServerTable("item", DType.INT8, 8, "range", 0, 4, item[:4]),
        ])  # fmt: skip


def test_an_empty_keyed_table_gives_zero_rows(tmp_path):
    rows = ServerFolderRows([ServerTable("user", DType.INT8, 8, "keyed")])
    assert not rows.fetch({"user": torch.tensor([1, 2])})["user"].any()
    with pytest.raises(FileNotFoundError, match="no embedding-server folders"):
        read_server_folders(tmp_path)
