"""Authentication and TLS for every server of ours: bearer tokens, TLS, who may call what.

One :class:`SecurityConfig` per process (``[security]`` in ``serve.toml``, or the ``--auth-*`` /
``--tls-*`` flags of every ``recserve serve`` command); :meth:`SecurityConfig.load`
reads its files once, at start-up, into a :class:`Security` that the servers use::

    security = SecurityConfig(token_file=Path("token"), tls_cert=cert, tls_key=key).load()
    grpc.server(pool, interceptors=security.interceptors())   # bearer tokens
    bind_port(server, host, port, "grpc_port", security.grpc_credentials)   # TLS
    uvicorn.Config(security.wrap_http(app), **security.http_ssl)   # the same over HTTP
    open_channel(shard_address, options, security.upstream)   # a router calling its shards

What needs the token (``authorization: Bearer <token>``, gRPC metadata or HTTP header), once one
is configured:

========  ===============================================================  =====================
access    methods                                                          token
========  ===============================================================  =====================
open      gRPC health, KServe ``ServerLive`` / ``ServerReady``,             never (probes)
          HTTP ``/v2/health/*``
admin     ``recserve.admin.v1.Admin/*`` (live updates), KServe repository   always
          load/unload and other control methods, HTTP ``/v2/repository*``,
          ``EmbeddingService/Put`` (writes rows)
serving   everything else: Recommend, ModelInfer, metadata, shard Search,   with ``auth_serving``
          embedding Lookup                                                  (the default)
========  ===============================================================  =====================

Tokens are compared with :func:`hmac.compare_digest` (constant time); a refusal is
UNAUTHENTICATED (gRPC) or 401 with ``WWW-Authenticate: Bearer`` (HTTP), and neither the answer
nor the log ever holds a token (the given one included: it may be another system's secret).
A refusal logs one warning line, the method or path escaped (``common.logs.safe``: a ``%0A``
in a path cannot start a forged line) and rate-limited (a flood of refusals is a few lines),
and calls the server's :data:`OnRefused` hook, if it passed one, with the gRPC method or HTTP
path and the reason ``"unauthenticated"`` (the serving process counts refused inference calls
in its failure metrics; this module knows nothing of them).
The Prometheus ``/metrics`` port is neither authenticated nor encrypted: it binds the same host
(127.0.0.1 by default) and holds no request data.
"""

from __future__ import annotations

import hmac
import ipaddress
import logging
import os
import re
import ssl
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Literal

import grpc
from pydantic import Field
from starlette.datastructures import Headers
from starlette.responses import JSONResponse

from common.config import Config, ConfigError, PathValue
from common.grpc_util import ClientAuth
from common.logs import limit_rate, safe

log = limit_rate(logging.getLogger(__name__))

Access = Literal["open", "serving", "admin"]
OPEN_GRPC = frozenset(
    {
        "/grpc.health.v1.Health/Check",
        "/grpc.health.v1.Health/Watch",
        "/inference.GRPCInferenceService/ServerLive",
        "/inference.GRPCInferenceService/ServerReady",
    }
)
"""Probes: load balancers and orchestrators call them without credentials."""
ADMIN_GRPC = (
    "/recserve.admin.v1.Admin/",  # serving/live/admin.py: live updates
    "/recserve.embedding.v1.EmbeddingService/Put",  # writes rows of keyed tables
    *(
        f"/inference.GRPCInferenceService/{m}"  # control methods (today all UNIMPLEMENTED)
        for m in ("Repository", "SystemSharedMemory", "CudaSharedMemory", "TraceSetting", "Log")
    ),
)
"""Prefixes of methods that change the server: they need the token even without
``auth_serving``. Literal names, not the services' constants: importing those pulls in torch."""
OnRefused = Callable[[str, str], None]
"""``on_refused(method_or_path, reason)``: called once per refused call, before it is answered;
the method is ``/package.Service/Method``, the path an HTTP one without its query."""
MIN_TOKEN_CHARS = 16
TOKEN_CHARS = re.compile(r"[\x21-\x7e]+")
"""Printable ASCII without spaces: what an HTTP header and gRPC metadata carry unchanged."""


def grpc_access(method: str) -> Access:
    """``/package.Service/Method`` -> who may call it (see the module docstring)."""
    if method in OPEN_GRPC:
        return "open"
    if method.startswith(ADMIN_GRPC):
        return "admin"
    return "serving"


def http_access(path: str) -> Access:
    """An HTTP path -> who may call it: ``/v2/health/*`` is open, ``/v2/repository*`` (KServe's
    model load/unload) is admin, the rest serving."""
    if path.startswith("/v2/health/"):
        return "open"
    if path.startswith("/v2/repository"):
        return "admin"
    return "serving"


# ---- checking a token ---------------------------------------------------------------------------
class Authenticator:
    """Holds the token (never shows it) and checks ``Authorization`` values in constant time."""

    def __init__(self, token: str, auth_serving: bool = True):
        self._token = token.encode()
        self.auth_serving = auth_serving

    def __repr__(self) -> str:
        return f"Authenticator(token=<hidden>, auth_serving={self.auth_serving})"

    def required(self, access: Access) -> bool:
        return access == "admin" or (access == "serving" and self.auth_serving)

    def check(self, authorization: str | None) -> str | None:
        """``"Bearer <token>"`` -> None when it holds the token, else why not (no token in it)."""
        if not authorization:
            return "no bearer token"
        scheme, _, given = authorization.strip().partition(" ")
        if scheme.lower() != "bearer":
            return "not a bearer token"
        # bytes: compare_digest refuses non-ASCII str; surrogateescape keeps any input comparable
        if not hmac.compare_digest(given.strip().encode("utf-8", "surrogateescape"), self._token):
            return "invalid bearer token"
        return None


def _refused(where: str, what: str, why: str) -> None:
    log.warning("%s: refused %s: %s", where, safe(what), why)


def _deny_handler(handler: grpc.RpcMethodHandler | None, why: str) -> grpc.RpcMethodHandler:
    """A handler of the same kind as ``handler`` (unary or streaming) that answers
    UNAUTHENTICATED without running it."""
    message = f"{why}: send the metadata 'authorization: Bearer <token>'"

    def deny(_request: Any, context: grpc.ServicerContext) -> Any:
        context.abort(grpc.StatusCode.UNAUTHENTICATED, message)

    streams = (handler.request_streaming, handler.response_streaming) if handler else (0, 0)
    make = {
        (False, False): grpc.unary_unary_rpc_method_handler,
        (False, True): grpc.unary_stream_rpc_method_handler,
        (True, False): grpc.stream_unary_rpc_method_handler,
        (True, True): grpc.stream_stream_rpc_method_handler,
    }[(bool(streams[0]), bool(streams[1]))]
    return make(deny)


class AuthInterceptor(grpc.ServerInterceptor):
    """Refuses (UNAUTHENTICATED) a call whose method needs the token and lacks it."""

    def __init__(self, auth: Authenticator, on_refused: OnRefused | None = None):
        self.auth, self.on_refused = auth, on_refused

    def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], grpc.RpcMethodHandler | None],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler | None:
        method = details.method
        if not self.auth.required(grpc_access(method)):
            return continuation(details)
        given = [v for k, v in details.invocation_metadata or () if k == "authorization"]
        why = self.auth.check(given[0] if len(given) == 1 else None)
        if why is None:
            return continuation(details)
        _refused("grpc", method, why)
        if self.on_refused is not None:
            self.on_refused(method, "unauthenticated")
        return _deny_handler(continuation(details), why)


class BearerAuthMiddleware:
    """ASGI middleware: the HTTP side of :class:`AuthInterceptor` (401, ``WWW-Authenticate``)."""

    def __init__(self, app: Any, auth: Authenticator, on_refused: OnRefused | None = None):
        self.app, self.auth, self.on_refused = app, auth, on_refused

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "http" and self.auth.required(http_access(scope["path"])):
            why = self.auth.check(Headers(scope=scope).get("authorization"))
            if why is not None:
                _refused("http", f"{scope['method']} {scope['path']}", why)
                if self.on_refused is not None:
                    self.on_refused(scope["path"], "unauthenticated")
                error = "invalid_request" if why == "no bearer token" else "invalid_token"
                response = JSONResponse(
                    {"error": f"{why}: send the header 'Authorization: Bearer <token>'"},
                    status_code=401,
                    headers={"WWW-Authenticate": f'Bearer realm="recserve", error="{error}"'},
                )
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)


# ---- configuration ------------------------------------------------------------------------------
class SecurityConfig(Config):
    """Tokens and TLS of one process; all off by default (then the servers must listen on
    127.0.0.1, their default, or on a network you trust)."""

    flags: ClassVar[Mapping[str, str]] = {
        "token_file": "--auth-token-file",
        "token_env": "--auth-token-env",
        "auth_serving": "--auth-serving/--no-auth-serving",
        "tls_cert": "--tls-cert",
        "tls_key": "--tls-key",
        "tls_client_ca": "--tls-client-ca",
        "upstream_ca": "--upstream-ca",
    }

    token_file: PathValue | None = None
    """File holding the bearer token (surrounding whitespace ignored). Set (or ``token_env``):
    admin methods need the token, and serving ones too with ``auth_serving``. A file or an
    environment variable, never a flag's value: a command line is visible to ``ps``."""
    token_env: str = ""
    """Name of an environment variable holding the token (instead of ``token_file``)."""
    auth_serving: bool = True
    """With a token: serving methods (Recommend, inference, metadata, shard and embedding
    lookups) need it too. False: only admin methods do. Health checks never do."""
    tls_cert: PathValue | None = None
    """PEM certificate chain: gRPC and HTTP serve TLS only (with ``tls_key``)."""
    tls_key: PathValue | None = None
    """PEM private key of ``tls_cert``."""
    tls_client_ca: PathValue | None = None
    """PEM CA certificates: set, clients must present a certificate they sign (mutual TLS)."""
    upstream_ca: PathValue | None = None
    """Router only: PEM CA certificates that verify the shard and embedding servers it calls;
    set, those calls use TLS (presenting ``tls_cert`` when set). They always carry the token."""
    token: str | None = Field(default=None, repr=False)
    """The token itself, for in-process use (tests); never read from a file or flag."""

    def has_token(self) -> bool:
        return bool(self.token_file or self.token_env or self.token is not None)

    def validate(self) -> None:  # type: ignore[override]  # see Config.validate
        """Raises ``ConfigError`` naming the first bad field (``security.<key> (--flag)``)."""

        def bad(name: str, why: str) -> ConfigError:
            flag = f" ({self.flags[name]})" if name in self.flags else ""
            return ConfigError(f"security.{name}{flag}: {why}")

        sources = [f for f in ("token_file", "token_env") if getattr(self, f)]
        if self.token is not None:
            sources.append("token")
        if len(sources) > 1:
            raise bad(sources[1], f"give one source of the token, not {' and '.join(sources)}")
        if (self.tls_cert is None) != (self.tls_key is None):
            missing = "tls_key" if self.tls_key is None else "tls_cert"
            raise bad(missing, "TLS needs both tls_cert and tls_key")
        if self.tls_client_ca is not None and self.tls_cert is None:
            raise bad("tls_client_ca", "mutual TLS needs the server's own tls_cert and tls_key")
        for name in ("token_file", "tls_cert", "tls_key", "tls_client_ca", "upstream_ca"):
            path = getattr(self, name)
            if path is not None and not Path(path).is_file():
                raise bad(name, f"{path} is not a file")
        if self.token_env and not os.environ.get(self.token_env, "").strip():
            raise bad("token_env", f"the environment variable {self.token_env} is not set")

    def read_token(self) -> str | None:
        """The token (checked: printable ASCII, no spaces, >= 16 characters), or None."""
        if self.token_file is not None:
            try:
                name, text = "token_file", Path(self.token_file).read_bytes().decode("ascii")
            except (OSError, UnicodeDecodeError) as e:  # neither quotes the file's bytes
                raise ConfigError(f"security.token_file (--auth-token-file): {e}") from None
        elif self.token_env:
            name, text = "token_env", os.environ.get(self.token_env, "")
        elif self.token is not None:
            name, text = "token", self.token
        else:
            return None
        token = text.strip()
        where = f"security.{name}{f' ({self.flags[name]})' if name in self.flags else ''}"
        if not TOKEN_CHARS.fullmatch(token):  # the message never quotes the token
            raise ConfigError(f"{where}: the token must be printable ASCII without spaces")
        if len(token) < MIN_TOKEN_CHARS:
            raise ConfigError(
                f"{where}: the token has {len(token)} characters; use at least "
                f"{MIN_TOKEN_CHARS} (e.g. `openssl rand -hex 32`)"
            )
        return token

    def load(self) -> Security:
        """Validates, reads the token and certificates once, and checks that the key matches
        the certificate (``ConfigError`` naming the field)."""
        self.validate()
        token = self.read_token()
        auth = Authenticator(token, self.auth_serving) if token is not None else None
        credentials, cert, key = None, None, None
        http_ssl: dict[str, Any] = {}
        if self.tls_cert is not None and self.tls_key is not None:
            try:  # the check uvicorn would make, but here, naming the fields
                ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
                ctx.load_cert_chain(self.tls_cert, self.tls_key)
                if self.tls_client_ca is not None:
                    ctx.load_verify_locations(self.tls_client_ca)
            except (ssl.SSLError, ValueError) as e:
                raise ConfigError(
                    f"security.tls_cert, tls_key, tls_client_ca: cannot use {self.tls_cert} with "
                    f"{self.tls_key}: {e}"
                ) from None
            cert, key = Path(self.tls_cert).read_bytes(), Path(self.tls_key).read_bytes()
            ca = Path(self.tls_client_ca).read_bytes() if self.tls_client_ca else None
            credentials = grpc.ssl_server_credentials(
                [(key, cert)], root_certificates=ca, require_client_auth=ca is not None
            )
            http_ssl |= {"ssl_certfile": str(self.tls_cert), "ssl_keyfile": str(self.tls_key)}
            if self.tls_client_ca is not None:
                http_ssl |= {
                    "ssl_ca_certs": str(self.tls_client_ca),
                    "ssl_cert_reqs": ssl.CERT_REQUIRED,
                }
        upstream = None
        if token is not None or self.upstream_ca is not None:
            roots = Path(self.upstream_ca).read_bytes() if self.upstream_ca else None
            mtls = roots is not None and cert is not None
            upstream = ClientAuth(roots, token, cert if mtls else None, key if mtls else None)
        return Security(auth, credentials, http_ssl, upstream)

    @classmethod
    def from_flags(cls, base: SecurityConfig | None = None, **flags: Any) -> SecurityConfig:
        """``base`` (default: all off) with every flag that is not None applied (unknown names
        ignored: a command passes all of its flags); errors name the field and flag."""
        base = base or cls()
        given = {k: v for k, v in flags.items() if v is not None and k in cls.model_fields}
        if given.get("token_file") is not None:  # a flag replaces the file's source of the token
            base = base.model_copy(update={"token_env": ""})
        elif given.get("token_env"):
            base = base.model_copy(update={"token_file": None})
        return base.updated(**given)


@dataclass(frozen=True)
class Security:
    """A loaded :class:`SecurityConfig`: what the servers and clients of one process use."""

    auth: Authenticator | None = None
    """Set: tokens are checked (see :meth:`Authenticator.required` for which methods)."""
    grpc_credentials: grpc.ServerCredentials | None = None
    """Set: gRPC listens with TLS only."""
    http_ssl: dict[str, Any] = field(default_factory=dict)
    """``uvicorn.Config`` keyword arguments for TLS (empty: plaintext)."""
    upstream: ClientAuth | None = None
    """How a router calls its shard and embedding servers (None: plaintext, no token)."""

    def interceptors(self, on_refused: OnRefused | None = None) -> list[grpc.ServerInterceptor]:
        """The token check (none when no token is configured); ``on_refused`` hears each
        refusal."""
        return [AuthInterceptor(self.auth, on_refused)] if self.auth is not None else []

    def wrap_http(self, app: Any, on_refused: OnRefused | None = None) -> Any:
        """The ASGI ``app`` behind the token check (itself when no token is configured);
        ``on_refused`` hears each refusal."""
        if self.auth is None:
            return app
        return BearerAuthMiddleware(app, self.auth, on_refused)

    def describe(self) -> str:
        """``"tls+token"``, ``"tls"``, ``"token"``, or ``""`` when both are off."""
        parts = ["tls"] if self.grpc_credentials is not None else []
        if self.auth is not None:
            parts.append("token" if self.auth.auth_serving else "token(admin)")
        return "+".join(parts)

    def warn_if_exposed(self, host: str, what: str) -> None:
        """Logs a warning when ``host`` is not a loopback address and TLS or a token is off."""
        try:
            loopback = ipaddress.ip_address(host).is_loopback
        except ValueError:
            loopback = host == "localhost"
        missing = [
            n for n, on in (("TLS", self.grpc_credentials), ("a token", self.auth)) if not on
        ]
        if not loopback and missing:
            log.warning("%s listens on %s without %s", what, host, " and ".join(missing))


NO_SECURITY = Security()
"""Plaintext, no token: the default of every server."""
