"""Forcing the int8 kernels' SIMD path (``$RECSERVE_SCAN_ISA``) in a test; a path this CPU cannot
run is skipped, not passed (on an AVX2-only machine the VNNI cases are skipped)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import pytest

from retrieval.index.scan import ISA_ENV, int8_isa

SIMD = ["vnni", "avx2"]
"""The int8 paths with SIMD kernels (the portable loops are the reference)."""


def force(mp: pytest.MonkeyPatch, isa: str) -> None:
    """Forces the int8 path ``isa`` through ``mp`` (skips where this CPU cannot run it)."""
    mp.setenv(ISA_ENV, isa)
    try:
        int8_isa()
    except RuntimeError:
        pytest.skip(f"this CPU cannot run the {isa} path")


@contextmanager
def forced(isa: str) -> Iterator[None]:
    """The int8 path ``isa`` for the calls inside: for hypothesis tests, which refuse
    function-scoped fixtures such as ``monkeypatch``."""
    with pytest.MonkeyPatch.context() as mp:
        force(mp, isa)
        yield
