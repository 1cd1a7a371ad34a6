"""The chaos soak's invariants (benchmarks/chaos_soak.py): after a burst of faults, the
cluster brought back to its layout and idle, then every KV block free, the processes the
start had, no orphan, the supervisor's fds and RSS within bounds of the start."""

from __future__ import annotations

import asyncio
import contextlib
import os
from dataclasses import dataclass

import psutil
from chaos_cluster import Cluster, blocks_in_use, by_device, live, poll

FD_GROWTH = 16  # file descriptors the supervisor may gain over the run
RSS_GROWTH_MB = 96.0  # and resident memory (MB): allocator pools and caches settle, leaks grow
READY_BOUND_S = 240.0  # for every worker to be ready again after a fault (a model load)
IDLE_BOUND_S = 60.0  # for every KV block to be free once no request is in flight


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
