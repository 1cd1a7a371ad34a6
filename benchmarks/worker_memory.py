"""Resident memory of a worker's model: each weights setting in a fresh process.

Each row loads the default model as a worker does (`load_shard`), in a process of its
own, and reads VmRSS before loading (Python, torch and the appliance imported) and after.
The model's share is the difference less the KV pool, set small here (64 MiB): what the
weights cost on top of the runtime, against the GGUF file's size.

    .venv/bin/python benchmarks/worker_memory.py
"""

from __future__ import annotations

import json
import subprocess
import sys

from appliance.model.model_source import default_model_path

CHILD = """
import json, sys
import torch
from appliance.settings.config import load_settings
from appliance.engine.shard_loading import load_shard

def rss():
    for line in open("/proc/self/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024

before = rss()
settings = load_settings(device="cpu", weights=sys.argv[1], kv={"memory_mb": 64})
parts = load_shard(settings)
kv = parts.kv.tensor.numel() * parts.kv.tensor.element_size()
print(json.dumps({"before": before, "after": rss(), "kv": kv, "dtype": str(parts.model.dtype)}))
"""


def main() -> int:
    size = default_model_path().stat().st_size
    print(f"model file: {default_model_path().name}, {size / 2**20:.1f} MiB\n")
    print("| weights | dtype | RSS before load | RSS after | KV pool | model's share | / file |")
    print("|---|---|---:|---:|---:|---:|---:|")
    for weights in ("quantized", "dense"):
        out = subprocess.run(
            [sys.executable, "-c", CHILD, weights], capture_output=True, text=True, check=True
        ).stdout
        r = json.loads(out.strip().splitlines()[-1])
        share = r["after"] - r["before"] - r["kv"]
        mib = [f"{r[k] / 2**20:.0f} MiB" for k in ("before", "after", "kv")]
        print(f"| {weights} | {r['dtype']} | {' | '.join(mib)} | {share / 2**20:.0f} MiB | "
              f"{share / size:.2f}x |")  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
