"""A member's stop closes its NIXL agent and fails on transfer handles nobody released
(libs.member.serve.close_agent); the agent's own count is tested with real NIXL in
tests/transfer/test_nixl_two_process.py."""

import pytest

from libs.member.serve import close_agent


class Agent:
    def __init__(self, leaked: int) -> None:
        self.leaked = leaked
        self.closed = 0

    def close(self) -> int:
        self.closed += 1
        return self.leaked


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
