"""An agent whose worker process cannot start (no fork, no memory, no file descriptors)
says so and stays: the head hears the worker exited (and restarts or gives it up as for
any exit), the agent logs why, and its link to the head goes on. Before, the OSError of
the start was caught as the link's end: the agent logged "the link to the head ended" and
stopped, taking the whole box down and hiding the cause."""

from __future__ import annotations

import errno
import logging
from collections.abc import Callable
from typing import Any

import pytest

from appliance.cluster.agent import SPAWN_FAILED, Agent
from appliance.cluster.messages import SpawnWorker, WorkerExited
from appliance.settings.config import load_settings


class NoProcesses:
    """A multiprocessing context whose processes fail to start, as a fork does at the
    process limit (EAGAIN)."""

    def Process(self, target: Callable[..., Any], args: tuple, daemon: bool) -> Any:
        class Unstartable:
            pid = None

            def start(self) -> None:
                raise OSError(errno.EAGAIN, "Resource temporarily unavailable")

        return Unstartable()


class HeadEnd:
    """The head's end of the link as the agent sees it: one SpawnWorker, then the link ends
    (after the agent has had a look for exits); what the agent sends is kept."""

    def __init__(self, message: SpawnWorker) -> None:
        self.incoming: list[object] = [message]
        self.sent: list[object] = []

    def poll(self, timeout: float) -> bool:
        return True

    def recv(self) -> object:
        if not self.incoming:
            raise EOFError("the head closed the link")
        return self.incoming.pop()

    def send(self, message: object) -> None:
        self.sent.append(message)


def test_a_worker_that_cannot_start_is_reported_exited_and_the_agent_stays(
    caplog: pytest.LogCaptureFixture,
) -> None:
    settings = load_settings()
    agent = Agent.__new__(Agent)  # its __init__ needs NIXL and a secret file: not the point
    agent.settings, agent.secret, agent.workers = settings, "secret", {}
    agent._ctx = NoProcesses()  # type: ignore[assignment]
    agent._interface = "lo"
    head = HeadEnd(SpawnWorker(5, "decode", settings, ()))
    agent._head = head  # type: ignore[assignment]
    with caplog.at_level(logging.INFO, logger="appliance.agent"):
        agent.serve()  # returns when the link ends, after the SpawnWorker
    assert head.sent == [WorkerExited(5, SPAWN_FAILED)]
    said = [r.getMessage() for r in caplog.records]
    assert any(
        "could not start worker 5 (decode)" in m and "temporarily unavailable" in m for m in said
    ), said
    assert said[-1] == "the link to the head ended (the head closed the link): stopping", said
    assert agent.workers == {}
