"""A search plan as data: per query row, its kind and its parameters, as tensors with named fields.

The planner (``planner.py``) makes a :class:`SearchPlan` from the index's statistics, the batch's
filters and the :class:`SearchParams` of the search; the executor (``executor.py``) runs any plan,
locally or through a router's shards (``search.run_search`` takes the candidates of either). The
plan says what each row does, never how a backend does it:

==================  ==========================================================================
``RowKind``         what row b does
==================  ==========================================================================
``PLAIN``           no filter clause, no recall target: its best lists until they hold what
                    it needs (``least`` / ``hold``), re-ranked when ``r > k``; a row left
                    short widens, then scans exactly
``LISTS``           a planned list row: ``nprobe`` lists (or the planner's ``lists``), maybe a
                    bound check asking for a second round (``check``), a re-rank (``r > k``)
``SHARED_EXACT``    an exact scan of its eligible items, the whole batch sharing one filter
                    and excluding nothing (a backend may answer the batch in one call)
``EXACT``           an exact scan of its eligible items
==================  ==========================================================================
"""

from __future__ import annotations

from dataclasses import InitVar, dataclass, field, replace
from enum import IntEnum
from functools import cached_property

import torch

from retrieval.index.scan import second_round_cpu


class RowKind(IntEnum):
    """What a plan's row does (``SearchPlan.kind [B] int8``). Exact kinds are odd, so a row's
    exactness is its low bit (and a plan sent as exact flags decodes to ``LISTS`` / ``EXACT``)."""

    LISTS = 0
    EXACT = 1
    PLAIN = 2
    SHARED_EXACT = 3


def kinds(exact: torch.Tensor, listed: RowKind = RowKind.LISTS) -> torch.Tensor:
    """``[B] int8`` kinds of rows that scan exactly where ``exact [B] bool``, else ``listed``."""
    out = torch.full(exact.shape, int(listed), dtype=torch.int8, device=exact.device)
    return out.masked_fill_(exact, int(RowKind.EXACT))


def every(b: int, kind: RowKind) -> torch.Tensor:
    """``[b] int8``: every row of one kind."""
    return torch.full((b,), int(kind), dtype=torch.int8)


@dataclass(frozen=True, slots=True)
class SearchParams:
    """The settings of one search, bundled once and passed unchanged to the planner.

    ``k`` results a row, ``nprobe`` the fewest lists a row probes, ``rerank`` candidates
    re-scored with the exact copy (0: none), ``exact`` every row scanned exactly (the
    reference), ``target [B] float32`` each row's recall target (0: the index's settings;
    None: none asks)."""

    k: int
    nprobe: int
    rerank: int = 0
    exact: bool = False
    target: torch.Tensor | None = None

    @property
    def targeted(self) -> bool:
        """Some row asks for a recall target."""
        return self.target is not None and bool(self.target.gt(0).any())


@dataclass(frozen=True)
class BoundCheck:
    """What a plan needs to decide, after its first round, which rows probe more lists.

    ``bounds [B, nlist] float32``: the best score an eligible item of each list could reach
    (``-inf``: probed in the first round, or holding no item the row's filter admits, or a row
    without a check). ``sizes [nlist] int64``: items per list. ``budget [B] float32``: codes a
    second round may scan before the exact scan of the row's eligible items costs less.
    """

    bounds: torch.Tensor
    sizes: torch.Tensor
    budget: torch.Tensor

    def rows(self, rows: torch.Tensor) -> BoundCheck:
        return replace(self, bounds=self.bounds[rows], budget=self.budget[rows])

    def second_round(self, kth: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``kth [B]``: each row's K-th best score after the first round -> ``(todo [B] bool``:
        rows some list could still improve, ``exact [B] bool``: those better scanned exactly,
        ``lists [B, P] int64``: the lists the others probe, ``-1`` padded)."""
        if self.bounds.device.type == "cpu":  # one C++ pass a row, not a dozen [B, L] torch ops
            return second_round_cpu(self.bounds, kth.cpu(), self.sizes.cpu(), self.budget.cpu())
        return self.second_round_torch(kth)

    def second_round_torch(
        self, kth: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """:meth:`second_round` in torch ops (a GPU's; the CPU's C++ pass gives the same)."""
        need = self.bounds > kth.to(self.bounds.device)[:, None]  # [B, nlist]
        count = need.sum(dim=1)
        todo = count > 0
        codes = (need.long() * self.sizes.to(need.device)).sum(dim=1).float()
        exact = todo & (codes > self.budget.to(need.device))
        p = int(count[todo & ~exact].max()) if bool((todo & ~exact).any()) else 1
        # needed lists first, by list index: the p smallest of (index, or nlist + index where not
        # needed); a top-p, not a stable sort of every [B, nlist] entry
        nlist = need.shape[1]
        idx = torch.arange(nlist, device=need.device)
        key = torch.where(need, idx, idx + nlist)
        order = torch.topk(key, min(p, nlist), dim=1, largest=False, sorted=True).indices
        slot = torch.arange(order.shape[1], device=need.device)
        lists = torch.where(slot < count[:, None], order, torch.full_like(order, -1))
        return todo, exact, lists


@dataclass(frozen=True)
class SearchPlan:
    """What every index (or shard) does for each of B query rows."""

    k: int
    """Results wanted per row."""
    r: int
    """Approximate candidates kept before re-ranking by exact score (``k`` without re-rank)."""
    nprobe: torch.Tensor
    """``[B] int64``: lists each row probes."""
    kind: torch.Tensor
    """``[B] int8``: what each row does (:class:`RowKind`)."""
    lists: torch.Tensor | None = None
    """``[B, P] int64``: when given, the lists each row probes (``-1`` skips a slot) instead of
    its best ``nprobe``, as the planner chose them (a filtered row skips the lists its filter
    rules out; a second round probes what the bound check asks for). Sent to the shards."""
    check: BoundCheck | None = None
    """Bounds on the lists the first round leaves out (the planner's alone: never sent)."""
    floor: torch.Tensor | None = None
    """``[B] float32``: a second round's K-th score so far; candidates below it cannot change
    the answer, and a scan may leave them out. Sent to the shards."""
    least: torch.Tensor | None = None
    """``[B] int64``: when given (with ``hold``), row b probes its best lists in order until
    they hold ``hold[b]`` items by the index's list sizes as built, at least ``least[b]`` (its
    nprobe) and at most ``nprobe[b]`` (``probe.lists_holding``): ``nprobe[b]`` is then a
    count from the average list. Sent to the shards."""
    hold: torch.Tensor | None = None
    """``[B] int64``: items row b's lists must hold (``planner.FILL`` times its ``r`` plus the
    items it excludes)."""
    exact: torch.Tensor = field(init=False)
    """``[B] bool``: rows scanned exactly over their eligible items (an exact kind)."""
    exact_rows: InitVar[torch.Tensor | None] = None
    """``exact`` where the caller has it already (else read off ``kind``)."""

    def __post_init__(self, exact_rows: torch.Tensor | None) -> None:
        exact = self.kind.bitwise_and(1).bool() if exact_rows is None else exact_rows
        object.__setattr__(self, "exact", exact)

    def rows(self, rows: torch.Tensor) -> SearchPlan:
        """The plan of a subset of rows (``rows [b] int64``)."""
        return replace(
            self,
            nprobe=self.nprobe[rows],
            kind=self.kind[rows],
            exact_rows=self.exact[rows],
            lists=None if self.lists is None else self.lists[rows],
            check=None if self.check is None else self.check.rows(rows),
            floor=None if self.floor is None else self.floor[rows],
            least=None if self.least is None else self.least[rows],
            hold=None if self.hold is None else self.hold[rows],
        )

    def all_exact(self) -> SearchPlan:
        """The same rows, each scanned exactly."""
        exact = torch.full_like(self.kind, int(RowKind.EXACT))
        rows = torch.ones_like(self.exact)
        return replace(self, kind=exact, exact_rows=rows, lists=None, check=None, floor=None)

    @property
    def reranks(self) -> bool:
        """Re-ranked: candidates carry exact scores that differ from their approximate ones."""
        return self.r > self.k

    @cached_property
    def one_kind(self) -> RowKind | None:
        """The kind of every row, where all rows share one; None otherwise (a mixed batch, or
        no rows). Read on the host once per plan (NumPy), as the backends choose by it."""
        kind = self.kind.numpy()
        if not kind.size or not (kind == kind[0]).all():
            return None
        return RowKind(int(kind[0]))

    @cached_property
    def one_list_count(self) -> tuple[int, int] | None:
        """``(lists, least)`` where every row probes its best ``lists`` lists and keeps, by their
        sizes as built, at least ``least`` of them (``least == lists``: all): no exact row, no
        planner's lists, no re-rank. None otherwise. A few host reads (NumPy: no torch op),
        what a one-call backend needs to know before it runs, made once per plan."""
        if self.lists is not None or self.reranks:
            return None
        kind, nprobe = self.kind.numpy(), self.nprobe.numpy()
        if (kind & 1).any() or not (nprobe == nprobe[0]).all():
            return None
        least = int(nprobe[0])
        if self.least is not None and self.hold is not None:
            fewest = self.least.numpy()
            if not (fewest == fewest[0]).all():
                return None
            least = int(fewest[0])
        return int(nprobe[0]), least
