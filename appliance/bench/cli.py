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
from typing import TYPE_CHECKING, Any

from appliance.bench import report
from appliance.bench.compare import (
    BASELINE,
    Run,
    Target,
    compare,
    default_target,
    llama_cpp_targets,
    naive_target,
    our_targets,
)
from appliance.bench.runner import Load, run_load
from appliance.bench.shift import DEFAULT_PHASES, Phase, Shift, make_shift, parse_phases
from appliance.bench.workloads import RequestSpec, generate
from appliance.core.goodput import SLO, RequestResult, phase_summaries, shift_total, summarize
from appliance.settings.config import load_settings

if TYPE_CHECKING:  # the model's modules load torch: only when a command runs
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
    # SUPPRESS: an option given before `compare` is not reset by compare's own default
    # (compare's own options say their defaults).
    cmp = modes.add_parser(
        "compare",
        help="start each layout (and peers) and run the same load",
        argument_default=argparse.SUPPRESS,
    )
    _add_common(cmp)
    cmp.add_argument(
        "--rates",
        default=None,
        help="comma-separated request rates to sweep (default: --request-rate)",
    )
    cmp.add_argument(
        "--configs",
        default="ours,peers",
        help="comma-separated: 'ours' (disaggregated, colocated x2, colocated x1), "
        "'default' (serve with no layout setting: the planner's default), "
        "'llama-cpp' (if installed), 'transformers' (naive), 'peers' (both)",
    )
    cmp.add_argument(
        "--llama-cpp-python", default=None, help="a python that has llama_cpp[server] installed"
    )


def _add_common(parser: argparse.ArgumentParser) -> None:
    suppress = parser.argument_default == argparse.SUPPRESS

    def default(value: Any) -> Any:  # compare's: none, bench's stand (see add_parser)
        return argparse.SUPPRESS if suppress else value

    parser.add_argument(
        "--workload",
        default=default("long-burst"),
        choices=["fixed", "chat", "long-burst", "shared-prefix", "grounded", "jsonl", "shift"],
        help="grounded: summarise, quote or edit a passage of the repository's docs, or "
        "return one of its functions renamed (answers copy their input)",
    )
    parser.add_argument(
        "--phases",
        type=_phases_arg,
        metavar="SPEC",
        help="shift workload: comma-separated workload:rate:seconds phases (workload chat, "
        "long-burst, fixed or shared-prefix; Poisson req/s), one after the other; "
        f"default {DEFAULT_PHASES}",
    )
    parser.add_argument("--jsonl", type=Path, help="prompts file for --workload jsonl")
    parser.add_argument("--input-len", type=int, default=default(128), help="fixed workload prompt")
    parser.add_argument("--output-len", type=int, default=default(64), help="fixed workload output")
    arrival = parser.add_mutually_exclusive_group()
    arrival.add_argument("--request-rate", type=float, help="Poisson arrivals per second")
    arrival.add_argument("--concurrency", type=int, help="closed loop: requests in flight")
    parser.add_argument("--num-requests", type=int, help="default 100 unless --duration")
    parser.add_argument("--duration", type=float, help="stop sending after this many seconds")
    parser.add_argument(
        "--warmup", type=int, default=default(2), help="requests run first, not counted"
    )
    parser.add_argument("--seed", type=int, default=default(0))
    parser.add_argument(
        "--goodput",
        nargs="+",
        default=default([]),
        metavar="METRIC:MS",
        help="SLO, e.g. ttft:2000 tpot:100",
    )
    parser.add_argument("--out", type=Path, help="folder for the JSON, table and plot")


def _phases_arg(text: str) -> list[Phase]:
    try:
        return parse_phases(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def run(args: argparse.Namespace) -> int:
    """Run `appliance bench [compare]`; exit code 1 when any request failed."""
    _settle_shift(args)
    if args.bench_command == "compare":
        return _compare(args)
    return _single(args)


def _settle_shift(args: argparse.Namespace) -> None:
    """--phases only with --workload shift, which takes its rates and lengths from them
    (the default phases when none are given)."""
    if args.workload != "shift":
        if args.phases is not None:
            raise ValueError("--phases goes with --workload shift only")
        return
    fixed_by_phases = {
        "--num-requests": args.num_requests,
        "--duration": args.duration,
        "--concurrency": args.concurrency,
        "--request-rate": args.request_rate,
        "--rates": getattr(args, "rates", None),
    }
    given = [flag for flag, value in fixed_by_phases.items() if value is not None]
    if given:
        raise ValueError(
            f"--workload shift takes its rates and lengths from --phases; drop {', '.join(given)}"
        )
    args.phases = args.phases or parse_phases(DEFAULT_PHASES)


def _tokenizer() -> Tokenizer:
    """Our tokenizer: prompts are built to exact token counts with it."""
    from appliance.model.model_source import prepare_tokenizer

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


def _shift(args: argparse.Namespace, tokenizer: Tokenizer) -> tuple[Shift, list[RequestSpec]]:
    """The shift of --phases and its warm-up requests."""
    return make_shift(
        args.phases, tokenizer, args.seed, args.warmup, args.input_len, args.output_len
    )


def _single_load(
    args: argparse.Namespace, tokenizer: Tokenizer, load: Load | None
) -> tuple[Load | Shift, Iterator[RequestSpec]]:
    if load is None:
        shift, warmup = _shift(args, tokenizer)
        return shift, iter(warmup)
    specs = _specs(args, tokenizer)
    if load.num_requests is not None:  # built now, not while the clock runs
        specs = iter(list(itertools.islice(specs, load.warmup + load.num_requests)))
    return load, specs


def _phase_parts(load: Load | Shift, results: list[RequestResult], slo: SLO) -> dict[str, Any]:
    """A shift run's per-phase summaries and whole-run row; nothing for other loads."""
    if not isinstance(load, Shift):
        return {}
    return {
        "phases": phase_summaries(results, load.phases, slo),
        "phases_total": shift_total(results, load.phases, slo),
    }


def _single(args: argparse.Namespace) -> int:
    slo = SLO.parse(args.goodput)
    asked = None if args.workload == "shift" else _load(args, args.request_rate)
    tokenizer = _tokenizer()
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else None
    load, specs = _single_load(args, tokenizer, asked)
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
    phases = _phase_parts(load, results, slo)
    text = report.table([(label, summary)])
    if phases:
        text += "\n\n" + report.phase_table(phases["phases"], phases["phases_total"])
    print(text)
    if args.out:
        payload = {"args": _args_dict(args), "slo": slo, "summary": summary}
        report.write_json(args.out / "result.json", {**payload, **phases, "results": results})
        (args.out / "table.md").write_text(text + "\n")
        report.plot_cdfs(args.out / "latency_cdf.png", {label: results}, _title(args, load))
    return 0 if summary.failed == 0 else 1


def _compare(args: argparse.Namespace) -> int:
    slo = SLO.parse(args.goodput)
    swept = [] if args.workload == "shift" else _sweep(args)
    tokenizer = _tokenizer()
    loads, specs = _compare_loads(args, tokenizer, swept)
    targets = _targets(args, tokenizer)
    count_tokens = lambda text: len(tokenizer.encode(text))  # noqa: E731
    runs = compare(
        targets, specs, loads, slo, count_tokens, args.out / "logs" if args.out else None
    )
    sections = [(_title(args, load), _runs_of(runs, load)) for load in loads]
    for title, section in sections:
        print(f"\n{_section_text(title, section)}")
    if args.out:
        _write_compare(args, slo, sections, runs)
    return 0 if all(r.summary.failed == 0 for r in runs) else 1


def _sweep(args: argparse.Namespace) -> list[Load]:
    """One load per rate of --rates (default: --request-rate, or the concurrency)."""
    asked = [float(r) for r in args.rates.split(",")] if args.rates else [args.request_rate]
    loads = [_load(args, rate) for rate in asked]
    if loads[0].num_requests is None:
        raise ValueError("compare needs --num-requests (every config gets the same requests)")
    return loads


def _compare_loads(
    args: argparse.Namespace, tokenizer: Tokenizer, swept: list[Load]
) -> tuple[list[Load | Shift], list[RequestSpec]]:
    """The loads each configuration is driven at, and the requests they send (a shift's:
    its warm-up, the schedule being the shift's own)."""
    if not swept:
        shift, warmup = _shift(args, tokenizer)
        return [shift], warmup
    total = args.warmup + (swept[0].num_requests or 0)
    return list(swept), list(itertools.islice(_specs(args, tokenizer), total))


def _targets(args: argparse.Namespace, tokenizer: Tokenizer) -> list[Target]:
    cores = len(os.sched_getaffinity(0))
    targets = []
    configs = set(args.configs.split(","))
    unknown = configs - {"ours", "default", "peers", "llama-cpp", "transformers"}
    if unknown:
        raise ValueError(
            f"unknown --configs {sorted(unknown)}; use ours, default, peers, llama-cpp, "
            "transformers"
        )
    from appliance.model.model_source import default_model_path

    gguf = load_settings().model or default_model_path()  # the model ours serve
    stop_ids = sorted(tokenizer.stop_token_ids)
    if "ours" in configs:
        targets += our_targets(cores)
    if "default" in configs:
        targets.append(default_target())
    if configs & {"peers", "llama-cpp"}:
        targets += llama_cpp_targets(gguf, cores, stop_ids, args.llama_cpp_python)
    if configs & {"peers", "transformers"}:
        targets.append(naive_target(gguf, cores))
    return targets


def _runs_of(runs: list[Run], load: Load | Shift) -> list[Run]:
    """The runs at `load` (rate None: a closed loop's or a shift's; only one of them)."""
    rate = None if isinstance(load, Shift) else load.rate
    return [r for r in runs if r.rate == rate]


def _section_text(title: str, runs: list[Run], heading: str = "") -> str:
    """One load's title and table; a shift's goodput per phase below it."""
    text = f"{heading}{title}\n\n{report.table([(r.label, r.summary) for r in runs], BASELINE)}"
    phased = [
        (r.label, r.phases, r.phases_total)
        for r in runs
        if r.phases is not None and r.phases_total is not None
    ]
    if phased:
        text += "\n\nGoodput req/s (SLO attainment) by phase\n\n"
        text += report.phase_compare_table(phased)
    return text


def _write_compare(
    args: argparse.Namespace, slo: SLO, sections: list[tuple[str, list[Run]]], runs: list[Run]
) -> None:
    out = args.out
    tables = [_section_text(title, section, "### ") + "\n" for title, section in sections]
    (out / "compare.md").write_text("\n".join(tables))
    payload = {"args": _args_dict(args), "slo": slo, "runs": [_run_dict(r) for r in runs]}
    report.write_json(out / "compare.json", payload)
    title, first = sections[0]
    report.plot_cdfs(out / "latency_cdf.png", {r.label: r.results for r in first}, title)
    if len(sections) > 1:
        sweep: dict[str, list] = {}
        for r in runs:
            sweep.setdefault(r.label, []).append((r.rate, r.summary))
        report.plot_sweep(out / "goodput_sweep.png", sweep, f"{args.workload} workload")


def _run_dict(run: Run) -> dict[str, Any]:
    phases = {} if run.phases is None else {"phases": run.phases, "phases_total": run.phases_total}
    summary = {"label": run.label, "rate": run.rate, "summary": run.summary}
    return {**summary, **phases, "results": run.results}


def _title(args: argparse.Namespace, load: Load | Shift) -> str:
    slo = " ".join(args.goodput) or "none"
    if isinstance(load, Shift):
        phases = ", ".join(f"{p.label(i)} for {p.seconds:g} s" for i, p in enumerate(load.phases))
        return f"shift workload, phases {phases}, {len(load.schedule)} requests, SLO {slo}"
    arrival = f"{load.rate} req/s Poisson" if load.rate else f"concurrency {load.concurrency}"
    return f"{args.workload} workload, {arrival}, {load.num_requests} requests, SLO {slo}"


def _args_dict(args: argparse.Namespace) -> dict:
    return {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}


def main() -> None:  # for `python -m appliance.bench.cli`
    parser = argparse.ArgumentParser(prog="appliance")
    add_parser(parser.add_subparsers(dest="command", required=True))
    sys.exit(run(parser.parse_args()))
