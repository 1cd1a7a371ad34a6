"""The sampling settings a model's makers recommend, for the request fields a client leaves
out: a Hugging Face folder's generation_config.json (Qwen3: temperature 0.6, top_p 0.95,
top_k 20), a GGUF's general.sampling.* keys (converted into its cache entry as the same
file, gguf_cache.py). vLLM applies them so (--generation-config auto), as llama.cpp's
server applies a GGUF's; a request that names a field keeps its own value.

Pure: plain dicts in and out, no torch (the serve process reads these)."""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

log = logging.getLogger("appliance.model")

# generation_config.json's names (transformers', vLLM's --override-generation-config) and
# the range each takes, as the API's own fields check them (server/protocol.py).
RANGES: dict[str, tuple[float, float]] = {
    "temperature": (0.0, 2.0),
    "top_p": (0.0, 1.0),  # above 0
    "top_k": (-1, 2**62),
    "min_p": (0.0, 1.0),
    "repetition_penalty": (0.0, 2.0),  # above 0
    "max_new_tokens": (1, 2**62),
}
ABOVE_ZERO = frozenset({"top_p", "repetition_penalty"})
INTEGERS = frozenset({"top_k", "max_new_tokens"})
# A GGUF's keys, as llama.cpp's converter writes them from generation_config.json.
GGUF_KEYS = {
    "general.sampling.temp": "temperature",
    "general.sampling.top_p": "top_p",
    "general.sampling.top_k": "top_k",
    "general.sampling.min_p": "min_p",
    "general.sampling.penalty_repeat": "repetition_penalty",
}
# How a setting names them: the model's own, the API's alone, or a folder's (vLLM's).
MODEL_OWN, API_OWN = "auto", "vllm"


def checked(name: str, value: Any) -> float | int:
    """One default, as its range allows; ValueError naming it otherwise."""
    if name not in RANGES:
        raise ValueError(f"{name!r} is not a sampling default; known: {', '.join(RANGES)}")
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise ValueError(f"{name} must be a number, got {value!r}")
    low, high = RANGES[name]
    if not low <= value <= high or (name in ABOVE_ZERO and value <= 0):
        raise ValueError(f"{name} must be in [{low}, {high}], got {value}")
    if name in INTEGERS:
        if value != int(value):
            raise ValueError(f"{name} must be a whole number, got {value}")
        return int(value)
    return float(value)


@dataclass(frozen=True)
class SamplingDefaults:
    """The defaults in force (by generation_config.json's names) and where they came from."""

    values: Mapping[str, float | int] = field(default_factory=dict)
    source: str = "the API's own defaults"

    @classmethod
    def from_generation_config(cls, config: Mapping[str, Any], source: str) -> SamplingDefaults:
        """The known fields of a generation_config.json; one out of range (or of a kind
        no request could send) is left out with a warning, not a failed start."""
        values = {}
        for name in RANGES:
            if config.get(name) is None:
                continue
            try:
                values[name] = checked(name, config[name])
            except ValueError as exc:
                log.warning("%s: not applied as a default: %s", source, exc)
        return cls(values, source) if values else cls()

    def overridden(self, overrides: Mapping[str, Any]) -> SamplingDefaults:
        """These with `overrides` (the override_generation_config setting) on top."""
        if not overrides:
            return self
        values = dict(self.values) | {name: checked(name, v) for name, v in overrides.items()}
        source = "override_generation_config" + (f" over {self.source}" if self.values else "")
        return SamplingDefaults(values, source)

    @property
    def max_tokens(self) -> int | None:
        """The output budget of a request that gives none (still within the context)."""
        value = self.values.get("max_new_tokens")
        return None if value is None else int(value)

    def fill(self, body: dict[str, Any], fields: Mapping[str, tuple[str, ...]]) -> dict[str, Any]:
        """`body` with a default in each field it leaves out (absent or null). `fields`
        maps a default's name to the body fields that give it (the first is written):
        {"repetition_penalty": ("repetition_penalty", "repeat_penalty")}."""
        filled = dict(body)
        for name, value in self.values.items():
            names = fields.get(name, ())
            if names and all(body.get(n) is None for n in names):
                filled[names[0]] = value
        return filled

    def describe(self) -> str:
        """'temperature 0.6, top_p 0.95' (empty without any)."""
        return ", ".join(f"{name} {shown(value)}" for name, value in self.values.items())


def shown(value: float | int) -> str:
    """A default as a person reads it: 0.6, 20, 1234567 (not 1.23457e+06)."""
    return str(value) if isinstance(value, int) else f"{value:g}"


def read_sampling_defaults(
    setting: str, model_dir: Path, overrides: Mapping[str, Any]
) -> SamplingDefaults:
    """The defaults the generation_config setting names: "auto" the model's own (its
    folder's or cache entry's generation_config.json), "vllm" none, else a folder (or
    the file itself) holding a generation_config.json; override_generation_config on top."""
    if setting == API_OWN:
        defaults = SamplingDefaults()
    else:
        path = model_dir if setting == MODEL_OWN else Path(setting)
        if path.is_dir():
            path = path / "generation_config.json"
        defaults = _read_file(path, required=setting != MODEL_OWN)
    return defaults.overridden(overrides)


def _read_file(path: Path, required: bool) -> SamplingDefaults:
    """The file's defaults; one the setting named must be readable (ValueError), the
    model's own may not be (a warning: it serves with the API's defaults, as vLLM)."""
    if not path.is_file():
        if required:
            raise ValueError(f"generation_config: no such file: {path}")
        return SamplingDefaults()
    try:
        config = json.loads(path.read_text())
        if not isinstance(config, dict):
            raise ValueError("it does not hold a JSON object")
    except (OSError, ValueError) as exc:  # JSONDecodeError is a ValueError
        problem = f"generation_config: {path} is not usable ({exc})"
        if required:
            raise ValueError(problem) from None
        log.warning("%s: the API's own sampling defaults apply", problem)
        return SamplingDefaults()
    return SamplingDefaults.from_generation_config(config, str(path))


def gguf_generation_config(metadata: Mapping[str, Any]) -> dict[str, float | int]:
    """A GGUF's general.sampling.* keys under generation_config.json's names (float32s
    to the digits they hold: 0.6, not 0.6000000238)."""
    return {
        name: float(f"{value:.7g}") if isinstance(value, float) else value
        for key, name in GGUF_KEYS.items()
        if (value := metadata.get(key)) is not None
    }
