"""The disaggregated runtime with real worker processes: parity across layouts, KV freed,
many concurrent requests, cancellation.

On this 2-core machine each worker is pinned to one core (1P+2D shares a core).
"""

from __future__ import annotations

import asyncio
import os

import pytest
from runtime_runs import GREEDY, QUESTIONS, cpu_topology, run_all, wait_all_free

from appliance.api import Appliance
from appliance.engine.llm_engine import LLMEngine
from appliance.engine.sequence import SamplingParams
from appliance.settings.config import load_settings

pytestmark = pytest.mark.process  # the slow lane (conftest.py): processes or a whole model


@pytest.fixture(scope="module")
def chat_prompts(engine: LLMEngine) -> list[list[int]]:
    return [
        engine.tokenizer.apply_chat_template([{"role": "user", "content": q}]) for q in QUESTIONS
    ]


@pytest.fixture(scope="module")
def expected(engine: LLMEngine, chat_prompts: list[list[int]]) -> list[list[int]]:
    return [c.token_ids for c in engine.generate(chat_prompts, GREEDY)]


@pytest.mark.parametrize(
    ("mode", "cores", "prefill", "decode", "colocated"),
    [
        ("colocated", [(0,), (1,)], None, None, None),
        ("disaggregated", [(0,), (1,)], "0", "1", None),
        ("disaggregated", [(0,), (1,), (1,)], "0", "1,2", None),
        ("disaggregated", [(0,), (1,), (1,)], "1", "2", "0"),
    ],
    ids=["colocated-2", "1P+1D", "1P+2D", "1P+1D+1C"],
)
def test_greedy_outputs_equal_the_single_engine(
    mode: str,
    cores: list,
    prefill: str | None,
    decode: str | None,
    colocated: str | None,
    chat_prompts: list[list[int]],
    expected: list[list[int]],
) -> None:
    settings = load_settings(
        dtype="float32",
        prefill_gemm="float32",  # a bfloat16 GEMM rounds as each worker's steps are batched
        device="cpu",
        mode=mode,
        prefill_devices=prefill,
        decode_devices=decode,
        colocated_devices=colocated,
        # A small prefill budget makes the router spread prompts instead of keeping them
        # with the worker that holds their common chat-template prefix.
        batch={"max_num_batched_tokens": 64, "chunk_size": 64} if colocated else {},
    )

    async def main() -> tuple[list[list[int]], dict, dict[str, int]]:
        async with Appliance(settings, cpu_topology(*cores)) as app:
            assert len(app.supervisor.workers) == len(cores)
            got = await run_all(app, chat_prompts)
            made: dict[str, int] = {}
            for worker in app.supervisor.workers.values():
                made[worker.role] = made.get(worker.role, 0) + worker.tokens_out
            return got, await wait_all_free(app.supervisor), made

    got, counts, made = asyncio.run(main())
    assert got == expected
    assert all(free == total for free, total in counts.values()), counts
    assert all(made.values()), made  # every role took part: colocated beside prefill too


@pytest.mark.extended  # a load test: the suite's runtime tests cover each path with a few requests
def test_200_concurrent_mixed_requests_complete_and_50_cancelled_free_their_blocks() -> None:
    """Disaggregated 1P+1D; prompts up to 3x the chunk size; 50 consumers leave midway."""
    import random
    from contextlib import aclosing

    rng = random.Random(0)
    # The smallest chunk the settings allow (16): prompts of 3-49 tokens prefill in 1 to 4
    # chunks, two chunks a step, as prompts of 3-149 did at 48: the same interleaving at a
    # third of the prefill tokens, whose compute was most of this test's time.
    chunk = 16
    settings = load_settings(
        dtype="bfloat16",
        device="cpu",
        mode="disaggregated",
        batch={"chunk_size": chunk, "max_num_batched_tokens": 2 * chunk},
    )
    requests = [
        (
            [rng.randrange(100, 40000) for _ in range(rng.randrange(3, 3 * chunk + 2))],
            SamplingParams(max_tokens=rng.randrange(2, 16), ignore_eos=True),
        )
        for _ in range(200)
    ]
    cancel = set(rng.sample(range(200), 50))

    async def one(index: int, app: Appliance) -> tuple[int, str | None]:
        ids, params = requests[index]
        received, reason = 0, None
        async with aclosing(app.generate(ids, params=params)) as stream:
            async for chunk in stream:
                received += len(chunk.token_ids)
                reason = chunk.finish_reason
                if index in cancel and received >= max(1, params.max_tokens // 2):
                    return received, "cancelled"
        return received, reason

    async def main() -> tuple[list, dict]:
        async with Appliance(settings, cpu_topology((0,), (1,))) as app:
            results = await asyncio.wait_for(
                asyncio.gather(*(one(i, app) for i in range(200))), timeout=400
            )
            return results, await wait_all_free(app.supervisor)

    results, counts = asyncio.run(main())
    for index, (received, reason) in enumerate(results):
        if index in cancel:
            assert reason == "cancelled"
        else:
            assert (received, reason) == (requests[index][1].max_tokens, "length")
    assert all(free == total for free, total in counts.values()), counts


def test_a_stream_outlives_its_only_decode_worker() -> None:
    """The decode pool's only worker is killed mid-stream: the stream waits for it to be
    restarted, goes on from where it was (prompt + tokens so far), and ends with exactly
    max_tokens tokens; greedy, so the same tokens as without the crash."""
    import signal

    settings = load_settings(dtype="float32", device="cpu", mode="disaggregated")
    params = SamplingParams(max_tokens=60, ignore_eos=True)

    async def consume(app: Appliance) -> list[int]:
        tokens: list[int] = []
        async for chunk in app.generate("Count to a thousand:", params=params):
            tokens += chunk.token_ids
        return tokens

    async def main() -> tuple[list[int], list[int], int]:
        async with Appliance(settings, cpu_topology((0,), (1,))) as app:
            calm = await consume(app)
            task = asyncio.create_task(consume(app))
            supervisor = app.supervisor
            while not any(len(r.output_ids) > 5 for r in supervisor.requests.values()):
                await asyncio.sleep(0.05)
            decode = next(w for w in supervisor.workers.values() if w.role == "decode")
            os.kill(decode.process.pid, signal.SIGKILL)
            crashed = await asyncio.wait_for(task, timeout=120)
            restarted = next(w for w in supervisor.workers.values() if w.role == "decode")
            return calm, crashed, restarted.restarts

    calm, crashed, restarts = asyncio.run(main())
    assert restarts == 1
    assert len(crashed) == 60 and crashed == calm
