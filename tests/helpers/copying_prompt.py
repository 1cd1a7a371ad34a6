"""A prompt whose continuation copies its input, so prompt-lookup drafts are accepted:
shared by the speculative decoding tests (engine, tensor-parallel)."""

from __future__ import annotations

from typing import Any

PASSAGE = (
    "The river wound through the valley, past farms and mills, until it reached the old "
    "stone bridge where the children of the town gathered every summer evening to fish."
)


def copying_prompt(tokenizer: Any) -> list[int]:
    """The passage twice and the start of a third time: the model goes on copying it."""
    return list(tokenizer.encode(PASSAGE + "\n" + PASSAGE + "\n" + PASSAGE[:60]))
