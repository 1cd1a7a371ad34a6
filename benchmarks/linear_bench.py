"""Projections on this CPU: `F.linear` against oneDNN's linear over a weight packed once.

Why appliance/model/packed_linear.py packs bfloat16 weights at load: prints, for each
projection shape of SmolLM2-135M and a few row counts, the microseconds of one call
both ways, their ratio, and whether the outputs are bit-identical (float32 is shown too:
packing speeds it up as well, but its sums come out in another order).

Run from the repository root: .venv/bin/python benchmarks/linear_bench.py
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from timing import best_seconds

SHAPES = {  # name: (out, in) of SmolLM2-135M's projections
    "q/k/v": (960, 576),
    "o": (576, 576),
    "gate/up": (3072, 576),
    "down": (576, 1536),
    "LM head": (49152, 576),
}
ROWS = (1, 8, 32, 1024)


def case(out: int, inp: int, rows: int, dtype: torch.dtype) -> tuple[float, float, float]:
    weight = torch.randn(out, inp).to(dtype)
    x = torch.randn(rows, inp).to(dtype)
    packed = torch.ops.mkldnn._reorder_linear_weight(weight, 1)

    def plain() -> torch.Tensor:
        return F.linear(x, weight)

    def onednn() -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")

    diff = (plain().float() - onednn().float()).abs().max().item()
    repeats = 5 if out * rows > 10_000_000 else 30
    return best_seconds(plain, repeats) * 1e6, best_seconds(onednn, repeats) * 1e6, diff


def main() -> None:
    print(f"torch {torch.__version__}, threads {torch.get_num_threads()}")
    print("| projection | rows | dtype | F.linear (us) | packed (us) | speed-up | max diff |")
    print("|---|---:|---|---:|---:|---:|---:|")
    for dtype in (torch.bfloat16, torch.float32):
        for name, (out, inp) in SHAPES.items():
            for rows in ROWS:
                plain, packed, diff = case(out, inp, rows, dtype)
                dt = str(dtype).removeprefix("torch.")
                print(
                    f"| {name} | {rows} | {dt} | {plain:.0f} | {packed:.0f} "
                    f"| {plain / packed:.2f}x | {diff:.1e} |"
                )


if __name__ == "__main__":
    main()
