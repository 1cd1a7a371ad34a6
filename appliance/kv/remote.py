"""KV blocks between boxes, through NIXL (the transfer library vLLM, SGLang and Dynamo
use; UCX underneath: TCP here, RDMA where the NICs have it, NVLink/CUDA IPC inside a box).

Each process that takes part has one agent (`KVTransfer`). A worker whose pool others
read registers it once (`register`) and hands out a `RemotePool`: its agent's name and
metadata, the pool's address and shape. A worker on another box loads that metadata once
and reads a request's blocks straight into its own registered pool (`start_read`), as
kv/byte_ranges.py lists them; the owner's CPU does nothing but its agent's progress.

Why the binding rather than NIXL's `nixl_agent` wrapper: the wrapper starts the agent's
progress thread with a zero poll delay, so every agent spins a core even when idle (seen
on a 2-core box: every transfer and the model ran at half speed). The binding takes the
delay; with one, the thread sleeps on the worker's file descriptor and wakes for data.
The UCX settings must be in the environment before the first agent of a process loads
UCX: KVTransfer sets them from the cluster settings (`ucx_environment`).
"""

from __future__ import annotations

import contextlib
import os
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from appliance.kv.byte_ranges import ByteRange, PoolShape, copy_ranges
from appliance.kv.handoff import KVShard
from appliance.kv.remote_pool import RemotePool, find_nixl
from appliance.settings.cluster import ClusterSettings

__all__ = [
    "Copies",
    "KVTransfer",
    "RemoteCopy",
    "RemoteSource",
    "TransferError",
    "pool_shape",
    "ucx_environment",
]

PROGRESS_DELAY_US = 100_000  # the progress thread's poll timeout: it wakes for data sooner
# UCX over TCP emulates a READ in pieces of this many bytes; its default (8 KiB) made
# reads 5x slower on loopback.
TCP_SEGMENT = "256k"


class TransferError(RuntimeError):
    """A KV read between boxes failed: the peer is gone, cut off, or too slow."""


def pool_shape(tensor: torch.Tensor, head_start: int = 0) -> PoolShape:
    """The shape of a contiguous pool [layers, 2, blocks, block_size, heads, head_dim]."""
    if tensor.dim() != 6 or tensor.shape[1] != 2 or not tensor.is_contiguous():
        raise ValueError(
            f"not a contiguous KV pool [layers, 2, blocks, block_size, heads, head_dim]: "
            f"{tuple(tensor.shape)}"
        )
    layers, _, blocks, block_size, heads, head_dim = tensor.shape
    dtype = str(tensor.dtype).removeprefix("torch.")
    size = tensor.element_size()
    return PoolShape(layers, blocks, block_size, heads, head_dim, size, head_start, dtype)


def ucx_environment(settings: ClusterSettings) -> dict[str, str]:
    """The UCX variables for these settings (set them before the first agent starts)."""
    env = {"UCX_TCP_TX_SEG_SIZE": TCP_SEGMENT, "UCX_TCP_RX_SEG_SIZE": TCP_SEGMENT}
    for name, value in (
        ("UCX_TLS", settings.transports),
        ("UCX_NET_DEVICES", settings.interface),
        ("UCX_TCP_PORT_RANGE", settings.transfer_ports),
    ):
        if value:
            env[name] = value
    return env


@dataclass
class RemoteCopy:
    """A started read of blocks from another box: its bytes, and whether it has landed."""

    nbytes: int
    _transfer: KVTransfer | None = None
    _request: int | None = None  # the NIXL transfer request, None once settled
    _deadline: float = 0.0
    _landed: bool = field(default=False)
    failed: str | None = None  # why it failed: to start, or later

    def done(self) -> bool:
        """Whether the blocks are in the destination pool; never blocks. TransferError when
        the read failed or ran past the deadline, now or at any later call (the
        destination blocks then hold garbage, and may still be written: see settled())."""
        if self.failed is not None:
            raise TransferError(self.failed)
        if self._landed:
            return True
        assert self._transfer is not None and self._request is not None
        state = self._transfer.state(self._request)
        if self._end(state):
            if state == "done":
                self._landed = True
                return True
            self.failed = "the KV read from the other box failed: its peer is gone"
        elif time.monotonic() > self._deadline:
            # Not cancelled: NIXL's release of a busy read only asks UCX to cancel it, and
            # an RMA read may still land; settled() waits for it to end instead.
            self.failed = "the KV read from the other box ran past its deadline"
        if self.failed is not None:
            raise TransferError(self.failed)
        return False

    def settled(self) -> bool:
        """Whether no byte of this read can still land: it landed, or ended in an error
        (the peer gone, or forgotten: DropPeer). A read past its deadline writes on until
        it ends, so its destination blocks must stay out of use until then."""
        if self._request is None:
            return True
        assert self._transfer is not None
        self.failed = self.failed or "another read of its request failed"
        return self._end(self._transfer.state(self._request))

    def _end(self, state: str) -> bool:
        """Let go of the NIXL request if it has ended ('done' or 'error'); whether it has.
        One in error is not released: NIXL may have dropped a request whose peer went away
        itself, and a second release of it would be a double free (a handle leaks instead)."""
        if state == "busy":
            return False
        if state == "done":
            assert self._transfer is not None and self._request is not None
            self._transfer.release(self._request)
        self._request = None
        return True

    def wait(self, poll_s: float = 0.0005) -> None:
        """Block until the blocks have landed (TransferError as done())."""
        while not self.done():
            time.sleep(poll_s)


class KVTransfer:
    """This process's NIXL agent: registers its KV pool for readers on other boxes, and
    reads blocks from theirs. `name` must be unique in the cluster."""

    def __init__(self, name: str, settings: ClusterSettings) -> None:
        bind = find_nixl()
        if bind is None:
            raise TransferError(
                "KV transfer between boxes needs NIXL: pip install 'appliance[cluster]' "
                "(the nixl-cu12 wheel, which serves CPUs too)"
            )
        # UCX reads its settings from the environment when the backend starts.
        os.environ.update(ucx_environment(settings))
        self._bind = bind
        config = bind.nixlAgentConfig()
        config.useProgThread = True  # a pool others read needs progress while we compute
        config.useListenThread = False  # metadata travels with our own messages
        config.pthrDelay = PROGRESS_DELAY_US
        config.syncMode = bind.NIXL_THREAD_SYNC_STRICT
        self._agent: Any = bind.nixlAgent(name, config)
        self._ucx = self._agent.createBackend("UCX", {})
        self.name = name
        self.timeout_s = settings.transfer_timeout_s
        self._registered: list[Any] = []  # registration lists, for close()
        self._peers: dict[bytes, str] = {}  # metadata -> the agent name it loaded as

    def register(self, tensor: torch.Tensor, head_start: int = 0) -> RemotePool:
        """Let other boxes read `tensor` (a whole contiguous KV pool); register once."""
        shape = pool_shape(tensor, head_start)
        memory, device = _memory_of(tensor)
        regions = [(tensor.data_ptr(), shape.nbytes, device, "")]
        descs = self._bind.nixlRegDList(self._segment(memory), regions)
        self._agent.registerMem(descs, [self._ucx])
        self._registered.append(descs)
        metadata = self._agent.getLocalMD()
        return RemotePool(self.name, metadata, tensor.data_ptr(), shape, device, memory)

    def start_read(
        self, src: RemotePool, src_ids: list[int], dst: KVShard, dst_ids: list[int]
    ) -> RemoteCopy:
        """Start reading blocks `src_ids` of a pool on another box into `dst_ids` of our
        registered pool `dst` (the heads both hold); poll the copy's done(), which raises
        TransferError if the read fails, here or later (a peer that is gone)."""
        ranges = copy_ranges(src.shape, src_ids, pool_shape(dst.tensor, dst.head_start), dst_ids)
        nbytes = sum(r.length for r in ranges)
        if not ranges:
            return RemoteCopy(0, _landed=True)
        try:
            request = self._post(src, ranges, dst.tensor)
        except Exception as error:  # NIXL raises its own exception types, one per cause
            return RemoteCopy(nbytes, failed=f"the KV read from {src.agent} failed: {error}")
        # A failed read leaves the peer loaded: invalidating it would cancel every other
        # read from it. A worker that restarts has a new agent name; DropPeer forgets.
        return RemoteCopy(nbytes, self, request, time.monotonic() + self.timeout_s)

    def _post(self, src: RemotePool, ranges: list[ByteRange], dst: torch.Tensor) -> int:
        """Create and post the read of `ranges`; NIXL's exceptions pass through (a peer
        that is gone fails at loading its metadata or at posting)."""
        peer = self._peer(src)
        memory, device = _memory_of(dst)
        base = dst.data_ptr()
        # [ranges, (address, length, device)] on each side
        local = np.array([(base + r.dst, r.length, device) for r in ranges], dtype=np.uint64)
        remote = np.array(
            [(src.address + r.src, r.length, src.device) for r in ranges], dtype=np.uint64
        )
        request = self._agent.createXferReq(
            self._bind.NIXL_READ,
            self._bind.nixlXferDList(self._segment(memory), local),
            self._bind.nixlXferDList(self._segment(src.memory), remote),
            peer,
            "",
            [self._ucx],
        )
        try:
            self._agent.postXferReq(request, "")
        except Exception:
            self._agent.releaseXferReq(request)
            raise
        return request

    def state(self, request: int) -> str:
        """'done', 'busy' or 'error' for a posted read."""
        try:
            status = self._agent.getXferStatus(request)
        except Exception:  # e.g. nixlRemoteDisconnectError: the peer is gone
            return "error"
        if status == self._bind.NIXL_SUCCESS:
            return "done"
        return "busy" if status == self._bind.NIXL_IN_PROG else "error"

    def release(self, request: int) -> None:
        self._agent.releaseXferReq(request)

    def forget(self, pool: RemotePool) -> None:
        """Drop a peer's metadata (its box left, or its worker restarts with new memory)."""
        name = self._peers.pop(pool.metadata, None)
        if name is not None:
            with contextlib.suppress(Exception):  # a peer NIXL already dropped
                self._agent.invalidateRemoteMD(name)

    def close(self) -> None:
        """Unregister every pool this agent registered and drop every peer."""
        for name in list(self._peers.values()):
            with contextlib.suppress(Exception):  # a peer NIXL already dropped
                self._agent.invalidateRemoteMD(name)
        self._peers.clear()
        for descs in self._registered:
            self._agent.deregisterMem(descs, [self._ucx])
        self._registered.clear()

    def _peer(self, pool: RemotePool) -> str:
        if pool.metadata not in self._peers:
            self._peers[pool.metadata] = self._agent.loadRemoteMD(pool.metadata)
        return self._peers[pool.metadata]

    def _segment(self, memory: str) -> Any:
        return self._bind.DRAM_SEG if memory == "DRAM" else self._bind.VRAM_SEG


def _memory_of(tensor: torch.Tensor) -> tuple[str, int]:
    """NIXL's memory kind and device id of a tensor."""
    if tensor.is_cuda:
        return "VRAM", tensor.device.index or 0
    return "DRAM", 0


@dataclass(frozen=True)
class RemoteSource:
    """A handed-off request's source on another box: its owner's pools (one per
    tensor-parallel shard) and this process's agent, which reads them."""

    transfer: KVTransfer
    pools: tuple[RemotePool, ...]

    def start_copy(self, src_ids: list[int], dst: list[KVShard], dst_ids: list[int]) -> Copies:
        """Start reading the blocks into every destination shard, each from every source
        pool whose heads it shares (one read per pair that shares any)."""
        reads = [
            self.transfer.start_read(pool, src_ids, shard, dst_ids)
            for shard in dst
            for pool in self.pools
        ]
        return Copies(reads)


def check_source_dtype(source: list[KVShard] | RemoteSource, dtype: torch.dtype) -> None:
    """Raises ValueError where a handoff's source pools keep K/V in another dtype than
    `dtype` (the destination pool's): blocks move as stored, never converted, so a
    mismatch (workers given different kv_cache_dtype or dtype) is refused before any
    block is taken for it."""
    want = str(dtype).removeprefix("torch.")
    if isinstance(source, RemoteSource):
        found = {pool.shape.dtype for pool in source.pools} - {""}
    else:
        found = {str(shard.tensor.dtype).removeprefix("torch.") for shard in source}
    other = sorted(found - {want})
    if other:
        raise ValueError(
            f"the handed-off KV is {', '.join(other)} and this pool keeps {want}: give "
            "every worker the same kv_cache_dtype (and dtype)"
        )


@dataclass
class Copies:
    """Several started reads as one copy (HandoffCopy's interface: nbytes, done())."""

    reads: list[RemoteCopy]

    @property
    def nbytes(self) -> int:
        return sum(read.nbytes for read in self.reads)

    def done(self) -> bool:
        """Whether every read has landed; TransferError as soon as one has failed (every
        read polled first). Until settled(), the others may still write."""
        landed, failure = True, None
        for read in self.reads:
            try:
                landed = read.done() and landed
            except TransferError as error:
                failure = failure or error
        if failure is not None:
            raise failure
        return landed

    def settled(self) -> bool:
        """Whether no read can still write into the destination blocks."""
        return all([read.settled() for read in self.reads])  # a list: poll each one
