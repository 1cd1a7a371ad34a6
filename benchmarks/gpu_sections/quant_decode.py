"""Section 9, quant_decode: a 4-bit GGUF's decode on the GPU against dense bfloat16. One
Llama-shaped model of random weights (Llama-3-8B's layers, 8 of them, an 8k vocabulary;
a tiny shape in the dry run), its matrices quantized to Q4_0 by our own quantizer (what
a Q4_0 GGUF holds: the gguf package writes no K-quants, and no file needs carrying),
built as a worker builds a GGUF's model on CUDA (shard_loading.build_model: the blocks
kept on the GPU, every projection and the head on triton_quant's kernels, the embedding
looked up by triton_quant.quant_rows) beside the dense bfloat16 model of the same
dequantized weights (what the GPU ran before). Decode steps (runner.run, as the engine
makes them) of each at batch 1 and 8: ms per step and the GB/s of weights they read;
the two models' prefill logits must agree. In the dry run the same code runs on the CPU
with the quantized products forced onto the Triton kernels under the interpreter:
checks only, its times mean nothing."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from .bandwidth import decode_row, hbm_limit, weight_shapes
from .common import Result, markdown_table, verdict
from .measure import free_memory
from .scale import Scale

if TYPE_CHECKING:
    from appliance.model.families.llama import LlamaForCausalLM as CausalLM
    from appliance.model.loader import ModelFiles
    from appliance.model.model_config import ModelConfig
    from appliance.model.quant import QuantWeight

# vocab, hidden, intermediate, layers, heads, kv_heads, head_dim: Llama-3-8B's layers,
# 8 of them (about 1 GB of Q4_0 blocks a step, 3.6 GB of bfloat16), a small vocabulary
GPU_SHAPE = (8192, 4096, 14336, 8, 32, 8, 128)
DRY_SHAPE = (256, 64, 128, 2, 4, 2, 16)
BATCHES = (1, 8)
BLOCK_SIZE = 16
FORMAT = "Q4_0"
# Over the largest |logit|: the two models multiply the same bfloat16-rounded weights
# (the GEMM rounds the exact dequantized weight to x's dtype, as the dense model's copy
# is), in other summation orders, with bfloat16 activations between the layers.
LOGIT_TOLERANCE = 3e-2


def section_quant_decode(scale: Scale) -> Result:
    """The Q4_0 model's decode GB/s and ms/step against the dense bfloat16 one's, both on
    the scale's device; the two agree on a prompt's logits."""
    from appliance.model.quant import QuantEmbedding, QuantLinear

    config = shaped_config(scale)
    context = 512 if scale.cuda else 32
    floats, blocks = random_weights(config)  # on the CPU; the blocks as a Q4_0 file holds them
    limit = hbm_limit(scale.device)
    rows: list[dict[str, Any]] = []
    logits: dict[str, torch.Tensor] = {}
    kinds: dict[str, bool] = {}
    with triton_products(scale):
        for kind in ("dense_bf16", "gguf_q4_0"):
            quantized = kind == "gguf_q4_0"
            model = build(config, floats, blocks, quantized, scale.device)
            if quantized:
                linears = [m for m in model.modules() if isinstance(m, QuantLinear)]
                kinds["every projection and the head in blocks"] = (
                    len(linears) == 4 * config.num_layers + 1
                )
                kinds["the embedding in blocks"] = isinstance(model.embed_tokens, QuantEmbedding)
                kinds["the blocks on the model's device"] = all(
                    p.blocks.device.type == scale.device.type for m in linears for p in m.parts
                )
                read = sum(m.weight_bytes() for m in linears)
            else:
                read = dense_read_bytes(config)
            logits[kind], kind_rows = measure(model, config, read, context, limit, scale)
            rows += [{"weights": kind, **row} for row in kind_rows]
            del model
            free_memory()
    error = float(
        (logits["gguf_q4_0"] - logits["dense_bf16"]).abs().max() / logits["dense_bf16"].abs().max()
    )
    checks = {
        **kinds,
        f"prefill logits agree within {LOGIT_TOLERANCE} of the largest": error <= LOGIT_TOLERANCE,
    }
    by = {(r["weights"], r["batch"]): r for r in rows}
    speedups = {
        f"batch {b}": round(
            by["dense_bf16", b]["ms_per_step"] / by["gguf_q4_0", b]["ms_per_step"], 2
        )
        for b in BATCHES
    }
    return verdict(
        checks,
        summary=f"Q4_0 decode vs dense bf16, x faster per step: {speedups}"
        + ("" if scale.cuda else " (dry run: times mean nothing)"),
        model=dict(
            zip(("vocab", "hidden", "intermediate", "layers", "heads", "kv_heads", "head_dim"),
                GPU_SHAPE if scale.cuda else DRY_SHAPE, strict=True)
        ),
        logit_error=error,
        speedup=speedups,
        hbm=limit,
        rows=rows,
        table=markdown_table(rows),
    )  # fmt: skip


def shaped_config(scale: Scale) -> ModelConfig:
    """The section's model shape as a ModelConfig (untied head, no biases)."""
    from appliance.model.model_config import ModelConfig

    vocab, hidden, inter, layers, heads, kv_heads, dim = GPU_SHAPE if scale.cuda else DRY_SHAPE
    return ModelConfig(
        "llama", vocab, hidden, inter, layers, heads, kv_heads, dim, 1e-5, 500000.0, 1024,
        False, False,
    )  # fmt: skip


def random_weights(config: ModelConfig) -> tuple[dict[str, torch.Tensor], dict[str, QuantWeight]]:
    """Every weight of a Llama checkpoint of `config` as random bfloat16 on the CPU
    (matrices of std 0.02, norms 1), and its matrices quantized to FORMAT by our own
    quantizer. Every layer has the first's values (quantizing is numpy on the CPU: one
    layer, not eight), each its own copy of the blocks, so no layer reads another's from
    the GPU's L2 cache."""
    from appliance.model.quant import QuantWeight, quantize_weights

    generator = torch.Generator().manual_seed(0)
    first: dict[str, torch.Tensor] = {}  # by the name with the layer index dropped
    floats: dict[str, torch.Tensor] = {}
    for name, shape in weight_shapes(config).items():
        key = _unlayered(name)
        if key not in first:
            first[key] = (
                torch.ones(shape, dtype=torch.bfloat16)
                if len(shape) == 1
                else torch.randn(shape, generator=generator).mul_(0.02).to(torch.bfloat16)
            )
        floats[name] = first[key]
    quantized = quantize_weights({k: v for k, v in first.items() if v.dim() == 2}, {}, FORMAT)
    blocks = {
        name: QuantWeight(q.format, q.blocks.clone(), q.in_features, True)
        for name in floats
        if (q := quantized.get(_unlayered(name))) is not None
    }
    return floats, blocks


def _unlayered(name: str) -> str:
    """A weight's name with its layer's index dropped (model.layers.3.x -> model.layers.x)."""
    parts = name.split(".")
    return ".".join(p for p in parts if not p.isdigit())


@dataclass
class _BlockFiles:
    """A ModelFiles stand-in whose block weights are given, not read from a GGUF."""

    files: ModelFiles
    blocks: Mapping[str, QuantWeight] = field(default_factory=dict)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.files, name)

    def quant_weights(self) -> dict[str, QuantWeight]:
        return dict(self.blocks)


def build(
    config: ModelConfig,
    floats: dict[str, torch.Tensor],
    blocks: Mapping[str, QuantWeight],
    quantized: bool,
    device: torch.device,
) -> CausalLM:
    """The worker's model (build_model) of `blocks` kept quantized, or dense bfloat16 of
    the same weights dequantized (the norms from `floats`)."""
    from appliance.engine.shard_loading import build_model
    from appliance.model.loader import ModelFiles

    if quantized:
        files: Any = _BlockFiles(ModelFiles(Path("random-q4_0"), config, floats, Path(".")), blocks)
    else:
        by_source: dict[int, torch.Tensor] = {}  # a layer's float32 weights serve them all
        dense = dict(floats)
        for name, weight in blocks.items():
            source = id(floats[name])
            if source not in by_source:
                by_source[source] = dequantized(weight, device)
            dense[name] = by_source[source]
        files = ModelFiles(Path("random-q4_0-dequantized"), config, dense, Path("."))
    model = build_model(files, torch.bfloat16, device, config.max_position_embeddings, quantized)
    model.decode_step = None  # a CPU dry run's compiled step would bypass the Triton path
    return model


def dequantized(weight: QuantWeight, device: torch.device) -> torch.Tensor:
    """The float32 weight of `weight`'s blocks, dequantized on `device` by triton_quant
    (the GPU image may lack the CPU kernels quant.py's dequantizer calls)."""
    from appliance.model.layers import triton_quant

    rows = torch.arange(weight.rows, device=device)
    return triton_quant.quant_rows(
        weight.blocks.to(device), weight.format.ggml_id, weight.in_features, rows
    )


def dense_read_bytes(config: ModelConfig) -> int:
    """Bytes a dense bfloat16 decode step reads of the weights: every matrix but the
    embedding (a row per sequence of it)."""
    shapes = weight_shapes(config)
    shapes.pop("model.embed_tokens.weight")
    return sum(2 * torch.Size(shape).numel() for shape in shapes.values())


def measure(
    model: CausalLM,
    config: ModelConfig,
    read: int,
    context: int,
    limit: dict[str, Any],
    scale: Scale,
) -> tuple[torch.Tensor, list[dict[str, Any]]]:
    """`model`'s float32 logits [16, vocab] of a 16-token prompt, and its decode rows."""
    from appliance.engine.model_runner import ModelRunner, forward, move_to
    from appliance.engine.sampling.sampler import Sampler
    from appliance.engine.scheduler import ScheduledChunk, SchedulerOutput
    from appliance.engine.sequence import SamplingParams, Sequence
    from appliance.kv.cache import KVCache, KVLayout

    layout = KVLayout(
        config.num_layers, BLOCK_SIZE, config.num_kv_heads, config.head_dim, torch.bfloat16
    )
    kv = KVCache(layout, max(BATCHES) * -(-context // BLOCK_SIZE) + 1, scale.device)
    runner = ModelRunner(model, kv, Sampler(scale.device))
    prompt = Sequence(-1, [(7 * i + 3) % config.vocab_size for i in range(16)], SamplingParams())
    prompt.block_table = [0]
    inputs = move_to(
        runner.prepare(SchedulerOutput(prefills=[ScheduledChunk(prompt, 16)])), scale.device
    )
    logits = model.logits(forward(model, inputs, kv.tensor)).float().cpu()
    per_token = layout.bytes_per_block() // layout.block_size
    rows = []
    for batch in BATCHES:
        row = decode_row(runner, batch, context, read, per_token, limit, scale)
        rows.append({**row, "weight_gib": round(read / 2**30, 3)})
    return logits, rows


@contextmanager
def triton_products(scale: Scale) -> Iterator[None]:
    """On a dry run (CPU tensors, Triton's interpreter) the quantized layers take their
    CUDA branch, the Triton kernels, as on the GPU; on CUDA they do anyway."""
    from appliance.model import quant

    if scale.cuda:
        yield
        return
    chooser = quant.runs_triton
    quant.runs_triton = lambda device: True  # type: ignore[assignment]
    try:
        yield
    finally:
        quant.runs_triton = chooser
