"""`pdmesh prefill`: one prefill service in the foreground."""

from __future__ import annotations

import argparse

from libs.member.serve import add_member_arguments, serve_member
from libs.member.sizing import default_prefill_tokens
from pdmesh.v1 import prefill_pb2


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_member_arguments(parser, "prefill")
    parser.add_argument(
        "--chunk-tokens", type=int, default=None,
        help="prompt tokens per prefill chunk; KV is written after each (default 256 on "
        "CPU, 512 on CUDA)",
    )
    parser.add_argument(
        "--max-batch-tokens", type=int, default=None,
        help="prompt tokens of all requests packed into one forward pass (default 512 on "
        "CPU: on 2 cores 1.07-1.11x the prefill throughput of 1024, whose pack attention is "
        "quadratic, and an abort waits for less of a pass; 2048 on CUDA, where a pass costs "
        "its kernel launches more than its tokens)",
    )


async def serve(args: argparse.Namespace) -> None:
    from services.prefill.service import PrefillConfig, PrefillService  # torch: see serve_member

    chunk, pack = default_prefill_tokens(args.device)
    chunk = args.chunk_tokens or chunk
    config = PrefillConfig(
        chunk_tokens=chunk,
        max_batch_tokens=max(args.max_batch_tokens or pack, chunk),
        max_rooms=args.max_rooms,
    )
    await serve_member(args, PrefillService, config,
                       prefill_pb2.DESCRIPTOR.services_by_name["Prefill"])
