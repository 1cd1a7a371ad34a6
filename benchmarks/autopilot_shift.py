"""Autopilot against every static layout on a shifting workload (issue 20), one command.

On two devices (one core each on a 2-core box) the layouts a move can reach are colocated
x2, 1P+1D and 1D+1C. Each runs the very same `bench --workload shift` schedule from a
fresh start, then the autopilot (starting in `--start`, `planner.auto_rebalance` on, this
box's profile, the run's SLO, every other planner setting the shipped default) runs it
too, while a poller records its layout every second. Prints and writes goodput per phase
for each, the autopilot's ratios against the best static layout per phase and against
the best single static layout over the run, the autopilot's layout over time, its moves,
and every one of its decisions with its inputs (`planner.decisions_log`).

    .venv/bin/python benchmarks/autopilot_shift.py                 # profiles first if needed
    .venv/bin/python benchmarks/autopilot_shift.py --simulate      # the simulator's view only
    .venv/bin/python benchmarks/autopilot_shift.py --mix-seed 3 --start colocated
    .venv/bin/python benchmarks/autopilot_shift.py --mix-seed 3 --dry-run   # what would run

`--mix-seed N` draws the phases instead of `--phases`: 2 or 3 of 90-150 s, each a
workload (chat, long-burst, fixed, shared-prefix) at a light, medium or heavy rate for
this box (`MIX_RATES`), no phase the same as the one before.

Writes benchmarks/results/autopilot_shift_cpu/{results.json,table.md,shift.png} (with
--mix-seed, under mix-N/ there).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import random
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

import httpx

from appliance.bench.compare import Target, running
from appliance.bench.report import plain
from appliance.bench.runner import run_load
from appliance.bench.shift import (
    PHASE_WORKLOADS,
    Phase,
    make_shift,
    parse_phases,
    shift_schedule,
)
from appliance.core.goodput import SLO, phase_summaries, shift_total
from appliance.model.model_source import default_model_path, prepare_tokenizer
from appliance.model.tokenizer import Tokenizer
from appliance.planner.layout import layout_of_roles
from appliance.planner.profile import (
    Profile,
    load_profile,
    model_id,
    newest_profile,
    profiles_folder,
)
from appliance.planner.simulator import Policy, SimRequest, simulate
from appliance.settings.config import load_settings
from appliance.topology.cpu import cpu_model_name

# Long prompts with short answers at a rate one prefill core keeps up with (the split
# wins: on a colocated worker each neighbour's prefill stalls an answer's few tokens for
# longer than the TPOT limit allows), then a chat mix too heavy for one decode core
# (colocated wins: two cores decode), then again. The chat phase is longer so that
# neither static layout wins the run by itself. Rates measured on an Intel Xeon (AMX,
# avx512_bf16), 2 cores; a faster box needs higher ones (`--simulate` shows the gaps).
PHASES = "fixed:1.4:90,chat:1.0:200,fixed:1.4:90"
INPUT_LEN, OUTPUT_LEN = 600, 16  # the fixed phase's prompt and answer tokens
GOODPUT = ["ttft:8000", "tpot:60"]
START = "split"  # the autopilot's first layout: `appliance serve`'s default split
OUT = Path(__file__).parent / "results" / "autopilot_shift_cpu"
SERVE = [sys.executable, "-m", "appliance.cli", "serve"]
STATIC = {
    "colocated x2": ("colocated", "colocated"),
    "1P+1D": ("prefill", "decode"),
    "1D+1C": ("colocated", "decode"),
}
STARTS = {"split": "1P+1D", "colocated": "colocated x2"}  # --start: a static layout
# Light, medium and heavy rates (req/s) of each workload on the 2-core Xeon the README's
# run used: light, every layout keeps up; heavy, the best barely does (`--simulate`).
MIX_RATES = {
    "chat": (0.6, 1.0, 1.4),
    "long-burst": (0.4, 0.7, 1.0),
    "fixed": (0.8, 1.2, 1.6),
    "shared-prefix": (0.8, 1.4, 2.0),
}
MIX_SECONDS = (90, 150)  # each drawn phase lasts this long, in steps of 10 s


def mixed_phases(seed: int) -> list[Phase]:
    """2 or 3 phases drawn from `seed` alone: each a workload at one of its `MIX_RATES`
    for 90-150 s, none the same workload and rate as the one before."""
    rng = random.Random(f"mix:{seed}")
    count = rng.choice((2, 3))
    phases: list[Phase] = []
    while len(phases) < count:
        workload = rng.choice(PHASE_WORKLOADS)
        rate = rng.choice(MIX_RATES[workload])
        seconds = float(rng.randrange(MIX_SECONDS[0], MIX_SECONDS[1] + 1, 10))
        if phases and (phases[-1].workload, phases[-1].rate) == (workload, rate):
            continue
        phases.append(Phase(workload, rate, seconds))
    return phases


def phases_text(phases: list[Phase]) -> str:
    """Phases as `--phases` takes them."""
    return ",".join(f"{p.workload}:{p.rate}:{p.seconds:g}" for p in phases)


def layout_env(roles: tuple[str, str]) -> dict[str, str]:
    """The settings that start these two devices' roles."""
    env = {"APPLIANCE_CPU_DEVICES": "2"}
    if roles == ("colocated", "colocated"):
        return env | {"APPLIANCE_MODE": "colocated"}
    named = {f"APPLIANCE_{role.upper()}_DEVICES": str(i) for i, role in enumerate(roles)}
    return env | {"APPLIANCE_MODE": "disaggregated"} | named


def slo_env(slo: SLO) -> dict[str, str]:
    """The run's SLO as the appliance's settings. Every server gets it, static layouts
    included: with an SLO set the shipped scheduling policy holds prompts that would push
    decoding past it (planner.scheduling_policy), so every layout is scored as the user
    who sets that SLO would run it."""
    assert slo.ttft is not None and slo.tpot is not None  # main checked
    return {
        "APPLIANCE_PLANNER__SLO_TTFT_MS": str(slo.ttft * 1000),
        "APPLIANCE_PLANNER__SLO_TPOT_MS": str(slo.tpot * 1000),
    }


def autopilot_env(
    start: tuple[str, str], profile: Path, token: Path, slo: SLO, decisions: Path
) -> dict[str, str]:
    """The autopilot's settings: it judges attainment by the SLO the run is scored by, and
    logs every decision to `decisions`; its rules (interval, window, margin, cooldown,
    dwell...) are the shipped defaults."""
    return (
        layout_env(start)
        | slo_env(slo)
        | {
            "APPLIANCE_PLANNER__PROFILE": str(profile),
            "APPLIANCE_PLANNER__AUTO_REBALANCE": "true",
            "APPLIANCE_PLANNER__DECISIONS_LOG": str(decisions),
            "APPLIANCE_ADMIN__TOKEN_FILE": str(token),
        }
    )


def read_decisions(path: Path | None, started_wall: float) -> list[dict[str, Any]]:
    """Every decision the autopilot logged, each with `t`: seconds from the run's start."""
    if path is None or not path.exists():
        return []
    decisions = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [d | {"t": round(d["at"] - started_wall, 1)} for d in decisions]


def find_profile(given: Path | None) -> Path:
    """The profile to plan with: given, the newest of the default model, or a new one."""
    if given is not None:
        return given
    settings = load_settings()
    folder = profiles_folder(settings.cache_dir)
    found = newest_profile(folder, model_id(default_model_path()))
    if found is None:
        print("no profile of the default model yet: running `appliance profile`", file=sys.stderr)
        subprocess.run([*SERVE[:-1], "profile"], check=True)
        found = newest_profile(folder, model_id(default_model_path()))
        assert found is not None  # the profile just written
    return folder / found.key.file_name()


class LayoutPoller:
    """Each device's role once a second, from /admin/state, while a run goes on."""

    def __init__(self, url: str, token: Path) -> None:
        self.url, self.token = url, token
        self.seen: list[tuple[float, list[str | None]]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> LayoutPoller:
        self.started = time.monotonic()
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(10)

    def _run(self) -> None:
        headers = {"Authorization": f"Bearer {self.token.read_text()}"}
        while not self._stop.wait(1.0):
            try:
                state = httpx.get(self.url + "/admin/state", headers=headers, timeout=5).json()
            except httpx.HTTPError:
                continue
            roles = [d["pool"] for d in state["devices"]]
            self.seen.append((time.monotonic() - self.started, roles))

    def blocks_in_use(self, wait_s: float = 15.0) -> int:
        """KV blocks still in use once the last reports are in (0: every block free)."""
        headers = {"Authorization": f"Bearer {self.token.read_text()}"}
        deadline = time.monotonic() + wait_s
        while True:
            state = httpx.get(self.url + "/admin/state", headers=headers, timeout=10).json()
            used = sum(d["worker"]["kv_blocks_used"] for d in state["devices"] if d["worker"])
            if used == 0 or time.monotonic() > deadline:
                return used
            time.sleep(0.5)


def run_one(
    target: Target,
    shift: Any,
    specs: list,
    slo: SLO,
    token: Path,
    tokenizer: Tokenizer,
    decisions_log: Path | None = None,
) -> dict:
    """Start the target, drive the shift, stop it; per-phase summaries, the layout over
    time, every decision its planner logged to `decisions_log` and the KV blocks still
    in use after."""

    def count(text: str) -> int:
        return len(tokenizer.encode(text))

    with running(target, Path(tempfile.mkdtemp(prefix="autopilot-shift-"))) as url:
        started_wall = time.time()
        with LayoutPoller(url, token) as poller:
            results, _ = asyncio.run(
                run_load(url, iter(specs), shift, count, extra_body={"ignore_eos": True})
            )
        blocks = poller.blocks_in_use()
    decisions = read_decisions(decisions_log, started_wall)
    phases = phase_summaries(results, shift.phases, slo)
    return {
        "label": target.label,
        "phases": phases,
        "total": shift_total(results, shift.phases, slo),
        "failed": sum(not r.ok for r in results),
        "errors": Counter(r.error for r in results if not r.ok),  # 429/503: admission
        "layout": poller.seen,
        "decisions": decisions,
        "kv_blocks_in_use_after": blocks,
    }


def simulated(
    profile: Profile, phases: list[Phase], slo: SLO, tokenizer: Tokenizer, lengths: tuple[int, int]
) -> dict[str, list[float]]:
    """The simulator's goodput per phase for each static layout, on the same schedule
    (`lengths`: the fixed workload's prompt and answer tokens)."""
    schedule = shift_schedule(phases, tokenizer, 0, *lengths)
    requests = [SimRequest(s.arrival_s, s.spec.prompt_tokens, s.spec.max_tokens) for s in schedule]
    out = {}
    for label, roles in STATIC.items():
        results = simulate(profile, layout_of_roles(roles), requests, Policy())
        tagged = [
            dataclasses.replace(r, phase=s.phase) for r, s in zip(results, schedule, strict=True)
        ]
        out[label] = [p.goodput for p in phase_summaries(tagged, phases, slo)]
    return out


def oracle_gain(per_phase: dict[str, list[float]], seconds: list[float]) -> float:
    """The best layout of each phase, switched to at no cost, over the best single layout
    (goodput over the whole run): the most any autopilot could gain."""
    best_each = sum(max(g[i] for g in per_phase.values()) * s for i, s in enumerate(seconds))
    totals = [sum(g * s for g, s in zip(gs, seconds, strict=True)) for gs in per_phase.values()]
    best_single = max(totals)
    return best_each / best_single if best_single else float("nan")


def table(runs: list[dict], phases: list[Phase]) -> str:
    """Goodput per phase and over the run; the autopilot's ratios against the best static
    layout of each phase and the best single static layout over the run."""
    head = (
        "| layout | " + " | ".join(p.label(i) for i, p in enumerate(phases)) + " | all | failed |"
    )
    lines = [head, "|---" * (len(phases) + 3) + "|"]
    for run in runs:
        cells = [f"{p.goodput:.3f} ({p.attainment:.0%})" for p in run["phases"]]
        total = run["total"]
        lines.append(
            f"| {run['label']} | {' | '.join(cells)} | {total.goodput:.3f} | {run['failed']} |"
        )
    static = [r for r in runs if r["label"] in STATIC]
    auto = next((r for r in runs if r["label"] == "autopilot"), None)
    if auto is not None and static:
        ratios = []
        for i in range(len(phases)):
            best = max(r["phases"][i].goodput for r in static)
            ratios.append(f"{auto['phases'][i].goodput / best:.2f}x" if best else "-")
        best_total = max(r["total"].goodput for r in static)
        overall = auto["total"].goodput / best_total if best_total else float("nan")
        lines.append(f"| autopilot / best static | {' | '.join(ratios)} | {overall:.2f}x | |")
        lines += moves_list(auto["decisions"])
    return "\n".join(lines)


def moves_list(decisions: list[dict[str, Any]]) -> list[str]:
    """The autopilot's moves: when (seconds from the run's start), the rule, the reason;
    and how many decisions it made by rule."""
    moves = [d for d in decisions if d.get("acted")]
    rules = Counter(d.get("rule", "") for d in decisions)
    lines = ["", f"Autopilot: {len(decisions)} decisions ({dict(sorted(rules.items()))})."]
    lines += [f"- {d['t']:.0f} s [{d['rule']}] {d['reason']}" for d in moves]
    return lines if decisions else []


def plot(runs: list[dict], phases: list[Phase], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (bars, over_time) = plt.subplots(2, 1, figsize=(9, 7))
    width = 0.8 / len(runs)
    for k, run in enumerate(runs):
        xs = [i + k * width for i in range(len(phases))]
        bars.bar(xs, [p.goodput for p in run["phases"]], width, label=run["label"])
    bars.set_xticks([i + 0.4 - width / 2 for i in range(len(phases))])
    bars.set_xticklabels([p.label(i) for i, p in enumerate(phases)])
    bars.set_ylabel("goodput (req/s within SLO)")
    bars.legend()
    auto = next((r for r in runs if r["label"] == "autopilot"), None)
    if auto is not None and auto["layout"]:
        names = {"colocated": "C", "prefill": "P", "decode": "D", None: "-"}
        labels = ["".join(names[r] for r in roles) for _, roles in auto["layout"]]
        order = sorted(set(labels))
        over_time.step(
            [t for t, _ in auto["layout"]], [order.index(x) for x in labels], where="post"
        )
        over_time.set_yticks(range(len(order)))
        over_time.set_yticklabels(order)
        edge = 0.0
        for p in phases[:-1]:
            edge += p.seconds
            over_time.axvline(edge, color="grey", linestyle=":")
        over_time.set_xlabel("seconds (phase edges dotted)")
        over_time.set_ylabel("autopilot layout (device 0, 1)")
    fig.tight_layout()
    fig.savefig(path)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--phases", default=PHASES)
    parser.add_argument(
        "--mix-seed", type=int, help="draw 2-3 phases of 90-150 s from this seed (not --phases)"
    )
    parser.add_argument("--goodput", nargs="+", default=GOODPUT, help="ttft:MS tpot:MS")
    parser.add_argument("--input-len", type=int, default=INPUT_LEN, help="fixed: prompt tokens")
    parser.add_argument("--output-len", type=int, default=OUTPUT_LEN, help="fixed: answer tokens")
    parser.add_argument("--start", choices=list(STARTS), default=START, help="autopilot's layout")
    parser.add_argument("--profile", type=Path)
    parser.add_argument("--simulate", action="store_true", help="only the simulator's table")
    parser.add_argument(
        "--dry-run", action="store_true", help="print the phases and settings, run nothing"
    )
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    if args.mix_seed is not None:
        args.phases = phases_text(mixed_phases(args.mix_seed))
    if args.out is None:
        args.out = OUT if args.mix_seed is None else OUT / f"mix-{args.mix_seed}"
    phases, slo = parse_phases(args.phases), SLO.parse(args.goodput)
    if slo.ttft is None or slo.tpot is None:
        parser.error("--goodput needs both ttft:MS and tpot:MS (the autopilot's SLO too)")
    start = STATIC[STARTS[args.start]]
    if args.dry_run:
        print(f"phases {args.phases} ({sum(p.seconds for p in phases):.0f} s)")
        env = autopilot_env(start, Path("PROFILE"), Path("TOKEN"), slo, Path("DECISIONS"))
        print(f"autopilot: starts {STARTS[args.start]}, settings {json.dumps(env)}")
        print(f"writes {args.out}/{{results.json,table.md,shift.png}}")
        return
    lengths = (args.input_len, args.output_len)
    profile_path = find_profile(args.profile)
    profile = load_profile(profile_path)
    tokenizer = prepare_tokenizer(None, load_settings().cache_dir)[1]
    predicted = simulated(profile, phases, slo, tokenizer, lengths)
    print(f"simulated goodput per phase ({args.phases}): {json.dumps(predicted)}")
    gain = oracle_gain(predicted, [p.seconds for p in phases])
    print(f"an oracle switching at once would gain {gain:.2f}x over the best")
    if args.simulate:
        return
    shift, specs = make_shift(phases, tokenizer, 0, 2, *lengths)
    scratch = Path(tempfile.mkdtemp(prefix="autopilot-token-"))
    token, decisions = scratch / "admin.token", scratch / "decisions.jsonl"
    with_token = {"APPLIANCE_ADMIN__TOKEN_FILE": str(token)} | slo_env(slo)
    targets = [
        Target(label, SERVE, layout_env(roles) | with_token, port_flag=None)
        for label, roles in STATIC.items()
    ]
    env = autopilot_env(start, profile_path, token, slo, decisions)
    targets.append(Target("autopilot", SERVE, env, port_flag=None))
    runs = []
    for target in targets:  # one at a time: each writes the token file at start
        print(f"running {target.label}", file=sys.stderr)
        log = decisions if target.label == "autopilot" else None
        runs.append(run_one(target, shift, specs, slo, token, tokenizer, log))
    args.out.mkdir(parents=True, exist_ok=True)
    text = table(runs, phases)
    cpu = cpu_model_name()
    header = (
        f"# Autopilot on a shifting workload\n\n{cpu}, 2 devices of one core. Phases "
        f"`{args.phases}` (fixed: {args.input_len}-token prompts, {args.output_len}-token "
        f"answers), SLO `{' '.join(args.goodput)}`, seed 0, ignore_eos; the autopilot starts "
        f"{STARTS[args.start]} with the shipped planner defaults. Goodput req/s "
        f"(attainment).\n\n"
    )
    (args.out / "table.md").write_text(header + text + "\n")
    record = {
        "args": vars(args) | {"profile": str(profile_path)},
        "predicted": predicted,
        "runs": runs,
    }
    (args.out / "results.json").write_text(json.dumps(plain(record), indent=1, default=str))
    plot(runs, phases, args.out / "shift.png")
    print(header + text)


if __name__ == "__main__":
    main()
