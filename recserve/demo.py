"""The local demo: data -> train -> build the in-model index -> recommend -> measure -> save."""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import torch
from rich.console import Console
from rich.table import Table

from recserve.demo_serving import serve_on_cluster
from retrieval.artifact import load_model, save_model
from retrieval.baselines import ease_weights, gram_of, recommend_items
from retrieval.data import RecDataset, SyntheticConfig, generate, load_movielens, read_parquet
from retrieval.data.schema import META_FILE
from retrieval.index.exact import recall_at_k
from retrieval.metrics import popularity_recs, ranking_metrics
from retrieval.model import RetrievalModel
from retrieval.seen import SeenSets
from retrieval.tiering import tier_model
from retrieval.training.prepare import Prepared, prepare
from retrieval.training.train import TrainConfig, train
from sharded_tables.placement import Budgets
from sharded_tables.specs import DType

console = Console()
DEMO_FILTERS = {  # one request-time filter per data set, to show eligibility inside the scan
    "movielens": 'genre in {Comedy, Romance} and decade != "1990s"',
    "synthetic": 'language in {en, fr} and available and not age_rating = "18+"',
}


def _recommend(
    model: RetrievalModel,
    prep: Prepared,
    users: np.ndarray,
    k: int,
    filters: list[str | None] | None = None,
    exact: bool = False,
    chunk: int = 512,
) -> np.ndarray:
    out = []
    with torch.inference_mode():
        for s in range(0, len(users), chunk):
            part = users[s : s + chunk]
            batch = prep.user_batch(part, None if filters is None else filters[s : s + chunk])
            out.append(model(batch, k, exact=exact)[0].numpy())
    return np.concatenate(out)


class DemoDataError(ValueError):
    """``--data`` names no data set (the message says what it accepts)."""


def _load(data: str, data_dir: Path, seed: int) -> RecDataset:
    if data == "movielens":
        return load_movielens(data_dir)
    if data == "synthetic":
        return generate(SyntheticConfig(seed=seed))
    folder = Path(data)
    if not (folder / META_FILE).is_file():
        raise DemoDataError(
            f"--data: {data!r} is neither movielens, synthetic nor a data set folder (no "
            f"{folder / META_FILE}; `recserve data import --out FOLDER` writes one)"
        )
    return read_parquet(folder)


def _show_recs(model: RetrievalModel, prep: Prepared, user: int, k: int, flt: str | None) -> None:
    ds = prep.dataset
    names = ds.display_names()
    ids = _recommend(model, prep, np.array([user]), k, [flt])[0]
    table = Table(title=f"user {user}" + (f" — filter: {flt}" if flt else ""), show_lines=False)
    table.add_column("#", justify="right")
    table.add_column("recommended")
    table.add_column("held out?", justify="center")
    for rank, i in enumerate(ids[:8], 1):
        if i >= 0:
            table.add_row(str(rank), names[i], "✓" if i in prep.test_items[user] else "")
    seen = [names[i] for i in prep.history[user][:3] if i >= 0]
    console.print(f"[dim]recently watched: {'; '.join(seen)}[/dim]")
    console.print(table)


def run_demo(
    *, data: str, data_dir: Path, epochs: int, k: int, out: Path, seed: int, progress: bool
) -> None:
    torch.manual_seed(seed)
    t0 = time.perf_counter()
    ds = _load(data, data_dir, seed)
    if k > ds.num_items:
        console.print(
            f"[yellow]k={k} is more than the catalog's {ds.num_items} items: k={ds.num_items}"
        )
        k = ds.num_items
    prep = prepare(ds)
    console.rule(f"[bold]recserve demo — {ds.name}")
    console.print(
        f"{ds.num_users} users, {ds.num_items} items, {len(ds.interactions)} interactions; "
        f"{len(prep.train.user_ids)} for training, the latest 20% per user held out"
    )

    model = RetrievalModel(prep.config)
    model.id_maps = ds.ids  # imported data: the saved model answers batch scoring in raw ids
    losses = train(model, prep.train, TrainConfig(epochs=epochs, seed=seed, progress=progress))
    console.print(f"trained {epochs} epochs: loss {losses[0]:.3f} -> {losses[-1]:.3f}")

    model.build_index(prep.train.item_features, ds.item_attributes, prep.tune_batch(seed=seed))
    mem = sum(model.index.memory_bytes().values())
    console.print(
        f"index: {model.index.nlist} lists, nprobe {model.config.index.nprobe}, "
        f"{model.config.index.codes} codes, {mem / model.index.ntotal:.0f} bytes/item"
    )

    users = np.array([u for u in range(ds.num_users) if prep.test_items[u]])
    t = time.perf_counter()
    recs = _recommend(model, prep, users, k)
    per_user_ms = (time.perf_counter() - t) / len(users) * 1e3
    exact = _recommend(model, prep, users, k, exact=True)
    pop = popularity_recs(prep.train.item_ids, ds.num_items, prep.history[users], k)
    relevant = [prep.test_items[u] for u in users]
    ours, base = ranking_metrics(recs, relevant, k), ranking_metrics(pop, relevant, k)
    idx_recall = recall_at_k(torch.from_numpy(recs), torch.from_numpy(exact))

    # the same model on tiered INT8 tables (1/4 of the FP32 table bytes), one fbgemm call
    tiered, _ = tier_model(model, Budgets(device=0, host=1 << 34), dtype=DType.INT8)
    int8 = ranking_metrics(_recommend(tiered, prep, users, k), relevant, k)

    table = Table(title=f"held-out interactions of {len(users)} users")
    for col in ("", f"recall@{k}", f"NDCG@{k}"):
        table.add_column(col)
    table.add_row("recserve (index)", f"{ours[f'recall@{k}']:.3f}", f"{ours[f'ndcg@{k}']:.3f}")
    table.add_row("recserve, INT8 tables", f"{int8[f'recall@{k}']:.3f}", f"{int8[f'ndcg@{k}']:.3f}")
    table.add_row("popularity baseline", f"{base[f'recall@{k}']:.3f}", f"{base[f'ndcg@{k}']:.3f}")
    ease = _ease_metrics(prep, users, relevant, k)
    if ease is not None:
        table.add_row(
            "EASE baseline (λ 300)", f"{ease[f'recall@{k}']:.3f}", f"{ease[f'ndcg@{k}']:.3f}"
        )
    console.print(table)
    console.print(
        f"index recall@{k} vs exact search: {idx_recall:.3f}; {per_user_ms:.2f} ms per user in batches"
    )

    first = int(users[0])
    _show_recs(model, prep, first, k, None)
    if (flt := DEMO_FILTERS.get(ds.name.split("-")[0])) is not None:
        _show_recs(model, prep, first, k, flt)

    path = save_model(model, out / "model")
    again = load_model(path)
    same = np.array_equal(_recommend(again, prep, users[:64], k), recs[:64])
    console.print(f"saved to {path} (reloaded with weights_only=True; same results: {same})")

    summary = {
        f"recall@{k} (popularity)": f"{ours[f'recall@{k}']:.3f} ({base[f'recall@{k}']:.3f})",
        f"EASE recall@{k}, same split and exclusions": (
            "skipped (catalog too large)" if ease is None else f"{ease[f'recall@{k}']:.3f}"
        ),
        f"index recall@{k} vs exact": f"{idx_recall:.3f}",
    }
    console.rule("serving: router + 2 document shards + 1 embedding server on 127.0.0.1")
    name = ds.name.split("-")[0]
    routed = serve_on_cluster(
        model, prep, out / "model_repo", out / "cluster", name, users, k,
        DEMO_FILTERS.get(name), console, summary,
    )  # fmt: skip
    in_process = _recommend(tiered, prep, users, k)  # the same INT8 rows, all in this process
    routed_recall = ranking_metrics(routed, relevant, k)[f"recall@{k}"]
    overlap = np.mean([len(set(a) & set(b)) / k for a, b in zip(routed, in_process, strict=True)])
    console.print(
        f"routed recall@{k}: {routed_recall:.3f}; top-{k} overlap with the unsharded model in "
        f"this process: {overlap:.2%}"
    )
    summary[f"routed recall@{k}"] = f"{routed_recall:.3f}"
    console.rule("offline batch scoring")
    summary["batch scoring"] = _batch_score(path, prep, out / "batch", k)
    console.print(summary["batch scoring"])
    table = Table(title="summary")
    table.add_column("")
    table.add_column("")
    for key, value in summary.items():
        table.add_row(key, value)
    console.print(table)
    console.print(f"[green]done in {time.perf_counter() - t0:.0f} s")


def _ease_metrics(
    prep: Prepared, users: np.ndarray, relevant: list[set[int]], k: int
) -> dict[str, float] | None:
    """EASE (``retrieval/baselines.py``) fitted on the training interactions, excluding what
    the model excludes (the history window): the strong simple baseline beside ours; None when
    the catalog's dense inverse would not fit."""
    n = prep.dataset.num_items
    seen = SeenSets.of(prep.train.user_ids, prep.train.item_ids, prep.dataset.num_users)
    try:
        weights = ease_weights(gram_of(seen, n), lam=300.0)
    except ValueError as e:
        console.print(f"[yellow]EASE baseline skipped: {e}")
        return None
    exclude = torch.from_numpy(prep.history[users])
    recs = recommend_items(weights, seen.indicator(users, n), exclude, k)
    return ranking_metrics(recs.numpy(), relevant, k)


def _batch_score(model_dir: Path, prep: Prepared, out: Path, k: int) -> str:
    """Every user through ``retrieval.batch_scoring`` (2 worker processes) from a parquet file."""
    import pyarrow.parquet as pq

    from retrieval.batch_scoring import ScoreJob, read_output, score, users_table
    from retrieval.data.score_users import score_users_table

    out.mkdir(parents=True, exist_ok=True)
    users = np.arange(prep.dataset.num_users)
    if prep.dataset.ids is not None:  # the model reads raw item ids: its data set's own users
        table = score_users_table(prep.dataset, prep.config.history_len)
    else:
        table = users_table(users, prep.user_batch(users))
    pq.write_table(table, out / "users.parquet")
    job = ScoreJob(model_dir, 0, out / "users.parquet", out / "recs", k=k, overwrite=True)
    start = time.perf_counter()
    score(job, progress=False)
    took = time.perf_counter() - start
    rows = read_output(job.out).num_rows
    return (
        f"{rows} users scored in {took:.1f} s ({rows / took:.0f} users/s, 2 processes) -> {job.out}"
    )
