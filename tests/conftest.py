"""Suite-wide settings; see pdmesh/cli.py for why OpenMP must not busy-wait here."""

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import pytest  # noqa: E402  (after the environment above, which must precede torch)


@pytest.fixture(autouse=True)
def _environment_restored():
    """Every test leaves os.environ as it found it: in-process CLI calls move flags such
    as --tls-cert into the environment, which would turn later tests' clients to TLS."""
    saved = dict(os.environ)
    yield
    if os.environ != saved:
        os.environ.clear()
        os.environ.update(saved)


@pytest.fixture(scope="session")
def smollm2():
    """The real SmolLM2 loaded once per session (~11 s of CPU a load on a 2-core host);
    the engine and mesh tests only read its weights."""
    from libs.engine.loader import load_model

    return load_model("smollm2")


@pytest.fixture(scope="session")
def hf_reference():
    """transformers' reference model loaded once per session (~37 s of CPU a load: its
    GGUF reader parses the file twice); tests only run it under no_grad."""
    from libs.engine.hf_reference import load_hf_reference

    return load_hf_reference()


@pytest.fixture(scope="session")
def etcd_installed():
    """Skips the test where Debian's etcd-server is not installed (`.ci/run` installs it)."""
    from pdmesh.etcdmesh import etcd_binary

    if etcd_binary() is None:
        pytest.skip("etcd not installed (Debian: apt-get install etcd-server; .ci/run does)")


@pytest.fixture(scope="module")
def etcd_server(tmp_path_factory, etcd_installed):
    """A real etcd on loopback, free ports, its data in a temp dir."""
    from pdmesh.etcdmesh import EtcdServer

    server = EtcdServer(tmp_path_factory.mktemp("etcd"))
    server.start()
    yield server
    server.stop()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """A failed test that ran against a mesh gets the end of that mesh's log in its report:
    a member that crashed or restarted (its traceback, the supervisor's restart line) is
    often the whole story, and a CI run keeps nothing else."""
    outcome = yield
    report = outcome.get_result()
    if not report.failed:
        return
    from pdmesh.localmesh import Mesh

    for name, value in getattr(item, "funcargs", {}).items():
        if isinstance(value, Mesh) and value.log_path.exists():
            tail = value.log().splitlines()[-MESH_LOG_LINES:]
            report.sections.append((f"{name}: the last {len(tail)} lines of {value.log_path}",
                                    "\n".join(tail)))


MESH_LOG_LINES = 80
