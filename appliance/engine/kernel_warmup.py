"""A CUDA worker's Triton kernels compiled before it says Ready, not by its first request.

Triton compiles a kernel at its first launch with each specialization (dtypes, constexprs,
which integer arguments are 1 or multiples of 16): seconds each on a cold cache, paid by
whichever request comes first. A worker on CUDA runs, before Ready:
- the model over a warm-up prompt of WARM_PROMPT tokens (the prefill attention kernel,
  the quantized GEMM and embedding lookups where the weights are in blocks), then, where
  it decodes, two decode steps of one sequence: one on the plain decode kernel, one with
  a block table wide enough that the flash-decoding rule splits it (the split kernel and
  its reduce); each step with the LM head's GEMV;
- where it decodes, the handoff's KV block copy (triton_kv_copy) once on its own pool:
  block 0 copied onto itself, so the copy's first real launch, from a prefill pool of
  the same layout, finds it compiled.
The warm-up writes K/V into the first blocks of a pool nothing uses yet (every block is
written before it is read) and changes no other state. A CPU worker runs none of it.
What still compiles on first use: other split counts (the reduce is specialized per
power of two), a speculative verify chunk, a tensor-parallel group's steps (its
followers step with it), a draft model's steps, and the copy from another layout (a
head slice of a wider pool).
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

import torch

from appliance.model.layers.paged_attention import (
    AttentionBatch,
    DecodeGroup,
    PrefillSegment,
    runs_triton,
)
from appliance.model.layers.triton_splits import MAX_SPLITS, MIN_SPLIT_KEYS

if TYPE_CHECKING:
    from appliance.engine.llm_engine import LLMEngine
    from appliance.model.causal_lm import CausalLM

log = logging.getLogger(__name__)

# Prompt rows of the warm-up prefill: past the quantized products' GEMM threshold
# (triton_quant.GEMM_TOKENS, 8), so the GEMM compiles, and one 16-token block.
WARM_PROMPT = 16


def warm_up(engine: LLMEngine, decodes: bool, tensor_parallel: bool) -> list[str]:
    """Run the worker's Triton kernels once (see the module's docstring): `decodes`, the
    worker takes handoffs or decodes (not a prefill worker); `tensor_parallel`, it leads a
    group. Returns the steps run, in order: none on a CPU worker."""
    pool = engine.kv.tensor
    if not runs_triton(pool.device):
        return []
    start = time.monotonic()
    ran: list[str] = []
    if not tensor_parallel:  # a group's followers would wait for their part of the step
        ran += warm_model(engine.model, pool, engine.kv.block_size, decodes)
    if decodes:
        ran += warm_kv_copy(pool)
    if pool.is_cuda:  # compiled and run before Ready
        torch.cuda.synchronize(pool.device)
    log.info("warmed the Triton kernels (%s) in %.1f s", ", ".join(ran), time.monotonic() - start)
    return ran


def warm_model(model: CausalLM, pool: torch.Tensor, block_size: int, decodes: bool) -> list[str]:
    """The model over a warm-up prompt and, if it `decodes`, two decode steps of it
    (plain and split), each with the last row's logits, in the first blocks of `pool`."""
    device = pool.device
    blocks = -(-(WARM_PROMPT + 1) // block_size)  # the prompt and one decoded token
    table = torch.arange(blocks, dtype=torch.int64, device=device)
    # The split rule reads the table's width (keys a sequence may hold), not its context:
    # this width splits a decode of few KV heads MAX_SPLITS ways, its context still short.
    wide = torch.zeros(MAX_SPLITS * MIN_SPLIT_KEYS // block_size, dtype=torch.int64, device=device)
    wide[:blocks] = table
    ran = []
    with torch.inference_mode():
        _step(model, pool, _prefill(table, block_size))
        ran.append(f"prefill {WARM_PROMPT}")
        for name, decode_table in (("decode", table), ("decode split", wide)):
            if decodes:
                _step(model, pool, _decode(decode_table, block_size))
                ran.append(name)
    return ran


def _prefill(table: torch.Tensor, block_size: int) -> tuple[torch.Tensor, AttentionBatch]:
    """A prompt of WARM_PROMPT tokens at positions 0.. in the blocks of `table`."""
    positions = torch.arange(WARM_PROMPT, dtype=torch.int64, device=table.device)  # [tokens]
    segment = PrefillSegment(0, WARM_PROMPT, WARM_PROMPT, table)
    slots = _slots(table, positions, block_size)
    return positions, AttentionBatch(slots, [segment], WARM_PROMPT, [])


def _decode(table: torch.Tensor, block_size: int) -> tuple[torch.Tensor, AttentionBatch]:
    """One decode token after the prompt, `table` [max_blocks] the sequence's blocks."""
    positions = torch.tensor([WARM_PROMPT], dtype=torch.int64, device=table.device)  # [1]
    context = positions + 1  # [1]
    group = DecodeGroup(None, table[None, :], None, context)  # tables [1, max_blocks]
    return positions, AttentionBatch(_slots(table, positions, block_size), [], 0, [group])


def _slots(table: torch.Tensor, positions: torch.Tensor, block_size: int) -> torch.Tensor:
    """Each position's slot in the pool: [tokens] int64."""
    return table[positions // block_size] * block_size + positions % block_size


def _step(model: CausalLM, pool: torch.Tensor, inputs: tuple[torch.Tensor, AttentionBatch]) -> None:
    positions, batch = inputs
    ids = torch.zeros_like(positions)  # [tokens]: token 0; any id serves
    hidden = model(ids, positions, batch, pool)  # [tokens, hidden]
    model.logits(hidden[-1:])


def warm_kv_copy(pool: torch.Tensor) -> list[str]:
    """The handoff's copy into `pool` (block 0 onto itself), where handoff would run it
    as the Triton kernel; returns what ran."""
    from appliance.kv import handoff

    if handoff.copy_kernel(pool, pool) != "triton":
        return []
    handoff.copy_blocks(pool, [0], pool, [0], "triton")
    return ["kv copy"]
