"""Where one call's time goes across the engine split: stamps at each stage of a one-row call.

The engine (host + batcher + ``EngineLoop``) runs in a child process, the client
(``ZmqEngineClient``) in this one, over IPC sockets as ``serve model --frontends N`` joins
them; ``time.perf_counter`` is ``CLOCK_MONOTONIC`` on Linux, the same clock in both processes,
so the stamps of the two sides line up. Calls go one at a time (C = 1), so the i-th stamp of
every stage belongs to the i-th call. The stages, wrapped here without touching product code:

    submit         caller -> ``client.submit`` returns (encode + send)
    to engine      -> the engine's I/O thread starts ``_submit`` (IPC + wake-up)
    admit          -> ``_submit`` returns (decode + edge check + batcher queue)
    to batcher     -> the batcher's ``run_batch`` starts (the batcher thread's wake-up)
    forward        ``run_batch``
    answer         -> the answer is encoded (the futures' callbacks + encode, batcher thread)
    to client      -> the client's receiving thread starts decoding (send + IPC + wake-up)
    complete       -> the futures are completed (decode + set_result)
    to caller      -> the caller's ``result()`` returns (its wake-up)

The engine's own in-process call (``InProcessEngine.submit`` -> ``result()``) is timed first in
the child as the baseline. Prints medians in microseconds and writes them as JSON with ``--out``::

    .venv/bin/python bench/split_profile.py --calls 2000 --out /tmp/split_profile.json
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # before bench/: its serving.py is not the serving package

from bench_model import trained_model, user_inputs  # noqa: E402

STAGES = (
    "submit",
    "to engine",
    "admit",
    "to batcher",
    "forward",
    "answer",
    "to client",
    "complete",
    "to caller",
)


def stamped(fn: Callable[..., Any], at_start: list[float] | None, at_end: list[float] | None):
    """``fn`` with a ``perf_counter`` stamp appended to ``at_start`` / ``at_end`` per call."""

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        if at_start is not None:
            at_start.append(time.perf_counter())
        try:
            return fn(*args, **kwargs)
        finally:
            if at_end is not None:
                at_end.append(time.perf_counter())

    return wrapper


def engine_child(root: str, addresses: tuple[str, str], calls: int, conn: Any) -> None:
    """The engine process: the in-process baseline, then the ``EngineLoop`` with stamps; sends
    ``{"baseline": [s...], "stamps": {stage: [t...]}}`` once told to stop."""
    from serving.engine import wire
    from serving.engine.batching import BatchPolicy
    from serving.engine.client import InProcessEngine
    from serving.engine.host import ModelHost
    from serving.engine.metrics import ServingMetrics
    from serving.engine.state import make_batcher
    from serving.engine.zmq_engine import EngineLoop
    from serving.repository.repository import ModelRepository

    metrics = ServingMetrics("bench")
    host = ModelHost(ModelRepository(Path(root)), "bench", poll_s=0.0, metrics=metrics)
    host.start(poll=False)
    engine = InProcessEngine(host, make_batcher(host, BatchPolicy(32, 0.0, 1024), metrics))
    reqs = conn.recv()
    baseline = []
    for i in range(calls):
        t0 = time.perf_counter()
        engine.submit([reqs[i % len(reqs)]])[0].result()
        baseline.append(time.perf_counter() - t0)
    s: dict[str, list[float]] = {k: [] for k in ("recv", "admitted", "b0", "b1", "encoded")}
    loop = EngineLoop(engine, *addresses)
    loop._submit = stamped(loop._submit, s["recv"], s["admitted"])  # type: ignore[method-assign]
    wire.encode_results = stamped(wire.encode_results, None, s["encoded"])  # the loop reads it
    engine.batcher.run_batch = stamped(engine.batcher.run_batch, s["b0"], s["b1"])
    loop.start()
    conn.send("ready")
    conn.recv()  # the client is done
    conn.send({"baseline": baseline, "stamps": s})
    loop.stop()
    engine.batcher.stop(drain=False, timeout=5.0)
    loop.close()


def client_side(addresses: tuple[str, str], reqs: list[Any], calls: int) -> dict[str, list[float]]:
    """``calls`` one-row calls through a ``ZmqEngineClient`` with stamps (after 200 warm-up)."""
    from serving.engine import wire
    from serving.engine.zmq_client import ZmqEngineClient

    client = ZmqEngineClient(*addresses, name="profile")
    client.start()
    assert client.wait_ready(60), "engine not ready"
    s: dict[str, list[float]] = {k: [] for k in ("t0", "sent", "recv", "set", "woke")}
    decode = wire.decode_results
    for i in range(200):  # warm-up: unstamped
        client.submit([reqs[i % len(reqs)]])[0].result()
    wire.decode_results = stamped(decode, s["recv"], None)
    for i in range(calls):
        s["t0"].append(time.perf_counter())
        fut = client.submit([reqs[i % len(reqs)]])[0]
        s["sent"].append(time.perf_counter())
        fut.add_done_callback(lambda _: s["set"].append(time.perf_counter()))
        fut.result()
        s["woke"].append(time.perf_counter())
    wire.decode_results = decode
    client.close()
    return s


def stages(engine: dict[str, list[float]], client: dict[str, list[float]]) -> dict[str, float]:
    """Median microseconds of each stage (the engine's stamps: the last ``calls`` of each)."""
    n = len(client["t0"])
    e = {k: np.array(v[-n:]) for k, v in engine.items()}
    c = {k: np.array(v) for k, v in client.items()}
    # a done callback added after completion runs at once: "set" is then the caller's own stamp
    seq = [c["t0"], c["sent"], e["recv"], e["admitted"], e["b0"], e["b1"], e["encoded"], c["recv"]]
    seq += [np.minimum(c["set"], c["woke"]), c["woke"]]
    out = {
        name: float(np.median(b - a) * 1e6)
        for name, a, b in zip(STAGES, seq[:-1], seq[1:], strict=True)
    }
    out["total"] = float(np.median(c["woke"] - c["t0"]) * 1e6)
    return out


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--calls", type=int, default=2000)
    p.add_argument("--items", type=int, default=20_000)
    p.add_argument("--users", type=int, default=2_000)
    p.add_argument("--epochs", type=int, default=0)
    p.add_argument("--out", type=Path)
    args = p.parse_args(argv)
    from serving.repository.repository import ModelRepository
    from serving.types import RecRequest

    prep, model = trained_model(args.users, args.items, args.epochs)
    reqs = []
    for u in range(200):
        hist, cat, dense = user_inputs(prep, u)
        reqs.append(RecRequest(history=hist, categorical=cat, dense=dense, k=100))
    with tempfile.TemporaryDirectory() as tmp:
        ModelRepository(Path(tmp)).publish("bench", model, parameters={"torch_threads": "1"})
        addresses = (f"ipc://{tmp}/in", f"ipc://{tmp}/out")
        ctx = mp.get_context("spawn")  # a forked torch (OpenMP) child dies
        here, there = ctx.Pipe()
        child = ctx.Process(target=engine_child, args=(tmp, addresses, args.calls, there))
        child.start()
        here.send(reqs)
        assert here.poll(300) and here.recv() == "ready", "the engine child did not start"
        client = client_side(addresses, reqs, args.calls)
        here.send("done")
        assert here.poll(60), "the engine child did not answer"
        got = here.recv()
        child.join(10)
    result = stages(got["stamps"], client)
    result["in-process engine"] = float(np.median(got["baseline"]) * 1e6)
    result["load average"] = os.getloadavg()[0]
    for name, us in result.items():
        print(f"{name:>18}: {us:8.1f}" + (" us" if name != "load average" else ""))
    if args.out:
        args.out.write_text(json.dumps({"calls": args.calls, "median_us": result}, indent=1))


if __name__ == "__main__":
    main()
