"""``recserve serve model | router | shard | embeddings``: the server processes.

The flags of ``model``, ``router`` and ``shard`` are generated from the fields of their configs
(``ServeConfig``, ``RouterConfig``, ``ShardServerConfig``, ``SecurityConfig``: name, help,
default), and every value goes through the config's validation, so an error names the field and
its flag. Every server binds 127.0.0.1 unless ``--host`` says otherwise and serves gRPC on
``--grpc-port``.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import typer

from common.security import SecurityConfig
from recserve.options import field_option
from serving.app.config import ServeConfig
from serving.sharding.config import RouterConfig, ShardServerConfig
from sharded_tables.remote.config import EmbeddingServerConfig

serve_app = typer.Typer(
    no_args_is_help=True,
    help="Server processes: a model, a router of document shards, a shard, embedding rows.",
)
LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


def _sec(name: str) -> Any:
    """A security flag (every server command takes them), from ``SecurityConfig``'s field."""
    return field_option(SecurityConfig, name, override=True)


def _serve(flags: dict[str, Any], config: Path | None, router: dict[str, Any] | None) -> None:
    """Builds the ServeConfig (file, then flags), and serves until SIGTERM."""
    import logging

    from common.config import ConfigError
    from serving.app.main import serve
    from serving.app.processes import GroupStartError
    from serving.engine.host import NoLoadableVersionError

    logging.basicConfig(level=logging.INFO, format=LOG_FORMAT)
    security = {k: flags.pop(k) for k in list(flags) if k in SecurityConfig.model_fields}
    try:
        cfg = ServeConfig.from_toml(config) if config is not None else ServeConfig()
        cfg = cfg.with_overrides(**flags)
        if router is None and cfg.router is not None:
            raise ConfigError(f"router: {config} has a [router] table: run `recserve serve router`")
        if router is not None:
            routed = (cfg.router or RouterConfig()).updated(**router)
            cfg = cfg.model_copy(update={"router": routed})
        sec = SecurityConfig.from_flags(cfg.security, **security)
        serve(cfg.model_copy(update={"security": sec}))
    except (ConfigError, NoLoadableVersionError, OSError, GroupStartError) as e:
        typer.echo(f"serve: {e}", err=True)
        raise typer.Exit(2) from None


def _opt(name: str) -> Any:
    return field_option(ServeConfig, name, override=True)


CONFIG_HELP = "serve.toml; flags override its values"


@serve_app.command("model")
def serve_model(
    model_repo: Path = _opt("model_repo"),
    model: str = _opt("model"),
    config: Path = typer.Option(None, "--config", help=CONFIG_HELP),
    host: str = _opt("host"),
    grpc_port: int = _opt("grpc_port"),
    http_port: int = _opt("http_port"),
    metrics_port: int = _opt("metrics_port"),
    poll_s: float = _opt("poll_s"),
    torch_threads: int = _opt("torch_threads"),
    processes: int = _opt("processes"),
    frontends: int = _opt("frontends"),
    state_dir: Path = _opt("state_dir"),
    device: str = _opt("device"),
    token_file: Path = _sec("token_file"),
    token_env: str = _sec("token_env"),
    auth_serving: bool = _sec("auth_serving"),
    tls_cert: Path = _sec("tls_cert"),
    tls_key: Path = _sec("tls_key"),
    tls_client_ca: Path = _sec("tls_client_ca"),
) -> None:
    """Serve a model of a repository over gRPC (and HTTP) until SIGTERM; prints one line when
    ready, hot-reloads new versions, drains on SIGTERM."""
    flags = dict(locals())
    _serve(flags, flags.pop("config"), router=None)


def _route(name: str) -> Any:
    return field_option(RouterConfig, name, override=True)


@serve_app.command("router")
def serve_router(
    shards: str = typer.Option(
        None,
        "--shards",
        help=f"{RouterConfig.model_fields['shards'].description} "
        "Shards separated by ',', replicas by '|' (a:1|a:2,b:1); required unless the config's "
        "[router] table has them",
    ),
    shard_deadline_ms: float = _route("shard_deadline_ms"),
    hedge_after_ms: float = _route("hedge_after_ms"),
    batches_in_flight: int = _route("batches_in_flight"),
    embedding_servers: str = typer.Option(
        None,
        "--embedding-servers",
        help=f"{RouterConfig.model_fields['embedding_servers'].description} Comma-separated.",
    ),
    model_repo: Path = _opt("model_repo"),
    model: str = _opt("model"),
    config: Path = typer.Option(None, "--config", help=CONFIG_HELP),
    host: str = _opt("host"),
    grpc_port: int = _opt("grpc_port"),
    http_port: int = _opt("http_port"),
    metrics_port: int = _opt("metrics_port"),
    poll_s: float = _opt("poll_s"),
    torch_threads: int = _opt("torch_threads"),
    processes: int = _opt("processes"),
    state_dir: Path = _opt("state_dir"),
    device: str = _opt("device"),
    token_file: Path = _sec("token_file"),
    token_env: str = _sec("token_env"),
    auth_serving: bool = _sec("auth_serving"),
    tls_cert: Path = _sec("tls_cert"),
    tls_key: Path = _sec("tls_key"),
    tls_client_ca: Path = _sec("tls_client_ca"),
    upstream_ca: Path = _sec("upstream_ca"),
) -> None:
    """Serve the router of a document-sharded version: the towers here, the index search on
    the shard servers (``serve shard``), their answers merged exactly. With ``--state-dir``,
    live updates (the Admin API) go through it to every shard, logged once here."""
    flags = dict(locals())  # the parameters only: taken before any local import
    from serving.sharding.config import parse_shards

    router = {
        "shards": parse_shards(shards) if shards is not None else None,
        "shard_deadline_ms": flags.pop("shard_deadline_ms"),
        "hedge_after_ms": flags.pop("hedge_after_ms"),
        "batches_in_flight": flags.pop("batches_in_flight"),
        "embedding_servers": [a.strip() for a in embedding_servers.split(",") if a.strip()]
        if embedding_servers is not None
        else None,
    }
    del flags["shards"], flags["embedding_servers"]
    _serve(flags, flags.pop("config"), router=router)


def _shard(name: str) -> Any:
    return field_option(ShardServerConfig, name)


@serve_app.command("shard")
def serve_shard_cmd(
    model_repo: Path = _shard("model_repo"),
    shard: int = _shard("shard"),
    model: str = _shard("model"),
    host: str = _shard("host"),
    grpc_port: int = _shard("grpc_port"),
    metrics_port: int = _shard("metrics_port"),
    poll_s: float = _shard("poll_s"),
    keep: int = _shard("keep"),
    device: str = _shard("device"),
    torch_threads: int = _shard("torch_threads"),
    compact_at: int = _shard("compact_at"),
    token_file: Path = _sec("token_file"),
    token_env: str = _sec("token_env"),
    auth_serving: bool = _sec("auth_serving"),
    tls_cert: Path = _sec("tls_cert"),
    tls_key: Path = _sec("tls_key"),
    tls_client_ca: Path = _sec("tls_client_ca"),
) -> None:
    """Serve one document shard of a model's index until SIGTERM (prints its address)."""
    flags = dict(locals())  # the parameters only: taken before any local import
    import logging

    from common.config import ConfigError

    security = {k: flags.pop(k) for k in list(flags) if k in SecurityConfig.model_fields}
    logging.basicConfig(level=logging.INFO, format=LOG_FORMAT)
    try:
        cfg = ShardServerConfig.from_dict(flags)
        sec = SecurityConfig.from_flags(None, **security).load()
        _run_shard(cfg, sec)
    except (ConfigError, ValueError, OSError) as e:
        typer.echo(f"serve shard: {e}", err=True)
        raise typer.Exit(2) from None


def _run_shard(cfg: ShardServerConfig, security: Any) -> None:
    import torch

    from common.devices import check_device

    if cfg.torch_threads:
        torch.set_num_threads(cfg.torch_threads)
    check_device(cfg.device)  # a GPU torch cannot see: refused before anything loads

    from serving.repository.repository import ModelRepository
    from serving.sharding.shard_server import ShardServer, serve_shard

    server = ShardServer(
        ModelRepository(cfg.model_repo), only_model(cfg.model_repo, cfg.model or None),
        cfg.shard, host=cfg.host, port=cfg.grpc_port, metrics_port=cfg.metrics_port,
        poll_s=cfg.poll_s, keep=cfg.keep, device=cfg.device, security=security,
        compact_at=cfg.compact_at,
    )  # fmt: skip
    serve_shard(server)


def _emb(name: str) -> Any:
    return field_option(EmbeddingServerConfig, name)


@serve_app.command("embeddings")
def serve_embeddings(
    folder: Path = _emb("folder"),
    model_repo: Path = _emb("model_repo"),
    model: str = _emb("model"),
    index: int = _emb("index"),
    host: str = _emb("host"),
    grpc_port: int = _emb("grpc_port"),
    memory_budget: str = _emb("memory_budget"),
    tables: str = _emb("tables"),
    poll_s: float = _emb("poll_s"),
    token_file: Path = _sec("token_file"),
    token_env: str = _sec("token_env"),
    auth_serving: bool = _sec("auth_serving"),
    tls_cert: Path = _sec("tls_cert"),
    tls_key: Path = _sec("tls_key"),
    tls_client_ca: Path = _sec("tls_client_ca"),
) -> None:
    """Serve one embedding server's rows (the remote tier) over gRPC until SIGTERM or SIGINT
    (prints its address)."""
    flags = dict(locals())  # the parameters only: taken before any local import
    from common.config import ConfigError
    from sharded_tables.remote.server import MemoryBudgetError, serve

    security = {k: flags.pop(k) for k in list(flags) if k in SecurityConfig.model_fields}
    try:
        cfg = EmbeddingServerConfig.from_dict(flags)
        cfg.validate()
        version, source = 0, None  # a folder: unversioned, not followed
        if cfg.model_repo is not None:
            assert cfg.index is not None  # validate(): a repository needs the index
            rows = embedding_folder(cfg.model_repo, cfg.model or None, cfg.index)
            version = int(rows.parent.parent.name)  # <model>/<version>/embeddings/server-<i>
            source = embedding_folders(cfg.model_repo, cfg.model or None, cfg.index)
        else:
            assert cfg.folder is not None  # validate(): a folder or a repository
            rows = cfg.folder
        sec = SecurityConfig.from_flags(None, **security).load()
        sec.warn_if_exposed(cfg.host, "serve embeddings")
        serve(
            rows, port=cfg.grpc_port, host=cfg.host, memory_budget=cfg.budget_bytes(),
            tables=cfg.table_names(), interceptors=sec.interceptors(),
            credentials=sec.grpc_credentials, version=version, source=source, poll_s=cfg.poll_s,
        )  # fmt: skip
    except (ConfigError, MemoryBudgetError, ValueError, OSError) as e:
        typer.echo(f"serve embeddings: {e}", err=True)
        raise typer.Exit(2) from None


TABLE_HELP = (
    "NAME:WIDTH, a keyed fp32 table (a hashed table's row and optimizer state; `recserve "
    "train` names the width it needs). Repeat for more tables."
)


@serve_app.command("training-store")
def serve_training_store(
    folder: Path = typer.Option(..., help="Rows folder; made when it does not exist."),
    table: list[str] = typer.Option(..., help=TABLE_HELP),
    host: str = typer.Option("127.0.0.1", help="Address to bind."),
    grpc_port: int = typer.Option(8301, help="gRPC port; 0: any free port."),
    memory_budget: str = typer.Option("4GiB", help="Refuse rows beyond this many bytes."),
) -> None:
    """Serve the training rows of hashed tables ([train.hashed] servers): an embedding server
    over keyed fp32 tables, made empty on first start; a restart replays its put log."""
    from sharded_tables.hashed_training import store_folder
    from sharded_tables.placement import parse_bytes
    from sharded_tables.remote.server import serve

    try:
        widths = {}
        for spec in table:
            name, sep, width = spec.rpartition(":")
            if not sep or not name or not width.isdigit() or int(width) < 1:
                raise ValueError(
                    f"--table: expected NAME:WIDTH (e.g. user_raw_id:33), got {spec!r}"
                )
            widths[name] = int(width)
        rows = store_folder(folder, widths)
        serve(rows, port=grpc_port, host=host, memory_budget=parse_bytes(memory_budget))
    except (ValueError, OSError) as e:
        typer.echo(f"serve training-store: {e}", err=True)
        raise typer.Exit(2) from None


def only_model(model_repo: Path, model: str | None) -> str:
    """``model``, or the repository's only model (``ValueError`` naming --model otherwise)."""
    from serving.repository.repository import ModelRepository

    found = ModelRepository(model_repo).models()
    if model:
        if model not in found:
            raise ValueError(f"--model: no model {model!r} in {model_repo} (found: {found})")
        return model
    if len(found) != 1:
        raise ValueError(f"--model: {model_repo} holds models {found}; name one")
    return found[0]


def embedding_folder(model_repo: Path, model: str | None, index: int) -> Path:
    """The latest version's rows for embedding server ``index``."""
    from serving.repository.repository import EMBEDDINGS_DIR, ModelRepository
    from sharded_tables.export import server_folder

    name = only_model(model_repo, model)
    vdir = ModelRepository(model_repo).verified_dir(name)
    folder = server_folder(vdir / EMBEDDINGS_DIR, index)
    if not folder.is_dir():
        raise ValueError(f"--index: {name} version {vdir.name} has no rows for server {index}")
    return folder


def embedding_folders(
    model_repo: Path, model: str | None, index: int
) -> Callable[[], dict[int, Path]]:
    """-> ``source()`` for a following embedding server: ``{version: rows folder of server
    index}`` over the complete versions (a folder may be missing: no rows there for it)."""
    from serving.repository.repository import EMBEDDINGS_DIR, ModelRepository
    from sharded_tables.export import server_folder

    repo = ModelRepository(model_repo)
    name = only_model(model_repo, model)

    def source() -> dict[int, Path]:
        return {
            v: server_folder(repo.model_dir(name) / str(v) / EMBEDDINGS_DIR, index)
            for v in repo.versions(name)
        }

    return source
