"""The architecture facts of a model, read from GGUF metadata or a Hugging Face config.json."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from appliance.model.errors import ModelLoadError

SUPPORTED_ARCHITECTURES = (
    "llama",
    "mistral",
    "qwen2",
    "qwen3",
    "phi3",
    "gemma3_text",
    "mixtral",
    "qwen3_moe",
    "gpt_oss",
)
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "longrope")
# Architectures whose config.json model_type and GGUF general.architecture name a layout
# of their own (the others run, and lay out a GGUF's Q/K rows, as "llama"; Gemma 3's
# config is read by gemma_config.py and names its own, "gemma3").
OWN_LAYOUTS = ("qwen2", "qwen3", "phi3")
# Mixture-of-experts families and the dense layout their attention runs as (model/moe.py).
MOE_LAYOUTS = {"mixtral": "llama", "qwen3_moe": "qwen3"}


@dataclass(frozen=True)
class ModelConfig:
    """What the forward pass needs to know about a Llama-family, Qwen2, Qwen3, Phi-3 or
    Gemma 3 model.

    `architecture` is "llama" (Mistral too), "qwen2", "qwen3", "phi3" or "gemma3": it says
    how a GGUF lays out Q/K rows, whether q/k/v and gate/up come fused (Phi-3:
    model/phi3.py), and "gemma3" runs gemma.py's layers. `qk_norm`: an RMSNorm over each
    head of q and k before RoPE (Qwen3, Gemma 3). `sliding_window`: each query attends to
    the last this many keys, itself included (Mistral, Phi-3); None: the whole context.
    `rotary_dim`: RoPE turns only the first this many dimensions of each head
    (Phi-4-mini's partial_rotary_factor); None: all of them. `layer_types` (Gemma 3):
    which layers are "sliding_attention" (windowed, RoPE base `local_rope_theta`,
    unscaled) and which "full_attention"; empty: every layer alike.
    `query_pre_attn_scalar`: attention scores scale by its -0.5 power (None: head_dim's).
    `final_logit_softcapping`: logits become cap * tanh(logits / cap).

    Mixture of experts (Mixtral, Qwen3-MoE: model/moe.py), where `num_experts` > 0: each
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
    # gpt-oss (model/gpt_oss.py): a learned sink logit per head joins each softmax.
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


def from_hf_config(cfg: dict[str, Any], source: str) -> ModelConfig:
    """Map a Hugging Face config.json (transformers 4 or 5 layout) to a ModelConfig."""
    arch = cfg.get("model_type", "")
    if arch == "gemma3":
        raise ModelLoadError(
            source,
            "gemma3 (Gemma3ForConditionalGeneration, text with a vision tower) is not "
            "supported: serve a text-only Gemma 3 (gemma3_text)",
        )
    if arch == "gemma3_text":
        from appliance.model.gemma_config import gemma3_from_hf  # it imports this module

        return gemma3_from_hf(cfg, source)
    if arch == "gpt_oss":
        from appliance.model.gpt_oss_config import gpt_oss_from_hf  # it imports this module

        return gpt_oss_from_hf(cfg, source)
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ModelLoadError(
            source,
            f"unknown architecture {arch!r} (supported: {', '.join(SUPPORTED_ARCHITECTURES)})",
        )
    num_heads = cfg["num_attention_heads"]
    rope = cfg.get("rope_parameters") or {}
    scaling = cfg.get("rope_scaling") or (
        rope if rope.get("rope_type", "default") != "default" else None
    )
    rope_scaling = check_rope_scaling(scaling, source)
    if rope_scaling and rope_scaling["rope_type"] == "longrope":
        # Phi-3 keeps LongRoPE's pretraining length beside the scaling, not in it.
        original = cfg.get("original_max_position_embeddings")
        rope_scaling.setdefault("original_max_position_embeddings", original)
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // num_heads
    eos = cfg.get("eos_token_id")
    layout = MOE_LAYOUTS.get(arch, arch)
    config = ModelConfig(
        architecture=layout if layout in OWN_LAYOUTS else "llama",
        vocab_size=cfg["vocab_size"],
        hidden_size=cfg["hidden_size"],
        intermediate_size=cfg["intermediate_size"],
        num_layers=cfg["num_hidden_layers"],
        num_heads=num_heads,
        num_kv_heads=cfg.get("num_key_value_heads") or num_heads,
        head_dim=head_dim,
        rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
        rope_theta=float(cfg.get("rope_theta") or rope.get("rope_theta") or 10000.0),
        max_position_embeddings=cfg.get("max_position_embeddings", 4096),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        attention_bias=arch == "qwen2" or bool(cfg.get("attention_bias", False)),
        rope_scaling=rope_scaling,
        eos_token_ids=tuple(eos if isinstance(eos, list) else [eos] if eos is not None else []),
        qk_norm=layout == "qwen3",
        sliding_window=_sliding_window(cfg, layout, source),
        rotary_dim=_rotary_dim(cfg, rope, arch, head_dim, source),
        **_experts(cfg, arch, source),
    )
    check_longrope(config, source)
    return config


def _experts(cfg: dict[str, Any], arch: str, source: str) -> dict[str, Any]:
    """The routed experts of a Mixtral or Qwen3-MoE config (none for the dense families)."""
    if arch not in MOE_LAYOUTS:
        return {}
    layers = cfg["num_hidden_layers"]
    if arch == "mixtral":
        dense: tuple[int, ...] = ()
        experts, size, norm = cfg["num_local_experts"], cfg["intermediate_size"], True
    else:
        # Published configs say num_experts; transformers 5 writes num_local_experts.
        experts = cfg["num_experts"] if "num_experts" in cfg else cfg["num_local_experts"]
        size = cfg["moe_intermediate_size"]
        norm = bool(cfg.get("norm_topk_prob", False))
        step, only = cfg.get("decoder_sparse_step") or 1, set(cfg.get("mlp_only_layers") or ())
        dense = tuple(i for i in range(layers) if i in only or experts == 0 or (i + 1) % step)
    top_k = cfg["num_experts_per_tok"]
    if experts > 0 and not 0 < top_k <= experts:
        raise ModelLoadError(source, f"num_experts_per_tok {top_k} of {experts} experts")
    return {
        "num_experts": experts,
        "experts_per_token": top_k,
        "expert_intermediate_size": size,
        "norm_topk_prob": norm,
        "dense_layers": dense,
    }


def _rotary_dim(
    cfg: dict[str, Any], rope: dict[str, Any], arch: str, head_dim: int, source: str
) -> int | None:
    """The dimensions of each head RoPE turns, from partial_rotary_factor (top level, or
    in transformers 5's rope_parameters), as transformers computes them; None for all.
    Phi-3's layout alone is run partially (model/phi3.py): elsewhere it is refused."""
    factor = cfg.get("partial_rotary_factor", rope.get("partial_rotary_factor", 1.0))
    if factor is None or float(factor) == 1.0:
        return None
    dim = int(head_dim * float(factor))
    if arch != "phi3":
        raise ModelLoadError(
            source, f"partial_rotary_factor {factor} is supported for phi3 models only"
        )
    if not 0 < dim < head_dim or dim % 2 or head_dim % 2:
        raise ModelLoadError(
            source,
            f"partial_rotary_factor {factor} gives {dim} of {head_dim} head dimensions: "
            "an even number between 0 and the head size is needed",
        )
    return dim


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


def _sliding_window(cfg: dict[str, Any], arch: str, source: str) -> int | None:
    """The window every layer attends within, or None. Mistral windows every layer; Qwen
    configs carry a `sliding_window` that only counts with `use_sliding_window`, and then
    for some layers only, which this server does not run: refused, never ignored."""
    window = cfg.get("sliding_window")
    if arch in ("qwen2", "qwen3"):
        sliding = [t for t in cfg.get("layer_types") or () if t != "full_attention"]
        if cfg.get("use_sliding_window") or sliding:
            raise ModelLoadError(
                source,
                "use_sliding_window (sliding-window layers in a Qwen model) is not supported",
            )
        return None
    return check_sliding_window(window, source)


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
    `supported` (YaRN is gpt-oss's alone: model/gpt_oss_config.py)."""
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
