"""The model a family builds: embedding, decoder layers, final norm, LM head and RoPE
tables, run over flat token batches and a paged KV cache, and its weights loaded by Hugging
Face name, each parameter copied as its source is read. What the layers are is the
family's (families/); this is the part every family shares."""

from __future__ import annotations

from collections.abc import Mapping

import torch
import torch.nn.functional as F
from torch import nn

from appliance.model.decode_step import CompiledDecode
from appliance.model.errors import ModelLoadError
from appliance.model.layers.norms import OffsetRMSNorm, RMSNorm
from appliance.model.layers.paged_attention import AttentionBatch
from appliance.model.layers.rotary import RotaryEmbedding
from appliance.model.model_config import ModelConfig
from appliance.model.quant import PrefillGemm
from appliance.model.tensor_parallel import (
    WHOLE_MODEL,
    AllReduce,
    Shard,
    no_reduce,
    shard_plan,
    shard_state,
)


class CausalLM(nn.Module):
    """The whole model, or one tensor-parallel shard of it (`shard`, whose partial sums
    `all_reduce` adds up over the group). forward() gives hidden states, whole on every
    shard; logits() the next-token scores. A family's subclass says what it is made of:
    build_layer() (a layers.decoder layer), build_norm(), and where it differs embed(),
    build_local_rope(), logits()."""

    def __init__(
        self,
        config: ModelConfig,
        dtype: torch.dtype,
        device: torch.device,
        max_positions: int,
        shard: Shard = WHOLE_MODEL,
        all_reduce: AllReduce = no_reduce,
    ) -> None:
        super().__init__()
        self.config = config
        self.shard = shard
        self.dtype = dtype
        self.device = device
        self.max_positions = max_positions
        # An explicit (empty) weight skips normal_ init, which on meta tensors imports
        # torch's compiler stack and costs a second at every start.
        embedding = torch.empty(config.vocab_size, config.hidden_size)
        # An nn.Embedding, or the QuantEmbedding attach_quant swaps in.
        self.embed_tokens: nn.Module = nn.Embedding(
            config.vocab_size, config.hidden_size, _weight=embedding
        )
        self.all_reduce = all_reduce
        self.layers = nn.ModuleList(self.build_layer(index) for index in range(config.num_layers))
        self.norm = self.build_norm()
        # None while tied to the embedding; attach_quant and pack_linears may swap in theirs.
        self.lm_head: nn.Module | None = (
            None
            if config.tie_word_embeddings
            else nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        )
        self.rope: RotaryEmbedding | None = None  # built by load_weights, on the real device
        # The table of layers whose local_rope is set (Gemma's sliding ones), by load_weights.
        self.local_rope: RotaryEmbedding | None = None
        # Decode-only steps in one compiled call, where the model allows (build_model).
        self.decode_step: CompiledDecode | None = None
        # When quantized products run as a GEMM (quant.use_prefill_gemm); told each step's rows.
        self.prefill_gemm: PrefillGemm | None = None
        self.requires_grad_(False)

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        batch: AttentionBatch,
        kv_cache: torch.Tensor,
    ) -> torch.Tensor:
        """input_ids, positions [tokens]; kv_cache [layers, 2, blocks, block_size, kv_heads,
        head_dim]. Returns hidden states [tokens, hidden]."""
        residual, delta = self.embed(input_ids), None
        if self.rope is None:
            raise RuntimeError("the model has no weights yet: load_weights builds its RoPE")
        rope = self.rope.at(positions)
        if self.prefill_gemm is not None:  # the prompt rows come first, decode rows after
            prompt_rows = batch.prompt_rows
            self.prefill_gemm.step_rows = batch.decode_start if prompt_rows is None else prompt_rows
        if self.decode_step is not None and self.decode_step.takes(batch):
            return self.decode_step(residual, rope, batch, kv_cache)
        local = rope if self.local_rope is None else self.local_rope.at(positions)
        for index, layer in enumerate(self.layers):
            turn = local if layer.local_rope else rope
            delta, residual = layer(residual, delta, turn, kv_cache[index], batch)
        return self.norm(residual, delta)[0]

    def build_layer(self, index: int) -> nn.Module:
        """Decoder layer `index` (a family's subclass builds it from layers/)."""
        raise NotImplementedError(f"{type(self).__name__} says no decoder layer")

    def build_norm(self) -> RMSNorm | OffsetRMSNorm:
        """The norm after the last layer, called as layers.norms.RMSNorm is."""
        return RMSNorm(self.config.hidden_size, self.config.rms_norm_eps)

    def build_local_rope(self) -> RotaryEmbedding | None:
        """A second RoPE table for the layers that ask for it (None: every layer uses one)."""
        return None

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """input_ids [tokens] -> the residual stream's start [tokens, hidden]."""
        return self.embed_tokens(input_ids)

    @torch.inference_mode()
    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[rows, hidden] -> float32 [rows, vocab]."""
        if self.lm_head is None:  # tied to the embedding
            return F.linear(hidden, self.embedding_weight()).float()
        return self.lm_head(hidden).float()

    def embedding_weight(self) -> torch.Tensor:
        """The float embedding's weight [vocab, hidden] (a quantized one has none)."""
        weight = self.embed_tokens.weight  # nn.Module's __getattr__ is typed Tensor | Module
        if not isinstance(weight, torch.Tensor):
            raise TypeError(f"the embedding's weight is a {type(weight).__name__}")
        return weight

    def load_weights(self, weights: Mapping[str, torch.Tensor], source: str) -> None:
        """Take Hugging Face-named float weights: this shard's part of each is copied into
        its parameter, in the model's dtype and on its device, as it is read, and q/k/v
        and gate/up straight into their rows of the fused parameter. `weights` may read
        each tensor only when asked for (loader.ModelFiles); one with `release(name)` is
        told when a tensor is copied. So loading holds the model's own parameters and one
        tensor being copied, never a full-size copy of the model. Parameters are
        allocated here: the model may be built on the meta device."""
        plan = self._load_plan()
        self._check_names(plan, weights, source)
        for name, parts in plan.items():
            self._load_parameter(name, parts, weights, source)
        factors = weights["rope_freqs"].float().clone() if "rope_freqs" in weights else None
        self.rope = RotaryEmbedding(
            self.config, self.max_positions, self.dtype, self.device, factors
        )
        self.local_rope = self.build_local_rope()

    def _load_plan(self) -> dict[str, list[tuple[str, int]]]:
        """Each parameter's Hugging Face sources, in row order, with the rows of this
        shard's part of each."""
        plan = shard_plan(self.config, self.shard)
        d = self.config.head_dim
        rows = {
            "q_proj": len(plan.q_heads) * d,
            "k_proj": len(plan.kv_heads) * d,
            "v_proj": len(plan.kv_heads) * d,
            "gate_proj": len(plan.mlp_columns),
            "up_proj": len(plan.mlp_columns),
        }
        expert = len(plan.expert_columns)
        out = {}
        for name, param in self.named_parameters():
            source = name if name.startswith("lm_head.") else "model." + name
            fused = next((f for f in _FUSED if f".{f}." in name), None)
            sizes = rows | {"gate_proj": expert, "up_proj": expert} if ".experts." in name else rows
            if fused is None:
                out[name] = [(source, param.shape[0] if param.dim() else 1)]
            else:
                out[name] = [(source.replace(fused, p), sizes[p]) for p in _FUSED[fused]]
        return out

    def _check_names(
        self,
        plan: dict[str, list[tuple[str, int]]],
        weights: Mapping[str, torch.Tensor],
        source: str,
    ) -> None:
        """Refuse weights that do not name exactly the parameters' sources (a tied model
        may bring an LM head; a GGUF may bring RoPE factors)."""
        wanted = {part for parts in plan.values() for part, _ in parts}
        extra = {"rope_freqs"} | ({"lm_head.weight"} if self.config.tie_word_embeddings else set())
        missing = sorted(wanted - set(weights))
        unexpected = sorted(set(weights) - wanted - extra)
        if missing or unexpected:
            raise ModelLoadError(
                source,
                f"weights do not fit the architecture (missing {missing[:3]}, "
                f"unexpected {unexpected[:3]})",
            )

    def _load_parameter(
        self,
        name: str,
        parts: list[tuple[str, int]],
        weights: Mapping[str, torch.Tensor],
        source: str,
    ) -> None:
        """Allocate one parameter and copy this shard's part of each of its sources into its
        rows, one source in memory at a time. Always a copy: a source may view a mapped
        file, which a user could rewrite under a running worker."""
        shape = self.get_parameter(name).shape
        target, start = None, 0
        for part, rows in parts:
            tensor = shard_state({part: weights[part]}, self.config, self.shard)[part]
            if target is None:
                dtype = self.dtype if tensor.is_floating_point() else tensor.dtype
                target = torch.empty(shape, dtype=dtype, device=self.device)
            into = target[start : start + rows] if len(parts) > 1 else target
            if tensor.shape != into.shape:
                raise ModelLoadError(
                    source,
                    f"weight {part} has shape {tuple(tensor.shape)}, expected {tuple(into.shape)}",
                )
            into.copy_(tensor)
            del tensor  # before the next source is read
            _release(weights, part)
            start += rows
        assert target is not None  # every parameter has a source: _load_plan lists one at least
        owner, _, leaf = name.rpartition(".")
        setattr(self.get_submodule(owner), leaf, nn.Parameter(target, requires_grad=False))


# Our fused parameters and the Hugging Face projections they are made of, in row order.
_FUSED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}


def _release(weights: Mapping[str, torch.Tensor], name: str) -> None:
    """Tell `weights` that its tensor `name` is copied (safetensors_file.MappedTensors.release)."""
    release = getattr(weights, "release", None)
    if release is not None:
        release(name)
