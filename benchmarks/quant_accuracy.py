"""Greedy agreement with the float32 dense engine: 12 chat prompts x 64 tokens.

A second table asks the same questions after a passage of about 270 tokens, so that each
prompt is prefilled by the GEMM path (128 rows or more), in float32, int16 and bfloat16
(`prefill_gemm`; bfloat16 runs natively only on CPUs with AVX512-BF16).

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

from appliance.engine.llm_engine import LLMEngine
from appliance.engine.sequence import SamplingParams
from appliance.model import cpu_kernels
from appliance.model.quant import QuantLinear
from appliance.settings.config import load_settings

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
PASSAGE = (
    "A serving appliance runs a language model on one box with several accelerators. It "
    "splits them into two pools. The prefill pool reads each prompt and builds its cache "
    "of keys and values; this work is bound by arithmetic, since every token of the prompt "
    "passes through every layer at once. The decode pool then produces one token per step "
    "for every running request, reading the whole cache and every weight again for each "
    "step; this work is bound by memory bandwidth. When both kinds of work share a device, "
    "a long prompt stalls every stream that is decoding, and users see their answers "
    "pause. When they are split, each pool is batched and sized on its own, and the cache "
    "is handed from one pool to the other over the fastest link inside the box. A "
    "supervisor process starts the workers, routes requests, watches their health and "
    "restarts any that fail; a console shows what each device is doing and lets the "
    "operator move a device from one pool to the other while requests keep flowing. "
    "Traffic changes during the day: short questions with long answers in the morning, "
    "long documents with short summaries in the afternoon. The best split changes with it."
)
PARAMS = SamplingParams(max_tokens=64, temperature=0, ignore_eos=True)


def answers(
    eight_bit: bool = False, long: bool = False, **settings: object
) -> tuple[list[list[int]], list[int]]:
    """Greedy answers to the 12 questions (after PASSAGE when `long`), prefix caching off:
    each prompt is prefilled whole; and the prompts' lengths in tokens."""
    kv = {"num_blocks": 256, "prefix_caching": False}
    engine = LLMEngine.from_settings(load_settings(device="cpu", kv=kv, **settings))
    for module in engine.model.modules():
        if isinstance(module, QuantLinear):
            module.precise = not eight_bit
    before = PASSAGE + "\n\n" if long else ""
    prompts = [
        engine.tokenizer.apply_chat_template([{"role": "user", "content": before + q}])
        for q in QUESTIONS
    ]
    got = [engine.generate([p], PARAMS)[0].token_ids for p in prompts]
    return got, [len(p) for p in prompts]


def span(lengths: list[int]) -> str:
    return f"{min(lengths)}-{max(lengths)}"


def common_prefix(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), len(a))


def main() -> int:
    reference, lengths = answers(dtype="float32", weights="dense")
    rows = [(f"quantized, {level} kernels", {"weights": "quantized", "cpu_isa": level})
            for level in cpu_kernels.cpu_levels()]  # fmt: skip
    rows.append(
        ("quantized, 8-bit activations (llama.cpp's)", {"weights": "quantized", "eight_bit": True})
    )
    rows.append(("dense bfloat16", {"weights": "dense", "dtype": "bfloat16"}))
    print(f"chat prompts ({span(lengths)} tokens: under 128, the integer "
          "kernel prefills them)\n")  # fmt: skip
    table(rows, reference)
    long_reference, long_lengths = answers(long=True, dtype="float32", weights="dense")
    long_rows = [
        (f"quantized, prefill GEMM {gemm}", {"weights": "quantized", "prefill_gemm": gemm})
        for gemm in ("float32", "int16", "bfloat16")
    ]
    print(f"\nthe same questions after a passage ({span(long_lengths)} tokens: "
          "the GEMM prefills them)\n")  # fmt: skip
    table(long_rows, long_reference, long=True)
    return 0


def table(rows: list[tuple[str, dict]], reference: list[list[int]], long: bool = False) -> None:
    print("| path vs float32 dense | prompts agreeing on all 64 | median tokens agreeing |")
    print("|---|---:|---:|")
    for label, settings in rows:
        got, _ = answers(long=long, **settings)
        prefixes = [common_prefix(g, r) for g, r in zip(got, reference, strict=True)]
        full = sum(p == len(r) for p, r in zip(prefixes, reference, strict=True))
        print(f"| {label} | {full}/12 | {statistics.median(prefixes):.1f} |")


if __name__ == "__main__":
    raise SystemExit(main())
