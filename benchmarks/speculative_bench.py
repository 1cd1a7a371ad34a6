"""Speculative decoding against plain decoding, ours and llama.cpp's, in one run (issue 38).

A real `appliance serve` (one start per configuration and round: speculative.method off,
then ngram with num_speculative_tokens=k; each start runs every load) is driven by
`appliance bench`'s runner with the same requests each time:

grounded   summarise, quote or proofread a paragraph of the repository's docs, or return
           one of its functions renamed (appliance/bench/workloads.py: answers copy their
           input, what prompt lookup is for)
chat       `appliance bench`'s chat mix (random-word prompts, 32-256 tokens out)

each at batch 1 (one request at a time) and at 16 streams (a closed loop of 16). On the
grounded workload at batch 1, llama.cpp's llama-lookup (prompt-lookup drafts of up to k
tokens, built by benchmarks/build_llama_cpp.sh) runs the very same prompts, and so does
the same binary with drafting off (--spec-draft-n-max 0: the same loop, one token a
step), llama.cpp's non-speculative figure. Greedy everywhere; ignore_eos (llama.cpp:
--ignore-eos) unless --natural-ends, so each side makes the tokens asked for.

Figures per (workload, streams, configuration):
  decode tok/s   tokens after each request's first over the time they took, summed over
                 requests (at batch 1: one stream's decode rate; llama-lookup prints the
                 same quantity, "decoded N tokens in T seconds", prefill excluded)
  TPOT p50       the median request's (latency - TTFT) / (tokens - 1)
  out tok/s      all output tokens over the run's wall clock (16 streams: the throughput)
  acceptance     accepted drafts / drafted tokens: from /metrics where the server exports
                 speculative counters, else from the engine's own counters
                 (scheduler.acceptance) over the same requests run in this process
                 (the table says which)

With --llama-server, llama.cpp's own server serves every load too, as ours does (one
start per configuration and round, -np <streams> slots, every core): plain, and with its
n-gram drafts (--spec-type ngram-simple --spec-draft-n-max k, its prompt lookup), its
acceptance from its /metrics (the same vLLM counter names): the serving comparison of
issue 38 in the same run.

Rounds alternate the order of the configurations (ours off, llama.cpp plain, ours on,
llama-lookup, and the llama-server pair; then backwards), `--repeats` rounds (3: these
machines are noisy); the table shows each cell's best round (batch 1 by decode tok/s, 16
streams by out tok/s) and the goals of issue 38 beside the ratios. The JSON in --out has
every round.

    benchmarks/build_llama_cpp.sh && .venv/bin/python benchmarks/speculative_bench.py --llama-server
    .venv/bin/python benchmarks/speculative_bench.py --dry-run   # every path, tiny counts

--dry-run runs every path once with a few tokens (its figures mean nothing) and writes to
a temporary folder unless --out is given.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import itertools
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

from appliance.bench.compare import Target, running
from appliance.bench.report import plain
from appliance.bench.runner import Load, run_load
from appliance.bench.workloads import RequestSpec, generate
from appliance.core.goodput import SLO, RequestResult, summarize
from appliance.model.model_source import default_model_path, prepare_tokenizer
from appliance.model.tokenizer import Tokenizer
from appliance.settings.config import load_settings
from appliance.topology.cpu import cpu_model_name

ROOT = Path(__file__).resolve().parents[1]
WORKLOADS = ("grounded", "chat")
OURS_OFF, OURS_ON = "ours, plain", "ours, ngram"
LLAMA_OFF, LLAMA_ON = "llama.cpp, plain", "llama.cpp, llama-lookup"
SERVER_OFF, SERVER_ON = "llama-server, plain", "llama-server, ngram-simple"
SLOT_TOKENS = 1536  # llama-server's context a slot: the longest chat prompt and answer fit
DRAFT_TOKENS, ACCEPTED_TOKENS = "spec_decode_num_draft_tokens", "spec_decode_num_accepted_tokens"
ISA_FLAGS = ("amx_tile", "avx512_bf16", "avx512_vnni", "avx512f", "avx2", "fma", "neon", "asimd")


@dataclass(frozen=True)
class Plan:
    """How much each load sends; --dry-run's is tiny."""

    repeats: int
    requests_b1: int
    requests_streams: int
    streams: int
    warmup: int
    max_tokens: int | None  # a cap on every request's answer (None: the workload's own)


@dataclass
class Figures:
    """One configuration's run of one load."""

    decode_tok_s: float
    tpot_p50_ms: float
    out_tok_s: float | None  # None: llama-lookup (its own process per request)
    completed: int
    failed: int
    drafted: int | None = None  # speculative counters over the load (None: not known)
    accepted: int | None = None

    @property
    def acceptance(self) -> float | None:
        if not self.drafted or self.accepted is None:
            return None
        return self.accepted / self.drafted


@dataclass
class Cell:
    """Every round's figures of one (workload, streams, configuration)."""

    workload: str
    streams: int
    config: str
    runs: list[Figures] = field(default_factory=list)

    def best(self) -> Figures:
        """Batch 1: the fastest stream; more streams: the most output per second."""
        if self.streams == 1 or self.runs[0].out_tok_s is None:
            return max(self.runs, key=lambda f: f.decode_tok_s)
        return max(self.runs, key=lambda f: f.out_tok_s or 0.0)


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, help="folder for the JSON and the table")
    parser.add_argument("--dry-run", action="store_true", help="every path, tiny counts")
    parser.add_argument("--repeats", type=int, default=3, help="alternating rounds")
    parser.add_argument("--k", type=int, default=4, help="num_speculative_tokens (and llama's)")
    parser.add_argument("--requests-b1", type=int, default=8, help="measured at batch 1")
    parser.add_argument("--streams", type=int, default=16, help="the concurrent load's streams")
    parser.add_argument("--requests-streams", type=int, default=48, help="measured at --streams")
    parser.add_argument("--warmup", type=int, default=2, help="uncounted requests per load")
    parser.add_argument("--max-tokens", type=int, help="cap every answer at this many tokens")
    parser.add_argument(
        "--mode",
        default="colocated",
        choices=["colocated", "disaggregated", "default"],
        help="our pool layout (default: the planner's, as a fresh `appliance serve`)",
    )
    parser.add_argument(
        "--server-env",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="more environment for both of our servers "
        "(e.g. APPLIANCE_SPECULATIVE__ADAPTIVE=false)",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--natural-ends", action="store_true", help="answers end at EOS")
    parser.add_argument("--llama-bin", type=Path, default=ROOT / ".bench/llama.cpp/bin")
    # GGML_NATIVE on a CPU with AMX builds AMX kernels that die of SIGILL on VMs that list
    # amx_tile without granting tile state; --no-repack keeps llama.cpp on AVX-512.
    parser.add_argument("--llama-flags", default="--no-repack", help="more llama-lookup flags")
    parser.add_argument(
        "--llama-server",
        action="store_true",
        help="llama.cpp's llama-server serves every load too, plain and with n-gram drafts",
    )
    parser.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    return parser.parse_args(argv)


def plan_of(args: argparse.Namespace) -> Plan:
    """The counts asked for; the dry run's: one round, a request or two, 16 tokens each
    (enough for a few drafts to be verified)."""
    if any("=" not in item for item in args.server_env):
        raise SystemExit(f"--server-env takes KEY=VALUE, got {args.server_env}")
    if args.k < 1:
        raise SystemExit(f"--k must be >= 1, got {args.k}")
    if args.dry_run:
        return Plan(1, 1, 2, 2, 0, 16)
    counts = (args.repeats, args.requests_b1, args.requests_streams, args.streams)
    if min(counts) < 1 or args.warmup < 0:
        raise SystemExit("repeats and the request and stream counts must be >= 1")
    return Plan(*counts, args.warmup, args.max_tokens)


def make_specs(
    tokenizer: Tokenizer, workload: str, count: int, seed: int, cap: int | None
) -> list[RequestSpec]:
    """`count` requests of a workload from its own seed, answers capped at `cap`."""
    specs = list(itertools.islice(generate(workload, tokenizer, seed), count))
    if cap is None:
        return specs
    return [dataclasses.replace(s, max_tokens=min(s.max_tokens, cap)) for s in specs]


def loads_of(
    tokenizer: Tokenizer, plan: Plan, seed: int
) -> dict[tuple[str, int], list[RequestSpec]]:
    """Each (workload, streams) load's requests (warm-up first), each from its own seed."""
    loads = {}
    for index, (workload, streams) in enumerate(itertools.product(WORKLOADS, (1, plan.streams))):
        measured = plan.requests_b1 if streams == 1 else plan.requests_streams
        count = plan.warmup + measured
        loads[workload, streams] = make_specs(
            tokenizer, workload, count, seed * 10 + index, plan.max_tokens
        )
    return loads


def our_target(speculate: bool, k: int, mode: str, more: list[str]) -> Target:
    """`appliance serve` with speculation off or ngram with k drafts, in `mode`, with
    the `more` KEY=VALUE environment."""
    env = dict(item.split("=", 1) for item in more)
    env["APPLIANCE_SPECULATIVE__METHOD"] = "ngram" if speculate else "off"
    if speculate:
        env["APPLIANCE_SPECULATIVE__NUM_SPECULATIVE_TOKENS"] = str(k)
    if mode != "default":
        env["APPLIANCE_MODE"] = mode
    serve = [sys.executable, "-m", "appliance.cli", "serve"]
    return Target(OURS_ON if speculate else OURS_OFF, serve, env, port_flag=None)


def server_target(args: argparse.Namespace, model: Path, speculate: bool, streams: int) -> Target:
    """llama.cpp's llama-server on every core with `streams` slots, plain or drafting up to
    k tokens by n-gram lookup over each slot's context (its prompt lookup)."""
    command = [str(args.llama_bin / "llama-server"), "-m", str(model), "-t", str(args.threads)]
    command += ["-np", str(streams), "-c", str(streams * SLOT_TOKENS), "--host", "127.0.0.1"]
    command += ["--metrics"]  # its spec_decode counters: the acceptance
    if speculate:
        command += ["--spec-type", "ngram-simple", "--spec-draft-n-max", str(args.k)]
    label = SERVER_ON if speculate else SERVER_OFF
    body = {"ignore_eos": not args.natural_ends}
    return Target(label, command, ready_path="/health", extra_body=body, port_flag="--port")


def figures_of(results: list[RequestResult], seconds: float) -> Figures:
    """A load's figures from its requests (decode: the tokens after each first)."""
    summary = summarize(results, seconds, SLO.parse([]))
    done = [r for r in results if r.ok and r.output_tokens > 1]
    decode_seconds = sum(r.latency - r.ttft for r in done)
    tokens = sum(r.output_tokens - 1 for r in done)
    return Figures(
        decode_tok_s=tokens / decode_seconds if decode_seconds > 0 else 0.0,
        tpot_p50_ms=summary.tpot.median * 1000,
        out_tok_s=summary.output_throughput,
        completed=summary.completed,
        failed=summary.failed,
    )


def speculative_counts(url: str) -> tuple[int, int] | None:
    """(draft tokens, accepted tokens) summed over the workers, from /metrics' counters
    of vLLM's names (appliance_spec_decode_num_draft_tokens / _num_accepted_tokens);
    None where the server exports none."""
    text = httpx.get(url + "/metrics", timeout=30).text
    totals: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for suffix in (DRAFT_TOKENS, ACCEPTED_TOKENS):
            if family.name.endswith(suffix):
                samples = [s.value for s in family.samples if s.name.endswith("_total")]
                totals[suffix] = totals.get(suffix, 0.0) + sum(samples)
    if DRAFT_TOKENS not in totals or ACCEPTED_TOKENS not in totals:
        return None
    return int(totals[DRAFT_TOKENS]), int(totals[ACCEPTED_TOKENS])


def serve_round(
    target: Target,
    loads: dict[tuple[str, int], list[RequestSpec]],
    plan: Plan,
    tokenizer: Tokenizer,
    log_dir: Path,
) -> dict[tuple[str, int], Figures]:
    """One start of `target`, every load driven in turn against it."""
    count = lambda text: len(tokenizer.encode(text))  # noqa: E731
    out = {}
    with running(target, log_dir) as url:
        for (workload, streams), specs in loads.items():
            measured = len(specs) - plan.warmup
            load = Load(concurrency=streams, num_requests=measured, warmup=plan.warmup)
            before = speculative_counts(url)
            label = f"{target.label} {workload} x{streams}"
            results, seconds = asyncio.run(
                run_load(url, iter(specs), load, count, extra_body=target.extra_body, label=label)
            )
            figures = figures_of(results, seconds)
            after = speculative_counts(url)
            if before is not None and after is not None:
                figures.drafted, figures.accepted = after[0] - before[0], after[1] - before[1]
            out[workload, streams] = figures
            print(f"  {label}: {_brief(figures)}", file=sys.stderr)
    return out


def _brief(f: Figures) -> str:
    return f"{f.completed} done, {f.failed} failed, decode {f.decode_tok_s:.1f} tok/s"


LOOKUP_DECODED = re.compile(r"decoded\s+(\d+) tokens in\s+([\d.]+) seconds")
LOOKUP_COUNT = re.compile(r"^.*\b(n_drafted|n_accept)\s+=\s+(\d+)", re.M)


def llama_lookup(
    args: argparse.Namespace, model: Path, spec: RequestSpec, drafts: int, folder: Path
) -> tuple[int, float, int, int]:
    """One request through llama-lookup with up to `drafts` drafts (0: plain decoding):
    (tokens decoded, their seconds, drafted, accepted)."""
    prompt = folder / "prompt.txt"
    prompt.write_text(spec.prompt)
    command = [str(args.llama_bin / "llama-lookup"), "-m", str(model), "-f", str(prompt)]
    command += ["-n", str(spec.max_tokens), "-t", str(args.threads), "-c", "4096"]
    command += ["--temp", "0", "--spec-draft-n-max", str(drafts), *args.llama_flags.split()]
    if not args.natural_ends:
        command.append("--ignore-eos")
    done = subprocess.run(command, capture_output=True, text=True, timeout=900, check=False)
    log = done.stdout + done.stderr
    decoded = LOOKUP_DECODED.search(log)
    if done.returncode != 0 or decoded is None:
        raise RuntimeError(f"llama-lookup exited {done.returncode}:\n{log[-2000:]}")
    counts = {name: int(value) for name, value in LOOKUP_COUNT.findall(log)}
    return int(decoded[1]), float(decoded[2]), counts["n_drafted"], counts["n_accept"]


def llama_round(
    args: argparse.Namespace, model: Path, specs: list[RequestSpec], drafts: int
) -> Figures:
    """The measured grounded batch-1 requests through llama-lookup, one process each.
    Its "decoded N tokens in T seconds" starts the clock with the first token already
    sampled from the prefill, so N - 1 of them took T: the tokens after the first over
    their time, as ours are counted."""
    with tempfile.TemporaryDirectory(prefix="speculative-bench-") as folder:
        runs = [llama_lookup(args, model, spec, drafts, Path(folder)) for spec in specs]
    tokens = sum(made - 1 for made, _, _, _ in runs)
    seconds = sum(took for _, took, _, _ in runs)
    tpot_p50 = statistics.median(took / max(1, made - 1) * 1000 for made, took, _, _ in runs)
    figures = Figures(tokens / seconds if seconds > 0 else 0.0, tpot_p50, None, len(specs), 0)
    if drafts:
        figures.drafted = sum(d for _, _, d, _ in runs)
        figures.accepted = sum(a for _, _, _, a in runs)
    label = LLAMA_ON if drafts else LLAMA_OFF
    print(f"  {label} grounded x1: {_brief(figures)}", file=sys.stderr)
    return figures


def engine_acceptance(
    loads: dict[tuple[str, int], list[RequestSpec]], plan: Plan, k: int, ignore_eos: bool
) -> dict[tuple[str, int], tuple[int, int]]:
    """(drafted, accepted) of each load's measured requests run in this process by an
    engine with ngram speculation, read from its scheduler's counters: the acceptance
    where /metrics has none (greedy: the tokens the server made)."""
    from appliance.engine.llm_engine import LLMEngine  # torch: only on this path
    from appliance.engine.sequence import SamplingParams

    settings = load_settings(speculative={"method": "ngram", "num_speculative_tokens": k})
    engine = LLMEngine.from_settings(settings)
    counts = engine.scheduler.acceptance
    out = {}
    for (workload, streams), specs in loads.items():
        before = (counts.drafted, counts.accepted)
        for spec in specs[plan.warmup :]:  # all at once: the scheduler batches them
            params = SamplingParams(
                max_tokens=spec.max_tokens, temperature=0, ignore_eos=ignore_eos
            )
            engine.add_request(engine.tokenizer.encode(spec.prompt), params)
        while engine.has_unfinished():
            engine.step()
        out[workload, streams] = (counts.drafted - before[0], counts.accepted - before[1])
    return out


def run_rounds(
    args: argparse.Namespace,
    plan: Plan,
    loads: dict[tuple[str, int], list[RequestSpec]],
    tokenizer: Tokenizer,
    log_dir: Path,
) -> tuple[dict[tuple[str, int, str], Cell], str | None]:
    """Every round, the configurations alternating; llama.cpp's rows left out (the reason
    returned) where llama-lookup is not built."""
    cells: dict[tuple[str, int, str], Cell] = {}
    model = load_settings().model or default_model_path()
    lookup = args.llama_bin / "llama-lookup"
    skipped = (
        None if lookup.is_file() else f"{lookup} is not built: run benchmarks/build_llama_cpp.sh"
    )
    if skipped:
        print(f"llama.cpp rows left out: {skipped}", file=sys.stderr)
    grounded_b1 = loads["grounded", 1][plan.warmup :]
    steps = [OURS_OFF, LLAMA_OFF, OURS_ON, LLAMA_ON]
    if args.llama_server and skipped is None:
        steps += [SERVER_OFF, SERVER_ON]
    for round_ in range(plan.repeats):
        print(f"round {round_ + 1} of {plan.repeats}", file=sys.stderr)
        for step in steps if round_ % 2 == 0 else steps[::-1]:
            if step in (LLAMA_OFF, LLAMA_ON):
                if skipped is None:
                    drafts = args.k if step == LLAMA_ON else 0
                    figures = llama_round(args, model, grounded_b1, drafts)
                    _cell(cells, "grounded", 1, step).runs.append(figures)
                continue
            if step in (SERVER_OFF, SERVER_ON):
                target = server_target(args, model, step == SERVER_ON, plan.streams)
            else:
                target = our_target(step == OURS_ON, args.k, args.mode, args.server_env)
                target.extra_body = {"ignore_eos": not args.natural_ends}
            served = serve_round(target, loads, plan, tokenizer, log_dir)
            for (workload, streams), figures in served.items():
                _cell(cells, workload, streams, step).runs.append(figures)
    return cells, skipped


def _cell(
    cells: dict[tuple[str, int, str], Cell], workload: str, streams: int, config: str
) -> Cell:
    return cells.setdefault((workload, streams, config), Cell(workload, streams, config))


def from_metrics(cells: dict[tuple[str, int, str], Cell]) -> bool:
    """Whether every speculative run of ours read its drafts from /metrics."""
    ours = [f for cell in cells.values() if cell.config == OURS_ON for f in cell.runs]
    return bool(ours) and all(f.drafted is not None for f in ours)


def fill_acceptance(
    cells: dict[tuple[str, int, str], Cell], counted: dict[tuple[str, int], tuple[int, int]]
) -> str:
    """Our speculative runs' drafts from the engine's counters, where /metrics had none;
    returns where the acceptance rates came from."""
    if from_metrics(cells):
        return "/metrics (the server's spec_decode counters, over each load)"
    for cell in cells.values():
        if cell.config == OURS_ON:
            for figures in cell.runs:
                figures.drafted, figures.accepted = counted[cell.workload, cell.streams]
    return (
        "the engine's own counters (scheduler.acceptance): the server exports no "
        "spec_decode counters, so an engine in this process ran each load's requests again"
    )


@dataclass(frozen=True)
class Goal:
    """One of issue 38's goals, judged on the best rounds."""

    text: str
    ratio: float | None  # None: a side is missing (llama.cpp not built)
    bound: float
    at_most: bool = False  # TPOT: lower is better

    @property
    def met(self) -> str:
        if self.ratio is None:
            return "-"
        return (
            "yes"
            if (self.ratio <= self.bound if self.at_most else self.ratio >= self.bound)
            else "no"
        )


def goals(cells: dict[tuple[str, int, str], Cell], streams: int) -> list[Goal]:
    """Issue 38's goals on the grounded and chat workloads (ratios of best rounds)."""

    def best(workload: str, n: int, config: str) -> Figures | None:
        cell = cells.get((workload, n, config))
        return cell.best() if cell and cell.runs else None

    def ratio(a: Figures | None, b: Figures | None, figure: str) -> float | None:
        if a is None or b is None:
            return None
        top, bottom = getattr(a, figure), getattr(b, figure)
        return top / bottom if top is not None and bottom else None

    on_g1, off_g1 = best("grounded", 1, OURS_ON), best("grounded", 1, OURS_OFF)
    on_gs, off_gs = best("grounded", streams, OURS_ON), best("grounded", streams, OURS_OFF)
    on_cs, off_cs = best("chat", streams, OURS_ON), best("chat", streams, OURS_OFF)
    llama_plain = best("grounded", 1, LLAMA_OFF)
    chat_b1 = ratio(best("chat", 1, OURS_ON), best("chat", 1, OURS_OFF), "decode_tok_s")
    return [
        Goal("grounded, batch 1: decode tok/s, ngram / our plain >= 2x",
             ratio(on_g1, off_g1, "decode_tok_s"), 2.0),
        Goal("grounded, batch 1: decode tok/s, ngram / llama.cpp plain >= 2x",
             ratio(on_g1, llama_plain, "decode_tok_s"), 2.0),
        Goal("chat, batch 1: decode tok/s, ngram / our plain >= 0.95x", chat_b1, 0.95),
        Goal(f"grounded, {streams} streams: TPOT p50, ngram / our plain <= 0.7x",
             ratio(on_gs, off_gs, "tpot_p50_ms"), 0.7, at_most=True),
        Goal(f"grounded, {streams} streams: out tok/s, ngram / our plain >= 1x (no lower)",
             ratio(on_gs, off_gs, "out_tok_s"), 1.0),
        Goal(f"chat, {streams} streams: out tok/s, ngram / our plain >= 0.95x (no worse)",
             ratio(on_cs, off_cs, "out_tok_s"), 0.95),
    ]  # fmt: skip


def _num(value: float | None, digits: int = 1) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def tables(cells: dict[tuple[str, int, str], Cell], targets: list[Goal]) -> str:
    """The figures of each cell's best round, then the goals."""
    lines = [
        "| workload | streams | config | decode tok/s | TPOT p50 ms | out tok/s | acceptance "
        "| rounds |",
        "|---|---:|---|---:|---:|---:|---:|---:|",
    ]
    for cell in cells.values():
        f = cell.best()
        accept = "-" if f.acceptance is None else f"{f.acceptance:.0%}"
        lines.append(
            f"| {cell.workload} | {cell.streams} | {cell.config} | {f.decode_tok_s:.1f} "
            f"| {f.tpot_p50_ms:.1f} | {_num(f.out_tok_s)} | {accept} | {len(cell.runs)} |"
        )
    lines += ["", "| goal (issue 38) | measured | met |", "|---|---:|---|"]
    for goal in targets:
        measured = "-" if goal.ratio is None else f"{goal.ratio:.2f}x"
        lines.append(f"| {goal.text} | {measured} | {goal.met} |")
    return "\n".join(lines)


def cpu_isa() -> str:
    """This CPU's vector extensions that matter here, from /proc/cpuinfo."""
    cpuinfo = Path("/proc/cpuinfo")
    flags = cpuinfo.read_text() if cpuinfo.is_file() else ""
    return " ".join(n.upper() for n in ISA_FLAGS if re.search(rf"\b{n}\b", flags)) or "unknown"


def header(args: argparse.Namespace, plan: Plan, source: str, skipped: str | None) -> str:
    model = load_settings().model or default_model_path()
    ends = "natural ends (EOS)" if args.natural_ends else "ignore_eos (each answer its full length)"
    lines = [
        f"CPU: {cpu_model_name()} ({cpu_isa()}), {args.threads} cores; model {Path(model).name}",
        f"ours: `appliance serve`, mode {args.mode}, speculative.method off / ngram with "
        f"num_speculative_tokens={args.k}; llama.cpp: llama-lookup --spec-draft-n-max "
        f"{args.k} / 0, -t {args.threads} {args.llama_flags}; other speculative.* settings "
        f"at their defaults{' but ' + ', '.join(args.server_env) if args.server_env else ''}",
        f"best of {plan.repeats} alternating rounds; batch 1: {plan.requests_b1} requests, "
        f"{plan.streams} streams: {plan.requests_streams}; greedy, {ends}",
        f"acceptance from {source}",
    ]
    if skipped:
        lines.append(f"llama.cpp rows left out: {skipped}")
    elif args.llama_server:
        lines.append(
            f"llama-server: -np {plan.streams} -t {args.threads} -c {plan.streams * SLOT_TOKENS}, "
            f"plain / --spec-type ngram-simple --spec-draft-n-max {args.k}"
        )
    if args.dry_run:
        lines.append("DRY RUN: tiny counts to check every path; these figures mean nothing")
    return "\n".join(lines)


def write(
    out: Path,
    args: argparse.Namespace,
    plan: Plan,
    text: str,
    cells: dict[tuple[str, int, str], Cell],
    targets: list[Goal],
    extra: dict[str, Any],
) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "speculative_bench.md").write_text(text + "\n")
    rows = []
    for cell in cells.values():
        runs = [{**plain(f), "acceptance": f.acceptance} for f in cell.runs]
        best = {**plain(cell.best()), "acceptance": cell.best().acceptance}
        rows.append({"workload": cell.workload, "streams": cell.streams,
                     "config": cell.config, "best": best, "runs": runs})  # fmt: skip
    payload = {
        "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "plan": plan,
        **extra,
        "cells": rows,
        "goals": [{**plain(g), "met": g.met} for g in targets],
    }
    (out / "speculative_bench.json").write_text(json.dumps(plain(payload), indent=2) + "\n")


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    plan = plan_of(args)
    started = time.perf_counter()
    settings = load_settings()
    tokenizer = prepare_tokenizer(settings.model, settings.cache_dir)[1]
    loads = loads_of(tokenizer, plan, args.seed)
    with tempfile.TemporaryDirectory(prefix="speculative-bench-") as scratch:
        out = args.out or (
            Path(scratch) if args.dry_run else ROOT / "benchmarks/results/speculative"
        )
        cells, skipped = run_rounds(args, plan, loads, tokenizer, out / "logs")
        counted = {}  # the dry run counts both ways, so both paths run
        if args.dry_run or not from_metrics(cells):
            counted = engine_acceptance(loads, plan, args.k, not args.natural_ends)
        source = fill_acceptance(cells, counted)
        targets = goals(cells, plan.streams)
        text = header(args, plan, source, skipped) + "\n\n" + tables(cells, targets)
        print(text)
        extra = {"cpu": cpu_model_name(), "isa": cpu_isa(), "acceptance_source": source,
                 "llama_cpp_skipped": skipped, "dry_run": args.dry_run,
                 "engine_counts": [{"workload": w, "streams": n, "drafted": d, "accepted": a}
                                   for (w, n), (d, a) in counted.items()],
                 "seconds": time.perf_counter() - started}  # fmt: skip
        write(out, args, plan, text, cells, targets, extra)
    failed = sum(f.failed for cell in cells.values() for f in cell.runs)
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
