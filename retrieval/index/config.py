"""How an :class:`~retrieval.index.ivf.IVFIndex` is built and searched (:class:`IVFConfig`),
and the names its fields take; the index module holds the tensors and the search."""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from retrieval.index.codes import CODE_KINDS

EXACT_DTYPES = {"float16": torch.float16, "float32": torch.float32, "none": None}
METRICS = ("ip", "cosine")
PROBES = ("auto", "l2", "ip")


@dataclass
class IVFConfig:
    """How the index is built and searched."""

    nlist: int = 1024
    """Inverted lists (k-means centroids); capped at the catalog size."""
    nprobe: int = 32
    """Lists probed per query, at least: the plan probes more lists for a filtered request (as
    its selectivity falls) or when these lists hold too few items for ``2 x`` the candidates
    (large K), and may scan a filtered request's eligible items exactly instead;
    :meth:`IVFIndex.search_plan` shows what a search will do."""
    codes: str = "int8"
    """Residual code format: "int8" (row-wise scale) or "fp8" (e4m3, row-wise scale)."""
    rerank: int = 0
    """Candidates re-scored with the exact copy before the final top-K (0: approximate scores are final)."""
    exact_copy: str = "auto"
    """Dtype of the exact copy of every vector, used for re-ranking and exact scans: "float16",
    "float32", "none" (exact scans decode the codes; no re-rank), or "auto": "float16" when
    ``rerank > 0``, else "none" (the copy costs 2 bytes x D per item, ~3x the INT8 codes, and only
    a re-rank needs it). The index records the resolved choice."""
    metric: str = "ip"
    """Score that ranks results: "ip" (inner product q·x) or "cosine" (vectors and queries
    L2-normalised, then inner product)."""
    probe: str = "auto"
    """How a query ranks the lists it probes: "l2" (nearest centroid: the rule the build
    assigns items by), "ip" (largest q·c), or "auto": "l2" when the build's vectors are unit-norm
    (metric "cosine", normalised embeddings), else "ip" (see ``retrieval/index/probe.py`` for
    why and the recall of each). The index records the choice; indexes saved before this option
    probe by "ip", as they did."""
    assign: str = "auto"
    """The rule k-means clusters by and items join lists by: "l2" (nearest centroid), "ip"
    (largest x·c, faiss's rule for an inner-product IVF), or "auto": the probe's rule, so that a
    query probes the lists its best items were put in (100k x 64 clustered, inner product:
    recall@100 at nprobe 4 0.974 with L2 lists probed by "ip", 0.986 with "ip" throughout; faiss
    0.987). The index records the choice; indexes saved before this option keep "l2"."""
    kmeans_iters: int = 10
    """k-means iterations at build (faiss's own IVF default). 200k x 64 clustered vectors, nlist
    1024: recall@100 at nprobe 2-32 equal to 4 decimals with 20, in half the build time."""
    kmeans_max_points_per_centroid: int = 256
    seed: int = 0
    exact_cost: float = 2.0
    """Cost of scoring one eligible item exactly, relative to one code in a list, where the build
    measured none (``plan_costs``): a filtered request is then scanned exactly when (eligible
    items x exact_cost) <= (codes in its probed lists)."""
    measure_costs: bool = True
    """The build times the filtered plan's two ways on its machine (an index with filter
    attributes, on the CPU; ``retrieval/index/calibrate.py``) into ``plan_costs``. False: the
    constant ``exact_cost`` decides, the same on every machine."""
    plan_costs: tuple[tuple[float, ...], ...] = ()
    """``(batch, selectivity, exact seconds per eligible item, list plan seconds per query, its
    first round's lists, codes its rounds scanned)`` measured by the build, for one query and
    for a batch (``retrieval/index/costs.py``)."""
    filter_nprobe_exponent: float = 0.5
    """A filtered request with selectivity s probes ``nprobe * s ** -exponent`` lists (its
    first round; ``filter_bound`` may add a second)."""
    filter_bound: float = 0.9
    """How sure a filtered request must be that the lists it did not probe hold nothing better
    than its K-th result (``retrieval/index/bound.py``, issue 19). Its first round skips the
    lists its filter rules out; then an unprobed list that may hold an eligible item is bounded
    by ``q·c + slack * |q| * rmax`` (``rmax``: its largest residual), and a row whose K-th score
    is below some bound probes those lists too, or scans its eligible items exactly when that
    is cheaper. 1.0: ``slack = 1``, a proof (no eligible item is missed for want of a probe; a
    loose bound, so costly). Below 1: the build measures ``slack`` as this quantile of the share
    of ``|q| * rmax`` that the best item of a list near a sample query reaches (0.9: recall@100
    0.987-0.99 at 10-50 % selectivity on anti-correlated 200k x 64 data, against 0.991 for
    every list; 0.99 probes 1.5x the lists for +0.003). 0: off, the first round only, whose
    recall falls where the filter is anti-correlated with the query (0.83 at 50 %)."""
    filter_bound_slack: float = 0.0
    """The slack of ``filter_bound``, recorded by the build (0: not measured, so no check; a
    value given here is kept)."""
    target_recall: float = 0.0
    """If > 0, the build picks the smallest power-of-two nprobe whose recall@``tune_k`` against
    exact search reaches this on sample queries (then ``nprobe`` is only the starting point),
    and records the curve a request's own ``recall_target`` reads (``recall_curve``)."""
    tune_k: int = 100
    recall_curve: tuple[tuple[int, float], ...] = ()
    """``(nprobe, recall)`` measured by the build with ``target_recall`` (powers of two, until
    recall 0.995): what a request's ``recall_target`` probes (``retrieval/index/targets.py``)."""
    slack_curve: tuple[tuple[float, float], ...] = ()
    """``(quantile, slack)`` of the filtered plan's bound, measured by the build with
    ``filter_bound``: the slack a request's ``recall_target`` bounds unprobed lists with."""

    def validate(self) -> None:
        if self.nlist < 1 or self.nprobe < 1:
            raise ValueError(f"nlist and nprobe must be >= 1, got {self.nlist}, {self.nprobe}")
        if self.codes not in CODE_KINDS:
            raise ValueError(f"codes must be one of {CODE_KINDS}, got {self.codes!r}")
        if self.exact_copy not in (*EXACT_DTYPES, "auto"):
            raise ValueError(
                f"exact_copy must be one of {(*EXACT_DTYPES, 'auto')}, got {self.exact_copy!r}"
            )
        if self.rerank < 0:
            raise ValueError(f"rerank must be >= 0, got {self.rerank}")
        if self.metric == "l2":
            raise ValueError(
                'metric "l2" is not offered: ranking by distance needs a per-item norm term the '
                'scan kernel does not have; for L2-normalised vectors write metric = "cosine" '
                '(the same order), else "ip"'
            )
        if self.metric not in METRICS:
            raise ValueError(f"metric must be one of {METRICS}, got {self.metric!r}")
        if not 0.0 <= self.filter_bound <= 1.0 or not 0.0 <= self.filter_bound_slack <= 1.0:
            raise ValueError(
                f"filter_bound and filter_bound_slack must be in [0, 1], got "
                f"{self.filter_bound}, {self.filter_bound_slack}"
            )
        if self.probe not in PROBES:
            raise ValueError(f"probe must be one of {PROBES}, got {self.probe!r}")
        if self.assign not in PROBES:
            raise ValueError(f"assign must be one of {PROBES}, got {self.assign!r}")

    def resolved(self) -> IVFConfig:
        """This config with ``exact_copy = "auto"`` replaced by what it means here."""
        if self.exact_copy != "auto":
            return self
        return replace(self, exact_copy="float16" if self.rerank > 0 else "none")
