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
from services.bootstrap.service import BootstrapService, lease_period
from services.bootstrap.store import MembershipStore, MemoryStore, parse_store

log = logging.getLogger("pdmesh.bootstrap")


class BootstrapAdmin(cgrpc.AdminServicer):
    def __init__(self, registry: MembershipStore, metrics_address: str):
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
    parser.add_argument(
        "--store", type=store_url, default="memory", metavar="memory|etcd://HOST:PORT[/PREFIX]",
        help="where registrations live: 'memory' (default: this process; a restart forgets "
             "them) or etcd v3 under leases (default prefix /pdmesh), so several bootstrap "
             "replicas serve one mesh",
    )


def store_url(text: str) -> str:
    try:
        parse_store(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return text


def make_store(text: str, lease: float) -> MembershipStore:
    target = parse_store(text)
    if target is None:
        return MemoryStore(Registry(lease_seconds=lease), lease_period(lease))
    from services.bootstrap.etcd_store import EtcdStore  # aetcd only where etcd is asked for

    return EtcdStore(target, lease_seconds=lease)


async def serve(args: argparse.Namespace) -> None:
    host = addresses.advertised_host(args, "bootstrap")
    registry = make_store(args.store, args.lease)
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
    log.info("bootstrap serving on %s:%d (lease %.1fs, store %s), metrics on http://%s/metrics",
             args.host, running.port, registry.lease_seconds, args.store, metrics_address)
    try:
        async with anyio.create_task_group() as tg:
            tg.start_soon(registry.run)
            tg.start_soon(serve_http,
                          asgi_server(BootstrapMetrics(registry).app(), args.host, 0), 2.0,
                          metrics_sock)
    finally:
        with anyio.move_on_after(2.0, shield=True):
            await running.stop(0.5)
            await registry.close()
