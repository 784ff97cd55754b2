"""`python -m pdmesh.healthcheck grpc HOST:PORT | http URL`: a container health probe
(Docker health checks, Kubernetes exec probes).

`grpc` asks the standard grpc.health.v1 service (every pdmesh service serves it, with this
process's mutual TLS from PDMESH_TLS_* when set) and succeeds on SERVING. Kubernetes' own
gRPC probe speaks plaintext only, hence this one. `http` succeeds on a 200 (the router's
/health: a prefill and a decode that pair are registered). Exit 0 healthy, 1 not, with one
line saying why; it never waits longer than --timeout. Light on purpose: no torch.

``$VAR`` in the target is expanded from the environment, since an exec probe gets no
``$(VAR)`` substitution; ``--tls-name`` checks the server's certificate for that name
instead of HOST (a pod probing itself by IP).
"""

from __future__ import annotations

import argparse
import os
import sys
import urllib.error
import urllib.request

import anyio
import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from libs.rpc import tls
from libs.rpc.calls import close_channel, unary
from libs.rpc.options import CLIENT_OPTIONS
from libs.rpc.tls import TlsError


async def grpc_serving(address: str, tls_name: str | None, timeout: float) -> str | None:
    """None when `address` answers SERVING, else why not."""
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
        return f"{e.code().name}: {e.details()}"
    finally:
        await close_channel(channel)
    if reply.status != health_pb2.HealthCheckResponse.SERVING:
        return health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
    return None


async def check(address: str, tls_name: str | None, timeout: float) -> bool:
    return await grpc_serving(address, tls_name, timeout) is None


def http_ok(url: str, timeout: float) -> str | None:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as response:
            return None if response.status == 200 else f"HTTP {response.status}"
    except urllib.error.HTTPError as e:
        return f"HTTP {e.code}"
    except (OSError, ValueError) as e:
        return str(e)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m pdmesh.healthcheck", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("kind", choices=["grpc", "http"])
    parser.add_argument("target", help="HOST:PORT (grpc) or a URL (http); $VAR expanded")
    parser.add_argument("--tls-name", default=None,
                        help="grpc: the name the server's certificate must carry "
                        "(default: HOST)")
    parser.add_argument("--timeout", type=float, default=3.0, help="seconds (default 3)")
    args = parser.parse_args(argv)
    target = os.path.expandvars(args.target)
    try:
        why = (anyio.run(grpc_serving, target, args.tls_name, args.timeout)
               if args.kind == "grpc" else http_ok(target, args.timeout))
    except TlsError as e:
        why = str(e)
    if why is not None:
        print(f"{args.kind} {target}: unhealthy: {why}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
