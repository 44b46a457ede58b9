"""Small gRPC helpers shared by this project's servers (embedding servers, the serving process)
and their clients: binding a port (TLS when given credentials), adding a service whose requests
that do not parse are refused with INVALID_ARGUMENT (:func:`add_service`), and opening a channel
that may use TLS and send a bearer token (:class:`ClientAuth`). What to check and which token to
accept is ``common/security.py``'s business; this module only speaks gRPC."""

from __future__ import annotations

import json
import socket
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field
from typing import Any

import grpc
from google.protobuf.message import DecodeError
from google.protobuf.message_factory import GetMessageClass


def format_address(host: str, port: int) -> str:
    """``host:port``, with IPv6 hosts in brackets."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def bind_port(
    server: grpc.Server,
    host: str,
    port: int,
    field: str,
    credentials: grpc.ServerCredentials | None = None,
) -> int:
    """Binds ``host:port`` (0: any free port), with TLS when ``credentials`` are given, and
    returns the bound port; ``OSError`` naming the config ``field`` when the address cannot be
    bound (grpc reports that as port 0 or an error)."""
    address = format_address(host, port)
    try:
        if credentials is None:
            bound = server.add_insecure_port(address)
        else:
            bound = server.add_secure_port(address, credentials)
    except RuntimeError as e:
        raise OSError(f"{field}: cannot bind {address}: {e}") from None
    if bound == 0:
        raise OSError(f"{field}: cannot bind {address}")
    return bound


def bind_tcp(
    host: str, port: int, field: str, *, reuse_addr: bool = False, reuse_port: bool = False
) -> socket.socket:
    """A TCP socket bound to ``host:port`` (0: any free port), not yet listening; ``OSError``
    naming the config ``field`` when the address cannot be bound. IPPROTO_TCP explicitly:
    asyncio sets TCP_NODELAY only on sockets it knows are TCP."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    if reuse_addr:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    if reuse_port:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise OSError(f"{field}: cannot bind {format_address(host, port)}: {e}") from None
    return sock


@dataclass(frozen=True)
class ClientAuth:
    """How a process calls a server of ours: TLS (when ``root_certificates`` is set) and a bearer
    token in every call's ``authorization`` metadata (when ``token`` is set). The token and key
    stay out of ``repr`` (and so out of logs)."""

    root_certificates: bytes | None = None
    """PEM CA certificates that verify the server; None: plaintext."""
    token: str | None = field(default=None, repr=False)
    """Sent as ``authorization: Bearer <token>``; None: no token."""
    certificate_chain: bytes | None = None
    """PEM client certificate (mutual TLS), with ``private_key``."""
    private_key: bytes | None = field(default=None, repr=False)


class _BearerToken(grpc.UnaryUnaryClientInterceptor, grpc.UnaryStreamClientInterceptor):
    """Adds ``authorization: Bearer <token>`` to every call (plaintext channels included, where
    gRPC refuses call credentials: a token over plaintext is for loopback and tests)."""

    def __init__(self, token: str):
        self._metadata = ("authorization", f"Bearer {token}")

    def __repr__(self) -> str:
        return "_BearerToken(<hidden>)"

    def _details(self, details: Any) -> Any:
        metadata = [*(details.metadata or ()), self._metadata]
        return details._replace(metadata=metadata)

    def intercept_unary_unary(self, continuation: Any, details: Any, request: Any) -> Any:
        return continuation(self._details(details), request)

    def intercept_unary_stream(self, continuation: Any, details: Any, request: Any) -> Any:
        return continuation(self._details(details), request)


def retry_options(
    attempts: int = 3, codes: Sequence[str] = ("UNAVAILABLE",), backoff_s: float = 0.05
) -> list[tuple[str, Any]]:
    """Channel options that make gRPC itself retry a call that failed with one of ``codes``
    (up to ``attempts`` tries, exponential backoff from ``backoff_s`` with jitter, within the
    call's own deadline): for clients, since UNAVAILABLE (a router with no shard answering, a
    draining server) is transient by definition."""
    if attempts < 2:
        raise ValueError(f"attempts: must be >= 2, got {attempts}")
    policy = {
        "maxAttempts": attempts,
        "initialBackoff": f"{backoff_s}s",
        "maxBackoff": f"{backoff_s * 2 ** (attempts - 1)}s",
        "backoffMultiplier": 2,
        "retryableStatusCodes": list(codes),
    }
    config = {"methodConfig": [{"name": [{}], "retryPolicy": policy}]}
    return [("grpc.service_config", json.dumps(config)), ("grpc.enable_retries", 1)]


def open_channel(
    address: str, options: Sequence[tuple[str, Any]] = (), auth: ClientAuth | None = None
) -> grpc.Channel:
    """A channel to ``address``: plaintext without ``auth``, else TLS and/or a bearer token."""
    if auth is None:
        return grpc.insecure_channel(address, options=list(options))
    if auth.root_certificates is None:
        channel = grpc.insecure_channel(address, options=list(options))
    else:
        credentials = grpc.ssl_channel_credentials(
            auth.root_certificates, auth.private_key, auth.certificate_chain
        )
        channel = grpc.secure_channel(address, credentials, options=list(options))
    if auth.token is None:
        return channel
    return grpc.intercept_channel(channel, _BearerToken(auth.token))


@dataclass(frozen=True)
class MalformedMessage:
    """What a gRPC handler gets, in place of its request message, when the bytes on the wire are
    no valid protobuf of that type (see :func:`tolerant_deserializer`)."""

    type_name: str
    """Full protobuf name of the message the method takes."""

    @property
    def message(self) -> str:
        """Why the request is refused (INVALID_ARGUMENT), for the status details."""
        return (
            f"request: not a valid {self.type_name} message (bad wire format, cut short, or a "
            "string that is not UTF-8)"
        )


def tolerant_deserializer(message_type: Any) -> Callable[[bytes], Any]:
    """A gRPC ``request_deserializer`` for ``message_type`` that never fails: bytes that do not
    parse become a :class:`MalformedMessage`, which the handler refuses with INVALID_ARGUMENT
    (gRPC itself answers a deserializer's failure with INTERNAL)."""
    name = message_type.DESCRIPTOR.full_name

    def parse(data: bytes) -> Any:
        try:
            return message_type.FromString(data)
        except DecodeError:  # its text says no more than the type's name
            return MalformedMessage(name)

    return parse


def _refusing_malformed(behaviour: Callable[[Any, grpc.ServicerContext], Any]) -> Any:
    """A method that answers a request whose bytes did not parse with INVALID_ARGUMENT."""

    def handle(request: Any, context: grpc.ServicerContext) -> Any:
        if isinstance(request, MalformedMessage):
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.message)
        return behaviour(request, context)

    return handle


_HANDLER_KINDS = {  # (client streaming, server streaming) -> handler factory
    (False, False): grpc.unary_unary_rpc_method_handler,
    (False, True): grpc.unary_stream_rpc_method_handler,
    (True, False): grpc.stream_unary_rpc_method_handler,
    (True, True): grpc.stream_stream_rpc_method_handler,
}


def add_service(
    server: grpc.Server,
    pb_module: Any,
    service_name: str,
    servicer: Any,
    *,
    refuse_malformed: bool = True,
    refuses_itself: Collection[str] = (),
) -> dict[str, grpc.RpcMethodHandler]:
    """Adds the service ``service_name`` (full name, e.g. ``recserve.admin.v1.Admin``) declared
    in the generated module ``pb_module`` (``*_pb2``) to ``server`` (before it starts), as the
    generated ``add_<Service>Servicer_to_server`` does (one handler per method of the
    descriptor, calling ``servicer.<Method>``), except that requests are parsed by
    :func:`tolerant_deserializer`: bytes that are no valid message get INVALID_ARGUMENT, where
    the generated deserializer makes gRPC answer INTERNAL. Returns the handlers by method name.

    ``refuse_malformed``: True: such a request is refused here, before the servicer runs;
    False: the servicer's method gets the :class:`MalformedMessage` in place of the request and
    must refuse it itself (a servicer that counts refusals, or checks authorization first).
    ``refuses_itself``: the methods that do so when ``refuse_malformed`` is True for the others.
    Methods that take a stream of requests keep the strict deserializer (a stream has no single
    request to refuse).
    """
    service = pb_module.DESCRIPTOR.services_by_name.get(service_name.rsplit(".", 1)[-1])
    if service is None or service.full_name != service_name:
        raise ValueError(f"service {service_name!r} is not declared in {pb_module.__name__}")
    handlers = {}
    for method in service.methods:
        request = GetMessageClass(method.input_type)
        behaviour = getattr(servicer, method.name)
        streamed = method.client_streaming
        if not streamed and refuse_malformed and method.name not in refuses_itself:
            behaviour = _refusing_malformed(behaviour)
        handlers[method.name] = _HANDLER_KINDS[streamed, method.server_streaming](
            behaviour,
            request_deserializer=request.FromString if streamed else tolerant_deserializer(request),
            response_serializer=GetMessageClass(method.output_type).SerializeToString,
        )
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(service_name, handlers),))
    server.add_registered_method_handlers(service_name, handlers)
    return handlers
