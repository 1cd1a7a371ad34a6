"""The lanes (docs/development.md#tests): `pytest -q` leaves the `extended` cases out, `-m
extended` runs only them, and a test named by its id runs whatever its mark."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest
from tests_root import ROOT

pytestmark = pytest.mark.process  # a pytest of its own collects the file

FILE = "tests/engine/test_speculative_engine.py"
NGRAM = "test_greedy_with_ngram_drafts_equals_plain_decoding"


def collected(*args: str) -> list[str]:
    """The ids of the n-gram matrix's cases a pytest run with `args` would run."""
    out = subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    ).stdout
    return re.findall(rf"{NGRAM}\[(\d+)\]", out)


def test_the_suite_runs_the_representative_rows_and_the_extended_lane_the_rest() -> None:
    assert collected(FILE) == ["1", "4", "8"]
    assert collected(FILE, "-m", "extended") == ["2", "3", "5", "6", "7"]
    assert collected(f"{FILE}::{NGRAM}[5]") == ["5"]
