"""Loading one shard of a worker: the device and dtype chosen, whether weights stay in
their block formats, the model built on the device, and its KV pool sized."""

from __future__ import annotations

import importlib.util
import logging
from collections.abc import Mapping
from dataclasses import dataclass, replace
from types import MappingProxyType

import torch

from appliance.engine.kv_pool_sizing import pool_blocks
from appliance.kv.cache import KVCache, KVLayout, resolve_kv_dtype
from appliance.model import cpu_kernels
from appliance.model.causal_lm import CausalLM
from appliance.model.decode_step import CompiledDecode, compiled_problem
from appliance.model.formats.gguf_index import tensor_index
from appliance.model.loader import ModelFiles, Selected, load_model_files
from appliance.model.packed_linear import pack_linears, packs_linears
from appliance.model.quant import (
    FORMATS,
    attach_quant,
    place_quant,
    quantizable,
    quantize_weights,
    use_prefill_gemm,
)
from appliance.model.registry import model_class
from appliance.model.tensor_parallel import (
    WHOLE_MODEL,
    AllReduce,
    Shard,
    kv_head_ranges,
    no_reduce,
    row_parallel_spans,
    shard_quant,
    shard_state,
)
from appliance.settings.config import Settings

log = logging.getLogger(__name__)

_DTYPES: Mapping[str, torch.dtype] = MappingProxyType(
    {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
)


def resolve_device(name: str) -> torch.device:
    """'auto' takes the first CUDA device when there is one, else the CPU."""
    if name == "cuda" and not torch.cuda.is_available():
        raise ValueError("device is 'cuda' but torch sees no CUDA device")
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    return torch.device(name)


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    """'auto': bfloat16 where the hardware computes it natively (CUDA with bf16, CPUs with
    AVX512-BF16 or AMX), else float16 on CUDA and float32 on the CPU.

    bfloat16 keeps float32's range (the dtype these models are trained in) at half the
    bytes; decode is memory-bound, so halving the bytes read per token is the main lever.
    benchmarks/engine_bench.py measures both dtypes side by side.
    """
    if name != "auto":
        return _DTYPES[name]
    if device.type == "cuda":
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    return torch.bfloat16 if cpu_has_native_bf16() else torch.float32


def activation_dtype(name: str, quantized: bool, device: torch.device) -> torch.dtype:
    """The dtype a model (a target or its draft) computes in. The CPU's quantized kernels
    take float32 activations (and bfloat16, converted as read): 'auto' keeps float32
    there, its accuracy at no cost in bytes read. A GPU's Triton products sum in float32
    whatever the activations' dtype, so 'auto' takes `resolve_dtype`'s choice there."""
    if quantized and name == "auto" and device.type == "cpu":
        return torch.float32
    return resolve_dtype(name, device)


def cpu_has_native_bf16() -> bool:
    """Whether this CPU has bfloat16 dot-product instructions torch's kernels use."""
    checks = ("_is_avx512_bf16_supported", "_is_amx_tile_supported")
    return any(getattr(torch.cpu, check, lambda: False)() for check in checks)


# The block formats the GPU's Triton kernels multiply in place (model/layers/triton_quant.py,
# whose tests hold the two sets alike): named here so the decision imports no triton.
GPU_BLOCK_FORMATS = frozenset({"Q8_0", "Q4_0", "Q4_1", "Q4_K", "Q5_K", "Q6_K"})


@dataclass(frozen=True)
class QuantFacts:
    """What decides whether a shard's weights stay in their block formats, as plain data."""

    device: str  # torch.device.type: "cpu", "cuda", ...
    formats: frozenset[str]  # block formats of the file's weights (quant.FORMATS names)
    quantize: str = "none"  # the `quantize` setting: float weights made "q8_0"/"q4_0" blocks
    dtype: str = "auto"  # the `dtype` setting
    cpu_kernels: bool = True  # the CPU kernels are built
    triton: bool = True  # triton is installed (the GPU's kernels)


def kept_formats(facts: QuantFacts) -> frozenset[str]:
    """The block formats this device multiplies in place: every one on the CPU, the Triton
    kernels' on CUDA (every one too since Q5_K's; a format without one would be
    dequantized as it loads), none elsewhere."""
    made = {facts.quantize.upper()} if facts.quantize != "none" else set()
    formats = facts.formats | made
    if facts.device == "cpu":
        return formats
    if facts.device == "cuda":
        return formats & GPU_BLOCK_FORMATS
    return frozenset()


def quant_problem(facts: QuantFacts) -> str:
    """Why weights cannot stay in their block formats here, or "" when they can.

    Tensor-parallel shards need no rule of their own: shard_quant cuts a weight's rows and
    whole blocks of its columns before the device matters, and a row-parallel shard's
    Triton product is widened to float64 for its group's all-reduce as the CPU's is."""
    if facts.device == "cpu":
        if not facts.cpu_kernels:
            return "the CPU kernels are not built (install a C compiler, re-run ./install.sh)"
        if facts.dtype == "float16":
            return "the kernels take float32 or bfloat16 activations, not float16"
    elif facts.device == "cuda":
        if not facts.triton:
            return "triton is not installed: its kernels multiply block weights on CUDA"
    else:
        return f"no kernels multiply block-quantized weights on {facts.device}"
    if not kept_formats(facts):
        if facts.formats:
            return (
                f"the file's block formats ({', '.join(sorted(facts.formats))}) are none the "
                f"{facts.device} kernels take ({', '.join(sorted(GPU_BLOCK_FORMATS))})"
            )
        return "the model has no weights in block formats (set quantize to make some)"
    return ""


def block_formats(files: ModelFiles) -> frozenset[str]:
    """The block formats (quant.FORMATS names) of the file's weights the quantized path
    would take, read from the GGUF's index alone."""
    if not files.source.is_file():
        return frozenset()
    names = {name for name in files.quant_names() if quantizable(name)}
    if not names:
        return frozenset()
    by_id = {fmt.ggml_id: fmt.name for fmt in FORMATS.values()}
    entries = tensor_index(files.source)
    return frozenset(by_id[e.type_id] for e in entries if e.type_id in by_id and e.dims[1:])


def use_quant(settings: Settings, files: ModelFiles, device: torch.device) -> bool:
    """Whether to multiply weights in their block formats (model/quant.py): on the CPU with
    the kernels built, or on CUDA with triton (for the formats its kernels take), where
    the file has such weights or `quantize` asks for them. 'auto' takes that path
    wherever it applies (it reads 4-7x fewer bytes a step than dense float32 or bfloat16
    and keeps each worker's memory near the file's size); 'dense' dequantizes everything,
    as before. Why it does not apply, or which formats stay dense, is logged."""
    if settings.weights == "dense":
        return False
    facts = QuantFacts(
        device.type,
        block_formats(files),
        settings.quantize,
        settings.dtype,
        cpu_kernels.available(),
        importlib.util.find_spec("triton") is not None,
    )
    problem = quant_problem(facts)
    if problem and settings.weights == "quantized":
        raise ValueError(f"weights=quantized: {problem}")
    if problem:
        if facts.formats:  # a file with blocks loads dense: worth saying why
            log.warning("%s loads dense: %s", files.source.name, problem)
        return False
    dense = facts.formats - kept_formats(facts)
    if dense:
        log.warning(
            "%s: %s weights load dense on %s (its kernels take %s)",
            files.source.name,
            ", ".join(sorted(dense)),
            device.type,
            ", ".join(sorted(GPU_BLOCK_FORMATS)),
        )
    return True


def build_model(
    files: ModelFiles,
    dtype: torch.dtype,
    device: torch.device,
    max_positions: int,
    quantized: bool = False,
    shard: Shard = WHOLE_MODEL,
    all_reduce: AllReduce = no_reduce,
    quantize_to: str = "none",
    tp_degrees: tuple[int, ...] = (1,),
) -> CausalLM:
    """The model (or `shard` of it) on `device`; `quantized` keeps the file's block-format
    weights in their blocks (and quantizes float ones to `quantize_to` unless 'none').
    `tp_degrees`: those of the appliance's groups, whose splits its quantized products
    sum apart (row_parallel_spans), so every worker answers alike."""
    with torch.device("meta"):  # parameters are allocated as their weights are read
        model = model_class(files.config)(
            files.config, dtype, device, max_positions, shard, all_reduce
        )
    # Weight mappings read a tensor when asked for it: nothing here holds them all.
    dense = files.named_weights() if quantized else files.dense_weights(dtype)
    if quantized:
        quant = files.quant_weights()
        if quantize_to != "none":
            floats = Selected(dense, [name for name in dense if name not in quant])
            quant = quantize_weights(floats, quant, quantize_to.upper())
        if device.type != "cpu":  # the rest load dense (use_quant logged which)
            kept = kept_formats(
                QuantFacts(device.type, frozenset(w.format.name for w in quant.values()))
            )
            quant = {name: w for name, w in quant.items() if w.format.name in kept}
        quant = shard_quant(quant, files.config, shard)
        spans = row_parallel_spans(files.config, tp_degrees)
        biases = {name: dense[name] for name in dense if name.endswith(".bias")}
        served = attach_quant(model, quant, shard_state(biases, files.config, shard), spans)
        place_quant(model, device)
        dense = Selected(dense, [name for name in dense if name not in served])
    model.load_weights(dense, str(files.source))
    if quantized and not compiled_problem(model):
        model.decode_step = CompiledDecode(model)
    if packs_linears(device, dtype):
        pack_linears(model, head=shard.rank == 0)  # followers compute no logits
    model.eval()
    return model


@dataclass
class ShardParts:
    """What one shard of a worker loads: its part of the model and its KV pool."""

    files: ModelFiles
    model: CausalLM
    kv: KVCache
    max_len: int


def load_shard(
    settings: Settings,
    shard: Shard = WHOLE_MODEL,
    all_reduce: AllReduce = no_reduce,
    shared_kv: bool = False,
) -> ShardParts:
    """Load the configured model's `shard` (cached after the first start) and size its KV
    pool; shared_kv puts a CPU pool in shared memory so other processes can map it.

    Every shard of a group gets the same number of blocks: the budget buys blocks of the
    largest shard (the first, when KV heads do not split evenly)."""
    device = resolve_device(settings.device)
    cpu_kernels.select(settings.cpu_isa)
    files = load_model_files(settings.model, settings.cache_dir)
    quantized = use_quant(settings, files, device)
    dtype = activation_dtype(settings.dtype, quantized, device)
    cfg = files.config
    max_len = min(
        settings.batch.max_model_len or cfg.max_position_embeddings, cfg.max_position_embeddings
    )
    kv_heads = kv_head_ranges(cfg.num_kv_heads, shard.size)
    degrees = (settings.prefill_tp, settings.decode_tp)
    model = build_model(
        files, dtype, device, max_len, quantized, shard, all_reduce, settings.quantize, degrees
    )
    if quantized:
        gemm = cpu_kernels.prefill_gemm_dtype(settings.prefill_gemm)
        use_prefill_gemm(
            model, gemm, cpu_kernels.prefill_gemm_rows(settings.prefill_gemm_rows, gemm)
        )
    kv_dtype = resolve_kv_dtype(settings.kv_cache_dtype, dtype, device)
    if kv_dtype != dtype:
        model.decode_step = None  # the compiled step reads and writes K/V in one dtype
    largest = KVLayout(
        cfg.num_layers, settings.kv.block_size, len(kv_heads[0]), cfg.head_dim, kv_dtype
    )
    own = replace(largest, num_kv_heads=len(kv_heads[shard.rank]))
    num_blocks = pool_blocks(settings, model, largest, own, max_len, shard, all_reduce)
    kv = KVCache(own, num_blocks, device, shared=shared_kv)
    return ShardParts(files, model, kv, max_len)
