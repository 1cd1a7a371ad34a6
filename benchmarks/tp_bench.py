"""Tensor parallelism on this machine: one colocated worker split over 2 devices (TP=2)
against one worker on the same cores (TP=1), in one run.

    .venv/bin/python benchmarks/tp_bench.py [--repeats 3]

Layouts, all colocated with dense weights (shards do not split 4-bit ones):
- TP=1 on one core; TP=1 on every core (intra-op threads);
- TP=2, one core per shard, all-reducing over gloo.
Per layout: TTFT of a lone 1024-token prompt (prefill), decode tokens/s of one request
(64 tokens) and of 8 at once (32 each), first token excluded. Best of --repeats after
one warm-up. Ratios are against TP=1 on the same cores as TP=2. Written to --out too.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import sys
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

import torch

from appliance.api import Appliance
from appliance.engine.sequence import SamplingParams
from appliance.model.model_source import prepare_tokenizer
from appliance.settings.config import load_settings
from appliance.topology.devices import Device, Topology

OUT = Path(__file__).resolve().parent / "results" / "tensor_parallel_cpu.md"
PROMPT = "A lighthouse keeper kept a log of every ship that passed, and the weather. "


@dataclass
class Layout:
    label: str
    core_sets: list[tuple[int, ...]]
    tp: int


@dataclass
class Figures:
    prefill_ms: float
    decode_b1: float
    decode_b8: float


def topology(core_sets: list[tuple[int, ...]]) -> Topology:
    devices = [
        Device("cpu", i, f"cores {','.join(map(str, c))}", 0, 0, cores=c)
        for i, c in enumerate(core_sets)
    ]
    return Topology.without_links(devices)


async def one(app: Appliance, ids: list[int], tokens: int) -> dict[str, float]:
    params = SamplingParams(max_tokens=tokens, ignore_eos=True)
    async for chunk in app.generate(ids, params=params):
        timing = chunk.timing
    return timing


async def measure(app: Appliance, prompt: list[int], short: list[int]) -> Figures:
    lone = await one(app, prompt, 1)
    b1 = await one(app, short, 64)
    b8 = await asyncio.gather(*(one(app, short[i:], 32) for i in range(8)))
    decode_s = max(t["finished"] for t in b8) - max(t["first_token"] for t in b8)
    return Figures(
        (lone["first_token"] - lone["prefill_start"]) * 1000,
        63 / (b1["finished"] - b1["first_token"]),
        8 * 31 / decode_s,
    )


def run_layout(layout: Layout, prompt: list[int], short: list[int], repeats: int) -> Figures:
    settings = load_settings(
        mode="colocated",
        weights="dense",
        prefill_tp=layout.tp,
        kv={"prefix_caching": False},  # every repeat prefills the whole prompt
    )

    async def main() -> Figures:
        async with Appliance(settings, topology(layout.core_sets)) as app:
            await measure(app, prompt, short)  # warm-up
            runs = [await measure(app, prompt, short) for _ in range(repeats)]
        return Figures(
            min(r.prefill_ms for r in runs),
            max(r.decode_b1 for r in runs),
            max(r.decode_b8 for r in runs),
        )

    return asyncio.run(main())


def table(results: dict[str, Figures], baseline: str) -> str:
    base = results[baseline]
    lines = [
        "| layout | prefill 1024 tok (ms) | vs base | decode b1 (tok/s) | vs base "
        "| decode b8 (tok/s) | vs base |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for label, f in results.items():
        lines.append(
            f"| {label} | {f.prefill_ms:.0f} | {base.prefill_ms / f.prefill_ms:.2f}× "
            f"| {f.decode_b1:.1f} | {f.decode_b1 / base.decode_b1:.2f}× "
            f"| {f.decode_b8:.1f} | {f.decode_b8 / base.decode_b8:.2f}× |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args()
    cores = sorted(os.sched_getaffinity(0))[:2]
    if len(cores) < 2:
        sys.exit("tp_bench needs 2 cores")
    settings = load_settings()
    _, tokenizer = prepare_tokenizer(settings.model, settings.cache_dir)
    ids = tokenizer.encode(PROMPT * 80)
    prompt, short = ids[:1024], ids[:40]
    layouts = [
        Layout(f"TP=1, core {cores[0]}", [(cores[0],)], 1),
        Layout(f"TP=1, cores {cores[0]},{cores[1]} (threads)", [tuple(cores)], 1),
        Layout(f"TP=2, core {cores[0]} and core {cores[1]}", [(c,) for c in cores], 2),
    ]
    results = {}
    for layout in layouts:
        print(f"running {layout.label} ...", file=sys.stderr)
        results[layout.label] = run_layout(layout, prompt, short, args.repeats)
    body = table(results, layouts[1].label)
    header = (
        "# Tensor parallelism on the CPU (benchmarks/tp_bench.py)\n\n"
        f"- date: {datetime.now(UTC).isoformat(timespec='seconds')}\n"
        f"- torch {torch.__version__}, python {platform.python_version()}, "
        f"{len(os.sched_getaffinity(0))} cores usable\n"
        "- colocated, dense weights, dtype auto, prefix caching off; "
        f"best of {args.repeats} after a warm-up; "
        "'vs base' is against TP=1 on the same two cores\n\n"
    )
    print(header + body)
    args.out.write_text(header + body + "\n")


if __name__ == "__main__":
    main()
