"""The KV cache's dtype (`kv_cache_dtype`) on the CPU: what bfloat16 K/V cost in answers
and buy in decode speed and memory, against float32 K/V, in one run (issue 38).

Accuracy: the parity tests' prompts (tests/model/test_parity_transformers.py) on the
embedded model with dense float32 weights, greedy to --tokens tokens (EOS ignored), each
KV dtype against the float32 pool: the leading tokens that agree, and the largest
difference of any logit along the float32 pool's answer (teacher-forced decode steps,
so every position compares). Beside them, the bar bfloat16 K/V is judged by: the
quantized weights' own agreement with the dense float32 model (float32 K/V).

Speed and memory: for each KV dtype a fresh worker-like process (the default weights,
the CPU's default path) decodes --steps tokens at batch 1 and 16 from --context-token
prompts (windows of the repository's docs; prefix caching keeps them between repeats, so
each repeat times decode only), best of --repeats, and its resident memory (RSS and
PSS) with a pool of the same tokens in each dtype.

    .venv/bin/python benchmarks/kv_dtype_bench.py            # ~10 minutes on 2 cores
    .venv/bin/python benchmarks/kv_dtype_bench.py --dry-run  # tiny sizes: the code paths
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from appliance.engine.llm_engine import LLMEngine
from appliance.engine.model_runner import move_to
from appliance.engine.scheduler import ScheduledChunk, SchedulerOutput
from appliance.engine.sequence import SamplingParams, Sequence
from appliance.kv.block_allocator import blocks_for_tokens
from appliance.kv.cache import KV_DTYPES, KVCache, KVLayout
from appliance.settings.config import load_settings

ROOT = Path(__file__).resolve().parent.parent
# The parity tests' prompts, from their one place (tests/helpers/parity_prompts.py).
sys.path.insert(0, str(ROOT / "tests" / "helpers"))
from parity_prompts import parity_prompts  # noqa: E402


def pool_engine(base: LLMEngine, dtype: torch.dtype, num_blocks: int = 256) -> LLMEngine:
    """An engine on `base`'s loaded model with its own KV pool of `num_blocks` in `dtype`
    (a model whose compiled decode step is on takes only its own dtype)."""
    cfg = base.model.config
    layout = KVLayout(cfg.num_layers, base.kv.block_size, cfg.num_kv_heads, cfg.head_dim, dtype)
    kv = KVCache(layout, num_blocks, base.model.device)
    return LLMEngine(base.model, base.tokenizer, kv, base.scheduler.limits)


@torch.inference_mode()
def forced_logits(engine: LLMEngine, prompt: list[int], answer: list[int]) -> torch.Tensor:
    """Float32 logits [len(answer), vocab] of each answer position, the prompt prefilled
    in one step and then one decode step per answer token fed (teacher forcing), so each
    decode reads the K/V its pool stored."""
    tokens = prompt + answer
    seq = Sequence(0, list(prompt), SamplingParams())
    seq.block_table = engine.kv.allocator.allocate(
        blocks_for_tokens(len(tokens), engine.kv.block_size)
    )
    rows = []
    try:
        rows.append(_run(engine, SchedulerOutput(prefills=[ScheduledChunk(seq, len(prompt))])))
        for position in range(len(prompt), len(tokens) - 1):
            seq.token_ids = tokens[: position + 1]
            seq.num_computed_tokens = position
            rows.append(_run(engine, SchedulerOutput(decodes=[ScheduledChunk(seq, 1)])))
    finally:
        engine.kv.allocator.free(seq.block_table)
    return torch.cat(rows)  # [len(answer), vocab]


def _run(engine: LLMEngine, out: SchedulerOutput) -> torch.Tensor:
    """One step's last row's logits [1, vocab]."""
    inputs = move_to(engine.runner.prepare(out), engine.model.device)
    hidden = engine.model(inputs.input_ids, inputs.positions, inputs.attention, engine.kv.tensor)
    return engine.model.logits(hidden[-1:])


@dataclass
class Agreement:
    """One prompt's answer under a way of running against the reference's."""

    tokens: int  # the answer's leading tokens equal to the reference's
    of: int  # the reference's answer length
    max_logit_error: float  # along the reference's answer, every vocabulary entry


def greedy(engine: LLMEngine, prompts: list[list[int]], tokens: int) -> list[list[int]]:
    params = SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True)
    return [c.token_ids for c in engine.generate(prompts, params)]


def agreement(
    reference: LLMEngine, other: LLMEngine, prompts: list[list[int]], tokens: int
) -> list[Agreement]:
    """Each prompt's greedy answer of `other` against `reference`'s, and its logits along
    the reference's answer."""
    expected, got = greedy(reference, prompts, tokens), greedy(other, prompts, tokens)
    out = []
    for prompt, want, have in zip(prompts, expected, got, strict=True):
        same = next(
            (i for i, (a, b) in enumerate(zip(want, have, strict=False)) if a != b), len(want)
        )
        error = forced_logits(other, prompt, want) - forced_logits(reference, prompt, want)
        out.append(Agreement(same, len(want), float(error.abs().max())))
    return out


def accuracy_rows(tokens: int) -> list[tuple[str, list[Agreement]]]:
    """(name, per-prompt agreement) for each KV dtype on dense float32 weights against
    the float32 pool, and the quantized weights (float32 K/V) against dense float32."""
    dense = LLMEngine.from_settings(load_settings(dtype="float32", device="cpu", weights="dense"))
    prompts = parity_prompts(dense)
    reference = pool_engine(dense, torch.float32)
    rows = []
    for name, dtype in KV_DTYPES.items():
        found = agreement(reference, pool_engine(dense, dtype), prompts, tokens)
        rows.append((f"KV {name}, dense float32 weights", found))
    quant = LLMEngine.from_settings(load_settings(device="cpu", weights="quantized"))
    found = agreement(reference, quant, prompts, tokens)
    rows.append(("quantized weights, KV float32 (the bar)", found))
    return rows


def accuracy_table(rows: list[tuple[str, list[Agreement]]]) -> str:
    lines = [
        "| against dense float32 weights, float32 KV | prompts agreeing on all | min / median "
        "tokens agreeing | max logit error |",
        "|---|---:|---:|---:|",
    ]
    for name, found in rows:
        counts = sorted(a.tokens for a in found)
        whole = sum(a.tokens == a.of for a in found)
        error = max(a.max_logit_error for a in found)
        median = counts[len(counts) // 2]
        lines.append(
            f"| {name} | {whole}/{len(found)} | {counts[0]} / {median} of {found[0].of} | "
            f"{error:.4f} |"
        )
    return "\n".join(lines)


# ---------------------------------------------------------------- speed and memory


def doc_tokens(engine: LLMEngine, count: int) -> list[int]:
    """At least `count` tokens of the repository's docs (repeated where short)."""
    text = "\n\n".join(p.read_text() for p in sorted((ROOT / "docs").glob("*.md")))
    ids = engine.tokenizer.encode(text)
    return (ids * (count // len(ids) + 1))[:count]


def decode_rate(engine: LLMEngine, prompts: list[list[int]], steps: int) -> float:
    """Tokens a second of the decode steps after every prompt has its first token."""
    params = SamplingParams(max_tokens=steps + 1, temperature=0, ignore_eos=True)
    for prompt in prompts:
        engine.add_request(prompt, params)
    made = {}
    while len(made) < len(prompts):  # prefills (from the prefix cache after a first run)
        for out in engine.step():
            made[out.seq_id] = len(out.token_ids)
    start, decoded = time.perf_counter(), 0
    while engine.has_unfinished():
        decoded += sum(len(out.token_ids) for out in engine.step())
    return decoded / (time.perf_counter() - start)


def memory() -> dict[str, int]:
    """This process's resident set and proportional set size, in bytes."""
    fields = {}
    for line in Path("/proc/self/smaps_rollup").read_text().splitlines():
        name, _, rest = line.partition(":")
        if name in ("Rss", "Pss"):
            fields[name.lower()] = int(rest.split()[0]) * 1024
    return fields


def child(args: argparse.Namespace) -> dict:
    """One KV dtype in this process: a worker's engine, its decode rates and memory."""
    batches = [int(b) for b in args.batches.split(",")]
    seq_len = args.context + args.steps + 1
    blocks = max(batches) * blocks_for_tokens(seq_len, 16) + 2 * max(batches)
    settings = load_settings(
        device="cpu",
        weights=args.weights,
        kv_cache_dtype=args.child,
        kv={"num_blocks": blocks, "block_size": 16, "prefix_caching": True},
        batch={"max_num_seqs": max(batches), "max_model_len": seq_len + 16},
    )
    engine = LLMEngine.from_settings(settings)
    ids = doc_tokens(engine, args.context + 97 * max(batches))
    prompts = [ids[97 * i : 97 * i + args.context] for i in range(max(batches))]
    rates = {}
    for batch in sorted(batches, reverse=True):  # the largest first fills the prefix cache
        rates[batch] = max(
            decode_rate(engine, prompts[:batch], args.steps) for _ in range(args.repeats)
        )
    pool = engine.kv.tensor
    return {
        "kv_dtype": str(pool.dtype).removeprefix("torch."),
        "compiled_step": engine.model.decode_step is not None,
        "rates": rates,
        "pool_bytes": pool.numel() * pool.element_size(),
        **memory(),
    }


def speed_rows(args: argparse.Namespace) -> list[dict]:
    """child() of each KV dtype, each in a fresh process."""
    rows = []
    for name in KV_DTYPES:
        command = [sys.executable, __file__, "--child", name, *_passed(args)]
        done = subprocess.run(command, capture_output=True, text=True, check=False)
        if done.returncode:
            raise RuntimeError(f"the {name} run failed:\n{done.stderr[-4000:]}")
        rows.append(json.loads(done.stdout.strip().splitlines()[-1]))
    return rows


def _passed(args: argparse.Namespace) -> list[str]:
    names = ("context", "steps", "batches", "repeats", "weights")
    return [f"--{n}={getattr(args, n)}" for n in names]


def speed_table(rows: list[dict], args: argparse.Namespace) -> str:
    batches = [int(b) for b in args.batches.split(",")]
    head = " | ".join(f"decode tok/s, batch {b}" for b in batches)
    lines = [
        f"| KV dtype | {head} | KV pool MiB | RSS MiB | PSS MiB | compiled decode step |",
        "|---|" + "---:|" * (len(batches) + 3) + "---|",
    ]
    mib = 2**20
    for row in rows:
        rates = " | ".join(f"{row['rates'][str(b)]:.1f}" for b in batches)
        lines.append(
            f"| {row['kv_dtype']} | {rates} | {row['pool_bytes'] / mib:.0f} | "
            f"{row['rss'] / mib:.0f} | {row['pss'] / mib:.0f} | "
            f"{'yes' if row['compiled_step'] else 'no'} |"
        )
    return "\n".join(lines)


def cpu_name() -> str:
    """The CPU's model name, its bfloat16 features and torch's threads."""
    fields: dict[str, str] = {}
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        key, _, value = line.partition(":")
        fields.setdefault(key.strip(), value.strip())
    name, flags = fields.get("model name", "?"), fields.get("flags", "").split()
    bf16 = [f for f in ("avx512_bf16", "amx_bf16") if f in flags]
    return (
        f"{name} ({', '.join(bf16) or 'no bf16 instructions'}), {torch.get_num_threads()} threads"
    )


def parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=64, help="greedy tokens a prompt")
    parser.add_argument("--context", type=int, default=4096, help="prompt tokens, speed")
    parser.add_argument("--steps", type=int, default=32, help="decode steps timed")
    parser.add_argument("--batches", default="1,16", help="decode batch sizes")
    parser.add_argument("--repeats", type=int, default=3, help="best of this many")
    parser.add_argument("--weights", default="auto", help="the speed runs' weights setting")
    parser.add_argument("--dry-run", action="store_true", help="tiny sizes: the code paths")
    parser.add_argument("--child", choices=list(KV_DTYPES), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.dry_run:
        args.tokens, args.context, args.steps, args.batches, args.repeats = 4, 48, 3, "1,2", 1
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse(argv)
    if args.child:
        print(json.dumps(child(args)))
        return
    print(f"{cpu_name()}; SmolLM2-135M-Instruct (embedded)\n")
    print(f"Greedy agreement, {args.tokens} tokens, the parity tests' prompts\n")
    print(accuracy_table(accuracy_rows(args.tokens)))
    print(
        f"\nDecode from {args.context}-token contexts, {args.steps} steps, best of "
        f"{args.repeats}; a pool of the same tokens in each dtype; weights={args.weights}\n"
    )
    print(speed_table(speed_rows(args), args))


if __name__ == "__main__":
    main()
