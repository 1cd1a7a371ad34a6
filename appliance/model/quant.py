"""Weights kept in GGUF's block formats and multiplied in place (cpu_kernels.quant_matmul).

Decode reads every weight once a step, so its speed is the bytes a weight takes: Q4_1 is
5 bits a weight where float32 is 32. A `QuantWeight` is one matrix as the file stores it
(a row of blocks per output feature, rows in Hugging Face order); `QuantLinear` and
`QuantEmbedding` take its place in the model. Float weights (an F16/F32 GGUF, a Hugging
Face folder) can be quantized at load to Q8_0 or Q4_0 (`quantize`).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch
from torch import nn

from appliance.model import cpu_kernels
from appliance.model.cpu_kernels import QuantMatrix
from appliance.model.layers.paged_attention import runs_triton

if TYPE_CHECKING:
    from appliance.model.causal_lm import CausalLM


@dataclass(frozen=True)
class BlockFormat:
    """One of GGML's block formats: `values` weights in `bytes` bytes."""

    name: str
    ggml_id: int
    values: int
    bytes: int


FORMATS = {
    f.name: f
    for f in (
        BlockFormat("Q4_0", 2, 32, 18),
        BlockFormat("Q4_1", 3, 32, 20),
        BlockFormat("Q8_0", 8, 32, 34),
        BlockFormat("Q4_K", 12, 256, 144),
        BlockFormat("Q5_K", 13, 256, 176),
        BlockFormat("Q6_K", 14, 256, 210),
    )
}


@dataclass
class QuantWeight:
    """A [rows, in_features] weight as blocks: `blocks` [rows, in / values * bytes] uint8."""

    format: BlockFormat
    blocks: torch.Tensor
    in_features: int
    in_memory: bool = False  # the blocks are this process's (not a view of a mapped file)

    def __post_init__(self) -> None:
        if self.in_features % self.format.values:
            raise ValueError(
                f"{self.format.name} holds rows of whole {self.format.values}-value blocks, "
                f"not {self.in_features} values"
            )
        row_bytes = self.in_features // self.format.values * self.format.bytes
        if self.blocks.dtype != torch.uint8 or self.blocks.dim() != 2:
            raise ValueError("blocks must be a 2-D uint8 tensor")
        if self.blocks.shape[1] != row_bytes:
            raise ValueError(
                f"rows of {self.blocks.shape[1]} bytes do not hold {self.in_features} "
                f"{self.format.name} values ({row_bytes} bytes)"
            )

    @property
    def rows(self) -> int:
        return self.blocks.shape[0]

    def row_slice(self, rows: slice) -> QuantWeight:
        """Some output rows (a column-parallel shard's)."""
        return QuantWeight(self.format, self.blocks[rows], self.in_features, self.in_memory)

    def column_slice(self, columns: slice) -> QuantWeight:
        """Some input columns (a row-parallel shard's): whole blocks only."""
        start, stop = columns.start, columns.stop
        per = self.format.values
        if start % per or stop % per:
            raise ValueError(
                f"columns {start}:{stop} split {self.format.name} blocks of {per} values; "
                "this model cannot be split over these shards with quantized weights "
                "(use weights=dense)"
            )
        size = self.format.bytes
        blocks = self.blocks[:, start // per * size : stop // per * size]
        return QuantWeight(self.format, blocks.contiguous().clone(), stop - start, True)

    def owned(self) -> QuantWeight:
        """Itself, with blocks in this process's own memory (they may view a mapped file)."""
        if self.in_memory:
            return self
        return QuantWeight(self.format, self.blocks.contiguous().clone(), self.in_features, True)

    def dequantize(self, rows: torch.Tensor | None = None) -> torch.Tensor:
        """The float32 weight (or some of its rows)."""
        ids = torch.arange(self.rows) if rows is None else rows
        return cpu_kernels.quant_rows(self.blocks, self.format.ggml_id, self.in_features, ids)


def concat_rows(parts: list[QuantWeight]) -> QuantWeight | None:
    """One weight of the parts' rows stacked in this process's memory (a fused q/k/v or
    gate/up), or None when their formats differ."""
    if len({(p.format, p.in_features) for p in parts}) != 1:
        return None
    if len(parts) == 1:
        return parts[0].owned()
    blocks = torch.cat([p.blocks for p in parts])
    return QuantWeight(parts[0].format, blocks, parts[0].in_features, True)


def _matrices(
    parts: list[QuantWeight], bias: torch.Tensor | None, span: int | None, partial: bool
) -> list[QuantMatrix]:
    """The parts (with their columns of `bias`) as the kernels' checked weights."""
    out, start = [], 0
    for part in parts:
        stop = start + part.rows
        bias_part = None if bias is None else bias[start:stop]
        format_id = part.format.ggml_id
        out.append(QuantMatrix(part.blocks, format_id, part.in_features, bias_part, span, partial))
        start = stop
    return out


@dataclass
class PrefillGemm:
    """When a model's quantized products leave the integer kernel for a GEMM, and its type.

    A product runs as a GEMM (in `dtype`) when it has `rows` rows or more and so does the
    running step's prompt chunks (`step_rows`, which CausalLM.forward sets each step: the
    rows before the batch's decode rows). A decode-only step (no prompt rows) therefore
    stays on the integer kernel whatever its batch; in a mixed step whose prompt rows
    reach `rows` its decode rows ride in the GEMM. `step_rows` None (a projection called
    outside a model's step) leaves it to the product's rows. Mutable: one per model,
    shared by its projections, written once per step by the one forward running."""

    dtype: torch.dtype = torch.float32
    rows: int = cpu_kernels.GEMM_ROWS
    step_rows: int | None = None

    def gemm_rows(self) -> int | None:
        """The rows from which a product of this step runs as a GEMM; None: none does."""
        if self.step_rows is not None and self.step_rows < self.rows:
            return None
        return self.rows


class QuantLinear(nn.Module):
    """A projection whose output columns come from one or more block-quantized weights (a
    fused projection whose parts the file stores in different formats keeps them apart).

    `span` and `partial` as QuantMatrix takes them: a row-parallel projection sums its
    inputs a tensor-parallel unit at a time (`span`), and a shard of one returns float64
    partial sums for its group's all-reduce (`partial`)."""

    def __init__(
        self,
        parts: list[QuantWeight],
        bias: torch.Tensor | None,
        span: int | None = None,
        partial: bool = False,
    ) -> None:
        super().__init__()
        fused = concat_rows(parts)
        self.parts = [fused] if fused is not None else [p.owned() for p in parts]
        self.in_features = parts[0].in_features
        self.out_features = sum(p.rows for p in parts)
        self.bias = None if bias is None else bias.float().contiguous()
        self.span = self.in_features if span is None else span
        self.partial = partial
        # checked once, not every product
        self._matrices = _matrices(self.parts, self.bias, self.span, partial)
        # Activations as two int8 parts (about 16 bits) rather than llama.cpp's one: the
        # 8-bit form changed SmolLM2's answers (benchmarks/quant_accuracy.py) for 10-15%
        # less kernel time.
        self.precise = True
        # When and in what type a prompt's products run as a GEMM: one object shared by the
        # model's projections (use_prefill_gemm(): the settings), told each step's prompt
        # rows by CausalLM.forward.
        self.prefill = PrefillGemm()

    @property
    def gemm_dtype(self) -> torch.dtype:
        """The type this projection's prefill GEMMs multiply in."""
        return self.prefill.dtype

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """[rows, in] -> [rows, out] in x's dtype (float32 or bfloat16 CPU rows; float64
        when `partial`). On CUDA (with triton) the Triton kernels multiply instead."""
        if runs_triton(x.device):
            return self._by_triton(x)
        dtype, rows = self.prefill.dtype, self.prefill.gemm_rows()
        if len(self._matrices) == 1:
            return self._matrices[0](x, None, self.precise, dtype, rows)
        out_dtype = torch.float64 if self.partial else x.dtype
        out = torch.empty(x.shape[0], self.out_features, dtype=out_dtype)
        start = 0
        for matrix in self._matrices:
            stop = start + matrix.out_features
            matrix(x, out[:, start:stop], self.precise, dtype, rows)
            start = stop
        return out

    def _by_triton(self, x: torch.Tensor) -> torch.Tensor:
        """The GPU's product: each part by triton_quant (its GEMV for decode's rows, the
        GEMM for prefill's) into its columns, in x's dtype with float32 sums, the bias
        added after; a row-parallel shard's partial sums widened to float64 as its
        all-reduce takes them (but summed whole, not `span` at a time)."""
        from appliance.model.layers import triton_quant  # on first CUDA use, never on CPU

        x = x.contiguous()
        out = torch.empty(x.shape[0], self.out_features, dtype=x.dtype, device=x.device)
        start = 0
        for part in self.parts:  # [rows, part.rows] column slices of out
            stop = start + part.rows
            columns = out[:, start:stop]
            triton_quant.quant_matmul(
                x, part.blocks, part.format.ggml_id, self.in_features, columns
            )
            start = stop
        if self.bias is not None:
            out += self.bias.to(out.device, out.dtype)
        return out.double() if self.partial else out

    def weight_bytes(self) -> int:
        return sum(p.blocks.numel() for p in self.parts)

    def place(self, move: Callable[[QuantWeight], QuantWeight]) -> None:
        """Take the parts `move` gives (on a GPU, where the Triton kernels read them), the
        bias beside them."""
        self.parts = [move(p) for p in self.parts]
        if self.bias is not None:
            self.bias = self.bias.to(self.parts[0].blocks.device)
        self._matrices = _matrices(self.parts, self.bias, self.span, self.partial)


def use_prefill_gemm(model: CausalLM, dtype: torch.dtype, rows: int) -> PrefillGemm:
    """Make every quantized projection of `model` run a step's products as a GEMM in
    `dtype` once its prompt chunks bring `rows` rows (loading.prefill_gemm_rows()), through
    one PrefillGemm the model tells each step's prompt rows; returns it."""
    prefill = PrefillGemm(dtype, rows)
    for module in model.modules():
        if isinstance(module, QuantLinear):
            module.prefill = prefill
    model.prefill_gemm = prefill
    return prefill


class QuantEmbedding(nn.Module):
    """Token embeddings looked up from a block-quantized table, a row dequantized per token
    (by the CPU kernels, or on CUDA by triton_quant.quant_rows: the table stays in blocks
    on the GPU too)."""

    def __init__(self, weight: QuantWeight, dtype: torch.dtype) -> None:
        super().__init__()
        self.weight_q = weight
        self.dtype = dtype

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """[tokens] int64 -> [tokens, hidden]."""
        w = self.weight_q
        if runs_triton(ids.device):
            from appliance.model.layers import triton_quant  # on first CUDA use, never on CPU

            return triton_quant.quant_rows(
                w.blocks, w.format.ggml_id, w.in_features, ids, self.dtype
            )
        return cpu_kernels.quant_rows(w.blocks, w.format.ggml_id, w.in_features, ids, self.dtype)


def place_quant(model: nn.Module, device: torch.device) -> None:
    """Move `model`'s block-quantized weights (its QuantLinears' and QuantEmbedding's) to
    `device`, where a GPU's Triton kernels read them in their blocks; a table two modules
    share (a tied head's) moves once. The CPU's stay where they are."""
    if device.type == "cpu":
        return
    moved: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # id -> (blocks, on device)

    def move(weight: QuantWeight) -> QuantWeight:
        # the source is kept in `moved` so its id is not reused by another while this runs
        key = id(weight.blocks)
        if key not in moved:
            moved[key] = (weight.blocks, weight.blocks.to(device))
        return QuantWeight(weight.format, moved[key][1], weight.in_features, True)

    for module in model.modules():
        if isinstance(module, QuantLinear):
            module.place(move)
        elif isinstance(module, QuantEmbedding):
            module.weight_q = move(module.weight_q)


def quantize(weight: torch.Tensor, format_name: str) -> QuantWeight:
    """A float [rows, in] weight as Q8_0 or Q4_0 blocks (llama.cpp's rounding)."""
    array = weight.detach().float().numpy()
    rows, columns = array.shape
    if columns % 32:
        raise ValueError(f"cannot quantize rows of {columns} values into 32-value blocks")
    groups = array.reshape(rows, columns // 32, 32)
    if format_name == "Q8_0":
        d = np.abs(groups).max(axis=-1) / 127.0
        inv = np.divide(1.0, d, out=np.zeros_like(d), where=d > 0)
        q = np.round(groups * inv[..., None]).astype(np.int8)
        blocks = np.concatenate(
            [d.astype(np.float16)[..., None].view(np.uint8), q.view(np.uint8)], axis=-1
        )
    elif format_name == "Q4_0":
        # The value of largest magnitude maps to -8, so its sign sets d's.
        index = np.abs(groups).argmax(axis=-1)[..., None]
        extreme = np.take_along_axis(groups, index, axis=-1)[..., 0]
        d = extreme / -8.0
        inv = np.divide(1.0, d, out=np.zeros_like(d), where=d != 0)
        q = np.clip(np.floor(groups * inv[..., None] + 8.5), 0, 15).astype(np.uint8)
        packed = q[..., :16] | (q[..., 16:] << 4)
        blocks = np.concatenate([d.astype(np.float16)[..., None].view(np.uint8), packed], axis=-1)
    else:
        raise ValueError(f"can quantize to Q8_0 or Q4_0, not {format_name}")
    data = torch.from_numpy(np.ascontiguousarray(blocks.reshape(rows, -1)))
    return QuantWeight(FORMATS[format_name], data, columns, True)


# Our fused projections and the Hugging Face-named parts they are made of, in row order.
_FUSED = {
    "self_attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    "self_attn.o_proj": ("self_attn.o_proj",),
    "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj"),
    "mlp.down_proj": ("mlp.down_proj",),
}
EMBEDDING = "model.embed_tokens.weight"
# A routed expert's projections (layers/moe.py) and the parts they are made of.
_EXPERT_FUSED = {"gate_up_proj": ("gate_proj", "up_proj"), "down_proj": ("down_proj",)}


def projections(layer: nn.Module) -> dict[str, nn.Module]:
    """A decoder layer's fused projections by name, in _FUSED's order (q/k/v, o, gate/up,
    down)."""
    out = {}
    for name in _FUSED:
        owner, attr = name.split(".")
        out[name] = getattr(getattr(layer, owner), attr)
    return out


def quantizable(name: str) -> bool:
    """Whether a Hugging Face-named weight is one the quantized path multiplies in place
    (a projection, the embedding or the LM head)."""
    parts = [p for fused in _FUSED.values() for p in fused]
    return name in (EMBEDDING, "lm_head.weight") or (
        name.endswith(".weight")
        and (
            any(f".{p}." in name for p in parts) or re.search(r"\.experts\.\d+\.", name) is not None
        )
    )


def quantize_weights(
    dense: Mapping[str, torch.Tensor], have: dict[str, QuantWeight], format_name: str
) -> dict[str, QuantWeight]:
    """`have` plus every float projection, embedding and head of `dense` it lacks,
    quantized to `format_name` (rows of a multiple of 32 values only)."""
    out = dict(have)
    for name, tensor in dense.items():
        if (
            name not in out
            and quantizable(name)
            and tensor.dim() == 2
            and tensor.shape[1] % 32 == 0
        ):
            out[name] = quantize(tensor, format_name)
    return out


def attach_quant(
    model: CausalLM,
    quant: dict[str, QuantWeight],
    dense: dict[str, torch.Tensor],
    spans: dict[str, int] | None = None,
) -> set[str]:
    """Give every projection of `model` (a CausalLM) whose parts are all in `quant` a
    QuantLinear (its biases from `dense`, this shard's), and the embedding and LM head
    theirs when quantized; returns the Hugging Face names now served, which the dense
    load must skip. `spans`: the row-parallel projections' (by _FUSED name; see
    tensor_parallel.row_parallel_spans), which a shard of a group of several returns as
    float64 partial sums."""
    served: set[str] = set()
    spans = spans or {}
    for index, layer in enumerate(model.layers):
        for fused, parts in _FUSED.items():
            names = [f"model.layers.{index}.{p}.weight" for p in parts]
            if not all(n in quant for n in names):
                continue
            bias_names = [n.removesuffix("weight") + "bias" for n in names]
            biases = [dense[b] for b in bias_names if b in dense]
            bias = torch.cat(biases) if len(biases) == len(names) else None
            weights = [quant[n] for n in names]
            span = _span_for(weights[0], spans.get(fused))
            partial = fused in spans and model.shard.size > 1
            owner, attr = fused.split(".")
            setattr(getattr(layer, owner), attr, QuantLinear(weights, bias, span, partial))
            served |= set(names) | ({*bias_names} if bias is not None else set())
        served |= _attach_experts(model, index, quant, dense, spans)
    owned = {n: quant[n].owned() for n in (EMBEDDING, "lm_head.weight") if n in quant}
    if EMBEDDING in owned:
        model.embed_tokens = QuantEmbedding(owned[EMBEDDING], model.dtype)
        served.add(EMBEDDING)
    head = EMBEDDING if model.config.tie_word_embeddings else "lm_head.weight"
    if head in owned:
        model.lm_head = QuantLinear([owned[head]], None)  # tied: the same blocks, no copy
        served.add(head)
    return served


def _attach_experts(
    model: CausalLM,
    index: int,
    quant: dict[str, QuantWeight],
    dense: dict[str, torch.Tensor],
    spans: dict[str, int],
) -> set[str]:
    """Layer `index`'s routed experts (layers/moe.py) whose parts are all in `quant`, each
    projection a QuantLinear with its biases from `dense` where it has them (gpt-oss), as
    attach_quant gives the MLP's (the down projections row-parallel); the names now
    served."""
    served: set[str] = set()
    experts = getattr(model.layers[index].mlp, "experts", None)
    for number, expert in enumerate(experts or ()):
        for attr, parts in _EXPERT_FUSED.items():
            names = [f"model.layers.{index}.mlp.experts.{number}.{p}.weight" for p in parts]
            if not all(n in quant for n in names):
                continue
            weights = [quant[n] for n in names]
            key = "experts.down_proj" if attr == "down_proj" else ""
            span = _span_for(weights[0], spans.get(key))
            # float64 wherever groups split experts, in a shard or a whole model: each
            # expert's share is weighted before the sum, and rounding it to float32
            # first (as a whole model would) cannot be done by a shard.
            partial = key in spans
            bias_names = [n.removesuffix("weight") + "bias" for n in names]
            biases = [dense[b] for b in bias_names if b in dense]
            bias = torch.cat(biases) if len(biases) == len(names) else None
            setattr(expert, attr, QuantLinear(weights, bias, span, partial))
            served |= set(names) | (set(bias_names) if bias is not None else set())
    return served


def _span_for(weight: QuantWeight, span: int | None) -> int | None:
    """`span` where the weight's blocks tile it (None, the whole row, elsewhere: a K-quant
    weight cannot be split on a span of 32-value blocks anyway)."""
    if span is None or span % weight.format.values != 0 or weight.in_features % span != 0:
        return None
    return span
