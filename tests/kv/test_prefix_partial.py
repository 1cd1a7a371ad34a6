"""Partial blocks on plain data: a finished request's last, partial block is kept under a
key no full block has, found for a prompt that starts with the same full blocks and then
its tokens (the longest run held, never the prompt's last token), and handed out as a
copy, so the kept block is never written by the sequence that reuses it."""

from __future__ import annotations

from appliance.engine.scheduler import Scheduler, SchedulerLimits
from appliance.engine.sequence import SamplingParams, Sequence
from appliance.kv.block_allocator import BlockAllocator
from appliance.kv.prefix_cache import PrefixCache, block_key, partial_keys, prefix_keys

SIZE = 4


class Pool:
    """A pool's blocks as lists of the tokens each row holds, copied as the engine would."""

    def __init__(self, num_blocks: int) -> None:
        self.rows: dict[int, list[int]] = {b: [] for b in range(num_blocks)}
        self.copies: list[tuple[int, int]] = []

    def copy(self, source: int, target: int) -> None:
        self.rows[target] = list(self.rows[source])
        self.copies.append((source, target))


def cache_with(num_blocks: int = 8) -> tuple[PrefixCache, Pool]:
    cache = PrefixCache(BlockAllocator(num_blocks), SIZE)
    pool = Pool(num_blocks)
    cache.copy_block = pool.copy
    return cache, pool


def finish(cache: PrefixCache, tokens: list[int], salt: str = "") -> tuple[list[int], list[int]]:
    """A request that computed `tokens`: full blocks cached, its last partial block kept."""
    blocks = cache.allocate(-(-len(tokens) // SIZE))
    keys = prefix_keys(tokens, SIZE, salt)
    for i, key in enumerate(keys):
        assert (
            cache.register(blocks[i], keys[i - 1] if i else None, tokens[i * SIZE :][:SIZE], salt)
            == key
        )
    full = len(keys)
    tail = tokens[full * SIZE :]
    cache.free(blocks[:full])
    if tail and not cache.keep_partial(blocks[full], keys[-1] if keys else None, tail, salt):
        cache.free(blocks[full:])
    return blocks, keys


def test_partial_keys_are_the_block_keys_of_every_run_and_differ_from_full_blocks() -> None:
    previous = block_key(None, [1, 2, 3, 4])
    tokens = [5, 6, 7]
    assert partial_keys(previous, tokens) == [block_key(previous, tokens[:n]) for n in (1, 2, 3)]
    assert partial_keys(None, tokens, "tenant") == [
        block_key(None, tokens[:n], "tenant") for n in (1, 2, 3)
    ]
    full = block_key(previous, [5, 6, 7, 8])
    assert full not in partial_keys(previous, [5, 6, 7])


def test_a_finished_requests_tail_is_found_copied_and_kept() -> None:
    cache, pool = cache_with()
    blocks, keys = finish(cache, [1, 2, 3, 4, 5, 6])  # one full block, then 5, 6
    assert cache.num_cached == 2 and cache.num_free == 8  # both cached, neither in use
    got = cache.match_partial(keys[-1], [5, 6, 9])
    assert got is not None
    block, n = got
    assert n == 2 and block != blocks[1]  # a fresh block: the kept one is never written
    assert pool.copies == [(blocks[1], block)]
    assert cache.hit_tokens == 2 and cache.partial_tokens == 2
    assert cache.match_partial(keys[-1], [5, 6, 9]) is not None  # still kept for the next


def test_the_longest_tail_held_wins_and_only_a_whole_tail_is_reused() -> None:
    cache, _ = cache_with()
    short, _ = finish(cache, [1, 2, 3, 4, 5])
    blocks, keys = finish(cache, [1, 2, 3, 4, 5, 6, 7])
    assert cache.find_partial(keys[-1], [5, 6, 7]) == (blocks[1], 3)
    # A prompt that holds only part of a tail there does not reuse it (its n rows are
    # one key): the shorter tail it holds whole is found instead.
    assert cache.find_partial(keys[-1], [5, 6]) == (short[1], 1)
    assert cache.find_partial(keys[-1], [5, 9, 9]) == (short[1], 1)
    assert cache.find_partial(keys[-1], [9, 6, 7]) is None


def test_a_partial_is_reused_only_after_the_same_prefix_and_under_the_same_salt() -> None:
    cache, _ = cache_with()
    _, keys = finish(cache, [1, 2, 3, 4, 5, 6], salt="a")
    other = block_key(None, [9, 2, 3, 4], "a")
    assert cache.find_partial(other, [5, 6]) is None
    _, plain = finish(cache, [7, 7])  # a first block's partial, no salt
    assert plain == []
    assert cache.find_partial(None, [7, 7], "b") is None
    assert cache.find_partial(None, [7, 7, 1]) is not None
    assert cache.find_partial(keys[-1], [5, 6], "a") is not None


def test_partial_blocks_are_evicted_like_cached_ones_and_told_to_the_store() -> None:
    cache, _ = cache_with(num_blocks=3)
    idle: list[int] = []
    evicted: list[int] = []
    cache.on_idle = lambda _block, key: idle.append(key)
    cache.on_evict = lambda _block, key: evicted.append(key)
    _, keys = finish(cache, [1, 2, 3, 4, 5, 6])
    partial = block_key(keys[-1], [5, 6])
    assert partial in idle
    assert partial in [key for _, key in cache.cached_blocks()]
    cache.allocate(3)  # the pool needs every block: both cached ones go
    assert partial in evicted
    assert cache.num_cached == 0 and cache.find_partial(keys[-1], [5, 6, 7]) is None


def test_no_copier_no_partials() -> None:
    cache = PrefixCache(BlockAllocator(4), SIZE)
    assert not cache.keep_partial(0, None, [1, 2])
    assert cache.match_partial(None, [1, 2]) is None


def test_a_stored_partial_loads_where_the_prefix_reaches_it() -> None:
    cache, _ = cache_with()
    prompt = [1, 2, 3, 4, 5, 6, 7, 8, 9]
    keys = prefix_keys(prompt, SIZE)
    read: list[str] = []

    def load(_block: int, name: str) -> bool:
        read.append(name)
        return True

    loaded = cache.load_prefix(prompt, 2, ["b0"], load, partial=(1, 3, "p1"))
    assert loaded == 2 and read == ["b0", "p1"]
    assert cache.stored_tokens == SIZE + 3
    found = cache.find_partial(keys[0], prompt[4:8])
    assert found is not None and found[1] == 3
    # Where the prefix stops short of the partial's block (block 0 neither held nor
    # stored), it is not read.
    other, _ = cache_with()
    read.clear()
    assert other.load_prefix(prompt, 2, [], load, partial=(1, 3, "p1")) == 0
    assert read == []


def scheduler_with(num_blocks: int = 16) -> tuple[Scheduler, Pool]:
    limits = SchedulerLimits(
        max_num_seqs=4, max_num_batched_tokens=64, chunk_size=64, max_model_len=64
    )
    scheduler = Scheduler(BlockAllocator(num_blocks), SIZE, limits, prefix_caching=True)
    pool = Pool(num_blocks)
    scheduler.blocks.copy_block = pool.copy
    return scheduler, pool


def run(scheduler: Scheduler, seq: Sequence, answer: list[int]) -> None:
    """Prefill seq, then decode `answer` token by token until it finishes."""
    scheduler.add(seq)
    for token in answer:
        out = scheduler.schedule()
        scheduler.update_from_output(out, {seq.seq_id: token})
    assert seq.finished


def test_the_next_turn_starts_mid_block_on_a_copy_of_the_last_answers_tail() -> None:
    scheduler, pool = scheduler_with()
    params = SamplingParams(max_tokens=3, ignore_eos=True)
    first = Sequence(0, [1, 2, 3, 4, 5], params)
    run(scheduler, first, [6, 7, 8])  # computed 1..7; 8 sampled, never fed
    assert first.num_computed_tokens == 7
    turn = Sequence(1, [1, 2, 3, 4, 5, 6, 7, 8, 9, 10], params)
    scheduler.add(turn)
    out = scheduler.schedule()
    assert turn.num_cached_tokens == 7  # one full block and 5, 6, 7 of the next
    [chunk] = out.prefills
    assert chunk.start == 7 and chunk.num_tokens == 3
    assert len(pool.copies) == 1 and pool.copies[0][1] == turn.block_table[1]
    scheduler.update_from_output(out, {1: 11})
    assert len(turn.block_keys) == 2  # the copied block filled up and joined the cache


def test_the_last_prompt_token_is_always_computed() -> None:
    scheduler, _ = scheduler_with()
    params = SamplingParams(max_tokens=3, ignore_eos=True)
    run(scheduler, Sequence(0, [1, 2, 3, 4, 5], params), [6, 7, 8])  # tail 5, 6, 7
    again = Sequence(1, [1, 2, 3, 4, 5, 6, 7], params)  # exactly the computed tokens
    scheduler.add(again)
    out = scheduler.schedule()
    assert again.num_cached_tokens == 4  # the tail would cover its last token: not used
    assert [c.num_tokens for c in out.chunks] == [3]
    scheduler.update_from_output(out, {1: 8})
    scheduler.finish(again, "stop")  # its own tail is 5, 6, 7: held already, freed
    assert scheduler.blocks.num_free == 16


def test_an_aborted_requests_tail_is_not_kept() -> None:
    scheduler, _ = scheduler_with()
    seq = Sequence(0, [1, 2, 3, 4, 5, 6], SamplingParams(max_tokens=8, ignore_eos=True))
    scheduler.add(seq)
    out = scheduler.schedule()
    scheduler.update_from_output(out, {0: 7})
    scheduler.finish(seq, "abort")
    assert scheduler.blocks.find_partial(prefix_keys([1, 2, 3, 4], SIZE)[0], [5, 6]) is None
    assert scheduler.blocks.num_free == 16
