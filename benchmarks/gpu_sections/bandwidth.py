"""Section 8, bandwidth: an 8B-shaped (Llama-3-8B) model of random bfloat16 weights on the
scale's device (a tiny shape in the dry run): decode ms/step and GB/s read (weights + KV)
against the HBM peak at several batch sizes x context lengths, eager and with CUDA
graphs as batch.cuda_graphs turns them on, and chunked prefills with their peak memory."""

from __future__ import annotations

import time
import traceback
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from .common import Result, markdown_table, verdict
from .measure import free_memory, median_seconds, peak_tracker, sync
from .scale import Scale

if TYPE_CHECKING:
    from appliance.engine.model_runner import ModelRunner
    from appliance.engine.scheduler import SchedulerOutput
    from appliance.model.families.llama import CausalLM
    from appliance.model.model_config import ModelConfig


# Peak memory bandwidth by GPU name, where NVML cannot tell (GB/s, the vendors' sheets).
HBM_GBS = {"H200": 4800.0, "H100": 3350.0, "A100": 2039.0, "L40S": 864.0, "L4": 300.0}


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
