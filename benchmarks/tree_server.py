"""`appliance serve` started from a checkout of this repository (a worktrees.py tree) on a
free port, for the benchmarks that compare two commits' servers."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(tree: Path, env: dict[str, str]) -> tuple[subprocess.Popen, str]:
    """`appliance serve` from `tree` with `env` over this environment, once its /health
    says 200: the process and its URL. Raises RuntimeError if it exits first."""
    port = free_port()
    full = {**os.environ, **env, "PYTHONPATH": str(tree), "APPLIANCE_PORT": str(port)}
    command = [sys.executable, "-m", "appliance.cli", "serve"]
    process = subprocess.Popen(
        command, cwd=tree, env=full, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    url = f"http://127.0.0.1:{port}"
    while True:
        if process.poll() is not None:
            raise RuntimeError(f"appliance serve from {tree} exited with {process.returncode}")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return process, url
        except httpx.TransportError:
            pass
        time.sleep(0.02)
