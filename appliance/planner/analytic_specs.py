"""What analytic profiles (planner/analytic.py) start from: GPU datasheets, model shapes and
the achievable shares of the peaks. Constants, each with where it comes from."""

from __future__ import annotations

from dataclasses import dataclass
from types import MappingProxyType


@dataclass(frozen=True)
class GpuSpec:
    """One GPU's datasheet numbers. `link_gb_s` is the GPU-to-GPU bandwidth both ways
    together, as datasheets state it (NVLink 600 GB/s = 300 GB/s each way)."""

    name: str
    bf16_tflops: float  # dense, without structured sparsity
    hbm_gb_s: float
    memory_gb: float
    link: str  # "NVLink" or "PCIe"
    link_gb_s: float
    link_latency_us: float  # one small all-reduce, or a copy's start
    source: str


# PCIe boxes: Gen4 x16 is 64 GB/s both ways; all-reduces cross the host bridge, hence
# the higher latency. The RTX 4090's driver disables peer-to-peer, so its traffic is
# staged through host memory: half the bandwidth.
GPUS: MappingProxyType[str, GpuSpec] = MappingProxyType(
    {
        "a100-80gb-sxm": GpuSpec(
            "NVIDIA A100-80GB SXM",
            312,
            2039,
            80,
            "NVLink",
            600,
            8,
            "NVIDIA A100 datasheet (2021): bf16 312 TFLOP/s dense, 2,039 GB/s HBM2e, "
            "NVLink 600 GB/s",
        ),
        "a100-40gb-pcie": GpuSpec(
            "NVIDIA A100-40GB PCIe",
            312,
            1555,
            40,
            "PCIe",
            64,
            25,
            "NVIDIA A100 datasheet (2021): 1,555 GB/s HBM2, PCIe Gen4 64 GB/s",
        ),
        "h100-80gb-sxm": GpuSpec(
            "NVIDIA H100-80GB SXM",
            989,
            3350,
            80,
            "NVLink",
            900,
            6,
            "NVIDIA H100 datasheet: bf16 989 TFLOP/s dense (1,979 sparse), 3.35 TB/s HBM3, "
            "NVLink 900 GB/s",
        ),
        "h200": GpuSpec(
            "NVIDIA H200 SXM",
            989,
            4800,
            141,
            "NVLink",
            900,
            6,
            "NVIDIA H200 datasheet: bf16 989 TFLOP/s dense, 4.8 TB/s HBM3e, 141 GB, "
            "NVLink 900 GB/s",
        ),
        "l40s": GpuSpec(
            "NVIDIA L40S",
            362,
            864,
            48,
            "PCIe",
            64,
            25,
            "NVIDIA L40S datasheet: bf16 362 TFLOP/s dense (733 sparse), 864 GB/s GDDR6, "
            "no NVLink, PCIe Gen4 x16",
        ),
        "rtx-4090": GpuSpec(
            "NVIDIA GeForce RTX 4090",
            165,
            1008,
            24,
            "PCIe",
            32,
            30,
            "vendor datasheet (Ada whitepaper): bf16 tensor 165 TFLOP/s dense with fp32 "
            "accumulate, 1,008 GB/s GDDR6X; PCIe only, no peer-to-peer",
        ),
    }
)


@dataclass(frozen=True)
class Efficiency:
    """Achievable shares of the peaks and fixed costs (stated in every profile).

    mfu 0.6: large bf16 GEMMs reach 60-70% of an A100's peak in serving engines' prefill;
    attention_mfu 0.5: FlashAttention-2's forward reaches ~50-70%; hbm 0.8: decode GEMVs
    stream weights at ~80% of peak HBM bandwidth; link 0.7: NCCL's measured bus
    bandwidth on NVLink is ~70-80% of the link's; memory_utilization 0.9 as vLLM's
    gpu_memory_utilization (ours too); step_overhead 2 ms: scheduling, sampling and kernel
    launches of a step without CUDA graphs."""

    mfu: float = 0.6
    attention_mfu: float = 0.5
    hbm: float = 0.8
    link: float = 0.7
    memory_utilization: float = 0.9
    reserve_gib: float = 2.0
    step_overhead_us: float = 2000.0
    host_step_us: float = 200.0
    host_token_us: float = 20.0
    handoff_base_us: float = 1000.0

    def __post_init__(self) -> None:
        for name in ("mfu", "attention_mfu", "hbm", "link", "memory_utilization"):
            value = getattr(self, name)
            if not 0 < value <= 1:
                raise ValueError(f"efficiency {name} must be in (0, 1], got {value}")


@dataclass(frozen=True)
class ModelShape:
    """A dense decoder's shapes: enough for its FLOPs, weight bytes and KV bytes."""

    name: str
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    ffn: int
    vocab: int
    gated_mlp: bool  # SwiGLU (gate, up, down) or a plain 2-matrix MLP (OPT)
    tied_embeddings: bool
    max_model_len: int
    source: str
    head_dim: int = 0  # 0: hidden / heads
    learned_positions: int = 0  # OPT's position embedding table
    dtype_bytes: int = 2

    @property
    def dim(self) -> int:
        return self.head_dim or self.hidden // self.heads

    def layer_params(self) -> int:
        """Parameters a token multiplies through the layers (norms and biases left out)."""
        q_out = self.heads * self.dim
        kv_out = 2 * self.kv_heads * self.dim
        attention = self.hidden * (q_out + kv_out) + q_out * self.hidden
        mlp = (3 if self.gated_mlp else 2) * self.hidden * self.ffn
        return self.layers * (attention + mlp)

    def params(self) -> int:
        embeddings = self.vocab * self.hidden * (1 if self.tied_embeddings else 2)
        return self.layer_params() + embeddings + self.learned_positions * self.hidden

    def weight_bytes(self) -> int:
        return self.params() * self.dtype_bytes

    def kv_bytes_per_token(self) -> int:
        """K and V of every layer for one token, the whole model."""
        return 2 * self.layers * self.kv_heads * self.dim * self.dtype_bytes


_HF = "the model's config.json on Hugging Face"
MODEL_SHAPES: MappingProxyType[str, ModelShape] = MappingProxyType(
    {
        "opt-13b": ModelShape(
            "opt-13b",
            5120,
            40,
            40,
            40,
            20480,
            50272,
            False,
            True,
            2048,
            f"facebook/opt-13b: {_HF} (ReLU MLP of 4x hidden)",
            learned_positions=2050,
        ),
        "llama-2-13b": ModelShape(
            "llama-2-13b",
            5120,
            40,
            40,
            40,
            13824,
            32000,
            True,
            False,
            4096,
            f"meta-llama/Llama-2-13b-hf: {_HF}",
        ),
        "llama-3-8b": ModelShape(
            "llama-3-8b",
            4096,
            32,
            32,
            8,
            14336,
            128256,
            True,
            False,
            8192,
            f"meta-llama/Meta-Llama-3-8B: {_HF}",
        ),
        "llama-3-70b": ModelShape(
            "llama-3-70b",
            8192,
            80,
            64,
            8,
            28672,
            128256,
            True,
            False,
            8192,
            f"meta-llama/Meta-Llama-3-70B: {_HF}",
        ),
        "qwen3-8b": ModelShape(
            "qwen3-8b",
            4096,
            36,
            32,
            8,
            12288,
            151936,
            True,
            False,
            32768,
            f"Qwen/Qwen3-8B: {_HF}",
            head_dim=128,
        ),
        "smollm2-135m": ModelShape(
            "smollm2-135m",
            576,
            30,
            9,
            3,
            1536,
            49152,
            True,
            True,
            8192,
            "the appliance's embedded default model (HuggingFaceTB/SmolLM2-135M-Instruct)",
        ),
    }
)
