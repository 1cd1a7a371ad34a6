/* The CPU kernels' problems and entry points; module.c binds them to Python. */
#ifndef APPLIANCE_KERNELS_H
#define APPLIANCE_KERNELS_H

#include <stdint.h>

/* Decode attention over a paged KV cache (paged_decode.c). Elements, contiguous unless a
 * stride is given:
 *   q      [n, heads, head_dim], rows `q_row_stride` apart
 *   k, v   caches [blocks, block_size, kv_heads, head_dim]
 *   tables [n, table_width] block ids;  lens [n] tokens in each context
 *   out    [n, heads, head_dim]
 * The `heads / kv_heads` query heads of a KV head are consecutive. window > 0: each query
 * attends to its context's last `window` tokens only (a sliding window); 0: all of them. */
typedef struct {
    const void *q, *k, *v;
    const int64_t *tables, *lens;
    void *out;
    long n, heads, kv_heads, head_dim, blocks, block_size, table_width, q_row_stride, window;
    float scale;
    int dtype, threads; /* threads: at most this many (torch.get_num_threads()) */
} PagedDecode;

/* Why the kernel cannot run `p` (a context or block id reaching outside the cache, a head
 * size or dtype it has no code for), or NULL. */
const char *paged_decode_check(const PagedDecode *p);
/* Runs a checked problem; -1 when out of memory. */
int paged_decode_run(const PagedDecode *p);

/* residual += x (when `x` is not NULL; else residual as is), then
 * out = residual * rsqrt(mean(residual^2) + eps) * weight, row by row (add_rms_norm.c).
 * residual, x, out [rows, dim] contiguous, weight [dim]; dim a multiple of 16. */
typedef struct {
    const void *x, *weight;
    void *residual, *out;
    long rows, dim;
    float eps;
    int dtype, threads;
} AddRmsNorm;

const char *add_rms_norm_check(const AddRmsNorm *p);
void add_rms_norm_run(const AddRmsNorm *p);

/* Rotates each token's query and key heads in place in `qkv` [tokens, heads + 2 *
 * kv_heads, head_dim] (rotate-half layout: cos, sin [tokens, head_dim / 2]), then copies
 * its key and value heads to slot `slots[t]` of the caches [cache_slots, kv_heads,
 * head_dim] (rope_store.c). All contiguous, one dtype. */
typedef struct {
    void *qkv, *k_cache, *v_cache;
    const void *cos, *sin;
    const int64_t *slots;
    long tokens, heads, kv_heads, head_dim, cache_slots;
    int dtype, threads;
} RopeStore;

const char *rope_store_check(const RopeStore *p);
void rope_store_run(const RopeStore *p);

/* gate_up [rows, 2 * intermediate] (contiguous, `dtype`): its first half becomes
 * silu(first half) * second half (silu_mul.c). */
typedef struct {
    void *gate_up;
    long rows, intermediate;
    int dtype, threads;
} SiluMul;

const char *silu_mul_check(const SiluMul *p);
void silu_mul_run(const SiluMul *p);

/* Weight formats, numbered as GGML numbers them (quant_matmul.c). */
enum { QUANT_Q4_0 = 2, QUANT_Q4_1 = 3, QUANT_Q8_0 = 8, QUANT_Q4_K = 12, QUANT_Q5_K = 13,
       QUANT_Q6_K = 14 };

/* out[:, :n] = x @ W.T (+ bias) with W [n, k] in a block format, `row_bytes` per row:
 *   x    [m, k] float32 or bfloat16 (`dtype`), rows `x_row_stride` elements apart
 *   bias [n] float32, or NULL
 *   out  [m, n] of `out_dtype` (x's, or F64), rows `out_row_stride` elements apart
 * precise: activations as two int8 parts (about 16 bits) instead of one.
 * span: each output is summed in float32 over `span` inputs at a time (a multiple of the
 * format's block size dividing k), and those sums in float64: a row-parallel shard whose
 * inputs are whole spans then computes the same float64 partial sums as the whole
 * product, so its group's all-reduce (of F64 `out`s) rounds to the whole product's
 * float32 result. */
typedef struct {
    const void *x;
    const uint8_t *w;
    const float *bias;
    void *out;
    long m, n, k, row_bytes, x_row_stride, out_row_stride, span;
    int format, dtype, out_dtype, threads, precise;
} QuantMatmul;

const char *quant_matmul_check(const QuantMatmul *p);
/* Runs a checked problem; -1 when out of memory. */
int quant_matmul_run(const QuantMatmul *p);

/* out [count, k] (float32 or bfloat16) = rows `rows` of W [total_rows, k] dequantized. */
typedef struct {
    const uint8_t *w;
    const int64_t *rows;
    void *out;
    long count, total_rows, k, row_bytes;
    int format, dtype, threads;
} QuantRows;

const char *quant_rows_check(const QuantRows *p);
int quant_rows_run(const QuantRows *p);

/* out[:, :n] = x @ W.T (+ bias) by an integer GEMM (quant_gemm.c), for a prefill's many
 * rows: x [m, k] float32, rows `x_row_stride` apart, quantized per 32 values to int16
 * (scale absmax / 32767); W [n, k] in Q4_0, Q4_1 or Q8_0 (`row_bytes` per row), unpacked
 * per call to int16 panels; bias [n] float32 or NULL; out [m, n] float32, rows
 * `out_row_stride` apart. */
typedef struct {
    const float *x;
    const uint8_t *w;
    const float *bias;
    float *out;
    long m, n, k, row_bytes, x_row_stride, out_row_stride;
    int format, threads;
} QuantGemm;

const char *quant_gemm_check(const QuantGemm *p);
/* Runs a checked problem; -1 when out of memory. */
int quant_gemm_run(const QuantGemm *p);

/* A decode step's decoder layers (decode_step.c): `layers` [num_layers, 28] int64, per
 * layer the addresses of its input and post-attention norm weights [hidden], then for each
 * of its q/k/v, o, gate/up and down projections (block-quantized, as QuantMatmul takes
 * them) the weights' address, the float32 bias's (or 0), its output rows, bytes per row,
 * format and span, then those of its query and key head norms' weights [head_dim] (Qwen3;
 * 0 and 0 for none). residual [n, hidden] holds the embeddings and is left holding the residual
 * stream; out [n, hidden] gets its final norm. cos, sin [n, head_dim / 2]; slots [n];
 * tables [n, table_width], lens [n] as PagedDecode's; kv [layers, 2, blocks, block_size,
 * kv_heads, head_dim]. All contiguous, of `dtype`. window: PagedDecode's. */
#define DECODE_LAYER_FIELDS 28
typedef struct {
    const int64_t *layers;
    long num_layers;
    void *residual, *out, *kv;
    const void *final_norm, *cos, *sin;
    const int64_t *slots, *tables, *lens;
    long n, hidden, heads, kv_heads, head_dim, intermediate, blocks, block_size, table_width;
    long window;
    float eps, scale;
    int dtype, threads, precise;
} DecodeStep;

const char *decode_step_check(const DecodeStep *p);
/* Runs a checked step; -1 when out of memory. */
int decode_step_run(const DecodeStep *p);

#endif
