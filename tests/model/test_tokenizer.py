"""Our tokenizer against transformers' tokenizer for the same model, and streaming text."""

from __future__ import annotations

import pytest

from appliance.engine.llm_engine import LLMEngine
from appliance.model.tokenizer import IncrementalDetokenizer, Tokenizer

TEXTS = [
    "Hello world",
    " leading space and trailing ",
    "日本語のテキスト 🚀 emoji, accents: café, naïve",
    "<|im_start|>user\nhi<|im_end|>",
    "tabs\tand\nnewlines  \n\n x",
    "",
    "a" * 300,
    "def f(x):\n    return x ** 2  # comment",
]
CHATS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "hello"},
        {"role": "user", "content": "more"},
    ],
]


@pytest.fixture(scope="module")
def hf_tokenizer(engine: LLMEngine):
    from transformers import AutoTokenizer

    from appliance.model.model_source import default_model_path

    path = default_model_path()
    return AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)


@pytest.mark.parametrize("text", TEXTS)
def test_raw_prompt_tokens_equal_transformers(engine: LLMEngine, hf_tokenizer, text: str) -> None:
    assert engine.tokenizer.encode(text) == hf_tokenizer(text).input_ids


def test_no_bos_is_added_for_smollm2(engine: LLMEngine) -> None:
    assert engine.tokenizer.encode("Hello")[0] != 1


@pytest.mark.parametrize("messages", CHATS)
def test_chat_template_equals_transformers(engine: LLMEngine, hf_tokenizer, messages) -> None:
    expected = hf_tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=False
    )
    assert engine.tokenizer.render_chat(messages) == expected
    ids = engine.tokenizer.apply_chat_template(messages)
    assert ids == hf_tokenizer(expected, add_special_tokens=False).input_ids


@pytest.mark.parametrize("prefill", ["The capital of France is", "Paris. "])
def test_a_continued_final_message_equals_transformers(
    engine: LLMEngine, hf_tokenizer, prefill: str
) -> None:
    """continue_final_message: the assistant's text left open (a prefill), no new turn."""
    messages = [*CHATS[0], {"role": "assistant", "content": prefill}]
    expected = hf_tokenizer.apply_chat_template(
        messages, continue_final_message=True, tokenize=False
    )
    assert engine.tokenizer.render_chat(messages, continue_final=True) == expected
    assert expected.rstrip().endswith(prefill.strip()) and "<|im_end|>" not in expected[-20:]
    plain = engine.tokenizer.render_chat(messages, add_generation_prompt=False)
    assert plain == hf_tokenizer.apply_chat_template(messages, tokenize=False)
    with pytest.raises(ValueError, match="only a last assistant message"):
        engine.tokenizer.render_chat(CHATS[0], continue_final=True)


def test_stop_tokens_hold_the_end_of_turn(engine: LLMEngine) -> None:
    assert engine.tokenizer.stop_token_ids == {2}  # <|im_end|>, SmolLM2's EOS


@pytest.mark.parametrize("text", TEXTS)
def test_streaming_never_emits_half_a_character(engine: LLMEngine, text: str) -> None:
    ids = engine.tokenizer.encode(text)
    detok = IncrementalDetokenizer(engine.tokenizer)
    pieces = [detok.add(i) for i in ids] + [detok.flush()]
    assert all("\ufffd" not in p for p in pieces)
    assert "".join(pieces) == engine.tokenizer.decode(ids)


def test_emoji_bytes_split_over_tokens_come_out_whole(engine: LLMEngine) -> None:
    ids = engine.tokenizer.encode("🚀")
    assert len(ids) > 1  # byte-level BPE splits it
    detok = IncrementalDetokenizer(engine.tokenizer)
    assert [detok.add(i) for i in ids][-1] == "🚀"


@pytest.mark.parametrize("text", TEXTS)
def test_each_tokens_bytes_join_to_the_texts_bytes(engine: LLMEngine, text: str) -> None:
    ids = engine.tokenizer.encode(text, add_special_tokens=False)
    assert b"".join(engine.tokenizer.token_bytes(i) for i in ids) == text.encode()


def test_a_tokens_bytes_are_its_byte_level_vocabulary_entry(engine: LLMEngine) -> None:
    """Against GPT-2's byte-to-character table (transformers'): each character of a
    byte-level BPE entry is one byte. A character split over tokens is split bytes, which
    its decoding alone cannot show (U+FFFD)."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    byte_of = {char: byte for byte, char in bytes_to_unicode().items()}
    tokenizer = engine.tokenizer
    ids = tokenizer.encode("日本語のテキスト 🚀 café", add_special_tokens=False)
    entries = tokenizer.token_strings(ids)
    assert [tokenizer.token_bytes(i) for i in ids] == [bytes(map(byte_of.get, e)) for e in entries]
    split = [i for i in ids if "\ufffd" in tokenizer.decode([i])]
    assert split and all(tokenizer.token_bytes(i) for i in split)
    end = tokenizer.token_id("<|im_end|>")
    assert end is not None and tokenizer.token_bytes(end) == b"<|im_end|>"  # its marker
    assert tokenizer.token_bytes(tokenizer.vocab_size) == b""


def test_the_tokens_holding_a_text_are_all_found(engine: LLMEngine) -> None:
    """DRY's sequence breakers: every token whose bytes hold one of the texts, no other."""
    tokenizer = engine.tokenizer
    found = tokenizer.ids_holding(("\n", ":"))
    every = range(tokenizer.vocab_size)
    assert found == {i for i in every if {b"\n", b":"} & _pieces(tokenizer.token_bytes(i))}
    assert set(tokenizer.encode("a:\n\nb", add_special_tokens=False)) & found
    assert tokenizer.ids_holding(("\n",)) < found
    assert tokenizer.ids_holding(()) == frozenset()


def _pieces(raw: bytes) -> set[bytes]:
    return {raw[i : i + 1] for i in range(len(raw))}


def test_missing_template_is_a_clear_error(engine: LLMEngine) -> None:
    bare = Tokenizer(engine.tokenizer._raw, {}, None)
    with pytest.raises(ValueError, match="no chat template"):
        bare.apply_chat_template([{"role": "user", "content": "x"}])
