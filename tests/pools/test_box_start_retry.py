"""A joined box's worker that fails to start is tried again by the process manager, as a
crashed worker's restart is: while a try may still come, a worker of its role counts as
coming (requests wait rather than fail), and the tries end at recovery.max_crashes.

Plain objects stand in for the head's agent link (the box joined, a spawned worker whose
process has exited) and for the supervisor's hooks; the process manager, the restart
policy and Boxes are the real ones.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

from appliance.cluster.messages import AgentHello
from appliance.core.events import Event, EventKind, EventLog
from appliance.core.roles import Role
from appliance.pools.boxes import Boxes
from appliance.pools.process_manager import ProcessManager
from appliance.pools.worker_handle import WorkerHandle
from appliance.settings.config import Settings
from appliance.topology.devices import Device, Topology
from appliance.workers.outboxes import OutboxReader


class Exited:
    """A worker process that died loading."""

    pid = None
    exitcode = 1

    def is_alive(self) -> bool:
        return False

    def join(self, timeout: float | None = None, /) -> None:
        return None

    def kill(self) -> None:
        return None


@dataclass
class Head:
    """The head's agent links as the process manager and Boxes use them."""

    boxes: set[str] = field(default_factory=set)
    spawned: int = 0

    def has_box(self, box: str) -> bool:
        return box in self.boxes

    def admit(self, hello: AgentHello, connection: object) -> None:
        self.boxes.add(hello.box)

    def spawn(self, worker_id: int, role: Role, settings: Settings, devices: Any) -> Any:
        self.spawned += 1
        return [], Exited()

    def stop(self) -> None:
        self.boxes.clear()


@dataclass
class Hooks:
    """The supervisor's side: records whether a worker was still coming each time the
    process manager said one of its role would not."""

    settings: Settings
    log: EventLog
    processes: ProcessManager | None = None
    gone: list[bool] = field(default_factory=list)

    def settings_for(self, role: Role) -> Settings:
        return self.settings

    def has_work(self, worker: WorkerHandle) -> bool:
        return False

    def holding(self, worker_id: int) -> list[int]:
        return []

    def on_exit(self, worker: WorkerHandle) -> None:
        return None

    def on_gone(self, role: Role) -> None:
        assert self.processes is not None
        self.gone.append(self.processes.may_come_back(role))

    async def release(self, worker: WorkerHandle) -> None:
        return None

    def note(self, kind: EventKind, message: str, **fault: Any) -> Event:
        return self.log.note(kind, message, **fault)


def cpu(index: int) -> Device:
    return Device("cpu", index, f"cpu{index}", 0, 0)


def joined_box(crash_window_s: float) -> tuple[ProcessManager, Boxes, Head, Hooks]:
    """A started process manager whose head has one device, and Boxes to join box b."""
    settings = Settings()
    settings.recovery.max_crashes = 3
    settings.recovery.crash_window_s = crash_window_s
    log = EventLog()
    processes = ProcessManager(settings, Topology.without_links([cpu(0)]), OutboxReader(print))
    hooks = Hooks(settings, log, processes)
    processes.start([], hooks)
    assert processes.all_ready is not None
    processes.all_ready.set_result(None)  # the head's own workers are up
    head = Head()
    boxes = Boxes(settings, processes, log)
    boxes.head = processes.cluster = head  # type: ignore[assignment]
    return processes, boxes, head, hooks


def test_a_box_worker_retried_after_a_failed_start_counts_as_coming_until_the_cap() -> None:
    """Each failed start says a decode worker is gone while a retry is pending: requests
    must see one coming (else parked handoffs and waiting prompts fail). The crash window
    is too short for the policy to trip, so only max_crashes ends the tries: three starts,
    then the device is failed and, only then, nobody is coming."""

    async def main() -> tuple[ProcessManager, Head, Hooks]:
        processes, boxes, head, hooks = joined_box(crash_window_s=0.01)
        boxes.joined(AgentHello("b", (cpu(0),), "decode"), object())  # type: ignore[arg-type]
        for _ in range(200):  # back-offs of 0.5 s and 1 s, exits seen within 0.2 s
            await asyncio.sleep(0.05)
            if hooks.gone and not hooks.gone[-1]:
                break
        await processes.stop(timeout=1.0)
        return processes, head, hooks

    processes, head, hooks = asyncio.run(main())
    assert head.spawned == 3
    assert hooks.gone == [True, True, True, False]
    assert processes.failed_devices == {1}
    assert not processes.may_come_back("decode")


def test_a_box_that_leaves_during_the_back_off_stops_the_tries() -> None:
    """The box is lost while its device waits for a retry: no more starts (its next join
    starts one), the device is not marked failed, and nobody is coming any more."""

    async def main() -> tuple[ProcessManager, Head, Hooks, bool]:
        processes, boxes, head, hooks = joined_box(crash_window_s=60.0)
        boxes.joined(AgentHello("b", (cpu(0),), "decode"), object())  # type: ignore[arg-type]
        while not hooks.gone:
            await asyncio.sleep(0.05)
        coming = processes.may_come_back("decode")  # in the 0.5 s back-off
        head.boxes.clear()
        for _ in range(100):
            await asyncio.sleep(0.05)
            if len(hooks.gone) > 1:
                break
        await processes.stop(timeout=1.0)
        return processes, head, hooks, coming

    processes, head, hooks, coming = asyncio.run(main())
    assert coming
    assert head.spawned == 1
    assert hooks.gone == [True, False]
    assert processes.failed_devices == set()
