"""The workers' fork server (appliance/workers/fork_server.py) starts with its context:
it imports the worker while its caller goes on, holds Ctrl-C for its forks, and leaves
with its caller."""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

import psutil
import pytest
from server_process import fork_servers, maps_torch, wait_until

pytestmark = pytest.mark.process  # the slow lane (conftest.py): processes

CALLER = """
from appliance.workers.fork_server import worker_context
worker_context()
print("context made", flush=True)
input()
"""


def _blocks_ctrl_c(process: psutil.Process) -> bool:
    """Whether SIGINT is in the process's blocked mask (/proc's SigBlk, a hex bit set)."""
    status = Path(f"/proc/{process.pid}/status").read_text()
    blocked = int(status.split("SigBlk:")[1].split()[0], 16)
    return bool(blocked & (1 << (signal.SIGINT - 1)))


def test_the_server_starts_with_the_context_and_leaves_with_its_caller() -> None:
    caller = subprocess.Popen(
        [sys.executable, "-c", CALLER], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        assert caller.stdout is not None and caller.stdout.readline() == "context made\n"
        # Before any worker is asked for, the server runs and imports the worker (torch).
        [server] = fork_servers(caller.pid)
        wait_until(lambda: maps_torch(server), 120, "the fork server importing torch")
        assert not server.children()
        # Ctrl-C held from its start, and so in each fork until the worker ignores it (the
        # resource tracker's start had unblocked it: a worker died of a Ctrl-C mid-start).
        assert _blocks_ctrl_c(server)
        assert not _blocks_ctrl_c(psutil.Process(caller.pid))  # the caller's mask as it was
        assert not maps_torch(psutil.Process(caller.pid))
    finally:
        caller.communicate("\n", timeout=60)
    assert caller.returncode == 0
    wait_until(lambda: not server.is_running(), 30, "the fork server leaving with its caller")
