"""Saved states as older formats wrote them (``retrieval/format.py``,
``retrieval/index/format.py``): what a test of "a version saved before ..." starts from."""

from __future__ import annotations

from typing import Any

from retrieval.format import FORMAT_KEY
from retrieval.index.format import EXTRA


def unversioned(state: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """``state`` (an index's state dict, or a model's with the index under ``prefix``) as the
    formats before versions wrote it: no ``format``, the index's statistics in its config."""
    out = {k: v for k, v in state.items() if k != FORMAT_KEY}
    extra = dict(out[prefix + EXTRA])
    extra.pop("format")
    extra["config"] = {**extra["config"], **extra.pop("stats")}
    out[prefix + EXTRA] = extra
    return out
