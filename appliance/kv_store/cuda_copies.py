"""A GPU pool's copies to and from the store's shared-memory arena: through a pinned
staging buffer, on a side stream.

Loading a stored block: its bytes go from the arena into a pinned staging row (a host
memcpy), then to the pool block on the side stream without blocking the CPU; `fence`
makes the compute stream wait for them on the GPU, so the worker goes on to schedule
and launch the prefill while they travel (the prefill's kernels start once they landed:
its first layer's attention reads them). Storing a block: a copy down on the side stream
(after the compute stream's work that made it) into a pinned row, then into the arena
slot. Only for a pool on a CUDA device (`for_pool` gives None otherwise: a CPU pool
copies directly, pool_blocks.py). Written for the GPU, exercised on it only: this box
has none.
"""

from __future__ import annotations

import torch

STAGING_BLOCKS = 64  # pinned rows: a long stored prefix's blocks in flight at once


class CudaBlockCopies:
    """A pinned ring of `rows` block-sized buffers and a side stream on the pool's GPU."""

    def __init__(self, pool: torch.Tensor, rows: int = STAGING_BLOCKS) -> None:
        self.pool = pool
        layers, two, _, block_size, heads, head_dim = pool.shape
        self.shape = (layers, two, block_size, heads, head_dim)  # one block of the pool
        nbytes = layers * two * block_size * heads * head_dim * pool.element_size()
        # [rows, block bytes], page-locked: DMA to and from the GPU without a bounce
        self.staging = torch.empty((rows, nbytes), dtype=torch.uint8, pin_memory=True)
        self.stream = torch.cuda.Stream(device=pool.device)
        self._done: list[torch.cuda.Event | None] = [None] * rows  # each row's last copy
        self._next = 0

    @classmethod
    def for_pool(cls, pool: torch.Tensor) -> CudaBlockCopies | None:
        return cls(pool) if pool.is_cuda else None

    def load(self, block: int, data: memoryview | bytes) -> None:
        """Start copying a stored block's bytes into pool block `block` (call `fence`
        before the step that reads it). The bytes are read before this returns."""
        if memoryview(data).nbytes != self.staging.shape[1]:
            raise ValueError(
                f"a stored block of {memoryview(data).nbytes} bytes does not fit a pool "
                f"block of {self.staging.shape[1]} bytes"
            )
        row = self._row()
        self.staging[row].copy_(torch.frombuffer(data, dtype=torch.uint8))
        # The block was free: a step still in flight on the compute stream may have used it.
        self.stream.wait_stream(torch.cuda.current_stream(self.pool.device))
        with torch.cuda.stream(self.stream):
            source = self.staging[row].view(self.pool.dtype).view(self.shape)
            self.pool[:, :, block].copy_(source, non_blocking=True)
            self._done[row] = self.stream.record_event()

    def fence(self) -> None:
        """The compute stream waits, on the GPU, for every load started: the CPU does not."""
        torch.cuda.current_stream(self.pool.device).wait_stream(self.stream)

    def store(self, block: int, out: memoryview) -> None:
        """Copy pool block `block` into `out` (an arena slot's payload): down into a
        pinned row on the side stream after the work that made the block, then a host
        memcpy. Returns once `out` holds it (the block is about to be reused)."""
        row = self._row()
        self.stream.wait_stream(torch.cuda.current_stream(self.pool.device))
        with torch.cuda.stream(self.stream):
            target = self.staging[row].view(self.pool.dtype).view(self.shape)
            target.copy_(self.pool[:, :, block], non_blocking=True)
            done = self.stream.record_event()
        done.synchronize()
        self._done[row] = None
        torch.frombuffer(out, dtype=torch.uint8).copy_(self.staging[row])

    def _row(self) -> int:
        """The next staging row, once its last copy has finished reading or writing it."""
        row = self._next
        self._next = (row + 1) % len(self._done)
        done = self._done[row]
        if done is not None:
            done.synchronize()
            self._done[row] = None
        return row
