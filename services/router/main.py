"""`pdmesh router`: the OpenAI HTTP gateway and the public gRPC API in one process."""

from __future__ import annotations

import argparse
import logging
import os
from pathlib import Path

import anyio

from libs.engine.specs import load_tokenizer
from libs.member.bounds import MAX_TOP_LOGPROBS
from libs.rpc import addresses
from libs.rpc.http import asgi_server, serve_http
from libs.rpc.membership import Membership, bootstrap_flag
from libs.rpc.server import start_server
from pdmesh.client import API_KEY_ENV
from pdmesh.v1 import bootstrap_pb2 as bpb
from pdmesh.v1 import common_pb2 as cpb
from pdmesh.v1 import generate_pb2
from services.router.admission import AdmissionQueue
from services.router.backend import MeshBackend
from services.router.core import MeshClient
from services.router.grpc_api import GenerateService
from services.router.kv_view import KvView
from services.router.kv_watch import follow_members
from services.router.metrics import RouterMetrics
from services.router.openai_api import create_app
from services.router.openai_schema import RequestLimits
from services.router.pairing import Pairing
from services.router.resume import DEFAULT_MAX_PREEMPTIONS

log = logging.getLogger("pdmesh.router")

STOP_SECONDS = 5.0  # uvicorn's own graceful stop is 1 s; this bounds it


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--name", default=None, help="member name (default router-PID)")
    addresses.add_arguments(parser)
    parser.add_argument("--http-port", type=int, default=8000, help="OpenAI HTTP port (8000)")
    parser.add_argument("--grpc-port", type=int, default=50051, help="gRPC Generate port (50051)")
    parser.add_argument(
        "--bootstrap", default="127.0.0.1:50050", type=bootstrap_flag,
        help="bootstrap address host:port, or several replicas host:port,host:port (failover)"
    )
    parser.add_argument(
        "--model", default="smollm2", help="model whose tokenizer and name the router serves"
    )
    parser.add_argument(
        "--request-timeout", type=float, default=300.0, help="per-request budget in seconds"
    )
    parser.add_argument(
        "--retries", type=int, default=1,
        help="retries of a request whose attempt failed UNAVAILABLE or FAILED_PRECONDITION "
        "before its first token, "
        "on another pair when one exists, after the failed legs were aborted (default 1)",
    )
    parser.add_argument(
        "--max-queue", type=queue_bound, default=1024, metavar="N",
        help="requests that may wait for KV capacity (the admission queue, FIFO) before "
        "a new one is refused at once with 429 / RESOURCE_EXHAUSTED (default 1024; at "
        "least 1)",
    )
    parser.add_argument(
        "--queue-timeout", type=positive_seconds, default=60.0, metavar="S",
        help="longest wait in the admission queue: then 503 / UNAVAILABLE (default 60; "
        "the request's own deadline ends it earlier, as 504 / DEADLINE_EXCEEDED)",
    )
    parser.add_argument(
        "--max-preemptions", type=int_in(0), default=DEFAULT_MAX_PREEMPTIONS, metavar="N",
        help="re-runs of a request that decodes preempted (their KV pool ran dry) before it "
        f"fails ABORTED (default {DEFAULT_MAX_PREEMPTIONS})",
    )
    parser.add_argument(
        "--max-n", type=int_in(1), default=RequestLimits.max_n,
        help=f"most choices (n) one request may ask for (default {RequestLimits.max_n})",
    )
    parser.add_argument(
        "--max-top-logprobs", type=int_in(0, MAX_TOP_LOGPROBS),
        default=RequestLimits.max_top_logprobs,
        help="most alternatives per token (top_logprobs; completions' logprobs) "
        f"(default {RequestLimits.max_top_logprobs}, at most {MAX_TOP_LOGPROBS})",
    )
    parser.add_argument(
        "--api-key", default=os.environ.get(API_KEY_ENV) or None,
        help=f"the key clients must send (HTTP 'Authorization: Bearer KEY', gRPC "
        f"'authorization' metadata); /health and /metrics stay open (default ${API_KEY_ENV}; "
        "none: open)",
    )
    parser.add_argument(
        "--kv-routing", choices=["on", "off"], default="on",
        help="pair each request by the prefix-cache pages its prefill and decode hold "
        "(members' cache events) and their load; off: by load alone, still counting where "
        "requests landed (default on)",
    )


def queue_bound(text: str) -> int:
    """--max-queue: an integer >= 1 (0 would refuse whatever cannot start at once, which
    is what the queue exists to avoid; a mesh that must not queue has no such mode)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value}: the queue must hold at least 1 request")
    return value


def int_in(low: int, high: int | None = None):
    """An argparse type: an integer in low..high (no upper bound where high is None), so
    a bad value is a usage error naming the flag, before anything starts."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
        if value < low or (high is not None and value > high):
            bound = f"at least {low}" if high is None else f"in {low}..{high}"
            raise argparse.ArgumentTypeError(f"{value}: must be {bound}")
        return value
    return parse


def positive_seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"{text}: must be more than 0 seconds")
    return value


def request_limits(args: argparse.Namespace) -> RequestLimits:
    """The request bounds the flags set (each checked by its argparse type)."""
    return RequestLimits(max_n=args.max_n, max_top_logprobs=args.max_top_logprobs)


def served_model_id(spec: str) -> str:
    """The id clients pass as `model`: the spec for built-ins, the file or folder name else."""
    path = Path(spec)
    return path.stem if path.suffix == ".gguf" else path.name if path.is_dir() else spec


async def serve(args: argparse.Namespace) -> None:
    name = args.name or f"router-{os.getpid()}"
    limits = request_limits(args)
    host = addresses.advertised_host(args, "router")
    try:
        config, tokenizer = await anyio.to_thread.run_sync(load_tokenizer, args.model)
    except ValueError as e:  # a model it cannot serve: one line, not a traceback
        raise SystemExit(f"pdmesh router: --model: {e}") from None
    model_id = served_model_id(args.model)
    metrics = RouterMetrics(name)
    pairing = Pairing(view=KvView(on_ignored=metrics.kv_event_ignored),
                      kv_routing=args.kv_routing == "on", on_route=metrics.kv_route)
    metrics.watch_view(pairing.view)
    queue = AdmissionQueue(args.max_queue, args.queue_timeout, on_depth=metrics.queue_depth.set)
    mesh = MeshClient(
        pairing, default_budget=args.request_timeout, retries=args.retries,
        on_retry=metrics.retry, queue=queue, on_queued=metrics.queue_time.observe,
        max_preemptions=args.max_preemptions, on_rerun=metrics.rerun, router=name,
    )
    backend = MeshBackend(model_id, config, tokenizer, mesh, metrics)
    grpc_api = GenerateService(backend, name, limits, args.api_key)
    running = await start_server(
        args.host,
        args.grpc_port,
        [
            (generate_pb2.DESCRIPTOR.services_by_name["Generate"], grpc_api),
            (cpb.DESCRIPTOR.services_by_name["Admin"], grpc_api),
        ],
    )
    http = asgi_server(create_app(backend, limits, args.api_key), args.host, args.http_port)
    membership = Membership(
        args.bootstrap,
        me=bpb.Member(
            role=cpb.ROUTER,
            name=name,
            address=addresses.join(host, running.port),
            http_address=addresses.join(host, args.http_port),
        ),
        on_join=[pairing.on_join],
        on_leave=[pairing.on_leave],
    )
    log.info(
        "router %s: HTTP on %s:%d, gRPC on %s:%d, model %s",
        name, args.host, args.http_port, args.host, running.port, model_id,
    )
    try:
        async with anyio.create_task_group() as tg:
            tg.start_soon(membership.run)
            tg.start_soon(serve_http, http, STOP_SECONDS)
            tg.start_soon(_close_retired, pairing)
            tg.start_soon(follow_members, pairing)  # with --kv-routing off: to count landings
    finally:
        with anyio.move_on_after(3.0, shield=True):
            await running.stop(0.5)
            for endpoint in list(pairing.endpoints.values()):
                await endpoint.channel.close()


async def _close_retired(pairing: Pairing) -> None:
    """Channels of departed members are closed here, on the loop that made them."""
    while True:
        while pairing.retired:
            await pairing.retired.pop().close()
        await anyio.sleep(0.5)
