"""A row to sample as the structured-output masks read it (seq id, its parameters, its
tokens so far and how many of them are the prompt), for tests that drive the masks
without an engine."""

from __future__ import annotations

from dataclasses import dataclass

from appliance.engine.sequence import SamplingParams


@dataclass(frozen=True)
class Row:
    """A row to sample, as the masks read it."""

    seq_id: int
    params: SamplingParams
    token_ids: list[int]
    num_prompt_tokens: int
