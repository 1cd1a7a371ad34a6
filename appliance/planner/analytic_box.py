"""The analytic profile of the GPUs this box has: what `serve` plans with on a GPU box before
any profile of it exists (planner.layout=auto), and what the autopilot starts from and
refines with the steps its workers run.

The detected cards are matched to a datasheet preset (analytic_specs.GPUS) by NVML's name
and memory; the model's shape comes from its own config. Where either cannot be told (a
card without a preset, a MIG slice, cards of several kinds, two workers on one GPU, a
mixture-of-experts model, which the dense roofline does not describe) there is no analytic
profile, and the reason says which.

Pure (no torch): the caller reads the model's config.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from appliance.planner.analytic import GPUS, analytic_profile
from appliance.planner.analytic_specs import ModelShape
from appliance.planner.profile import Profile
from appliance.topology.devices import Device, Topology

GIB = 1024**3
# A card's memory must be this close to its preset's (as a ratio) to take the preset's
# figures: a MIG slice, or a variant with less memory, is not the datasheet's card.
MEMORY_TOLERANCE = (0.9, 1.1)


class ShapeFacts(Protocol):
    """What an analytic profile needs of a model (appliance.model.ModelConfig has it)."""

    @property
    def hidden_size(self) -> int: ...
    @property
    def intermediate_size(self) -> int: ...
    @property
    def num_layers(self) -> int: ...
    @property
    def num_heads(self) -> int: ...
    @property
    def num_kv_heads(self) -> int: ...
    @property
    def head_dim(self) -> int: ...
    @property
    def vocab_size(self) -> int: ...
    @property
    def tie_word_embeddings(self) -> bool: ...
    @property
    def max_position_embeddings(self) -> int: ...
    @property
    def num_experts(self) -> int: ...


def gpu_preset(name: str, total_memory: int) -> str | None:
    """The datasheet preset of a card by NVML's name and its memory in bytes; None where
    no preset is that card (another variant, a MIG slice)."""
    upper = name.upper()
    if "H200" in upper and "NVL" not in upper:
        preset = "h200"
    elif "H100" in upper and ("HBM3" in upper or "SXM" in upper):
        preset = "h100-80gb-sxm"
    elif "A100" in upper and "SXM" in upper:
        preset = "a100-80gb-sxm"
    elif "A100" in upper and "PCIE" in upper:
        preset = "a100-40gb-pcie"
    elif "L40S" in upper:
        preset = "l40s"
    elif "RTX 4090" in upper:
        preset = "rtx-4090"
    else:
        return None
    ratio = total_memory / GIB / GPUS[preset].memory_gb
    return preset if MEMORY_TOLERANCE[0] <= ratio <= MEMORY_TOLERANCE[1] else None


def model_shape(facts: ShapeFacts, name: str) -> ModelShape | None:
    """The dense shape of a model; None for a mixture of experts."""
    if facts.num_experts > 0:
        return None
    return ModelShape(
        name=name,
        hidden=facts.hidden_size,
        layers=facts.num_layers,
        heads=facts.num_heads,
        kv_heads=facts.num_kv_heads,
        ffn=facts.intermediate_size,
        vocab=facts.vocab_size,
        gated_mlp=True,  # every family the registry builds has a gated MLP
        tied_embeddings=facts.tie_word_embeddings,
        max_model_len=facts.max_position_embeddings,
        source=f"{name}: the model's own config",
        head_dim=facts.head_dim,
    )


def box_profile(topology: Topology, facts: ShapeFacts, model: str) -> tuple[Profile | None, str]:
    """The analytic profile of this box's own GPUs serving `model`, and a line saying what
    it is; (None, why not) where there is none."""
    local = [d for d in topology.devices if not d.box]
    if not local or any(d.kind != "cuda" for d in local):
        return None, "not a GPU box"
    why_not = _why_no_preset(local)
    if why_not:
        return None, why_not
    preset = gpu_preset(local[0].name, local[0].total_memory)
    assert preset is not None  # _why_no_preset found one for every card
    shape = model_shape(facts, model)
    if shape is None:
        return None, f"{model} is a mixture of experts: the analytic roofline is for dense models"
    try:
        profile = analytic_profile(preset, len(local), shape)
    except ValueError as exc:  # the model fits no worker of these cards
        return None, str(exc)
    return profile, f"the analytic profile of {len(local)}x {GPUS[preset].name} (datasheet)"


def _why_no_preset(devices: Sequence[Device]) -> str:
    """Why these cards have no one preset; "" where they do."""
    names = sorted({d.name for d in devices})
    if len(names) > 1:
        return f"cards of several kinds ({', '.join(names)}): no analytic profile of a mix"
    if len({d.ordinal for d in devices}) < len(devices):
        return "two workers share a GPU: the analytic profile counts whole cards"
    first = devices[0]
    if gpu_preset(first.name, first.total_memory) is None:
        memory = first.total_memory / GIB
        return f"no datasheet preset for {first.name} ({memory:.0f} GiB)"
    return ""
