"""Our engine's prefill and decode rates at two commits of this repository, same machine,
same run: a refactor must leave them unchanged within noise.

The rows are benchmarks/llama_cpp_bench.py's own (its `ours_prefill` and `ours_decode`,
as each commit has them): prefill 512, decode b1, decode b16, on the embedded model with
the default CPU settings. Each commit runs in its own process from a git worktree (the
compiled kernels copied in when its C sources are this checkout's), alternating, best of
`--repeats`.

    .venv/bin/python benchmarks/tree_ab.py --before 856fc2e [--after HEAD] [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

from worktrees import ROOT, alternate

# Run inside each worktree: its own `appliance` ahead of the editable install's, then the
# rows of its own llama_cpp_bench.py. Settings moved between commits: both paths tried.
PROBE = """
import json, sys
sys.meta_path = [f for f in sys.meta_path if "__editable__" not in type(f).__module__
                 and "__editable__" not in getattr(f, "__module__", "")]
# The finder's path hook would still add this checkout to namespace packages (a commit's
# `appliance` has no __init__.py): a package the commit lacks would come from here.
sys.path[:] = [p for p in sys.path if "__editable__" not in p]
sys.path_hooks[:] = [h for h in sys.path_hooks if "editable" not in repr(h)]
sys.path_importer_cache.clear()
tree = sys.argv[1]
sys.path[:0] = [tree, tree + "/benchmarks"]
try:
    from appliance.settings.config import load_settings
except ImportError:
    from appliance.config import load_settings
import appliance, llama_cpp_bench as bench
from appliance.engine.llm_engine import LLMEngine
assert all(p.startswith(tree) for p in appliance.__path__), appliance.__path__
kv = {"memory_mb": 1024, "prefix_caching": False}
engine = LLMEngine.from_settings(load_settings(device="cpu", kv=kv))
rows = {
    "prefill 512": bench.ours_prefill(engine, 512),
    "decode b1": bench.ours_decode(engine, 1, 32, 129),
    "decode b16": bench.ours_decode(engine, 16, 128, 129),
}
print(json.dumps(rows))
"""


def rows_of(tree: Path) -> dict[str, float]:
    done = subprocess.run(
        [sys.executable, "-c", PROBE, str(tree)], capture_output=True, text=True, cwd=tree
    )
    if done.returncode != 0:
        raise RuntimeError(f"{tree}: {done.stderr[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--before", required=True)
    parser.add_argument("--after", default="HEAD")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    sources = ["git", "diff", "--quiet", args.before, args.after, "--", "appliance/model/csrc"]
    if subprocess.run(sources, cwd=ROOT).returncode != 0:
        print("the C kernels differ between the two commits: build each tree's own first")
        return 2
    runs = alternate([args.before, args.after], args.repeats, rows_of)
    from appliance.topology.cpu import cpu_model_name

    print(f"CPU: {cpu_model_name()}; best of {args.repeats}, alternating; tok/s\n")
    print(f"| row | {args.before} | {args.after} | after / before |")
    print("|---|---:|---:|---:|")
    for row in runs[args.before][0]:
        a = max(r[row] for r in runs[args.before])
        b = max(r[row] for r in runs[args.after])
        print(f"| {row} | {a:.1f} | {b:.1f} | {b / a:.2f}x |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
