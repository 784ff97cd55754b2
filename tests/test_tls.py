"""Bad TLS input: each a one-line error naming the flag and file, never a wedge.

Unit checks of libs.rpc.tls.load, then real processes: a service given another role's
certificate, and clients against a bootstrap of the other kind (TLS vs plaintext)."""

from __future__ import annotations

import datetime
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from cryptography.hazmat.primitives.serialization import Encoding

from libs.rpc import tls
from pdmesh.certs import issue, new_authority, role_env, write_set
from pdmesh.localmesh import free_port

NOW = datetime.datetime.now(datetime.UTC)


@pytest.fixture(scope="module")
def certs(tmp_path_factory) -> Path:
    return write_set(tmp_path_factory.mktemp("certs"))


def _write(directory: Path, name: str, cert: bytes, key: bytes) -> tuple[str, str]:
    (directory / f"{name}.pem").write_bytes(cert)
    (directory / f"{name}.key").write_bytes(key)
    return str(directory / f"{name}.pem"), str(directory / f"{name}.key")


def _other_ca(tmp_path: Path, **dates):
    """A decode certificate with the dates asked, of a new CA (a set's CA key is not kept);
    returns ((cert, key), that CA's file)."""
    other = new_authority()
    (tmp_path / "other-ca.pem").write_bytes(other.cert.public_bytes(Encoding.PEM))
    cert, key = issue(other, "decode", ["127.0.0.1"], **dates)
    return _write(tmp_path, "decode", cert, key), str(tmp_path / "other-ca.pem")


def test_a_good_set_loads_with_its_role(certs):
    for role in tls.ROLES:
        config = tls.from_env(role_env(certs, role))
        assert config is not None and config.role == role
    assert tls.from_env({}) is None


@pytest.mark.parametrize("dates, words", [
    ({"not_before": NOW - datetime.timedelta(days=3),
      "not_after": NOW - datetime.timedelta(days=1)}, "expired"),
    ({"not_before": NOW + datetime.timedelta(days=1),
      "not_after": NOW + datetime.timedelta(days=3)}, "not valid before"),
])
def test_out_of_date_certificates_are_refused(tmp_path, certs, dates, words):
    (cert, key), ca = _other_ca(tmp_path, **dates)
    with pytest.raises(tls.TlsError) as e:
        tls.load(cert, key, ca)
    assert words in str(e.value) and "--tls-cert" in str(e.value) and cert in str(e.value)


def test_a_certificate_of_another_ca_is_refused(tmp_path, certs):
    (cert, key), _ = _other_ca(tmp_path)
    with pytest.raises(tls.TlsError) as e:
        tls.load(cert, key, str(certs / "ca.pem"))
    assert "not signed by the CA" in str(e.value) and "--tls-ca" in str(e.value)


def test_missing_files_and_a_mismatched_key_are_refused(certs, tmp_path):
    env = role_env(certs, "decode")
    with pytest.raises(tls.TlsError) as e:
        tls.load(env[tls.CERT_ENV], str(tmp_path / "nope.key"), env[tls.CA_ENV])
    assert "--tls-key" in str(e.value) and "nope.key" in str(e.value)
    with pytest.raises(tls.TlsError) as e:
        tls.load(env[tls.CERT_ENV], str(certs / "prefill.key"), env[tls.CA_ENV])
    assert "does not match" in str(e.value)
    with pytest.raises(tls.TlsError) as e:
        tls.from_env({tls.CERT_ENV: env[tls.CERT_ENV]})
    assert "--tls-key, --tls-ca missing" in str(e.value)


def _cli(*args: str, env: dict[str, str] | None = None, timeout: float = 30):
    full = {k: v for k, v in os.environ.items() if not k.startswith("PDMESH_TLS_")}
    full.update(env or {})
    return subprocess.run([sys.executable, "-m", "pdmesh.cli", *args], capture_output=True,
                          text=True, timeout=timeout, env=full)


def _flags(certs: Path, role: str) -> list[str]:
    return ["--tls-cert", str(certs / f"{role}.pem"), "--tls-key", str(certs / f"{role}.key"),
            "--tls-ca", str(certs / "ca.pem")]


def test_a_service_with_another_roles_certificate_refuses_to_start(certs):
    out = _cli("decode", "--model", "tiny", *_flags(certs, "prefill"))
    assert out.returncode == 2
    line = out.stderr.strip().splitlines()[-1]
    assert "prefill.pem" in line and "--tls-cert" in line and "needs a decode certificate" in line


def test_a_missing_key_file_is_one_line(certs, tmp_path):
    flags = _flags(certs, "client")
    flags[3] = str(tmp_path / "gone.key")
    out = _cli("status", "--bootstrap", "127.0.0.1:1", *flags)
    assert out.returncode == 2
    assert out.stderr.strip().count("\n") == 0 and "gone.key" in out.stderr, out.stderr


def _bootstrap(*flags: str) -> tuple[subprocess.Popen, str]:
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("PDMESH_TLS_")}
    process = subprocess.Popen([sys.executable, "-m", "pdmesh.cli", "bootstrap", "--port",
                                str(port), *flags], env=env, stdout=subprocess.DEVNULL,
                               stderr=subprocess.DEVNULL)
    address = f"127.0.0.1:{port}"
    return process, address


@pytest.mark.parametrize("server_tls, client_tls, words", [
    (False, True, "this process uses TLS (--tls-cert "),
    (True, False, "requires TLS and this process runs plaintext (no --tls-cert)"),
])
def test_tls_and_plaintext_refuse_each_other_in_one_line(certs, server_tls, client_tls, words):
    process, address = _bootstrap(*(_flags(certs, "bootstrap") if server_tls else []))
    try:
        good = _flags(certs, "client") if server_tls else []
        deadline = time.monotonic() + 30
        while _cli("status", "--bootstrap", address, *good).returncode != 0:
            assert time.monotonic() < deadline, "bootstrap did not start"
            time.sleep(0.3)
        started = time.monotonic()
        out = _cli("status", "--bootstrap", address,
                   *(_flags(certs, "client") if client_tls else []))
        assert time.monotonic() - started < 10  # refused, not wedged
        assert out.returncode == 1
        line = out.stderr.strip().splitlines()[-1]
        assert "UNAVAILABLE" in line and words in line, out.stderr
    finally:
        process.terminate()
        process.wait(10)


def test_up_with_a_certs_dir_lacking_a_role_is_one_line_before_anything_starts(certs, tmp_path):
    partial = tmp_path / "partial"
    partial.mkdir()
    for name in ("ca.pem", "bootstrap.pem", "bootstrap.key"):
        (partial / name).write_bytes((certs / name).read_bytes())
    out = _cli("up", "--model", "tiny", "--certs", str(partial))
    assert out.returncode == 2
    assert out.stderr.strip() == (f"pdmesh up: --certs {partial}: {partial}/prefill.pem: "
                                  "No such file or directory")
