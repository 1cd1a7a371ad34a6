"""Gemma 3 text's decoder: llama.py's model with Gemma's differences.

- RMSNorm scales by (1 + weight), computed in float32 and cast back (Gemma3RMSNorm);
  four norms a layer: before and after attention, before and after the MLP, each
  output normed before it joins the residual stream.
- q_norm and k_norm over each head, the same (1 + weight) norm.
- A GeGLU MLP: gelu (tanh approximation) of the gate times up.
- Embeddings scaled by sqrt(hidden_size) in the model's dtype.
- Attention scores scaled by query_pre_attn_scalar ** -0.5.
- Sliding layers attend within the window with RoPE base local_rope_theta, unscaled;
  full layers see the whole context with rope_theta and its scaling.
- Logits capped by final_logit_softcapping where the config has it.

The compiled whole-step decode (decode_step.py) runs Llama's layers only: a Gemma model
always runs these Python layers (compiled_problem refuses it).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

import torch
import torch.nn.functional as F
from torch import nn

from appliance.model.families.gpt_oss import GptOssCausalLM
from appliance.model.families.llama import MLP, Attention, CausalLM, HeadNorm, sum_partials
from appliance.model.layers.paged_attention import AttentionBatch
from appliance.model.layers.rotary import RotaryEmbedding
from appliance.model.model_config import ModelConfig
from appliance.model.tensor_parallel import WHOLE_MODEL, AllReduce, Shard, no_reduce


class GemmaNorm(nn.Module):
    """Gemma's RMSNorm: the float32 norm of x times (1 + weight), cast to x's dtype."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim), requires_grad=False)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        normed = F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps)
        return (normed * (1.0 + self.weight.float())).to(x.dtype)


class GemmaHeadNorm(HeadNorm):
    """HeadNorm (its in-place interface) with Gemma's (1 + weight) float32 norm."""

    def apply_(self, heads: torch.Tensor) -> None:
        """Normalise `heads` [tokens, n, head_dim] in place (a view into the fused qkv)."""
        normed = F.rms_norm(heads.float(), (heads.shape[-1],), eps=self.eps)
        heads.copy_(normed * (1.0 + self.weight.float()))


class GemmaAttention(Attention):
    """Llama's attention with Gemma's head norms, score scale and this layer's window."""

    def __init__(self, config: ModelConfig, shard: Shard, index: int) -> None:
        super().__init__(config, shard)
        self.q_norm = GemmaHeadNorm(config.head_dim, config.rms_norm_eps)
        self.k_norm = GemmaHeadNorm(config.head_dim, config.rms_norm_eps)
        self.scale = (config.query_pre_attn_scalar or config.head_dim) ** -0.5
        self.window = config.layer_window(index)


class GemmaMLP(MLP):
    """GeGLU: down(gelu_tanh(gate) * up); never the SiLU kernel."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)  # [tokens, columns] each
        return self.down_proj(F.gelu(gate, approximate="tanh").mul_(up))


class GemmaDecoderLayer(nn.Module):
    def __init__(
        self, config: ModelConfig, shard: Shard, all_reduce: AllReduce, index: int
    ) -> None:
        super().__init__()
        hidden, eps = config.hidden_size, config.rms_norm_eps
        self.input_layernorm = GemmaNorm(hidden, eps)
        self.self_attn = GemmaAttention(config, shard, index)
        self.post_attention_layernorm = GemmaNorm(hidden, eps)
        self.pre_feedforward_layernorm = GemmaNorm(hidden, eps)
        self.mlp = GemmaMLP(config, shard)
        self.post_feedforward_layernorm = GemmaNorm(hidden, eps)
        self.all_reduce = all_reduce
        self.sliding = config.layer_window(index) is not None

    def forward(
        self,
        residual: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        kv_layer: torch.Tensor,
        batch: AttentionBatch,
    ) -> torch.Tensor:
        """The residual stream [tokens, hidden] after this layer. A shard's row-parallel
        partial sums are summed before the norm that follows them."""
        h = self.self_attn(self.input_layernorm(residual), rope, kv_layer, batch)
        residual = residual + self.post_attention_layernorm(self._sum(h, residual.dtype))
        h = self.mlp(self.pre_feedforward_layernorm(residual))
        return residual + self.post_feedforward_layernorm(self._sum(h, residual.dtype))

    def _sum(self, partial: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        return sum_partials(self.all_reduce, partial, dtype)


class GemmaCausalLM(CausalLM):
    """CausalLM with Gemma 3's layers, embedding scale, two RoPE tables and logit cap."""

    def __init__(
        self,
        config: ModelConfig,
        dtype: torch.dtype,
        device: torch.device,
        max_positions: int,
        shard: Shard = WHOLE_MODEL,
        all_reduce: AllReduce = no_reduce,
    ) -> None:
        super().__init__(config, dtype, device, max_positions, shard, all_reduce)
        self.layers = nn.ModuleList(
            GemmaDecoderLayer(config, shard, all_reduce, i) for i in range(config.num_layers)
        )
        self.norm = GemmaNorm(config.hidden_size, config.rms_norm_eps)  # type: ignore[assignment]
        self.local_rope: RotaryEmbedding | None = None  # the sliding layers', by load_weights
        self.requires_grad_(False)

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        batch: AttentionBatch,
        kv_cache: torch.Tensor,
    ) -> torch.Tensor:
        """As CausalLM.forward (no compiled decode step)."""
        embedded = self.embed_tokens(input_ids)
        # sqrt(hidden) rounded to the model's dtype first, as transformers does.
        scale = torch.tensor(self.config.hidden_size**0.5).to(embedded.dtype)
        residual = embedded * scale
        if self.rope is None or self.local_rope is None:
            raise RuntimeError("the model has no weights yet: load_weights builds its RoPE")
        full, local = self.rope.at(positions), self.local_rope.at(positions)
        for index, layer in enumerate(self.layers):
            rope = local if layer.sliding else full
            residual = layer(residual, rope, kv_cache[index], batch)
        return self.norm(residual)

    @torch.inference_mode()
    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[rows, hidden] -> float32 [rows, vocab], capped where the config says."""
        logits = super().logits(hidden)
        cap = self.config.final_logit_softcapping
        return logits if cap is None else torch.tanh(logits / cap).mul_(cap)

    def load_weights(self, weights: Mapping[str, torch.Tensor], source: str) -> None:
        """As CausalLM.load_weights, and the sliding layers' RoPE table (their base, no
        scaling)."""
        super().load_weights(weights, source)
        local = dataclasses.replace(
            self.config,
            rope_theta=self.config.local_rope_theta or self.config.rope_theta,
            rope_scaling=None,
        )
        self.local_rope = RotaryEmbedding(local, self.max_positions, self.dtype, self.device)


def model_class(config: ModelConfig) -> type[CausalLM]:
    """The model class that runs `config`'s architecture."""
    if config.architecture == "gpt_oss":
        return GptOssCausalLM
    return GemmaCausalLM if config.architecture == "gemma3" else CausalLM
