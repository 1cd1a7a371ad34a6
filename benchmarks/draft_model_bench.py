"""Draft-model speculation against plain decoding, in-process, where the draft is cheaper
than the target (issue 38).

No smaller real model of SmolLM2's tokenizer is on this machine, so both models are made
from random weights over SmolLM2's vocabulary (its tokenizer is copied beside them):

draft      SmolLM2-135M's shape (30 layers of 576), or --draft-layers/--hidden smaller
target     the draft's layers, embeddings, final norm and head, then --extra-layers more
           layers whose outputs (attention o_proj and MLP down_proj) are scaled by
           --noise: every step reads and computes them, and they move the residual only
           a little, so the target's greedy tokens are mostly the draft's. --noise sets
           how often they differ (acceptance); 0 makes the target answer as the draft.

Configurations, each one request at a time (batch 1), greedy, ignore_eos:
  plain      speculative.method off
  draft      method draft, the draft above, num_speculative_tokens --k (adaptive off)
  self       the target drafting for itself: every draft is accepted, and each costs a
             whole target step (speculation's bookkeeping at acceptance 1.0; no gain)
  random     a draft of the same shape with weights of its own: almost every draft is
             rejected (what a bad draft costs)

Figures: decode tok/s (tokens after the first over the time they took, best of
--repeats alternating rounds), acceptance (accepted / drafted), the draft's steps.

    .venv/bin/python benchmarks/draft_model_bench.py
    .venv/bin/python benchmarks/draft_model_bench.py --dry-run   # tiny shapes and counts

--dry-run builds tiny models and runs every path once: its figures mean nothing.
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from kv_dtype_bench import cpu_name  # benchmarks/ is the script's folder: on sys.path

from appliance.engine.llm_engine import LLMEngine
from appliance.engine.sequence import SamplingParams
from appliance.engine.speculative.draft_model import DraftModelProposer
from appliance.model.model_source import prepare_model
from appliance.settings.config import load_settings

VOCAB = 49152  # SmolLM2's
PROMPT = "Write a short story about a lighthouse keeper who finds a message in a bottle."


@dataclass
class Row:
    name: str
    tok_s: float  # best round's decode tok/s
    acceptance: float | None
    draft_steps: int


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dry-run", action="store_true", help="tiny shapes, tiny counts")
    parser.add_argument("--draft-layers", type=int, default=30, help="SmolLM2-135M: 30")
    parser.add_argument("--hidden", type=int, default=576, help="SmolLM2-135M: 576")
    parser.add_argument("--extra-layers", type=int, default=30, help="the target's more")
    parser.add_argument("--noise", type=float, default=0.05, help="scale of their outputs")
    parser.add_argument("--k", type=int, default=4, help="num_speculative_tokens")
    parser.add_argument("--tokens", type=int, default=128, help="answer length")
    parser.add_argument("--repeats", type=int, default=3, help="alternating rounds")
    parser.add_argument("--dtype", default="float32", help="the engines' dtype")
    parser.add_argument("--folder", type=Path, help="keep the models here (else a temp dir)")
    parser.add_argument(
        "--k-matrix", action="store_true", help="also check k = 1..8 answer as plain (slow lane)"
    )
    args = parser.parse_args(argv)
    if args.dry_run:
        args.draft_layers, args.hidden, args.extra_layers = 1, 64, 1
        args.tokens, args.repeats = 6, 1
    return args


def llama_config(layers: int, hidden: int) -> Any:
    """SmolLM2-135M's proportions (9 heads of 64, 3 KV heads, MLP 1536/576) at `hidden`."""
    import transformers

    heads = max(1, hidden // 64)
    return transformers.LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=hidden,
        intermediate_size=hidden * 8 // 3,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=max(1, heads // 3),
        max_position_embeddings=2048,
        tie_word_embeddings=True,
    )


def make_models(args: argparse.Namespace, root: Path) -> dict[str, Path]:
    """The draft, the target built on it, and a random draft of the draft's shape."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    draft_cfg = llama_config(args.draft_layers, args.hidden)
    draft = AutoModelForCausalLM.from_config(draft_cfg, dtype=torch.float32).eval()
    target_cfg = llama_config(args.draft_layers + args.extra_layers, args.hidden)
    target = AutoModelForCausalLM.from_config(target_cfg, dtype=torch.float32).eval()
    state = target.state_dict()
    state.update(draft.state_dict())  # the first layers, embeddings, norm, head: the draft's
    with torch.no_grad():
        for layer in range(args.draft_layers, target_cfg.num_hidden_layers):
            for part in ("self_attn.o_proj", "mlp.down_proj"):
                state[f"model.layers.{layer}.{part}.weight"].mul_(args.noise)
    target.load_state_dict(state)
    torch.manual_seed(1)
    other = AutoModelForCausalLM.from_config(draft_cfg, dtype=torch.float32).eval()
    tokenizer = prepare_model(None, load_settings().cache_dir)[1]
    folders = {}
    for name, model in (("draft", draft), ("target", target), ("random", other)):
        folder = root / name
        model.save_pretrained(folder, safe_serialization=True)
        for file in ("tokenizer.json", "tokenizer_config.json"):
            shutil.copy(tokenizer / file, folder / file)
        folders[name] = folder
    return folders


def engine_for(
    args: argparse.Namespace, folders: dict[str, Path], draft: str | None, k: int | None = None
) -> Any:
    spec: dict[str, Any] = {"method": "off"}
    if draft is not None:
        spec = {
            "method": "draft",
            "draft_model": folders[draft],
            "num_speculative_tokens": k or args.k,
            "adaptive": False,
        }
    settings = load_settings(
        model=folders["target"],
        dtype=args.dtype,
        device="cpu",
        kv={"num_blocks": 256},
        speculative=spec,
    )
    return LLMEngine.from_settings(settings)


def decode_rate(engine: LLMEngine, prompt: list[int], tokens: int) -> tuple[float, list[int]]:
    """Tokens after the first over the seconds they took, and the answer."""
    params = SamplingParams(max_tokens=tokens, ignore_eos=True)
    made: list[int] = []
    first_at = 0.0
    for out in engine.stream(prompt, params):
        if not made:
            first_at = time.perf_counter()
        made += out.token_ids
    seconds = time.perf_counter() - first_at
    return (len(made) - 1) / seconds, made


def main(argv: list[str] | None = None) -> None:
    args = parse(argv)
    with tempfile.TemporaryDirectory() as temp:
        root = args.folder or Path(temp)
        folders = make_models(args, root)
        configs = {"plain": None, "draft": "draft", "self": "target", "random": "random"}
        engines = {name: engine_for(args, folders, d) for name, d in configs.items()}
        prompt = engines["plain"].tokenizer.encode(PROMPT)
        best: dict[str, float] = dict.fromkeys(configs, 0.0)
        answers: dict[str, list[int]] = {}
        for round_ in range(args.repeats):
            order = list(configs) if round_ % 2 == 0 else list(reversed(configs))
            for name in order:
                rate, answers[name] = decode_rate(engines[name], prompt, args.tokens)
                best[name] = max(best[name], rate)
        rows = [row_of(name, engines[name], best[name]) for name in configs]
        if args.k_matrix:
            k_matrix(args, folders, prompt, answers["plain"])
    same = all(answers[name] == answers["plain"] for name in configs)
    print(f"CPU: {cpu_name()}")
    print(
        f"draft {args.draft_layers}x{args.hidden}, target +{args.extra_layers} layers "
        f"(noise {args.noise}), k {args.k}, {args.tokens} tokens, dtype {args.dtype}; "
        f"answers identical to plain: {same}"
    )
    print(
        f"{'config':8} {'decode tok/s':>12} {'vs plain':>9} {'acceptance':>10} {'draft steps':>11}"
    )
    for row in rows:
        ratio = row.tok_s / rows[0].tok_s
        accept = "-" if row.acceptance is None else f"{row.acceptance:.2f}"
        print(f"{row.name:8} {row.tok_s:12.1f} {ratio:9.2f} {accept:>10} {row.draft_steps:11}")
    if args.dry_run:
        print("(dry run: tiny shapes and counts, the figures mean nothing)")
    if not same:
        raise SystemExit("speculation changed a greedy answer")


def k_matrix(
    args: argparse.Namespace, folders: dict[str, Path], prompt: list[int], plain: list[int]
) -> None:
    """The exactness matrix of issue 38 for the draft: k = 1..8, each greedy answer
    token for token plain decoding's (the suite runs k = 1, 3, 8 on tiny models)."""
    for k in range(1, 9):
        for draft in ("draft", "target"):
            engine = engine_for(args, folders, draft, k)
            _, answer = decode_rate(engine, prompt, args.tokens)
            counts = engine.scheduler.acceptance
            kept = f"{counts.accepted}/{counts.drafted}"
            print(f"k={k} {draft:6}: same as plain {answer == plain}, accepted {kept}")
            if answer != plain:
                raise SystemExit(f"k={k}, draft {draft}: the greedy answer differs from plain")


def row_of(name: str, engine: LLMEngine, tok_s: float) -> Row:
    drafter = engine.scheduler.drafter
    if drafter is None:
        return Row(name, tok_s, None, 0)
    assert isinstance(drafter.proposer, DraftModelProposer)
    counts = engine.scheduler.acceptance
    rate = counts.accepted / counts.drafted if counts.drafted else 0.0
    return Row(name, tok_s, rate, drafter.proposer.counts.steps)


if __name__ == "__main__":
    main()
