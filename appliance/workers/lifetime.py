"""A worker process lives no longer than the process that started it, and no shorter than
it decides: a supervisor killed outright (SIGKILL, OOM) would otherwise leave its workers
waiting on their inboxes for good, each holding a model and its KV pool; and Ctrl-C in a
terminal, which reaches the whole process group, would kill each worker mid-step (and,
while it starts, mid-import) when its supervisor or agent means to drain first."""

from __future__ import annotations

import ctypes
import os
import signal
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from multiprocessing.connection import wait
from multiprocessing.process import BaseProcess
from typing import Protocol

PR_SET_PDEATHSIG = 1


def die_with_parent(parent_pid: int) -> None:
    """Ask Linux to kill this process when `parent_pid` (its parent) exits, however it
    ends; exit at once if it is already gone."""
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL) != 0:
            raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG) failed")
    if os.getppid() != parent_pid:  # the parent died before the request took effect
        os._exit(1)


def die_with_supervisor(supervisor: BaseProcess) -> None:
    """Exit as soon as `supervisor` (multiprocessing's parent_process(), which forked this
    process through its fork server) has exited, however it ended. The fork server is this
    process's parent, and it outlives a supervisor killed outright as long as any process
    it forked holds its end of the server's pipe, so Linux's parent-death signal alone
    would keep the workers waiting on their inboxes for good: a thread watches the
    supervisor's sentinel (the pipe its exit closes) instead."""
    sentinel = supervisor.sentinel

    def watch() -> None:
        wait([sentinel])
        os._exit(1)

    threading.Thread(target=watch, name="supervisor-watch", daemon=True).start()


class Startable(Protocol):
    def start(self) -> None: ...


@contextmanager
def ctrl_c_held() -> Iterator[None]:
    """SIGINT blocked in this thread meanwhile, and so in every process started
    meanwhile, which inherits the mask (through exec too): a child's Ctrl-C waits until
    its ignore_ctrl_c drops it. The caller's own pending SIGINT is delivered at the end."""
    blocked = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, blocked)


def start_holding_ctrl_c(process: Startable) -> None:
    """Start a worker process with SIGINT held: a fork inherits the fork server's held
    mask (fork_server.worker_context), and a server this start must start again (the
    last one died) inherits this one. A Ctrl-C while it starts waits until ignore_ctrl_c
    drops it."""
    with ctrl_c_held():
        process.start()


def ignore_ctrl_c() -> None:
    """A worker's first instruction: ignore SIGINT (its spawner stops it), then unblock
    what ctrl_c_held blocked in its fork server (whose mask a fork inherits), dropping a
    Ctrl-C that came meanwhile."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
