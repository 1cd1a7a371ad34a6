"""WorkerHandles of workers that were never started, for the routing and handoff tests:
a handle's place in the pools and its last reported load, no process behind it."""

from __future__ import annotations

from typing import Any

from appliance.pools.worker_handle import WorkerHandle, WorkerView


def worker_handle(
    worker_id: int,
    role: str,
    *,
    device: int | None = None,
    free: int = 0,
    inbox: Any = None,
    ready: bool = False,
) -> WorkerHandle:
    """Worker `worker_id` of `role` on CPU device `device` (its id unless given) that
    reported `free` free KV blocks; `ready`: loaded and taking work, its pool all free;
    `inbox` what the messages sent to it go to (none unless given)."""
    device = worker_id if device is None else device
    handle = WorkerHandle(worker_id, role, device, f"cpu{device}", (device,), inbox, None)
    handle.num_free = free
    if ready:
        handle.loaded = handle.ready = True
        handle.num_blocks = free
    return handle


def worker_view(worker_id: int, role: str = "prefill", **fields: Any) -> WorkerView:
    """A ready CPU worker's view as /metrics and the admin API read it (8 blocks, all
    free, nothing queued), with `fields` set over those defaults."""
    base: dict[str, Any] = dict(
        worker_id=worker_id,
        role=role,
        device="cpu",
        ready=True,
        alive=True,
        waiting=0,
        running=0,
        num_free_blocks=8,
        num_blocks=8,
        restarts=0,
        phase="ready",
        device_index=worker_id,
        pid=None,
        tokens_out=0,
    )
    return WorkerView(**(base | fields))
