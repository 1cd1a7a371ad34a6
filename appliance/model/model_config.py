"""The architecture facts of a model, read from GGUF metadata or a Hugging Face config.json."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from appliance.model.errors import ModelLoadError

SUPPORTED_ARCHITECTURES = ("llama", "mistral", "qwen2", "qwen3", "gemma3_text")
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


@dataclass(frozen=True)
class ModelConfig:
    """What the forward pass needs to know about a Llama-family, Qwen2, Qwen3 or Gemma 3
    model.

    `architecture` is "llama" (Mistral too), "qwen2", "qwen3" or "gemma3": it says how a
    GGUF lays out Q/K rows, and "gemma3" runs gemma.py's layers. `qk_norm`: an RMSNorm
    over each head of q and k before RoPE (Qwen3, Gemma 3). `sliding_window`: each query
    attends to the last this many keys, itself included (Mistral); None: the whole
    context. `layer_types` (Gemma 3): which layers are "sliding_attention" (windowed, RoPE
    base `local_rope_theta`, unscaled) and which "full_attention"; empty: every layer
    alike. `query_pre_attn_scalar`: attention scores scale by its -0.5 power (None:
    head_dim's). `final_logit_softcapping`: logits become cap * tanh(logits / cap)."""

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
    layer_types: tuple[str, ...] = ()
    local_rope_theta: float | None = None
    query_pre_attn_scalar: float | None = None
    final_logit_softcapping: float | None = None

    def layer_window(self, index: int) -> int | None:
        """The sliding window layer `index` attends within, or None for its whole context."""
        if self.layer_types and self.layer_types[index] != "sliding_attention":
            return None
        return self.sliding_window

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ModelConfig:
        data = dict(data)
        data["eos_token_ids"] = tuple(data.get("eos_token_ids", ()))
        data["layer_types"] = tuple(data.get("layer_types", ()))
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
    eos = cfg.get("eos_token_id")
    return ModelConfig(
        architecture=arch if arch in ("qwen2", "qwen3") else "llama",
        vocab_size=cfg["vocab_size"],
        hidden_size=cfg["hidden_size"],
        intermediate_size=cfg["intermediate_size"],
        num_layers=cfg["num_hidden_layers"],
        num_heads=num_heads,
        num_kv_heads=cfg.get("num_key_value_heads") or num_heads,
        head_dim=cfg.get("head_dim") or cfg["hidden_size"] // num_heads,
        rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
        rope_theta=float(cfg.get("rope_theta") or rope.get("rope_theta") or 10000.0),
        max_position_embeddings=cfg.get("max_position_embeddings", 4096),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        attention_bias=arch == "qwen2" or bool(cfg.get("attention_bias", False)),
        rope_scaling=check_rope_scaling(scaling, source),
        eos_token_ids=tuple(eos if isinstance(eos, list) else [eos] if eos is not None else []),
        qk_norm=arch == "qwen3",
        sliding_window=_sliding_window(cfg, arch, source),
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


def check_rope_scaling(scaling: dict[str, Any] | None, source: str) -> dict[str, Any] | None:
    """Normalise rope scaling to {'rope_type': ..., params} or None; refuse unknown kinds."""
    if not scaling:
        return None
    scaling = dict(scaling)
    kind = scaling.pop("rope_type", None) or scaling.pop("type", "default")
    scaling.pop("rope_theta", None)
    if kind not in SUPPORTED_ROPE_TYPES:
        raise ModelLoadError(
            source,
            f"unsupported RoPE scaling {kind!r} (supported: {', '.join(SUPPORTED_ROPE_TYPES)})",
        )
    return None if kind == "default" else {"rope_type": kind, **scaling}
