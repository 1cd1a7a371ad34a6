"""Speculative decoding in a tensor-parallel decode pool: a TP=1 prefill worker hands off
to a TP=2 decode group whose leader drafts by prompt lookup and verifies the drafts in
steps its follower runs in lockstep; greedy answers equal one process's plain decoding,
token for token, drafts were kept, and every KV block is free after. (No shared fixture
serves a TP=2 pool: this module starts its own processes, as tests/model/
test_tensor_parallel.py does.)"""

from __future__ import annotations

import asyncio

import pytest
from copying_prompt import copying_prompt
from runtime_runs import cpu_topology, wait_all_free

from appliance.api import Appliance
from appliance.engine.llm_engine import LLMEngine
from appliance.engine.sequence import SamplingParams
from appliance.settings.config import load_settings

pytestmark = pytest.mark.process  # worker processes and a whole model

GREEDY = SamplingParams(max_tokens=32)


def prompts_of(engine: LLMEngine) -> list[list[int]]:
    """A prompt that continues by copying (drafts are kept) and a chat question."""
    tokenizer = engine.tokenizer
    copying = copying_prompt(tokenizer)
    chat = tokenizer.apply_chat_template([{"role": "user", "content": "Name a planet."}])
    return [copying, chat]


def test_a_tp2_decode_pool_speculates_with_plain_decodings_answers(engine: LLMEngine) -> None:
    prompts = prompts_of(engine)
    expected = [c.token_ids for c in engine.generate(prompts, GREEDY)]
    settings = load_settings(
        dtype="float32",
        device="cpu",
        weights="dense",
        mode="disaggregated",
        prefill_gemm="float32",
        decode_tp=2,
        prefill_devices="2",
        decode_devices="0,1",
        speculative={"method": "ngram", "num_speculative_tokens": 8},
    )

    async def main() -> tuple[list[list[int]], dict, list]:
        async with Appliance(settings, cpu_topology((0,), (1,), (0,))) as app:

            async def one(ids: list[int]) -> list[int]:
                return [
                    t async for chunk in app.generate(ids, params=GREEDY) for t in chunk.token_ids
                ]

            got = list(await asyncio.gather(*(one(p) for p in prompts)))
            counts = await wait_all_free(app.supervisor)
            views = app.supervisor.views()
        return got, counts, views

    got, counts, views = asyncio.run(main())
    assert got == expected
    assert all(free == total for free, total in counts.values()), counts
    decode = [v for v in views if v.role == "decode"]
    assert [len(v.devices) for v in decode] == [2]
    assert decode[0].speculation.accepted > 0  # the copying prompt's drafts held
    assert all(v.speculation.drafted == 0 for v in views if v.role == "prefill")
