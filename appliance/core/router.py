"""Where work goes: which prefill (or colocated) worker takes a prompt, which decode
worker continues it.

Pure: it reads the load counters a WorkerHandle keeps through its own event methods
(queued prompt tokens, running sequences, free KV blocks) and writes none of them, never
the processes, so it is tested on plain data. What each worker prefilled lately is its own memory.
- A prompt goes to the worker where it waits least for its first token, counted in
  prompt tokens computed (`prefill_cost`): the queue ahead of it there, its own part not
  cached there, and a row for each running sequence in each step meanwhile. Cached there
  is the longest prefix the worker prefilled lately (its prefix cache likely still holds
  it) joined by what the box's KV store (issue 41) holds that it can load, nearly free.
  So a prefix the store serves whole favours no worker (load decides), while a pool that
  carries a prefix further than the store wins until its queue outweighs what it saves.
  Round-robin when tuned so. Queued tokens are what each prompt was expected to compute
  where it went (`Routed.compute`), not its length: a queue of cached prompts is short.
- A handoff goes, among the decode workers with room for it, to the one best linked to
  the prefill worker holding its KV (an NVLink partner before a PCIe peer), then to the
  one with the most free KV blocks, fewest running sequences breaking ties; with no room
  anywhere, to the one with the most free blocks. Free is what the worker last reported
  less the blocks its report does not show yet: of handoffs sent to it and not answered,
  and of those it took since (it answers a handoff before it reports the step that holds
  its blocks). CPU devices share RAM: all their links rank the same, so there the most
  free blocks decide.
"""

from __future__ import annotations

import itertools
from collections import OrderedDict
from collections.abc import Callable, Collection, Mapping
from typing import Protocol, TypeVar

from appliance.core.prefill_cost import Load, Routed, cheapest, held_prefix, prompt_cost
from appliance.core.tuning import Tuning
from appliance.kv.prefix_cache import prefix_keys


class WorkerLoad(Protocol):
    """What the router reads of a worker: the counters the pools keep on its handle."""

    @property
    def worker_id(self) -> int: ...
    @property
    def devices(self) -> tuple[int, ...]: ...
    @property
    def num_free(self) -> int: ...  # free KV blocks as of its last report
    @property
    def running(self) -> int: ...
    @property
    def queued_tokens(self) -> int: ...  # of prompts sent and not yet answered: to compute


W = TypeVar("W", bound=WorkerLoad)  # the pools' handle type, handed back as it came

PREFIX_KEYS_KEPT = 8192  # per prefill worker: block keys of prompts it prefilled lately

LinkRank = Callable[[int, int], int]  # two device indices -> how fast they copy; higher wins
# A worker id and a prompt's block keys -> those the box's KV store holds that this worker
# can load (stored under its namespace: its model, weights and KV dtype)
StoredKeys = Callable[[int, list[int]], Collection[int]]


def equal_links(a: int, b: int) -> int:
    """A link rank under which every pair of devices is as good as any other."""
    return 0


class Router:
    """The routing policy of one supervisor."""

    def __init__(
        self, block_size: int, prefix_caching: bool, link_rank: LinkRank = equal_links
    ) -> None:
        """`link_rank` ranks the link between two devices (`Topology.bandwidth_rank`)."""
        self.block_size = block_size
        self.prefix_caching = prefix_caching
        self.link_rank = link_rank
        self._turns = itertools.count()  # round-robin routing
        # worker id -> keys of prompt blocks it prefilled lately (likely still cached there)
        self._prefixes: dict[int, OrderedDict[int, None]] = {}

    def prefill(
        self,
        candidates: list[W],
        token_ids: list[int],
        tuning: Tuning,
        salt: str = "",
        stored: StoredKeys | None = None,
    ) -> W:
        """Pick the worker that prefills `token_ids` (under cache_salt `salt`), and
        remember it got their prefix. `stored` names the prompt's blocks the box's KV
        store holds (None: no store)."""
        return self.route(candidates, token_ids, tuning, salt, stored).worker

    def route(
        self,
        candidates: list[W],
        token_ids: list[int],
        tuning: Tuning,
        salt: str = "",
        stored: StoredKeys | None = None,
    ) -> Routed[W]:
        """`prefill`, with the prompt tokens the chosen worker is expected to compute."""
        # Only a prefix cache makes where a prefix went matter: otherwise skip the hashing.
        keys = prefix_keys(token_ids, self.block_size, salt) if self.prefix_caching else []
        if tuning.routing == "round_robin":
            routed = Routed(candidates[next(self._turns) % len(candidates)], len(token_ids))
        else:
            shared = {}  # worker id -> the prompt's keys the store holds for it
            if stored is not None and keys:
                shared = {w.worker_id: stored(w.worker_id, keys) for w in candidates}
            budget = tuning.prefill_token_budget
            routed = least_wait(
                candidates, len(token_ids), keys, self.block_size, budget, self._prefixes, shared
            )
        remember_prefix(self._prefixes.setdefault(routed.worker.worker_id, OrderedDict()), keys)
        return routed

    def forget(self, worker_id: int) -> None:
        """That worker is gone: what it prefilled is gone with it."""
        self._prefixes.pop(worker_id, None)

    def decode(
        self,
        candidates: list[W],
        in_flight: Mapping[int, int],
        source: W,
        blocks: int,
    ) -> W:
        """Pick the decode worker that continues a request prefilled by `source` and needing
        `blocks` KV blocks; `in_flight` maps a worker id to the blocks of the handoffs it
        has been sent and not answered."""

        def free(worker: W) -> int:
            return worker.num_free - in_flight.get(worker.worker_id, 0)

        roomy = [w for w in candidates if free(w) >= blocks]
        if not roomy:  # it waits for room anyway: ask the one likeliest to have it soon
            return max(candidates, key=lambda w: (free(w), -w.running))
        return max(roomy, key=lambda w: (self._link(source, w), free(w), -w.running))

    def _link(self, source: W, decode: W) -> int:
        """How fast KV moves from `source` to `decode`: the slowest link between their
        devices (a tensor-parallel handoff may copy between any of their shards)."""
        return min(self.link_rank(a, b) for a in source.devices for b in decode.devices)


def least_wait(
    candidates: list[W],
    prompt_tokens: int,
    keys: list[int],
    block_size: int,
    budget: int,
    prefixes: Mapping[int, Mapping[int, None]],
    stored: Mapping[int, Collection[int]] | None = None,
) -> Routed[W]:
    """The worker where a prompt of `prompt_tokens` tokens (block keys `keys`) waits least
    for its first token (`prefill_cost.prompt_cost`; a step takes `budget` prompt
    tokens); `prefixes` maps a worker id to the block keys it prefilled lately, `stored`
    to the keys the box's KV store holds that it can load."""
    costs = []
    for worker in candidates:
        pooled = prefixes.get(worker.worker_id, {})
        loads = stored.get(worker.worker_id, ()) if stored is not None else ()
        held = held_prefix(keys, pooled, loads)
        load = Load(worker.queued_tokens, worker.running)
        costs.append(prompt_cost(prompt_tokens, held, load, block_size, budget))
    best = cheapest(costs)
    return Routed(candidates[best], costs[best].compute)


def remember_prefix(held: OrderedDict[int, None], keys: list[int]) -> None:
    """Note that a worker prefilled these blocks, forgetting the oldest beyond a bound."""
    for key in keys:
        held[key] = None
        held.move_to_end(key)
    while len(held) > PREFIX_KEYS_KEPT:
        held.popitem(last=False)
