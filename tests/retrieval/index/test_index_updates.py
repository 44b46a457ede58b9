"""Copy-on-write updates of the IVF index: add / replace / remove items, rewrite signatures,
list balance. Oracle: an index built over all items, and the same index after removing and
re-adding some of them (the centroids stay, so assignment and codes must match exactly)."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

from retrieval.filters import eligible
from retrieval.index import IVFConfig, IVFIndex, build_ivf, exact_search
from retrieval.index.build import bit_index
from retrieval.index.kmeans import assign
from retrieval.index.update import (
    REBUILD_IMBALANCE,
    add_items,
    list_imbalance,
    positions_of,
    rebuild_recommended,
    remove_items,
    set_signatures,
)

N, D = 2000, 16
VALUES = {"colour": ["red", "green", "blue"], "flag": ["false", "true"]}


def clustered(n: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    c = torch.randn(20, D, generator=torch.Generator().manual_seed(0)) * 3
    return c[torch.randint(0, 20, (n,), generator=g)] + torch.randn(n, D, generator=g)


@pytest.fixture(scope="module", params=["int8+f16", "fp8+none"])
def built(request) -> tuple[IVFIndex, torch.Tensor, dict]:
    codes, exact = request.param.split("+")
    exact_copy = {"f16": "float16", "none": "none"}[exact]
    x = clustered(N, 1)
    rng = np.random.default_rng(2)
    attrs = {"colour": rng.integers(0, 3, N), "flag": rng.integers(0, 2, N)}
    cfg = IVFConfig(nlist=32, nprobe=8, codes=codes, exact_copy=exact_copy, rerank=50)
    index = build_ivf(x, cfg, item_attributes=attrs, attribute_values=VALUES)
    return index, x, attrs


def rows_by_id(index: IVFIndex) -> dict[str, torch.Tensor]:
    """Every per-item buffer, rows ordered by item id, plus each row's list."""
    order = torch.argsort(index.item_ids)
    sizes = index.offsets[1:] - index.offsets[:-1]
    lists = torch.repeat_interleave(torch.arange(index.nlist), sizes)
    out = {
        "ids": index.item_ids[order],
        "lists": lists[order],
        "codes": index.codes[order].view(torch.uint8),
        "scales": index.scales[order],
        "sig": index.sig[order],
    }
    if index.exact.shape[0]:
        out["exact"] = index.exact[order]
    return out


def assert_consistent(index: IVFIndex) -> None:
    """Offsets, list order, counts and postings agree with the per-item buffers."""
    n = index.item_ids.shape[0]
    assert int(index.offsets[-1]) == n == index.ntotal == index.codes.shape[0]
    assert index.scales.shape[0] == index.sig.shape[0] == n
    assert index.exact.shape[0] in (0, n)
    assert torch.unique(index.item_ids).numel() == n
    flags = (index.sig.unsqueeze(-1) >> torch.arange(64)) & 1  # [N, W, 64], bit by bit
    assert torch.equal(index.bit_counts, flags.sum(dim=0).flatten())
    assert torch.equal(index.postings, bit_index(index.sig)[1])
    sizes = index.offsets[1:] - index.offsets[:-1]
    assert index.max_list == int(sizes.max())


def sig_of(index: IVFIndex, colour: list[str], flag: list[str]) -> torch.Tensor:
    from retrieval.filters import pack_bits

    bits = np.zeros((len(colour), index.schema.num_words * 64), dtype=bool)
    for i, (c, f) in enumerate(zip(colour, flag, strict=True)):
        bits[i, index.schema.bit_of[("colour", c)]] = True
        bits[i, index.schema.bit_of[("flag", f)]] = True
    return pack_bits(bits)


def test_remove_then_re_add_restores_the_built_index(built):
    index, x, _ = built
    gone = torch.arange(0, N, 7)
    before = rows_by_id(index)
    sig = index.sig[positions_of(index, gone)]
    smaller = remove_items(index, gone)
    assert_consistent(smaller)
    assert smaller.ntotal == N - gone.numel()
    assert (positions_of(smaller, gone) == -1).all()
    again = add_items(smaller, gone, x[gone], sig)
    assert_consistent(again)
    after = rows_by_id(again)
    for name, t in before.items():
        assert torch.equal(after[name], t), name
    # the old indexes were not touched (copy-on-write)
    assert index.ntotal == N and smaller.ntotal == N - gone.numel()
    q = clustered(32, 9)
    ids0, s0 = index.search(q, 20)
    ids1, s1 = again.search(q, 20)
    torch.testing.assert_close(s1, s0)
    assert (ids0 == ids1).float().mean() > 0.98  # equal scores may swap places


def test_new_items_join_the_list_the_build_rule_gives_and_are_found(built):
    index, _, _ = built
    new = torch.nn.functional.normalize(
        torch.randn(40, D, generator=torch.Generator().manual_seed(5))
    )
    new = new * 100  # far longer than the catalog's vectors: each is its own best match (dot)
    ids = torch.arange(10_000, 10_040)
    sig = sig_of(index, ["blue"] * 40, ["true"] * 40)
    bigger = add_items(index, ids, new, sig)
    assert_consistent(bigger)
    assert bigger.ntotal == N + 40
    pos = positions_of(bigger, ids)
    lists = torch.searchsorted(bigger.offsets, pos, right=True) - 1
    assert torch.equal(lists, assign(new, index.centroids, index.config.assign))  # the build's rule
    # every new item is its own query's best match (exactly, and through the lists)
    top, _ = bigger.search(new, 1, nprobe=bigger.nlist)
    assert torch.equal(top[:, 0], ids)
    truth, _ = exact_search(bigger.vectors_at(torch.arange(bigger.ntotal)), new, 1)
    assert torch.equal(bigger.item_ids[truth[:, 0]], ids)


def test_filters_see_added_items_and_new_signatures(built):
    index, x, _ = built
    ids = torch.tensor([20_000])
    v = x[:1] * 10  # long: the best match of itself under the dot product
    bigger = add_items(index, ids, v, sig_of(index, ["red"], ["false"]))
    # selective filter: answered from the postings
    got, _ = bigger.search(v, 5, "colour = red and flag = false")
    assert 20_000 in got[0].tolist()
    flipped = set_signatures(bigger, ids, sig_of(bigger, ["green"], ["true"]))
    assert_consistent(flipped)
    got, _ = flipped.search(v, 5, "colour = red and flag = false")
    assert 20_000 not in got[0].tolist()
    got, _ = flipped.search(v, 5, "colour = green")
    assert 20_000 in got[0].tolist()
    fb = flipped.compile_filter("colour = green and flag = true", 1)
    ok = eligible(flipped.sig, fb.masks[0], fb.negate[0])
    assert 20_000 in flipped.item_ids[ok].tolist()
    # codes and vectors are shared, not copied, by a signature rewrite
    assert flipped.codes.data_ptr() == bigger.codes.data_ptr()


def test_replacing_an_item_moves_it(built):
    index, x, _ = built
    target = x[1] * 10  # item 5 moves far out, along item 1's direction
    five = torch.tensor([5])
    moved = add_items(index, five, target[None], index.sig[positions_of(index, five)])
    assert moved.ntotal == N
    assert_consistent(moved)
    top, _ = moved.search(target[None], 1, nprobe=moved.nlist)
    assert top[0].tolist() == [5]
    got = moved.vectors_at(positions_of(moved, five))[0]
    torch.testing.assert_close(
        got, target, atol=0.07 * float(target.abs().max()), rtol=0
    )  # fp8: 3 mantissa bits
    old = index.vectors_at(positions_of(index, five))[0]
    assert not torch.allclose(old, target, atol=1.0)  # the old index still has the old vector


def test_unknown_and_duplicate_ids_are_refused_naming_them(built):
    index, x, _ = built
    with pytest.raises(ValueError, match=r"ids: items not in the index: 99999, 88888"):
        remove_items(index, torch.tensor([3, 99999, 88888]))
    with pytest.raises(ValueError, match="ids: items not in the index: 77777"):
        set_signatures(index, torch.tensor([77777]), index.sig[:1])
    with pytest.raises(ValueError, match="ids: item 4 appears more than once"):
        add_items(index, torch.tensor([4, 4]), x[:2], index.sig[:2])
    with pytest.raises(ValueError, match=r"vectors: expected \[1, 16\]"):
        add_items(index, torch.tensor([30_000]), x[:1, :8], index.sig[:1])
    with pytest.raises(ValueError, match="sig: expected int64"):
        add_items(index, torch.tensor([30_000]), x[:1], index.sig[:1, :0])
    with pytest.raises(ValueError, match="vectors: expected finite"):
        add_items(index, torch.tensor([30_000]), torch.full((1, D), float("nan")), index.sig[:1])


def test_imbalance_grows_when_one_list_takes_the_additions(built):
    index, _, _ = built
    before = list_imbalance(index)
    assert 1.0 <= before < REBUILD_IMBALANCE and not rebuild_recommended(index)
    # 600 items at one centroid: its list grows far past the mean
    lumps = index.centroids[:1].repeat(600, 1) + 0.001 * torch.randn(600, D)
    ids = torch.arange(50_000, 50_600)
    lumped = add_items(index, ids, lumps, index.sig[:1].repeat(600, 1))
    sizes = lumped.offsets[1:] - lumped.offsets[:-1]
    assert list_imbalance(lumped) == pytest.approx(float(sizes.max() / sizes.float().mean()))
    assert list_imbalance(lumped) > REBUILD_IMBALANCE and rebuild_recommended(lumped)


@pytest.mark.gpu
def test_updates_of_a_cuda_index_stay_on_the_device_and_match_the_cpu(built):
    index, x, _ = built
    ids, sig = torch.tensor([40_000, 3]), index.sig[:2]
    cpu = set_signatures(
        remove_items(add_items(index, ids, x[:2] * 3, sig), ids[:1]), ids[1:], sig[:1]
    )
    gpu = set_signatures(
        remove_items(add_items(copy.deepcopy(index).to("cuda"), ids, x[:2] * 3, sig), ids[:1]),
        ids[1:],
        sig[:1],
    )
    derived = {"half_norms", "centroids_t"}  # recomputed on the device: float sums may differ
    for name, buf in gpu.named_buffers():
        assert buf.device.type == "cuda", name
        if name in derived:
            torch.testing.assert_close(buf.cpu(), getattr(cpu, name), rtol=1e-6, atol=1e-5)
        else:
            assert torch.equal(buf.cpu(), getattr(cpu, name)), name
    q = x[:8].cuda()
    same = gpu.search(q, 10)[0].cpu() == cpu.search(q.cpu(), 10)[0]
    assert same.float().mean() > 0.95  # torch ops on CUDA vs the C++ kernel: ties may swap
