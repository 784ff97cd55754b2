"""`pdmesh prefill`: one prefill service in the foreground."""

from __future__ import annotations

import argparse

from libs.member.serve import add_member_arguments, serve_member
from pdmesh.v1 import prefill_pb2


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_member_arguments(parser, "prefill")
    parser.add_argument(
        "--chunk-tokens", type=int, default=256,
        help="prompt tokens per prefill chunk; KV is written after each (default 256)",
    )
    parser.add_argument(
        "--max-batch-tokens", type=int, default=512,
        help="prompt tokens of all requests packed into one forward pass (default 512: on "
        "2 CPU cores 1.07-1.11x the prefill throughput of 1024, whose pack attention is "
        "quadratic, and an abort waits for less of a pass)",
    )


async def serve(args: argparse.Namespace) -> None:
    from services.prefill.service import PrefillConfig, PrefillService  # torch: see serve_member

    config = PrefillConfig(
        chunk_tokens=args.chunk_tokens,
        max_batch_tokens=max(args.max_batch_tokens, args.chunk_tokens),
        max_rooms=args.max_rooms,
    )
    await serve_member(args, PrefillService, config,
                       prefill_pb2.DESCRIPTOR.services_by_name["Prefill"])
