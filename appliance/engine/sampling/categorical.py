"""One categorical draw per row from one uniform number: the inverse of the row's
cumulative distribution, the sampler's and the speculative verifier's.

Why not the exponential race (argmax(p / E), E ~ Exp(1) per vocabulary entry): it draws
a random number per entry, ~1.1 ms a row on a CPU thread for a 49k vocabulary (most of a
sampled step: benchmarks/sampler_bench.py), where one uniform and running sums cost
tens of microseconds. The running sums are float64, so a token's share of the row is
kept to ~1e-16 plus its block's float32 sum's rounding (~1e-7 of the block's mass): a
float32 running sum near 1 would round away tokens below ~6e-8, up to ~1e-3 of the
mass over a vocabulary this size."""

from __future__ import annotations

import torch

BLOCK = 256  # entries per block of draw()'s first step


def uniforms(count: int, generator: torch.Generator, device: torch.device) -> torch.Tensor:
    """[count] float64 uniforms in [0, 1) from `generator` (a seeded request's own, or
    the shared one): the numbers `draw` takes, 53 bits each."""
    return torch.rand(count, generator=generator, dtype=torch.float64, device=device)


def draw(weights: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Index i of each row of `weights` [rows, vocab] (nonnegative, not necessarily
    normalized, each row with some positive weight) with probability weight_i / sum, from
    the row's uniform `u` [rows]: the first i whose running sum exceeds u times the row's
    total. An index of zero weight adds nothing to the running sum, so it is never the
    first to exceed it. Returns [rows] int64; nothing is read back to the host.

    In two steps, so no float64 copy of the whole row is made (a 16-row step's would be
    6 MB, written and read every step): the running sum of blocks of BLOCK entries finds
    the block, then the running sum inside that block the index."""
    rows, vocab = weights.shape
    if vocab % BLOCK:  # zeros at the end: never drawn
        weights = torch.nn.functional.pad(weights, (0, -vocab % BLOCK))
    blocks = weights.view(rows, -1, BLOCK)  # [rows, blocks, BLOCK]
    # Summed in the weights' dtype (float32: pairwise, ~1e-7 of a block's mass), then
    # carried in float64; a float64 copy of every weight first cost more than the rest.
    sums = blocks.sum(-1).double()  # [rows, blocks]
    ends = sums.cumsum(-1)  # [rows, blocks]: the running sum at each block's end
    # u < 1 in 53 bits: u * total stays below the total, so some block's end exceeds it.
    point = u.to(ends.dtype)[:, None] * ends[:, -1:]  # [rows, 1]
    # [rows, 1]: never a weightless block; clamped for a row with no finite total (NaN
    # logits), which gets some index, never an error, as the exponential race gave one.
    block = torch.searchsorted(ends, point, right=True).clamp_(max=ends.shape[1] - 1)
    start = (ends - sums).gather(1, block)  # [rows, 1]: the running sum before it
    inner = blocks.gather(1, block[:, :, None].expand(-1, -1, BLOCK)).squeeze(1)  # [rows, BLOCK]
    index = torch.searchsorted(start + inner.cumsum(-1, dtype=torch.float64), point, right=True)
    # Summed in another order the block's end can round a hair below `point`: then its
    # last weighted entry, never a weightless one after it.
    last = torch.where(inner > 0, torch.arange(BLOCK, device=inner.device), -1).amax(-1)
    drawn = block.squeeze(1) * BLOCK + torch.minimum(index.squeeze(1), last)
    return drawn.clamp_(0, vocab - 1)
