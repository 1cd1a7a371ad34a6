"""Batch-1 decode step time of a random mixture-of-experts model (Mixtral layout, 8
experts, top-2) against its dense equivalents: one with the same active parameters (an
MLP as wide as the two routed experts together) and one with the same total parameters
(an MLP as wide as all eight). A decode step that reads only the routed experts' weights
runs near the first; one that computed every expert would run near the second.

Each model is saved by transformers as a folder (float32, a small vocabulary so the LM
head does not hide the layers) and served by our engine on the CPU, float32, dense
weights. A step's time is (best time of 1 + N tokens - best time of 1 token) / N over
`--repeats` runs interleaved across the three models, after a warm-up. The "FFN
MB/step" column is the feed-forward weights a step reads (routed experts, or the MLP).

Run from the repository root:  .venv/bin/python benchmarks/moe_step_bench.py
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
import time
from pathlib import Path

import torch

from appliance.engine.llm_engine import LLMEngine
from appliance.engine.sequence import SamplingParams
from appliance.model.model_source import prepare_model
from appliance.settings.config import load_settings
from appliance.topology.cpu import cpu_model_name

HIDDEN, LAYERS, HEADS, KV_HEADS, VOCAB = 1024, 4, 16, 4, 1024
EXPERTS, TOP_K, EXPERT_WIDTH = 8, 2, 1024


def build(kind: str, folder: Path) -> Path:
    """A random model saved with the embedded model's tokenizer beside it."""
    from transformers import LlamaConfig, MixtralConfig

    common = {
        "vocab_size": VOCAB,
        "hidden_size": HIDDEN,
        "num_hidden_layers": LAYERS,
        "num_attention_heads": HEADS,
        "num_key_value_heads": KV_HEADS,
        "max_position_embeddings": 512,
        "tie_word_embeddings": False,
    }
    if kind == "moe":
        config = MixtralConfig(
            intermediate_size=EXPERT_WIDTH,
            num_local_experts=EXPERTS,
            num_experts_per_tok=TOP_K,
            **common,
        )
    else:
        experts = TOP_K if kind == "active" else EXPERTS
        config = LlamaConfig(intermediate_size=experts * EXPERT_WIDTH, **common)
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.save_pretrained(folder)
    tokenizer_dir = prepare_model(None, load_settings().cache_dir)[1]
    shutil.copy(tokenizer_dir / "tokenizer.json", folder / "tokenizer.json")
    return folder


def run_seconds(engine: LLMEngine, tokens: int) -> float:
    """Seconds to generate `tokens` tokens after a 16-token prompt."""
    start = time.perf_counter()
    engine.generate([list(range(1, 17))], SamplingParams(max_tokens=tokens, ignore_eos=True))
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: its default)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    ffn_mb = {  # float32 feed-forward bytes a step reads, all layers
        "moe": LAYERS * TOP_K * 3 * HIDDEN * EXPERT_WIDTH * 4 / 2**20,
        "active": LAYERS * TOP_K * 3 * HIDDEN * EXPERT_WIDTH * 4 / 2**20,
        "total": LAYERS * EXPERTS * 3 * HIDDEN * EXPERT_WIDTH * 4 / 2**20,
    }
    names = {
        "moe": f"MoE {EXPERTS} experts top-{TOP_K}",
        "active": f"dense, same active ({TOP_K * EXPERT_WIDTH} wide)",
        "total": f"dense, same total ({EXPERTS * EXPERT_WIDTH} wide)",
    }
    engines = {}
    with tempfile.TemporaryDirectory() as tmp:
        for kind in names:
            settings = load_settings(
                model=build(kind, Path(tmp) / kind), dtype="float32", device="cpu", weights="dense"
            )
            engines[kind] = LLMEngine.from_settings(settings)
    # Interleaved, so background load on a shared machine hits every model alike; the
    # best long run less the best short one (a best difference would favour a slow short).
    long, short = dict.fromkeys(names, float("inf")), dict.fromkeys(names, float("inf"))
    for repeat in range(args.repeats + 1):  # the first is a warm-up
        for kind, engine in engines.items():
            seconds = run_seconds(engine, args.tokens + 1), run_seconds(engine, 1)
            if repeat:
                long[kind], short[kind] = min(long[kind], seconds[0]), min(short[kind], seconds[1])
    best = {kind: (long[kind] - short[kind]) / args.tokens for kind in names}
    rows = [(names[kind], ffn_mb[kind], best[kind]) for kind in names]
    load = os.getloadavg()[0]
    print(
        f"CPU: {cpu_model_name()}, {os.cpu_count()} cores, "
        f"{torch.get_num_threads()} torch threads, load average {load:.1f}, "
        f"torch {torch.__version__}"
    )
    print(f"hidden {HIDDEN}, {LAYERS} layers, vocab {VOCAB}, float32, batch 1")
    print("| model | FFN MB/step | ms/step | vs MoE |")
    print("|---|---:|---:|---:|")
    base = rows[0][2]
    for name, mb, seconds in rows:
        print(f"| {name} | {mb:.0f} | {seconds * 1000:.2f} | {seconds / base:.2f}x |")


if __name__ == "__main__":
    main()
