"""Predicted against measured: the simulator, fed only by `appliance profile`, against real
serving runs of the same requests on this machine.

    .venv/bin/python benchmarks/planner_validation.py                # about 40 minutes
    .venv/bin/python benchmarks/planner_validation.py --reuse        # predictions only,
                                                                     # from the saved runs

1. `appliance profile` writes OUT/profile.json (skipped with --profile FILE).
2. `appliance bench compare --configs ours` runs the three layouts of this 2-core box
   (disaggregated 1P+1D, colocated x2, colocated x1 on both cores) on the long-burst and
   chat workloads at three rates each: OUT/<workload>/compare.json.
3. The simulator replays the very same requests (same workload, seed, arrivals, warm-up
   skipped) on each layout with the profile; the bench's own code computes the figures.
4. OUT/validation.md: every cell predicted / measured / error; goodput and p50 within 20%,
   p90 within 30% pass; and each rate's ranking of the layouts, predicted and measured.

The profile is never fitted to the serving runs: they are measured after it and only
compared with.
"""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
from pathlib import Path

from appliance.core.goodput import SLO, RequestResult, Summary, summarize
from appliance.model.model_source import prepare_tokenizer
from appliance.planner.layout import Layout, Pool
from appliance.planner.plan import duration_of
from appliance.planner.profile import Profile, load_profile
from appliance.planner.simulator import Policy, requests_from_workload, simulate
from appliance.settings.config import load_settings

ROOT = Path(__file__).resolve().parent.parent
RATES = {"long-burst": (0.5, 1.0, 2.0), "chat": (0.5, 1.0, 2.0)}
SLO_SPEC = ["ttft:5000", "tpot:100"]
WARMUP = 2
SEED = 0
# The labels `bench compare` gives our three layouts (bench/compare.py: our_targets).
LAYOUTS = {
    "disaggregated 1P+1D": Layout(
        mode="disaggregated", prefill=Pool(workers=1), decode=Pool(workers=1)
    ),
    "colocated x2": Layout(mode="colocated", prefill=Pool(workers=2)),
    "colocated x1 (all cores)": Layout(mode="colocated", device_size=2, prefill=Pool(workers=1)),
}
# (figure, tolerance): goodput and medians within 20%, p90s within 30%.
FIGURES = (
    ("goodput", 0.2),
    ("TTFT p50", 0.2),
    ("TTFT p90", 0.3),
    ("TPOT p50", 0.2),
    ("TPOT p90", 0.3),
)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    default_out = ROOT / "benchmarks/results/planner_validation_cpu"
    parser.add_argument("--out", type=Path, default=default_out)
    parser.add_argument("--profile", type=Path, help="use this profile instead of profiling")
    parser.add_argument("--num-requests", type=int, default=30)
    parser.add_argument("--reuse", action="store_true", help="keep serving runs already saved")
    parser.add_argument("--workloads", default="long-burst,chat")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    profile_path = args.profile or _profile(args.out / "profile.json", args.reuse)
    profile = load_profile(profile_path)
    slo = SLO.parse(SLO_SPEC)
    sections = [_header(profile, args)]
    for workload in args.workloads.split(","):
        measured = _measure(workload, args.out / workload, args.num_requests, args.reuse)
        sections.append(_compare(workload, measured, profile, slo, args.num_requests))
    text = "\n\n".join(sections) + "\n"
    (args.out / "validation.md").write_text(text)
    print(text)
    return 0


def _profile(path: Path, reuse: bool) -> Path:
    if not (reuse and path.is_file()):
        _run(["profile", "--out", str(path)])
    return path


def _measure(workload: str, out: Path, num: int, reuse: bool) -> dict:
    result = out / "compare.json"
    if not (reuse and result.is_file()):
        rates = ",".join(str(r) for r in RATES[workload])
        _run(
            [
                *("bench", "compare", "--configs", "ours", "--workload", workload),
                *("--seed", str(SEED), "--num-requests", str(num), "--warmup", str(WARMUP)),
                *("--rates", rates, "--goodput", *SLO_SPEC, "--out", str(out)),
            ]
        )
    return json.loads(result.read_text())


def _run(arguments: list[str]) -> None:
    command = [sys.executable, "-m", "appliance.cli", *arguments]
    print("$ appliance " + " ".join(arguments), file=sys.stderr, flush=True)
    subprocess.run(command, check=True, cwd=ROOT)


def _compare(workload: str, measured: dict, profile: Profile, slo: SLO, num: int) -> str:
    tokenizer = prepare_tokenizer(None, load_settings().cache_dir)[1]
    policy = Policy.from_settings(load_settings())
    rows, rankings, misses = [], [], 0
    for rate in RATES[workload]:
        requests = requests_from_workload(workload, tokenizer, SEED, num, rate=rate, warmup=WARMUP)
        predicted, actual = {}, {}
        for run in (r for r in measured["runs"] if r["rate"] == rate):
            layout = LAYOUTS[run["label"]]
            simulated = simulate(profile, layout, requests, policy)
            predicted[run["label"]] = summarize(simulated, duration_of(simulated), slo)
            actual[run["label"]] = _summary_of(run, slo)
        for label in LAYOUTS:
            if label in actual:
                cells, missed = _cells(predicted[label], actual[label])
                misses += missed
                rows.append(f"| {rate} | {label} | " + " | ".join(cells) + " |")
        rankings.append(_ranking(rate, predicted, actual))
    names = " | ".join(f"{name} pred / meas (err)" for name, _ in FIGURES)
    head = f"| rate req/s | layout | {names}"
    table = [head + " |", "|" + "---|" * (2 + len(FIGURES)), *rows]
    return "\n".join(
        [
            f"## {workload} workload, {num} requests per run, SLO {' '.join(SLO_SPEC)}",
            "",
            *table,
            "",
            f"Cells outside tolerance (marked **): {misses}",
            "",
            *rankings,
        ]
    )


def _summary_of(run: dict, slo: SLO) -> Summary:
    """The run's summary recomputed from its per-request results by the bench's code."""
    fields = RequestResult.__dataclass_fields__
    results = [RequestResult(**{k: v for k, v in r.items() if k in fields}) for r in run["results"]]
    return summarize(results, run["summary"]["duration"], slo)


def _cells(predicted: Summary, actual: Summary) -> tuple[list[str], int]:
    cells, missed = [], 0
    for (name, tolerance), (p, m) in zip(FIGURES, _pairs(predicted, actual), strict=True):
        error = (p - m) / m if m else math.inf
        bad = not abs(error) <= tolerance
        missed += bad
        scale = 1 if name == "goodput" else 1000  # goodput in req/s, times in ms
        text = f"{p * scale:.3g} / {m * scale:.3g} ({error:+.0%})"
        cells.append(f"**{text}**" if bad else text)
    return cells, missed


def _pairs(p: Summary, m: Summary) -> list[tuple[float, float]]:
    return [
        (p.goodput, m.goodput),
        (p.ttft.median, m.ttft.median),
        (p.ttft.p90, m.ttft.p90),
        (p.tpot.median, m.tpot.median),
        (p.tpot.p90, m.tpot.p90),
    ]


def _ranking(rate: float, predicted: dict[str, Summary], actual: dict[str, Summary]) -> str:
    def order(summaries: dict[str, Summary]) -> list[str]:
        return sorted(summaries, key=lambda label: -summaries[label].goodput)

    same = order(predicted) == order(actual)
    return (
        f"- {rate} req/s, ranked by goodput: predicted {' > '.join(order(predicted))}; "
        f"measured {' > '.join(order(actual))}: {'same' if same else 'DIFFERENT'}"
    )


def _header(profile: Profile, args: argparse.Namespace) -> str:
    return "\n".join(
        [
            "# Planner validation: simulator (calibrated by `appliance profile` only) "
            "against measured serving runs",
            "",
            f"Profile: {profile.key.model}, {profile.key.dtype}, {profile.key.weights}; "
            f"{profile.key.device_kind}; {profile.atoms} cores.",
            f"Command: `.venv/bin/python benchmarks/planner_validation.py --num-requests "
            f"{args.num_requests}`. Times in ms, goodput in req/s; err = (pred - meas) / meas.",
        ]
    )


if __name__ == "__main__":
    sys.exit(main())
