"""The front ends a serving process runs, registered here by import (the layer check sees them).

Every process serves gRPC ``Recommend`` and grpc.health.v1 (``serving/frontends/recommend_grpc.py``)
and, on the same gRPC port, the services of :data:`GRPC_SERVICES`; with ``http_port`` set it
serves :data:`HTTP_APP` too. A new front end joins by adding its ``add_servicer`` (or its app)
here; :class:`~serving.app.server.Server` takes others in its place (tests: only the services a
test needs).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from serving.engine.state import ServingState
from serving.frontends import kserve_grpc, kserve_http
from serving.frontends.recommend_grpc import ExtraServicer
from serving.live import admin

HttpApp = Callable[[ServingState], Any]
"""``make_app(state) -> ASGI app``: the HTTP front end, run by uvicorn on ``http_port``."""

GRPC_SERVICES: tuple[ExtraServicer, ...] = (
    kserve_grpc.add_servicer,  # KServe v2 / Triton GRPCInferenceService
    admin.add_servicer,  # live updates (serving/live/admin.py; refused without state_dir)
)
"""Services added beside Recommend and health, each ``add_servicer(server, state)``."""

HTTP_APP: HttpApp = kserve_http.make_app
"""The KServe v2 HTTP/REST front end."""
