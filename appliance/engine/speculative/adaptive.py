"""How many drafts each sequence proposes, from its own measured acceptance. Torch-free.

The cost model. A decode step that reads the weights once makes one token per sequence;
a verify step of k drafts runs k + 1 rows for that sequence. While decode is bandwidth
bound (small batches) a row more costs a fraction of a step: a verify step costs
1 + c * k decode steps, c being `verify_token_cost`. If each draft is kept with
probability a, independently, until the first miss (the geometric model), a verify step
of k drafts makes on average

    E(a, k) = 1 + a + a^2 + ... + a^k = (1 - a^(k + 1)) / (1 - a)

tokens, so it pays when gain(a, k) = E(a, k) / (1 + c * k) > 1. At k = 1 that is a > c;
and where it does not pay at k = 1 it pays at no larger k (each row more adds a^k < c
tokens for c more cost).

The batch. `verify_token_cost` is c at batch 1. A step of n rows costs about t0 + s * n
(t0: reading and unpacking the weights and the step's fixed work; s: a row's own work),
so at a batch of B sequences a draft's row costs s against each sequence's share of the
step, (t0 + s * B) / B; with c1 = s / (t0 + s) that is

    c(B) = B * c1 / (B * c1 + 1 - c1)

which grows towards 1: on a compute-bound batch a row more costs a whole sequence's
share, and a draft must be kept nearly always to pay. (With every sequence drafting k,
the batch makes B * E(a, k) tokens in t0 + s * B * (1 + k): E(a, k) / (1 + c(B) * k)
of plain decoding's rate, the gain above at c(B).) The scheduler passes each verify
step's batch with its result (DraftLength.record), so a sequence pauses where the batch
makes its drafts a loss and probes again at its pause's end.

The estimate. Of a verify step's drafts, the kept ones say "kept" and a rejection, if
any, says "missed" once; the drafts after a rejection were never tested. Under the
geometric model the maximum-likelihood acceptance is kept / (kept + missed). Both counts
decay by DECAY at each verify step, so the estimate follows the last handful of steps
(a sequence that copies a passage, then writes its own words, changes its mind).

The rule, per sequence (DraftLength):
  - k starts at the range's top (num_speculative_tokens), halves after a draft the target
    rejected from its first token, doubles after a draft it kept whole (one as long as k);
    it never leaves [k_min, k_max];
  - after MIN_EVIDENCE verify steps, when gain(a, k_min) <= 1 the sequence pauses: it
    proposes nothing for `backoff` steps (8, doubling at each pause in a row up to 256,
    back to 8 once speculation paid again), then probes again at k_min with its counts
    forgotten.
"""

from __future__ import annotations

from dataclasses import dataclass

DECAY = 0.8  # weight of the older evidence at each verify step: about the last 5 steps
MIN_EVIDENCE = 4  # verify steps before a sequence may be paused
FIRST_BACKOFF = 8  # steps a sequence proposes nothing after its first pause
MAX_BACKOFF = 256


def expected_tokens(acceptance: float, k: int) -> float:
    """Tokens a verify step of k drafts makes on average, each draft kept with probability
    `acceptance` until the first miss (the accepted drafts plus the target's own token)."""
    return sum(acceptance**i for i in range(k + 1))


def gain(acceptance: float, k: int, verify_token_cost: float) -> float:
    """Tokens per decode-step's cost of a verify step of k drafts, against plain decoding's
    one token per step: above 1, speculating pays."""
    return expected_tokens(acceptance, k) / (1 + verify_token_cost * k)


def batch_cost(verify_token_cost: float, batch: int) -> float:
    """c(B): what a draft's row costs against a sequence's share of a step of `batch`
    sequences, from its cost at batch 1 (see the module's docstring)."""
    scaled = max(1, batch) * verify_token_cost
    rest = 1 - verify_token_cost
    return scaled / (scaled + rest) if scaled + rest > 0 else 1.0


@dataclass(frozen=True)
class AdaptivePolicy:
    """The settings of the per-sequence rule (see the module's docstring), shared by every
    sequence's DraftLength: nothing of a step is kept here (its batch comes with each
    verify result)."""

    verify_token_cost: float = 0.1

    def __post_init__(self) -> None:
        if not 0 <= self.verify_token_cost <= 1:
            raise ValueError(f"verify_token_cost must be in [0, 1], got {self.verify_token_cost}")

    def cost(self, batch: int) -> float:
        """A draft's row's cost in a step of `batch` sequences, in sequence-steps (c(B))."""
        return batch_cost(self.verify_token_cost, batch)


@dataclass
class DraftLength:
    """One sequence's draft length and what its verify steps have shown so far.

    `policy` None: a fixed k (k_max every step, never paused)."""

    k_min: int
    k_max: int
    policy: AdaptivePolicy | None = None
    k: int = 0  # the next draft's length (k_max to start)
    kept: float = 0.0  # decayed count of drafts kept
    missed: float = 0.0  # decayed count of verify steps that ended in a rejection
    verifies: int = 0  # verify steps since the last (re)start
    paused_for: int = 0  # steps left without proposing
    backoff: int = FIRST_BACKOFF  # the next pause's length

    def __post_init__(self) -> None:
        if not 1 <= self.k_min <= self.k_max:
            raise ValueError(
                f"the draft range needs 1 <= min <= max, got {self.k_min}, {self.k_max}"
            )
        self.k = self.k or self.k_max

    @property
    def acceptance(self) -> float:
        """The estimated chance that a draft is kept (1 before any miss)."""
        tested = self.kept + self.missed
        return self.kept / tested if tested else 1.0

    def next_k(self) -> int:
        """How many drafts to propose this step (0 while paused: each call is a step)."""
        if self.paused_for > 0:
            self.paused_for -= 1
            if self.paused_for == 0:
                self._restart()
            return 0
        return self.k

    def record(self, drafted: int, accepted: int, batch: int) -> None:
        """A verify step: `drafted` drafts, of which the first `accepted` were kept, in a
        step of `batch` sequences (the batch its rows' cost is weighed against)."""
        if not 0 <= accepted <= drafted:
            raise ValueError(f"{accepted} drafts kept of {drafted}")
        if self.policy is None:
            return
        self.kept = self.kept * DECAY + accepted
        self.missed = self.missed * DECAY + (accepted < drafted)
        self.verifies += 1
        if accepted == 0:
            self.k = max(self.k_min, self.k // 2)
        elif accepted == drafted == self.k:
            self.k = min(self.k_max, self.k * 2)
        if self.verifies < MIN_EVIDENCE:
            return
        if gain(self.acceptance, self.k_min, self.policy.cost(batch)) <= 1:
            self.paused_for = self.backoff
            self.backoff = min(MAX_BACKOFF, self.backoff * 2)
        else:
            self.backoff = FIRST_BACKOFF

    def _restart(self) -> None:
        """After a pause: probe at the range's bottom, the old evidence forgotten."""
        self.k = self.k_min
        self.kept = self.missed = 0.0
        self.verifies = 0
