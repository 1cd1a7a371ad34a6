"""A draft model's own counters on /metrics, from a real `appliance serve` (colocated,
the embedded model drafting for itself, so its drafts are kept): per worker, its forward
passes, the drafts it handed the scheduler and those a verify step kept, beside the
spec_decode counters of the drafts verified."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest
from openai import OpenAI
from prometheus_client.parser import text_string_to_metric_families
from server_process import API_KEY, ServerProcess

from appliance.model.model_source import default_model_path, model_name

pytestmark = pytest.mark.process  # a server of its own

AUTH = {"Authorization": f"Bearer {API_KEY}"}


@pytest.fixture(scope="module")
def server() -> Iterator[ServerProcess]:
    process = ServerProcess(
        {
            "APPLIANCE_MODE": "colocated",
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


def totals(server: ServerProcess) -> dict[str, float]:
    """Each appliance_spec_decode_* counter summed over the workers."""
    text = httpx.get(server.url + "/metrics", headers=AUTH).text
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name.startswith("appliance_spec_decode_"):
                out[sample.name] = out.get(sample.name, 0.0) + sample.value
    return out


def test_the_draft_models_counters_count_its_passes_and_kept_drafts(
    server: ServerProcess,
) -> None:
    client = OpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0, timeout=300)
    before = totals(server)
    assert before["appliance_spec_decode_draft_model_steps_total"] == 0
    questions = ("Name three planets.", "Repeat: the old stone bridge.")
    for question in questions:
        messages = [{"role": "user", "content": question}]
        client.chat.completions.create(
            model=model_name(None), messages=messages, max_tokens=32, temperature=0
        )
    after = totals(server)
    steps = after["appliance_spec_decode_draft_model_steps_total"]
    proposed = after["appliance_spec_decode_draft_model_proposed_total"]
    kept = after["appliance_spec_decode_draft_model_accepted_total"]
    verified = after["appliance_spec_decode_num_draft_tokens_total"]
    # Its own model drafting: every draft verified was handed out by it, and all kept
    # but each answer's last ones (at most 4: never settled, the sequence ended).
    assert steps > 0 and proposed >= verified > 0
    assert 0 < proposed - len(questions) * 4 <= kept <= proposed
    assert kept <= after["appliance_spec_decode_num_accepted_tokens_total"]
