"""Section 8, bandwidth: an 8B-shaped (Llama-3-8B) model of random bfloat16 weights on the
scale's device (a tiny shape in the dry run): decode ms/step and GB/s read (weights + KV)
against the HBM peak at several batch sizes x context lengths, eager and with CUDA
graphs as batch.cuda_graphs turns them on, and chunked prefills with their peak memory."""

from __future__ import annotations

import math
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
    from appliance.model.families.llama import LlamaForCausalLM as CausalLM
    from appliance.model.model_config import ModelConfig


# Peak memory bandwidth by GPU name, where NVML cannot tell (GB/s, the vendors' sheets).
HBM_GBS = {"H200": 4800.0, "H100": 3350.0, "A100": 2039.0, "L40S": 864.0, "L4": 300.0}


def section_bandwidth(scale: Scale) -> Result:
    """A Llama-3-8B-shaped model of random bfloat16 weights: decode steps (runner.run, as
    the engine makes them) of `batch` sequences at a context length, ms per step and the
    GB/s of weights and KV they read, against the device's peak; with the runner's CUDA
    graphs too where it has them; chunked prefills with their time and peak memory. The
    KV pool is sized to the rows that fit the device memory free beside the weights (see
    plan_rows); a row that does not fit is skipped with the memory it would need."""
    from appliance.engine.model_runner import ModelRunner
    from appliance.engine.sampling.sampler import Sampler
    from appliance.kv.cache import KVCache, KVLayout

    config = shaped_config(scale)
    model = random_model(config, scale.device)
    # What a decode step reads of the weights: all but the embedding, of which it reads
    # a row per sequence (the model's linear weights are not its parameters: counted
    # from their shapes).
    weight_bytes = model_bytes(config) - 2 * config.vocab_size * config.hidden_size
    layout = KVLayout(
        config.num_layers, BLOCK_SIZE, config.num_kv_heads, config.head_dim, torch.bfloat16
    )
    plan = plan_rows(scale, free_device_bytes(scale.device))
    kv = KVCache(layout, plan["pool_blocks"], scale.device)
    runner = ModelRunner(model, kv, Sampler(scale.device))
    per_token = layout.bytes_per_block() // layout.block_size
    limit = hbm_limit(scale.device)
    fits = [row for row in plan["decode"] if row["fits"]]
    eager = [
        decode_row(runner, row["batch"], row["tokens"], weight_bytes, per_token, limit, scale)
        for row in fits
    ]
    graphs = graph_rows(runner, fits, weight_bytes, per_token, limit, scale)
    prefill = [prefill_row(runner, row["tokens"], scale) for row in plan["prefill"] if row["fits"]]
    skipped = [row for row in plan["decode"] + plan["prefill"] if not row["fits"]]
    best = max(eager, key=lambda r: r["gb_per_s"], default=None)
    checks = {
        "some decode row fits the device memory": bool(eager),
        "the CUDA graph rows raised no error": graphs["status"] != "error",
    }
    if scale.cuda:  # elsewhere use_decode_graphs says they are CUDA only: skipped
        checks["the CUDA graph rows ran"] = graphs["status"] == "ran"
    return verdict(
        checks,
        summary=(f"best {best['gb_per_s']} GB/s (batch {best['batch']}, context {best['context']})"
                 if best else "no decode row fits")
        + (f" of {limit['gb_per_s']} GB/s" if limit["gb_per_s"] else "")
        + (f"; {len(skipped)} row(s) skipped: too large for the memory free" if skipped else ""),
        model=dict(zip(("vocab", "hidden", "intermediate", "layers", "heads", "kv_heads",
                        "head_dim"), scale.bandwidth_shape, strict=True)),
        weight_gib=round(weight_bytes / 2**30, 2),
        memory={k: v for k, v in plan.items() if k not in ("decode", "prefill")},
        skipped=[{k: row[k] for k in ("kind", "batch", "tokens", "reason")} for row in skipped],
        hbm=limit,
        eager=eager,
        cuda_graphs=graphs,
        prefill=prefill,
        table=[*markdown_table(eager), "", *markdown_table(prefill)],
    )  # fmt: skip


# Device memory left beside the weights and the KV pool: the allocator's slack, a step's
# activations (a 512-token chunk of the 8B shape, its logits included: ~0.5 GiB), the
# CUDA graphs' memory pool and the prefills' peak.
HEADROOM_BYTES = 3 * 2**30
BLOCK_SIZE = 16


def model_bytes(config: ModelConfig) -> int:
    """Bytes of all the weights random_model builds for `config` (bfloat16)."""
    return sum(2 * math.prod(shape) for shape in weight_shapes(config).values())


def block_bytes_of(config: ModelConfig) -> int:
    """Bytes of one KV block (K and V, every layer, bfloat16)."""
    return 2 * config.num_layers * BLOCK_SIZE * config.num_kv_heads * config.head_dim * 2


def free_device_bytes(device: torch.device) -> int | None:
    """The device memory free now (after the weights are loaded); None on the CPU, where
    the dry run's tiny shapes are not sized."""
    if device.type != "cuda":
        return None
    free_memory()
    return torch.cuda.mem_get_info(device)[0]


def plan_rows(scale: Scale, free_bytes: int | None) -> dict[str, Any]:
    """Which rows run in `free_bytes` of device memory (free beside the weights; None: no
    limit) and the KV pool they take: a decode row `batch` sequences of ceil(context /
    16) blocks each, a prefill ceil(tokens / 16), the pool the largest row that fits and
    one block more, HEADROOM_BYTES kept free. A row that does not fit is skipped, its
    reason the memory it would need."""
    block_bytes = block_bytes_of(shaped_config(scale))
    room = None
    if free_bytes is not None:
        room = max(0, (free_bytes - HEADROOM_BYTES) // block_bytes - 1)

    def gib(blocks: int) -> float:
        return round(blocks * block_bytes / 2**30, 2)

    def row(kind: str, batch: int, tokens: int) -> dict[str, Any]:
        blocks = batch * -(-tokens // BLOCK_SIZE)
        planned = {"kind": kind, "batch": batch, "tokens": tokens, "blocks": blocks,
                   "kv_gib": gib(blocks), "fits": room is None or blocks <= room}  # fmt: skip
        if not planned["fits"]:
            planned["reason"] = (
                f"its KV cache needs {gib(blocks)} GiB; {gib(room or 0)} GiB are free beside "
                f"the weights and {HEADROOM_BYTES / 2**30:.0f} GiB kept for steps"
            )
        return planned

    decode = [
        row("decode", b, c) for b in scale.bandwidth_batches for c in scale.bandwidth_contexts
    ]
    prefill = [row("prefill", 1, n) for n in scale.bandwidth_prefills]
    pool = max((r["blocks"] for r in decode + prefill if r["fits"]), default=0) + 1
    return {
        "free_gib": None if free_bytes is None else round(free_bytes / 2**30, 2),
        "headroom_gib": HEADROOM_BYTES / 2**30,
        "block_bytes": block_bytes,
        "pool_blocks": pool,
        "pool_gib": gib(pool),
        "decode": decode,
        "prefill": prefill,
    }


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

    weights = {
        name: torch.ones(shape, dtype=torch.bfloat16, device=device)
        if len(shape) == 1
        else torch.randn(shape, dtype=torch.bfloat16, device=device).mul_(0.02)
        for name, shape in weight_shapes(config).items()
    }
    files = ModelFiles(Path("random"), config, weights, Path("."))
    model = build_model(files, torch.bfloat16, device, config.max_position_embeddings)
    del weights, files
    free_memory()
    return model


def weight_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Each weight's name and shape in a Llama checkpoint of `config` (untied head)."""
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
    return shapes


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
    runner: ModelRunner,
    fits: list[dict[str, Any]],
    weight_bytes: int,
    per_token: int,
    limit: dict[str, Any],
    scale: Scale,
) -> dict[str, Any]:
    """The decode rows that fit again with CUDA graphs, turned on as batch.cuda_graphs
    does (runner.use_decode_graphs: sizes 1, 2, 4, ... up to the largest batch); on the
    CPU that call says graphs are CUDA only and the rows are skipped. An error (a capture
    or replay that fails) is the status "error" with its traceback: the section fails."""
    from appliance.engine.model_runner import decode_graph_sizes

    if not fits:
        return {"status": "skipped", "reason": "no decode row fits the device memory"}
    largest = max(row["batch"] for row in fits)
    longest = max(row["tokens"] for row in fits)
    try:
        if not runner.use_decode_graphs(largest, longest):
            return {"status": "skipped", "reason": "CUDA graphs apply to CUDA devices only"}
        rows = [
            decode_row(runner, row["batch"], row["tokens"], weight_bytes, per_token, limit, scale)
            for row in fits
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
