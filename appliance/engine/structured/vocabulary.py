"""The model's tokenizer as llguidance sees it: every token's bytes, and the end tokens a
finished grammar leaves open. Built once per worker, at its first structured request
(about 0.3 s for SmolLM2's 49,152 tokens)."""

from __future__ import annotations

from collections.abc import Iterable

import llguidance

from appliance.model.tokenizer import Tokenizer


def grammar_vocabulary(
    tokenizer: Tokenizer, vocab_size: int, end_ids: Iterable[int]
) -> llguidance.LLTokenizer:
    """llguidance's tokenizer over the same tokenizer.json the engine decodes with.

    vocab_size is the model's (its logits' width, which may exceed the tokenizer's);
    end_ids the tokens that end a request: once a grammar is complete they are the only
    ones allowed, so the request stops with finish_reason "stop"."""
    ends = sorted(set(end_ids))
    if not ends:
        raise ValueError("structured outputs need the model's end tokens, and it has none")
    # The Rust tokenizer's own JSON: the token table transformers would hand llguidance,
    # without importing transformers in a worker.
    raw = tokenizer.to_json()
    return llguidance.LLTokenizer(raw, n_vocab=vocab_size, eos_token=ends)
