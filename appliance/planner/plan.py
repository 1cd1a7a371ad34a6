"""`appliance plan`: every feasible layout of a box, simulated on one workload, ranked by
predicted goodput, with the highest rate at which each keeps 90% of requests within the
SLO. Pure Python (no torch): a profile, requests and the simulator.

Percentiles and goodput come from core.goodput (`summarize`, `SLO`), the code the bench
reports measured runs with, so a plan and a benchmark read the same way.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace

from appliance.core.goodput import SLO, RequestResult, Summary, summarize
from appliance.planner.layout import Layout, Pool
from appliance.planner.profile import Profile, ProfileKey
from appliance.planner.simulator import Policy, SimRequest, simulate

Simulate = Callable[[Profile, Layout, Sequence[SimRequest], Policy], list[RequestResult]]


def parse_unit(unit: str) -> tuple[int, int]:
    """(device_size, tp) of a worker unit name such as '2x1' (see profile.worker_unit)."""
    size, _, tp = unit.partition("x")
    if not (size.isdigit() and tp.isdigit()):
        raise ValueError(f"worker unit {unit!r} is not of the form '<device_size>x<tp>'")
    return int(size), int(tp)


def feasible_layouts(profile: Profile, full_only: bool = False) -> list[Layout]:
    """Every layout of a box of `profile.atoms` atoms whose workers are sizes the profile
    has: colocated N workers of TP t, and each prefill:decode split with a TP per pool.
    With `full_only`, those that use every atom (a layout that leaves some idle is
    rarely better than one that gives them to a pool)."""
    units = sorted({parse_unit(u) for u in profile.workers})
    layouts = []
    for size in sorted({s for s, _ in units}):
        devices = profile.atoms // size
        tps = sorted(t for s, t in units if s == size)
        layouts += _colocated(size, devices, tps) + _disaggregated(size, devices, tps)
    if full_only:
        layouts = [lay for lay in layouts if lay.atoms == profile.atoms]
    return layouts


def _colocated(size: int, devices: int, tps: list[int]) -> list[Layout]:
    return [
        Layout(mode="colocated", device_size=size, prefill=Pool(workers=n, tp=tp))
        for tp in tps
        for n in range(1, devices // tp + 1)
    ]


def _disaggregated(size: int, devices: int, tps: list[int]) -> list[Layout]:
    layouts = []
    for p_tp in tps:
        for d_tp in tps:
            for p in range(1, (devices - d_tp) // p_tp + 1):
                for d in range(1, (devices - p * p_tp) // d_tp + 1):
                    layouts.append(
                        Layout(
                            mode="disaggregated",
                            device_size=size,
                            prefill=Pool(workers=p, tp=p_tp),
                            decode=Pool(workers=d, tp=d_tp),
                        )
                    )
    return layouts


@dataclass(frozen=True)
class PlanSpec:
    """What to plan for, and how hard to search. The max-rate search looks at rates
    rate * 2**(k/steps) for |k| <= span*steps (bisection, then the rate where the
    attainment crosses the target, interpolated between the two rates around it)."""

    rate: float
    slo: SLO
    attainment: float = 0.9
    full_only: bool = True
    steps: int = 4
    span: int = 3
    plot_best: int = 4

    def __post_init__(self) -> None:
        if not (self.rate > 0 and math.isfinite(self.rate)):
            raise ValueError(f"the plan needs a finite positive request rate, got {self.rate}")
        if not 0 < self.attainment <= 1:
            raise ValueError(f"attainment must be in (0, 1], got {self.attainment}")
        if self.slo.ttft is None and self.slo.tpot is None and self.slo.latency is None:
            raise ValueError("the plan needs an SLO, e.g. --goodput ttft:250 tpot:100")
        if self.steps < 1 or self.span < 1:
            raise ValueError("steps and span must be at least 1")

    def grid_rate(self, k: int) -> float:
        return self.rate * 2 ** (k / self.steps)


@dataclass
class Point:
    """One simulated run of a layout at one rate."""

    rate: float
    summary: Summary
    attainment: float  # share of all requests that met the SLO


@dataclass
class LayoutPlan:
    """One layout's prediction: at the plan's rate, and the highest rate it sustains."""

    layout: Layout
    at_rate: Point
    max_rate: float  # 0.0: misses the attainment even at the lowest rate searched
    capped: bool  # still meets it at the highest rate searched: max_rate is a floor
    points: list[Point] = field(default_factory=list)  # every rate simulated, by rate
    gain: float | None = None  # max_rate over the best colocated layout's

    @property
    def label(self) -> str:
        return self.layout.label


@dataclass
class Plan:
    """The ranked layouts (best first) and what they were ranked on."""

    key: ProfileKey
    analytic: bool
    atoms: int
    workload: str
    num_requests: int
    spec: PlanSpec
    ranked: list[LayoutPlan]
    skipped: int  # layouts leaving atoms idle, not simulated (full_only)

    @property
    def best(self) -> LayoutPlan:
        return self.ranked[0]

    def best_colocated(self) -> LayoutPlan | None:
        colocated = [lp for lp in self.ranked if lp.layout.mode == "colocated"]
        return max(colocated, key=lambda lp: lp.max_rate, default=None)


def duration_of(results: Sequence[RequestResult]) -> float:
    """A simulated run's length: from time 0 to the last request's end (as the bench
    times a run from its start to its last response)."""
    ends = [r.start + (r.latency if r.ok else 0.0) for r in results]
    return max(max(ends, default=0.0), 1e-9)


def attainment_of(results: Sequence[RequestResult], slo: SLO) -> float:
    """Share of all requests (failed ones too) that met the SLO."""
    return sum(slo.met_by(r) for r in results) / len(results) if results else 0.0


def at_rate(requests: Sequence[SimRequest], base: float, rate: float) -> list[SimRequest]:
    """The same requests arriving at `rate` instead of `base`: the gaps of a Poisson
    process drawn from one seed scale by base/rate, so every rate gets the same draws."""
    scale = base / rate
    return [replace(r, arrival_s=r.arrival_s * scale) for r in requests]


class _Runner:
    """Simulates layouts at grid rates, each run once (the requests of a rate are shared
    by every layout)."""

    def __init__(
        self,
        profile: Profile,
        requests: Sequence[SimRequest],
        spec: PlanSpec,
        policy: Policy,
        simulate_fn: Simulate,
    ) -> None:
        self.profile, self.requests, self.spec = profile, requests, spec
        self.policy, self.simulate = policy, simulate_fn
        self.by_rate: dict[int, list[SimRequest]] = {}
        self.points: dict[tuple[str, int], Point] = {}

    def point(self, layout: Layout, k: int) -> Point:
        if (layout.label, k) not in self.points:
            rate = self.spec.grid_rate(k)
            if k not in self.by_rate:
                self.by_rate[k] = at_rate(self.requests, self.spec.rate, rate)
            results = self.simulate(self.profile, layout, self.by_rate[k], self.policy)
            summary = summarize(results, duration_of(results), self.spec.slo)
            self.points[layout.label, k] = Point(
                rate, summary, attainment_of(results, self.spec.slo)
            )
        return self.points[layout.label, k]

    def meets(self, layout: Layout, k: int) -> bool:
        return self.point(layout, k).attainment >= self.spec.attainment

    def max_rate(self, layout: Layout) -> tuple[float, bool]:
        """Bisection over the grid (attainment falls as the rate rises), then the
        log-rate where the attainment crosses the target between the bracketing rates."""
        top = self.spec.span * self.spec.steps
        if self.meets(layout, 0):
            low, high = 0, top + 1
        else:
            low, high = -top - 1, 0
        while high - low > 1:
            mid = (low + high) // 2
            low, high = (mid, high) if self.meets(layout, mid) else (low, mid)
        if low == top:
            return self.spec.grid_rate(top), True
        if low == -top - 1:
            return 0.0, False
        return self._crossing(self.point(layout, low), self.point(layout, high)), False

    def _crossing(self, ok: Point, miss: Point) -> float:
        target = self.spec.attainment
        share = (ok.attainment - target) / max(ok.attainment - miss.attainment, 1e-12)
        return math.exp(math.log(ok.rate) + share * (math.log(miss.rate) - math.log(ok.rate)))

    def plan(self, layout: Layout) -> LayoutPlan:
        max_rate, capped = self.max_rate(layout)
        return LayoutPlan(layout, self.point(layout, 0), max_rate, capped)

    def sweep(self, plan: LayoutPlan) -> None:
        """A point per doubling of the rate across the grid, for the plot."""
        top = self.spec.span * self.spec.steps
        for k in range(-top, top + 1, self.spec.steps):
            self.point(plan.layout, k)
        mine = [p for (label, _), p in self.points.items() if label == plan.label]
        plan.points = sorted(mine, key=lambda p: p.rate)


def make_plan(
    profile: Profile,
    requests: Sequence[SimRequest],
    spec: PlanSpec,
    workload: str,
    policy: Policy | None = None,
    simulate_fn: Simulate = simulate,
) -> Plan:
    """Simulate every feasible layout (those using the whole box when
    `spec.full_only`) on `requests` (arriving at `spec.rate`), find each one's max rate
    and rank them: those meeting the attainment at that rate by max rate, the rest by
    the share of requests they keep within the SLO (see `_rank`)."""
    if not requests:
        raise ValueError("the plan needs at least one request")
    every = feasible_layouts(profile)
    layouts = feasible_layouts(profile, spec.full_only)
    if not layouts:
        raise ValueError(f"no layout of {profile.atoms} atoms fits the profile's workers")
    runner = _Runner(profile, requests, spec, policy or Policy(), simulate_fn)
    plans = [runner.plan(layout) for layout in layouts]
    ranked = _rank(plans, spec.attainment)
    result = Plan(
        profile.key,
        profile.analytic,
        profile.atoms,
        workload,
        len(requests),
        spec,
        ranked,
        len(every) - len(layouts),
    )
    _set_gains(result)
    shown = ranked[: spec.plot_best]
    colocated = result.best_colocated()
    for lp in shown + ([colocated] if colocated and colocated not in shown else []):
        runner.sweep(lp)
    return result


def _rank(plans: list[LayoutPlan], target: float) -> list[LayoutPlan]:
    # Layouts that keep the target share of requests within the SLO at the plan's rate
    # first, by their max rate: their goodput at that rate is all but the same (the rate
    # times a share near 1), what sets them apart is the load they have room for. The
    # others after, by the share they keep (their goodput over the rate). Goodput as the
    # bench reports it divides by the run's length, which the last long answer sets: too
    # noisy to order layouts that all keep up.
    def key(lp: LayoutPlan) -> tuple[bool, float, float, int, str]:
        meets = lp.at_rate.attainment >= target
        first = -lp.max_rate if meets else -lp.at_rate.attainment
        return (not meets, first, -lp.max_rate, lp.layout.atoms, lp.label)

    return sorted(plans, key=key)


def _set_gains(plan: Plan) -> None:
    base = plan.best_colocated()
    if base is None or base.max_rate <= 0:
        return
    for lp in plan.ranked:
        lp.gain = lp.max_rate / base.max_rate
