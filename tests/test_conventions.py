"""Conventions of the product code's comments and docstrings, checked over every file: they say
*why* the code is as it is, so they quote no measurement (a figure goes stale when the code or
the machine changes; ``bench/RESULTS.md`` holds the current ones, with their commands) and no
issue number (an issue closes, the code stays; say what the issue wanted instead).

What counts as a quoted measurement: a time figure (``74 us``, ``0.3 ms``, ``~50 ns``), a speed
ratio (``1.2x``, ``1.05-1.19x``) or a measured share (``13 % of a batch``, but not a threshold
such as ``>= 95 % of the asked rate``). Error messages, code and string constants are not
comments and are not read.
"""

from __future__ import annotations

import ast
import io
import re
import tokenize
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PRODUCT = ("common", "retrieval", "sharded_tables", "serving", "recserve", "model_repo")
"""The product packages (bench/, tests/, docs/ and examples/ may quote figures)."""
C_LIKE = {".cpp", ".cc", ".h", ".hpp", ".cu", ".proto"}
GENERATED = re.compile(r"_pb2(_grpc)?\.pyi?$")
EXCEPTIONS: set[str] = set()
"""Glob patterns (relative to the repository) of files not checked yet."""

ISSUE = re.compile(r"\b(?:issues?|PR)\s+#?\d+\b|(?<![\w&#])#\d+\b", re.IGNORECASE)
TIME = re.compile(r"(?<![\w.])\d+(?:[.,]\d+)*\s*(?:ns|us|µs|μs|ms)\b")
RATIO = re.compile(r"(?<![\w.])\d+(?:\.\d+)?(?:\s*[-–]\s*\d+(?:\.\d+)?)?x\b")
SHARE = re.compile(r"~?\d+(?:\.\d+)?\s*% of (?:a|an|the|its)\b")
COMPARISON = ("<", ">", "=", "≤", "≥")


@dataclass(frozen=True)
class Finding:
    path: str
    line: int
    kind: str
    text: str

    def __str__(self) -> str:
        return f"{self.path}:{self.line}: {self.kind}: {self.text.strip()[:120]}"


def python_texts(source: str) -> Iterator[tuple[int, str]]:
    """(line, text) of every comment and docstring (any bare string statement: module, class,
    function and attribute docstrings) of a Python source."""
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT:
            yield tok.start[0], tok.string.lstrip("#")
    for node in ast.walk(ast.parse(source)):
        if (
            isinstance(node, ast.Expr)
            and isinstance(node.value, ast.Constant)
            and isinstance(node.value.value, str)
        ):
            for offset, line in enumerate(node.value.value.splitlines()):
                yield node.lineno + offset, line


def c_texts(source: str) -> Iterator[tuple[int, str]]:
    """(line, text) of every ``//`` and ``/* */`` comment of a C++ or protobuf source (string
    and character literals blanked first, so a ``//`` inside one is no comment)."""
    blanked = re.sub(r"'(?:\\.|[^'\\\n])'", "''", source)
    blanked = re.sub(r'"(?:\\.|[^"\\\n])*"', '""', blanked)
    for m in re.finditer(r"//[^\n]*|/\*.*?\*/", blanked, re.DOTALL):
        first = blanked.count("\n", 0, m.start()) + 1
        for offset, line in enumerate(m.group().splitlines()):
            yield first + offset, line


def findings_in(text: str) -> Iterator[tuple[str, str]]:
    """(kind, match) of every quoted measurement or issue number in one line of comment."""
    for kind, pattern in (("issue number", ISSUE), ("time figure", TIME), ("ratio", RATIO)):
        for m in pattern.finditer(text):
            yield kind, m.group()
    for m in SHARE.finditer(text):
        if not text[: m.start()].rstrip().endswith(COMPARISON):  # a threshold, not a figure
            yield "measured share", m.group()


def check_file(path: Path, rel: str) -> list[Finding]:
    source = path.read_text(encoding="utf-8")
    texts = python_texts(source) if path.suffix in {".py", ".pyi"} else c_texts(source)
    return [Finding(rel, line, kind, text) for line, text in texts for kind, _ in findings_in(text)]


def product_files() -> Iterator[tuple[Path, str]]:
    for package in PRODUCT:
        for path in sorted((REPO / package).rglob("*")):
            rel = path.relative_to(REPO).as_posix()
            if not path.is_file() or GENERATED.search(path.name):
                continue
            if path.suffix not in {".py", ".pyi"} | C_LIKE:
                continue
            if any(Path(rel).match(pattern) for pattern in EXCEPTIONS):
                continue
            yield path, rel


def test_product_comments_quote_no_measurement_and_no_issue_number():
    found = [f for path, rel in product_files() for f in check_file(path, rel)]
    assert not found, (
        "product comments say why, not how fast or which issue (figures: bench/RESULTS.md):\n"
        + "\n".join(map(str, found))
    )


def test_the_exceptions_still_name_files():
    """An exception that matches no file is stale (a moved or merged file): remove it."""
    for pattern in EXCEPTIONS:
        assert any(Path(p.relative_to(REPO).as_posix()).match(pattern) for p in REPO.glob(pattern))


PLANTED_PY = '''\
"""A module. The fast path was added for issue 17."""

X = 1  # a cache: 74 -> 53 us a call


def f() -> None:
    """Cheaper than the heap (1.05-1.19x)."""
    # see #23; the sort was 13 % of a batch


Y = 2
"""Kept >= 95 % of the asked rate; 0x80 flips the sign; a 16 x 4 block."""
'''
PLANTED_C = """\
// One pass (~0.3 ms of a batch, issue 21).
int f() { return 0; }  /* 3-4x the float path */
const char* s = "not a comment: 5 ms // nor this";
"""


@pytest.mark.parametrize(
    ("name", "source", "lines"),
    [("planted.py", PLANTED_PY, [1, 3, 7, 8, 8]), ("planted.cpp", PLANTED_C, [1, 1, 2])],
)
def test_planted_figures_and_issue_numbers_are_found(tmp_path, name, source, lines):
    """Each planted quote is found on its line; thresholds, hex constants, shapes and string
    literals are not."""
    path = tmp_path / name
    path.write_text(source)
    found = check_file(path, name)
    assert sorted(f.line for f in found) == lines, "\n".join(map(str, found))
    kinds = {f.kind for f in found}
    assert kinds == {"issue number", "time figure", "ratio"} | (
        {"measured share"} if name.endswith(".py") else set()
    )


def test_test_file_names_are_unique():
    """Test folders have no ``__init__.py``, so pytest imports each test file by its name alone:
    two files of one name stop the whole suite at collection."""
    by_name: dict[str, list[str]] = {}
    for path in sorted((REPO / "tests").rglob("test_*.py")):
        by_name.setdefault(path.name, []).append(str(path.relative_to(REPO)))
    repeated = {name: paths for name, paths in by_name.items() if len(paths) > 1}
    assert not repeated, repeated
