"""The pool-wiring handshake: which decode worker holds which prefill worker's KV tensor.

A decode worker pulls a handed-off prompt's blocks straight from the prefill worker's KV
tensor, so it must hold that tensor first. Each (prefill, decode) pair is wired once,
when the second of the two has loaded: the supervisor asks the prefill worker to share
its pool (SharePool), the prefill worker pickles its tensor for that decode worker
(PoolShared: a shared-memory fd or a CUDA IPC handle), and the supervisor relays the
bytes unopened (PeerPool). A loaded worker takes work once it holds (decode) or has given
(prefill) every pool it needs. Before a prefill worker stops, every decode worker lets go
of its tensor (DropPeer, answered by PeerDropped).

Every pair is wired: a handoff prefers the best-linked decode worker but goes to another
one when that one is full, and any two devices can copy (through the host at worst). A
pair on two boxes shares the pool as its transfer agent registered it (kv/remote.py),
and the decode worker reads the blocks over the network; a tensor-parallel group's shards
live in several processes and are not registered, so a group is wired within its box only.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Mapping

from appliance.pools.worker_handle import WorkerHandle
from appliance.workers.messages import (
    DropPeer,
    PeerDropped,
    PeerPool,
    PoolShared,
    SharePool,
    ToWorker,
)

DROP_PEER_TIMEOUT_S = 10.0  # how long decode workers get to let go of a retiring pool

Send = Callable[[int | None, ToWorker], None]


class Wiring:
    """The handshake's state: each decode worker's `peers`, and the drops awaited."""

    def __init__(self, workers: Mapping[int, WorkerHandle], send: Send) -> None:
        self.workers = workers
        self.send = send
        self._drops: dict[tuple[int, int], asyncio.Future] = {}  # (decode, prefill)

    def on_loaded(self, worker: WorkerHandle) -> None:
        """Wire the worker that just loaded (or one that switched role in place) to every
        loaded worker of the other pool, where the decode worker lacks the tensor."""
        if worker.role not in ("decode", "prefill"):
            return  # a colocated worker hands nothing off
        for peer in self._peers_of(worker):
            prefill, decode = (peer, worker) if worker.role == "decode" else (worker, peer)
            if prefill.worker_id not in decode.peers:  # else held since a role switch
                self.send(prefill.worker_id, SharePool(decode.worker_id, prefill.box != decode.box))

    def on_pool_shared(self, message: PoolShared) -> None:
        """Relay a prefill worker's pickled pool to the decode worker it was made for."""
        decode = self.workers.get(message.consumer)
        if decode is None or not decode.alive or message.worker_id not in self.workers:
            return
        self.send(decode.worker_id, PeerPool(message.worker_id, message.data))
        decode.peers.add(message.worker_id)  # its inbox has the pool before any handoff

    def newly_wired(self) -> list[WorkerHandle]:
        """Loaded workers, not yet ready, that now hold or have given every pool."""
        return [w for w in self.workers.values() if w.loaded and not w.ready and self._wired(w)]

    def forget(self, prefill_id: int) -> None:
        """A prefill worker died: its decode peers drop its tensor (nobody waits)."""
        for decode in self.workers.values():
            if prefill_id in decode.peers:
                decode.peers.discard(prefill_id)
                self.send(decode.worker_id, DropPeer(prefill_id))

    async def release(self, prefill_id: int) -> None:
        """Ask every decode peer of a prefill worker about to stop to let go of its tensor,
        and wait until each has (at most DROP_PEER_TIMEOUT_S)."""
        loop = asyncio.get_running_loop()
        waits = []
        for decode in self.workers.values():
            if prefill_id in decode.peers:
                decode.peers.discard(prefill_id)
                if decode.alive:
                    dropped = self._drops[(decode.worker_id, prefill_id)] = loop.create_future()
                    self.send(decode.worker_id, DropPeer(prefill_id))
                    waits.append(dropped)
        if waits:
            await asyncio.wait(waits, timeout=DROP_PEER_TIMEOUT_S)

    def on_peer_dropped(self, message: PeerDropped) -> None:
        dropped = self._drops.pop((message.worker_id, message.peer), None)
        if dropped is not None and not dropped.done():
            dropped.set_result(None)

    def _peers_of(self, worker: WorkerHandle) -> list[WorkerHandle]:
        """Loaded workers of the other pool, taking part in handoffs, it can be wired to."""
        role = {"decode": "prefill", "prefill": "decode"}[worker.role]
        return [
            w
            for w in self.workers.values()
            if w.role == role and w.loaded and w.routable_soon and can_pair(w, worker)
        ]

    def _wired(self, worker: WorkerHandle) -> bool:
        if worker.role == "decode":
            return {p.worker_id for p in self._peers_of(worker)} <= worker.peers
        if worker.role == "prefill":
            return all(worker.worker_id in d.peers for d in self._peers_of(worker))
        return True


def can_pair(a: WorkerHandle, b: WorkerHandle) -> bool:
    """Whether a prefill and a decode worker can hand KV off: in one box always; across
    boxes only single-device workers (a group's shards are not registered for reads)."""
    return a.box == b.box or len(a.devices) == len(b.devices) == 1
