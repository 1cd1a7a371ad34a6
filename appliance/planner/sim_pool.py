"""The simulator's sequences and KV pools: block counts and a prefix cache, no token ids.

A pool mirrors appliance/kv/prefix_cache.py over counts. A block is named by what it
holds instead of by its tokens' hash: block i of a request sharing prefix `prefix_id` is
`(prefix_id, i)` while it lies wholly inside the shared prefix, else `(-1 - request, i)`
(its own tokens, which only that request, recomputed after a preemption, can match).
Blocks nobody uses stay cached (counted free) until an allocation needs them, least
recently freed first, after the never-cached ones.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

from appliance.kv.block_allocator import blocks_for_tokens

Key = tuple[int, int]


@dataclass(slots=True, eq=False)
class SimSeq:
    """One attempt of one request on one worker (a handoff makes a new one on the decode
    worker, streaming into the same `times`)."""

    req: int  # the request's index
    prompt: int
    output: int  # tokens it makes in all
    times: list[float]  # when each streamed token reaches the client
    prefix_id: int | None = None
    prefix_blocks: int = 0  # full blocks of the shared prefix (0: nothing shared)
    stored_blocks: int = 0  # prompt blocks the box's KV store serves (planner/prefix_hits.py)
    made: int = 0  # tokens sampled so far
    computed: int = 0  # tokens whose K/V the worker holds
    own: int = 0  # blocks it holds outside the cache
    shared: list[Key] = field(default_factory=list)  # cached blocks it holds
    registered: int = 0  # leading blocks already offered to the cache
    prefill_only: bool = False  # park after the first token (disaggregated prefill)
    k0: int = -1  # decoding lazily since this step of its worker (-1: not lazily)
    c0: int = 0  # `computed` at step k0

    @property
    def length(self) -> int:
        """Tokens it has: prompt and output so far."""
        return self.prompt + self.made

    @property
    def blocks(self) -> int:
        return self.own + len(self.shared)

    def key(self, index: int) -> Key:
        """The name of what its block `index` holds."""
        if index < self.prefix_blocks:
            return (self.prefix_id if self.prefix_id is not None else 0, index)
        return (-1 - self.req, index)


class KVPool:
    """One worker's KV blocks: how many are held, and which cached ones hold what."""

    def __init__(self, total: int, block_size: int, caching: bool) -> None:
        self.total = total
        self.block_size = block_size
        self.caching = caching
        self.plain = 0  # held blocks outside the cache
        self.refs: dict[Key, int] = {}  # cached blocks in use -> sequences using each
        self.idle: OrderedDict[Key, None] = OrderedDict()  # cached, unused, oldest first

    @property
    def free(self) -> int:
        """Blocks a sequence can get now (cached unused ones included)."""
        return self.total - self.plain - len(self.refs)

    def reserve(self, seq: SimSeq, num_tokens: int) -> bool:
        """Make seq's blocks cover `num_tokens` more tokens, if the pool allows."""
        extra = blocks_for_tokens(seq.computed + num_tokens, self.block_size) - seq.blocks
        if extra <= 0:
            return True
        if extra > self.free:
            return False
        self.allocate(seq, extra)
        return True

    def allocate(self, seq: SimSeq, n: int) -> None:
        """n blocks to seq (the caller checked `free`): never-cached ones first, then the
        least recently freed cached ones, forgetting what they held."""
        fresh = self.total - self.plain - len(self.refs) - len(self.idle)
        for _ in range(n - fresh):
            self.idle.popitem(last=False)
        self.plain += n
        seq.own += n

    def match(self, seq: SimSeq, max_blocks: int) -> int:
        """Give seq the cached blocks of its longest cached prefix (at most max_blocks);
        returns how many."""
        if not self.caching:
            return 0
        count = 0
        while count < max_blocks:
            key = seq.key(count)
            refs = self.refs.get(key)
            if refs is None:
                if key not in self.idle:
                    break
                del self.idle[key]
                refs = 0
            self.refs[key] = refs + 1
            seq.shared.append(key)
            count += 1
        seq.registered = count
        return count

    def register_prefix(self, seq: SimSeq) -> None:
        """Its computed blocks of the shared prefix join the cache now, so others share
        them while it runs (its own blocks join when it lets them go: only it can match
        them, after a preemption)."""
        if not self.caching:
            return
        upto = min(seq.computed // self.block_size, seq.prefix_blocks)
        for index in range(seq.registered, upto):
            key = seq.key(index)
            if key not in self.refs and key not in self.idle:
                self.refs[key] = 1
                self.plain -= 1
                seq.own -= 1
                seq.shared.append(key)
        seq.registered = max(seq.registered, upto)

    def release(self, seq: SimSeq) -> None:
        """seq lets go of every block: its full ones stay cached, the rest are freed."""
        if self.caching:  # freed in block order, as the scheduler frees a block table
            for key in seq.shared:
                refs = self.refs[key] - 1
                if refs:
                    self.refs[key] = refs
                else:
                    del self.refs[key]
                    self.idle[key] = None
            for index in range(seq.registered, seq.computed // self.block_size):
                key = seq.key(index)
                if key not in self.refs and key not in self.idle:
                    self.idle[key] = None
                    self.plain -= 1
                    seq.own -= 1
        self.plain -= seq.own
        seq.own = 0
        seq.shared = []
        seq.registered = 0
