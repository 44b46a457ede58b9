"""The serving benchmark's baseline servers, each its own process (``bench/serving.py`` starts
them): (a) ``noop``, a grpcio ``Recommend`` servicer with a fixed empty answer; (b) ``naive``, one
forward per request, unbatched; (c) ``noop-shard`` (``bench/sharding.py``), a grpcio ``Shard``
servicer whose ``Search`` answers a fixed ``--answer-width``-candidate answer: what the hop from
a router to a shard costs with no search. Run as ``python bench/serving_baselines.py KIND --repo
DIR``; prints the ready line (``common/ready.py``, role ``baseline``) and serves until SIGTERM."""

from __future__ import annotations

import argparse
import signal
import sys
from concurrent import futures
from pathlib import Path
from typing import Any

import grpc
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from serving_workload import MODEL

from common.ready import announce
from common.stop_signals import StopSignals
from serving.protos import recommend_pb2, recommend_pb2_grpc, shard_pb2, shard_pb2_grpc


class NoopServicer(recommend_pb2_grpc.RecommenderServicer):
    """(a): the same fixed empty answer to every call; no parsing beyond gRPC's own."""

    RESPONSE = recommend_pb2.RecommendResponse(model=MODEL, version=1)

    def Recommend(self, request: Any, context: grpc.ServicerContext) -> Any:
        return self.RESPONSE


class NoopShardServicer(shard_pb2_grpc.ShardServicer):
    """(c): one query's answer of ``width`` candidates (the bytes a real shard sends), fixed."""

    def __init__(self, width: int):
        self.response = shard_pb2.SearchResponse(
            width=width, ids=bytes(8 * width), approx=bytes(4 * width), scores=bytes(4 * width)
        )

    def Search(self, request: Any, context: grpc.ServicerContext) -> Any:
        return self.response


class NaiveServicer(recommend_pb2_grpc.RecommenderServicer):
    """(b): parse -> one forward for this request alone (``ModelRunner.run([req])``) -> render.
    Every gRPC thread runs its own forward; nothing is batched or queued."""

    def __init__(self, repo: Path):
        from serving.engine.runner import ModelRunner
        from serving.repository.repository import ModelRepository

        loaded = ModelRepository(repo).load(MODEL)
        self.runner = ModelRunner(loaded.model, MODEL, loaded.version)
        self.runner.warmup()

    def Recommend(self, request: Any, context: grpc.ServicerContext) -> Any:
        from serving.frontends.recommend_grpc import parse_recommend, render_recommend

        (out,) = self.runner.run([parse_recommend(request, None)])
        if isinstance(out, Exception):
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(out))
        return render_recommend(out)


def serve_baseline(args: argparse.Namespace) -> None:
    """Runs (a) or (b) on a free port: prints the ready line (``common/ready.py``, role
    ``baseline``), serves until SIGTERM."""
    torch.set_num_threads(args.threads)
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=args.grpc_workers))
    if args.serve == "noop-shard":
        shard_pb2_grpc.add_ShardServicer_to_server(NoopShardServicer(args.answer_width), server)
    else:
        servicer = NoopServicer() if args.serve == "noop" else NaiveServicer(args.repo)
        recommend_pb2_grpc.add_RecommenderServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    stop = StopSignals(signal.SIGTERM, signal.SIGINT)
    announce("baseline", grpc=f"127.0.0.1:{port}", system=args.serve)
    stop.wait()
    server.stop(1).wait()


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("serve", choices=["noop", "naive", "noop-shard"], help="which baseline")
    p.add_argument("--repo", type=Path, help="the model repository (naive)")
    p.add_argument("--threads", type=int, default=2, help="torch threads")
    p.add_argument("--grpc-workers", type=int, default=64, help="gRPC threads")
    p.add_argument("--answer-width", type=int, default=100, help="noop-shard: candidates")
    serve_baseline(p.parse_args(argv))


if __name__ == "__main__":
    main()
