"""The shared main of a prefill or decode process: load, serve, register, watch."""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING

import anyio
from google.protobuf.descriptor import ServiceDescriptor

from libs import faults
from libs.member import sizing, ucx
from libs.member.formats import FORMATS
from libs.member.timeouts import TIMEOUTS
from libs.rpc import addresses
from libs.rpc.http import asgi_server, listen, serve_http
from libs.rpc.membership import Membership, bootstrap_flag
from libs.rpc.server import start_server
from pdmesh.v1 import common_pb2 as cpb

if TYPE_CHECKING:
    from libs.member.service import MemberConfig, MemberService

log = logging.getLogger(__name__)


# A member exits with this code when a flag's value cannot work on this machine (no such
# device, a pool that does not fit): restarting it would fail the same way, so `pdmesh up`
# stops the mesh instead (pdmesh/supervisor.py). argparse exits 2 on a bad flag too.
EXIT_CANNOT_START = 2


def cannot_start(line: str) -> SystemExit:
    """Print ``line`` (the whole story, one line) and return the SystemExit to raise."""
    print(line, file=sys.stderr, flush=True)
    return SystemExit(EXIT_CANNOT_START)


def add_member_arguments(parser: argparse.ArgumentParser, role: str) -> None:
    parser.add_argument(
        "--name", default=None, help=f"member name, stable across restarts (default {role}-PID)"
    )
    addresses.add_arguments(parser)
    parser.add_argument("--port", type=int, default=0, help="gRPC port (default: a free one)")
    parser.add_argument(
        "--bootstrap", default="127.0.0.1:50050", type=bootstrap_flag,
        help="bootstrap address host:port, or several replicas host:port,host:port (failover)"
    )
    parser.add_argument(
        "--model", default="smollm2", help="smollm2 | tiny | random:smollm2 | PATH (GGUF or HF dir)"
    )
    parser.add_argument("--device", default="cpu", help="cpu | cuda | cuda:N (default cpu)")
    parser.add_argument(
        "--dtype", default="float32", choices=["float32", "bfloat16"],
        help="weights, activations and KV (default float32: token-exact with the fp32 "
        "reference; bfloat16 uses AMX/tensor cores, ~1.5x faster batched decode on CPU)",
    )
    parser.add_argument(
        "--weights", default="native", choices=["native", "nvfp4"],
        help="native (default): linear weights as the checkpoint stores them, in --dtype; "
        "nvfp4: quantize every layer's q/k/v/o/gate/up/down weights to NVFP4 at load "
        "(weight-only: embeddings, norms, lm_head and activations stay in --dtype; on CPU "
        "a dequantized copy is kept, same numerics, no speed or memory gain). A ModelOpt "
        "NVFP4 checkpoint directory is served as NVFP4 either way",
    )
    parser.add_argument(
        "--kv-pages", type=int, default=None,
        help=f"KV pool size in pages (default: {sizing.CPU_KV_PAGES[role]} on the CPU; on "
        "CUDA what --gpu-memory-fraction of the device holds after the weights)",
    )
    parser.add_argument(
        "--gpu-memory-fraction", type=sizing.memory_fraction, default=None, metavar="F",
        help="on CUDA, the fraction of the device's total memory this member may fill with "
        "its weights and KV pool, less a reserve for activations "
        f"(default {sizing.DEFAULT_GPU_MEMORY_FRACTION}; pdmesh up gives each member on a "
        "GPU its share of the mesh's)",
    )
    parser.add_argument(
        "--cuda-graphs", default="on", choices=["on", "off"],
        help="on CUDA, decode steps and prefill packs replay CUDA graphs captured at start, "
        "one per batch-size or pack-size bucket (default on; off: launched eagerly)",
    )
    parser.add_argument("--max-rooms", type=int, default=256, help="bound on concurrent rooms")
    parser.add_argument(
        "--prefix-cache", default="on", choices=["on", "off"],
        help="keep full KV pages of finished requests for later prompts that share their "
        "prefix, evicted least recently used when free pages run out (default on)",
    )
    parser.add_argument("--page-size", type=int, default=16, help="tokens per KV page")
    parser.add_argument(
        "--kv-transfer", default="native", choices=FORMATS,
        help="how prompt KV travels from prefill to decode: native (pool bytes as they are) "
        "or nvfp4 (E2M1 + e4m3 scales per 16 + fp32 scale per page/layer/K|V: ~3.5x fewer "
        "bytes than bf16; needs head_dim %% 16 == 0). Prefills and decodes pair only with "
        "the same format (default native)",
    )
    parser.add_argument(
        "--metrics-port", type=int, default=0,
        help="Prometheus /metrics HTTP port (default: a free one, published in the registry)",
    )
    parser.add_argument(
        "--pinned-after", type=float, default=TIMEOUTS.pinned_after, metavar="S",
        help="report a live room as pinned after S seconds without progress "
        f"(default {TIMEOUTS.pinned_after:g})",
    )
    parser.add_argument(
        "--stall-after", type=float, default=None, metavar="S",
        help="turn health NOT_SERVING when work waits but nothing progressed for S seconds "
        f"(default: prefill {TIMEOUTS.prefill_stall_seconds:g}, "
        f"decode {TIMEOUTS.decode_stall_seconds:g})",
    )
    parser.add_argument(
        "--faults", default=os.environ.get(faults.ENV, ""), metavar="SPEC",
        help="TEST ONLY: fault injection points, e.g. 'pause_between_chunks=2,"
        "decode-0:delay_notifications=0.5' (default: none, or $PDMESH_FAULTS; see libs/faults)",
    )
    ucx.add_arguments(parser)


async def serve_member(
    args: argparse.Namespace,
    service_class: type[MemberService],
    config: MemberConfig,
    descriptor: ServiceDescriptor,
) -> None:
    """Load the model (off the loop), start the server (the role's gRPC service, described
    by ``descriptor``, and Admin), register, and serve until cancelled."""
    # torch and NIXL load here, not at import: `pdmesh` builds every role's parser in every
    # process (bootstrap, router and supervisor included), which must not pay for them
    from libs.engine.weight_budget import ModelTooLarge
    from libs.member.kv_member import DoesNotFit, KvMember
    from libs.transfer.errors import BackendUnavailable
    from libs.transfer.kvwire import UnsupportedKvShape

    role, role_name = service_class.role, service_class.role_name
    name = args.name or f"{role_name}-{os.getpid()}"
    try:
        injected = faults.Faults.parse(args.faults, name)
    except ValueError as e:
        raise SystemExit(f"pdmesh {role_name}: --faults: {e}") from None
    host = addresses.advertised_host(args, role_name)
    ucx.apply(args)  # before the agent exists: UCX reads its environment once
    why = sizing.check_device(args.device)
    if why is not None:
        raise cannot_start(f"pdmesh {role_name}: --device {args.device}: {why}")
    log.info("loading model %s on %s", args.model, args.device)
    try:
        member = await anyio.to_thread.run_sync(
            lambda: KvMember.create(
                role, name, args.model, args.device, args.kv_pages, args.page_size,
                args.dtype, args.weights, args.kv_transfer,
                memory_fraction=args.gpu_memory_fraction, max_rooms=args.max_rooms,
                cuda_graphs=args.cuda_graphs == "on", prefix_cache=args.prefix_cache == "on",
            )
        )
    except DoesNotFit as e:
        raise cannot_start(f"pdmesh {role_name}: {e}") from None
    except BackendUnavailable as e:
        raise cannot_start(f"pdmesh {role_name}: --ucx-transports/--ucx-net-devices: {e}") \
            from None
    except UnsupportedKvShape as e:
        raise SystemExit(f"pdmesh {role_name}: --kv-transfer {args.kv_transfer}: {e}") from None
    except ModelTooLarge as e:  # restarting cannot help: the supervisor must not retry it
        raise cannot_start(f"pdmesh {role_name}: --model {args.model}: {e}") from None
    except ValueError as e:  # an unknown spec, a refused checkpoint (CheckpointError)
        raise SystemExit(f"pdmesh {role_name}: --model {args.model}: {e}") from None
    member.pinned_after = args.pinned_after
    member.stall_after = args.stall_after
    if injected.active:
        log.warning("FAULT INJECTION ACTIVE on %s: %s", name, injected)
        member.faults = injected
    membership_ref: list[Membership] = []
    service = service_class(
        member, config, lambda: membership_ref[0].epoch if membership_ref else 0
    )
    try:  # before registering: a member is paired only once it can serve at full speed
        await anyio.to_thread.run_sync(service.prepare)
    except DoesNotFit as e:
        raise cannot_start(f"pdmesh {role_name}: {e}") from None
    # the prefix cache's changes, for the router's KV-aware pairing (libs/member/kv_events.py)
    from libs.member.kv_events import KvEventHub, KvEventsService
    from pdmesh.v1 import kvevents_pb2

    kv_events = KvEventsService(KvEventHub(member.pool.cache), service.ref,
                                member.layout.model, member.pool.page_size)
    running = await start_server(args.host, args.port, [
        (descriptor, service), (cpb.DESCRIPTOR.services_by_name["Admin"], service),
        (kvevents_pb2.DESCRIPTOR.services_by_name["KvEvents"], kv_events),
    ])
    address = addresses.join(host, running.port)
    metrics_sock = listen(args.host, args.metrics_port)
    metrics_address = addresses.join(host, metrics_sock.getsockname()[1])
    membership = Membership(
        args.bootstrap,
        me=member.registration(address, metrics_address),
        on_join=[member.on_join],
        on_leave=[member.on_leave],
    )
    membership_ref.append(membership)
    log.info("%s %s serving on %s, metrics on http://%s/metrics", role_name, member.name,
             address, metrics_address)
    async with stopping(running, member.agent, member.name):
        async with anyio.create_task_group() as tg:
            tg.start_soon(membership.run)
            tg.start_soon(_report_health, running, service, member.name)
            tg.start_soon(serve_http, asgi_server(service.metrics.app(), args.host, 0), 2.0,
                          metrics_sock)
            tg.start_soon(service.run)


@asynccontextmanager
async def stopping(running, agent, name: str) -> AsyncIterator[None]:
    """Serve inside this; on the way out, stop the gRPC server and then close the NIXL
    agent. A body that crashed keeps its own exception (a leak found after it is only
    logged), while a clean or cancelled stop fails on a leak."""
    crashed = False
    try:
        yield
    except Exception:
        crashed = True
        raise
    finally:
        with anyio.move_on_after(2.0, shield=True):
            await running.stop(0.5)
        close_agent(agent, name, crashed=crashed)


def close_agent(agent, name: str, crashed: bool = False) -> None:
    """Close the member's NIXL agent once its tasks are gone; a transfer handle still held
    then is a leak, and the stop fails with a line naming it (exit code 1) instead of
    ending quietly or, at interpreter exit, in UCX's abort. After a crash the leak is
    logged only: a SystemExit raised here would replace the crash as what the process
    reports, and the crash is the cause."""
    leaked = agent.close()
    if not leaked:
        return
    log.error("%s: %d NIXL transfer handles were never released", name, leaked)
    if not crashed:
        raise SystemExit(f"pdmesh: {name} stopped holding {leaked} unreleased NIXL "
                         "transfer handles (a leak)")


async def _report_health(running, service, name: str, every: float = 0.5) -> None:
    """Keep grpc.health.v1 in step with the service's own loops: a wedged loop turns the
    standard health check NOT_SERVING (what probes and operators read), not just Stats."""
    serving = True
    while True:
        healthy = service.healthy()
        if healthy != serving:
            await running.set_serving(healthy)
            serving = healthy
            if healthy:
                log.info("%s healthy again: its loop made progress", name)
            else:
                log.error("%s NOT_SERVING: work is waiting and its loop made no progress", name)
        await anyio.sleep(every)
