"""Your own CSV end to end, with the README's five commands only, read from its "Your own CSV"
section: `recserve data import` -> `recserve train --config examples/own-data.toml` (``[data]
source = "parquet"``, publishing) -> `recserve serve model` -> `recserve test load` ->
`recserve score`, whose answers use the CSV's own user and item ids. The test changes only the
ports (any free one), the load test's duration and the scoring's worker count."""

from __future__ import annotations

import csv
import shlex
import subprocess
import sys
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from common.process import start
from retrieval.artifact import load_model
from support.process_util import STARTUP_S, recserve_cmd

pytestmark = [pytest.mark.slow, pytest.mark.multiproc]

ROOT = Path(__file__).parents[2]
EXAMPLE = ROOT / "examples" / "own-data.toml"
SECTION = "## Your own CSV"


def readme_commands() -> list[list[str]]:
    """The ``recserve`` commands of the README's own-CSV section, in order, as argv (after
    ``recserve``; a trailing ``&`` dropped)."""
    text = (ROOT / "README.md").read_text()
    block = text[text.index(SECTION) :].split("```bash\n", 1)[1].split("```", 1)[0]
    commands = []
    for line in block.replace("\\\n", " ").splitlines():
        line = line.strip().removesuffix("&").strip()
        if line.startswith(".venv/bin/recserve "):
            commands.append(shlex.split(line)[1:])
    return commands


def with_option(argv: list[str], flag: str, value: str) -> list[str]:
    """``argv`` with ``flag``'s value replaced (the flag must be there)."""
    i = argv.index(flag)
    return [*argv[: i + 1], value, *argv[i + 2 :]]


def recserve(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "recserve", *args],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=cwd,
    )


def write_csvs(tmp: Path, users: int = 40, items: int = 30, events: int = 500) -> None:
    """A click log with string ids (users in 3 taste groups), an items file with a category
    and multi-valued tags; one catalog item is never clicked, one clicked item is not listed."""
    rng = np.random.default_rng(0)
    with (tmp / "clicks.csv").open("w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["user_id", "item_id", "timestamp"])
        for e in range(events):
            u = int(rng.integers(users))
            i = (
                (u % 3) * 10 + int(rng.integers(10))
                if rng.random() < 0.8
                else int(rng.integers(items))
            )
            w.writerow(
                [f"cust-{u:03d}", f"SKU{i}", f"2024-03-{1 + e // 60:02d}T{e % 24:02d}:00:00Z"]
            )
    with (tmp / "items.csv").open("w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["item_id", "name", "category", "tags"])
        for i in [*range(1, items), items]:  # SKU0 clicked but not listed; SKU<items> listed only
            w.writerow(
                [f"SKU{i}", f"Product {i}", "abc"[min(i // 10, 2)], "sale|new" if i % 2 else "new"]
            )


def test_own_csv_through_the_readme_commands_answers_in_raw_ids(tmp_path: Path) -> None:
    write_csvs(tmp_path)
    (tmp_path / "examples").mkdir()
    (tmp_path / "examples" / "own-data.toml").write_text(EXAMPLE.read_text())
    imp, train, serve, load, score = commands = readme_commands()
    assert [c[:2] for c in commands] == [
        ["data", "import"], ["train", "--config"], ["serve", "model"], ["test", "load"],
        ["score", "--model-repo"],
    ]  # fmt: skip
    out = recserve(*imp, cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    assert "40 users, 31 items, 500 interactions" in out.stdout
    assert "1 items in the log but not in the items file" in out.stdout
    assert "1 items in the items file without interactions" in out.stdout

    out = recserve(*train, cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "published shop v1" in out.stdout
    repo = tmp_path / "runs" / "shop_repo"
    model = load_model(repo / "shop" / "1" / "model")
    assert model.id_maps is not None
    catalog = set(model.id_maps.items.raw.to_pylist())
    assert len(catalog) == 31 and "SKU0" in catalog and "SKU30" in catalog

    serve = with_option(with_option(serve, "--grpc-port", "0"), "--http-port", "0")
    proc = start(recserve_cmd(*serve), log_path=tmp_path / "serve.log", cwd=tmp_path, name="serve")
    try:
        address = proc.wait_ready(STARTUP_S).grpc
        load = with_option(with_option(load, "--target", address), "--duration", "3")
        out = recserve(*load, cwd=tmp_path)
        assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
        assert "failures 0 (0.00%)" in out.stdout
    finally:
        proc.stop()

    out = recserve(*score, "--workers", "1", cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    recs = pq.read_table(tmp_path / "runs" / "shop-recs")
    users = pq.read_table(tmp_path / "data" / "shop" / "score_users.parquet")
    assert sorted(recs.column("user_id").to_pylist()) == sorted(users.column("user_id").to_pylist())
    assert recs.schema.field("item_ids").type == pa.list_(pa.string())
    history = dict(
        zip(users.column("user_id").to_pylist(), users.column("history").to_pylist(), strict=True)
    )
    k = int(score[score.index("--k") + 1])
    for user, items in zip(
        recs.column("user_id").to_pylist(), recs.column("item_ids").to_pylist(), strict=True
    ):
        assert len(items) == k and len(set(items)) == k and set(items) <= catalog
        assert not set(items) & set(history[user][:10])  # the model's window is excluded

    # an item the model does not know, in a history, is refused before any work
    bad = pa.table({
        "user_id": ["cust-001", "new-user"],
        "history": [["SKU1"], ["SKU2", "SKU-NEW"]],
        "categorical": pa.array([[], []], pa.list_(pa.int64())),
        "dense": pa.array([[], []], pa.list_(pa.float32())),
    })  # fmt: skip
    pq.write_table(bad, tmp_path / "bad.parquet")
    out = recserve(
        "score", "--model-repo", "runs/shop_repo", "--users", "bad.parquet", "--out", "recs2",
        "--quiet", cwd=tmp_path,
    )  # fmt: skip
    assert out.returncode == 2
    assert "column 'history', row 1: item 'SKU-NEW' is not in the model's catalog" in out.stderr
