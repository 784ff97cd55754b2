"""What a decode step costs the host at B streams, with no device work at all.

The decode's batch loop and its B stream readers share one event loop (and one GIL with
the compute thread), so at 128 streams the host's share of a step (admitting, growing
pages, packing the rows, handing each token to its stream, detokenizing, pacing) can
exceed the GPU's few milliseconds. This runs the real Batcher and the real TokenStreams
with SmolLM2's tokenizer over an engine that does nothing (constant logits, one greedy
token), so each step's time is host time only: a floor under the mesh's decode step on
any device, and the figure the host-side work is tuned against. No gRPC: the streams'
messages are built but not sent.

    python -m bench.decode_host_bench [--streams 128] [--tokens 512] [--rate 1500]
                                      [--overlap both|on|off] [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import time

import anyio
import torch

from libs.engine.config import ModelConfig
from libs.engine.kvpool import KvPool
from libs.engine.sampling import SamplingParams
from libs.engine.specs import random_tokenizer_source
from libs.engine.tokenizer import Tokenizer
from services.decode.batcher import STEP_PARTS, Batcher
from services.decode.main import DEFAULT_MESSAGE_RATE
from services.decode.stream import TokenStream

WORDS = "the old man said that he would go there and we will all see it".split()


class NullEngine:
    """Logits whose argmax cycles through some real words' ids (their row only as wide
    as the largest id: a full vocabulary's zeros would be most of the step on a CPU)."""

    device = "cpu"

    def __init__(self, ids: list[int], pages: int) -> None:
        self.pool = KvPool(ModelConfig.tiny(), pages, 16)
        self.ids = ids
        self.steps = 0

    def decode_step(self, batch, copy=True, fed=None) -> torch.Tensor:
        logits = torch.zeros(len(batch), max(self.ids) + 1)
        logits[:, self.ids[self.steps % len(self.ids)]] = 1.0
        self.steps += 1
        return logits


async def run_once(tokenizer: Tokenizer, streams: int, tokens: int, rate: float,
                   overlap: bool) -> dict:
    ids = [i for w in WORDS for i in tokenizer.encode(" " + w)]
    engine = NullEngine(ids, streams * (tokens // 16 + 4))
    batcher = Batcher(engine, tokenizer.eos_token_ids, max_batch=streams, overlap=overlap)
    params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
    messages = 0

    async def one() -> None:
        nonlocal messages
        seq = batcher.admit(engine.pool.alloc(2), 20, ids[0], params)
        stream = TokenStream(seq, tokenizer, batcher.cancel,
                             lambda: len(batcher.running) / rate if rate else 0.0)
        with seq.tokens.reading():
            while (await stream.next()).finish_reason is None:
                messages += 1
        messages += 1
        await seq.released.wait()
        engine.pool.free(seq.pages)

    async with anyio.create_task_group() as tg:
        tg.start_soon(batcher.run)
        started = time.perf_counter()
        async with anyio.create_task_group() as clients:
            for _ in range(streams):
                clients.start_soon(one)
        wall = time.perf_counter() - started
        tg.cancel_scope.cancel()
    steps = batcher.steps
    return {"overlap": overlap, "steps": steps, "messages": messages,
            "step_ms": 1e3 * wall / steps,
            "parts_ms": {p: 1e3 * batcher.step_seconds[p] / steps for p in STEP_PARTS}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--streams", type=int, default=128)
    parser.add_argument("--tokens", type=int, default=512, help="tokens a stream (default 512)")
    parser.add_argument("--rate", type=float, default=DEFAULT_MESSAGE_RATE,
                        help="--message-rate of the decode (default the decode's, "
                        f"{DEFAULT_MESSAGE_RATE:g}; 0: no pace)")
    parser.add_argument("--overlap", choices=("both", "on", "off"), default="both")
    parser.add_argument("--repeats", type=int, default=3, help="runs of each, alternating")
    parser.add_argument("--out", help="write the runs as JSON here")
    args = parser.parse_args()
    tokenizer = Tokenizer.load(random_tokenizer_source(), (2,))  # or PDMESH_TOKENIZER
    modes = {"both": [False, True], "on": [True], "off": [False]}[args.overlap]
    runs = []
    for _ in range(args.repeats):
        for overlap in modes:
            run = anyio.run(run_once, tokenizer, args.streams, args.tokens, args.rate, overlap)
            runs.append(run)
            parts = ", ".join(f"{p} {v:.3f}" for p, v in run["parts_ms"].items())
            print(f"{args.streams} streams, overlap {'on ' if overlap else 'off'}: "
                  f"{run['step_ms']:.3f} ms a step ({parts}); "
                  f"{run['messages'] / run['steps']:.1f} messages a step", flush=True)
    for overlap in modes:
        best = min(r["step_ms"] for r in runs if r["overlap"] == overlap)
        print(f"best of {args.repeats}, overlap {'on' if overlap else 'off'}: {best:.3f} ms a "
              f"step, {args.streams / best * 1e3:,.0f} tokens/s host-bound")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"args": vars(args), "runs": runs}, f, indent=1)


if __name__ == "__main__":
    main()
