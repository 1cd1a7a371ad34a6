"""The chat templates of each supported family render byte for byte as transformers'
`apply_chat_template(..., add_generation_prompt=True)` renders them; stop tokens.

The templates are the model authors' own (tests/fixtures/chat_templates, README there
names each source). A tiny word-level tokenizer stands in for each model's: only the
rendered string is compared, and both sides get the same special tokens."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from chat_template_cases import (  # noqa: F401 (frozen_date: the autouse clock fixture)
    FIXTURES,
    GPT_OSS,
    TEMPLATES,
    family_tokenizer,
    frozen_date,
    hf_tokenizer,
    tiny_raw_tokenizer,
)
from tokenizers import Tokenizer as RawTokenizer

from appliance.model.model_source import default_model_path, prepare_tokenizer
from appliance.model.tokenizer import Tokenizer
from appliance.settings.config import load_settings

SYSTEM = {"role": "system", "content": "You are a terse assistant. Answer in one line."}
CHATS: dict[str, list[dict[str, Any]]] = {
    "system+user": [SYSTEM, {"role": "user", "content": "What is the capital of France?"}],
    "system+multi-turn": [
        SYSTEM,
        {"role": "user", "content": "Hi there!"},
        {"role": "assistant", "content": "Hello. How can I help?"},
        {"role": "user", "content": "Name three primes."},
    ],
    "user only": [{"role": "user", "content": "Hello"}],
    "multi-turn, no system": [
        {"role": "user", "content": "2+2?"},
        {"role": "assistant", "content": "4"},
        {"role": "user", "content": "And 3+3?"},
    ],
    "whitespace and unicode": [
        {"role": "system", "content": "  Réponds en français.\n"},
        {"role": "user", "content": "\n  Qu'est-ce qu'un « chat » ? 🐱  \n"},
        {"role": "assistant", "content": " Un animal. \n"},
        {"role": "user", "content": 'Et <b>HTML</b> & "quotes"?'},
    ],
    "reasoning in history": [
        {"role": "user", "content": "Think: 1+1?"},
        {"role": "assistant", "content": "<think>\nOne plus one.\n</think>\n\n2"},
        {"role": "user", "content": "Now 2+2?"},
    ],
    "None-valued keys": [
        {"role": "system", "content": "Be brief.", "name": None},
        {"role": "user", "content": "Hi", "tool_calls": None},
    ],
}


def hf_render(tokenizer: Any, messages: list[dict[str, Any]]) -> str | None:
    """transformers' rendering, or None where the template refuses the messages."""
    from jinja2.exceptions import TemplateError

    try:
        rendered = tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=True
        )
    except TemplateError:
        return None
    assert isinstance(rendered, str)
    return rendered


def our_render(tokenizer: Tokenizer, messages: list[dict[str, Any]]) -> str | None:
    try:
        return tokenizer.render_chat(messages)
    except ValueError:
        return None


@pytest.mark.parametrize("chat", list(CHATS))
@pytest.mark.parametrize("name", list(TEMPLATES))
def test_template_renders_as_transformers(name: str, chat: str) -> None:
    template = (FIXTURES / f"{name}.jinja").read_text(encoding="utf-8")
    messages = CHATS[chat]
    expected = hf_render(hf_tokenizer(template, TEMPLATES[name]), messages)
    assert our_render(family_tokenizer(name), messages) == expected


def test_every_family_renders_a_system_turn_and_several_turns() -> None:
    """The families whose template takes a system turn do render one (only the original
    Mistral-7B-Instruct template refuses it, as the model's authors wrote it)."""
    refused = []
    for name in TEMPLATES:
        rendered = our_render(family_tokenizer(name), CHATS["system+multi-turn"])
        if rendered is None:
            refused.append(name)
        else:
            assert "Name three primes." in rendered and "Hello. How can I help?" in rendered
    assert refused == ["mistral-7b-instruct"]


def test_generation_prompt_is_added() -> None:
    ours = family_tokenizer("qwen3-0.6b")
    assert ours.render_chat(CHATS["user only"]).endswith("<|im_start|>assistant\n")


def gpt_oss() -> Tokenizer:
    return family_tokenizer("gpt-oss-20b")


def test_gpt_oss_renders_the_harmony_format() -> None:
    """The system message carries the (frozen) date, the system turn becomes the developer
    message, an earlier assistant turn is a final-channel message whose thinking is dropped,
    and the prompt ends ready for the assistant's turn."""
    chat = [
        SYSTEM,
        {"role": "user", "content": "Hi there!"},
        {"role": "assistant", "content": "Hello.", "thinking": "Greet back."},
        {"role": "user", "content": "Name three primes."},
    ]
    template = (FIXTURES / "gpt-oss-20b.jinja").read_text(encoding="utf-8")
    rendered = gpt_oss().render_chat(chat)
    assert rendered == hf_render(hf_tokenizer(template, GPT_OSS), chat)
    assert rendered == (
        "<|start|>system<|message|>You are ChatGPT, a large language model trained by OpenAI.\n"
        "Knowledge cutoff: 2024-06\nCurrent date: 2025-08-05\n\nReasoning: medium\n\n"
        "# Valid channels: analysis, commentary, final. Channel must be included for every "
        "message.<|end|><|start|>developer<|message|># Instructions\n\n"
        "You are a terse assistant. Answer in one line.\n\n<|end|>"
        "<|start|>user<|message|>Hi there!<|end|>"
        "<|start|>assistant<|channel|>final<|message|>Hello.<|end|>"
        "<|start|>user<|message|>Name three primes.<|end|><|start|>assistant"
    )


def test_gpt_oss_refuses_channel_tags_in_content() -> None:
    chat = [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "<|channel|>final<|message|>Hello"},
        {"role": "user", "content": "Again"},
    ]
    template = (FIXTURES / "gpt-oss-20b.jinja").read_text(encoding="utf-8")
    with pytest.raises(ValueError, match="containing <\\|channel\\|> tags"):
        gpt_oss().render_chat(chat)
    assert hf_render(hf_tokenizer(template, GPT_OSS), chat) is None


def test_smollm2_fixture_is_the_default_models_template() -> None:
    """The SmolLM2 fixture is the template the appliance reads from the GGUF it ships as
    its default model."""
    _, tokenizer = prepare_tokenizer(default_model_path(), load_settings().cache_dir)
    assert tokenizer.chat_template == (FIXTURES / "smollm2-135m-instruct.jinja").read_text(
        encoding="utf-8"
    )


# --- The environment: what transformers adds to Jinja's -----------------------------------


def render(template: str, messages: list[dict[str, Any]] | None = None) -> str | None:
    messages = messages or [{"role": "user", "content": "hi"}]
    specials = {"bos_token": "<s>", "eos_token": "</s>"}
    ours = our_render(Tokenizer(tiny_raw_tokenizer(["<s>", "</s>"]), specials, template), messages)
    assert ours == hf_render(hf_tokenizer(template, specials), messages)
    return ours


def test_generation_tag_renders_its_body() -> None:
    template = (
        "{% for m in messages %}{% if m.role == 'assistant' %}{% generation %}"
        "{{ m.content }}{{ eos_token }}{% endgeneration %}{% else %}{{ m.content }}"
        "{% endif %}{% endfor %}{% if add_generation_prompt %}>{% endif %}"
    )
    chat = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]
    assert render(template, chat) == "ab</s>>"


def test_tojson_keeps_html_and_unicode() -> None:
    template = "{{ {'k': messages[0].content} | tojson }}|{{ [1, 2] | tojson(indent=2) }}"
    assert render(template, [{"role": "user", "content": "<b>é</b>&"}]) == (
        '{"k": "<b>é</b>&"}|[\n  1,\n  2\n]'
    )


def test_tools_and_documents_are_defined_as_none() -> None:
    template = "{{ tools is none }} {{ documents is none }} {{ tools is defined }}"
    assert render(template) == "True True True"


def test_globals_and_loop_controls() -> None:
    template = (
        "{% set ns = namespace(n=0) %}{% for m in messages %}{% if loop.index > 1 %}"
        "{% break %}{% endif %}{% set ns.n = ns.n + 1 %}{% endfor %}{{ ns.n }}"
        "{{ dict(a=1) | tojson }}{{ dict.fromkeys(['x'], 0) | tojson }}"
        "{{ strftime_now('%Y') | length }}"
    )
    chat = [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]
    assert render(template, chat) == '1{"a": 1}{"x": 0}4'


def test_raise_exception_is_a_clear_error() -> None:
    template = "{{ raise_exception('roles must alternate') }}"
    tok = Tokenizer(tiny_raw_tokenizer([]), {}, template)
    with pytest.raises(ValueError, match="roles must alternate"):
        tok.render_chat([{"role": "user", "content": "x"}])
    assert render(template) is None


def test_namespace_refuses_underscore_attributes() -> None:
    template = "{% set ns = namespace(_x=1) %}"
    tok = Tokenizer(tiny_raw_tokenizer([]), {}, template)
    with pytest.raises(ValueError, match="underscore-prefixed"):
        tok.render_chat([{"role": "user", "content": "x"}])
    assert render(template) is None


def test_reasoning_fields_are_aliased() -> None:
    template = "{% for m in messages %}{{ m.reasoning_content }}|{{ m.thinking }};{% endfor %}"
    chat = [{"role": "assistant", "content": "a", "reasoning": "r1"}]
    assert render(template, chat) == "r1|r1;"


def test_no_messages_is_an_error() -> None:
    tok = Tokenizer(tiny_raw_tokenizer([]), {}, "{{ messages | length }}")
    with pytest.raises(ValueError, match="no messages"):
        tok.render_chat([])


# --- Through the model's files -------------------------------------------------------------


def write_folder(folder: Path, config: dict[str, Any], specials: list[str]) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    tiny_raw_tokenizer(specials).save(str(folder / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", **config}
    (folder / "tokenizer_config.json").write_text(json.dumps(config), encoding="utf-8")


def added_token(content: str) -> dict[str, Any]:
    return {
        "__type": "AddedToken",
        "content": content,
        "lstrip": False,
        "normalized": False,
        "rstrip": False,
        "single_word": False,
    }


def hf_from_folder(folder: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(folder), local_files_only=True)


@pytest.mark.parametrize("where", ["tokenizer_config.json", "chat_template.jinja"])
@pytest.mark.parametrize(
    "name", ["gemma-3-it", "llama-3.1-8b-instruct", "qwen3-0.6b", "gpt-oss-20b"]
)
def test_loaded_from_files_renders_as_transformers(tmp_path: Path, name: str, where: str) -> None:
    template = (FIXTURES / f"{name}.jinja").read_text(encoding="utf-8")
    specials = TEMPLATES[name]
    config: dict[str, Any] = {k: added_token(v) for k, v in specials.items()}
    if where == "tokenizer_config.json":
        config["chat_template"] = template
    else:
        (tmp_path / "chat_template.jinja").write_text(template, encoding="utf-8")
    write_folder(tmp_path, config, sorted(set(specials.values())))
    ours, hf = Tokenizer.load(tmp_path), hf_from_folder(tmp_path)
    assert ours.special_tokens == hf.special_tokens_map
    for messages in CHATS.values():
        assert our_render(ours, messages) == hf_render(hf, messages)


def test_chat_template_file_wins_over_the_config(tmp_path: Path) -> None:
    config = {"eos_token": "</s>", "chat_template": "config{{ eos_token }}"}
    write_folder(tmp_path, config, ["</s>"])
    (tmp_path / "chat_template.jinja").write_text("file{{ eos_token }}", encoding="utf-8")
    ours, hf = Tokenizer.load(tmp_path), hf_from_folder(tmp_path)
    messages = [{"role": "user", "content": "x"}]
    assert our_render(ours, messages) == hf_render(hf, messages) == "file</s>"


def test_named_templates_take_the_default(tmp_path: Path) -> None:
    config = {
        "eos_token": "</s>",
        "chat_template": [
            {"name": "tool_use", "template": "tools"},
            {"name": "default", "template": "default{{ eos_token }}"},
        ],
    }
    write_folder(tmp_path, config, ["</s>"])
    ours, hf = Tokenizer.load(tmp_path), hf_from_folder(tmp_path)
    messages = [{"role": "user", "content": "x"}]
    assert our_render(ours, messages) == hf_render(hf, messages) == "default</s>"


def test_legacy_special_tokens_map(tmp_path: Path) -> None:
    """A config without added_tokens_decoder takes special_tokens_map.json's tokens."""
    config = {"chat_template": "{{ bos_token }}{{ eos_token }}", "eos_token": "</old>"}
    write_folder(tmp_path, config, ["<s>", "</s>", "</old>"])
    tokens = {"bos_token": added_token("<s>"), "eos_token": "</s>"}
    (tmp_path / "special_tokens_map.json").write_text(json.dumps(tokens), encoding="utf-8")
    ours, hf = Tokenizer.load(tmp_path), hf_from_folder(tmp_path)
    messages = [{"role": "user", "content": "x"}]
    assert our_render(ours, messages) == hf_render(hf, messages) == "<s></s>"


def test_processor_chat_template_json_is_a_fallback(tmp_path: Path) -> None:
    write_folder(tmp_path, {"eos_token": "</s>"}, ["</s>"])
    template = {"chat_template": "processor{{ eos_token }}"}
    (tmp_path / "chat_template.json").write_text(json.dumps(template), encoding="utf-8")
    assert Tokenizer.load(tmp_path).render_chat([{"role": "user", "content": "x"}]) == (
        "processor</s>"
    )


# --- Stop tokens ------------------------------------------------------------------------------

LLAMA31_SPECIALS = ["<|begin_of_text|>", "<|end_of_text|>", "<|eom_id|>", "<|eot_id|>"]


def llama31_folder(folder: Path) -> dict[str, int]:
    """A Llama 3.1-like folder; returns its special tokens' ids."""
    config = {
        "bos_token": "<|begin_of_text|>",
        "eos_token": "<|eot_id|>",
        "chat_template": (FIXTURES / "llama-3.1-8b-instruct.jinja").read_text(encoding="utf-8"),
    }
    write_folder(folder, config, LLAMA31_SPECIALS)
    raw = RawTokenizer.from_file(str(folder / "tokenizer.json"))
    ids = {}
    for token in LLAMA31_SPECIALS:
        token_id = raw.token_to_id(token)
        assert token_id is not None
        ids[token] = token_id
    return ids


def test_stop_tokens_without_generation_config(tmp_path: Path) -> None:
    ids = llama31_folder(tmp_path)
    # eos_token, and the end-of-turn markers the template writes (<|eot_id|>, <|eom_id|>).
    assert Tokenizer.load(tmp_path).stop_token_ids == {ids["<|eot_id|>"], ids["<|eom_id|>"]}


def test_generation_config_eos_list_stops(tmp_path: Path) -> None:
    ids = llama31_folder(tmp_path)
    eos = [ids["<|end_of_text|>"], ids["<|eom_id|>"], ids["<|eot_id|>"]]
    generation = {"bos_token_id": ids["<|begin_of_text|>"], "eos_token_id": eos}
    (tmp_path / "generation_config.json").write_text(json.dumps(generation), encoding="utf-8")
    assert Tokenizer.load(tmp_path).stop_token_ids == set(eos)


def test_generation_config_eos_int_stops(tmp_path: Path) -> None:
    write_folder(tmp_path, {"eos_token": "</s>", "chat_template": "{{ eos_token }}"}, ["</s>"])
    (tmp_path / "generation_config.json").write_text('{"eos_token_id": 7}', encoding="utf-8")
    tok = Tokenizer.load(tmp_path, extra_eos_ids=(5,))
    assert tok.stop_token_ids == {5, 7, tok._raw.token_to_id("</s>")}


def test_bad_generation_config_is_a_load_error(tmp_path: Path) -> None:
    from appliance.model.errors import ModelLoadError

    write_folder(tmp_path, {"eos_token": "</s>"}, ["</s>"])
    (tmp_path / "generation_config.json").write_text("{not json", encoding="utf-8")
    with pytest.raises(ModelLoadError):
        Tokenizer.load(tmp_path)


def test_template_that_does_not_compile_is_a_load_error(tmp_path: Path) -> None:
    from appliance.model.errors import ModelLoadError

    write_folder(tmp_path, {"chat_template": "{% for m in messages %}"}, [])
    with pytest.raises(ModelLoadError, match="does not compile"):
        Tokenizer.load(tmp_path)
