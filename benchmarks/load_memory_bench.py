"""Peak host memory while loading a model, against the size of the weights it ends with.

Each row is one fresh process doing what the serving stack does: `serve` prepares the
model as the serve process does before it starts workers (`prepare_model`: config,
tokenizer, and whatever cache that writes); the other rows load it as a worker does
(`load_model_files`, then `build_model` on the CPU) with the setting shown, the first
row of a dtype against a cache that has no weights of it yet. Peak is the process's
peak resident set (VmHWM, file pages it mapped included) less its peak after
Python, torch and the appliance were imported; weights are the bytes the loaded model
holds. Models: the embedded SmolLM2-135M GGUF (Q4_1/Q8_0), a random llama GGUF of a
few GB (Q8_0 blocks), and a random llama Hugging Face folder of a few GB (bfloat16,
sharded into several safetensors files with model.safetensors.index.json), each
written to a temporary folder, as is the cache. The folder's rows load the whole model
in bfloat16 and in float32 (twice the file's bytes) and rank 0 of a tensor-parallel
split in two (its half of each split projection, the embedding and LM head whole).

    .venv/bin/python benchmarks/load_memory_bench.py [--layers 16] [--folder-layers 32]
        [--only default|random|folder]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import gguf
import numpy as np
import torch

from appliance.topology.cpu import cpu_model_name


class Step(NamedTuple):
    """A row of the table. "unpacked" is weights=dense without oneDNN's packed bfloat16
    linears (which the CPU gets where it has them, in copies of their own made after
    loading): what loading alone costs."""

    run: str  # "serve" or "worker"
    weights: str = ""
    dtype: str = ""
    shard: str = "0/1"  # tensor-parallel "rank/size"


STEPS = (
    Step("serve"),
    Step("worker", "dense", "float32"),
    Step("worker", "dense", "float32"),
    Step("worker", "dense", "bfloat16"),
    Step("worker", "dense", "bfloat16"),
    Step("worker", "unpacked", "bfloat16"),
    Step("worker", "auto", "auto"),
)
# A folder's: no cache (its safetensors files are mapped and copied from), no blocks.
FOLDER_STEPS = (
    Step("worker", "dense", "bfloat16"),
    Step("worker", "unpacked", "bfloat16"),
    Step("worker", "dense", "float32"),
    Step("worker", "dense", "bfloat16", "0/2"),
)

CHILD = r"""
import json, sys, time
from pathlib import Path

import torch

from appliance.settings.config import load_settings
from appliance.engine import shard_loading
from appliance.engine.shard_loading import build_model, resolve_dtype, use_quant
from appliance.model.loader import load_model_files
from appliance.model.model_source import prepare_model
from appliance.model.tensor_parallel import Shard


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


step, path, cache, weights, dtype, shard = sys.argv[1:]
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
    rank, size = map(int, shard.split("/"))
    model = build_model(files, chosen, cpu, 256, quantized, Shard(rank, size))
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


def hf_tensors(shape: Shape) -> dict[str, tuple[int, ...]]:
    """An untied llama's Hugging Face weight names and shapes, in the order HF saves them."""
    kv_rows = shape.kv_heads * (shape.hidden // shape.heads)
    tensors: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (shape.vocab, shape.hidden)}
    for i in range(shape.layers):
        layer = f"model.layers.{i}."
        tensors |= {
            layer + "input_layernorm.weight": (shape.hidden,),
            layer + "self_attn.q_proj.weight": (shape.hidden, shape.hidden),
            layer + "self_attn.k_proj.weight": (kv_rows, shape.hidden),
            layer + "self_attn.v_proj.weight": (kv_rows, shape.hidden),
            layer + "self_attn.o_proj.weight": (shape.hidden, shape.hidden),
            layer + "post_attention_layernorm.weight": (shape.hidden,),
            layer + "mlp.gate_proj.weight": (shape.ff, shape.hidden),
            layer + "mlp.up_proj.weight": (shape.ff, shape.hidden),
            layer + "mlp.down_proj.weight": (shape.hidden, shape.ff),
        }
    return tensors | {
        "model.norm.weight": (shape.hidden,),
        "lm_head.weight": (shape.vocab, shape.hidden),
    }


def random_pieces(
    generator: torch.Generator, layout: dict[str, tuple[tuple[int, ...], torch.dtype]]
) -> Iterator[tuple[str, torch.Tensor]]:
    """Each tensor's random values (norms ones), in pieces of at most 16M values."""
    for name, (shape, _) in layout.items():
        if len(shape) == 1:
            yield name, torch.ones(shape)
            continue
        rows, columns = shape
        step = max(1, 2**24 // columns)
        for start in range(0, rows, step):
            piece = torch.randn(min(step, rows - start), columns, generator=generator)
            yield name, piece.mul_(0.02)


def write_random_folder(folder: Path, shape: Shape, files: int = 4, seed: int = 0) -> Path:
    """An untied llama (GQA) Hugging Face folder of random bfloat16 weights, sharded
    into `files` safetensors files of about equal size with model.safetensors.index.json,
    and a byte-level tokenizer of TOKENS."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    from appliance.model.formats.safetensors_file import write_safetensors

    folder.mkdir(parents=True)
    tensors = hf_tensors(shape)
    total = 2 * sum(math.prod(dims) for dims in tensors.values())
    groups: list[list[str]] = [[] for _ in range(files)]
    written = 0
    for name, dims in tensors.items():  # in order, a file filled to its share of the bytes
        groups[min(files - 1, written * files // total)].append(name)
        written += 2 * math.prod(dims)
    generator = torch.Generator().manual_seed(seed)
    weight_map = {}
    for i, names in enumerate(groups):
        file = f"model-{i + 1:05d}-of-{files:05d}.safetensors"
        layout = {name: (tensors[name], torch.bfloat16) for name in names}
        write_safetensors(folder / file, layout, random_pieces(generator, layout))
        weight_map |= dict.fromkeys(names, file)
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": shape.hidden,
        "intermediate_size": shape.ff,
        "num_hidden_layers": shape.layers,
        "num_attention_heads": shape.heads,
        "num_key_value_heads": shape.kv_heads,
        "vocab_size": shape.vocab,
        "max_position_embeddings": 2048,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "hidden_act": "silu",
        "tie_word_embeddings": False,
        "bos_token_id": 0,
        "eos_token_id": 0,
        "torch_dtype": "bfloat16",
    }
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    vocab = {token: i for i, token in enumerate(TOKENS)}
    tokenizer = Tokenizer(models.BPE(vocab, [("a", "b")]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens([TOKENS[0]])
    tokenizer.save(str(folder / "tokenizer.json"))
    special = {"eos_token": TOKENS[0], "bos_token": TOKENS[0]}
    tokenizer_config = {"tokenizer_class": "PreTrainedTokenizerFast", **special}
    (folder / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))
    return folder


def measure(step: Step, model: Path, cache: Path) -> dict:
    """One fresh process's peak (see CHILD)."""
    done = subprocess.run(
        [sys.executable, "-c", CHILD, step.run, str(model), str(cache), *step[1:]],
        capture_output=True,
        text=True,
    )
    if done.returncode:
        raise SystemExit(f"{step} failed:\n{done.stderr}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def print_rows(label: str, model: Path, folder: Path, steps: tuple[Step, ...] = STEPS) -> None:
    """The table's rows for one model, each from a fresh process, against one cache."""
    cache = folder / f"cache-{label}"
    cached: set[str] = set()  # dtypes whose cache the rows above wrote
    for step in steps:
        what = "serve" if step.run == "serve" else f"{step.weights} {step.dtype}"
        if step.shard != "0/1":
            rank, size = step.shard.split("/")
            what += f", TP rank {rank} of {size}"
        fresh = step.dtype not in cached
        if model.is_file() and step.weights in ("dense", "unpacked") and fresh:
            what += " (first: writes the cache)"
            cached.add(step.dtype)
        r = measure(step, model, cache)
        grew = r["peak"] - r["base"]
        ratio = f"{grew / r['weights']:.2f}" if r["weights"] else "-"
        print(
            f"| {label} | {what} | {r['dtype']} | {mib(r['weights'])} | {mib(r['base'])} | "
            f"{mib(grew)} | {ratio} | {r['seconds']:.1f} |",
            flush=True,
        )


def mib(value: int) -> str:
    return f"{value / 2**20:,.0f} MiB" if value else "-"


def main() -> None:
    from appliance.model.model_source import default_model_path

    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--layers", type=int, default=16, help="of the random model")
    parser.add_argument("--folder-layers", type=int, default=32, help="of the random folder")
    parser.add_argument("--only", choices=("default", "random", "folder"))
    args = parser.parse_args()
    cores = len(os.sched_getaffinity(0))
    print(f"CPU: {cpu_model_name()}, {cores} cores; Python {platform.python_version()}")
    print("| model | load | dtype | weights | baseline | peak over baseline | / weights | s |")
    print("|---|---|---|---:|---:|---:|---:|---:|")
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        if args.only in (None, "default"):
            print_rows("SmolLM2-135M Q4_1", default_model_path(), folder)
        if args.only in (None, "random"):
            shape = Shape(layers=args.layers)
            path = write_random_gguf(folder / "random.gguf", shape)
            label = f"random {shape.parameters() / 1e6:,.0f}M Q8_0"
            print_rows(label, path, folder)
        if args.only in (None, "folder"):
            shape = Shape(layers=args.folder_layers)
            files = 4
            path = write_random_folder(folder / "random-hf", shape, files)
            label = f"random {shape.parameters() / 1e6:,.0f}M BF16 folder ({files} files)"
            print_rows(label, path, folder, FOLDER_STEPS)


if __name__ == "__main__":
    main()
