"""The foundation model with its item table on 2 real embedding servers: same results as local.

Also: the plan's server folders feed ``recserve serve embeddings`` as written, a hashed table evicts
rows to the servers' keyed store and gets them back, and a dead server fails the request fast.
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
from sharded_tables.remote.client import RemoteLookupError, RemoteTable, RemoteTables
from sharded_tables.remote.server_files import ServerTable, write_server_folder
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


def test_hashed_table_evicts_to_the_servers_and_reads_back(servers, tmp_path):
    specs = [TableSpec("query", 4, 8, DType.FP32, hashed=True)]
    budgets = Budgets(device=0, host=1 << 20, remote_per_server=1 << 20, remote_servers=1)
    placement = plan(specs, budgets)
    assert placement.placement("query").tier is Tier.HOST
    # the keyed store for evicted rows: one server
    write_server_folder(tmp_path / "kv", [ServerTable("query", DType.FP32, 8, "keyed")])
    (proc,) = servers.start((tmp_path / "kv", 0))
    client = RemoteTables([RemoteTable("query", DType.FP32, 8, (proc.address,), "keyed")])
    coll = TieredEmbeddingCollection(specs, placement, remote=client)
    raw = torch.tensor([[2**40 + 1, -(2**50), 123456789]])
    coll({"query": raw})
    coll.dynamic["query"].weight[:] = torch.randn(4, 8)
    before = coll({"query": raw})["query"].clone()
    coll({"query": torch.tensor([[10, 11, 12, 13]])})  # evicts all three to the server
    _rows, found = client.get("query", raw.flatten())
    assert found.all()
    after = coll({"query": raw})["query"]
    torch.testing.assert_close(after, before, rtol=0, atol=0)
    client.close()
