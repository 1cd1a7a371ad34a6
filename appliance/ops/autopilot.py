"""Autopilot: every `planner.interval_s` the rebalancer looks at the last window of
traffic, simulates the current layout and every layout one move away with this box's
profile (appliance/planner/rebalance.py), and, with `planner.auto_rebalance`, moves one
device through the pool mover. Each look is a decision the admin API shows (the latest
`DECISIONS_KEPT`) and, with `planner.decisions_log`, a JSON line with its inputs (every
layout's simulated goodput, the measured figures, the layouts barred, the rule that
decided); a Prometheus count and a log line. A decision that recommends another layout,
and a hold on a new rule that weighs measurements, is also an event (`kind: planner`)
with its reason. Without a profile it says so and never moves."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import math
import time
from collections import Counter, deque
from collections.abc import Mapping
from typing import Any, cast

from appliance.admin.schema import Decision, Measured, Move, PlannerView
from appliance.core.admission import admission_limits
from appliance.core.goodput import SLO
from appliance.core.roles import Role
from appliance.model.model_source import default_model_path
from appliance.ops.pool_moves import MoveError, PoolMover, device_roles
from appliance.planner.auto_layout import analytic_base, box_kind, known_profile, moves_itself
from appliance.planner.measured_acceptance import MovingAcceptance
from appliance.planner.profile import Profile, ProfileError, model_id
from appliance.planner.rebalance import (
    Measurement,
    RebalanceMemory,
    RebalanceRules,
    Roles,
    TrafficWindow,
    Verdict,
    decide,
    mix_of,
)
from appliance.planner.simulator import Policy
from appliance.pools.supervisor import Supervisor, online_profile
from appliance.settings.config import Settings

DECISIONS_KEPT = 10
# Holds an event notes when their rule differs from the last look's (with the layouts
# barred as targets, or measurements deciding); routine holds are only counted and logged.
NOTED_HOLDS = frozenset({"measured-stay"})

log = logging.getLogger("appliance.planner")


class Autopilot:
    """The rebalancer's loop, its latest decisions, and applying its recommendation."""

    def __init__(self, supervisor: Supervisor, mover: PoolMover, settings: Settings) -> None:
        self.supervisor = supervisor
        self.mover = mover
        self.planner = settings.planner
        self.settings = settings
        self.slo = SLO(ttft=self.planner.slo_ttft_ms / 1000, tpot=self.planner.slo_tpot_ms / 1000)
        self.moves = moves_itself(settings)  # else it only recommends
        self.rules = rules_of(settings)
        self.memory = RebalanceMemory()
        # The workers' speculative acceptance over the window it looks at: the simulator
        # speculates at it (planner/measured_acceptance.py).
        self.acceptance = MovingAcceptance(self.planner.window_s)
        self.profile: Profile | None = None
        self.profile_name: str | None = None
        self.status = "starting"
        self.decisions: deque[Decision] = deque(maxlen=DECISIONS_KEPT)  # oldest first
        self.counts: Counter[str] = Counter()  # "move" / "hold" -> decisions made
        self.last: Verdict | None = None  # the latest look's
        self._last_rule: str | None = None  # the latest recorded decision's rule
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        """Find the profile and begin looking every interval (the workers are ready).
        Without one it looks all the same: the steps the workers run are fitted as they
        come (the online profile), and it plans once a worker size fits."""
        self.profile, self.status = self._find_profile()
        self._task = asyncio.create_task(self._loop())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    def _find_profile(self) -> tuple[Profile | None, str]:
        try:
            found, where = known_profile(self.settings, box_kind(self.supervisor.topology))
        except (ProfileError, OSError) as exc:
            return None, f"cannot plan: {exc}"
        if found is None:
            model = model_id(self.settings.model or default_model_path())
            learning = (
                "learning the step costs from the steps the workers run (or run "
                "`appliance profile` to time the box now)"
            )
            analytic, about = self._analytic_base()
            if analytic is not None:
                return analytic, f"no profile of {model} yet: planning on {about}, {learning}"
            return None, f"no profile of {model} yet: {learning}"
        self.profile_name = str(where)
        return found, "watching"

    def _analytic_base(self) -> tuple[Profile | None, str]:
        """On a GPU box, the analytic profile of its cards (none on CPUs)."""
        topology = self.supervisor.topology
        if box_kind(topology) == "cpu":
            return None, "a CPU box"
        return analytic_base(self.settings, topology)

    async def _loop(self) -> None:
        while True:
            await asyncio.sleep(self.planner.interval_s)
            await self.look(time.monotonic())

    async def look(self, now: float) -> Decision | None:
        """One look at the traffic: decide, record, and move if autopilot is on."""
        if not self.supervisor.ready:
            return None
        self.observe_acceptance(now)
        # The profile on disk (if any) refined by the steps the workers ran lately.
        profile = online_profile(self.supervisor, self.profile)
        if profile is None:
            return None  # no worker size has steps enough to fit yet
        if (running := self.mover.running) is not None:
            self.status = f"move {running.move_id} of device {running.device} is running"
            return None
        roles = device_roles(self.supervisor)
        in_place = self.mover.in_place_moves()
        in_flight = self.supervisor.table.requests.values()
        window = self.supervisor.traffic.window(now, self.planner.window_s, self.slo, in_flight)
        # Simulating every layout a move or two away takes milliseconds to seconds (a big
        # box): off the loop that streams tokens. Only this task touches the memory.
        try:
            verdict = await asyncio.to_thread(self._decide, profile, window, roles, now, in_place)
        except (ValueError, ProfileError) as exc:  # e.g. a worker restarting, a size unprofiled
            self.status = f"cannot plan this look: {exc}"
            return None
        if device_roles(self.supervisor) != roles or self.mover.running is not None:
            return None  # a move was asked for meanwhile: this look is stale
        self.last = verdict
        acted, reason = self._act(verdict)
        decision = _decision(verdict, window, acted, reason, now)
        self._record(decision, verdict)
        self._log(record_of(decision, verdict, window, now))
        return decision

    def _decide(
        self,
        profile: Profile,
        window: TrafficWindow,
        roles: list[str | None],
        now: float,
        in_place: frozenset[tuple[int, str]],
    ) -> Verdict:
        size = device_size(self.supervisor)
        return decide(
            window,
            profile,
            roles,
            self.policy(),
            self.slo,
            self.rules,
            self.memory,
            now,
            size,
            in_place,
        )

    def observe_acceptance(self, now: float) -> None:
        """Note every worker's speculative totals as of its last report."""
        totals = {w.worker_id: w.speculation for w in self.supervisor.workers.values()}
        self.acceptance.observe(now, totals)

    def policy(self) -> Policy:
        """What the simulator schedules with: the live knobs the workers schedule with,
        speculation at the acceptance measured over the window (None: plain), and the
        SLO admission the supervisor holds prompts by (None where no SLO is configured
        or the policy is fcfs: first come, first served), so that a layout is judged as
        the box would run it."""
        tuning = self.supervisor.tuning
        return Policy(
            max_num_seqs=tuning.decode_max_seqs,
            prefill_token_budget=tuning.prefill_token_budget,
            chunk_size=tuning.chunk_size,
            routing=tuning.routing,
            prefix_caching=self.settings.kv.prefix_caching,
            speculation=self.acceptance.speculation(self.settings.speculative),
            admission=admission_limits(self.planner),
        )

    def _act(self, verdict: Verdict) -> tuple[bool, str]:
        if verdict.move is None or not self.moves:
            return False, verdict.reason
        device, to = verdict.move
        try:
            self.mover.start(device, cast(Role, to))
        except MoveError as exc:
            return False, f"{verdict.reason}; the move was refused: {exc}"
        return True, verdict.reason

    def _record(self, decision: Decision, verdict: Verdict) -> None:
        self.decisions.append(decision)
        action = "move" if decision.move_device is not None else "hold"
        self.counts[action] += 1
        self.status = "watching" if self.moves else "recommending only"
        # A hold with nothing better in sight is only counted and logged: one every
        # interval would push every other event out of the admin API's list. A hold by a
        # rule that weighs measurements is an event when that rule starts holding.
        rule = verdict.rule
        changed, self._last_rule = rule != self._last_rule, rule
        noted = rule in NOTED_HOLDS or "not a target:" in verdict.reason
        if decision.recommended != decision.current or (changed and noted):
            self.supervisor.note("planner", _line(decision, rule))
        else:
            log.debug("%s", _line(decision, rule))

    def _log(self, record: dict[str, Any]) -> None:
        """Append the decision with its inputs to `planner.decisions_log`, if set."""
        path = self.planner.decisions_log
        if path is None:
            return
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            with path.open("a") as out:
                out.write(json.dumps(record) + "\n")
        except OSError as exc:  # a full disk must not stop the planner
            log.warning("planner: cannot append to %s: %s", path, exc)

    def apply(self) -> Move:
        """Start the first move toward the recommended layout now (autopilot on or off);
        MoveError when there is nothing to apply. A layout two moves away is remembered,
        so the next look makes the second move."""
        last = self.last
        if last is None:
            raise MoveError("the planner has not looked at any traffic yet")
        if not last.path or tuple(device_roles(self.supervisor)) != last.current:
            raise MoveError("nothing to apply: the planner recommends the current layout")
        device, to = last.path[0]
        move = self.mover.start(device, cast(Role, to))
        self.supervisor.note("planner", f"recommendation applied: move device {device} to {to}")
        self.memory.applied(last, time.monotonic())  # judged, dwelt on, as its own moves are
        self.last = None  # applied: the next look recommends afresh
        return move

    def view(self) -> PlannerView:
        """The state the console's planner panel shows."""
        last = self.decisions[-1] if self.decisions else None
        return PlannerView(
            auto_rebalance=self.moves,
            interval_s=self.planner.interval_s,
            profile=self.profile_name,
            status=self.status,
            current=[cast(Role | None, r) for r in device_roles(self.supervisor)],
            recommended=last.recommended if last else None,
            predicted_current=last.predicted_current if last else None,
            predicted_recommended=last.predicted_recommended if last else None,
            next_move=self._next_move(),
            decisions=list(self.decisions),
        )

    def _next_move(self) -> tuple[int, Role] | None:
        last = self.last
        if last is None or not last.path:
            return None
        device, to = last.path[0]
        return device, cast(Role, to)


def rules_of(settings: Settings) -> RebalanceRules:
    """The rebalancer's rules from the planner settings."""
    planner = settings.planner
    return RebalanceRules(
        margin=planner.margin,
        target_attainment=planner.target_attainment,
        cooldown_s=planner.cooldown_s,
        confirm_windows=planner.confirm_windows,
        min_requests=planner.min_requests,
        dwell_s=planner.dwell_s,
        hold_off_s=planner.hold_off_s,
        remember_s=planner.remember_s,
    )


def device_size(supervisor: Supervisor) -> int:
    """Atoms per device as profiles count them: cores of a CPU device, 1 for a GPU."""
    first = supervisor.topology.devices[0]
    return len(first.cores) if first.kind == "cpu" and first.cores else 1


def _decision(
    verdict: Verdict, window: TrafficWindow, acted: bool, reason: str, now: float
) -> Decision:
    """The admin API's decision: the verdict, what was done, and the verdict's inputs
    (layouts keyed as `roles_key` writes them, measurements aged as of `now`)."""
    device, to = verdict.move if verdict.move is not None else (None, None)

    def measured(found: Measurement) -> Measured:
        mix = found.mix
        return Measured(
            age_s=now - found.at,
            attainment=found.attainment,
            goodput=found.goodput,
            rate=mix.rate,
            mean_prompt_tokens=mix.prompt,
            mean_output_tokens=mix.output,
        )

    return Decision(
        at=time.time(),
        current=[cast(Role | None, r) for r in verdict.current],
        recommended=[cast(Role | None, r) for r in verdict.recommended],
        move_device=device,
        move_to=cast(Role | None, to),
        predicted_current=verdict.predicted_current,
        predicted_recommended=verdict.predicted_recommended,
        attainment=window.attainment,
        window_requests=len(window.requests),
        acted=acted,
        reason=reason,
        rule=verdict.rule,
        simulated={roles_key(r): goodput for r, goodput in verdict.simulated.items()},
        measured=None if verdict.measured is None else measured(verdict.measured),
        remembered={roles_key(r): measured(found) for r, found in verdict.remembered.items()},
        barred={roles_key(r): why for r, why in verdict.barred.items()},
    )


def _line(decision: Decision, rule: str = "") -> str:
    """A decision in one log line (an event's message)."""
    if decision.move_device is None:
        what = "hold"
    else:
        applied = "" if decision.acted else " (not applied)"
        what = f"move device {decision.move_device} to {decision.move_to}{applied}"
    ruled = f" [{rule}]" if rule else ""
    return (
        f"planner{ruled}: {what}; predicted goodput {decision.predicted_current:.2f} -> "
        f"{decision.predicted_recommended:.2f} req/s on {decision.window_requests} "
        f"requests; {decision.reason}"
    )


def roles_key(roles: Roles) -> str:
    """A layout as a JSON key: each device's role by index, '-' for none."""
    return ",".join(role or "-" for role in roles)


def record_of(
    decision: Decision, verdict: Verdict, window: TrafficWindow, now: float
) -> dict[str, Any]:
    """A decision with its inputs, as `planner.decisions_log` keeps it: the window (its
    traffic mix, measured attainment, requests ended and running and their latencies'
    p90), the fraction within the rules' headroom of the SLO, the box's slowdown over
    the simulator, every layout simulated on it, this window's
    and the remembered measurements on similar traffic, the layouts barred as targets
    and why, the rule that decided and its reason."""
    mix = mix_of(window)
    return {
        "at": decision.at,
        "monotonic": now,
        "current": roles_key(verdict.current),
        "recommended": roles_key(verdict.recommended),
        "path": [[device, to] for device, to in verdict.path],
        "move": None if verdict.move is None else list(verdict.move),
        "acted": decision.acted,
        "rule": verdict.rule,
        "reason": decision.reason,
        "window": {
            "seconds": window.duration_s,
            "requests": len(window.requests),
            "attainment": window.attainment,
            "rate": mix.rate,
            "mean_prompt_tokens": mix.prompt,
            "mean_output_tokens": mix.output,
        }
        | _latencies(window),
        "headroom": verdict.headroom,
        "slowdown": dataclasses.asdict(verdict.slowdown) | {"applied": verdict.calibrated},
        "predicted_current": verdict.predicted_current,
        "predicted_recommended": verdict.predicted_recommended,
        "predicted_via": verdict.predicted_via,
        "simulated": {roles_key(r): goodput for r, goodput in verdict.simulated.items()},
        "measured": _measurement(verdict.measured, now),
        "remembered": _measurements(verdict.remembered, now),
        "barred": {roles_key(r): why for r, why in verdict.barred.items()},
    }


def _latencies(window: TrafficWindow) -> dict[str, Any]:
    """How many of the window's requests ended and are running, and the p90 of their
    measured TTFT and time per token (running ones as they stand; None: none)."""
    latencies = window.latencies
    ttfts = sorted(m.ttft for m in latencies if m.ok and m.first_token)
    tpots = sorted(m.tpot for m in latencies if m.ok and m.tpot is not None)
    running = sum(m.running for m in latencies)
    return {
        "ended": len(latencies) - running,
        "running": running,
        "ttft_p90": _p90(ttfts),
        "tpot_p90": _p90(tpots),
    }


def _p90(values: list[float]) -> float | None:
    """The 90th percentile of sorted `values` (nearest rank); None when empty."""
    if not values:
        return None
    return values[min(len(values) - 1, math.ceil(0.9 * len(values)) - 1)]


def _measurements(found: Mapping[Roles, Measurement], now: float) -> dict[str, Any]:
    return {roles_key(roles): _measurement(m, now) for roles, m in found.items()}


def _measurement(found: Measurement | None, now: float) -> dict[str, float] | None:
    if found is None:
        return None
    return {
        "age_s": now - found.at,
        "attainment": found.attainment,
        "goodput": found.goodput,
        "rate": found.mix.rate,
        "mean_prompt_tokens": found.mix.prompt,
        "mean_output_tokens": found.mix.output,
    }
