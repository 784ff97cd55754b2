"""`pdmesh certs DIR`: a development CA and one certificate per role (libs.rpc.tls).

DIR gets ca.pem and, for each role, ROLE.pem and ROLE.key (mode 0600; DIR 0700). The
CA's private key is never written: to add or replace a certificate, issue the whole set
again. Each certificate names its role in a URI subject alternative name
(spiffe://pdmesh/role/ROLE) and the hosts it may serve in DNS/IP names: localhost,
127.0.0.1, ::1, this machine's hostname and any --host given. Keys are ECDSA P-256.
"""

from __future__ import annotations

import argparse
import datetime
import ipaddress
import os
import socket
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from libs.rpc.tls import CA_ENV, CERT_ENV, KEY_ENV, ROLE_URI_PREFIX, ROLES

DEFAULT_DAYS = 30
SKEW = datetime.timedelta(minutes=5)  # clocks of the mesh's hosts may differ a little


@dataclass(frozen=True)
class Authority:
    """A CA in memory: its certificate and the key that signs role certificates."""

    cert: x509.Certificate
    key: ec.EllipticCurvePrivateKey


def new_authority(name: str = "pdmesh development CA", days: int = DEFAULT_DAYS) -> Authority:
    key = ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(subject).issuer_name(subject).public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - SKEW).not_valid_after(now + datetime.timedelta(days=days))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(x509.KeyUsage(
            digital_signature=True, key_cert_sign=True, crl_sign=True, content_commitment=False,
            key_encipherment=False, data_encipherment=False, key_agreement=False,
            encipher_only=False, decipher_only=False), critical=True)
        .sign(key, hashes.SHA256())
    )
    return Authority(cert, key)


def _san_entry(host: str) -> x509.GeneralName:
    try:
        return x509.IPAddress(ipaddress.ip_address(host))
    except ValueError:
        return x509.DNSName(host)


def default_hosts(extra: list[str] | None = None) -> list[str]:
    hosts = ["localhost", "127.0.0.1", "::1", socket.gethostname(), *(extra or [])]
    return list(dict.fromkeys(h for h in hosts if h))


def issue(ca: Authority, role: str, hosts: list[str], *,
          not_before: datetime.datetime | None = None,
          not_after: datetime.datetime | None = None,
          days: int = DEFAULT_DAYS) -> tuple[bytes, bytes]:
    """A certificate (PEM) and its key (PEM) for `role`, valid for `hosts`."""
    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.datetime.now(datetime.UTC)
    names = [x509.UniformResourceIdentifier(ROLE_URI_PREFIX + role),
             *(_san_entry(h) for h in hosts)]
    cert = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, f"pdmesh {role}")]))
        .issuer_name(ca.cert.subject).public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(not_before or now - SKEW)
        .not_valid_after(not_after or now + datetime.timedelta(days=days))
        .add_extension(x509.SubjectAlternativeName(names), critical=False)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.ExtendedKeyUsage([x509.oid.ExtendedKeyUsageOID.SERVER_AUTH,
                                              x509.oid.ExtendedKeyUsageOID.CLIENT_AUTH]),
                       critical=False)
        .sign(ca.key, hashes.SHA256())
    )
    key_pem = key.private_bytes(serialization.Encoding.PEM,
                                serialization.PrivateFormat.PKCS8,
                                serialization.NoEncryption())
    return cert.public_bytes(serialization.Encoding.PEM), key_pem


def _write_private(path: Path, data: bytes) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(data)


def write_set(directory: str | Path, hosts: list[str] | None = None,
              days: int = DEFAULT_DAYS) -> Path:
    """Write ca.pem and ROLE.pem/ROLE.key for every role into `directory` (made 0700)."""
    directory = Path(directory)
    directory.mkdir(mode=0o700, parents=True, exist_ok=True)
    directory.chmod(0o700)
    ca = new_authority(days=days)
    (directory / "ca.pem").write_bytes(ca.cert.public_bytes(serialization.Encoding.PEM))
    for role in ROLES:
        cert, key = issue(ca, role, default_hosts(hosts), days=days)
        (directory / f"{role}.pem").write_bytes(cert)
        _write_private(directory / f"{role}.key", key)
    return directory


def role_env(directory: str | Path, role: str) -> dict[str, str]:
    """The PDMESH_TLS_* variables that give a process `role`'s certificate from a set."""
    directory = Path(directory)
    return {CERT_ENV: str(directory / f"{role}.pem"), KEY_ENV: str(directory / f"{role}.key"),
            CA_ENV: str(directory / "ca.pem")}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("dir", help="directory to write ca.pem, ROLE.pem and ROLE.key into")
    parser.add_argument("--host", action="append", default=[], metavar="NAME",
                        help="another DNS name or IP the members serve on (repeatable); "
                        "localhost, 127.0.0.1, ::1 and this hostname are always included")
    parser.add_argument("--days", type=int, default=DEFAULT_DAYS,
                        help=f"validity in days (default {DEFAULT_DAYS})")


def main(args: argparse.Namespace) -> int:
    directory = write_set(args.dir, args.host, args.days)
    print(f"wrote a development CA and certificates for {', '.join(ROLES)} to {directory}")
    env = role_env(directory, "client")
    print("a client (pdmesh status, generate, storm) uses:")
    for name, value in env.items():
        print(f"  export {name}={value}")
    return 0
