"""Building an :class:`IVFIndex`: k-means, list assignment, residual codes, filter signatures,
postings, each list's bound statistics and the slack of its bound (``bound.py``), and
(optionally) nprobe tuned for a target recall against exact search."""

from __future__ import annotations

import math
from collections.abc import Mapping

import numpy as np
import torch

from retrieval.filters import Vocabulary, pack_bits
from retrieval.index.bound import list_bits, list_radius, measure_slack, residual_norms
from retrieval.index.calibrate import calibrates, measure_plan_costs
from retrieval.index.codes import quantize
from retrieval.index.exact import exact_search, recall_at_k
from retrieval.index.inputs import as_tensor
from retrieval.index.ivf import EXACT_DTYPES, BuiltIVFConfig, IVFConfig, IVFIndex
from retrieval.index.kmeans import assign, train_centroids
from retrieval.index.probe import unit_norm
from retrieval.index.scan import bit_index_cpu, encode_int8_cpu
from retrieval.index.targets import CURVE_TOP, SLACK_QUANTILES, curve_nprobe
from retrieval.value_lists import ValueLists


def build_ivf(
    vectors: torch.Tensor | np.ndarray,
    config: IVFConfig | None = None,
    *,
    item_ids: torch.Tensor | np.ndarray | None = None,
    item_attributes: Mapping[str, np.ndarray] | None = None,
    attribute_values: Mapping[str, Vocabulary] | None = None,
    tune_queries: torch.Tensor | np.ndarray | None = None,
) -> IVFIndex:
    """Builds an :class:`IVFIndex` over ``vectors [N, D]`` floats (tensor or NumPy array).

    ``item_ids [N]`` integers default to ``0..N-1``; ``item_attributes`` (codes ``[N]`` or bool
    ``[N, V]`` per attribute, vocabularies in ``attribute_values``: strings, or integers that
    filters then name by their decimal text, ``label = 3``) become filter signatures.
    ``config`` is resolved for the catalog (:meth:`IVFConfig.resolved`: nlist, nprobe, the
    target recall); with a target recall, nprobe is tuned on ``tune_queries [Q, D]`` (default: a
    sample of the vectors themselves). With ``config.metric = "cosine"`` the vectors are
    L2-normalised first. What the build measures is the index's :class:`IndexStats`
    (``index.stats``); ``index.config`` holds the settings as resolved.

    With ``probe`` and ``assign`` both "auto" on unit-norm vectors, a build tuned on real
    queries (``tune_queries`` and ``target_recall``) builds its lists both by L2 and by inner
    product and keeps the one that reaches the target with fewer lists (L2 on a tie): queries
    drawn like the items favour L2, a model's users, who sit away from the items, favoured
    inner product (``bench/RESULTS.md``, serve vs no-op re-measured).
    """
    vectors = as_tensor(vectors, "vectors")
    if vectors.dim() != 2 or vectors.shape[0] < 1 or not vectors.is_floating_point():
        raise ValueError(
            f"vectors must be floats [N >= 1, D], got {tuple(vectors.shape)} {vectors.dtype}"
        )
    n = vectors.shape[0]
    config = (config or IVFConfig()).resolved(n)
    x = vectors.detach().cpu().float().contiguous()
    if config.metric == "cosine":
        x = torch.nn.functional.normalize(x, dim=1)
    ids = _item_ids(item_ids, n)
    if item_attributes and not attribute_values:
        raise ValueError("attribute_values is required with item_attributes")
    probe = config.probe if config.probe != "auto" else ("l2" if unit_norm(x) else "ip")
    by = probe if config.assign == "auto" else config.assign  # lists as queries probe them
    sample = (
        x[torch.randperm(n, generator=torch.Generator().manual_seed(config.seed))[:256]]
        if tune_queries is None
        else as_tensor(tune_queries, "tune_queries").float().cpu()
    )
    rules = [(probe, by)]
    if (
        tune_queries is not None
        and config.target_recall > 0
        and (config.probe, config.assign, probe) == ("auto", "auto", "l2")
    ):
        rules.append(("ip", "ip"))  # the queries' own recall picks the rule
    best: IVFIndex | None = None
    for probe_, by_ in rules:
        index = _lists_index(x, ids, config, probe_, by_, item_attributes, attribute_values)
        # the calibration times compiled sample filters (the signature test, a superset on a
        # multi-valued hashed attribute: its costs, not its answers); the value lists join after
        lists, index.value_lists = index.value_lists, {}
        _calibrate(index, sample, (x, ids))
        index.value_lists = lists
        if best is None or index.config.nprobe < best.config.nprobe:
            best = index
    assert best is not None
    return best


def _lists_index(
    x: torch.Tensor,
    ids: torch.Tensor,
    config: BuiltIVFConfig,
    probe: str,
    by: str,
    item_attributes: Mapping[str, np.ndarray] | None,
    attribute_values: Mapping[str, Vocabulary] | None,
) -> IVFIndex:
    """The index of ``x [N, D]`` (ids ``[N]``) with lists built by ``by`` and probed by
    ``probe``: k-means, assignment, codes, signatures, postings and each list's bounds."""
    n, d = x.shape
    index = IVFIndex(config, d, attribute_values)
    nlist = min(config.nlist, n)
    centroids = train_centroids(
        x,
        nlist,
        iters=config.kmeans_iters,
        seed=config.seed,
        max_points_per_centroid=config.kmeans_max_points_per_centroid,
        by=by,
    )
    lists = assign(x, centroids, by)
    order = torch.argsort(lists, stable=True)
    counts = torch.bincount(lists, minlength=nlist)
    ls = lists[order]
    codes, scales, norms = encode(x, order, ls, centroids, config.codes)
    sig = index.schema.signatures(item_attributes or {}, n)[order]
    index.centroids = centroids
    index.offsets = torch.cat([torch.zeros(1, dtype=torch.int64), counts.cumsum(0)])
    index.built_sizes = counts.clone()
    index.item_ids = ids[order].contiguous()
    index.codes, index.scales = codes.contiguous(), scales.contiguous()
    exact_dtype = EXACT_DTYPES[index.config.exact_copy]  # "auto" resolved by the index
    # recorded, so a saved index probes and takes new items as it was built
    index.config = index.config.model_copy(update={"probe": probe, "assign": by})
    index.exact = x[order].to(exact_dtype) if exact_dtype is not None else torch.zeros(0, d)
    index.sig = sig.contiguous()
    index.bit_counts, index.postings = bit_index(sig, index.schema.unindexed_bits())
    index.list_radius = list_radius(ls, norms, nlist)
    index.list_bits = list_bits(ls, sig, nlist)
    # a multi-valued hashed attribute's exact values, by id: what its answers are verified by
    given = item_attributes or {}  # a multi-valued one: each item's codes, a list
    index.value_lists = {
        a: ValueLists.of(ids.numpy(), list(given[a])) for a in index.schema.multi_valued
    }
    index._refresh()
    return index


def _calibrate(index: IVFIndex, sample: torch.Tensor, vectors: Vectors) -> None:
    """The build's measurements on ``sample [Q, D]`` queries into ``index.stats``: the filter
    bound's slack, with ``target_recall`` the recall curve and nprobe (against exact search over
    ``vectors``), and the filtered plan's costs on this machine (``calibrate.py``)."""
    config = index.config
    if config.filter_bound > 0:
        qs = (*SLACK_QUANTILES, config.filter_bound)
        slacks = measure_slack(index.tensors(), sample, qs)
        curve = tuple((q, s) for q, s in zip(qs[:-1], slacks[:-1], strict=True))
        measured = {"filter_bound_slack": slacks[-1], "slack_curve": curve}
        index.stats = index.stats.model_copy(update=measured)
    if config.target_recall > 0:
        tune_nprobe(index, sample, vectors)
    if config.measure_costs and calibrates(index):
        costs = measure_plan_costs(index, sample)
        index.stats = index.stats.model_copy(update={"plan_costs": costs})


def _item_ids(item_ids: torch.Tensor | np.ndarray | None, n: int) -> torch.Tensor:
    """``item_ids`` (None: ``0..N-1``) -> ``[N] int64`` on the CPU; integers only."""
    if item_ids is None:
        return torch.arange(n)
    ids = as_tensor(item_ids, "item_ids")
    if ids.is_floating_point() or ids.is_complex() or ids.dtype == torch.bool:
        raise ValueError(f"item_ids must be integers, got {ids.dtype}")
    if ids.shape != (n,):
        raise ValueError(f"item_ids must be [N={n}], got {tuple(ids.shape)}")
    return ids.detach().cpu().long()


def encode(
    x: torch.Tensor, order: torch.Tensor, lists: torch.Tensor, centroids: torch.Tensor, kind: str
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Residual codes of ``x [N, D]`` float32 in list-sorted ``order`` (rows in ``lists``) ->
    ``(codes [N, D], scales [N], norms [N])``, norms for ``list_radius``
    (:func:`~retrieval.index.bound.residual_norms`). INT8 is one C++ pass with no float copy of
    the catalog (the torch ops' time: ``bench/RESULTS.md``, 10M x 64); FP8 takes the torch ops."""
    if kind == "int8":
        return encode_int8_cpu(x, order, lists, centroids)
    residuals = x[order] - centroids[lists]
    codes, scales = quantize(residuals, kind)
    return codes, scales, residual_norms(residuals, codes, scales)


def bit_index(
    sig: torch.Tensor, unindexed: np.ndarray | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(bit_counts [W*64] int64, postings [nnz] int32)`` of ``sig [N, W]``: how many items set
    each bit, and the items of every bit, bit after bit (``scan.bit_index_cpu``: a counting sort
    in C++, not a NumPy unpacking of every bit), but the bits ``unindexed [W*64] bool``, which
    are counted and listed in no postings (``FilterSchema.unindexed_bits``)."""
    if sig.shape[1] == 0:
        return torch.zeros(0, dtype=torch.int64), torch.zeros(0, dtype=torch.int32)
    if sig.shape[0] >= 2**31:
        raise ValueError("postings hold int32 positions: at most 2**31 - 1 items per index")
    if unindexed is None or not unindexed.any():
        return bit_index_cpu(sig)
    skip = pack_bits(unindexed[None, :])[0].to(sig.device)  # [W]
    counts, postings = bit_index_cpu((sig & ~skip).contiguous())
    counts += bit_index_cpu((sig & skip).contiguous())[0]  # their postings: dropped
    return counts, postings


Vectors = tuple[torch.Tensor, torch.Tensor]
"""``(x [N, D] float32, ids [N] int64)``: the vectors an index was built from and their item ids."""


def tune_nprobe(index: IVFIndex, queries: torch.Tensor, vectors: Vectors | None = None) -> int:
    """Measures the recall curve (:func:`measure_recall_curve`) into ``index.stats`` and sets
    ``index.config.nprobe`` to the smallest power of two (or nlist) whose recall reaches
    ``target_recall``."""
    curve = measure_recall_curve(index, queries, vectors)
    nprobe = curve_nprobe(curve, index.config.target_recall, index.nlist)
    index.config = index.config.model_copy(update={"nprobe": nprobe})
    index.stats = index.stats.model_copy(update={"recall_curve": curve})
    return nprobe


def measure_recall_curve(
    index: IVFIndex, queries: torch.Tensor, vectors: Vectors | None = None
) -> tuple[tuple[int, float], ...]:
    """``(nprobe, recall)`` for nprobe = 1, 2, 4, ...: unfiltered recall@``tune_k`` against
    exact search on ``queries [Q, D]`` (rounded down to 4 decimals), until it reaches
    ``CURVE_TOP`` or nprobe reaches nlist (``retrieval/index/targets.py``). The truth is exact
    search over the build's ``vectors`` when given (a target is recall against the true
    neighbours), else over what the index holds (its exact copy, or its decoded codes)."""
    cfg = index.config
    k = min(cfg.tune_k, index.ntotal)
    empty = index.schema.empty(len(queries))
    if vectors is not None:  # the true neighbours, not those of the quantized copy
        x, ids = vectors  # (a cosine build normalised x; a query's norm does not change its order)
        truth = ids[exact_search(x, queries.float(), k)[0]]
    else:
        truth_pos, _ = index.search(queries, k, empty, nprobe=1, exact=True, positions=True)
        truth = index.item_ids[truth_pos.clamp(min=0)]
    curve, nprobe = [], 1
    while True:
        pos, _ = index.search(queries, k, empty, nprobe=nprobe, positions=True)
        found = index.ids_at(pos)
        recall = math.floor(recall_at_k(found, truth) * 1e4) / 1e4
        curve.append((nprobe, recall))
        if nprobe >= index.nlist or recall >= CURVE_TOP:
            return tuple(curve)
        nprobe = min(2 * nprobe, index.nlist)
