"""Weights under the names the decoder loads, each a part of a tensor the files hold
(Phi-3's fused projections, a mixture of experts' stacked experts): the base that keeps
the source last read until its last part is copied, so it is read (a GGUF's
dequantized) once, not once per part."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

import torch


class WeightParts(Mapping[str, torch.Tensor]):
    """`weights` renamed by `parts`: a loaded name -> (its source's name, how to cut it);
    a subclass's __getitem__ cuts the part, reading its source through held()."""

    def __init__(
        self, weights: Mapping[str, torch.Tensor], parts: Mapping[str, tuple[Any, ...]]
    ) -> None:
        self._weights = weights
        self._parts = parts
        last = {part[0]: name for name, part in parts.items()}  # later parts win
        self._last_parts = set(last.values())
        self._held: tuple[str, torch.Tensor] | None = None

    def held(self, source: str) -> torch.Tensor:
        """The source tensor, read once for all its parts."""
        if self._held is None or self._held[0] != source:
            self._held = (source, self._weights[source])
        return self._held[1]

    def __iter__(self) -> Iterator[str]:
        return iter(self._parts)

    def __len__(self) -> int:
        return len(self._parts)

    def release(self, name: str) -> None:
        """The decoder copied `name`: its source goes once its last part is copied."""
        if name not in self._last_parts:
            return
        source = self._parts[name][0]
        if self._held is not None and self._held[0] == source:
            self._held = None
        release = getattr(self._weights, "release", None)
        if release is not None:
            release(source)
