"""Adapter from the benchmark to our in-model IVF index (``retrieval.index``).

Everything that depends on the index's API is in this file, so when that API changes only
:func:`build_ours` and :meth:`Ours.search` need fixing. Intended API::

    cfg = IVFConfig(nlist=4096, nprobe=32, rerank=256, codes="int8")
    index = build_ivf(vectors [N, D] float32, cfg, item_attributes={...}, attribute_values={...})
    ids, scores = index.search(queries [B, D] float32, k, filters=None | str | [str]*B,
                               nprobe=32, rerank=256)       # ``filter=`` in the first draft
    index.compile_filter(str, B) -> FilterBatch             # optional; accepted by ``filters=``
    index.memory_bytes() -> dict[str, int]

Rerank is varied without rebuilding: the ``rerank=`` keyword of ``search`` if it has one, else
the index's config object (``cfg`` / ``config``) is replaced with the new value. ``nprobe`` is what
we *ask* for: the index may widen it for a selective filter, or scan the eligible items exactly.
"""

from __future__ import annotations

import inspect
from typing import Any

import numpy as np
import torch
from ann_data import AnnData
from pydantic import BaseModel
from timing import stopwatch


class Ours:
    """A built ``IVFIndex`` plus what the sweep needs: search, bytes per item, build seconds.

    ``precompile``: compile each filter string once per batch size outside the timed call, as
    the faiss side builds its ``IDSelectorBitmap`` outside timing; False times the parsing too.
    """

    def __init__(
        self, index: Any, n: int, build_s: float, cfg: Any, precompile: bool = True
    ) -> None:
        self.index = index
        self.n = n
        self.build_s = build_s
        self.cfg = cfg
        built = getattr(index, "config", cfg)
        self.cfg_probe = str(getattr(built, "probe", "ip"))  # the rule the build chose
        params = inspect.signature(index.search).parameters
        self._filter_kwarg = next((p for p in ("filters", "filter") if p in params), None)
        self._rerank_kwarg = "rerank" in params
        self._rerank = getattr(cfg, "rerank", None)
        self._precompile = precompile and hasattr(index, "compile_filter")
        self._compiled: dict[tuple[str, int], Any] = {}

    def set_rerank(self, rerank: int) -> bool:
        """Switch the rerank depth for later searches; False if the index offers no way to."""
        if self._rerank_kwarg:
            self._rerank = rerank
            return True
        for attr in ("cfg", "config"):
            cfg = getattr(self.index, attr, None)
            if cfg is not None and isinstance(cfg, BaseModel) and hasattr(cfg, "rerank"):
                setattr(self.index, attr, cfg.model_copy(update={"rerank": rerank}))
                self._rerank = rerank
                return True
        return rerank == self._rerank

    def set_filter_bound(self, bound: float) -> bool:
        """Switch the filtered plan's bound check (``IVFConfig.filter_bound``: the quantile the
        build measured its slack at; 0: off) for later searches; False if it cannot."""
        cfg, stats = getattr(self.index, "config", None), getattr(self.index, "stats", None)
        if cfg is None or stats is None or not hasattr(cfg, "filter_bound"):
            return False
        if not hasattr(self, "_built"):
            self._built = (cfg, stats)
        built, measured = self._built
        slack = dict(measured.slack_curve).get(bound, measured.filter_bound_slack)
        self.index.config = built.model_copy(update={"filter_bound": bound})
        slack = slack if bound > 0 else 0.0
        self.index.stats = measured.model_copy(update={"filter_bound_slack": slack})
        return True

    def _filter_arg(self, filter: str | None, batch: int) -> Any:
        if filter is None or not self._precompile:
            return filter
        key = (filter, batch)
        if key not in self._compiled:
            self._compiled[key] = self.index.compile_filter(filter, batch)
        return self._compiled[key]

    @torch.inference_mode()
    def search(self, q: torch.Tensor, k: int, nprobe: int, filter: str | None = None) -> np.ndarray:
        """``q [B, D] float32`` -> ids ``[B, K] int64`` (-1 pads); ``filter`` applies to every row."""
        ids = self.search_native(q, k, nprobe, filter)
        return ids.numpy() if isinstance(ids, torch.Tensor) else np.asarray(ids)

    def search_native(
        self, q: torch.Tensor, k: int, nprobe: int, filter: str | None = None
    ) -> torch.Tensor:
        """:meth:`search` as a user calls the index for one query: the index's own ids tensor
        (faiss returns its NumPy array), no inference-mode context (~9 us a call; the search
        needs no autograd state)."""
        kwargs: dict[str, Any] = {"nprobe": nprobe}
        if self._rerank_kwarg:
            kwargs["rerank"] = self._rerank
        if filter is not None:
            if self._filter_kwarg is None:
                raise TypeError("our index's search() takes no filter argument")
            kwargs[self._filter_kwarg] = self._filter_arg(filter, q.shape[0])
        ids, _scores = self.index.search(q, k, **kwargs)
        return ids

    def bytes_per_item(self) -> float:
        return sum(int(v) for v in self.index.memory_bytes().values()) / self.n

    def memory_breakdown(self) -> dict[str, int]:
        return {k: int(v) for k, v in self.index.memory_bytes().items()}


def build_ours(
    data: AnnData,
    nlist: int,
    codes: str,
    rerank: int,
    nprobe: int = 32,
    precompile: bool = True,
    probe: str = "auto",
) -> Ours:
    """Build our index over ``data.x`` with the filter attributes; raises ImportError if absent.
    ``probe``: how queries rank lists (``IVFConfig.probe``: auto, l2, ip)."""
    from retrieval.index import IVFConfig, build_ivf

    # Without re-ranking the exact copy is dead weight: leave it out, so bytes/item compare with SQ8.
    cfg = IVFConfig(
        nlist=nlist,
        nprobe=nprobe,
        rerank=rerank,
        codes=codes,
        exact_copy="float16" if rerank else "none",
        probe=probe,
    )
    x = torch.from_numpy(data.x)
    attrs = {name: np.asarray(v, dtype=np.int64) for name, v in data.attributes.items()}
    elapsed = stopwatch()
    index = build_ivf(x, cfg, item_attributes=attrs, attribute_values=data.attribute_values)
    if hasattr(index, "eval"):
        index.eval()
    return Ours(index, len(data.x), elapsed(), cfg, precompile)
