"""Replay a saturated phase that the autopilot reaches late, in the simulator, with and
without SLO admission (appliance/core/admission.py, planner.scheduling_policy).

The case of issue 35's mix 15: chat at 1.4 req/s for 100 s, SLO ttft 8 s / tpot 60 ms,
starting on the split (1P+1D); the autopilot moved device 0 to colocated at 30 s and
device 1 at 40 s, in place (what each ran went on there). Each row simulates that
schedule (the benchmark's seeded arrivals, seed 0) with the box's profile, its step
costs scaled by `--slowdown` (the box served slower than its profile: colocated x2's
measured TPOT was ~1.7x its simulation in the seeded runs), for: colocated x2 from the
start, the split throughout, and the split moved to colocated x2 at 30/40 s; each under
fcfs and under slo admission. Prints goodput (req/s within the SLO), attainment, TPOT
p50/p90 and TTFT p90 of the requests that arrived in the phase, and the longest wait a
held prompt had.

    .venv/bin/python benchmarks/admission_replay.py
    .venv/bin/python benchmarks/admission_replay.py --phases chat:1.2:120 --moves 20,30
"""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path

from appliance.bench.shift import parse_phases, shift_schedule
from appliance.core.admission import AdmissionLimits
from appliance.core.goodput import SLO, RequestResult, phase_summaries
from appliance.model.model_source import prepare_tokenizer
from appliance.planner.layout import layout_of_roles
from appliance.planner.profile import Profile, StepCost, WorkerCost, load_profile
from appliance.planner.sim_run import Move
from appliance.planner.simulator import Policy, SimRequest, simulate
from appliance.settings.config import load_settings

PROFILE = Path(__file__).parents[1] / "tests" / "data" / "autopilot_mix1" / "profile.json"
SCALED = ("base_s", "per_token_s", "per_seq_s", "per_attended_s", "per_context_s")


def scaled(profile: Profile, factor: float) -> Profile:
    """The profile with every step `factor` times slower."""

    def step(cost: StepCost) -> StepCost:
        return cost.model_copy(update={f: getattr(cost, f) * factor for f in SCALED})

    def worker(cost: WorkerCost) -> WorkerCost:
        kinds = {k: step(getattr(cost, k)) for k in ("prefill", "decode", "mixed")}
        return cost.model_copy(update=kinds)

    workers = {unit: worker(cost) for unit, cost in profile.workers.items()}
    return profile.model_copy(update={"workers": workers})


def row(label: str, results: list[RequestResult], phases: list, slo: SLO) -> str:
    """The first phase's figures."""
    first = phase_summaries(results, phases, slo)[0]
    return (
        f"| {label} | {first.goodput:.2f} | {first.attainment:.0%} | {first.tpot_p50 * 1e3:.0f}"
        f" / {first.tpot_p90 * 1e3:.0f} | {first.ttft_p90:.2f} | {first.failed} |"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--phases", default="chat:1.4:100")
    parser.add_argument("--moves", default="30,40", help="when device 0, then 1, turn colocated")
    parser.add_argument("--slowdown", type=float, nargs="+", default=[1.0, 1.3, 1.7])
    parser.add_argument("--ttft-ms", type=float, default=8000)
    parser.add_argument("--tpot-ms", type=float, default=60)
    parser.add_argument("--profile", type=Path, default=PROFILE)
    args = parser.parse_args()
    phases = parse_phases(args.phases)
    tokenizer = prepare_tokenizer(None, load_settings().cache_dir)[1]
    schedule = shift_schedule(phases, tokenizer, 0, 600, 16)
    requests = [SimRequest(s.arrival_s, s.spec.prompt_tokens, s.spec.max_tokens) for s in schedule]
    slo = SLO(ttft=args.ttft_ms / 1000, tpot=args.tpot_ms / 1000)
    limits = AdmissionLimits.from_slo(slo.ttft, slo.tpot)
    first, second = (float(t) for t in args.moves.split(","))
    moves = [Move(first, 0, "colocated"), Move(second, 1, "colocated")]
    runs = {
        "colocated x2": (("colocated", "colocated"), []),
        "1P+1D": (("prefill", "decode"), []),
        f"1P+1D, colocated x2 from {first:g}/{second:g} s": (("prefill", "decode"), moves),
    }
    base = load_profile(args.profile)
    print(
        f"{args.phases}, {len(requests)} requests, SLO ttft {args.ttft_ms:g} ms / tpot "
        f"{args.tpot_ms:g} ms; slo admission holds a prompt at most {limits.max_wait_s:g} s\n"
    )
    print(
        "| slowdown / layout / policy | goodput | attainment | TPOT p50 / p90 ms | "
        "TTFT p90 s | failed |"
    )
    print("|---|---|---|---|---|---|")
    for factor in args.slowdown:
        profile = scaled(base, factor)
        for label, (roles, moving) in runs.items():
            for policy, admission in (("fcfs", None), ("slo", limits)):
                results = simulate(
                    profile,
                    layout_of_roles(roles),
                    requests,
                    Policy(admission=admission),
                    moves=moving,
                )
                tagged = [
                    dataclasses.replace(r, phase=s.phase)
                    for r, s in zip(results, schedule, strict=True)
                ]
                print(row(f"{factor:g}x / {label} / {policy}", tagged, phases, slo))


if __name__ == "__main__":
    main()
