"""bench/timeline.py: the timestamp hook wraps functions at import, and records become one
request's path with the median gap after each record."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
HOOK = ROOT / "bench" / "timeline_hook"
CALL = (
    "from serving.protos import shard_pb2 as pb\n"
    "from serving.sharding import wire\n"
    "wire.decode_response(pb.SearchResponse(width=0), 1, 4)\n"
    "print(hasattr(wire.decode_response, '__wrapped__'))\n"
)


def run_hooked(tmp_path: Path, record: bool) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(HOOK), str(ROOT)])}
    env.pop("RECSERVE_TIMELINE_DIR", None)
    if record:
        env["RECSERVE_TIMELINE_DIR"] = str(tmp_path)
    return subprocess.run(
        [sys.executable, "-c", CALL], env=env, capture_output=True, text=True, timeout=120
    )


@pytest.mark.multiproc
def test_the_hook_records_a_wrapped_call_and_is_inert_without_its_variable(tmp_path):
    out = run_hooked(tmp_path, record=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "True"
    (records,) = tmp_path.glob("*.txt")
    lines = [line.split() for line in records.read_text().splitlines()]
    assert [p for _, _, p in lines] == ["decode_response:in", "decode_response:out"]
    assert int(lines[0][0]) <= int(lines[1][0]) and lines[0][1] == lines[1][1]  # one thread
    quiet = tmp_path / "quiet"
    quiet.mkdir()
    out = run_hooked(quiet, record=False)
    assert out.returncode == 0 and out.stdout.strip() == "False"
    assert not list(quiet.iterdir())


def test_records_become_the_common_path_with_median_gaps():
    sys.path.insert(0, str(ROOT / "bench"))
    try:
        from timeline import FRONT, path_table, request_paths
    finally:
        sys.path.remove(str(ROOT / "bench"))

    records = []
    for start, search in ((0, 100), (1000, 300), (2000, 200)):  # three requests, one client
        records += [
            (start, "router", 1, FRONT),
            (start + 10, "shard-0", 2, "Search:in"),
            (start + 10 + search, "shard-0", 2, "Search:out"),
        ]
    records.append((3000, "router", 1, FRONT))  # the next request ends the third path
    paths, nxt = request_paths(records, since_ns=0)
    table = path_table(paths, nxt)
    assert table["requests"] == 3 and table["on_common_path"] == 3
    assert [r["median_us"] for r in table["rows"]] == [0.01, 0.2, 0.79]  # ns -> us medians
    assert table["rows"][1]["from"] == "shard-0 Search:in"
    assert table["rows"][-1]["to"] == "load generator (reply, next request)"
