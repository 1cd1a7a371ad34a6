"""Which family runs a model: architecture names (config.json `model_type` and
`architectures`, a GGUF's `general.architecture`) mapped to the family files in
families/, each imported only when asked for.

A family file has `from_hf(cfg, source) -> ModelConfig` (its config.json reader) and
`MODEL` (its CausalLM subclass); where it differs from the plain case, `gguf_facts(config,
meta, reader, path)` (what its GGUF says beyond the common facts), `weights(weights,
config)` (the files' weights under the names the model loads), and for block-quantized
GGUF weights `loaded_names(names, config)` and `split_quant(quant, config)`.
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import ModuleType
from typing import TYPE_CHECKING, Any

from appliance.model.errors import ModelLoadError
from appliance.model.model_config import ModelConfig

if TYPE_CHECKING:
    import torch

    from appliance.model.causal_lm import CausalLM
    from appliance.model.quant import QuantWeight


@dataclass(frozen=True)
class Family:
    """`model_types`: config.json's model_type -> its class in `architectures`;
    `gguf`: a GGUF's general.architecture -> the layout (ModelConfig.architecture) its
    common facts are read as."""

    name: str
    summary: str
    model_types: Mapping[str, str]
    gguf: Mapping[str, str] = field(default_factory=dict)

    def module(self) -> ModuleType:
        return importlib.import_module(f"appliance.model.families.{self.name}")


FAMILIES = (
    Family(
        "llama",
        "pre-norm attention, SiLU MLP; Mistral's window, Qwen2's q/k/v biases, Qwen3's head norms",
        {
            "llama": "LlamaForCausalLM",
            "mistral": "MistralForCausalLM",
            "qwen2": "Qwen2ForCausalLM",
            "qwen3": "Qwen3ForCausalLM",
        },
        {"llama": "llama", "mistral": "llama", "qwen2": "qwen2", "qwen3": "qwen3"},
    ),
    Family(
        "phi3",
        "llama's layers; q/k/v and gate/up fused in the files, partial RoPE, LongRoPE",
        {"phi3": "Phi3ForCausalLM"},
        {"phi3": "phi3"},
    ),
    Family(
        "gemma3",
        "four norms a layer with (1 + weight), GeGLU, sliding and full layers, two RoPE tables",
        {"gemma3_text": "Gemma3ForCausalLM"},
        {"gemma3": "llama"},
    ),
    Family(
        "mixtral",
        "llama's attention with routed experts in place of the MLP (Mixtral, Qwen3-MoE)",
        {"mixtral": "MixtralForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM"},
        {"mixtral": "llama", "qwen3moe": "qwen3"},
    ),
    Family(
        "gpt_oss",
        "attention with sinks and biases, alternating windows, YaRN, clamped-SwiGLU experts",
        {"gpt_oss": "GptOssForCausalLM"},
        {"gpt-oss": "llama"},
    ),
)


def _unknown(arch: object, source: object, known: list[str]) -> ModelLoadError:
    return ModelLoadError(
        source,  # type: ignore[arg-type]
        f"unknown architecture {arch!r} (supported: {', '.join(known)})",
    )


def hf_family(cfg: dict[str, Any], source: str) -> Family:
    """The family of a config.json, by model_type (or, without one, its architectures)."""
    arch = cfg.get("model_type", "")
    if arch == "gemma3":
        raise ModelLoadError(
            source,
            "gemma3 (Gemma3ForConditionalGeneration, text with a vision tower) is not "
            "supported: serve a text-only Gemma 3 (gemma3_text)",
        )
    classes = cfg.get("architectures") or []
    for family in FAMILIES:
        if arch in family.model_types or (
            not arch and any(c in family.model_types.values() for c in classes)
        ):
            return family
    known = [name for family in FAMILIES for name in family.model_types]
    raise _unknown(arch, source, known)


def gguf_family(arch: Any, source: object) -> Family:
    """The family of a GGUF by its general.architecture (a llama.cpp Mixtral is a "llama"
    with experts: read as llama's, built as mixtral's, as family_of() says)."""
    for family in FAMILIES:
        if arch in family.gguf:
            return family
    raise _unknown(arch, source, [name for family in FAMILIES for name in family.gguf])


def family_of(config: ModelConfig) -> Family:
    """The family that builds `config`'s model."""
    by_layout = {"phi3": "phi3", "gemma3": "gemma3", "gpt_oss": "gpt_oss"}
    name = by_layout.get(config.architecture) or ("mixtral" if config.num_experts else "llama")
    return next(family for family in FAMILIES if family.name == name)


def from_hf_config(cfg: dict[str, Any], source: str) -> ModelConfig:
    """A Hugging Face config.json (transformers 4 or 5 layout) as a ModelConfig, read by
    its family."""
    config: ModelConfig = hf_family(cfg, source).module().from_hf(cfg, source)
    return config


def model_class(config: ModelConfig) -> type[CausalLM]:
    """The model class that runs `config`'s architecture."""
    model: type[CausalLM] = family_of(config).module().MODEL
    return model


def loaded_weights(
    weights: Mapping[str, torch.Tensor], config: ModelConfig
) -> Mapping[str, torch.Tensor]:
    """The files' weights under the names and row orders the model loads."""
    module = family_of(config).module()
    return module.weights(weights, config) if hasattr(module, "weights") else weights


def loaded_names(names: list[str], config: ModelConfig) -> list[str]:
    """The names the model loads for a GGUF's block-quantized `names`."""
    module = family_of(config).module()
    return module.loaded_names(names, config) if hasattr(module, "split_quant") else names


def split_quant(quant: dict[str, QuantWeight], config: ModelConfig) -> dict[str, QuantWeight]:
    """A GGUF's block-quantized weights under the names and row orders the model loads."""
    module = family_of(config).module()
    return module.split_quant(quant, config) if hasattr(module, "split_quant") else quant
