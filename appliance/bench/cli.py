"""The `appliance bench` and `appliance bench compare` commands."""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import sys
from collections.abc import Iterator
from pathlib import Path

from appliance.bench import report
from appliance.bench.compare import (
    BASELINE,
    Run,
    compare,
    llama_cpp_targets,
    naive_target,
    our_targets,
)
from appliance.bench.metrics import SLO, summarize
from appliance.bench.runner import Load, run_load
from appliance.bench.workloads import RequestSpec, generate
from appliance.config import load_settings
from appliance.model.loader import default_model_path, prepare_tokenizer
from appliance.model.tokenizer import Tokenizer


def add_parser(commands: argparse._SubParsersAction) -> None:
    """Add `bench` (and its `compare`) to the `appliance` command's subcommands."""
    bench = commands.add_parser(
        "bench",
        help="load-test an OpenAI-compatible endpoint (or `bench compare` the pool layouts)",
    )
    _add_common(bench)
    bench.add_argument("--url", default="http://127.0.0.1:8000", help="endpoint base URL")
    bench.add_argument("--model", help="model id to send (default: the endpoint's first)")
    bench.add_argument("--api-key", help="sent as a Bearer token")
    bench.add_argument("--extra-body", default="{}", help="JSON merged into every request")
    bench.add_argument("--label", default="", help="name of this run in the table")
    modes = bench.add_subparsers(dest="bench_command")
    # SUPPRESS: an option given before `compare` is not reset by compare's own default.
    cmp = modes.add_parser(
        "compare",
        help="start each layout (and peers) and run the same load",
        argument_default=argparse.SUPPRESS,
    )
    _add_common(cmp)
    cmp.add_argument(
        "--rates", help="comma-separated request rates to sweep (default: --request-rate)"
    )
    cmp.add_argument(
        "--configs",
        default="ours,peers",
        help="comma-separated: 'ours' (disaggregated, colocated x2, colocated x1), "
        "'llama-cpp' (if installed), 'transformers' (naive), 'peers' (both)",
    )
    cmp.add_argument("--llama-cpp-python", help="a python that has llama_cpp[server] installed")


def _add_common(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--workload",
        default="long-burst",
        choices=["fixed", "chat", "long-burst", "shared-prefix", "jsonl"],
    )
    parser.add_argument("--jsonl", type=Path, help="prompts file for --workload jsonl")
    parser.add_argument("--input-len", type=int, default=128, help="fixed workload prompt")
    parser.add_argument("--output-len", type=int, default=64, help="fixed workload output")
    arrival = parser.add_mutually_exclusive_group()
    arrival.add_argument("--request-rate", type=float, help="Poisson arrivals per second")
    arrival.add_argument("--concurrency", type=int, help="closed loop: requests in flight")
    parser.add_argument("--num-requests", type=int, help="default 100 unless --duration")
    parser.add_argument("--duration", type=float, help="stop sending after this many seconds")
    parser.add_argument("--warmup", type=int, default=2, help="requests run first, not counted")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--goodput", nargs="+", default=[], metavar="METRIC:MS", help="SLO, e.g. ttft:2000 tpot:100"
    )
    parser.add_argument("--out", type=Path, help="folder for the JSON, table and plot")


def run(args: argparse.Namespace) -> int:
    """Run `appliance bench [compare]`; exit code 1 when any request failed."""
    if args.bench_command == "compare":
        return _compare(args)
    return _single(args)


def _tokenizer() -> Tokenizer:
    """Our tokenizer: prompts are built to exact token counts with it."""
    settings = load_settings()
    return prepare_tokenizer(settings.model, settings.cache_dir)[1]


def _load(args: argparse.Namespace, rate: float | None) -> Load:
    concurrency = None if rate is not None else args.concurrency
    if rate is None and concurrency is None:
        rate = float("inf")  # everything at once, as vLLM's benchmark does by default
    count = args.num_requests or (None if args.duration else 100)
    return Load(rate, concurrency, count, args.duration, args.warmup, args.seed)


def _specs(args: argparse.Namespace, tokenizer: Tokenizer) -> Iterator[RequestSpec]:
    return generate(
        args.workload, tokenizer, args.seed, args.input_len, args.output_len, args.jsonl
    )


def _single(args: argparse.Namespace) -> int:
    slo = SLO.parse(args.goodput)
    load = _load(args, args.request_rate)
    tokenizer = _tokenizer()
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else None
    specs = _specs(args, tokenizer)
    if load.num_requests is not None:  # built now, not while the clock runs
        specs = iter(list(itertools.islice(specs, load.warmup + load.num_requests)))
    results, seconds = asyncio.run(
        run_load(
            args.url,
            specs,
            load,
            lambda text: len(tokenizer.encode(text)),
            model=args.model,
            extra_body=json.loads(args.extra_body),
            headers=headers,
            label=args.label,
        )
    )
    summary = summarize(results, seconds, slo)
    label = args.label or args.url
    print(report.table([(label, summary)]))
    if args.out:
        payload = {"args": _args_dict(args), "slo": slo, "summary": summary, "results": results}
        report.write_json(args.out / "result.json", payload)
        (args.out / "table.md").write_text(report.table([(label, summary)]) + "\n")
        report.plot_cdfs(args.out / "latency_cdf.png", {label: results}, _title(args, load))
    return 0 if summary.failed == 0 else 1


def _compare(args: argparse.Namespace) -> int:
    slo = SLO.parse(args.goodput)
    asked = [float(r) for r in args.rates.split(",")] if args.rates else [args.request_rate]
    loads = [_load(args, rate) for rate in asked]
    rates = [load.rate for load in loads]  # what each run records (None: closed loop)
    if loads[0].num_requests is None:
        raise ValueError("compare needs --num-requests (every config gets the same requests)")
    tokenizer = _tokenizer()
    total = args.warmup + loads[0].num_requests
    specs = list(itertools.islice(_specs(args, tokenizer), total))
    cores = len(os.sched_getaffinity(0))
    targets = []
    configs = set(args.configs.split(","))
    unknown = configs - {"ours", "peers", "llama-cpp", "transformers"}
    if unknown:
        raise ValueError(
            f"unknown --configs {sorted(unknown)}; use ours, peers, llama-cpp, transformers"
        )
    gguf = load_settings().model or default_model_path()  # the model ours serve
    stop_ids = sorted(tokenizer.stop_token_ids)
    if "ours" in configs:
        targets += our_targets(cores)
    if configs & {"peers", "llama-cpp"}:
        targets += llama_cpp_targets(gguf, cores, stop_ids, args.llama_cpp_python)
    if configs & {"peers", "transformers"}:
        targets.append(naive_target(gguf, cores))
    count_tokens = lambda text: len(tokenizer.encode(text))  # noqa: E731
    runs = compare(
        targets, specs, loads, slo, count_tokens, args.out / "logs" if args.out else None
    )
    for rate in rates:
        rows = [(r.label, r.summary) for r in runs if r.rate == rate]
        print(f"\n{_title(args, _load(args, rate))}\n")
        print(report.table(rows, BASELINE))
    if args.out:
        _write_compare(args, slo, rates, runs)
    return 0 if all(r.summary.failed == 0 for r in runs) else 1


def _write_compare(
    args: argparse.Namespace, slo: SLO, rates: list[float | None], runs: list[Run]
) -> None:
    out = args.out
    tables = []
    for rate in rates:
        rows = [(r.label, r.summary) for r in runs if r.rate == rate]
        tables.append(f"### {_title(args, _load(args, rate))}\n\n{report.table(rows, BASELINE)}\n")
    (out / "compare.md").write_text("\n".join(tables))
    payload = {
        "args": _args_dict(args),
        "slo": slo,
        "runs": [
            {"label": r.label, "rate": r.rate, "summary": r.summary, "results": r.results}
            for r in runs
        ],
    }
    report.write_json(out / "compare.json", payload)
    first = {r.label: r.results for r in runs if r.rate == rates[0]}
    report.plot_cdfs(out / "latency_cdf.png", first, _title(args, _load(args, rates[0])))
    if len(rates) > 1:
        sweep: dict[str, list] = {}
        for r in runs:
            sweep.setdefault(r.label, []).append((r.rate, r.summary))
        report.plot_sweep(out / "goodput_sweep.png", sweep, f"{args.workload} workload")


def _title(args: argparse.Namespace, load: Load) -> str:
    arrival = f"{load.rate} req/s Poisson" if load.rate else f"concurrency {load.concurrency}"
    slo = " ".join(args.goodput) or "none"
    return f"{args.workload} workload, {arrival}, {load.num_requests} requests, SLO {slo}"


def _args_dict(args: argparse.Namespace) -> dict:
    return {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}


def main() -> None:  # for `python -m appliance.bench.cli`
    parser = argparse.ArgumentParser(prog="appliance")
    add_parser(parser.add_subparsers(dest="command", required=True))
    sys.exit(run(parser.parse_args()))
