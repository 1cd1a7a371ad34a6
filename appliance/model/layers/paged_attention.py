"""Attention over a paged KV cache (the same code on CPU and CUDA).

A step's tokens lie flat, one row each: first the prefill segments (several query
tokens per sequence, possibly after a cached prefix), then the decode tokens (one per
sequence), which attend in batches of similar context length (decode groups). Prefill
runs torch's SDPA. Decode runs the compiled CPU kernel (the cpu_kernels package) where it applies,
SDPA over each group's gathered and padded context elsewhere (other dtypes). On CUDA, with
triton installed, both run the Triton kernel (triton_attention.py), which reads K/V in place
through the block tables.

A sliding window (Mistral) lets each query see only the last `window` keys, itself
included, as transformers' mask does: SDPA through its mask, the compiled CPU kernel and
the Triton one by reading only those. Blocks that fall out of the window stay allocated:
the cache holds every token of a sequence.

The cache may keep K/V in another dtype than the activations (kv_cache_dtype: a bfloat16
cache beside float32 activations on the CPU, half the bytes a decode step reads): K/V are
rounded to it as stored, and read back widened to the queries' dtype (SDPA, the torch
paths); decode on the compiled CPU kernel, which reads one dtype, reads the cache in place
with the queries rounded to the cache's dtype and its output widened back (its sums are
float32 either way).

Attention sinks (gpt-oss): a learned logit per query head joins each softmax's
denominator and adds no value, so a head may attend to "nothing". SDPA takes no such
term: with sinks, prefill and decode run attend_with_sinks (the scores as one matrix,
the sink a last column of the softmax) and never the compiled CPU decode kernel, which
has none; the Triton kernel folds the sink into its online softmax's sum.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from appliance.model import cpu_kernels
from appliance.model.layers.rotary import apply_rope

# Looked up, not imported: CPU processes never load triton.
_TRITON_INSTALLED = importlib.util.find_spec("triton") is not None


@dataclass
class PrefillSegment:
    """One sequence's prompt chunk in this step."""

    start: int  # first row of the chunk in the flat token batch
    length: int  # query tokens of this chunk
    context_len: int  # tokens in the cache after this step: cached prefix + chunk
    block_table: torch.Tensor  # [blocks] int64, the sequence's KV blocks in order


@dataclass
class DecodeGroup:
    """Decode sequences of similar context length, attending in one padded batch."""

    rows: torch.Tensor | None  # [n] int64 among the decode rows; None: all, in order
    block_tables: torch.Tensor  # [n, max_blocks] int64, padded with 0
    visible: torch.Tensor | None  # [n, 1, 1, max_blocks * block_size] bool, True for key
    # slots inside a sequence's context, False for the padding of its block table; None
    # where the step runs on the Triton kernel, which reads context_lens (built if needed)
    context_lens: torch.Tensor  # [n] int64, tokens in each sequence's context


@dataclass
class AttentionBatch:
    """Where each token's K/V goes and what each query may attend to."""

    slot_mapping: torch.Tensor  # [tokens] int64: block_id * block_size + offset
    prefills: list[PrefillSegment]
    decode_start: int  # rows from here on are decode tokens
    decode_groups: list[DecodeGroup]
    # Rows of prompt chunks at the head of the batch (None: all before decode_start). A
    # speculative verify chunk attends as a segment but decodes: its rows follow the
    # prompts' and must stay on the decode kernel's numbers (quant.PrefillGemm).
    prompt_rows: int | None = None
    # The Triton path's launch metadata for the prefill segments (triton_attention's
    # segment_runs), made on the device by the step's first layer and reused by the rest.
    kernel_plan: object = field(default=None, compare=False, repr=False)


def write_kv(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Store the step's K/V [tokens, kv_heads, head_dim] into their cache slots, in the
    cache's dtype (rounded, where it is narrower)."""
    # caches [num_blocks, block_size, kv_heads, head_dim] viewed as [slots, kv_heads, head_dim]
    k_cache.view(-1, *k_cache.shape[2:]).index_copy_(0, slot_mapping, k.to(k_cache.dtype))
    v_cache.view(-1, *v_cache.shape[2:]).index_copy_(0, slot_mapping, v.to(v_cache.dtype))


def rotate_and_store(
    qkv: torch.Tensor,
    rope: tuple[torch.Tensor, torch.Tensor],
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    heads: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The step's projections qkv [tokens, heads + 2 * kv_heads, head_dim] -> q, k (both
    rotated) and v, with k and v stored in the cache. On the CPU one compiled pass rotates
    qkv in place and stores (cpu_kernels.rope_store); elsewhere torch ops do."""
    kv_heads = (qkv.shape[1] - heads) // 2
    if cpu_kernels.rope_store_takes(qkv, *rope, slot_mapping, k_cache, v_cache):
        cpu_kernels.rope_store(qkv, *rope, slot_mapping, k_cache, v_cache, heads, checked=True)
        return qkv[:, :heads], qkv[:, heads : heads + kv_heads], qkv[:, heads + kv_heads :]
    qk = apply_rope(qkv[:, : heads + kv_heads], *rope)
    q, k, v = qk[:, :heads], qk[:, heads:], qkv[:, heads + kv_heads :]
    write_kv(k_cache, v_cache, k, v, slot_mapping)
    return q, k, v


def paged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    batch: AttentionBatch,
    scale: float,
    window: int | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """q [tokens, heads, head_dim], k/v [tokens, kv_heads, head_dim] -> like q. The step's
    k/v are already in the cache (rotate_and_store). `window`: each query attends to the
    last `window` keys only (None: its whole context). `sinks` [heads]: each head's sink
    logit, in every softmax's denominator (None: none)."""
    if runs_triton(q.device):
        from appliance.model.layers import triton_attention  # on first CUDA use, never on CPU

        return triton_attention.attend(q, k_cache, v_cache, batch, scale, window, sinks)
    groups = batch.decode_groups
    if not batch.prefills and len(groups) == 1 and groups[0].rows is None:
        # every row: nothing to place
        return _decode(q, k_cache, v_cache, groups[0], scale, window, sinks)
    out = torch.empty_like(q)
    for seg in batch.prefills:
        rows = slice(seg.start, seg.start + seg.length)
        out[rows] = _prefill(q[rows], k[rows], v[rows], k_cache, v_cache, seg, scale, window, sinks)
    decode_q, decode_out = q[batch.decode_start :], out[batch.decode_start :]
    for group in groups:
        if group.rows is None:
            decode_out[:] = _decode(decode_q, k_cache, v_cache, group, scale, window, sinks)
        else:
            picked = decode_q.index_select(0, group.rows)
            result = _decode(picked, k_cache, v_cache, group, scale, window, sinks)
            decode_out.index_copy_(0, group.rows, result)
    return out


def runs_triton(device: torch.device) -> bool:
    """Whether attention on this device runs the Triton kernel (CUDA with triton installed).
    It takes decodes of any mix of context lengths in one launch: the model runner need not
    group them."""
    return device.type == "cuda" and _TRITON_INSTALLED


def _prefill(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    seg: PrefillSegment,
    scale: float,
    window: int | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    if window is not None and seg.context_len <= window:
        window = None  # the window hides nothing from this chunk
    if seg.context_len == seg.length and window is None:
        # Nothing cached before this chunk: plain causal attention over its own K/V.
        mask, causal = None, True
    else:
        # Keys from the first one the chunk's first query sees (all, without a window).
        first = 0 if window is None else max(0, seg.context_len - seg.length - window + 1)
        if seg.context_len != seg.length:
            k = _gather(k_cache, seg.block_table, seg.context_len).to(q.dtype)
            v = _gather(v_cache, seg.block_table, seg.context_len).to(q.dtype)
        k, v = k[first:], v[first:]  # [keys, kv_heads, head_dim]
        # The chunk's query i sits at position context_len - length + i.
        q_pos = torch.arange(seg.context_len - seg.length, seg.context_len, device=q.device)
        k_pos = torch.arange(first, seg.context_len, device=q.device)
        mask = k_pos[None, :] <= q_pos[:, None]  # [length, keys]
        if window is not None:
            mask &= k_pos[None, :] > q_pos[:, None] - window
        causal = False
    if sinks is not None:
        if mask is None:  # [length, length]: causal within the chunk
            mask = torch.ones(seg.length, seg.length, dtype=torch.bool, device=q.device).tril()
        heads = (q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None])
        return attend_with_sinks(*heads, mask, scale, sinks)[0].transpose(0, 1)
    # 4-D [1, heads, length, head_dim]: SDPA's fused CPU kernel takes no 3-D input.
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1)[None],
        k.transpose(0, 1)[None],
        v.transpose(0, 1)[None],
        attn_mask=mask,
        is_causal=causal,
        scale=scale,
        enable_gqa=True,
    )
    return out[0].transpose(0, 1)


def _gather(cache: torch.Tensor, block_table: torch.Tensor, length: int) -> torch.Tensor:
    """One sequence's first `length` cached tokens: [length, kv_heads, head_dim]."""
    # index_select, not cache[block_table]: advanced indexing is ~40x slower on CPU here.
    return cache.index_select(0, block_table).flatten(0, 1)[:length]


def _decode(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    group: DecodeGroup,
    scale: float,
    window: int | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """One query token per sequence against its cached keys: on the CPU by the compiled
    kernel, which reads the cache in place (queries in another dtype than the cache's
    rounded to it, the output widened back); elsewhere (and without it, and with sinks,
    which it has not) by SDPA or attend_with_sinks."""
    rows = q if q.dtype == k_cache.dtype else q.to(k_cache.dtype)
    if sinks is None and cpu_kernels.decode_takes(rows, k_cache, v_cache):
        tables, lens = group.block_tables, group.context_lens
        out = cpu_kernels.paged_decode(
            rows, k_cache, v_cache, tables, lens, scale, checked=True, window=window
        )
        return out.to(q.dtype)
    return sdpa_decode(q, k_cache, v_cache, group, scale, window, sinks)


def sdpa_decode(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    group: DecodeGroup,
    scale: float,
    window: int | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """_decode with torch's SDPA over the group's gathered, padded context (within the
    last `window` keys of each, when given; attend_with_sinks with `sinks`)."""
    tables = group.block_tables
    decodes, kv_heads, head_dim = tables.shape[0], k_cache.shape[2], k_cache.shape[3]
    # [decodes * max_blocks, block_size, kv_heads, head_dim] -> [decodes, ctx, kv_heads, head_dim]
    k = k_cache.index_select(0, tables.flatten()).view(decodes, -1, kv_heads, head_dim)
    v = v_cache.index_select(0, tables.flatten()).view(decodes, -1, kv_heads, head_dim)
    k, v = k.to(q.dtype), v.to(q.dtype)  # a cache in another dtype: widened as read
    # The query heads sharing a KV head are that head's query rows: [decodes, kv_heads,
    # group, head_dim]. Plain multi-head SDPA over a few rows was 1.2-5x faster on the CPU
    # than one row per query head with enable_gqa, and than matmuls in 16-bit floats.
    # Every row sees the same keys: no mask among them.
    grouped = q.view(decodes, kv_heads, -1, head_dim)
    visible = group.visible
    if visible is None:  # [decodes, 1, 1, ctx]: the slots inside each context
        keys = torch.arange(tables.shape[1] * k_cache.shape[1], device=q.device)
        visible = (keys[None, :] < group.context_lens.to(q.device)[:, None])[:, None, None, :]
    if window is not None:
        # The query sits at context_len - 1: it sees keys from context_len - window on.
        keys = torch.arange(visible.shape[-1], device=visible.device)
        inside = keys[None, :] >= (group.context_lens.to(visible.device) - window)[:, None]
        visible = visible & inside[:, None, None, :]  # [decodes, 1, 1, ctx]
    if sinks is not None:  # a row per query head: [decodes, heads, 1, head_dim]
        rows = q.view(decodes, -1, 1, head_dim)
        out = attend_with_sinks(rows, k.transpose(1, 2), v.transpose(1, 2), visible, scale, sinks)
        return out.reshape(decodes, -1, head_dim)
    out = F.scaled_dot_product_attention(
        grouped, k.transpose(1, 2), v.transpose(1, 2), attn_mask=visible, scale=scale
    )  # K/V seen as [decodes, kv_heads, ctx, head_dim]
    return out.reshape(decodes, -1, head_dim)


def attend_with_sinks(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    visible: torch.Tensor,
    scale: float,
    sinks: torch.Tensor,
) -> torch.Tensor:
    """Attention with a sink logit per head, as transformers' gpt-oss eager attention:
    q [batch, heads, queries, head_dim], k/v [batch, kv_heads, keys, head_dim] (query head
    h reads KV head h // (heads / kv_heads)), `visible` bool broadcastable to [batch,
    heads, queries, keys], sinks [heads] -> [batch, heads, queries, head_dim]. The softmax
    runs in float32 over the scores and the sink, which then drops out (it has no value)."""
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    scores = torch.matmul(q, k.transpose(-1, -2)).float() * scale  # [b, heads, queries, keys]
    scores = scores.masked_fill(~visible, float("-inf"))
    sink = sinks.float().view(1, -1, 1, 1).expand(*scores.shape[:-1], 1)
    probs = torch.cat([scores, sink], dim=-1).softmax(dim=-1)[..., :-1]
    return torch.matmul(probs.to(v.dtype), v)
