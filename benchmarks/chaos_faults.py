"""The chaos soak's faults (benchmarks/chaos_soak.py): each kind, drawn from a shuffled
deck by the seed, and how it is injected."""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import signal
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import httpx
import psutil
from chaos_cluster import Cluster
from chaos_disk import FULL_WARNING, TAKES_AGAIN, count_lines
from chaos_traffic import MODEL, Traffic, long_text

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
    "disk_full",
)
DISK_HOLD_MAX_S = 8.0  # the longest a full disk is left full (and never past --stop-max)
DISK_BACK_BOUND_S = 60.0  # for the disk tier to take blocks again once room is made
BOX_FAULTS = ("kill_box_worker", "kill_agent", "stop_box", "cut_link")


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
        self,
        cluster: Cluster,
        traffic: Traffic,
        rng: random.Random,
        stop_max_s: float,
        kinds: tuple[str, ...],
    ) -> None:
        """`stop_max_s`: the longest SIGSTOP; `kinds`: the fault kinds drawn from."""
        self.cluster, self.traffic, self.rng = cluster, traffic, rng
        self.stop_max_s, self.kinds = stop_max_s, kinds
        self.faults: list[Fault] = []
        self.violations: list[str] = []  # what a fault's own checks found wrong
        self.deck: list[str] = []  # the kinds still to draw in this turn of the deck
        self.started = time.monotonic()

    async def inject(self, round_: int) -> Fault:
        # A fault of box b only while box b is there to take it (agent and worker).
        box_up = len(self.cluster.box_pids()) > 1
        kind = self._draw(box_up)
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
            "disk_full": self._disk_full,
        }
        try:
            await actions[kind](fault)
        except (httpx.HTTPError, OSError, psutil.Error) as exc:
            fault.applied, fault.detail = False, f"{type(exc).__name__}: {exc}"
        self.faults.append(fault)
        return fault

    def _draw(self, box_up: bool) -> str:
        """The next kind from a shuffled deck of every kind, so that each kind comes once in
        each len(kinds) faults (a short run injects every kind, not the seed's favourites);
        a fault of box b stays in the deck while the box is down."""
        if not self.deck:
            self.deck = self.rng.sample(self.kinds, len(self.kinds))
        for i, kind in enumerate(self.deck):
            if box_up or kind not in BOX_FAULTS:
                return self.deck.pop(i)
        return self.rng.choice([k for k in self.kinds if k not in BOX_FAULTS] or self.kinds)

    def applied(self) -> int:
        return sum(f.applied for f in self.faults)

    def untried(self) -> set[str]:
        """The kinds not drawn yet (a fault of box b waits while the box is down)."""
        return set(self.kinds) - {f.kind for f in self.faults}

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

    async def _disk_full(self, fault: Fault) -> None:
        """Fill the disk tier's filesystem to ENOSPC for a drawn time with the traffic
        running (and a request of new blocks, so the tier meets it), then free it. Checked:
        the head warned once, and the tier took blocks again after (its disk bytes written
        grow on /metrics); the traffic's own answers are checked as always."""
        disk, log = self.cluster.disk, self.cluster.folder / "head.log"
        if not disk.mounted:
            fault.applied, fault.detail = False, f"disk_full {disk.why_not}"
            return
        seconds = round(self.rng.uniform(1.0, min(DISK_HOLD_MAX_S, self.stop_max_s)), 1)
        log_at = log.stat().st_size
        filled = disk.fill()
        try:
            await self._new_blocks()
            until = time.monotonic() + seconds
            while time.monotonic() < until:  # a room freed (a temporary removed) is refilled
                await asyncio.sleep(0.25)
                disk.top_up()
        finally:
            disk.free()
        written = await asyncio.to_thread(self.cluster.disk_written) or 0.0
        freed = time.monotonic()

        async def taken_again() -> bool:
            await self._new_blocks()
            return (await asyncio.to_thread(self.cluster.disk_written) or 0.0) > written

        back = await poll_async(taken_again, DISK_BACK_BOUND_S)
        warned = count_lines(log, FULL_WARNING, log_at)
        again = count_lines(log, TAKES_AGAIN, log_at)
        fault.detail = (
            f"{disk.path} filled ({filled >> 10} KiB) for {seconds} s, then freed: "
            f"{warned} full-disk warning(s), "
            + (
                f"blocks taken again after {time.monotonic() - freed:.1f} s"
                if back
                else "no blocks taken again"
            )
        )
        label = f"disk_full at {fault.at} s"
        if warned != 1:
            self.violations.append(f"{label}: {warned} full-disk warnings in the head's log, not 1")
        if not back or again != 1:
            self.violations.append(
                f"{label}: the disk tier did not take blocks again within "
                f"{DISK_BACK_BOUND_S:.0f} s of room made ({again} 'takes blocks again' lines)"
            )

    async def _new_blocks(self) -> None:
        """A prompt no one sent before (about eight full KV blocks), answered at once: its
        blocks go to the store when it finishes and push older ones to the disk tier."""
        prompt = f"Note {self.rng.getrandbits(64):x}: " + long_text(self.rng, 100)
        body = {"model": MODEL, "prompt": prompt, "max_tokens": 1, "temperature": 0}
        with contextlib.suppress(httpx.HTTPError):  # a 503 while a worker is back: not ours
            await self.traffic.client.http.post("/v1/completions", json=body, timeout=60)


async def poll_async(check: Callable[[], Awaitable[bool]], bound_s: float) -> bool:
    """`await check()` every half second until it is true or `bound_s` has passed."""
    deadline = time.monotonic() + bound_s
    while True:
        with contextlib.suppress(httpx.HTTPError):
            if await check():
                return True
        if time.monotonic() > deadline:
            return False
        await asyncio.sleep(0.5)
