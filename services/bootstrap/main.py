"""`pdmesh bootstrap`: the registry service in the foreground."""

from __future__ import annotations

import argparse
import logging

import anyio

from libs.rpc.dump import dump
from libs.rpc.handlers import contained
from libs.rpc.server import start_server
from pdmesh.v1 import bootstrap_pb2, common_pb2
from pdmesh.v1 import common_pb2_grpc as cgrpc
from services.bootstrap.registry import Registry
from services.bootstrap.service import BootstrapService, expire_leases, lease_period

log = logging.getLogger("pdmesh.bootstrap")


class BootstrapAdmin(cgrpc.AdminServicer):
    def __init__(self, registry: Registry):
        self.registry = registry

    @contained
    async def Dump(self, request, context):
        return dump("bootstrap")

    @contained
    async def Stats(self, request, context):
        return common_pb2.MemberStats(role=common_pb2.BOOTSTRAP, name="bootstrap", healthy=True)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    parser.add_argument("--port", type=int, default=50050, help="gRPC port (default 50050)")
    parser.add_argument(
        "--lease", type=float, default=5.0, help="seconds a member lives without KeepAlive"
    )


async def serve(args: argparse.Namespace) -> None:
    registry = Registry(lease_seconds=args.lease)
    service = BootstrapService(registry)
    running = await start_server(
        args.host,
        args.port,
        [
            (bootstrap_pb2.DESCRIPTOR.services_by_name["Bootstrap"], service),
            (common_pb2.DESCRIPTOR.services_by_name["Admin"], BootstrapAdmin(registry)),
        ],
    )
    log.info("bootstrap serving on %s:%d (lease %.1fs)", args.host, running.port, args.lease)
    try:
        await expire_leases(registry, lease_period(args.lease))
    finally:
        with anyio.move_on_after(2.0, shield=True):
            await running.stop(0.5)
