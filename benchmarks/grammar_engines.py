"""llguidance against xgrammar on this box: which grammar engine constrains decoding.

For each JSON schema of tests/data/json_schemas.json, on the embedded model's tokenizer
(SmolLM2, 49,152 tokens), both engines:
  - compile the schema (compact JSON, no free whitespace) and build a matcher: the time
    until the first mask is ready, with xgrammar's cache off (a request's first token
    waits for exactly this);
  - compute the mask of every step along one token path: a random walk through the
    grammar drawn with llguidance (seeded; half the steps take the shortest allowed
    token so walks end), replayed token for token in xgrammar, so both time the same
    states;
  - cover the schema: it compiles, and the walk's finished document validates against
    the schema with jsonschema's format checker.

    .venv/bin/python benchmarks/grammar_engines.py [--steps 200] [--seed 0]

Prints a markdown table; the reasoning lives in benchmarks/results/grammar_engines.md.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import jsonschema
import llguidance
import llguidance.torch
import torch
import xgrammar

from appliance.engine.structured.compile import JSON_OPTIONS
from appliance.model.model_source import prepare_model
from appliance.settings.config import load_settings

SCHEMAS = Path(__file__).resolve().parent.parent / "tests" / "data" / "json_schemas.json"


@dataclass
class Row:
    """One engine on one schema."""

    compile_ms: float | None = None  # None: it did not compile
    error: str = ""
    mask_us: list[float] = field(default_factory=list)
    valid: bool | None = None  # the walk's document validates (None: no finished walk)


class Llguidance:
    """llguidance: LLTokenizer straight from tokenizer.json (no transformers)."""

    name = "llguidance 1.9.1"

    def __init__(self, tokenizer_json: str, vocab: int, eos: list[int]) -> None:
        start = time.perf_counter()
        self.tok = llguidance.LLTokenizer(tokenizer_json, n_vocab=vocab, eos_token=eos)
        self.setup_s = time.perf_counter() - start
        self.vocab = vocab

    def compile(self, schema: dict[str, Any]) -> tuple[Any, float]:
        start = time.perf_counter()
        grammar = llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=JSON_OPTIONS)
        matcher = llguidance.LLMatcher(self.tok, grammar, log_level=0)
        if matcher.is_error():
            raise ValueError(matcher.get_error())
        mask = llguidance.torch.allocate_token_bitmask(1, self.vocab)
        llguidance.torch.fill_next_token_bitmask(matcher, mask)
        return matcher, (time.perf_counter() - start) * 1e3

    def mask(self, matcher: Any, bitmask: torch.Tensor) -> None:
        llguidance.torch.fill_next_token_bitmask(matcher, bitmask)

    def accept(self, matcher: Any, token: int) -> bool:
        return bool(matcher.consume_token(token))

    def done(self, matcher: Any) -> bool:
        return bool(matcher.is_accepting())


class Xgrammar:
    """xgrammar: TokenizerInfo from the transformers tokenizer over the same tokenizer.json."""

    name = "xgrammar 0.2.9"

    def __init__(self, tokenizer_dir: Path, vocab: int, eos: list[int]) -> None:
        from transformers import PreTrainedTokenizerFast

        hf = PreTrainedTokenizerFast(tokenizer_file=str(tokenizer_dir / "tokenizer.json"))
        start = time.perf_counter()
        info = xgrammar.TokenizerInfo.from_huggingface(hf, vocab_size=vocab, stop_token_ids=eos)
        self.compiler = xgrammar.GrammarCompiler(info, max_threads=1, cache_enabled=False)
        self.setup_s = time.perf_counter() - start
        self.vocab = vocab

    def compile(self, schema: dict[str, Any]) -> tuple[Any, float]:
        start = time.perf_counter()
        compiled = self.compiler.compile_json_schema(
            json.dumps(schema), any_whitespace=False, separators=(", ", ": ")
        )
        matcher = xgrammar.GrammarMatcher(compiled)
        mask = xgrammar.allocate_token_bitmask(1, self.vocab)
        matcher.fill_next_token_bitmask(mask, 0)
        return matcher, (time.perf_counter() - start) * 1e3

    def mask(self, matcher: Any, bitmask: torch.Tensor) -> None:
        matcher.fill_next_token_bitmask(bitmask, 0)

    def accept(self, matcher: Any, token: int) -> bool:
        return bool(matcher.accept_token(token))

    def done(self, matcher: Any) -> bool:
        return bool(matcher.is_completed())


def allowed(bitmask: torch.Tensor, vocab: int) -> list[int]:
    """Token ids a [1, vocab/32] int32 bitmask allows."""
    bits = (bitmask[0, :, None] >> torch.arange(32, dtype=torch.int32)) & 1  # [words, 32]
    return bits.flatten()[:vocab].nonzero().flatten().tolist()


def walk(engine: Llguidance, schema: dict[str, Any], steps: int, rng: random.Random) -> list[int]:
    """A token path through the schema's grammar, ending in an end token if it finishes."""
    matcher, _ = engine.compile(schema)
    bitmask = llguidance.torch.allocate_token_bitmask(1, engine.vocab)
    path: list[int] = []
    for _ in range(steps):
        engine.mask(matcher, bitmask)
        ids = allowed(bitmask, engine.vocab)
        if not ids:
            break
        token = ids[0] if rng.random() < 0.5 else rng.choice(ids)
        path.append(token)
        if not engine.accept(matcher, token) or matcher.is_stopped():
            break
    if engine.done(matcher):
        path.append(engine.tok.eos_token)  # only an end token may follow a finished document
    return path


def run_engine(
    engine: Any, schema: dict[str, Any], path: list[int], decode: Any, eos: set[int]
) -> Row:
    row = Row()
    try:
        matcher, row.compile_ms = engine.compile(schema)
    except Exception as exc:  # an engine's refusal is a result here
        row.error = str(exc).splitlines()[0][:80]
        return row
    bitmask = (
        llguidance.torch.allocate_token_bitmask(1, engine.vocab)
        if isinstance(engine, Llguidance)
        else xgrammar.allocate_token_bitmask(1, engine.vocab)
    )
    text_ids = []
    for token in path:
        start = time.perf_counter()
        engine.mask(matcher, bitmask)
        row.mask_us.append((time.perf_counter() - start) * 1e6)
        if token in eos:
            break  # the walk's end: checked below with the engine's own "finished"
        if not engine.accept(matcher, token):
            seen = decode([*text_ids, token])
            row.error = f"rejected the path at token {len(text_ids)}: ...{seen[-30:]!r}"
            return row
        text_ids.append(token)
    if path and path[-1] in eos and engine.done(matcher):
        try:
            jsonschema.validate(
                json.loads(decode(text_ids)), schema, format_checker=jsonschema.FormatChecker()
            )
            row.valid = True
        except (ValueError, jsonschema.ValidationError) as exc:
            row.valid = False
            row.error = f"walk invalid: {str(exc).splitlines()[0][:60]}"
    return row


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200, help="longest walk per schema")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    settings = load_settings()
    config, tokenizer_dir = prepare_model(None, settings.cache_dir)
    from tokenizers import Tokenizer as RawTokenizer

    raw = RawTokenizer.from_file(str(tokenizer_dir / "tokenizer.json"))
    eos = sorted(config.eos_token_ids)
    engines = [
        Llguidance(raw.to_str(), config.vocab_size, eos),
        Xgrammar(tokenizer_dir, config.vocab_size, eos),
    ]
    schemas: dict[str, dict[str, Any]] = json.loads(SCHEMAS.read_text())
    rng = random.Random(args.seed)
    rows: dict[str, list[Row]] = {}
    for name, schema in schemas.items():
        path = walk(engines[0], schema, args.steps, rng)
        rows[name] = [
            run_engine(e, schema, path, lambda ids: raw.decode(ids), set(eos)) for e in engines
        ]
        cells = [
            f"{r.compile_ms:.1f} ms, {statistics.median(r.mask_us):.0f} us, "
            f"{max(r.mask_us) / 1e3:.1f} ms, {r.compile_ms + sum(r.mask_us) / 1e3:.1f} ms"
            if r.compile_ms is not None and r.mask_us
            else r.error
            for r in rows[name]
        ]
        print(f"| {name} | {len(path)} | " + " | ".join(cells) + " |", flush=True)
    print()
    print("(per schema: compile+first mask, mask p50, mask max, compile + all masks)")
    print()
    print(
        "| engine | tokenizer setup | compile+first mask p50 / max | mask p50 / p99 / max "
        "| schemas compiled | walks valid |"
    )
    print("|---|---|---|---|---|---|")
    for i, engine in enumerate(engines):
        mine = [r[i] for r in rows.values()]
        compiles = [r.compile_ms for r in mine if r.compile_ms is not None]
        masks = [m for r in mine for m in r.mask_us]
        finished = [r for r in mine if r.valid is not None]
        print(
            f"| {engine.name} | {engine.setup_s * 1e3:.0f} ms "
            f"| {statistics.median(compiles):.1f} / {max(compiles):.1f} ms "
            f"| {percentile(masks, 0.5):.0f} / {percentile(masks, 0.99):.0f} / {max(masks):.0f} us "
            f"| {len(compiles)}/{len(mine)} | {sum(bool(r.valid) for r in finished)}/"
            f"{len(finished)} |"
        )
        for name, r in zip(rows, mine, strict=True):
            if r.error:
                print(f"  {engine.name} {name}: {r.error}")


if __name__ == "__main__":
    main()
