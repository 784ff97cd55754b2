"""Which UCX transports and network devices a member's NIXL agent uses.

UCX picks for itself by default: shared memory and CMA between processes of one host,
RDMA where a device offers it, TCP otherwise. Across hosts without RDMA the KV moves
over TCP; `--ucx-transports tcp` forces that (also useful to put a single host's KV on
the network, as the namespace fault tests do), and `--ucx-net-devices` picks the
interface when a host has several. The flags set UCX_TLS / UCX_NET_DEVICES before the
agent is created (UCX reads its environment once); without them any UCX_* variable in
the environment passes through unchanged.
"""

from __future__ import annotations

import argparse
import os


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--ucx-transports", default=None, metavar="LIST",
        help="UCX transports for the KV transfer (sets UCX_TLS), e.g. 'tcp' between hosts "
        "without RDMA, 'rc,cuda_copy' with InfiniBand/RoCE; every member of a mesh needs one "
        "transport in common (default: $UCX_TLS, else UCX's own choice)",
    )
    parser.add_argument(
        "--ucx-net-devices", default=None, metavar="LIST",
        help="network interfaces UCX may use (sets UCX_NET_DEVICES), e.g. 'eth0' or "
        "'mlx5_0:1' (default: $UCX_NET_DEVICES, else all)",
    )


def apply(args: argparse.Namespace, environ: dict[str, str] | None = None) -> None:
    """Put the flags into the environment UCX will read (os.environ by default)."""
    environ = os.environ if environ is None else environ
    if args.ucx_transports:
        environ["UCX_TLS"] = args.ucx_transports
    if args.ucx_net_devices:
        environ["UCX_NET_DEVICES"] = args.ucx_net_devices
