"""The request mix of the load tests, built from a published model's shape; no locust here, so
it is testable in any process and shared by ``loadtest/locustfile.py`` and ``recserve soak``
(a :class:`Request` becomes a gRPC ``RecommendRequest`` or a KServe v2 JSON body here).

- **users**: a pool of ``pool`` synthetic users drawn Zipf-like (rank ``r`` with probability
  ∝ 1/r), so a few users come back often, as on a real site. A user's features are a pure
  function of ``(seed, user)``: the same user always sends the same history, categorical codes
  and dense features.
- **history**: 1 .. ``history_len`` items, longer for the busier users, items drawn Zipf-like
  over the catalog (popular items recur across users).
- **K**: 10 / 50 / 100 / 500 with weights 4 / 3 / 2 / 1, capped at the catalog size.
- **filters**: none (60 %), broad (30 %: about half the values of the attribute with the most
  values), narrow (10 %: one value of each of up to two attributes, ANDed).
- **raw ids**: a model with id maps (``ModelShape.raw_item_ids``) is sent the history in its
  raw item ids (``raw_history``), as its users would.

Example::

    mix = RequestMix(read_model_shape(Path("runs/demo/model_repo")), pool=10_000, seed=0)
    rng = random.Random(1)
    req = mix.draw(rng)        # Request(user_id="u17", history=[...], k=50, filter="", ...)
    kserve_body(req)           # {"inputs": [{"name": "history", ...}, ...]}
"""

from __future__ import annotations

import math
import random
import re
from dataclasses import dataclass
from typing import Any

from loadtest.shape import ModelShape
from serving.protos.recommend_pb2 import RecommendRequest

OWN_CONNECTION = ("grpc.use_local_subchannel_pool", 1)
"""A channel option: this channel opens its own TCP connection. gRPC otherwise shares one
connection among the channels of a process to the same address, and a group of server
processes sharing a port (``SO_REUSEPORT``) spreads connections, not calls: a load generator's
simulated clients must each be a connection, as real clients are."""

K_WEIGHTS = ((10, 4.0), (50, 3.0), (100, 2.0), (500, 1.0))
FILTER_WEIGHTS = (("none", 6.0), ("broad", 3.0), ("narrow", 1.0))
MAX_K = 10_000
"""The servers' own cap on K (``serving.types.MAX_K``)."""
# a bare word of the filter grammar (retrieval/filters.py); other attribute names are skipped
_WORD = re.compile(r"[A-Za-z0-9_.+\-:/]+")


@dataclass(frozen=True)
class Request:
    """One ``Recommend`` call: a user's features, K, a filter (``""``: none)."""

    user_id: str
    history: list[int]
    """Item ids, newest first (H of them)."""
    categorical: list[int]
    """One code per categorical feature, in the model's order (F)."""
    dense: list[float]
    """Dd dense features."""
    k: int
    filter: str
    label: str
    """``k=<K> filter=<none|broad|narrow>``: the request's class in locust's statistics."""
    raw_history: list[str] | None = None
    """``history`` in the model's raw item ids (a model with id maps): what is sent then."""


def zipf_rank(rng: random.Random, n: int) -> int:
    """A rank in ``[0, n)`` with probability ∝ 1/(rank + 1) (log-uniform: O(1), no table)."""
    return min(int(n ** rng.random()) - 1, n - 1)


def quote(value: str) -> str | None:
    """A filter value as a quoted token; ``None`` when it holds both kinds of quote."""
    if '"' not in value:
        return f'"{value}"'
    return f"'{value}'" if "'" not in value else None


class RequestMix:
    """Draws :class:`Request` s for ``shape`` (see the module docstring for the mix)."""

    def __init__(self, shape: ModelShape, pool: int = 10_000, seed: int = 0):
        assert pool >= 1, pool
        self.shape = shape
        self.pool = pool
        self.seed = seed
        k_weights: dict[int, float] = {}
        for k, w in K_WEIGHTS:  # a K past the catalog asks for the whole catalog
            capped = min(k, shape.num_items, MAX_K)
            k_weights[capped] = k_weights.get(capped, 0.0) + w
        self.ks, self._k_weights = list(k_weights), list(k_weights.values())
        self.attributes = {
            a: [q for q in map(quote, values) if q is not None]
            for a, values in shape.item_attributes.items()
            if _WORD.fullmatch(a) and values
        }
        self.attributes = {a: v for a, v in self.attributes.items() if v}
        self._users: dict[int, tuple[list[int], list[int], list[float]]] = {}

    def user(self, u: int) -> tuple[list[int], list[int], list[float]]:
        """User ``u``'s (history, categorical, dense): fixed for a given seed."""
        cached = self._users.get(u)
        if cached is not None:
            return cached
        s = self.shape
        rng = random.Random(self.seed * 1_000_003 + u)
        # busier users (low rank) have longer histories: length ∝ H / (1 + log(1 + u))
        longest = max(1, round(s.history_len / (1.0 + math.log1p(u))))
        history = [zipf_rank(rng, s.num_items) for _ in range(rng.randint(1, longest))]
        categorical = [rng.randrange(size) for size in s.user_features.values()]
        dense = [round(rng.gauss(0.0, 1.0), 4) for _ in range(s.dense_dim)]
        self._users[u] = (history, categorical, dense)
        return self._users[u]

    def filter(self, rng: random.Random, kind: str) -> str:
        """A filter of selectivity ``kind`` (none / broad / narrow) over the model's attributes."""
        if kind == "none" or not self.attributes:
            return ""
        if kind == "broad":
            attr = max(self.attributes, key=lambda a: len(self.attributes[a]))
            values = self.attributes[attr]
            chosen = rng.sample(values, max(1, math.ceil(len(values) / 2)))
            return f"{attr} in {{{', '.join(chosen)}}}"
        attrs = rng.sample(sorted(self.attributes), min(2, len(self.attributes)))
        return " and ".join(f"{a} = {rng.choice(self.attributes[a])}" for a in attrs)

    def draw(self, rng: random.Random) -> Request:
        """The next request of a client whose random stream is ``rng``."""
        u = zipf_rank(rng, self.pool)
        history, categorical, dense = self.user(u)
        k = rng.choices(self.ks, weights=self._k_weights)[0]
        kind = rng.choices([f for f, _ in FILTER_WEIGHTS], [w for _, w in FILTER_WEIGHTS])[0]
        text = self.filter(rng, kind)
        raw = self.shape.raw_item_ids
        raw_history = None if raw is None else [raw[i] for i in history]
        label = f"k={k} filter={kind}"
        return Request(f"u{u}", history, categorical, dense, k, text, label, raw_history)


def recommend_request(req: Request, model: str = "") -> RecommendRequest:
    """The gRPC ``Recommend`` message of ``req`` (``model`` empty: the server's default)."""
    return RecommendRequest(
        user_id=req.user_id,
        history=req.history if req.raw_history is None else [],
        raw_history=req.raw_history or [],
        categorical=req.categorical,
        dense=req.dense,
        k=req.k,
        filter=req.filter,
        model=model,
    )


def kserve_body(req: Request) -> dict[str, Any]:
    """The KServe v2 JSON inference request of ``req`` (one row: every shape is ``[1, ...]``)."""
    inputs: list[dict[str, Any]] = [
        {"name": "history", "datatype": "INT64", "shape": [1, len(req.history)],
         "data": req.history},
        {"name": "categorical", "datatype": "INT64", "shape": [1, len(req.categorical)],
         "data": req.categorical},
        {"name": "dense", "datatype": "FP32", "shape": [1, len(req.dense)], "data": req.dense},
        {"name": "k", "datatype": "INT32", "shape": [1, 1], "data": [req.k]},
    ]  # fmt: skip
    if req.filter:
        inputs.append(
            {"name": "filter", "datatype": "BYTES", "shape": [1, 1], "data": [req.filter]}
        )
    if req.raw_history is not None:  # the user's own ids instead of the dense ones
        shape = [1, len(req.raw_history)]
        inputs[0] = {"name": "raw_history", "datatype": "BYTES", "shape": shape,
                     "data": req.raw_history}  # fmt: skip
    return {"id": req.user_id, "inputs": inputs}
