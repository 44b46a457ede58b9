"""How an :class:`~retrieval.index.ivf.IVFIndex` is built and searched (:class:`IVFConfig`: what
``[model.index]`` of ``train.toml`` sets, the same class), what a build resolved it to
(:class:`BuiltIVFConfig`), and the names its fields take; the index module holds the tensors
and the search, ``stats.py`` what the build measured."""

from __future__ import annotations

import math
from typing import Annotated, Any, Literal

from pydantic import Field, field_validator

from common.config import Config

MIN_POINTS_PER_CENTROID = 39
"""faiss's ``ClusteringParameters.min_points_per_centroid``: fewer points per centroid warn."""


def default_nlist(num_items: int) -> int:
    """Inverted lists for a catalog of ``num_items``: about sqrt(N), but never fewer than
    ``MIN_POINTS_PER_CENTROID`` items per list (80 items: 2 lists; 10,000: 100)."""
    return max(1, min(math.isqrt(num_items), num_items // MIN_POINTS_PER_CENTROID))


EXACT_COPIES = ("float16", "float32", "none")
"""Dtypes of the exact copy (``ivf.EXACT_DTYPES`` maps them to torch's); this module loads no
torch, so that a config check does not."""
METRICS = ("ip", "cosine")
PROBES = ("auto", "l2", "ip")
DEFAULT_TARGET_RECALL = 0.97
"""The recall a build tunes nprobe for when neither ``nprobe`` nor ``target_recall`` is given."""

PositiveInt = Annotated[int, Field(ge=1)]
Share = Annotated[float, Field(ge=0, le=1)]
"""A probability or a fraction: 0 to 1."""


class IVFConfig(Config):
    """How the index is built and searched: ``[model.index]``. ``nlist``, ``nprobe`` and
    ``target_recall`` left unset follow the catalog: the build resolves them
    (:meth:`resolved`) and the index keeps what it chose."""

    nlist: PositiveInt | None = None
    """Inverted lists (k-means centroids), capped at the catalog size; None: about sqrt(items),
    with at least 39 items a list (what faiss's k-means asks for:
    ``default_nlist``)."""
    nprobe: PositiveInt | None = None
    """Lists probed per query, at least: the plan probes more lists for a filtered request (as
    its selectivity falls) or when these lists hold too few items for ``2 x`` the candidates
    (large K), and may scan a filtered request's eligible items exactly instead;
    :meth:`IVFIndex.search_plan` shows what a search will do. None: the build picks it for
    ``target_recall`` (``nlist / 8`` where that is 0)."""
    codes: Literal["int8", "fp8"] = "int8"
    """Residual code format: "int8" (row-wise scale) or "fp8" (e4m3, row-wise scale)."""
    rerank: int = Field(default=0, ge=0)
    """Candidates re-scored with the exact copy before the final top-K (0: approximate scores
    are final)."""
    exact_copy: Literal["auto", "float16", "float32", "none"] = "auto"
    """Dtype of the exact copy of every vector, used for re-ranking and exact scans: "float16",
    "float32", "none" (exact scans decode the codes; no re-rank), or "auto": "float16" when
    ``rerank > 0``, else "none" (the copy costs 2 bytes x D per item, several times the INT8
    codes, and only a re-rank needs it). The index records the resolved choice."""
    metric: Literal["ip", "cosine"] = "ip"
    """Score that ranks results: "ip" (inner product q·x) or "cosine" (vectors and queries
    L2-normalised, then inner product)."""
    probe: Literal["auto", "l2", "ip"] = "auto"
    """How a query ranks the lists it probes: "l2" (nearest centroid: the rule the build
    assigns items by), "ip" (largest q·c), or "auto": "l2" when the build's vectors are unit-norm
    (metric "cosine", normalised embeddings), else "ip" (see ``retrieval/index/probe.py`` for
    why and the recall of each). The index records the choice."""
    assign: Literal["auto", "l2", "ip"] = "auto"
    """The rule k-means clusters by and items join lists by: "l2" (nearest centroid), "ip"
    (largest x·c, faiss's rule for an inner-product IVF), or "auto": the probe's rule, so that a
    query probes the lists its best items were put in (``bench/RESULTS.md`` has the recall of
    each). The index records the choice."""
    kmeans_iters: PositiveInt = 10
    """k-means iterations at build (faiss's own IVF default; more changed no measured recall,
    at twice the build time)."""
    kmeans_max_points_per_centroid: PositiveInt = 256
    """Sample size of k-means, per centroid."""
    seed: int = Field(default=0, ge=0)
    """Seed of the k-means sample and start, and of the build's sample queries."""
    hashed_min_values: PositiveInt = 4096
    """Values from which a categorical attribute's signature is hashed (its value's position
    as hexadecimal digits, one-hot 16 bits a digit: ``retrieval/filters.py``) instead of one
    bit per value; such an attribute holds one value an item."""
    exact_cost: float = Field(default=2.0, gt=0)
    """Cost of scoring one eligible item exactly, relative to one code in a list, where the build
    measured none (``IndexStats.plan_costs``): a filtered request is then scanned exactly when
    (eligible items x exact_cost) <= (codes in its probed lists)."""
    measure_costs: bool = True
    """The build times the filtered plan's two ways on its machine (an index with filter
    attributes, on the CPU; ``retrieval/index/calibrate.py``) into ``IndexStats.plan_costs``.
    False: the constant ``exact_cost`` decides, the same on every machine."""
    filter_nprobe_exponent: float = Field(default=0.5, ge=0)
    """A filtered request with selectivity s probes ``nprobe * s ** -exponent`` lists (its
    first round; ``filter_bound`` may add a second)."""
    filter_bound: Share = 0.9
    """How sure a filtered request must be that the lists it did not probe hold nothing better
    than its K-th result (``retrieval/index/bound.py``). Its first round skips the lists its
    filter rules out; then an unprobed list that may hold an eligible item is bounded by ``q·c +
    slack * |q| * rmax`` (``rmax``: its largest residual), and a row whose K-th score is below
    some bound probes those lists too, or scans its eligible items exactly when that is
    cheaper. 1.0: ``slack = 1``, a proof (no eligible item is missed for want of a probe; a
    loose bound, so costly). Below 1: the build measures ``slack`` as this quantile of the share
    of ``|q| * rmax`` that the best item of a list near a sample query reaches
    (``IndexStats.filter_bound_slack``; ``bench/RESULTS.md`` has the recall and lists of each
    quantile). 0: off, the first round only, whose recall falls where the filter is
    anti-correlated with the query."""
    target_recall: Share | None = None
    """If > 0, the build picks the smallest power-of-two nprobe whose recall@``tune_k`` against
    exact search reaches this on sample queries (then ``nprobe`` is only the starting point),
    and records the curve a request's own ``recall_target`` reads (``IndexStats.recall_curve``).
    None: 0.97 when ``nprobe`` is unset too, else 0 (the ``nprobe`` given stands)."""
    tune_k: PositiveInt = 100
    """K of the recall that ``target_recall`` asks for."""

    @field_validator("metric", mode="before")
    @classmethod
    def _no_l2(cls, value: Any) -> Any:
        if value == "l2":
            raise ValueError(
                '"l2" is not offered: ranking by distance needs a per-item norm term the scan '
                'kernel does not have; for L2-normalised vectors write metric = "cosine" (the '
                'same order), else "ip"'
            )
        return value

    def resolved(self, num_items: int = 0) -> BuiltIVFConfig:
        """This config as a build over ``num_items`` resolves it: ``nlist``, ``nprobe`` and
        ``target_recall`` numbers (the tuned nprobe replaces this one later), ``exact_copy =
        "auto"`` what it means here. An index not built yet (``num_items`` 0) holds one list."""
        nlist = self.nlist or default_nlist(max(num_items, 1))
        target = self.target_recall
        if target is None:
            target = DEFAULT_TARGET_RECALL if self.nprobe is None else 0.0
        exact = self.exact_copy
        if exact == "auto":
            exact = "float16" if self.rerank > 0 else "none"
        values = {
            **dict(self),
            "nlist": nlist,
            "nprobe": self.nprobe or max(1, nlist // 8),
            "target_recall": target,
            "exact_copy": exact,
        }
        return BuiltIVFConfig(**values)


class BuiltIVFConfig(IVFConfig):
    """:class:`IVFConfig` as an index holds it: the numbers its build resolved (``nlist``,
    ``nprobe``, tuned where ``target_recall`` asks, ``target_recall``), ``exact_copy``, ``probe``
    and ``assign`` as chosen. Saved with the index, so a loaded index searches as it was built."""

    nlist: PositiveInt = 1
    """The lists the build asked for (``IVFIndex.nlist``: those it made, at most the items)."""
    nprobe: PositiveInt = 1
    """Lists probed per query, at least: as given, else picked by the build."""
    target_recall: Share = 0.0
    """The recall nprobe was tuned for (0: not tuned)."""

    def resolved(self, num_items: int = 0) -> BuiltIVFConfig:
        """Already resolved: itself."""
        return self
