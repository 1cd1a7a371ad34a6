"""Where worker processes come from: multiprocessing's fork server, preloaded with the
worker's modules (torch among them).

The server is a fresh interpreter (not the supervisor or agent, which run no model and
never import torch) that imports the worker once; each worker is a fork of it. A start,
or a crash's restart, then skips the ~2 s of CPU a fresh interpreter spends importing
torch, and the workers share those pages. The server makes no CUDA context, so each
worker makes its own, as a spawned one would. A worker watches the process that asked
for it (lifetime.die_with_supervisor), not the server, which is its parent."""

from __future__ import annotations

import multiprocessing
from multiprocessing import forkserver, resource_tracker
from multiprocessing.context import ForkServerContext

from appliance.workers.lifetime import ctrl_c_held

WORKER_MODULE = "appliance.workers.worker"  # what the server imports before any fork


def worker_context() -> ForkServerContext:
    """The multiprocessing context worker processes start from. Its server starts now
    (once a process) and imports in the background, ~1.5 s of CPU on a core the caller is
    not using, while the caller goes on: the first worker's fork waits only for what is
    left of that. `appliance serve` makes the context before its own imports for this."""
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload([WORKER_MODULE])
    # Its forks inherit its signal mask: with SIGINT blocked from its start, a Ctrl-C
    # reaches neither it mid-import nor a worker before the worker ignores it. The
    # resource tracker it needs starts first: its own start unblocks SIGINT in this thread.
    resource_tracker.ensure_running()
    with ctrl_c_held():
        forkserver.ensure_running()
    return context
