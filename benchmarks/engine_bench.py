"""Our engine against Hugging Face transformers' `generate`: same model, dtype, machine, run.

For each dtype in `--dtypes` it loads `LLMEngine` (timing `LLMEngine.from_settings`) and a
copy of the transformers model read from the same GGUF file, then measures, on the same
deterministic token ids fed to both sides (greedy, EOS never stops a request):

prefill
    One request of `prefill_len` (1024) prompt tokens and one output token, timed from
    the call to its completion. Ours: `engine.generate([ids], max_tokens=1)` with the
    whole prompt in one chunk. Transformers: `generate(max_new_tokens=1)`.
    Rate = prompt tokens / seconds.
decode b1 / decode bN
    1 (or N = 32) prompts of `decode_prompt_len` (32) tokens, each producing
    `decode_tokens` (64) or `batch_tokens` (32) new tokens. The clock starts when every
    request has its first token (so prefill and the first sample are excluded) and
    stops when the last token is out. Ours: `add_request` + `step()` loop, timestamps
    taken after each step. Transformers: one `generate(min_new_tokens=max_new_tokens=n)`
    call with a StoppingCriteria that only timestamps each decoding step (it runs
    after each step's token is appended and never stops anything).
    Rate = tokens made after the clock started / seconds = batch × (n - 1) / seconds.
    `min_new_tokens` keeps transformers from stopping at EOS; ours uses `ignore_eos`.

Each measurement runs once untimed as a warm-up, then `--repeats` times, alternating
ours and transformers so background load hits both alike; the table shows the best run
(highest rate) and the median of the paired ratios (each of our runs over the
transformers run right after it), and the JSON beside it keeps every run. On CUDA each
timestamp is taken after a device synchronize.

Run from the repository root:  .venv/bin/python benchmarks/engine_bench.py
`--quick` shrinks everything (128-token prefill, 8 decode tokens, batch 4, 1 repeat) to
check the script itself; its results go to files with a `_quick` suffix.
"""

from __future__ import annotations

import argparse
import copy
import datetime
import gc
import json
import platform
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from appliance.engine.llm_engine import LLMEngine
from appliance.engine.sequence import SamplingParams
from appliance.model.model_source import default_model_path
from appliance.settings.config import load_settings
from appliance.topology.cpu import cpu_model_name

REPO_ROOT = Path(__file__).resolve().parents[1]

PROMPT_TEXT = (
    "The appliance serves a small language model on one machine. Requests arrive over "
    "HTTP, are tokenized, scheduled in batches, and stream their answers back token by "
    "token while the paged key-value cache holds what each request has already seen. "
)
TARGETS = {"prefill": 1.0, "decode_b1": 3.0, "decode_batch": 2.0}
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class Shape:
    """Sizes of one benchmark run."""

    prefill_len: int
    decode_prompt_len: int
    decode_tokens: int
    batch: int
    batch_tokens: int
    repeats: int


FULL = Shape(
    prefill_len=1024, decode_prompt_len=32, decode_tokens=64, batch=32, batch_tokens=32, repeats=3
)
QUICK = Shape(
    prefill_len=128, decode_prompt_len=32, decode_tokens=8, batch=4, batch_tokens=8, repeats=1
)


@dataclass
class Run:
    """One timed run: `tokens` counted over `seconds`, and the first request's output ids."""

    tokens: int
    seconds: float
    output_ids: list[int] = field(default_factory=list)

    @property
    def rate(self) -> float:
        return self.tokens / self.seconds


@dataclass
class Result:
    """One table row with every run behind it (rates in tokens/s)."""

    metric: str
    label: str
    dtype: str
    ours: list[float]
    transformers: list[float]
    target: float
    agreement: str = ""  # leading greedy tokens equal to transformers' in the same dtype
    float32_agreement: str = ""  # ours / transformers': each against transformers float32

    @property
    def ratio(self) -> float:
        return max(self.ours) / max(self.transformers)

    @property
    def paired_ratio(self) -> float:
        """Median of each of our runs over the transformers run after it: the two ran
        back to back, so load that drifts over minutes cancels within each pair."""
        return statistics.median(o / t for o, t in zip(self.ours, self.transformers, strict=True))


Bench = Callable[[], Run]


# ---------------------------------------------------------------- timing helpers


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def now(device: torch.device) -> float:
    sync(device)
    return time.perf_counter()


# ---------------------------------------------------------------- our engine


def load_engine(dtype: str, weights: str, device: str) -> tuple[LLMEngine, float]:
    """Build the engine with the whole long prompt allowed in one chunk; time the build.
    Prefix caching is off: every run feeds the same ids, and a cached prompt would not be
    computed at all (benchmarks/prefix_cache_bench.py measures that)."""
    settings = load_settings(
        dtype=dtype,
        weights=weights,
        device=device,
        batch={"chunk_size": 2048, "max_num_batched_tokens": 2048},
        kv={"prefix_caching": False},
    )
    start = time.perf_counter()
    engine = LLMEngine.from_settings(settings)
    return engine, time.perf_counter() - start


def ours_prefill(engine: LLMEngine, ids: list[int]) -> Run:
    params = SamplingParams(max_tokens=1, ignore_eos=True)
    start = now(engine.model.device)
    [completion] = engine.generate([ids], params)
    seconds = now(engine.model.device) - start
    return Run(len(ids), seconds, completion.token_ids)


def ours_decode(engine: LLMEngine, prompts: list[list[int]], new_tokens: int) -> Run:
    """Step until done; count and time only what comes after every request's first token."""
    params = SamplingParams(max_tokens=new_tokens, ignore_eos=True)
    order = [engine.add_request(p, params) for p in prompts]
    outputs: dict[int, list[int]] = {seq_id: [] for seq_id in order}
    start: float | None = None
    end = 0.0
    counted = 0
    while engine.has_unfinished():
        step = engine.step()
        end = time.perf_counter()
        for out in step:
            outputs[out.seq_id].extend(out.token_ids)
            counted += len(out.token_ids) if start is not None else 0
        if start is None and all(outputs.values()):
            start = end
    if start is None or counted == 0:
        raise RuntimeError("decode run made no tokens after the first ones")
    return Run(counted, end - start, outputs[order[0]])


# ---------------------------------------------------------------- transformers


def load_hf_model(device: torch.device) -> tuple[Any, float]:
    """The same GGUF through transformers, dequantized to float32."""
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging

    logging.set_verbosity_error()
    logging.disable_progress_bar()
    path = default_model_path()
    start = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32
    )
    model.to(device).eval()
    return model, time.perf_counter() - start


def make_step_clock(device: torch.device) -> tuple[Any, list[float]]:
    """A StoppingCriteria that records a timestamp after each decoding step, stops nothing."""
    from transformers import StoppingCriteria

    times: list[float] = []

    class StepClock(StoppingCriteria):
        def __call__(self, input_ids: torch.Tensor, scores: Any, **kwargs: Any) -> torch.Tensor:
            times.append(now(device))
            return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)

    return StepClock(), times


def hf_generate(model: Any, ids: torch.Tensor, new_tokens: int, clock: Any = None) -> torch.Tensor:
    from transformers import StoppingCriteriaList

    eos = model.generation_config.eos_token_id
    pad = eos[0] if isinstance(eos, list) else eos
    return model.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        max_new_tokens=new_tokens,
        min_new_tokens=new_tokens,
        do_sample=False,
        pad_token_id=pad,
        stopping_criteria=StoppingCriteriaList([clock] if clock is not None else []),
    )


def hf_prefill(model: Any, ids: list[int]) -> Run:
    tensor = torch.tensor([ids], device=model.device)
    start = now(model.device)
    out = hf_generate(model, tensor, 1)
    seconds = now(model.device) - start
    return Run(len(ids), seconds, out[0, len(ids) :].tolist())


def hf_decode(model: Any, prompts: list[list[int]], new_tokens: int) -> Run:
    tensor = torch.tensor(prompts, device=model.device)
    clock, times = make_step_clock(model.device)
    out = hf_generate(model, tensor, new_tokens, clock)
    if len(times) != new_tokens:
        raise RuntimeError(f"expected {new_tokens} decoding steps, timed {len(times)}")
    return Run(
        len(prompts) * (new_tokens - 1), times[-1] - times[0], out[0, tensor.shape[1] :].tolist()
    )


# ---------------------------------------------------------------- measurements


def prompt_ids(engine: LLMEngine, length: int, offset: int = 0) -> list[int]:
    """Deterministic ids: the tokenized repeated text, cut to exactly `length` tokens."""
    text = PROMPT_TEXT
    ids = engine.tokenizer.encode(text)
    while len(ids) < length + offset:
        text += PROMPT_TEXT
        ids = engine.tokenizer.encode(text)
    return ids[offset : offset + length]


def compare(ours: Bench, theirs: Bench, repeats: int) -> tuple[list[Run], list[Run]]:
    """One warm-up each, then `repeats` runs alternating ours and theirs."""
    ours()
    theirs()
    ours_runs: list[Run] = []
    their_runs: list[Run] = []
    for _ in range(repeats):
        ours_runs.append(ours())
        their_runs.append(theirs())
    return ours_runs, their_runs


def agreement(ours: Run, theirs: Run) -> str:
    """How many leading greedy tokens the two sides share (a same-model sanity check)."""
    same = 0
    for a, b in zip(ours.output_ids, theirs.output_ids, strict=False):
        if a != b:
            break
        same += 1
    return f"{same}/{min(len(ours.output_ids), len(theirs.output_ids))}"


def float32_agreement(ours: Run, theirs: Run, reference: Run) -> str:
    """Leading greedy tokens each side shares with transformers in float32. In 16-bit
    floats both sides round differently, and one near-tie between two tokens ends the
    agreement with each other; this says which side stays nearer the exact model."""
    return f"{agreement(ours, reference)} / {agreement(theirs, reference)}"


def measure_dtype(
    engine: LLMEngine, model: Any, base: Any, dtype: str, shape: Shape, references: dict[str, Run]
) -> list[Result]:
    """The three measurements for one dtype. `references` caches transformers' float32
    run of each (`base`, the float32 model: measured as float32's own runs, or once
    here for the first other dtype)."""
    long_prompt = prompt_ids(engine, shape.prefill_len)
    short = [prompt_ids(engine, shape.decode_prompt_len, 7 * i) for i in range(shape.batch)]
    cases: list[tuple[str, str, Bench, Callable[[Any], Bench]]] = [
        (
            "prefill",
            f"prefill {shape.prefill_len} tok",
            lambda: ours_prefill(engine, long_prompt),
            lambda m: lambda: hf_prefill(m, long_prompt),
        ),
        (
            "decode_b1",
            "decode b1",
            lambda: ours_decode(engine, short[:1], shape.decode_tokens),
            lambda m: lambda: hf_decode(m, short[:1], shape.decode_tokens),
        ),
        (
            "decode_batch",
            f"decode b{shape.batch}",
            lambda: ours_decode(engine, short, shape.batch_tokens),
            lambda m: lambda: hf_decode(m, short, shape.batch_tokens),
        ),
    ]
    results = []
    for metric, label, ours, theirs in cases:
        ours_runs, their_runs = compare(ours, theirs(model), shape.repeats)
        if model is base:
            references.setdefault(metric, their_runs[-1])
        elif metric not in references:
            references[metric] = theirs(base)()
        results.append(
            Result(
                metric,
                label,
                dtype,
                [r.rate for r in ours_runs],
                [r.rate for r in their_runs],
                TARGETS[metric],
                agreement(ours_runs[-1], their_runs[-1]),
                float32_agreement(ours_runs[-1], their_runs[-1], references[metric]),
            )
        )
        print(
            f"  {label:<18} ours {max(results[-1].ours):10.1f} tok/s   "
            f"transformers {max(results[-1].transformers):10.1f} tok/s",
            flush=True,
        )
    return results


def hf_for_dtype(base: Any, dtype: str) -> Any:
    """The float32 model itself, or a converted copy (so float32 is never round-tripped)."""
    if DTYPES[dtype] == torch.float32:
        return base
    return copy.deepcopy(base).to(DTYPES[dtype])


# ---------------------------------------------------------------- report


def environment(device: torch.device, shape: Shape, quick: bool) -> dict[str, Any]:
    import transformers

    env: dict[str, Any] = {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "torch_threads": torch.get_num_threads(),
        "cpu": cpu_model_name(),
        "device": device.type,
        "quick": quick,
        "shape": asdict(shape),
    }
    if device.type == "cuda":
        env["gpu"] = torch.cuda.get_device_name(device)
    return env


def markdown(
    env: dict[str, Any], loads: dict[str, float], hf_load: float, rows: list[Result]
) -> str:
    shape = env["shape"]
    lines = [
        f"# Engine vs transformers `generate` ({env['device']}{', quick' if env['quick'] else ''})",
        "",
        f"- date: {env['date']}",
        f"- torch {env['torch']}, transformers {env['transformers']}, python {env['python']}",
        f"- CPU: {env['cpu']}, torch threads: {env['torch_threads']}"
        + (f", GPU: {env['gpu']}" if "gpu" in env else ""),
        "- `LLMEngine.from_settings` load time: "
        + ", ".join(f"{d} {s:.2f} s" for d, s in loads.items())
        + f"; transformers GGUF load (float32): {hf_load:.2f} s",
        f"- best of {shape['repeats']} timed run(s) after one warm-up; decode prompts "
        f"{shape['decode_prompt_len']} tokens, b1 makes {shape['decode_tokens']} tokens, "
        f"batch makes {shape['batch_tokens']} per request; decode rates exclude prefill",
        "",
        "| metric | dtype | ours (tok/s) | transformers (tok/s) | ratio | median of paired "
        "ratios | target | met |"
        " greedy agree | agree with float32: ours / transformers |",
        "|---|---|---:|---:|---:|---:|---:|:-:|:-:|:-:|",
    ]
    for r in rows:
        lines.append(
            f"| {r.label} | {r.dtype} | {max(r.ours):.1f} | {max(r.transformers):.1f} | "
            f"{r.ratio:.2f}× | {r.paired_ratio:.2f}× | ≥{r.target:g}× | "
            f"{'yes' if r.ratio >= r.target else 'no'} | "
            f"{r.agreement} | {r.float32_agreement} |"
        )
    lines += [
        "",
        "ratio: our best run over transformers' best (what the target is judged on); "
        "median of paired ratios: each of our runs over the transformers run right after "
        "it, so load that drifts between runs cancels within a pair.",
        "",
        "greedy agree: leading tokens of the first request equal to transformers' in the "
        "same dtype. In bfloat16 both sides round differently and one near-tie ends that "
        "run; the last column counts each side's agreement with transformers in float32.",
    ]
    return "\n".join(lines) + "\n"


def raw_json(
    env: dict[str, Any], loads: dict[str, float], hf_load: float, rows: list[Result]
) -> str:
    data = {
        "environment": env,
        "engine_load_seconds": loads,
        "transformers_load_seconds": hf_load,
        "results": [
            {
                **asdict(r),
                "ours_best": max(r.ours),
                "ours_median": statistics.median(r.ours),
                "transformers_best": max(r.transformers),
                "transformers_median": statistics.median(r.transformers),
                "ratio": r.ratio,
                "paired_ratio": r.paired_ratio,
            }
            for r in rows
        ],
    }
    return json.dumps(data, indent=2) + "\n"


# ---------------------------------------------------------------- main


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument(
        "--dtypes",
        default="float32:dense,bfloat16:dense,float32:quantized",
        help="comma-separated dtypes, each with an optional :weights (dense, quantized, auto); "
        "transformers always runs dense weights of that dtype",
    )
    parser.add_argument("--repeats", type=int, default=None, help="timed runs per measurement")
    parser.add_argument("--quick", action="store_true", help="tiny sizes, to test the script")
    parser.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads")
    parser.add_argument("--out-dir", type=Path, default=REPO_ROOT / "benchmarks" / "results")
    args = parser.parse_args(argv)
    args.dtypes = [d.strip() for d in args.dtypes.split(",") if d.strip()]
    unknown = [d for d in args.dtypes if d.partition(":")[0] not in DTYPES]
    if unknown:
        parser.error(f"unknown dtype {unknown[0]!r}; choose from {', '.join(DTYPES)}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    shape = QUICK if args.quick else FULL
    if args.repeats:
        shape = Shape(**{**asdict(shape), "repeats": args.repeats})

    loads: dict[str, float] = {}
    rows: list[Result] = []
    references: dict[str, Run] = {}
    base = None
    hf_load = 0.0
    for config in args.dtypes:
        dtype, _, weights = config.partition(":")
        label = f"{dtype} ({weights} weights)" if weights else dtype
        print(f"[{label}] loading our engine ...", flush=True)
        engine, loads[label] = load_engine(dtype, weights or "dense", args.device)
        if base is None:
            print("loading the transformers model from the GGUF ...", flush=True)
            base, hf_load = load_hf_model(engine.model.device)
        model = hf_for_dtype(base, dtype)
        rows += measure_dtype(engine, model, base, label, shape, references)
        del engine, model
        gc.collect()

    device = torch.device(base.device.type) if base is not None else torch.device("cpu")
    env = environment(device, shape, args.quick)
    table = markdown(env, loads, hf_load, rows)
    print("\n" + table)
    stem = f"engine_{device.type}{'_quick' if args.quick else ''}"
    args.out_dir.mkdir(parents=True, exist_ok=True)
    (args.out_dir / f"{stem}.md").write_text(table)
    (args.out_dir / f"{stem}.json").write_text(raw_json(env, loads, hf_load, rows))
    print(f"wrote {args.out_dir / stem}.md and .json")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
