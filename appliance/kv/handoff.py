"""Moving a request's KV blocks from one worker's pool to another's (the pull handoff).

The source tensor is the prefill worker's pool, shared once at start (shared memory on
the CPU, a CUDA IPC handle on GPUs); the destination is the decode worker's own pool.

One code path for both: start_copy copies and returns a HandoffCopy. On the CPU the bytes
have landed when it returns (no events). On CUDA the copy is queued on side streams of
the decode process (CopyStreams), behind the prefill worker's `ready` event (recorded
after each step that parks blocks, before they are announced), and start_copy returns
at once; the decode worker keeps the request out of its batch (PendingCopies) until the
copy's own event says it has landed, and only then are the source blocks released.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.util
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Generic, TypeVar

import torch

from appliance.kv.byte_ranges import block_runs

T = TypeVar("T")
# Looked up, not imported: CPU processes never load triton.
_TRITON_INSTALLED = importlib.util.find_spec("triton") is not None


@dataclass(frozen=True)
class KVShard:
    """One tensor-parallel shard's KV pool: KV heads head_start.. of the model.

    A worker of one process has a single shard with every head. `ready`, on CUDA: the
    owning prefill worker's handoff event, opened from its IPC handle; a copy out of
    this pool waits for it. Only a group's first shard has one: its step ends in the
    all-reduces every shard's K/V writes come before. `peer_enabled`: this process
    enabled its GPU's peer access to the pool's (another GPU: `reading_from`), so a
    kernel of its own may read the pool directly."""

    head_start: int
    tensor: torch.Tensor  # [layers, 2, num_blocks, block_size, shard_kv_heads, head_dim]
    ready: torch.cuda.Event | None = None
    peer_enabled: bool = False

    @property
    def heads(self) -> range:
        """The model's KV heads this shard holds."""
        return range(self.head_start, self.head_start + self.tensor.shape[-2])


@dataclass
class HandoffCopy:
    """A started copy of handed-off blocks: its bytes, and the events of the destination
    streams it ran on (none on the CPU, where it has landed already)."""

    nbytes: int
    landed: list[torch.cuda.Event] = field(default_factory=list)
    # The source pools stay mapped in this process until the copy has read them.
    keep: tuple[torch.Tensor, ...] = ()

    def done(self) -> bool:
        """Whether the blocks are in the destination pool (never blocks)."""
        return all(event.query() for event in self.landed)

    def wait(self) -> None:
        """Block until the blocks are in the destination pool."""
        for event in self.landed:
            event.synchronize()


class CopyStreams:
    """This process's side streams for handoff copies, one per CUDA device, made at first
    use: the copies run beside the model's steps on the default stream, not behind them."""

    def __init__(self) -> None:
        self._streams: dict[torch.device, torch.cuda.Stream] = {}

    def on(self, device: torch.device) -> torch.cuda.Stream:
        """The side stream of `device` (a CUDA device)."""
        if device not in self._streams:
            self._streams[device] = torch.cuda.Stream(device)
        return self._streams[device]


def start_copy(
    src: list[KVShard],
    src_ids: list[int],
    dst: list[KVShard],
    dst_ids: list[int],
    streams: CopyStreams | None = None,
) -> HandoffCopy:
    """Start copying blocks between pools split over KV heads in any two ways (a 2-shard
    prefill into a 1-shard decode gathers heads, the reverse splits them).

    On CUDA the copy waits for the sources' `ready` events and runs on `streams` (this
    process's side streams of every device involved): poll the result's done() before
    the blocks are read or the sources released. On the CPU it has landed on return."""
    _check_covers(src, dst)
    if not dst[0].tensor.is_cuda:
        return HandoffCopy(_copy_heads(src, src_ids, dst, dst_ids))
    streams = streams or CopyStreams()
    devices = sorted({shard.tensor.device for shard in [*src, *dst]}, key=str)
    ready = [shard.ready for shard in src if shard.ready is not None]
    with contextlib.ExitStack() as current:
        for device in devices:
            side = streams.on(device)
            # Blocks just allocated here may have been read by a step still queued.
            side.wait_stream(torch.cuda.current_stream(device))
            for event in ready:
                side.wait_event(event)
            # torch copies between GPUs on both devices' current streams (the source's
            # runs the copy): the side streams stand in for the model's on each.
            current.enter_context(torch.cuda.stream(side))
        moved = _copy_heads(src, src_ids, dst, dst_ids)
        landed = [_record(streams.on(d)) for d in {shard.tensor.device for shard in dst}]
    return HandoffCopy(moved, landed, tuple(shard.tensor for shard in src))


def _record(stream: torch.cuda.Stream) -> torch.cuda.Event:
    event = torch.cuda.Event()
    event.record(stream)
    return event


def copy_between_shards(
    src: list[KVShard], src_ids: list[int], dst: list[KVShard], dst_ids: list[int]
) -> int:
    """start_copy, then wait until the blocks have landed; returns bytes moved."""
    copy = start_copy(src, src_ids, dst, dst_ids)
    copy.wait()
    return copy.nbytes


def _copy_heads(
    src: list[KVShard], src_ids: list[int], dst: list[KVShard], dst_ids: list[int]
) -> int:
    """Each destination shard takes, from every source shard, the heads both hold, on the
    current streams; returns bytes moved."""
    moved = 0
    for to in dst:
        for origin in src:
            first = max(to.heads.start, origin.heads.start)
            last = min(to.heads.stop, origin.heads.stop)
            if first >= last:
                continue
            source, target = _heads(origin, first, last), _heads(to, first, last)
            kernel = copy_kernel(source, target, origin.peer_enabled)
            moved += copy_blocks(source, src_ids, target, dst_ids, kernel)
    return moved


class PendingCopies(Generic[T]):
    """Items (handed-off requests) whose blocks are still being copied, by key in arrival
    order; each leaves once its injected done() predicate holds (polled every step)."""

    def __init__(self) -> None:
        self._waiting: dict[int, tuple[T, Callable[[], bool]]] = {}

    def add(self, key: int, item: T, done: Callable[[], bool]) -> None:
        """Hold `item` until done() is true."""
        self._waiting[key] = (item, done)

    def landed(self) -> list[T]:
        """Remove and return, in arrival order, every item whose copy is done."""
        keys = [key for key, (_, done) in self._waiting.items() if done()]
        return [self._waiting.pop(key)[0] for key in keys]

    def __contains__(self, key: object) -> bool:
        return key in self._waiting

    def __len__(self) -> int:
        return len(self._waiting)


def _check_covers(src: list[KVShard], dst: list[KVShard]) -> None:
    """Every destination head must come from exactly one source shard."""
    have = sorted(h for shard in src for h in shard.heads)
    want = sorted(h for shard in dst for h in shard.heads)
    if have != want:
        raise ValueError(f"KV shards hold heads {have}, the destination wants {want}")


def _heads(shard: KVShard, first: int, last: int) -> torch.Tensor:
    return shard.tensor[..., first - shard.head_start : last - shard.head_start, :]


def copy_kernel(src: torch.Tensor, dst: torch.Tensor, peer_enabled: bool = False) -> str:
    """How copy_blocks moves blocks between these pools: "triton", one launch of
    triton_kv_copy for all blocks, where a kernel on dst's GPU may read src (the same
    GPU, or another whose peer access this process enabled: `peer_enabled`) and triton
    is installed; else "runs", a strided copy_ per run of consecutive ids."""
    return kernel_for(_gpu(src.device), _gpu(dst.device), peer_enabled, _TRITON_INSTALLED)


def kernel_for(
    src_gpu: int | None, dst_gpu: int | None, peer_enabled: bool, triton_installed: bool
) -> str:
    """copy_kernel's choice on plain data: the pools' GPU ordinals (None: not on a GPU)
    and whether peer access from dst's GPU to src's was enabled. That the GPUs could
    (can_device_access_peer) is not enough: a kernel reading a peer's memory without it
    enabled faults, where copy_ goes through the host."""
    if not triton_installed or src_gpu is None or dst_gpu is None:
        return "runs"
    return "triton" if src_gpu == dst_gpu or peer_enabled else "runs"


def _gpu(device: torch.device) -> int | None:
    return device.index if device.type == "cuda" else None  # a tensor's has its index


def copy_blocks(
    src: torch.Tensor,
    src_ids: list[int],
    dst: torch.Tensor,
    dst_ids: list[int],
    kernel: str | None = None,
) -> int:
    """dst[:, :, dst_ids] = src[:, :, src_ids] for pools [layers, 2, blocks, ...] of one
    dtype, the bytes as stored (ValueError for pools of two dtypes); returns bytes.

    `kernel`: "triton" or "runs" (copy_kernel's choice for these pools where None). On
    CUDA the copy is queued on the current streams (start_copy makes its side streams
    current); across GPUs it goes device to device (NVLink) where peer access exists.
    """
    if len(src_ids) != len(dst_ids):
        raise ValueError(f"copying {len(src_ids)} blocks into {len(dst_ids)}")
    if src.shape[:2] != dst.shape[:2] or src.shape[3:] != dst.shape[3:]:
        raise ValueError(f"KV pools differ in layout: {tuple(src.shape)} vs {tuple(dst.shape)}")
    if src.dtype != dst.dtype:
        # The blocks move as stored: converting would round (or widen) the prefill's K/V
        # into other numbers than the colocated answer reads; the pools' settings differ.
        raise ValueError(
            f"KV pools differ in dtype: {_name(src.dtype)} vs {_name(dst.dtype)}; give "
            "every worker the same kv_cache_dtype (and dtype)"
        )
    if (kernel or copy_kernel(src, dst)) == "triton":
        from appliance.model.layers import triton_kv_copy  # never imported on the CPU path

        with torch.cuda.device(dst.device) if dst.is_cuda else contextlib.nullcontext():
            triton_kv_copy.copy_blocks(src, src_ids, dst, dst_ids)
        return len(src_ids) * src[:, :, :1].numel() * src.element_size()
    with torch.cuda.device(dst.device) if dst.is_cuda else contextlib.nullcontext():
        # One strided copy per run of consecutive ids on both sides: a single pass over
        # the bytes, where index_select + index_copy_ would make two and a temporary.
        # On CUDA it is queued, not waited for; between GPUs with peer access (see
        # enable_peer_access) it goes device to device, else through the host.
        for src_start, dst_start, length in block_runs(src_ids, dst_ids):
            dst[:, :, dst_start : dst_start + length].copy_(
                src[:, :, src_start : src_start + length], non_blocking=True
            )
    return len(src_ids) * src[:, :, :1].numel() * src.element_size()


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def peer_access(src: torch.device, dst: torch.device) -> bool:
    """Whether dst's GPU can read src's memory directly (NVLink or PCIe P2P)."""
    if src.type != "cuda" or dst.type != "cuda":
        return False
    if src.index == dst.index:
        return True
    return torch.cuda.can_device_access_peer(dst.index, src.index)


def enable_peer_access(src: torch.device, dst: torch.device, pool: torch.Tensor) -> bool:
    """Let dst's GPU read src's memory directly (NVLink or PCIe P2P) where the GPUs allow
    it, when a decode worker is paired with a prefill worker's `pool` (on src) rather than
    at its first handoff; returns whether dst reads src directly."""
    if not peer_access(src, dst):
        return False
    if src != dst:
        # torch enables peer access at its first copy between two GPUs, for the copy's
        # source GPU to reach the destination's memory (at::cuda::get_p2p_access(source,
        # destination), kept in its own table). One element each way does both now: the
        # pool's into dst (the direction copy_ takes), and one of dst's into src, so that
        # dst's GPU may read src's memory, as a kernel of its own reading the pool does
        # (the Triton KV copy).
        here = torch.empty(1, dtype=pool.dtype, device=dst)
        here.copy_(pool.reshape(-1)[:1])
        torch.empty(1, dtype=pool.dtype, device=src).copy_(here)
        torch.cuda.synchronize(dst)
        torch.cuda.synchronize(src)
    return True


def reading_from(shards: list[KVShard], device: torch.device) -> list[KVShard]:
    """Another worker's pools as this process (its pool on `device`) reads them: peer
    access enabled for each on another GPU where the GPUs allow it, and marked so."""
    return [
        dataclasses.replace(
            shard,
            peer_enabled=shard.tensor.device != device
            and enable_peer_access(shard.tensor.device, device, shard.tensor),
        )
        for shard in shards
    ]
