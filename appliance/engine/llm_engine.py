"""An in-process engine: requests in, text deltas out, one model step at a time."""

from __future__ import annotations

import functools
import itertools
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

import torch

from appliance.engine.model_runner import ModelRunner, StepInputs
from appliance.engine.sampling.logprobs import TokenLogprobs
from appliance.engine.sampling.sampler import Sampler
from appliance.engine.scheduler import Scheduler, SchedulerLimits
from appliance.engine.sequence import SamplingParams, Sequence, SequenceStatus
from appliance.engine.shard_loading import load_shard
from appliance.engine.speculative.draft_loading import engine_drafter
from appliance.engine.speculative.proposer import Drafter
from appliance.engine.step_timing import StepClock
from appliance.engine.stop_strings import StopStringMatcher
from appliance.engine.structured.masks import GrammarMasks
from appliance.kv.block_allocator import blocks_for_tokens
from appliance.kv.cache import KVCache
from appliance.kv.handoff import CopyStreams, HandoffCopy, KVShard, PendingCopies, start_copy
from appliance.kv.remote import Copies, RemoteSource, TransferError, check_source_dtype
from appliance.kv_store.pool_blocks import copy_pool_block
from appliance.model.causal_lm import CausalLM
from appliance.model.tensor_parallel import Shard
from appliance.model.tokenizer import IncrementalDetokenizer, Tokenizer
from appliance.settings.config import Settings


class ShardGroup(Protocol):
    """The other shards of a tensor-parallel group, which run each step in lockstep with
    this one (rank 0, which schedules and samples). See workers/shard_group.py."""

    size: int

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor: ...

    def run_step(self, inputs: StepInputs) -> None: ...

    def kv_shards(self) -> list[KVShard]: ...

    def resize_kv(self, num_blocks: int) -> None: ...


@dataclass
class RequestOutput:
    """What one step produced for one request."""

    seq_id: int
    text: str  # the new text since the last output (may be empty)
    token_ids: list[int]  # the new token ids
    finished: bool
    finish_reason: str | None
    num_prompt_tokens: int
    num_output_tokens: int
    handoff_blocks: list[int] | None = None  # a parked prefill's blocks, to pull then release
    cached_tokens: int = 0  # prompt tokens found in the prefix cache
    logprobs: list[TokenLogprobs] | None = None  # one per new token, where the request asked
    # On the first output, where asked: the prompt's tokens from its second on, each
    # under the distribution of the positions before it (vLLM's prompt_logprobs).
    prompt_logprobs: list[TokenLogprobs] | None = None
    # On the output of the step that completed the prompt, where asked (params.embed).
    embedding: list[float] | None = None


@dataclass
class Completion:
    """A whole finished request."""

    text: str
    token_ids: list[int]
    finish_reason: str | None
    num_prompt_tokens: int
    logprobs: list[TokenLogprobs] | None = None  # one per token, where the request asked
    prompt_logprobs: list[TokenLogprobs] | None = None  # from the prompt's second token


@dataclass
class _Stream:
    detokenizer: IncrementalDetokenizer
    stops: StopStringMatcher
    sent_tokens: int = 0
    # Prompt logprobs by position, gathered over the prompt's chunks (a recomputed chunk
    # of a preempted prompt gives the same again) until the first output carries them.
    prompt: dict[int, TokenLogprobs] = field(default_factory=dict)


class LLMEngine:
    """Scheduler + model runner + detokenization for one pool of KV blocks."""

    def __init__(
        self,
        model: CausalLM,
        tokenizer: Tokenizer,
        kv: KVCache,
        limits: SchedulerLimits,
        prefix_caching: bool = False,
        group: ShardGroup | None = None,
        drafter: Drafter | None = None,
    ) -> None:
        """drafter: speculative decoding's proposer and draft length (None: off)."""
        self.model = model
        self.tokenizer = tokenizer
        self.kv = kv
        self._group = group
        self._kv_shards = None if group else [KVShard(0, kv.tensor)]
        self.scheduler = Scheduler(kv.allocator, kv.block_size, limits, prefix_caching, drafter)
        if group is None:  # (a tensor-parallel pool's other shards are in other processes)
            # A finished request's partial last block is reused as a copy (prefix_cache.py).
            self.scheduler.blocks.copy_block = functools.partial(copy_pool_block, kv.tensor)
        sampler = Sampler(model.device)
        # Structured outputs' matchers live with the sampler that masks their rows.
        sampler.grammar = self.grammar = GrammarMasks(tokenizer, model.config.vocab_size)
        self.scheduler.draft_check = self.grammar.valid_drafts  # drafts stop where it refuses
        self.runner = ModelRunner(model, kv, sampler, group)
        self._ids, self.clock = itertools.count(), StepClock()  # clock: the last step's timing
        self._seqs: dict[int, Sequence] = {}
        self._streams: dict[int, _Stream] = {}
        # Handed-off requests whose blocks are being copied in (CUDA), held out of the batch.
        self._copies: PendingCopies[Sequence] = PendingCopies()
        self._copy_streams = CopyStreams()
        self._landed: list[int] = []  # their ids once in the batch, until pop_landed
        self.model_source: Path | None = None  # the weights' file or folder (the KV store's key)
        self._aborted: set[int] = set()  # of those in flight: freed once they land
        self._copy_failed: list[int] = []  # reads from another box that failed, to report
        self._garbage: set[int] = set()  # their requests: blocks freed once reads settle
        # Recorded after a step that parks blocks; decode workers' copies wait for it.
        self.handoff_ready = torch.cuda.Event(interprocess=True) if kv.tensor.is_cuda else None

    @classmethod
    def from_settings(
        cls,
        settings: Settings,
        shared_kv: bool = False,
        group: ShardGroup | None = None,
        decodes: bool = True,
    ) -> LLMEngine:
        """Load the configured model (cached after the first start) and size its KV pool;
        shared_kv puts a CPU pool in shared memory so other processes can map it. With a
        group this process is shard 0 of a tensor-parallel model whose other shards the
        group runs. `decodes` (not a prefill worker): batch.cuda_graphs applies."""
        if group is None:
            parts = load_shard(settings, shared_kv=shared_kv)
        else:
            shard = Shard(0, group.size)
            parts = load_shard(settings, shard, group.all_reduce, shared_kv=shared_kv)
        cfg = parts.files.config
        tokenizer = Tokenizer.load(
            parts.files.tokenizer_dir, cfg.eos_token_ids, settings.chat_template
        )
        limits = SchedulerLimits(
            max_num_seqs=settings.batch.max_num_seqs,
            max_num_batched_tokens=settings.batch.max_num_batched_tokens,
            chunk_size=settings.batch.chunk_size,
            max_model_len=parts.max_len,
            prefill_wait_steps=settings.batch.prefill_wait_steps,
        )
        # A draft model (method draft) loads here and takes its KV out of the target's pool.
        parts, drafter = engine_drafter(settings, parts, decodes, group)
        engine = cls(
            parts.model, tokenizer, parts.kv, limits, settings.kv.prefix_caching, group, drafter
        )
        engine.model_source = parts.files.source
        if decodes and settings.batch.cuda_graphs:
            engine.runner.use_decode_graphs(settings.batch.max_num_seqs, parts.max_len)
        return engine

    def add_request(
        self, prompt_ids: list[int], params: SamplingParams, prefill_only: bool = False
    ) -> int:
        """Queue a tokenized prompt; returns its id. Raises ValueError if it cannot fit.

        prefill_only: stop after the first token and park the prompt's blocks for a decode
        worker (the output carries `handoff_blocks`; call `release` once they are copied)."""
        bad = [t for t in prompt_ids if not 0 <= t < self.model.config.vocab_size]
        if bad:
            raise ValueError(f"token id {bad[0]} is outside the vocabulary")
        seq = self._new_sequence(list(prompt_ids), params)
        seq.prefill_only = prefill_only
        self.scheduler.add(seq)
        self._track(seq)
        return seq.seq_id

    def _new_sequence(self, token_ids: list[int], params: SamplingParams) -> Sequence:
        stop_ids = frozenset() if params.ignore_eos else self.tokenizer.stop_token_ids
        seq = Sequence(next(self._ids), token_ids, params, stop_token_ids=stop_ids)
        if params.dry.on:
            seq.dry_breakers = self.tokenizer.ids_holding(params.dry_sequence_breakers)
        return seq

    def _track(self, seq: Sequence) -> None:
        self._seqs[seq.seq_id] = seq
        stops = StopStringMatcher(seq.params.stop, seq.params.include_stop_str)
        detokenizer = IncrementalDetokenizer(self.tokenizer, seq.params.skip_special_tokens)
        stream = _Stream(detokenizer, stops)
        self._streams[seq.seq_id] = stream

    def add_prefilled(
        self,
        token_ids: list[int],
        num_prompt_tokens: int,
        params: SamplingParams,
        source: list[KVShard] | RemoteSource,
        source_blocks: list[int],
    ) -> tuple[int, int] | None:
        """Continue a request another pool prefilled: pull its prompt K/V from `source`
        (that pool's KV tensors, one per shard, or pools on another box to read through
        this process's transfer agent) into this pool and decode from its first token.

        token_ids is the prompt plus the first token. Returns the new id and the bytes
        copied (blocks this pool's prefix cache held are not), or None when this pool has
        no room now (nothing is copied; retry or pick another worker).

        The request joins the batch once its blocks have landed: at once on the CPU, on
        CUDA at a later step (or admit_copied); pop_landed says which have. Release the
        source blocks only then. A read from another box that fails frees the request
        (pop_failed_copies says which): prefill it again."""
        check_source_dtype(source, self.kv.tensor.dtype)  # moved as stored: one dtype
        if len(self.scheduler.running) + len(self._copies) >= self.scheduler.limits.max_num_seqs:
            return None
        seq = self._new_sequence(list(token_ids), params)
        seq.num_prompt_tokens = num_prompt_tokens
        seq.num_computed_tokens = num_prompt_tokens
        if not self.scheduler.admit_prefilled(seq):
            return None
        self.scheduler.running.remove(seq)  # until its blocks land: admit_copied
        needed = blocks_for_tokens(num_prompt_tokens, self.kv.block_size)
        have = seq.num_cached_tokens // self.kv.block_size  # cached here already
        src_ids, dst_ids = source_blocks[have:needed], seq.block_table[have:needed]
        if isinstance(source, RemoteSource):
            copy: HandoffCopy | Copies = source.start_copy(src_ids, self.kv_shards, dst_ids)
        else:
            copy = start_copy(source, src_ids, self.kv_shards, dst_ids, self._copy_streams)
        self._track(seq)
        stream = self._streams[seq.seq_id]
        # The prefill side already streamed the first token: prime the text state only.
        _shown(stream, params, 0, stream.detokenizer.add(token_ids[-1]))
        stream.sent_tokens = len(seq.output_ids)
        self._copies.add(seq.seq_id, seq, self._settled(seq.seq_id, copy))
        self.admit_copied()
        return seq.seq_id, copy.nbytes

    def _settled(self, seq_id: int, copy: HandoffCopy | Copies) -> Callable[[], bool]:
        """`copy.done`, but a failed read is noted as failed at once and counts as done
        once nothing of it can still land (its blocks are freed then, not before)."""
        failed = False

        def settled() -> bool:
            nonlocal failed
            if failed:
                assert isinstance(copy, Copies)  # only reads from another box fail
                return copy.settled()
            try:
                return copy.done()
            except TransferError:
                failed = True
                self._copy_failed.append(seq_id)
                self._garbage.add(seq_id)
                return settled()

        return settled

    def admit_copied(self) -> None:
        """Move handed-off requests whose blocks have landed into the running batch (an
        aborted one is freed instead); never waits for a copy."""
        for seq in self._copies.landed():
            self.scheduler.running.append(seq)
            if seq.seq_id in self._garbage or seq.seq_id in self._aborted:
                self._garbage.discard(seq.seq_id)  # its blocks hold garbage: free them
                self._aborted.discard(seq.seq_id)
                self._seqs.pop(seq.seq_id, None)
                self.scheduler.finish(seq, "abort")
                self._forget(seq.seq_id)
            else:
                self._landed.append(seq.seq_id)

    def pop_failed_copies(self) -> list[int]:
        """Ids of handed-off requests whose read from another box failed since the last
        call: they are over (their blocks are freed once no byte can still land in them),
        and their source blocks can be released."""
        failed, self._copy_failed = self._copy_failed, []
        return failed

    def pop_landed(self) -> list[int]:
        """Ids of handed-off requests that joined the batch since the last call."""
        landed, self._landed = self._landed, []
        return landed

    @property
    def copies_in_flight(self) -> int:
        """Handed-off requests whose blocks are still being copied in (not those failed
        already, whose blocks wait only for a late read to end)."""
        return len(self._copies) - len(self._garbage)

    @property
    def kv_shards(self) -> list[KVShard]:
        """This worker's pools split over KV heads, where handed-off blocks are copied to.
        A tensor-parallel worker opens its followers' pools at its first handoff: only a
        decode worker ever needs them."""
        if self._kv_shards is None:
            assert self._group is not None  # only a worker with a group starts without them
            self._kv_shards = [KVShard(0, self.kv.tensor), *self._group.kv_shards()]
        return self._kv_shards

    @property
    def num_free_blocks(self) -> int:
        """KV blocks no running request holds (cached ones included: they are reclaimable)."""
        return self.scheduler.blocks.num_free

    def release(self, seq_id: int) -> None:
        """Free a parked prefill's blocks once a decode worker has copied them."""
        self.scheduler.release(seq_id)
        self._seqs.pop(seq_id, None)

    def expire_leases(self, lease_seconds: float, now: float | None = None) -> list[int]:
        """Free parked prefills no decode worker pulled in time; returns their ids."""
        now = time.monotonic() if now is None else now
        expired = self.scheduler.expire_leases(now, lease_seconds)
        for seq in expired:
            self._seqs.pop(seq.seq_id, None)
        return [seq.seq_id for seq in expired]

    def abort(self, seq_id: int) -> None:
        """Drop a request now and free its blocks."""
        seq = self._seqs.pop(seq_id, None)
        if seq is not None and seq_id in self._copies:
            self._aborted.add(seq_id)  # its copy still writes its blocks: free them after
        elif seq is not None:
            self.scheduler.finish(seq, "abort")
            self._forget(seq_id)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished() or bool(self._copies)

    def step(self) -> list[RequestOutput]:
        """Admit landed handoffs, run one model step; report every request that produced a
        token."""
        self.admit_copied()
        out = self.scheduler.schedule()
        if out.empty:
            return []
        # Grammar masks of the rows to sample are computed while the forward runs.
        # (Verify chunks' masks are computed as they are judged: Sampler.verify.)
        self.grammar.start([c.seq for c in out.chunks if c.completes and not c.drafts])
        sampled = self.clock.run(self.runner.run, out, self.kv.tensor.is_cuda)
        updated = self.scheduler.update_from_output(
            out, sampled, time.monotonic(), self.runner.verified
        )
        if self.handoff_ready is not None and any(
            s.seq_id in self.scheduler.parked for s in updated
        ):
            # After the step that wrote the parked blocks, before they are announced.
            self.handoff_ready.record(torch.cuda.current_stream(self.kv.tensor.device))
        for seq_id, found in self.runner.prompt_logprobs.items():
            if (stream := self._streams.get(seq_id)) is not None:
                stream.prompt.update(found)
        logprobs = self.runner.logprobs
        return [self._output(seq, logprobs.get(seq.seq_id)) for seq in updated]

    def _output(self, seq: Sequence, logprobs: list[TokenLogprobs] | None = None) -> RequestOutput:
        """What `seq` made this step; `logprobs`: its made tokens', if it asked (a verify
        step's run may be longer than what the stops let through)."""
        stream = self._streams[seq.seq_id]
        first, new_ids = stream.sent_tokens, seq.output_ids[stream.sent_tokens :]
        pieces = []
        for i, t in enumerate(new_ids):
            if seq.finished and i + 1 == len(new_ids) and t in seq.stop_token_ids:
                break  # the model's end token that ended it: no part of the text
            pieces.append(_shown(stream, seq.params, first + i, stream.detokenizer.add(t)))
            if stream.stops.stopped and i + 1 < len(new_ids):
                _cut_verified_run(seq, first + i + 1)
                new_ids = new_ids[: i + 1]
                break
        stream.sent_tokens = len(seq.output_ids)
        text = "".join(pieces)
        if stream.stops.stopped and not seq.finished:
            self.scheduler.finish(seq, "stop")
        if seq.finished:
            text += stream.stops.feed(stream.detokenizer.flush()) + stream.stops.flush()
            if stream.stops.stopped and seq.finish_reason == "length":
                # A stop string ending on the last token allowed: a stop, as vLLM says.
                seq.finish_reason = "stop"
            self._seqs.pop(seq.seq_id, None)
        parked = seq.status is SequenceStatus.PARKED
        if seq.finished or parked:
            self._forget(seq.seq_id)
        return RequestOutput(
            seq.seq_id,
            text,
            new_ids,
            seq.finished,
            seq.finish_reason,
            seq.num_prompt_tokens,
            len(seq.output_ids),
            list(seq.block_table) if parked else None,
            seq.num_cached_tokens,
            # One per new id: a verify step's may be cut short by a stop inside its run.
            logprobs[: len(new_ids)] if logprobs is not None and new_ids else None,
            self._prompt_logprobs(seq, stream) if first == 0 and new_ids else None,
            self.runner.embeddings.get(seq.seq_id),
        )

    @staticmethod
    def _prompt_logprobs(seq: Sequence, stream: _Stream) -> list[TokenLogprobs] | None:
        """The prompt logprobs the first output carries, in order, where asked."""
        if seq.params.prompt_logprobs is None:
            return None
        return [stream.prompt[p] for p in range(1, seq.num_prompt_tokens) if p in stream.prompt]

    def _forget(self, seq_id: int) -> None:
        self._streams.pop(seq_id, None)
        self.runner.sampler.forget(seq_id)
        self.runner.pooling.forget(seq_id)
        self.grammar.forget(seq_id)

    def stream(self, prompt_ids: list[int], params: SamplingParams) -> Iterator[RequestOutput]:
        """Run one request alone, yielding its outputs as they come."""
        seq_id = self.add_request(prompt_ids, params)
        try:
            while True:
                for output in self.step():
                    if output.seq_id == seq_id:
                        yield output
                        if output.finished:
                            return
        finally:
            self.abort(seq_id)

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[Completion]:
        """Run several prompts as one batch to the end."""
        order = [self.add_request(p, params) for p in prompts]
        texts: dict[int, list[str]] = {i: [] for i in order}
        tokens: dict[int, list[int]] = {i: [] for i in order}
        logprobs: dict[int, list[TokenLogprobs]] = {i: [] for i in order}
        prompt_logprobs: dict[int, list[TokenLogprobs] | None] = {}
        reasons: dict[int, str | None] = {}
        while self.has_unfinished():
            for output in self.step():
                texts[output.seq_id].append(output.text)
                tokens[output.seq_id].extend(output.token_ids)
                logprobs[output.seq_id].extend(output.logprobs or [])
                if output.prompt_logprobs is not None:
                    prompt_logprobs[output.seq_id] = output.prompt_logprobs
                if output.finished:
                    reasons[output.seq_id] = output.finish_reason
        asked = params.logprobs is not None
        return [
            Completion(
                "".join(texts[i]),
                tokens[i],
                reasons.get(i),
                len(prompt),
                logprobs[i] if asked else None,
                prompt_logprobs.get(i),
            )
            for i, prompt in zip(order, prompts, strict=True)
        ]


def _shown(stream: _Stream, params: SamplingParams, position: int, piece: str) -> str:
    """The text output token `position` (from 0) adds, as far as it can be shown. Before
    min_tokens no stop string ends the output (vLLM's rule): that text skips the matcher."""
    if position + params.emitted < params.min_tokens:  # a re-run's earlier output counts
        return piece
    return stream.stops.feed(piece)


def _cut_verified_run(seq: Sequence, outputs: int) -> None:
    """A stop string ended the output inside a verified run (several tokens made in one
    step): the tokens after it were never made, as in plain decoding. Keeps the first
    `outputs` output tokens; the caller finishes the sequence (or it was finished, by an
    end token or max_tokens after the stop: the stop string came first)."""
    del seq.token_ids[seq.num_prompt_tokens + outputs :]
    if seq.finished:
        seq.finish_reason = "stop"
