"""Registering a gRPC servicer so that a request that does not parse is the client's error; a caller's address and
tenant.

grpcio turns a request deserializer's exception into UNKNOWN (unary) or an exception inside the
request iterator (streaming), which the servicers would report as INTERNAL. Registered with
:func:`add_servicer`, such a request reaches its handler as a :class:`Malformed` value instead,
and the handler answers INVALID_ARGUMENT naming the message type and the parse error.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import grpc
from google.protobuf.descriptor import ServiceDescriptor
from google.protobuf.message import DecodeError, Message
from google.protobuf.message_factory import GetMessageClass

from common.config import Settings
from services.gateway.tenants import Tenant, identify

HANDLER_KINDS = {  # (client_streaming, server_streaming) -> grpc's handler constructor
    (False, False): grpc.unary_unary_rpc_method_handler,
    (False, True): grpc.unary_stream_rpc_method_handler,
    (True, False): grpc.stream_unary_rpc_method_handler,
    (True, True): grpc.stream_stream_rpc_method_handler,
}


@dataclass(frozen=True)
class Malformed:
    """A request message that did not parse as ``type_name``."""

    type_name: str
    error: str

    @property
    def message(self) -> str:
        return f"the request is not a valid {self.type_name} message: {self.error}"


def _parser(cls: type[Message]) -> Callable[[bytes], Message | Malformed]:
    def parse(data: bytes) -> Message | Malformed:
        try:
            return cls.FromString(data)
        except DecodeError as exc:
            return Malformed(cls.DESCRIPTOR.full_name, str(exc))

    return parse


def add_servicer(server: grpc.aio.Server, service: ServiceDescriptor, servicer: Any) -> None:
    """What the generated ``add_*Servicer_to_server`` does, with requests parsed by :func:`_parser`."""
    handlers = {}
    for method in service.methods:
        kind = HANDLER_KINDS[(method.client_streaming, method.server_streaming)]
        handlers[method.name] = kind(
            getattr(servicer, method.name),
            request_deserializer=_parser(GetMessageClass(method.input_type)),
            response_serializer=GetMessageClass(method.output_type).SerializeToString,
        )
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(service.full_name, handlers),))


def text_metadata(pairs: Iterable[tuple[str, str | bytes]] | None) -> dict[str, str]:
    """A call's metadata as a mapping of its text entries (binary ``-bin`` ones left out)."""
    return {key: value for key, value in pairs or () if isinstance(value, str)}


def tenant_of_call(context: grpc.aio.ServicerContext, settings: Settings) -> Tenant:
    """Who a gRPC call is for (services.gateway.tenants), from its metadata."""
    return identify(text_metadata(context.invocation_metadata()), settings)


def client_address(peer: str) -> str:
    """The client's address without its port (what rate limiting keys on): ``ipv4:1.2.3.4:5678`` → ``1.2.3.4``."""
    kind, _, rest = peer.partition(":")
    if kind in ("ipv4", "ipv6"):
        return rest.rpartition(":")[0].strip("[]") or rest
    return peer
