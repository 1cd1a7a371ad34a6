"""Prompt routing with the box's KV store (issue 41), on plain data: a prompt goes to the
entry worker where it waits least, the tokens its pool saves against its queue; a block
the store holds counts as held by every worker that can load it (of its namespace), so a
prefix the store serves whole biases no such worker, while a pool that carries it further
than the store wins while its queue is shorter than what it saves, and a worker that
cannot load it gains nothing from it."""

from __future__ import annotations

from worker_handles import worker_handle

from appliance.core.router import Router, StoredKeys
from appliance.core.tuning import Tuning
from appliance.kv.prefix_cache import prefix_keys
from appliance.pools.worker_handle import WorkerHandle

BLOCK = 16
TUNING = Tuning(
    prefill_token_budget=512,
    chunk_size=256,
    decode_max_seqs=64,
    routing="least_loaded",
    admission="open",
)
HISTORY = list(range(1000, 1000 + 8 * BLOCK))  # a chat's history: eight full blocks


def entry(worker_id: int, queued: int = 0) -> WorkerHandle:
    handle = worker_handle(worker_id, "prefill")
    handle.queued_tokens = queued
    return handle


def lookup(
    held: set[int], asked: list[tuple[int, list[int]]], loads: set[int] | None = None
) -> StoredKeys:
    """A store holding `held` for the workers in `loads` (None: every worker), as the
    router asks it; each question noted in `asked`."""

    def stored(worker_id: int, prompt_keys: list[int]) -> set[int]:
        asked.append((worker_id, prompt_keys))
        return held & set(prompt_keys) if loads is None or worker_id in loads else set()

    return stored


def routed(
    router: Router, workers: list[WorkerHandle], prompt: list[int], stored: StoredKeys | None = None
) -> WorkerHandle:
    return router.prefill(workers, prompt, TUNING, stored=stored)


def test_the_worker_whose_pool_holds_the_longest_prefix_takes_the_prompt() -> None:
    """b holds eight blocks, a four (the first prompt's): b saves 64 tokens more, so b
    takes it while its queue is shorter than that, and a once b's queue outweighs them
    (the rule before took b at any queue within a step budget, 512 tokens)."""
    router = Router(BLOCK, prefix_caching=True)
    a, b = entry(0), entry(1, queued=40)  # b is busier
    assert routed(router, [a, b], [*HISTORY[: 4 * BLOCK], 1, 2]) is a  # no prefix: least loaded
    router.prefill([b], [*HISTORY, 3], TUNING)  # b prefilled the whole history
    assert routed(router, [a, b], [*HISTORY, 4, 5]) is b  # b: 40 + 2 against a's 66
    b.queued_tokens = 100
    assert routed(router, [a, b], [*HISTORY, 4, 5]) is a  # b: 100 + 2 against a's 66


def test_a_prefix_the_store_holds_whole_biases_no_worker() -> None:
    router = Router(BLOCK, prefix_caching=True)
    a, b = entry(0), entry(1, queued=100)
    router.prefill([b], [*HISTORY, 3], TUNING)  # b's pool holds the history
    assert routed(router, [a, b], [*HISTORY, 4, 5]) is b  # without the store: b's pool
    keys = prefix_keys(HISTORY, BLOCK)
    asked: list[tuple[int, list[int]]] = []
    stored = lookup(set(keys), asked)  # the store holds it too: a loads it as well
    assert routed(router, [a, b], [*HISTORY, 6, 7], stored) is a  # so the least loaded
    assert asked == [(0, keys), (1, keys)]  # each worker's prompt's full blocks' keys


def test_stored_blocks_a_worker_cannot_load_do_not_count_for_it() -> None:
    """The store holds the history under b's namespace only (a runs another KV dtype):
    a, though least loaded, would compute it all; b loads the rest after its own four
    blocks, so b takes it. Counting the store for every worker tied them at eight
    blocks, and the least loaded a, which can load none, took it."""
    router = Router(BLOCK, prefix_caching=True)
    a, b = entry(0), entry(1, queued=100)
    router.prefill([b], [*HISTORY[: 4 * BLOCK], 3], TUNING)  # b's pool: four blocks
    keys = prefix_keys(HISTORY, BLOCK)
    stored = lookup(set(keys), [], loads={1})
    assert routed(router, [a, b], [*HISTORY, 4, 5], stored) is b


def test_a_pool_that_carries_the_prefix_further_than_the_store_wins() -> None:
    """While its queue is shorter than the tokens it saves (three blocks, 48): the rule
    before took b at a queue of 100 too."""
    router = Router(BLOCK, prefix_caching=True)
    a, b = entry(0), entry(1, queued=40)
    router.prefill([b], [*HISTORY, 3], TUNING)  # b's pool: all eight blocks
    keys = prefix_keys(HISTORY, BLOCK)
    stored = lookup(set(keys[:5]), [])  # the store: the first five (evicted elsewhere)
    assert routed(router, [a, b], [*HISTORY, 4, 5], stored) is b  # 40 + 2 against 50
    b.queued_tokens = 100
    assert routed(router, [a, b], [*HISTORY, 4, 5], stored) is a  # 100 + 2 against 50


def test_stored_blocks_join_a_pools_own_head_and_a_gap_ends_the_prefix() -> None:
    """Worker a holds the head (a system prompt), the store the rest: a gets all eight
    blocks; b, holding neither the head nor anything else, gets none, since a stored run
    after a block nobody has is of no use."""
    router = Router(BLOCK, prefix_caching=True)
    a, b = entry(0, queued=100), entry(1)
    router.prefill([a], [*HISTORY[: 2 * BLOCK], 3], TUNING)  # a: the first two blocks
    keys = prefix_keys(HISTORY, BLOCK)
    stored = lookup(set(keys[2:]), [])
    assert routed(router, [a, b], [*HISTORY, 4, 5], stored) is a
    # The store's run without the head is nobody's: the least loaded takes it.
    fresh = Router(BLOCK, prefix_caching=True)
    assert routed(fresh, [a, b], [*HISTORY, 4, 5], stored) is b


def test_far_behind_the_least_loaded_a_prefix_does_not_win() -> None:
    router = Router(BLOCK, prefix_caching=True)
    a, b = entry(0), entry(1, queued=TUNING.prefill_token_budget + 1)
    router.prefill([b], [*HISTORY, 3], TUNING)
    assert routed(router, [a, b], [*HISTORY, 4, 5]) is a


def test_round_robin_and_a_disabled_prefix_cache_never_ask_the_store() -> None:
    asked: list[tuple[int, list[int]]] = []
    stored = lookup(set(), asked)
    off = Router(BLOCK, prefix_caching=False)
    a, b = entry(0), entry(1)
    off.prefill([a, b], [*HISTORY, 1], TUNING, stored=stored)
    in_turn = TUNING.model_copy(update={"routing": "round_robin"})
    Router(BLOCK, prefix_caching=True).prefill([a, b], [*HISTORY, 1], in_turn, stored=stored)
    assert asked == []
