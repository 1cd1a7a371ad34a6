"""On the CPU, projections run oneDNN's linear over weights packed once at load.

`F.linear` hands oneDNN a plain [out, in] weight and oneDNN reorders it into its blocked
layout on every call. Packing once with `torch.ops.mkldnn._reorder_linear_weight` (what
torch.compile's CPU freezing does) leaves each call the matmul alone: 1.2-2.2x faster
for bfloat16 at 1 to 32 rows, and bit-identical to `F.linear`
(benchmarks/linear_bench.py). Only bfloat16 is packed: packed float32 is faster too but
sums in another order, and float32 is the dtype that must match transformers' outputs.
A GPU keeps `F.linear` (cuBLAS).
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING

import torch
from torch import nn

if TYPE_CHECKING:
    from appliance.model.causal_lm import CausalLM


def packs_linears(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether this device and dtype have oneDNN's packed bfloat16 linear."""
    return device.type == "cpu" and dtype == torch.bfloat16 and _cpu_packs_bf16()


@functools.cache  # a fact of the CPU: asked once
def _cpu_packs_bf16() -> bool:
    """oneDNN packs bfloat16 weights only with AVX512BW/VL/DQ or AVX-NE-CONVERT: some
    torch builds report bf16 support on AVX2 CPUs and then refuse to pack, so try it."""
    if not (torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()):
        return False
    try:
        torch.ops.mkldnn._reorder_linear_weight(torch.zeros(16, 16, dtype=torch.bfloat16), 1)
    except RuntimeError:
        return False
    return True


class PackedLinear(nn.Module):
    """`F.linear(x, weight, bias)` with the weight in oneDNN's layout."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__()
        if not packs_linears(weight.device, weight.dtype):
            raise ValueError(
                "oneDNN cannot pack this weight: packed linears are bfloat16 on a CPU with "
                "AVX512BW/VL/DQ or AVX-NE-CONVERT"
            )
        self.out_features, self.in_features = weight.shape
        # The batch-size hint only tunes the layout; any number of rows runs on it.
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight, 1)
        self.bias = bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """[rows, in] -> [rows, out]."""
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")


def pack_linears(model: CausalLM, head: bool = True) -> int:
    """Swap every nn.Linear in `model` (a CausalLM) for a PackedLinear of its weight and,
    with `head`, give a tied LM head its own packed copy of the embedding (one more copy
    of the embedding's memory; tensor-parallel followers compute no logits and skip it);
    returns how many. Raises ValueError where this CPU cannot pack (packs_linears)."""
    if not packs_linears(model.device, model.dtype):
        raise ValueError(f"oneDNN packs no {model.dtype} weights on this {model.device.type}")
    swaps = [
        (owner, name, child)
        for owner in model.modules()
        for name, child in owner.named_children()
        if isinstance(child, nn.Linear)
    ]
    count = len(swaps)
    while swaps:  # each plain weight freed once its packed copy exists: one at a time
        owner, name, child = swaps.pop()
        setattr(owner, name, PackedLinear(child.weight, child.bias))
        del child
    if head and model.lm_head is None:  # tied: the lookup keeps the plain embedding
        model.lm_head = PackedLinear(model.embedding_weight(), None)
        return count + 1
    return count
