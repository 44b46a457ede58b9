"""The serving process: its config, its parts wired together, process groups, the ready line.

``config`` (what ``serve.toml`` and the flags set) -> ``server.Server`` (one process: host,
batcher, gRPC/HTTP/metrics listeners running the front ends that ``frontends`` registers) or
``processes`` (N of them behind one port) -> ``main.serve`` (until SIGTERM, then drain).
Importing ``serving.app.config`` loads no torch.
"""
