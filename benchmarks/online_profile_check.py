"""Does the online profile predict the box? A fresh `appliance serve` (default settings, no
profile on disk) serves a run of traffic; its workers' steps are fitted as they run
(GET /admin/profile); then a second run of different requests is served and measured, and
the simulator, fed only that online profile, replays the second run's requests on the
layout the server runs. The table: TTFT and TPOT p50 (and p90) predicted / measured.

    .venv/bin/python benchmarks/online_profile_check.py [--rate 1.0] [--num-requests 40]

The profile is fitted on the first run and frozen before the second is measured: it is
never fitted to the requests it predicts.
"""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
import tempfile
from pathlib import Path

import httpx

from appliance.bench.compare import Target, running
from appliance.core.goodput import SLO, RequestResult, Summary, summarize
from appliance.model.model_source import prepare_tokenizer
from appliance.planner.layout import Layout, Pool
from appliance.planner.plan import duration_of
from appliance.planner.profile import Profile
from appliance.planner.simulator import Policy, requests_from_workload, simulate
from appliance.settings.config import load_settings
from appliance.topology.cpu import cpu_model_name

ROOT = Path(__file__).resolve().parent.parent
SLO_SPEC = ["ttft:3000", "tpot:100"]
WARMUP = 2
TOLERANCE = 0.2  # the bound on the medians


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workload", default="chat")
    parser.add_argument("--rate", type=float, default=1.0)
    parser.add_argument("--num-requests", type=int, default=40)
    parser.add_argument(
        "--out", type=Path, default=ROOT / "benchmarks/results/online_profile_cpu.md"
    )
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as folder:
        base = Path(folder)
        env = {
            "APPLIANCE_CACHE_DIR": str(base / "cache"),  # no profile on disk: online only
            "APPLIANCE_ADMIN__TOKEN_FILE": str(base / "admin.token"),
        }
        serve = [sys.executable, "-m", "appliance.cli", "serve"]
        target = Target("default settings", serve, env, port_flag=None)
        with running(target, base / "logs") as url:
            bench(url, args, seed=1, out=base / "fit")  # the steps the profile is fitted on
            profile = fetch_profile(url, base / "admin.token")
            layout = served_layout(url, base / "admin.token")
            bench(url, args, seed=2, out=base / "measured")
            measured = json.loads((base / "measured" / "result.json").read_text())
    slo = SLO.parse(SLO_SPEC)
    actual = summary_of(measured, slo)
    predicted, simulated = predict(profile, layout, args, slo)
    text = report(args, layout, profile, predicted, actual)
    args.out.write_text(text)
    args.out.with_suffix(".json").write_text(
        json.dumps(per_request(profile, measured, simulated), indent=1)
    )
    print(text)
    return 0


def bench(url: str, args: argparse.Namespace, seed: int, out: Path) -> None:
    command = [
        *(sys.executable, "-m", "appliance.cli", "bench", "--url", url),
        *("--workload", args.workload, "--request-rate", str(args.rate)),
        *("--num-requests", str(args.num_requests), "--warmup", str(WARMUP)),
        *("--seed", str(seed), "--goodput", *SLO_SPEC, "--out", str(out)),
        *("--extra-body", json.dumps({"ignore_eos": True})),
    ]
    subprocess.run(command, check=False, cwd=ROOT)


def admin_get(url: str, token_file: Path, path: str) -> dict:
    token = token_file.read_text().strip()
    reply = httpx.get(url + path, headers={"Authorization": f"Bearer {token}"}, timeout=30)
    reply.raise_for_status()
    return reply.json()


def fetch_profile(url: str, token_file: Path) -> Profile:
    return Profile.model_validate(admin_get(url, token_file, "/admin/profile"))


def served_layout(url: str, token_file: Path) -> Layout:
    """The layout the server runs, from its devices' pools (one-device workers)."""
    snapshot = admin_get(url, token_file, "/admin/state")
    pools = [d["pool"] for d in snapshot["devices"] if d.get("worker")]
    count = {role: pools.count(role) for role in ("prefill", "decode", "colocated")}
    if count["colocated"] and not (count["prefill"] or count["decode"]):
        return Layout(mode="colocated", prefill=Pool(workers=count["colocated"]))
    return Layout(
        mode="disaggregated",
        prefill=Pool(workers=count["prefill"]),
        decode=Pool(workers=count["decode"]),
    )


def predict(
    profile: Profile, layout: Layout, args: argparse.Namespace, slo: SLO
) -> tuple[Summary, list[RequestResult]]:
    tokenizer = prepare_tokenizer(None, load_settings().cache_dir)[1]
    requests = requests_from_workload(
        args.workload, tokenizer, 2, args.num_requests, rate=args.rate, warmup=WARMUP
    )
    simulated = simulate(profile, layout, requests, Policy.from_settings(load_settings()))
    return summarize(simulated, duration_of(simulated), slo), simulated


def per_request(profile: Profile, measured: dict, simulated: list[RequestResult]) -> dict:
    """Each request measured beside its simulated twin (same seed, same order), and the
    profile: where a prediction misses, which requests and by how much."""
    keep = ("prompt_tokens", "output_tokens", "start", "ttft", "tpot")
    rows = []
    for real, sim in zip(measured["results"], simulated, strict=False):
        real_result = RequestResult.from_dict(real)
        rows.append(
            {
                "measured": {k: getattr(real_result, k) for k in keep},
                "simulated": {k: getattr(sim, k) for k in keep},
            }
        )
    return {"profile": profile.model_dump(mode="json"), "requests": rows}


def summary_of(run: dict, slo: SLO) -> Summary:
    fields = RequestResult.__dataclass_fields__
    results = [RequestResult(**{k: v for k, v in r.items() if k in fields}) for r in run["results"]]
    return summarize(results, run["summary"]["duration"], slo)


def report(
    args: argparse.Namespace, layout: Layout, profile: Profile, p: Summary, m: Summary
) -> str:
    rows = []
    for name, predicted, measured in (
        ("TTFT p50 (ms)", p.ttft.median, m.ttft.median),
        ("TPOT p50 (ms)", p.tpot.median, m.tpot.median),
        ("TTFT p90 (ms)", p.ttft.p90, m.ttft.p90),
        ("TPOT p90 (ms)", p.tpot.p90, m.tpot.p90),
    ):
        error = (predicted - measured) / measured if measured else math.inf
        within = "yes" if abs(error) <= TOLERANCE else "no"
        if "p90" in name:
            within = "-"
        rows.append(
            f"| {name} | {predicted * 1000:.0f} | {measured * 1000:.0f} | {error:+.0%} | {within} |"
        )
    units = ", ".join(sorted(profile.workers))
    return "\n".join(
        [
            "# The online profile against the box",
            "",
            f"CPU: {cpu_model_name()}. A fresh `appliance serve` with default settings runs "
            f"{layout.label}; {args.num_requests} {args.workload} requests at {args.rate} req/s "
            f"fit its profile (worker sizes {units}), then {args.num_requests} other requests "
            "at the same rate are measured and simulated on that profile.",
            "",
            "| figure | predicted | measured | error | within 20% |",
            "|---|---|---|---|---|",
            *rows,
            "",
            "Assumptions of the profile: " + "; ".join(profile.assumptions),
            "",
        ]
    )


if __name__ == "__main__":
    sys.exit(main())
