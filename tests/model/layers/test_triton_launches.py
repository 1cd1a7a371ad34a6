"""Kernel launches per step of the Triton attention path (triton_attention.attend), counted
under Triton's interpreter: every Triton kernel launch, and every torch op that would
launch a kernel on a GPU (views and allocations launch none), recorded by wrapping the
module's kernels and by a TorchDispatchMode around the call.

Before (the tree at 8acc2db, the same counter on the attend of that tree):
- prefill of 64 short prompts: 128 launches a layer, every layer (one Triton launch and
  one torch.full a prompt segment), so 3,840 a step of a 30-layer model (SmolLM2-135M)
  and ~4k of a 32-layer 8B;
- decode of 8 sequences: 1 launch a layer; batch 1 at 8k keys: 1 launch of 1 program a
  KV head, walking all 8,192 keys alone;
- a verify step of 4 sequences x 5 tokens: 8 launches a layer (4 launches, 4 fills).
After (asserted below): the prompts' one varlen launch a layer, plus a few torch ops on
the step's first layer only (the tables packed on the device; the metadata's one
host-to-device copy is a no-op on the CPU, so it is not counted here); decode of 8
sequences 1 launch a layer; batch 1 at 8k keys 2 (its keys split into 16 parts, then
the reduce); a verify step of 4 sequences 1 launch a layer (after the first's packing).

A child process runs the interpreter (TRITON_INTERPRET must be set before triton is
imported, see test_triton_attention.py) and reports the counts as JSON.
"""

from __future__ import annotations

import json
import os
import sys
from collections import Counter
from collections.abc import Callable
from types import ModuleType
from typing import Any

import pytest
import torch
from interpreter_child import child_results
from torch.utils._python_dispatch import TorchDispatchMode

# Each test runs the Triton interpreter in a child process: the slow lane's kind of test.
pytestmark = pytest.mark.process

# Ops that make or reshape a tensor's header or memory without running a kernel.
NO_LAUNCH = {"empty", "empty_like", "empty_strided", "lift_fresh", "detach", "alias"}
HEADS, KV_HEADS, HEAD_DIM, BLOCK_SIZE = 2, 1, 16, 16


class LaunchCounter(TorchDispatchMode):
    """Counts torch ops that launch a kernel, and the Triton launches of the kernels put
    in its place by count_kernels (the interpreter's own torch ops inside them aside)."""

    def __init__(self) -> None:
        super().__init__()
        self.launches: Counter[str] = Counter()
        self._inside_kernel = False

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        name = func.overloadpacket.__name__
        if not self._inside_kernel and not func.is_view and name not in NO_LAUNCH:
            self.launches[f"torch.{name}"] += 1
        return func(*args, **(kwargs or {}))

    def wrap(self, name: str, kernel: Any) -> Any:
        """`kernel` (a JITFunction) counting each launch as `name`."""
        counter = self

        class Counted:
            def __getitem__(self, grid: Any) -> Callable[..., Any]:
                def launch(*args: Any, **kwargs: Any) -> Any:
                    counter.launches[name] += 1
                    counter._inside_kernel = True
                    try:
                        return kernel[grid](*args, **kwargs)
                    finally:
                        counter._inside_kernel = False

                return launch

        return Counted()


def count_kernels(module: ModuleType, counter: LaunchCounter) -> None:
    """Put counting wrappers in place of the module's Triton kernels."""
    for name in ("_paged_attention_kernel", "_split_reduce_kernel"):
        if hasattr(module, name):
            setattr(module, name, counter.wrap(f"triton.{name}", getattr(module, name)))


def _pool(contexts: list[int]) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor]]:
    """Random caches and each sequence's block table (distinct blocks, in order)."""
    widths = [-(-n // BLOCK_SIZE) for n in contexts]
    shape = (1 + sum(widths), BLOCK_SIZE, KV_HEADS, HEAD_DIM)
    k_cache, v_cache = torch.randn(shape), torch.randn(shape)
    tables, first = [], 1
    for width in widths:
        tables.append(torch.arange(first, first + width))
        first += width
    return k_cache, v_cache, tables


def _prefill_batch(runs: list[tuple[int, int]], prompt_rows: int | None) -> tuple[Any, ...]:
    """A step of prefill segments (cached, new tokens): q, caches and the batch."""
    from appliance.model.layers.paged_attention import AttentionBatch, PrefillSegment

    contexts = [cached + new for cached, new in runs]
    k_cache, v_cache, tables = _pool(contexts)
    segments, row = [], 0
    for (_, new), context, table in zip(runs, contexts, tables, strict=True):
        segments.append(PrefillSegment(row, new, context, table))
        row += new
    batch = AttentionBatch(torch.zeros(row, dtype=torch.int64), segments, row, [], prompt_rows)
    return torch.randn(row, HEADS, HEAD_DIM), k_cache, v_cache, batch


def _decode_batch(contexts: list[int]) -> tuple[Any, ...]:
    """A decode-only step, one group in row order (the Triton path's ragged decode)."""
    from appliance.model.layers.paged_attention import AttentionBatch, DecodeGroup

    k_cache, v_cache, tables = _pool(contexts)
    width = max(len(t) for t in tables)
    padded = torch.stack([torch.nn.functional.pad(t, (0, width - len(t))) for t in tables])
    lens = torch.tensor(contexts)
    visible = torch.ones(len(contexts), 1, 1, width * BLOCK_SIZE, dtype=torch.bool)
    group = DecodeGroup(None, padded, visible, lens)
    batch = AttentionBatch(torch.zeros(len(contexts), dtype=torch.int64), [], 0, [group])
    return torch.randn(len(contexts), HEADS, HEAD_DIM), k_cache, v_cache, batch


def steps() -> dict[str, tuple[Any, ...]]:
    """The steps counted: 64 short prompts (2 to 9 tokens, every fourth after a cached
    prefix), a decode of 8, a decode of 1 at 8k keys, a verify step of 4 x 5 tokens."""
    prompts = [(16 * (i % 4 == 0), 2 + i % 8) for i in range(64)]
    return {
        "prefill_64_prompts": _prefill_batch(prompts, None),
        "decode_8": _decode_batch([5 + 37 * i for i in range(8)]),
        "decode_1_at_8k": _decode_batch([8192]),
        "verify_4x5": _prefill_batch([(40 + i, 5) for i in range(4)], prompt_rows=0),
    }


def count_layers(module: ModuleType, layers: int = 2) -> dict[str, list[dict[str, int]]]:
    """Each step's launches on each of `layers` layers (the same batch, as the model's
    layers share it), by kernel or torch op."""
    torch.manual_seed(0)
    counter = LaunchCounter()
    count_kernels(module, counter)
    found: dict[str, list[dict[str, int]]] = {}
    for name, (q, k_cache, v_cache, batch) in steps().items():
        per_layer = []
        for _ in range(layers):
            counter.launches.clear()
            with counter:
                out = module.attend(q, k_cache, v_cache, batch, HEAD_DIM**-0.5)
            if out.isnan().any():
                raise AssertionError(f"{name}: NaN in the output")
            per_layer.append(dict(counter.launches))
        found[name] = per_layer
    return found


@pytest.fixture(scope="module")
def launches() -> dict[str, list[dict[str, int]]]:
    return child_results(__file__)


def test_prefill_of_64_prompts_is_one_launch_a_layer(launches: dict) -> None:
    first, second = launches["prefill_64_prompts"]
    # The step's first layer packs the tables (cat, zeros, index_copy) and launches once.
    assert first.pop("triton._paged_attention_kernel") == 1
    assert sum(first.values()) <= 4, first
    # Every later layer: the one varlen launch, nothing else (was 64 + 64 fills).
    assert second == {"triton._paged_attention_kernel": 1}


def test_decode_of_a_batch_is_one_launch_a_layer(launches: dict) -> None:
    for layer in launches["decode_8"]:
        assert layer == {"triton._paged_attention_kernel": 1}


def test_batch_one_at_8k_keys_splits_and_reduces(launches: dict) -> None:
    for layer in launches["decode_1_at_8k"]:
        assert layer == {"triton._paged_attention_kernel": 1, "triton._split_reduce_kernel": 1}


def test_a_verify_step_is_one_launch_a_layer(launches: dict) -> None:
    assert launches["verify_4x5"][1] == {"triton._paged_attention_kernel": 1}


if __name__ == "__main__":
    # The child: TRITON_INTERPRET must be in the environment before triton is imported.
    os.environ.setdefault("TRITON_INTERPRET", "1")
    if len(sys.argv) > 1:  # another tree's triton_attention.py (to count "before")
        import importlib.util

        spec = importlib.util.spec_from_file_location("counted_attention", sys.argv[1])
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module  # its dataclasses look their module up
        spec.loader.exec_module(module)
    else:
        from appliance.model.layers import triton_attention as module
    print(json.dumps(count_layers(module)))
