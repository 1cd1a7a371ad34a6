"""The sampler's cost per decode step on the CPU: `Sampler.sample` over [rows, vocab] logits
of the default model's vocabulary, greedy and sampled (unseeded, seeded, with top-p), beside
the floor every sampled row pays anyway (a softmax of its logits). One thread, as a worker
a core runs it; microseconds per step, median of `--repeats`.

    .venv/bin/python benchmarks/sampler_bench.py [--rows 1 16] [--repeats 50]
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

import torch
from timing import best_seconds

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


def best_us(step: Callable[[], object], repeats: int) -> float:
    return best_seconds(step, repeats) * 1e6


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
    floor = best_us(lambda: logits.softmax(-1), repeats)
    steps = [lambda p=p: sampler.sample(logits, rows_of(p, count)) for p in SETTINGS.values()]
    return floor, [best_us(step, repeats) for step in steps]


if __name__ == "__main__":
    main()
