"""The model authors' chat templates (tests/fixtures/chat_templates) with the special tokens
each one's tokenizer_config.json names, a tiny word-level tokenizer standing in for each
model's, transformers' tokenizer over the same, and a frozen clock for the templates
that write today's date. Shared by the chat template and tool template tests."""

from __future__ import annotations

import functools
from datetime import datetime, tzinfo
from typing import Any

import pytest
from tests_root import CHAT_TEMPLATES
from tokenizers import Tokenizer as RawTokenizer
from tokenizers import models, pre_tokenizers

from appliance.model.tokenizer import Tokenizer

FIXTURES = CHAT_TEMPLATES

# The date strftime_now gives both renderers (Llama 3.2 and gpt-oss write today's date), so
# that a test running across midnight still compares equal strings.
FROZEN_NOW = datetime(2025, 8, 5, 12, 0, 0)


class FrozenDatetime(datetime):
    @classmethod
    def now(cls, tz: tzinfo | None = None) -> datetime:  # type: ignore[override]
        return FROZEN_NOW.replace(tzinfo=tz)


@pytest.fixture(autouse=True)
def frozen_date(monkeypatch: pytest.MonkeyPatch) -> None:
    """Both strftime_now's (ours and transformers') call their module's `datetime.now()`."""
    monkeypatch.setattr("appliance.model.tokenizer.datetime", FrozenDatetime)
    monkeypatch.setattr("transformers.utils.chat_template_utils.datetime", FrozenDatetime)


# The special tokens each model's tokenizer_config.json names (what transformers passes
# the template as its special_tokens_map).
LLAMA3 = {"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>"}
QWEN = {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"}
MISTRAL = {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"}
GEMMA3 = {
    "bos_token": "<bos>",
    "eos_token": "<eos>",
    "unk_token": "<unk>",
    "pad_token": "<pad>",
    "boi_token": "<start_of_image>",
    "eoi_token": "<end_of_image>",
    "image_token": "<image_soft_token>",
}
PHI3 = {
    "bos_token": "<s>",
    "eos_token": "<|endoftext|>",
    "unk_token": "<unk>",
    "pad_token": "<|endoftext|>",
}
PHI4 = {"bos_token": "<|endoftext|>", "eos_token": "<|im_end|>", "pad_token": "<|dummy_85|>"}
PHI4_MINI = {
    "bos_token": "<|endoftext|>",
    "eos_token": "<|endoftext|>",
    "unk_token": "<|endoftext|>",
}
SMOLLM2 = {
    "bos_token": "<|im_start|>",
    "eos_token": "<|im_end|>",
    "unk_token": "<|endoftext|>",
    "pad_token": "<|im_end|>",
}
GPT_OSS = {"bos_token": "<|startoftext|>", "eos_token": "<|return|>", "pad_token": "<|endoftext|>"}

TEMPLATES = {
    "llama-3-8b-instruct": LLAMA3,
    "llama-3.1-8b-instruct": LLAMA3,
    "llama-3.2-3b-instruct": LLAMA3,
    "qwen2.5-0.5b-instruct": QWEN,
    "qwen3-0.6b": QWEN,
    "mistral-7b-instruct": MISTRAL,
    "mistral-7b-instruct-v0.3": MISTRAL,
    "mistral-nemo-instruct-2407": MISTRAL,
    "gemma-3-it": GEMMA3,
    "phi-3-mini-instruct": PHI3,
    "phi-3.5-mini-instruct": PHI3,
    "phi-4": PHI4,
    "phi-4-mini-instruct": PHI4_MINI,
    "smollm2-135m-instruct": SMOLLM2,
    "gpt-oss-20b": GPT_OSS,
}


def tiny_raw_tokenizer(specials: list[str]) -> RawTokenizer:
    """A word-level tokenizer that knows `specials` as special tokens."""
    raw = RawTokenizer(models.WordLevel({"<unk-word>": 0, "hello": 1}, unk_token="<unk-word>"))
    raw.pre_tokenizer = pre_tokenizers.Whitespace()
    raw.add_special_tokens(specials)
    return raw


def hf_tokenizer(template: str, specials: dict[str, str]) -> Any:
    """transformers' fast tokenizer over `tiny_raw_tokenizer`, with `template`."""
    from transformers import PreTrainedTokenizerFast

    raw = tiny_raw_tokenizer(sorted(set(specials.values())))
    return PreTrainedTokenizerFast(tokenizer_object=raw, chat_template=template, **specials)


@functools.cache
def family_tokenizer(name: str) -> Tokenizer:
    """Ours over `tiny_raw_tokenizer` with family `name`'s template (a fixture file) and
    special tokens. Built once per family and shared: compiling the template is most of
    what a render costs (tens of milliseconds, gpt-oss's over 0.1 s), and rendering leaves
    the tokenizer as it was."""
    template = (FIXTURES / f"{name}.jinja").read_text(encoding="utf-8")
    specials = TEMPLATES[name]
    return Tokenizer(tiny_raw_tokenizer(sorted(set(specials.values()))), specials, template)
