"""`pdmesh decode`: one decode service in the foreground."""

from __future__ import annotations

import argparse
import logging

from libs.member import sizing
from libs.member.serve import add_member_arguments, serve_member
from pdmesh.v1 import decode_pb2

log = logging.getLogger(__name__)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_member_arguments(parser, "decode")
    parser.add_argument(
        "--max-batch", type=int, default=None,
        help=f"sequences per decode step (default {sizing.CPU_MAX_BATCH} on the CPU, "
        f"{sizing.CUDA_MAX_BATCH} on CUDA)",
    )


async def serve(args: argparse.Namespace) -> None:
    from services.decode.service import DecodeConfig, DecodeService  # torch: see serve_member

    max_batch = args.max_batch or sizing.default_max_batch(args.device)
    log.info("max batch %d sequences a step", max_batch)
    config = DecodeConfig(max_rooms=args.max_rooms, max_batch=max_batch)
    await serve_member(args, DecodeService, config,
                       decode_pb2.DESCRIPTOR.services_by_name["Decode"])
