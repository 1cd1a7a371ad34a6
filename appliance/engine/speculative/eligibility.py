"""Which sequences may speculate this step. Torch-free (the scheduler asks it).

Verification compares drafts with the distribution the sampler would draw from; where
sampling-time processing changes that distribution per position (penalties and
logit_bias on the growing output, a grammar's state, min_tokens' end-token mask) or a
request wants logprobs per token, the sequence decodes plainly for now: the same answer,
one token a step."""

from __future__ import annotations

from appliance.engine.sequence import Sequence


def speculates(seq: Sequence) -> bool:
    """Whether `seq` may carry drafts: decoding here, one token uncomputed, and none of
    the sampling features verification does not handle yet."""
    p = seq.params
    if seq.prefill_only or not seq.output_ids or seq.num_uncomputed != 1:
        return False
    if p.structured is not None or p.logit_bias or p.logprobs is not None:
        return False
    if p.presence_penalty != 0 or p.frequency_penalty != 0 or p.repetition_penalty != 1:
        return False
    # min_tokens masks end tokens until that many outputs (a re-run's earlier ones count).
    outputs = len(seq.token_ids) - max(0, seq.num_prompt_tokens - p.emitted)
    return outputs >= p.min_tokens
