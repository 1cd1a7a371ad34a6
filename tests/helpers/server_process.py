"""A real `appliance serve` process on a free loopback port, for the server tests."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import psutil

from appliance.bench.compare import free_port

API_KEY = "test-key"
# Settings that name a layout. The server tests were written for the split (1 prefill +
# 1 decode worker): where a test names none, ServerProcess names the split, since the
# default layout is the planner's (colocated on a CPU box without a profile).
LAYOUT_SETTINGS = (
    "APPLIANCE_MODE",
    "APPLIANCE_PREFILL_DEVICES",
    "APPLIANCE_DECODE_DEVICES",
    "APPLIANCE_COLOCATED_DEVICES",
    "APPLIANCE_PLANNER__LAYOUT",
)
OUTPUT_LINES_KEPT = 2000


def fork_servers(pid: int) -> list[psutil.Process]:
    """The fork servers among `pid`'s children: a supervisor's or an agent's, whose
    children are its workers (appliance/workers/fork_server.py)."""
    return [
        child
        for child in psutil.Process(pid).children()
        if any("multiprocessing.forkserver" in part for part in child.cmdline())
    ]


def maps_torch(process: psutil.Process) -> bool:
    """Whether `process` has a torch library mapped (imported torch)."""
    return any("libtorch" in m.path for m in process.memory_maps())


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
    # The command line after `appliance`; a test that gives the port another way (a
    # --config file) sets port_in_env False.
    args: tuple[str, ...] = ("serve",)
    port_in_env: bool = True
    split_unless_named: bool = True  # False: the default layout, or the one a file names
    # A process group of its own (as a shell's job has), for a test that signals the whole
    # group as Ctrl-C in a terminal does, the workers with the server.
    own_group: bool = False
    process: subprocess.Popen | None = None
    health_seen: list[tuple[int, dict]] = field(default_factory=list)
    admin_token_file: Path | None = None  # where its admin token is, when a test set it
    # Its last output lines. A reader thread keeps the pipe drained: a full pipe would
    # block the server at its next log line (an access log line per request).
    output: deque[str] = field(default_factory=lambda: deque(maxlen=OUTPUT_LINES_KEPT))

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout: float = 180.0) -> None:
        """Launch it and wait until /health says it is ready."""
        self.launch()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                self.process.wait()
                time.sleep(0.2)  # the reader's last lines
                raise RuntimeError("appliance serve exited:\n" + "".join(self.output))
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

    def starting(self) -> bool:
        """Whether it answers and says it is starting (/health 503, workers loading)."""
        try:
            return httpx.get(self.url + "/health", timeout=2).status_code == 503
        except httpx.TransportError:
            return False

    def launch(self) -> None:
        """Start the process; it is not ready yet."""
        env = {**os.environ, **self.env}
        if self.port_in_env:
            env["APPLIANCE_PORT"] = str(self.port)
        if self.split_unless_named and not any(name in self.env for name in LAYOUT_SETTINGS):
            env["APPLIANCE_MODE"] = "disaggregated"
        self.process = subprocess.Popen(
            [sys.executable, "-m", "appliance.cli", *self.args],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=self.own_group,
        )
        threading.Thread(target=self._read_output, daemon=True).start()

    def _read_output(self) -> None:
        assert self.process is not None and self.process.stdout is not None
        for line in self.process.stdout:
            self.output.append(line)

    def stop(self, timeout: float = 30.0, sig: int = signal.SIGINT) -> int:
        """SIGINT, as Ctrl-C would (or `sig`); returns the exit code."""
        if self.process.poll() is None:
            self.process.send_signal(sig)
        try:
            return self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            self.process.kill()
            return self.process.wait()


def greedy_text(url: str, prompt: str, max_tokens: int, timeout: float) -> str:
    """The text of a greedy completion (EOS ignored) of `prompt` from the server at `url`."""
    reply = httpx.post(
        url + "/v1/completions",
        json={
            "model": "SmolLM2-135M-Instruct",
            "prompt": prompt,
            "max_tokens": max_tokens,
            "temperature": 0,
            "ignore_eos": True,
        },
        headers={"Authorization": f"Bearer {API_KEY}"},
        timeout=timeout,
    )
    reply.raise_for_status()
    return str(reply.json()["choices"][0]["text"])


def admin_split_server(folder: Path, devices: int, **more: str) -> ServerProcess:
    """A split server for the tests that kill its workers, not yet started: `devices` CPU
    devices sharing the cores, prefill on device 0 and decode on the others, a 64 MB KV
    pool, its admin token in `folder` (worker_faults.state reads it); `more` adds
    settings. Each such test module starts its own: their assertions count restarts and
    leave a device failed, which a shared server would carry into the next module."""
    token_file = folder / "admin.token"
    env = {
        "APPLIANCE_CPU_DEVICES": str(devices),
        "APPLIANCE_CPU_SHARE_CORES": "true",
        "APPLIANCE_PREFILL_DEVICES": "0",
        "APPLIANCE_DECODE_DEVICES": ",".join(str(d) for d in range(1, devices)),
        "APPLIANCE_KV__MEMORY_MB": "64",
        "APPLIANCE_ADMIN__TOKEN_FILE": str(token_file),
        **more,
    }
    return ServerProcess(env, admin_token_file=token_file)


def cluster_head(folder: Path, listen: str, **more: str) -> tuple[ServerProcess, Path]:
    """A head for the tests with boxes, not yet started, and its cluster secret: prefill
    on device 0 and decode on device 1 of two one-core devices, listening for agents on
    `listen` (host:port), their KV crossing over TCP; `more` adds settings."""
    secret = folder / "secret"
    secret.write_text("a-shared-secret-of-the-test-boxes\n")
    env = {
        "APPLIANCE_API_KEY": API_KEY,
        "APPLIANCE_DTYPE": "float32",
        "APPLIANCE_WEIGHTS": "dense",
        "APPLIANCE_CPU_DEVICES": "2",
        "APPLIANCE_CPU_SHARE_CORES": "true",
        "APPLIANCE_PREFILL_DEVICES": "0",
        "APPLIANCE_DECODE_DEVICES": "1",
        "APPLIANCE_KV__MEMORY_MB": "64",
        "APPLIANCE_ADMIN__TOKEN_FILE": str(folder / "admin.token"),
        "APPLIANCE_CLUSTER__LISTEN": listen,
        "APPLIANCE_CLUSTER__SECRET_FILE": str(secret),
        "APPLIANCE_CLUSTER__TRANSPORTS": "tcp",
        **more,
    }
    return ServerProcess(env, admin_token_file=folder / "admin.token"), secret
