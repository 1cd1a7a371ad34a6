"""A whole decode step's decoder layers as one compiled call (csrc/decode_step.c), for a
whole model (no tensor parallelism) on the CPU whose every projection is block-quantized.

The Python layers call ~15 kernels and modules a layer; at batch 1 on two cores those
calls cost about as much as the kernels' own work. The compiled step calls the same
kernels in the same order, so it answers as the layers do; prefill and mixed steps keep
the layers (their kernels' work dwarfs the calls).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, cast

import torch

from appliance.model import cpu_kernels
from appliance.model.layers.paged_attention import AttentionBatch
from appliance.model.quant import QuantLinear, projections

if TYPE_CHECKING:
    from appliance.model.causal_lm import CausalLM
    from appliance.model.layers.decoder import DecoderLayer


def compiled_problem(model: CausalLM) -> str:
    """Why the compiled step cannot run `model`, or "" when it can."""
    if not cpu_kernels.available() or model.device.type != "cpu":
        return "the compiled kernels are not built, or the model is not on the CPU"
    if model.config.attention_sinks:  # gpt-oss: its decode attention has no sink term
        return "attention sinks: the compiled step's attention has none (the layers run)"
    if model.config.architecture == "gemma3":
        return "the compiled step runs Llama's layers, not Gemma's (four norms, GeGLU)"
    if model.config.num_experts:
        return "mixture-of-experts layers route each token to its own experts"
    if model.shard.size != 1:
        return "tensor-parallel shards add partial sums between the layers"
    if model.dtype not in (torch.float32, torch.bfloat16):
        return "the compiled step runs float32 or bfloat16"
    if model.config.head_dim not in cpu_kernels.HEAD_SIZES:
        return f"decode attention is compiled for head sizes {cpu_kernels.HEAD_SIZES}"
    for layer in model.layers:
        for name, linear in projections(layer).items():
            if not isinstance(linear, QuantLinear) or len(linear.parts) != 1:
                return f"{name} is not one block-quantized weight"
    return ""


class CompiledDecode:
    """The decoder layers of `model` (for which compiled_problem() is "") as one call per
    decode step."""

    def __init__(self, model: CausalLM) -> None:
        problem = compiled_problem(model)
        if problem:
            raise ValueError(f"cannot compile the decode step: {problem}")
        config = model.config
        self.model = model
        self.shape = cpu_kernels.StepShape(
            hidden=config.hidden_size,
            heads=config.num_heads,
            kv_heads=config.num_kv_heads,
            head_dim=config.head_dim,
            intermediate=config.intermediate_size,
            eps=model.norm.eps,
            scale=config.head_dim**-0.5,
            window=config.sliding_window or 0,
        )
        self.layers = torch.tensor([_fields(layer) for layer in model.layers], dtype=torch.int64)

    def takes(self, batch: AttentionBatch) -> bool:
        """Whether `batch` is a decode-only step of one group in row order."""
        groups = batch.decode_groups
        return not batch.prefills and len(groups) == 1 and groups[0].rows is None

    def __call__(
        self,
        residual: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        batch: AttentionBatch,
        kv_cache: torch.Tensor,
    ) -> torch.Tensor:
        """The embeddings residual [n, hidden] -> the final norm [n, hidden], as the
        layers give it."""
        group = batch.decode_groups[0]
        first = _layer(self.model.layers[0]).self_attn.qkv_proj  # every projection's setting
        assert isinstance(first, QuantLinear)  # compiled_problem() found them all quantized
        return cpu_kernels.decode_step(
            self.layers,
            self.shape,
            residual,
            self.model.norm.weight,
            *rope,
            batch.slot_mapping,
            group.block_tables,
            group.context_lens,
            kv_cache,
            first.precise,
        )


def _quantized(linears: dict[str, torch.nn.Module]) -> list[QuantLinear]:
    """A layer's projections, in order, which compiled_problem() found block-quantized."""
    out = []
    for linear in linears.values():
        assert isinstance(linear, QuantLinear)  # CompiledDecode runs only where they are
        out.append(linear)
    return out


def _layer(module: torch.nn.Module) -> DecoderLayer:
    return cast("DecoderLayer", module)  # CausalLM.layers (a ModuleList) holds DecoderLayers


def _fields(module: torch.nn.Module) -> list[int]:
    """A layer's row of the compiled step's table (kernels.h: DecodeStep.layers)."""
    layer = _layer(module)
    row = [
        layer.input_layernorm.weight.data_ptr(),
        layer.post_attention_layernorm.weight.data_ptr(),
    ]
    for linear in _quantized(projections(layer)):  # kernels.h's order: q/k/v, o, gate/up, down
        part = linear.parts[0]
        bias = 0 if linear.bias is None else linear.bias.data_ptr()
        row += [part.blocks.data_ptr(), bias, part.rows, part.blocks.shape[1]]
        row += [part.format.ggml_id, linear.span]
    head_norms = (layer.self_attn.q_norm, layer.self_attn.k_norm)  # Qwen3's, or none: 0
    return row + [0 if norm is None else norm.weight.data_ptr() for norm in head_norms]
