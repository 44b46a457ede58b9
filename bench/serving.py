"""Serving benchmark: ``recserve serve model`` against a no-op grpcio server, a naive unbatched server
and the real Triton Inference Server -- one run, one model, one load generator.

One synthetic catalog (``--items``, default 100k; ``--small``: 20k) and one model, trained
``--epochs`` (default 2: a few seconds) with its IVF index's nprobe tuned for recall 0.97 on
users' queries as ``recserve train`` does (``--epochs 0``: untrained weights, the workload of the
first runs, where IVF needs ~40 % of the lists), published once into a model
repository. Every system serves it on 127.0.0.1 as its own process:

(a) ``noop``: a grpcio ``Recommend`` servicer that returns a fixed empty response (the
    framework's ceiling), thread pool as large as ours (``--grpc-workers``);
(b) ``naive``: a grpcio ``Recommend`` servicer that runs the model's forward for each request
    on its own (``ModelRunner.run([request])``: no batcher), same thread pool;
(c) ``triton``: nvidia-pytriton's bundled ``tritonserver`` on the same repository through our
    Python backend (``model.py`` of the version, dynamic batching from its ``config.pbtxt``,
    ``--processes`` model instances), called with KServe v2 ``ModelInfer`` (raw gRPC stubs of
    tritonclient); skipped, with the reason recorded, when it cannot start;
(d) ``ours``: ``recserve serve model --processes N`` (default: one per core, the torch threads shared
    out) with its default batching (from ``config.pbtxt``), called with ``Recommend``;
    ``ours-1proc``: one serving process (what each of the N adds); ``ours-kserve``: the
    group called with KServe v2 ``ModelInfer`` (the same protocol as Triton); and
    ``ours-split``: ``recserve serve model --frontends F`` (one engine process with the one
    model copy, F front-end processes on the port; ``--frontends``, default 0: the cores left
    after the engine's), called with ``Recommend``.

The load generator is a separate process: closed loop, C clients (``--concurrency``), each a
thread with its own channel and connection, sending the next request as soon as the last answers; 1 query per
request, K = 100, unfiltered (``--filter 50|5|0.5``: every request filtered, passing about
that % of the catalog; the share measured is recorded), the same users in the same order for every system. Reported per
(system, C): q/s, p50, p99, errors, and the share of the 2 cores used by processes outside this
run. All systems are up at once and take turns at each C (noop, naive, triton, ours at C = 1,
then at the next C): this machine's speed drifts over minutes, and systems measured one after
the other would carry that drift into their ratios. The headline is each system's max q/s at
p99 <= ``--p99-ms`` (the highest q/s among the concurrency levels whose p99 is within it) and ours / each of them against the targets
(>= 0.5x noop, >= 3x naive, >= 1.0x Triton). Answers of naive, Triton and ours are checked
against the in-process forward (ids equal) for a few users.

Latency vs catalog size (``--sizes``, default 1M; ``--small``: none): ours at C=1 (p50/p99)
and C=8 (q/s), each size its own model, repository and server; the main size reuses the sweep.

Run from the repository root::

    .venv/bin/python bench/serving.py --small     # 20k items, ~2 min
    .venv/bin/python bench/serving.py             # 100k items + 1M sizes, ~6 min on 2 cores
    # serving on a GPU vs on the CPU, same model and load (issue 20): once per device
    .venv/bin/python bench/serving.py --small --systems ours-1proc --device cuda --out gpu.json
    .venv/bin/python bench/serving.py --small --systems ours-1proc --device cpu --out cpu.json

Writes ``--out`` (default ``bench/results/serving.json``, ``serving_small.json`` with
``--small``) and prints markdown tables. Every server process is stopped in a ``finally`` (its
process group, so Triton's backend stubs too); the JSON records that none was left.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import multiprocessing
import os
import platform
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from loadgen import closed_loop, ready  # noqa: E402
from server_procs import (  # noqa: E402
    Running,
    Unavailable,
    processes_mentioning,
    start,
    start_triton,
    stop,
    triton_stats,
    wait_ready,
    wait_triton,
)
from serving_report import PROTOCOL, render, summarize  # noqa: E402
from serving_workload import (  # noqa: E402
    FILTERS,
    MODEL,
    Workload,
    build_workload,
    publish,
    threads_each,
)
from timing import OtherLoad, int_list, percentiles  # noqa: E402

from serving.protos import recommend_pb2, recommend_pb2_grpc  # noqa: E402

RUN_MARKER = "recserve-serving-bench-"
"""Prefix of this run's temp folder; every server's command line names it."""
SYSTEMS = ("noop", "naive", "ours", "ours-1proc", "ours-kserve", "ours-split", "triton")
"""Run in this order: Triton last, since its backend stubs linger after it stops and would
load the machine while the next system is measured (seen as 16-33 % other load)."""


# ---- arguments ----------------------------------------------------------------------------------


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command line (see the module docstring)."""
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--small", action="store_true", help="20k items, shorter cases, no --sizes")
    p.add_argument("--items", type=int, help="catalog size (default 100k, 20k with --small)")
    p.add_argument("--users", type=int, default=2000, help="synthetic users")
    p.add_argument(
        "--epochs",
        type=int,
        default=2,
        help="training epochs of the served model (0: untrained weights, IVF's worst case)",
    )
    p.add_argument("--request-users", type=int, default=256, help="distinct users in requests")
    p.add_argument(
        "--concurrency", type=int_list, default=[1, 4, 8, 16, 32], help="closed-loop clients"
    )
    p.add_argument("--k", type=int, default=100, help="results per request")
    p.add_argument(
        "--filter",
        choices=list(FILTERS),
        default="none",
        help="every request's filter, by the %% of the catalog it passes (serving_workload.py)",
    )
    p.add_argument("--seconds", type=float, help="measured seconds per load case (default 5; 2)")
    p.add_argument("--warmup-s", type=float, default=1.0, help="untimed seconds per load case")
    p.add_argument("--p99-ms", type=float, default=20.0, help="latency budget of the headline")
    p.add_argument("--threads", type=int, default=2, help="torch threads of every model server")
    p.add_argument(
        "--processes",
        type=int,
        default=len(os.sched_getaffinity(0)),
        help="ours' serving processes and Triton's model instances (default: the cores)",
    )
    p.add_argument(
        "--frontends",
        type=int,
        default=0,
        help="ours-split's front-end processes (0: the cores left after the engine's)",
    )
    p.add_argument("--grpc-workers", type=int, default=64, help="gRPC threads (ours' default)")
    p.add_argument(
        "--device",
        default="cpu",
        help="where ours runs the model (`recserve serve --device`: cpu, cuda, cuda:N); run the "
        "bench once per device for the GPU-vs-CPU comparison of issue 20",
    )
    p.add_argument("--sizes", type=int_list, help="extra catalog sizes for ours (default 1M)")
    p.add_argument("--systems", default=",".join(SYSTEMS), help="which systems to run")
    p.add_argument("--check-users", type=int, default=4, help="users checked vs in-process")
    p.add_argument("--startup-timeout-s", type=float, default=180.0, help="per server start")
    p.add_argument("--out", type=Path, help="JSON results (default bench/results/serving*.json)")
    args = p.parse_args(argv)
    args.items = args.items or (20_000 if args.small else 100_000)
    args.seconds = args.seconds or (2.0 if args.small else 5.0)
    if args.sizes is None:
        args.sizes = [] if args.small else [1_000_000]
    args.sizes = [s for s in args.sizes if s != args.items]
    args.systems = [s.strip() for s in args.systems.split(",") if s.strip()]
    if unknown := set(args.systems) - set(SYSTEMS):
        p.error(f"--systems: unknown {sorted(unknown)}; choose from {SYSTEMS}")
    if args.out is None:
        name = "serving_small.json" if args.small else "serving.json"
        args.out = ROOT / "bench" / "results" / name
    if args.k > args.items or args.request_users > args.users:
        p.error("need --k <= --items and --request-users <= --users")
    return args


def inprocess_latency(work: Workload, n: int = 200) -> dict[str, float]:
    """p50/p99 ms of one-user ``model(batch, k)`` calls in this process (no serving at all)."""
    batches = [work.prep.user_batch(work.users[i : i + 1]) for i in range(len(work.users))]
    lat = []
    with torch.inference_mode():
        for i in range(n + 10):
            t0 = time.perf_counter()
            work.model(batches[i % len(batches)], work.k)
            if i >= 10:
                lat.append((time.perf_counter() - t0) * 1e3)
    p50, p99 = percentiles(lat)
    return {"p50_ms": p50, "p99_ms": p99}


@contextlib.contextmanager
def server(system: str, repo: Path, tmp: Path, args: argparse.Namespace) -> Iterator[Running]:
    """Starts ``system`` on ``repo``; yields it once ready; always stops it."""
    log = tmp / f"{system}-{repo.name}.log"
    if system in ("noop", "naive"):
        cmd = [sys.executable, str(Path(__file__).with_name("serving_baselines.py")), system]
        cmd += ["--repo", str(repo)]
        cmd += ["--threads", str(args.threads), "--grpc-workers", str(args.grpc_workers)]
        run = start(cmd, log)
    elif system.startswith("ours"):
        cmd = [sys.executable, "-m", "recserve", "serve", "model", "--model-repo", str(repo)]
        cmd += ["--model", MODEL, "--grpc-port", "0", "--device", args.device]
        if system == "ours-split":  # the engine's torch threads as one of ours'; front ends: 1
            cmd += ["--frontends", str(args.frontends), "--torch-threads", str(threads_each(args))]
        elif system == "ours-1proc":
            cmd += ["--torch-threads", str(args.threads)]
        else:
            cmd += ["--processes", str(args.processes), "--torch-threads", str(threads_each(args))]
        run = start(cmd, log)
    else:
        run = start_triton(repo, tmp, log)
    try:
        if system == "triton":
            wait_triton(run, MODEL, args.startup_timeout_s)
        else:
            wait_ready(run, args.startup_timeout_s)
        yield run
    finally:
        stop(run)


# ---- the load generator (a separate process) ----------------------------------------------------
def _call(protocol: str, channel: grpc.Channel) -> Callable[[bytes], Any]:
    """``send(serialized request)`` for ``protocol`` (the request is parsed once, up front)."""
    if protocol == "recommend":
        return recommend_pb2_grpc.RecommenderStub(channel).Recommend
    from tritonclient.grpc import service_pb2_grpc

    return service_pb2_grpc.GRPCInferenceServiceStub(channel).ModelInfer


def _parse(protocol: str, payloads: list[bytes]) -> list[Any]:
    if protocol == "recommend":
        return [recommend_pb2.RecommendRequest.FromString(b) for b in payloads]
    from tritonclient.grpc import service_pb2

    return [service_pb2.ModelInferRequest.FromString(b) for b in payloads]


def run_load(
    protocol: str,
    address: str,
    payloads: list[bytes],
    concurrency: int,
    warmup_s: float,
    seconds: float,
) -> dict[str, Any]:
    """The load generator process: ``protocol``'s calls in a closed loop (``bench/loadgen.py``)."""
    return closed_loop(
        address,
        lambda channel: _call(protocol, channel),
        _parse(protocol, payloads),
        concurrency,
        warmup_s,
        seconds,
    )


# ---- what else ran -----------------------------------------------------------------------------
def top_other_processes(n: int = 5) -> list[str]:
    """The busiest processes right now (``ps``), as a record of what shared the machine."""
    out = subprocess.run(
        ["ps", "-eo", "pcpu,etime,args", "--sort=-pcpu"], capture_output=True, text=True
    ).stdout.splitlines()
    return [line.strip()[:160] for line in out[1 : n + 1]]


# ---- the runs -----------------------------------------------------------------------------------


def check_ids(system: str, address: str, work: Workload, users: np.ndarray) -> bool:
    """Whether ``system``'s answers for ``users`` have the in-process forward's ids."""
    want = work.expected_ids(users)
    with grpc.insecure_channel(address) as channel:
        send = _call(PROTOCOL[system], channel)
        got = []
        for u in users:
            if PROTOCOL[system] == "recommend":
                req = recommend_pb2.RecommendRequest.FromString(work.recommend(int(u)))
                got.append(np.array(send(req, timeout=60).item_ids, np.int64))
            else:
                from tritonclient.grpc import service_pb2

                req = service_pb2.ModelInferRequest.FromString(work.model_infer(int(u)))
                res = send(req, timeout=60)
                i = [o.name for o in res.outputs].index("item_ids")
                got.append(np.frombuffer(res.raw_output_contents[i], np.int64))
    return all(g.shape == w.shape and bool((g == w).all()) for g, w in zip(got, want, strict=True))


def load_cases(
    system: str,
    run: Running,
    work: Workload,
    levels: list[int],
    pool: ProcessPoolExecutor,
    loadgen_pid: int,
    args: argparse.Namespace,
) -> list[dict[str, Any]]:
    """Every concurrency level of ``levels`` against a running ``system``."""
    payloads = work.payloads(PROTOCOL[system])
    rows = []
    for c in levels:
        load = OtherLoad({os.getpid(), loadgen_pid}, {run.proc.pid})
        load.start()
        got = pool.submit(
            run_load, PROTOCOL[system], run.address, payloads, c, args.warmup_s, args.seconds
        ).result()
        row = {"system": system, "items": work.model.index.ntotal, "concurrency": c, **got}
        rows.append({**row, "other_load": load.stop()})
        print(json.dumps(rows[-1]), flush=True)
    return rows


def start_system(
    stack: contextlib.ExitStack,
    system: str,
    repo: Path,
    tmp: Path,
    work: Workload,
    args: argparse.Namespace,
) -> tuple[dict[str, Any], Running | None]:
    """Starts ``system`` (stopped when ``stack`` closes) and checks its answers -> (its result
    so far, the running server). Never raises for a system that cannot run: the result says
    why it was skipped, and the server is None."""
    started = time.perf_counter()
    try:
        run = stack.enter_context(server(system, repo, tmp, args))
        out: dict[str, Any] = {"startup_s": time.perf_counter() - started, **run.extra}
        print(f"{system} up at {run.address} in {out['startup_s']:.1f} s", flush=True)
        if system != "noop":
            out["ids_equal"] = check_ids(system, run.address, work, work.users[: args.check_users])
        return {**out, "rows": []}, run
    except Unavailable as e:
        print(f"{system} skipped: {e}", file=sys.stderr, flush=True)
        return {"skipped": str(e)[-2000:], "rows": []}, None


def systems_in_turns(
    repo: Path,
    tmp: Path,
    work: Workload,
    pool: ProcessPoolExecutor,
    loadgen_pid: int,
    args: argparse.Namespace,
) -> dict[str, dict[str, Any]]:
    """Every system of ``--systems`` up at once, then each concurrency level against each
    system in turn (noop at C, ours at C, ..., then the next C): this machine's speed drifts
    by up to 1.5x over minutes, which systems measured one after the other would carry into
    their ratios. An idle server's own CPU shows in "CPU used by others"."""
    systems: dict[str, dict[str, Any]] = {}
    with contextlib.ExitStack() as stack:
        running: dict[str, Running] = {}
        for s in args.systems:
            systems[s], run = start_system(stack, s, repo, tmp, work, args)
            if run is not None:
                running[s] = run
        for c in args.concurrency:
            for s, run in running.items():
                systems[s]["rows"] += load_cases(s, run, work, [c], pool, loadgen_pid, args)
        if "triton" in running:
            systems["triton"]["triton_stats"] = triton_stats(running["triton"].address, MODEL)
    return systems


def size_cases(
    tmp: Path, pool: ProcessPoolExecutor, loadgen_pid: int, args: argparse.Namespace
) -> list[dict[str, Any]]:
    """Ours at C=1 and C=8 on each extra catalog size (own model, repository and server)."""
    rows = []
    for items in args.sizes:
        work, build_s = build_workload(items, args)
        repo = publish(work, tmp / f"repo-{items}", args)
        inproc = inprocess_latency(work)
        with server("ours", repo, tmp, args) as run:
            cases = load_cases("ours", run, work, [1, 8], pool, loadgen_pid, args)
        rows.append(size_row(items, build_s, inproc, cases, work))
        del work
    return rows


def size_row(
    items: int,
    build_s: float,
    inproc: dict[str, float],
    cases: list[dict[str, Any]],
    work: Workload,
) -> dict[str, Any]:
    """One row of the catalog-size table from ours' C=1 and C=8 cases."""
    by_c = {r["concurrency"]: r for r in cases}
    one, eight = by_c.get(1, {}), by_c.get(8, {})
    idx = work.model.index
    return {
        "items": items, "nlist": idx.nlist, "nprobe": idx.config.nprobe, "build_s": build_s,
        "inprocess_p50_ms": inproc["p50_ms"], "inprocess_p99_ms": inproc["p99_ms"],
        "c1_p50_ms": one.get("p50_ms"), "c1_p99_ms": one.get("p99_ms"), "c1_qps": one.get("qps"),
        "c8_qps": eight.get("qps"), "c8_p50_ms": eight.get("p50_ms"),
        "c8_p99_ms": eight.get("p99_ms"),
        "other_load": max(one.get("other_load", 0.0), eight.get("other_load", 0.0)),
    }  # fmt: skip


# ---- main ---------------------------------------------------------------------------------------
def environment(work: Workload, args: argparse.Namespace) -> dict[str, Any]:
    """Machine, versions, the index's shape and what else was running at the start."""
    idx = work.model.index
    load = OtherLoad()
    load.start()
    time.sleep(1.0)
    return {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "cpu_count": os.cpu_count(), "cpu": platform.processor() or platform.machine(),
        "python": platform.python_version(), "torch": torch.__version__,
        "grpc": grpc.__version__, "items": idx.ntotal, "dim": idx.dim, "nlist": idx.nlist,
        "nprobe": idx.config.nprobe, "codes": idx.config.codes, "epochs": args.epochs,
        "filter": work.filter, "filter_passes": work.passing(),
        "argv": sys.argv[1:], "other_load_at_start": load.stop(), "loadavg_at_start": os.getloadavg(),
        "top_processes_at_start": top_other_processes(),
    }  # fmt: skip


def run_all(args: argparse.Namespace, results: dict[str, Any]) -> None:
    """Builds and publishes the main model, then every system, then the catalog sizes."""
    work, build_s = build_workload(args.items, args)
    results["environment"] = environment(work, args)
    print(f"{args.items:,} items, K={args.k}, model built in {build_s:.1f} s", flush=True)
    print(json.dumps(results["environment"]), flush=True)
    spawn = multiprocessing.get_context("spawn")
    with (
        tempfile.TemporaryDirectory(prefix=RUN_MARKER) as tmp_name,
        ProcessPoolExecutor(1, mp_context=spawn) as pool,
    ):
        tmp = Path(tmp_name)
        try:
            loadgen_pid = pool.submit(ready).result()
            repo = publish(work, tmp / "repo", args)
            inproc = inprocess_latency(work)
            results["inprocess"] = inproc
            results["systems"] = systems_in_turns(repo, tmp, work, pool, loadgen_pid, args)
            ours = results["systems"].get("ours", {}).get("rows", [])
            results["sizes"] = [size_row(args.items, build_s, inproc, ours, work)] if ours else []
            del work
            results["sizes"] += size_cases(tmp, pool, loadgen_pid, args)
        finally:
            results["leftover_servers"] = processes_mentioning(tmp_name)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    t0 = time.perf_counter()
    config = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}
    results: dict[str, Any] = {"config": config}
    run_all(args, results)
    results["summary"] = summarize(results, args.p99_ms)
    results["wall_s"] = time.perf_counter() - t0
    print("\n" + render(results))
    print(f"\nserver processes left by this run: {results['leftover_servers'] or 'none'}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=2))
    print(f"wrote {args.out} ({results['wall_s']:.0f} s)")


if __name__ == "__main__":
    main()
