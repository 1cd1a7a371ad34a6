"""A worker pool's blocks as the store's bytes, and back.

A stored block is one block of every layer's K and V, in the pool's dtype, laid out
[layers, 2, block_size, kv_heads, head_dim] (the pool's own order with the block axis
taken out), so a worker whose namespace matches (same model, dtype, block size, shard)
loads it with one copy. The only module of the store that imports torch: the store
itself moves bytes.
"""

from __future__ import annotations

import warnings

import torch


def block_bytes(pool: torch.Tensor, block: int) -> torch.Tensor:
    """Block `block` of `pool` [layers, 2, blocks, block_size, kv_heads, head_dim] as
    contiguous bytes (a copy: the store must not hold a view the pool will overwrite)."""
    # [layers, 2, block_size, kv_heads, head_dim] -> flat uint8
    return pool[:, :, block].contiguous().view(torch.uint8).reshape(-1)


def load_block(pool: torch.Tensor, block: int, data: memoryview | bytes | bytearray) -> None:
    """Copy a stored block's bytes into block `block` of `pool` (on any device: a
    non-CPU pool takes them through a host tensor). ValueError when the bytes are not
    one block of this pool (another model or dtype slipped through the namespace)."""
    layers, two, _, block_size, heads, head_dim = pool.shape
    expected = layers * two * block_size * heads * head_dim * pool.element_size()
    if memoryview(data).nbytes != expected:
        raise ValueError(
            f"a stored block of {memoryview(data).nbytes} bytes does not fit a pool block "
            f"of {expected} bytes"
        )
    with warnings.catch_warnings():
        # A read-only buffer (a disk block's bytes) only ever read here.
        warnings.filterwarnings("ignore", message=".*not writable.*")
        flat = torch.frombuffer(data, dtype=pool.dtype)
    pool[:, :, block].copy_(flat.view(layers, two, block_size, heads, head_dim))


def store_block(pool: torch.Tensor, block: int, out: memoryview) -> None:
    """Copy block `block` of `pool` into `out` (a reserved arena slot's payload, mapped
    writable: one copy, the block's strided rows gathered straight into shared memory; a
    non-CPU pool's bytes come down synchronously). ValueError when `out` is not one block
    of this pool."""
    layers, two, _, block_size, heads, head_dim = pool.shape
    expected = layers * two * block_size * heads * head_dim * pool.element_size()
    if out.nbytes != expected:
        raise ValueError(f"a slot of {out.nbytes} bytes does not fit a pool block of {expected}")
    # [layers, 2, block_size, kv_heads, head_dim] over the slot's bytes
    slot = torch.frombuffer(out, dtype=pool.dtype).view(layers, two, block_size, heads, head_dim)
    slot.copy_(pool[:, :, block])


def copy_pool_block(pool: torch.Tensor, source: int, target: int) -> None:
    """Block `source`'s bytes into block `target` of the same pool (every layer's K and
    V): a partial block is reused as a copy the new sequence writes its own rows into."""
    pool[:, :, target].copy_(pool[:, :, source])
