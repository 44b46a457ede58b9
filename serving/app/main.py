"""``recserve serve model`` (and ``serve router``): one serving process, a group of them
(``processes > 1``), or one engine and front ends (``frontends``), until SIGTERM."""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Sequence

from common.ready import ReadyLine
from common.stop_signals import EXIT_MARGIN_S, exit_if_stuck, serve_until_signal
from serving.app.config import ServeConfig
from serving.app.processes import serve_processes
from serving.app.server import ExtraServicer, Server
from serving.app.split import serve_split

log = logging.getLogger(__name__)


def serve(
    config: ServeConfig,
    *,
    extra_servicers: Sequence[ExtraServicer] | None = None,
) -> None:
    """Prints the ready line once serving (``common/ready.py``; the sentence of
    :meth:`Server.announce_line` goes to the log), serves until SIGTERM or SIGINT, then drains and returns; a drain that overruns
    ``drain_timeout_s`` (a stuck batch) ends the process at once with status 1. With
    ``processes > 1`` a group of serving processes serves (``serving/app/processes.py``; each
    runs the front ends of ``serving/app/frontends.py``); with ``frontends`` set, one engine
    process and front-end processes (``serving/app/split.py``)."""
    if config.frontends is not None or config.processes > 1:
        if extra_servicers is not None:
            raise ValueError(
                "extra_servicers: not with processes > 1 or frontends (each runs the registered "
                "front ends)"
            )
        if config.frontends is not None:
            serve_split(config)
        else:
            serve_processes(config)
        return
    server = Server(config, extra_servicers=extra_servicers)

    def start() -> ReadyLine:
        server.start()
        log.info("%s", server.announce_line())
        return server.ready()

    serve_until_signal(start)
    log.info("draining (up to %.1f s)", config.drain_timeout_s)
    exit_if_stuck(config.drain_timeout_s + EXIT_MARGIN_S, "the drain or the exit after it")
    if not server.drain_and_stop():
        log.error("drain did not finish within %.1f s; exiting anyway", config.drain_timeout_s)
        sys.stderr.flush()
        os._exit(1)
    log.info("drained; bye")
