"""--host / --advertise-address / --ucx-*: what a service binds, advertises and moves KV
over, and the one-line refusals when an address cannot work."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys

import pytest

from libs.member import ucx
from libs.rpc import addresses, tls
from pdmesh.certs import issue, new_authority, role_env, write_set


def _args(host: str, advertise: str | None = None) -> argparse.Namespace:
    return argparse.Namespace(host=host, advertise_address=advertise)


def test_a_wildcard_bind_needs_an_advertised_address(monkeypatch):
    for name in (tls.CERT_ENV, tls.KEY_ENV, tls.CA_ENV):
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(SystemExit) as e:
        addresses.advertised_host(_args("0.0.0.0"), "decode")
    assert "--host 0.0.0.0" in str(e.value) and "--advertise-address" in str(e.value)
    assert addresses.advertised_host(_args("0.0.0.0", "10.0.0.7"), "decode") == "10.0.0.7"
    assert addresses.advertised_host(_args("10.0.0.8"), "decode") == "10.0.0.8"


def test_join_brackets_ipv6_only():
    assert addresses.join("::1", 5) == "[::1]:5"
    assert addresses.join("10.0.0.1", 5) == "10.0.0.1:5"
    assert addresses.join("decode-0.mesh", 5) == "decode-0.mesh:5"


def test_a_certificate_must_name_the_advertised_host(tmp_path):
    ca = new_authority()
    cert, key = issue(ca, "decode", ["decode-0.mesh", "10.1.2.3"])
    (tmp_path / "decode.pem").write_bytes(cert)
    config = tls.TlsConfig(cert_path=str(tmp_path / "decode.pem"), cert=cert, key=key, ca=b"",
                           role="decode")
    tls.require_name(config, "10.1.2.3")
    tls.require_name(config, "DECODE-0.mesh")
    with pytest.raises(tls.TlsError) as e:
        tls.require_name(config, "10.9.9.9")
    line = str(e.value)
    assert "decode.pem" in line and "does not name 10.9.9.9" in line and "--host 10.9.9.9" in line


def test_ucx_flags_set_the_environment_ucx_reads():
    env = {"UCX_TLS": "rc"}
    ucx.apply(argparse.Namespace(ucx_transports=None, ucx_net_devices=None), env)
    assert env == {"UCX_TLS": "rc"}  # nothing given: the environment passes through
    ucx.apply(argparse.Namespace(ucx_transports="tcp", ucx_net_devices="eth1"), env)
    assert env == {"UCX_TLS": "tcp", "UCX_NET_DEVICES": "eth1"}


def _cli(*args: str, env: dict[str, str] | None = None):
    full = {k: v for k, v in os.environ.items() if not k.startswith("PDMESH_TLS_")}
    full.update(env or {})
    return subprocess.run([sys.executable, "-m", "pdmesh.cli", *args], capture_output=True,
                          text=True, timeout=60, env=full)


@pytest.mark.parametrize("command", ["bootstrap", "router", "decode"])
def test_services_refuse_an_address_no_peer_can_dial_in_one_line(command):
    out = _cli(command, "--host", "0.0.0.0", "--model", "tiny") if command != "bootstrap" \
        else _cli(command, "--host", "0.0.0.0")
    assert out.returncode != 0
    assert "Traceback" not in out.stderr  # one line (after the TLS-off warning), no trace
    line = out.stderr.strip().splitlines()[-1]
    assert line.startswith(f"pdmesh {command}: --host 0.0.0.0 binds every"), out.stderr


def test_a_service_whose_certificate_does_not_name_its_address_refuses_to_start(tmp_path):
    certs = write_set(tmp_path / "certs")  # names localhost, 127.0.0.1, ::1, this hostname
    out = _cli("bootstrap", "--host", "0.0.0.0", "--advertise-address", "10.200.0.9",
               "--port", "0", env=role_env(certs, "bootstrap"))
    assert out.returncode != 0
    assert "Traceback" not in out.stderr
    line = out.stderr.strip().splitlines()[-1]
    assert line.startswith("pdmesh bootstrap: --advertise-address 10.200.0.9: ")
    assert "bootstrap.pem" in line and "does not name 10.200.0.9" in line, out.stderr


def test_a_ucx_transport_this_host_lacks_is_one_line_and_exit_2():
    out = _cli("decode", "--model", "tiny", "--ucx-transports", "nosuch", "--bootstrap",
               "127.0.0.1:1")
    assert out.returncode == 2  # the supervisor stops the mesh rather than restart it
    assert "Traceback" not in out.stderr
    line = out.stderr.strip().splitlines()[-1]
    assert line == ("pdmesh decode: --ucx-transports/--ucx-net-devices: the UCX backend did "
                    "not start with UCX_TLS=nosuch (nixlBackendError)"), out.stderr


def test_up_on_every_interface_advertises_loopback_to_its_children():
    from pdmesh.supervisor import Plan

    plan = Plan(host="0.0.0.0", bootstrap_port=7000)
    assert plan.bootstrap == "127.0.0.1:7000"
    for child in plan.children():
        args = child.argv
        assert args[args.index("--host") + 1] == "0.0.0.0"
        assert args[args.index("--advertise-address") + 1] == "127.0.0.1", args
    named = Plan(host="0.0.0.0", advertise_address="10.1.1.1").children()
    assert all("10.1.1.1" in c.argv for c in named)
    assert "--advertise-address" not in Plan().children()[0].argv  # the default is unchanged
