"""`pdmesh decode`: one decode service in the foreground."""

from __future__ import annotations

import argparse

from libs.member.serve import add_member_arguments, serve_member
from pdmesh.v1 import decode_pb2


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_member_arguments(parser, "decode", pages=2048)
    parser.add_argument("--max-batch", type=int, default=64, help="sequences per decode step")


async def serve(args: argparse.Namespace) -> None:
    from services.decode.service import DecodeConfig, DecodeService  # torch: see serve_member

    config = DecodeConfig(max_rooms=args.max_rooms, max_batch=args.max_batch)
    await serve_member(args, DecodeService, config,
                       decode_pb2.DESCRIPTOR.services_by_name["Decode"])
