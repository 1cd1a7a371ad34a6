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
from multiprocessing.context import ForkServerContext

WORKER_MODULE = "appliance.workers.worker"  # what the server imports before any fork


def worker_context() -> ForkServerContext:
    """The multiprocessing context worker processes start from."""
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload([WORKER_MODULE])
    return context
