"""A served request whose remote rows miss the cache fetches them in its own (handler) thread,
right after it is queued: its batch takes those rows and sends no fetch of its own, and the
answer equals the model with every table local."""

from __future__ import annotations

import threading

import numpy as np
import torch

from retrieval.model import table_specs
from retrieval.tiering import tier_model
from serving.types import RecResult
from sharded_tables.planner import Budgets, plan
from sharded_tables.specs import DType, Tier
from support.tiny_model import Tiny, start_server


class Servers:
    """In-process embedding servers: packed rows by table; records the thread of each call."""

    def __init__(self, packed: dict[str, torch.Tensor]):
        self.packed = packed
        self.threads: list[str] = []

    def fetch(self, ids_by_table, timeout=None):
        self.threads.append(threading.current_thread().name)
        return {t: self.packed[t][ids] for t, ids in ids_by_table.items()}


def test_a_request_fetches_its_missing_rows_ahead_in_its_own_thread(tiny: Tiny, serve_config):
    specs = table_specs(tiny.model.config, DType.FP32)
    item = next(s for s in specs if s.name == "item")
    budgets = Budgets(
        device=0,
        host=sum(s.bytes() for s in specs) - item.bytes() + 4096,
        remote_per_server=item.bytes() + 4096,
        remote_servers=1,
        cache_fraction=0.01,
        cache_whole_max=0,  # hot rows, not a whole copy
    )
    placement = plan(specs, budgets)
    assert placement.placement("item").tier is Tier.REMOTE
    assert placement.placement("item").cache_rows < item.rows
    tiered, rows = tier_model(tiny.model, placement=placement)
    servers = Servers(rows)
    tiered.tables.remote = servers
    server = start_server(serve_config(), tiered)
    try:
        for user in (5, 9):
            servers.threads.clear()
            result = server.state.recommend(tiny.request(user, k=10), timeout=10.0)
            assert isinstance(result, RecResult)
            want_ids, want_scores = tiny.expected(tiny.model, np.array([user]), 10)
            np.testing.assert_array_equal(result.item_ids, want_ids[0])
            np.testing.assert_allclose(result.scores, want_scores[0], rtol=1e-5, atol=1e-5)
            assert servers.threads == [threading.current_thread().name]  # ahead, not the batch
        assert tiered.tables.remote_stats().fetched_ahead > 0
    finally:
        server.drain_and_stop(5.0)
