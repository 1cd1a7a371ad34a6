"""The one error a model load raises: it names the file and the problem."""

from __future__ import annotations

from pathlib import Path


class ModelLoadError(RuntimeError):
    """A model could not be loaded; str() is one line for the user."""

    def __init__(self, source: str | Path, problem: str) -> None:
        super().__init__(f"cannot load model {source}: {problem}")
        self.source = str(source)
        self.problem = problem
