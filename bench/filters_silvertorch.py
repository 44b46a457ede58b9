"""``bench/filters.py``'s third part: our exact filter evaluation against SilverTorch's CPU Bloom
search (``torch.ops.st.bloom_index_search_batch``), on the workload shape of SilverTorch's own
benchmark: ``features`` multi-valued attributes of ``values`` values each, every document holding
``per_doc`` of them in each, queried with OR-groups (one attribute, ``per_doc`` values ORed)
ANDed together.

SilverTorch is not a dependency: it is used when ``import silvertorch`` works (or from a directory
given with ``--silvertorch-path``, holding a built checkout), and the part says so when it does
not. Its Bloom search returns candidates with false positives; for answers equal to ours they are
verified exactly against each document's value lists, and both the search and the search plus
verification are timed. Our side is the exact evaluation of the compiled clauses over every
signature (``filter_mask``, a bool mask like the Bloom search's) and the admitted positions
(``eligible_positions``).
"""

from __future__ import annotations

import importlib
import resource
import sys
from pathlib import Path
from typing import Any

import numpy as np
import torch
from timing import stopwatch

from retrieval.index import IVFConfig, build_ivf
from retrieval.index.eligible_scan import SLICES_AFTER, eligible_positions
from retrieval.index.scan import bit_slices_cpu, filter_mask, sliced_mask_cpu, sliced_rows_cpu


def load_silvertorch(path: Path | None) -> tuple[bool, str]:
    """Make ``torch.ops.st`` available -> ``(loaded, why not / where from)``."""
    if path is not None:
        sys.path.insert(0, str(path))
    try:
        importlib.import_module("silvertorch.ops._load_ops")
    except Exception as e:  # not installed, or built against another torch
        return False, f"silvertorch not importable ({type(e).__name__}: {e})"
    mod = sys.modules["silvertorch.ops._load_ops"]
    return True, str(Path(mod.__file__ or "").parent.parent)


def documents(n: int, features: int, values: int, per_doc: int, seed: int = 12345) -> np.ndarray:
    """Each document's values: ``[n, features, per_doc]`` int8 in ``[0, values)``, ascending,
    distinct within a feature (generated in chunks: a full ``[n, F, V]`` float array is large;
    int8, as 10M documents' value lists in int64 would be 4 GB)."""
    assert values <= 127
    rng = np.random.default_rng(seed)
    out = np.empty((n, features, per_doc), dtype=np.int8)
    for s in range(0, n, 100_000):
        e = min(n, s + 100_000)
        r = rng.random((e - s, features, values), dtype=np.float32)
        out[s:e] = np.sort(np.argsort(r, axis=-1)[..., :per_doc], axis=-1)
    return out


BUNDLE_DOCS = 32 * 64
"""Documents in one of SilverTorch's Bloom column bundles (32 columns of 64): bundles are sized
and filled from their own documents alone, so an index built a whole number of bundles at a
time and concatenated is the index built at once."""


def bloom_index(
    docs: np.ndarray, b_multiplier: float, hash_k: int, chunk: int = 100 * BUNDLE_DOCS
) -> tuple[torch.Tensor, torch.Tensor]:
    """SilverTorch's Bloom index of ``docs [N, F, per_doc]`` -> ``(bloom [*] int64, bundle
    offsets [N / 2048 + 1] int64)``, built ``chunk`` documents at a time (its build takes the
    values as int64 with their offsets: 96 bytes a value held at once, 4.8 GB at 10M)."""
    assert chunk % BUNDLE_DOCS == 0
    n, features, per_doc = docs.shape
    feature_ids = torch.arange(1, features + 1, dtype=torch.int32)
    blooms, bundles, base = [], [torch.zeros(1, dtype=torch.int64)], 0
    for s in range(0, n, chunk):
        part = torch.from_numpy(docs[s : s + chunk].reshape(-1)).long() + 1  # its values from 1
        offsets = torch.arange(0, part.numel() + 1, per_doc, dtype=torch.int64)
        bloom, bundle = torch.ops.st.bloom_index_build(
            feature_ids, offsets, part, b_multiplier, hash_k
        )
        blooms.append(bloom)
        bundles.append(bundle[1:] + base)
        base += int(bundle[-1])
    return torch.cat(blooms), torch.cat(bundles)


def queries(
    groups: int, features: int, values: int, per_doc: int, seed: int = 12345, per_group: int = 0
) -> list[tuple[int, list[int]]]:
    """``groups`` OR-groups ``(feature, values)`` of ``per_group`` values (``per_doc`` by
    default), the features cycling as SilverTorch's benchmark cycles them."""
    rng = np.random.default_rng(seed + groups)
    m = per_group or per_doc
    return [(g % features, sorted(rng.permutation(values)[:m].tolist())) for g in range(groups)]


def present_values(docs: np.ndarray, values: int) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
    """``docs [N, F, per_doc]`` as our multi-valued attributes: ``f{i}`` -> ``[N, values]``
    bool, and their vocabularies ``v0 .. v{values - 1}``."""
    attrs: dict[str, np.ndarray] = {}
    for f in range(docs.shape[1]):
        present = np.zeros((docs.shape[0], values), dtype=bool)
        np.put_along_axis(present, docs[:, f, :].astype(np.int64), True, axis=1)
        attrs[f"f{f}"] = present
    vocab: dict[str, Any] = {f: [f"v{v}" for v in range(values)] for f in attrs}
    return attrs, vocab


def our_text(q: list[tuple[int, list[int]]]) -> str:
    return " and ".join(f"f{f} in {{{', '.join(f'v{v}' for v in vs)}}}" for f, vs in q)


def st_text(q: list[tuple[int, list[int]]]) -> str:
    """SilverTorch's syntax: ``feature:value`` (both from 1), ``OR`` inside a group, ``AND``."""
    return " AND ".join("(" + " OR ".join(f"{f + 1}:{v + 1}" for v in vs) + ")" for f, vs in q)


def reference(docs: np.ndarray, q: list[tuple[int, list[int]]]) -> np.ndarray:
    """Brute force over the value lists -> ``[M]`` admitted documents."""
    keep = np.ones(docs.shape[0], dtype=bool)
    for f, vs in q:
        keep &= np.isin(docs[:, f, :], vs).any(axis=1)
    return np.flatnonzero(keep)


def passes(
    vals: torch.Tensor, cand: torch.Tensor, q: list[tuple[int, list[int]]], values: int
) -> torch.Tensor:
    """Whether each candidate of ``cand [M]`` passes ``q`` -> ``[M]`` bool, read from the value
    lists ``vals [N, F, per_doc]``: each group a lookup table of its values."""
    rows = vals.index_select(0, cand)  # [M, F, per_doc]
    keep = torch.ones(cand.numel(), dtype=torch.bool)
    for f, vs in q:
        lut = torch.zeros(values, dtype=torch.bool)
        lut[vs] = True
        keep &= lut[rows[:, f].int()].any(dim=1)  # int8 values: widened to index
    return keep


def verify(
    vals: torch.Tensor, cand: torch.Tensor, q: list[tuple[int, list[int]]], values: int
) -> torch.Tensor:
    """The candidates ``cand [M]`` that pass ``q`` (:func:`passes`)."""
    return cand[passes(vals, cand, q, values)]


def compare(
    n: int,
    groups_list: list[int],
    rounds: int,
    in_turns: Any,
    features: int = 10,
    values: int = 10,
    per_doc: int = 5,
    b_multiplier: float = 2.0,
    hash_k: int = 5,
) -> dict[str, Any]:
    """Ms per query of each way at each OR-group count, admitted counts, false positives, bytes
    per document. Needs ``torch.ops.st`` loaded (:func:`load_silvertorch`)."""
    docs = documents(n, features, values, per_doc)
    attrs, vocab = present_values(docs, values)
    elapsed = stopwatch()
    build = build_ivf(
        torch.randn(n, 8),
        IVFConfig(nlist=16, measure_costs=False),
        item_attributes=attrs,
        attribute_values=vocab,
    )  # signatures and postings; the vectors do not matter here
    t = build.tensors()
    slices = bit_slices_cpu(t.lists.sig)  # held once, as the signatures are
    ours_s = elapsed()
    del attrs  # [N, V] bools a feature: 1 GB at 10M, read by the build only

    elapsed = stopwatch()
    bloom, bundle = bloom_index(docs, b_multiplier, hash_k)
    bloom_s = elapsed()
    vals = torch.from_numpy(docs)  # what its exact verification reads

    sig_bytes = t.lists.sig.numel() * 8
    post_bytes = t.postings.numel() * 4 + t.bit_counts.numel() * 8
    out: dict[str, Any] = {
        "items": n,
        "shape": {"features": features, "values": values, "per_doc": per_doc},
        "bloom": {"b_multiplier": b_multiplier, "hash_k": hash_k},
        "bytes_per_item": {
            "ours, signatures": sig_bytes / n,
            "ours, signatures + postings": (sig_bytes + post_bytes) / n,
            "ours, bit slices": slices.numel() * 8 / n,
            "silvertorch, bloom index": (bloom.numel() * bloom.element_size()) / n,
            "value lists (its exact verification)": vals.numel() * vals.element_size() / n,
        },
        "build_s": {"ours (signatures, postings, slices)": ours_s, "silvertorch bloom": bloom_s},
        "groups": {},
    }
    for groups in groups_list:
        q = queries(groups, features, values, per_doc)
        out["groups"][str(groups)] = one_query(
            q, build, slices, docs, values, (bloom, bundle), hash_k, rounds, in_turns
        )
    out["peak_rss_gib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    return out


def one_query(
    q: list[tuple[int, list[int]]],
    build: Any,
    slices: torch.Tensor,
    docs: np.ndarray,
    values: int,
    bloom_index: tuple[torch.Tensor, torch.Tensor],
    hash_k: int,
    rounds: int,
    in_turns: Any,
) -> dict[str, Any]:
    """One query ``q`` every way (``docs [N, F, per_doc]`` of ``values`` values each; the Bloom
    index ``(bloom, bundle offsets)``) -> ms, admitted counts, false positives, equal answers."""
    st = torch.ops.st
    t, item_ids = build.tensors(), build.item_ids.numpy()
    n = docs.shape[0]
    bloom, bundle = bloom_index
    vals = torch.from_numpy(docs)
    fb = build.compile_filter(our_text(q), 1)
    masks, negate = fb.masks[0], fb.negate[0]
    _, (plans, plan_off) = st.parse_expression_query_batch(
        [st_text(q)], torch.ones(1, dtype=torch.long), hash_k, True, 5
    )

    def bloom_mask() -> torch.Tensor:
        return st.bloom_index_search_batch(bloom, bundle, plans, plan_off, hash_k, hash_k, True)

    def bloom_verified() -> torch.Tensor:
        cand = bloom_mask()[0, :n].nonzero().flatten()
        return verify(vals, cand, q, values)

    ways = {
        "ours, sliced_mask (exact bool mask, bit slices, C++)": lambda: sliced_mask_cpu(
            slices, masks, negate, n
        ),
        "ours, sliced_rows (exact positions, bit slices, C++)": lambda: sliced_rows_cpu(
            slices, masks, negate, n
        ),
        "ours, filter_mask (exact bool mask, C++)": lambda: filter_mask(t.lists.sig, masks, negate),
        "ours, eligible_positions (exact positions, C++)": lambda: eligible_positions(
            t, masks, negate
        ),
        "silvertorch, bloom_index_search_batch (bool mask)": bloom_mask,
        "silvertorch, bloom search + exact verification (positions)": bloom_verified,
    }
    for _ in range(SLICES_AFTER):  # as a serving index is after a few dense filters: slices kept
        eligible_positions(t, masks, negate)
    truth = reference(docs, q)
    ours_ids = np.sort(item_ids[eligible_positions(t, masks, negate).numpy()])
    ours_mask_ids = np.sort(item_ids[filter_mask(t.lists.sig, masks, negate).numpy()])
    sliced_ids = np.sort(item_ids[sliced_rows_cpu(slices, masks, negate, n).numpy()])
    sliced_mask_ids = np.sort(item_ids[sliced_mask_cpu(slices, masks, negate, n).numpy()])
    cand = bloom_mask()[0, :n].nonzero().flatten().numpy()
    verified = np.sort(bloom_verified().numpy())
    ms = in_turns(ways, rounds)
    return {
        "clauses": int(masks.shape[0]),
        "selectivity": len(truth) / n,
        "ms": {k: v * 1e3 for k, v in ms.items()},
        "admitted": {
            "reference": len(truth),
            "ours": len(ours_ids),
            "silvertorch candidates": len(cand),
            "silvertorch verified": len(verified),
        },
        "false_positives": {
            "ours": len(np.setdiff1d(ours_ids, truth)),
            "silvertorch candidates": len(np.setdiff1d(cand, truth)),
        },
        "missed": {
            "ours": len(np.setdiff1d(truth, ours_ids)),
            "silvertorch": len(np.setdiff1d(truth, cand)),
        },
        "equal_answers": bool(
            np.array_equal(ours_ids, truth)
            and np.array_equal(ours_mask_ids, truth)
            and np.array_equal(sliced_ids, truth)
            and np.array_equal(sliced_mask_ids, truth)
            and np.array_equal(verified, truth)
        ),
    }


def render(r: dict[str, Any]) -> str:
    """The part as a markdown table."""
    s = r["shape"]
    lines = [
        f"Against SilverTorch's CPU Bloom search, {r['items']:,} documents of its benchmark's "
        f"shape ({s['features']} features x {s['values']} values, {s['per_doc']} a document); "
        "bytes per document: " + ", ".join(f"{k} {v:.0f}" for k, v in r["bytes_per_item"].items()),
        "| OR-groups | way | ms a query | admitted | false positives |",
        "|---|---|---|---|---|",
    ]
    for g, row in r["groups"].items():
        for way, ms in row["ms"].items():
            fp = (
                row["false_positives"]["silvertorch candidates"]
                if "bool mask" in way and way.startswith("silvertorch")
                else 0
            )
            adm = (
                row["admitted"]["silvertorch candidates"]
                if fp
                else row["admitted"]["ours" if way.startswith("ours") else "silvertorch verified"]
            )
            lines.append(f"| {g} | {way} | {ms:.2f} | {adm:,} | {fp:,} |")
    return "\n".join(lines)
