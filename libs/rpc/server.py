"""Start a grpc.aio server with health and reflection, as every pdmesh service does.

Services are added from their protobuf descriptors (not the generated
`add_*_to_server`) so that a request that fails to parse reaches the handler
as `Malformed` and is answered INVALID_ARGUMENT, instead of grpc's UNKNOWN.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import grpc
from google.protobuf import message_factory
from google.protobuf.descriptor import ServiceDescriptor
from google.protobuf.message import DecodeError
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from libs.rpc import tls
from libs.rpc.options import SERVER_OPTIONS


@dataclass(frozen=True)
class Malformed:
    """Stands in for a request whose bytes did not parse as `type_name`."""

    type_name: str
    error: str


def _safe_parser(cls):
    def parse(data: bytes):
        try:
            return cls.FromString(data)
        except (DecodeError, RuntimeError, ValueError) as e:
            return Malformed(cls.DESCRIPTOR.full_name, str(e))

    return parse


def service_handler(descriptor: ServiceDescriptor, servicer: object) -> grpc.GenericRpcHandler:
    """A generic handler serving every method of `descriptor` from `servicer`."""
    handlers = {}
    for method in descriptor.methods:
        request_cls = message_factory.GetMessageClass(method.input_type)
        response_cls = message_factory.GetMessageClass(method.output_type)
        behavior = getattr(servicer, method.name)
        kwargs = dict(
            request_deserializer=_safe_parser(request_cls),
            response_serializer=response_cls.SerializeToString,
        )
        if method.client_streaming:
            raise NotImplementedError("pdmesh has no client-streaming methods")
        if method.server_streaming:
            handlers[method.name] = grpc.unary_stream_rpc_method_handler(behavior, **kwargs)
        else:
            handlers[method.name] = grpc.unary_unary_rpc_method_handler(behavior, **kwargs)
    return grpc.method_handlers_generic_handler(descriptor.full_name, handlers)


def bind(server: grpc.Server | grpc.aio.Server, host: str, port: int) -> int:
    """Bind host:port with mutual TLS when this process has a certificate (libs.rpc.tls),
    plaintext otherwise; returns the port (0: the bind failed)."""
    config = tls.from_env()
    if config is None:
        return server.add_insecure_port(f"{host}:{port}")
    return server.add_secure_port(f"{host}:{port}", tls.server_credentials(config))


@dataclass
class RunningServer:
    server: grpc.aio.Server
    port: int
    health: health.aio.HealthServicer

    async def set_serving(self, serving: bool) -> None:
        status = (
            health_pb2.HealthCheckResponse.SERVING
            if serving
            else health_pb2.HealthCheckResponse.NOT_SERVING
        )
        await self.health.set("", status)

    async def stop(self, grace: float = 1.0) -> None:
        await self.server.stop(grace)


async def start_server(
    host: str, port: int, services: Iterable[tuple[ServiceDescriptor, object]]
) -> RunningServer:
    """Create, populate and start a server bound to host:port (port 0 picks a free one)."""
    services = list(services)
    server = grpc.aio.server(options=SERVER_OPTIONS)
    server.add_generic_rpc_handlers([service_handler(d, s) for d, s in services])
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    names = [d.full_name for d, _ in services] + [health.SERVICE_NAME, reflection.SERVICE_NAME]
    reflection.enable_server_reflection(names, server)
    bound = bind(server, host, port)
    if bound == 0:
        raise OSError(f"could not bind gRPC server to {host}:{port}")
    await server.start()
    running = RunningServer(server=server, port=bound, health=health_servicer)
    await running.set_serving(True)
    return running
