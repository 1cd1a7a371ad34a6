"""A request's tokens, sampling parameters and progress. Torch-free."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from enum import Enum

from appliance.engine.sampling.dry import Dry
from appliance.engine.speculative.adaptive import DraftLength

GREEDY_BELOW = 1e-5  # temperatures under this sample greedily
MAX_TOP_LOGPROBS = 20  # OpenAI's limit on top_logprobs
MAX_SPECULATIVE_TOKENS = 16  # the most drafts one sequence verifies in one step
DRY_BREAKERS = ("\n", ":", '"', "*")  # llama.cpp's default sequence breakers
MAX_MIROSTAT_TAU = 100.0  # bits: past any vocabulary's surprise (17 bits at 128k tokens)


@dataclass(frozen=True)
class StructuredOutput:
    """What a request's output must match, as plain data (it travels to worker processes,
    which build their own grammar matcher from it and replay the tokens so far).

    kind "json": `spec` is a JSON schema as JSON text; "json_object": any JSON object
    (`spec` empty); "regex": a regular expression; "choice": a JSON list of strings;
    "grammar": a grammar (Lark or GBNF) as text. A re-run's matcher replays the output
    its prompt holds (SamplingParams.emitted)."""

    kind: str
    spec: str = ""
    # json and json_object: a regex of the whitespace allowed between the JSON's tokens
    # (vLLM's guided_whitespace_pattern); "": none but the ", " and ": " models write.
    whitespace: str = ""

    def __post_init__(self) -> None:
        kinds = ("json", "json_object", "regex", "choice", "grammar")
        if self.kind not in kinds:
            raise ValueError(f"structured output kind must be one of {kinds}, got {self.kind!r}")
        if self.whitespace and self.kind not in ("json", "json_object"):
            raise ValueError(f"a whitespace pattern applies to JSON, not to kind {self.kind!r}")


@dataclass(frozen=True)
class SamplingParams:
    """How to pick tokens and when to stop. Bad values raise ValueError naming the field."""

    max_tokens: int = 256
    temperature: float = 0.0  # 0 means greedy
    top_k: int = 0  # 0 means no top-k cut
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    include_stop_str: bool = False  # vLLM's include_stop_str_in_output: the stop stays in
    skip_special_tokens: bool = True  # vLLM's: False shows markers (<|im_start|>) in the text
    stop_token_ids: tuple[int, ...] = ()  # added to the model's own end tokens
    ignore_eos: bool = False
    # vLLM's penalties: presence and frequency over the generated tokens, repetition over
    # prompt and generated (1: off); logit_bias as (token id, bias) pairs.
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    allowed_token_ids: tuple[int, ...] = ()  # vLLM's: only these may be sampled (): any
    # vLLM's bad_words, tokenized: a sequence's last token is barred where the output so
    # far ends with the rest of it (a one-token word always).
    bad_words: tuple[tuple[int, ...], ...] = ()
    min_p: float = 0.0  # drop tokens under min_p times the likeliest one's probability
    min_tokens: int = 0  # end tokens and stop token ids are masked until this many
    # llama.cpp's cuts (sampling/cuts.py): off at these values.
    top_n_sigma: float = 0.0  # keep logits within n deviations of the largest (<= 0: off)
    typical_p: float = 1.0  # locally typical sampling's mass (1: off)
    xtc_probability: float = 0.0  # XTC: the chance the top choices are excluded (0: off)
    xtc_threshold: float = 0.1  # ... those at this probability or more, but the least
    # A temperature in temperature +- range, by the candidates' entropy (0: off).
    dynatemp_range: float = 0.0
    dynatemp_exponent: float = 1.0
    # llama.cpp's mirostat (sampling/mirostat.py): 1 or 2 samples by it in place of top-k, top-p,
    # min-p and the cuts above (0: off); tau the target surprise, eta its learning rate.
    mirostat: int = 0
    mirostat_tau: float = 5.0
    mirostat_eta: float = 0.1
    # llama.cpp's DRY (sampling/dry.py): a penalty on extending a repeat (multiplier 0: off).
    dry_multiplier: float = 0.0
    dry_base: float = 1.75
    dry_allowed_length: int = 2
    dry_penalty_last_n: int = -1  # -1: the whole context
    dry_sequence_breakers: tuple[str, ...] = DRY_BREAKERS
    logprobs: int | None = None  # None: none; k: the sampled token's and the top k
    processed_logprobs: bool = False  # False: the model's raw distribution (vLLM's default)
    prompt_logprobs: int | None = None  # k: each prompt token's (from the 2nd) and top k
    # A re-run's: how many of the prompt's last tokens the request generated already (they
    # count as output for the penalties, min_tokens and the grammar, as in the first attempt).
    emitted: int = 0
    structured: StructuredOutput | None = None
    # llama.cpp's per-request speculative.n_max / speculative.n_min: this request's draft
    # length range within the server's (n_max 0: no speculation; None: the server's).
    speculative_n_max: int | None = None
    speculative_n_min: int | None = None
    # vLLM's per-request cache_salt: requests with different salts share no prefix-cache
    # block (it enters the first block's key); empty: none, the plain keys.
    cache_salt: str = ""
    # OpenAI's predicted output, tokenized: where the server speculates by n-gram lookup,
    # its tokens are looked up beside the prompt's and the output's (and the request
    # speculates on an opt-in server too). Never changes the answer.
    prediction: tuple[int, ...] = ()
    # An embedding request's: the prompt's mean-pooled, normalized last hidden state comes
    # with its first output (engine/pooling.py); every prompt position is computed.
    embed: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        object.__setattr__(self, "prediction", tuple(self.prediction))
        object.__setattr__(self, "logit_bias", tuple(tuple(p) for p in self.logit_bias))
        object.__setattr__(self, "allowed_token_ids", tuple(self.allowed_token_ids))
        object.__setattr__(self, "bad_words", tuple(tuple(w) for w in self.bad_words))
        object.__setattr__(self, "dry_sequence_breakers", tuple(self.dry_sequence_breakers))
        checks = [
            (self.max_tokens >= 1, f"max_tokens must be at least 1, got {self.max_tokens}"),
            (
                math.isfinite(self.temperature) and self.temperature >= 0,
                f"temperature must be a finite number >= 0, got {self.temperature}",
            ),
            (self.top_k >= 0, f"top_k must be >= 0 (0 turns it off), got {self.top_k}"),
            (0 < self.top_p <= 1, f"top_p must be in (0, 1], got {self.top_p}"),
            (all(s for s in self.stop), "stop strings must not be empty"),
            (
                -2 <= self.presence_penalty <= 2,
                f"presence_penalty must be in [-2, 2], got {self.presence_penalty}",
            ),
            (
                -2 <= self.frequency_penalty <= 2,
                f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}",
            ),
            (
                0 < self.repetition_penalty <= 2,
                f"repetition_penalty must be in (0, 2], got {self.repetition_penalty}",
            ),
            (0 <= self.min_p <= 1, f"min_p must be in [0, 1], got {self.min_p}"),
            (self.min_tokens >= 0, f"min_tokens must be >= 0, got {self.min_tokens}"),
            *_llama_cpp_checks(self),
            (
                self.logprobs is None or 0 <= self.logprobs <= MAX_TOP_LOGPROBS,
                f"logprobs must be in [0, {MAX_TOP_LOGPROBS}], got {self.logprobs}",
            ),
            (self.emitted >= 0, f"emitted must be >= 0, got {self.emitted}"),
            (
                self.prompt_logprobs is None or 0 <= self.prompt_logprobs <= MAX_TOP_LOGPROBS,
                f"prompt_logprobs must be in [0, {MAX_TOP_LOGPROBS}], got {self.prompt_logprobs}",
            ),
            *_speculative_checks(self.speculative_n_max, self.speculative_n_min),
            (
                not self.embed or self.max_tokens == 1,
                f"an embedding's request makes one token, got max_tokens {self.max_tokens}",
            ),
        ]
        for ok, message in checks:
            if not ok:
                raise ValueError(message)

    @property
    def whole_prompt(self) -> bool:
        """Every prompt position must be computed (no cached prefix): its logits or its
        hidden state are asked for."""
        return self.prompt_logprobs is not None or self.embed

    @property
    def dry(self) -> Dry:
        return Dry(
            self.dry_multiplier, self.dry_base, self.dry_allowed_length, self.dry_penalty_last_n
        )

    @property
    def greedy(self) -> bool:
        # Dividing logits by a temperature this small overflows: it is greedy anyway.
        return self.temperature < GREEDY_BELOW


def _llama_cpp_checks(p: SamplingParams) -> list[tuple[bool, str]]:
    def finite(value: float) -> bool:
        return math.isfinite(value)

    return [
        (finite(p.top_n_sigma), f"top_n_sigma must be a finite number, got {p.top_n_sigma}"),
        (0 < p.typical_p <= 1, f"typical_p must be in (0, 1], got {p.typical_p}"),
        (
            0 <= p.xtc_probability <= 1,
            f"xtc_probability must be in [0, 1], got {p.xtc_probability}",
        ),
        (0 <= p.xtc_threshold <= 1, f"xtc_threshold must be in [0, 1], got {p.xtc_threshold}"),
        (
            finite(p.dynatemp_range) and p.dynatemp_range >= 0,
            f"dynatemp_range must be a finite number >= 0, got {p.dynatemp_range}",
        ),
        (
            finite(p.dynatemp_exponent) and p.dynatemp_exponent >= 0,
            f"dynatemp_exponent must be a finite number >= 0, got {p.dynatemp_exponent}",
        ),
        (p.mirostat in (0, 1, 2), f"mirostat must be 0, 1 or 2, got {p.mirostat}"),
        (
            finite(p.mirostat_tau) and 0 < p.mirostat_tau <= MAX_MIROSTAT_TAU,
            f"mirostat_tau must be in (0, {MAX_MIROSTAT_TAU}], got {p.mirostat_tau}",
        ),
        (
            finite(p.mirostat_eta) and 0 <= p.mirostat_eta <= 1,
            f"mirostat_eta must be in [0, 1], got {p.mirostat_eta}",
        ),
        (
            finite(p.dry_multiplier) and p.dry_multiplier >= 0,
            f"dry_multiplier must be a finite number >= 0, got {p.dry_multiplier}",
        ),
        (finite(p.dry_base) and p.dry_base > 0, f"dry_base must be > 0, got {p.dry_base}"),
        (
            p.dry_allowed_length >= 0,
            f"dry_allowed_length must be >= 0, got {p.dry_allowed_length}",
        ),
        (
            p.dry_penalty_last_n >= -1,
            f"dry_penalty_last_n must be >= -1 (-1: the whole context), got {p.dry_penalty_last_n}",
        ),
        (
            all(p.dry_sequence_breakers),
            "dry_sequence_breakers must not hold an empty string",
        ),
    ]


def _speculative_checks(n_max: int | None, n_min: int | None) -> list[tuple[bool, str]]:
    top = MAX_SPECULATIVE_TOKENS
    return [
        (
            n_max is None or 0 <= n_max <= top,
            f"speculative.n_max must be in [0, {top}], got {n_max}",
        ),
        (
            n_min is None or 0 <= n_min <= top,
            f"speculative.n_min must be in [0, {top}], got {n_min}",
        ),
        (
            n_max is None or n_min is None or n_min <= n_max,
            f"speculative.n_min ({n_min}) must not exceed speculative.n_max ({n_max})",
        ),
    ]


class SequenceStatus(Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PARKED = "parked"  # prefill done; its blocks wait for a decode worker to pull them
    FINISHED = "finished"


@dataclass(eq=False)  # identity, not field equality: two requests may look alike
class Sequence:
    """One request inside a worker: prompt + output ids and how much of it the KV cache holds."""

    seq_id: int
    token_ids: list[int]
    params: SamplingParams
    stop_token_ids: frozenset[int] = frozenset()
    # The tokens holding one of its DRY sequence breakers (the engine's tokenizer finds them).
    dry_breakers: frozenset[int] = frozenset()
    num_prompt_tokens: int = 0
    num_computed_tokens: int = 0  # tokens whose K/V is in the cache
    block_table: list[int] = field(default_factory=list)
    block_keys: list[int] = field(default_factory=list)  # prefix-cache keys of its full blocks
    num_cached_tokens: int = 0  # prompt tokens its first schedule found in the prefix cache
    status: SequenceStatus = SequenceStatus.WAITING
    finish_reason: str | None = None  # "stop", "length", "abort" or "handoff"
    prefill_only: bool = False  # park after the first token instead of decoding
    parked_at: float = 0.0  # when it was parked: its lease starts then
    # Its draft length and measured acceptance, where it may speculate (the scheduler's).
    draft_length: DraftLength | None = None

    def __post_init__(self) -> None:
        if not self.token_ids:
            raise ValueError("a prompt needs at least one token")
        self.num_prompt_tokens = self.num_prompt_tokens or len(self.token_ids)

    def __len__(self) -> int:
        return len(self.token_ids)

    @property
    def output_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def num_uncomputed(self) -> int:
        return len(self.token_ids) - self.num_computed_tokens

    @property
    def finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED
