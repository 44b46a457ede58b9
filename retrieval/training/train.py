"""Trains a :class:`RetrievalModel` on (user, item) interactions: both towers together.

One step, for a batch of B positive (user, item) pairs and R random items::

    pooled = tables(user features + item features)     ONE fbgemm training-kernel call
    q, v   = user_tower(pooled), item_tower(pooled)    [B, D], [B + R, D]
    loss   = sampled softmax over in-batch + random negatives, log-Q corrected
    loss.backward()                                     table rows updated inside (fused
                                                        row-wise Adagrad), towers by Adam

:class:`Trainer` adds what a long run needs: a progress bar with loss and examples/s, an
evaluation after each epoch (of the validation split), checkpoints (every ``checkpoint_every``
steps and each epoch, written then renamed, each epoch's *before* its evaluation, so a failing
evaluation never loses the epoch), resume from a checkpoint with the same result as an
uninterrupted run (batch order and negatives are functions of (seed, epoch, step), not of a
running generator; an epoch whose evaluation did not finish is evaluated on resume), early
stopping with the best epoch's weights kept (:class:`EarlyStopping`), and a stop on a NaN/inf
loss that names the step and its batch and leaves the last good checkpoint as it was.

Tables: ``table_optimizer="rowwise_adagrad"`` (or ``adagrad`` / ``sgd``) trains them through
fbgemm's ``SplitTableBatchedEmbeddingBagsCodegen`` with the optimizer fused into backward
(:class:`sharded_tables.trainable.TrainableTables`); the model's float tables are swapped out
for the run and get the trained rows back at the end, so export is unchanged. ``"adam"`` keeps
them as plain ``nn.EmbeddingBag`` parameters in the dense optimizer.
"""

from __future__ import annotations

import copy
import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
from tqdm import tqdm

from common.atomic import atomic_writer
from retrieval.model import RetrievalModel, table_configs
from retrieval.training import dcp_checkpoint
from retrieval.training.config import TrainConfig
from retrieval.training.distributed import DistContext, average_gradients
from retrieval.training.dmp_tables import DMPTables
from retrieval.training.early_stopping import EarlyStopping
from retrieval.training.hard_negatives import HardNegativeMiner
from retrieval.training.hashed_store import hashed_tables
from retrieval.training.loss import (
    column_log_q,
    in_batch_logits,
    sampled_softmax_loss,
    task_loss,
)
from retrieval.training.pairs import TrainingData, batch_inputs, batch_starts
from retrieval.training.sharding import make_sharder, plan_sharding
from sharded_tables.hashed_training import HashedTrainingTables
from sharded_tables.interface import TableCollection
from sharded_tables.trainable import TrainableTables

log = logging.getLogger(__name__)
CHECKPOINT_FILE = "checkpoint.pt"


class TrainingDivergedError(RuntimeError):
    """The loss became NaN or infinite; the message names the step and its batch."""


class Trainer:
    """Trains ``model`` on ``data`` (see the module docstring); :meth:`fit` runs or resumes."""

    def __init__(
        self,
        model: RetrievalModel,
        data: TrainingData,
        cfg: TrainConfig,
        evaluate: Callable[[RetrievalModel], dict[str, float]] | None = None,
        dist_ctx: DistContext | None = None,
        stopper: EarlyStopping | None = None,
    ):
        """``evaluate``: called after each epoch with the float tables in the model (under
        torchrun on the ranks given one; every rank takes part in gathering the tables);
        ``stopper``: reads its results, the best epoch's weights are kept at the end;
        ``dist_ctx``: this process's rank among several (torchrun); see
        ``retrieval/training/distributed.py``."""
        cfg.validate()
        if model.config.table_plan is not None:
            raise ValueError("training needs plain float tables (tier the model after training)")
        self.dist = dist_ctx if dist_ctx is not None and dist_ctx.world > 1 else None
        if self.dist is not None:
            _check_distributed(cfg, self.dist.world)
        self.model, self.data, self.cfg, self.evaluate = model, data, cfg, evaluate
        self.float_tables: TableCollection | None = None
        """The model's own tables while fused-optimizer ones train in their place."""
        hashed = sorted(t.name for t in table_configs(model.config) if t.hashed)
        if hashed and cfg.table_optimizer == "adam":
            raise ValueError(
                f"train.table_optimizer: hashed tables {hashed} train with a fused optimizer "
                "(rowwise_adagrad, adagrad or sgd), not adam"
            )
        self.dmp: DMPTables | None = None
        """Under torchrun: the tables TorchRec shards (checkpointed through DCP)."""
        self.hashed: HashedTrainingTables | None = None
        """The hashed tables' trainer, when the model has some."""
        if cfg.table_optimizer != "adam":
            self._swap_in_trainable()
        self.miner = (
            HardNegativeMiner(cfg.hard_negatives, cfg.hard_negative_ranks, cfg.seed)
            if cfg.hard_negatives
            else None
        )
        self.opt = torch.optim.Adam(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
        self.epoch = self.step_in_epoch = self.global_step = 0
        self.epoch_losses: list[float] = []
        self.losses: list[float] = []
        """Losses of the current epoch's steps so far."""
        self.evals: list[dict[str, float]] = []
        self.stopper = stopper
        self.best_state: dict[str, Any] | None = None
        """The model's state after the best epoch so far (float tables), when ``stopper``."""
        self.stopped = False
        """The stopper ended the run before ``epochs``."""
        self.sharding = self.dmp.placement() if self.dmp is not None else None
        """Under torchrun: ``{table: [(rank, offsets, sizes)]}``, where TorchRec put each shard."""
        self._evaluates = self._any_rank(evaluate is not None)

    # ---- tables ---------------------------------------------------------------------------
    def _swap_in_trainable(self) -> None:
        tables = self.model.tables
        configs = table_configs(self.model.config)
        rows = tables.float_weights()
        kernel: TrainableTables | DMPTables
        if self.dist is not None:  # TorchRec's DMP over the plan of [train.sharding]
            sharder = make_sharder(self.cfg.table_optimizer, self.cfg.table_lr)
            plan = plan_sharding(configs, self.cfg.sharding, self.dist.world, sharder)
            kernel = self.dmp = DMPTables(configs, plan, sharder, rows)
        else:
            kernel = TrainableTables(
                configs, optimizer=self.cfg.table_optimizer, learning_rate=self.cfg.table_lr
            )
            kernel.load_float(rows)
        trainable: TableCollection = kernel
        if any(t.hashed for t in configs):  # their ids go through a working table first
            trainable = self.hashed = hashed_tables(kernel, self.cfg)
        self.float_tables = tables
        self.model.tables = trainable

    def _swap_back(self) -> None:
        """The float tables take the trained rows and return to the model (export format)."""
        tables = self.model.tables
        if self.float_tables is None or tables is self.float_tables:
            return
        # sharded over ranks: a collective, every rank gets every table's rows
        self.float_tables.load_float(tables.float_weights())
        keyed = tables.keyed_rows()  # hashed tables: every id's row, from the servers too
        if keyed:
            self.float_tables.load_keyed(keyed)
        self.model.tables = self.float_tables

    # ---- one step -------------------------------------------------------------------------
    def step_loss(self, idx: np.ndarray, epoch: int, step: int) -> torch.Tensor:
        """The loss of the batch of pairs ``idx [B]`` (negatives drawn for (epoch, step))."""
        model, data, cfg = self.model, self.data, self.cfg
        slices = cfg.micro_batches
        if self.dist is not None:  # this rank's slice of the global batch is one softmax
            b = len(idx) // self.dist.world
            idx, slices = idx[self.dist.rank * b : (self.dist.rank + 1) * b], 1
        items = data.item_ids[idx]
        batch = batch_inputs(model, data, idx, cfg.history)
        n = data.item_log_q.shape[0]
        neg = np.random.default_rng([cfg.seed, epoch, step, 1]).integers(0, n, cfg.random_negatives)
        if self.miner is not None:  # hard ones join the uniform ones
            neg = np.concatenate([neg, self.miner.mine(model, batch, items, epoch, step)])
        cols = torch.from_numpy(np.concatenate([items, neg]))  # [B + R]
        b, c = len(items), len(cols)
        user = model.user_sparse(batch)
        pooled = model.lookup({**user, **{f: t[cols] for f, t in data.item_features.items()}})
        q = model.user_tower_on(pooled, batch)  # [B, D]
        v = model.item_tower_on(pooled)  # [B + R, D]
        parts = []
        size = b // slices if b >= slices else b
        for s in range(0, b, size):  # a slice sees its own positives and the random items
            sl = slice(s, s + size)
            col = torch.cat([cols[sl], cols[b:]])
            v_col = torch.cat([v[sl], v[b:]])
            tl = None
            if model.head is not None:  # [B', C', T], once for both losses
                tl = model.head.task_logits(q[sl].unsqueeze(1), v_col.unsqueeze(0))
            logits = in_batch_logits(q[sl], v_col, model.config.temperature, model.head, tl)
            lq = column_log_q(data.item_log_q[col], len(col) - (c - b), c - b, n)
            loss = sampled_softmax_loss(logits, cols[sl], col, lq)
            if tl is not None and data.task_labels is not None and cfg.task_loss_weight:
                labels = torch.from_numpy(data.task_labels[idx[sl]])
                loss = loss + cfg.task_loss_weight * task_loss(tl, labels, cols[sl], col)
            parts.append(loss)
        return torch.stack(parts).mean()

    # ---- the loop -------------------------------------------------------------------------
    def fit(self) -> list[float]:
        """Trains (or continues) until ``epochs`` or ``max_steps``; returns per-epoch mean
        losses. Raises :class:`TrainingDivergedError` on a NaN/inf loss. Once the epochs are
        done (or the stopper stopped them), the model holds the best epoch's weights."""
        cfg, data = self.cfg, self.data
        m = len(data.user_ids)
        starts = batch_starts(m, cfg.batch_size)
        self.model.train()
        if self.hashed is not None and self.global_step == 0:
            self.hashed.clear_store()  # a fresh run: rows of an earlier one must not come back
        try:
            if self._validation_pending():  # resumed from an epoch whose evaluation failed
                self._validate()
            while self.epoch < cfg.epochs and not self.stopped:
                if self.miner is not None and self.epoch > 0:
                    self.miner.refresh(self.model, data.item_features)
                order = np.random.default_rng([cfg.seed, self.epoch]).permutation(m)
                bar = tqdm(
                    total=len(starts),
                    initial=self.step_in_epoch,
                    desc=f"epoch {self.epoch + 1}/{cfg.epochs}",
                    disable=not cfg.progress or (self.dist is not None and not self.dist.is_main),
                    leave=False,
                )
                t0, seen = time.perf_counter(), 0
                while self.step_in_epoch < len(starts):
                    if cfg.max_steps is not None and self.global_step >= cfg.max_steps:
                        bar.close()
                        self.checkpoint()
                        return self.epoch_losses
                    s = starts[self.step_in_epoch]
                    idx = order[s : s + cfg.batch_size]
                    self._train_step(idx)
                    seen += len(idx)
                    bar.update()
                    bar.set_postfix(
                        loss=f"{np.mean(self.losses[-20:]):.3f}",
                        ex_s=f"{seen / (time.perf_counter() - t0):.0f}",
                        refresh=False,
                    )
                    if cfg.checkpoint_every and self.global_step % cfg.checkpoint_every == 0:
                        self.checkpoint()
                bar.close()
                self._end_epoch()
        finally:  # also on max_steps and errors: the model always gets its float tables back
            self.model.eval()
            self._swap_back()
        self._keep_best()
        return self.epoch_losses

    def _train_step(self, idx: np.ndarray) -> None:
        loss = self.step_loss(idx, self.epoch, self.step_in_epoch)
        if not self._all_finite(loss):
            where = self.cfg.checkpoint_dir or "(no checkpoint_dir)"
            raise TrainingDivergedError(
                f"loss is {loss.item()} at step {self.global_step} (epoch {self.epoch + 1}, "
                f"batch {self.step_in_epoch}: pairs {idx[:8].tolist()}...); nothing from this "
                f"step was applied; the last good checkpoint is in {where}"
            )
        self.opt.zero_grad()
        loss.backward()  # fused tables: the rows this batch read are updated here
        if self.dist is not None:
            average_gradients(list(self.model.parameters()), self.dist.world)
        self.opt.step()
        self.losses.append(self._mean_over_ranks(loss.item()))
        self.step_in_epoch += 1
        self.global_step += 1

    def _all_finite(self, loss: torch.Tensor) -> bool:
        """Finite on every rank (ranks stop together)."""
        bad = torch.tensor([0.0 if bool(torch.isfinite(loss)) else 1.0])
        if self.dist is not None:
            torch.distributed.all_reduce(bad)
        return bad.item() == 0.0

    def _any_rank(self, flag: bool) -> bool:
        """True on every rank when ``flag`` is true on any (a collective under torchrun)."""
        if self.dist is None:
            return flag
        t = torch.tensor([1.0 if flag else 0.0])
        torch.distributed.all_reduce(t)
        return bool(t.item() > 0)

    def _mean_over_ranks(self, value: float) -> float:
        if self.dist is None:
            return value
        t = torch.tensor([value], dtype=torch.float64)
        torch.distributed.all_reduce(t)
        return float(t.item()) / self.dist.world

    def _end_epoch(self) -> None:
        self.epoch_losses.append(float(np.mean(self.losses)) if self.losses else float("nan"))
        self.losses = []
        self.epoch += 1
        self.step_in_epoch = 0
        self.checkpoint()  # before evaluating: a failing evaluation never loses this epoch
        if self._evaluates:
            self._validate()

    # ---- evaluation and early stopping ----------------------------------------------------
    def _validation_pending(self) -> bool:
        """A checkpoint written at an epoch's end whose evaluation did not finish."""
        if not self._evaluates or self.epoch == 0 or self.step_in_epoch:
            return False
        return not self.evals or self.evals[-1]["epoch"] < self.epoch

    def _validate(self) -> None:
        """Evaluates this epoch's weights with the float tables in the model (gathered from
        every rank), gives them to the stopper (a copy when they are the best) and decides, on
        every rank alike, whether to stop."""
        training_tables = self.model.tables
        self.model.eval()
        self._swap_back()  # under torchrun a collective: every rank gets every table's rows
        try:
            stop = False
            if self.evaluate is not None:
                result = {"epoch": float(self.epoch), **self.evaluate(self.model)}
                self.evals.append(result)
                log.info("epoch %d: %s", self.epoch, result)
                if self.stopper is not None:
                    if self.stopper.update(self.epoch, result[self.stopper.metric]):
                        self.best_state = _copy_state(self.model)
                    stop = self.stopper.should_stop
            self.stopped = self._any_rank(stop)
        finally:
            self.model.tables = training_tables
            self.model.train()
        if self.stopped and self.stopper is not None:
            log.info(
                "stopping after epoch %d: %s has not improved for %d epochs (best: epoch %d)",
                self.epoch, self.stopper.metric, self.stopper.bad_epochs, self.stopper.best_epoch,
            )  # fmt: skip

    @property
    def kept_epoch(self) -> int:
        """The epoch whose weights the model holds after :meth:`fit`."""
        if self.stopper is not None and self.best_state is not None:
            return self.stopper.best_epoch
        return self.epoch

    def _keep_best(self) -> None:
        """Loads the best epoch's weights when a later epoch was worse."""
        if self.best_state is not None and self.kept_epoch != self.epoch:
            self.model.load_state_dict(self.best_state)

    # ---- checkpoints ----------------------------------------------------------------------
    def state(self) -> dict[str, Any]:
        """Everything a resume needs (plain tensors and numbers: loads with weights_only)."""
        cfg = self.cfg.model_dump()
        cfg["checkpoint_dir"] = str(cfg["checkpoint_dir"]) if cfg["checkpoint_dir"] else None
        return {
            "model": self.model.state_dict(),
            "optimizer": self.opt.state_dict(),
            "epoch": self.epoch,
            "step_in_epoch": self.step_in_epoch,
            "global_step": self.global_step,
            "epoch_losses": list(self.epoch_losses),
            "losses": list(self.losses),
            "evals": [dict(e) for e in self.evals],
            "train_config": cfg,
            "stopper": self.stopper.state() if self.stopper is not None else None,
            "best_state": self.best_state,
        }

    def checkpoint(self) -> Path | None:
        """Writes ``checkpoint_dir/checkpoint.pt`` atomically (``common.atomic``: a crash keeps
        the old one); under torchrun a DCP folder (:mod:`retrieval.training.dcp_checkpoint`),
        every rank taking part."""
        if self.cfg.checkpoint_dir is None:
            return None
        self.cfg.checkpoint_dir.mkdir(parents=True, exist_ok=True)
        if self.dmp is not None:
            sharded = self.dmp.sharded_state()
            return dcp_checkpoint.save(self.cfg.checkpoint_dir, self.state(), sharded)
        path = self.cfg.checkpoint_dir / CHECKPOINT_FILE
        with atomic_writer(path) as fh:
            torch.save(self.state(), fh)
        return path

    def resume(self, path: Path) -> None:
        """Continues from a checkpoint written by :meth:`checkpoint` (same model config): the
        ``checkpoint.pt`` file, or under torchrun the checkpoint folder (same world size)."""
        if self.dmp is not None:
            sharded = self.dmp.sharded_state()
            state = dcp_checkpoint.load(path, sharded)
            self.dmp.load_sharded_state(sharded)
        else:
            state = torch.load(path, weights_only=True)
        self.model.load_state_dict(state["model"])
        self.opt.load_state_dict(state["optimizer"])
        self.epoch, self.step_in_epoch = state["epoch"], state["step_in_epoch"]
        self.global_step = state["global_step"]
        self.epoch_losses, self.losses = list(state["epoch_losses"]), list(state["losses"])
        self.evals = [dict(e) for e in state["evals"]]
        if self.stopper is not None and state.get("stopper") is not None:
            self.stopper = EarlyStopping.from_state(state["stopper"])
            self.best_state = state.get("best_state")


def _copy_state(model: RetrievalModel) -> dict[str, Any]:
    """A copy of ``model.state_dict()`` that later steps do not change."""
    return {
        k: v.detach().clone() if isinstance(v, torch.Tensor) else copy.deepcopy(v)
        for k, v in model.state_dict().items()
    }


def _check_distributed(cfg: TrainConfig, world: int) -> None:
    if cfg.batch_size % world:
        raise ValueError(f"train.batch_size: {cfg.batch_size} must be a multiple of {world} ranks")
    if cfg.table_optimizer == "adam":
        raise ValueError("train.table_optimizer: multi-process runs shard tables: use a fused one")
    if cfg.hard_negatives:
        raise ValueError("train.hard_negatives: one process only (mining is not sharded yet)")


def train(
    model: RetrievalModel,
    data: TrainingData,
    cfg: TrainConfig,
    evaluate: Callable[[RetrievalModel], dict[str, float]] | None = None,
) -> list[float]:
    """Runs ``cfg.epochs`` epochs; returns the mean loss of each epoch. Deterministic for a seed."""
    return Trainer(model, data, cfg, evaluate).fit()
