"""The workers' fork server (appliance/workers/fork_server.py) starts with its context:
it imports the worker while its caller goes on, and leaves with its caller."""

from __future__ import annotations

import subprocess
import sys

import psutil
import pytest
from server_process import fork_servers, wait_until

pytestmark = pytest.mark.process  # the slow lane (conftest.py): processes

CALLER = """
from appliance.workers.fork_server import worker_context
worker_context()
print("context made", flush=True)
input()
"""


def _imported_torch(process: psutil.Process) -> bool:
    return any("libtorch" in m.path for m in process.memory_maps())


def test_the_server_starts_with_the_context_and_leaves_with_its_caller() -> None:
    caller = subprocess.Popen(
        [sys.executable, "-c", CALLER], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        assert caller.stdout is not None and caller.stdout.readline() == "context made\n"
        # Before any worker is asked for, the server runs and imports the worker (torch).
        [server] = fork_servers(caller.pid)
        wait_until(lambda: _imported_torch(server), 120, "the fork server importing torch")
        assert not server.children()
        assert not _imported_torch(psutil.Process(caller.pid))
    finally:
        caller.communicate("\n", timeout=60)
    assert caller.returncode == 0
    wait_until(lambda: not server.is_running(), 30, "the fork server leaving with its caller")
