"""A real `appliance serve` process on a free loopback port, for the server tests."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from appliance.bench.compare import free_port

API_KEY = "test-key"


def wait_until(check: Callable[[], Any], bound_s: float, what: str, every_s: float = 0.2) -> Any:
    """Poll `check` until it returns something true, and return that; TimeoutError naming
    `what` once `bound_s` has passed."""
    deadline = time.monotonic() + bound_s
    while not (value := check()):
        if time.monotonic() > deadline:
            raise TimeoutError(f"not within {bound_s:.0f} s: {what}")
        time.sleep(every_s)
    return value


@dataclass
class ServerProcess:
    """`appliance serve` with the given APPLIANCE_* settings; records /health while starting."""

    env: dict[str, str]
    port: int = field(default_factory=free_port)
    process: subprocess.Popen | None = None
    health_seen: list[tuple[int, dict]] = field(default_factory=list)
    admin_token_file: Path | None = None  # where its admin token is, when a test set it

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout: float = 180.0) -> None:
        env = {**os.environ, **self.env, "APPLIANCE_PORT": str(self.port)}
        self.process = subprocess.Popen(
            [sys.executable, "-m", "appliance.cli", "serve"],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"appliance serve exited:\n{self.process.stdout.read()}")
            try:
                reply = httpx.get(self.url + "/health", timeout=2)
            except httpx.TransportError:
                time.sleep(0.1)
                continue
            self.health_seen.append((reply.status_code, reply.json()))
            if reply.status_code == 200:
                return
            time.sleep(0.1)
        self.stop()
        raise RuntimeError("appliance serve did not become healthy in time")

    def stop(self, timeout: float = 30.0, sig: int = signal.SIGINT) -> int:
        """SIGINT, as Ctrl-C would (or `sig`); returns the exit code."""
        if self.process.poll() is None:
            self.process.send_signal(sig)
        try:
            return self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            self.process.kill()
            return self.process.wait()
