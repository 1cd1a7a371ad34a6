"""A text completion at a cursor (fill in the middle): the code before it as the prompt,
the code after it as the `suffix` (OpenAI's legacy field, Ollama's), other files of the
project as context (llama.cpp's /infill). The prompt is the model's own markers around
them (chat/fill_in_middle.py), its ends stop the answer; a model without markers is a
400 naming the field, as Ollama answers "does not support insert"."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

from appliance.chat.fill_in_middle import ExtraFile, FillInMiddle
from appliance.server.errors import APIError
from appliance.server.protocol import CompletionRequest
from appliance.server.state import ServerState

# The room kept for the answer: max_tokens, else a quarter of the context; never more
# than half of it, so the code around the cursor is there to complete.
OUTPUT_SHARE, MOST_OUTPUT_SHARE = 4, 2


@dataclass(frozen=True)
class Infill:
    """What goes after the cursor, and the other files (`param`: the field to name)."""

    suffix: str
    extra: tuple[ExtraFile, ...] = ()
    param: str = "suffix"


def markers(state: ServerState, param: str) -> FillInMiddle:
    """The served model's markers; a 400 naming `param` where it has none."""
    tokenizer = state.appliance.tokenizer
    assert tokenizer is not None  # requests are served only once the tokenizer is loaded
    found = FillInMiddle.of(tokenizer)
    if found is None:
        raise APIError(
            400,
            f"{state.appliance.model_name} does not fill in the middle (its vocabulary has "
            "no infill markers): serve a code model trained for it (Qwen2.5-Coder, "
            "StarCoder2, CodeLlama, DeepSeek-Coder, Codestral)",
            param,
            "unsupported",
        )
    return found


async def infill_prompts(
    state: ServerState, req: CompletionRequest, infill: Infill
) -> tuple[list[list[int]], CompletionRequest]:
    """Each text prompt as an infill's ids, and the request stopping at the markers' ends
    too."""
    fim = markers(state, infill.param)
    if req.echo:
        raise APIError(400, "echo with a suffix is not served", "echo", "unsupported")
    tokenizer = state.appliance.tokenizer
    assert tokenizer is not None
    context = state.appliance.max_model_len
    output = req.requested_max_tokens() or context // OUTPUT_SHARE
    budget = context - min(output, context // MOST_OUTPUT_SHARE)
    prompts = []
    for prompt in req.prompts():
        if not isinstance(prompt, str):
            raise APIError(400, "an infill's prompt is text (the code before the cursor)", "prompt")
        ids = await asyncio.to_thread(
            fim.prompt, tokenizer, prompt, infill.suffix, infill.extra, max(budget, 1)
        )
        prompts.append(ids)
    stops = [*req.stop_token_ids, *sorted(fim.ends - set(req.stop_token_ids))]
    return prompts, req.model_copy(update={"stop_token_ids": stops})
