"""The pools' worker processes: spawning them, the transport to their inboxes, watching
that they live, restarting the ones that crash (the restart policy's back-off), stopping.

What a worker's exit means for the requests it held and for the other pool is not
decided here: the supervisor is told through `ProcessHooks` and decides.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections import Counter
from collections.abc import Iterable
from typing import Any, Protocol

from appliance.cluster.head import LOST, ClusterHead
from appliance.core.events import Event, EventKind
from appliance.core.restart_policy import RestartPolicy
from appliance.core.roles import Role
from appliance.core.stall import StallAction, stall_action
from appliance.pools.worker_handle import Inbox, WorkerHandle, WorkerProcess
from appliance.settings.config import Settings
from appliance.topology.devices import Device, Topology
from appliance.workers.fork_server import worker_context
from appliance.workers.lifetime import ignore_ctrl_c, start_holding_ctrl_c
from appliance.workers.messages import Shutdown, ToWorker
from appliance.workers.outboxes import Outbox, OutboxReader, Pipe

WATCH_INTERVAL_S = 0.2  # how often worker processes are checked for being alive


def _run_worker(*args: Any) -> None:
    """A worker process's entry (workers/worker.py's run_worker), imported in the workers'
    fork server: the supervisor runs no model and so never imports torch (a second off
    every start, and its memory), and relays the workers' pickled pools as bytes."""
    # Ctrl-C in a terminal reaches the whole process group: the supervisor drains and
    # then stops its workers; a worker that took it would die mid-stream (and at start,
    # mid-import, with a traceback) and be counted as a crash.
    ignore_ctrl_c()
    from appliance.workers.worker import run_worker

    run_worker(*args)


class ProcessHooks(Protocol):
    """What the process manager asks of, and tells, the supervisor."""

    def settings_for(self, role: Role) -> Settings:
        """The settings (with the live tuning) a worker of `role` starts with."""
        ...

    def has_work(self, worker: WorkerHandle) -> bool:
        """Whether requests wait on this worker (a silent one is then stalled)."""
        ...

    def holding(self, worker_id: int) -> list[int]:
        """The ids of the requests that still need this worker (for fault events)."""
        ...

    def on_exit(self, worker: WorkerHandle) -> None:
        """A serving worker's process exited (a restart, if any, is already scheduled)."""
        ...

    def on_gone(self, role: Role) -> None:
        """A worker of `role` will not come (back): it crashed too often or failed to
        start. Requests waiting for one may have nobody left."""
        ...

    async def release(self, worker: WorkerHandle) -> None:
        """A live worker is about to stop: let the others let go of its KV tensor."""
        ...

    def note(self, kind: EventKind, message: str, **fault: Any) -> Event:
        """Record an event for the admin API; `fault`: EventLog.note's fault fields."""
        ...


class ProcessManager:
    """Owns every worker process and the handle the rest of the supervisor reads it by."""

    def __init__(self, settings: Settings, topology: Topology, reader: OutboxReader) -> None:
        self.settings = settings
        self.topology = topology
        self.workers: dict[int, WorkerHandle] = {}
        self.failed_devices: set[int] = set()  # crashed too often: no more restarts
        recovery = settings.recovery
        self.restart_policy = RestartPolicy(recovery.max_crashes, recovery.crash_window_s)
        # Starts pending per role (a crashed worker's restart, a joined box's device being
        # started or tried again): requests wait for them, not fail. A count, as two may
        # overlap on one device (a box rejoining while its crashed worker's restart waits).
        self._restarting: Counter[str] = Counter()
        # Roles a pool move is bringing to a device: requests wait for them, not fail.
        self.arriving: Counter[str] = Counter()
        self._ids = itertools.count()
        self._ctx = worker_context()  # forks of a server that imported the worker once
        self._reader = reader
        self._hooks: ProcessHooks | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._watchdog: asyncio.Task | None = None
        self._tasks: set[asyncio.Task] = set()  # restarts and joins in progress
        self.all_ready: asyncio.Future | None = None  # the first workers, all ready
        self.cluster: ClusterHead | None = None  # other boxes' agents, when they may join
        self._remote_readers: list[OutboxReader] = []  # one per worker on another box
        # The last action taken about each worker's current stall (core/stall.py).
        self._stall_actions: dict[int, StallAction] = {}

    @property
    def hooks(self) -> ProcessHooks:
        if self._hooks is None:
            raise RuntimeError("the process manager is not started: call start() first")
        return self._hooks

    @property
    def loop(self) -> asyncio.AbstractEventLoop:
        """The loop start() runs on: every worker, reader and timer lives on it."""
        if self._loop is None:
            raise RuntimeError("the process manager is not started: call start() first")
        return self._loop

    def start(self, layout: list[tuple[Role, tuple[int, ...]]], hooks: ProcessHooks) -> None:
        """Spawn a worker per (role, devices) of `layout`; `all_ready` resolves once every
        one is marked ready, or fails if one exits first."""
        self._hooks = hooks
        self._loop = asyncio.get_running_loop()
        self.all_ready = self._loop.create_future()
        for role, group in layout:
            self.spawn(role, group)
        self._reader.start()
        self._watchdog = asyncio.create_task(self._watch())

    def spawn(self, role: Role, group: int | tuple[int, ...]) -> WorkerHandle:
        """Start a worker process of `role` on a device or a tensor-parallel group (on
        another box, through its agent)."""
        group = (group,) if isinstance(group, int) else group
        worker_id = next(self._ids)
        devices = tuple(self.topology.devices[i] for i in group)
        name = "+".join(d.name for d in devices)  # a tensor-parallel group names them all
        settings = self.hooks.settings_for(role)
        inbox: Inbox
        process: WorkerProcess
        if devices[0].box:  # its agent starts it, and it dials in (cluster/head.py)
            assert self.cluster is not None  # only a cluster has devices off the head's box
            inbox, process = self.cluster.spawn(worker_id, role, settings, devices)
            name = f"{devices[0].box}/{name}"
        else:
            inbox, process = self._spawn_here(worker_id, role, settings, devices)
        cores = devices[0].cores
        worker = WorkerHandle(
            worker_id, role, group[0], name, cores, inbox, process, group, devices[0].box
        )
        worker.shares_pool = role == "prefill" or devices[0].kind == "cuda"
        self.workers[worker_id] = worker
        return worker

    def _spawn_here(
        self, worker_id: int, role: Role, settings: Settings, devices: tuple[Device, ...]
    ) -> tuple[Inbox, WorkerProcess]:
        """A worker process on this box, with its inbox queue and outbox pipe."""
        inbox = self._ctx.Queue()
        receiving, sending = self._ctx.Pipe(duplex=False)
        process = self._ctx.Process(
            target=_run_worker,
            args=(worker_id, role, settings, devices, inbox, Outbox(sending)),
            daemon=True,
        )
        start_holding_ctrl_c(process)
        sending.close()  # the worker holds it now: its exit closes the pipe
        self._reader.add(worker_id, receiving)
        return inbox, process

    def attach(self, worker_id: int, connection: Pipe) -> None:
        """A worker on another box dialled in: read its reports from that connection, on
        a thread of its own."""
        reader = self._reader.sibling()
        reader.add(worker_id, connection)
        reader.start()
        # Readers of remote workers that have exited have ended: let them go.
        self._remote_readers = [r for r in self._remote_readers if r.running] + [reader]

    def send(self, worker_id: int | None, message: ToWorker) -> None:
        """Put a message in a worker's inbox; a worker that is gone is skipped."""
        if worker_id is not None and worker_id in self.workers:
            self.workers[worker_id].inbox.put(message)

    # A worker's identity and lifecycle (its role, loaded, ready, alive, draining,
    # stopping...) change here only; the other parts call these methods
    # (tests/pools/test_worker_handle_ownership.py holds the rule).

    def mark_loaded(self, worker: WorkerHandle, num_blocks: int, shard_pids: list[int]) -> None:
        """The worker said Ready: its model is loaded, its KV pool of `num_blocks` blocks
        allocated; `shard_pids`: its other shards' processes. It takes work once wired."""
        worker.pool_allocated(num_blocks)
        worker.shard_pids = shard_pids
        worker.loaded = True

    def start_draining(self, worker_id: int) -> None:
        """Route nothing new to the worker (its device is moving to another pool)."""
        self.workers[worker_id].draining = True

    def stop_draining(self, worker_id: int) -> None:
        """The worker takes work again (its drain ran out of time: the move is off)."""
        self.workers[worker_id].draining = False

    def switch_role(self, worker: WorkerHandle, role: Role) -> None:
        """The worker serves as `role` from now on, in place (a pool move that keeps it)."""
        worker.role = role

    def mark_ready(self, worker: WorkerHandle) -> None:
        """The worker is loaded and wired: it takes work, and whoever waits for it goes on."""
        worker.ready = True
        if worker.started is not None and not worker.started.done():
            worker.started.set_result(None)
        ready = self.all_ready
        if ready is not None and not ready.done() and all(w.ready for w in self.workers.values()):
            ready.set_result(None)

    def may_come_back(self, role: Role) -> bool:
        """A worker of `role` is starting, restarting after a crash, or on its way by a
        pool move."""
        starting = any(w.role == role and w.routable_soon for w in self.workers.values())
        return starting or self._restarting[role] > 0 or self.arriving[role] > 0

    # ------------------------------------------------------------ watching

    async def _watch(self) -> None:
        """Every WATCH_INTERVAL_S: a worker whose process exited is handled within that
        time; one that has work but has reported no step for too long is acted on once
        (core/stall.py: killed here, its box marked lost on another box)."""
        while True:
            await asyncio.sleep(WATCH_INTERVAL_S)
            now = time.monotonic()
            for worker in list(self.workers.values()):
                if not worker.alive or worker.stopping:
                    continue
                if not worker.process.is_alive():
                    self._on_exit(worker)
                else:
                    self._check_stall(worker, now)

    def _check_stall(self, worker: WorkerHandle, now: float) -> None:
        stalled = self._stalled_for(worker, now)
        if stalled == 0.0:  # it reported a step (or has nothing to do): a new stall may come
            self._stall_actions.pop(worker.worker_id, None)
        done = self._stall_actions.get(worker.worker_id, StallAction.NONE)
        grace = self.settings.cluster.heartbeat_timeout_s
        timeout = self.settings.recovery.stall_timeout_s
        action = stall_action(stalled, timeout, bool(worker.box), done, grace)
        if action is StallAction.NONE:
            return
        self._stall_actions[worker.worker_id] = action
        cause = f"no step reported for {stalled:.0f} s with work to do"
        fields = {"worker": worker.worker_id, "box": worker.box, "cause": cause}
        if action is StallAction.KILL:
            where = f" (asking box {worker.box!r} to)" if worker.box else ""
            message = f"worker {worker.worker_id} stalled: killing it{where}"
            requests = self.hooks.holding(worker.worker_id)
            self.hooks.note("worker", message, fault="stall", requests=requests, **fields)
            worker.process.kill()  # on another box: a message its agent carries out
            self.hooks.note("worker", f"killed worker {worker.worker_id}", fault="kill", **fields)
            return
        # Its agent answers the heartbeat but the kill it was asked for has not happened:
        # the box is marked lost once, and its workers' requests go on elsewhere.
        message = (
            f"worker {worker.worker_id} on box {worker.box!r} still stalled {grace:.0f} s "
            "after its kill was asked for: marking the box lost"
        )
        self.hooks.note("worker", message)
        assert self.cluster is not None  # a worker on another box came through it
        self.cluster.lose(worker.box, f"its worker {worker.worker_id} stalled ({cause})")

    def _stalled_for(self, worker: WorkerHandle, now: float) -> float:
        """How long a worker that has work to run has not reported a step (0 if idle)."""
        has_work = worker.running > 0 or self.hooks.has_work(worker)
        if not (worker.ready and has_work):
            return 0.0
        return now - max(worker.last_report, worker.last_work)

    def _on_exit(self, worker: WorkerHandle) -> None:
        worker.alive = False
        self._stall_actions.pop(worker.worker_id, None)
        code = worker.process.exitcode
        cause = "its box was lost" if worker.box and code == LOST else f"exit code {code}"
        self.hooks.note(
            "worker",
            f"worker {worker.worker_id} ({worker.role}, {worker.device}) exited with code {code}",
            fault="worker_exit",
            worker=worker.worker_id,
            box=worker.box,
            cause=cause,
            requests=self.hooks.holding(worker.worker_id),
        )
        error = RuntimeError(f"worker {worker.worker_id} exited while starting")
        assert self.all_ready is not None  # start() set it before spawning any worker
        if not self.all_ready.done():  # a failed start is reported, not retried
            self.all_ready.set_exception(error)
            return
        if worker.started is not None and not worker.started.done():
            worker.started.set_exception(error)  # whoever started it decides what next
        elif not worker.draining:  # a moving device's successor is started by the move
            self._restart_later(worker)  # first: requests may wait for it to come back
        self.hooks.on_exit(worker)

    # ------------------------------------------------------------ restarts

    def _restart_later(self, worker: WorkerHandle, failed_starts: int = 0) -> None:
        if not self._box_joined(worker.device_index):
            # Its workers start again when the box rejoins (Boxes.joined).
            self.hooks.note("worker", f"box {worker.box!r} is gone: {worker.device} waits for it")
            self.hooks.on_gone(worker.role)
            return
        delay = self._next_start_in(worker.devices, worker.device, failed_starts)
        if delay is None:
            self.hooks.on_gone(worker.role)
            return
        self._restarting[worker.role] += 1
        self.track(asyncio.create_task(self._restart(worker, worker.role, delay, failed_starts)))

    def _next_start_in(
        self, devices: tuple[int, ...], name: str, failed_starts: int
    ) -> float | None:
        """Count a crash (or a failed start) of the worker on `devices`: seconds until it
        is started again (the restart policy's back-off), or None once it failed too often
        (then the devices are marked failed, a group as one)."""
        delay = self.restart_policy.on_crash(devices[0], time.monotonic())
        if failed_starts >= self.settings.recovery.max_crashes:  # however slowly it fails
            delay = None
        if delay is None:
            self.failed_devices.update(devices)
            self.hooks.note("worker", f"{name} crashed too often: no more restarts")
        return delay

    def _box_joined(self, index: int) -> bool:
        """Whether device `index` is on this box or on one whose agent is joined."""
        box = self.topology.devices[index].box
        return not box or (self.cluster is not None and self.cluster.has_box(box))

    def _taken(self, index: int) -> bool:
        """Whether a live worker has device `index`."""
        return any(w.alive and index in w.devices for w in self.workers.values())

    def forget_exited(self, devices: Iterable[int]) -> None:
        """Drop the exited workers of these devices and their failed mark (a lost box's,
        as it rejoins: workers start there again, and a handle left behind would keep
        /health `degraded`)."""
        wanted = set(devices)
        self.failed_devices.difference_update(wanted)
        for worker in list(self.workers.values()):
            if not worker.alive and wanted.intersection(worker.devices):
                del self.workers[worker.worker_id]

    def track(self, task: asyncio.Task) -> None:
        """A task starting workers (a restart, a box's join): stop() cancels it."""
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _restart(
        self, dead: WorkerHandle, role: Role, delay: float, failed_starts: int
    ) -> None:
        """Start a worker of the dead one's role on its device, after `delay`; `role` was
        counted in `_restarting`, and is taken off here."""
        await asyncio.sleep(delay)
        device = dead.device_index
        taken = any(w.device_index == device and w.alive for w in self.workers.values())
        # A pool move that took the device over forgets the dead handle; a retry after a
        # failed start finds it forgotten by the start before (and must still run).
        forgotten = failed_starts == 0 and dead.worker_id not in self.workers
        if forgotten or taken:
            self._restarting[role] -= 1
            return
        self.workers.pop(dead.worker_id, None)
        try:
            worker = await self.add_worker(
                role, dead.devices, self.settings.recovery.start_timeout_s
            )
        except Exception as exc:  # it died loading, or could not even be spawned
            self._restarting[role] -= 1  # first: the retry's back-off decides who waits
            self.hooks.note("worker", f"restarting {dead.device} failed: {exc}")
            self._restart_later(dead, failed_starts + 1)
            return
        self._restarting[role] -= 1
        worker.restarts = dead.restarts + 1
        self.hooks.note(
            "worker",
            f"worker {worker.worker_id} restarted on {worker.device} (after worker "
            f"{dead.worker_id})",
            fault="restart",
            worker=worker.worker_id,
            box=worker.box,
            cause=f"worker {dead.worker_id} exited with code {dead.process.exitcode}",
        )

    # ------------------------------------------------------------ joining and leaving

    async def add_worker(
        self, role: Role, devices: int | tuple[int, ...], timeout: float
    ) -> WorkerHandle:
        """Start a worker of `role` while the pools serve; returns once it takes requests.
        Raises RuntimeError if it exits or is not ready within `timeout`."""
        worker = self.spawn(role, devices)
        worker.started = self.loop.create_future()
        try:
            async with asyncio.timeout(timeout):  # not wait_for: see request_flow.next_item
                await asyncio.shield(worker.started)
        except TimeoutError:
            await self.retire(worker.worker_id)
            self.hooks.on_gone(role)
            message = f"worker {worker.worker_id} not ready within {timeout:.0f} s"
            raise RuntimeError(message) from None
        except RuntimeError:
            self.workers.pop(worker.worker_id, None)
            self.hooks.on_gone(role)
            raise
        self.hooks.note("worker", f"worker {worker.worker_id} ({role}) serves on {worker.device}")
        return worker

    async def start_retrying(self, role: Role, index: int) -> None:
        """Start a worker of `role` on device `index` while the pools serve (a joined box's
        device). A start that fails (the worker died loading, or was not ready in time) is
        tried again after the restart policy's back-off, as a crashed worker's restart is,
        until the device fails too often; meanwhile a worker of `role` counts as coming
        (may_come_back), so requests wait for it rather than fail. The tries stop where
        the device's box is gone (its next join starts one) or a live worker has the
        device (a join while this one waited started one); then those waiting are told."""
        timeout = self.settings.recovery.start_timeout_s
        # Counted before the first try: a failed start tells those waiting (on_gone) while
        # a retry may still come.
        self._restarting[role] += 1
        gave_up = False
        try:
            for failed_starts in itertools.count(1):
                try:
                    await self.add_worker(role, index, timeout)
                    return
                except RuntimeError as error:
                    self.hooks.note("worker", f"a worker for device {index} did not start: {error}")
                if not self._wants_start(index):
                    break
                name = self.topology.devices[index].name
                delay = self._next_start_in((index,), name, failed_starts)
                if delay is None:
                    break
                await asyncio.sleep(delay)
                if not self._wants_start(index):
                    break
            gave_up = True
        finally:
            self._restarting[role] -= 1
        if gave_up:
            self.hooks.on_gone(role)

    def _wants_start(self, index: int) -> bool:
        """Whether device `index` still needs a worker started: its box is joined and no
        live worker has it."""
        return self._box_joined(index) and not self._taken(index)

    async def retire(self, worker_id: int, timeout: float = 10.0) -> None:
        """Stop a worker and forget it. A prefill worker stops only after the decode
        workers have let go of its KV tensor: a CUDA tensor's owner must outlive the
        processes that mapped it."""
        worker = self.workers[worker_id]
        worker.draining = worker.stopping = True
        await self.hooks.release(worker)
        worker.inbox.put(Shutdown())
        await asyncio.to_thread(worker.process.join, timeout)
        if worker.process.is_alive():
            worker.process.kill()
            await asyncio.to_thread(worker.process.join, timeout)
        del self.workers[worker_id]

    async def stop(self, timeout: float = 10.0) -> None:
        """Ask every worker to stop, then make sure each has."""
        if self._watchdog is not None:
            self._watchdog.cancel()
        for task in list(self._tasks):
            task.cancel()
        for worker in self.workers.values():
            worker.inbox.put(Shutdown())
        deadline = time.monotonic() + timeout
        for worker in self.workers.values():
            await asyncio.to_thread(worker.process.join, max(0.0, deadline - time.monotonic()))
            if worker.process.is_alive():
                worker.process.kill()
        for reader in [self._reader, *self._remote_readers]:
            await asyncio.to_thread(reader.stop)
        if self.cluster is not None:
            self.cluster.stop()
