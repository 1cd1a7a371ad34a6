"""Peak host memory while loading a model, against the size of the weights it ends with.

Each row is one fresh process doing what the serving stack does: `serve` prepares the
model as the serve process does before it starts workers (`prepare_model`: config,
tokenizer, and whatever cache that writes); the other rows load it as a worker does
(`load_model_files`, then `build_model` on the CPU) with the setting shown, the first
row of a dtype against a cache that has no weights of it yet. Peak is the process's
peak resident set (VmHWM, file pages it mapped included) less its peak after
Python, torch and the appliance were imported; weights are the bytes the loaded model
holds. Models: the embedded SmolLM2-135M GGUF (Q4_1/Q8_0), and a random llama GGUF of
a few GB (Q8_0 blocks) written to a temporary folder, as is the cache.

    .venv/bin/python benchmarks/load_memory_bench.py [--layers 16] [--only default|random]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import gguf
import numpy as np

# The rows of the table: (what runs, weights setting, dtype). "unpacked" is weights=dense
# without oneDNN's packed bfloat16 linears (which the CPU gets where it has them, in
# copies of their own made after loading): what loading alone costs.
STEPS = (
    ("serve", "", ""),
    ("worker", "dense", "float32"),
    ("worker", "dense", "float32"),
    ("worker", "dense", "bfloat16"),
    ("worker", "dense", "bfloat16"),
    ("worker", "unpacked", "bfloat16"),
    ("worker", "auto", "auto"),
)

CHILD = r"""
import json, sys, time
from pathlib import Path

import torch

from appliance.config import load_settings
from appliance.engine import shard_loading
from appliance.engine.shard_loading import build_model, resolve_dtype, use_quant
from appliance.model.loader import load_model_files, prepare_model


def peak():
    # VmHWM: this process image's peak (ru_maxrss also counts the parent's pages at fork)
    for line in open("/proc/self/status"):
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024


def model_bytes(model):
    storages = {}

    def add(t):
        try:
            storage = t.untyped_storage()
            storages[storage.data_ptr()] = storage.nbytes()
        except (RuntimeError, NotImplementedError):  # an opaque (oneDNN-packed) tensor
            storages[id(t)] = t.numel() * t.element_size()

    def visit(value):
        if isinstance(value, torch.Tensor):
            add(value)
        elif isinstance(value, dict):
            for item in value.values():
                visit(item)
        elif isinstance(value, (list, tuple)):
            for item in value:
                visit(item)
        elif isinstance(getattr(value, "blocks", None), torch.Tensor):  # a QuantWeight
            add(value.blocks)

    for module in model.modules():
        visit(vars(module))
    return sum(storages.values())


step, path, cache, weights, dtype = sys.argv[1:]
base = peak()
start = time.perf_counter()
size = 0
if step == "serve":
    prepare_model(Path(path), Path(cache))
else:
    cpu = torch.device("cpu")
    if weights == "unpacked":
        shard_loading.packs_linears = lambda device, dtype: False
    setting = "dense" if weights == "unpacked" else weights
    settings = load_settings(device="cpu", weights=setting, dtype=dtype)
    files = load_model_files(Path(path), Path(cache))
    quantized = use_quant(settings, files, cpu)
    chosen = torch.float32 if quantized and dtype == "auto" else resolve_dtype(dtype, cpu)
    model = build_model(files, chosen, cpu, 256, quantized)
    size = model_bytes(model)
    dtype = ("quantized, " if quantized else "") + str(chosen).removeprefix("torch.")
seconds = time.perf_counter() - start
print(json.dumps({"base": base, "peak": peak(), "weights": size, "seconds": seconds,
                  "dtype": dtype}))
"""

# A byte-level vocabulary transformers converts in milliseconds (the model's rows are
# `vocab` wide all the same: only encoding uses these).
TOKENS = ["<|endoftext|>", *(chr(c) for c in range(ord("a"), ord("z") + 1)), "ab", "Ġ"]


@dataclass(frozen=True)
class Shape:
    """A llama model's dimensions."""

    hidden: int = 2048
    layers: int = 16
    heads: int = 16
    kv_heads: int = 4
    ff: int = 5632
    vocab: int = 32000

    def parameters(self) -> int:
        head_dim = self.hidden // self.heads
        attention = 2 * self.hidden * self.hidden + 2 * self.hidden * self.kv_heads * head_dim
        per_layer = attention + 3 * self.hidden * self.ff + 2 * self.hidden
        return self.layers * per_layer + 2 * self.vocab * self.hidden + self.hidden


def q8_0_blocks(rng: np.random.Generator, rows: int, columns: int) -> np.ndarray:
    """Random Q8_0 blocks [rows, columns / 32 * 34]: a small float16 scale and 32 int8s."""
    blocks = rng.integers(0, 256, (rows, columns // 32, 34), dtype=np.uint8)
    blocks[..., :2] = np.array([0.0005], dtype=np.float16).view(np.uint8)
    return blocks.reshape(rows, -1)


def write_random_gguf(path: Path, shape: Shape, seed: int = 0) -> Path:
    """An untied llama GGUF of random Q8_0 weights (F32 norms) with a tokenizer."""
    rng = np.random.default_rng(seed)
    writer = gguf.GGUFWriter(str(path), "llama")
    head_dim = shape.hidden // shape.heads
    for key, value in {
        "block_count": shape.layers,
        "embedding_length": shape.hidden,
        "feed_forward_length": shape.ff,
        "attention.head_count": shape.heads,
        "attention.head_count_kv": shape.kv_heads,
        "context_length": 2048,
        "vocab_size": shape.vocab,
    }.items():
        writer.add_uint32(f"llama.{key}", value)
    writer.add_float32("llama.attention.layer_norm_rms_epsilon", 1e-5)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(TOKENS)
    writer.add_token_types([gguf.TokenType.CONTROL] + [gguf.TokenType.NORMAL] * (len(TOKENS) - 1))
    writer.add_token_merges(["a b"])
    writer.add_eos_token_id(0)
    q8 = gguf.GGMLQuantizationType.Q8_0
    norm = np.ones(shape.hidden, dtype=np.float32)
    kv_rows = shape.kv_heads * head_dim
    matrices = {
        "token_embd.weight": (shape.vocab, shape.hidden),
        "output.weight": (shape.vocab, shape.hidden),
    }
    writer.add_tensor("output_norm.weight", norm)
    for i in range(shape.layers):
        writer.add_tensor(f"blk.{i}.attn_norm.weight", norm)
        writer.add_tensor(f"blk.{i}.ffn_norm.weight", norm)
        matrices |= {
            f"blk.{i}.attn_q.weight": (shape.hidden, shape.hidden),
            f"blk.{i}.attn_k.weight": (kv_rows, shape.hidden),
            f"blk.{i}.attn_v.weight": (kv_rows, shape.hidden),
            f"blk.{i}.attn_output.weight": (shape.hidden, shape.hidden),
            f"blk.{i}.ffn_gate.weight": (shape.ff, shape.hidden),
            f"blk.{i}.ffn_up.weight": (shape.ff, shape.hidden),
            f"blk.{i}.ffn_down.weight": (shape.hidden, shape.ff),
        }
    for name, (rows, columns) in matrices.items():
        writer.add_tensor(name, q8_0_blocks(rng, rows, columns), raw_dtype=q8)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def measure(step: str, model: Path, cache: Path, weights: str, dtype: str) -> dict:
    """One fresh process's peak (see CHILD)."""
    done = subprocess.run(
        [sys.executable, "-c", CHILD, step, str(model), str(cache), weights, dtype],
        capture_output=True,
        text=True,
    )
    if done.returncode:
        raise SystemExit(f"{step} {weights} {dtype} failed:\n{done.stderr}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def print_rows(label: str, model: Path, folder: Path) -> None:
    """The table's rows for one model, each from a fresh process, against one cache."""
    cache = folder / f"cache-{label}"
    cached: set[str] = set()  # dtypes whose cache the rows above wrote
    for step, weights, dtype in STEPS:
        what = "serve" if step == "serve" else f"{weights} {dtype}"
        if weights in ("dense", "unpacked") and dtype not in cached:
            what += " (first: writes the cache)"
            cached.add(dtype)
        r = measure(step, model, cache, weights, dtype)
        grew = r["peak"] - r["base"]
        ratio = f"{grew / r['weights']:.2f}" if r["weights"] else "-"
        print(
            f"| {label} | {what} | {r['dtype']} | {mib(r['weights'])} | {mib(r['base'])} | "
            f"{mib(grew)} | {ratio} | {r['seconds']:.1f} |",
            flush=True,
        )


def cpu_name() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.machine()


def mib(value: int) -> str:
    return f"{value / 2**20:,.0f} MiB" if value else "-"


def main() -> None:
    from appliance.model.loader import default_model_path

    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--layers", type=int, default=16, help="of the random model")
    parser.add_argument("--only", choices=("default", "random"))
    args = parser.parse_args()
    cores = len(os.sched_getaffinity(0))
    print(f"CPU: {cpu_name()}, {cores} cores; Python {platform.python_version()}")
    print("| model | load | dtype | weights | baseline | peak over baseline | / weights | s |")
    print("|---|---|---|---:|---:|---:|---:|---:|")
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        if args.only != "random":
            print_rows("SmolLM2-135M Q4_1", default_model_path(), folder)
        if args.only != "default":
            shape = Shape(layers=args.layers)
            path = write_random_gguf(folder / "random.gguf", shape)
            label = f"random {shape.parameters() / 1e6:,.0f}M Q8_0"
            print_rows(label, path, folder)


if __name__ == "__main__":
    main()
