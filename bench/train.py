"""Training-step benchmark: our ``Trainer`` step against TorchRec ``EmbeddingBagCollection`` loops.

Every loop trains the SAME model shape (``retrieval/model.py``: tables from ``table_configs``,
both towers) on the SAME batches of (user, item) pairs, in one process, with one thread count,
starting from the SAME initial weights (one seeded model, deep-copied; its float table rows are
loaded into every TorchRec table), with the same loss (in-batch sampled softmax with log-Q
correction, ``retrieval/training/loss.py``):

* ``ours fused``: ``Trainer._train_step`` with ``table_optimizer="rowwise_adagrad"`` (one fbgemm
  training-TBE call per step, row-wise Adagrad fused into backward; Adam for the towers);
* ``ours adam``: ``Trainer._train_step`` with ``table_optimizer="adam"`` (plain
  ``nn.EmbeddingBag`` tables in the dense Adam);
* ``TorchRec EBC + Adam`` (the baseline every ratio divides by): an unsharded
  ``torchrec.EmbeddingBagCollection`` with the same tables, fed a ``KeyedJaggedTensor`` built
  from the same padded features inside the step, its pooled outputs into
  ``model.user_tower_on`` / ``model.item_tower_on``; one ``torch.optim.Adam`` over everything;
* ``TorchRec EBC + fused rowwise Adagrad in backward``: the same EBC with
  ``torchrec.optim.apply_optimizer_in_backward(RowWiseAdagrad)`` on its tables (an unsharded EBC
  runs it as a per-parameter hook on dense gradients), Adam for the towers;
* ``TorchRec DMP (fused TBE)``: the EBC sharded by ``DistributedModelParallel`` (gloo, world
  size 1, CPU): TorchRec's own production path, fbgemm's training TBE with the fused
  row-wise Adagrad that ``apply_optimizer_in_backward`` asked for (``--no-dmp`` skips it).

Timing: ``--warmup`` untimed steps per loop, then the ``--steps`` batches in ``--rounds``
chunks; each round times every loop on that round's chunk, the loop order rotating between
rounds, so background load hits every loop alike. Throughput is pairs (examples) per second:
median over rounds, and all steps / all time. Losses (mean of the first and last tenth of the timed steps) are
reported as a sanity check: the loops share the initial weights, so same-optimizer loops should
agree closely.

Run from the repository root::

    .venv/bin/python bench/train.py --small           # ~10 s
    .venv/bin/python bench/train.py                   # synthetic 20k x 50k + MovieLens 100k, ~1 min

Writes ``--out`` (default ``bench/results/train.json``, ``train_small.json`` with ``--small``)
and prints a markdown table.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import dataclasses
import datetime
import json
import logging
import os
import platform
import socket
import statistics
import sys
import time
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from timing import OtherLoad

from retrieval.data import RecDataset, SyntheticConfig, generate, load_movielens
from retrieval.model import RetrievalModel, table_configs
from retrieval.tiering import float_tables
from retrieval.training.loss import column_log_q, in_batch_logits, sampled_softmax_loss
from retrieval.training.pairs import TrainingData, batch_inputs, batch_starts
from retrieval.training.prepare import Prepared, prepare
from retrieval.training.train import TrainConfig, Trainer

BASELINE = "TorchRec EBC + Adam"
OURS_FUSED = "ours: Trainer, fused fbgemm rowwise Adagrad"
OURS_ADAM = "ours: Trainer, tables in Adam"
TORCHREC_IN_BACKWARD = "TorchRec EBC + fused rowwise Adagrad in backward"
TORCHREC_DMP = "TorchRec DMP (sharded EBC, fused TBE rowwise Adagrad)"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--small", action="store_true", help="small synthetic set, fewer steps")
    p.add_argument("--datasets", default="synthetic,movielens", help="comma-separated")
    p.add_argument("--users", type=int, help="synthetic users (default 20k, 2k with --small)")
    p.add_argument("--items", type=int, help="synthetic items (default 50k, 5k with --small)")
    p.add_argument("--data-dir", type=Path, default=Path("data/ml-100k"))
    p.add_argument("--batch", type=int, default=512, help="pairs per step")
    p.add_argument("--steps", type=int, help="timed steps per loop (default 300, 40 --small)")
    p.add_argument("--rounds", type=int, help="interleaved chunks of the steps (30; 10 --small)")
    p.add_argument(
        "--quiet",
        type=float,
        default=0.15,
        help="a round is quiet when other processes took less than this share of the CPU",
    )
    p.add_argument("--warmup", type=int, default=5, help="untimed steps per loop first")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--no-dmp", action="store_true", help="skip the DistributedModelParallel loop")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)
    args.users = args.users or (2_000 if args.small else 20_000)
    args.items = args.items or (5_000 if args.small else 50_000)
    args.steps = args.steps or (40 if args.small else 300)
    args.rounds = min(args.rounds or (10 if args.small else 30), args.steps)
    if args.out is None:
        args.out = Path("bench/results") / ("train_small.json" if args.small else "train.json")
    return args


# ---- data -----------------------------------------------------------------------------------
def load_dataset(name: str, args: argparse.Namespace) -> RecDataset:
    """The synthetic set of ``--users`` x ``--items`` or MovieLens 100k from ``--data-dir``."""
    if name == "synthetic":
        return generate(SyntheticConfig(num_users=args.users, num_items=args.items, seed=args.seed))
    if name == "movielens":
        return load_movielens(args.data_dir)
    raise ValueError(f"unknown dataset {name!r} (synthetic, movielens)")


def step_batches(num_pairs: int, batch: int, count: int, seed: int) -> list[np.ndarray]:
    """``count`` batches of pair indices, epoch after epoch, in the order ``Trainer.fit`` uses."""
    starts = batch_starts(num_pairs, batch)
    out: list[np.ndarray] = []
    epoch = 0
    while len(out) < count:
        order = np.random.default_rng([seed, epoch]).permutation(num_pairs)
        out += [order[s : s + batch] for s in starts[: count - len(out)]]
        epoch += 1
    return out


# ---- TorchRec loops -------------------------------------------------------------------------
def make_ebc(model: RetrievalModel) -> nn.Module:
    """A TorchRec ``EmbeddingBagCollection`` with the model's tables, holding its float rows."""
    from torchrec import EmbeddingBagCollection, EmbeddingBagConfig, PoolingType

    pooling = {"mean": PoolingType.MEAN, "sum": PoolingType.SUM}
    configs = [
        EmbeddingBagConfig(
            name=t.name,
            embedding_dim=t.dim,
            num_embeddings=t.num_embeddings,
            feature_names=list(t.feature_names()),
            pooling=pooling[t.pooling],
        )
        for t in table_configs(model.config)
    ]
    ebc = EmbeddingBagCollection(tables=configs, device=torch.device("cpu"))
    rows = float_tables(model)
    with torch.no_grad():
        for name, bag in ebc.embedding_bags.items():
            bag.weight.copy_(rows[name])
    return ebc


def to_kjt(features: dict[str, torch.Tensor]) -> Any:
    """Padded id matrices ``{feature: [B, L]}`` (-1 = none) -> a ``KeyedJaggedTensor``."""
    from torchrec import KeyedJaggedTensor

    keys = list(features)
    present = [features[k] >= 0 for k in keys]
    values = torch.cat([features[k][m] for k, m in zip(keys, present, strict=True)])
    lengths = torch.cat([m.sum(dim=1) for m in present])
    return KeyedJaggedTensor(keys=keys, values=values, lengths=lengths)


@contextlib.contextmanager
def quiet_torchrec() -> Iterator[None]:
    """Silences TorchRec's planner warnings while sharding (they go to stderr at every build)."""
    logger = logging.getLogger("torchrec")
    level = logger.level
    logger.setLevel(logging.ERROR)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            yield
        finally:
            logger.setLevel(level)


def init_single_process_group() -> None:
    """A gloo process group of one rank on a free local port (DMP needs one)."""
    import torch.distributed as dist

    if dist.is_initialized():
        return
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)


class TorchRecLoop:
    """One training step per call, mirroring ``Trainer.step_loss`` (no random negatives) with a
    TorchRec EBC in place of our tables.

    ``mode``: ``"adam"`` (tables in the dense Adam), ``"in_backward"``
    (``apply_optimizer_in_backward(RowWiseAdagrad)``, unsharded) or ``"dmp"`` (the same, sharded
    by ``DistributedModelParallel``: fbgemm's fused TBE).
    """

    def __init__(
        self, model: RetrievalModel, data: TrainingData, cfg: TrainConfig, mode: str
    ) -> None:
        from torchrec.optim import RowWiseAdagrad
        from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward

        self.model, self.data, self.mode = model, data, mode
        ebc = make_ebc(model)
        dense = [p for n, p in model.named_parameters() if not n.startswith("tables.")]
        if mode == "adam":
            self.ebc = ebc
            dense += list(ebc.parameters())
        else:
            apply_optimizer_in_backward(
                RowWiseAdagrad, ebc.parameters(), {"lr": cfg.table_lr, "eps": 1e-8}
            )
            self.ebc = self._shard(ebc) if mode == "dmp" else ebc
        self.opt = torch.optim.Adam(dense, lr=cfg.lr, weight_decay=cfg.weight_decay)
        self.losses: list[float] = []

    @staticmethod
    def _shard(ebc: nn.Module) -> nn.Module:
        from torchrec.distributed.model_parallel import DistributedModelParallel

        init_single_process_group()
        rows = ebc.state_dict()
        with quiet_torchrec():
            dmp = DistributedModelParallel(ebc, device=torch.device("cpu"))
        dmp.load_state_dict(rows)  # sharding re-initializes the rows
        return dmp

    def pooled(self, features: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Pooled ``{feature: [B, D]}`` from the EBC (DMP returns an awaitable)."""
        out = self.ebc(to_kjt(features))
        if self.mode == "dmp":
            out = out.wait()
        return out.to_dict()

    def step(self, idx: np.ndarray) -> None:
        """One step on the pairs ``idx [B]``: forward, backward, optimizer step."""
        model, data = self.model, self.data
        items = data.item_ids[idx]
        batch = batch_inputs(model, data, idx)
        cols = torch.from_numpy(items)
        user = model.user_sparse(batch)
        pooled = self.pooled({**user, **{f: t[cols] for f, t in data.item_features.items()}})
        q = model.user_tower_on(pooled, batch)
        v = model.item_tower_on(pooled)
        logits = in_batch_logits(q, v, model.config.temperature, model.head)
        lq = column_log_q(data.item_log_q[cols], len(cols), 0, data.item_log_q.shape[0])
        loss = sampled_softmax_loss(logits, cols, cols, lq)
        self.opt.zero_grad()
        loss.backward()
        self.opt.step()
        self.losses.append(loss.item())


# ---- loops as timed units ----------------------------------------------------------------------
@dataclasses.dataclass
class Loop:
    """A named training loop: ``step(idx)`` trains one batch; ``losses()`` every step's loss."""

    name: str
    step: Callable[[np.ndarray], None]
    losses: Callable[[], list[float]]
    times: list[float] = dataclasses.field(default_factory=list)
    """Seconds of each timed round."""
    loads: list[float] = dataclasses.field(default_factory=list)
    """Other processes' CPU share during each timed round."""


def ours(model: RetrievalModel, prep: Prepared, cfg: TrainConfig, name: str) -> Loop:
    """Our ``Trainer`` on a copy of ``model``; ``cfg.table_optimizer`` picks the tables' path."""
    trainer = Trainer(copy.deepcopy(model), prep.train, cfg)
    trainer.model.train()
    history: list[float] = []

    def step(idx: np.ndarray) -> None:
        trainer._train_step(idx)
        history.append(trainer.losses[-1])  # fit() clears losses each epoch; we never do

    return Loop(name, step, lambda: history)


def torchrec_loop(model: RetrievalModel, prep: Prepared, cfg: TrainConfig, mode: str) -> Loop:
    """A :class:`TorchRecLoop` on a copy of ``model``."""
    names = {"adam": BASELINE, "in_backward": TORCHREC_IN_BACKWARD, "dmp": TORCHREC_DMP}
    m = copy.deepcopy(model)
    m.train()
    loop = TorchRecLoop(m, prep.train, cfg, mode)
    return Loop(names[mode], loop.step, lambda: loop.losses)


def build_loops(model: RetrievalModel, prep: Prepared, cfg: TrainConfig, dmp: bool) -> list[Loop]:
    """Every loop, from the same initial model."""
    fused = cfg.updated(table_optimizer="rowwise_adagrad")
    adam = cfg.updated(table_optimizer="adam")
    loops = [
        torchrec_loop(model, prep, cfg, "adam"),
        ours(model, prep, fused, OURS_FUSED),
        ours(model, prep, adam, OURS_ADAM),
        torchrec_loop(model, prep, cfg, "in_backward"),
    ]
    if dmp:
        loops.append(torchrec_loop(model, prep, cfg, "dmp"))
    return loops


def run_interleaved(
    loops: list[Loop], warm: list[np.ndarray], timed: list[np.ndarray], rounds: int
) -> float:
    """Warm-up steps, then ``rounds`` chunks of ``timed``: each round times every loop on the
    same chunk, the order rotated by one per round; each timed chunk also records the CPU share
    other processes took meanwhile. Returns that share over the whole timed part."""
    for loop in loops:
        for idx in warm:
            loop.step(idx)
    chunks = np.array_split(np.arange(len(timed)), rounds)
    total = OtherLoad()
    total.start()
    for r, chunk in enumerate(chunks):
        order = loops[r % len(loops) :] + loops[: r % len(loops)]
        for loop in order:
            load = OtherLoad()
            load.start()
            t0 = time.perf_counter()
            for i in chunk:
                loop.step(timed[i])
            loop.times.append(time.perf_counter() - t0)
            loop.loads.append(load.stop())
    return total.stop()


# ---- results ----------------------------------------------------------------------------------
def median_or_none(values: list[float], least: int = 3) -> float | None:
    """Median of ``values``, or ``None`` when there are fewer than ``least``."""
    return statistics.median(values) if len(values) >= least else None


def summarize(
    loop: Loop, base: Loop, chunk_steps: list[int], batch: int, warmup: int, quiet: float
) -> dict[str, Any]:
    """Throughput, ratio against ``base`` and losses of one loop.

    Ratios are paired: each round's baseline time over this loop's time on the same chunk, the
    median over rounds; "quiet" keeps the rounds where others took < ``quiet`` of the CPU (in
    both chunks, for ratios)."""
    per_round = [n * batch / t for n, t in zip(chunk_steps, loop.times, strict=True)]
    ratios = [b / t for b, t in zip(base.times, loop.times, strict=True)]
    calm = [x < quiet for x in loop.loads]
    both = [c and x < quiet for c, x in zip(calm, base.loads, strict=True)]
    losses = loop.losses()
    window = max(1, len(losses[warmup:]) // 10)
    return {
        "loop": loop.name,
        "ex_per_s_median": statistics.median(per_round),
        "ex_per_s_overall": sum(chunk_steps) * batch / sum(loop.times),
        "ex_per_s_quiet_median": median_or_none(
            [x for x, c in zip(per_round, calm, strict=True) if c]
        ),
        "quiet_rounds": sum(calm),
        "vs_baseline": statistics.median(ratios),
        "vs_baseline_quiet": median_or_none([x for x, c in zip(ratios, both, strict=True) if c]),
        "ms_per_step_median": statistics.median(
            [t / n * 1e3 for n, t in zip(chunk_steps, loop.times, strict=True)]
        ),
        "ex_per_s_rounds": per_round,
        "other_load_rounds": loop.loads,
        "loss_first_tenth": float(np.mean(losses[warmup : warmup + window])),
        "loss_last_tenth": float(np.mean(losses[-window:])),
        "steps": len(losses),
    }


def bench_dataset(name: str, args: argparse.Namespace) -> dict[str, Any]:
    """All loops on one dataset; rows carry ratios against the TorchRec EBC + Adam baseline."""
    t0 = time.perf_counter()
    ds = load_dataset(name, args)
    prep = prepare(ds)
    torch.manual_seed(args.seed)
    model = RetrievalModel(prep.config)
    cfg = TrainConfig(batch_size=args.batch, seed=args.seed, progress=False)
    loops = build_loops(model, prep, cfg, dmp=not args.no_dmp)
    pairs = len(prep.train.user_ids)
    batches = step_batches(pairs, args.batch, args.warmup + args.steps, args.seed)
    warm, timed = batches[: args.warmup], batches[args.warmup :]
    other = run_interleaved(loops, warm, timed, args.rounds)
    chunk_steps = [len(c) for c in np.array_split(np.arange(len(timed)), args.rounds)]
    base = next(loop for loop in loops if loop.name == BASELINE)
    rows = [
        summarize(loop, base, chunk_steps, len(timed[0]), args.warmup, args.quiet) for loop in loops
    ]
    tables = {t.name: [t.num_embeddings, t.dim, t.pooling] for t in table_configs(prep.config)}
    return {
        "dataset": ds.name,
        "users": ds.num_users,
        "items": ds.num_items,
        "train_pairs": pairs,
        "batch": len(timed[0]),
        "warmup_steps": len(warm),
        "timed_steps": len(timed),
        "tables": tables,
        "other_load": other,
        "seconds": time.perf_counter() - t0,
        "rows": rows,
    }


def fmt(value: float | None, spec: str, suffix: str = "") -> str:
    """``value`` formatted (then ``suffix``), or a dash for ``None``."""
    return "–" if value is None else format(value, spec) + suffix


def markdown(result: dict[str, Any]) -> str:
    """One dataset's table."""
    rows = result["rows"]
    rounds = len(rows[0]["ex_per_s_rounds"])
    lines = [
        f"**{result['dataset']}** ({result['users']} users, {result['items']} items, "
        f"{result['train_pairs']} train pairs, batch {result['batch']}, {result['timed_steps']} steps "
        f"per loop in {rounds} rounds; other processes took {result['other_load']:.0%} of the CPU)",
        "",
        "| loop | pairs/s | ms/step | vs TorchRec EBC + Adam | pairs/s, quiet rounds (n) "
        "| vs baseline, quiet | loss, first 10% of steps | loss, last 10% |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['loop']} | {r['ex_per_s_median']:,.0f} | {r['ms_per_step_median']:.1f} "
            f"| {r['vs_baseline']:.2f}x | {fmt(r['ex_per_s_quiet_median'], ',.0f')} "
            f"({r['quiet_rounds']}) | {fmt(r['vs_baseline_quiet'], '.2f', 'x')} "
            f"| {r['loss_first_tenth']:.3f} | {r['loss_last_tenth']:.3f} |"
        )
    return "\n".join(lines)


def environment(args: argparse.Namespace) -> dict[str, Any]:
    """Versions, threads and machine load at the start."""
    import fbgemm_gpu
    import torchrec

    return {
        "date": datetime.date.today().isoformat(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torchrec": torchrec.__version__,
        "fbgemm_gpu": fbgemm_gpu.__version__,
        "threads": args.threads,
        "cpus": os.cpu_count(),
        "loadavg_start": os.getloadavg(),
        "argv": sys.argv[1:],
    }


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    env = environment(args)
    results = []
    for name in args.datasets.split(","):
        result = bench_dataset(name.strip(), args)
        print(markdown(result) + "\n", flush=True)
        results.append(result)
    env["loadavg_end"] = os.getloadavg()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"environment": env, "results": results}, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
