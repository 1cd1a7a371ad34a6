"""Where work goes: which prefill (or colocated) worker takes a prompt, which decode
worker continues it.

Pure: it reads the load counters a WorkerHandle keeps through its own event methods
(queued prompt tokens, running sequences, free KV blocks) and writes none of them, never
the processes, so it is tested on plain data. What each worker prefilled lately is its own memory.
- A prompt goes to the worker with the fewest queued prompt tokens or, among those within
  one step budget of it, the one that prefilled the longest prefix of the prompt lately
  (its prefix cache likely still holds it). Round-robin when tuned so. The box's KV store
  (issue 41) holds blocks any worker loads instead of computing: a block it holds counts
  as held by every worker, so a prefix the store serves whole biases no worker (the least
  loaded takes it) while one a worker's pool carries further than the store still wins.
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
    def queued_tokens(self) -> int: ...  # prompt tokens sent and not yet answered


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
        # Only a prefix cache makes where a prefix went matter: otherwise skip the hashing.
        keys = prefix_keys(token_ids, self.block_size, salt) if self.prefix_caching else []
        if tuning.routing == "round_robin":
            worker = candidates[next(self._turns) % len(candidates)]
        else:
            shared = {}  # worker id -> the prompt's keys the store holds for it
            if stored is not None and keys:
                shared = {w.worker_id: stored(w.worker_id, keys) for w in candidates}
            budget = tuning.prefill_token_budget
            worker = least_loaded(candidates, keys, budget, self._prefixes, shared)
        remember_prefix(self._prefixes.setdefault(worker.worker_id, OrderedDict()), keys)
        return worker

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


def least_loaded(
    candidates: list[W],
    keys: list[int],
    budget: int,
    prefixes: Mapping[int, Mapping[int, None]],
    stored: Mapping[int, Collection[int]] | None = None,
) -> W:
    """The worker with the fewest queued prompt tokens, or, among those within `budget`
    tokens of it, the one holding the longest run of `keys` (prompt block keys);
    `prefixes` maps a worker id to the block keys it prefilled lately, `stored` to the
    keys the box's KV store holds that it can load (held as if in its own pool)."""
    least = min(w.queued_tokens for w in candidates)
    near = [w for w in candidates if w.queued_tokens <= least + budget]

    def score(worker: W) -> tuple[int, int, int]:
        held = prefixes.get(worker.worker_id, {})
        loads = stored.get(worker.worker_id, ()) if stored is not None else ()
        matched = 0
        while matched < len(keys) and (keys[matched] in held or keys[matched] in loads):
            matched += 1
        return (-matched, worker.queued_tokens, worker.running)

    return min(near, key=score)


def remember_prefix(held: OrderedDict[int, None], keys: list[int]) -> None:
    """Note that a worker prefilled these blocks, forgetting the oldest beyond a bound."""
    for key in keys:
        held[key] = None
        held.move_to_end(key)
    while len(held) > PREFIX_KEYS_KEPT:
        held.popitem(last=False)
