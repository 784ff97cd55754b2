"""`pdmesh bootstrap`: the registry service in the foreground."""

from __future__ import annotations

import argparse
import logging
import os

import anyio

from libs.rpc import addresses
from libs.rpc.dump import dump
from libs.rpc.handlers import contained
from libs.rpc.http import asgi_server, listen, serve_http
from libs.rpc.server import start_server
from pdmesh.v1 import bootstrap_pb2, common_pb2
from pdmesh.v1 import common_pb2_grpc as cgrpc
from services.bootstrap.metrics import BootstrapMetrics
from services.bootstrap.registry import Registry
from services.bootstrap.service import BootstrapService, expire_leases, lease_period

log = logging.getLogger("pdmesh.bootstrap")


class BootstrapAdmin(cgrpc.AdminServicer):
    def __init__(self, registry: Registry, metrics_address: str):
        self.registry = registry
        self.metrics_address = metrics_address

    @contained
    async def Dump(self, request, context):
        return dump("bootstrap")

    @contained
    async def Stats(self, request, context):
        return common_pb2.MemberStats(role=common_pb2.BOOTSTRAP, name="bootstrap", healthy=True,
                                      pid=os.getpid(), metrics_address=self.metrics_address)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    addresses.add_arguments(parser)
    parser.add_argument("--port", type=int, default=50050, help="gRPC port (default 50050)")
    parser.add_argument(
        "--lease", type=float, default=5.0, help="seconds a member lives without KeepAlive"
    )
    parser.add_argument(
        "--metrics-port", type=int, default=0,
        help="port of the Prometheus /metrics endpoint (default 0: a free port, logged and "
             "shown by `pdmesh status`)",
    )


async def serve(args: argparse.Namespace) -> None:
    host = addresses.advertised_host(args, "bootstrap")
    registry = Registry(lease_seconds=args.lease)
    service = BootstrapService(registry)
    metrics_sock = listen(args.host, args.metrics_port)
    metrics_address = addresses.join(host, metrics_sock.getsockname()[1])
    running = await start_server(
        args.host,
        args.port,
        [
            (bootstrap_pb2.DESCRIPTOR.services_by_name["Bootstrap"], service),
            (common_pb2.DESCRIPTOR.services_by_name["Admin"],
             BootstrapAdmin(registry, metrics_address)),
        ],
    )
    log.info("bootstrap serving on %s:%d (lease %.1fs), metrics on http://%s/metrics",
             args.host, running.port, args.lease, metrics_address)
    try:
        async with anyio.create_task_group() as tg:
            tg.start_soon(expire_leases, registry, lease_period(args.lease))
            tg.start_soon(serve_http,
                          asgi_server(BootstrapMetrics(registry).app(), args.host, 0), 2.0,
                          metrics_sock)
    finally:
        with anyio.move_on_after(2.0, shield=True):
            await running.stop(0.5)
