"""Moving a device between roles (prefill, decode, colocated) while serving: its worker
drains (routing skips it; what it runs finishes, what it prefilled is handed off), stops,
and a worker of the new role starts on the device. Prompts or handoffs that only the new
worker could take wait for it.

Most moves keep the worker: every role runs the same engine, and the roles differ in what
the router sends it, its batch limits, and whether decode workers map its KV pool. So the
move retunes it in place and its running requests go on where they are (no drain, no
reload): a former prefill worker still hands off what it prefilled, a former decode
worker finishes its streams. Two moves restart instead: to prefill when the worker's pool
cannot be handed off from (a CPU pool outside shared memory: one a non-prefill worker
made), and from prefill with batch.cuda_graphs (its new role decodes from graphs that
only a starting worker captures)."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import time
from collections import deque
from collections.abc import Awaitable, Callable

from appliance.admin.schema import Move
from appliance.core.roles import ROLES, Role
from appliance.core.tuning import batch_limits, check_for_mode
from appliance.planner.layout import roles_problem
from appliance.pools.supervisor import Supervisor
from appliance.pools.worker_handle import WorkerHandle
from appliance.workers.messages import Tune

START_TIMEOUT_S = 300.0
MOVES_KEPT = 5


class MoveError(ValueError):
    """A move that cannot be made; `status` is the HTTP status that says why."""

    def __init__(self, message: str, status: int = 409) -> None:
        super().__init__(message)
        self.status = status


class PoolMover:
    """Runs one move at a time and keeps the last few for the admin API."""

    def __init__(self, supervisor: Supervisor, drain_timeout_s: float) -> None:
        self.supervisor = supervisor
        self.drain_timeout_s = drain_timeout_s
        self.moves: deque[Move] = deque(maxlen=MOVES_KEPT)  # oldest first
        self._ids = itertools.count(1)
        self._task: asyncio.Task | None = None

    @property
    def running(self) -> Move | None:
        last = self.moves[-1] if self.moves else None
        return last if last is not None and last.finished_at is None else None

    def start(self, device: int, to: Role) -> Move:
        """Begin moving `device` to the `to` pool; raises MoveError when it cannot be."""
        worker = self._movable_worker(device, to)
        supervisor = self.supervisor
        move = Move(
            move_id=next(self._ids),
            device=device,
            from_role=worker.role,
            to_role=to,
            phase="draining",
            remaining=supervisor.busy_with(worker.worker_id),
            started_at=time.time(),
        )
        self.moves.append(move)
        if self.in_place(worker, to):
            self._switch(move, worker)
            return move
        supervisor.note(
            "move",
            f"move {move.move_id}: {worker.device} leaves the {worker.role} pool for {to}; "
            f"draining {move.remaining} requests",
        )
        drained = supervisor.drain(worker.worker_id, self.drain_timeout_s, move_progress(move))
        self._task = asyncio.create_task(self._run(move, worker, drained))
        return move

    def in_place(self, worker: WorkerHandle, to: str) -> bool:
        """Whether moving the worker to `to` keeps it (see the module's docstring)."""
        if worker.role == "prefill" and self.supervisor.settings.batch.cuda_graphs:
            return False
        return to != "prefill" or worker.shares_pool

    def in_place_moves(self) -> frozenset[tuple[int, str]]:
        """Every (device, role) move that would keep the device's worker now."""
        return frozenset(
            (worker.device_index, to)
            for worker in self.supervisor.workers.values()
            if worker.alive and not worker.stopping
            for to in ROLES
            if to != worker.role and self.in_place(worker, to)
        )

    def _switch(self, move: Move, worker: WorkerHandle) -> None:
        """Retune the worker for its new role and route by it from now on; a worker that
        now decodes for (or prefills to) the other pool is wired to it first."""
        supervisor = self.supervisor
        supervisor.processes.switch_role(worker, move.to_role)
        worker.inbox.put(
            Tune(**batch_limits(supervisor.settings.batch, worker.role, supervisor.tuning))
        )
        supervisor.note(
            "move",
            f"move {move.move_id}: {worker.device} turns from {move.from_role} to "
            f"{move.to_role} in place; its {move.remaining} requests go on",
        )
        supervisor.wiring.on_loaded(worker)  # a colocated worker wires to nothing
        supervisor.flow.submit_waiting()  # a new entry (or decode) worker may take them now
        supervisor.handoffs.retry_waiting()
        self._end(move)

    async def stop(self) -> None:
        """Abandon a running move (the appliance is stopping)."""
        if self._task is not None and not self._task.done():
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    def _movable_worker(self, device: int, to: Role) -> WorkerHandle:
        supervisor = self.supervisor
        if supervisor.settings.prefill_tp > 1 or supervisor.settings.decode_tp > 1:
            raise MoveError(
                "devices move between pools one at a time: with prefill_tp or decode_tp "
                "above 1 a worker spans several devices",
                400,
            )
        if self.running is not None:
            running = self.running
            raise MoveError(f"move {running.move_id} (device {running.device}) is still running")
        count = len(supervisor.topology.devices)
        if not 0 <= device < count:
            raise MoveError(f"no device {device}: this box has devices 0-{count - 1}", 400)
        worker = next(
            (w for w in supervisor.workers.values() if w.device_index == device and w.routable),
            None,
        )
        if worker is None:
            raise MoveError(f"device {device} has no worker serving right now")
        if worker.role == to:
            raise MoveError(f"device {device} is already in the {to} pool")
        self._check_layout_after(device, to)
        return worker

    def _check_layout_after(self, device: int, to: Role) -> None:
        """Refuse a move whose layout could not serve: nothing would prefill or decode, a
        prefill worker would have no decode worker, or colocated limits would clash."""
        roles = device_roles(self.supervisor)
        roles[device] = to
        problem = roles_problem(roles)
        if problem is not None:
            raise MoveError(f"moving device {device} to {to} would leave a layout where {problem}")
        waiting = self.supervisor.flow.awaiting_handoff()
        if waiting and "decode" not in roles:
            raise MoveError(
                f"device {device} is the last decode worker and {waiting} prefilled requests "
                "still wait to be handed off to it: try again when they have"
            )
        if to == "colocated":
            try:
                check_for_mode(self.supervisor.tuning, "colocated")
            except ValueError as exc:
                raise MoveError(f"device {device} cannot be colocated: {exc}") from None

    async def _run(self, move: Move, worker: WorkerHandle, drained: Awaitable[bool]) -> None:
        supervisor = self.supervisor
        supervisor.arriving[move.to_role] += 1  # prompts or handoffs wait for it meanwhile
        try:
            await self._steps(move, worker, drained)
        finally:
            supervisor.arriving[move.to_role] -= 1
            supervisor.on_gone(move.to_role)  # whoever still waits with nobody coming fails

    async def _steps(self, move: Move, worker: WorkerHandle, drained: Awaitable[bool]) -> None:
        supervisor = self.supervisor
        try:
            if not await drained:
                self._end(
                    move,
                    f"{move.remaining} requests still ran after {self.drain_timeout_s:.0f} s; "
                    f"the device stays in the {move.from_role} pool",
                )
                return
            move.phase = "stopping"
            await supervisor.retire(worker.worker_id)
            move.phase = "starting"
            await supervisor.add_worker(move.to_role, move.device, START_TIMEOUT_S)
            self._end(move)
        except Exception as exc:  # a worker that would not start: say so, keep serving
            error = str(exc)
            if move.phase == "starting":  # its old worker is gone: put the device back
                error += await self._restore(move)
            self._end(move, error)

    async def _restore(self, move: Move) -> str:
        try:
            await self.supervisor.add_worker(move.from_role, move.device, START_TIMEOUT_S)
        except Exception as exc:
            return f"; starting a {move.from_role} worker there again failed too: {exc}"
        return f"; the device is back in the {move.from_role} pool"

    def _end(self, move: Move, error: str | None = None) -> None:
        move.phase = "failed" if error else "done"
        move.error = error
        move.finished_at = time.time()
        took = move.finished_at - move.started_at
        outcome = f"failed: {error}" if error else f"done in {took:.1f} s"
        self.supervisor.note(
            "move", f"move {move.move_id} of device {move.device} to {move.to_role} {outcome}"
        )


def device_roles(supervisor: Supervisor) -> list[str | None]:
    """Each device's role, by index: its live worker's (None: it has none)."""
    roles: list[str | None] = [None] * len(supervisor.topology.devices)
    for worker in supervisor.workers.values():
        if worker.alive and not worker.stopping:
            for device in worker.devices:
                roles[device] = worker.role
    return roles


def move_progress(move: Move) -> Callable[[int], None]:
    """What a drain reports to: the move's count of requests its worker still has."""

    def progress(remaining: int) -> None:
        move.remaining = remaining

    return progress
