"""What exact tensor-parallel answers cost one process: decode on the quantized path with
and without the spans of row-parallel products (tensor_parallel.row_parallel_spans).

An appliance that configures a degree above 1 sums each span between two splits of that
degree on its own (so its groups answer as one process does); one with every degree 1
sums whole rows. Both engines run in this process, alternating, best of `--repeats`.

    .venv/bin/python benchmarks/span_cost_bench.py            # groups of 2
    .venv/bin/python benchmarks/span_cost_bench.py --tp 3 --cpu-isa avx2
"""

from __future__ import annotations

import argparse

import torch
from llama_cpp_bench import cpu_isa, ours_decode

from appliance.engine.llm_engine import LLMEngine
from appliance.model import cpu_kernels
from appliance.model.tensor_parallel import row_parallel_spans
from appliance.settings.config import load_settings
from appliance.topology.cpu import cpu_model_name


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tp", type=int, default=2, help="the configured degree")
    parser.add_argument("--cpu-isa", default="auto")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    base = {"device": "cpu", "weights": "quantized", "cpu_isa": args.cpu_isa}
    engines = {
        "whole rows (every degree 1)": LLMEngine.from_settings(load_settings(**base)),
        f"spans (prefill_tp={args.tp})": LLMEngine.from_settings(
            load_settings(**base, prefill_tp=args.tp)
        ),
    }
    spans = row_parallel_spans(next(iter(engines.values())).model.config, (args.tp,))
    print(f"CPU: {cpu_model_name()} ({cpu_isa()}); {torch.get_num_threads()} threads; kernels "
          f"{cpu_kernels.level()}; spans {spans}; best of {args.repeats}\n")  # fmt: skip
    print("| decode tok/s | " + " | ".join(engines) + " | ratio |")
    print("|---|" + "---:|" * (len(engines) + 1))
    for batch in (1, 16):
        best = dict.fromkeys(engines, 0.0)
        for _ in range(args.repeats):
            for name, engine in engines.items():
                prompt = 32 if batch == 1 else 128
                best[name] = max(best[name], ours_decode(engine, batch, prompt, 128))
        whole, spanned = best.values()
        print(f"| batch {batch} | {whole:.1f} | {spanned:.1f} | {spanned / whole:.2f}x |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
