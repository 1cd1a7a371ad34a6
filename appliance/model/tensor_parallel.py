"""Tensor parallelism, Megatron style: which heads and MLP columns each shard of a group holds.

Attention is split by KV head, each shard keeping the query heads that read its KV heads
(so grouped-query attention stays local), and the MLP by intermediate column. The
projections into a shard (q/k/v, gate/up) are column-parallel; the ones out of it (o, down)
are row-parallel, and their partial sums meet in one all-reduce per block. Embeddings,
norms and the LM head are replicated. Splits need not be even: SmolLM2's 3 KV heads go
2 + 1 over two shards. A row-parallel projection's bias (gpt-oss's o and experts' down)
is the first shard's alone, zeros on the others, so the sum adds it once; gpt-oss's sink
logits go with their query heads.

Routed experts (layers/moe.py) are split as the MLP is: every shard holds every expert,
each cut by intermediate column (gate/up by row, down by input column), and the router
whole. Each shard routes the same whole hidden state with the same router, so all pick
the same experts with no exchange of tokens, and the experts' partial sums join the
block's one all-reduce. Split across shards by expert instead, a batch-1 decode step
(two experts of many) would keep all but two shards idle and need tokens sent to their
experts' shards and back; split by column, every shard reads its share of exactly the
routed experts' bytes.

The planning here is pure (no process group), so it is tested on plain data.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TypeVar

import torch

from appliance.model.model_config import ModelConfig
from appliance.model.quant import QuantWeight

W = TypeVar("W")  # a weight: a tensor, or a QuantWeight


@dataclass(frozen=True)
class Shard:
    """This process's place in its tensor-parallel group."""

    rank: int = 0
    size: int = 1

    def __post_init__(self) -> None:
        if self.size < 1 or not 0 <= self.rank < self.size:
            raise ValueError(f"shard rank {self.rank} of a group of {self.size}")


WHOLE_MODEL = Shard()  # a group of one: the unsplit model


@dataclass(frozen=True)
class ShardPlan:
    """The slices of the model one shard holds."""

    q_heads: range
    kv_heads: range
    mlp_columns: range
    expert_columns: range = range(0)  # of each expert's intermediate ones


def split_evenly(n: int, parts: int) -> list[range]:
    """Contiguous ranges covering range(n), sizes differing by at most one (larger first)."""
    base, extra = divmod(n, parts)
    ranges, start = [], 0
    for index in range(parts):
        stop = start + base + (index < extra)
        ranges.append(range(start, stop))
        start = stop
    return ranges


def kv_head_ranges(num_kv_heads: int, size: int) -> list[range]:
    """Each shard's KV heads; every shard needs at least one."""
    if size > num_kv_heads:
        raise ValueError(
            f"tensor-parallel degree {size} is more than the model's {num_kv_heads} KV heads"
        )
    return split_evenly(num_kv_heads, size)


def shard_plan(config: ModelConfig, shard: Shard) -> ShardPlan:
    """What `shard` holds of a model with `config`."""
    if config.num_heads % config.num_kv_heads:
        raise ValueError(
            f"{config.num_heads} query heads do not group evenly over "
            f"{config.num_kv_heads} KV heads"
        )
    kv = kv_head_ranges(config.num_kv_heads, shard.size)[shard.rank]
    group = config.num_heads // config.num_kv_heads  # query heads per KV head
    q = range(kv.start * group, kv.stop * group)
    mlp = _columns(config.intermediate_size, shard)
    return ShardPlan(q, kv, mlp, _columns(config.expert_intermediate_size, shard))


def _columns(width: int, shard: Shard) -> range:
    """`shard`'s intermediate columns of an MLP `width` wide, in whole mlp_unit()s."""
    unit = mlp_unit(width)
    units = split_evenly(width // unit, shard.size)[shard.rank]
    return range(units.start * unit, units.stop * unit)


def mlp_unit(width: int) -> int:
    """The MLP columns a shard takes whole: 256 (a K-quant block, eight 32-value ones)
    where the MLP's width is a multiple of it, else 32, else 1; so a quantized down
    projection splits on block edges."""
    return next(unit for unit in (256, 32, 1) if width % unit == 0)


def row_parallel_spans(config: ModelConfig, degrees: Iterable[int]) -> dict[str, int]:
    """The spans (cpu_kernels.QuantMatrix's) of the row-parallel projections, by their names
    in the layer, for an appliance whose groups have `degrees`: the widest inputs every
    split of those degrees falls between. A quantized product sums each span on its own,
    so a shard's partial sums are exactly what one process sums, and a group answers as
    one process does. Empty where no degree splits the model: a product then sums its
    whole row, as fast as it can (a span's sum costs a batch-1 step about 10%)."""
    splits = sorted({d for d in degrees if d > 1})
    if not splits:
        return {}
    group = config.num_heads // config.num_kv_heads
    width = group * config.head_dim  # o_proj inputs per KV head
    heads = [r.start * width for d in splits for r in kv_head_ranges(config.num_kv_heads, d)]
    plans = [shard_plan(config, Shard(rank, d)) for d in splits for rank in range(d)]
    expert_columns = [plan.expert_columns.start for plan in plans]
    spans = {
        "self_attn.o_proj": math.gcd(config.num_heads * config.head_dim, *heads),
        "mlp.down_proj": math.gcd(config.intermediate_size, *[p.mlp_columns.start for p in plans]),
    }
    if config.num_experts:
        spans["experts.down_proj"] = math.gcd(config.expert_intermediate_size, *expert_columns)
    return spans


def _spans(config: ModelConfig, shard: Shard) -> tuple[dict[str, slice], dict[str, slice]]:
    """Which rows of each column-parallel projection, and which input columns of each
    row-parallel one, `shard` holds, keyed by a part of their names."""
    plan = shard_plan(config, shard)
    d = config.head_dim
    experts = _span(plan.expert_columns, 1)
    rows = {  # projections split by output row (column-parallel): biases follow
        ".experts.*.gate_proj.": experts,  # routed experts' first: the names hold the MLP's
        ".experts.*.up_proj.": experts,
        ".q_proj.": _span(plan.q_heads, d),
        ".self_attn.sinks": _span(plan.q_heads, 1),  # gpt-oss: a sink per query head
        ".k_proj.": _span(plan.kv_heads, d),
        ".v_proj.": _span(plan.kv_heads, d),
        ".gate_proj.": _span(plan.mlp_columns, 1),
        ".up_proj.": _span(plan.mlp_columns, 1),
    }
    columns = {  # projections split by input column (row-parallel)
        ".experts.*.down_proj.": experts,
        ".o_proj.": _span(plan.q_heads, d),
        ".down_proj.": _span(plan.mlp_columns, 1),
    }
    return rows, columns


def shard_state(
    state: dict[str, torch.Tensor], config: ModelConfig, shard: Shard
) -> dict[str, torch.Tensor]:
    """Cut Hugging Face-named full weights to one shard's, before q/k/v and gate/up are
    fused, so a shard never holds a full copy of a split projection."""

    def cut_columns(tensor: torch.Tensor, columns: slice) -> torch.Tensor:
        if tensor.dim() == 1:  # a row-parallel bias (gpt-oss): the first shard adds it
            return tensor if shard.rank == 0 else torch.zeros_like(tensor)
        # A view: the parameter's copy_ reads it in place. A contiguous copy first was a
        # temporary the size of the shard's part, and the heap kept the holes they left.
        return tensor[:, columns]

    return _cut(
        state,
        _spans(config, shard) if shard.size > 1 else None,
        lambda tensor, rows: tensor[rows],
        cut_columns,
    )


def shard_quant(
    quant: dict[str, QuantWeight], config: ModelConfig, shard: Shard
) -> dict[str, QuantWeight]:
    """shard_state for block-quantized weights: rows of whole blocks, or input columns on
    block edges (a split that cuts a block raises, naming the remedy)."""
    return _cut(
        quant,
        _spans(config, shard) if shard.size > 1 else None,
        QuantWeight.row_slice,
        QuantWeight.column_slice,
    )


def _cut(
    weights: dict[str, W],
    spans: tuple[dict[str, slice], dict[str, slice]] | None,
    cut_rows: Callable[[W, slice], W],
    cut_columns: Callable[[W, slice], W],
) -> dict[str, W]:
    """Each weight cut to the rows or columns `spans` names for it (None: all whole)."""
    if spans is None:
        return weights
    rows, columns = spans
    out = {}
    for name, weight in weights.items():
        row = next((r for key, r in rows.items() if _matches(key, name)), None)
        column = next((c for key, c in columns.items() if _matches(key, name)), None)
        if row is not None:
            weight = cut_rows(weight, row)
        elif column is not None:
            weight = cut_columns(weight, column)
        out[name] = weight
    return out


def _matches(key: str, name: str) -> bool:
    """Whether `name` holds `key`, a "*" in which stands for one expert's number."""
    head, star, tail = key.partition("*")
    if not star:
        return key in name
    return re.search(re.escape(head) + r"\d+" + re.escape(tail), name) is not None


def _span(units: range, width: int) -> slice:
    """The rows (or columns) of `units` heads or columns, each `width` wide."""
    return slice(units.start * width, units.stop * width)


AllReduce = Callable[[torch.Tensor], torch.Tensor]


def no_reduce(x: torch.Tensor) -> torch.Tensor:
    """A group of one: its partial sums are already whole."""
    return x
