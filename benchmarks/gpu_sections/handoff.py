"""Section 6, handoff: the KV handoff copy (copy_blocks) between two pools of the default
model's layout on the scale's device, consecutive and scattered block ids, checked byte
for byte and timed against a plain copy of the same bytes."""

from __future__ import annotations

import random
from typing import Any

import torch

from .common import Result, markdown_table, verdict
from .measure import best_seconds, sync
from .scale import Scale


def section_handoff(scale: Scale) -> Result:
    """copy_blocks between two pools of the default model's layout (bfloat16), for the
    blocks of a few prompt lengths, consecutive and scattered block ids, each checked
    byte for byte and timed beside a plain copy of the same number of bytes."""
    from appliance.kv.cache import KVCache, KVLayout
    from appliance.kv.handoff import peer_access

    device = scale.device
    layout = KVLayout(30, 16, 3, 64, torch.bfloat16)
    blocks = 2 * -(-max(scale.handoff_tokens) // layout.block_size)
    src = KVCache(layout, blocks, device, shared=not scale.cuda)
    dst = KVCache(layout, blocks, device, shared=not scale.cuda)
    src.tensor.normal_()
    rng = random.Random(3)
    rows = [
        handoff_row(src.tensor, dst.tensor, tokens, scattered, layout.block_size, rng, scale)
        for tokens in scale.handoff_tokens
        for scattered in (False, True)
    ]
    checks = {f"{r['tokens']} tokens, {r['ids']}: bytes equal": r["equal"] for r in rows}
    peer = peer_access(device, device) if scale.cuda else None
    for row in rows:
        del row["equal"]
    big = max(rows, key=lambda r: r["bytes"])
    return verdict(
        checks,
        summary=f"{big['tokens']} tokens ({big['ids']}): {big['handoff_gb_s']} GB/s vs plain "
        f"{big['plain_gb_s']} GB/s",
        peer_access_same_device=peer,
        rows=rows,
        table=markdown_table(rows),
    )


def handoff_row(
    src: torch.Tensor,
    dst: torch.Tensor,
    tokens: int,
    scattered: bool,
    block_size: int,
    rng: random.Random,
    scale: Scale,
) -> dict[str, Any]:
    """One prompt length's copy: checked, then timed against a plain copy."""
    from appliance.kv.handoff import copy_blocks

    n = -(-tokens // block_size)
    total = src.shape[2]
    src_ids = rng.sample(range(total), n) if scattered else list(range(n))
    dst_ids = rng.sample(range(total), n) if scattered else list(range(n))
    dst.zero_()
    nbytes = copy_blocks(src, src_ids, dst, dst_ids)
    sync(scale.device)
    equal = torch.equal(dst[:, :, dst_ids], src[:, :, src_ids])
    a = torch.empty(nbytes // src.element_size(), dtype=src.dtype, device=src.device)
    b = torch.empty_like(a)
    handoff = best_seconds(
        lambda: copy_blocks(src, src_ids, dst, dst_ids), scale.device, scale.repeats
    )
    plain = best_seconds(lambda: b.copy_(a), scale.device, scale.repeats)
    return {
        "tokens": tokens,
        "ids": "scattered" if scattered else "consecutive",
        "bytes": nbytes,
        "handoff_ms": round(handoff * 1e3, 3),
        "plain_ms": round(plain * 1e3, 3),
        "handoff_gb_s": round(nbytes / handoff / 1e9, 1),
        "plain_gb_s": round(nbytes / plain / 1e9, 1),
        "equal": equal,
    }
