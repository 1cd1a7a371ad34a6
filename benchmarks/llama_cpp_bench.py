"""Our engine against llama.cpp on the same GGUF file, thread count and machine, one run.

llama.cpp's numbers come from its own tools (llama-bench: pp512 and tg128; llama-batched-
bench: 16 sequences decoding at once), built from the llama-cpp-python sdist by
benchmarks/build_llama_cpp.sh (or named with --llama-bin). Ours, on the same shapes:

prefill 512   one request of 512 prompt tokens, one output token: prompt tokens / second
decode b1     one request, 128 new tokens after its prefill: tokens / second of the steps
decode b16    16 requests of 128-token prompts, 128 new tokens each: all new tokens /
              second of the steps after every prefill (llama-batched-bench's S_TG)

Each side runs `--repeats` times, alternating, and the table shows each side's best run
and the ratio of the bests. The table names the CPU, its ISA level and the kernels' level.
Then it reports where one batch-1 decode step of ours spends its time, part by part.

Run from the repository root:
    benchmarks/build_llama_cpp.sh && .venv/bin/python benchmarks/llama_cpp_bench.py
    .venv/bin/python benchmarks/llama_cpp_bench.py --cpu-isa avx2   # our AVX2 kernels

With --cpu-isa avx2 torch is held to AVX2 too (its prefill GEMM and attention: MKL, oneDNN
and ATen's own kernels read their caps from the environment, so the script starts itself
again with them set), as on a CPU without AVX-512.
"""

from __future__ import annotations

import argparse
import csv
import io
import os
import re
import statistics
import subprocess
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch

from appliance.engine.llm_engine import LLMEngine
from appliance.engine.sequence import SamplingParams
from appliance.model import cpu_kernels
from appliance.model.cpu_kernels import loading
from appliance.model.model_source import default_model_path
from appliance.settings.config import load_settings
from appliance.topology.cpu import cpu_model_name

REPO_ROOT = Path(__file__).resolve().parents[1]


def cpu_isa() -> str:
    flags = Path("/proc/cpuinfo").read_text()
    names = ("avx512_bf16", "avx512_vnni", "avx512f", "avx2", "fma", "f16c", "neon", "asimd")
    return " ".join(n.upper() for n in names if re.search(rf"\b{n}\b", flags))


def llama_bench(binary: Path, model: Path, threads: int) -> dict[str, float]:
    out = subprocess.run(
        [str(binary), "-m", str(model), "-t", str(threads), "-p", "512", "-n", "128",
         "-r", "1", "-o", "csv"],
        capture_output=True, text=True, check=True, timeout=600,
    ).stdout  # fmt: skip
    rows = list(csv.DictReader(io.StringIO(out)))
    return {
        "prefill 512" if row["n_prompt"] == "512" else "decode b1": float(row["avg_ts"])
        for row in rows
    }


def llama_batched(binary: Path, model: Path, threads: int, batch: int) -> float:
    out = subprocess.run(
        [str(binary), "-m", str(model), "-t", str(threads), "-c", "8192", "-b", "2048",
         "-ub", "512", "-npp", "128", "-ntg", "128", "-npl", str(batch)],
        capture_output=True, text=True, check=True, timeout=900,
    ).stdout  # fmt: skip
    for line in out.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) >= 8 and cells[0] == "128" and cells[2] == str(batch):
            return float(cells[7])  # S_TG t/s
    raise RuntimeError(f"llama-batched-bench printed no row for batch {batch}:\n{out}")


def ours_prefill(engine: LLMEngine, length: int) -> float:
    ids = [(7 * i) % 4000 + 100 for i in range(length)]
    start = time.perf_counter()
    engine.generate([ids], SamplingParams(max_tokens=1, temperature=0, ignore_eos=True))
    return length / (time.perf_counter() - start)


def ours_decode(engine: LLMEngine, batch: int, prompt: int, new: int) -> float:
    for b in range(batch):
        ids = [(11 * i + b) % 4000 + 100 for i in range(prompt)]
        engine.add_request(ids, SamplingParams(max_tokens=new, temperature=0, ignore_eos=True))
    engine.step()  # every prefill in one step (16 x 128 tokens fit its budget)
    start, made = time.perf_counter(), 0
    while engine.has_unfinished():
        made += sum(len(o.token_ids) for o in engine.step())
    return made / (time.perf_counter() - start)


class TimedKernels:
    """The compiled module with a clock on each call (about a microsecond a call)."""

    def __init__(self, module: object) -> None:
        self.module = module
        self.seconds: dict[str, float] = defaultdict(float)

    def __getattr__(self, name: str) -> object:
        function = getattr(self.module, name)
        if not callable(function):
            return function

        def timed(*args: object) -> object:
            start = time.perf_counter()
            try:
                return function(*args)
            finally:
                self.seconds[name] += time.perf_counter() - start

        return timed


def step_breakdown(engine: LLMEngine, steps: int = 64) -> list[tuple[str, float]]:
    """Milliseconds per batch-1 decode step in each compiled kernel, and the rest."""
    ids = list(range(100, 132))
    engine.add_request(ids, SamplingParams(max_tokens=steps + 1, temperature=0, ignore_eos=True))
    engine.step()
    # Every kernel call reads the module through loading.compiled(): the timer sees them all.
    timed = TimedKernels(loading.compiled())
    loading._cpu_kernels = timed
    try:
        start = time.perf_counter()
        while engine.has_unfinished():
            engine.step()
        total = (time.perf_counter() - start) / steps * 1000
    finally:
        loading._cpu_kernels = timed.module
    parts = {"the layers, one compiled call": "decode_step",
             "quantized matmuls": "quant_matmul", "decode attention": "paged_decode",
             "add + RMSNorm": "add_rms_norm", "RoPE + KV store": "rope_store",
             "embedding rows": "quant_rows"}  # fmt: skip
    out = [(label, timed.seconds[name] / steps * 1000) for label, name in parts.items()]
    kernels = sum(ms for _, ms in out)
    out.append(("everything else (Python, torch ops, sampling)", total - kernels))
    out.append(("step", total))
    out.append(("step / its kernels (a ratio, not ms)", total / kernels))
    return out


def breakdowns(engine: LLMEngine) -> dict[str, list[tuple[str, float]]]:
    """step_breakdown() with the compiled decode step and with the Python layers."""
    compiled = engine.model.decode_step
    out = {"compiled step": step_breakdown(engine)} if compiled is not None else {}
    engine.model.decode_step = None
    try:
        out["Python layers"] = step_breakdown(engine)
    finally:
        engine.model.decode_step = compiled
    return out


TORCH_AVX2 = {
    "ATEN_CPU_CAPABILITY": "avx2",
    "MKL_ENABLE_INSTRUCTIONS": "AVX2",
    "ONEDNN_MAX_CPU_ISA": "AVX2",
}


def hold_torch_to_avx2() -> None:
    """Start this script again with torch's libraries held to AVX2, unless they are."""
    if any(os.environ.get(name) != value for name, value in TORCH_AVX2.items()):
        os.execve(sys.executable, [sys.executable, *sys.argv], {**os.environ, **TORCH_AVX2})


def built_for(llama_bin: Path) -> str:
    """How build_llama_cpp.sh built the binaries in `llama_bin` (bin-avx2: LLAMA_CPP_ISA)."""
    if llama_bin.name.endswith("avx2"):
        return "for AVX2 + FMA + F16C only (LLAMA_CPP_ISA=avx2)"
    return "with GGML_NATIVE for this CPU"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--llama-bin", type=Path, default=REPO_ROOT / ".bench/llama.cpp/bin")
    parser.add_argument("--cpu-isa", default="auto")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--batch", type=int, default=16)
    args = parser.parse_args()
    if args.cpu_isa == "avx2":
        hold_torch_to_avx2()
    torch.set_num_threads(args.threads)
    model = default_model_path()
    # No prefix caching: every run feeds the same prompt, and a hit is no prefill.
    kv = {"memory_mb": 1024, "prefix_caching": False}
    settings = load_settings(device="cpu", cpu_isa=args.cpu_isa, kv=kv)
    engine = LLMEngine.from_settings(settings)
    ours: dict[str, list[float]] = {"prefill 512": [], "decode b1": [], f"decode b{args.batch}": []}
    theirs: dict[str, list[float]] = {k: [] for k in ours}
    for _ in range(args.repeats):
        ours["prefill 512"].append(ours_prefill(engine, 512))
        ours["decode b1"].append(ours_decode(engine, 1, 32, 129))
        ours[f"decode b{args.batch}"].append(ours_decode(engine, args.batch, 128, 129))
        for kind, rate in llama_bench(args.llama_bin / "llama-bench", model, args.threads).items():
            theirs[kind].append(rate)
        batched = llama_batched(args.llama_bin / "llama-batched-bench", model, args.threads,
                                args.batch)  # fmt: skip
        theirs[f"decode b{args.batch}"].append(batched)
    print(f"CPU: {cpu_model_name()} ({cpu_isa()}); {args.threads} threads; model {model.name}")
    print(f"our kernels: {cpu_kernels.level()} (cpu_isa={args.cpu_isa}), torch's "
          f"{torch.backends.cpu.get_cpu_capability()}; "
          f"llama.cpp built {built_for(args.llama_bin)}; best of {args.repeats}\n")  # fmt: skip
    print("| tok/s | llama.cpp | ours | ours / llama.cpp |")
    print("|---|---:|---:|---:|")
    for kind in ours:
        a, b = max(theirs[kind]), max(ours[kind])
        spread = f" (median {statistics.median(ours[kind]):.0f})"
        print(f"| {kind} | {a:.1f} | {b:.1f}{spread} | {b / a:.2f}x |")
    print("\nwhere one batch-1 decode step of ours goes (ms, a clock around each kernel call):")
    print("the compiled step the engine takes, and the same step through the Python layers\n")
    columns = breakdowns(engine)
    print("| part | " + " | ".join(columns) + " |")
    print("|---|" + "---:|" * len(columns))
    for row, (label, _) in enumerate(next(iter(columns.values()))):
        cells = " | ".join(f"{parts[row][1]:.2f}" for parts in columns.values())
        print(f"| {label} | {cells} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
