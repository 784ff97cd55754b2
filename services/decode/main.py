"""`pdmesh decode`: one decode service in the foreground."""

from __future__ import annotations

import argparse
import logging

from libs.member import sizing
from libs.member.serve import add_member_arguments, serve_member
from pdmesh.v1 import decode_pb2
from services.decode import growth

log = logging.getLogger(__name__)

# Token messages a second across all of a decode's streams. A message costs tens of
# microseconds of Python here and again in the router's relay: at this rate each process
# spends a fraction of a core on them, and past a few sequences a message carries several
# tokens (services/decode/stream.py). At one stream the pace (0.7 ms) is below a step, so
# every token still goes out alone; at 128 a stream sends every 85 ms. On one H100 at 128
# streams, 1,500 gave 1.12x the aggregate tokens/s of 4,000 (docs/performance.md).
DEFAULT_MESSAGE_RATE = 1500.0


def message_rate(text: str) -> float:
    rate = float(text)
    if not rate >= 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {text}")
    return rate


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_member_arguments(parser, "decode")
    parser.add_argument(
        "--max-batch", type=int, default=None,
        help=f"sequences per decode step (default {sizing.CPU_MAX_BATCH} on the CPU, "
        f"{sizing.CUDA_MAX_BATCH} on CUDA)",
    )
    parser.add_argument(
        "--kv-reserve", default="grow", choices=growth.RESERVE_MODES,
        help="grow (default): admit a request with its prompt's pages plus "
        "--kv-growth-tokens, add pages as it generates, and preempt the newest sequence "
        "(the router re-runs it) when the pool runs dry; upfront: reserve prompt + "
        "max_tokens at admission and refuse when the pool is short",
    )
    parser.add_argument(
        "--kv-growth-tokens", type=int, default=growth.DEFAULT_GROWTH_TOKENS, metavar="N",
        help="with --kv-reserve grow, tokens of KV reserved past the prompt at admission "
        f"(default {growth.DEFAULT_GROWTH_TOKENS}: one page)",
    )

    parser.add_argument(
        "--overlap-steps", default="auto", choices=("auto", "on", "off"),
        help="on: launch each decode step before handing off the previous one's tokens, "
        "so the host's share of a step (streams, admission, page growth) runs while the "
        "device computes; off: one step at a time. Default auto: on for CUDA, off on the "
        "CPU (there a launch is the whole forward, so there is nothing to overlap)",
    )
    parser.add_argument(
        "--message-rate", type=message_rate, default=DEFAULT_MESSAGE_RATE, metavar="PER_S",
        help=f"token messages a second across all streams (default {DEFAULT_MESSAGE_RATE:g}): "
        "each stream waits out its share (batch size / rate) between messages, and the "
        "tokens sampled meanwhile go in one message; 0 sends each token as soon as its "
        "reader can",
    )


def overlap_steps(choice: str, device: str) -> bool:
    """--overlap-steps: auto overlaps on CUDA only."""
    return sizing.is_cuda(device) if choice == "auto" else choice == "on"


async def serve(args: argparse.Namespace) -> None:
    from services.decode.service import DecodeConfig, DecodeService  # torch: see serve_member

    max_batch = args.max_batch or sizing.default_max_batch(args.device)
    log.info("max batch %d sequences a step", max_batch)
    reservation = growth.Reservation(args.kv_reserve, args.kv_growth_tokens)
    config = DecodeConfig(max_rooms=args.max_rooms, max_batch=max_batch,
                          reservation=reservation, message_rate=args.message_rate,
                          overlap_steps=overlap_steps(args.overlap_steps, args.device))
    await serve_member(args, DecodeService, config,
                       decode_pb2.DESCRIPTOR.services_by_name["Decode"])
