"""One ``recserve serve embeddings`` process: which rows it serves, where it listens, how much
memory its rows may take (``sharded_tables/remote/server.py``). Loads no torch."""

from __future__ import annotations

from collections.abc import Mapping
from typing import ClassVar

from pydantic import Field, field_validator

from common.config import Config, ConfigError, PathValue, Port, WaitS
from sharded_tables.placement import parse_bytes


class EmbeddingServerConfig(Config):
    """An embedding server: one folder of packed rows (the remote tier), over gRPC."""

    flags: ClassVar[Mapping[str, str]] = {
        "folder": "--folder",
        "model_repo": "--model-repo",
        "model": "--model",
        "index": "--index",
        "host": "--host",
        "grpc_port": "--grpc-port",
        "memory_budget": "--memory-budget",
        "tables": "--tables",
        "poll_s": "--poll-s",
    }

    folder: PathValue | None = None
    """Rows folder of one embedding server (manifest.json + packed rows)."""
    model_repo: PathValue | None = None
    """Instead of --folder: a model repository; serves its latest version's rows."""
    model: str = ""
    """With --model-repo: the model (empty: the repository's only one)."""
    index: int | None = Field(default=None, ge=0)
    """With --model-repo: which embedding server's rows (0, 1, ...)."""
    host: str = Field(default="127.0.0.1", min_length=1)
    """Address to bind (this machine only by default)."""
    grpc_port: Port = 8201
    """gRPC port: Lookup, Put, health; 0: any free port."""
    memory_budget: str = "4GiB"
    """Refuse rows (at start, and puts later) larger than this: bytes, or 512MiB, 4GiB, 1.5GB."""
    tables: str = ""
    """Comma-separated tables to serve (empty: all of the folder's)."""
    poll_s: WaitS = 2.0
    """With --model-repo: seconds between looks for a new version, loaded beside the held one."""

    @field_validator("memory_budget")
    @classmethod
    def _a_size(cls, text: str) -> str:
        try:
            parse_bytes(text)
        except ValueError:  # the error names the field: say only what is wrong with the value
            raise ValueError(
                f"cannot read {text!r}; use bytes or a size like 512MiB, 4GiB"
            ) from None
        return text

    def budget_bytes(self) -> int:
        """``memory_budget`` in bytes."""
        return parse_bytes(self.memory_budget, "memory_budget")

    def table_names(self) -> list[str] | None:
        """``tables`` as a list; None: all."""
        return [t.strip() for t in self.tables.split(",") if t.strip()] or None

    def validate(self) -> None:  # type: ignore[override]  # see common.config.Config.validate
        """One source of rows: a folder, or a repository with the server's index."""
        if (self.folder is None) == (self.model_repo is None):
            raise ConfigError("folder (--folder): give --folder DIR, or --model-repo DIR --index N")
        if self.model_repo is not None and self.index is None:
            raise ConfigError(
                "index (--index): required with --model-repo (which embedding server)"
            )
