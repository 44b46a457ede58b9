"""Multi-process training benchmark: our ``Trainer`` step as 1 process (its fused fbgemm fast
path), as 1 process with TorchRec's DMP tables, and as W processes under DMP (gloo, CPU).

Every case trains the SAME model (``retrieval/model.py``, one seed) on the SAME global batches
(``--batch`` pairs a step, each of W ranks taking ``batch / W``), through
``Trainer._train_step``: the step ``torchrun -m recserve train`` runs. Cases:

* ``ours fused, 1 process``: ``sharded_tables.trainable.TrainableTables`` (one fbgemm
  training-TBE call a step), the single-process path;
* ``DMP, 1 process``: the same Trainer with its tables swapped for
  ``retrieval.training.dmp_tables.DMPTables`` planned for one rank (TorchRec's
  ``DistributedModelParallel``, fused TBE, a process group of one);
* ``DMP, W processes``: ``--world`` processes (``torch.multiprocessing``, gloo), the plan of
  ``[train.sharding]``'s default (table-wise); examples/s counts the global batch.

Threads: ``--threads`` per process (default 1), so W processes use W cores: the scaling a
torchrun job buys. (A 2-thread intra-op pool in one process measured here swung 10x between
rounds on this shared 2-core machine, as the other processes took a core from it.) Each case runs ``--rounds``
times, the order rotating, in fresh processes; a round warms up (``--warmup`` steps) then times
``--steps`` steps; the median round is reported, with the CPU share other processes took
meanwhile (``timing.OtherLoad``).

Run from the repository root::

    .venv/bin/python bench/train_dmp.py --small     # ~1 min
    .venv/bin/python bench/train_dmp.py             # synthetic 20k users x 50k items

Writes ``--out`` (default ``bench/results/train_dmp.json``, ``train_dmp_small.json`` with
``--small``) and prints a markdown table.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import socket
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from timing import OtherLoad
from train import step_batches

from retrieval.data import SyntheticConfig, generate
from retrieval.model import RetrievalModel, table_configs
from retrieval.training.distributed import DistContext
from retrieval.training.dmp_tables import DMPTables
from retrieval.training.prepare import prepare
from retrieval.training.sharding import make_sharder, plan_sharding
from retrieval.training.train import TrainConfig, Trainer

FUSED, DMP_ONE = "ours fused, 1 process", "DMP, 1 process"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--small", action="store_true", help="2k users x 5k items, fewer steps")
    p.add_argument("--users", type=int, help="synthetic users (default 20k, 2k with --small)")
    p.add_argument("--items", type=int, help="synthetic items (default 50k, 5k with --small)")
    p.add_argument("--batch", type=int, default=512, help="pairs per step (all ranks)")
    p.add_argument("--steps", type=int, help="timed steps a round (default 60, 20 --small)")
    p.add_argument("--warmup", type=int, default=5, help="untimed steps a round first")
    p.add_argument("--rounds", type=int, default=3, help="fresh runs of every case")
    p.add_argument("--world", type=int, default=2, help="processes of the multi-process case")
    p.add_argument("--threads", type=int, default=1, help="torch threads per process")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)
    args.users = args.users or (2_000 if args.small else 20_000)
    args.items = args.items or (5_000 if args.small else 50_000)
    args.steps = args.steps or (20 if args.small else 60)
    if args.out is None:
        name = "train_dmp_small.json" if args.small else "train_dmp.json"
        args.out = Path("bench/results") / name
    return args


def make_trainer(args: argparse.Namespace, case: str, world: int) -> Trainer:
    """The case's Trainer on this rank (every rank builds the same data and model)."""
    prep = prepare(
        generate(SyntheticConfig(num_users=args.users, num_items=args.items, seed=args.seed))
    )
    torch.manual_seed(args.seed)
    model = RetrievalModel(prep.config)
    cfg = TrainConfig(batch_size=args.batch, seed=args.seed, progress=False)
    ctx = DistContext(dist.get_rank(), world) if world > 1 else None
    trainer = Trainer(model, prep.train, cfg, dist_ctx=ctx)
    if case == DMP_ONE:  # Trainer keeps one process on its fast path: swap DMP in here
        configs = table_configs(model.config)
        sharder = make_sharder(cfg.table_optimizer, cfg.table_lr)
        plan = plan_sharding(configs, cfg.sharding, 1, sharder)
        trainer.model.tables = DMPTables(configs, plan, sharder, model.tables.float_weights())
    trainer.model.train()
    return trainer


def worker(rank: int, args: argparse.Namespace, case: str, world: int, port: int, out: str) -> None:
    """One rank of one round: warm up, time ``--steps`` steps, rank 0 writes the timing."""
    torch.set_num_threads(args.threads)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world
    )
    try:
        trainer = make_trainer(args, case, world)
        pairs = len(trainer.data.user_ids)
        batches = step_batches(pairs, args.batch, args.warmup + args.steps, args.seed)
        for idx in batches[: args.warmup]:
            trainer._train_step(idx)
        dist.barrier()
        load = OtherLoad()
        load.start()
        t0 = time.perf_counter()
        for idx in batches[args.warmup :]:
            trainer._train_step(idx)
        dist.barrier()
        seconds = time.perf_counter() - t0
        if rank == 0:
            losses = trainer.losses[-args.steps :]
            Path(out).write_text(
                json.dumps({"seconds": seconds, "other_load": load.stop(), "loss_last": losses[-1]})
            )
    finally:
        dist.destroy_process_group()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def run_case(args: argparse.Namespace, case: str, world: int, tmp: Path) -> dict[str, Any]:
    out = tmp / "round.json"
    mp.spawn(worker, args=(args, case, world, free_port(), str(out)), nprocs=world)
    result: dict[str, Any] = json.loads(out.read_text())
    result["ex_per_s"] = args.steps * args.batch / result["seconds"]
    return result


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    cases = [(FUSED, 1), (DMP_ONE, 1), (f"DMP, {args.world} processes", args.world)]
    rounds: dict[str, list[dict[str, Any]]] = {name: [] for name, _ in cases}
    tmp = args.out.parent / ".train_dmp_tmp"
    tmp.mkdir(parents=True, exist_ok=True)
    load_start = os.getloadavg()
    for r in range(args.rounds):
        for name, world in cases[r % len(cases) :] + cases[: r % len(cases)]:
            rounds[name].append(run_case(args, name, world, tmp))
            print(f"round {r + 1} {name}: {rounds[name][-1]['ex_per_s']:,.0f} ex/s", flush=True)
    base = statistics.median(x["ex_per_s"] for x in rounds[FUSED])
    rows = []
    for name, world in cases:
        speeds = [x["ex_per_s"] for x in rounds[name]]
        rows.append(
            {
                "case": name,
                "processes": world,
                "threads_per_process": args.threads,
                "ex_per_s_median": statistics.median(speeds),
                "ex_per_s_rounds": speeds,
                "vs_ours_fused": statistics.median(speeds) / base,
                "other_load_rounds": [x["other_load"] for x in rounds[name]],
                "loss_last_step": [x["loss_last"] for x in rounds[name]],
            }
        )
    env = {
        "date": datetime.date.today().isoformat(),
        "torch": torch.__version__,
        "cpus": os.cpu_count(),
        "loadavg_start": load_start,
        "loadavg_end": os.getloadavg(),
        "argv": sys.argv[1:],
    }
    result = {"environment": env, "users": args.users, "items": args.items,
              "batch": args.batch, "steps": args.steps, "rounds": rows}  # fmt: skip
    args.out.write_text(json.dumps(result, indent=2))
    (tmp / "round.json").unlink(missing_ok=True)
    tmp.rmdir()
    print(markdown(result))
    print(f"wrote {args.out}")


def markdown(result: dict[str, Any]) -> str:
    lines = [
        f"synthetic {result['users']} users x {result['items']} items, batch {result['batch']}, "
        f"{result['steps']} timed steps a round",
        "",
        "| case | processes x threads | ex/s (median) | rounds | vs ours fused | others' CPU share |",
        "|---|---|---|---|---|---|",
    ]
    for r in result["rounds"]:
        rounds = ", ".join(f"{x:,.0f}" for x in r["ex_per_s_rounds"])
        loads = ", ".join(f"{x:.0%}" for x in r["other_load_rounds"])
        lines.append(
            f"| {r['case']} | {r['processes']} x {r['threads_per_process']} "
            f"| {r['ex_per_s_median']:,.0f} | {rounds} | {r['vs_ours_fused']:.2f}x | {loads} |"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    main()
