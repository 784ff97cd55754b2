"""A member's stop closes its NIXL agent and fails on transfer handles nobody released
(libs.member.serve.close_agent, libs.member.serve.stopping); the agent's own count is
tested with real NIXL in tests/transfer/test_nixl_two_process.py."""

import logging

import anyio
import pytest

from libs.member.serve import close_agent, stopping


class Agent:
    def __init__(self, leaked: int) -> None:
        self.leaked = leaked
        self.closed = 0

    def close(self) -> int:
        self.closed += 1
        return self.leaked


class Server:
    def __init__(self) -> None:
        self.stopped = 0

    async def stop(self, grace: float) -> None:
        self.stopped += 1


def test_clean_close_returns_quietly():
    agent = Agent(0)
    close_agent(agent, "prefill-0")
    assert agent.closed == 1


def test_a_leak_fails_the_stop_naming_the_member():
    agent = Agent(2)
    with pytest.raises(SystemExit) as caught:
        close_agent(agent, "prefill-0")
    assert agent.closed == 1
    assert "prefill-0" in str(caught.value) and "2 unreleased" in str(caught.value)


async def test_a_crash_keeps_its_own_exception_and_logs_the_leak(caplog):
    agent, server = Agent(3), Server()
    with caplog.at_level(logging.ERROR), pytest.raises(RuntimeError, match="boom"):
        async with stopping(server, agent, "decode-1"):
            raise RuntimeError("boom")
    assert server.stopped == 1 and agent.closed == 1
    assert "decode-1: 3 NIXL transfer handles were never released" in caplog.text


async def test_a_cancelled_stop_still_fails_on_a_leak():
    agent, server = Agent(1), Server()
    with pytest.raises(SystemExit, match="decode-1 stopped holding 1 unreleased"):
        with anyio.CancelScope() as scope:
            async with stopping(server, agent, "decode-1"):
                scope.cancel()
                await anyio.sleep(10)
    assert server.stopped == 1 and agent.closed == 1


async def test_a_clean_stop_without_leaks_ends_quietly():
    agent, server = Agent(0), Server()
    async with stopping(server, agent, "prefill-0"):
        pass
    assert server.stopped == 1 and agent.closed == 1
