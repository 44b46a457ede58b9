"""Placement planner: hand-checked plans, narrowing, refusals, invariants, serialization."""

from __future__ import annotations

import math
from fractions import Fraction

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sharded_tables.planner import (
    SLOT_MAP_BYTES,
    Budgets,
    PlacementPlan,
    PlanError,
    TablePlacement,
    format_bytes,
    parse_bytes,
    plan,
)
from sharded_tables.specs import DTYPES_WIDEST_FIRST, DType, TableSpec, Tier

KIB, MIB = 2**10, 2**20


@pytest.fixture
def example() -> PlacementPlan:
    specs = [
        # 128 B rows, 20 lookups: hottest per byte, but 1.28 MB > device, so host.
        TableSpec("item", rows=10_000, dim=32, lookups_per_sample=20.0),
        # 64 B rows, 12.8 kB: fits the device.
        TableSpec("country", rows=200, dim=16),
        # 25.6 MB fp32 > 3 x 8 MiB remote, so it narrows to fp16 (12.8 MB over 3 servers).
        TableSpec("user_id", rows=100_000, dim=64, allowed_dtypes=(DType.FP16, DType.INT8)),
        # 5.12 MB, coldest: only remote has room; ids are not skewed, so no cache.
        TableSpec("cold", rows=20_000, dim=64, expected_hit_rate=0.2, lookups_per_sample=0.01),
    ]
    budgets = Budgets(device=64 * KIB, host=4 * MIB, remote_per_server=8 * MIB, remote_servers=3)
    return plan(specs, budgets)


def test_hand_checked_example(example):
    assert example.placement("country") == TablePlacement(
        "country", Tier.DEVICE, DType.FP32, 12_800
    )
    assert example.placement("item") == TablePlacement("item", Tier.HOST, DType.FP32, 1_280_000)
    user = example.placement("user_id")
    assert (user.tier, user.dtype, user.partition) == (Tier.REMOTE, DType.FP16, "range")
    assert user.servers == (0, 1, 2)
    assert user.row_bounds == (0, 33_334, 66_667, 100_000)
    assert (user.cache_rows, user.cache_bytes) == (10_000, 10_000 * 128)  # ceil(10%), host memory
    cold = example.placement("cold")
    assert (cold.tier, cold.dtype, cold.cache_rows) == (Tier.REMOTE, DType.FP32, 0)
    use = example.usage()
    assert use["host"] == 1_280_000 + 1_280_000
    assert cold.row_bounds == (0, 6_667, 13_334, 20_000)
    assert use["remote"] == 12_800_000 + 5_120_000
    assert [t.table for t in example.tables] == ["item", "country", "user_id", "cold"]


def test_summary_lists_every_table_and_tier(example):
    text = example.summary()
    assert text.splitlines()[0].split() == [
        "table",
        "tier",
        "dtype",
        "MiB",
        "servers",
        "cache",
        "rows",
    ]
    assert "user_id  remote  fp16" in text and "0-2 range" in text and "10000" in text
    assert "remote  17.1 MiB of 24.0 MiB (3 x 8.0 MiB)" in text


def spec_1000x64(**kw) -> TableSpec:
    """fp32 256 000 B, fp16 128 000 B, int8 68 000 B, int4 36 000 B."""
    return TableSpec("t", rows=1_000, dim=64, **kw)


def test_no_quantization_when_the_table_fits():
    p = plan([spec_1000x64(allowed_dtypes=(DType.INT4,))], Budgets(device=0, host=256_000))
    assert p.placement("t").dtype is DType.FP32


def test_int4_when_only_int4_fits():
    allowed = (DType.FP16, DType.INT8, DType.INT4)
    p = plan([spec_1000x64(allowed_dtypes=allowed)], Budgets(device=0, host=40_000))
    assert (p.placement("t").tier, p.placement("t").dtype) == (Tier.HOST, DType.INT4)


def test_narrowing_stays_within_allowed_dtypes_and_steps_the_largest_table():
    big = TableSpec("big", rows=1_000, dim=64, allowed_dtypes=(DType.INT8,))  # skips fp16, fp8
    fixed = TableSpec("fixed", rows=500, dim=64)  # 128 000 B, never narrowed
    p = plan([big, fixed], Budgets(device=0, host=128_000 + 68_000))
    assert p.placement("big").dtype is DType.INT8
    assert p.placement("fixed").dtype is DType.FP32


def test_keyed_tables_use_all_servers_with_ceil_shares():
    spec = TableSpec("h", rows=10, dim=4, hashed=True)  # 16 B rows, 4 per server
    p = plan([spec], Budgets(device=0, host=0, remote_per_server=64, remote_servers=3))
    h = p.placement("h")
    assert (h.partition, h.servers, h.row_bounds, h.bytes) == ("keyed", (0, 1, 2), (), 3 * 64)
    assert p.usage()["remote[2]"] == 64


def test_host_tables_get_device_caches_only_with_a_gpu():
    spec = TableSpec("t", rows=1_000, dim=16)  # 64 000 B
    for has_gpu, rows in ((False, 0), (True, 93)):  # wants 100; its slot map takes 4 000 B
        p = plan([spec], Budgets(device=10_000, host=100_000, has_gpu=has_gpu))
        assert p.placement("t").tier is Tier.HOST
        assert p.placement("t").cache_rows == rows
        assert p.placement("t").cache_bytes == rows * 64 + (SLOT_MAP_BYTES * 1_000 if rows else 0)
    p = plan([spec], Budgets(device=4_000, host=100_000, has_gpu=True))
    assert p.placement("t").cache_rows == 0  # room for the slot map alone: no cache


def test_cache_shrinks_to_the_host_room_left():
    spec = TableSpec("t", rows=1_000, dim=16, allowed_dtypes=())
    p = plan([spec], Budgets(device=0, host=640, remote_per_server=64_000, remote_servers=1))
    assert p.placement("t").cache_rows == 10  # wants 100 rows, room for 10


def test_a_cache_budget_caches_remote_tables_without_pulling_them_into_the_host_tier():
    hot = TableSpec("hot", rows=100, dim=16, lookups_per_sample=10)  # 6 400 B, fills the host
    cold = TableSpec("cold", rows=1_000, dim=16)  # 64 000 B: remote
    budgets = dict(device=0, host=6_400, remote_per_server=100_000, remote_servers=1)
    without = plan([hot, cold], Budgets(**budgets))
    assert without.placement("cold").tier is Tier.REMOTE
    assert without.placement("cold").cache_rows == 0  # no host room left for a cache
    with_cache = plan([hot, cold], Budgets(**budgets, cache=1_000_000, cache_whole_max=0))
    cold_p = with_cache.placement("cold")
    assert (cold_p.tier, cold_p.cache_tier, cold_p.cache_rows) == (Tier.REMOTE, Tier.HOST, 100)
    assert with_cache.placement("hot").tier is Tier.HOST
    assert with_cache.usage()["host"] == 6_400 + 100 * 64  # the table, then its cache
    small = plan([hot, cold], Budgets(**budgets, cache=640))
    assert small.placement("cold").cache_rows == 10  # the cache budget bounds it
    assert Budgets.from_dict({**budgets, "cache": "1KiB"}).cache == 1024
    with pytest.raises(PlanError, match=r"budgets\.cache"):
        Budgets(**budgets, cache=-1)


def test_small_ranged_remote_tables_are_cached_whole_from_the_cache_budget():
    hot = TableSpec("hot", rows=100, dim=16, lookups_per_sample=10)  # 6 400 B, fills the host
    tiny = TableSpec("tiny", rows=10, dim=16, expected_hit_rate=0.0)  # 640 B, any skew
    cold = TableSpec("cold", rows=1_000, dim=16)  # 64 000 B
    keyed = TableSpec("keyed", rows=10, dim=16, hashed=True)  # rows follow raw ids: never whole
    budgets = dict(device=0, host=6_400, remote_per_server=100_000, remote_servers=1)
    p = plan([hot, tiny, cold, keyed], Budgets(**budgets, cache=70_000))
    assert all(p.placement(t).tier is Tier.REMOTE for t in ("tiny", "cold", "keyed"))
    assert p.placement("tiny").cache_rows == 10 and p.placement("cold").cache_rows == 1_000
    assert p.placement("tiny").cache_bytes == 640
    assert p.placement("keyed").cache_rows == 1  # a share (ceil 10 %), not the whole table
    # over the size limit, or no room left: a share of the rows, as before
    capped = plan([hot, tiny, cold], Budgets(**budgets, cache=70_000, cache_whole_max=1_000))
    assert (capped.placement("tiny").cache_rows, capped.placement("cold").cache_rows) == (10, 100)
    tight = plan([hot, tiny, cold], Budgets(**budgets, cache=7_000))
    assert (tight.placement("tiny").cache_rows, tight.placement("cold").cache_rows) == (10, 99)
    assert Budgets.from_dict({**budgets, "cache_whole_max": "1MiB"}).cache_whole_max == 1 << 20


def test_refusal_names_table_free_room_and_shortfall():
    spec = TableSpec("big", rows=1_000, dim=64, dtype=DType.INT4)  # 36 000 B
    budgets = Budgets(device=0, host=10_000, remote_per_server=5_000, remote_servers=2)
    with pytest.raises(PlanError) as e:
        plan([spec], budgets)
    msg = str(e.value)
    assert "cannot place table 'big' (35.2 KiB at int4)" in msg
    assert "device 0 B free, host 9.8 KiB free, remote 2 x 4.9 KiB free" in msg
    assert "short by 15.6 KiB (16000 bytes)" in msg


def test_refusal_when_room_is_fragmented():
    specs = [TableSpec("a", rows=100, dim=4), TableSpec("b", rows=100, dim=4)]  # 1600 B each
    with pytest.raises(PlanError, match=r"'b' \(1.6 KiB at fp32\).*short by 0 B in total"):
        plan(specs, Budgets(device=1_000, host=2_000, remote_per_server=1_000, remote_servers=1))


@pytest.mark.parametrize(
    "make,field",
    [
        (
            lambda: plan([TableSpec("a", 1, 2), TableSpec("a", 2, 2)], Budgets(0, 9)),
            r"specs\[1\].name",
        ),
        (lambda: Budgets(device=-1, host=0), "budgets.device"),
        (lambda: Budgets(0, 0, remote_per_server=10), "budgets.remote_servers"),
        (lambda: Budgets(0, 0, remote_servers=2), "budgets.remote_per_server"),
        (lambda: Budgets(0, 0, cache_fraction=1.5), "budgets.cache_fraction"),
        (lambda: Budgets.from_dict({"device": 1, "host": 1, "gpu": True}), "budgets.gpu"),
        (lambda: Budgets.from_dict({"device": "1 XB", "host": 0}), "budgets.device"),
        (lambda: Budgets.from_dict({"host": 0}), "budgets.device: missing"),
        (lambda: plan([TableSpec("a", 1, 2, lookups_per_sample=-1)], Budgets(0, 9)), "lookups"),
        (lambda: TablePlacement("a", "gpu", DType.FP32, 1), "placement 'a'.tier"),
        (lambda: TablePlacement("a", Tier.REMOTE, DType.FP32, 1, (0,), "range"), "row_bounds"),
    ],
)
def test_invalid_inputs_name_the_field(make, field):
    with pytest.raises(PlanError, match=field):
        make()


@pytest.mark.parametrize(
    "text,n",
    [(0, 0), ("123", 123), ("1_000", 1000), ("512MiB", 512 * MIB), ("4 GiB", 4 * 2**30),
     ("1.5GB", 1_500_000_000), ("2kb", 2000), ("1.5KiB", 1536), (" 7 B ", 7)],
)  # fmt: skip
def test_parse_bytes(text, n):
    assert parse_bytes(text) == n


@pytest.mark.parametrize("text", ["", "MiB", "1.2.3GB", "5 XB", "-1KiB", -3, 1.5, True])
def test_parse_bytes_rejects(text):
    with pytest.raises(PlanError, match="host"):
        parse_bytes(text, field="host")


def test_format_bytes():
    assert [format_bytes(n) for n in (0, 1023, 1024, 3 * 2**29)] == [
        "0 B",
        "1023 B",
        "1.0 KiB",
        "1.5 GiB",
    ]


def test_budgets_from_toml_with_human_sizes(tmp_path):
    path = tmp_path / "budgets.toml"
    path.write_text(
        'device = "1MiB"\nhost = "1.5GB"\nremote_per_server = 1024\nremote_servers = 2\n'
    )
    assert Budgets.load(path) == Budgets(MIB, 1_500_000_000, 1024, 2)
    path.write_text("device = [")
    with pytest.raises(PlanError, match=r"budgets\.toml"):
        Budgets.load(path)


def test_plan_saves_and_loads_json(example, tmp_path):
    example.save(tmp_path / "plan.json")
    assert PlacementPlan.load(tmp_path / "plan.json") == example
    with pytest.raises(PlanError, match="JSON only"):
        example.save(tmp_path / "plan.toml")


# --- properties over random specs and budgets --------------------------------------------------


@st.composite
def specs_and_budgets(draw) -> tuple[list[TableSpec], Budgets]:
    specs = []
    for i in range(draw(st.integers(0, 6))):
        dtype = draw(st.sampled_from(DTYPES_WIDEST_FIRST))
        specs.append(
            TableSpec(
                f"t{i}",
                rows=draw(st.integers(1, 3_000)),
                dim=draw(st.sampled_from([2, 4, 8, 16, 32])),
                dtype=dtype,
                expected_hit_rate=draw(st.sampled_from([0.0, 0.5, 0.9])),
                lookups_per_sample=draw(st.sampled_from([0.0, 1.0, 3.5, 20.0])),
                allowed_dtypes=tuple(draw(st.sets(st.sampled_from(DTYPES_WIDEST_FIRST)))),
                hashed=draw(st.booleans()),
            )
        )
    servers = draw(st.integers(0, 4))
    budgets = Budgets(
        device=draw(st.integers(0, 100_000)),
        host=draw(st.integers(0, 100_000)),
        remote_per_server=draw(st.integers(1, 100_000)) if servers else 0,
        remote_servers=servers,
        cache_fraction=draw(st.sampled_from([0.0, 0.05, 0.07, 0.5, 1.0])),
        has_gpu=draw(st.booleans()),
        cache=draw(st.one_of(st.none(), st.integers(0, 100_000))),
        cache_whole_max=draw(st.sampled_from([0, 1_000, 64 << 20])),
    )
    return specs, budgets


def check_plan(specs: list[TableSpec], budgets: Budgets, p: PlacementPlan) -> None:
    """Recomputes usage from the specs: nothing exceeds a budget, every table placed once."""
    assert [t.table for t in p.tables] == [s.name for s in specs]
    use = {tier: 0 for tier in Tier}
    per_server = [0] * budgets.remote_servers
    for s, t in zip(specs, p.tables, strict=True):
        assert t.dtype in s.dtypes()
        assert DTYPES_WIDEST_FIRST.index(t.dtype) >= DTYPES_WIDEST_FIRST.index(s.dtype)
        rb = s.row_bytes(t.dtype)
        if t.tier is Tier.REMOTE and s.hashed:
            share = math.ceil(s.rows / budgets.remote_servers)
            assert (t.partition, t.servers) == ("keyed", tuple(range(budgets.remote_servers)))
            per_server = [u + share * rb for u in per_server]
            assert t.bytes == share * rb * budgets.remote_servers
        elif t.tier is Tier.REMOTE:
            assert t.partition == "range" and len(set(t.servers)) == len(t.servers)
            assert t.row_bounds[0] == 0 and t.row_bounds[-1] == s.rows
            for srv, lo, hi in zip(t.servers, t.row_bounds, t.row_bounds[1:], strict=False):
                assert hi > lo
                per_server[srv] += (hi - lo) * rb
            assert t.bytes == s.rows * rb
        else:
            assert t.bytes == s.rows * rb and not t.servers
        use[t.tier] += t.bytes
        slot_map = SLOT_MAP_BYTES * s.rows if t.cache_tier is Tier.DEVICE and t.cache_rows else 0
        assert t.cache_bytes == t.cache_rows * rb + slot_map
        whole = t.tier is Tier.REMOTE and not s.hashed and t.cache_rows == s.rows
        if whole and t.bytes <= budgets.cache_whole_max:
            pass  # cached whole: small enough, from the cache room, whatever its skew
        elif t.cache_rows:
            assert s.expected_hit_rate >= 0.5 and t.cache_tier is not None
            assert t.cache_rows <= math.ceil(s.rows * Fraction(str(budgets.cache_fraction)))
            assert t.cache_tier is Tier.HOST or budgets.has_gpu
        if t.cache_rows:
            assert t.cache_tier is not None
            use[t.cache_tier] += t.cache_bytes
    for tier in Tier:
        assert use[tier] <= budgets.capacity(tier)
        assert p.usage()[tier.value] == use[tier]
    assert all(u <= budgets.remote_per_server for u in per_server)
    assert [p.usage()[f"remote[{i}]"] for i in range(budgets.remote_servers)] == per_server


@settings(max_examples=300, deadline=None)
@given(specs_and_budgets())
def test_plan_respects_budgets_or_refuses(case):
    specs, budgets = case
    try:
        p = plan(specs, budgets)
    except PlanError as e:
        assert "cannot place table" in str(e) and "short by" in str(e)
        return
    check_plan(specs, budgets, p)
    assert PlacementPlan.from_json(p.to_json()) == p
    assert PlacementPlan.from_dict(p.to_dict()) == p


@settings(max_examples=100, deadline=None)
@given(specs_and_budgets())
def test_plan_is_deterministic_and_ignores_input_order(case):
    specs, budgets = case
    try:
        p = plan(specs, budgets)
    except PlanError as e:
        with pytest.raises(PlanError) as again:
            plan(specs[::-1], budgets)
        assert str(again.value) == str(e)
        return
    assert plan(specs, budgets) == p
    assert set(plan(specs[::-1], budgets).tables) == set(p.tables)
