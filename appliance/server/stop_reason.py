"""What ended a generation that stopped (finish_reason "stop"), as vLLM's `stop_reason`
says it: the stop string that matched, the stop token id, or None for the model's own
end. Anthropic's `stop_sequence` and llama.cpp's `stopping_word` are the same fact."""

from __future__ import annotations

from appliance.api import SamplingParams
from appliance.model.tokenizer import Tokenizer


def stop_reason(
    tokenizer: Tokenizer, params: SamplingParams, token_ids: list[int], text: str
) -> str | int | None:
    """`text` is the answer as sent (the stop string cut off, or ending it with
    include_stop_str), `token_ids` every token made: the stop string is the one the
    tokens' text holds where the answer ends."""
    if not token_ids:
        return None
    if token_ids[-1] in params.stop_token_ids:
        return token_ids[-1]
    if params.include_stop_str:  # the text ends with the stop string
        matched = [word for word in params.stop if text.endswith(word)]
        return max(matched, key=len) if matched else None
    full = tokenizer.decode(token_ids)
    after = full[len(text) :] if full.startswith(text) else ""
    matched = [word for word in params.stop if after.startswith(word)]
    return max(matched, key=len) if matched else None
