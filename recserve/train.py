"""``recserve train``: run a training config, save the model folder, optionally publish it.

Rank 0 of a torchrun job (or the only process) writes, in this order: ``OUT/model`` (the kept
weights with their index) and ``OUT/metrics.json`` (per-epoch losses and validation metrics, the
kept epoch, batch size and steps per epoch, who each split holds and who it leaves out); then it
evaluates the test split and rewrites ``metrics.json`` with it (a failing evaluation leaves the
model folder as written); then, with a ``[publish]`` table, a new version in the model
repository, by the policy of ``serving/repository/publish_trained.py`` (tables tiered and
quantized to ``table_dtype``, ``shards`` document shards, written atomically), so a running server
hot-swaps to it.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

from rich.console import Console
from rich.table import Table

from retrieval.artifact import save_model
from retrieval.training import dcp_checkpoint
from retrieval.training.distributed import DistContext
from retrieval.training.run import RunConfig, RunResult, evaluate_test, run_training
from retrieval.training.train import CHECKPOINT_FILE

log = logging.getLogger(__name__)


def run(config: Path, out: Path, resume: bool, ctx: DistContext | None) -> RunResult | None:
    """Trains; on rank 0 saves and publishes. Returns the result on rank 0, else None."""
    cfg = RunConfig.from_toml(config)  # every table checked before any work
    if cfg.train.checkpoint_dir is None:
        cfg.train.checkpoint_dir = out / "checkpoints"
    checkpoint = _checkpoint(cfg.train.checkpoint_dir, ctx) if resume else None
    result = run_training(cfg, ctx, resume=checkpoint)
    if ctx is not None and not ctx.is_main:
        return None
    console = Console()
    path = save_model(result.model, out / "model")  # before evaluating: it may fail
    _write_metrics(out, result)
    try:
        evaluate_test(result, cfg.evaluate)
    except Exception:
        log.error("the test evaluation failed; the trained model is saved in %s", path)
        raise
    _write_metrics(out, result)
    _print(console, result, path)
    if cfg.publish is not None:
        from serving.repository.publish_trained import publish_trained

        console.print(publish_trained(result.model, cfg.publish).describe())
    return result


def _checkpoint(folder: Path, ctx: DistContext | None) -> Path:
    """What ``--resume`` continues from: ``checkpoint.pt`` of one process, the DCP folder that
    ``LATEST`` names under torchrun (``retrieval/training/dcp_checkpoint.py``)."""
    if ctx is None:
        path = folder / CHECKPOINT_FILE
        if not path.is_file():
            raise ValueError(f"--resume: no checkpoint at {path}")
        return path
    found = dcp_checkpoint.latest(folder)
    if found is None:
        raise ValueError(
            f"--resume: no multi-process checkpoint in {folder} (no {folder / 'LATEST'})"
        )
    return found


def _write_metrics(out: Path, result: RunResult) -> None:
    (out / "metrics.json").write_text(json.dumps(result.report(), indent=2))


def _print(console: Console, result: RunResult, path: Path) -> None:
    plan, counts, losses = result.plan, result.prep.counts, result.epoch_losses
    console.print(
        f"batch_size {plan.batch_size}: {plan.steps} step{'' if plan.steps == 1 else 's'} per "
        f"epoch over {plan.pairs} training pairs ({plan.unused_pairs} short of a batch unused "
        f"each epoch)"
    )
    if losses:
        console.print(f"trained {len(losses)} epochs: loss {losses[0]:.3f} -> {losses[-1]:.3f}")
    if counts is not None:
        console.print(
            f"users: {counts.users}; in test {counts.users_in_test}, kept out of test "
            f"{counts.users_kept_out_of_test} (a single interaction), without interactions "
            f"{counts.users_without_interactions}"
        )
    if result.evals:
        _table(console, "validation, per epoch", result.evals)
        stop = ", stopped early" if result.stopped_early else ""
        console.print(f"kept the weights of epoch {result.kept_epoch}{stop}")
    if result.test is not None:
        scored = result.evaluated.get("test_users", 0)
        _table(console, f"test, kept weights ({scored} users)", [result.test])
    console.print(f"model folder: {path}")


def _table(console: Console, title: str, rows: list[dict[str, float]]) -> None:
    table = Table(title=title)
    keys = list(rows[-1])
    for key in keys:
        table.add_column(key)
    for row in rows:
        table.add_row(*(f"{row.get(k, float('nan')):.3f}" for k in keys))
    console.print(table)
