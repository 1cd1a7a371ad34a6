"""Greedy agreement with the float32 dense engine: 12 chat prompts x 64 tokens.

For each way of running the default model (the quantized kernels at each ISA level this
CPU has, the same with llama.cpp's 8-bit activations instead of our two 8-bit parts, and
dense bfloat16, the path `dtype=auto` took before on CPUs with AVX512-BF16)
it counts, per prompt, how many leading tokens equal the float32 dense engine's, and how
many prompts agree on all 64. Quantized outputs follow llama.cpp's arithmetic (int8
activations), so they leave float32 at the first near-tie.

    .venv/bin/python benchmarks/quant_accuracy.py
"""

from __future__ import annotations

import statistics

from appliance.config import load_settings
from appliance.engine.llm_engine import LLMEngine
from appliance.engine.sequence import SamplingParams
from appliance.model import cpu_kernels
from appliance.model.quant import QuantLinear

QUESTIONS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain photosynthesis in one sentence.",
    "List three primary colors.",
    "What is 12 times 7?",
    "Give me a tip for learning Python.",
    "Who wrote Romeo and Juliet?",
    "Describe a cat to someone who has never seen one.",
    "What does a CPU do?",
    "Suggest a name for a bakery.",
    "Why is the sky blue?",
    "Translate 'good morning' into Spanish.",
]
PARAMS = SamplingParams(max_tokens=64, temperature=0, ignore_eos=True)


def answers(eight_bit: bool = False, **settings: object) -> list[list[int]]:
    engine = LLMEngine.from_settings(
        load_settings(device="cpu", kv={"num_blocks": 256}, **settings)
    )
    for module in engine.model.modules():
        if isinstance(module, QuantLinear):
            module.precise = not eight_bit
    prompts = [
        engine.tokenizer.apply_chat_template([{"role": "user", "content": q}]) for q in QUESTIONS
    ]
    return [engine.generate([p], PARAMS)[0].token_ids for p in prompts]


def common_prefix(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), len(a))


def main() -> int:
    reference = answers(dtype="float32", weights="dense")
    rows = [(f"quantized, {level} kernels", {"weights": "quantized", "cpu_isa": level})
            for level in cpu_kernels.cpu_levels()]  # fmt: skip
    rows.append(
        ("quantized, 8-bit activations (llama.cpp's)", {"weights": "quantized", "eight_bit": True})
    )
    rows.append(("dense bfloat16", {"weights": "dense", "dtype": "bfloat16"}))
    print("| path vs float32 dense | prompts agreeing on all 64 | median tokens agreeing |")
    print("|---|---:|---:|")
    for label, settings in rows:
        got = answers(**settings)
        prefixes = [common_prefix(g, r) for g, r in zip(got, reference, strict=True)]
        full = sum(p == len(r) for p, r in zip(prefixes, reference, strict=True))
        print(f"| {label} | {full}/12 | {statistics.median(prefixes):.1f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
