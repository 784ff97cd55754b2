"""`pdmesh storm`: load and faults against a running mesh, with a timeline and a verdict.

One module per mode (abort, agentic, cascade, restart); this one holds the flags, runs
the chosen mode beside the timeline sampler, adds the checks every mode shares (no room
pinned, quiescent after the load), prints the verdict and writes the JSON.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import anyio

from pdmesh.storm import abort, agentic, cascade, restart
from pdmesh.storm.common import Timeline, ms, wait_quiet
from pdmesh.storm.evidence import busy_evidence, render

MODES = {"abort": abort, "agentic": agentic, "cascade": cascade, "restart": restart}

DESCRIPTION = """\
Load and faults against a running mesh. Every mode samples the members' counters every
100 ms and prints a timeline line about every second (t, inflight, KV pages used,
transfer_failed, pinned rooms, members up, aborts by reason), then one line per check
and `verdict: PASS|FAIL` (exit code 0|1), and writes the JSON to --out. Every mode
also checks: no room pinned at any sample, and inflight 0 and 0 KV pages after the load.

modes:
  abort    waves of --concurrency long requests, each cancelled by its client at a random
           time in [--abort-min, --abort-max]; each wave must quiesce (inflight 0, 0 KV
           pages) within --quiet-budget of its last cancel.
  agentic  --sessions concurrent chat sessions x --rounds rounds, greedy; before each
           round a request on the same conversation is cancelled at a random time in
           [--abort-min, --abort-max]; afterwards every session is replayed alone without
           cancels: a session whose token ids differ in any round is corrupt (must be 0).
  cascade  a client process runs --sessions streaming sessions back to back and is
           SIGKILLed after --kill-after s, --cycles times; after each kill the mesh must
           quiesce within --quiet-budget; then --liveness requests must each complete
           with tokens within --liveness-timeout.
  restart  --concurrency workers send requests back to back while the storm SIGKILLs a
           --target member --restarts times (the mesh must run under `pdmesh up` on this
           host, whose supervisor restarts it); waits until it is back with a new epoch,
           then --interval s; then --settle s of load. Requests in flight at a kill must
           fail within --fail-budget s; every settle request must succeed; the other
           role's transfer_failed must not grow during settle and it is never restarted.

recommended (the field report's figures):
  pdmesh storm --mode agentic --sessions 30 --rounds 3
  pdmesh storm --mode cascade --sessions 60 --kill-after 20 --cycles 2 --liveness 3
  pdmesh storm --mode restart --target decode --restarts 20
"""

# Flags whose default depends on the mode (None on the command line means "the mode's").
MODE_DEFAULTS = {
    "abort": {"concurrency": 64, "prompt_words": 400, "max_tokens": 512, "quiet_budget": 1.0},
    "agentic": {"sessions": 30, "prompt_words": 40, "max_tokens": 32, "quiet_budget": 5.0},
    "cascade": {"sessions": 60, "prompt_words": 100, "max_tokens": 256, "quiet_budget": 5.0},
    "restart": {"concurrency": 8, "prompt_words": 40, "max_tokens": 32, "quiet_budget": 5.0},
}


def _by_mode(flag: str) -> str:
    values = [f"{mode} {d[flag]}" for mode, d in MODE_DEFAULTS.items() if flag in d]
    return "default: " + ", ".join(values)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.description = DESCRIPTION
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    common = parser.add_argument_group("every mode")
    common.add_argument("--mode", choices=list(MODES), default="abort",
                        help="which storm (default abort; see above)")
    common.add_argument("--router", default="127.0.0.1:50051",
                        help="router gRPC address (127.0.0.1:50051)")
    common.add_argument("--bootstrap", default="127.0.0.1:50050",
                        help="bootstrap address (127.0.0.1:50050)")
    common.add_argument("--prompt-words", type=int, default=None,
                        help=f"words per prompt or user turn ({_by_mode('prompt_words')})")
    common.add_argument("--max-tokens", type=int, default=None,
                        help=f"tokens asked per request ({_by_mode('max_tokens')})")
    common.add_argument("--quiet-budget", type=float, default=None,
                        help="seconds the mesh may take to reach inflight 0 and 0 KV pages "
                        "after a wave's last cancel, a client kill, or the load's end "
                        f"({_by_mode('quiet_budget')})")
    common.add_argument("--request-timeout", type=float, default=60.0,
                        help="client deadline of each request, agentic and restart (60 s)")
    common.add_argument("--seed", type=int, default=0, help="random seed of the schedule")
    common.add_argument("--out", default=None,
                        help="JSON output path (default bench-results/storm.json for abort, "
                        "bench-results/storm-MODE.json for the others)")
    load = parser.add_argument_group("load (each flag names the modes it applies to)")
    load.add_argument("--concurrency", type=int, default=None,
                      help=f"abort: requests per wave; restart: workers "
                      f"({_by_mode('concurrency')})")
    load.add_argument("--waves", type=int, default=32, help="abort: waves (32: 2,048 aborts)")
    load.add_argument("--abort-min", type=float, default=0.02,
                      help="abort, agentic: earliest cancel after a request starts (0.02 s)")
    load.add_argument("--abort-max", type=float, default=1.0,
                      help="abort, agentic: latest cancel (1.0 s)")
    load.add_argument("--sessions", type=int, default=None,
                      help=f"agentic, cascade: concurrent sessions ({_by_mode('sessions')})")
    load.add_argument("--rounds", type=int, default=3, help="agentic: rounds per session (3)")
    load.add_argument("--cancel-tokens", type=int, default=256,
                      help="agentic: max_tokens of the cancelled request (ignore_eos, so it "
                      "is still running when cancelled; 256)")
    kill = parser.add_argument_group("faults and recovery")
    kill.add_argument("--kill-after", type=float, default=20.0,
                      help="cascade: seconds of client load before its SIGKILL (20)")
    kill.add_argument("--cycles", type=int, default=2, help="cascade: client kills (2)")
    kill.add_argument("--liveness", type=int, default=3,
                      help="cascade: liveness requests after the last cycle (3)")
    kill.add_argument("--liveness-timeout", type=float, default=5.0,
                      help="cascade: seconds a liveness request may take (5)")
    kill.add_argument("--target", choices=["decode", "prefill"], default="decode",
                      help="restart: the role whose members are killed (decode)")
    kill.add_argument("--restarts", type=int, default=20, help="restart: kills (20)")
    kill.add_argument("--interval", type=float, default=2.0,
                      help="restart: seconds of load after a recovery before the next kill, "
                      "and before the first (2)")
    kill.add_argument("--settle", type=float, default=10.0,
                      help="restart: seconds of load after the last restart (10)")
    kill.add_argument("--recover-timeout", type=float, default=60.0,
                      help="restart: seconds a killed member may take to be back (60; the "
                      "supervisor's backoff alone reaches 10)")
    kill.add_argument("--fail-budget", type=float, default=3.0,
                      help="restart: seconds within which a request in flight at a kill "
                      "must fail at the client (3)")


def resolve(args: argparse.Namespace) -> argparse.Namespace:
    """Fill the flags left to the mode's default."""
    for flag, value in MODE_DEFAULTS[args.mode].items():
        if getattr(args, flag) is None:
            setattr(args, flag, value)
    for flag in ("concurrency", "sessions"):
        if getattr(args, flag) is None:
            setattr(args, flag, 0)
    if args.out is None:
        suffix = "" if args.mode == "abort" else f"-{args.mode}"
        args.out = f"bench-results/storm{suffix}.json"
    return args


async def storm(args: argparse.Namespace) -> tuple[dict, Timeline]:
    """The mode beside the sampler; then the checks every mode shares."""
    timeline = Timeline(args.bootstrap)
    stop = anyio.Event()
    async with anyio.create_task_group() as tg:
        tg.start_soon(timeline.run, stop)
        try:
            result = await MODES[args.mode].run(args, timeline)
            quiet = await wait_quiet(args.bootstrap, time.monotonic(), args.quiet_budget)
        finally:
            stop.set()
    pinned = timeline.pinned_ever()
    print(f"after the load: quiescent {ms(quiet)}; pinned rooms at most {pinned} per sample")
    result["checks"] += [
        ("no room pinned at any sample", pinned == 0),
        (f"inflight 0 and 0 KV pages within {args.quiet_budget} s after the load",
         quiet is not None),
    ]
    result["figures"]["final_quiet_s"] = quiet
    if quiet is None:  # a wedge: say where, while the mesh is still in that state
        result["figures"]["evidence"] = await busy_evidence(args.bootstrap)
    return result, timeline


def main(args: argparse.Namespace) -> int:
    args = resolve(args)
    result, timeline = anyio.run(storm, args)
    for text, ok in result["checks"]:
        print(f"check {'ok  ' if ok else 'FAIL'} {text}")
    ok = all(passed for _, passed in result["checks"])
    print(f"verdict: {'PASS' if ok else 'FAIL'}")
    if "evidence" in result["figures"]:
        print(render(result["figures"]["evidence"]))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    document = {"mode": args.mode, "args": vars(args), "ok": ok,
                "checks": [{"check": text, "ok": passed} for text, passed in result["checks"]],
                **result["figures"], "outcomes": result["outcomes"],
                "timeline": timeline.rows}
    out.write_text(json.dumps(document, indent=1, default=str))
    print(f"wrote {out}")
    return 0 if ok else 1
