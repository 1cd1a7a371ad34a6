"""OpenAI's predicted outputs (`prediction`): the prediction's tokens, which the
n-gram proposer drafts from (docs/speculative.md), and usage's count of them, OpenAI's
accepted_prediction_tokens / rejected_prediction_tokens."""

from __future__ import annotations

import asyncio
from collections import Counter
from typing import Any

from appliance.server.errors import APIError
from appliance.server.protocol import SamplingFields
from appliance.server.state import ServerState


async def prediction_ids(state: ServerState, req: SamplingFields, context: int) -> tuple[int, ...]:
    """The predicted output's tokens as the answer would hold them: no special tokens
    added. () when none was sent; at most a context's worth (a 400 naming the field):
    a longer one cannot be the answer."""
    text = req.prediction_text()
    tokenizer = state.appliance.tokenizer
    if text is None or tokenizer is None:
        return ()
    ids = await asyncio.to_thread(tokenizer.encode, text, False)
    if len(ids) > context:
        raise APIError(
            400,
            f"the prediction has {len(ids)} tokens, but this model's context holds {context}",
            "prediction",
        )
    return tuple(ids)


def prediction_usage(
    predictions: list[tuple[int, ...]], outputs: list[list[int]]
) -> dict[str, Any]:
    """usage.completion_tokens_details for choices that were sent a prediction, summed
    over them: OpenAI's accepted_prediction_tokens, the prediction's tokens that appear
    in the answer (each as often as it appears in both: a count, linear in the lengths,
    where an in-order match of two long repetitive lists would take seconds), and
    rejected_prediction_tokens, the rest of the prediction. {} when none was sent."""
    if not any(predictions):
        return {}
    accepted = rejected = 0
    for prediction, output in zip(predictions, outputs, strict=True):
        kept = (Counter(prediction) & Counter(output)).total()
        accepted += kept
        rejected += len(prediction) - kept
    details = {"accepted_prediction_tokens": accepted, "rejected_prediction_tokens": rejected}
    return {"completion_tokens_details": details}
