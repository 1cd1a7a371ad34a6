"""Prefix caching over one paged KV pool: full blocks addressed by their content.

A block's key is a 64-bit BLAKE2b hash of its token ids chained with the previous block's
key, so two sequences whose first k blocks have the same keys share the same first
k * block_size tokens and can share those blocks' K/V. The hash is fixed (not Python's
`hash`, which is salted for str and depends on None's address), so a key is the same in
every process and every run. Blocks in use are reference-counted; a cached block nobody
uses stays cached until the pool needs room (least recently used first). A block in use
is never evicted, so eviction cannot touch a running sequence.

A partial block is the tail of a finished request: its first n < block_size tokens' K/V
computed (prompt and fed output; the last sampled token never is), the rest garbage. It is
keyed `block_key(previous, its n tokens)`, a message of another length than any full
block's, so the two never collide; kept idle (LRU with the cached blocks) until evicted;
and a later prompt that holds the same full blocks then those n tokens gets a COPY of it
in a block of its own (`match_partial`): it writes its rows n.. there, so the block is
never shared for writing.

Pure Python over a BlockAllocator, with the allocator's interface (num_free,
can_allocate, allocate, free): `num_free` counts the cached blocks nobody uses, since
they are handed out when needed. Disabled, it is the allocator and nothing more.
"""

from __future__ import annotations

import hashlib
import sys
from array import array
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import TypeVar

from appliance.kv.block_allocator import BlockAllocator, OutOfBlocks

BlockKey = int  # unsigned 64-bit

Found = TypeVar("Found")  # what names a stored block's bytes (the store's hit)

_FIRST = b"\x00"  # tags a block with no prefix, so no chained block can hash like it
_CHAINED = b"\x01"
_SALTED = b"\x02"  # a first block under a request's cache_salt: its own key space


def block_key(previous: BlockKey | None, tokens: Sequence[int], salt: str = "") -> BlockKey:
    """The key of a full block of `tokens` after the prefix keyed `previous` (None for a
    sequence's first block): the same in every process and run, on any machine, so keys
    computed by one process (the supervisor, another box) name the blocks of another's
    cache. A first block's `salt` (vLLM's per-request cache_salt) enters its key, so every
    chained key after it differs too: requests with different salts share no block; no
    salt keys a block as before."""
    head = _head(previous, salt)
    packed = array("q", tokens)  # 8 bytes a token: packing ints is far cheaper than str
    if sys.byteorder == "big":  # one byte order everywhere
        packed.byteswap()
    digest = hashlib.blake2b(head, digest_size=8)
    digest.update(packed)
    return int.from_bytes(digest.digest(), "little")


def _head(previous: BlockKey | None, salt: str) -> bytes:
    """What a block's hash starts with: its prefix's key, or (a first block) its salt."""
    if previous is not None:
        return _CHAINED + previous.to_bytes(8, "little")
    if not salt:
        return _FIRST
    salted = salt.encode()  # its length first: no salt's bytes can run into the tokens
    return _SALTED + len(salted).to_bytes(8, "little") + salted


def partial_keys(
    previous: BlockKey | None, tokens: Sequence[int], salt: str = ""
) -> list[BlockKey]:
    """`block_key(previous, tokens[:n], salt)` for every n in 1..len(tokens), in one pass
    (BLAKE2 streams: hashing the tokens one by one digests as hashing them at once)."""
    digest = hashlib.blake2b(_head(previous, salt), digest_size=8)
    keys: list[BlockKey] = []
    for token in tokens:
        digest.update(token.to_bytes(8, "little", signed=True))
        keys.append(int.from_bytes(digest.copy().digest(), "little"))
    return keys


def prefix_keys(token_ids: Sequence[int], block_size: int, salt: str = "") -> list[BlockKey]:
    """The keys of every full block of `token_ids`, in order (under the request's
    cache_salt `salt`; empty: none)."""
    keys: list[BlockKey] = []
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        tokens = token_ids[start : start + block_size]
        keys.append(block_key(keys[-1] if keys else None, tokens, salt))
    return keys


class PrefixCache:
    def __init__(self, allocator: BlockAllocator, block_size: int, enabled: bool = True) -> None:
        self.allocator = allocator
        self.block_size = block_size
        self.enabled = enabled
        self._block_of: dict[BlockKey, int] = {}
        self._content: dict[int, tuple[BlockKey, tuple[int, ...]]] = {}  # block -> key, tokens
        self._refs: dict[int, int] = {}  # cached block -> sequences using it
        self._idle: OrderedDict[int, None] = OrderedDict()  # cached, unused, LRU first
        self.hit_tokens = 0  # prompt tokens served from the cache, since start
        self.stored_tokens = 0  # prompt tokens loaded from the box's KV store, since start
        # The box's KV store (kv_store.write_policy): told of a cached block about to be
        # reused for another (evict) or left unused by its last sequence (finish), while
        # its bytes are still in the pool. (block, key) -> None.
        self.on_evict: Callable[[int, BlockKey], None] | None = None
        self.on_idle: Callable[[int, BlockKey], None] | None = None
        # Copies pool block src's bytes into block dst (src, dst): a partial block is
        # reused only through it. None (a tensor-parallel pool, whose shards are in other
        # processes): no partial block is kept or reused.
        self.copy_block: Callable[[int, int], None] | None = None
        self._partial_of: dict[BlockKey, int] = {}  # a partial block's key -> block
        self.partial_tokens = 0  # prompt tokens served from partial blocks, since start

    # ------------------------------------------------------------ the allocator's interface

    @property
    def num_blocks(self) -> int:
        return self.allocator.num_blocks

    @property
    def num_free(self) -> int:
        """Blocks a sequence can get now: never used, or cached and unused."""
        return self.allocator.num_free + len(self._idle)

    @property
    def num_cached(self) -> int:
        return len(self._content)

    def can_allocate(self, n: int) -> bool:
        return n <= self.num_free

    def allocate(self, n: int) -> list[int]:
        """n blocks, all or nothing: free ones first, then evicted cached ones (LRU)."""
        if n > self.num_free:
            raise OutOfBlocks(f"asked for {n} KV blocks, {self.num_free} free")
        fresh = min(n, self.allocator.num_free)
        blocks = self.allocator.allocate(fresh)
        while len(blocks) < n:
            block, _ = self._idle.popitem(last=False)
            if self.on_evict is not None:
                self.on_evict(block, self._content[block][0])
            self._forget(block)
            blocks.append(block)
        return blocks

    def free(self, blocks: Sequence[int]) -> None:
        """A sequence lets go of its blocks: cached ones stay cached, others are freed."""
        plain = []
        for block in blocks:
            refs = self._refs.get(block)
            if refs is None:
                plain.append(block)
            elif refs == 1:
                self._refs[block] = 0
                self._idle[block] = None
                if self.on_idle is not None:
                    self.on_idle(block, self._content[block][0])
            else:
                assert refs > 1, f"block {block} freed more often than it was used"
                self._refs[block] = refs - 1
        if plain:
            self.allocator.free(plain)

    # ------------------------------------------------------------ the cache

    def match(
        self, token_ids: Sequence[int], max_blocks: int, salt: str = ""
    ) -> tuple[list[int], list[int]]:
        """The cached blocks holding the longest prefix of `token_ids` (at most
        `max_blocks` full blocks) under cache_salt `salt`, each now used once more; and
        their keys."""
        blocks: list[int] = []
        keys: list[BlockKey] = []
        if not self.enabled:
            return blocks, keys
        size = self.block_size
        previous = None
        for i in range(max_blocks):
            tokens = tuple(token_ids[i * size : (i + 1) * size])
            if len(tokens) < size:
                break
            key = block_key(previous, tokens, salt)
            block = self._block_of.get(key)
            if block is None or self._content[block][1] != tokens:  # a hash collision
                break
            self._use(block)
            blocks.append(block)
            keys.append(key)
            previous = key
        self.hit_tokens += len(blocks) * size
        return blocks, keys

    def register(
        self, block: int, previous: BlockKey | None, tokens: Sequence[int], salt: str = ""
    ) -> BlockKey:
        """Block `block` now holds the K/V of a full block of `tokens` after the prefix
        keyed `previous` (a first block: under cache_salt `salt`): cache it (unless the
        same content is cached already) and return its key. The sequence that computed it
        keeps using it."""
        key = block_key(previous, tokens, salt)
        if not self.enabled or key in self._block_of or block in self._content:
            return key
        self._block_of[key] = block
        self._content[block] = (key, tuple(tokens))
        self._refs[block] = 1
        return key

    @property
    def keeps_partials(self) -> bool:
        """Whether partial blocks are kept and reused here."""
        return self.enabled and self.copy_block is not None

    def keep_partial(
        self, block: int, previous: BlockKey | None, tokens: Sequence[int], salt: str = ""
    ) -> bool:
        """A sequence lets go of block `block`, whose first len(tokens) < block_size rows
        hold the K/V of `tokens` after the prefix keyed `previous`: keep it as a partial
        block, cached and unused, for a prompt that holds all of `tokens` there. False:
        not kept, the caller frees it (the same partial is kept already, or partials are
        off)."""
        if not self.keeps_partials or not 0 < len(tokens) < self.block_size:
            return False
        key = block_key(previous, tokens, salt)
        if key in self._partial_of or block in self._content:
            return False
        self._partial_of[key] = block
        self._content[block] = (key, tuple(tokens))
        self._refs[block] = 0
        self._idle[block] = None
        if self.on_idle is not None:
            self.on_idle(block, key)
        return True

    def find_partial(
        self, previous: BlockKey | None, tokens: Sequence[int], salt: str = ""
    ) -> tuple[int, int] | None:
        """The held partial block after the prefix keyed `previous` whose tokens are the
        longest leading run of `tokens` (at most block_size-1 of them): (block, its n
        tokens), or None."""
        if not self._partial_of:
            return None
        tokens = tokens[: self.block_size - 1]
        keys = partial_keys(previous, tokens, salt)
        for n in range(len(keys), 0, -1):
            block = self._partial_of.get(keys[n - 1])
            if block is not None and self._content[block][1] == tuple(tokens[:n]):
                return block, n
        return None

    def match_partial(
        self, previous: BlockKey | None, tokens: Sequence[int], salt: str = ""
    ) -> tuple[int, int] | None:
        """After a sequence's full blocks (the last keyed `previous`), the next block: the
        longest partial block held for the first tokens of `tokens` (the caller passes
        those it may take: never its last token, which is computed for its logits),
        COPIED into a fresh block the sequence now owns. Returns (that block, n tokens
        held) or None (none held, or no room for the copy)."""
        if not self.keeps_partials:
            return None
        found = self.find_partial(previous, tokens, salt)
        if found is None:
            return None
        source, n = found
        self._use(source)  # not evicted for its own copy's room
        try:
            if not self.can_allocate(1):
                return None
            (block,) = self.allocate(1)
            assert self.copy_block is not None
            self.copy_block(source, block)
        finally:
            self.free([source])
        self.hit_tokens += n
        self.partial_tokens += n
        return block, n

    def load_prefix(
        self,
        token_ids: Sequence[int],
        max_blocks: int,
        found: Sequence[Found],
        load: Callable[[int, Found], bool],
        salt: str = "",
        positions: Sequence[int] | None = None,
        partial: tuple[int, int, Found] | None = None,
    ) -> int:
        """Cache the blocks of `token_ids`' prefix (at most `max_blocks`) that the box's
        store holds and this pool does not: `found[j]` names the stored bytes of the
        prompt's block `positions[j]` (None: block j). The store may hold blocks with gaps
        between them (a shared head that stays hot in the pools never reaches a store
        written on eviction; a history's middle may still be in this pool while its
        latest answer, decoded on another worker, is stored): a gap must be this pool's,
        else the prefix ends there. `load(block, found[j])` copies them into pool
        block `block` (False: they could not be read; the prefix ends there). The loaded
        blocks stay cached and unused, for the sequence's own `match`; only free room is
        taken (cached blocks nobody uses are evicted for it, as for any sequence, but never
        the prompt's own: a block after a gap the store fills is worth keeping).
        `partial` (position p, n, its bytes): a stored partial block holding the first n
        tokens of block p; kept as this pool's partial block where the prefix reaches p
        (for the sequence's `match_partial`). `salt` is the request's cache_salt. Returns
        how many blocks were loaded (the partial one included)."""
        if not self.enabled:
            return 0
        size = self.block_size
        at = dict(zip(range(len(found)) if positions is None else positions, found, strict=True))
        keys = prefix_keys(token_ids[: max_blocks * size], size, salt)
        here: list[int] = []  # the prompt's blocks this pool holds: in use meanwhile
        missing: list[int] = []  # the prompt's blocks to load, up to the first gap
        reach = len(keys)  # the prefix's blocks the pool holds or may load
        for i, key in enumerate(keys):
            block = self._block_of.get(key)
            if block is not None and self._content[block][1] == tuple(token_ids[i * size :][:size]):
                self._use(block)
                here.append(block)
            elif i in at:
                missing.append(i)
            else:
                reach = i
                break
        blocks = self.allocate(min(len(missing), self.num_free))
        loaded = 0
        for i, block in zip(missing, blocks, strict=False):
            if not load(block, at[i]):
                break
            tokens = token_ids[i * size : (i + 1) * size]
            self.register(block, keys[i - 1] if i else None, tokens, salt)
            loaded += 1
        if loaded < len(missing):
            reach = missing[loaded]
        self.stored_tokens += loaded * size
        if partial is not None and partial[0] == reach:
            n = self._load_partial(token_ids, keys, partial, load, salt)
            self.stored_tokens += n
            loaded += n > 0
        self.free(here + blocks)  # registered ones stay cached; the rest go back
        return loaded

    def _load_partial(
        self,
        token_ids: Sequence[int],
        keys: list[BlockKey],
        partial: tuple[int, int, Found],
        load: Callable[[int, Found], bool],
        salt: str,
    ) -> int:
        """load_prefix's partial block, read into a free block and kept as this pool's
        partial: its n tokens; 0 where the pool has it, has no room or the read failed.
        The prefix's blocks are in use meanwhile, so its room never evicts them."""
        at, n, hit = partial
        size = self.block_size
        tokens = token_ids[at * size : at * size + n]
        previous = keys[at - 1] if at else None
        if not self.keeps_partials or len(tokens) != n or not 0 < n < size:
            return 0
        if block_key(previous, tokens, salt) in self._partial_of or not self.can_allocate(1):
            return 0
        (block,) = self.allocate(1)
        if not load(block, hit) or not self.keep_partial(block, previous, tokens, salt):
            self.free([block])
            return 0
        return n

    def cached_blocks(self) -> list[tuple[int, BlockKey]]:
        """Every cached block nobody uses, least recently used first, with its key (what
        the pool would evict next: the store takes them when the worker stops)."""
        return [(block, self._content[block][0]) for block in self._idle]

    def _use(self, block: int) -> None:
        if self._refs[block] == 0:
            del self._idle[block]
        self._refs[block] += 1

    def _forget(self, block: int) -> None:
        key, tokens = self._content.pop(block)
        if len(tokens) < self.block_size:
            del self._partial_of[key]
        else:
            del self._block_of[key]
        del self._refs[block]
