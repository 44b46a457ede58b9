"""``bench/filters.py``'s fourth part: filtered top-K end to end against SilverTorch's pipeline,
on the documents of its benchmark's shape (``filters_silvertorch.documents``) given vectors
(``ann_data.make_data``), every query of a batch sharing one filter, recall@K against the exact
filtered truth, q/s of each at the cheapest nprobe reaching the target.

* ours: ``build_ivf(x, item_attributes=..., attribute_values=...)``, then
  ``index.search(q, K, text, nprobe=p)``;
* SilverTorch, Bloom + fused int8 ANN: its Bloom search (``bloom_index_search_batch``) for the
  candidate mask, its fused ANN op (``fused_kmean_ann``: the probed lists' int8 documents
  scored, those the mask drops skipped), the top ``2K`` of its scores verified exactly against
  the documents' value lists, the first K kept (its mask has false positives);
* SilverTorch, Bloom + verification + exact scan: its candidates all verified, then the gather
  + matmul + ``topk`` scan of them (``EligibleScan``; recall 1 by construction).

SilverTorch has no k-means of its own (its op takes the lists as given), so its op reads our
index's lists: the same centroids and list order, probed by the same rule; its documents int8
with one scale for the catalog (int32 scores, its exact dp4a path: no half rounding). Its CPU op
is a reference loop (its GPU kernel is the production path); the q/s say what a CPU host gets.
"""

from __future__ import annotations

import resource
import sys
from typing import Any

import numpy as np
import torch
from ann_data import exact_topk, make_data
from ann_peers import EligibleScan
from filters_silvertorch import (
    bloom_index,
    documents,
    our_text,
    passes,
    present_values,
    reference,
    st_text,
    verify,
)
from timing import stopwatch

from retrieval.index import IVFConfig, build_ivf
from retrieval.index.eligible_scan import SLICES_AFTER

Query = list[tuple[int, list[int]]]


def pack_lsb(mask: torch.Tensor, n: int) -> torch.Tensor:
    """A bool mask ``[>= n]`` -> ``[1, ceil(n / 64)] int64``, document ``j`` at bit ``j % 64`` of
    word ``j // 64`` (its fused op's order; its Bloom search packs from the top bit)."""
    words = (n + 63) // 64
    m = torch.zeros(words * 64, dtype=torch.int64)
    m[:n] = mask[:n]
    shifts = torch.arange(64, dtype=torch.int64)
    return (m.view(words, 64) << shifts).sum(dim=1).unsqueeze(0)  # bit 63 wraps, as it should


class SilverTorchPipeline:
    """Its filtered search over our lists: Bloom mask -> fused int8 ANN -> top 2K verified.

    ``x [N, D] float32`` in catalog order, ``docs [N, F, per_doc] int8``; ``tensors`` our index's
    (centroids ``[L, D]``, offsets ``[L + 1]``, item ids ``[N]`` in list order)."""

    def __init__(
        self, x: np.ndarray, docs: np.ndarray, tensors: Any, probe: str, values: int
    ) -> None:
        self.order = tensors.item_ids  # list-order row -> catalog id
        self.offsets = tensors.lists.offsets
        self.sizes = self.offsets[1:] - self.offsets[:-1]
        self.centroids = tensors.centroids
        self.probe, self.values, self.n = probe, values, x.shape[0]
        xt = torch.from_numpy(x)
        self.scale = float(xt.abs().max()) / 127  # one scale: int32 scores, exact
        self.codes = torch.empty(x.shape, dtype=torch.int8)
        # in list order, a chunk at a time: a whole copy of 10M x 64 floats would be 2.5 GB
        for s in range(0, self.n, 1 << 20):
            rows = xt.index_select(0, self.order[s : s + (1 << 20)])
            self.codes[s : s + rows.shape[0]] = (rows / self.scale).round().clamp(-127, 127)
        docs_sorted = docs[self.order.numpy()]
        self.vals = torch.from_numpy(docs_sorted)  # value lists in list order, to verify
        self.bloom = bloom_index(docs_sorted, 2.0, 5)

    def search(self, q: torch.Tensor, k: int, query: Query, nprobe: int) -> np.ndarray:
        """``q [B, D]`` -> catalog ids ``[B, k]`` (-1 pads)."""
        st = torch.ops.st
        _, (plans, plan_off) = st.parse_expression_query_batch(
            [st_text(query)], torch.ones(1, dtype=torch.long), 5, True, 5
        )
        mask = st.bloom_index_search_batch(*self.bloom, plans, plan_off, 5, 5, True)[0]
        bits = pack_lsb(mask, self.n)  # [1, W]
        coarse = q @ self.centroids.T  # [B, L]
        if self.probe == "l2":
            coarse -= 0.5 * (self.centroids * self.centroids).sum(dim=1)
        ids = coarse.topk(nprobe, dim=1).indices  # [B, P]
        lengths = self.sizes[ids]
        q8 = (q / (q.abs().max() / 127)).round().clamp(-127, 127).to(torch.int8)
        scores, rows = st.fused_kmean_ann(
            self.offsets, ids, lengths, self.codes, q8, int(lengths.sum(dim=1).max()),
            bits, -1, -1, torch.zeros(q.shape[0], dtype=torch.int64),
        )  # fmt: skip
        top = scores.topk(min(2 * k, scores.shape[1]), dim=1).indices
        cand = rows.gather(1, top).long()  # [B, 2K] list-order rows, -1 pads
        return self.first_verified(cand, query, k)

    def first_verified(self, cand: torch.Tensor, query: Query, k: int) -> np.ndarray:
        """The first ``k`` of each row of ``cand [B, C]`` that pass ``query`` exactly -> catalog
        ids ``[B, k]``, in score order."""
        ok = (cand >= 0) & passes(
            self.vals, cand.clamp(min=0).flatten(), query, self.values
        ).view_as(cand)
        first = torch.sort((~ok).to(torch.int8), dim=1, stable=True).indices[:, :k]
        kept = cand.gather(1, first)
        out = torch.where(ok.gather(1, first), self.order[kept.clamp(min=0)], -1)
        return out.numpy()


def top_k(
    n: int,
    d: int,
    n_queries: int,
    k: int,
    nlist: int,
    target: float,
    sweep: Any,
    best: Any,
    in_turns: Any,
    rounds: int,
    filters: dict[str, Query],
    features: int = 10,
    values: int = 10,
    per_doc: int = 5,
) -> dict[str, Any]:
    """Each filter of ``filters``: recall and q/s of ours and SilverTorch's two ways, sweeps
    (``sweep(fn, truth, settings, target)``) then the chosen settings timed in turns; the
    builds' seconds and the process's peak memory. Progress goes to stderr (a 10M build is
    minutes)."""
    wall = stopwatch()

    def progress(what: str) -> None:
        rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
        print(f"[st top-k {wall():6.0f} s, peak {rss:.1f} GiB] {what}", file=sys.stderr, flush=True)

    data = make_data(n, d, n_queries)
    docs = documents(n, features, values, per_doc)
    attrs, vocab = present_values(docs, values)
    progress(f"data: {n:,} x {d} vectors, documents")
    elapsed = stopwatch()
    index = build_ivf(
        torch.from_numpy(data.x),
        IVFConfig(nlist=nlist),
        item_attributes=attrs,
        attribute_values=vocab,
    )
    build_s = {"ours": elapsed()}
    del attrs  # [N, V] bools a feature: 1 GB at 10M, read by the build only
    progress(f"our index built in {build_s['ours']:.0f} s")
    q = torch.from_numpy(data.q)
    elapsed = stopwatch()
    pipeline = SilverTorchPipeline(data.x, docs, index.tensors(), index.config.probe, values)
    build_s["silvertorch (int8 codes, Bloom index)"] = st_s = elapsed()
    progress(f"its int8 codes and Bloom index built in {st_s:.0f} s")
    scan = EligibleScan(torch.from_numpy(data.x))
    probes = [2**i for i in range(12) if 2**i <= nlist]
    out: dict[str, Any] = {
        "items": n, "dim": d, "nlist": nlist, "k": k, "queries": n_queries,
        "probe": index.config.probe, "build_s": build_s, "filters": {},
    }  # fmt: skip
    for name, query in filters.items():
        text = our_text(query)
        truth = exact_topk(data.x, data.q, k, reference(docs, query))
        progress(f"{name}: exact truth")
        for _ in range(SLICES_AFTER):  # as a serving index is after a few dense filters
            index.search(q, k, text, nprobe=1)

        def bloom_scan(_: int, query: Query = query) -> np.ndarray:
            st = torch.ops.st
            _, (plans, off) = st.parse_expression_query_batch(
                [st_text(query)], torch.ones(1, dtype=torch.long), 5, True, 5
            )
            mask = st.bloom_index_search_batch(*pipeline.bloom, plans, off, 5, 5, True)[0]
            rows = mask[: pipeline.n].nonzero().flatten()
            # the mask is over list order: verified rows back to catalog ids
            ids = pipeline.order[verify(pipeline.vals, rows, query, values)]
            return scan.search(q, k, ids)

        systems = {
            "ours": (lambda p, text=text: index.search(q, k, text, nprobe=p)[0].numpy(), probes),
            "silvertorch, Bloom + fused int8 ANN + top-2K verified": (
                lambda p, query=query: pipeline.search(q, k, query, p),
                probes,
            ),
            "silvertorch, Bloom + verification + exact scan": (bloom_scan, [0]),
        }
        points = {}
        for s, (fn, ps) in systems.items():
            points[s] = sweep(fn, truth, ps, target)
            progress(f"{name}: {s} swept, {points[s][-1]}")
        chosen = {s: best(points[s], target) for s in systems}
        fns = {s: (lambda fn=systems[s][0], c=c: fn(c["nprobe"])) for s, c in chosen.items() if c}
        out["filters"][name] = {
            "text": text,
            "selectivity": float(len(reference(docs, query)) / n),
            "points": points,
            "turns_qps": {s: n_queries / t for s, t in in_turns(fns, rounds).items()},
        }
        progress(f"{name}: turns {out['filters'][name]['turns_qps']}")
    out["peak_rss_gib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    return out


def render(r: dict[str, Any], target: float) -> str:
    """The part as a markdown table."""
    lines = [
        f"Filtered top-{r['k']} against SilverTorch, {r['items']:,} x {r['dim']} documents of its "
        f"benchmark's shape, {r['queries']} queries a batch sharing the filter, nlist "
        f"{r['nlist']}; cheapest setting reaching recall {target}",
        "| filter | pass | system | nprobe | recall | q/s (median of the turns) |",
        "|---|---|---|---|---|---|",
    ]
    for name, f in r["filters"].items():
        for system, pts in f["points"].items():
            reached = [p for p in pts if p["recall"] >= target]
            b = max(reached, key=lambda p: p["qps"]) if reached else None
            qps = f["turns_qps"].get(system)
            cells = "not reached | |" if b is None else f"{b['nprobe']} | {b['recall']:.3f} |"
            lines.append(
                f"| {name} | {100 * f['selectivity']:.1f} % | {system} | {cells} "
                f"{'' if qps is None else f'{qps:,.0f}'} |"
            )
    return "\n".join(lines)
