"""The parity tests' prompts (raw text and chats), as token ids: shared by the transformers
parity tests and benchmarks/kv_dtype_bench.py's agreement table."""

from __future__ import annotations

from typing import Any

RAW_PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    ",
    "1, 2, 3, 5, 8, 13,",
    "Once upon a time in a small village by the sea, there lived an old fisherman who",
    "Das Wetter heute ist",
    "Q: Why is the sky blue?\nA:",
]
CHATS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [
        {"role": "system", "content": "You answer in one short sentence."},
        {"role": "user", "content": "Name three primary colors. " * 6},
    ],
]


def parity_prompts(engine: Any) -> list[list[int]]:
    """RAW_PROMPTS then CHATS, tokenized by `engine`'s tokenizer (chats with its template)."""
    ids = [engine.tokenizer.encode(p) for p in RAW_PROMPTS]
    return ids + [engine.tokenizer.apply_chat_template(c) for c in CHATS]
