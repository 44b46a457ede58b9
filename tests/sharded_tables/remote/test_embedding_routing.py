"""Pure parts of the remote tier: id routing, the mixing hash, routing specs and size parsing."""

from __future__ import annotations

import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from common.config import ConfigError
from sharded_tables.remote.client import RemoteTable, RemoteTables, route, splitmix64
from sharded_tables.remote.config import EmbeddingServerConfig
from sharded_tables.specs import DType


def servers(n: int) -> tuple[str, ...]:
    return tuple(f"127.0.0.1:{7000 + s}" for s in range(n))


@settings(max_examples=100, deadline=None)
@given(st.lists(st.integers(0, 10_000), min_size=2, max_size=6), st.data())
def test_every_ranged_id_goes_to_the_one_server_that_holds_it(cuts, data):
    bounds = tuple(sorted(cuts))
    assume(bounds[0] < bounds[-1])
    table = RemoteTable("t", DType.INT8, 8, servers(len(bounds) - 1), "range", bounds)
    ids = data.draw(st.lists(st.integers(bounds[0], bounds[-1] - 1), min_size=1, max_size=50))
    server = route(table, torch.tensor(ids))
    for i, s in zip(ids, server.tolist(), strict=True):
        holders = [k for k in range(len(bounds) - 1) if bounds[k] <= i < bounds[k + 1]]
        assert holders == [s]


@settings(max_examples=100, deadline=None)
@given(st.lists(st.integers(-(2**63), 2**63 - 1), min_size=1, max_size=50), st.integers(1, 7))
def test_keyed_ids_go_to_one_stable_server(ids, n):
    table = RemoteTable("t", DType.FP16, 8, servers(n), "keyed")
    first = route(table, torch.tensor(ids))
    assert ((first >= 0) & (first < n)).all()
    assert torch.equal(first, route(table, torch.tensor(ids)))
    assert torch.equal(first[:1], route(table, torch.tensor(ids[:1])))  # independent of the batch


def test_splitmix64_matches_the_reference_sequence():
    # splitmix64 seeded with 0 yields 0xE220A8397B1DCDAF, then 0x6E789E6AA1B965F4 (state + golden).
    out = splitmix64(torch.tensor([0, 0x9E3779B97F4A7C15 - (1 << 64)]))
    assert [int(x) for x in out] == [0xE220A8397B1DCDAF, 0x6E789E6AA1B965F4]


def test_keyed_ids_spread_evenly():
    table = RemoteTable("t", DType.FP16, 8, servers(4), "keyed")
    counts = torch.bincount(route(table, torch.arange(40_000)), minlength=4)
    assert counts.min() > 9_000


def test_out_of_range_id_is_named_before_anything_is_sent():
    table = RemoteTable("items", DType.INT8, 8, servers(2), "range", (0, 10, 20))
    with pytest.raises(
        ValueError, match="table 'items': id 20 is outside the table's rows \\[0, 20\\)"
    ):
        route(table, torch.tensor([3, 20]))


def test_bad_routing_is_refused():
    with pytest.raises(ValueError, match="table 'items': bounds must be 3 ascending"):
        RemoteTable("items", DType.INT8, 8, servers(2), "range", (0, 10))
    with pytest.raises(ValueError, match="table 'items': servers"):
        RemoteTable("items", DType.INT8, 8, (), "keyed")
    with pytest.raises(ValueError, match="fallback"):
        RemoteTables([], fallback="ignore")  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("text", "n"),
    [
        ("1048576", 1 << 20),
        ("512MiB", 512 << 20),
        ("4GiB", 4 << 30),
        ("1.5 gb", 1_500_000_000),
        ("7b", 7),
    ],
)
def test_memory_budget_reads_sizes(text: str, n: int):
    assert EmbeddingServerConfig(memory_budget=text).budget_bytes() == n


@pytest.mark.parametrize("text", ["", "4XB", "-1", "GiB"])
def test_a_bad_memory_budget_is_refused_naming_the_field(text: str):
    with pytest.raises(ConfigError, match=r"^memory_budget \(--memory-budget\): cannot read"):
        EmbeddingServerConfig(memory_budget=text)
