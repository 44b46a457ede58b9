"""From a :class:`RecDataset` to model inputs: time split, histories, item features, config.

Per user, by time: the latest ``test_fraction`` of the interactions is the test split, the latest
``validation`` share of the rest the validation split, and what is left the training pairs::

    user's timeline:  [ train pairs ........ | validation | test ]
    tower's history:    train pairs            (evaluating validation; training)
                        train + validation     (evaluating test; serving)

A user with a single interaction has nothing to hold out: it stays in training and is counted
in :class:`SplitCounts` (likewise for validation), never dropped silently.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from retrieval.config import ModelConfig
from retrieval.data import Interactions, RecDataset, history_by_user, split_by_time
from retrieval.data.split import user_timelines
from retrieval.features import UserBatch, item_feature_ids, make_user_batch
from retrieval.filters import FilterSchema, filter_vocabulary
from retrieval.seen import SeenSets
from retrieval.training.histories import timeline_first
from retrieval.training.pairs import TrainingData, log_q_from_counts
from retrieval.training.task_labels import task_labels


@dataclass(frozen=True)
class SplitCounts:
    """Users and interactions in each part of the split."""

    users: int
    """Users of the dataset."""
    users_without_interactions: int
    users_in_test: int
    """Users with at least one test interaction (those the test evaluation can score)."""
    users_kept_out_of_test: int
    """Users with interactions but none held out: too few (a single one) to split."""
    users_in_validation: int
    users_kept_out_of_validation: int
    """Users with training interactions but none held out for validation (too few)."""
    train_pairs: int
    validation_pairs: int
    test_pairs: int

    @classmethod
    def of(
        cls,
        num_users: int,
        fit: Interactions,
        validation: Interactions | None,
        test: Interactions,
    ) -> SplitCounts:
        """Counts of a split; ``validation`` None: no validation split."""
        val = validation if validation is not None else fit.select(np.zeros(0, np.int64))

        def users(*parts: Interactions) -> int:
            return len(np.unique(np.concatenate([p.user_id for p in parts])))

        present, before_test = users(fit, val, test), users(fit, val)
        return cls(
            users=num_users,
            users_without_interactions=num_users - present,
            users_in_test=users(test),
            users_kept_out_of_test=present - users(test),
            users_in_validation=users(val),
            users_kept_out_of_validation=before_test - users(val) if validation is not None else 0,
            train_pairs=len(fit),
            validation_pairs=len(val),
            test_pairs=len(test),
        )


@dataclass
class Prepared:
    """Everything training and evaluation need, derived once from a dataset."""

    dataset: RecDataset
    config: ModelConfig
    train: TrainingData
    history: np.ndarray
    """``[U, H]`` each user's most recent items before the test split (train and validation:
    what the user tower reads at serving); ``train.history`` holds the train items only."""
    test_items: list[set[int]] = field(default_factory=list)
    """Held-out items per user (empty set: no test interactions)."""
    validation_items: list[set[int]] = field(default_factory=list)
    """Validation items per user (all empty without a validation split)."""
    counts: SplitCounts | None = None
    """Who is in which part of the split."""
    seen: SeenSets | None = None
    """Every item each user consumed before the test split (train and validation): what the
    test evaluation excludes (``user_batch(users, seen=prep.seen)``)."""
    train_seen: SeenSets | None = None
    """Every item each user consumed before the validation split (the training pairs)."""

    def tune_batch(self, size: int = 256, seed: int = 0) -> UserBatch:
        """A sample of users whose query vectors tune the index."""
        rng = np.random.default_rng(seed)
        return self.user_batch(
            rng.choice(self.dataset.num_users, min(size, self.dataset.num_users), replace=False)
        )

    def user_batch(
        self,
        users: np.ndarray,
        filters: list[str | None] | None = None,
        history: np.ndarray | None = None,
        seen: SeenSets | None = None,
        schema: FilterSchema | None = None,
    ) -> UserBatch:
        """Inputs of ``users [B]``; ``history [U, H]`` defaults to :attr:`history`. ``seen``
        (e.g. :attr:`seen`): every item a user consumed goes with the request and is never
        recommended; None (the default, what a served request without a seen list gets):
        only the history window is excluded. ``schema``: what compiles the filters (a model's
        own, ``model.index.schema``, knows the values live updates added; None: the config's)."""
        ds = self.dataset
        hist = self.history if history is None else history
        cat = user_codes(ds, list(self.config.user_features), users)
        cfg = self.config
        if schema is None:
            schema = FilterSchema(
                filter_vocabulary(cfg.item_attributes, cfg.numeric_attributes),
                cfg.index.hashed_min_values,
            )
        rows = None if seen is None else seen.rows(users)
        return make_user_batch(hist[users], cat, ds.user_dense[users], schema, filters, rows)


def user_codes(ds: RecDataset, names: list[str], users: np.ndarray | None = None) -> np.ndarray:
    """The categorical features ``names`` of ``users [B]`` (default: all U) -> ``[B, F] int64``;
    ``F = 0`` for data without user features (an imported log with no users file)."""
    rows = np.arange(ds.num_users) if users is None else users
    if not names:
        return np.zeros((len(rows), 0), dtype=np.int64)
    return np.stack([ds.user_features[n][rows] for n in names], axis=1).astype(np.int64)


def prepare(
    ds: RecDataset,
    *,
    history_len: int = 50,
    test_fraction: float = 0.2,
    validation: float = 0.0,
    **model_overrides: Any,
) -> Prepared:
    """Splits each user's interactions by time (test, then ``validation`` of the rest: see the
    module docstring) and builds the model config for the dataset."""
    train_i, test_i = split_by_time(ds.interactions, test_fraction=test_fraction)
    hist, _ = history_by_user(train_i, ds.num_users, history_len)
    fit_i, fit_hist, val_i = train_i, hist, None
    if validation > 0:
        fit_i, val_i = split_by_time(train_i, test_fraction=validation)
        fit_hist, _ = history_by_user(fit_i, ds.num_users, history_len)
    config = ModelConfig(
        num_items=ds.num_items,
        user_features=dict(ds.user_feature_sizes),
        dense_dim=int(ds.user_dense.shape[1]),
        item_attributes={k: list(v) for k, v in ds.attribute_values.items()},
        history_len=history_len,
        **model_overrides,
    )
    cat = user_codes(ds, list(config.user_features))
    fit_i = fit_i.select(user_timelines(fit_i)[0])  # timeline order: causal histories
    train = TrainingData(
        user_ids=fit_i.user_id.astype(np.int64),
        item_ids=fit_i.item_id.astype(np.int64),
        history=fit_hist,
        categorical=cat,
        dense=ds.user_dense.astype(np.float32),
        item_features=item_feature_ids(ds.item_attributes, ds.num_items),
        item_log_q=log_q_from_counts(fit_i.item_id, ds.num_items),
        pair_first=timeline_first(fit_i.user_id),
        task_labels=_task_labels(config, fit_i),
    )
    counts = SplitCounts.of(ds.num_users, fit_i, val_i, test_i)
    return Prepared(
        ds,
        config,
        train,
        hist,
        items_by_user(test_i, ds.num_users),
        items_by_user(val_i, ds.num_users),
        counts,
        seen=SeenSets.of(train_i.user_id, train_i.item_id, ds.num_users),
        train_seen=SeenSets.of(fit_i.user_id, fit_i.item_id, ds.num_users),
    )


def _task_labels(config: ModelConfig, pairs: Interactions) -> np.ndarray | None:
    """The head's per-task labels of the training pairs, or None (no head, or no task with a
    label rule: the head learns through the softmax only)."""
    if not config.scoring_head:
        return None
    labels = task_labels(config.head_tasks, pairs)
    return None if np.isnan(labels[:1]).all() else labels


def items_by_user(interactions: Interactions | None, num_users: int) -> list[set[int]]:
    """Each user's set of items (``num_users`` sets; empty for a user without any)."""
    out: list[set[int]] = [set() for _ in range(num_users)]
    if interactions is None:
        return out
    for u, i in zip(interactions.user_id.tolist(), interactions.item_id.tolist(), strict=True):
        out[u].add(i)
    return out
