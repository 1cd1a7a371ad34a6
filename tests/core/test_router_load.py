"""Prefix affinity against load, on plain data: a prompt goes where it waits least for its
first token, in prompt tokens computed (the queue ahead, the part of it not cached there,
a row per running sequence per step). Hand-made worker states: where only one worker's
pool holds the prefix (store off, or the store lacks the blocks) that worker wins though
busier; where the store holds the prefix, any worker loads it and load decides: the case
measured on the colocated layout (docs/kv_store.md), where every chat turn went to the
worker holding the shared system prompt while the other sat idle."""

from __future__ import annotations

from worker_handles import worker_handle

from appliance.core.prefill_cost import Held, Load, held_prefix, prompt_cost, uncached_tokens
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
SYSTEM = list(range(5000, 5000 + 40 * BLOCK))  # a shared system prompt: 40 blocks, 640 tokens
HISTORY = [*SYSTEM, *range(9000, 9000 + 5 * BLOCK)]  # and a chat's earlier turns: 45 blocks
TURN = [*HISTORY, *range(7000, 7000 + 80)]  # the next turn: 800 tokens, 80 of them new


def colocated(queued: int = 0, running: int = 0, worker_id: int = 0) -> WorkerHandle:
    handle = worker_handle(worker_id, "colocated")
    handle.queued_tokens, handle.running = queued, running
    return handle


def store_of(held: list[int], loads: set[int] | None = None) -> StoredKeys:
    """A store holding `held` for the workers in `loads` (None: every worker)."""

    def stored(worker_id: int, keys: list[int]) -> set[int]:
        return set(held) & set(keys) if loads is None or worker_id in loads else set()

    return stored


def warmed(router: Router, worker: WorkerHandle) -> None:
    """`worker` prefilled the chat's history: its pool holds it."""
    router.prefill([worker], [*HISTORY, 1], TUNING)


# ---------------------------------------------------------------- the cost, on numbers


def test_the_block_with_the_last_token_is_always_computed() -> None:
    assert uncached_tokens(800, 45, BLOCK) == 80
    assert uncached_tokens(32, 2, BLOCK) == 16  # both blocks held: the last is computed
    assert uncached_tokens(5, 0, BLOCK) == 5


def test_a_held_prefix_joins_pool_and_store_and_ends_at_a_gap() -> None:
    keys = [1, 2, 3, 4, 5]
    assert held_prefix(keys, {1, 2}, {3, 5}) == Held(3, 1)  # 4 missing: 5 is of no use
    assert held_prefix(keys, {1, 2}, {1, 2, 3}) == Held(3, 1)  # a pool's block is not loaded
    assert held_prefix(keys, set(), {2, 3}) == Held(0, 0)  # without the head: nothing


def test_running_sequences_cost_a_row_in_every_step_the_prompt_spans() -> None:
    idle = prompt_cost(800, Held(0, 0), Load(0, 0), BLOCK, 512)
    assert (idle.wait, idle.compute) == (800, 800)
    busy = prompt_cost(800, Held(0, 0), Load(300, 4), BLOCK, 512)
    assert busy.wait == 300 + 800 + 4 * 3  # 1100 tokens: three steps of 512
    cached = prompt_cost(800, Held(45, 45), Load(0, 4), BLOCK, 512)
    assert (cached.wait, cached.compute, cached.loaded) == (80 + 4, 80, 45)


# ---------------------------------------------------------------- affinity wins


def test_with_the_store_off_the_worker_holding_the_prefix_wins_though_busier() -> None:
    router = Router(BLOCK, prefix_caching=True)
    holder, other = colocated(queued=300, running=3), colocated(worker_id=1)
    warmed(router, holder)
    # holder: 300 queued + 80 new + 3 rows a step (one step) = 383; other: 800
    routed = router.route([holder, other], TURN, TUNING)
    assert routed.worker is holder and routed.compute == 80


def test_where_the_store_lacks_the_blocks_the_pool_that_holds_them_wins() -> None:
    router = Router(BLOCK, prefix_caching=True)
    holder, other = colocated(queued=300, running=3), colocated(worker_id=1)
    warmed(router, holder)
    keys = prefix_keys(TURN, BLOCK)
    head_only = store_of(keys[:10])  # the store: the first ten blocks only
    # other: 800 - 160 = 640 against holder's 383
    assert router.prefill([holder, other], TURN, TUNING, stored=head_only) is holder
    others_kind = store_of(keys, loads={0})  # all of it, but other cannot load it
    assert router.prefill([holder, other], TURN, TUNING, stored=others_kind) is holder


def test_affinity_yields_once_the_queue_outweighs_the_tokens_saved() -> None:
    router = Router(BLOCK, prefix_caching=True)
    holder, other = colocated(queued=719, worker_id=0), colocated(worker_id=1)
    warmed(router, holder)
    assert router.prefill([holder, other], TURN, TUNING) is holder  # 719 + 80 < 800
    holder.queued_tokens = 721
    another = [*HISTORY, *range(8000, 8080)]  # (the holder holds TURN whole now)
    assert router.prefill([holder, other], another, TUNING) is other  # 721 + 80 > 800


# ---------------------------------------------------------------- load wins


def test_where_the_store_holds_the_prefix_a_busy_holder_loses_to_an_idle_worker() -> None:
    """The measured case: worker 0 holds the system prompt and the history in its pool and
    is decoding another chat's answer; the store holds the history too. Worker 1 loads it
    (45 blocks, a few ms) and computes the same 80 tokens at once."""
    router = Router(BLOCK, prefix_caching=True)
    holder, idle = colocated(running=1), colocated(worker_id=1)
    warmed(router, holder)
    stored = store_of(prefix_keys(HISTORY, BLOCK))
    routed = router.route([holder, idle], TURN, TUNING, stored=stored)
    assert routed.worker is idle and routed.compute == 80  # 80 against holder's 81
    holder.running, holder.queued_tokens = 0, 40  # a queued prompt, not a running one
    assert router.prefill([holder, idle], TURN, TUNING, stored=stored) is idle


def test_with_nothing_to_choose_the_pool_beats_a_load_from_the_store() -> None:
    """Both idle, the store and worker 0's pool hold the history: equal waits, and worker
    0 copies nothing in."""
    router = Router(BLOCK, prefix_caching=True)
    holder, other = colocated(), colocated(worker_id=1)
    warmed(router, holder)
    stored = store_of(prefix_keys(HISTORY, BLOCK))
    assert router.prefill([other, holder], TURN, TUNING, stored=stored) is holder


def test_a_burst_of_turns_the_store_holds_spreads_over_both_workers() -> None:
    """Eight chats' next turns at once, every history in the store and in worker 0's
    pool: each prompt queued where it went, as the request flow does (its `compute`).
    Without the store all eight go to worker 0 (it saves 720 tokens on each); with it
    they split evenly."""
    chats = [[*SYSTEM, *range(10_000 * c, 10_000 * c + 5 * BLOCK)] for c in range(1, 9)]
    turns = [[*chat, *range(7000, 7080)] for chat in chats]
    stored_keys = [k for chat in chats for k in prefix_keys(chat, BLOCK)]

    def burst(stored: StoredKeys | None) -> list[int]:
        router = Router(BLOCK, prefix_caching=True)
        workers = [colocated(), colocated(worker_id=1)]
        for chat in chats:
            router.prefill(workers[:1], [*chat, 1], TUNING)  # worker 0 served every chat
        picked = []
        for turn in turns:
            routed = router.route(workers, turn, TUNING, stored=stored)
            routed.worker.queued_tokens += routed.compute
            picked.append(routed.worker.worker_id)
        return picked

    assert burst(None) == [0] * 8
    assert sorted(burst(store_of(stored_keys))) == [0] * 4 + [1] * 4
