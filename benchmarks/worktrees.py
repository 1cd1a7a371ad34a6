"""Two commits of this repository measured in one run: each checked out in a git worktree
(this checkout's compiled kernels copied in, so only the Python differs unless a script
builds its own), measured in turn, alternating, so the machine's drift falls on both."""

from __future__ import annotations

import shutil
import subprocess
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

ROOT = Path(__file__).resolve().parent.parent
T = TypeVar("T")


def worktree(rev: str, folder: Path) -> Path:
    """A checkout of `rev` under `folder`, with this checkout's compiled kernels."""
    path = folder / rev.replace("/", "_")
    subprocess.run(["git", "worktree", "add", "--detach", str(path), rev], cwd=ROOT, check=True)
    for built in (ROOT / "appliance" / "model").glob("_cpu_kernels_*.so"):
        shutil.copy2(built, path / "appliance" / "model" / built.name)
    return path


def alternate(revs: list[str], rounds: int, measure: Callable[[Path], T]) -> dict[str, list[T]]:
    """`measure(tree)` of each commit's worktree, `rounds` times, the commits in turn;
    the worktrees are removed after, whatever happens."""
    results: dict[str, list[T]] = {rev: [] for rev in revs}
    with tempfile.TemporaryDirectory() as folder:
        trees = {rev: worktree(rev, Path(folder)) for rev in revs}
        try:
            for _ in range(rounds):
                for rev, tree in trees.items():
                    results[rev].append(measure(tree))
        finally:
            for tree in trees.values():
                subprocess.run(["git", "worktree", "remove", "--force", str(tree)], cwd=ROOT)
    return results
