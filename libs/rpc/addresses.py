"""`--host` and `--advertise-address`: what a service binds, and what it tells others.

A service binds `--host` (127.0.0.1 by default; 0.0.0.0 or :: for every interface) and
registers the advertised address with the bootstrap: routers and peers dial it, the
status command reads it, and under TLS they verify it against the service's certificate.
A member on another host must therefore advertise a name or IP that the other hosts
reach, and its certificate must name it (`pdmesh certs DIR --host NAME`). A wildcard
bind with nothing advertised is refused: no peer can dial 0.0.0.0.
"""

from __future__ import annotations

import argparse
import ipaddress

from libs.rpc import tls

WILDCARDS = frozenset({"0.0.0.0", "::", "[::]", ""})


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--host", default="127.0.0.1",
        help="address to bind (default 127.0.0.1; 0.0.0.0 binds every interface and then "
        "needs --advertise-address)",
    )
    parser.add_argument(
        "--advertise-address", default=None, metavar="HOST",
        help="the name or IP other hosts reach this service at: registered with the "
        "bootstrap and dialled by peers, so under TLS the certificate must name it "
        "(default: --host)",
    )


def advertised_host(args: argparse.Namespace, command: str) -> str:
    """The host this service advertises; a SystemExit with one line when it cannot work
    (a wildcard bind with nothing advertised, a certificate that does not name it)."""
    host = args.advertise_address or args.host
    if host in WILDCARDS:
        raise SystemExit(f"pdmesh {command}: --host {args.host} binds every interface; give "
                         "--advertise-address HOST, the name or IP other hosts reach it at")
    try:
        config = tls.from_env()
    except tls.TlsError as e:
        raise SystemExit(f"pdmesh {command}: {e}") from None
    if config is not None:
        try:
            tls.require_name(config, host)
        except tls.TlsError as e:
            flag = "--advertise-address" if args.advertise_address else "--host"
            raise SystemExit(f"pdmesh {command}: {flag} {host}: {e}") from None
    return host


def join(host: str, port: int) -> str:
    """host:port, with an IPv6 literal in brackets as gRPC and HTTP expect."""
    try:
        if isinstance(ipaddress.ip_address(host), ipaddress.IPv6Address):
            return f"[{host}]:{port}"
    except ValueError:
        pass
    return f"{host}:{port}"
