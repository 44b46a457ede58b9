"""A seeded synthetic catalog and interaction log that looks like real traffic.

* Items belong to latent topics; popularity within the catalog is Zipf-distributed.
* Each user has 1-3 interest topics and draws most items from them (weighted by popularity), with
  some exploration of the whole catalog; timestamps increase along each user's timeline.
* Item attributes usable as filters: ``category`` (correlated with topic), ``language`` (skewed),
  ``region``, ``age_rating``, ``available`` (boolean).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from retrieval.data.schema import Interactions, RecDataset

LANGUAGES = ["en", "es", "fr", "de", "pt", "ja", "hi", "ko"]
REGIONS = ["na", "eu", "latam", "apac", "mea", "global"]
AGE_RATINGS = ["all", "7+", "13+", "16+", "18+"]


@dataclass
class SyntheticConfig:
    """Sizes and shape of the generated data."""

    num_users: int = 2000
    num_items: int = 5000
    num_topics: int = 20
    num_categories: int = 12
    max_topics_per_user: int = 3
    mean_interactions: float = 40.0
    """Mean interactions per user (lognormal spread, at least 5)."""
    zipf_exponent: float = 1.1
    explore: float = 0.1
    """Share of interactions drawn from the whole catalog instead of the user's topics."""
    available_fraction: float = 0.9
    seed: int = 0


def generate(cfg: SyntheticConfig) -> RecDataset:
    """Vectorized generation; the same seed gives identical arrays."""
    rng = np.random.default_rng(cfg.seed)
    n, u, t = cfg.num_items, cfg.num_users, cfg.num_topics
    topic = rng.integers(0, t, n)
    pop = 1.0 / np.arange(1, n + 1) ** cfg.zipf_exponent
    pop = pop[rng.permutation(n)]  # popularity rank independent of item id

    # attributes: category mostly follows topic; language skewed towards "en"
    topic_category = rng.integers(0, cfg.num_categories, t)
    category = np.where(rng.random(n) < 0.8, topic_category[topic], rng.integers(0, cfg.num_categories, n))
    lang_p = np.array([0.45, 0.15, 0.1, 0.08, 0.07, 0.06, 0.05, 0.04])
    language = rng.choice(len(LANGUAGES), n, p=lang_p)
    region = rng.integers(0, len(REGIONS), n)
    age_rating = rng.choice(len(AGE_RATINGS), n, p=[0.35, 0.2, 0.25, 0.12, 0.08])
    available = (rng.random(n) < cfg.available_fraction).astype(np.int64)

    # users: interest topics and activity
    k = rng.integers(1, cfg.max_topics_per_user + 1, u)
    interests = np.argsort(rng.random((u, t)), axis=1)[:, : cfg.max_topics_per_user]  # [U, max]
    sigma = 0.6
    counts = np.maximum(5, rng.lognormal(np.log(cfg.mean_interactions) - sigma**2 / 2, sigma, u).astype(np.int64))
    m = int(counts.sum())
    user_id = np.repeat(np.arange(u), counts)

    # per interaction: pick one of the user's topics, then an item of that topic by popularity
    slot = (rng.random(m) * k[user_id]).astype(np.int64)
    chosen_topic = interests[user_id, slot]
    order = np.argsort(topic, kind="stable")
    topic_start = np.searchsorted(topic[order], np.arange(t + 1))
    cum = np.zeros(n + 1)
    cum[1:] = np.cumsum(pop[order])  # popularity mass within topic-sorted order
    lo, hi = cum[topic_start[chosen_topic]], cum[topic_start[chosen_topic + 1]]
    pick = np.searchsorted(cum, lo + rng.random(m) * (hi - lo), side="right") - 1
    pick = np.clip(pick, topic_start[chosen_topic], topic_start[chosen_topic + 1] - 1)
    item_id = order[pick]
    explore = rng.random(m) < cfg.explore
    item_id[explore] = rng.choice(n, int(explore.sum()), p=pop / pop.sum())

    # timestamps: each user's events spread over a year, increasing
    start = rng.integers(1_600_000_000, 1_630_000_000, u)
    gaps = rng.exponential(3600 * 24, m).astype(np.int64) + 1
    first = np.r_[0, np.cumsum(counts)[:-1]]
    cum_gaps = np.cumsum(gaps)
    timestamp = start[user_id] + cum_gaps - np.repeat(cum_gaps[first] - gaps[first], counts)

    user_region = rng.integers(0, len(REGIONS), u)
    age_bucket = rng.integers(0, 7, u)
    pref_lang = rng.choice(len(LANGUAGES), u, p=lang_p)
    activity = np.log(counts.astype(np.float32))
    tenure = rng.random(u).astype(np.float32)
    dense = np.stack([(activity - activity.mean()) / activity.std(), (tenure - 0.5) / 0.29], axis=1)

    ds = RecDataset(
        name=f"synthetic-{u}u-{n}i-seed{cfg.seed}", num_users=u, num_items=n,
        item_attributes={"category": category.astype(np.int64), "language": language.astype(np.int64),
                         "region": region.astype(np.int64), "age_rating": age_rating.astype(np.int64),
                         "available": available},
        attribute_values={"category": [f"cat{i}" for i in range(cfg.num_categories)], "language": LANGUAGES,
                          "region": REGIONS, "age_rating": AGE_RATINGS, "available": ["false", "true"]},
        user_features={"region": user_region, "age_bucket": age_bucket, "preferred_language": pref_lang},
        user_feature_sizes={"region": len(REGIONS), "age_bucket": 7, "preferred_language": len(LANGUAGES)},
        user_dense=dense.astype(np.float32),
        interactions=Interactions(user_id.astype(np.int64), item_id.astype(np.int64), timestamp.astype(np.int64)),
        item_names=None,
    )
    ds.validate()
    return ds


def item_topics(cfg: SyntheticConfig) -> np.ndarray:
    """The latent topic of every item (for tests of the generator)."""
    return np.random.default_rng(cfg.seed).integers(0, cfg.num_topics, cfg.num_items)
