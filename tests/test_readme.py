"""The README stays a short front page: at most 12,000 characters, with its two setup commands;
figures live in bench/RESULTS.md and details in docs/."""

from __future__ import annotations

from pathlib import Path

README = Path(__file__).resolve().parents[1] / "README.md"
LIMIT = 12_000


def test_the_readme_stays_within_its_length() -> None:
    text = README.read_text()
    assert len(text) <= LIMIT, (
        f"README.md is {len(text):,} characters, over {LIMIT:,}: move detail to docs/"
    )


def test_the_readme_keeps_its_setup_commands() -> None:
    text = README.read_text()
    assert "make demo" in text and "make test " in text
