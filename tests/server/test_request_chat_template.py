"""A request's own chat_template (vLLM's, behind its --trust-request-chat-template): on a
server that trusts them the prompt is the request's template's rendering, on the chat
route and /tokenize alike; on one that does not (the default), and for a template that
does not compile, a 400 naming chat_template."""

from __future__ import annotations

from typing import Any

import httpx
import openai
import pytest
from openai import OpenAI
from server_process import API_KEY, ServerProcess

from appliance.model.model_source import model_name, prepare_tokenizer
from appliance.settings.config import load_settings

pytestmark = pytest.mark.process  # the slow lane (conftest.py): processes or a whole model

MODEL = model_name(None)
AUTH = {"Authorization": f"Bearer {API_KEY}"}
MESSAGES = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Name a colour."},
]
TEMPLATE = (
    "{% for m in messages %}### {{ m.role | upper }}: {{ m.content }}\n{% endfor %}"
    "{% if add_generation_prompt %}### ASSISTANT:{% endif %}"
)
RENDERED = "### SYSTEM: Be brief.\n### USER: Name a colour.\n### ASSISTANT:"


def test_a_trusted_servers_prompt_is_the_requests_template(
    configured_server: ServerProcess,
) -> None:
    tokenizer = prepare_tokenizer(None, load_settings().cache_dir)[1]
    expected = tokenizer.encode(RENDERED, add_special_tokens=False)
    http = httpx.Client(base_url=configured_server.url, headers=AUTH, timeout=60)
    body: dict[str, Any] = {"messages": MESSAGES, "chat_template": TEMPLATE}
    assert http.post("/tokenize", json=body).json()["tokens"] == expected
    models = http.post("/tokenize", json={"messages": MESSAGES}).json()["tokens"]
    assert models != expected  # the model's own template renders another prompt
    client = OpenAI(base_url=configured_server.url + "/v1", api_key=API_KEY, max_retries=0)
    ask: dict[str, Any] = dict(model=MODEL, messages=MESSAGES, max_tokens=2)
    own = client.chat.completions.create(**ask, extra_body={"chat_template": TEMPLATE})
    assert own.usage is not None and own.usage.prompt_tokens == len(expected)
    with pytest.raises(openai.BadRequestError, match="does not compile") as refused:
        client.chat.completions.create(**ask, extra_body={"chat_template": "{% for %}"})
    assert refused.value.body["param"] == "chat_template"  # type: ignore[index]


def test_an_untrusting_server_refuses_it_naming_the_setting(server: ServerProcess) -> None:
    client = OpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0)
    with pytest.raises(openai.BadRequestError, match="trust_request_chat_template") as refused:
        client.chat.completions.create(
            model=MODEL, messages=MESSAGES, max_tokens=2, extra_body={"chat_template": TEMPLATE}
        )
    assert refused.value.body["param"] == "chat_template"  # type: ignore[index]
    http = httpx.Client(base_url=server.url, headers=AUTH, timeout=60)
    reply = http.post("/tokenize", json={"messages": MESSAGES, "chat_template": TEMPLATE})
    assert reply.status_code == 400 and reply.json()["error"]["param"] == "chat_template"
