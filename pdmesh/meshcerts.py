"""The certificates `pdmesh up` hands its children: a set the operator wrote with
`pdmesh certs DIR` (--certs DIR), a fresh set in a private temporary directory removed
at exit (the default), or none at all (--insecure, with a warning)."""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from libs.rpc import tls
from pdmesh.certs import role_env, write_set

log = logging.getLogger("pdmesh.up")

MESH_ROLES = ("bootstrap", "prefill", "decode", "router", "tracestore")


class CertsError(ValueError):
    """--certs DIR cannot serve the mesh; str() is one line naming the file."""


def check_set(directory: Path) -> None:
    """Every role of the mesh has a certificate of its own role, signed by ca.pem, in date."""
    for role in MESH_ROLES:
        try:
            config = tls.from_env(role_env(directory, role))
            assert config is not None
            tls.require_role(config, role)
        except tls.TlsError as e:
            message = str(e)  # names the file; the --tls-* flags are not what was given
            for flag, env in (("--tls-cert", tls.CERT_ENV), ("--tls-key", tls.KEY_ENV),
                              ("--tls-ca", tls.CA_ENV)):
                message = message.replace(f"{flag} (${env}) ", "")
            raise CertsError(f"--certs {directory}: {message}") from None


@contextmanager
def for_up(certs: str | None, insecure: bool, host: str) -> Iterator[Path | None]:
    """The directory of the mesh's certificate set for as long as the mesh runs.

    The supervisor's own environment gets the trace store's certificate; each child gets
    its role's (pdmesh.supervisor)."""
    for name in (tls.CERT_ENV, tls.KEY_ENV, tls.CA_ENV):
        os.environ.pop(name, None)  # never inherited: each child gets its role's
    if insecure:
        log.warning("--insecure: every gRPC hop is plaintext and unauthenticated; anyone who "
                    "reaches a port can register a member or read every member's NIXL "
                    "metadata")
        yield None
        return
    if certs is not None:
        directory = Path(certs)
        check_set(directory)
        os.environ.update(role_env(directory, "tracestore"))
        yield directory
        return
    directory = Path(tempfile.mkdtemp(prefix="pdmesh-certs-"))  # 0700
    try:
        write_set(directory, [host])
        os.environ.update(role_env(directory, "tracestore"))
        exports = " ".join(f"{k}={v}" for k, v in role_env(directory, "client").items())
        log.info("mutual TLS on every hop; certificates in %s (removed at exit). A client "
                 "(pdmesh status, generate, storm) needs: %s", directory, exports)
        yield directory
    finally:
        shutil.rmtree(directory, ignore_errors=True)
