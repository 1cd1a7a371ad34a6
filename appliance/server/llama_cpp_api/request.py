"""llama.cpp server's /completion body, validated and made into the text completion body
the OpenAI route serves (routes.prepared_completion), so both share one path: the
tokenizer, sampling, stops, grammar and JSON schema.

Its sampling fields share OpenAI's (and vLLM's) names and pass through as they are:
temperature, top_k, top_p, min_p, repeat_penalty, presence_penalty, frequency_penalty,
stop, ignore_eos, grammar, json_schema, and llama.cpp's own samplers, which the OpenAI
route takes under the same names (top_n_sigma, typical_p, xtc_*, dynatemp_*,
mirostat*, dry_*). Renamed: n_predict -> max_tokens (-1 and -2, or past the context's
room: until the context is full), n_probs -> logprobs, post_sampling_probs ->
logprobs_mode, seed -1 -> none, logit_bias as [[id, bias]] pairs (false: never), top_p
0 -> top_k 1 (the likeliest token, as llama.cpp). What this server does not have
(tfs_z, tail-free sampling, which llama.cpp dropped too; n_indent, t_max_predict_ms,
n_cmpl) is refused unless sent at the value that turns it off, as llama.cpp's own
clients send it; the fields that say where or how the server keeps its cache or slots
(cache_prompt, id_slot, n_keep, samplers, repeat_last_n, ...) are accepted and not
applied."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from pydantic import Field, field_validator

from appliance.chat.fill_in_middle import ExtraFile
from appliance.server.errors import APIError
from appliance.server.infill import Infill
from appliance.server.protocol import MAX_TOP_LOGPROBS, Body

# Passed to the completion body under the same name (the OpenAI route checks them).
SAME_NAMES = (
    "temperature",
    "top_k",
    "top_p",
    "min_p",
    "repeat_penalty",
    "presence_penalty",
    "frequency_penalty",
    "stop",
    "ignore_eos",
    "grammar",
    "json_schema",
    "top_n_sigma",
    "typical_p",
    "xtc_probability",
    "xtc_threshold",
    "dynatemp_range",
    "dynatemp_exponent",
    "mirostat",
    "mirostat_tau",
    "mirostat_eta",
    "dry_multiplier",
    "dry_base",
    "dry_allowed_length",
    "dry_penalty_last_n",
    "dry_sequence_breakers",
)
# Sampling this server does not have, each with what llama.cpp reads as "off" (what its
# clients send by default: SillyTavern's top_n_sigma is 0): other values are a 400.
OFF: dict[str, Callable[[float], bool]] = {
    "tfs_z": lambda v: v >= 1,
    "n_indent": lambda v: v <= 0,
    "t_max_predict_ms": lambda v: v <= 0,
    "n_cmpl": lambda v: v == 1,
}
UNTIL_FULL = (-1, -2)  # n_predict: no limit but the context
# The completion body's fields this adapter fills from fields of other names: an error
# about one names the field the client sent.
RENAMED = {
    "max_tokens": "n_predict",
    "logprobs": "n_probs",
    "logprobs_mode": "post_sampling_probs",
}


class LlamaCompletion(Body):
    """POST /completion (and /completions): the fields this adapter reads itself; the
    sampling fields of SAME_NAMES go through as they came."""

    prompt: str | list[int]
    n_predict: int = -1
    stream: bool = False
    seed: int = -1
    n_probs: int = Field(0, ge=0, le=MAX_TOP_LOGPROBS)
    post_sampling_probs: bool = False
    return_tokens: bool = False
    logit_bias: list[list[Any]] | dict[str, Any] | None = None

    @field_validator("prompt", mode="before")
    @classmethod
    def _one_prompt(cls, value: Any) -> Any:
        if isinstance(value, list) and any(not isinstance(v, int) for v in value):
            raise ValueError(
                "one prompt per request, as text or token ids: a list of prompts, or text "
                "and ids mixed, is not served"
            )
        return value

    def completion_body(self, body: dict[str, Any], model: str) -> dict[str, Any]:
        """The /v1/completions body of this request (`body`: the request as it came)."""
        for name, is_off in OFF.items():
            value = body.get(name)
            if value is not None and not (_is_number(value) and is_off(value)):
                raise APIError(
                    400,
                    f"{name} is not supported by this server: send the value that turns it "
                    "off (as llama.cpp reads it) or leave it out",
                    name,
                    "unsupported",
                )
        if body.get("lora"):
            raise APIError(400, "lora adapters are not served", "lora", "unsupported")
        out: dict[str, Any] = {"model": model, "prompt": self.prompt}
        out |= {name: body[name] for name in SAME_NAMES if body.get(name) is not None}
        top_p = out.get("top_p", 1)
        if _is_number(top_p) and top_p <= 0:  # llama.cpp keeps the likeliest token
            out = {k: v for k, v in out.items() if k != "top_p"} | {"top_k": 1}
        if self.n_predict > 0:
            out["max_tokens"] = self.n_predict
        elif self.n_predict not in UNTIL_FULL:
            raise APIError(
                400,
                f"n_predict must be > 0, or -1 (until the context is full); got {self.n_predict}",
                "n_predict",
            )
        if self.seed >= 0:
            out["seed"] = self.seed
        if self.n_probs:
            out["logprobs"] = self.n_probs
        if self.post_sampling_probs:
            out["logprobs_mode"] = "processed_logprobs"
        if self.logit_bias:
            out["logit_bias"] = _openai_bias(self.logit_bias)
        return out


class ExtraChunk(Body):
    """One of /infill's input_extra: another file of the project, for context."""

    text: str = ""
    filename: str = "tmp"


class LlamaInfill(LlamaCompletion):
    """POST /infill: code completion at a cursor. `input_prefix` is the code before it,
    `input_suffix` after it, `prompt` more text right before it (llama.cpp's), and
    `input_extra` other files; the /completion fields otherwise."""

    prompt: str = ""
    input_prefix: str = ""
    input_suffix: str = ""
    input_extra: list[ExtraChunk] = Field(default_factory=list)

    def completion_body(self, body: dict[str, Any], model: str) -> dict[str, Any]:
        """The /completion body of the code before the cursor."""
        before = {"prompt": self.input_prefix + self.prompt}
        after = {"suffix": self.input_suffix} if self.input_suffix else {}
        return super().completion_body(body, model) | before | after

    def infill(self) -> Infill:
        extra = tuple(ExtraFile(chunk.filename, chunk.text) for chunk in self.input_extra)
        return Infill(self.input_suffix, extra, param="input_suffix")


def _is_number(value: Any) -> bool:
    # A JSON true is not the number 1 (True == 1 in Python).
    return isinstance(value, int | float) and not isinstance(value, bool)


def _openai_bias(bias: list[list[Any]] | dict[str, Any]) -> dict[str, float]:
    """llama.cpp's [[token id, bias or false]] pairs (or OpenAI's object) as OpenAI's
    {"id": bias}; false (never this token) is -100. Tokens named by text are refused."""
    pairs = list(bias.items()) if isinstance(bias, dict) else bias
    out: dict[str, float] = {}
    for pair in pairs:
        if len(pair) != 2:
            message = f"logit_bias entries are [token id, bias], got {pair}"
            raise APIError(400, message, "logit_bias")
        token, value = pair
        if isinstance(token, str) and token.isdigit():
            token = int(token)
        if not isinstance(token, int) or isinstance(token, bool):
            raise APIError(
                400,
                f"logit_bias names tokens by id; text ({token!r}) is not served: "
                "POST /tokenize gives its ids",
                "logit_bias",
            )
        if value is False:
            value = -100.0
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise APIError(400, f"logit_bias of {token} must be a number or false", "logit_bias")
        out[str(token)] = float(value)
    return out
