"""bench/render_results.py and result_rows.py: RESULTS.md is exactly the render of bench/page.toml and the JSON it
names, a stale page fails the check, and each ANN row names the fastest peer at its recall."""

from __future__ import annotations

import sys
import tomllib
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

import render_results
import result_rows


def test_the_page_in_the_repository_is_the_render_of_its_manifest() -> None:
    assert render_results.main(["--check"]) == 0


def test_check_fails_when_the_page_was_edited_by_hand(tmp_path: Path) -> None:
    page = tmp_path / "RESULTS.md"
    page.write_text(render_results.PAGE.read_text().replace("1.", "9.", 1))
    assert render_results.main(["--check", "--out", str(page)]) == 1
    assert render_results.main(["--check", "--out", str(tmp_path / "missing.md")]) == 1


def test_writing_then_checking_agrees(tmp_path: Path) -> None:
    page = tmp_path / "RESULTS.md"
    assert render_results.main(["--out", str(page)]) == 0
    assert render_results.main(["--check", "--out", str(page)]) == 0
    assert page.read_text() == render_results.PAGE.read_text()


def point(system: str, recall: float, qps: float, p50: float) -> dict[str, object]:
    return {
        "system": system,
        "setting": "s",
        "filter": "none",
        "recall": recall,
        "qps_batch": qps,
        "p50_single_ms": p50,
        "bytes_per_item": 1.0,
    }


def test_an_ann_row_names_the_fastest_peer_that_reaches_its_recall() -> None:
    # SQ8 on its slow path: IVF-Flat is the peer to beat; a faster peer below the recall is not.
    data = {
        "points": [
            point("ours-int8", 0.97, 1000.0, 0.10),
            point("faiss-IVF-SQ8", 0.96, 40.0, 2.0),
            point("faiss-IVF-Flat", 0.98, 250.0, 0.40),
            point("faiss-IVF-Flat", 0.90, 900.0, 0.05),
        ]
    }
    (row,) = result_rows.ann(data, {"case": "c", "recalls": [0.95]})
    cells = row.split(" | ")
    assert "faiss-IVF-Flat" in cells[4] and cells[5] == "**4.00×**, one sweep"
    assert cells[6].endswith("(faiss-IVF-Flat)") and cells[7] == "4.00×"
    (missing,) = result_rows.ann(data, {"case": "c", "recalls": [0.99]})
    assert missing.split(" | ")[3] == "ours: not in the sweep (its best 0.970)"
    # With --rounds against that peer, the page takes the median of the turns, not the sweep.
    turn = {
        "ours": "ours-int8",
        "filter": "none",
        "target": 0.95,
        "peer": "faiss-IVF-Flat",
        "qps_ratio_median": 3.0,
        "qps_ratios": [2.0, 3.0, 4.0],
        "p50_ratio_median": 2.5,
    }
    (row,) = result_rows.ann({**data, "rounds": [turn]}, {"case": "c", "recalls": [0.95]})
    assert row.split(" | ")[5] == "**3.00×**, median of 3 turns" and row.endswith("| 2.50×")


def test_every_hand_kept_row_says_where_it_was_copied_from() -> None:
    manifest = tomllib.loads(render_results.MANIFEST.read_text())
    hand = [h for t in manifest["target"] for h in t.get("hand", [])]
    assert hand
    for h in hand:
        assert h["date"] and h["commit"] and h["source"] and h["latest"], h
