"""The box's KV store in the planner's simulator (issue 41): a workload's prompts are
partly served from the store, whatever worker prefills them, so a simulated prefill
computes only the rest.

A worker's own prefix cache is simulated block by block (sim_pool.KVPool: a request's
shared prefix is a hit where that worker's pool still holds it). The store is not: it
holds far more than a pool (host memory and disk) and any worker loads from it, so it is
modelled by the share of prompt tokens it served, measured per workload (the store's
blocks served times the block size over the prompt tokens, as /metrics and the admin
snapshot count them: `measured_rate`). `with_store_hits` gives each request of a
workload its stored tokens at that rate (whole blocks, never the block with the last
token, which a worker always computes); the simulated worker starts such a prompt at
the larger of its pool's cached prefix and its stored part (`start_from_store`), holding
pool blocks for both, so its prefill is charged for the computed tokens only. Loading
the stored blocks costs nothing here (a copy from shared memory, small next to a
prefill; the profile has no measurement of it).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from appliance.planner.sim_pool import SimSeq
    from appliance.planner.simulator import SimRequest


def measured_rate(stored_tokens: int, prompt_tokens: int) -> float:
    """The share of prompt tokens a store served: `stored_tokens` (blocks served times
    the block size) over the `prompt_tokens` sent; 0 with none sent."""
    if stored_tokens < 0 or prompt_tokens < 0:
        raise ValueError(
            f"token counts must be >= 0, got stored {stored_tokens}, prompt {prompt_tokens}"
        )
    if stored_tokens > prompt_tokens:
        raise ValueError(f"stored tokens ({stored_tokens}) exceed the prompt's ({prompt_tokens})")
    return stored_tokens / prompt_tokens if prompt_tokens else 0.0


@dataclass(frozen=True)
class StoreHitRates:
    """Per workload (its name, as `appliance bench --workload` calls it), the share of
    prompt tokens the box's KV store serves; a workload not named gets `default`."""

    rates: Mapping[str, float] = field(default_factory=dict)
    default: float = 0.0

    def __post_init__(self) -> None:
        for name, rate in {**self.rates, "default": self.default}.items():
            if not 0.0 <= rate <= 1.0:
                raise ValueError(f"store hit rate of {name} must be in [0, 1], got {rate}")

    def rate(self, workload: str) -> float:
        return self.rates.get(workload, self.default)


def stored_tokens(prompt_tokens: int, rate: float, block_size: int) -> int:
    """The prompt tokens a store serving `rate` of them gives one prompt: whole blocks,
    and never the block holding the last token (its logits pick the next token)."""
    if block_size < 1:
        raise ValueError(f"block_size must be at least 1, got {block_size}")
    most = (prompt_tokens - 1) // block_size
    return min(int(rate * prompt_tokens) // block_size, most) * block_size


def with_store_hits(
    requests: Sequence[SimRequest], rate: float, block_size: int
) -> list[SimRequest]:
    """The requests of one workload with their stored tokens at `rate`."""
    return [
        replace(r, stored_tokens=stored_tokens(r.prompt_tokens, rate, block_size)) for r in requests
    ]


def start_from_store(seq: SimSeq, block_size: int) -> int:
    """Where a simulated prompt starts computing: after its pool's cached prefix
    (seq.computed, just matched) or its stored blocks, whichever is longer (capped below
    the block with its last token, as it grew when a preempted one comes back)."""
    stored = min(seq.stored_blocks, (seq.length - 1) // block_size) * block_size
    return max(seq.computed, stored)
