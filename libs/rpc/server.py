"""Start a grpc.aio server with health and reflection, as every pdmesh service does."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from libs.rpc.options import SERVER_OPTIONS


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
    host: str,
    port: int,
    register: Iterable[Callable[[grpc.aio.Server], None]],
    service_names: Iterable[str],
) -> RunningServer:
    """Create, populate and start a server bound to host:port (port 0 picks a free one).

    `register` are the generated `add_*Servicer_to_server` calls, already bound
    to their servicer; `service_names` are the full names reflection announces.
    """
    server = grpc.aio.server(options=SERVER_OPTIONS)
    for add in register:
        add(server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    names = [*service_names, health.SERVICE_NAME, reflection.SERVICE_NAME]
    reflection.enable_server_reflection(names, server)
    bound = server.add_insecure_port(f"{host}:{port}")
    if bound == 0:
        raise OSError(f"could not bind gRPC server to {host}:{port}")
    await server.start()
    running = RunningServer(server=server, port=bound, health=health_servicer)
    await running.set_serving(True)
    return running
