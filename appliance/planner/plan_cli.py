"""The `appliance plan` command: rank this box's layouts (or an analytic box's) for a
workload, a rate and an SLO (planner/plan.py); with `--boxes 2`, compare two independent
boxes with a cross-box split over a few rates and workloads (planner/two_boxes.py)."""

from __future__ import annotations

import argparse
import json
import math
import random
import sys
from dataclasses import replace
from pathlib import Path

from appliance.core.goodput import SLO
from appliance.planner import plan_report, two_boxes
from appliance.planner.analytic import GPUS, MODEL_SHAPES, analytic_profile, network_link
from appliance.planner.plan import Plan, PlanSpec, make_plan
from appliance.planner.profile import (
    Profile,
    ProfileError,
    load_profile,
    model_id,
    newest_profile,
    profiles_folder,
)
from appliance.planner.simulator import Policy, SimRequest, requests_from_workload
from appliance.planner.speculation import Speculation
from appliance.settings.config import Settings, load_settings

WORKLOADS = ("chat", "long-burst", "fixed", "shared-prefix", "sharegpt-like")
# ShareGPT-like lengths (no tokenizer needed): log-normal prompts of median 300 tokens
# (mean ~500) and answers of median 180 (mean ~250), within the ranges reported for
# ShareGPT conversations (mean input ~300-700, output ~200-300 tokens).
SHAREGPT_PROMPT = (math.log(300), 1.0)
SHAREGPT_OUTPUT = (math.log(180), 0.8)


def add_parser(commands: argparse._SubParsersAction) -> None:
    """Add `plan` to the `appliance` command's subcommands."""
    cmd = commands.add_parser(
        "plan",
        help="rank the box's pool layouts by predicted goodput (simulated on a profile)",
    )
    cmd.add_argument("--workload", default="chat", choices=WORKLOADS)
    cmd.add_argument("--rate", type=float, help="request rate, Poisson, req/s")
    cmd.add_argument(
        "--goodput",
        nargs="+",
        required=True,
        metavar="METRIC:MS",
        help="the SLO, e.g. ttft:250 tpot:100",
    )
    source = cmd.add_mutually_exclusive_group()
    source.add_argument("--profile", type=Path, help="a profile file (default: the newest)")
    source.add_argument(
        "--analytic", choices=sorted(GPUS), help="plan a GPU box from its datasheet instead"
    )
    cmd.add_argument("--gpus", type=int, default=8, help="GPUs of the --analytic box")
    cmd.add_argument("--model-shape", choices=sorted(MODEL_SHAPES), help="for --analytic")
    cmd.add_argument("--num-requests", type=int, default=1000)
    cmd.add_argument("--seed", type=int, default=0)
    cmd.add_argument("--input-len", type=int, default=128, help="fixed workload prompt")
    cmd.add_argument("--output-len", type=int, default=64, help="fixed workload output")
    cmd.add_argument(
        "--all-layouts", action="store_true", help="also simulate layouts leaving atoms idle"
    )
    cmd.add_argument("--out", type=Path, help="write plan.json, plan.md, goodput_vs_rate.png")
    cmd.add_argument("--json", action="store_true", help="print the plan as JSON")
    cmd.add_argument(
        "--spec-acceptance",
        type=float,
        metavar="A",
        help="plan with speculative decoding at this per-draft acceptance (0-1; a worker's "
        "/metrics appliance_spec_decode_acceptance_rate is near it), draft lengths and "
        "cut-off from the speculative.* settings",
    )
    _add_two_box_options(cmd)


def _add_two_box_options(cmd: argparse.ArgumentParser) -> None:
    cmd.add_argument(
        "--boxes",
        type=int,
        choices=(1, 2),
        default=1,
        help="2: compare two independent boxes with a cross-box split (needs --link-gbps)",
    )
    cmd.add_argument(
        "--link-gbps", type=float, help="the network link between boxes, Gb/s (e.g. 400)"
    )
    cmd.add_argument(
        "--rates", type=float, nargs="+", help="with --boxes 2: the rates (default: --rate)"
    )
    cmd.add_argument(
        "--workloads",
        nargs="+",
        choices=WORKLOADS,
        help="with --boxes 2: the workloads (default: --workload)",
    )


def run(args: argparse.Namespace) -> int:
    """Plan and print it; exit 2 with a one-line error on bad input."""
    try:
        return _run(args)
    except (ValueError, OSError) as exc:  # ProfileError and SettingsError are ValueErrors
        print(f"appliance plan: {exc}", file=sys.stderr)
        return 2


def _run(args: argparse.Namespace) -> int:
    slo = SLO.parse(args.goodput)
    if args.num_requests < 1:
        raise ValueError(f"--num-requests must be at least 1, got {args.num_requests}")
    if args.boxes == 2:
        return _run_two_boxes(args, slo)
    if args.rate is None:
        raise ValueError("the plan needs --rate (request rate, req/s)")
    spec = PlanSpec(rate=args.rate, slo=slo, full_only=not args.all_layouts)
    settings = load_settings(getattr(args, "config", None))
    profile = _profile(args, settings)
    policy = _policy(args, settings)
    requests = _requests(args, profile, settings, args.workload, args.rate)
    plan = make_plan(profile, requests, spec, args.workload, policy)
    _print(plan, args.json)
    if args.out:
        paths = plan_report.write(plan, args.out)
        print(f"plan written to {', '.join(map(str, paths))}", file=sys.stderr)
    return 0


def _run_two_boxes(args: argparse.Namespace, slo: SLO) -> int:
    """The comparison table of two boxes: each workload at each rate."""
    if args.link_gbps is None:
        raise ValueError(
            "--boxes 2 needs the network link between the boxes: --link-gbps (e.g. 400)"
        )
    if args.out or args.json:
        raise ValueError("--boxes 2 prints a markdown table: --out and --json are for one box")
    rates = args.rates or ([args.rate] if args.rate is not None else [])
    if not rates or any(not (math.isfinite(r) and r > 0) for r in rates):
        raise ValueError(f"--boxes 2 needs finite positive --rate or --rates, got {rates}")
    settings = load_settings(getattr(args, "config", None))
    profile = _profile(args, settings)
    policy = _policy(args, settings)
    rows = []
    for workload in args.workloads or [args.workload]:
        requests = _requests(args, profile, settings, workload, rates[0])
        for both in two_boxes.compare_at_rates(profile, requests, rates[0], rates, slo, policy):
            rows.append((workload, both))
    print(two_boxes.heading(profile, args.num_requests, slo))
    print()
    print(two_boxes.table(rows))
    return 0


def _policy(args: argparse.Namespace, settings: Settings) -> Policy:
    """The settings' policy, speculating at --spec-acceptance where it is given."""
    policy = Policy.from_settings(settings)
    acceptance = getattr(args, "spec_acceptance", None)
    if acceptance is None:
        return policy
    if settings.speculative.method == "off":
        raise ValueError("--spec-acceptance plans a speculating server: set speculative.method")
    return replace(policy, speculation=Speculation.from_settings(settings.speculative, acceptance))


def _profile(args: argparse.Namespace, settings: Settings) -> Profile:
    if args.analytic:
        if not args.model_shape:
            raise ValueError(
                f"--analytic needs --model-shape, one of {', '.join(sorted(MODEL_SHAPES))}"
            )
        return analytic_profile(
            args.analytic,
            args.gpus,
            args.model_shape,
            max_batch=settings.batch.max_num_seqs,
            link_gbps=args.link_gbps,
        )
    profile = _measured_profile(args, settings)
    if args.link_gbps is not None:  # a measured box's link is stated, not measured
        return profile.model_copy(update={"network": network_link(args.link_gbps)})
    return profile


def _measured_profile(args: argparse.Namespace, settings: Settings) -> Profile:
    if args.profile:
        return load_profile(args.profile)
    from appliance.model.model_source import default_model_path

    folder = profiles_folder(settings.cache_dir)
    model = model_id(settings.model or default_model_path())
    profile = newest_profile(folder, model)
    if profile is None:
        raise ProfileError(
            f"no profile of {model} under {folder}: run `appliance profile` first, or pass "
            "--profile FILE, or --analytic GPU --gpus N --model-shape NAME"
        )
    return profile


def _requests(
    args: argparse.Namespace, profile: Profile, settings: Settings, workload: str, rate: float
) -> list[SimRequest]:
    if workload == "sharegpt-like":
        return sharegpt_like(args.seed, args.num_requests, rate, profile.max_model_len)
    from appliance.model.model_source import prepare_tokenizer

    tokenizer = prepare_tokenizer(None, settings.cache_dir)[1]
    return requests_from_workload(
        workload,
        tokenizer,
        args.seed,
        args.num_requests,
        rate=rate,
        input_len=args.input_len,
        output_len=args.output_len,
    )


def sharegpt_like(
    seed: int, num_requests: int, rate: float, max_model_len: int
) -> list[SimRequest]:
    """ShareGPT-like requests (log-normal prompt and answer lengths, see SHAREGPT_*)
    arriving as a Poisson process of `rate` per second, drawn from `seed`."""
    rng = random.Random(seed)
    requests: list[SimRequest] = []
    now = 0.0
    for _ in range(num_requests):
        now += rng.expovariate(rate)
        prompt = int(min(max_model_len * 3 // 4, max(4, rng.lognormvariate(*SHAREGPT_PROMPT))))
        room = max_model_len - prompt
        output = int(min(room, max(2, rng.lognormvariate(*SHAREGPT_OUTPUT))))
        requests.append(SimRequest(arrival_s=now, prompt_tokens=prompt, output_tokens=output))
    return requests


def _print(plan: Plan, as_json: bool) -> None:
    if as_json:
        print(json.dumps(plan_report.payload(plan), indent=1, allow_nan=False))
        return
    print(plan_report.heading(plan))
    print()
    print(plan_report.table(plan))
    for note in _notes(plan):
        print(note)


def _notes(plan: Plan) -> list[str]:
    best = plan.best
    notes = [f"\nbest: {best.label} ({best.layout.settings()})"]
    if plan.analytic:
        notes.append("analytic profile: predictions from datasheets, not measurements")
    return notes


def main(argv: list[str] | None = None) -> int:  # for `python -m appliance.planner.plan_cli`
    parser = argparse.ArgumentParser(prog="appliance")
    add_parser(parser.add_subparsers(dest="command", required=True))
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
