"""The `pdmesh` command: run the mesh, one service, or talk to a running mesh."""

from __future__ import annotations

import argparse
import ctypes
import os
import shlex
import signal
import sys
from pathlib import Path

# Before torch is imported anywhere: OpenMP's default busy-wait makes every
# process on a small shared CPU (prefill, decode, router side by side) spin
# against the others: small ops run 10-30x slower without this.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

DESCRIPTION = """\
pdmesh: a prefill/decode-disaggregated LLM serving mesh.

  pdmesh up                  run bootstrap, prefill, decode and router (Ctrl-C stops all)
  pdmesh bootstrap|prefill|decode|router   one service in the foreground
  pdmesh status [--json]     members, live counters and pinned rooms
  pdmesh debug dump MEMBER   every thread's and asyncio task's stack of a live service
  pdmesh generate PROMPT     stream a completion through the router's gRPC API
  pdmesh storm               abort|agentic|cascade|restart storms: timeline and verdict
  pdmesh bench               the mesh against transformers (starts its own mesh)
  pdmesh certs DIR           a development CA and a certificate per role (mutual TLS)
  pdmesh traces [ID]         recent requests (--aborted, --reason, --since, --slowest) or
                             one request's span tree, from `pdmesh up --trace-store`
"""


def _die_with_parent() -> None:
    """Get SIGTERM when the process named by PDMESH_PARENT_PID dies (Linux).

    `pdmesh up` names itself for its services, and the test harness names itself for
    `pdmesh up`, so no process outlives whoever started it. The child arms this itself
    after exec: a `preexec_fn` would force a plain fork() of a parent whose gRPC threads
    are live, and gRPC's fork handlers can then crash the forked child before it execs
    (docs/incidents.md).
    """
    parent = os.environ.get("PDMESH_PARENT_PID")
    if not parent or not sys.platform.startswith("linux"):
        return
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except OSError:
        return
    if os.getppid() != int(parent):
        sys.exit(0)  # the parent is already gone


GPU_MEMORY_FRACTION_ENV = "PDMESH_GPU_MEMORY_FRACTION"


def build_parser() -> argparse.ArgumentParser:
    from libs.member import sizing
    from libs.member.formats import FORMATS as KV_FORMATS
    from services.bootstrap import main as bootstrap_main
    from services.decode import main as decode_main
    from services.prefill import main as prefill_main
    from services.router import main as router_main

    parser = argparse.ArgumentParser(
        prog="pdmesh", description=DESCRIPTION, formatter_class=argparse.RawTextHelpFormatter
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    up = sub.add_parser("up", help="run the whole mesh (supervisor)")
    up.add_argument("--model", default="smollm2", help="smollm2 | tiny | PATH (default smollm2)")
    up.add_argument("--device", default="cpu",
                    help="cpu | cuda | cuda:N for every prefill and decode (default cpu)")
    up.add_argument("--prefill-device", default=None, metavar="DEVICE",
                    help="the prefills' device, e.g. cuda:0 (default --device)")
    up.add_argument("--decode-device", default=None, metavar="DEVICE",
                    help="the decodes' device, e.g. cuda:1, so that prefill and decode stop "
                    "competing for one GPU (default --device)")
    up.add_argument(
        "--dtype", default="float32", choices=["float32", "bfloat16"],
        help="model and KV dtype (default float32)",
    )
    up.add_argument(
        "--weights", default="native", choices=["native", "nvfp4"],
        help="linear weights of every prefill and decode: native (default) as the checkpoint "
        "stores them; nvfp4 quantizes q/k/v/o/gate/up/down to NVFP4 at load, weight-only "
        "(see pdmesh prefill --help)",
    )
    up.add_argument(
        "--kv-transfer", default="native", choices=KV_FORMATS,
        help="how prompt KV travels prefill -> decode, for every member: native or nvfp4 "
        "(see pdmesh prefill --help; --prefill-args/--decode-args can override per role)",
    )
    up.add_argument(
        "--prefix-cache", default="on", choices=["on", "off"],
        help="prefix cache on every prefill and decode (default on; see pdmesh prefill --help)",
    )
    up.add_argument("--prefill", type=int, default=1, help="prefill processes (default 1)")
    up.add_argument("--prefill-kv-pages", type=int, default=None,
                    help="KV pool pages per prefill (default: sized to the device, see "
                    "pdmesh prefill --help)")
    up.add_argument("--decode-kv-pages", type=int, default=None,
                    help="KV pool pages per decode (default: sized to the device, see "
                    "pdmesh decode --help)")
    up.add_argument(
        "--gpu-memory-fraction", type=sizing.memory_fraction, metavar="F",
        default=os.environ.get(GPU_MEMORY_FRACTION_ENV) or sizing.DEFAULT_GPU_MEMORY_FRACTION,
        help="on CUDA, the fraction of the GPU's memory the prefills and decodes may fill "
        "together (weights and KV pools), split evenly between the members on each GPU (default "
        f"${GPU_MEMORY_FRACTION_ENV} or {sizing.DEFAULT_GPU_MEMORY_FRACTION})",
    )
    up.add_argument("--decode", type=int, default=1, help="decode processes (default 1)")
    up.add_argument("--host", default="127.0.0.1", help="address every service binds")
    up.add_argument("--advertise-address", default=None, metavar="HOST",
                    help="what every service registers and the others dial (default: --host; "
                    "127.0.0.1 when --host is 0.0.0.0)")
    up.add_argument("--http-port", type=int, default=8000, help="OpenAI HTTP port (8000)")
    up.add_argument("--grpc-port", type=int, default=50051, help="router gRPC port (50051)")
    up.add_argument("--bootstrap-port", type=int, default=50050, help="bootstrap port (50050)")
    for role in ("prefill", "decode", "router"):
        up.add_argument(f"--{role}-args", default="", metavar="ARGS",
                        help=f"extra flags for every {role}, e.g. '--max-rooms 8' "
                        f"(see pdmesh {role} --help)")
    up.add_argument("--trace-store", default=None, metavar="PATH",
                    help="run the embedded trace store: an OTLP/gRPC receiver writing spans "
                    "to this SQLite file, with every service exporting to it unless "
                    "OTEL_EXPORTER_OTLP_ENDPOINT is set (read with `pdmesh traces`)")
    up.add_argument("--trace-store-port", type=int, default=0,
                    help="its OTLP/gRPC port (default a free one)")
    up.add_argument("--trace-store-max-spans", type=int, default=200_000,
                    help="spans kept; the oldest are dropped past it (200000)")
    up.add_argument("--certs", default=None, metavar="DIR",
                    help="mutual TLS with the certificates `pdmesh certs DIR` wrote (default: "
                    "a fresh set in a private directory removed at exit)")
    up.add_argument("--insecure", action="store_true",
                    help="plaintext gRPC on every hop: no certificates, anyone who reaches a "
                    "port can register or read the mesh (logs a warning)")
    up.add_argument("--faults", default=None, metavar="SPEC",
                    help="TEST ONLY: fault injection points for prefills and decodes "
                    "(see pdmesh prefill --help; default none)")

    for name, module, text in (
        ("bootstrap", bootstrap_main, "the registry service"),
        ("prefill", prefill_main, "one prefill service"),
        ("decode", decode_main, "one decode service"),
        ("router", router_main, "the OpenAI gateway and gRPC Generate API"),
    ):
        p = sub.add_parser(name, help=text, description=f"pdmesh {name}: {text}")
        module.add_arguments(p)
        p.set_defaults(service=module)

    status = sub.add_parser("status", help="members and their live counters")
    status.add_argument("--json", action="store_true",
                        help="one JSON object (see docs/operations.md)")
    status.add_argument("--bootstrap", default="127.0.0.1:50050",
                        help="bootstrap address, or replicas host:port,host:port (the first "
                        "that answers)")

    debug = sub.add_parser("debug", help="evidence from a live service")
    debug_sub = debug.add_subparsers(dest="debug_command", required=True, metavar="WHAT")
    dump = debug_sub.add_parser(
        "dump", help="every thread's and asyncio task's stack of one member"
    )
    dump.add_argument("member", help="member name as `pdmesh status` shows it, or bootstrap")
    dump.add_argument("--bootstrap", default="127.0.0.1:50050", help="bootstrap address")
    dump.add_argument("--json", action="store_true", help="the DumpReply as JSON")

    gen = sub.add_parser("generate", help="stream a completion through the gRPC API")
    gen.add_argument("prompt", help="the user message (chat) or raw prompt (--raw)")
    gen.add_argument("--router", default="127.0.0.1:50051", help="router gRPC address")
    gen.add_argument("--raw", action="store_true", help="send a raw prompt, no chat template")
    gen.add_argument("--max-tokens", type=int, default=128)
    gen.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--seed", type=int, default=None)

    storm = sub.add_parser("storm", help="load and faults against a running mesh, with a verdict")
    from pdmesh import storm as storm_mod

    storm_mod.add_arguments(storm)

    traces = sub.add_parser(
        "traces", help="recent requests and one request's span tree from the trace store"
    )
    from pdmesh import traces as traces_mod

    traces_mod.add_arguments(traces)

    bench = sub.add_parser("bench", help="benchmark a mesh against transformers side by side")
    from pdmesh import bench as bench_mod

    bench_mod.add_arguments(bench)
    certs = sub.add_parser("certs", help="write a development CA and per-role certificates")
    from pdmesh import certs as certs_mod

    certs_mod.add_arguments(certs)
    from pdmesh.client import API_KEY_ENV

    services = [p for name, p in sub.choices.items()
                if name in ("bootstrap", "prefill", "decode", "router")]
    for command in (*services, status, dump, gen, storm, bench):  # bench: --router/--bootstrap
        _add_tls_arguments(command)

    for command in (up, gen, storm, bench):
        command.add_argument(
            "--api-key", default=None, metavar="KEY",
            help=f"the router's API key (default ${API_KEY_ENV}); `up` hands it to its router",
        )
    return parser


def _add_tls_arguments(parser: argparse.ArgumentParser) -> None:
    from libs.rpc.tls import CA_ENV, CERT_ENV, KEY_ENV

    group = parser.add_argument_group("mutual TLS (all three, or none for plaintext)")
    for flag, env, what in (("--tls-cert", CERT_ENV, "this process's certificate (PEM)"),
                            ("--tls-key", KEY_ENV, "its private key (PEM)"),
                            ("--tls-ca", CA_ENV, "the CA every peer's certificate is signed by")):
        group.add_argument(flag, default=None, metavar="FILE", help=f"{what} (default ${env})")


def _take_tls(args: argparse.Namespace) -> str | None:
    """Move --tls-* into the environment (where open_channel, the servers and the span
    exporter read them) and check the files: a one-line refusal, or None."""
    from libs.rpc import tls

    for flag, env in (("tls_cert", tls.CERT_ENV), ("tls_key", tls.KEY_ENV),
                      ("tls_ca", tls.CA_ENV)):
        value = getattr(args, flag, None)
        if value:
            os.environ[env] = value
    if not hasattr(args, "tls_cert"):
        return None
    try:
        config = tls.from_env()
        if config is not None and getattr(args, "service", None) is not None:
            tls.require_role(config, args.command)
    except tls.TlsError as e:
        return str(e)
    if config is None and getattr(args, "service", None) is not None:
        import logging

        from libs.rpc.runtime import setup_logging

        setup_logging(args.command)  # run_service's own call then changes nothing
        logging.getLogger("pdmesh").warning(
            "TLS is off (no --tls-cert): this %s serves and calls plaintext gRPC", args.command)
    return None


def _take_api_key(args: argparse.Namespace) -> None:
    """Move --api-key into the environment, where the router `up` starts, every
    GenerateClient and the storms' client processes read it: never in a child's argv
    (visible in `ps`) nor in a results file that records the arguments."""
    from pdmesh.client import API_KEY_ENV

    key = getattr(args, "api_key", None)
    if key:
        os.environ[API_KEY_ENV] = key
    if hasattr(args, "api_key") and getattr(args, "service", None) is None:
        del args.api_key


def _extra_args(args: argparse.Namespace) -> dict[str, list[str]]:
    """The flags `pdmesh up` passes through to each role's children."""
    extra = {role: shlex.split(getattr(args, f"{role}_args"))
             for role in ("prefill", "decode", "router")}
    for role, pages in (("prefill", args.prefill_kv_pages), ("decode", args.decode_kv_pages)):
        if pages is not None:
            extra[role] += ["--kv-pages", str(pages)]
    if args.faults is not None:
        for role in ("prefill", "decode"):
            extra[role] += ["--faults", args.faults]
    return extra


def _check_model(spec: str) -> str | None:
    """Why `spec` cannot be served, or None. For a HF directory its config.json and
    tokenizer are read here (no weights) and the vocabularies compared; the built-in models
    need no check."""
    from libs.engine.specs import check_spec, load_tokenizer

    try:
        check_spec(spec)
        if Path(spec).is_dir():
            load_tokenizer(spec)
    except (ValueError, OSError) as e:
        return str(e)
    return None


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    _take_api_key(args)
    refusal = _take_tls(args)
    if refusal:
        from libs.member.serve import EXIT_CANNOT_START

        print(f"pdmesh {args.command}: {refusal}", file=sys.stderr)
        return EXIT_CANNOT_START
    _die_with_parent()
    if getattr(args, "service", None) is not None:
        from libs.rpc.runtime import run_service

        _exit_without_teardown(run_service(args.command, lambda: args.service.serve(args)))
    if args.command == "up":
        from pdmesh.supervisor import Plan

        plan = Plan(
            model=args.model, device=args.device, prefill_device=args.prefill_device,
            decode_device=args.decode_device, dtype=args.dtype, weights=args.weights,
            kv_transfer=args.kv_transfer, prefix_cache=args.prefix_cache,
            prefill=args.prefill, decode=args.decode,
            host=args.host, http_port=args.http_port, grpc_port=args.grpc_port,
            bootstrap_port=args.bootstrap_port, gpu_memory_fraction=args.gpu_memory_fraction,
            extra=_extra_args(args), advertise_address=args.advertise_address,
        )
        if plan.prefill < 1 or plan.decode < 1:
            parser.error("--prefill and --decode must be at least 1")
        from services.router import main as router_main

        # A bad router flag (`--max-queue 0`, say) is refused here, in one line, rather
        # than by a router the supervisor would restart forever.
        router_parser = argparse.ArgumentParser(prog="pdmesh up --router-args")
        router_main.add_arguments(router_parser)
        router_parser.parse_args(plan.extra["router"])
        refusal = _check_model(args.model)
        if refusal:  # before any process starts: a bad model would only crash-loop them
            print(f"pdmesh up: --model: {refusal}", file=sys.stderr)
            return 2
        from libs.member.sizing import check_device

        for flag, device in (("--device", args.device), ("--prefill-device", args.prefill_device),
                             ("--decode-device", args.decode_device)):
            refusal = device and check_device(device)
            if refusal:
                print(f"pdmesh up: {flag} {device}: {refusal}", file=sys.stderr)
                return 2
        from libs.rpc.runtime import setup_logging
        from pdmesh import meshcerts

        setup_logging("up")  # for_up logs where the certificates are, or --insecure's warning
        try:
            with meshcerts.for_up(args.certs, args.insecure, plan.advertised) as certs_dir:
                plan.certs = certs_dir
                return _run_up(args, plan)
        except meshcerts.CertsError as e:
            print(f"pdmesh up: {e}", file=sys.stderr)
            return 2
    if args.command == "certs":
        from pdmesh import certs as certs_mod

        return certs_mod.main(args)
    if args.command == "status":
        return _status(args)
    if args.command == "generate":
        return _generate(args)
    if args.command == "debug":
        return _debug_dump(args)
    if args.command == "traces":
        from pdmesh import traces as traces_mod

        return traces_mod.main(args)
    if args.command == "storm":
        from pdmesh import storm as storm_mod

        return storm_mod.main(args)
    if args.command == "bench":
        from pdmesh import bench as bench_mod

        return bench_mod.run(args)
    parser.error(f"unknown command {args.command}")
    return 2


def _run_up(args: argparse.Namespace, plan) -> int:
    """Run the supervisor, beside the embedded trace store when --trace-store asks."""
    from libs.rpc.runtime import run_service
    from pdmesh.supervisor import supervise

    if args.trace_store is None:
        return run_service("up", lambda: supervise(plan))
    from pdmesh import tracestore

    store, port = tracestore.serve(
        args.trace_store, args.host, args.trace_store_port, args.trace_store_max_spans
    )
    scheme = "http" if plan.certs is None else "https"  # https: the children's certificates
    # the children inherit it; an operator's own collector wins
    os.environ.setdefault("OTEL_EXPORTER_OTLP_ENDPOINT", f"{scheme}://{args.host}:{port}")
    os.environ.setdefault("OTEL_EXPORTER_OTLP_PROTOCOL", "grpc")
    print(f"trace store: {args.trace_store} (OTLP/gRPC on {args.host}:{port})", flush=True)
    try:
        return run_service("up", lambda: supervise(plan))
    finally:
        store.stop(2).wait()


def _exit_without_teardown(code: int) -> None:
    """End a service that has stopped cleanly (its servers stopped, deregistered, spans
    flushed, its NIXL agent closed with every transfer handle accounted for: see
    libs.member.serve.close_agent) without Python's interpreter teardown: after torch was
    imported that teardown costs ~1 s of CPU and frees nothing the kernel would not, and
    every prefill and decode pays it at every stop (2-3 s per member on a 2-core host
    when all stop at once). A service that failed, a leak included, raises instead
    and exits the usual way."""
    import logging

    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _hint(error) -> str:
    """For UNAVAILABLE: the TLS mismatch it may be (libs.rpc.tls.unavailable_hint)."""
    import grpc

    from libs.rpc.tls import unavailable_hint

    return f"; {unavailable_hint()}" if error.code() == grpc.StatusCode.UNAVAILABLE else ""


def _status(args: argparse.Namespace) -> int:
    import anyio
    import grpc

    from pdmesh.status import collect, render, to_json

    try:
        status = anyio.run(collect, args.bootstrap)
    except grpc.aio.AioRpcError as e:
        print(f"pdmesh status: bootstrap {args.bootstrap} unreachable ({e.code().name}"
              f"{_hint(e)})", file=sys.stderr)
        return 1
    print(to_json(status) if args.json else render(status))
    return 0


def _debug_dump(args: argparse.Namespace) -> int:
    import anyio
    import grpc
    from google.protobuf.json_format import MessageToJson

    from pdmesh.status import dump_member, render_dump

    try:
        reply = anyio.run(dump_member, args.bootstrap, args.member)
    except LookupError as e:
        print(f"pdmesh debug dump: {e.args[0]}", file=sys.stderr)
        return 1
    except grpc.aio.AioRpcError as e:
        print(f"pdmesh debug dump: {e.code().name}: {e.details()}{_hint(e)}", file=sys.stderr)
        return 1
    print(MessageToJson(reply) if args.json else render_dump(reply))
    return 0


def _generate(args: argparse.Namespace) -> int:
    import anyio
    import grpc

    from pdmesh.client import Done, GenerateClient

    async def go() -> int:
        async with GenerateClient(args.router) as client:
            kwargs = {"prompt": args.prompt} if args.raw else {
                "messages": [{"role": "user", "content": args.prompt}]
            }
            async for item in client.generate(
                max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                seed=args.seed, **kwargs,
            ):
                if isinstance(item, Done):
                    print(f"\n[{item.finish_reason}: {item.prompt_tokens} prompt + "
                          f"{item.completion_tokens} completion tokens]", file=sys.stderr)
                else:
                    print(item.text, end="", flush=True)
        return 0

    try:
        return anyio.run(go)
    except grpc.aio.AioRpcError as e:
        print(f"pdmesh generate: {e.code().name}: {e.details()}{_hint(e)}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
