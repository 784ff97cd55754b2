"""deploy/k8s parses and is wired together: every pdmesh container's args parse with the
real CLI, ports and probes agree with those args, Services point at real ports, the
bootstrap stores in the bundled etcd, members find the bootstrap, certificates come from
the Secret with each process's own role."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml

from pdmesh.cli import build_parser
from pdmesh.healthcheck import main as healthcheck_main
from services.bootstrap.etcd_store import parse_store

K8S = Path(__file__).resolve().parent.parent / "deploy" / "k8s"
NAMESPACE = "pdmesh"
ROLES = ("bootstrap", "prefill", "decode", "router")


def documents() -> list[dict]:
    listed = yaml.safe_load((K8S / "kustomization.yaml").read_text())["resources"]
    assert sorted(listed) == sorted(p.name for p in K8S.glob("*.yaml")
                                    if p.name != "kustomization.yaml")
    return [d for name in listed for d in yaml.safe_load_all((K8S / name).read_text()) if d]


def by_kind(kind: str) -> dict[str, dict]:
    return {d["metadata"]["name"]: d for d in documents() if d["kind"] == kind}


def workloads() -> dict[str, dict]:
    return {**by_kind("Deployment"), **by_kind("StatefulSet")}


def container(name: str) -> dict:
    (only,) = workloads()[name]["spec"]["template"]["spec"]["containers"]
    return only


def expand(value: str, env: dict[str, str]) -> str:
    """Kubernetes' $(VAR) substitution in args, with stand-in values."""
    return re.sub(r"\$\((\w+)\)", lambda m: env[m.group(1)], value)


STAND_IN = {"POD_NAME": "pod-0", "POD_IP": "10.0.0.7"}


def parsed(role: str):
    c = container(role)
    env_names = {e["name"] for e in c.get("env", [])}
    for var in re.findall(r"\$\((\w+)\)", " ".join(c["args"])):
        assert var in env_names, f"{role}: $({var}) is not defined in env"
    args = [expand(a, STAND_IN) for a in c["args"]]
    assert args[0] == role
    return build_parser().parse_args(args)  # SystemExit here: a flag the CLI lacks


def ports(role: str) -> dict[str, int]:
    return {p["name"]: p["containerPort"] for p in container(role)["ports"]}


def test_every_object_is_in_the_namespace_and_every_role_runs():
    for d in documents():
        if d["kind"] != "Namespace":
            assert d["metadata"]["namespace"] == NAMESPACE, d["metadata"]["name"]
    assert set(ROLES) <= set(workloads())
    assert workloads()["bootstrap"]["spec"]["replicas"] >= 2  # no single point of failure
    assert workloads()["router"]["spec"]["replicas"] >= 2


@pytest.mark.parametrize("role", ROLES)
def test_args_parse_and_ports_match_them(role):
    args = parsed(role)
    own = ports(role)
    if role == "router":
        assert own == {"http": args.http_port, "grpc": args.grpc_port}
    else:
        assert own["grpc"] == args.port and own["metrics"] == args.metrics_port


@pytest.mark.parametrize("role", ROLES)
def test_tls_comes_from_the_secret_with_the_roles_own_certificate(role):
    c = container(role)
    env = {e["name"]: e.get("value") for e in c["env"]}
    mounts = {m["name"]: m["mountPath"] for m in c["volumeMounts"]}
    volumes = {v["name"]: v for v in workloads()[role]["spec"]["template"]["spec"]["volumes"]}
    assert volumes["certs"]["secret"]["secretName"] == "pdmesh-certs"
    assert env["PDMESH_TLS_CERT"] == f"{mounts['certs']}/{role}.pem"
    assert env["PDMESH_TLS_KEY"] == f"{mounts['certs']}/{role}.key"
    assert env["PDMESH_TLS_CA"] == f"{mounts['certs']}/ca.pem"


def service_port(service: str, name: str) -> tuple[str, int, int]:
    s = by_kind("Service")[service]
    port = next(p for p in s["spec"]["ports"] if p["name"] == name)
    return s, port["port"], port["targetPort"]


def test_services_select_their_pods_and_target_real_ports():
    for name, s in by_kind("Service").items():
        labels = workloads()[name]["spec"]["template"]["metadata"]["labels"]
        assert s["spec"]["selector"].items() <= labels.items()
        own = {p["name"]: p["containerPort"] for p in container(name)["ports"]}
        for p in s["spec"]["ports"]:
            assert own[p["name"]] == p["targetPort"], (name, p)


def test_the_bootstrap_stores_in_the_etcd_service_and_members_find_the_bootstrap():
    target = parse_store(parsed("bootstrap").store)
    host, port = target.address.rsplit(":", 1)
    _, etcd_port, _ = service_port("etcd", "client")
    assert host == f"etcd.{NAMESPACE}.svc.cluster.local" and int(port) == etcd_port
    _, boot_port, _ = service_port("bootstrap", "grpc")
    for role in ("prefill", "decode", "router"):
        for address in parsed(role).bootstrap.split(","):
            assert address == f"bootstrap.{NAMESPACE}.svc.cluster.local:{boot_port}", role


@pytest.mark.parametrize("role", ("prefill", "decode"))
def test_members_bind_the_stable_name_their_headless_service_publishes(role):
    args = parsed(role)
    service = by_kind("Service")[role]
    assert service["spec"]["clusterIP"] == "None"
    assert service["spec"].get("publishNotReadyAddresses") is True
    assert workloads()[role]["spec"]["serviceName"] == role
    assert args.host == f"{STAND_IN['POD_NAME']}.{role}.{NAMESPACE}.svc.cluster.local"
    assert args.name == STAND_IN["POD_NAME"]


@pytest.mark.parametrize("role", ("bootstrap", "prefill", "decode"))
def test_readiness_is_grpc_health_on_the_served_port(role, monkeypatch, capsys):
    probe = container(role)["readinessProbe"]["exec"]["command"]
    assert probe[:4] == ["python", "-m", "pdmesh.healthcheck", "grpc"]
    monkeypatch.setenv("POD_NAME", STAND_IN["POD_NAME"])
    address = __import__("os").path.expandvars(probe[4])
    args = parsed(role)
    host, port = address.rsplit(":", 1)
    assert int(port) == args.port
    if role != "bootstrap":
        assert host == args.host  # the name the member bound and registered
    # the probe's own flags parse (and it fails, exit 1, against nothing listening)
    monkeypatch.setattr("sys.argv", ["healthcheck"])
    assert healthcheck_main(["grpc", "127.0.0.1:1", "--timeout", "0.2",
                             *probe[5:]]) == 1


def test_router_readiness_is_its_http_health():
    probe = container("router")["readinessProbe"]["httpGet"]
    assert probe["path"] == "/health" and probe["port"] == parsed("router").http_port


async def test_healthcheck_follows_the_servers_grpc_health(monkeypatch):
    from libs.rpc import tls
    from libs.rpc.server import start_server
    from pdmesh.healthcheck import check

    # a plaintext server and probe, whatever a session-wide mesh set for this process's
    # clients (tls.use_for_clients) or left in the environment
    monkeypatch.setattr(tls, "_client_override", None)
    for env in (tls.CERT_ENV, tls.KEY_ENV, tls.CA_ENV):
        monkeypatch.delenv(env, raising=False)

    running = await start_server("127.0.0.1", 0, [])
    try:
        address = f"127.0.0.1:{running.port}"
        await running.set_serving(True)
        assert await check(address, None, 2.0)
        await running.set_serving(False)
        assert not await check(address, None, 2.0)
    finally:
        await running.stop(0)
