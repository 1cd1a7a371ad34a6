"""gpt-oss's weights under the names and layouts the decoder (model/gpt_oss.py) loads.

The decoder loads, per layer, the router as `mlp.gate.{weight,bias}` and each expert as
`mlp.experts.E.{gate,up,down}_proj.{weight,bias}` in nn.Linear's [out, in] layout. The
files hold them otherwise:

- a Hugging Face folder (transformers' GptOssForCausalLM): `mlp.router.*`, and every
  expert stacked, transposed and gate/up interleaved: `experts.gate_up_proj` [experts,
  hidden, 2 * columns] whose even columns are the gate's and odd ones the up's,
  `experts.gate_up_proj_bias` [experts, 2 * columns] alike, `experts.down_proj`
  [experts, columns, hidden], `experts.down_proj_bias` [experts, hidden];
- a llama.cpp GGUF (gguf_names gives its names): `mlp.gate.*`, and each projection's
  experts stacked apart, de-interleaved and [experts, out, in] already
  (`mlp.experts.{gate,up,down}_proj.{weight,bias}`, ffn_*_exps).

A stacked source is read once for all its experts (a folder's: views of the mapped
file), or from a GGUF an expert's rows at a time. A folder's MXFP4 experts
(`*_blocks`, `*_scales`) are refused: they are not dequantized here.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Mapping

import torch

from appliance.model.errors import ModelLoadError
from appliance.model.formats.weight_parts import WeightParts
from appliance.model.model_config import ModelConfig

_EXPERTS = r"model\.layers\.(\d+)\.mlp\.experts\."
# A folder's stacked tensors -> (the projection, its kind, which of the interleaved
# columns it takes: 0 the gate's, 1 the up's; None all), transposed where a weight.
_FOLDER = {
    "gate_up_proj": (("gate_proj", "weight", 0), ("up_proj", "weight", 1)),
    "gate_up_proj_bias": (("gate_proj", "bias", 0), ("up_proj", "bias", 1)),
    "down_proj": (("down_proj", "weight", None),),
    "down_proj_bias": (("down_proj", "bias", None),),
}

# name in the files, expert, interleaved columns (0, 1 or None), transposed
Source = tuple[str, int | None, int | None, bool]


def _sources(names: Iterable[str], config: ModelConfig, where: str) -> dict[str, Source]:
    """Each name the decoder loads -> where it lies in the files."""
    out: dict[str, Source] = {}
    for name in names:
        folder = re.fullmatch(_EXPERTS + r"(\w+?)", name)
        stacked = re.fullmatch(_EXPERTS + r"(gate|up|down)_proj\.(weight|bias)", name)
        if name.endswith(("_blocks", "_scales")):
            raise ModelLoadError(
                where,
                f"{name} is an MXFP4-quantized expert tensor, which is not read from a "
                "folder: serve a GGUF of the model, or a folder saved dequantized",
            )
        if stacked:
            layer, part, kind = stacked.groups()
            for expert in range(config.num_experts):
                out[_name(layer, expert, f"{part}_proj", kind)] = (name, expert, None, False)
        elif folder and folder.group(2) in _FOLDER:
            layer, fused = folder.groups()
            for expert in range(config.num_experts):
                for part, kind, half in _FOLDER[fused]:
                    transposed = kind == "weight"
                    out[_name(layer, expert, part, kind)] = (name, expert, half, transposed)
        else:
            out[name.replace(".mlp.router.", ".mlp.gate.")] = (name, None, None, False)
    return out


def _name(layer: str, expert: int, part: str, kind: str) -> str:
    return f"model.layers.{layer}.mlp.experts.{expert}.{part}.{kind}"


class GptOssWeights(WeightParts):
    """A gpt-oss model's weights (a folder's or a GGUF's, read on demand) under the names
    and layouts the decoder loads: one expert's part of a stacked tensor at a time."""

    def __init__(self, weights: Mapping[str, torch.Tensor], config: ModelConfig) -> None:
        where = str(getattr(weights, "path", "gpt-oss weights"))
        super().__init__(weights, _sources(weights, config, where))

    def __getitem__(self, name: str) -> torch.Tensor:
        source, expert, half, transposed = self._parts[name]
        if expert is None:
            return self._weights[source]
        tensor = self._expert(source, expert)  # [in, 2 * columns] or [out, in], or 1-D
        if half is not None:
            tensor = tensor[..., half::2]  # the gate's columns (even) or the up's (odd)
        return tensor.transpose(0, 1) if transposed else tensor

    def _expert(self, source: str, expert: int) -> torch.Tensor:
        """One expert's slice of a stacked tensor: from a GGUF its rows alone are read."""
        read_rows = getattr(self._weights, "rows", None)
        if read_rows is None:
            return self.held(source)[expert]
        shape = self._weights.shape(source)  # type: ignore[attr-defined]
        per = math.prod(shape[1:-1])  # rows of one expert in the [rows, last] layout
        return read_rows(source, expert * per, (expert + 1) * per).view(shape[1:])


def loaded_names(names: Iterable[str], config: ModelConfig) -> list[str]:
    """The names the decoder loads, for a gpt-oss model's `names`."""
    return list(_sources(names, config, "gpt-oss weights"))
