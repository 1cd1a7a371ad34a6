"""The engine's sections of the settings model (appliance/settings/config.py): the KV pool,
batching and speculative decoding. Import them from appliance.settings.config, which
re-exports them."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import AliasChoices, BaseModel, ConfigDict, Field, field_validator, model_validator


class KVSettings(BaseModel):
    """Paged KV cache of each worker."""

    model_config = ConfigDict(extra="forbid")

    block_size: int = Field(16, ge=1, le=1024, description="Tokens per KV block.")
    memory_mb: int = Field(
        512,
        ge=1,
        description="Memory budget for one worker's KV tensor, in MiB. On the CPU it sizes "
        "the pool; on a GPU only when set explicitly (else gpu_memory_utilization does).",
    )
    gpu_memory_utilization: float = Field(
        0.9,
        gt=0,
        le=1,
        description="On a GPU: the fraction of the device's total memory this worker may use "
        "for its weights, a step's activations and its KV pool together (as vLLM's "
        "gpu_memory_utilization). After the weights load and one profiled step of the "
        "largest batch the scheduler allows, the KV pool gets what is left of that share "
        "(never more than the device has free). Workers sharing one GPU need fractions "
        "that add up to at most 1 (0.45 each for two). memory_mb or num_blocks, when set, "
        "override it; the CPU ignores it.",
    )
    num_blocks: int | None = Field(
        None,
        ge=1,
        description="Exact number of KV blocks; overrides memory_mb and "
        "gpu_memory_utilization when set.",
    )
    prefix_caching: bool = Field(
        True,
        description="Keep full KV blocks of past requests, keyed by their tokens, so a "
        "repeated prefix (a system prompt, a document) is not prefilled again.",
    )

    @property
    def memory_mb_given(self) -> bool:
        """Whether memory_mb was set (keyword, environment or TOML) rather than left at
        its default: only then does it size a GPU's pool instead of gpu_memory_utilization."""
        return "memory_mb" in self.model_fields_set


class BatchSettings(BaseModel):
    """Batching knobs of the scheduler."""

    model_config = ConfigDict(extra="forbid")

    max_num_seqs: int = Field(64, ge=1, description="Most sequences running at once.")
    max_num_batched_tokens: int = Field(
        2048, ge=16, description="Token budget of one model step (prefill chunks + decodes)."
    )
    chunk_size: int = Field(
        512, ge=16, description="Longest piece of one prompt prefilled in a single step."
    )
    max_model_len: int | None = Field(
        None, ge=16, description="Longest prompt + output; defaults to the model's context."
    )
    prefill_wait_steps: int = Field(
        0,
        ge=0,
        description="Steps a new prompt may wait while other requests decode, so that the "
        "prompts arriving within them prefill in one step: running streams stall once for "
        "several prompts instead of once for each, and prompts that start together decode "
        "together (TGI's max_waiting_tokens). Lowers time per output token under steady "
        "load; adds up to this many decode steps to time to first token. 0: a prompt "
        "starts at the next step. Only colocated workers hold prompts back: a prefill "
        "pool has no streams to protect, and a decode pool's requests arrive prefilled. "
        "The planner's simulator does not model the wait.",
    )
    cuda_graphs: bool = Field(
        False,
        description="Replay decode-only steps from CUDA graphs, captured when a decode or "
        "colocated worker starts for batch sizes 1, 2, 4, ... up to max_num_seqs (a "
        "larger batch, after tuning, runs eagerly). CUDA with triton only, one-device "
        "workers only: device=cpu or a decoding pool's tp above 1 refuses it, and a "
        "worker that lands on the CPU (device=auto) logs that it runs eagerly. Off until "
        "measured on a GPU (benchmarks/gpu_check.py compares both): no GPU has run it, "
        "and capture costs start time and memory outside the KV pool's share.",
    )


class SpeculativeSettings(BaseModel):
    """Speculative decoding (vLLM's speculative_config names): a proposer drafts tokens,
    one forward pass verifies them, and the answer is the one plain decoding gives
    (greedy: token for token; sampling: the same distribution)."""

    model_config = ConfigDict(extra="forbid", validate_by_name=True)  # draft_model's alias

    method: Literal["off", "ngram", "draft"] = Field(
        "off",
        description="off: plain decoding. ngram: prompt lookup, no extra model: the "
        "longest recent suffix found earlier in the prompt or output proposes what "
        "followed it (pays where answers copy their input: summaries, quotes, code edits). "
        "draft: a smaller model of the same tokenizer (draft_model), run by each decoding "
        "worker beside the target (a tensor-parallel worker's leader alone, unsharded), "
        "proposes its greedy continuation. Every sampling feature speculates (penalties, "
        "logit_bias, min_tokens, structured outputs, logprobs).",
    )
    draft_model: Path | None = Field(
        default=None,
        validation_alias=AliasChoices("draft_model", "model"),
        description="method draft: the draft model, as --model takes one (GGUF file, "
        "Hugging Face folder, or org/name[:quant] in the local Hugging Face cache); vLLM's "
        "speculative_config.model, which is accepted as speculative.model too. Its "
        "tokenizer must be the target's (a worker refuses to start otherwise). It runs on "
        "the target's device (or draft_device), in the target's dtype; its KV pool is "
        "carved out of the worker's KV budget (docs/speculative.md).",
    )
    draft_device: str | None = Field(
        None,
        pattern=r"^(cpu|cuda(:\d+)?)$",
        description="method draft: where each decoding worker runs its draft model. Unset "
        "(or the worker's own device): beside the target, its KV pool carved out of the "
        "target's. Another device (cuda:3, a box's spare GPU): the draft and a KV pool of "
        "as many blocks as the target's live there, and the target keeps its whole pool "
        "and memory; only token ids cross between the devices. Name a device no pool "
        "uses, or leave room on it (gpu_memory_utilization): every decoding worker puts "
        "its draft there. On CPUs a worker's device is its core set, so cpu is the "
        "worker's own.",
    )
    num_speculative_tokens: int = Field(
        4,
        ge=1,
        le=16,
        description="Most draft tokens one sequence verifies in one step (the top of its "
        "draft length range; an adaptive k starts there).",
    )
    num_speculative_tokens_min: int = Field(
        1,
        ge=1,
        le=16,
        description="The bottom of the draft length range: an adaptive k never shrinks "
        "below it, and a proposal shorter than it is not verified (llama.cpp's draft-min).",
    )
    adaptive: bool = Field(
        True,
        description="Each sequence's k follows its measured acceptance (halved after a "
        "draft rejected at its first token, doubled after one kept whole), and a sequence "
        "whose acceptance says verifying does not pay (see verify_token_cost) proposes "
        "nothing for a while, then probes again. False: every draft is "
        "num_speculative_tokens long.",
    )
    verify_token_cost: float = Field(
        0.4,
        ge=0,
        le=1,
        description="adaptive: what one more row of a verify step costs, as a share of a "
        "one-token decode step (while decode is bandwidth bound a row more is cheap next "
        "to reading the weights; 0.4 is measured with the quantized CPU kernels, AMD "
        "EPYC avx512_bf16, benchmarks/spec_step_bench.py; a GPU's rows cost less). A "
        "sequence speculates while its acceptance a makes "
        "(1 + a + ... + a^k) / (1 + cost * k) > 1 at the range's bottom k: at k = 1, "
        "while a > cost.",
    )
    disable_by_batch_size: int | None = Field(
        8,
        ge=1,
        description="With more running sequences than this in a worker, nobody drafts "
        "(vLLM's name). A decode step reads the weights once for the whole batch; at a "
        "large batch the step is bound by compute rather than by that read, so the "
        "drafts' extra rows cost about as much as the tokens they may save: past this "
        "size speculation would slow every stream. None: never.",
    )
    opt_in: bool = Field(
        False,
        description="Only requests that ask for it (speculative.n_max > 0 in the body) "
        "speculate; the others decode plainly. False: every request may, unless it "
        "sends speculative.n_max = 0.",
    )
    prompt_lookup_min: int = Field(
        2, ge=1, description="ngram: the shortest suffix that may propose a continuation."
    )
    prompt_lookup_max: int = Field(
        5, ge=1, description="ngram: the longest suffix tried (the longest match wins)."
    )

    @field_validator("draft_model", mode="before")
    @classmethod
    def _draft_by_name(cls, value: object) -> object:
        # As --model: a hub name becomes its local path here, once; workers get a path.
        if value is None or str(value) == "":
            return None
        from appliance.settings.config import is_model_name  # config imports this module

        if isinstance(value, str) and is_model_name(value):
            from appliance.model.hub import resolve_model

            return resolve_model(value, None).path
        return value

    @field_validator("draft_model")
    @classmethod
    def _draft_exists(cls, value: Path | None) -> Path | None:
        if value is not None and not value.exists():
            raise ValueError(f"speculative.draft_model: no such file or folder: {value}")
        return value

    @model_validator(mode="after")
    def _lookup_range(self) -> SpeculativeSettings:
        if self.method == "draft" and self.draft_model is None:
            raise ValueError("speculative.method=draft needs speculative.draft_model")
        if self.num_speculative_tokens_min > self.num_speculative_tokens:
            raise ValueError(
                f"speculative.num_speculative_tokens_min ({self.num_speculative_tokens_min}) "
                f"must not exceed speculative.num_speculative_tokens "
                f"({self.num_speculative_tokens})"
            )
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError(
                f"speculative.prompt_lookup_min ({self.prompt_lookup_min}) must not exceed "
                f"speculative.prompt_lookup_max ({self.prompt_lookup_max})"
            )
        return self
