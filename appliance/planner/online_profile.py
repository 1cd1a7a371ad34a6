"""The profile a serving box refines from the steps its workers actually run.

Each worker reports every model step's shape and time (engine/step_timing.py's StepTiming:
its prompt tokens, sequences, attended pairs and decode context, and the seconds around
the model runner). The supervisor records them here under the worker's size
(profile.worker_unit); per size and kind of step the last `WINDOW` are kept, and the
step-cost model `appliance profile` fits (fitting.fit_step_cost, with the features
profiler._worker_cost uses per kind) is fitted to them on demand, as traffic comes.

A kind is fitted once its window holds `MIN_SAMPLES` steps and each of its features takes
at least two values, the largest at least `MIN_SPREAD` times the smallest (with less, a
coefficient cannot be told from the base). Where a CPU worker's quantized products switch
from the integer kernel to a GEMM at its prefill_gemm_rows (each step says the count and
its prompt tokens), and the window holds steps on both sides (`MIN_REGIME` each, of two
or more sizes), a kind's tokens get a line per side (StepCost.gemm_rows): the GEMM's
dequantizing is a cost per step, and the integer kernel's per token is several times the
GEMM's, a cliff one line cannot follow. Until then it takes the base profile's cost
for that kind, else, for prefill and decode, the mixed fit (one model over every step of
the size, as the profiler's mixed is); a size with none of those has no cost (None).

A worker that speculates runs verify steps: each sequence's decode row plus its drafts'
rows (StepTiming.draft_rows). Where a kind's window holds steps with different numbers
of draft rows (plain steps among them), the fit gives draft rows a cost of their own
(StepCost.per_draft_s), which planner/speculation.py charges each draft it simulates;
until then a draft row costs a query token's (StepCost.draft_s).

Pure (no torch): the planner imports it, and so does the supervisor.
"""

from __future__ import annotations

import threading
from collections import Counter, deque
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import TYPE_CHECKING, Protocol

from appliance.engine.step_timing import StepTiming
from appliance.planner.analytic_specs import Efficiency
from appliance.planner.fitting import both_regimes, fit_step_cost, in_regimes
from appliance.planner.profile import (
    HandoffCost,
    HostCost,
    Profile,
    ProfileKey,
    StepCost,
    WorkerCost,
    worker_unit,
)

if TYPE_CHECKING:
    from appliance.settings.config import Settings
    from appliance.topology.devices import Topology


class SizedWorker(Protocol):
    """What the online profile reads of a worker (the pools' WorkerHandle has it)."""

    @property
    def cores(self) -> tuple[int, ...]: ...
    @property
    def devices(self) -> tuple[int, ...]: ...
    @property
    def loaded(self) -> bool: ...
    @property
    def num_blocks(self) -> int: ...


WINDOW = 2000  # steps kept per worker size and kind: the newest, so the fit follows the box
MIN_SAMPLES = 30  # steps of a kind before it is fitted
MIN_SPREAD = 1.5  # each feature's largest value over its smallest, at least
OUTLIER = 0.5  # a step this far (relative) off the first fit is left out of the second
MIN_REGIME = 5  # steps on each side of the kernel switch before each gets a line of its own
KINDS = ("prefill", "decode", "mixed")
FEATURES = MappingProxyType(
    {  # as profiler._worker_cost fits them: a decode step's tokens are its sequences
        "prefill": ("tokens", "seqs", "attended"),
        "decode": ("seqs", "context"),
        "mixed": ("tokens", "seqs", "attended", "context"),
    }
)
# What a box's own steps do not show, where no base profile says: the analytic profiles'
# Efficiency defaults (host costs a step and a streamed token; a handoff's control
# messages), and a copy at memory (CPU) or PCIe (GPU) speed.
HOST = HostCost(
    per_step_s=Efficiency().host_step_us / 1e6, per_token_s=Efficiency().host_token_us / 1e6
)
HANDOFF_BASE_S = Efficiency().handoff_base_us / 1e6
COPY_BYTES_PER_S = {"cpu": 5e9, "cuda": 20e9}


class OnlineProfile:
    """Recent timed steps per worker size and kind; their fitted costs. Thread-safe: the
    supervisor records on its loop, a planner may read from another thread."""

    def __init__(self, window: int = WINDOW, min_samples: int = MIN_SAMPLES) -> None:
        self.window = window
        self.min_samples = min_samples
        self._steps: dict[tuple[str, str], deque[StepTiming]] = {}
        self._recorded: Counter[str] = Counter()  # steps ever recorded, per size
        self._fits: dict[str, tuple[int, dict[str, StepCost | None]]] = {}  # by count
        self._lock = threading.Lock()

    def record(self, unit: str, timing: StepTiming | None) -> None:
        """One step a worker of size `unit` ran (an append: per step, on the loop); None,
        a step not timed, is left out."""
        if timing is None or timing.seconds <= 0:
            return
        with self._lock:
            steps = self._steps.get((unit, timing.kind))
            if steps is None:
                steps = self._steps[(unit, timing.kind)] = deque(maxlen=self.window)
            steps.append(timing)
            self._recorded[unit] += 1

    def units(self) -> list[str]:
        """The worker sizes with steps recorded."""
        with self._lock:
            return sorted(self._recorded)

    def steps(self, unit: str, kind: str) -> list[StepTiming]:
        """The steps of `kind` kept for `unit`, oldest first."""
        with self._lock:
            return list(self._steps.get((unit, kind), ()))

    def counts(self, unit: str) -> dict[str, int]:
        """Steps kept per kind for `unit`."""
        with self._lock:
            return {kind: len(self._steps.get((unit, kind), ())) for kind in KINDS}

    def step_costs(self, unit: str) -> dict[str, StepCost | None]:
        """Each kind's fit for `unit` (None: too few steps, or too little spread); refitted
        only after new steps came."""
        with self._lock:
            count = self._recorded[unit]
            cached = self._fits.get(unit)
            if cached is not None and cached[0] == count:
                return cached[1]
            kept = {kind: list(self._steps.get((unit, kind), ())) for kind in KINDS}
        every = kept["prefill"] + kept["decode"] + kept["mixed"]
        fits = {
            "prefill": self._fit(kept["prefill"], FEATURES["prefill"]),
            "decode": self._fit(kept["decode"], FEATURES["decode"]),
            "mixed": self._fit(every, FEATURES["mixed"]),  # over every step, as profiled
        }
        with self._lock:
            self._fits[unit] = (count, fits)
        return fits

    def _fit(self, steps: list[StepTiming], features: tuple[str, ...]) -> StepCost | None:
        if len(steps) < self.min_samples or not all(_spread(steps, f) for f in features):
            return None
        gemm_rows = _regimes(steps) if "tokens" in features else None
        if gemm_rows is not None:  # both sides of the kernel switch seen: two lines
            steps = [s for s in steps if s.gemm_rows == gemm_rows]
            features = in_regimes(features)
        if _spread(steps, "draft_rows"):  # verify steps among them: a draft row's own cost
            features = (*features, "draft_rows")
        samples = [s.features() for s in steps]
        cost = fit_step_cost(samples, features, gemm_rows)
        # Once more without the steps the first fit is far off (a pause, a noisy neighbour).
        kept = [s for s in samples if abs(_predict(cost, s) / s["seconds"] - 1) <= OUTLIER]
        if len(kept) < len(samples) and len(kept) >= max(self.min_samples, len(samples) // 2):
            cost = fit_step_cost(kept, features, gemm_rows)
        return cost

    def worker_cost(
        self, unit: str, kv_blocks: int | None = None, base: WorkerCost | None = None
    ) -> WorkerCost | None:
        """The cost of a worker of size `unit` from its steps, each kind not fitted yet
        taken from `base` (else the mixed fit); None where a kind has neither, or no KV
        pool size is known (`kv_blocks`, else the base's)."""
        fits = self.step_costs(unit)
        costs: dict[str, StepCost] = {}
        for kind in KINDS:
            fallback = getattr(base, kind) if base is not None else fits["mixed"]
            cost = fits[kind] if fits[kind] is not None else fallback
            if cost is None:
                return None
            costs[kind] = cost
        blocks = kv_blocks or (base.kv_blocks if base is not None else None)
        if blocks is None:
            return None
        # The steps were timed as the box served: what the other devices cost them then is
        # in their times already.
        return WorkerCost(**costs, kv_blocks=blocks, contention=1.0)

    def profile(self, base: Profile, kv_blocks: Mapping[str, int] | None = None) -> Profile:
        """`base` with each worker size these steps fit replacing (or joining) its own."""
        workers = dict(base.workers)
        refined = []
        for unit in self.units():
            blocks = (kv_blocks or {}).get(unit)
            cost = self.worker_cost(unit, blocks, base.workers.get(unit))
            if cost is not None and cost != base.workers.get(unit):
                workers[unit] = cost
                refined.append(unit)
        if not refined:
            return base
        notes = (*base.assumptions, *self._notes(refined))
        return base.model_copy(update={"workers": workers, "assumptions": notes})

    def standalone(self, facts: BoxFacts, kv_blocks: Mapping[str, int]) -> Profile | None:
        """A profile of these steps alone, the rest from `facts`; None until a size fits."""
        workers = {}
        for unit in self.units():
            cost = self.worker_cost(unit, kv_blocks.get(unit))
            if cost is not None:
                workers[unit] = cost
        if not workers:
            return None
        return Profile(
            key=facts.key,
            atoms=facts.atoms,
            block_size=facts.block_size,
            kv_bytes_per_token=facts.kv_bytes_per_token,
            max_model_len=facts.max_model_len,
            workers=workers,
            handoff=facts.handoff,
            host=facts.host,
            assumptions=(*facts.assumptions, *self._notes(sorted(workers))),
        )

    def _notes(self, units: list[str]) -> list[str]:
        notes = []
        for unit in units:
            counts = self.counts(unit)
            fits = self.step_costs(unit)
            fitted = [k for k in KINDS if fits[k] is not None]
            shown = ", ".join(f"{counts[k]} {k}" for k in KINDS)
            notes.append(
                f"online {unit}: fitted from the last steps its workers ran ({shown}); "
                f"fitted kinds: {', '.join(fitted) or 'none'} (the others from the base "
                "profile, else the mixed fit); contention 1.0: the steps were timed under "
                "the box's own load"
            )
        return notes


def _spread(steps: list[StepTiming], feature: str) -> bool:
    values = {getattr(s, feature) for s in steps}
    return len(values) >= 2 and max(values) >= MIN_SPREAD * min(values)


def _regimes(steps: list[StepTiming]) -> int | None:
    """The newest step's gemm_rows where the steps run under it show both kernel regimes,
    each with at least MIN_REGIME steps of two or more token counts (a line of its own can
    be fitted); else None: one line over all (the switch unseen, or a worker without one)."""
    gemm_rows = steps[-1].gemm_rows
    if gemm_rows is None:
        return None
    under = [(s.gemm, s.tokens) for s in steps if s.gemm_rows == gemm_rows]
    return gemm_rows if both_regimes(under, MIN_REGIME) else None


def _predict(cost: StepCost, sample: Mapping[str, float]) -> float:
    plain = cost.seconds(
        int(sample["tokens"]),
        int(sample["seqs"]),
        int(sample["attended"]),
        int(sample["context"]),
        int(sample["prompt_tokens"]),
    )
    return plain + cost.draft_s * sample["draft_rows"]


@dataclass(frozen=True)
class BoxFacts:
    """What a profile holds beside its worker costs, for one built from online steps."""

    key: ProfileKey
    atoms: int
    block_size: int
    kv_bytes_per_token: int
    max_model_len: int
    handoff: HandoffCost
    host: HostCost
    assumptions: tuple[str, ...] = ()


def worker_size(worker: SizedWorker) -> str:
    """A worker's size (profile.worker_unit): the cores of its CPU device, or one GPU (a
    GPU device has no cores; as autopilot.device_size counts), times its devices."""
    return worker_unit(len(worker.cores) or 1, len(worker.devices))


def kv_sizes(workers: Iterable[SizedWorker]) -> dict[str, int]:
    """The KV blocks of each worker size, as its loaded workers said (Ready); the smallest
    where two of a size differ."""
    sizes: dict[str, int] = {}
    for worker in workers:
        if worker.loaded and worker.num_blocks > 0:
            unit = worker_size(worker)
            sizes[unit] = min(sizes.get(unit, worker.num_blocks), worker.num_blocks)
    return sizes


def box_facts(settings: Settings, topology: Topology) -> BoxFacts:
    """The facts of this box and model no step shows: the model's shape read from its
    files (cached by the time the workers run), the rest assumed (see `assumptions`)."""
    from appliance.model.model_source import default_model_path, prepare_model
    from appliance.planner.profile import model_id

    config, _ = prepare_model(settings.model, settings.cache_dir)
    local = [d for d in topology.devices if not d.box]
    first = local[0]
    kind = first.kind
    atoms = sum(len(d.cores) or 1 for d in local) if kind == "cpu" else len(local)
    explicit = {"float32": 4, "bfloat16": 2, "float16": 2}
    # "auto" on a CPU: float32 (the quantized kernels' activations, and CPUs without bf16).
    # kv_cache_dtype, where set, is what the pool holds (auto: the activations' dtype).
    value_bytes = explicit.get(
        settings.kv_cache_dtype, explicit.get(settings.dtype, 4 if kind == "cpu" else 2)
    )
    per_token = 2 * config.num_layers * config.num_kv_heads * config.head_dim * value_bytes
    context = config.max_position_embeddings
    copy_speed = COPY_BYTES_PER_S[kind]
    return BoxFacts(
        key=ProfileKey(
            model=model_id(settings.model or default_model_path()),
            dtype=settings.dtype,
            weights=settings.weights,
            device_kind=f"{kind}: {first.name} (online)" if kind == "cuda" else "cpu (online)",
        ),
        atoms=atoms,
        block_size=settings.kv.block_size,
        kv_bytes_per_token=per_token,
        max_model_len=min(settings.batch.max_model_len or context, context),
        handoff=HandoffCost(base_s=HANDOFF_BASE_S, per_byte_s=1 / copy_speed),
        host=HOST,
        assumptions=(
            f"online: KV of {value_bytes} bytes a value (dtype {settings.dtype}, "
            f"kv_cache_dtype {settings.kv_cache_dtype})",
            f"online, not measured: a handoff {HANDOFF_BASE_S * 1e3:g} ms + bytes at "
            f"{copy_speed / 1e9:g} GB/s; host {HOST.per_step_s * 1e6:g} us a step, "
            f"{HOST.per_token_s * 1e6:g} us a streamed token",
        ),
    )
