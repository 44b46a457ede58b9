"""Locust users for a recserve target; the request mix is :mod:`workload` (beside this file).

- :class:`RecommendGrpcUser`: gRPC ``Recommend`` (``serving/protos/recommend.proto``) over a
  gevent-patched grpc channel; a client interceptor reports every call to locust.
- :class:`KServeHttpUser`: KServe v2 JSON ``POST /v2/models/{model}/infer``.

A request whose answer is ``partial`` (a shard or embedding server missed its deadline) counts
as a failure. Name one user class per run; ``--host`` is ``HOST:PORT`` for gRPC and
``http://HOST:PORT`` for HTTP. From the repository root::

    locust -f loadtest/locustfile.py --headless -u 20 -r 5 -t 60s --host 127.0.0.1:8001 \\
        --model-repo runs/demo/model_repo --csv runs/loadtest/locust RecommendGrpcUser

Custom arguments (or their environment variables): ``--model-repo`` (``RECSERVE_MODEL_REPO``,
required), ``--model`` (``RECSERVE_MODEL``; default: the repository's only model),
``--user-pool``, ``--think-time``, ``--request-timeout``, ``--mix-seed``.
"""

from __future__ import annotations

import contextlib
import csv
import itertools
import random
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import grpc
import grpc.experimental.gevent as grpc_gevent
from locust import FastHttpUser, User, events, task
from locust.env import Environment
from locust.exception import LocustError
from locust.stats import PERCENTILES_TO_REPORT, StatsCSV

from common.atomic import atomic_writer
from loadtest.shape import read_model_shape
from loadtest.workload import OWN_CONNECTION, RequestMix, kserve_body, recommend_request
from serving.protos.recommend_pb2 import RecommendResponse
from serving.protos.recommend_pb2_grpc import RecommenderStub

# locust has monkey-patched the standard library by now; grpc must use gevent too, or each
# call would block every user of this process
grpc_gevent.init_gevent()

_MIX: list[RequestMix] = []
"""The run's request mix, built once per locust process when it starts (``events.init``)."""
_USER_NUMBER = itertools.count()


class PartialAnswerError(Exception):
    """The target answered without every shard or embedding server."""


ARGUMENTS: tuple[tuple[str, type, Any, str], ...] = (
    ("--model-repo", str, "", "model repository: its published config.json shapes the requests"),
    ("--model", str, "", "model name (default: the repository's only model)"),
    ("--user-pool", int, 10_000, "synthetic end users, drawn Zipf-like"),
    ("--think-time", float, 0.0, "mean seconds between a user's requests (exponential; 0: none)"),
    ("--request-timeout", float, 10.0, "seconds before a request counts as failed"),
    ("--mix-seed", int, 0, "seed of the end users' features and the request streams"),
)
"""recserve's own locust arguments: (flag, type, default, help)."""


@events.init_command_line_parser.add_listener
def add_arguments(parser: Any) -> None:
    """Adds :data:`ARGUMENTS`; each also reads ``RECSERVE_<NAME>`` (``--model-repo``:
    ``RECSERVE_MODEL_REPO``), configargparse's env_var."""
    for flag, kind, default, text in ARGUMENTS:
        env = "RECSERVE_" + flag[2:].replace("-", "_").upper()
        parser.add_argument(flag, type=kind, default=default, env_var=env, help=f"{text} (${env})")


@events.init.add_listener
def build_mix(environment: Environment, **_kwargs: Any) -> None:
    """Reads the model's shape from the repository and builds the request mix."""
    opts = environment.parsed_options
    if opts is None or not opts.model_repo:
        raise SystemExit("locustfile: --model-repo (or RECSERVE_MODEL_REPO) is required")
    try:
        shape = read_model_shape(Path(opts.model_repo), opts.model or None)
    except ValueError as e:
        raise SystemExit(f"locustfile: {e}") from None
    _MIX[:] = [RequestMix(shape, pool=opts.user_pool, seed=opts.mix_seed)]
    KServeHttpUser.network_timeout = opts.request_timeout


@events.quitting.add_listener
def final_csv(environment: Environment, **_kwargs: Any) -> None:
    """locust rewrites its CSVs once a second, not at exit, so they can miss the last second: at
    shutdown (after ``--run-time`` the users have stopped) replace the stats, failures and
    exceptions CSVs with final ones, written by locust's own ``StatsCSV``."""
    opts = environment.parsed_options
    if opts is None or not opts.csv_prefix:
        return
    stats_csv = StatsCSV(environment, PERCENTILES_TO_REPORT)
    for suffix, write in (
        ("stats", stats_csv.requests_csv),
        ("failures", stats_csv.failures_csv),
        ("exceptions", stats_csv.exceptions_csv),
    ):
        path = Path(f"{opts.csv_prefix}_{suffix}.csv")
        # atomic: locust's writer keeps its handle on the old file, so its next write cannot
        # mix with ours
        with atomic_writer(path, "w", newline="") as f:
            write(csv.writer(f))


def mix() -> RequestMix:
    return _MIX[0]


def think_time(user: User) -> float:
    """Seconds until the user's next request: exponential around ``--think-time``."""
    mean = user.environment.parsed_options.think_time
    return random.expovariate(1.0 / mean) if mean > 0 else 0.0


def client_rng() -> random.Random:
    """Each locust user's own request stream (reproducible for a given --mix-seed)."""
    return random.Random(mix().seed * 7919 + next(_USER_NUMBER))


# ---- gRPC --------------------------------------------------------------------------------------
class LocustInterceptor(grpc.UnaryUnaryClientInterceptor):
    """Fires locust's ``request`` event for every unary call: its name (``label``, else the
    method), time, response size, and the error (an RpcError, or what ``check`` finds wrong
    with a successful response)."""

    def __init__(self, environment: Environment, check: Callable[[Any], Exception | None]):
        self.environment = environment
        self.check = check
        self.label = ""
        """Set by the user before each call (one user = one greenlet, calls in sequence)."""

    def intercept_unary_unary(
        self, continuation: Any, client_call_details: Any, request: Any
    ) -> Any:
        start = time.perf_counter()
        call = continuation(client_call_details, request)
        response, length, exception = None, 0, None
        try:
            response = call.result()
            length = response.ByteSize()
            exception = self.check(response)
        except grpc.RpcError as e:
            exception = e
        self.environment.events.request.fire(
            request_type="grpc",
            name=self.label or client_call_details.method,
            response_time=(time.perf_counter() - start) * 1000,
            response_length=length,
            response=response,
            context={},
            exception=exception,
        )
        return call


def partial_error(response: RecommendResponse) -> Exception | None:
    if response.partial:
        return PartialAnswerError(f"partial answer (missing: {', '.join(response.missing)})")
    return None


class RecommendGrpcUser(User):
    """Calls ``Recommender.Recommend`` in a loop; ``--host HOST:PORT``."""

    wait_time = think_time

    def __init__(self, environment: Environment):
        super().__init__(environment)
        if not self.host:
            raise LocustError("--host: the gRPC listener's HOST:PORT is required")
        self.interceptor = LocustInterceptor(environment, check=partial_error)
        # each user its own TCP connection (a server group spreads connections, not calls)
        channel = grpc.insecure_channel(self.host, options=[OWN_CONNECTION])
        self.channel = grpc.intercept_channel(channel, self.interceptor)
        self.stub = RecommenderStub(self.channel)
        self.rng = client_rng()

    @task
    def recommend(self) -> None:
        req = mix().draw(self.rng)
        self.interceptor.label = f"Recommend {req.label}"
        # a failed call raises here, after the interceptor has reported it as a failure
        with contextlib.suppress(grpc.RpcError):
            self.stub.Recommend(
                recommend_request(req, mix().shape.name),
                timeout=self.environment.parsed_options.request_timeout,
            )

    def on_stop(self) -> None:
        self.channel.close()


# ---- KServe v2 over HTTP -----------------------------------------------------------------------
class KServeHttpUser(FastHttpUser):
    """POSTs KServe v2 JSON to ``/v2/models/{model}/infer`` in a loop; ``--host http://H:P``."""

    wait_time = think_time
    connection_timeout = 5.0

    def on_start(self) -> None:
        self.rng = client_rng()
        self.path = f"/v2/models/{mix().shape.name}/infer"

    @task
    def infer(self) -> None:
        req = mix().draw(self.rng)
        with self.client.post(
            self.path, json=kserve_body(req), name=f"infer {req.label}", catch_response=True
        ) as resp:
            if resp.status_code != 200:
                detail = resp.text or repr(resp.error)
                resp.failure(f"HTTP {resp.status_code}: {detail[:200]}")
                return
            params = resp.json().get("parameters") or {}
            if params.get("partial"):
                resp.failure(f"partial answer (missing: {params.get('missing', '')})")
            else:
                resp.success()
