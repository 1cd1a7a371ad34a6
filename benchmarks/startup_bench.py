"""Time from starting a Python process to a ready engine, first with an empty weight
cache (dequantize + convert + write the cache) and then with the cache in place.

Run from the repository root: .venv/bin/python benchmarks/startup_bench.py [--dtype D]
Each start is a fresh interpreter, so imports are counted; the cache is a temporary
folder, so the user's own cache is neither used nor touched.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import time

READY = """
from appliance.settings.config import load_settings
from appliance.engine.llm_engine import LLMEngine
LLMEngine.from_settings(load_settings(cache_dir={cache!r}, dtype={dtype!r}))
"""


def start_seconds(cache: str, dtype: str) -> float:
    start = time.perf_counter()
    subprocess.run(
        [sys.executable, "-c", READY.format(cache=cache, dtype=dtype)],
        check=True,
        capture_output=True,
    )
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--warm-starts", type=int, default=3)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as cache:
        rows = [("first start (empty cache)", start_seconds(cache, args.dtype))]
        for i in range(args.warm_starts):
            rows.append((f"start {i + 2} (cache)", start_seconds(cache, args.dtype)))
    print(f"| start (dtype {args.dtype}) | process start to engine ready (s) |")
    print("|---|---:|")
    for name, seconds in rows:
        print(f"| {name} | {seconds:.2f} |")


if __name__ == "__main__":
    main()
