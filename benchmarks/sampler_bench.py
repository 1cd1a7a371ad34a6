"""The sampler's cost per decode step on the CPU: `Sampler.sample` over [rows, vocab] logits
of the default model's vocabulary, greedy and sampled (unseeded, seeded, with top-p), beside
the floor every sampled row pays anyway (a softmax of its logits). One thread, as a worker
a core runs it; microseconds per step, best of `--repeats`. `--llama-cpp` times llama.cpp's
samplers instead (each at temperature 0.8: top-n-sigma, typical_p, XTC, dynamic
temperature, mirostat 1 and 2, DRY over a context of `--context` tokens).

    .venv/bin/python benchmarks/sampler_bench.py [--rows 1 16] [--repeats 50] [--llama-cpp]
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

import torch
from timing import best_seconds

from appliance.engine.sampling.sampler import Sampler, SampleRow
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
HOT = {"temperature": 0.8}
LLAMA_CPP = {
    "temperature 0.8": SamplingParams(**HOT),
    "top_n_sigma 1": SamplingParams(**HOT, top_n_sigma=1.0),
    "typical_p 0.9": SamplingParams(**HOT, typical_p=0.9),
    "xtc 0.5 / 0.1": SamplingParams(**HOT, xtc_probability=0.5, xtc_threshold=0.1),
    "dynatemp 0.5": SamplingParams(**HOT, dynatemp_range=0.5),
    "mirostat 1": SamplingParams(**HOT, mirostat=1),
    "mirostat 2": SamplingParams(**HOT, mirostat=2),
    "dry 0.8": SamplingParams(**HOT, dry_multiplier=0.8),
}


def best_us(step: Callable[[], object], repeats: int) -> float:
    return best_seconds(step, repeats) * 1e6


def rows_of(params: SamplingParams, count: int, context: list[int]) -> list[SampleRow]:
    return [SampleRow(i, params, context, len(context) // 2) for i in range(count)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--repeats", type=int, default=50)
    parser.add_argument("--llama-cpp", action="store_true", help="llama.cpp's samplers")
    parser.add_argument("--context", type=int, default=4096, help="tokens each row has read")
    args = parser.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    settings = LLAMA_CPP if args.llama_cpp else SETTINGS
    # A context drawn from a few hundred ids: it repeats itself, as text does, so DRY finds runs.
    context = torch.randint(0, 300, (args.context,)).tolist() if args.llama_cpp else [1, 2, 3]
    print(f"{cpu_model_name()}, kernels {level()}, 1 thread; vocabulary {VOCAB}", end="")
    print(f", {len(context)}-token contexts\n" if args.llama_cpp else "\n")
    print("| rows | softmax alone (floor) | " + " | ".join(settings) + " |")
    print("|---:|---:|" + "---:|" * len(settings))
    for count in args.rows:
        floor, cells = timings(settings, count, context, args.repeats)
        print(f"| {count} | {floor:.0f} µs | " + " | ".join(f"{c:.0f} µs" for c in cells) + " |")


def timings(
    settings: dict[str, SamplingParams], count: int, context: list[int], repeats: int
) -> tuple[float, list[float]]:
    """Microseconds of a softmax of [count, VOCAB] logits, then of a step of each setting
    (a sampler of its own: mirostat's controllers start alike in each)."""
    logits = torch.randn(count, VOCAB) * 3  # [rows, vocab]: a flat-ish row, a wide nucleus
    floor = best_us(lambda: logits.softmax(-1), repeats)
    cells = []
    for params in settings.values():
        sampler, rows = Sampler(torch.device("cpu")), rows_of(params, count, context)
        cells.append(best_us(lambda s=sampler, r=rows: s.sample(logits, r), repeats))
    return floor, cells


if __name__ == "__main__":
    main()
