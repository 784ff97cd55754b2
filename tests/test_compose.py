"""docker-compose.yml: services on a compose network (no host networking), published
ports, health checks wired to grpc.health.v1 and the router's /health, certificates
mounted, Jaeger beside them, a CPU and a GPU profile. The wiring is checked from the
YAML; `docker compose config` validates the file where the tool exists."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

yaml = pytest.importorskip("yaml")

ROOT = Path(__file__).resolve().parents[1]
COMPOSE = ROOT / "docker-compose.yml"
ROLE = {"bootstrap": "bootstrap", "router": "router", "prefill-cpu": "prefill",
        "decode-cpu": "decode", "prefill-gpu": "prefill", "decode-gpu": "decode"}


@pytest.fixture(scope="module")
def services() -> dict:
    return yaml.safe_load(COMPOSE.read_text())["services"]


def _flag(command: list[str], name: str) -> str:
    return command[command.index(name) + 1]


def test_no_host_networking_and_every_service_on_the_compose_network(services):
    assert "network_mode" not in COMPOSE.read_text()
    for name, service in services.items():
        networks = service["networks"]
        assert "pdmesh" in networks, name
        assert "ipc" not in service, name


def test_services_bind_everything_advertise_their_name_and_publish_their_ports(services):
    for name, role in ROLE.items():
        command = services[name]["command"]
        assert command[0] == role
        assert _flag(command, "--host") == "0.0.0.0"
        advertised = _flag(command, "--advertise-address")
        aliases = (services[name]["networks"].get("pdmesh") or {}).get("aliases", []) \
            if isinstance(services[name]["networks"], dict) else []
        default = advertised.removeprefix("${").split(":-")[-1].rstrip("}")
        assert default in (name, *aliases), (name, advertised)  # reachable on the network
        published = {p.split(":")[1] for p in services[name]["ports"]}
        ports = [_flag(command, f) for f in ("--port", "--grpc-port", "--http-port",
                                             "--metrics-port") if f in command]
        assert set(ports) <= published, (name, ports, published)
        if role != "bootstrap":
            assert _flag(command, "--bootstrap").endswith("bootstrap:50050}")


def test_health_checks_ask_grpc_health_and_the_routers_health_endpoint(services):
    for name, role in ROLE.items():
        test = services[name]["healthcheck"]["test"]
        assert test[:4] == ["CMD", "python", "-m", "pdmesh.healthcheck"], name
        command = services[name]["command"]
        if role == "router":
            assert test[4:] == ["http", f"http://127.0.0.1:{_flag(command, '--http-port')}"
                                "/health"]
        else:
            assert test[4:] == ["grpc", f"127.0.0.1:{_flag(command, '--port')}"]
    for name in ("router", "prefill-cpu", "decode-cpu", "prefill-gpu", "decode-gpu"):
        assert services[name]["depends_on"]["bootstrap"]["condition"] == "service_healthy"


def test_certificates_are_mounted_and_each_service_has_its_roles(services):
    for name, role in ROLE.items():
        service = services[name]
        assert "./certs:/certs:ro" in service["volumes"], name
        env = service["environment"]
        assert env["PDMESH_TLS_CERT"] == f"/certs/{role}.pem"
        assert env["PDMESH_TLS_KEY"] == f"/certs/{role}.key"
        assert env["PDMESH_TLS_CA"] == "/certs/ca.pem"
        assert env["OTEL_EXPORTER_OTLP_ENDPOINT"] == "http://jaeger:4317"
    assert services["jaeger"]["environment"]["COLLECTOR_OTLP_ENABLED"] == "true"
    assert "4317:4317" in services["jaeger"]["ports"]


def test_cpu_and_gpu_profiles(services):
    for role in ("prefill", "decode"):
        cpu, gpu = services[f"{role}-cpu"], services[f"{role}-gpu"]
        assert cpu["profiles"] == ["cpu"] and gpu["profiles"] == ["gpu"]
        assert "deploy" not in cpu and "--device" not in cpu["command"]
        assert _flag(gpu["command"], "--device") == "cuda"
        devices = gpu["deploy"]["resources"]["reservations"]["devices"]
        assert devices == [{"driver": "nvidia", "count": 1, "capabilities": ["gpu"]}]
        assert _flag(cpu["command"], "--ucx-transports") == "tcp"
    for always in ("bootstrap", "router", "jaeger"):
        assert "profiles" not in services[always]


def _compose_tool() -> list[str] | None:
    if shutil.which("docker") and subprocess.run(
            ["docker", "compose", "version"], capture_output=True).returncode == 0:
        return ["docker", "compose"]
    if shutil.which("docker-compose"):
        return ["docker-compose"]
    return None


@pytest.mark.skipif(_compose_tool() is None,
                    reason="neither `docker compose` nor `docker-compose` is installed "
                    "(Debian: apt-get install docker-compose); the YAML tests above check "
                    "the wiring")
@pytest.mark.parametrize("profile", ["cpu", "gpu"])
def test_docker_compose_config_validates(profile):
    tool = _compose_tool()
    out = subprocess.run([*tool, "-f", str(COMPOSE), "--profile", profile, "config"],
                         capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    resolved = yaml.safe_load(out.stdout)["services"]
    assert {f"prefill-{profile}", f"decode-{profile}", "bootstrap", "router",
            "jaeger"} <= set(resolved)
