"""The engine client: everything a front end asks of the engine, in this process or another.

A front end (Recommend gRPC, KServe v2 gRPC and HTTP, the admin API) never touches the model,
the batcher or the host: it holds an :class:`EngineClient` and

* submits the parsed rows of one call with their deadline -> one future per row
  (:meth:`EngineClient.submit`: all rows or none; a refusal names the row);
* reads :attr:`EngineClient.ready` (a version loaded, the engine reachable) and
  :meth:`EngineClient.info` (the served version's tensor interface and batching policy);
* forwards a live update (:meth:`EngineClient.update`: the admin message's bytes in, the
  reply's bytes out, so the engine layer knows no wire protocol).

Two implementations, as vLLM's in-process and multi-process engine clients:
:class:`InProcessEngine` (this module: the single-process mode, and the engine side of the
split) and ``serving.engine.zmq_client.ZmqEngineClient`` (a front-end process talking to the
engine process over ZeroMQ, ``serving/engine/wire.py`` for the messages)::

    engine = InProcessEngine(host, batcher)
    futures = engine.submit([req_a, req_b])       # [Future[RecResult]] * 2
    info = engine.info()                          # ModelInfo: F, Dd, max K, policy, ...
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, Protocol

from serving.engine.batching import BatchPolicy, DynamicBatcher
from serving.engine.host import ModelHost
from serving.engine.runner import Admission, check_target
from serving.limits import LimitsConfig
from serving.types import MAX_K, ModelNotFoundError, RecRequest, RecResult, RequestError

UpdateHandler = Callable[[str, bytes, str, "float | None"], bytes]
"""``handle(kind, request bytes, update_id, deadline) -> reply bytes``: applies one live update
(``serving/live/admin.py`` builds it; the engine forwards admin messages as bytes)."""


@dataclass(frozen=True)
class ModelInfo:
    """What a front end needs of the served version to parse and describe calls."""

    name: str
    version: int
    categorical: int
    """F: categorical user features."""
    dense: int
    """Dd: dense user features."""
    max_k: int
    """Largest K a request may ask for (``MAX_K``, the catalog, the index)."""
    raw_ids: bool
    """The version has id maps (raw ids in and out)."""
    seen_store: bool
    """The version keeps a seen store (the optional ``user`` input)."""
    platform: str
    """``config.pbtxt``'s platform (or backend); "" without one."""
    policy: BatchPolicy
    """The engine's batching policy (``max_batch_size`` bounds a call's rows)."""
    config: Any = None
    """The version's ``config.pbtxt``: a ``ModelConfig`` message in process, its serialized
    bytes from another process (None: the version has none)."""

    def check_target(self, model: str, version: int | None) -> None:
        """:class:`ModelNotFoundError` unless ``model`` / ``version`` name this version."""
        check_target(self.name, self.version, model, version)


class EngineClient(Protocol):
    """The engine as a front end sees it (see the module docstring)."""

    @property
    def ready(self) -> bool:
        """A version is loaded and the engine answers."""
        ...

    @property
    def version(self) -> int | None:
        """The version being served (None: none, or the engine is unreachable)."""
        ...

    def info(self) -> ModelInfo:
        """The served version; :class:`~serving.types.UnavailableError` when there is none."""
        ...

    def submit(self, reqs: Sequence[RecRequest]) -> list[Future[RecResult]]:
        """Queues every row of one call (each with its ``deadline``), or none; a refusal at the
        edge (INVALID_ARGUMENT, NOT_FOUND, RESOURCE_EXHAUSTED, UNAVAILABLE) is raised at once in
        process and by every future across processes."""
        ...

    def update(
        self, kind: str, request: bytes, update_id: str, deadline: float | None
    ) -> Future[bytes]:
        """One live update (``kind``: the admin method, ``request``: its message's bytes) ->
        the reply message's bytes."""
        ...

    def close(self) -> None:
        """Releases what the client holds (sockets, threads)."""
        ...


def row_note(b: int, rows: int) -> str:
    """Where a refusal of a call of ``rows`` rows comes from (nothing for a one-row call)."""
    return f" (batch row {b})" if rows > 1 else ""


class InProcessEngine:
    """The engine in this process: ``host`` (the version, hot reload) and ``batcher``."""

    def __init__(
        self,
        host: ModelHost,
        batcher: DynamicBatcher[Admission],
        *,
        limits: LimitsConfig | None = None,
        on_update: UpdateHandler | None = None,
    ):
        """``limits``: what a filter is parsed within at admission; ``on_update``: applies
        live updates (None: live updates are off)."""
        self.host, self.batcher = host, batcher
        self.limits = limits or LimitsConfig()
        self.on_update = on_update

    @property
    def ready(self) -> bool:
        return self.host.ready

    @property
    def version(self) -> int | None:
        return self.host.version

    def info(self) -> ModelInfo:
        runner = self.host.current()  # UnavailableError before the first version loads
        loaded = self.host.loaded
        config = None if loaded is None else loaded.config
        platform = (config.platform or config.backend) if config is not None else ""
        return ModelInfo(
            name=runner.name,
            version=runner.version,
            categorical=len(runner.features),
            dense=runner.dense_dim,
            max_k=min(MAX_K, runner.num_items, runner.model.index.ntotal),
            raw_ids=runner.item_map is not None,
            seen_store=runner.model.seen_store is not None,
            platform=platform,
            policy=self.batcher.policy,
            config=config,
        )

    def submit(self, reqs: Sequence[RecRequest]) -> list[Future[RecResult]]:
        futures: list[Future[RecResult]] = []
        for b, req in enumerate(reqs):
            try:
                futures.append(self.batcher.submit(self.host.current().admit(req, self.limits)))
            except (RequestError, ModelNotFoundError) as e:
                _cancel(futures)
                raise type(e)(f"{e}{row_note(b, len(reqs))}") from None
            except BaseException:
                _cancel(futures)
                raise
        return futures

    def update(
        self, kind: str, request: bytes, update_id: str, deadline: float | None
    ) -> Future[bytes]:
        out: Future[bytes] = Future()
        if self.on_update is None:
            raise RuntimeError("update: live updates are off in this engine")
        try:
            out.set_result(self.on_update(kind, request, update_id, deadline))
        except Exception as e:
            out.set_exception(e)
        return out

    def close(self) -> None:
        """Nothing to release: the server stops the batcher and the host."""


def _cancel(futures: Sequence[Future[Any]]) -> None:
    for f in futures:
        f.cancel()
