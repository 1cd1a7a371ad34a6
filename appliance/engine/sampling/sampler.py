"""Picking next tokens from logits: logits processing, greedy, temperature, top-k, top-p,
min-p, llama.cpp's cuts (cuts.py) and mirostat (mirostat.py), per-request seeds, and the
log probabilities requests ask for.

A step's rows are sampled together with batched tensor ops, whatever mix of greedy and
random rows and of settings it holds: per-row settings travel as tensors, and the draw is
one uniform number per row through the row's cumulative distribution (categorical.py),
which picks token i with probability probs[i].
Nothing reads the device until the step's results are complete: `sample` reads them once
with one `.tolist()` (token ids, and logprobs where asked, packed in one tensor), the
step's only host sync (a step with mirostat rows reads their drawn tokens' probabilities
once more, for their controllers).

The order, vLLM's: `process_logits` (structured-output mask, allowed_token_ids,
bad_words, logit_bias, min_tokens, penalties, DRY), then `_pick` (temperature, top-n-sigma,
min_p, top-k, typical_p, top-p, XTC, the draw; greedy rows take the argmax of the
processed logits; a mirostat row draws from its controller's cut after temperature).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from collections.abc import Sequence as Ids
from dataclasses import dataclass, replace

import torch

from appliance.engine.sampling.categorical import draw, uniforms
from appliance.engine.sampling.cuts import (
    MoreCuts,
    dynamic_temperature,
    top_n_sigma,
    typical,
    xtc_branch,
)
from appliance.engine.sampling.dry import dry_penalties
from appliance.engine.sampling.logprobs import TokenLogprobs
from appliance.engine.sampling.mirostat import Mirostat
from appliance.engine.sampling.penalties import apply_penalties
from appliance.engine.sequence import SamplingParams, Sequence
from appliance.engine.speculative.verify import accept_greedy, rejection_sample
from appliance.engine.structured.masks import GrammarMasks, apply_grammar


@dataclass(frozen=True)
class SampleRow:
    """One row of a step's logits to sample: the request and what its processors read."""

    seq_id: int
    params: SamplingParams
    token_ids: Ids[int] = ()  # prompt + output so far (read during the step, never written)
    num_prompt_tokens: int = 0
    end_token_ids: frozenset[int] = frozenset()  # the model's end tokens (none: ignore_eos)
    dry_breakers: frozenset[int] = frozenset()  # the tokens holding a DRY sequence breaker

    @classmethod
    def of(cls, seq: Sequence) -> SampleRow:
        """The row of a sequence whose chunk completes this step."""
        return cls(
            seq.seq_id,
            seq.params,
            seq.token_ids,
            seq.num_prompt_tokens,
            seq.stop_token_ids,
            seq.dry_breakers,
        )

    @property
    def output_start(self) -> int:
        """Where the request's output begins in token_ids: a re-run's prompt ends with the
        output its earlier attempt made (params.emitted), output for the processors too."""
        return max(0, self.num_prompt_tokens - self.params.emitted)

    @property
    def output_ids(self) -> Ids[int]:
        return self.token_ids[self.output_start :]

    @property
    def masks_end(self) -> bool:
        """Whether min_tokens still holds the end tokens and stop token ids back."""
        return len(self.token_ids) - self.output_start < self.params.min_tokens

    @property
    def penalized(self) -> bool:
        p = self.params
        return p.presence_penalty != 0 or p.frequency_penalty != 0 or p.repetition_penalty != 1

    @property
    def processed(self) -> bool:
        """Whether process_logits changes this row (a greedy row then takes the argmax of
        the processed logits, not of the model's)."""
        p = self.params
        masked = p.structured is not None or bool(p.allowed_token_ids) or bool(p.bad_words)
        penalized = self.penalized or p.dry.on
        return masked or bool(p.logit_bias) or self.masks_end or penalized


def verify_rows(row: SampleRow, drafts: Ids[int]) -> list[SampleRow]:
    """The 1 + k rows a verify chunk's logits are judged as: row i is `row` with drafts
    0..i-1 appended to its tokens, what plain decoding's processors would have read had it
    emitted them (penalty counts, min_tokens' output count). A row no processor reads
    needs no copies of its tokens."""
    if not row.processed:
        return [row] * (len(drafts) + 1)
    base = tuple(row.token_ids)
    return [replace(row, token_ids=base + tuple(drafts[:i])) for i in range(len(drafts) + 1)]


@dataclass
class Sampled:
    """A step's draw: a token per row, and its TokenLogprobs where the row asked."""

    token_ids: list[int]
    logprobs: list[TokenLogprobs | None]


class Sampler:
    """Holds one random generator per seeded request, so a seed gives the same output
    whatever else shares the batch; unseeded requests share one generator."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._generators: dict[int, torch.Generator] = {}
        self._mirostats: dict[int, Mirostat] = {}  # the controllers of mirostat requests
        # Unseeded rows need no stream of their own: one generator draws all their noise
        # in one call, seeded from the OS so runs differ.
        self._shared = torch.Generator(device=device)
        self._shared.seed()
        self.grammar: GrammarMasks | None = None  # the engine sets it: it has the tokenizer
        # How top-p finds its cut: a sort of each row on a GPU (no read of the device
        # mid-step); on a CPU, where a read costs nothing, from the largest few (nucleus).
        self.sort_top_p = device.type == "cuda"

    def sample(self, logits: torch.Tensor, rows: list[SampleRow]) -> Sampled:
        """logits float32 [rows, vocab], one row per SampleRow; returns a token per row and
        the logprobs of the rows that ask for them.

        Reads the device once: the step's token ids (and logprobs), together."""
        processed = self.process_logits(logits, rows)
        want = any(row.params.logprobs is not None for row in rows)
        tokens, probs = self._pick(processed, rows, keep_probs=want)
        if not want:
            return Sampled(tokens.tolist(), [None] * len(rows))
        table = logprob_table(logits, processed, probs, tokens, rows)
        return read_logprobs(table.tolist(), rows)

    def sample_tensor(self, logits: torch.Tensor, rows: list[SampleRow]) -> torch.Tensor:
        """Like `sample` without logprobs, but the token ids stay on the logits' device
        ([rows] int64): no host sync, so a caller (or a CUDA graph later) can queue more
        work behind them."""
        return self._pick(self.process_logits(logits, rows), rows, keep_probs=False)[0]

    def process_logits(self, logits: torch.Tensor, rows: list[SampleRow]) -> torch.Tensor:
        """The one place logits change before temperature and the draw, in vLLM's order.
        Returns `logits` itself when no row needs any of it, a new tensor otherwise."""
        if not any(row.processed for row in rows):
            return logits
        logits = logits.clone()  # [rows, vocab]: the raw ones stay for raw logprobs
        # 1. Structured output: the grammar mask of rows with params.structured, first,
        #    so neither the bias nor the penalties can favour a token the grammar forbids.
        apply_grammar(self.grammar, logits, rows)
        return after_the_grammar(logits, rows)

    def _pick(
        self, logits: torch.Tensor, rows: list[SampleRow], *, keep_probs: bool
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Tokens [rows] int64 from processed logits: greedy rows their argmax, the others
        a draw after temperature, min_p, top-k and top-p; and (keep_probs) the random rows'
        probabilities [rows, vocab] (None when every row is greedy)."""
        greedy = logits.argmax(dim=-1)
        if all(row.params.greedy for row in rows):
            return greedy, None  # the common case costs one argmax, as it always did
        params = [row.params for row in rows]
        probs, temperature = distributions(logits, params, self.sort_top_p)
        steered = self._mirostat_rows(probs, logits, rows)
        drawn = draw(probs, self._uniforms(rows, logits.device))
        self._observe(steered, probs, drawn)
        # Greedy rows took a placeholder temperature of 1 above; their argmax wins here.
        return torch.where(temperature == 0, greedy, drawn), probs if keep_probs else None

    def _mirostat_rows(
        self, probs: torch.Tensor, logits: torch.Tensor, rows: list[SampleRow]
    ) -> list[tuple[int, Mirostat]]:
        """Put each mirostat row's distribution (mirostat.py, from its logits after
        temperature) in place of probs' [rows, vocab] row; returns those rows' controllers."""
        steered = []
        for index, row in enumerate(rows):
            p = row.params
            if p.mirostat and not p.greedy:
                state = self._mirostats.get(row.seq_id)
                if state is None:
                    state = Mirostat(p.mirostat, p.mirostat_tau, p.mirostat_eta)
                    self._mirostats[row.seq_id] = state
                probs[index] = state.probabilities(logits[index] / p.temperature)
                steered.append((index, state))
        return steered

    @staticmethod
    def _observe(
        steered: list[tuple[int, Mirostat]], probs: torch.Tensor, drawn: torch.Tensor
    ) -> None:
        """Feed each mirostat row's drawn token's probability back to its controller: one
        read of the device, only in a step that has such rows."""
        if not steered:
            return
        where = _upload([index for index, _ in steered], torch.int64, probs.device)
        chosen = probs[where].gather(1, drawn[where][:, None])[:, 0].tolist()
        for (_, state), prob in zip(steered, chosen, strict=True):
            state.observe(prob)

    def verify(self, logits: torch.Tensor, row: SampleRow, drafts: Ids[int]) -> Sampled:
        """A verify chunk's tokens: logits [1 + k, vocab] of its rows (after its last
        token, then after each of the k drafts) -> the accepted drafts and one token more
        (verify.py), with each one's logprobs where the request asks.

        Row i is judged as plain decoding would sample it had it emitted drafts 0..i-1:
        processed (grammar, logit_bias, min_tokens, penalties) for the output so far plus
        those drafts. Greedy rows compare with the processed argmax; random rows
        rejection-sample the processed distributions with the request's generator (its
        own when seeded). Logprobs are the target's at each emitted position, the
        corrected token's too. Reads the device once, twice with logprobs."""
        positions = verify_rows(row, drafts)  # [1 + k] rows: the output grows by a draft
        processed = self._process_verify(logits, positions, drafts)
        probs: torch.Tensor | None = None
        if row.params.greedy:
            tokens = accept_greedy(drafts, processed.argmax(dim=-1).tolist())
        else:
            params = [row.params] * logits.shape[0]
            probs = distributions(processed, params, self.sort_top_p)[0]  # [1 + k, vocab]
            seeded = row.params.seed is not None
            generator = self._generator(row.seq_id, row.params) if seeded else self._shared
            tokens = rejection_sample(probs, drafts, None, generator)
        if row.params.logprobs is None:
            return Sampled(tokens, [None] * len(tokens))
        n = len(tokens)  # emitted token j was made at row j
        emitted = _upload(tokens, torch.int64, logits.device)
        kept = None if probs is None else probs[:n]
        table = logprob_table(logits[:n], processed[:n], kept, emitted, positions[:n])
        return read_logprobs(table.tolist(), positions[:n])

    def _process_verify(
        self, logits: torch.Tensor, rows: list[SampleRow], drafts: Ids[int]
    ) -> torch.Tensor:
        """process_logits for a verify chunk's rows [1 + k, vocab] (verify_rows): the
        grammar's mask at each row comes from the matcher advanced over the drafts before
        it (and rolled back), the rest as in a plain step."""
        if not any(r.processed for r in rows):
            return logits
        logits = logits.clone()  # [1 + k, vocab]: the raw ones stay for raw logprobs
        if rows[0].params.structured is not None:
            if self.grammar is None:
                raise ValueError("a structured output needs the engine's grammar masks")
            self.grammar.apply_drafts(logits, rows[0], drafts)
        return after_the_grammar(logits, rows)

    @staticmethod
    def probabilities(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
        """[vocab] logits -> [vocab] probabilities after temperature and the cuts: one row
        of what `sample` draws from (logits already processed)."""
        if params.greedy:
            return torch.nn.functional.one_hot(logits.argmax(), logits.shape[-1]).float()
        return distributions(logits[None], [params])[0][0]

    def _uniforms(self, rows: list[SampleRow], device: torch.device) -> torch.Tensor:
        """One uniform [rows] float64 per row: a seeded row's from its own generator (so
        its draw depends on nothing else in the batch), the others' from the shared one in
        one call. Greedy rows take one too (unused): the shared stream's use does not
        depend on which rows are greedy."""
        u = uniforms(len(rows), self._shared, device)
        for index, row in enumerate(rows):
            if row.params.seed is not None and not row.params.greedy:
                # One small launch per seeded row, but no sync: the row's generator
                # advances on the device like the row's tokens do.
                u[index] = uniforms(1, self._generator(row.seq_id, row.params), device)[0]
        return u

    def _generator(self, seq_id: int, params: SamplingParams) -> torch.Generator:
        gen = self._generators.get(seq_id)
        if gen is None:
            gen = torch.Generator(device=self.device)
            if params.seed is None:
                gen.seed()
            else:
                gen.manual_seed(params.seed)
            self._generators[seq_id] = gen
        return gen

    def forget(self, seq_id: int) -> None:
        """Drop a finished request's generator and mirostat state."""
        self._generators.pop(seq_id, None)
        self._mirostats.pop(seq_id, None)


def distributions(
    logits: torch.Tensor, params: list[SamplingParams], sort_top_p: bool | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Processed logits [rows, vocab] -> what each row draws from [rows, vocab] (after
    temperature and the cuts, batch_probabilities), and the rows' temperatures [rows]
    (0 marks a greedy row, whose draw the argmax replaces)."""
    temperature, top_k, top_p, min_p = _settings(params, logits.device)
    probs = batch_probabilities(
        logits,
        temperature,
        top_k,
        top_p,
        min_p=min_p,
        cuts=_cuts(params, logits.shape[-1]),
        sort_top_p=sort_top_p,
        more=MoreCuts.of(params, logits.device),
    )
    return probs, temperature


def _settings(
    params: list[SamplingParams], device: torch.device
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Per-row temperature (0 for greedy rows), top_k, top_p and min_p (None when no row
    has one) as [rows] tensors on `device`."""
    # Greedy rows (temperatures below GREEDY_BELOW too) travel as 0: the mark that picks
    # their argmax, and no division by a tiny temperature.
    temperature = [0.0 if p.greedy else p.temperature for p in params]
    min_p = [0.0 if p.greedy else p.min_p for p in params]
    return (
        _upload(temperature, torch.float32, device),
        _upload([p.top_k for p in params], torch.int64, device),
        _upload([p.top_p for p in params], torch.float32, device),
        _upload(min_p, torch.float32, device) if any(min_p) else None,
    )


def after_the_grammar(logits: torch.Tensor, rows: list[SampleRow]) -> torch.Tensor:
    """The processors after a step's grammar mask, in vLLM's order, on logits already
    copied: the other masks (nothing may favour a token they leave out), then logit_bias,
    min_tokens, the repetition, presence and frequency penalties, and DRY (after them, as
    in llama.cpp's chain)."""
    keep_allowed(logits, rows)
    bar_bad_words(logits, rows)
    add_logit_bias(logits, rows)
    mask_end_tokens(logits, rows)
    logits = penalize(logits, rows)
    subtract_dry(logits, rows)
    return logits


def keep_allowed(logits: torch.Tensor, rows: list[SampleRow]) -> None:
    """vLLM's allowed_token_ids: every other token of such a row gets -inf, in place."""
    for index, row in enumerate(rows):
        allowed = [t for t in row.params.allowed_token_ids if 0 <= t < logits.shape[-1]]
        if allowed:
            kept = logits[index, allowed].clone()  # [allowed]
            logits[index] = -math.inf
            logits[index, allowed] = kept


def bar_bad_words(logits: torch.Tensor, rows: list[SampleRow]) -> None:
    """vLLM's bad_words: the token that would complete a barred sequence gets -inf, in
    place (a one-token word always; a longer one where the output ends with its start)."""
    for index, row in enumerate(rows):
        output = row.output_ids
        for word in row.params.bad_words:
            *start, last = word
            if len(output) < len(start) or not 0 <= last < logits.shape[-1]:
                continue
            if not start or list(output[-len(start) :]) == start:
                logits[index, last] = -math.inf


def add_logit_bias(logits: torch.Tensor, rows: list[SampleRow]) -> None:
    """Add each row's logit_bias to its logits [rows, vocab], in place, in one scatter."""
    vocab = logits.shape[-1]
    entries = [
        (index, token, bias)
        for index, row in enumerate(rows)
        for token, bias in row.params.logit_bias
        if 0 <= token < vocab
    ]
    _add_at(logits, entries)


def _add_at(logits: torch.Tensor, entries: list[tuple[int, int, float]]) -> None:
    """Add each (row, token, amount) to logits [rows, vocab], in place, in one scatter."""
    if not entries:
        return
    index, tokens, amounts = zip(*entries, strict=True)
    device = logits.device
    logits.index_put_(
        (_upload(list(index), torch.int64, device), _upload(list(tokens), torch.int64, device)),
        _upload(list(amounts), logits.dtype, device),
        accumulate=True,
    )


def mask_end_tokens(logits: torch.Tensor, rows: list[SampleRow]) -> None:
    """min_tokens: rows with fewer outputs than that cannot end yet, so their end tokens
    and stop token ids get -inf, in place (vLLM's MinTokensLogitsProcessor)."""
    vocab = logits.shape[-1]
    entries = [
        (index, token)
        for index, row in enumerate(rows)
        if row.masks_end
        for token in sorted(row.end_token_ids | set(row.params.stop_token_ids))
        if 0 <= token < vocab
    ]
    if not entries:
        return
    index, tokens = zip(*entries, strict=True)
    device = logits.device
    where = (_upload(list(index), torch.int64, device), _upload(list(tokens), torch.int64, device))
    # A fill on the device, not a host scalar copied there (that copy would wait).
    logits.index_put_(where, logits.new_full((len(index),), float("-inf")))


def penalize(logits: torch.Tensor, rows: list[SampleRow]) -> torch.Tensor:
    """The penalized rows' logits after their penalties (penalties.py), the others as
    they are. Only the rows that have a penalty pass their ids."""
    chosen = [index for index, row in enumerate(rows) if row.penalized]
    if not chosen:
        return logits
    picked = [rows[i] for i in chosen]
    device = logits.device
    # The prompt counts only for repetition: others skip its (possibly long) ids.
    prompts = [
        row.token_ids[: row.output_start] if row.params.repetition_penalty != 1 else ()
        for row in picked
    ]
    params = [row.params for row in picked]
    every = len(chosen) == len(rows)
    where = _upload(chosen, torch.int64, device)
    # Every row penalised: in place (process_logits' copy); else on a copy of those rows.
    penalized = apply_penalties(
        logits if every else logits[where],
        prompts,
        [row.output_ids for row in picked],
        _upload([p.presence_penalty for p in params], torch.float32, device),
        _upload([p.frequency_penalty for p in params], torch.float32, device),
        _upload([p.repetition_penalty for p in params], torch.float32, device),
    )
    return logits if every else logits.index_copy_(0, where, penalized)


def subtract_dry(logits: torch.Tensor, rows: list[SampleRow]) -> None:
    """DRY's penalties (dry.py) off each DRY row's logits, in place, in one scatter. Its
    window is the row's whole context, prompt and output."""
    vocab = logits.shape[-1]
    entries = [
        (index, token, -penalty)
        for index, row in enumerate(rows)
        if row.params.dry.on
        for token, penalty in dry_penalties(row.params.dry, row.token_ids, row.dry_breakers).items()
        if 0 <= token < vocab
    ]
    _add_at(logits, entries)


def logprob_table(
    raw: torch.Tensor,
    processed: torch.Tensor,
    probs: torch.Tensor | None,
    tokens: torch.Tensor,
    rows: list[SampleRow],
) -> torch.Tensor:
    """The step's tokens and logprobs packed in one float64 tensor, to read in one sync:
    the [rows] token ids, then, for the rows that ask (in order), token_table's rows
    [asking, 3 + 2k] flattened (k: the largest number of top logprobs asked).

    A row's distribution is the model's raw one, or with processed_logprobs the one it was
    drawn from: after processing, and for random rows after temperature and the cuts
    (cut tokens at -inf), as vLLM's processed_logprobs mode. Only the asking rows pay for
    the log-softmax."""
    asking = [row for row in rows if row.params.logprobs is not None]
    where = _upload(
        [i for i, row in enumerate(rows) if row.params.logprobs is not None],
        torch.int64,
        raw.device,
    )
    logprobs = raw.index_select(0, where).float().log_softmax(-1)  # [asking, vocab]
    wants = [row.params.processed_logprobs for row in asking]
    if any(wants):
        done = processed.index_select(0, where).float().log_softmax(-1)
        if probs is not None:
            random = _upload([not row.params.greedy for row in asking], torch.bool, raw.device)
            done = torch.where(random[:, None], probs.index_select(0, where).log(), done)
        logprobs = torch.where(_upload(wants, torch.bool, raw.device)[:, None], done, logprobs)
    k = max(row.params.logprobs or 0 for row in asking)
    table = token_table(logprobs, tokens.index_select(0, where), k)
    return torch.cat([tokens.double(), table.flatten()])


def token_table(logprobs: torch.Tensor, tokens: torch.Tensor, k: int) -> torch.Tensor:
    """logprobs [rows, vocab] and a token per row [rows] -> [rows, 3 + 2k] float64: per
    row the token, its logprob, its rank, the top k ids, their logprobs (one read)."""
    chosen = logprobs.gather(1, tokens[:, None])  # [rows, 1]
    rank = (logprobs > chosen).sum(-1, keepdim=True) + 1
    top = logprobs.topk(k, dim=-1)  # [rows, k] each
    parts = (tokens[:, None], chosen, rank, top.indices, top.values)
    return torch.cat([part.double() for part in parts], dim=1)


def table_entry(values: list[float], asked: int) -> TokenLogprobs:
    """One row of token_table, read to the host, with its `asked` top entries."""
    k = (len(values) - 3) // 2
    ids, lps = values[3 : 3 + asked], values[3 + k : 3 + k + asked]
    top = tuple((int(i), lp) for i, lp in zip(ids, lps, strict=True))
    return TokenLogprobs(int(values[0]), values[1], int(values[2]), top)


def read_logprobs(packed: list[float], rows: list[SampleRow]) -> Sampled:
    """A Sampled from logprob_table's values, read to the host."""
    tokens = [int(value) for value in packed[: len(rows)]]
    asking = sum(row.params.logprobs is not None for row in rows)
    width = (len(packed) - len(rows)) // max(asking, 1)
    entries = iter(range(len(rows), len(packed), max(width, 1)))
    logprobs: list[TokenLogprobs | None] = []
    for row in rows:
        if row.params.logprobs is None:
            logprobs.append(None)
            continue
        start = next(entries)
        logprobs.append(table_entry(packed[start : start + width], row.params.logprobs))
    return Sampled(tokens, logprobs)


def _cuts(params: Iterable[SamplingParams], vocab: int) -> tuple[int, bool]:
    """What the batch's rows cut, known on the host without reading the device: the
    largest top-k that cuts anything (0: none does), and whether any row has top-p."""
    sampled = [p for p in params if not p.greedy]
    top_k = max((p.top_k for p in sampled if 0 < p.top_k < vocab), default=0)
    return top_k, any(p.top_p < 1.0 for p in sampled)


def batch_probabilities(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    *,
    min_p: torch.Tensor | None = None,
    cuts: tuple[int, bool],
    sort_top_p: bool | None = None,
    more: MoreCuts | None = None,
) -> torch.Tensor:
    """[rows, vocab] logits -> probabilities, each row after its own temperature [rows]
    (0, a greedy row, counts as 1), min_p [rows] (0: no cut; None: no row has one), top_k
    [rows] (0 or >= vocab: no cut) and top_p [rows] (1: no cut), in vLLM's order, and
    llama.cpp's cuts where `more` has them (cuts.py says where each falls). `cuts` (from
    _cuts) lets a batch skip the sort or the top-k it does not need. A row's result
    depends on nothing else in the batch, whatever the others cut. sort_top_p: top-p's cut
    by a sort of each row (top_p_by_sort) rather than nucleus(); None: on CUDA only."""
    max_k, any_top_p = cuts
    vocab = logits.shape[-1]
    more = more or MoreCuts()
    # A dynamic temperature comes last (_after_top_p): its rows are cut at temperature 1.
    heated = temperature > 0
    if more.dynatemp_range is not None:
        heated &= more.dynatemp_range <= 0
    logits = logits / torch.where(heated, temperature, 1.0)[:, None]
    if more.top_n_sigma is not None:
        logits = top_n_sigma(logits, more.top_n_sigma)
    if min_p is not None:
        # vLLM's: drop tokens less likely than min_p times the likeliest, after temperature.
        probs = logits.softmax(-1)
        floor = min_p[:, None] * probs.amax(-1, keepdim=True)
        logits = logits.masked_fill(probs < floor, float("-inf"))
    # Rows without a top-k keep everything: their threshold is -inf.
    has_k = (top_k > 0) & (top_k < vocab)
    kth_index = (top_k.clamp(1, max(max_k, 1)) - 1)[:, None]
    if sort_top_p is None:
        sort_top_p = logits.device.type == "cuda"
    if any_top_p and sort_top_p and more.typical_rows is None:
        return _after_top_p(
            top_p_by_sort(logits, (has_k, kth_index, max_k), top_p), more, temperature
        )
    if max_k:
        # The largest max_k values suffice for the k-th, not a sort of the vocabulary.
        kth = torch.topk(logits, max_k).values.gather(1, kth_index)
        kth = torch.where(has_k[:, None], kth, float("-inf"))
        # Ties with the k-th value stay, like torch.topk's threshold always kept them.
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if more.typical_rows is not None:
        assert more.typical_p is not None  # made together (MoreCuts.of)
        logits = typical(logits, more.typical_rows, more.typical_p, by_sort=sort_top_p)
    if not any_top_p:
        return _after_top_p(logits.softmax(-1), more, temperature)
    if sort_top_p:  # top-k done above: the sort cuts top-p alone
        no_k = (torch.zeros_like(has_k), kth_index, 0)
        return _after_top_p(top_p_by_sort(logits, no_k, top_p), more, temperature)
    keep = nucleus(logits.softmax(-1), top_p)
    return _after_top_p(logits.masked_fill(~keep, float("-inf")).softmax(-1), more, temperature)


def _after_top_p(probs: torch.Tensor, more: MoreCuts, temperature: torch.Tensor) -> torch.Tensor:
    """What follows top-p and min-p in llama.cpp's chain, on probabilities: XTC, then a
    dynamic temperature on each of XTC's outcomes (its entropy differs between them)."""

    def heated(p: torch.Tensor) -> torch.Tensor:
        if more.dynatemp_range is None:
            return p
        assert more.dynatemp_exponent is not None  # made together (MoreCuts.of)
        return dynamic_temperature(p, temperature, more.dynatemp_range, more.dynatemp_exponent)

    if more.xtc_probability is None:
        return heated(probs)
    assert more.xtc_threshold is not None  # made together (MoreCuts.of)
    chance, excluded = xtc_branch(probs, more.xtc_probability, more.xtc_threshold)
    return (1 - chance[:, None]) * heated(probs) + chance[:, None] * heated(excluded)


def top_p_by_sort(
    logits: torch.Tensor, top_k: tuple[torch.Tensor, torch.Tensor, int], top_p: torch.Tensor
) -> torch.Tensor:
    """Top-k (has_k [rows], kth_index [rows, 1], max_k, as batch_probabilities makes them)
    then top-p through one sort of each row: a GPU's choice (its sort is fast, and
    nucleus() would read the device mid-step)."""
    has_k, kth_index, max_k = top_k
    # Stable: equal logits keep their vocabulary order, so which of them a top-p cut
    # drops never depends on the sort algorithm a batch shape picks (~10% slower on CPU).
    sorted_logits, order = torch.sort(logits, descending=True, stable=True)
    if max_k:
        kth = torch.where(has_k[:, None], sorted_logits.gather(1, kth_index), float("-inf"))
        # Sorted, the cut entries are the tail: masking them keeps the order descending.
        sorted_logits = sorted_logits.masked_fill(sorted_logits < kth, float("-inf"))
    sorted_probs = sorted_logits.softmax(-1)
    # Drop a token once the ones before it already reach top_p (the first always stays).
    # Rows with top_p 1 drop nothing, even where rounding lifts the sum past 1.
    before = sorted_probs.cumsum(-1) - sorted_probs
    drop = (before >= top_p[:, None]) & (top_p < 1.0)[:, None]
    logits = logits.scatter(1, order, sorted_logits.masked_fill(drop, float("-inf")))
    return logits.softmax(-1)


def nucleus(probs: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Which tokens of each row [rows, vocab] top_p [rows] keeps (bool [rows, vocab]): the
    likeliest, in order, until the ones before a token reach top_p (the first always
    stays; top_p 1 keeps all), equal probabilities taken in vocabulary order, as a stable
    sort would list them. Found from the row's largest K probabilities, K growing until
    they reach top_p (64, then 1024, 16384, all), not a sort of the vocabulary: a stable
    sort of 49k entries is ~4 ms a row on a CPU thread. Reads the device (CPU only)."""
    vocab = probs.shape[-1]
    cuts = top_p < 1.0
    k = 64
    while True:
        k = min(k, vocab)
        largest = torch.topk(probs, k).values  # [rows, k], descending
        if k == vocab or bool(((largest.sum(-1) >= top_p) | ~cuts).all()):
            break
        k *= 16
    before = largest.cumsum(-1) - largest
    # [rows, 1]: at least 1 (a row of NaN, all its logits cut, keeps its first)
    kept = (before < top_p[:, None]).sum(-1, keepdim=True).clamp_(min=1)
    last = largest.gather(1, kept - 1)  # the smallest kept probability
    above = probs > last
    ties = probs == last
    room = kept - above.sum(-1, keepdim=True)  # how many of the ties stay
    keep = above | ties
    if bool((room < ties.sum(-1, keepdim=True)).any()):  # a cut through equal values
        keep = above | (ties & (ties.cumsum(-1) <= room))
    return keep | ~cuts[:, None]


def _upload(values: list, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A small host list as a tensor on `device`. To CUDA through pinned memory without
    blocking: a pageable copy would wait for every kernel queued before it."""
    if device.type != "cuda":
        return torch.tensor(values, dtype=dtype, device=device)
    return torch.tensor(values, dtype=dtype, pin_memory=True).to(device, non_blocking=True)
