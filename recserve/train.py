"""``recserve train``: run a training config, save the model folder, optionally publish it.

Rank 0 of a torchrun job (or the only process) writes ``OUT/model`` (the trained model with its
index), ``OUT/metrics.json`` (per-epoch losses and evaluations) and, with a ``[publish]`` table,
a new version in the model repository: tables quantized to ``table_dtype``, the catalog split
into ``shards`` document shards when > 0, written atomically (``ModelRepository.publish``), so
a running server hot-swaps to it.
"""

from __future__ import annotations

import json
from pathlib import Path

from rich.console import Console
from rich.table import Table

from retrieval.artifact import save_model
from retrieval.model import RetrievalModel
from retrieval.training.config import PublishConfig
from retrieval.training.distributed import DistContext
from retrieval.training.run import RunConfig, RunResult, run_training


def run(config: Path, out: Path, resume: bool, ctx: DistContext | None) -> RunResult | None:
    """Trains; on rank 0 saves and publishes. Returns the result on rank 0, else None."""
    cfg = RunConfig.from_toml(config)  # every table checked before any work
    if cfg.train.checkpoint_dir is None and ctx is None:
        cfg.train.checkpoint_dir = out / "checkpoints"
    checkpoint = None
    if resume:
        if cfg.train.checkpoint_dir is None:
            raise ValueError("--resume: multi-process runs have no checkpoints yet")
        checkpoint = cfg.train.checkpoint_dir / "checkpoint.pt"
        if not checkpoint.is_file():
            raise ValueError(f"--resume: no checkpoint at {checkpoint}")
    result = run_training(cfg, ctx, resume=checkpoint)
    if ctx is not None and not ctx.is_main:
        return None
    console = Console()
    path = save_model(result.model, out / "model")
    (out / "metrics.json").write_text(
        json.dumps({"epoch_losses": result.epoch_losses, "evals": result.evals}, indent=2)
    )
    _print(console, result, path)
    if cfg.publish is not None:
        _publish(console, result.model, cfg.publish)
    return result


def _print(console: Console, result: RunResult, path: Path) -> None:
    losses = result.epoch_losses
    console.print(f"trained {len(losses)} epochs: loss {losses[0]:.3f} -> {losses[-1]:.3f}")
    if result.evals:
        table = Table(title="evaluation on held-out interactions")
        keys = list(result.evals[-1])
        for key in keys:
            table.add_column(key)
        for e in result.evals:
            table.add_row(*(f"{e.get(k, float('nan')):.3f}" for k in keys))
        console.print(table)
    console.print(f"model folder: {path}")


def _publish(console: Console, model: RetrievalModel, spec: PublishConfig) -> None:
    from retrieval.tiering import tier_model
    from serving.repository import ModelRepository
    from sharded_tables.placement import Budgets
    from sharded_tables.specs import DType

    dtype = DType(spec.table_dtype)
    served = model
    if dtype is not DType.FP32:
        served, _ = tier_model(model, Budgets(device=0, host=1 << 40), dtype=dtype)
    shards = spec.shards or None
    repo = ModelRepository(spec.model_repo)
    version = repo.publish(spec.name, served, shards=shards, keep=spec.keep)
    console.print(
        f"published {spec.name} v{version} ({dtype.value} tables"
        f"{f', {shards} document shards' if shards else ''}) to {repo.version_dir(spec.name, version)}"
    )
