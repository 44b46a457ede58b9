"""The engine of a serving process: model host (hot reload), live updates, batcher.

The single-process :class:`~serving.app.server.Server` and the engine process of a split group
(``serving/app/split.py``) build the engine the same way::

    parts = EngineParts(config, repo, metrics)
    engine = parts.start()        # loads + warms the newest version: an InProcessEngine
    ...
    parts.drain(timeout)          # the batcher runs what it holds
    parts.close(timeout)          # polls stop, logs close
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from common.grpc_util import ClientAuth
from serving.app.config import ServeConfig
from serving.engine.client import InProcessEngine
from serving.engine.host import ModelHost, Repository
from serving.engine.metrics import ServingMetrics
from serving.engine.state import make_batcher
from serving.live.admin import update_handler

if TYPE_CHECKING:
    from serving.live.updates import LiveUpdates


class EngineParts:
    """Builds and owns one model's engine (see the module docstring)."""

    def __init__(
        self,
        config: ServeConfig,
        repo: Repository,
        metrics: ServingMetrics,
        upstream: ClientAuth | None = None,
    ):
        """``upstream``: how a router calls its shards and embedding servers."""
        self.config, self.metrics = config, metrics
        make_runner = None
        self.router: Any = None
        if config.router is not None:  # a router: the index search runs on shard servers
            from serving.sharding.router import make_router

            repo, make_runner = make_router(
                repo,  # type: ignore[arg-type]
                config.model,
                config.router,
                metrics.registry,
                upstream=upstream,
            )
            self.router = repo
        self.updates: LiveUpdates | None = None
        if config.state_dir is not None:
            model_repo = repo
            if self.router is not None:  # updates go through the shards, in two phases
                from serving.sharding.routed_updates import RoutedUpdates

                self.updates = RoutedUpdates(
                    config.state_dir,
                    config.model,
                    metrics,
                    self.router.client,
                    versions=lambda: model_repo.versions(config.model),
                )
            else:
                from serving.live.updates import LiveUpdates

                self.updates = LiveUpdates(
                    config.state_dir,
                    config.model,
                    metrics,
                    versions=lambda: model_repo.versions(config.model),
                    compact_at=config.compact_at,
                )
        self.host = ModelHost(
            repo,
            config.model,
            config.poll_s,
            metrics=metrics,
            make_runner=make_runner,
            on_load=self.updates.replay if self.updates is not None else None,
        )
        self.engine: InProcessEngine | None = None

    def start(self) -> InProcessEngine:
        """Loads and warms the newest version, starts the batcher -> the engine."""
        cfg = self.config
        if cfg.torch_threads:
            import torch

            torch.set_num_threads(cfg.torch_threads)
        self.host.start()
        loaded = self.host.loaded  # set: start() returned
        policy = cfg.batching.policy(None if loaded is None else loaded.config)
        workers = cfg.router.batches_in_flight if cfg.router is not None else 1
        batcher = make_batcher(self.host, policy, self.metrics, workers)
        on_update = None
        if self.updates is not None:
            on_update = update_handler(self.updates, self.host, cfg.limits)
        self.engine = InProcessEngine(self.host, batcher, limits=cfg.limits, on_update=on_update)
        return self.engine

    def drain(self, timeout: float) -> bool:
        """Runs what the batcher holds (refusing more); False when it did not finish in time."""
        if self.engine is None:
            return True
        return self.engine.batcher.stop(drain=True, timeout=timeout)

    def close(self, timeout: float) -> None:
        """Stops the version poll (and a router's shard calls), closes the update logs."""
        if self.router is not None:  # cancels a version poll waiting on a shard that left too
            self.router.close()
        self.host.stop(timeout=timeout)
        if self.updates is not None:
            self.updates.close()
