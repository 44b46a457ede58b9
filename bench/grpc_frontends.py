"""Which gRPC front end costs a request the least CPU when a batching thread computes the answer:
grpcio's thread-pool server (what ``recserve serve`` runs) or ``grpc.aio`` (an asyncio loop that
awaits the batcher's future), beside a no-op that answers a fixed empty reply (``bench/serving.py``'s
anchor). Each server parses the request's history, hands it to one batching thread (a queue and
``concurrent.futures`` futures, as ``serving/engine/batching.py``) that answers 100 ids and scores,
and renders them; no model runs, so what differs is the front end alone.

    .venv/bin/python bench/grpc_frontends.py --concurrency 1,8 --rounds 2

Every server runs in a process of its own, in turn, loaded by ``bench/loadgen.py``'s closed loop
(its own process); the rows give q/s, p50/p99 and the CPU per request of the server and of the
load generator over the measured window.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import multiprocessing
import subprocess
import sys
import threading
from concurrent import futures
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

import grpc
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # before bench/: its serving.py

from loadgen import closed_loop, ready

from serving.protos import recommend_pb2 as pb
from serving.protos import recommend_pb2_grpc as pb_grpc

MODES = ("noop", "sync", "aio")


class Batcher:
    """One thread that answers whatever is queued, as one batch, with 100 ids and scores."""

    def __init__(self) -> None:
        self.queue: collections.deque[futures.Future[Any]] = collections.deque()
        self.cond = threading.Condition()
        threading.Thread(target=self._loop, daemon=True).start()

    def submit(self, history: np.ndarray) -> futures.Future[Any]:
        fut: futures.Future[Any] = futures.Future()
        with self.cond:
            self.queue.append(fut)
            self.cond.notify()
        return fut

    def _loop(self) -> None:
        answer = (np.arange(100, dtype=np.int64), np.linspace(1, 0, 100, dtype=np.float32))
        while True:
            with self.cond:
                while not self.queue:
                    self.cond.wait()
                batch = list(self.queue)
                self.queue.clear()
            for fut in batch:
                fut.set_result(answer)


def parse(req: Any) -> np.ndarray:
    return np.fromiter(req.history, dtype=np.int64, count=len(req.history))


def render(answer: tuple[np.ndarray, np.ndarray]) -> Any:
    ids, scores = answer
    return pb.RecommendResponse(item_ids=ids.tolist(), scores=scores.tolist(), model="m", version=1)


def serve(mode: str) -> None:
    """Runs one server on a free loopback port; prints the address, then serves until killed."""
    batcher = Batcher()

    class Noop(pb_grpc.RecommenderServicer):
        reply = pb.RecommendResponse(model="m", version=1)

        def Recommend(self, request: Any, context: Any) -> Any:
            return self.reply

    class Sync(pb_grpc.RecommenderServicer):
        def Recommend(self, request: Any, context: Any) -> Any:
            return render(batcher.submit(parse(request)).result())

    class Aio(pb_grpc.RecommenderServicer):
        async def Recommend(self, request: Any, context: Any) -> Any:
            return render(await asyncio.wrap_future(batcher.submit(parse(request))))

    if mode in ("noop", "sync"):
        server = grpc.server(futures.ThreadPoolExecutor(64))
        pb_grpc.add_RecommenderServicer_to_server(Noop() if mode == "noop" else Sync(), server)
        port = server.add_insecure_port("127.0.0.1:0")
        server.start()
        print(f"127.0.0.1:{port}", flush=True)
        server.wait_for_termination()
        return

    async def main() -> None:
        server = grpc.aio.server()
        pb_grpc.add_RecommenderServicer_to_server(Aio(), server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        print(f"127.0.0.1:{port}", flush=True)
        await server.wait_for_termination()

    asyncio.run(main())


def load(address: str, concurrency: int, seconds: float, pid: int) -> dict[str, Any]:
    requests = [pb.RecommendRequest(history=list(range(i, i + 20)), k=100) for i in range(64)]
    return closed_loop(
        address,
        lambda channel: pb_grpc.RecommenderStub(channel).Recommend,
        requests,
        concurrency,
        1.0,
        seconds,
        cpu_pids={"server": pid},
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--serve", choices=MODES, help=argparse.SUPPRESS)  # the server process
    p.add_argument("--modes", default=",".join(MODES))
    p.add_argument("--concurrency", default="1,8")
    p.add_argument("--seconds", type=float, default=5.0)
    p.add_argument("--rounds", type=int, default=2, help="every mode again, in turn")
    p.add_argument("--out", type=Path)
    args = p.parse_args()
    if args.serve:
        serve(args.serve)
        return
    rows = []
    spawn = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(1, mp_context=spawn) as pool:
        pool.submit(ready).result()
        for rnd in range(args.rounds):
            for mode in args.modes.split(","):
                cmd = [sys.executable, __file__, "--serve", mode]
                proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
                try:
                    address = proc.stdout.readline().strip()  # type: ignore[union-attr]
                    for c in (int(v) for v in args.concurrency.split(",")):
                        got = pool.submit(load, address, c, args.seconds, proc.pid).result()
                        answered = got["qps"] * args.seconds
                        row = {
                            "round": rnd,
                            "mode": mode,
                            "concurrency": c,
                            "qps": round(got["qps"]),
                            "p50_ms": round(got["p50_ms"], 2),
                            "p99_ms": round(got["p99_ms"], 2),
                            "server_cpu_ms": round(got["cpu_s"]["server"] * 1e3 / answered, 3),
                            "loadgen_cpu_ms": round(got["cpu_s"]["loadgen"] * 1e3 / answered, 3),
                        }
                        print(json.dumps(row), flush=True)
                        rows.append(row)
                finally:
                    proc.kill()
                    proc.wait()
    if args.out is not None:
        args.out.write_text(json.dumps({"argv": sys.argv[1:], "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
