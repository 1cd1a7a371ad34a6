"""The architecture facts of a model, read from GGUF metadata or a Hugging Face config.json."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from appliance.model.errors import ModelLoadError

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "longrope")
SLIDING, FULL = "sliding_attention", "full_attention"


@dataclass(frozen=True)
class ModelConfig:
    """What the forward pass needs to know about a model of any family (families/; each
    family's config reader fills it, registry.py says which reader).

    `architecture` is the layout: "llama" (Mistral, Mixtral too), "qwen2", "qwen3" (and
    Qwen3-MoE), "phi3", "gemma3" or "gpt_oss": it says how a GGUF lays out Q/K rows
    (llama's permuted), and with the experts which family builds the model
    (registry.family_of). `qk_norm`: an RMSNorm over each
    head of q and k before RoPE (Qwen3, Gemma 3). `sliding_window`: each query attends to
    the last this many keys, itself included (Mistral, Phi-3); None: the whole context.
    `rotary_dim`: RoPE turns only the first this many dimensions of each head
    (Phi-4-mini's partial_rotary_factor); None: all of them. `layer_types` (Gemma 3):
    which layers are "sliding_attention" (windowed, RoPE base `local_rope_theta`,
    unscaled) and which "full_attention"; empty: every layer alike.
    `query_pre_attn_scalar`: attention scores scale by its -0.5 power (None: head_dim's).
    `final_logit_softcapping`: logits become cap * tanh(logits / cap).

    Mixture of experts (Mixtral, Qwen3-MoE: families/mixtral.py), where `num_experts` > 0: each
    token's `experts_per_token` experts of highest router softmax, their weights
    renormalized to sum to 1 where `norm_topk_prob`; each expert an MLP of
    `expert_intermediate_size` columns. `dense_layers` keep a dense MLP of
    `intermediate_size` (Qwen3-MoE's mlp_only_layers and decoder_sparse_step)."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool
    rope_scaling: dict[str, Any] | None = None
    eos_token_ids: tuple[int, ...] = field(default_factory=tuple)
    qk_norm: bool = False
    sliding_window: int | None = None
    rotary_dim: int | None = None
    layer_types: tuple[str, ...] = ()
    local_rope_theta: float | None = None
    query_pre_attn_scalar: float | None = None
    final_logit_softcapping: float | None = None
    # gpt-oss (families/gpt_oss.py): a learned sink logit per head joins each softmax.
    attention_sinks: bool = False

    def layer_window(self, index: int) -> int | None:
        """The sliding window layer `index` attends within, or None for its whole context."""
        if self.layer_types and self.layer_types[index] != "sliding_attention":
            return None
        return self.sliding_window

    num_experts: int = 0
    experts_per_token: int = 0
    expert_intermediate_size: int = 0
    norm_topk_prob: bool = True
    dense_layers: tuple[int, ...] = ()
    # gpt-oss's clamped SwiGLU in its experts (None: plain SiLU-gated MLPs).
    swiglu_limit: float | None = None
    swiglu_alpha: float = 1.702

    def sparse_layer(self, index: int) -> bool:
        """Whether layer `index` routes tokens to experts (else a dense MLP)."""
        return self.num_experts > 0 and index not in self.dense_layers

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ModelConfig:
        data = dict(data)
        data["eos_token_ids"] = tuple(data.get("eos_token_ids", ()))
        data["layer_types"] = tuple(data.get("layer_types", ()))
        data["dense_layers"] = tuple(data.get("dense_layers", ()))
        return cls(**data)


def eos_ids(value: Any) -> tuple[int, ...]:
    """A config's eos_token_id (one id, a list of them, or none) as a tuple."""
    return tuple(value if isinstance(value, list) else [value] if value is not None else [])


def check_top_k(top_k: int, experts: int, source: str, *, routed: bool = False) -> None:
    """Each token routes to between 1 and all of the experts (where there are experts, or
    always where the family is `routed`)."""
    if (experts > 0 or routed) and not 0 < top_k <= experts:
        raise ModelLoadError(source, f"num_experts_per_tok {top_k} of {experts} experts")


def parse_layer_types(types: Any, num_layers: int, period: int, source: str) -> tuple[str, ...]:
    """Each layer's kind: `types` (a config's layer_types), or where it has none, as
    transformers derives them, every `period`th layer full and the others sliding."""
    if types is None:
        types = [SLIDING if (i + 1) % period else FULL for i in range(num_layers)]
    if len(types) != num_layers or any(t not in (SLIDING, FULL) for t in types):
        raise ModelLoadError(
            source, f"layer_types must name {num_layers} layers {SLIDING!r} or {FULL!r}"
        )
    return tuple(types)


def check_longrope(config: ModelConfig, source: str) -> None:
    """A LongRoPE scaling needs its pretraining length and one short and one long factor
    per pair of turned dimensions."""
    scaling = config.rope_scaling or {}
    if scaling.get("rope_type") != "longrope":
        return
    pairs = (config.rotary_dim or config.head_dim) // 2
    if not scaling.get("original_max_position_embeddings"):
        raise ModelLoadError(source, "longrope scaling needs original_max_position_embeddings")
    for key in ("short_factor", "long_factor"):
        factors = scaling.get(key)
        if not isinstance(factors, list) or len(factors) != pairs:
            raise ModelLoadError(
                source, f"longrope {key} must list {pairs} numbers (one per rotated pair)"
            )


def check_degree(config: ModelConfig, degree: int, setting: str) -> None:
    """Refuse, naming the setting, a tensor-parallel degree the model's KV heads cannot be
    split over (tensor_parallel.py gives each shard at least one)."""
    if degree > config.num_kv_heads:
        raise ValueError(
            f"{setting}={degree}: the model has {config.num_kv_heads} KV heads, and each "
            f"shard needs at least one; use at most {config.num_kv_heads}"
        )


def check_sliding_window(window: Any, source: str) -> int | None:
    """A sliding window as an int of at least 1, or None for none."""
    if window is None:
        return None
    if isinstance(window, bool) or not isinstance(window, int) or window < 1:
        raise ModelLoadError(source, f"sliding_window must be a positive integer, got {window!r}")
    return window


def check_rope_scaling(
    scaling: dict[str, Any] | None, source: str, supported: tuple[str, ...] = SUPPORTED_ROPE_TYPES
) -> dict[str, Any] | None:
    """Normalise rope scaling to {'rope_type': ..., params} or None; refuse kinds not in
    `supported` (YaRN is gpt-oss's alone: families/gpt_oss.py)."""
    if not scaling:
        return None
    scaling = dict(scaling)
    kind = scaling.pop("rope_type", None) or scaling.get("type") or "default"
    kind = "longrope" if kind == "su" else kind  # LongRoPE's first name (Phi-3 128k)
    for key in ("type", "rope_theta", "partial_rotary_factor"):  # not scaling: read apart
        scaling.pop(key, None)
    if kind not in supported:
        raise ModelLoadError(
            source, f"unsupported RoPE scaling {kind!r} (supported: {', '.join(supported)})"
        )
    return None if kind == "default" else {"rope_type": kind, **scaling}
