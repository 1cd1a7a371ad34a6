"""Triton kernels under the interpreter, from a test. Triton decides when a kernel module
is first imported whether its kernels are compiled or interpreted (TRITON_INTERPRET), so
a test module runs its cases in one child python — the module itself, as a script — and
reads back the child's last stdout line: a JSON object of results."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import traceback
from collections.abc import Callable, Mapping
from typing import Any

from tests_root import TESTS


def run_jobs(jobs: Mapping[str, Callable[[], object]]) -> dict[str, object]:
    """Each job's result, or its traceback as a string: a case that raises fails its own
    test, not the whole module's."""
    results: dict[str, object] = {}
    for key, job in jobs.items():
        try:
            results[key] = job()
        except Exception:
            results[key] = traceback.format_exc()
    return results


def child_results(script: str, *args: str, timeout: float = 600) -> Any:
    """Run `script` (a test module's `__main__`) under the interpreter, tests/helpers
    importable as in pytest; its last stdout line, parsed."""
    path = os.pathsep.join(p for p in (str(TESTS / "helpers"), os.environ.get("PYTHONPATH")) if p)
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": path}
    proc = subprocess.run(
        [sys.executable, script, *args], env=env, capture_output=True, text=True, timeout=timeout
    )
    assert proc.returncode == 0, f"the interpreter child failed:\n{proc.stderr[-4000:]}"
    return json.loads(proc.stdout.strip().splitlines()[-1])
