"""The triton_kernel section's other kernels: the handoff's one-launch KV block copy
(triton_kv_copy) against torch indexing, and the quantized GEMV and GEMM (triton_quant)
over Q8_0 and Q4_0 weights against their float64 dequantized product; on CUDA each also
timed (the copy beside the strided copy_ per block it replaces, the GEMV as weight GB/s).
Under the interpreter (the dry run) small shapes, no measure of speed.

The dequantizing here is torch's own (d * q, d * (q - 8)): the GPU image may lack the
CPU kernels quant.py's dequantizer calls."""

from __future__ import annotations

import math
from typing import Any

import torch

from .measure import best_seconds
from .scale import Scale


def extra_cases(scale: Scale) -> dict[str, dict[str, Any]]:
    """Each case's figures, with `ok` whether it passed."""
    cases = {"kv_copy": kv_copy_case(scale)}
    for name in ("Q8_0", "Q4_0"):
        for product in ("gemv", "gemm"):
            cases[f"{name} {product}"] = quant_case(scale, name, product)
    return cases


def kv_copy_case(scale: Scale) -> dict[str, Any]:
    """A scattered 4k-token handoff (256 blocks, ids never consecutive) between two bf16
    pools of Llama 3 8B's KV shape (4 layers on the GPU, 2 tiny ones in the dry run):
    the kernel's copy must equal torch indexing's, bit for bit."""
    from appliance.kv import handoff

    layers, blocks, heads, dim = (4, 256, 8, 128) if scale.cuda else (2, 16, 1, 8)
    shape = (layers, 2, 2 * blocks + 1, 16, heads, dim)
    src = torch.randn(shape, device=scale.device).to(torch.bfloat16)
    dst = torch.zeros_like(src)
    src_ids = [2 * i + 1 for i in range(blocks)]
    dst_ids = [2 * i + 2 for i in range(blocks)]
    handoff.copy_blocks(src, src_ids, dst, dst_ids, kernel="triton")
    ok = torch.equal(dst[:, :, dst_ids], src[:, :, src_ids]) and not dst[:, :, 0].any()
    row: dict[str, Any] = {"ok": bool(ok), "blocks": blocks, "layers": layers}
    if scale.cuda:
        nbytes = blocks * src[:, :, :1].numel() * src.element_size()
        for kernel in ("triton", "runs"):
            seconds = best_seconds(
                lambda k=kernel: handoff.copy_blocks(src, src_ids, dst, dst_ids, kernel=k),
                scale.device,
                scale.repeats,
            )
            row[f"{kernel}_us"] = round(seconds * 1e6, 1)
            row[f"{kernel}_gb_per_s"] = round(nbytes / seconds / 1e9, 1)
    return row


def _quantized(name: str, rows: int, columns: int, device: torch.device) -> tuple[Any, ...]:
    """Random Q8_0 or Q4_0 blocks [rows, bytes] on `device` and their float64 weight."""
    from appliance.model import quant

    weight = quant.quantize(torch.randn(rows, columns), name)
    raw = weight.blocks.view(rows, columns // 32, -1)  # [rows, blocks, block bytes]
    d = raw[..., :2].contiguous().view(torch.float16).double()  # [rows, blocks, 1]
    if name == "Q8_0":
        q = raw[..., 2:].contiguous().view(torch.int8).double()
    else:
        packed = raw[..., 2:].long()
        q = torch.cat([packed & 15, packed >> 4], dim=-1).double() - 8
    dense = (d * q).view(rows, columns)
    return weight.blocks.to(device), dense.to(device), weight.format.ggml_id


def quant_case(scale: Scale, name: str, product: str) -> dict[str, Any]:
    """quant_gemv (1 row) or quant_gemm (64 rows) at 4096 x 4096 in bf16 (256 x 256 in
    the dry run) against float64 over the dequantized weight; the GEMV timed on CUDA."""
    from appliance.model.layers import triton_quant

    width = 4096 if scale.cuda else 256
    tokens = 64 if product == "gemm" else 1
    blocks, dense, ggml_id = _quantized(name, width, width, scale.device)
    x = torch.randn(tokens, width, device=scale.device).to(torch.bfloat16)
    run = triton_quant.quant_gemm if product == "gemm" else triton_quant.quant_gemv
    out = run(x, blocks, ggml_id, width)
    reference = x.double() @ dense.T
    error = float((out.double() - reference).abs().max() / reference.abs().max())
    # bf16 output rounding (2^-8), and in the GEMM the weight's (2^-9 a term)
    tolerance = 1.6e-2 if product == "gemm" else 8e-3
    row: dict[str, Any] = {
        "ok": math.isfinite(error) and error <= tolerance,
        "error": error,
        "tolerance": tolerance,
    }
    if scale.cuda and product == "gemv":
        seconds = best_seconds(lambda: run(x, blocks, ggml_id, width), scale.device, scale.repeats)
        row["us"] = round(seconds * 1e6, 1)
        row["weight_gb_per_s"] = round(blocks.numel() / seconds / 1e9, 1)
    return row
