"""The item index as tensors inside a module: IVF lists of residual codes, filter signatures,
an optional exact copy for re-ranking, and the search plan that ties them together.

Every buffer is in the ``state_dict`` (sized by the catalog, so loading resizes them), and
``.to("cuda")`` moves the whole index. Items are stored in list-sorted order: list ``l`` holds
rows ``offsets[l] : offsets[l + 1]``; ``item_ids`` maps a row back to the catalog's item id.

Search, per batch (B queries, P probes, r candidates, K results)::

    coarse = q @ centroids.T                       [B, nlist] -> top-P lists per query
    scan the lists' codes, filter inside the scan  -> best r approximate   [B, r]
    re-rank the r with the exact copy (optional)   -> top K                [B, K]

The plan adapts to each request's filter: its selectivity ``s`` (estimated from per-bit counts)
widens the probe (``nprobe * s**-exponent``, and enough lists to hold ``2r`` eligible items); when
scanning its eligible items exactly is cheaper than the lists that hold its best ``r / s`` items
(a cost model the build measures on its machine, ``retrieval/index/costs.py``), it skips the
lists. Given the queries, the plan also skips the lists a filtered row's filter rules out and
bounds what the lists it leaves out could hold (``retrieval/index/bound.py``): a row whose K-th
result some bound beats probes those lists in a second round, or scans exactly. A request that still finds fewer than K items while
more exist is answered by the exact scan, so a filter can never starve a result.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch
from torch import nn

from common.compile_boundary import eager_under_compile
from retrieval.filter_verify import value_keys
from retrieval.filters import (
    FilterBatch,
    FilterSchema,
    Vocabulary,
)
from retrieval.index.candidates import probe
from retrieval.index.config import METRICS, PROBES, BuiltIVFConfig, IVFConfig
from retrieval.index.exclude import IdOrder
from retrieval.index.executor import Executor
from retrieval.index.format import EXTRA, INDEX_FORMAT, migrate, version_of
from retrieval.index.fresh import LiveSegment
from retrieval.index.inputs import (
    as_count,
    as_queries,
    check_filter_batch,
    filters_on,
    search_params,
)
from retrieval.index.plan import SearchParams, SearchPlan
from retrieval.index.planner import make_plan
from retrieval.index.probe import half_sq_norms
from retrieval.index.readout import ids_at, scores_at, vectors_at
from retrieval.index.scan import probe_table_cpu, value_index_cpu
from retrieval.index.search import Candidates
from retrieval.index.selectivity import sample_of, sample_rows
from retrieval.index.stats import IndexStats
from retrieval.index.targets import check_targets
from retrieval.index.tensors import FilterSample, IndexTensors, Lists, ProbeTable, ValuePostings
from retrieval.value_lists import ValueLists

FilterArg = FilterBatch | str | Sequence[str | None] | None
__all__ = [
    "EXACT_DTYPES",
    "METRICS",
    "PROBES",
    "FilterArg",
    "IVFConfig",
    "IVFIndex",
    "SearchParams",
]
_CODE_DTYPES = {"int8": torch.int8, "fp8": torch.float8_e4m3fn}
EXACT_DTYPES = {"float16": torch.float16, "float32": torch.float32, "none": None}
MAX_KEPT_PARAMS = 64
"""Distinct ``(k, nprobe, rerank)`` a search keeps checked (:meth:`IVFIndex._plain_params`)."""
PROBE_TABLE_MIN = 1 << 17
"""Centroid floats (nlist x D) from which a few queries' probe reads an int8 table first: below
it the float table stays in a core's cache, and reading the int8 table first gains nothing."""


class IVFIndex(nn.Module):
    """IVF index held as buffers. Build with :func:`build_ivf`; search with :meth:`search`
    (trusted callers: :meth:`execute`); a document shard answers :meth:`item_candidates`.

    Buffers (N items, D dims, W signature words): ``centroids [nlist, D] f32``, ``offsets
    [nlist+1] i64``, ``item_ids [N] i64``, ``codes [N, D] int8|fp8``, ``scales [N] bf16``,
    ``exact [N, D] f16|f32`` (or ``[0, D]``), ``sig [N, W] i64``, ``bit_counts [W*64] i64``,
    ``postings [sum(bit_counts)] i32`` (the items of each bit: an inverted index over attributes),
    ``list_radius [nlist] f32`` and ``list_bits [nlist, W] i64`` (each list's largest residual and
    the OR of its signatures: ``retrieval/index/bound.py``; empty: no bound check),
    ``filter_sample [S, W] i64`` (the signatures of ``selectivity.sample_rows``: what the
    planner estimates a filter's share from; read again off ``sig`` with every bundle, kept as
    given by an index without items, a router's),
    ``built_sizes [nlist] i64`` (each list's items as built, the whole catalog's in a document
    shard too, which live updates leave as they are: what a row's list count is read from,
    ``probe.lists_holding``; empty: ``nprobe`` lists a row).

    ``config`` holds the settings as the build resolved them, ``stats`` what it measured; both
    are saved in the state (its extra state, with a format version: ``format.py``).
    """

    centroids: torch.Tensor
    offsets: torch.Tensor
    item_ids: torch.Tensor
    codes: torch.Tensor
    scales: torch.Tensor
    exact: torch.Tensor
    sig: torch.Tensor
    bit_counts: torch.Tensor
    postings: torch.Tensor
    list_radius: torch.Tensor
    list_bits: torch.Tensor
    built_sizes: torch.Tensor
    filter_sample: torch.Tensor

    def __init__(
        self,
        config: IVFConfig,
        dim: int,
        attribute_values: Mapping[str, Vocabulary] | None = None,
        stats: IndexStats | None = None,
        hashed_digits: Mapping[str, int] | None = None,
    ):
        super().__init__()
        config = config.resolved()
        self.config: BuiltIVFConfig = config
        self.stats = stats or IndexStats()
        """What the build measured (an index derived from another: its measurements)."""
        self.dim = dim
        # an index derived from another keeps its hashed layout (``hashed_digits``)
        self.schema = FilterSchema(attribute_values or {}, config.hashed_min_values, hashed_digits)
        w = self.schema.num_words
        exact_dtype = EXACT_DTYPES[config.exact_copy] or torch.float32
        self.register_buffer("centroids", torch.zeros(0, dim))
        # ||c||^2 / 2 per list, for probing by L2 (derived from centroids at _refresh: not saved)
        self.register_buffer("half_norms", torch.zeros(0), persistent=False)
        self.register_buffer("centroids_t", torch.zeros(dim, 0), persistent=False)
        """``[D, nlist]``: the centroids transposed, the CPU probe's layout."""
        self.register_buffer("offsets", torch.zeros(1, dtype=torch.int64))
        self.register_buffer("item_ids", torch.zeros(0, dtype=torch.int64))
        self.register_buffer("codes", torch.zeros(0, dim, dtype=_CODE_DTYPES[config.codes]))
        self.register_buffer("scales", torch.zeros(0, dtype=torch.bfloat16))
        self.register_buffer("exact", torch.zeros(0, dim, dtype=exact_dtype))
        self.register_buffer("sig", torch.zeros(0, w, dtype=torch.int64))
        self.register_buffer("bit_counts", torch.zeros(w * 64, dtype=torch.int64))
        # items of each signature bit, bit after bit (int32 positions; offsets = cumsum(bit_counts))
        self.register_buffer("postings", torch.zeros(0, dtype=torch.int32))
        # the items of each hashed attribute's values, derived from sig at _refresh: not saved
        self.register_buffer("value_offsets", torch.zeros(0, dtype=torch.int64), persistent=False)
        self.register_buffer("value_postings", torch.zeros(0, dtype=torch.int32), persistent=False)
        self.register_buffer("list_radius", torch.zeros(0))
        self.register_buffer("list_bits", torch.zeros(0, w, dtype=torch.int64))
        self.register_buffer("built_sizes", torch.zeros(0, dtype=torch.int64))
        self.register_buffer("filter_sample", torch.zeros(0, w, dtype=torch.int64))
        self.max_list = 0
        self._ntotal = 0
        self.executor = Executor()
        """Runs this index's plans and keeps what its searches repeat (``executor.py``)."""
        self.probe_table: ProbeTable | None = None
        """The centroids in int8 for a few queries' probe (``scan.probe_table_cpu``), made by
        :meth:`_refresh` from :data:`PROBE_TABLE_MIN` centroid floats on the CPU."""
        self.posting_offsets: list[int] = [0]
        self.filter_host = sample_of(self.filter_sample, 0)
        """The planner's sample (``selectivity.py``) with its host side, made by
        :meth:`sample_filters`; each bundle takes the buffer's rows where they are."""
        self.value_layout = self.schema.value_layout(0)
        """``FilterSchema.value_layout``: where the values' postings list each hashed attribute."""
        self.id_order = IdOrder.of(self.item_ids)
        self.live: LiveSegment | None = None
        """What live updates changed since this main index was built (``fresh.py``): fresh
        rows and tombstones, searched beside the main lists. None: nothing."""
        self.served_items: int | None = None
        """A router's statistics-only index: the items its shards serve (None: ``ntotal``)."""
        self.value_lists: dict[str, ValueLists] = {}
        """Each multi-valued hashed attribute's exact values by item id (saved with the
        index): what :mod:`~retrieval.index.verified` checks its superset signatures against."""

    # ---- state -------------------------------------------------------------------------------
    @property
    def ntotal(self) -> int:
        """Items in the catalog this index plans for (a router's statistics-only index holds
        the catalog's list sizes but none of its items)."""
        return self._ntotal

    @property
    def nlist(self) -> int:
        return int(self._buffers["centroids"].shape[0])  # type: ignore[union-attr]  # no __getattr__

    def get_extra_state(self) -> dict[str, Any]:
        return {
            "format": INDEX_FORMAT,
            "config": self.config.model_dump(),
            "stats": self.stats.model_dump(),
            "dim": self.dim,
            "attribute_values": self.schema.to_dict(),
            "hashed_digits": dict(self.schema.hashed_digits),
            "value_lists": {a: v.state() for a, v in self.value_lists.items()},
        }

    def set_extra_state(self, state: dict[str, Any]) -> None:
        """Adopts a saved state's config (e.g. its tuned nprobe), statistics and filter schema;
        ``state`` is of this format (``_load_from_state_dict`` migrated it)."""
        if state["dim"] != self.dim or state["config"]["codes"] != self.config.codes:
            raise ValueError(
                f"index state has dim={state['dim']} codes={state['config']['codes']!r}, "
                f"this index has dim={self.dim} codes={self.config.codes!r}"
            )
        self.config = BuiltIVFConfig.from_dict(
            state["config"], where="index state", prefix="config."
        )
        self.stats = IndexStats.from_dict(state["stats"], where="index state", prefix="stats.")
        # the saved layout: hashed attributes as saved (a state from before them: none)
        self.schema = FilterSchema(
            state["attribute_values"], hashed_digits=state.get("hashed_digits", {})
        )
        lists = state.get("value_lists", {})
        self.value_lists = {a: ValueLists.from_state(v) for a, v in lists.items()}
        self.schema.multi_valued = set(self.value_lists)

    def _load_from_state_dict(
        self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs
    ):
        # An older format first becomes this one (``format.py``); then the buffers, sized by the
        # catalog, adopt the saved sizes, with matching dims and dtypes. The exact copy may
        # differ in dtype from this module's: the saved config (extra state, loaded after the
        # buffers) says which it is.
        self._migrate(state_dict, prefix)
        for name, buf in self._buffers.items():
            saved = state_dict.get(prefix + name)
            if saved is None or buf is None:
                continue
            adoptable = name == "exact" and saved.dtype in (torch.float16, torch.float32)
            if (saved.dtype != buf.dtype and not adoptable) or (
                saved.shape[1:] != buf.shape[1:]
                and name not in ("sig", "bit_counts", "postings", "list_bits", "filter_sample")
            ):
                error_msgs.append(
                    f"{prefix}{name}: saved {tuple(saved.shape)} {saved.dtype}, expected [*, "
                    f"{', '.join(map(str, buf.shape[1:]))}] {buf.dtype} (different index config?)"
                )
                continue
            self._buffers[name] = torch.empty_like(saved, device=buf.device)
        super()._load_from_state_dict(
            state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs
        )
        self._refresh()

    @staticmethod
    def _migrate(state_dict: dict[str, Any], prefix: str) -> None:
        """Brings this index's entries of ``state_dict`` (a copy ``load_state_dict`` made) to
        this format, in place."""
        extra = state_dict.get(prefix + EXTRA)
        if not isinstance(extra, dict):
            return  # torch reports the missing state
        version = version_of(extra)
        if version == INDEX_FORMAT:
            return
        mine = {k[len(prefix) :]: v for k, v in state_dict.items() if k.startswith(prefix)}
        mine = {k: v for k, v in mine.items() if "." not in k}  # not a submodule's
        for key, value in migrate(mine, version).items():
            state_dict[prefix + key] = value

    def _refresh(self) -> None:
        self.centroids_t = self.centroids.float().T.contiguous()
        if self.centroids.dtype == torch.float32 and self.centroids.is_cpu:
            # one copy: [nlist, D] as a view of the probe's [D, nlist] (the C++ kernels read
            # only that layout; torch ops take either)
            self.centroids = self.centroids_t.T
        self.half_norms = half_sq_norms(self.centroids)  # from the layout a load sees too
        sizes = self.offsets[1:] - self.offsets[:-1]
        self.max_list = int(sizes.max()) if sizes.numel() else 0
        self._ntotal = int(self.offsets[-1])
        # kept plans and graphs read the lists: start afresh, on the backend chosen
        held = self.__dict__.get("executor")
        self.executor = Executor(None if held is None else held.backend)
        ct = self.centroids_t  # below PROBE_TABLE_MIN the float table stays in a core's cache
        self.probe_table = (
            probe_table_cpu(ct) if ct.is_cpu and ct.numel() >= PROBE_TABLE_MIN else None
        )
        listed = self._posting_counts().clamp(min=0)
        self.posting_offsets = torch.cat([listed.new_zeros(1), listed.cumsum(0)]).tolist()
        self._value_index()
        self.id_order = IdOrder.of(self.item_ids)
        self.sample_filters()

    def sample_filters(self) -> None:
        """Reads ``filter_sample`` again off ``sig`` (``selectivity.sample_rows``), with its host
        side; an index without items (a router's) keeps the one it was given."""
        if self.sig.shape[0]:
            self.filter_sample = self.sig[sample_rows(self.sig.shape[0]).to(self.sig.device)]
        self.filter_host = sample_of(self.filter_sample, self._ntotal)

    def _filter_sample(self) -> FilterSample:
        """The bundle's sample: :attr:`filter_host` with the buffer as it is (moved or not);
        attribute reads only, so a compiled forward traces it."""
        s = self.filter_host
        return FilterSample(self._buffers["filter_sample"], s.host, s.counts, s.postings, s.ntotal)  # type: ignore[arg-type]

    def _posting_counts(self) -> torch.Tensor:
        """``[W*64]``: the items each bit's postings list, ``-1`` for a bit they leave out (a
        hashed attribute's: ``build.bit_index``), read off the postings' length, so an index
        saved when they listed its key's top digit, or every bit, reads as it was saved."""
        counts = self.bit_counts
        if not self.schema.hashed_base or self.schema.num_words != self.sig.shape[1]:
            return counts
        for top in (False, True):
            skip = torch.from_numpy(self.schema.unindexed_bits(top)).to(counts.device)
            if int(counts.masked_fill(skip, 0).sum()) == self.postings.numel():
                return counts.masked_fill(skip, -1)
        return counts

    def _value_postings(self) -> ValuePostings:
        """The values' postings of the buffers as they are: none where the signatures are not
        the schema's (a calibration copy's one bit a row: ``calibrate._filtered``)."""
        b, layout = self._buffers, self.value_layout
        sig = b["sig"]
        assert sig is not None
        if sig.shape[1] != self.schema.num_words or layout.shape[0] == 0:
            layout = layout[:0]
        return ValuePostings(layout, b["value_offsets"], b["value_postings"])  # type: ignore[arg-type]

    def _value_index(self) -> None:
        """The items of each hashed attribute's values (``ValuePostings``), from ``sig``: one
        C++ pass, at every change of the signatures (a live update's new value lands in its
        bucket like any other)."""
        sig = self._buffers["sig"]
        assert sig is not None
        self.value_layout = self.schema.value_layout(sig.shape[0])
        words = self.schema.num_words
        if self.value_layout.shape[0] == 0 or sig.shape[0] == 0 or sig.shape[1] != words:
            offsets, postings = sig.new_zeros(0), sig.new_zeros(0, dtype=torch.int32)
        else:
            listed = value_index_cpu(sig, self.value_layout)
            offsets, postings = (t.to(sig.device) for t in listed)
        self.value_offsets, self.value_postings = offsets, postings

    def memory_bytes(self) -> dict[str, int]:
        """Bytes held per buffer and per derived lookup (sum / ntotal = bytes per item); a buffer
        viewing another's storage (``centroids`` of ``centroids_t`` on the CPU) counts once."""
        out, held = {}, set()
        for name, b in self.named_buffers():
            where = (b.device, b.untyped_storage().data_ptr())
            out[name] = 0 if where in held else b.untyped_storage().nbytes()
            if b.numel():
                held.add(where)
        out["id_order"] = self.id_order.nbytes  # rebuilt on load: no buffer, still memory
        out["probe_table"] = sum(t.nbytes for t in self.probe_table or ())  # likewise
        return out

    # ---- search ------------------------------------------------------------------------------
    def compile_filter(self, filters: FilterArg, batch: int) -> FilterBatch:
        """Text filter(s) or a compiled batch (which may exclude items: ``FilterBatch.exclude``)
        -> :class:`FilterBatch` on this index's device."""
        if filters is None:
            fb = self.schema.empty(batch)
        elif isinstance(filters, FilterBatch):
            fb = filters
        elif isinstance(filters, str):  # one filter for every row: compiled once, copied
            fb = self.schema.compile([filters]).rows(torch.zeros(batch, dtype=torch.int64))
        else:
            fb = self.schema.compile(list(filters))
        check_filter_batch(fb, batch, self.schema.num_words)
        return filters_on(fb, self._buffers["centroids"].device)  # type: ignore[union-attr]

    def search(
        self,
        q: torch.Tensor | np.ndarray,
        k: int,
        filters: FilterArg = None,
        *,
        nprobe: int | None = None,
        rerank: int | None = None,
        recall_target: float | torch.Tensor | None = None,
        exact: bool = False,
        positions: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Top-``k`` items for ``q [B, D]`` floats (tensor or NumPy array) -> ``(item_ids [B, k]
        int64, scores [B, k] float32)``; ``-1`` / ``-inf`` pad rows whose filter admits fewer
        than ``k`` items.

        ``k``, ``nprobe``, ``rerank``: integers (``int`` or NumPy's). ``nprobe`` is the fewest
        lists a row probes (None: the config's); ``rerank`` the candidates re-scored with the
        exact copy (None: the config's; > 0 needs an index that keeps the copy).
        ``recall_target``: recall@K against exact search each row asks for, in (0, 1] (one for
        all rows, or ``[B]``; 0 or None: ``nprobe``), read off the curves the build measured
        (``retrieval/index/targets.py``); 1 scans exactly. ``exact``: every row scans its
        eligible items exactly (the reference the index is measured against). ``positions``:
        list-sorted positions instead of item ids (what :meth:`vectors_at` reads).
        :meth:`search_plan` tells, per row, how many lists the search will probe.
        """
        q = self._check_queries(q)
        fb = None if filters is None else self.compile_filter(filters, q.shape[0])
        if recall_target is None and not exact:
            params = self._plain_params(k, nprobe, rerank)
        else:
            b = q.shape[0]
            target = None
            if recall_target is not None:
                target = torch.as_tensor(recall_target, dtype=torch.float32).expand(b)
                check_targets(target, b)
            params = self.params(k, nprobe, rerank, exact=exact, target=target)
        # a direct search: no compile boundary (:meth:`execute` is this call on trusted inputs)
        return self.executor.search(self.tensors(), q, fb, params, positions, self.live)

    def _execute(
        self,
        q: torch.Tensor,
        fb: FilterBatch | None,
        params: SearchParams,
        positions: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """:meth:`search` on validated inputs (the model's forward checks its batch at its own
        edge): ``q [B, D]`` float32 on this index's device, ``fb`` on it too (None: no clause,
        nothing excluded), ``params`` from :meth:`params`."""
        return self.executor.search(self.tensors(), q, fb, params, positions, self.live)

    # The host plan branches on data (which rows are exact, how many lists each probes), so
    # under torch.compile it runs eagerly: graphs around it (towers, scoring) still compile, and
    # the heavy part, the scan, is one C++ op either way. Direct searches skip the wrapper.
    _eager_execute = eager_under_compile(_execute)

    def execute(
        self,
        q: torch.Tensor,
        fb: FilterBatch | None,
        params: SearchParams,
        positions: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """:meth:`_execute` for the model's forward: traced as it is with the device backend
        (``executor.backend = "device"``: fixed shapes, no host read), else eagerly under a
        compile (a recall target, or live rows beside the main index, take the host's rounds)."""
        live_rows = self.live is not None and self.live.size > 0
        if self.executor.backend == "device" and params.target is None and not live_rows:
            return self._execute(q, fb, params, positions)
        return self._eager_execute(q, fb, params, positions)

    def params(
        self,
        k: int,
        nprobe: int | None = None,
        rerank: int | None = None,
        *,
        exact: bool = False,
        target: torch.Tensor | None = None,
    ) -> SearchParams:
        """The checked settings of a search (:func:`~retrieval.index.inputs.search_params`)."""
        return search_params(
            self.config.nprobe, self.config.rerank, self.keeps_exact_copy, self.ntotal,
            k, nprobe, rerank, exact, target,
        )  # fmt: skip

    def _plain_params(self, k: int, nprobe: int | None, rerank: int | None) -> SearchParams:
        """:meth:`params` without a target or an exact scan, checked once per ``(k, nprobe,
        rerank)`` of plain ``int`` (or None) and kept with the bundle (:meth:`tensors`), as
        what they are checked against (the config, the catalog's size) changes only with it.
        Other integral types are checked every call and never kept (``True == 1``)."""
        if not (
            type(k) is int
            and (nprobe is None or type(nprobe) is int)
            and (rerank is None or type(rerank) is int)
        ):
            return self.params(k, nprobe, rerank)
        kept = self.__dict__.get("_params")
        if kept is None:
            kept = self.__dict__["_params"] = {}
        key = (k, nprobe, rerank)
        params = kept.get(key)
        if params is None:
            if len(kept) >= MAX_KEPT_PARAMS:
                kept.clear()
            params = kept[key] = self.params(k, nprobe, rerank)
        return params

    def search_plan(
        self,
        k: int,
        filters: FilterArg = None,
        *,
        batch: int | None = None,
        nprobe: int | None = None,
        rerank: int | None = None,
    ) -> SearchPlan:
        """What :meth:`search` with these arguments does to each of its B rows (``batch``, or the
        length of a list of filters, else 1): ``plan.kind [B]`` (``plan.RowKind``),
        ``plan.nprobe [B]`` lists probed (the count scanned: ``nprobe`` or more for a selective
        filter or a large ``k``; a row without a filter clause may stop earlier, at
        ``plan.least``, once its lists hold ``plan.hold`` items by their sizes), or ``plan.exact
        [B]`` an exact scan of the row's eligible items; ``plan.r`` candidates kept before
        re-ranking. A row whose probed lists turn out to hold fewer than ``k`` eligible items is
        then re-asked as an exact scan, and a filtered row's results may ask for a second round
        (``retrieval/index/bound.py``): both depend on the query, so no plan can show them."""
        if batch is None:
            listed = filters is not None and not isinstance(filters, str | FilterBatch)
            batch = len(list(filters)) if listed else 1  # type: ignore[arg-type]
        fb = self.compile_filter(filters, as_count(batch, "batch", 1))
        return self.plan(fb, self.params(k, nprobe, rerank))

    def plan(
        self, fb: FilterBatch, params: SearchParams, q: torch.Tensor | None = None
    ) -> SearchPlan:
        """Per row: its kind, lists to probe, or an exact scan (``retrieval/index/planner.py``).
        Reads only the index's statistics, so a router holding them plans for its shards.
        ``q [B, D]``: filtered rows get a bound check."""
        return make_plan(self.tensors(), fb, params, q)

    def item_candidates(
        self, q: torch.Tensor, fb: FilterBatch, plan: SearchPlan, with_vectors: bool = False
    ) -> Candidates:
        """This index's candidates ``[B, r]`` for a router's ``plan``, keyed by item id (what a
        document shard answers), with their vectors ``[B, r, D]`` when ``with_vectors`` (for a
        scoring head): list rows' best ``r`` approximate scores of the probed lists (re-scored
        exactly when the plan re-ranks), exact rows' best ``k`` eligible items."""
        return self.executor.item_candidates(self.tensors(), q, fb, plan, with_vectors, self.live)

    def _check_queries(self, q: torch.Tensor | np.ndarray) -> torch.Tensor:
        """The public edge for queries: ``[B, D]`` floats -> float32 on this index's device."""
        return as_queries(q, self.dim, self._buffers["centroids"].device)  # type: ignore[union-attr]

    @property
    def keeps_exact_copy(self) -> bool:
        """The index (or, for a router's statistics-only index, its shards) keeps an exact
        copy of every vector to re-rank with."""
        return self.config.exact_copy != "none"

    def __setattr__(self, name: str, value: Any) -> None:
        self._forget()  # a new buffer, config, statistic or list: a new bundle
        super().__setattr__(name, value)

    def _apply(self, fn: Any, recurse: bool = True) -> IVFIndex:
        self._forget()  # .to() / .cuda() rebind the buffers in the buffer dict
        return super()._apply(fn, recurse)

    def _forget(self) -> None:
        """Drops the bundle and the settings checked against it (:meth:`_plain_params`)."""
        self.__dict__["_bundle"] = self.__dict__["_params"] = None

    def tensors(self) -> IndexTensors:
        """The index's tensors as one bundle (``retrieval/index/tensors.py``), made once and kept
        until an attribute is set or the buffers move (a one-query search would otherwise spend
        a good part of its time gathering them)."""
        bundle = self.__dict__.get("_bundle")
        if bundle is None:
            bundle = self.__dict__["_bundle"] = self._gather_tensors()
        return bundle

    def _gather_tensors(self) -> IndexTensors:
        """The bundle, read from the module's buffer dict (a buffer read as an attribute goes
        through ``nn.Module.__getattr__``)."""
        b = self._buffers
        return IndexTensors(
            self.config,
            self.stats,
            Lists(b["codes"], b["scales"], b["offsets"], b["sig"], self.max_list),  # type: ignore[arg-type]
            b["centroids"],  # type: ignore[arg-type]
            b["centroids_t"],  # type: ignore[arg-type]
            b["half_norms"],  # type: ignore[arg-type]
            self.probe_table,
            b["exact"],  # type: ignore[arg-type]
            b["item_ids"],  # type: ignore[arg-type]
            self.id_order,
            b["bit_counts"],  # type: ignore[arg-type]
            b["postings"],  # type: ignore[arg-type]
            self.posting_offsets,
            self._posting_counts(),  # of the buffers as they are (a copy may change them)
            self._value_postings(),
            self._filter_sample(),
            b["built_sizes"],  # type: ignore[arg-type]
            b["list_radius"],  # type: ignore[arg-type]
            b["list_bits"],  # type: ignore[arg-type]
            self._ntotal,
            b["centroids"].shape[0],  # type: ignore[union-attr]
            self._value_keys(),
        )

    def _value_keys(self) -> torch.Tensor:
        """``IndexTensors.value_keys`` of :attr:`value_lists` at the items' positions, kept
        while neither those nor the items (``item_ids``) change (a compiled forward reads the
        kept ones: the eager call before a capture makes them)."""
        ids = self._buffers["item_ids"]
        assert ids is not None
        if not self.value_lists:
            return ids.new_zeros(0)
        kept = self.__dict__.get("_value_keys_kept")
        if kept is not None and torch.compiler.is_compiling():
            return kept[1]
        held = (tuple(map(id, self.value_lists.values())), ids.data_ptr(), ids._version, ids.device)
        if kept is None or kept[0] != held:
            multi = sorted(self.value_lists)
            keys = value_keys(ids.cpu().numpy(), self.value_lists, multi).to(ids.device)
            kept = self.__dict__["_value_keys_kept"] = (held, keys, self.value_lists)
        return kept[1]

    def probe(self, q: torch.Tensor, nprobe: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``(coarse [B, P], lists [B, P])`` of ``q`` (as scored) by the index's probe rule."""
        return probe(self.tensors(), q, nprobe)

    def ids_at(self, pos: torch.Tensor) -> torch.Tensor:
        """Positions ``[B, k]`` (-1 pads) -> item ids (-1 pads) (``readout.ids_at``; a fresh
        row's position is ``ntotal + row``: ``fresh.py``)."""
        if self.live is not None and self.live.n:
            return self.live.ids_at(self.tensors(), pos)
        return ids_at(self.tensors(), pos)

    def scores_at(self, q: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        """``q [B, D]`` float32 scored against rows ``pos [M]`` -> ``[B, M]``, with the exact
        copy, else off the codes (``readout.scores_at``)."""
        return scores_at(self.tensors(), q, pos)

    def vectors_at(self, pos: torch.Tensor) -> torch.Tensor:
        """Float vectors of rows ``pos [M]`` from the exact copy, else decoded from the codes
        (fresh rows from their own vectors)."""
        if self.live is not None and self.live.n:
            return self.live.vectors_at(self.tensors(), pos)
        return vectors_at(self.tensors(), pos)
