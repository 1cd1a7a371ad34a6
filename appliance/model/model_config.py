"""The architecture facts of a model, read from GGUF metadata or a Hugging Face config.json."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from appliance.model.errors import ModelLoadError

SUPPORTED_ARCHITECTURES = ("llama", "mistral", "qwen2")
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


@dataclass(frozen=True)
class ModelConfig:
    """What the forward pass needs to know about a Llama-family or Qwen2 model."""

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

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ModelConfig:
        data = dict(data)
        data["eos_token_ids"] = tuple(data.get("eos_token_ids", ()))
        return cls(**data)


def from_hf_config(cfg: dict[str, Any], source: str) -> ModelConfig:
    """Map a Hugging Face config.json (transformers 4 or 5 layout) to a ModelConfig."""
    arch = cfg.get("model_type", "")
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
        architecture="qwen2" if arch == "qwen2" else "llama",
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
    )


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
