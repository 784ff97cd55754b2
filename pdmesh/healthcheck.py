"""`python -m pdmesh.healthcheck grpc HOST:PORT | http URL`: a container health probe.

`grpc` asks the standard grpc.health.v1 service (every pdmesh service serves it, mutual
TLS with this process's PDMESH_TLS_* certificate when set) and succeeds on SERVING;
`http` succeeds on a 200 (the router's /health: a prefill and a decode that pair are
registered). Exit 0 healthy, 1 not, with one line saying why; it never waits longer
than --timeout. Light on purpose: no torch, run every few seconds by Docker.
"""

from __future__ import annotations

import argparse
import sys
import urllib.error
import urllib.request

import anyio
import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from libs.rpc.calls import open_channel
from libs.rpc.tls import TlsError


async def grpc_serving(address: str, timeout: float) -> str | None:
    """None when `address` answers SERVING, else why not."""
    channel = open_channel(address)
    try:
        reply = await health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(service=""), timeout=timeout)
    except grpc.aio.AioRpcError as e:
        return f"{e.code().name}: {e.details()}"
    finally:
        await channel.close()
    if reply.status != health_pb2.HealthCheckResponse.SERVING:
        return health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
    return None


def http_ok(url: str, timeout: float) -> str | None:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as response:
            return None if response.status == 200 else f"HTTP {response.status}"
    except urllib.error.HTTPError as e:
        return f"HTTP {e.code}"
    except (OSError, ValueError) as e:
        return str(e)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m pdmesh.healthcheck", description=__doc__)
    parser.add_argument("kind", choices=["grpc", "http"])
    parser.add_argument("target", help="HOST:PORT (grpc) or a URL (http)")
    parser.add_argument("--timeout", type=float, default=3.0, help="seconds (default 3)")
    args = parser.parse_args(argv)
    try:
        why = (anyio.run(grpc_serving, args.target, args.timeout) if args.kind == "grpc"
               else http_ok(args.target, args.timeout))
    except TlsError as e:
        why = str(e)
    if why is not None:
        print(f"{args.kind} {args.target}: unhealthy: {why}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
