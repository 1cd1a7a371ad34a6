"""Splitting a step's decodes into groups of similar context length. Torch-free.

Decode attention gathers each sequence's keys padded to the longest in its batch, so one
2k-token sequence among short ones made every one of them pay for 2k keys (a 7x slower
step in a measured 10-sequence batch). Grouping sequences by block-table width bounds
that padding; each extra group costs one more gather and matmul per layer. The CPU
kernel (model/cpu_kernels/) reads each context unpadded, so where it runs the model
runner makes one group of all decodes instead.
"""

from __future__ import annotations

import math

# In "block-rows" (one sequence x one KV block), measured on CPU bf16 decode attention:
GROUP_OVERHEAD = 32  # what one more group costs: a 1x1 group takes ~110 us, a block-row ~3.5
GROUP_CAP = 128  # past this a single gather+matmul gets slower per block-row (CPU caches)


def decode_groups(
    widths: list[int], overhead: int = GROUP_OVERHEAD, cap: int = GROUP_CAP
) -> list[list[int]]:
    """Indices of `widths` (block-table lengths) in groups minimizing the padded work plus
    `overhead` per group; a group of more than one sequence holds at most `cap` block-rows.

    Groups are runs of the sequences sorted by width, found by dynamic programming."""
    order = sorted(range(len(widths)), key=widths.__getitem__)
    best = [0.0] + [math.inf] * len(order)  # best[j]: cost of the first j sorted sequences
    start = [0] * (len(order) + 1)  # start[j]: where the last group of that best begins
    for j in range(1, len(order) + 1):
        width = widths[order[j - 1]]  # the widest of any group ending at j
        for i in range(j, 0, -1):  # the group holds sorted sequences i-1 .. j-1
            size = j - i + 1
            if size > 1 and size * width > cap:
                break
            cost = best[i - 1] + overhead + size * width
            if cost < best[j]:
                best[j], start[j] = cost, i - 1
    groups = []
    j = len(order)
    while j > 0:
        groups.append(order[start[j] : j])
        j = start[j]
    return groups[::-1]
