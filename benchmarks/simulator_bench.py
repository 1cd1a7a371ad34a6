"""How fast the planner's simulator runs: 10,000 chat-workload requests (the very ones
`appliance bench --workload chat --seed 0 --request-rate R` sends) through a 1P+1D and a
colocated x2 layout, on a hand-built profile resembling a small CPU box (decode step
15 ms + 0.5 ms a sequence, prefill 2 ms + 0.25 ms a token). The target: each layout
simulated in under 5 s of wall time.

Run from the repository root: .venv/bin/python benchmarks/simulator_bench.py
[--requests N] [--rate R]
"""

from __future__ import annotations

import argparse
import math
import time
from pathlib import Path

from appliance.core.goodput import SLO, summarize
from appliance.model.model_source import prepare_tokenizer
from appliance.planner.layout import Layout, Pool
from appliance.planner.profile import (
    HandoffCost,
    HostCost,
    Profile,
    ProfileKey,
    StepCost,
    WorkerCost,
)
from appliance.planner.simulator import requests_from_workload, simulate
from appliance.settings.config import load_settings
from appliance.topology.cpu import cpu_model_name

LAYOUTS = (
    Layout(mode="disaggregated", prefill=Pool(workers=1), decode=Pool(workers=1)),
    Layout(mode="colocated", prefill=Pool(workers=2)),
)


def cpu_name() -> str:
    """The CPU's model name and the best of the ISAs the kernels pick from."""
    text = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    flags = next(
        (
            set(line.split(":", 1)[1].split())
            for line in text.splitlines()
            if line.startswith("flags")
        ),
        set[str](),
    )
    isa = next((f for f in ("avx512_bf16", "avx512f", "avx2") if f in flags), "no avx2")
    return f"{cpu_model_name()} ({isa})"


def cpu_like_profile() -> Profile:
    """Step costs of the order SmolLM2-135M has on one core of a small CPU box."""
    worker = WorkerCost(
        prefill=StepCost(base_s=0.002, per_token_s=0.00025, per_attended_s=1e-9),
        decode=StepCost(base_s=0.015, per_seq_s=0.0005, per_context_s=2e-7),
        mixed=StepCost(base_s=0.015, per_token_s=0.00025, per_seq_s=0.0005, per_context_s=2e-7),
        kv_blocks=4096,
        contention=1.2,
    )
    return Profile(
        key=ProfileKey(model="bench", dtype="float32", weights="dense", device_kind="cpu"),
        atoms=2,
        block_size=16,
        kv_bytes_per_token=46080,  # 30 layers x K,V x 3 heads x 64 x float32
        max_model_len=8192,
        workers={"1x1": worker},
        handoff=HandoffCost(base_s=0.0005, per_byte_s=1e-10),
        host=HostCost(per_step_s=0.0003, per_token_s=0.0001),
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=10_000)
    parser.add_argument("--rate", type=float, default=8.0, help="Poisson arrivals per second")
    args = parser.parse_args()
    tokenizer = prepare_tokenizer(None, load_settings().cache_dir)[1]
    began = time.perf_counter()
    requests = requests_from_workload("chat", tokenizer, 0, args.requests, rate=args.rate)
    made = time.perf_counter() - began
    profile = cpu_like_profile()
    print(f"CPU: {cpu_name()}")
    print(
        f"{args.requests} chat requests at {args.rate} req/s (made in {made:.1f} s); "
        "profile: decode 15 ms + 0.5 ms/seq, prefill 2 ms + 0.25 ms/token, contention 1.2\n"
    )
    print(
        "| layout | requests | simulated s | wall s | requests/s simulated | "
        "TTFT p50 ms | TPOT p50 ms | TPOT p99 ms |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for layout in LAYOUTS:
        began = time.perf_counter()
        results = simulate(profile, layout, requests)
        wall = time.perf_counter() - began
        span = max(r.start + r.latency for r in results)
        summary = summarize(results, span, SLO())
        print(
            f"| {layout.label} | {len(results)} | {span:.1f} | {wall:.2f} | "
            f"{len(results) / wall:,.0f} | {_ms(summary.ttft.median)} | "
            f"{_ms(summary.tpot.median)} | {_ms(summary.tpot.p99)} |"
        )


def _ms(seconds: float) -> str:
    return "-" if math.isnan(seconds) else f"{seconds * 1000:.1f}"


if __name__ == "__main__":
    main()
