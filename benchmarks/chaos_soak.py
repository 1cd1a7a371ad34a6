"""A chaos soak (issue 40): mixed traffic against a head and a cross-box agent on loopback
while a seeded scheduler injects faults, every answer checked against a reference.

The cluster: `appliance serve` on 127.0.0.2 (prefill on CPU device 0, decode on device 1,
dense float32 weights and KV, speculation off) and `appliance agent` for box "b" (one
decode device) joining from 127.0.0.3 through a TCP relay in this process, so the link
between the boxes can be cut from outside (the relay closes both ends of every connection
it carries: the agent's and its worker's). The KV itself crosses through NIXL straight
between the boxes, not through the relay. The agent is brought back whenever it exits, as
its systemd unit would.

Traffic: `--clients` loops of temperature-0 requests drawn from a fixed catalogue: chat
(whole and streamed), completions (whole and streamed), long prompts, prompts sharing a
long prefix, `n=2`, and streams the client drops after a few chunks. Every request's
reference answer is taken first from the same server, one request at a time, before any
fault; on dense float32 weights and KV the greedy answer does not depend on batch shape.

Faults, one drawn at a time by `--seed`: SIGKILL or SIGSTOP/SIGCONT of a head worker, of
box b's worker, of the agent (SIGSTOP: the whole box, agent and worker); an in-place move
of device 1 (POST /admin/pools); an autopilot move (POST /admin/planner/apply); a cut
link; clients that disconnect mid-stream. A full disk for the cache directory is not
injected: it needs a filesystem of its own (a mount, which needs root).

The soak runs for at least `--minutes` and until at least `--faults` faults have been
applied (a fault whose target is not there, or a move the appliance refuses, is logged and
not counted). After every `--faults-per-check` faults, traffic pauses, the requests in
flight end, the box waits for its workers (box b's included) and for idle, and the
invariants are read: every KV block free, as many processes under the server and the
agent as at the start, no orphan (this process is a child subreaper: a worker whose
parent died lands here), the supervisor's file descriptors and RSS within FD_GROWTH and
RSS_GROWTH_MB of the start (the start is read after the references, on a warm server).

Every request ends as one of: completed (the reference answer), failed cleanly (a 503 with
Retry-After, or a stream's 503 error event, within the deadline), cancelled (dropped by
its client on purpose), or a must-be-0 outcome: lost (the connection ended without an
answer), wrong (an answer that is not the reference), hang (no end within `--deadline`),
bad status (any other status, a 5xx above all). The exit code is 1 if any must-be-0 figure
is not 0 or an invariant failed.

    .venv/bin/python benchmarks/chaos_soak.py --minutes 60 --faults 200 --seed 1 --out soak.json
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import ctypes
import io
import json
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx
import psutil

from appliance.bench.compare import free_port
from appliance.cluster.certs import make_certs

MODEL = "SmolLM2-135M-Instruct"
API_KEY = "chaos-soak-key"
HEAD_HOST, BOX_HOST = "127.0.0.2", "127.0.0.3"
FD_GROWTH = 16  # file descriptors the supervisor may gain over the run
RSS_GROWTH_MB = 96.0  # and resident memory (MB): allocator pools and caches settle, leaks grow
READY_BOUND_S = 240.0  # for every worker to be ready again after a fault (a model load)
IDLE_BOUND_S = 60.0  # for every KV block to be free once no request is in flight
PR_SET_CHILD_SUBREAPER = 36
BACK_OFF_S = 1.0  # a client answered 503 + Retry-After waits this long (not the header's)
MUST_BE_ZERO = ("lost", "wrong", "hang", "bad_status")
VERDICTS = ("completed", "failed_cleanly", "cancelled", *MUST_BE_ZERO)
FAULT_KINDS = (
    "kill_worker",
    "stop_worker",
    "kill_box_worker",
    "kill_agent",
    "stop_box",
    "move",
    "autopilot",
    "cut_link",
    "disconnect",
)
BOX_FAULTS = ("kill_box_worker", "kill_agent", "stop_box", "cut_link")


# ----------------------------------------------------------------------------- traffic


@dataclass(frozen=True)
class Spec:
    """One request of the catalogue: where it goes, its body (n=1, whole), how it is sent."""

    name: str
    route: str  # "/v1/completions" or "/v1/chat/completions"
    body: dict[str, Any]
    stream: bool = False
    n: int = 1
    drop_after: int = 0  # > 0: the client closes the stream after this many chunks


@dataclass
class Outcome:
    """What became of one request."""

    spec: str
    verdict: str  # completed, failed_cleanly, cancelled, lost, wrong, hang, bad_status
    seconds: float
    detail: str = ""


WORDS = (
    "harbor lantern orchard copper meadow signal winter river market engine garden "
    "letter bridge valley candle ledger window summit thunder compass island village"
).split()


def long_text(rng: random.Random, words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(words))


def catalogue(seed: int, max_tokens: int) -> list[Spec]:
    """The requests the clients draw from: each kind with a few prompts."""
    rng = random.Random(seed)
    common = {"model": MODEL, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
    prompts = [
        "The lighthouse keeper wrote in his log that the ship",
        "Three things every garden needs are",
        "In the winter market the baker sold",
        "A letter arrived from the island, and it said",
    ]
    questions = ["Name a color.", "What is rain?", "Say something kind.", "Count to five."]
    shared = "Context: " + long_text(rng, 160) + "\nQuestion: "  # the reused prefix
    specs = []
    for i, p in enumerate(prompts):
        body = {**common, "prompt": p}
        specs += [Spec(f"complete{i}", "/v1/completions", body)]
        specs += [Spec(f"stream{i}", "/v1/completions", body, stream=True)]
        specs += [Spec(f"n2_{i}", "/v1/completions", body, n=2)]
        specs += [Spec(f"drop{i}", "/v1/completions", body, stream=True, drop_after=2)]
    for i, q in enumerate(questions):
        chat = {**common, "messages": [{"role": "user", "content": q}]}
        specs += [Spec(f"chat{i}", "/v1/chat/completions", chat)]
        specs += [Spec(f"chat_stream{i}", "/v1/chat/completions", chat, stream=True)]
        specs += [Spec(f"prefix{i}", "/v1/completions", {**common, "prompt": shared + q})]
    for i in range(3):
        body = {**common, "prompt": f"Story {i}: " + long_text(rng, 300)}
        specs += [Spec(f"long{i}", "/v1/completions", body)]
    return specs


def reply_texts(spec: Spec, reply: dict[str, Any]) -> list[str]:
    """The choices' texts of a whole reply, by index."""
    choices = sorted(reply["choices"], key=lambda c: c["index"])
    if spec.route.endswith("chat/completions"):
        return [c["message"]["content"] or "" for c in choices]
    return [c["text"] for c in choices]


def delta_text(spec: Spec, choice: dict[str, Any]) -> str:
    if spec.route.endswith("chat/completions"):
        return choice.get("delta", {}).get("content") or ""
    return choice.get("text") or ""


class Client:
    """Sends one Spec and judges the answer against its reference."""

    def __init__(self, http: httpx.AsyncClient, references: dict[str, str], deadline: float):
        self.http, self.references, self.deadline = http, references, deadline

    async def reference(self, spec: Spec) -> str:
        """The answer of `spec` (whole, n=1) alone on the server."""
        reply = await self.http.post(spec.route, json=spec.body, timeout=self.deadline)
        reply.raise_for_status()
        return reply_texts(spec, reply.json())[0]

    async def send(self, spec: Spec) -> Outcome:
        started = time.monotonic()
        try:
            verdict, detail = await asyncio.wait_for(self._send(spec), self.deadline)
        except TimeoutError:
            verdict, detail = "hang", f"no end within {self.deadline:.0f} s"
        except httpx.TransportError as exc:  # the connection ended without an answer
            verdict, detail = "lost", f"{type(exc).__name__}: {exc}"
        return Outcome(spec.name, verdict, time.monotonic() - started, detail[:300])

    async def _send(self, spec: Spec) -> tuple[str, str]:
        body = {**spec.body, "n": spec.n, "stream": spec.stream}
        if not spec.stream:
            reply = await self.http.post(spec.route, json=body, timeout=None)
            if reply.status_code != 200:
                return refused(reply.status_code, reply.headers, reply.text)
            return self._judge(spec, reply_texts(spec, reply.json()))
        async with self.http.stream("POST", spec.route, json=body, timeout=None) as reply:
            if reply.status_code != 200:
                return refused(reply.status_code, reply.headers, (await reply.aread()).decode())
            return await self._read_stream(spec, reply)

    async def _read_stream(self, spec: Spec, reply: httpx.Response) -> tuple[str, str]:
        texts = [""] * spec.n
        chunks = 0
        async for line in reply.aiter_lines():
            if not line.startswith("data: "):
                continue
            data = line.removeprefix("data: ")
            if data == "[DONE]":
                return self._judge(spec, texts)
            event = json.loads(data)
            if "error" in event:
                return stream_error(event["error"])
            for choice in event.get("choices", []):
                texts[choice["index"]] += delta_text(spec, choice)
            chunks += 1
            if spec.drop_after and chunks >= spec.drop_after:
                return "cancelled", f"dropped after {chunks} chunks"
        return "lost", "the stream ended without [DONE]"

    def _judge(self, spec: Spec, texts: list[str]) -> tuple[str, str]:
        """Completed when every choice is the reference (n=2 at temperature 0: both are)."""
        expected = self.references[spec.name]
        wrong = [t for t in texts if t != expected]
        if wrong:
            return "wrong", f"expected {expected!r}, got {wrong[0]!r}"
        return "completed", ""


def refused(status: int, headers: httpx.Headers, text: str) -> tuple[str, str]:
    """A non-200 answer: clean only as a 503 (or 429) that says when to come back."""
    if status in (429, 503) and headers.get("retry-after"):
        return "failed_cleanly", f"{status}: {text[:200]}"
    return "bad_status", f"{status}: {text[:200]}"


def stream_error(error: dict[str, Any]) -> tuple[str, str]:
    """An error event inside a stream: clean as a 503's (service_unavailable) with a message."""
    if error.get("type") == "service_unavailable" and error.get("message"):
        return "failed_cleanly", f"stream error: {error['message']}"
    return "bad_status", f"stream error: {error}"


async def references(client: Client, specs: list[Spec]) -> dict[str, str]:
    """Each spec's answer alone on the server, one request at a time (specs with the same
    route and body share one)."""
    by_body: dict[str, str] = {}
    answers = {}
    for spec in specs:
        key = spec.route + json.dumps(spec.body, sort_keys=True)
        if key not in by_body:
            by_body[key] = await client.reference(spec)
        answers[spec.name] = by_body[key]
    return answers


class Traffic:
    """`clients` loops sending requests drawn from the catalogue while running is set."""

    def __init__(self, client: Client, specs: list[Spec], rng: random.Random) -> None:
        self.client, self.rng = client, rng
        self.specs = [s for s in specs if not s.drop_after]  # drops come as a fault
        self.drops = [s for s in specs if s.drop_after]
        self.running = asyncio.Event()
        self.outcomes: list[Outcome] = []
        self.in_flight = 0
        self._tasks: list[asyncio.Task] = []

    def start(self, clients: int) -> None:
        self._tasks = [asyncio.create_task(self._loop()) for _ in range(clients)]

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    async def _loop(self) -> None:
        while True:
            await self.running.wait()
            if await self.one(self.rng.choice(self.specs)) == "failed_cleanly":
                await asyncio.sleep(BACK_OFF_S)  # told to come back later: not at once

    async def one(self, spec: Spec) -> str:
        """Send `spec`, record its outcome; its verdict."""
        self.in_flight += 1
        try:
            outcome = await self.client.send(spec)
            self.outcomes.append(outcome)
            return outcome.verdict
        finally:
            self.in_flight -= 1

    def disconnecting(self, count: int) -> list[asyncio.Task]:
        """`count` streams whose clients hang up after a few chunks."""
        return [asyncio.create_task(self.one(self.rng.choice(self.drops))) for _ in range(count)]

    async def pause(self) -> None:
        """No new request; returns once those in flight have ended (each within its
        deadline, so this ends too)."""
        self.running.clear()
        while self.in_flight:
            await asyncio.sleep(0.1)


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


# ---------------------------------------------------------------------------- the faults


@dataclass
class Fault:
    """One injected fault: what, when (s from the soak's start), to what, what it did."""

    kind: str
    at: float
    round: int
    detail: str = ""
    applied: bool = True


class Chaos:
    """Draws and injects faults, and brings the cluster back to its layout after them."""

    def __init__(
        self, cluster: Cluster, traffic: Traffic, rng: random.Random, options: Options
    ) -> None:
        self.cluster, self.traffic, self.rng = cluster, traffic, rng
        self.stop_max_s, self.kinds = options.stop_max_s, options.kinds
        self.faults: list[Fault] = []
        self.started = time.monotonic()

    async def inject(self, round_: int) -> Fault:
        # A fault of box b only while box b is there to take it (agent and worker).
        box_up = len(self.cluster.box_pids()) > 1
        kind = self.rng.choice([k for k in self.kinds if box_up or k not in BOX_FAULTS])
        fault = Fault(kind, round(time.monotonic() - self.started, 1), round_)
        actions: dict[str, Callable[[Fault], Awaitable[None]]] = {
            "kill_worker": self._kill_worker,
            "stop_worker": self._stop_worker,
            "kill_box_worker": self._kill_box_worker,
            "kill_agent": self._kill_agent,
            "stop_box": self._stop_box,
            "move": self._move,
            "autopilot": self._autopilot,
            "cut_link": self._cut_link,
            "disconnect": self._disconnect,
        }
        try:
            await actions[kind](fault)
        except (httpx.HTTPError, OSError, psutil.Error) as exc:
            fault.applied, fault.detail = False, f"{type(exc).__name__}: {exc}"
        self.faults.append(fault)
        return fault

    def applied(self) -> int:
        return sum(f.applied for f in self.faults)

    async def _head_worker(self, fault: Fault) -> int | None:
        state = await asyncio.to_thread(self.cluster.state)
        pids = [
            d["worker"]["pid"]
            for d in state["devices"]
            if not d["box"] and d["worker"] and d["worker"]["pid"]
        ]
        if not pids:
            fault.applied, fault.detail = False, "no head worker running"
            return None
        return int(self.rng.choice(sorted(pids)))

    def _box_worker(self, fault: Fault) -> int | None:
        """Box b's worker: the largest process under the agent."""
        assert self.cluster.agent is not None
        under = [psutil.Process(p) for p in self.cluster.box_pids() if p != self.cluster.agent.pid]
        if not under:
            fault.applied, fault.detail = False, "box b has no worker running"
            return None
        return max(under, key=lambda p: p.memory_info().rss).pid

    async def _kill_worker(self, fault: Fault) -> None:
        if (pid := await self._head_worker(fault)) is not None:
            os.kill(pid, signal.SIGKILL)
            fault.detail = f"SIGKILL head worker pid {pid}"

    async def _stop_worker(self, fault: Fault) -> None:
        if (pid := await self._head_worker(fault)) is not None:
            await self._freeze([pid], fault, f"head worker pid {pid}")

    async def _kill_box_worker(self, fault: Fault) -> None:
        if (pid := self._box_worker(fault)) is not None:
            os.kill(pid, signal.SIGKILL)
            fault.detail = f"SIGKILL box b's worker pid {pid}"

    async def _kill_agent(self, fault: Fault) -> None:
        agent = self.cluster.agent
        if agent is None or agent.poll() is not None:
            fault.applied, fault.detail = False, "the agent is not running"
            return
        agent.kill()
        fault.detail = f"SIGKILL agent pid {agent.pid} (started again at recovery)"

    async def _stop_box(self, fault: Fault) -> None:
        pids = self.cluster.box_pids()
        if not pids:
            fault.applied, fault.detail = False, "the agent is not running"
            return
        await self._freeze(pids, fault, f"box b (agent and workers: pids {pids})")

    async def _freeze(self, pids: list[int], fault: Fault, what: str) -> None:
        """SIGSTOP `pids`, wait a drawn time with the traffic running, SIGCONT."""
        seconds = round(self.rng.uniform(1.0, self.stop_max_s), 1)
        for pid in pids:
            os.kill(pid, signal.SIGSTOP)
        await asyncio.sleep(seconds)
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):  # the supervisor killed it
                os.kill(pid, signal.SIGCONT)
        fault.detail = f"SIGSTOP {what} for {seconds} s, then SIGCONT"

    async def _move(self, fault: Fault) -> None:
        state = await asyncio.to_thread(self.cluster.state)
        device = state["devices"][1]
        to = self.rng.choice([r for r in ("prefill", "decode") if r != device["pool"]])
        body = {"device": 1, "to": to}
        reply = await asyncio.to_thread(self.cluster.admin_post, "/admin/pools", body)
        fault.applied = reply.status_code == 202
        fault.detail = f"device 1 {device['pool']} -> {to}: {reply.status_code} {reply.text[:160]}"

    async def _autopilot(self, fault: Fault) -> None:
        reply = await asyncio.to_thread(self.cluster.admin_post, "/admin/planner/apply")
        fault.applied = reply.status_code == 202
        fault.detail = f"{reply.status_code} {reply.text[:200]}"

    async def _cut_link(self, fault: Fault) -> None:
        fault.detail = f"cut {self.cluster.relay.cut()} connections between box b and the head"

    async def _disconnect(self, fault: Fault) -> None:
        count = self.rng.randint(2, 4)
        self.traffic.disconnecting(count)
        fault.detail = f"{count} streams dropped by their clients after 2 chunks"


# ---------------------------------------------------------------------- the invariants


@dataclass
class Figures:
    """The invariants' figures at a quiet moment."""

    blocks_in_use: int
    processes: int
    orphans: int
    fds: int
    rss_mb: float
    health: str  # /health's status: ok, or degraded while a worker is listed not alive


def orphans(cluster: Cluster) -> list[psutil.Process]:
    """Processes that lost their parent and came to this one (the subreaper), reaping
    those already dead."""
    ours = {p.pid for p in (cluster.head, cluster.agent) if p is not None}
    found = []
    for child in psutil.Process().children():
        if child.pid in ours:
            continue
        if live(child):
            found.append(child)
        else:
            with contextlib.suppress(ChildProcessError):
                os.waitpid(child.pid, os.WNOHANG)
    return found


def figures(cluster: Cluster) -> Figures:
    head, health = cluster.head_process(), cluster.health()
    return Figures(
        blocks_in_use=blocks_in_use(health),
        processes=len(cluster.tree()),
        orphans=len(orphans(cluster)),
        fds=head.num_fds(),
        rss_mb=round(head.memory_info().rss / 2**20, 1),
        health=str(health.get("status")),
    )


class Checker:
    """Brings the cluster back after faults and reads the invariants against the start."""

    def __init__(self, cluster: Cluster, start: Figures) -> None:
        self.cluster, self.start = cluster, start
        self.violations: list[str] = []
        self.samples: list[Figures] = [start]
        self.recovered = True  # False once a device's worker did not come back

    def _layout_back(self) -> bool:
        """Device 0 prefills, 1 and box b's decode; a move back is asked where not, once
        no move runs. True when the layout is the start's."""
        self.cluster.ensure_agent()
        state = self.cluster.state()
        if any(m["phase"] not in ("done", "failed") for m in state["moves"]):
            return False
        wrong = [
            (i, "prefill" if i == 0 else "decode")
            for i, d in enumerate(state["devices"])
            if d["worker"] and d["pool"] != ("prefill" if i == 0 else "decode")
        ]
        for device, to in wrong:
            self.cluster.admin_post("/admin/pools", {"device": device, "to": to})
        return not wrong

    def _idle(self) -> bool:
        health = self.cluster.health()
        return not health["generations_admitted"] and blocks_in_use(health) == 0

    async def after_faults(self, label: str) -> Figures:
        """Wait for the workers, the layout and idle; record what does not come back."""
        if not await poll(self._layout_back, READY_BOUND_S):
            self.violations.append(f"{label}: the layout did not come back")
        self.recovered = bool(await poll(self.cluster.ready, READY_BOUND_S))
        if not self.recovered:
            health = await asyncio.to_thread(self.cluster.health)
            self.violations.append(f"{label}: workers not all ready: {by_device(health)}")
        if not await poll(self._idle, IDLE_BOUND_S):
            health = await asyncio.to_thread(self.cluster.health)
            self.violations.append(f"{label}: KV blocks held when idle: {by_device(health)}")
        count = self.start.processes
        if not await poll(lambda: len(self.cluster.tree()) == count, 30):
            tree = [" ".join(p.cmdline())[:120] for p in self.cluster.tree()]
            self.violations.append(f"{label}: {len(tree)} processes, not {count}: {tree}")
        if not await poll(lambda: not orphans(self.cluster), 30):
            for orphan in orphans(self.cluster):
                self.violations.append(f"{label}: orphan {orphan.pid} {orphan.cmdline()[:6]}")
                orphan.kill()  # so the next round starts clean
        now = await asyncio.to_thread(figures, self.cluster)
        self.samples.append(now)
        if now.fds - self.start.fds > FD_GROWTH:
            self.violations.append(f"{label}: supervisor fds {self.start.fds} -> {now.fds}")
        if now.rss_mb - self.start.rss_mb > RSS_GROWTH_MB:
            self.violations.append(f"{label}: supervisor RSS {self.start.rss_mb} -> {now.rss_mb}")
        return now


# ------------------------------------------------------------------------------ the soak


@dataclass
class Options:
    minutes: float
    faults: int
    seed: int
    clients: int
    max_tokens: int
    deadline_s: float
    faults_per_check: int
    stop_max_s: float
    stall_timeout_s: float
    kinds: tuple[str, ...] = FAULT_KINDS


@dataclass
class Report:
    """What --out holds."""

    options: dict[str, Any]
    seconds: float
    requests: dict[str, int] = field(default_factory=dict)  # by verdict, and "sent"
    faults: dict[str, int] = field(default_factory=dict)  # applied, by kind
    faults_not_applied: dict[str, int] = field(default_factory=dict)
    events: dict[str, int] | None = None  # the head's appliance.events lines by fault kind
    start: Figures | None = None
    end: Figures | None = None
    violations: list[str] = field(default_factory=list)
    agent_exits: list[int] = field(default_factory=list)
    fault_log: list[Fault] = field(default_factory=list)
    bad_requests: list[Outcome] = field(default_factory=list)
    interrupted: bool = False  # stopped by SIGINT before its bars were passed

    @property
    def failed(self) -> bool:
        bad = any(self.requests.get(k) for k in MUST_BE_ZERO) or bool(self.violations)
        return bad or self.interrupted


async def soak(cluster: Cluster, options: Options) -> Report:
    rng = random.Random(options.seed)
    limits = httpx.Limits(max_connections=64, max_keepalive_connections=0)
    headers = {"Authorization": f"Bearer {API_KEY}"}
    async with httpx.AsyncClient(base_url=cluster.url, headers=headers, limits=limits) as http:
        client = Client(http, {}, options.deadline_s)
        specs = catalogue(options.seed, options.max_tokens)
        client.references = await references(client, specs)
        start = await asyncio.to_thread(figures, cluster)
        traffic, report = Traffic(client, specs, rng), Report(asdict(options), 0.0, start=start)
        chaos, checker = Chaos(cluster, traffic, rng, options), Checker(cluster, start)
        traffic.start(options.clients)
        try:
            await rounds(chaos, checker, options, rng)
        except asyncio.CancelledError:  # Ctrl-C: report what was seen so far
            report.interrupted = True
        await traffic.stop()
        if checker.recovered and not report.interrupted:
            report.end = await checker.after_faults("end")
        else:
            report.end = await asyncio.to_thread(figures, cluster)
    report.seconds = round(time.monotonic() - chaos.started, 1)
    verdicts = Counter(o.verdict for o in traffic.outcomes)
    report.requests = {"sent": len(traffic.outcomes)} | {v: verdicts[v] for v in VERDICTS}
    report.faults = dict(Counter(f.kind for f in chaos.faults if f.applied))
    report.faults_not_applied = dict(Counter(f.kind for f in chaos.faults if not f.applied))
    report.violations = checker.violations
    report.fault_log = chaos.faults
    report.bad_requests = [o for o in traffic.outcomes if o.verdict in MUST_BE_ZERO]
    return report


async def rounds(chaos: Chaos, checker: Checker, options: Options, rng: random.Random) -> None:
    """Faults with traffic running, then a check with none, until both bars are passed."""
    end_at = time.monotonic() + options.minutes * 60
    round_ = 0
    while time.monotonic() < end_at or chaos.applied() < options.faults:
        round_ += 1
        chaos.traffic.running.set()
        for _ in range(options.faults_per_check):
            await asyncio.sleep(rng.uniform(0.5, 3.0))  # traffic before the fault
            fault = await chaos.inject(round_)
            print(f"[{fault.at:7.1f} s] round {round_}: {fault.kind}: {fault.detail}")
        await asyncio.sleep(rng.uniform(1.0, 4.0))  # traffic after it
        await chaos.traffic.pause()
        await checker.after_faults(f"round {round_}")
        if not checker.recovered:  # every later round would wait for it again
            print(f"round {round_}: the workers did not all come back: the soak stops")
            return


def fault_events(log: Path) -> Counter[str]:
    """The head's structured fault events (logger appliance.events, a JSON object a line)
    counted by kind."""
    counts: Counter[str] = Counter()
    for line in log.read_text(errors="replace").splitlines():
        _, marker, data = line.partition(" appliance.events: ")
        if marker:
            with contextlib.suppress(json.JSONDecodeError):
                counts[str(json.loads(data).get("kind"))] += 1
    return counts


def table(report: Report) -> str:
    r, start, end = report.requests, report.start, report.end
    rows: list[tuple[str, object]] = [
        ("requests sent", r["sent"]),
        ("completed (the reference answer)", r["completed"]),
        ("failed cleanly (503 + Retry-After)", r["failed_cleanly"]),
        ("cancelled by their clients", r["cancelled"]),
        ("lost (must be 0)", r["lost"]),
        ("wrong answers (must be 0)", r["wrong"]),
        ("hangs (must be 0)", r["hang"]),
        ("other statuses (must be 0)", r["bad_status"]),
        ("invariant violations (must be 0)", len(report.violations)),
        ("interrupted before its bars", "yes" if report.interrupted else "no"),
    ]
    rows += [(f"fault: {k}", n) for k, n in sorted(report.faults.items())]
    rows += [(f"fault not applied: {k}", n) for k, n in sorted(report.faults_not_applied.items())]
    if report.events is not None:
        rows += [(f"appliance.events: {k}", n) for k, n in sorted(report.events.items())]
    if start and end:
        for name in ("blocks_in_use", "processes", "orphans", "fds", "rss_mb", "health"):
            rows.append((f"{name} start -> end", f"{getattr(start, name)} -> {getattr(end, name)}"))
    width = max(len(k) for k, _ in rows)
    lines = [f"{'':{width}}  value", f"{'-' * width}  -----"]
    lines += [f"{k:{width}}  {v}" for k, v in rows]
    return "\n".join(lines)


def subreaper() -> None:
    """Orphaned descendants come to this process instead of init, where the soak sees them."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_CHILD_SUBREAPER)")


def parse(argv: list[str] | None) -> tuple[Options, Path | None, Path | None]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--minutes", type=float, default=60.0, help="at least this long")
    parser.add_argument("--faults", type=int, default=200, help="at least this many applied")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--clients", type=int, default=3, help="request loops at once")
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--deadline", type=float, default=180.0, help="s; past it: a hang")
    parser.add_argument("--faults-per-check", type=int, default=1)
    parser.add_argument("--stop-max", type=float, default=20.0, help="longest SIGSTOP, s")
    parser.add_argument("--stall-timeout", type=float, default=15.0, help="recovery's, s")
    parser.add_argument(
        "--kinds",
        default=",".join(FAULT_KINDS),
        help="the fault kinds drawn from, comma-separated (to reproduce one)",
    )
    parser.add_argument("--out", type=Path, help="the report as JSON")
    parser.add_argument("--folder", type=Path, help="for logs and certificates (a temp one)")
    args = parser.parse_args(argv)
    options = Options(
        args.minutes,
        args.faults,
        args.seed,
        args.clients,
        args.max_tokens,
        args.deadline,
        args.faults_per_check,
        args.stop_max,
        args.stall_timeout,
        kinds(args.kinds),
    )
    return options, args.out, args.folder


def kinds(text: str) -> tuple[str, ...]:
    chosen = tuple(k.strip() for k in text.split(",") if k.strip())
    unknown = sorted(set(chosen) - set(FAULT_KINDS))
    if unknown or not chosen:
        raise SystemExit(f"--kinds: unknown {unknown}; the kinds are {', '.join(FAULT_KINDS)}")
    return chosen


def main(argv: list[str] | None = None) -> int:
    options, out, folder = parse(argv)
    folder = folder or Path(tempfile.mkdtemp(prefix="chaos-soak-"))
    folder.mkdir(parents=True, exist_ok=True)
    subreaper()
    if isinstance(sys.stdout, io.TextIOWrapper):  # progress lines as they come, in a log too
        sys.stdout.reconfigure(line_buffering=True)
    cluster = Cluster(folder, options.stall_timeout_s)
    cluster.start()
    try:
        started = time.monotonic()
        if not asyncio.run(poll(cluster.ready, READY_BOUND_S)):
            raise SystemExit(f"the cluster was not ready within {READY_BOUND_S:.0f} s: {folder}")
        print(f"cluster ready in {time.monotonic() - started:.0f} s; logs in {folder}")
        report = asyncio.run(soak(cluster, options))
    finally:
        cluster.stop()
    report.agent_exits = cluster.agent_exits
    report.events = dict(fault_events(folder / "head.log"))
    print(table(report))
    for problem in report.violations:
        print("violation:", problem)
    for outcome in report.bad_requests:
        print("bad request:", outcome)
    if report.failed:  # what the supervisor said last (its access log aside)
        lines = (folder / "head.log").read_text(errors="replace").splitlines()
        said = [line for line in lines if not line.startswith("INFO:  ")]
        print("the head's log, last lines:", *said[-40:], sep="\n")
    if out is not None:
        out.write_text(json.dumps(asdict(report), indent=1, default=str) + "\n")
    return 1 if report.failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
