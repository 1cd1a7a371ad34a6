"""The Triton paged-attention kernel (appliance/model/triton_attention.py) against a dense
float64 reference, on the CPU under Triton's interpreter.

Why a child process: triton decides at @triton.jit time, when the kernel module is first
imported, whether a kernel is compiled or interpreted, from TRITON_INTERPRET. Setting the
variable at the top of this file would work only if nothing in the pytest process had
imported the kernel module before (test order, a future test of gpu_check's dry run), and
it would leak into every later test and the workers they spawn. So one child Python with
TRITON_INTERPRET=1 runs every case once (a module fixture: one torch + triton start-up)
and reports each case's error as JSON; each case is its own test here. triton is a dev
dependency: without it the child fails and every test here errors, none is skipped.

The caches start as NaN and only the slots inside each context are written, so a kernel
that read a slot past a context (a partly filled last block, the zero padding of a block
table) would return NaN. Block ids are shuffled: tables are non-contiguous, out of order.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

import pytest
import torch
from interpreter_child import child_results, run_jobs

# Each test runs the Triton interpreter in a child process: the slow lane's kind of test.
pytestmark = pytest.mark.process


@dataclass(frozen=True)
class Case:
    """One launch of the kernel on random data."""

    name: str
    dtype: str
    heads: int
    kv_heads: int
    head_dim: int
    block_size: int
    runs: tuple[tuple[int, int], ...]  # per sequence: (cached tokens, query tokens now)
    varlen: bool  # query runs from query_starts; else one length for all (decode, a chunk)
    tolerance: float  # max |kernel - reference| / (1 + |reference|), elementwise
    sinks: bool = False  # a random sink logit per query head (gpt-oss)
    window: int | None = None  # each query sees its last `window` keys only
    splits: int | None = None  # parts of the context (flash-decoding); None: the rule's


# Decode: one query per sequence, contexts from 1 token to three key tiles, block edges on
# both sides of a block boundary.
DECODES = ((0, 1), (15, 1), (16, 1), (74, 1), (139, 1))
# Chunked prefill, several sequences in one launch: no prefix, a prefix hit ending
# mid-block, a block-aligned prefix, a chunk of several query tiles, and a decode.
CHUNKS = ((0, 33), (37, 20), (64, 5), (3, 90), (130, 1))
# Decodes whose contexts span several parts when split: odd lengths, the longest 299.
LONG_DECODES = ((0, 1), (16, 1), (74, 1), (298, 1))
# Verify chunks of 5 tokens (4 drafts and the real token) after contexts of odd lengths.
VERIFIES = ((40, 5), (222, 5), (0, 5))
# Tolerances, on the error over 1 + |reference|: float32 runs ieee dots and a float32
# softmax (errors seen ~1e-7). 16-bit inputs round the probabilities to the input dtype
# before the second product and the output at the end, as on the GPU: at most half an ulp
# (2**-9 relative in bfloat16, 2**-12 in float16) of the output plus as much of the largest
# |V| (randn: < 5 here), so < 0.01 in bfloat16 and < 0.0013 in float16.
CASES = (
    # GQA with 3 query heads per KV head (the default model's ratio), blocks of 16.
    Case("decode_gqa_fp32", "float32", 6, 2, 64, 16, DECODES, False, 1e-5),
    Case("decode_gqa_bf16", "bfloat16", 6, 2, 64, 16, DECODES, False, 1e-2),
    # Multi-head (group 1), a head size that is no power of two, blocks of 8.
    Case("decode_mha_odd_head_fp16", "float16", 4, 4, 48, 8, ((2, 1), (29, 1)), False, 1.3e-3),
    Case("prefill_varlen_fp32", "float32", 6, 2, 64, 16, CHUNKS, True, 1e-5),
    Case("prefill_varlen_bf16", "bfloat16", 6, 2, 64, 16, CHUNKS, True, 1e-2),
    # One chunk after a cached prefix ending mid-block, as attention.py launches a prefill
    # segment: GQA 4, blocks of 32.
    Case("chunk_prefix_hit_fp32", "float32", 8, 2, 64, 32, ((45, 40),), False, 1e-5),
    Case("chunk_prefix_hit_bf16", "bfloat16", 8, 2, 64, 32, ((45, 40),), False, 1e-2),
    # gpt-oss: sink logits per head, alone and with a window (its sliding layers).
    Case("decode_sinks_fp32", "float32", 6, 2, 64, 16, DECODES, False, 1e-5, sinks=True),
    Case("prefill_sinks_fp32", "float32", 6, 2, 64, 16, CHUNKS, True, 1e-5, sinks=True),
    Case("prefill_sinks_window_fp32", "float32", 8, 2, 64, 16, CHUNKS, True, 1e-5, True, 12),
    Case("decode_sinks_window_bf16", "bfloat16", 6, 2, 64, 16, DECODES, False, 1e-2, True, 9),
    # Split over the context (a partial softmax per part, then the reduce): 2 to 8 parts
    # of contexts of odd lengths up to 299 keys, so the longest has parts of 64 keys and
    # the shorter ones empty parts (they walk nothing); the cases above run unsplit.
    Case("decode_split2_gqa_bf16", "bfloat16", 6, 2, 64, 16, LONG_DECODES, False, 1e-2, splits=2),
    Case(
        "decode_split3_mha_odd_head_fp16",
        "float16",
        4,
        4,
        48,
        8,
        LONG_DECODES,
        False,
        1.3e-3,
        splits=3,
    ),
    Case("decode_split5_gqa8_fp32", "float32", 16, 2, 64, 16, LONG_DECODES, False, 1e-5, splits=5),
    Case(
        "decode_split8_sinks_window_fp32",
        "float32",
        6,
        2,
        64,
        16,
        LONG_DECODES,
        False,
        1e-5,
        True,
        100,
        splits=8,
    ),
    Case(
        "decode_split4_sinks_window_bf16",
        "bfloat16",
        6,
        2,
        64,
        16,
        LONG_DECODES,
        False,
        1e-2,
        True,
        70,
        splits=4,
    ),
    # Speculative verify chunks: a few query tokens a sequence, causal among themselves,
    # on the decode tiles (5 tokens x GQA 3 = 15 rows of 16), split or not; one length
    # for all, or varlen (drafts of different lengths).
    Case("verify_uniform_bf16", "bfloat16", 6, 2, 64, 16, VERIFIES, False, 1e-2),
    Case("verify_uniform_split4_fp16", "float16", 6, 2, 64, 16, VERIFIES, False, 1.3e-3, splits=4),
    Case(
        "verify_varlen_split3_sinks_window_fp32",
        "float32",
        6,
        2,
        64,
        16,
        ((250, 3), (16, 5), (0, 2), (131, 4)),
        True,
        1e-5,
        True,
        40,
        splits=3,
    ),
)
ATTEND_TOLERANCE = 1e-5  # attend() against the CPU path (SDPA, the C kernel), float32


def _pool(
    runs: list[int], block_size: int, kv_heads: int, head_dim: int, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """NaN caches [num_blocks, block_size, kv_heads, head_dim] with random K/V in the first
    `runs[i]` slots of sequence i's blocks, and the tables [seqs, max_blocks] (int64, each
    padded with block 0, never written: NaN)."""
    widths = [-(-n // block_size) for n in runs]
    num_blocks = 1 + sum(widths) + 5  # block 0 and a few that no table holds
    ids = (torch.randperm(num_blocks - 1) + 1).tolist()  # shuffled: any ids, any order
    shape = (num_blocks, block_size, kv_heads, head_dim)
    k_cache = torch.full(shape, float("nan"), dtype=dtype)
    v_cache = torch.full(shape, float("nan"), dtype=dtype)
    tables = torch.zeros(len(runs), max(widths), dtype=torch.int64)
    for i, (n, width) in enumerate(zip(runs, widths, strict=True)):
        tables[i, :width] = torch.tensor(ids[:width])
        ids = ids[width:]
        for pos in range(n):
            block, offset = tables[i, pos // block_size], pos % block_size
            k_cache[block, offset] = torch.randn(kv_heads, head_dim).to(dtype)
            v_cache[block, offset] = torch.randn(kv_heads, head_dim).to(dtype)
    return k_cache, v_cache, tables


def _reference(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    tables: torch.Tensor,
    runs: list[tuple[int, int, int]],
    scale: float,
    sinks: torch.Tensor | None = None,
    window: int | None = None,
) -> torch.Tensor:
    """Dense float64 attention: runs are (first row, query tokens, context tokens); a sink
    logit per head joins each softmax as a key without value; a window hides older keys."""
    block_size, group = k_cache.shape[1], q.shape[1] // k_cache.shape[2]
    out = torch.zeros(q.shape, dtype=torch.float64)
    for i, (start, length, context) in enumerate(runs):
        blocks = tables[i, torch.arange(context) // block_size]
        slots = blocks * block_size + torch.arange(context) % block_size  # [ctx]
        k = k_cache.flatten(0, 1)[slots].double().repeat_interleave(group, 1)  # [ctx, heads, dim]
        v = v_cache.flatten(0, 1)[slots].double().repeat_interleave(group, 1)
        qq = q[start : start + length].double()  # [length, heads, dim]
        scores = torch.einsum("lhd,chd->hlc", qq, k) * scale  # [heads, length, ctx]
        q_pos = torch.arange(context - length, context)
        hidden = torch.arange(context)[None, :] > q_pos[:, None]  # causal: later keys hidden
        if window is not None:
            hidden |= torch.arange(context)[None, :] <= q_pos[:, None] - window
        scores = scores.masked_fill(hidden, float("-inf"))
        if sinks is not None:  # [heads, length, ctx + 1], the sink's column dropped after
            sink = sinks.double()[:, None, None].expand(-1, length, 1)
            probs = torch.cat([scores, sink], dim=-1).softmax(-1)[..., :-1]
        else:
            probs = scores.softmax(-1)
        out[start : start + length] = torch.einsum("hlc,chd->lhd", probs, v)
    return out


def _run_case(case: Case) -> float:
    """The kernel's largest error against the reference, over 1 + |reference| (NaN if it
    produced any NaN)."""
    from appliance.model.layers import triton_attention

    dtype = getattr(torch, case.dtype)
    contexts = [cached + new for cached, new in case.runs]
    k_cache, v_cache, tables = _pool(contexts, case.block_size, case.kv_heads, case.head_dim, dtype)
    lengths = [new for _, new in case.runs]
    starts = [sum(lengths[:i]) for i in range(len(lengths) + 1)]
    # q as the model makes it: the query heads of a fused [tokens, heads + 2 kv, dim] tensor.
    width = case.heads + 2 * case.kv_heads
    q = torch.randn(starts[-1], width, case.head_dim).to(dtype)[:, : case.heads]
    scale = case.head_dim**-0.5
    sinks = torch.randn(case.heads) * 2 if case.sinks else None
    extra = {"sinks": sinks, "window": case.window, "splits": case.splits}
    if case.varlen:
        # int32 metadata here, int64 below: the kernel takes either.
        out = triton_attention.paged_attention(
            q,
            k_cache,
            v_cache,
            tables,
            torch.tensor(contexts, dtype=torch.int32),
            scale,
            query_len=max(lengths),
            query_starts=torch.tensor(starts, dtype=torch.int32),
            **extra,
        )
    else:
        assert len(set(lengths)) == 1, "a uniform launch has one query length"
        lens = torch.tensor(contexts)
        out = triton_attention.paged_attention(
            q, k_cache, v_cache, tables, lens, scale, query_len=lengths[0], **extra
        )
    runs = list(zip(starts[:-1], lengths, contexts, strict=True))
    ref = _reference(q, k_cache, v_cache, tables, runs, scale, sinks, case.window)
    return ((out.double() - ref).abs() / (1 + ref.abs())).max().item()


def _run_attend(sinks: bool = False) -> float:
    """triton_attention.attend over a whole step (two prompt chunks, one a prefix hit, in
    one varlen launch; a speculative verify chunk after them in another; two decode
    groups, one out of row order) against attention.paged_attention's CPU path: the max
    abs difference. With `sinks` (and a window): gpt-oss's attention, whose CPU path is
    attend_with_sinks."""
    from appliance.model.layers import triton_attention
    from appliance.model.layers.paged_attention import AttentionBatch, DecodeGroup, PrefillSegment
    from appliance.model.layers.paged_attention import paged_attention as cpu_paged_attention

    heads, kv_heads, head_dim, block_size = 9, 3, 64, 16
    chunks = [(0, 21), (40, 30), (61, 4)]  # prefill: (cached, chunk); the last a verify
    # Decode contexts, the new token included: 600 widens the first group's tables to 608
    # keys, so decode_splits gives it 2 parts (6 programs, 2 x 256 keys).
    decodes = [35, 3, 600]
    contexts = [c + n for c, n in chunks] + decodes
    k_cache, v_cache, tables = _pool(contexts, block_size, kv_heads, head_dim, torch.float32)
    # Zeros, not NaN, past the contexts: the CPU path's SDPA multiplies masked slots by 0.
    k_cache, v_cache = k_cache.nan_to_num(0.0), v_cache.nan_to_num(0.0)
    tokens = sum(n for _, n in chunks) + len(decodes)
    q = torch.randn(tokens, heads, head_dim)
    k, v = torch.randn(tokens, kv_heads, head_dim), torch.randn(tokens, kv_heads, head_dim)
    # The step's own K/V: the prefill chunks' slots (the decode tokens' are already random).
    row = 0
    for i, (cached, n) in enumerate(chunks):
        for j, pos in enumerate(range(cached, cached + n)):
            block, offset = tables[i, pos // block_size], pos % block_size
            k_cache[block, offset], v_cache[block, offset] = k[row + j], v[row + j]
        row += n
    segments, row = [], 0
    for i, (cached, n) in enumerate(chunks):
        width = -(-(cached + n) // block_size)
        segments.append(PrefillSegment(row, n, cached + n, tables[i, :width].clone()))
        row += n

    def group(members: list[int]) -> DecodeGroup:
        seqs = [len(chunks) + m for m in members]
        lens = torch.tensor([contexts[s] for s in seqs])
        width = max(-(-int(n) // block_size) for n in lens)
        visible = torch.arange(width * block_size)[None, :] < lens[:, None]
        return DecodeGroup(
            torch.tensor(members), tables[seqs, :width].clone(), visible[:, None, None], lens
        )

    groups = [group([2, 0]), group([1])]
    # attend() splits the first group's keys (the rule's choice for an H100), not the second's.
    assert triton_attention.choose_splits(q, k_cache, groups[0].block_tables, 1, 132) == 2
    assert triton_attention.choose_splits(q, k_cache, groups[1].block_tables, 1, 132) == 1
    prompt_rows = 21 + 30  # the verify chunk's rows follow the prompts'
    batch = AttentionBatch(torch.zeros(0, dtype=torch.int64), segments, row, groups, prompt_rows)
    scale = head_dim**-0.5
    extra = {"window": 17, "sinks": torch.randn(heads)} if sinks else {}
    ours = triton_attention.attend(q, k_cache, v_cache, batch, scale, **extra)
    theirs = cpu_paged_attention(q, k, v, k_cache, v_cache, batch, scale, **extra)
    return (ours - theirs).abs().max().item()


def _child() -> dict[str, float | str]:
    """Every case's error (or its traceback) under the interpreter."""
    torch.manual_seed(0)
    jobs = {case.name: lambda case=case: _run_case(case) for case in CASES}
    jobs["attend"] = _run_attend
    jobs["attend_sinks"] = lambda: _run_attend(sinks=True)
    return run_jobs(jobs)


@pytest.fixture(scope="module")
def errors() -> dict[str, float | str]:
    """The child's results: one interpreter process for every case."""
    return child_results(__file__)


@pytest.mark.parametrize("case", CASES, ids=[case.name for case in CASES])
def test_kernel_matches_dense_reference(errors: dict[str, float | str], case: Case) -> None:
    error = errors[case.name]
    assert not isinstance(error, str), error
    assert error <= case.tolerance, f"{case.name}: error {error} over 1 + |reference|"


@pytest.mark.parametrize("job", ["attend", "attend_sinks"])
def test_attend_matches_cpu_path(errors: dict[str, float | str], job: str) -> None:
    error = errors[job]
    assert not isinstance(error, str), error
    assert error <= ATTEND_TOLERANCE, f"max abs difference from the CPU path {error}"


if __name__ == "__main__":
    # The child: TRITON_INTERPRET must be in the environment before triton is imported
    # (the fixture sets it; a bare run sets it here, before any import of the kernels).
    os.environ.setdefault("TRITON_INTERPRET", "1")
    print(json.dumps(_child()))
