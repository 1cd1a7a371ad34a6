"""Speculative decoding where users meet it: the per-request fields (llama.cpp's
speculative.n_max / speculative.n_min, sent by the openai client in extra_body), the
per-worker counts on /metrics and the admin snapshot (and both across the box link's
wire), and answers served over HTTP by the
shared servers of both layouts (conftest.py builds their n-gram drafter, opt-in): greedy
with speculation equals greedy without, token for token, in the split layout (decoding
after a handoff) and colocated, with prefix caching on, on grounded prompts where drafts
are kept (/metrics says so); max_tokens and stops inside an accepted run end the answer
where plain decoding does; every KV block is free after."""

from __future__ import annotations

import time
from typing import Any

import httpx
import pytest
from openai import OpenAI
from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families
from server_process import API_KEY, ServerProcess
from worker_handles import worker_view

from appliance.cluster.wire import FROM_WORKER, TO_WORKER, Codec
from appliance.engine.sequence import SamplingParams
from appliance.engine.speculative.acceptance import AcceptanceCounts
from appliance.model.model_source import model_name
from appliance.pools.worker_handle import WorkerView
from appliance.server.body import validated
from appliance.server.errors import APIError
from appliance.server.metrics import SpeculationCollector
from appliance.server.prediction import prediction_usage
from appliance.server.protocol import ChatCompletionRequest, CompletionRequest
from appliance.server.snapshot import speculation_figures
from appliance.workers.messages import Submit, TokenBatch

MODEL = model_name(None)
AUTH = {"Authorization": f"Bearer {API_KEY}"}
PASSAGE = (
    "The river wound through the valley, past farms and mills, until it reached the old "
    "stone bridge where the children of the town gathered every summer evening to fish."
)
# Raw text that continues by copying: n-gram drafts from the passage are kept.
COPYING = PASSAGE + "\n" + PASSAGE + "\n" + PASSAGE[:60]
QUOTE = [{"role": "user", "content": f"Repeat this sentence exactly:\n\n{PASSAGE}"}]
ON = {"speculative.n_max": 8}

# ---------------------------------------------------------------- the request fields


def test_the_fields_reach_the_engines_parameters() -> None:
    body = {"model": MODEL, "prompt": "x", "speculative.n_max": 3, "speculative.n_min": 2}
    params = validated(CompletionRequest, body).sampling_params(16, 0)
    assert (params.speculative_n_max, params.speculative_n_min) == (3, 2)
    chat = {"model": MODEL, "messages": QUOTE, "speculative.n_max": 0, "speculative.n_min": None}
    params = validated(ChatCompletionRequest, chat).sampling_params(16, 0)
    assert (params.speculative_n_max, params.speculative_n_min) == (0, None)
    unset = validated(ChatCompletionRequest, {"model": MODEL, "messages": QUOTE})
    assert unset.sampling_params(16, 0).speculative_n_max is None


@pytest.mark.parametrize(
    ("fields", "status", "param"),
    [
        ({"speculative.n_max": 17}, 422, "speculative.n_max"),
        ({"speculative.n_max": -1}, 422, "speculative.n_max"),
        ({"speculative.n_max": "4"}, 422, "speculative.n_max"),  # strict: no coercion
        ({"speculative.n_min": 2.5}, 422, "speculative.n_min"),
        ({"speculative.n_max": 2, "speculative.n_min": 3}, 400, "speculative.n_min"),
        ({"prediction": {"type": "text", "content": "a"}}, 422, "prediction.type"),
        ({"prediction": {"type": "content"}}, 422, "prediction.content"),
        (
            {"prediction": {"type": "content", "content": [{"type": "image_url"}]}},
            422,
            "prediction.content",
        ),
    ],
)
def test_bad_values_are_refused_naming_the_field(
    fields: dict[str, Any], status: int, param: str
) -> None:
    with pytest.raises(APIError) as caught:
        request = validated(CompletionRequest, {"model": MODEL, "prompt": "x", **fields})
        request.check_sampling(49152)
    assert (caught.value.status, caught.value.param) == (status, param)
    assert param in caught.value.message


# ---------------------------------------------------------------- the counts


def view(worker_id: int, counts: AcceptanceCounts) -> WorkerView:
    return worker_view(worker_id, "decode", speculation=counts)


class Pools:
    """The read-only pool state /metrics reads: workers' views as last reported."""

    def __init__(self, counts: list[AcceptanceCounts]) -> None:
        self.counts = counts

    def views(self) -> list[WorkerView]:
        return [view(i, c) for i, c in enumerate(self.counts)]


def test_metrics_show_each_workers_counts_rate_and_mean_accepted_length() -> None:
    busy = AcceptanceCounts()
    busy.record(4, 5)  # all 4 kept, and the target's token: 5 made
    busy.record(4, 1)  # none kept
    registry = CollectorRegistry()
    registry.register(SpeculationCollector(Pools([busy, AcceptanceCounts()])))  # type: ignore[arg-type]

    def value(name: str, worker: str) -> float | None:
        return registry.get_sample_value(
            name, {"worker": worker, "role": "decode", "device": "cpu"}
        )

    assert value("appliance_spec_decode_num_drafts_total", "0") == 2
    assert value("appliance_spec_decode_num_draft_tokens_total", "0") == 8
    assert value("appliance_spec_decode_num_accepted_tokens_total", "0") == 4
    assert value("appliance_spec_decode_acceptance_rate", "0") == 0.5
    assert value("appliance_spec_decode_mean_accepted_length", "0") == 3.0  # (5 + 1) / 2
    assert value("appliance_spec_decode_num_drafts_total", "1") == 0
    assert value("appliance_spec_decode_acceptance_rate", "1") == 0


def test_the_admin_snapshot_gives_the_figures_once_drafts_were_verified() -> None:
    busy = AcceptanceCounts()
    busy.record(4, 3)
    assert speculation_figures(view(0, busy)) == {
        "spec_acceptance_rate": 0.5,
        "spec_mean_accepted_length": 3.0,
    }
    assert speculation_figures(view(1, AcceptanceCounts())) == {}  # the console shows none


def test_the_counts_and_a_requests_range_cross_the_box_link() -> None:
    """A worker on another box reports its totals, and gets a request's range and
    prediction, through the cluster link's codec as a local one does through its queue."""
    counts = AcceptanceCounts()
    counts.record(4, 3)
    report = TokenBatch(1, speculation=counts)
    assert wire_trip(report, FROM_WORKER).speculation == counts
    params = SamplingParams(speculative_n_max=3, speculative_n_min=1, prediction=(5, 6, 7))
    submit = wire_trip(Submit(1, [5, 6], params, False), TO_WORKER)
    assert submit.params == params


def wire_trip(message: Any, accepts: tuple[type, ...]) -> Any:
    nonce = bytes(16)
    return Codec(nonce).decode(Codec(nonce).encode(message), accepts)


# ---------------------------------------------------------------- served


def client_of(server: ServerProcess) -> OpenAI:
    return OpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0, timeout=300)


def spec_counts(server: ServerProcess) -> dict[str, float]:
    """Each spec_decode counter summed over the server's workers."""
    text = httpx.get(server.url + "/metrics", headers=AUTH).text
    totals: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name.startswith("appliance_spec_decode_num_"):
                totals[sample.name] = totals.get(sample.name, 0.0) + sample.value
    return totals


def wait_all_free(server: ServerProcess, bound_s: float = 10.0) -> None:
    """Every worker's KV blocks free again (prefix-cached ones count as free)."""
    deadline = time.monotonic() + bound_s
    while True:
        health = httpx.get(server.url + "/health").json()
        workers = [w for pool in health["pools"].values() for w in pool]
        if all(w["num_free_blocks"] == w["num_blocks"] for w in workers):
            return
        if time.monotonic() > deadline:
            pytest.fail(f"KV blocks still held {bound_s} s after the answers: {workers}")
        time.sleep(0.05)


def completion(client: OpenAI, extra: dict[str, Any] | None = None, **ask: Any) -> Any:
    ask = {"model": MODEL, "prompt": COPYING, "max_tokens": 48, "temperature": 0, **ask}
    return client.completions.create(**ask, extra_body=extra).choices[0]


def chat(client: OpenAI, extra: dict[str, Any] | None = None, **ask: Any) -> Any:
    ask = {"model": MODEL, "messages": QUOTE, "max_tokens": 48, "temperature": 0, **ask}
    return client.chat.completions.create(**ask, extra_body=extra)


def test_greedy_answers_with_speculation_equal_plain_ones(layout_server: ServerProcess) -> None:
    """Each prompt twice with speculation (the second from the prefix cache), against
    plain decoding: the same text, token count and finish reason; drafts were kept."""
    client = client_of(layout_server)
    before = spec_counts(layout_server)
    plain = completion(client)
    plain_chat = chat(client)
    assert spec_counts(layout_server) == before  # opt-in: plain requests draft nothing
    for _ in range(2):
        got = completion(client, ON)
        assert (got.text, got.finish_reason) == (plain.text, plain.finish_reason)
        got_chat = chat(client, ON)
        assert got_chat.choices[0].message.content == plain_chat.choices[0].message.content
        assert got_chat.choices[0].finish_reason == plain_chat.choices[0].finish_reason
        assert got_chat.usage.completion_tokens == plain_chat.usage.completion_tokens
        assert got_chat.usage.prompt_tokens == plain_chat.usage.prompt_tokens
    after = spec_counts(layout_server)
    drafted = after["appliance_spec_decode_num_draft_tokens_total"] - before.get(
        "appliance_spec_decode_num_draft_tokens_total", 0
    )
    kept = after["appliance_spec_decode_num_accepted_tokens_total"] - before.get(
        "appliance_spec_decode_num_accepted_tokens_total", 0
    )
    assert drafted > 0 and kept > 0
    assert kept / drafted > 0.5  # the copying prompt: most drafts hold
    wait_all_free(layout_server)


def test_a_request_turns_speculation_off_with_n_max_0(layout_server: ServerProcess) -> None:
    client = client_of(layout_server)
    plain = completion(client)
    before = spec_counts(layout_server)
    off = completion(client, {"speculative.n_max": 0, "speculative.n_min": 0})
    assert spec_counts(layout_server) == before
    narrow = completion(client, {"speculative.n_max": 2, "speculative.n_min": 2})
    assert off.text == narrow.text == plain.text
    after = spec_counts(layout_server)
    steps = after["appliance_spec_decode_num_drafts_total"] - before.get(
        "appliance_spec_decode_num_drafts_total", 0
    )
    drafted = after["appliance_spec_decode_num_draft_tokens_total"] - before.get(
        "appliance_spec_decode_num_draft_tokens_total", 0
    )
    assert steps > 0 and drafted <= 2 * steps  # never more than its n_max a step
    wait_all_free(layout_server)


def test_max_tokens_and_stops_inside_an_accepted_run_end_where_plain_decoding_does(
    layout_server: ServerProcess,
) -> None:
    client = client_of(layout_server)
    plain = completion(client)
    words = plain.text.split()
    assert len(words) > 8, plain.text
    stop = " " + words[6]  # a word well inside the copied text
    cases: list[dict[str, Any]] = [
        {"max_tokens": 5},
        {"max_tokens": 11},
        {"stop": [stop]},
        {"stop": [stop], "max_tokens": 30},
    ]
    for ask in cases:
        want = completion(client, **ask)
        got = completion(client, ON, **ask)
        assert (got.text, got.finish_reason) == (want.text, want.finish_reason), ask
    # Streamed: the deltas of several tokens a step add up to the same text.
    stream = client.completions.create(
        model=MODEL, prompt=COPYING, max_tokens=48, temperature=0, stream=True, extra_body=ON
    )
    pieces = [c.choices[0].text for c in stream if c.choices]
    assert "".join(pieces) == plain.text
    wait_all_free(layout_server)


def test_metrics_gauges_show_acceptance_per_decoding_worker(
    layout_server: ServerProcess,
) -> None:
    """After a speculative answer, the worker that decoded it (the decode worker after a
    handoff; a colocated one) shows its acceptance rate and mean accepted length; a
    prefill worker never drafts."""
    completion(client_of(layout_server), ON)
    text = httpx.get(layout_server.url + "/metrics", headers=AUTH).text
    gauges: dict[str, dict[tuple[str, str], float]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name.startswith("appliance_spec_decode_"):
                key = (sample.labels["worker"], sample.labels["role"])
                gauges.setdefault(sample.name, {})[key] = sample.value
    rates = gauges["appliance_spec_decode_acceptance_rate"]
    lengths = gauges["appliance_spec_decode_mean_accepted_length"]
    speculating = [key for key, rate in rates.items() if rate > 0]
    assert speculating, rates
    assert {role for _, role in speculating} <= {"decode", "colocated"}
    assert all(lengths[key] > 1 for key in speculating)
    assert all(rates[key] == 0 for key in rates if key[1] == "prefill")


def test_a_predicted_output_is_drafted_from_and_changes_no_answer(
    layout_server: ServerProcess,
) -> None:
    """OpenAI's `prediction`, as the official client sends it: on this opt-in server a
    request that sends one speculates without speculative.n_max, its drafts come from
    the prediction (the prompt holds no copy of the answer) and, the prediction being
    the answer, most are kept; a wrong prediction, as text parts, changes nothing."""
    client = client_of(layout_server)
    ask: dict[str, Any] = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "Write four short lines about the sea."}],
        "max_tokens": 48,
        "temperature": 0,
    }
    plain = client.chat.completions.create(**ask)
    text = plain.choices[0].message.content
    assert text and plain.usage is not None
    before = spec_counts(layout_server)
    predicted = client.chat.completions.create(
        **ask, prediction={"type": "content", "content": text}
    )
    after = spec_counts(layout_server)
    assert predicted.choices[0].message.content == text
    assert predicted.choices[0].finish_reason == plain.choices[0].finish_reason
    assert predicted.usage is not None
    assert predicted.usage.completion_tokens == plain.usage.completion_tokens
    drafted = after["appliance_spec_decode_num_draft_tokens_total"] - before.get(
        "appliance_spec_decode_num_draft_tokens_total", 0
    )
    kept = after["appliance_spec_decode_num_accepted_tokens_total"] - before.get(
        "appliance_spec_decode_num_accepted_tokens_total", 0
    )
    assert drafted > 0 and kept / drafted > 0.8, (kept, drafted)
    details = predicted.usage.completion_tokens_details
    assert details is not None and details.accepted_prediction_tokens is not None
    told = details.accepted_prediction_tokens + (details.rejected_prediction_tokens or 0)
    assert details.accepted_prediction_tokens >= 0.9 * told > 0  # the answer, re-encoded
    wrong = [{"type": "text", "text": "Tax forms are due "}, {"type": "text", "text": "in May."}]
    missed = client.chat.completions.create(
        **ask,
        prediction={"type": "content", "content": wrong},
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(missed)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == text
    last = chunks[-1].usage
    assert last is not None and last.completion_tokens_details is not None
    assert last.completion_tokens_details.rejected_prediction_tokens
    assert plain.usage.completion_tokens_details is None  # no prediction, no details
    wait_all_free(layout_server)


def test_prediction_usage_counts_the_predictions_tokens_found_in_each_answer() -> None:
    assert prediction_usage([(), ()], [[1, 2], [3]]) == {}
    found = prediction_usage([(5, 6, 6, 7), (), (9,)], [[6, 5, 8], [1], [2]])
    details = found["completion_tokens_details"]
    # 5 and one 6 of the first; none of the third; the second choice sent none.
    assert details == {"accepted_prediction_tokens": 2, "rejected_prediction_tokens": 3}
