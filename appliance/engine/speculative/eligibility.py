"""Which sequences may speculate this step, and which of their drafts may be verified.
Torch-free (the scheduler asks it).

Verification judges each drafted position as plain decoding would sample it (the sampler
processes every verify row for the output so far plus the drafts before it: penalties,
logit_bias, min_tokens' end-token mask, the grammar's state), and logprobs come from the
target's rows: every sampling feature speculates but mirostat, whose cut at each
position depends on the tokens drawn before it through its controller's state (a
mirostat request decodes a token a step). A structured request's drafts are cut at the
first token its grammar refuses, so no such token is ever verified."""

from __future__ import annotations

from collections.abc import Callable
from collections.abc import Sequence as Ids

from appliance.engine.sequence import Sequence

# How many of a sequence's drafts its grammar allows in a row (GrammarMasks.valid_drafts).
DraftCheck = Callable[[Sequence, Ids[int]], int]


def speculates(seq: Sequence) -> bool:
    """Whether `seq` may carry drafts: decoding here, with one token uncomputed, and not
    sampled by mirostat."""
    steered = seq.params.mirostat != 0 and not seq.params.greedy
    return not (seq.prefill_only or steered) and bool(seq.output_ids) and seq.num_uncomputed == 1


def draft_room(seq: Sequence, chunk_size: int, max_model_len: int) -> int:
    """The most drafts seq's next verify chunk may carry, the step's budget aside, so that
    none is wasted: the chunk holds seq's last token besides them, and the step emits at
    most drafts + 1 tokens, within max_tokens and the context. 0 or less: none."""
    return min(
        chunk_size - 1,
        seq.params.max_tokens - len(seq.output_ids) - 1,
        max_model_len - len(seq) - 1,
    )


def allowed_drafts(seq: Sequence, drafts: list[int], grammar: DraftCheck | None) -> list[int]:
    """`drafts` up to the first token seq's grammar refuses (all of them where it has no
    structured output); none for a structured sequence when no grammar check is given."""
    if seq.params.structured is None or not drafts:
        return drafts
    return drafts[: grammar(seq, drafts)] if grammar is not None else []
