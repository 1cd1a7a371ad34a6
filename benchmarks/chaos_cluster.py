"""The chaos soak's cluster (benchmarks/chaos_soak.py): the head, box b's agent (brought
back whenever it exits), the TCP relay between them that can cut the link, the head's KV
store disk tier on a tmpfs of its own (chaos_disk.py), and reading /health and /metrics."""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import psutil
from chaos_disk import FullDisk

from appliance.bench.compare import free_port
from appliance.cluster.certs import make_certs

API_KEY = "chaos-soak-key"
HEAD_HOST, BOX_HOST = "127.0.0.2", "127.0.0.3"
# The KV store's tiers, small so blocks keep moving: a host tier of 2 blocks (a float32
# block of SmolLM2-135M is 720 KiB), a disk tier of about 8 on a 16 MiB tmpfs, so the
# traffic writes the disk tier all the time and a full filesystem is met at once.
STORE_HOST_MB, STORE_DISK_MB, DISK_FS_MB = 2, 6, 16
DISK_WRITTEN = re.compile(r'^appliance_kv_store_written_bytes(?:_total)?\{tier="disk"\} (\S+)$')


# ----------------------------------------------------------------------- the link relay


class Relay:
    """A TCP relay between box b and the head's cluster port, which can cut every
    connection it carries. It connects on from box b's address, so the head sees the
    box where it is."""

    def __init__(self, target: tuple[str, int]) -> None:
        self.target = target
        self.listener = socket.create_server((HEAD_HOST, 0))
        self.address = f"{HEAD_HOST}:{self.listener.getsockname()[1]}"
        self._pairs: list[tuple[socket.socket, socket.socket]] = []
        self._lock = threading.Lock()
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                inner, _ = self.listener.accept()
            except OSError:  # closed
                return
            try:
                outer = socket.create_connection(self.target, source_address=(BOX_HOST, 0))
            except OSError:
                inner.close()
                continue
            with self._lock:
                self._pairs.append((inner, outer))
            for a, b in ((inner, outer), (outer, inner)):
                threading.Thread(target=self._pump, args=(a, b), daemon=True).start()

    @staticmethod
    def _pump(source: socket.socket, sink: socket.socket) -> None:
        try:
            while data := source.recv(65536):
                sink.sendall(data)
        except OSError:
            pass
        for s in (source, sink):
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)

    def cut(self) -> int:
        """Close both ends of every connection carried now; how many there were."""
        with self._lock:
            pairs, self._pairs = self._pairs, []
        for pair in pairs:
            for s in pair:
                with contextlib.suppress(OSError):
                    s.shutdown(socket.SHUT_RDWR)
                s.close()
        return len(pairs)

    def close(self) -> None:
        self.listener.close()
        self.cut()


# ------------------------------------------------------------------------- the cluster


class Cluster:
    """The head, box b's agent (brought back whenever it exits) and the relay between."""

    def __init__(self, folder: Path, stall_timeout_s: float) -> None:
        self.folder = folder
        certs = folder / "certs"
        make_certs(certs, ["b"])
        self.secret = folder / "secret"
        self.secret.write_text("the-chaos-soak-cluster-secret-0123456789\n")
        self.port = free_port()
        listen = (HEAD_HOST, free_port())
        self.relay = Relay(listen)
        self.token_file = folder / "admin.token"
        # Everything the head writes while it runs is under `folder` (its log, the admin
        # token) but the disk tier, which is on its own filesystem; the cache_dir holds
        # the model's converted weights, written at the start, not while serving.
        self.disk = FullDisk(folder / "kv-disk", DISK_FS_MB)
        self.url = f"http://127.0.0.1:{self.port}"
        self.engine_env = {
            "APPLIANCE_DTYPE": "float32",
            "APPLIANCE_WEIGHTS": "dense",
            "APPLIANCE_KV_CACHE_DTYPE": "float32",
            "APPLIANCE_SPECULATIVE__METHOD": "off",
        }
        self.head_env = {
            **self.engine_env,
            "APPLIANCE_PORT": str(self.port),
            "APPLIANCE_API_KEY": API_KEY,
            "APPLIANCE_MODE": "disaggregated",
            "APPLIANCE_CPU_DEVICES": "2",
            "APPLIANCE_CPU_SHARE_CORES": "true",
            "APPLIANCE_PREFILL_DEVICES": "0",
            "APPLIANCE_DECODE_DEVICES": "1",
            "APPLIANCE_KV__MEMORY_MB": "256",
            # The box's KV store, its blocks put when each request finishes (the pools
            # are too large to evict under this traffic) and pushed on to the disk tier.
            "APPLIANCE_KV_STORE__ENABLED": "true",
            "APPLIANCE_KV_STORE__WRITE_POLICY": "finish",
            "APPLIANCE_KV_STORE__HOST_MEMORY_MB": str(STORE_HOST_MB),
            "APPLIANCE_KV_STORE__DISK_PATH": str(self.disk.path),
            "APPLIANCE_KV_STORE__DISK_MB": str(STORE_DISK_MB),
            "APPLIANCE_ADMIN__TOKEN_FILE": str(self.token_file),
            # Faults come far more often here than max_crashes' default allows before a
            # device is marked failed for good; the soak asks that every fault is survived.
            "APPLIANCE_RECOVERY__MAX_CRASHES": "1000",
            "APPLIANCE_RECOVERY__STALL_TIMEOUT_S": str(stall_timeout_s),
            "APPLIANCE_CLUSTER__LISTEN": f"{listen[0]}:{listen[1]}",
            "APPLIANCE_CLUSTER__SECRET_FILE": str(self.secret),
            "APPLIANCE_CLUSTER__TRANSPORTS": "tcp",
            "APPLIANCE_CLUSTER__INTERFACE": "lo",
            "APPLIANCE_CLUSTER__CA_FILE": str(certs / "ca.crt"),
            "APPLIANCE_CLUSTER__CERT_FILE": str(certs / "head.crt"),
            "APPLIANCE_CLUSTER__KEY_FILE": str(certs / "head.key"),
        }
        self.agent_command = [sys.executable, "-m", "appliance.cli", "agent"]
        self.agent_command += ["--head", self.relay.address, "--box", "b", "--pool", "decode"]
        self.agent_command += ["--cpu-devices", "1", "--address", BOX_HOST]
        self.agent_command += ["--secret-file", str(self.secret)]
        for flag, name in (("ca-file", "ca.crt"), ("cert-file", "b.crt"), ("key-file", "b.key")):
            self.agent_command += [f"--cluster.{flag}", str(certs / name)]
        self.head: subprocess.Popen | None = None
        self.agent: subprocess.Popen | None = None
        self.agent_exits: list[int] = []  # exit codes of the agents that ended

    # -- processes

    def start(self) -> None:
        """The disk tier's tmpfs (where it can be mounted), the head, the agent."""
        if not self.disk.mount():
            print(f"the full-disk fault is {self.disk.why_not}")
        with (self.folder / "head.log").open("ab") as log:
            self.head = subprocess.Popen(
                [sys.executable, "-m", "appliance.cli", "serve"],
                env={**os.environ, **self.head_env},
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # a Ctrl-C reaches the soak, which stops them in turn
            )
        self.ensure_agent()

    def ensure_agent(self) -> bool:
        """Start the agent if it is not running (its unit's Restart=always); True if it was
        started now."""
        if self.agent is not None:
            if self.agent.poll() is None:
                return False
            self.agent_exits.append(self.agent.returncode)
        with (self.folder / "agent.log").open("ab") as log:
            self.agent = subprocess.Popen(
                self.agent_command,
                env={**os.environ, **self.engine_env},
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # a Ctrl-C reaches the soak, which stops them in turn
            )
        return True

    def stop(self) -> None:
        for process in (self.head, self.agent):  # the head first: its log ends with no box lost
            if process is not None and process.poll() is None:
                process.send_signal(signal.SIGINT)
                try:
                    process.wait(60)
                except subprocess.TimeoutExpired:
                    process.kill()
                    process.wait(30)
        self.relay.close()
        self.disk.unmount()

    def head_process(self) -> psutil.Process:
        assert self.head is not None
        return psutil.Process(self.head.pid)

    def tree(self) -> list[psutil.Process]:
        """Every live process under the server and the agent (the agent included)."""
        found = []
        for root in (self.head, self.agent):
            if root is None or root.poll() is not None:
                continue
            with contextlib.suppress(psutil.NoSuchProcess):
                top = psutil.Process(root.pid)
                found += [p for p in [top, *top.children(recursive=True)] if live(p)]
        return [p for p in found if self.head is None or p.pid != self.head.pid]

    def box_pids(self) -> list[int]:
        """The agent and everything under it."""
        if self.agent is None or self.agent.poll() is not None:
            return []
        with contextlib.suppress(psutil.NoSuchProcess):
            top = psutil.Process(self.agent.pid)
            return [p.pid for p in [top, *top.children(recursive=True)] if live(p)]
        return []

    def ready(self) -> bool:
        """Every worker ready, box b's too (the agent brought back first if it exited)."""
        self.ensure_agent()
        return all_ready(self.health())

    # -- HTTP

    def health(self) -> dict[str, Any]:
        return httpx.get(self.url + "/health", timeout=10).json()

    def _admin_headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.token_file.read_text().strip()}"}

    def state(self) -> dict[str, Any]:
        reply = httpx.get(self.url + "/admin/state", headers=self._admin_headers(), timeout=10)
        reply.raise_for_status()
        return reply.json()

    def disk_written(self) -> float | None:
        """Bytes the KV store wrote to its disk tier since it opened (/metrics); None
        before a worker opened it."""
        headers = {"Authorization": f"Bearer {API_KEY}"}
        reply = httpx.get(self.url + "/metrics", headers=headers, timeout=10)
        reply.raise_for_status()
        for line in reply.text.splitlines():
            if found := DISK_WRITTEN.match(line):
                return float(found.group(1))
        return None

    def admin_post(self, path: str, body: dict[str, Any] | None = None) -> httpx.Response:
        return httpx.post(self.url + path, json=body, headers=self._admin_headers(), timeout=30)


def live(process: psutil.Process) -> bool:
    try:
        return process.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def all_ready(health: dict[str, Any]) -> bool:
    """A ready worker on each of the three devices (box b's too). A worker that exited
    may still be listed beside its successor (`alive` false): that is not counted."""
    workers = [w for pool in health.get("pools", {}).values() for w in pool]
    ready = {w["device_index"] for w in workers if w["alive"] and w["ready"]}
    on_b = [w for w in workers if w["alive"] and str(w["device"]).startswith("b/")]
    return ready == {0, 1, 2} and len(on_b) == 1


def by_device(health: dict[str, Any]) -> str:
    """Each device's workers in a line: 'device 1: worker 8 (decode) exited, 3/364 blocks'."""
    rows: dict[int, list[str]] = {i: [] for i in range(3)}
    for pool in health.get("pools", {}).values():
        for w in pool:
            used = w["num_blocks"] - w["num_free_blocks"]
            rows.setdefault(w["device_index"], []).append(
                f"worker {w['worker_id']} ({w['role']}) {w['phase']}, {used}/{w['num_blocks']} "
                "blocks used"
            )
    status = f"status {health.get('status')}, {health.get('generations_admitted')} admitted"
    return "; ".join(
        [status] + [f"device {i}: {', '.join(r) or 'no worker'}" for i, r in rows.items()]
    )


def blocks_in_use(health: dict[str, Any]) -> int:
    workers = [w for pool in health.get("pools", {}).values() for w in pool if w["alive"]]
    return sum(w["num_blocks"] - w["num_free_blocks"] for w in workers)


async def poll(check: Callable[[], Any], bound_s: float, every_s: float = 0.5) -> Any:
    """`check()` (run in a thread) until it is true; its last value either way."""
    deadline = time.monotonic() + bound_s
    while True:
        try:
            value = await asyncio.to_thread(check)
        except (httpx.HTTPError, ValueError, KeyError, OSError):
            value = None
        if value or time.monotonic() > deadline:
            return value
        await asyncio.sleep(every_s)
