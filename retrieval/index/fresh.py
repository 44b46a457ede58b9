"""The fresh segment: what live updates changed since the main index was built, searched beside it.

An update never rewrites the main index (its lists, codes, postings and per-list bounds are
sized by the catalog). Instead each :class:`IVFIndex` may carry a :class:`LiveSegment`:

* **fresh rows**: upserted items, and items whose attributes changed, as ``ids [F] int64``,
  ``vectors [F, D] float32`` (as the index scores them: unit norm for "cosine", rounded through
  the exact copy's dtype when the index keeps one) and ``sig [F, W] int64``; ``alive [F] bool``
  says which rows still hold their item's latest state;
* **tombstones**: ``[T] int64`` ids (sorted) of main items no longer served from the main
  index: removed, replaced by an upsert, or moved to a fresh row by an attribute change.

So an upsert, a remove or an attribute flip touches the rows of its batch only: its time and
extra memory depend on the batch (and the segment, bounded by compaction, ``compaction.py``),
never on the catalog. The main index's statistics stay valid for the rows it still serves: its
postings and bit counts over-count the tombstoned ones (the planner's estimates, the exact
scan's candidates, checked against their exclusion), its list bounds bound a subset.

**Search** (``executor.py``): every fetch of a search's rounds takes the main index's
candidates, with the tombstones excluded inside the scan like a user's seen items, and the
fresh rows' exact candidates under the same filter (``filters.eligible``) and the same
exclusions, side by side (:func:`fresh_candidates`): fresh row ``j`` takes position
``ntotal + j``. The rounds' own top-K (``search.select``) is the one merge of main and fresh, so
a row is short, or asks for a second round, on the merged answer, as a document shard's router
decides it on the merged answer of every shard's main and fresh part.

**Snapshot protocol**: a :class:`LiveSegment` is immutable, and a search reads the one its index
holds from start to end. An update makes a new segment and a new (shallow) index sharing every
main buffer, which the server swaps in between batches (one reference). The fresh rows live in
a :class:`FreshStore` of spare capacity shared by successive segments: a new segment appends
rows past every older segment's length (which never read them), and copies only the small
``alive`` mask and tombstone list it changes. A store is appended to only from the segment that
claimed its last row; any other (an aborted prepare's sibling) copies the store's rows first,
so no segment ever sees another branch's rows.

Example::

    seg = LiveSegment.empty(index)
    seg = seg.upserted(t, torch.tensor([7]), vectors, sig)   # vectors [1, D], sig [1, W]
    seg = seg.removed(t, torch.tensor([3]))                   # a main item: a tombstone
"""

from __future__ import annotations

import threading
from collections.abc import Mapping
from dataclasses import dataclass, field
from functools import cached_property

import torch

from retrieval.filter_verify import value_keys
from retrieval.filters import FilterBatch, eligible
from retrieval.index.exclude import ExcludedRows, excluded_positions
from retrieval.index.kmeans import assign
from retrieval.index.readout import ids_at as main_ids_at
from retrieval.index.readout import vectors_at as main_vectors_at
from retrieval.index.scan import topk_rows
from retrieval.index.search import NEG_INF, Candidates
from retrieval.index.tensors import IndexTensors
from retrieval.index.verified import extended
from retrieval.value_lists import ValueLists

MIN_CAPACITY = 1024
"""Rows a new store holds before it first grows (then it doubles: amortised O(1) an item)."""


class FreshStore:
    """Fresh rows with spare capacity (``ids [C]``, ``vectors [C, D]``, ``sig [C, W]``, ``lists
    [C]`` the list each would join, by the build's rule), of which ``length`` are claimed, and ``row_of`` the latest claimed row of each id. Written only under
    ``lock`` and only past every segment's length (the snapshot protocol above)."""

    def __init__(self, dim: int, words: int, device: torch.device, capacity: int = MIN_CAPACITY):
        self.ids = torch.full((capacity,), -1, dtype=torch.int64, device=device)
        self.vectors = torch.zeros(capacity, dim, device=device)
        self.sig = torch.zeros(capacity, words, dtype=torch.int64, device=device)
        self.lists = torch.zeros(capacity, dtype=torch.int64, device=device)
        self.length = 0
        self.row_of: dict[int, int] = {}
        self.lock = threading.Lock()

    def _grow(self, need: int) -> None:
        """Capacity for ``need`` rows (doubling; the claimed rows copied once)."""
        cap = self.ids.shape[0]
        if need <= cap:
            return
        cap = max(need, 2 * cap)
        for name in ("ids", "vectors", "sig", "lists"):
            old = getattr(self, name)
            new = old.new_full((cap, *old.shape[1:]), -1 if name == "ids" else 0)
            new[: self.length] = old[: self.length]
            setattr(self, name, new)

    def claim(
        self,
        n: int,
        ids: torch.Tensor,
        vectors: torch.Tensor,
        sig: torch.Tensor,
        lists: torch.Tensor,
    ) -> int:
        """Appends rows after row ``n`` (a segment's length: the store's, else it raises) ->
        the first new row. ``ids [m]``, ``vectors [m, D]``, ``sig [m, W]``, ``lists [m]``."""
        if n != self.length:
            raise RuntimeError("a fresh store is appended to only from its latest segment")
        m = ids.numel()
        self._grow(n + m)
        dev = self.ids.device
        self.ids[n : n + m] = ids.to(dev)
        self.vectors[n : n + m] = vectors.to(dev, torch.float32)
        self.sig[n : n + m] = sig.to(dev)
        self.lists[n : n + m] = lists.to(dev)
        for j, i in enumerate(ids.tolist()):
            self.row_of[i] = n + j
        self.length = n + m
        return n

    def copy_of(self, n: int, alive: torch.Tensor) -> FreshStore:
        """A new store with the first ``n`` rows (``alive [n]``: which ``row_of`` names)."""
        out = FreshStore(self.vectors.shape[1], self.sig.shape[1], self.ids.device, max(n, 1))
        for name in ("ids", "vectors", "sig", "lists"):
            getattr(out, name)[:n] = getattr(self, name)[:n]
        out.length = n
        rows = alive.nonzero().flatten().tolist()
        out.row_of = dict(zip(self.ids[:n][alive].tolist(), rows, strict=True))
        return out


@dataclass(frozen=True)
class LiveSegment:
    """One snapshot of an index's live changes: the store's first ``n`` rows, ``alive [n] bool``,
    ``tombstones [T] int64`` (sorted main item ids) and ``tomb_rows [T] int64`` (their main rows,
    ascending: what each search's scan skips). Never changed: every update returns a new one
    (the module docstring's protocol). ``value_lists``: what every served item holds of the
    multi-valued hashed attributes, by id (the index's: ``live_index.with_live`` gives them),
    which a filter naming one verifies its fresh candidates against."""

    store: FreshStore
    n: int
    alive: torch.Tensor
    tombstones: torch.Tensor
    tomb_rows: torch.Tensor
    value_lists: Mapping[str, ValueLists] = field(default_factory=dict)

    @cached_property
    def value_keys(self) -> torch.Tensor:
        """``IndexTensors.value_keys`` of the fresh rows (position: the row)."""
        keys = value_keys(self.ids.cpu().numpy(), self.value_lists, sorted(self.value_lists))
        return keys.to(self.alive.device)

    @classmethod
    def empty(cls, t: IndexTensors) -> LiveSegment:
        """No change yet, for an index of tensors ``t``."""
        dev = t.device
        store = FreshStore(t.centroids.shape[1], t.lists.sig.shape[1], dev)
        none = torch.zeros(0, dtype=torch.int64, device=dev)
        return cls(store, 0, torch.zeros(0, dtype=torch.bool, device=dev), none, none)

    # ---- what it holds --------------------------------------------------------------------
    @property
    def ids(self) -> torch.Tensor:
        """``[n] int64``: the fresh rows' item ids (dead rows too: see ``alive``)."""
        return self.store.ids[: self.n]

    @property
    def vectors(self) -> torch.Tensor:
        return self.store.vectors[: self.n]

    @property
    def sig(self) -> torch.Tensor:
        return self.store.sig[: self.n]

    @property
    def lists(self) -> torch.Tensor:
        """``[n] int64``: the list each fresh row joins when compaction folds it."""
        return self.store.lists[: self.n]

    @cached_property
    def all_alive(self) -> bool:
        """Every fresh row holds its item's latest state (no mask to apply). Read once per
        segment on the CPU; a GPU's segment always applies its mask (no host read)."""
        return self.alive.is_cpu and bool(self.alive.all())

    @property
    def fresh_count(self) -> int:
        """Items served from fresh rows."""
        return int(self.alive.sum())

    @property
    def size(self) -> int:
        """What compaction folds: fresh rows (dead ones too) and tombstones."""
        return self.n + int(self.tombstones.numel())

    def live_items(self, ntotal: int) -> int:
        """Items the index serves, its main index holding ``ntotal``."""
        return ntotal - int(self.tombstones.numel()) + self.fresh_count

    def locate(self, t: IndexTensors, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Where items ``ids [m]`` are served -> ``(main rows [m], fresh rows [m])``, ``-1``
        where not there (an item is served from one of them at most)."""
        ids = ids.cpu()
        main = t.id_order.positions(ids).cpu() if t.ntotal else torch.full_like(ids, -1)
        tomb = self.tombstones.cpu()
        if tomb.numel():
            main = torch.where(torch.isin(ids, tomb), torch.full_like(main, -1), main)
        alive = self.alive.cpu()
        rows = [self.store.row_of.get(i, -1) for i in ids.tolist()]
        fresh = torch.tensor([r if 0 <= r < self.n and bool(alive[r]) else -1 for r in rows])
        return main, fresh.long().view(-1)

    # ---- updates (each -> a new segment) --------------------------------------------------
    def _writable(self) -> FreshStore:
        """This segment's store when it claimed the store's last row, else a copy of its rows."""
        if self.n == self.store.length:
            return self.store
        return self.store.copy_of(self.n, self.alive)

    def _after(
        self,
        t: IndexTensors,
        ids: torch.Tensor,
        new_vectors: torch.Tensor | None,
        new_sig: torch.Tensor | None,
    ) -> LiveSegment:
        """Items ``ids [m]`` leave where they are served; with ``new_vectors [m, D]`` and
        ``new_sig [m, W]`` they come back as fresh rows."""
        main, fresh = self.locate(t, ids)
        dev = self.alive.device
        with self.store.lock:
            store = self._writable()
            alive = self.alive.clone()
            alive[fresh[fresh >= 0].to(dev)] = False
            n = self.n
            if new_vectors is not None and new_sig is not None:
                store.claim(n, ids, new_vectors, new_sig, _lists_of(t, new_vectors))
                n = store.length
                alive = torch.cat([alive, torch.ones(ids.numel(), dtype=torch.bool, device=dev)])
        at = main >= 0  # main items no longer served from their row
        tomb = torch.cat([self.tombstones, ids.cpu()[at].to(dev)]).sort().values
        rows = torch.cat([self.tomb_rows, main[at].to(dev)]).sort().values
        return LiveSegment(store, n, alive, tomb, rows)

    def upserted(
        self, t: IndexTensors, ids: torch.Tensor, vectors: torch.Tensor, sig: torch.Tensor
    ) -> LiveSegment:
        """Items ``ids [m]`` (distinct) with vectors ``[m, D]`` (as given: scored inside) and
        signatures ``[m, W]``: new ones, or replacing the items' current state."""
        x = vectors.detach().float()
        if t.config.metric == "cosine":
            x = torch.nn.functional.normalize(x, dim=1)
        if t.exact.shape[0]:  # scored as the exact copy would hold them
            x = x.to(t.exact.dtype).float()
        return self._after(t, ids, x, sig)

    def removed(self, t: IndexTensors, ids: torch.Tensor) -> LiveSegment:
        """Items ``ids [m]`` (each served: the caller checked) no longer served."""
        return self._after(t, ids, None, None)

    def relabeled(self, t: IndexTensors, ids: torch.Tensor, sig: torch.Tensor) -> LiveSegment:
        """Items ``ids [m]`` (each served) with signatures ``sig [m, W]``, vectors kept: a main
        item moves to a fresh row (the main index's postings stay true for what it serves)."""
        return self._after(t, ids, self.vectors_of(t, ids), sig)

    def vectors_of(self, t: IndexTensors, ids: torch.Tensor) -> torch.Tensor:
        """Vectors ``[m, D]`` of served items ``ids [m]``, as scored (the main index's from its
        exact copy, else decoded from its codes)."""
        main, fresh = self.locate(t, ids)
        out = torch.zeros(ids.numel(), t.centroids.shape[1], device=self.vectors.device)
        at = main >= 0
        if bool(at.any()):
            pos = main[at].to(t.device)
            out[at.to(out.device)] = main_vectors_at(t, pos).to(out.device)
        at = fresh >= 0
        if bool(at.any()):
            out[at.to(out.device)] = self.vectors[fresh[at].to(out.device)]
        return out

    def signatures_of(self, t: IndexTensors, ids: torch.Tensor) -> torch.Tensor:
        """Current signatures ``[m, W] int64`` (CPU) of served items ``ids [m]``."""
        main, fresh = self.locate(t, ids)
        out = torch.zeros(ids.numel(), t.lists.sig.shape[1], dtype=torch.int64)
        at = main >= 0
        out[at] = t.lists.sig.cpu()[main[at]]
        at = fresh >= 0
        out[at] = self.sig.cpu()[fresh[at]]
        return out

    # ---- search ---------------------------------------------------------------------------
    def excluding_tombstones(
        self, t: IndexTensors, fb: FilterBatch | None, b: int
    ) -> FilterBatch | None:
        """``fb`` (None: no clause) as the main index's scan takes it: each row's excluded
        items as main rows with the tombstones' among them (:class:`ExcludedRows`); ``fb``
        itself when there are none."""
        tomb = self.tomb_rows
        if not tomb.numel():
            return fb
        dev = tomb.device
        if fb is None:
            empty = torch.empty((b, 0), dtype=torch.bool, device=dev)
            fb = FilterBatch(
                torch.empty((b, 0, t.lists.sig.shape[1]), dtype=torch.int64, device=dev), empty
            )
        if fb.exclude is None or not fb.exclude.shape[1]:
            excl = tomb.expand(b, -1)  # one sorted row for all: a view
        else:
            seen = excluded_positions(t.id_order, fb.exclude).to(dev)  # [B, S], PAD padded
            excl = torch.cat([seen, tomb.expand(b, -1)], dim=1).sort(dim=1).values
        return ExcludedRows(fb.masks, fb.negate, excl, fb.neg_masks, fb.verify)

    def candidates(
        self, q: torch.Tensor, fb: FilterBatch | None, width: int, base: int
    ) -> Candidates:
        """The fresh rows' exact top-``width`` for ``q [B, D]`` (as scored) under ``fb``'s
        filter and exclusions (None: none) -> ``[B, min(width, n)]``, keys ``base + row``
        (``-1`` / ``-inf`` padded). Torch ops only: a GPU's stay on the device."""
        scores = q.float() @ self.vectors.T  # [B, n]
        ok: torch.Tensor | None = None if self.all_alive else self.alive.expand_as(scores)
        if fb is not None:
            if fb.masks.shape[1]:
                hit = eligible(self.sig, fb.masks, fb.negate, fb.neg_masks)  # [B, n]
                ok = hit if ok is None else ok & hit
            if fb.verify is not None:  # a relabeled item's tags came with its signature
                rows = torch.arange(self.n, device=scores.device)
                v, keys = fb.verify, self.value_keys
                hit = eligible(extended(keys, rows, self.sig, v), v.masks, v.negate, v.neg_masks)
                hit = hit | ~v.rows[:, None]
                ok = hit if ok is None else ok & hit
            if fb.exclude is not None and fb.exclude.shape[1]:
                seen = fb.exclude.sort(dim=1).values.contiguous()  # [B, S]
                ids = self.ids.expand_as(scores).contiguous()
                at = torch.searchsorted(seen, ids).clamp(max=seen.shape[1] - 1)
                fresh = seen.gather(1, at) != ids
                ok = fresh if ok is None else ok & fresh
        if ok is not None:
            scores = scores.masked_fill(~ok, NEG_INF)
        if self.n <= width:  # every row is a candidate: the merge's own top-K orders them
            idx = torch.arange(self.n, device=scores.device).expand_as(scores)
            top = scores
        else:
            top, idx = topk_rows(scores, width)  # the CPU's heap: k << n
        keys = torch.where(top > NEG_INF, idx + base, torch.full_like(idx, -1))
        return Candidates(keys, top, top)

    def by_id(self, c: Candidates, base: int, with_vectors: bool, dim: int) -> Candidates:
        """Fresh candidates (keys ``base + row``) keyed by item id, with their vectors
        ``[B, w, D]`` when ``with_vectors``."""
        row = (c.keys - base).clamp(min=0)
        ids = torch.where(c.keys >= 0, self.ids[row], c.keys)
        vecs = None
        if with_vectors:
            vecs = self.vectors[row.flatten()].view(*row.shape, dim)
            vecs = vecs.masked_fill((c.keys < 0).unsqueeze(-1), 0.0)
        return Candidates(ids, c.approx, c.scores, vecs)

    def ids_at(self, t: IndexTensors, pos: torch.Tensor) -> torch.Tensor:
        """Positions ``[B, k]`` (main rows, then ``ntotal + fresh row``; ``-1`` pads) -> ids."""
        n = t.ntotal
        main = main_ids_at(t, torch.where(pos < n, pos, torch.full_like(pos, -1)))
        if not self.n:
            return main
        fresh = self.ids[(pos - n).clamp(0, self.n - 1)]
        return torch.where(pos >= n, fresh, main)

    def vectors_at(self, t: IndexTensors, pos: torch.Tensor) -> torch.Tensor:
        """Float vectors of positions ``pos [M]`` (main rows, then ``ntotal + fresh row``)."""
        n = t.ntotal
        main = main_vectors_at(t, pos.clamp(max=max(n - 1, 0)))
        if not self.n:
            return main
        fresh = self.vectors[(pos - n).clamp(0, self.n - 1)]
        return torch.where((pos >= n).unsqueeze(1), fresh.to(main.device), main)


def _lists_of(t: IndexTensors, x: torch.Tensor) -> torch.Tensor:
    """The list each of vectors ``x [m, D]`` (as scored) joins, by the build's rule."""
    if not t.nlist:
        return torch.zeros(x.shape[0], dtype=torch.int64)
    by = t.config.assign if t.config.assign != "auto" else "l2"
    return assign(x.cpu(), t.centroids.cpu(), by)


def merged(main: Candidates, fresh: Candidates | None) -> Candidates:
    """Main and fresh candidates side by side: the rounds' top-K (``search.select``) merges
    them as it merges a router's shards."""
    return main if fresh is None or not fresh.width else Candidates.concat([main, fresh])


def take_top_k(
    main: tuple[torch.Tensor, torch.Tensor], fresh: Candidates, k: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """One top-``k`` of a one-call backend's ``(ids [B, k], scores [B, k])`` and fresh
    candidates keyed by id ``[B, w]`` -> ``(ids [B, k], scores [B, k])``, best first."""
    ids = torch.cat([main[0], fresh.keys.to(main[0].device)], dim=1)
    scores = torch.cat([main[1], fresh.scores.to(main[1].device)], dim=1)
    top, idx = scores.topk(k, dim=1)
    ids = ids.gather(1, idx)
    return torch.where(top > NEG_INF, ids, torch.full_like(ids, -1)), top
