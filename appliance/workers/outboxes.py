"""Worker -> supervisor messages: one pipe per worker, read by one supervisor thread.

Not one queue shared by all workers: a worker killed (SIGKILL, out of memory) while it
held a shared queue's write lock would leave the lock taken and silence every other
worker. A pipe has one writer; a dead writer only ends its own pipe (EOF).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from multiprocessing.connection import wait
from typing import Any, Protocol, cast

from appliance.workers.messages import FromWorker

WAKE_EVERY_S = 0.2  # how soon a newly added pipe is read


class Pipe(Protocol):
    """One worker's end of its messages: a multiprocessing Connection, or (a worker on
    another box) its link to the head (appliance/cluster/channel.py's Link)."""

    def send(self, obj: Any) -> None: ...

    def recv(self) -> Any: ...

    def fileno(self) -> int: ...

    def close(self) -> None: ...


class Outbox:
    """The worker's end: `put` sends one message."""

    def __init__(self, connection: Pipe) -> None:
        self._connection = connection

    def put(self, message: FromWorker) -> None:
        self._connection.send(message)


class OutboxReader:
    """Reads every worker's pipe on a thread and hands each message to `deliver`."""

    def __init__(
        self, deliver: Callable[[FromWorker], None], ends_when_empty: bool = False
    ) -> None:
        self._deliver = deliver
        self._ends_when_empty = ends_when_empty  # the thread ends once its pipes have
        self._pipes: dict[int, Pipe] = {}  # worker id -> the reading end
        self._lock = threading.Lock()
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def sibling(self) -> OutboxReader:
        """Another reader delivering to the same place, whose thread ends once the pipes
        given to it have (a remote worker's own: a message cut mid-way by the network must
        not hold up every other worker's)."""
        return OutboxReader(self._deliver, ends_when_empty=True)

    @property
    def running(self) -> bool:
        return self._thread.is_alive()

    def add(self, worker_id: int, connection: Pipe) -> None:
        with self._lock:
            self._pipes[worker_id] = connection

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stopping.set()
        self._thread.join(timeout=2 * WAKE_EVERY_S + 1)
        with self._lock:
            for connection in self._pipes.values():
                connection.close()
            self._pipes.clear()

    def _run(self) -> None:
        while not self._stopping.is_set():
            with self._lock:
                pipes = {c: w for w, c in self._pipes.items()}
            if not pipes and self._ends_when_empty:
                return
            # `wait` returns those of the objects it was given that are ready: pipes here
            # (typeshed widens its return to any waitable object).
            waiting: list[Any] = list(pipes)  # each has its fileno(), as wait needs
            ready = cast(list[Pipe], wait(waiting, timeout=WAKE_EVERY_S))
            for connection in ready:
                self._read(pipes[connection], connection)

    def _read(self, worker_id: int, connection: Pipe) -> None:
        try:
            message = connection.recv()
        except (EOFError, OSError):  # the worker exited: its pipe is done
            with self._lock:
                self._pipes.pop(worker_id, None)
            connection.close()
            return
        self._deliver(message)
