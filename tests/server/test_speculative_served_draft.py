"""A draft model where users meet it: `appliance serve` with speculative.method = "draft"
(the draft: the embedded model itself, so nearly every draft is kept), in each layout.
Split: the decode worker loads the draft and, for each handed-off request, computes the
prompt in the draft first (it cannot draft otherwise: its drafts were kept, /metrics
says so); the prefill worker loads none and drafts nothing. Colocated: each worker drafts
for its own requests. Greedy answers through the official openai client equal the same
server's plain answers (`speculative.n_max` 0), token for token, alone and for requests
decoded together; every KV block is free after."""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import pytest
from openai import OpenAI
from prometheus_client.parser import text_string_to_metric_families
from server_process import API_KEY, ServerProcess, wait_until

from appliance.model.model_source import default_model_path, model_name

pytestmark = pytest.mark.process  # a server of its own: the shared ones draft by n-gram

MODEL = model_name(None)
AUTH = {"Authorization": f"Bearer {API_KEY}"}
PLAIN = {"speculative.n_max": 0}  # this request decodes without drafts
QUESTIONS = [
    "Repeat this sentence exactly: the river wound past the old stone bridge.",
    "Name three planets of the solar system.",
    "What is the capital of France?",
]


@pytest.fixture(scope="module", params=["split", "colocated"])
def draft_server(request: pytest.FixtureRequest) -> Iterator[ServerProcess]:
    """1 prefill + 1 decode worker, or colocated ones; each decoding worker drafts 4
    tokens a step with the embedded model (adaptive off: a draft as large as the target
    never pays, and the adaptive rule would pause it at once)."""
    layout = {"APPLIANCE_MODE": "colocated"} if request.param == "colocated" else {}
    process = ServerProcess(
        {
            **layout,
            "APPLIANCE_API_KEY": API_KEY,
            "APPLIANCE_KV__MEMORY_MB": "48",
            "APPLIANCE_SPECULATIVE__METHOD": "draft",
            "APPLIANCE_SPECULATIVE__DRAFT_MODEL": str(default_model_path()),
            "APPLIANCE_SPECULATIVE__NUM_SPECULATIVE_TOKENS": "4",
            "APPLIANCE_SPECULATIVE__ADAPTIVE": "false",
        }
    )
    process.start()
    yield process
    process.stop()


@pytest.fixture(scope="module")
def client(draft_server: ServerProcess) -> OpenAI:
    return OpenAI(base_url=draft_server.url + "/v1", api_key=API_KEY, max_retries=0, timeout=300)


def spec_counts(server: ServerProcess) -> dict[tuple[str, str], float]:
    """Each spec_decode counter by (name, worker role), from /metrics."""
    text = httpx.get(server.url + "/metrics", headers=AUTH).text
    totals: dict[tuple[str, str], float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name.startswith("appliance_spec_decode_num_"):
                key = (sample.name, sample.labels["role"])
                totals[key] = totals.get(key, 0.0) + sample.value
    return totals


def chat(client: OpenAI, question: str, extra: dict[str, Any] | None = None) -> Any:
    messages = [{"role": "user", "content": question}]
    return client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=32, temperature=0, extra_body=extra
    )


def answer(reply: Any) -> tuple[str | None, str, int]:
    """What must match: the text, the finish reason and the tokens made."""
    choice = reply.choices[0]
    return choice.message.content, choice.finish_reason, reply.usage.completion_tokens


def test_a_decoding_workers_pool_shares_its_budget(draft_server: ServerProcess) -> None:
    """The draft's KV pool comes out of a decoding worker's budget: the draft has the
    target's shape, so the two pools get half the blocks each. A prefill worker loads
    no draft and keeps the budget's blocks (split)."""
    pools = httpx.get(draft_server.url + "/health").json()["pools"]
    workers = [w for pool in pools.values() for w in pool]
    if pools.get("prefill"):
        [prefill], [decode] = pools["prefill"], pools["decode"]
        assert decode["num_blocks"] == prefill["num_blocks"] // 2
    else:  # colocated: every worker decodes, so every one carries a draft
        assert len({w["num_blocks"] for w in workers}) == 1 and workers[0]["num_blocks"] > 0


def test_drafted_answers_equal_plain_ones(client: OpenAI, draft_server: ServerProcess) -> None:
    """One at a time, then all together (the draft drafts for the batch in one pass
    per draft position): the plain answers, token for token."""
    plain = [answer(chat(client, q, PLAIN)) for q in QUESTIONS]
    before = spec_counts(draft_server)
    alone = [answer(chat(client, q)) for q in QUESTIONS]
    with ThreadPoolExecutor(len(QUESTIONS)) as pool:
        together = [answer(r) for r in pool.map(lambda q: chat(client, q), QUESTIONS)]
    assert alone == plain
    assert together == plain
    after = spec_counts(draft_server)

    def made(name: str, role: str) -> float:
        key = (f"appliance_spec_decode_num_{name}_total", role)
        return after.get(key, 0.0) - before.get(key, 0.0)

    drafted, kept = made("draft_tokens", "decode"), made("accepted_tokens", "decode")
    # A handed-off request's drafts need the prompt in the draft first: kept drafts show
    # the decode worker's draft computed it. Its own model drafting: nearly all kept.
    if made("draft_tokens", "colocated") > 0:
        drafted, kept = made("draft_tokens", "colocated"), made("accepted_tokens", "colocated")
    assert drafted > 0 and kept > 0.8 * drafted
    assert made("draft_tokens", "prefill") == 0


def test_every_block_is_free_after(client: OpenAI, draft_server: ServerProcess) -> None:
    """The target's blocks, as /health counts them (a worker's report may come a moment
    after the answer). The draft's blocks go with them: tests/engine/test_speculative_
    draft.py checks its pool."""
    chat(client, QUESTIONS[0])

    def all_free() -> bool:
        health = httpx.get(draft_server.url + "/health").json()
        workers = [w for pool in health["pools"].values() for w in pool]
        return all(w["num_free_blocks"] == w["num_blocks"] for w in workers)

    wait_until(all_free, 10.0, "every KV block free after the answers")
