"""The kernels between a layer's projections: the residual add fused with the RMSNorm
after it (add_rms_norm, csrc/add_rms_norm.c) and the MLP's SiLU-gated product (silu_mul,
csrc/silu_mul.c), each with the check that says whether it takes given tensors
(`*_takes()`; else the model runs torch ops).

An add and a norm as torch ops are several passes and dispatches per layer, whose fixed
costs dominate on the CPU at decode sizes (benchmarks/cpu_kernels_bench.py).
"""

from __future__ import annotations

import torch

from appliance.model.cpu_kernels.loading import DTYPES, compiled, threads


def _norm_problem(x: torch.Tensor | None, residual: torch.Tensor, weight: torch.Tensor) -> str:
    """Why add_rms_norm() cannot take these tensors, or "" when it can."""
    if compiled() is None or residual.device.type != "cpu" or residual.dtype not in DTYPES:
        return "the kernel runs float32 or bfloat16 CPU tensors"
    if residual.dim() != 2 or residual.shape[1] == 0 or residual.shape[1] % 16:
        return f"rows {tuple(residual.shape)} are not [rows, a multiple of 16]"
    if not residual.is_contiguous():
        return "the residual must be contiguous: it is updated in place"
    if weight.shape != residual.shape[1:] or weight.dtype != residual.dtype:
        return f"norm weight {tuple(weight.shape)} does not fit rows of {residual.shape[1]}"
    if x is not None and (x.shape != residual.shape or x.dtype != residual.dtype):
        return f"cannot add {tuple(x.shape)} to a residual {tuple(residual.shape)}"
    if any(t is not None and t.device != residual.device for t in (x, weight)):
        return "the addend and the weight must be on the residual's device"
    return ""


def norm_takes(x: torch.Tensor | None, residual: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether add_rms_norm() can run on these."""
    return not _norm_problem(x, residual, weight)


def add_rms_norm(
    x: torch.Tensor | None,
    residual: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    checked: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """residual += x (in place; x None adds nothing), then (rms_norm(residual) * weight,
    residual). Both [rows, dim], weight [dim], one dtype. `checked`: norm_takes() said
    yes to these tensors, so they are not checked again (a decode step's hot path)."""
    problem = "" if checked else _norm_problem(x, residual, weight)
    if problem:
        raise ValueError(problem)
    x = None if x is None else x.contiguous()
    weight = weight.contiguous()
    out = torch.empty_like(residual)
    kernels = compiled()
    assert kernels is not None  # norm_takes() found them loaded
    kernels.add_rms_norm(
        0 if x is None else x.data_ptr(),
        weight.data_ptr(),
        residual.data_ptr(),
        out.data_ptr(),
        residual.shape[0],
        residual.shape[1],
        eps,
        DTYPES[residual.dtype],
        threads(),
    )
    return out, residual


def silu_takes(gate_up: torch.Tensor) -> bool:
    """Whether silu_mul() can take `gate_up`: contiguous float32 or bfloat16 CPU rows
    whose halves are a multiple of 16 wide."""
    return (
        compiled() is not None
        and gate_up.device.type == "cpu"
        and gate_up.dtype in DTYPES
        and gate_up.dim() == 2
        and gate_up.is_contiguous()
        and gate_up.shape[1] % 32 == 0
    )


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up [rows, 2 * inter] -> silu(gate) * up [rows, inter], computed in place into
    its first half (returned as a view; csrc/silu_mul.c), as the compiled step does."""
    if not silu_takes(gate_up):
        raise ValueError("gate_up must be contiguous [rows, 2 * inter] float32 or bfloat16 "
                         "CPU rows, inter a multiple of 16")  # fmt: skip
    rows, inter = gate_up.shape[0], gate_up.shape[1] // 2
    kernels = compiled()
    assert kernels is not None  # silu_takes() found them loaded
    kernels.silu_mul(gate_up.data_ptr(), rows, inter, DTYPES[gate_up.dtype], threads())
    return gate_up[:, :inter]
