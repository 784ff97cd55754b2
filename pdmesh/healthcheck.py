"""`python -m pdmesh.healthcheck HOST:PORT`: exit 0 when the gRPC server there answers
grpc.health.v1 SERVING, 1 otherwise: a readiness probe for Kubernetes (deploy/k8s).

Kubernetes' own gRPC probe speaks plaintext only; this one uses the process's mutual TLS
(PDMESH_TLS_*) like every pdmesh client. ``$VAR`` in the address is expanded from the
environment, since an exec probe gets no ``$(VAR)`` substitution; ``--tls-name`` checks
the server's certificate for that name instead of HOST (a pod probing itself by IP).
"""

from __future__ import annotations

import argparse
import os
import sys

import anyio
import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from libs.rpc import tls
from libs.rpc.calls import close_channel, unary
from libs.rpc.options import CLIENT_OPTIONS


async def check(address: str, tls_name: str | None, timeout: float) -> bool:
    config = tls.client_config()
    options = list(CLIENT_OPTIONS)
    if config is None:
        channel = grpc.aio.insecure_channel(address, options=options)
    else:
        if tls_name:
            options.append(("grpc.ssl_target_name_override", tls_name))
        channel = grpc.aio.secure_channel(address, tls.channel_credentials(config),
                                          options=options)
    try:
        reply = await unary(health_pb2_grpc.HealthStub(channel).Check,
                            health_pb2.HealthCheckRequest(service=""), timeout=timeout)
    except grpc.aio.AioRpcError as e:
        print(f"{address}: {e.code().name}", file=sys.stderr)
        return False
    finally:
        await close_channel(channel)
    serving = reply.status == health_pb2.HealthCheckResponse.SERVING
    if not serving:
        print(f"{address}: {health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)}",
              file=sys.stderr)
    return serving


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m pdmesh.healthcheck", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("address", help="HOST:PORT ($VAR expanded from the environment)")
    parser.add_argument("--tls-name", default=None,
                        help="name the server's certificate must carry (default: HOST)")
    parser.add_argument("--timeout", type=float, default=2.0, help="seconds (2)")
    args = parser.parse_args(argv)
    address = os.path.expandvars(args.address)
    return 0 if anyio.run(check, address, args.tls_name, args.timeout) else 1


if __name__ == "__main__":
    sys.exit(main())
