"""copy_pool_block: a partial block reused by a new sequence is a copy of every layer's K
and V rows of the kept block, and the kept block is left as it was."""

from __future__ import annotations

import torch

from appliance.kv_store.pool_blocks import copy_pool_block


def test_a_block_is_copied_whole_and_the_source_is_untouched() -> None:
    # [layers, 2, blocks, block_size, kv_heads, head_dim]
    pool = torch.arange(3 * 2 * 4 * 5 * 2 * 3, dtype=torch.float32).reshape(3, 2, 4, 5, 2, 3)
    before = pool.clone()
    copy_pool_block(pool, 1, 3)
    assert torch.equal(pool[:, :, 3], before[:, :, 1])
    assert torch.equal(pool[:, :, :3], before[:, :, :3])
    pool[:, :, 3, 2:] = -1  # the new sequence writes its rows past n: the source keeps its own
    assert torch.equal(pool[:, :, 1], before[:, :, 1])
