"""How a worker's KV budget is shared between the target's pool and a draft model's.
Torch-free arithmetic (draft_loading.py applies it).

The draft's K/V cannot live in the target's pool: its layers, KV heads and head size
are its own, so its blocks have another shape. It gets a pool of its own with as many
blocks as the target's (same block size), so that every sequence the target can hold
the draft can hold too, and the two together cost what the target's pool alone was
sized to: the budget is split in proportion to their blocks' bytes."""

from __future__ import annotations


def split_pool(
    target_blocks: int, target_block_bytes: int, draft_block_bytes: int, taken_bytes: int = 0
) -> int:
    """The block count both pools get when a target pool of `target_blocks` gives up its
    bytes for the two of them, less `taken_bytes` more (on a GPU sized by its memory
    share: the draft's weights, loaded after that share was measured). Raises ValueError
    when nothing is left for a block of each."""
    budget = target_blocks * target_block_bytes - taken_bytes
    blocks = budget // (target_block_bytes + draft_block_bytes)
    if blocks < 1:
        raise ValueError(
            f"speculative.method=draft: the KV budget ({target_blocks} blocks of "
            f"{target_block_bytes} bytes, less {taken_bytes} bytes of draft weights) holds "
            f"no block of the target's and the draft's ({draft_block_bytes} bytes) together; "
            "raise kv.memory_mb (or kv.gpu_memory_utilization)"
        )
    return blocks
