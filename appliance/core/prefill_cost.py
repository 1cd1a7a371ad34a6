"""What a prompt costs on each entry worker, in prompt tokens computed before its first
token: the rule the router picks a prefill (or colocated) worker by.

Pure, plain numbers. The gain of a worker is the prefix it would not compute: blocks its
own pool holds (what the router sent it lately) joined by blocks the box's KV store holds
under its namespace, which it loads into its pool before the prefill. Loading is nearly
free against computing (a block 0.1 ms against about 3 ms a row, 16 rows a block, on the
bench's EPYC: docs/kv_store.md), so a stored block counts as held; only where costs tie does
a pool's own block beat a stored one. Against the gain stands the worker's load: the
prompt tokens queued there ahead of it (counted as what they compute, not their length),
and its running sequences, each one row in every step the prompt waits and prefills.

So where the store holds a prefix every worker can load, load decides; where only one
worker's pool holds it, that worker wins until its queue outweighs the tokens it saves.
Dynamo's KV router weighs the same two things (blocks to prefill against active blocks);
SGLang's cache-aware router switches between them by thresholds instead.
"""

from __future__ import annotations

from collections.abc import Collection, Container, Sequence
from dataclasses import dataclass
from typing import Generic, TypeVar

T = TypeVar("T")  # a worker as its router sees it: the pools' handle, or a simulated one


@dataclass(frozen=True)
class Held:
    """How much of a prompt's prefix a worker has: `blocks` leading blocks in all, of them
    `loaded` from the store (not in its own pool)."""

    blocks: int
    loaded: int


@dataclass(frozen=True)
class Load:
    """A worker's load as the router sees it."""

    queued_tokens: int  # prompt tokens sent to it and not yet answered, to be computed
    running: int  # sequences in its last step report


@dataclass(frozen=True)
class Cost:
    """A prompt's cost on one worker: `wait` tokens computed before its first token (queue
    ahead, its own uncached part, the running sequences' rows meanwhile); ties go to the
    fewest blocks to load from the store, then the fewest running."""

    wait: int
    compute: int  # of the prompt's own tokens, those this worker computes
    loaded: int
    running: int

    def rank(self) -> tuple[int, int, int]:
        return (self.wait, self.loaded, self.running)


@dataclass(frozen=True)
class Routed(Generic[T]):
    """Where a prompt went, and the tokens of it expected to be computed there (what its
    worker's queued tokens grow by until its first token)."""

    worker: T
    compute: int


def held_prefix(keys: Sequence[int], pooled: Container[int], stored: Collection[int]) -> Held:
    """The leading run of `keys` (a prompt's block keys, in order) a worker has, in its
    pool or loadable from the store; a block nobody has ends it (what follows must be
    computed after it anyway)."""
    blocks = loaded = 0
    for key in keys:
        if key in pooled:
            blocks += 1
        elif key in stored:
            blocks += 1
            loaded += 1
        else:
            break
    return Held(blocks, loaded)


def uncached_tokens(prompt_tokens: int, held_blocks: int, block_size: int) -> int:
    """Prompt tokens computed with `held_blocks` leading blocks cached: the block with the
    last token is always computed (its logits), so at least one token."""
    usable = min(held_blocks, (prompt_tokens - 1) // block_size)
    return prompt_tokens - usable * block_size


def prompt_cost(
    prompt_tokens: int, held: Held, load: Load, block_size: int, step_budget: int
) -> Cost:
    """What this prompt costs on a worker with `load` that has `held` of its prefix; a
    step takes up to `step_budget` prompt tokens."""
    compute = uncached_tokens(prompt_tokens, held.blocks, block_size)
    ahead = load.queued_tokens + compute
    steps = -(-ahead // step_budget)  # steps until its last token is computed
    return Cost(ahead + load.running * steps, compute, held.loaded, load.running)


def cheapest(costs: Sequence[Cost]) -> int:
    """The index of the cheapest cost (the first of equals)."""
    return min(range(len(costs)), key=lambda i: costs[i].rank())
