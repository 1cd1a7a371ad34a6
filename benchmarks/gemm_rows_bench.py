"""Where a prompt's quantized products should leave the integer kernel for a GEMM, on this
CPU: the crossover row count behind the `prefill_gemm_rows` setting's auto table
(appliance/model/cpu_kernels/loading.py, GEMM_ROWS_BY_LEVEL).

For each kernel level this CPU runs (the cpu_isa cap) and each GEMM type (prefill_gemm:
float32, bfloat16, int16), at 8, 16, 32, 48, 64, 96, 128 and 256 rows, it times:

- one product: SmolLM2-135M's gate/up projection's shape (3072 x 576, random weights in
  Q4_0, the 4-bit format `quantize` writes; the embedded model's Q4_1 runs the same
  kernels) on the integer kernel against the GEMM path (the weight dequantized, then
  torch's GEMM or the int16 one);
- with `--model`, one whole-model prefill of the embedded model (a prompt of that many
  tokens, one output token, prefix caching off) with every product on the integer kernel
  against every product on the GEMM path.

Each case is the median of `--repeats` calls after one warm-up (medians, not minima: the
crossover is a ratio of two times taken on a box others may be using). It prints a table
of milliseconds and the crossover: the fewest rows from which the GEMM path was faster at
that count and at every larger one measured. One thread by default, as a worker on one
core runs.

Run from the repository root:
    .venv/bin/python benchmarks/gemm_rows_bench.py [--model] [--levels avx512 avx2]
"""

from __future__ import annotations

import argparse
import functools
import statistics
import time
from collections.abc import Callable, Sequence

import torch

from appliance.model import cpu_kernels
from appliance.model.quant import quantize

ROWS = (8, 16, 32, 48, 64, 96, 128, 256)
GEMM_TYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "int16": torch.int16}
GATE_UP = (3072, 576)  # SmolLM2-135M's fused gate/up projection: (out, in)
NEVER = 1 << 30  # a row count no step reaches: every product on the integer kernel


def median_seconds(fn: Callable[[], object], repeats: int) -> float:
    """Median of `repeats` timed calls after one untimed warm-up call."""
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def crossover(kernel: Sequence[float], gemm: Sequence[float], rows: Sequence[int]) -> int | None:
    """The fewest rows from which the GEMM was faster there and at every larger count."""
    found = None
    for count, k, g in reversed(list(zip(rows, kernel, gemm, strict=True))):
        if g >= k:
            break
        found = count
    return found


def product_times(
    gemm: torch.dtype, rows: Sequence[int], repeats: int
) -> tuple[list[float], list[float]]:
    """Seconds of one gate/up product per row count: (integer kernel, GEMM path)."""
    out, inp = GATE_UP
    weight = quantize(torch.randn(out, inp, generator=torch.Generator().manual_seed(0)), "Q4_0")
    matrix = cpu_kernels.QuantMatrix(weight.blocks, weight.format.ggml_id, inp)
    kernel, by_gemm = [], []
    for count in rows:
        x = torch.randn(count, inp)  # [rows, in] activations
        kernel.append(median_seconds(functools.partial(matrix, x, gemm_rows=None), repeats))
        on_gemm = functools.partial(matrix, x, gemm_dtype=gemm, gemm_rows=1)
        by_gemm.append(median_seconds(on_gemm, repeats))
    return kernel, by_gemm


def prefill_times(
    gemm_name: str, isa: str, rows: Sequence[int], repeats: int
) -> tuple[list[float], list[float]]:
    """Seconds of one whole-model prefill per prompt length: (integer kernel, GEMM path)."""
    from appliance.engine.llm_engine import LLMEngine
    from appliance.engine.sequence import SamplingParams
    from appliance.settings.config import load_settings

    settings = load_settings(
        device="cpu",
        weights="quantized",
        cpu_isa=isa,
        prefill_gemm=gemm_name,
        kv={"prefix_caching": False, "num_blocks": 64},
    )
    engine = LLMEngine.from_settings(settings)
    prefill = engine.model.prefill_gemm
    assert prefill is not None  # the quantized path installs it
    params = SamplingParams(max_tokens=1, ignore_eos=True)
    ids = engine.tokenizer.encode("The quick brown fox jumps over the lazy dog. " * 40)
    kernel, by_gemm = [], []
    for count in rows:

        def run(prompt: list[int] = ids[:count]) -> None:
            engine.generate([prompt], params)

        prefill.rows = NEVER
        kernel.append(median_seconds(run, repeats))
        prefill.rows = 1
        by_gemm.append(median_seconds(run, repeats))
    return kernel, by_gemm


def report(title: str, rows: Sequence[int], kernel: list[float], gemm: list[float]) -> None:
    print(f"\n{title}")
    print("| rows | integer kernel (ms) | GEMM path (ms) | kernel / GEMM |")
    print("|---:|---:|---:|---:|")
    for count, k, g in zip(rows, kernel, gemm, strict=True):
        print(f"| {count} | {k * 1e3:.2f} | {g * 1e3:.2f} | {k / g:.2f} |")
    print(f"crossover: {crossover(kernel, gemm, rows)} rows")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--levels", nargs="*", help="kernel levels (default: every one)")
    parser.add_argument("--gemms", nargs="*", default=list(GEMM_TYPES), choices=GEMM_TYPES)
    parser.add_argument("--rows", nargs="*", type=int, default=list(ROWS))
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--model", action="store_true", help="also whole-model prefills")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    levels = args.levels or list(reversed(cpu_kernels.cpu_levels()))
    if not levels:
        print("no CPU kernels built: nothing to compare")
        return 1
    print(f"torch {torch.__version__}, threads {args.threads}, repeats {args.repeats} (median)")
    for isa in levels:
        if cpu_kernels.select(isa) != isa:
            print(f"\nlevel {isa}: this CPU does not run it")
            continue
        for name in args.gemms:
            gemm = GEMM_TYPES[name]
            auto = cpu_kernels.prefill_gemm_rows("auto", gemm)
            tag = f"level {isa}, GEMM {name} (table: {auto})"
            report(
                f"{tag}: gate/up product", args.rows, *product_times(gemm, args.rows, args.repeats)
            )
            if args.model:
                times = prefill_times(name, isa, args.rows, args.repeats)
                report(f"{tag}: whole-model prefill", args.rows, *times)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
