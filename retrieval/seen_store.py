"""The served model's own record of what each known user consumed (``model.seen_store = true``).

A request may carry its user's seen list (``UserBatch.seen``), or name its user
(``UserBatch.user [B]``, the dense user index) and let the model look the list up here: the
store is CSR buffers inside the model (``indptr [U + 1]``, ``items [M]``, each user's distinct
items ascending), so it is saved, published and loaded with the model's ``state_dict``, and a
router holds it for its shards. The looked-up rows join the request's own list and the history
window as the items the index skips inside its scan (``retrieval/index/exclude.py``).

Filled at training from the interactions before the test split (``recserve train``); grown
by live updates (``AddSeen``: (user, item) pairs, a new user too) without a redeploy.

Sizes: 8 bytes per stored (user, item) pair plus 8 per user (MovieLens 100k: ~0.7 MiB); exact,
no false positive (an item is skipped only if the user consumed it). An update rebuilds the
arrays (``O(M)``, copy-on-write: batches in flight keep the old store), which suits stores up to
tens of millions of pairs; past that, send the lists with the requests instead.

Example::

    store = SeenStore.of(np.array([0, 0, 2]), np.array([5, 2, 7]), num_users=3)
    store.rows(torch.tensor([0, 1, 9, -1]))  # [[2, 5], [-1, -1], [-1, -1], [-1, -1]]
    store = store.with_pairs(torch.tensor([1]), torch.tensor([4]))  # user 1 consumed item 4
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from torch import nn

from retrieval.seen import SeenSets


class SeenStore(nn.Module):
    """Seen items of U users as buffers: ``indptr [U + 1] int64``, ``items [M] int64``."""

    indptr: torch.Tensor
    items: torch.Tensor

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("indptr", torch.zeros(1, dtype=torch.int64))
        self.register_buffer("items", torch.zeros(0, dtype=torch.int64))
        self.widest = 0
        """The longest user's row: the fixed width of :meth:`rows` on the device path (read on
        the host whenever the arrays change: at a load or an update, never per request)."""

    @classmethod
    def of(cls, users: np.ndarray, items: np.ndarray, num_users: int) -> SeenStore:
        """From ``M`` (user, item) pairs (repeats allowed) of users ``0..num_users-1``."""
        return cls.from_sets(SeenSets.of(users, items, num_users))

    @classmethod
    def from_sets(cls, sets: SeenSets) -> SeenStore:
        store = cls()
        store.indptr = torch.from_numpy(sets.indptr.astype(np.int64))
        store.items = torch.from_numpy(sets.items.astype(np.int64))
        return store

    @property
    def num_users(self) -> int:
        return int(self.indptr.shape[0]) - 1

    def nbytes(self) -> int:
        return int(self.indptr.numel() * 8 + self.items.numel() * 8)

    def __setattr__(self, name: str, value: Any) -> None:
        super().__setattr__(name, value)
        if name == "indptr" and isinstance(value, torch.Tensor):
            self._measure()

    def _measure(self) -> None:
        lengths = self.indptr[1:] - self.indptr[:-1]
        self.__dict__["widest"] = int(lengths.max()) if lengths.numel() else 0

    def rows(self, users: torch.Tensor, width: int | None = None) -> torch.Tensor:
        """The seen items of ``users [B] int64`` -> ``[B, S] int64``, ascending, ``-1`` padded;
        a user the store does not know (``-1``, or beyond U) gets an empty row. ``width``: S
        fixed (:attr:`widest`: no host read, the device path's), else the batch's longest row."""
        u_count = self.num_users
        users = users.to(self.indptr.device)
        known = (users >= 0) & (users < u_count)
        u = users.clamp(0, max(u_count - 1, 0))
        if u_count == 0 or self.items.numel() == 0:
            return torch.full((users.shape[0], 0), -1, dtype=torch.int64, device=users.device)
        start = self.indptr[u]
        length = torch.where(known, self.indptr[u + 1] - start, torch.zeros_like(start))
        if width is None:
            width = int(length.max()) if length.numel() else 0
        col = torch.arange(width, device=users.device)
        at = (start[:, None] + col).clamp(max=self.items.numel() - 1)
        return torch.where(col < length[:, None], self.items[at], torch.full_like(at, -1))

    def with_pairs(self, users: torch.Tensor, items: torch.Tensor) -> SeenStore:
        """A new store holding these (user, item) pairs too (``[n] int64`` each, ids >= 0; a
        user beyond U grows the store). This one is left as it is."""
        counts = (self.indptr[1:] - self.indptr[:-1]).cpu().numpy()
        old_users = np.repeat(np.arange(self.num_users), counts)
        all_users = np.concatenate([old_users, users.cpu().numpy().astype(np.int64)])
        all_items = np.concatenate([self.items.cpu().numpy(), items.cpu().numpy().astype(np.int64)])
        num_users = max(self.num_users, int(all_users.max(initial=-1)) + 1)
        return SeenStore.of(all_users, all_items, num_users).to(self.indptr.device)

    def take(self, other: SeenStore) -> None:
        """Makes this store hold ``other``'s arrays (in place: every model sharing this module
        sees them; a server calls it while batches are held off)."""
        self.indptr, self.items = other.indptr, other.items

    def _load_from_state_dict(
        self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs
    ):
        # sized by the data: adopt the saved sizes
        for name in ("indptr", "items"):
            saved = state_dict.get(prefix + name)
            if saved is not None:
                self._buffers[name] = torch.empty_like(saved, device=getattr(self, name).device)
        super()._load_from_state_dict(
            state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs
        )
        self._measure()  # copied in place: no assignment saw the new arrays
