"""Reasoning and a family's own tool-call format through a served model and the openai
client, in both layouts: a tiny random Qwen3 (the embedded model's 49k tokenizer) with
Qwen3's real chat template, its output steered by `guided_regex` into Qwen3's shapes
(`<think>...</think>`, `<tool_call>...</tool_call>`), which the server must split into
`reasoning_content`, `content` and `tool_calls` as it does for a real Qwen3."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from family_configs import tiny_config
from openai import OpenAI
from random_models import random_model, save_folder
from server_process import API_KEY, ServerProcess
from tests_root import CHAT_TEMPLATES

pytestmark = pytest.mark.process  # servers of its own

TEMPLATE = CHAT_TEMPLATES / "qwen3-0.6b.jinja"
THINKING = r"<think>\n[a-z]{3,8}\n</think>\n\n[a-z]{3,8}"
CALL = r'<tool_call>\n\{"name": "get_time", "arguments": \{"city": "[a-z]{3,6}"\}\}\n</tool_call>'
TOOLS: list[Any] = [
    {
        "type": "function",
        "function": {
            "name": "get_time",
            "description": "The time in a city",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}},
                "required": ["city"],
            },
        },
    }
]
ASK = [{"role": "user", "content": "What time is it in Paris?"}]


def qwen3_folder(folder: Path) -> Path:
    # The embedded model's vocabulary: save_folder copies its tokenizer.
    config = tiny_config("Qwen3Config", 49152, head_dim=16, tie_word_embeddings=False)
    return save_folder(random_model(config), folder)


@pytest.fixture(scope="module", params=["disaggregated", "colocated"])
def qwen3_server(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ServerProcess]:
    folder = qwen3_folder(tmp_path_factory.mktemp("qwen3") / "tiny-qwen3")
    process = ServerProcess(
        {
            "APPLIANCE_MODEL": str(folder),
            "APPLIANCE_CHAT_TEMPLATE": str(TEMPLATE),
            "APPLIANCE_DTYPE": "float32",
            "APPLIANCE_API_KEY": API_KEY,
            "APPLIANCE_KV__MEMORY_MB": "32",
            "APPLIANCE_MODE": request.param,
        }
    )
    process.start()
    yield process
    process.stop()


def client_of(server: ServerProcess) -> tuple[OpenAI, str]:
    client = OpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0, timeout=120)
    return client, client.models.list().data[0].id


def test_thinking_comes_back_as_reasoning_content_whole_and_streamed(
    qwen3_server: ServerProcess,
) -> None:
    client, model = client_of(qwen3_server)
    ask: dict[str, Any] = dict(
        model=model,
        messages=ASK,
        max_tokens=64,
        temperature=1.0,
        seed=5,
        extra_body={"guided_regex": THINKING},
    )
    whole = client.chat.completions.create(**ask).choices[0]
    reasoning = (whole.message.model_extra or {}).get("reasoning_content")
    assert whole.finish_reason == "stop"
    assert reasoning and reasoning.strip().isalpha() and "<think>" not in reasoning
    assert whole.message.content and whole.message.content.strip().isalpha()
    streamed_reasoning, streamed_content = "", ""
    for chunk in client.chat.completions.create(**ask, stream=True):
        for choice in chunk.choices:
            streamed_reasoning += (choice.delta.model_extra or {}).get("reasoning_content") or ""
            streamed_content += choice.delta.content or ""
    # The same seed: the stream is the whole answer in pieces.
    assert streamed_reasoning == reasoning and streamed_content == whole.message.content


def test_qwen3s_own_tool_call_format_is_parsed_whole_and_streamed(
    qwen3_server: ServerProcess,
) -> None:
    client, model = client_of(qwen3_server)
    ask: dict[str, Any] = dict(
        model=model,
        messages=ASK,
        tools=TOOLS,
        tool_choice="auto",
        max_tokens=64,
        temperature=1.0,
        seed=7,
        extra_body={"guided_regex": CALL, "chat_template_kwargs": {"enable_thinking": False}},
    )
    whole = client.chat.completions.create(**ask).choices[0]
    assert whole.finish_reason == "tool_calls"
    calls = whole.message.tool_calls or []
    assert [call.function.name for call in calls] == ["get_time"]  # type: ignore[union-attr]
    arguments = json.loads(calls[0].function.arguments)  # type: ignore[union-attr]
    assert set(arguments) == {"city"} and arguments["city"].isalpha()
    assert not whole.message.content
    streamed, reasons = "", []
    for chunk in client.chat.completions.create(**ask, stream=True):
        for choice in chunk.choices:
            reasons.append(choice.finish_reason)
            for piece in choice.delta.tool_calls or []:
                streamed += piece.function.arguments or ""  # type: ignore[union-attr]
    assert json.loads(streamed) == arguments
    assert [r for r in reasons if r] == ["tool_calls"]
