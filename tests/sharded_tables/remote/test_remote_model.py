"""The foundation model with its item table on 2 real embedding servers: same results as local.

Also: the plan's server folders feed ``recserve serve embeddings`` as written, a hashed table's
learned rows are served from the servers' keyed tables, and a dead server fails the request fast.
"""

from __future__ import annotations

import time

import numpy as np
import pytest
import torch

from retrieval.artifact import load_model, save_model
from retrieval.data import SyntheticConfig, generate
from retrieval.model import RetrievalModel, table_specs
from retrieval.tiering import tier_model
from retrieval.training.prepare import prepare
from retrieval.training.train import TrainConfig, train
from sharded_tables.export import remote_routing, write_server_folders
from sharded_tables.planner import Budgets, plan
from sharded_tables.remote.client import RemoteLookupError, RemoteTables
from sharded_tables.specs import DType, TableSpec, Tier
from sharded_tables.tiered import TieredEmbeddingCollection

pytestmark = pytest.mark.multiproc  # real embedding-server processes


@pytest.fixture(scope="module")
def trained():
    ds = generate(SyntheticConfig(num_users=300, num_items=1200, seed=11))
    prep = prepare(ds, history_len=10)
    model = RetrievalModel(prep.config)
    train(model, prep.train, TrainConfig(epochs=1, batch_size=256, progress=False))
    model.build_index(prep.train.item_features, ds.item_attributes)
    return prep, model.eval()


def test_remote_item_table_serves_the_same_recommendations(trained, servers, tmp_path):
    prep, model = trained
    specs = table_specs(model.config, DType.INT8)
    item_bytes = next(s for s in specs if s.name == "item").bytes()
    # The host budget holds everything but the item table: it goes to 2 servers.
    budgets = Budgets(
        device=0,
        host=sum(s.bytes() for s in specs) - item_bytes + 4096,
        remote_per_server=item_bytes,
        remote_servers=2,
        cache_fraction=0.01,
    )
    placement = plan(specs, budgets)
    item = placement.placement("item")
    assert item.tier is Tier.REMOTE and len(item.servers) == 2
    local, _ = tier_model(model, Budgets(device=0, host=1 << 30), dtype=DType.INT8)
    tiered, remote_rows = tier_model(model, placement=placement)
    folders = write_server_folders(placement, specs, remote_rows, tmp_path / "shards")
    procs = servers.start(*[(folders[i], 0) for i in sorted(folders)])
    client = RemoteTables(remote_routing(placement, specs, [p.address for p in procs]))
    tiered.tables.remote = client
    batch = prep.user_batch(np.arange(64), [None] * 32 + ["region in {eu, na}"] * 32)
    with torch.inference_mode():
        want = local(batch, 50)
        got = tiered(batch, 50)
    assert torch.equal(got[0], want[0])
    torch.testing.assert_close(got[1], want[1])
    # the same folder loads with the servers attached
    save_model(tiered, tmp_path / "m")
    again = load_model(tmp_path / "m", remote=client)
    with torch.inference_mode():
        assert torch.equal(again(batch, 50)[0], want[0])
    # a dead server: the request fails fast, naming the server
    procs[0].proc.kill()
    procs[0].proc.wait(5)
    cold = prep.user_batch(np.arange(64, 128))
    t0 = time.perf_counter()
    with pytest.raises(RemoteLookupError, match=procs[0].address), torch.inference_mode():
        tiered(cold, 50)
    assert time.perf_counter() - t0 < 3.0
    client.close()


def test_a_hashed_table_on_the_servers_answers_its_learned_rows(servers, tmp_path):
    specs = [TableSpec("query", 4, 8, DType.FP16, hashed=True)]
    budgets = Budgets(device=0, host=0, remote_per_server=1 << 20, remote_servers=2)
    placement = plan(specs, budgets)
    assert placement.placement("query").partition == "keyed"
    keys = torch.arange(40, dtype=torch.int64) * 2**40 + 7  # sparse raw ids
    rows = torch.randn(40, 8, generator=torch.Generator().manual_seed(1))
    coll = TieredEmbeddingCollection(specs, placement)
    packed = coll.load_keyed({"query": (keys, rows)})
    folders = write_server_folders(placement, specs, packed, tmp_path / "rows")
    procs = servers.start(*((folders[i], 0) for i in sorted(folders)))
    client = RemoteTables(remote_routing(placement, specs, [p.address for p in procs]))
    coll.remote = client
    ids = torch.tensor([[int(keys[3]), -1], [int(keys[39]), 5]])  # 5: never learned
    out = coll({"query": ids})["query"]
    q = rows.half().float()
    torch.testing.assert_close(out[0], q[3])
    torch.testing.assert_close(out[1], q[39] / 2)
    assert sorted(client.keys("query").tolist()) == keys.tolist()  # each on its routed server
    # a live update writes through to the servers (a new key too) and past the hot-row cache
    new = torch.full((2, 8), 0.25)
    coll.row_writer("query", torch.tensor([int(keys[3]), 5]), new)()
    out = coll({"query": ids})["query"]
    torch.testing.assert_close(out[0], new[0])
    torch.testing.assert_close(out[1], (q[39] + new[1]) / 2)
    client.close()
