"""Small catalogs build quietly: the default nlist leaves faiss's k-means enough points per list,
and an explicit nlist that does not is explained once in our log, not on stderr per build."""

from __future__ import annotations

import logging

import pytest
import torch

from retrieval.index.build import build_ivf
from retrieval.index.config import IVFConfig
from retrieval.index.kmeans import MIN_POINTS_PER_CENTROID, default_nlist


@pytest.mark.parametrize("n", [1, 38, 39, 80, 500, 1520, 1521, 10_000, 1_000_000])
def test_default_nlist_keeps_enough_points_per_list(n):
    nlist = default_nlist(n)
    assert nlist >= 1
    assert nlist == 1 or n // nlist >= MIN_POINTS_PER_CENTROID
    assert nlist <= max(1, int(n**0.5))  # about sqrt(N) once the catalog is large enough
    if n >= 1521:  # 39 ** 2
        assert nlist == int(n**0.5)


def test_the_default_follows_the_rule():
    for n in (80, 400, 5000):
        assert IVFConfig().resolved(n).nlist == default_nlist(n)


def test_building_on_an_80_item_catalog_prints_no_faiss_warning(capfd):
    x = torch.randn(80, 16, generator=torch.Generator().manual_seed(0))
    index = build_ivf(x, IVFConfig())
    assert index.ntotal == 80 and index.nlist == 2
    err = capfd.readouterr().err
    assert "please provide at least" not in err and "WARNING" not in err, err


def test_an_explicit_nlist_too_large_is_explained_once(capfd, caplog):
    x = torch.randn(81, 16, generator=torch.Generator().manual_seed(1))
    cfg = IVFConfig(nlist=8)
    with caplog.at_level(logging.WARNING, logger="retrieval.index.kmeans"):
        first = build_ivf(x, cfg)
        build_ivf(x, cfg)
    assert first.nlist == 8  # the asked-for lists are built
    assert "please provide at least" not in capfd.readouterr().err
    lines = [r.getMessage() for r in caplog.records if r.name == "retrieval.index.kmeans"]
    assert len(lines) == 1, lines
    assert "nlist = 8" in lines[0] and "Leave [model.index] nlist unset for 2 lists" in lines[0]
