"""Analytic profiles: a GPU box's step costs from a datasheet and a model's shapes, so a
user can plan an 8-GPU box before buying or profiling it.

A step's time is a roofline: the larger of its math at an achievable share of the peak
FLOP/s and its memory traffic at an achievable share of the HBM bandwidth, plus a fixed
per-step overhead and, for a tensor-parallel worker, two all-reduces per layer over the
GPUs' link. The profile's StepCost is linear, so each step kind takes the line of the
regime it runs in (see `_prefill`, `_decode`, `_mixed`); every assumption is written into
the profile (`Profile.assumptions`) and `Profile.analytic` is set.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from appliance.planner.analytic_specs import (
    GPUS,
    MODEL_SHAPES,
    Efficiency,
    GpuSpec,
    ModelShape,
)
from appliance.planner.profile import (
    HandoffCost,
    HostCost,
    Profile,
    ProfileKey,
    StepCost,
    WorkerCost,
    worker_unit,
)

__all__ = [
    "GPUS",
    "MODEL_SHAPES",
    "Efficiency",
    "GpuSpec",
    "ModelShape",
    "analytic_profile",
    "gpu_spec",
    "kv_blocks",
    "model_shape",
    "network_link",
    "tp_degrees",
    "worker_cost",
]

TP_DEGREES = (1, 2, 4, 8)
BLOCK_SIZE = 16
GIB = 1024**3
# The share of a network link's line rate a KV handoff gets: RDMA reads of large,
# registered buffers (NIXL over UCX on InfiniBand or RoCE) reach ~80-90% of line rate
# after headers and per-message gaps; KV scattered over blocks sends many mid-sized
# messages, hence the low end.
NETWORK_EFFICIENCY = 0.8
# A cross-box handoff's fixed part: the in-box handoff's 1 ms of control messages plus
# the head's request to the agent box and the read's completion notice (a TCP round trip
# and a NIXL notification each, ~0.1-0.3 ms on a datacenter network).
NETWORK_LATENCY_US = 1500.0


@dataclass(frozen=True)
class _Roofline:
    """The per-GPU rates of one worker of `tp` GPUs running `shape`."""

    shape: ModelShape
    gpu: GpuSpec
    eff: Efficiency
    tp: int

    @property
    def flops(self) -> float:  # achievable GEMM FLOP/s of the whole worker
        return self.gpu.bf16_tflops * 1e12 * self.eff.mfu * self.tp

    @property
    def attention_flops(self) -> float:
        return self.gpu.bf16_tflops * 1e12 * self.eff.attention_mfu * self.tp

    @property
    def bandwidth(self) -> float:  # achievable HBM bytes/s of the whole worker
        return self.gpu.hbm_gb_s * 1e9 * self.eff.hbm * self.tp

    def weights_s(self) -> float:
        """Reading every weight once (each GPU its 1/tp share, all at once)."""
        return self.shape.weight_bytes() / self.bandwidth

    def token_flops_s(self) -> float:
        """The GEMMs of one query token through every layer (not the LM head)."""
        return 2 * self.shape.layer_params() / self.flops

    def head_s(self) -> float:
        """One sequence's logits: the LM head GEMM for its last token."""
        return 2 * self.shape.hidden * self.shape.vocab / self.flops

    def attended_s(self) -> float:
        """One query-key pair through every layer: QK^T and PV, 2 FLOPs per dim each."""
        shape = self.shape
        return 4 * shape.layers * shape.heads * shape.dim / self.attention_flops

    def context_s(self) -> float:
        """A decode reading one cached token's K and V in every layer."""
        return self.shape.kv_bytes_per_token() / self.bandwidth

    def allreduce_base_s(self) -> float:
        """The latency of a step's all-reduces: two per layer (attention out, MLP out)."""
        if self.tp == 1:
            return 0.0
        return 2 * self.shape.layers * self.gpu.link_latency_us * 1e-6

    def allreduce_token_s(self) -> float:
        """One token's activations through a ring all-reduce, two per layer: each GPU
        sends and receives 2(t-1)/t of the bytes at the link's one-way bandwidth."""
        if self.tp == 1:
            return 0.0
        one_way = self.gpu.link_gb_s * 1e9 / 2 * self.eff.link
        message = self.shape.hidden * self.shape.dtype_bytes
        return 2 * self.shape.layers * 2 * (self.tp - 1) / self.tp * message / one_way


def _prefill(roof: _Roofline, overhead_s: float) -> StepCost:
    """Prompt chunks alone run compute-bound: max(math, weights) is the math once a step
    has more than about `knee_tokens` tokens (~120 on an A100), so the line is the math's
    tangent. Below the knee the step really takes the weight read: the line is low there
    (optimistic for short prompts, the same for every layout)."""
    return StepCost(
        base_s=overhead_s + roof.allreduce_base_s(),
        per_token_s=roof.token_flops_s() + roof.allreduce_token_s(),
        per_seq_s=roof.head_s(),
        per_attended_s=roof.attended_s(),
    )


def _decode(roof: _Roofline, overhead_s: float, max_batch: int) -> StepCost:
    """Decodes alone run memory-bound: every step reads all weights, then each
    sequence's KV. The math of a batch overtakes the weight read only past the knee;
    where that happens inside `max_batch` the per-sequence cost is the chord of max()
    from batch 1 to `max_batch` (an upper bound of it in between)."""
    weights = roof.weights_s()
    per_seq_math = roof.token_flops_s() + roof.head_s()
    per_seq = 0.0
    if per_seq_math * max_batch > weights:  # compute overtakes inside the batch range
        per_seq = (per_seq_math * max_batch - weights) / max(1, max_batch - 1)
    return StepCost(
        base_s=overhead_s + roof.allreduce_base_s() + weights,
        per_token_s=roof.allreduce_token_s(),
        per_seq_s=per_seq,
        per_context_s=roof.context_s(),
    )


def _mixed(roof: _Roofline, overhead_s: float) -> StepCost:
    """A colocated step (prompt chunks beside decodes) is the prefill tangent (every
    token's math, the decodes' one token each included) plus the decodes' KV reads,
    which are a memory-bound attention kernel of their own, not hidden by the GEMMs."""
    prefill = _prefill(roof, overhead_s)
    return prefill.model_copy(update={"per_context_s": roof.context_s()})


def tp_degrees(gpus: int) -> tuple[int, ...]:
    """The TP degrees a box of `gpus` GPUs can form."""
    return tuple(t for t in TP_DEGREES if t <= gpus)


def kv_blocks(shape: ModelShape, gpu: GpuSpec, eff: Efficiency, tp: int) -> int:
    """KV blocks of one worker of `tp` GPUs: each GPU's usable share of its memory, less
    its weight shard and an activation reserve, over its shard of a block."""
    usable = gpu.memory_gb * 1e9 * eff.memory_utilization
    free = usable - shape.weight_bytes() / tp - eff.reserve_gib * GIB
    block = shape.kv_bytes_per_token() * BLOCK_SIZE / tp
    return max(0, math.floor(free / block))


def worker_cost(
    shape: ModelShape, gpu: GpuSpec, eff: Efficiency, tp: int, max_batch: int = 64
) -> WorkerCost | None:
    """The costs of a worker of `tp` GPUs; None where it cannot run the model (its heads
    do not split `tp` ways, or its memory does not hold the weights and one longest
    sequence's KV)."""
    if shape.heads % tp:
        return None
    blocks = kv_blocks(shape, gpu, eff, tp)
    if blocks < math.ceil(shape.max_model_len / BLOCK_SIZE):
        return None
    roof = _Roofline(shape, gpu, eff, tp)
    overhead = eff.step_overhead_us * 1e-6
    return WorkerCost(
        prefill=_prefill(roof, overhead),
        decode=_decode(roof, overhead, max_batch),
        mixed=_mixed(roof, overhead),
        kv_blocks=blocks,
    )


def network_link(
    gbps: float, latency_us: float = NETWORK_LATENCY_US, efficiency: float = NETWORK_EFFICIENCY
) -> HandoffCost:
    """The link between two boxes as a handoff cost: a NIC of `gbps` gigabits per second
    (line rate) at `efficiency` of it (see NETWORK_EFFICIENCY), `latency_us` per handoff."""
    if not (math.isfinite(gbps) and gbps > 0):
        raise ValueError(f"a network link needs a finite positive speed in Gb/s, got {gbps}")
    if not (math.isfinite(latency_us) and latency_us >= 0):
        raise ValueError(f"a network link's latency must be >= 0 us, got {latency_us}")
    if not 0 < efficiency <= 1:
        raise ValueError(f"a network link's efficiency must be in (0, 1], got {efficiency}")
    return HandoffCost(base_s=latency_us * 1e-6, per_byte_s=8 / (gbps * 1e9) / efficiency)


def analytic_profile(
    gpu: GpuSpec | str,
    gpus: int,
    shape: ModelShape | str,
    eff: Efficiency | None = None,
    max_batch: int = 64,
    link_gbps: float | None = None,
) -> Profile:
    """A profile of a box of `gpus` GPUs of kind `gpu` serving a model of `shape`, with a
    worker unit for every TP degree that fits; ValueError when none does. `link_gbps`:
    the network link to a second such box (`Profile.network`, see `network_link`)."""
    gpu = gpu_spec(gpu) if isinstance(gpu, str) else gpu
    shape = model_shape(shape) if isinstance(shape, str) else shape
    eff = eff or Efficiency()
    if gpus < 1:
        raise ValueError(f"a box needs at least one GPU, got {gpus}")
    network = network_link(link_gbps) if link_gbps is not None else None
    workers = {}
    for tp in tp_degrees(gpus):
        cost = worker_cost(shape, gpu, eff, tp, max_batch)
        if cost is not None:
            workers[worker_unit(1, tp)] = cost
    if not workers:
        raise ValueError(
            f"{shape.name} ({shape.weight_bytes() / 1e9:.0f} GB of weights) fits no worker "
            f"of up to {max(tp_degrees(gpus))} {gpu.name} GPUs of {gpu.memory_gb:.0f} GB"
        )
    return Profile(
        key=ProfileKey(
            model=f"{shape.name} (analytic)",
            dtype="bfloat16",
            weights="dense",
            device_kind=f"analytic: {gpus}x {gpu.name}",
        ),
        atoms=gpus,
        block_size=BLOCK_SIZE,
        kv_bytes_per_token=shape.kv_bytes_per_token(),
        max_model_len=shape.max_model_len,
        workers=workers,
        handoff=_handoff(shape, gpu, eff),
        host=HostCost(per_step_s=eff.host_step_us * 1e-6, per_token_s=eff.host_token_us * 1e-6),
        network=network,
        analytic=True,
        assumptions=_assumptions(shape, gpu, eff, gpus, max_batch) + _link_assumption(link_gbps),
    )


def _link_assumption(gbps: float | None) -> tuple[str, ...]:
    if gbps is None:
        return ()
    return (
        f"network link between two boxes: {gbps:g} Gb/s at {NETWORK_EFFICIENCY:g} of line "
        f"rate, {NETWORK_LATENCY_US:g} us per handoff; one link: cross-box handoffs "
        "queue on it",
    )


def _handoff(shape: ModelShape, gpu: GpuSpec, eff: Efficiency) -> HandoffCost:
    # One GPU pair's one-way link (a TP pool's shards would move in parallel: conservative).
    one_way = gpu.link_gb_s * 1e9 / 2 * eff.link
    return HandoffCost(base_s=eff.handoff_base_us * 1e-6, per_byte_s=1 / one_way)


def gpu_spec(name: str) -> GpuSpec:
    """A GPU preset by name; ValueError naming the presets."""
    if name not in GPUS:
        raise ValueError(f"unknown GPU {name!r}; choose one of {', '.join(GPUS)}")
    return GPUS[name]


def model_shape(name: str) -> ModelShape:
    """A model shape preset by name; ValueError naming the presets."""
    if name not in MODEL_SHAPES:
        raise ValueError(f"unknown model shape {name!r}; choose one of {', '.join(MODEL_SHAPES)}")
    return MODEL_SHAPES[name]


def _assumptions(
    shape: ModelShape, gpu: GpuSpec, eff: Efficiency, gpus: int, max_batch: int
) -> tuple[str, ...]:
    roof = _Roofline(shape, gpu, eff, 1)
    knee = roof.weights_s() / (roof.token_flops_s() + roof.head_s())
    return (
        f"analytic, not measured: {gpus}x {gpu.name} ({gpu.source}): "
        f"{gpu.bf16_tflops:g} TFLOP/s bf16 dense, {gpu.hbm_gb_s:g} GB/s HBM, "
        f"{gpu.memory_gb:g} GB, {gpu.link} {gpu.link_gb_s:g} GB/s both ways, "
        f"{gpu.link_latency_us:g} us per collective",
        f"model {shape.name} ({shape.source}): {shape.params() / 1e9:.2f}B params in "
        f"bf16, {shape.kv_bytes_per_token()} KV bytes per token, "
        f"max_model_len {shape.max_model_len}",
        f"achievable: {eff.mfu:g} of peak FLOP/s for GEMMs, {eff.attention_mfu:g} for "
        f"attention, {eff.hbm:g} of HBM bandwidth, {eff.link:g} of link bandwidth",
        f"per step: {eff.step_overhead_us:g} us launch and scheduling overhead; host "
        f"{eff.host_step_us:g} us per step, {eff.host_token_us:g} us per streamed token",
        "prefill and mixed steps: the compute-bound tangent of max(math, weight read); "
        f"steps under ~{knee:.0f} tokens are weight-read bound and predicted too fast",
        f"decode steps: weight read + KV read; compute adds only where it overtakes the "
        f"weight read within a batch of {max_batch} (chord of max() from 1 to {max_batch})",
        "tensor parallel: weights, KV and math split evenly over t GPUs; 2 ring "
        "all-reduces of each token's hidden state per layer; no pipeline parallelism",
        f"KV pool per GPU: {eff.memory_utilization:g} of memory less the weight shard "
        f"and {eff.reserve_gib:g} GiB for activations, CUDA context and NCCL buffers; "
        "a TP degree is offered where it holds one max_model_len sequence",
        f"KV handoff: {eff.handoff_base_us:g} us + bytes over one GPU pair's one-way "
        "link at the achievable share, not overlapped with prefill",
    )
