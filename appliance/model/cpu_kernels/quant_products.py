"""Matrix products with block-quantized weights read in place (csrc/quant_matmul.c), in
GGML's block formats: QuantMatrix (a weight checked once, multiplied many times),
quant_matmul() (one product) and quant_rows() (rows dequantized, as an embedding reads
them). Dense float weights would be several times the bytes a decode step reads. A
prefill's products dequantize for torch's GEMM or run the int16 GEMM (csrc/quant_gemm.c):
see GEMM_ROWS.
"""

from __future__ import annotations

import torch

from appliance.model.cpu_kernels.loading import DTYPES, OUT_DTYPES, compiled, threads


def quant_takes(x: torch.Tensor) -> bool:
    """Whether quant_matmul() can take activations `x` [rows, in]: float32 or bfloat16 CPU
    rows whose values are contiguous."""
    return (
        compiled() is not None
        and x.device.type == "cpu"
        and x.dtype in DTYPES
        and x.dim() == 2
        and x.stride(1) == 1
    )


GEMM_ROWS = 128
"""The default row count from which a product of float32 activation rows dequantizes the
weight and runs a GEMM instead of the integer kernel (QuantMatrix's `gemm_rows`; a model's
own count is the `prefill_gemm_rows` setting, loading.prefill_gemm_rows()). The integer
kernel's work grows with the rows; a GEMM blocked for the caches overtakes it, dequantizing
included, somewhere between 16 and 128 rows, where depends on the CPU and the GEMM's type
(about 64 rows at float32 on a Zen 4; far lower in bfloat16 on a Xeon with AMX): see
loading.GEMM_ROWS_BY_LEVEL and benchmarks/gemm_rows_bench.py. Below it the integer kernel
reads the blocks in place, and a row's result does not depend on what it is batched with.

A model switches on the rows of its step's prompt chunks only (quant.PrefillGemm): a
decode-only step stays on the integer kernel whatever its batch, as the compiled decode
step does, so a decoding sequence's numbers do not depend on how many others decode
beside it; in a mixed step whose prompt rows reach the count, its decode rows ride in the
same GEMM (as they did at 128).

The GEMM runs in float32 or, where `gemm_dtype` says so (prefill_gemm_dtype()), in
bfloat16: weight and activations rounded to bfloat16 and so is each product, about 2^-9
of it (float32's GEMM: 2^-24), for 2.4x the prefill speed on CPUs with AVX512-BF16.
torch.int16 is the integer GEMM (csrc/quant_gemm.c) instead, for Q4_0, Q4_1 and Q8_0
weights: activations quantized per 32 values to int16 times the weights' small integers,
exact int32 sums per block, about 1e-4 of sum |w| |x| relative error (1e-5 measured), for
1.45-1.7x the speed of float32's GEMM, dequantizing included, on AVX2 CPUs, where that
GEMM is at the FMA peak (a Zen 4 held to AVX2, 512 rows, SmolLM2's shapes: 1.3-1.45x the
whole prefill)."""

GEMM_FORMATS = frozenset({2, 3, 8})
"""The GGML formats (Q4_0, Q4_1, Q8_0: one scale per 32 values) the int16 GEMM takes."""


def _check_blocks(blocks: torch.Tensor) -> None:
    """The kernel reads a weight's rows of blocks as one contiguous uint8 array."""
    if blocks.dtype != torch.uint8 or blocks.dim() != 2 or not blocks.is_contiguous():
        raise ValueError("the weight's blocks must be a contiguous 2-D uint8 tensor")


class QuantMatrix:
    """A block-quantized weight W [out_features, in] (`blocks` [out_features, row bytes]
    uint8 in GGML format `format_id`, one row of blocks per output feature) and its
    optional float32 `bias`, checked once: a product then checks only its activations,
    which a decode step multiplies a hundred times.

    A product sums each output over `span` inputs at a time in float32 (default: all of
    them) and those sums in float64. A row-parallel projection takes the span its
    tensor-parallel splits fall on: a shard then computes the same span sums, and with
    `partial` returns their float64 total for the group's all-reduce, which rounds to what
    the whole product gives (float32 totals of a few float32 sums are exact in float64)."""

    def __init__(
        self,
        blocks: torch.Tensor,
        format_id: int,
        in_features: int,
        bias: torch.Tensor | None = None,
        span: int | None = None,
        partial: bool = False,
    ) -> None:
        _check_blocks(blocks)
        n = blocks.shape[0]
        if bias is not None and (bias.dtype != torch.float32 or bias.shape != (n,)):
            raise ValueError(f"bias must be [{n}] float32")
        span = in_features if span is None else span
        if span < 1 or in_features % span:
            raise ValueError(f"span {span} does not divide the {in_features} inputs")
        if partial and bias is not None:
            raise ValueError("a partial product (a row-parallel shard's) takes no bias")
        self.blocks = blocks
        self.bias = None if bias is None else bias.contiguous()
        self.format_id = format_id
        self.in_features = in_features
        self.out_features = n
        self.span = span
        self.partial = partial

    def __call__(
        self,
        x: torch.Tensor,
        out: torch.Tensor | None = None,
        precise: bool = True,
        gemm_dtype: torch.dtype = torch.float32,
        gemm_rows: int | None = GEMM_ROWS,
    ) -> torch.Tensor:
        """x [rows, in] @ W.T (+ bias) -> [rows, out_features] in x's dtype (float64 when
        `partial`). `out` may be a column slice of a wider tensor (rows apart by its
        stride). `precise` carries the activations as two int8 parts (about 16 bits; see
        csrc/quant_matmul.c), else one (llama.cpp's 8); `gemm_dtype` is the type a product
        of `gemm_rows` float32 rows or more multiplies in (GEMM_ROWS' docstring; None:
        never, the integer kernel for any rows): float32, bfloat16, or int16 (the integer
        GEMM; float32 for a weight it does not take: another format, a span or a partial
        product, or at the generic level). The kernel checks the format, sizes, span and
        strides."""
        if not quant_takes(x):
            raise ValueError("x must be [rows, in] float32 or bfloat16 on the CPU, rows contiguous")
        if x.shape[1] != self.in_features:
            raise ValueError(f"x has {x.shape[1]} features, the weight takes {self.in_features}")
        rows, n = x.shape[0], self.out_features
        out_dtype = torch.float64 if self.partial else x.dtype
        if out is not None and (
            out.shape != (rows, n) or out.dtype != out_dtype or out.stride(1) != 1
        ):
            raise ValueError(f"out must be [{rows}, {n}] {out_dtype}, rows contiguous")
        if gemm_rows is not None and rows >= gemm_rows and x.dtype == torch.float32:
            if gemm_dtype == torch.int16 and self._int16_takes():
                return self._by_int16(x, out)
            return self._by_gemm(x, out, torch.float32 if gemm_dtype == torch.int16 else gemm_dtype)
        if out is None:
            out = torch.empty(rows, n, dtype=out_dtype)
        return self._by_kernel(x, out, precise)

    def _by_kernel(self, x: torch.Tensor, out: torch.Tensor, precise: bool) -> torch.Tensor:
        """The product by the integer kernel, into `out` (checked by __call__)."""
        kernels = compiled()
        assert kernels is not None  # quant_takes() found them loaded
        kernels.quant_matmul(
            x.data_ptr(),
            self.blocks.data_ptr(),
            0 if self.bias is None else self.bias.data_ptr(),
            out.data_ptr(),
            x.shape[0],
            self.out_features,
            self.in_features,
            self.blocks.shape[1],
            x.stride(0),
            out.stride(0),
            self.span,
            self.format_id,
            DTYPES[x.dtype],
            OUT_DTYPES[out.dtype],
            threads(),
            int(precise),
        )
        return out

    def _int16_takes(self) -> bool:
        """Whether the int16 GEMM takes this weight: its formats, whole rows summed at once
        (it has no span sums), a float32 result; and whether it is worth it here: the
        generic build's is plain C, 8x slower than float32's GEMM."""
        kernels = compiled()
        return (
            kernels is not None
            and kernels.LEVEL != "generic"
            and self.format_id in GEMM_FORMATS
            and self.span == self.in_features
            and not self.partial
        )

    def _by_int16(self, x: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
        """The product by the int16 GEMM (float32 `x`, checked by __call__), into `out` or
        a new tensor."""
        kernels = compiled()
        assert kernels is not None  # quant_takes() found them loaded
        if out is None:
            out = torch.empty(x.shape[0], self.out_features, dtype=torch.float32)
        kernels.quant_gemm(
            x.data_ptr(),
            self.blocks.data_ptr(),
            0 if self.bias is None else self.bias.data_ptr(),
            out.data_ptr(),
            x.shape[0],
            self.out_features,
            self.in_features,
            self.blocks.shape[1],
            x.stride(0),
            out.stride(0),
            self.format_id,
            threads(),
        )
        return out

    def _by_gemm(
        self, x: torch.Tensor, out: torch.Tensor | None, dtype: torch.dtype
    ) -> torch.Tensor:
        """The product as torch's GEMM in `dtype` (float32 or bfloat16) with the weight
        dequantized for it, a GEMM a span (each span's inputs contiguous, as a shard's are);
        the result in float32 (float64 when partial)."""
        every_row = torch.arange(self.out_features)
        weight = quant_rows(self.blocks, self.format_id, self.in_features, every_row, dtype)
        x = x.to(dtype)
        if self.span == self.in_features and not self.partial:
            if self.bias is None or dtype != torch.float32:
                result = torch.mm(x, weight.t()).float()
                if self.bias is not None:
                    result += self.bias  # in float32, as the kernel adds it
            else:
                result = torch.addmm(self.bias, x, weight.t())
            return result if out is None else out.copy_(result)
        total = torch.zeros(x.shape[0], self.out_features, dtype=torch.float64)
        for start in range(0, self.in_features, self.span):
            part = slice(start, start + self.span)
            total += torch.mm(x[:, part].contiguous(), weight[:, part].contiguous().t())
        if not self.partial:
            total = total.float()
            if self.bias is not None:
                total += self.bias
        return total if out is None else out.copy_(total)


def quant_matmul(
    x: torch.Tensor,
    blocks: torch.Tensor,
    format_id: int,
    in_features: int,
    bias: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    precise: bool = True,
    span: int | None = None,
    partial: bool = False,
) -> torch.Tensor:
    """One product by a weight not kept (QuantMatrix's __init__ and __call__ in one)."""
    return QuantMatrix(blocks, format_id, in_features, bias, span, partial)(x, out, precise)


def quant_rows(
    blocks: torch.Tensor,
    format_id: int,
    in_features: int,
    rows: torch.Tensor,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """Rows `rows` (int64 ids) of a block-quantized weight, dequantized: [len(rows), in]."""
    kernels = compiled()
    if kernels is None or dtype not in DTYPES:
        raise ValueError("dequantizing rows needs the kernels and float32 or bfloat16")
    _check_blocks(blocks)
    rows = rows.to(torch.int64).contiguous().view(-1)
    out = torch.empty(rows.shape[0], in_features, dtype=dtype)
    kernels.quant_rows(
        blocks.data_ptr(),
        rows.data_ptr(),
        out.data_ptr(),
        rows.shape[0],
        blocks.shape[0],
        in_features,
        blocks.shape[1],
        format_id,
        DTYPES[dtype],
        threads(),
    )
    return out
