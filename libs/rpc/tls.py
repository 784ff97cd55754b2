"""Mutual TLS for every gRPC hop: one certificate, key and CA per process, read from
PDMESH_TLS_CERT / PDMESH_TLS_KEY / PDMESH_TLS_CA (the `--tls-*` flags set these).

Every channel (libs.rpc.calls.open_channel) and every server (libs.rpc.server,
the trace store) takes its credentials from here, so a process is either TLS on every
hop or plaintext on every hop. Servers require a client certificate signed by the CA.

A certificate names its holder's role in a URI subject alternative name,
``spiffe://pdmesh/role/<role>`` (bootstrap, prefill, decode, router, tracestore,
client); the bootstrap reads it from the peer's certificate to admit a registration
(peer_role). Files are checked when loaded, so a bad certificate is a one-line error
naming the file and the flag, never a handshake that fails later.
"""

from __future__ import annotations

import datetime
import ipaddress
import os
from collections.abc import Mapping
from dataclasses import dataclass

import grpc
from cryptography import x509
from cryptography.hazmat.primitives import serialization

CERT_ENV = "PDMESH_TLS_CERT"
KEY_ENV = "PDMESH_TLS_KEY"
CA_ENV = "PDMESH_TLS_CA"
ROLE_URI_PREFIX = "spiffe://pdmesh/role/"
ROLES = ("bootstrap", "prefill", "decode", "router", "tracestore", "client")

_SOURCES = {CERT_ENV: "--tls-cert", KEY_ENV: "--tls-key", CA_ENV: "--tls-ca"}


class TlsError(ValueError):
    """A TLS setting that cannot work; str() is one line naming the flag and file."""


@dataclass(frozen=True)
class TlsConfig:
    cert_path: str
    cert: bytes
    key: bytes
    ca: bytes
    role: str


def _where(env_name: str, path: str) -> str:
    return f"{_SOURCES[env_name]} (${env_name}) {path}"


def _read(env_name: str, path: str) -> bytes:
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError as e:
        raise TlsError(f"{_where(env_name, path)}: {e.strerror or e}") from None


def _certificate(env_name: str, path: str, data: bytes) -> x509.Certificate:
    try:
        return x509.load_pem_x509_certificate(data)
    except ValueError as e:
        raise TlsError(f"{_where(env_name, path)}: not a PEM certificate ({e})") from None


def role_of(cert: x509.Certificate) -> str | None:
    """The role a certificate names in its spiffe://pdmesh/role/ URI, or None."""
    try:
        sans = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    except x509.ExtensionNotFound:
        return None
    for uri in sans.get_values_for_type(x509.UniformResourceIdentifier):
        if uri.startswith(ROLE_URI_PREFIX):
            return uri[len(ROLE_URI_PREFIX):]
    return None


def load(cert_path: str, key_path: str, ca_path: str,
         now: datetime.datetime | None = None) -> TlsConfig:
    """Read and check the three files: dates, the CA's signature, the key, the role."""
    cert_pem = _read(CERT_ENV, cert_path)
    key_pem = _read(KEY_ENV, key_path)
    ca_pem = _read(CA_ENV, ca_path)
    cert = _certificate(CERT_ENV, cert_path, cert_pem)
    ca = _certificate(CA_ENV, ca_path, ca_pem)
    now = now or datetime.datetime.now(datetime.UTC)
    if now < cert.not_valid_before_utc:
        raise TlsError(f"{_where(CERT_ENV, cert_path)}: not valid before "
                       f"{cert.not_valid_before_utc:%Y-%m-%d %H:%M:%S} UTC")
    if now > cert.not_valid_after_utc:
        raise TlsError(f"{_where(CERT_ENV, cert_path)}: expired "
                       f"{cert.not_valid_after_utc:%Y-%m-%d %H:%M:%S} UTC")
    try:
        cert.verify_directly_issued_by(ca)
    except Exception as e:  # noqa: BLE001 - InvalidSignature, ValueError, TypeError
        raise TlsError(f"{_where(CERT_ENV, cert_path)}: not signed by the CA in "
                       f"{_where(CA_ENV, ca_path)} ({type(e).__name__})") from None
    try:
        key = serialization.load_pem_private_key(key_pem, password=None)
    except (ValueError, TypeError) as e:
        raise TlsError(f"{_where(KEY_ENV, key_path)}: not an unencrypted PEM private key "
                       f"({e})") from None
    if key.public_key().public_bytes(
        serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo
    ) != cert.public_key().public_bytes(
        serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo
    ):
        raise TlsError(f"{_where(KEY_ENV, key_path)}: does not match the certificate "
                       f"{cert_path}")
    role = role_of(cert)
    if role not in ROLES:
        raise TlsError(f"{_where(CERT_ENV, cert_path)}: names no pdmesh role (a URI "
                       f"subject alternative name {ROLE_URI_PREFIX}<{'|'.join(ROLES)}>)")
    return TlsConfig(cert_path=cert_path, cert=cert_pem, key=key_pem, ca=ca_pem, role=role)


_cache: dict[tuple[str, str, str], TlsConfig] = {}


def from_env(env: Mapping[str, str] | None = None) -> TlsConfig | None:
    """This process's TLS config: None when none of the three variables is set."""
    env = os.environ if env is None else env
    paths = tuple(env.get(name, "") for name in (CERT_ENV, KEY_ENV, CA_ENV))
    if not any(paths):
        return None
    names = (CERT_ENV, KEY_ENV, CA_ENV)
    missing = [_SOURCES[name] for name, p in zip(names, paths, strict=True) if not p]
    if missing:
        raise TlsError(f"TLS needs --tls-cert, --tls-key and --tls-ca together: "
                       f"{', '.join(missing)} missing")
    if paths not in _cache:
        _cache[paths] = load(*paths)
    return _cache[paths]


_client_override: tuple[TlsConfig | None] | None = None


def use_for_clients(config: TlsConfig | None) -> None:
    """Make this process a client of a mesh it started, without touching its environment:
    channels use `config` (None: plaintext) instead of PDMESH_TLS_*; servers and child
    processes are unaffected (pdmesh.localmesh, for tests and benchmarks)."""
    global _client_override
    _client_override = (config,)


def client_config() -> TlsConfig | None:
    """What a channel of this process presents: the config use_for_clients set, else the
    environment's."""
    return _client_override[0] if _client_override is not None else from_env()


def require_role(config: TlsConfig, role: str) -> None:
    """A service refuses to start with a certificate made for another role."""
    if config.role != role:
        raise TlsError(f"{_where(CERT_ENV, config.cert_path)}: is a {config.role} "
                       f"certificate; `pdmesh {role}` needs a {role} certificate")


def names_of(cert: x509.Certificate) -> list[str]:
    """The DNS names and IPs a certificate may serve (its subject alternative names)."""
    try:
        sans = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    except x509.ExtensionNotFound:
        return []
    return [*sans.get_values_for_type(x509.DNSName),
            *(str(ip) for ip in sans.get_values_for_type(x509.IPAddress))]


def require_name(config: TlsConfig, host: str) -> None:
    """A service refuses to advertise a host its certificate does not name: every peer
    that dials it would fail the handshake's hostname check, one request at a time."""
    names = names_of(x509.load_pem_x509_certificate(config.cert))
    wanted = host.strip("[]").lower()
    try:
        wanted = str(ipaddress.ip_address(wanted))
    except ValueError:
        pass
    if wanted not in (n.lower() for n in names):
        raise TlsError(f"{_where(CERT_ENV, config.cert_path)}: does not name {host} (it names "
                       f"{', '.join(names) or 'no host'}); issue it with `pdmesh certs DIR "
                       f"--host {host}`")


def channel_credentials(config: TlsConfig) -> grpc.ChannelCredentials:
    return grpc.ssl_channel_credentials(
        root_certificates=config.ca, private_key=config.key, certificate_chain=config.cert
    )


def server_credentials(config: TlsConfig) -> grpc.ServerCredentials:
    """Server credentials that refuse any client without a certificate of the CA."""
    return grpc.ssl_server_credentials(
        [(config.key, config.cert)], root_certificates=config.ca, require_client_auth=True
    )


def peer_role(context) -> str | None:
    """The role named by the calling peer's verified certificate; None over plaintext."""
    pems = context.auth_context().get("x509_pem_cert")
    if not pems:
        return None
    return role_of(x509.load_pem_x509_certificate(pems[0]))


def unavailable_hint() -> str:
    """Why a peer may be UNAVAILABLE besides being down: a TLS mismatch fails the handshake
    at once (typed UNAVAILABLE, never a hang) and grpc's own message does not say so."""
    try:
        config = from_env()
    except TlsError:
        config = None
    if config is None:
        return "down, or it requires TLS and this process runs plaintext (no --tls-cert)"
    return (f"down, or a TLS mismatch: this process uses TLS (--tls-cert {config.cert_path}, "
            f"a {config.role} certificate) and the peer runs plaintext or trusts another CA")
