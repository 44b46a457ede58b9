"""Choosing the lists a query probes, and re-scoring candidates with the exact copy.

The build assigns every item to its nearest centroid by L2 distance (k-means' own rule, which
keeps residuals, and so code errors, small). A query ranks the lists it probes by one of:

* ``"l2"``, the assignment's own rule: nearest centroid,
  ``||q - c||^2 = ||q||^2 - 2 q·c + ||c||^2``, so lists rank by ``q·c - ||c||^2 / 2``
  (``||q||^2`` is the same for every list of a query);
* ``"ip"``: largest ``q·c``.

For unit-norm vectors (cosine, normalised embeddings) a centroid's norm shrinks as its cluster
spreads (about ``sqrt(1 - spread^2)``), so ``-||c||^2 / 2`` credits the wide clusters whose items
reach furthest towards the query, which ``q·c`` alone under-rates: "l2" holds more of the true
top-K at equal nprobe there (``tests/retrieval/index/test_metric.py``; the figure on real 784-d
embeddings is in ``bench/RESULTS.md``). For vectors of any norm (maximum inner product) the norm
penalty points the wrong way, against the long vectors whose inner products are largest: on
the benchmark's clustered data "l2" holds 0.987 of the top-100 at nprobe 32 against "ip"'s
0.994. Hence ``IVFConfig.probe = "auto"``: "l2" when the build's vectors are unit-norm, else "ip".

The scan adds ``q·c`` (not the probe key) to every residual score, so an item's approximate
score estimates ``q·x`` whichever rule chose its list.
"""

from __future__ import annotations

import torch

from retrieval.index.scan import ProbeTable, probe_cpu, topk_rows

FEW_QUERIES = 16
"""Batches up to this many queries probe through the C++ call (:func:`probe_lists`)."""

RESCORE_FLOATS = 1 << 22
"""Float elements of the ``[b, r, D]`` temporary a re-rank builds per chunk of query rows
(16 MiB), so its memory stays bounded whatever the batch and ``r`` (it was a full ``[B, r, D]``:
0.37 GB at B = 1000, r = 200, D = 784)."""


def half_sq_norms(centroids: torch.Tensor) -> torch.Tensor:
    """``centroids [nlist, D]`` -> ``||c||^2 / 2`` as ``[nlist] float32``."""
    return 0.5 * centroids.float().pow(2).sum(dim=1)


def probe_lists(
    q: torch.Tensor,
    centroids: torch.Tensor,
    half_norms: torch.Tensor | None,
    nprobe: int,
    centroids_t: torch.Tensor | None = None,
    table: ProbeTable | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``nprobe`` best lists of each query -> ``(coarse [B, P] float32 = q·c of each probed
    list, lists [B, P] int64)``, best first. ``q [B, D] float32``; ``half_norms [nlist]`` from
    :func:`half_sq_norms` ranks by L2 ("l2"), None by ``q·c`` ("ip"); ``nprobe <= nlist``.
    A few queries on the CPU: one C++ call over ``centroids_t [D, nlist]`` (the transposed
    centroids; made when not given), where a matmul and a top-k would each cost more in dispatch than the work;
    larger batches: the matmul (blocked: it reads the centroids once for many queries).
    ``table``: ``scan.probe_table_cpu`` of ``centroids_t``, read first by a few queries' probe."""
    small = q.shape[0] <= FEW_QUERIES
    if small and q.device.type == "cpu" and centroids.dtype == q.dtype == torch.float32:
        ct = centroids.T.contiguous() if centroids_t is None else centroids_t
        return probe_cpu(q.contiguous(), ct, half_norms, nprobe, table)
    ip = q @ centroids.T  # [B, nlist]
    if half_norms is None:
        return topk_rows(ip, nprobe)
    _, lists = topk_rows(ip - half_norms, nprobe)  # [B, P]: nearest by L2
    return ip.gather(1, lists), lists


def lists_holding(
    lists: torch.Tensor, sizes: torch.Tensor, least: torch.Tensor | int, hold: torch.Tensor
) -> torch.Tensor:
    """Each row's best lists, in order, until they hold ``hold[b]`` items, and at least
    ``least[b]`` of them: ``lists [B, P] int64`` best first (``-1`` skips a slot), ``sizes
    [nlist]`` items per list, ``least`` (``[B] int64``, or one for every row), ``hold [B] int64``
    -> ``[B, P]``, the slots past that ``-1``. A plan's "lists to hold ``FILL`` need items"
    (``planner.lists_for``) counts lists of average size; a query's nearest lists are often
    larger, and then it probes fewer (``bench/RESULTS.md``). The CPU's one-call search applies
    the same rule in C++ (``csrc/ivf_scan.cpp``)."""
    real = lists >= 0
    held = torch.where(real, sizes[lists.clamp(min=0)], torch.zeros_like(lists))  # [B, P]
    before = held.cumsum(1) - held  # items in the slots ahead of each
    slot = torch.arange(lists.shape[1], device=lists.device)
    fewest = least if isinstance(least, int) else least.to(lists.device)[:, None]
    keep = (slot < fewest) | (before < hold.to(lists.device)[:, None])
    return torch.where(keep, lists, torch.full_like(lists, -1))


def unit_norm(x: torch.Tensor, tol: float = 1e-3) -> bool:
    """Every row of ``x [N, D]`` has L2 norm 1 within ``tol`` (what ``probe = "auto"`` asks)."""
    return bool(((x.float().norm(dim=1) - 1.0).abs() <= tol).all())


def rescore(
    q: torch.Tensor, cand: torch.Tensor, exact: torch.Tensor, max_floats: int = RESCORE_FLOATS
) -> torch.Tensor:
    """Exact scores of candidates: ``q [B, D] float32``, ``cand [B, r] int64`` positions (``-1``
    pads), ``exact [N, D] f16|f32`` -> ``[B, r] float32`` (``-inf`` at pads).

    Query rows go in chunks so that the float ``[b, r, D]`` gather stays under ``max_floats``
    elements (at least one row a chunk).
    """
    b, r = cand.shape
    out = torch.empty(b, r, device=q.device)
    step = max(1, max_floats // max(1, r * q.shape[1]))
    for s in range(0, b, step):
        c = cand[s : s + step]
        vecs = exact[c.clamp(min=0)].float()  # [b', r, D], bounded by the chunk
        out[s : s + step] = torch.bmm(vecs, q[s : s + step].unsqueeze(-1)).squeeze(-1)
    return out.masked_fill(cand < 0, float("-inf"))
