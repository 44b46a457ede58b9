"""A tiny dataset whose users cover every case of the split (shared by the split's tests)."""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from retrieval.data import Interactions, RecDataset, SyntheticConfig, generate

COUNTS = (1, 10, 2, 0, 5)
"""Interactions of users 0..4: a single one, ten, two, none, five."""


def tiny(counts: tuple[int, ...] = COUNTS, num_items: int = 80) -> RecDataset:
    """``len(counts)`` users; user u's interactions are items ``10 u, 10 u + 1, ...`` at times
    ``0, 1, ...``: its latest items are its highest ids."""
    base = generate(SyntheticConfig(num_users=len(counts), num_items=num_items, seed=3))
    users = np.repeat(np.arange(len(counts)), counts).astype(np.int64)
    rank = np.concatenate([np.arange(c) for c in counts]).astype(np.int64)
    it = Interactions(users, (users * 10 + rank) % num_items, rank)
    return replace(base, interactions=it)
