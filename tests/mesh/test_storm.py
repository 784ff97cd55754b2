"""`pdmesh storm` against a real mesh, one small storm per mode: each must PASS, and its
JSON must show that the faults really happened (cancels, kills, restarts)."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

from pdmesh.localmesh import start_mesh
from pdmesh.storm import MODES, add_arguments
from pdmesh.storm.agentic import Conversation, Plan, compare

ENV_EXTRA = {"OMP_WAIT_POLICY": "PASSIVE"}


def storm(mesh, out, *flags: str, timeout: float = 300) -> dict:
    """Run `pdmesh storm` against `mesh`; assert PASS; return its JSON."""
    run = subprocess.run(
        [sys.executable, "-m", "pdmesh.cli", "storm", "--router", mesh.router,
         "--bootstrap", mesh.bootstrap, "--out", str(out), *flags],
        capture_output=True, text=True, timeout=timeout, env={**mesh.env(), **ENV_EXTRA},
    )
    # On a FAIL the storm's stdout ends with its evidence (who is busy, where requests wait);
    # the mesh log's tail says what the services logged meanwhile.
    assert run.returncode == 0, (run.stdout[-6000:] + run.stderr[-3000:]
                                 + "\nmesh log tail:\n" + mesh.log()[-6000:])
    assert "verdict: PASS" in run.stdout
    result = json.loads(out.read_text())
    assert result["ok"] and all(c["ok"] for c in result["checks"])
    assert result["timeline"] and "aborts_by_reason" in result["timeline"][-1]
    return result


def test_help_explains_every_mode_and_flag():
    parser = argparse.ArgumentParser(prog="pdmesh storm")
    add_arguments(parser)
    text = parser.format_help()
    for mode in MODES:
        assert f"\n  {mode} " in text
    for action in parser._actions:
        assert action.help, action.option_strings


def test_agentic_compare_names_the_first_differing_round():
    plan = Plan(0, ["a", "b", "c"], [0.1, 0.1, 0.1])
    same = Conversation([[1, 2], [3], [4]])
    assert compare(plan, same, Conversation([[1, 2], [3], [4]])) == {"session": 0, "ok": True}
    bad = compare(plan, same, Conversation([[1, 2], [5], [6]]))
    assert bad["corrupt_round"] == 1 and bad["storm"] == [3] and bad["replay"] == [5]
    assert "failed" in compare(plan, same, Conversation([[1, 2]], error="UNAVAILABLE"))


def test_small_abort_storm_passes(tiny_mesh, tmp_path):
    result = storm(tiny_mesh, tmp_path / "storm.json", "--mode", "abort", "--waves", "3",
                   "--concurrency", "12", "--prompt-words", "200")
    assert len(result["quiesce_s"]) == 3 and max(result["quiesce_s"]) <= 1.0
    cancelled = sum(v for k, v in result["outcomes"].items() if k.startswith("cancelled"))
    assert cancelled >= 30  # the storm really aborted requests mid-flight


def test_small_agentic_storm_has_no_corrupt_session(tiny_mesh, tmp_path):
    result = storm(tiny_mesh, tmp_path / "agentic.json", "--mode", "agentic",
                   "--sessions", "6", "--rounds", "2")
    assert result["corrupt"] == 0 and result["failed"] == 0
    assert [v.get("ok") for v in result["verdicts"]] == [True] * 6
    assert result["outcomes"]["completed"] == 6 * 2  # every round's real request
    assert result["cancels"] >= 6  # most of the 12 pre-round requests were cut mid-flight
    assert result["tokens_compared"] >= 6 * 2  # replies were compared, not empty lists


def test_small_cascade_storm_quiesces_and_stays_alive(tiny_mesh, tmp_path):
    result = storm(tiny_mesh, tmp_path / "cascade.json", "--mode", "cascade",
                   "--sessions", "8", "--kill-after", "3", "--cycles", "1")
    (cycle,) = result["cycles"]
    assert cycle["client"]["inflight"] >= 1 and cycle["mesh_at_kill"]["kv_pages_used"] > 0
    assert cycle["aborts_by_reason"].get("client_disconnect", 0) >= 1  # the kill aborted them
    assert cycle["quiet_s"] is not None and cycle["quiet_s"] <= 5.0
    assert [c["ok"] for c in result["liveness"]] == [True] * 3
    assert all(c["tokens"] >= 1 for c in result["liveness"])


def test_restart_storm_kills_and_recovers_one_role(tmp_path):
    target = "decode"
    mesh = start_mesh(tmp_path, model="tiny", extra_env={"OMP_WAIT_POLICY": "PASSIVE"})
    try:
        result = storm(mesh, tmp_path / "restart.json", "--mode", "restart",
                       "--target", target, "--restarts", "2", "--concurrency", "4",
                       "--interval", "1", "--settle", "4")
        log = mesh.log()
    finally:
        mesh.stop()
    kills = result["kills"]
    assert len(kills) == 2 and all(k["back_s"] is not None for k in kills)
    epochs = [kills[0]["epoch"]] + [k["new_epoch"] for k in kills]
    assert len(set(epochs)) == 3 and kills[1]["epoch"] == kills[0]["new_epoch"]
    assert kills[0]["new_pid"] != kills[0]["pid"] and kills[1]["pid"] == kills[0]["new_pid"]
    assert f"{target}-0 exited" in log and "restart #2" in log
    assert all(k["inflight_at_kill"] >= 1 for k in kills)  # the load was on at each kill
    assert all(s <= 3.0 for k in kills for s in k["kill_to_fail_s"])
    assert result["settle"]["requests"] > 0
    assert set(result["settle"]["outcomes"]) == {"completed"}
    assert result["survivors_start"] == result["survivors_end"]  # the other role stayed up
    # Writes that met a killed peer must not wreck the survivors' own shutdown (UCX can
    # abort a process at exit after a remote disconnect; see libs/transfer/agent.py).
    assert "all services stopped" in mesh.log()
    assert "stopped with exit code" not in mesh.log()


async def test_busy_evidence_names_the_holder_and_where_its_handlers_wait(tiny_mesh):
    """What a failed quiescence check prints: the member still holding a request, and the
    stacks of the request's handlers on the router and on that member."""
    import anyio

    from pdmesh.client import GenerateClient
    from pdmesh.status import collect
    from pdmesh.storm.evidence import busy_evidence, render

    streaming = anyio.Event()
    async with GenerateClient(tiny_mesh.router, timeout=60) as client:
        async with anyio.create_task_group() as tg:
            async def one_long_request() -> None:
                async for _ in client.generate(prompt="river engine", max_tokens=2000,
                                               temperature=0, ignore_eos=True):
                    streaming.set()  # tokens arrive: the decode is past its KV wait
                    await anyio.sleep(0.05)  # a slow reader: the request stays in decode

            tg.start_soon(one_long_request)
            with anyio.fail_after(30):
                await streaming.wait()
                while not any(m["role"] == "decode" and m["inflight"]
                              for m in (await collect(tiny_mesh.bootstrap))["members"]):
                    await anyio.sleep(0.05)
            evidence = await busy_evidence(tiny_mesh.bootstrap)
            tg.cancel_scope.cancel()
    decode = [m for m in evidence["members"] if m["role"] == "decode"]
    assert decode and decode[0]["inflight"] == 1 and decode[0]["kv_pages_used"] > 0
    name = decode[0]["name"]
    (decode_stack,) = evidence["stacks"][name]
    assert "in Generate" in decode_stack and "in _stream" in decode_stack  # streaming tokens
    router = "\n".join(evidence["stacks"]["router"])
    assert "router/grpc_api.py" in router and "in Generate" in router
    assert "router/core.py" in router and "in _attempt" in router  # the attempt, in reach
    text = render(evidence)
    assert f"decode {name}: inflight 1" in text and f"{name}: 1 request chain(s)" in text
