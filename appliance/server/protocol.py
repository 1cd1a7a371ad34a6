"""Request bodies of the OpenAI routes, validated strictly: a wrong type is an error,
never coerced ("10" is not a number, "yes" is not true). A null means "the default", as
in OpenAI's API."""

from __future__ import annotations

import json
from dataclasses import replace
from types import MappingProxyType
from typing import Any, ClassVar, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    PrivateAttr,
    ValidationInfo,
    field_validator,
    model_validator,
)

from appliance.api import SamplingParams
from appliance.engine.sequence import DRY_BREAKERS, MAX_MIROSTAT_TAU, MAX_SPECULATIVE_TOKENS
from appliance.server.errors import APIError
from appliance.server.structured_fields import StructuredFields
from appliance.server.tool_fields import (
    LEGACY_CALL_ID,
    MessageToolFields,
    StructuredOutput,
    ToolFields,
    check_tool_messages,
    constrained,
    template_message,
)

# Fields this server does not implement, each with the values meaning "off" (what clients
# send by default): sent with another value, they are refused (400, naming the field)
# instead of silently ignored. OpenAI's own fields first, then the extra sampling fields of
# vLLM (and a few of llama.cpp's server) that OpenAI-compatible clients send in extra_body.
# Implemented, so not here: top_k, seed, n, stop, stop_token_ids, ignore_eos,
# include_stop_str_in_output, allowed_token_ids, truncate_prompt_tokens,
# return_tokens_as_token_ids, bad_words, skip_special_tokens,
# spaces_between_special_tokens, the
# structured-output fields (structured_fields.py, guided_whitespace_pattern too), the
# penalties (and llama.cpp's repeat_penalty), logit_bias, min_p, min_tokens, logprobs,
# llama.cpp's typical_p, top_n_sigma, XTC, dynamic temperature, mirostat and DRY; OpenAI's
# deprecated functions and function_call (tool_fields.py);
UNSUPPORTED_FIELDS: MappingProxyType[str, tuple[Any, ...]] = MappingProxyType(
    {
        # OpenAI
        "best_of": (None, 1),
        # vLLM's extra sampling parameters
        "length_penalty": (None, 1, 1.0),
        "use_beam_search": (None, False),
        "logits_processors": (None, []),
        # vLLM's per-request grammar engine: this server's is llguidance, vLLM's "guidance"
        "guided_decoding_backend": (None, "auto", "guidance"),
        "detokenize": (None, True),
    }
)
MAX_STOP_STRINGS = 16
MAX_ALLOWED_TOKEN_IDS = 1 << 18  # past any vocabulary: a bound on the body, not a rule
MAX_BAD_WORDS = 256  # each is checked against every step's output: a bound on the work
MAX_STOP_CHARS = 1024  # stop matching rescans held-back text: long stops slow a worker
MAX_SEED = 2**63 - 1
MAX_TOP_K = 2**31 - 1
MAX_STOP_TOKEN_IDS = 64
MAX_LOGIT_BIAS = 300  # OpenAI's limit on logit_bias entries
MAX_DRY_BREAKERS = 64
MAX_DRY_BREAKER_CHARS = 40  # llama.cpp's: a longer breaker is cut to this
MAX_TOP_LOGPROBS = 20  # OpenAI's top_logprobs limit; vLLM takes as many on completions


def unsupported_field(body: dict[str, Any]) -> str | None:
    """The first field in a raw body that asks for something this server does not do."""
    for name, off in UNSUPPORTED_FIELDS.items():
        if name in body and not any(_same(body[name], value) for value in off):
            return name
    return None


def unsupported_message(name: str) -> str:
    """Why `name` is refused, and what it may be sent as instead."""
    off = [value for value in UNSUPPORTED_FIELDS[name] if value is not None]
    accepted = f"send {json.dumps(off[-1])} or leave it out" if off else "leave it out"
    return f"{name} is not supported by this server: {accepted}"


def _same(a: Any, b: Any) -> bool:
    # True == 1 in Python; a JSON true is not the number 1.
    return type(a) is type(b) and a == b


def valid_unicode(text: str) -> str:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:  # JSON can carry "\ud800", which is no character
        raise ValueError("text is not valid Unicode (a lone surrogate escape?)") from None
    return text


def cache_salt_of(value: str) -> str:
    """vLLM's `cache_salt`: a non-empty string (400 naming the field otherwise); requests
    with different salts share no prefix-cache block (appliance/kv/prefix_cache.py)."""
    if not value:
        raise APIError(400, "cache_salt must be a non-empty string if given", "cache_salt")
    return valid_unicode(value)  # (it is encoded into the first block's key)


class Body(BaseModel):
    """Strict fields, unknown ones ignored (clients send extras), null taken as unset."""

    model_config = ConfigDict(strict=True, extra="ignore")

    @model_validator(mode="before")
    @classmethod
    def _null_is_default(cls, data: Any) -> Any:
        if isinstance(data, dict):
            return {k: v for k, v in data.items() if v is not None}
        return data


class StreamOptions(Body):
    include_usage: bool = False


def text_of(content: str | list[dict[str, Any]]) -> str:
    """A content field's text: a string, or OpenAI's text parts joined."""
    if isinstance(content, str):
        return valid_unicode(content)
    texts = []
    for i, part in enumerate(content):
        if part.get("type") != "text" or not isinstance(part.get("text"), str):
            kind = part.get("type")
            raise ValueError(
                f"content part {i} has type {kind!r}; only text parts "
                '({"type": "text", "text": "..."}) are supported'
            )
        texts.append(part["text"])
    return valid_unicode("".join(texts))


class Prediction(Body):
    """OpenAI's predicted output: text much of the answer is expected to repeat (the file
    a code edit rewrites). Its tokens are drafts for speculative decoding to verify; the
    answer is the one the model gives without it (docs/speculative.md)."""

    type: Literal["content"]
    content: str | list[dict[str, Any]]

    @field_validator("content")
    @classmethod
    def _text_only(cls, value: str | list[dict[str, Any]]) -> str:
        return text_of(value)


class SamplingFields(Body, StructuredFields):
    """What both routes share: the model, how to sample, when to stop, how to answer (and
    the structured-output fields, structured_fields.py)."""

    # Whether a max_tokens past the room the prompt leaves is cut to it (else a 400).
    CAPPED_AT_ROOM: ClassVar[bool] = False
    # The fields the model's sampling defaults fill where a body leaves them out
    # (model/sampling_defaults.py), by generation_config.json's names; the first is set.
    DEFAULTED: ClassVar[dict[str, tuple[str, ...]]] = {
        "temperature": ("temperature",),
        "top_p": ("top_p",),
        "top_k": ("top_k",),
        "min_p": ("min_p",),
        "repetition_penalty": ("repetition_penalty", "repeat_penalty"),
    }

    model: str
    max_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0, le=2, allow_inf_nan=False, description="0: greedy")
    top_p: float = Field(1.0, gt=0, le=1, allow_inf_nan=False)
    # Past the vocabulary a cut keeps every token; the bound keeps it a 64-bit integer for
    # the workers' sampler (a larger one crashed it: the API fuzzer's top_k=2**63).
    top_k: int = Field(-1, ge=-1, le=MAX_TOP_K, description="-1 or 0: no top-k cut")
    seed: int | None = Field(None, ge=0, le=MAX_SEED)
    stop: str | list[str] = Field(default_factory=list)
    stop_token_ids: list[int] = Field(default_factory=list, max_length=MAX_STOP_TOKEN_IDS)
    include_stop_str_in_output: bool = False  # vLLM's: the stop string ends the text
    skip_special_tokens: bool = True  # vLLM's: False keeps markers in the text
    # vLLM's; either value reads as vLLM's fast-tokenizer detokenizer reads it: special
    # tokens kept in the text are joined as the tokenizer decodes them, no space added.
    spaces_between_special_tokens: bool = True
    # vLLM's: keep only the prompt's last k tokens (-1: as many as the context takes).
    truncate_prompt_tokens: int | None = Field(None, ge=-1)
    # vLLM's: logprobs name each token "token_id:N", not by its text (exact ids for RL).
    return_tokens_as_token_ids: bool = False
    n: int = Field(1, ge=1)
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False
    user: str | None = None
    # vLLM's penalties (OpenAI has presence and frequency); llama.cpp calls repetition
    # "repeat_penalty". Ranges as SamplingParams checks them.
    presence_penalty: float = Field(0.0, ge=-2, le=2, allow_inf_nan=False)
    frequency_penalty: float = Field(0.0, ge=-2, le=2, allow_inf_nan=False)
    repetition_penalty: float | None = Field(None, gt=0, le=2, allow_inf_nan=False)
    repeat_penalty: float | None = Field(None, gt=0, le=2, allow_inf_nan=False)
    # OpenAI's: {"token id": bias in [-100, 100]}, added to the logits before sampling.
    logit_bias: dict[str, float] = Field(default_factory=dict, max_length=MAX_LOGIT_BIAS)
    # vLLM's: only these tokens may be sampled (a classifier's labels, a yes/no).
    allowed_token_ids: list[int] | None = Field(None, max_length=MAX_ALLOWED_TOKEN_IDS)
    # vLLM's: words the output may not hold (each as it starts a text and after a space).
    bad_words: list[str] = Field(default_factory=list, max_length=MAX_BAD_WORDS)
    min_p: float = Field(0.0, ge=0, le=1, allow_inf_nan=False)
    min_tokens: int = Field(0, ge=0)
    # llama.cpp server's samplers, under its names and with its "off" values (-1 for
    # top_n_sigma): engine/sampling/cuts.py and engine/sampling/mirostat.py say what each does.
    top_n_sigma: float = Field(-1.0, allow_inf_nan=False, description="<= 0: off")
    typical_p: float = Field(1.0, gt=0, le=1, allow_inf_nan=False)
    xtc_probability: float = Field(0.0, ge=0, le=1, allow_inf_nan=False)
    xtc_threshold: float = Field(0.1, ge=0, le=1, allow_inf_nan=False)
    dynatemp_range: float = Field(0.0, ge=0, le=2, allow_inf_nan=False, description="0: off")
    dynatemp_exponent: float = Field(1.0, ge=0, allow_inf_nan=False)
    mirostat: Literal[0, 1, 2] = 0
    mirostat_tau: float = Field(5.0, gt=0, le=MAX_MIROSTAT_TAU, allow_inf_nan=False)
    mirostat_eta: float = Field(0.1, ge=0, le=1, allow_inf_nan=False)
    dry_multiplier: float = Field(0.0, ge=0, allow_inf_nan=False, description="0: off")
    dry_base: float = Field(1.75, gt=0, allow_inf_nan=False, description="under 1: off")
    dry_allowed_length: int = Field(2, ge=0)
    dry_penalty_last_n: int = Field(-1, ge=-1, description="-1: the whole context; 0: off")
    # None: llama.cpp's default ("\n", ":", '"', "*").
    dry_sequence_breakers: list[str] | None = Field(None, max_length=MAX_DRY_BREAKERS)
    # vLLM's switch (its server option, here per request): the model's own distribution,
    # or the one tokens are drawn from (after bias, penalties, temperature and the cuts).
    logprobs_mode: Literal["raw_logprobs", "processed_logprobs"] = "raw_logprobs"
    # vLLM's: each prompt token's logprob and its top k, as `prompt_logprobs` (whole only).
    prompt_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    # llama.cpp server's per-request draft range, under its names (docs/speculative.md):
    # n_max 0 turns speculation off for this request (> 0 turns it on, on an opt-in
    # server); neither goes past the server's own range.
    speculative_n_max: int | None = Field(
        None, ge=0, le=MAX_SPECULATIVE_TOKENS, alias="speculative.n_max"
    )
    speculative_n_min: int | None = Field(
        None, ge=0, le=MAX_SPECULATIVE_TOKENS, alias="speculative.n_min"
    )
    # vLLM's: requests with different salts never share cached prefix blocks (tenants).
    cache_salt: str = ""
    prediction: Prediction | None = None  # OpenAI's predicted output

    def prediction_text(self) -> str | None:
        """The predicted output's text; None when none was sent (or it is empty)."""
        if self.prediction is None:
            return None
        assert isinstance(self.prediction.content, str)  # joined by its validator
        return self.prediction.content or None

    @field_validator("cache_salt")
    @classmethod
    def _salt_is_given(cls, value: str) -> str:
        return cache_salt_of(value)

    @field_validator("stop")
    @classmethod
    def _stops_are_usable(cls, value: str | list[str]) -> list[str]:
        stops = [value] if isinstance(value, str) else list(value)
        if len(stops) > MAX_STOP_STRINGS:
            raise ValueError(f"at most {MAX_STOP_STRINGS} stop strings, got {len(stops)}")
        if any(not s for s in stops):
            raise ValueError("stop strings must not be empty")
        if any(len(s) > MAX_STOP_CHARS for s in stops):
            raise ValueError(f"stop strings must be at most {MAX_STOP_CHARS} characters")
        return [valid_unicode(s) for s in stops]

    @field_validator("bad_words")
    @classmethod
    def _bad_words_are_words(cls, value: list[str]) -> list[str]:
        if any(not w.strip() or len(w) > MAX_STOP_CHARS for w in value):
            raise ValueError(f"bad words must hold text, at most {MAX_STOP_CHARS} characters")
        return [valid_unicode(w) for w in value]

    @field_validator("dry_sequence_breakers")
    @classmethod
    def _breakers_are_text(cls, value: list[str] | None) -> list[str] | None:
        if value is None:
            return None
        if not value or not all(value):
            raise ValueError("must be a non-empty array of non-empty strings (as llama.cpp)")
        # llama.cpp cuts a longer breaker to its first 40 characters (with a warning).
        return [valid_unicode(text[:MAX_DRY_BREAKER_CHARS]) for text in value]

    @field_validator("stop_token_ids")
    @classmethod
    def _ids_are_ids(cls, value: list[int]) -> list[int]:
        if any(i < 0 for i in value):
            raise ValueError("token ids must not be negative")
        return value

    @field_validator("logit_bias")
    @classmethod
    def _bias_is_by_token_id(cls, value: dict[str, float]) -> dict[str, float]:
        for key, bias in value.items():
            if not key.isdigit():
                raise ValueError(f"keys must be token ids (as strings), got {key!r}")
            if not -100 <= bias <= 100:
                raise ValueError(f"biases must be in [-100, 100], got {bias} for {key}")
        return value

    def check_sampling(self, vocab: int) -> None:
        """Refuse, before tokenizing, what a valid body may still ask wrongly: token ids
        this model does not have, top_logprobs without logprobs, prompt logprobs streamed
        (400, naming the field)."""
        self.requested_logprobs()
        n_max, n_min = self.speculative_n_max, self.speculative_n_min
        if n_max is not None and n_min is not None and n_min > n_max:
            message = f"speculative.n_min ({n_min}) must not exceed speculative.n_max ({n_max})"
            raise APIError(400, message, "speculative.n_min")
        if self.stream and self.prompt_logprobs is not None:
            message = "prompt_logprobs is not available when stream is enabled (as vLLM)"
            raise APIError(400, message, "prompt_logprobs")
        bad = [int(key) for key in self.logit_bias if int(key) >= vocab]
        if bad:
            raise APIError(
                400,
                f"logit_bias token id {bad[0]} is outside the vocabulary ({vocab})",
                "logit_bias",
            )
        self._check_allowed(vocab)

    def _check_allowed(self, vocab: int) -> None:
        allowed = self.allowed_token_ids
        if allowed is not None and not allowed:
            message = "allowed_token_ids is empty: no token could be sampled (send null for any)"
            raise APIError(400, message, "allowed_token_ids")
        outside = [t for t in allowed or [] if not 0 <= t < vocab]
        if outside:
            message = f"allowed_token_ids token id {outside[0]} is outside the vocabulary ({vocab})"
            raise APIError(400, message, "allowed_token_ids")

    def requested_logprobs(self) -> int | None:
        """How many top logprobs a token carries (None: no logprobs at all)."""
        return None

    def truncated(self, prompt: list[int], context: int) -> list[int]:
        """The prompt as truncate_prompt_tokens leaves it: its last k tokens (-1: the last
        context - 1, which leave room for one token of output), or all of it."""
        return keep_last(prompt, self.truncate_prompt_tokens, context - 1)

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    def requested_max_tokens(self) -> int | None:
        return self.max_tokens

    def max_tokens_field(self) -> str:
        """The field the output budget came in (an error about it names that one)."""
        return "max_tokens"

    def default_max_tokens(self, room: int) -> int:
        """Without max_tokens, generate until the context is full (or a stop)."""
        return room

    def sampling_params(self, max_tokens: int, choice: int) -> SamplingParams:
        """The engine's parameters for choice `choice` of n (each choice its own seed)."""
        seed = None if self.seed is None else (self.seed + choice) % (MAX_SEED + 1)
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=self.temperature,
            top_k=max(self.top_k, 0),
            top_p=self.top_p,
            seed=seed,
            stop=tuple(self.stop),
            include_stop_str=self.include_stop_str_in_output,
            skip_special_tokens=self.skip_special_tokens,
            stop_token_ids=tuple(self.stop_token_ids),
            ignore_eos=self.ignore_eos,
            structured=self.structured_output(),
            presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
            repetition_penalty=self._repetition_penalty(),
            logit_bias=tuple((int(key), bias) for key, bias in self.logit_bias.items()),
            allowed_token_ids=tuple(self.allowed_token_ids or ()),
            min_p=self.min_p,
            min_tokens=self.min_tokens,
            top_n_sigma=max(self.top_n_sigma, 0.0),
            typical_p=self.typical_p,
            xtc_probability=self.xtc_probability,
            xtc_threshold=self.xtc_threshold,
            dynatemp_range=self.dynatemp_range,
            dynatemp_exponent=self.dynatemp_exponent,
            mirostat=self.mirostat,
            mirostat_tau=self.mirostat_tau,
            mirostat_eta=self.mirostat_eta,
            dry_multiplier=self.dry_multiplier,
            dry_base=self.dry_base,
            dry_allowed_length=self.dry_allowed_length,
            dry_penalty_last_n=self.dry_penalty_last_n,
            dry_sequence_breakers=tuple(self.dry_sequence_breakers or DRY_BREAKERS),
            logprobs=self.requested_logprobs(),
            processed_logprobs=self.logprobs_mode == "processed_logprobs",
            prompt_logprobs=self.prompt_logprobs,
            speculative_n_max=self.speculative_n_max,
            speculative_n_min=self.speculative_n_min,
            cache_salt=self.cache_salt,
        )

    def _repetition_penalty(self) -> float:
        both = (self.repetition_penalty, self.repeat_penalty)
        if None not in both and both[0] != both[1]:
            raise APIError(
                400,
                f"repetition_penalty ({both[0]}) and repeat_penalty ({both[1]}) are two "
                "names for one setting: send one",
                "repeat_penalty",
            )
        return next((p for p in both if p is not None), 1.0)


class ChatMessage(Body, MessageToolFields):
    """One turn; content is text or text parts (joined); an assistant turn's tool calls,
    a tool's result (tool_fields.py). Images are not served."""

    role: Literal["system", "developer", "user", "assistant", "tool", "function"]
    # Present and not null (check_message_contents), but for an assistant turn that calls.
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None

    @field_validator("content")
    @classmethod
    def _text_only(cls, value: str | list[dict[str, Any]]) -> str:
        return text_of(value)

    def for_template(self) -> dict[str, Any]:
        # The template knows the classic roles; "developer" is OpenAI's new name for system,
        # "function" its deprecated one for a tool's result.
        role = {"developer": "system", "function": "tool"}.get(self.role, self.role)
        # `_text_only` has joined any text parts: a validated message's content is a str.
        assert self.content is None or isinstance(self.content, str)
        message = template_message(role, self.content, self.name, self)
        if self.role == "function":
            message["tool_call_id"] = LEGACY_CALL_ID  # the id its call got (template_message)
        return message


def check_message_contents(messages: Any) -> None:
    """Refuse, as OpenAI does with a 400, a message whose `content` is missing or null.

    Runs on the raw body, before nulls become defaults (a null content would otherwise
    read as "" and be generated from). Only an assistant turn carrying tool calls (or a
    function_call) may lack content in OpenAI's API."""
    if not isinstance(messages, list):
        return  # not a list: the field validation names it (422)
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or message.get("content") is not None:
            continue
        where = f"messages[{i}]"
        calls = message.get("tool_calls") or message.get("function_call")
        if message.get("role") == "assistant" and calls:
            continue
        raise APIError(
            400,
            f"Missing required parameter: '{where}.content'.",
            f"{where}.content",
            "missing_required_parameter",
        )


class ChatCompletionRequest(SamplingFields, ToolFields):
    messages: list[ChatMessage] = Field(min_length=1)
    # The tool calls' constraint, set by the route once it knows the model's format.
    _tool_output: StructuredOutput | None = PrivateAttr(None)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    echo: bool = False  # completions only: refused here (check_sampling)

    def check_sampling(self, vocab: int) -> None:
        if self.echo:
            raise APIError(
                400,
                "echo is not supported by this server on chat completions: send false or "
                "leave it out",
                "echo",
                "unsupported",
            )
        super().check_sampling(vocab)

    @model_validator(mode="before")
    @classmethod
    def _contents_present(cls, data: Any) -> Any:
        # An APIError is no ValueError: pydantic lets it through as it is (a 400, not 422).
        if isinstance(data, dict):
            check_message_contents(data.get("messages"))
            check_tool_messages(data.get("messages"))
        return data

    def constrain_tool_calls(self, structured: StructuredOutput | None) -> None:
        """Each choice's output follows `structured` (tool_choice required or named)."""
        self._tool_output = structured

    def sampling_params(self, max_tokens: int, choice: int) -> SamplingParams:
        return constrained(super().sampling_params(max_tokens, choice), self._tool_output)

    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens

    def max_tokens_field(self) -> str:
        return "max_completion_tokens" if self.max_completion_tokens else "max_tokens"

    def requested_logprobs(self) -> int | None:
        if not self.logprobs:
            if self.top_logprobs:  # OpenAI's rule: top_logprobs needs logprobs true
                raise APIError(400, "top_logprobs needs logprobs: true", "top_logprobs")
            return None
        return self.top_logprobs or 0


class CompletionRequest(SamplingFields):
    # OpenAI's legacy insert: the text after the cursor, the prompt the text before it; a
    # fill-in-the-middle model's markers around them (server/infill.py). "" is none.
    # (Before the prompt: its check reads it, an empty prompt being a cursor at the start.)
    suffix: str | None = None
    # One prompt (text or token ids) or a batch of them; each gets n choices.
    prompt: str | list[int] | list[str] | list[list[int]]
    # OpenAI's takes 0..5 top logprobs here; like vLLM this server takes up to 20.
    logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    echo: bool = False  # the prompt's text first (and with logprobs, its tokens' logprobs)

    def requested_logprobs(self) -> int | None:
        return self.logprobs

    def sampling_params(self, max_tokens: int, choice: int) -> SamplingParams:
        params = super().sampling_params(max_tokens, choice)
        if self.echo and self.logprobs is not None:
            # Echo's prompt part takes `logprobs` alternatives (vLLM's prompt_logprobs may
            # ask more: the larger is computed, each shows its own).
            k = max(self.logprobs, self.prompt_logprobs or 0)
            return replace(params, prompt_logprobs=k)
        return params

    def default_max_tokens(self, room: int) -> int:
        return min(16, room)  # OpenAI's default for this route

    @field_validator("prompt")
    @classmethod
    def _not_empty(cls, value: Any, info: ValidationInfo) -> Any:
        if isinstance(value, str) or not value:
            prompts = [value]
        elif isinstance(value[0], int):
            prompts = [value]
        else:
            prompts = value
        at_a_cursor = bool(info.data.get("suffix"))  # empty: the start of the file
        for i, prompt in enumerate(prompts):
            if len(prompt) == 0 and not (at_a_cursor and isinstance(prompt, str)):
                raise ValueError(f"prompt {i} is empty")
            if isinstance(prompt, list) and min(prompt) < 0:
                raise ValueError(f"prompt {i} has a negative token id")
            if isinstance(prompt, str):
                valid_unicode(prompt)
        return value

    def prompts(self) -> list[str | list[int]]:
        """The batch of prompts, each as text or token ids."""
        if isinstance(self.prompt, str) or isinstance(self.prompt[0], int):
            return [self.prompt]
        return list(self.prompt)


class OpenEndedCompletion(CompletionRequest):
    """A text completion as Ollama's /api/generate (raw) and llama.cpp's /completion take
    one: without a limit it runs until the context is full (or a stop), not OpenAI's 16,
    and a limit past the context's room runs until it is full, not a 400."""

    CAPPED_AT_ROOM: ClassVar[bool] = True

    def default_max_tokens(self, room: int) -> int:
        return room


def keep_last(prompt: list[int], k: int | None, most: int) -> list[int]:
    """vLLM's truncate_prompt_tokens: the prompt's last `k` tokens (-1: the last `most`,
    what the context takes; 0 or None: all of it)."""
    keep = most if k == -1 else k
    return prompt[-keep:] if keep and len(prompt) > keep else prompt
