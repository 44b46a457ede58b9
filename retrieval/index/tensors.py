"""The index's tensors as typed bundles, handed to every kernel wrapper instead of positional lists.

* :class:`Lists`: the inverted lists a scan reads (as faiss passes its ``InvertedLists``):
  residual codes, their scales, the list boundaries and the items' filter signatures.
* :class:`ScanRows`: what one scan reads of its query rows: queries, probed lists with their
  coarse scores, each row's filter and the rows it excludes.
* :class:`IndexTensors`: everything a search reads of an index (its lists, centroids, exact
  copy, id order, postings, per-list statistics, config), made by ``IVFIndex.tensors()`` once
  per search, so the planner, the executor and its backends take one argument, not the index.

Adding a tensor to the index adds a field here; no kernel signature repeats the list.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from retrieval.index.config import IVFConfig
from retrieval.index.exclude import IdOrder
from retrieval.index.stats import IndexStats

ProbeTable = tuple[torch.Tensor, torch.Tensor, torch.Tensor]
"""``scan.probe_table_cpu``'s quantized centroids: what a few queries' probe reads first."""


@dataclass(frozen=True, slots=True)
class Lists:
    """An index's inverted lists (N items, D dims, W signature words, L lists), list-sorted:
    list ``l`` holds rows ``offsets[l] : offsets[l + 1]``.

    ``codes [N, D] int8 | float8_e4m3fn`` residual codes, ``scales [N] bfloat16``, ``offsets
    [L + 1] int64``, ``sig [N, W] int64`` filter signatures, ``max_list`` the longest list (the
    reference scan's width)."""

    codes: torch.Tensor
    scales: torch.Tensor
    offsets: torch.Tensor
    sig: torch.Tensor
    max_list: int

    @classmethod
    def of(
        cls, codes: torch.Tensor, scales: torch.Tensor, offsets: torch.Tensor, sig: torch.Tensor
    ) -> Lists:
        """The bundle of these tensors, its longest list read off ``offsets``."""
        sizes = offsets[1:] - offsets[:-1]
        return cls(codes, scales, offsets, sig, int(sizes.max()) if sizes.numel() else 0)


@dataclass(frozen=True, slots=True)
class ScanRows:
    """A scan's B query rows (P probed slots, C filter clauses, S excluded rows).

    ``q [B, D] float32`` queries (as scored), ``probes [B, P] int64`` list ids (``-1`` skips a
    slot), ``coarse [B, P] float32`` q·centroid of each probed list, ``fmask [B, C, W] int64`` /
    ``fneg [B, C] bool`` each row's filter, ``excl [B, S] int64`` rows each excludes (ascending,
    ``exclude.PAD`` padded; None: none), ``floor [B] float32`` a second round's K-th score so far
    (candidates below it may be left out; None: keep all), ``fnone [B, C, W] int64`` each
    clause's "or none of these bits" part (``FilterBatch.neg_masks``; None: no clause has one)."""

    q: torch.Tensor
    probes: torch.Tensor
    coarse: torch.Tensor
    fmask: torch.Tensor
    fneg: torch.Tensor
    excl: torch.Tensor | None = None
    floor: torch.Tensor | None = None
    fnone: torch.Tensor | None = None

    def excluded(self) -> torch.Tensor:
        """``excl``, or ``[B, 0]`` where the rows exclude nothing (what the kernels take)."""
        if self.excl is None:
            return self.probes.new_empty((self.probes.shape[0], 0))
        return self.excl.contiguous()

    def part(self, rows: slice) -> ScanRows:
        """The rows ``rows`` of every per-row field (a bounded chunk of the batch)."""
        return ScanRows(
            self.q[rows],
            self.probes[rows],
            self.coarse[rows],
            self.fmask[rows],
            self.fneg[rows],
            None if self.excl is None else self.excl[rows],
            None if self.floor is None else self.floor[rows],
            None if self.fnone is None else self.fnone[rows],
        )


@dataclass(frozen=True, slots=True)
class ValuePostings:
    """The items of each hashed attribute's values (``FilterSchema.value_layout``,
    ``csrc/ivf_scan/values.cpp``): ``layout [A, 4] int64`` on the CPU (an attribute's first
    bit, digits, bucket digits, first slot), ``offsets [S + 1] int64`` and ``postings [M]
    int32``: slot ``s`` (a bucket of one attribute's values) holds ``postings[offsets[s] :
    offsets[s + 1]]``, ascending. ``offsets`` empty: none listed (its attributes never drive)."""

    layout: torch.Tensor
    offsets: torch.Tensor
    postings: torch.Tensor


@dataclass(frozen=True, slots=True)
class FilterSample:
    """A catalog's sample of signatures, as the planner's estimate reads it
    (``selectivity.py``): ``sig [S, W] int64`` on the index's device, ``host [S, W]`` on the CPU
    with its ``counts [W*64]`` / ``postings`` (every bit listed), ``ntotal`` the items sampled
    from."""

    sig: torch.Tensor
    host: torch.Tensor
    counts: torch.Tensor
    postings: torch.Tensor
    ntotal: int

    @property
    def size(self) -> int:
        return int(self.host.shape[0])


@dataclass(frozen=True, slots=True)
class IndexTensors:
    """Everything a search reads of an index (:class:`~retrieval.index.ivf.IVFIndex`'s buffers
    and what ``_refresh`` derives from them), read once per search from the module's buffer
    dict.

    ``centroids [L, D] f32`` and ``centroids_t [D, L]`` (the CPU probe's layout), ``half_norms
    [L]`` (``|c|^2 / 2``), ``probe_table`` (int8 centroids for a few queries' probe, or None),
    ``exact [N, D] f16|f32`` (or ``[0, D]``: no copy), ``item_ids [N]`` and ``id_order``
    (id -> row), ``bit_counts [W*64]`` / ``postings`` / ``posting_offsets`` (the items of each
    signature bit; ``posting_counts`` those the postings list, ``-1`` for a bit they leave
    out, a hashed attribute's), ``values`` (the items of a hashed attribute's values, which
    its filters drive from: :class:`ValuePostings`), ``filter_sample`` the signatures the
    planner estimates a filter's share from (``selectivity.py``), ``built_sizes [L]`` (list
    sizes as built; empty: saved before them),
    ``list_radius [L]`` / ``list_bits [L, W]`` (``bound.py``'s statistics), ``ntotal`` the items
    the index plans for (a router's statistics-only index holds none of them), ``nlist`` = L;
    ``stats`` what the build measured (the planner's costs and curves, the bound's slack);
    ``value_keys [K] int64`` sorted, the values items hold of the multi-valued hashed
    attributes, ``position << 32 | code`` (``retrieval/filter_verify.py``; empty: none)."""

    config: IVFConfig
    stats: IndexStats
    lists: Lists
    centroids: torch.Tensor
    centroids_t: torch.Tensor
    half_norms: torch.Tensor
    probe_table: ProbeTable | None
    exact: torch.Tensor
    item_ids: torch.Tensor
    id_order: IdOrder
    bit_counts: torch.Tensor
    postings: torch.Tensor
    posting_offsets: list[int]
    posting_counts: torch.Tensor
    values: ValuePostings
    filter_sample: FilterSample
    built_sizes: torch.Tensor
    list_radius: torch.Tensor
    list_bits: torch.Tensor
    ntotal: int
    nlist: int
    value_keys: torch.Tensor

    @property
    def probe_half(self) -> torch.Tensor | None:
        """The probe rule as the probe kernels take it: ``half_norms`` ("l2"), None ("ip")."""
        return self.half_norms if self.config.probe == "l2" else None

    @property
    def keeps_exact_copy(self) -> bool:
        """The index (or, for a router's statistics-only index, its shards) keeps an exact
        copy of every vector to re-rank with."""
        return self.config.exact_copy != "none"

    @property
    def device(self) -> torch.device:
        return self.centroids.device

    def scored(self, q: torch.Tensor) -> torch.Tensor:
        """Queries as the index scores them (unit norm for "cosine")."""
        return torch.nn.functional.normalize(q, dim=1) if self.config.metric == "cosine" else q
