"""Markdown tables of ``bench/quality.py``'s results: per dataset, the model's variants per table
optimizer, then the model beside the baselines (popularity, item-kNN, EASE) on every metric."""

from __future__ import annotations

from typing import Any

FLOAT_IVF = "float tables, IVF INT8 codes"
INT8_IVF = "INT8 tables, IVF INT8 codes"
EXACT = "float tables, exact search"
WINDOW = "history window excluded only"
ROUTED = "float tables, routed over 2 document shards"
OURS = (FLOAT_IVF, INT8_IVF, EXACT, ROUTED)
"""The model's rows in the comparison with the baselines."""


def markdown(result: dict[str, Any], k: int) -> str:
    """One dataset: the variants table, the comparison with the baselines, the notes."""
    return "\n".join(
        [variants_table(result, k), "", comparison_table(result, k), "", notes(result, k)]
    )


def variants_table(result: dict[str, Any], k: int) -> str:
    """A row per variant, recall and NDCG per table optimizer (means over seeds)."""
    models = result["models"]
    opts = list(models)
    head = " | ".join(f"recall@{k}, {o} | NDCG@{k}, {o}" for o in opts)
    lines = [
        f"**{result['dataset']}** ({result['users']} users, {result['items']} items; "
        f"{result['eval_users']} held-out users)",
        "",
        f"| variant | {head} |",
        "|---|" + "---|---|" * len(opts),
    ]
    for label in models[opts[0]]["rows"]:
        cells = " | ".join(
            f"{models[o]['rows'][label]['recall']:.4f} | {models[o]['rows'][label]['ndcg']:.4f}"
            for o in opts
        )
        lines.append(f"| {label} | {cells} |")
    return "\n".join(lines)


def comparison_table(result: dict[str, Any], k: int) -> str:
    """The baselines and the model's main rows: recall/NDCG at 10 and K, coverage@K, and
    recall@K when only the history window is excluded."""
    lines = [
        f"| method | recall@10 | recall@{k} | NDCG@10 | NDCG@{k} | coverage@{k} | "
        f"recall@{k}, {WINDOW} |",
        "|---|---|---|---|---|---|---|",
    ]
    tuning = result["baseline_tuning"]
    for name, modes in result["baselines"].items():
        setting = {
            kk: v for kk, v in tuning.get(name, {}).items() if kk in ("lambda", "neighbours")
        }
        label = name + "".join(f" ({kk} {v:g})" for kk, v in setting.items())
        lines.append(_row(label, modes["full"], modes["window"]))
    for name, info in tuning.items():
        if "skipped" in info:
            lines.append(f"| {name} | skipped: {info['skipped']} | | | | | |")
    for opt, m in result["models"].items():
        rows = m["rows"]
        for label in OURS:
            window = rows.get(f"{label}, {WINDOW}")
            lines.append(_row(f"ours ({opt}): {label}", rows[label], window))
    return "\n".join(lines)


def _row(label: str, full: dict[str, float], window: dict[str, float] | None) -> str:
    w = f"{window['recall']:.4f}" if window is not None else "–"
    return (
        f"| {label} | {full['recall@10']:.4f} | {full['recall']:.4f} | {full['ndcg@10']:.4f} | "
        f"{full['ndcg']:.4f} | {full['coverage']:.3f} | {w} |"
    )


def notes(result: dict[str, Any], k: int) -> str:
    """Per optimizer: losses, nprobe, index recall, spread over seeds; the seen lists' sizes."""
    lines = []
    for o, m in result["models"].items():
        ir = ", ".join(f"{c} codes {v:.3f}" for c, v in m["index_recall_vs_exact"].items())
        spread = m["rows"][FLOAT_IVF]
        lines.append(
            f"- {o}: loss {m['first_epoch_loss']:.3f} -> {m['last_epoch_loss']:.3f} over "
            f"{m['epochs']} epochs ({m['train_s']:.0f} s per model); one user's forward "
            f"{m['forward_ms']:.2f} ms (median); nprobe {m['nprobe']}; index "
            f"recall@{k} vs exact: {ir}; float-model std over seeds {m['seeds']}: recall "
            f"{spread['recall_std']:.4f}, NDCG {spread['ndcg_std']:.4f}"
        )
    s = result["seen_items"]
    lines.append(
        f"- seen lists of the evaluated users: mean {s['mean']:.0f}, median {s['median']:.0f}, "
        f"max {s['max']} items; {s['over_window']} users beyond the history window; the store "
        f"{s['store_bytes'] / 2**20:.2f} MiB"
    )
    for name, info in result["baseline_tuning"].items():
        if "recall" in info:
            grid = ", ".join(f"{v:g}: {r:.4f}" for v, r in info["recall"].items())
            lines.append(f"- {name} tuning, validation recall@{k} ({info['users']} users): {grid}")
    return "\n".join(lines)
