"""The sampler's cost per decode step on the CPU: `Sampler.sample` over [rows, vocab] logits
of the default model's vocabulary, greedy and sampled (unseeded, seeded, with top-p), beside
the floor every sampled row pays anyway (a softmax of its logits). One thread, as a worker
a core runs it; microseconds per step, median of `--repeats`.

    .venv/bin/python benchmarks/sampler_bench.py [--rows 1 16] [--repeats 50]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from appliance.engine.sampler import Sampler, SampleRow
from appliance.engine.sequence import SamplingParams
from appliance.model.cpu_kernels.loading import level
from appliance.topology.cpu import cpu_model_name

VOCAB = 49152  # SmolLM2's
SETTINGS = {
    "greedy": SamplingParams(),
    "temperature 0.8": SamplingParams(temperature=0.8),
    "temperature 0.8, seeded": SamplingParams(temperature=0.8, seed=7),
    "temperature 0.8, top_p 0.9": SamplingParams(temperature=0.8, top_p=0.9),
}


def micros(step: Callable[[], object], repeats: int) -> float:
    """Median microseconds of `step` over `repeats` calls, after two to warm up."""
    for _ in range(2):
        step()
    times = []
    for _ in range(repeats):
        began = time.perf_counter()
        step()
        times.append(time.perf_counter() - began)
    return statistics.median(times) * 1e6


def rows_of(params: SamplingParams, count: int) -> list[SampleRow]:
    return [SampleRow(i, params, [1, 2, 3], 3) for i in range(count)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--repeats", type=int, default=50)
    args = parser.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    sampler = Sampler(torch.device("cpu"))
    print(f"{cpu_model_name()}, kernels {level()}, 1 thread; vocabulary {VOCAB}\n")
    print("| rows | softmax alone (floor) | " + " | ".join(SETTINGS) + " |")
    print("|---:|---:|" + "---:|" * len(SETTINGS))
    for count in args.rows:
        floor, cells = timings(sampler, count, args.repeats)
        print(f"| {count} | {floor:.0f} µs | " + " | ".join(f"{c:.0f} µs" for c in cells) + " |")


def timings(sampler: Sampler, count: int, repeats: int) -> tuple[float, list[float]]:
    """Microseconds of a softmax of [count, VOCAB] logits, then of a step of each setting."""
    logits = torch.randn(count, VOCAB) * 3  # [rows, vocab]: a flat-ish row, a wide nucleus
    floor = micros(lambda: logits.softmax(-1), repeats)
    steps = [lambda p=p: sampler.sample(logits, rows_of(p, count)) for p in SETTINGS.values()]
    return floor, [micros(step, repeats) for step in steps]


if __name__ == "__main__":
    main()
