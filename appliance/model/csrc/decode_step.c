/* A decode step's decoder layers in one call, for a whole model (no tensor parallelism)
 * whose projections are all block-quantized. Per layer, the kernels the Python layer
 * calls one by one, in the same order on the same buffers: add + RMSNorm, q/k/v, the
 * q and k head norms (Qwen3), RoPE and the KV store, decode attention, o, add + RMSNorm,
 * gate/up, SiLU * up, down; then the
 * final add + RMSNorm. At batch 1 a step's kernels take a few milliseconds, and the ~15
 * Python-level calls a layer made took almost as long again. */
#include <stdlib.h>

#include "kernels.h"
#include "vec.h"

/* The fields of one layer in DecodeStep.layers, in order. */
enum { INPUT_NORM, POST_NORM, PROJECTIONS };
enum { P_WEIGHTS, P_BIAS, P_ROWS, P_ROW_BYTES, P_FORMAT, P_SPAN, P_FIELDS };
enum { QKV, O, GATE_UP, DOWN };
enum { Q_NORM = PROJECTIONS + 4 * P_FIELDS, K_NORM }; /* after the projections */

static const int64_t *projection(const DecodeStep *p, long layer, int which) {
    return p->layers + layer * DECODE_LAYER_FIELDS + PROJECTIONS + which * P_FIELDS;
}

/* The product problem of projection `which` of `layer` on x [n, k] (rows x_stride apart)
 * into out [n, rows]. */
static QuantMatmul product(const DecodeStep *p, long layer, int which, const void *x, long k,
                           long x_stride, void *out) {
    const int64_t *f = projection(p, layer, which);
    return (QuantMatmul){.x = x,
                         .w = (const uint8_t *)(uintptr_t)f[P_WEIGHTS],
                         .bias = (const float *)(uintptr_t)f[P_BIAS],
                         .out = out,
                         .m = p->n,
                         .n = f[P_ROWS],
                         .k = k,
                         .row_bytes = f[P_ROW_BYTES],
                         .x_row_stride = x_stride,
                         .out_row_stride = f[P_ROWS],
                         .span = f[P_SPAN],
                         .format = (int)f[P_FORMAT],
                         .dtype = p->dtype,
                         .out_dtype = p->dtype,
                         .threads = p->threads,
                         .precise = p->precise};
}

static long qkv_rows(const DecodeStep *p) { return (p->heads + 2 * p->kv_heads) * p->head_dim; }

static AddRmsNorm norm(const DecodeStep *p, const void *x, const void *weight, void *out) {
    return (AddRmsNorm){.x = x, .weight = weight, .residual = p->residual, .out = out,
                        .rows = p->n, .dim = p->hidden, .eps = p->eps, .dtype = p->dtype,
                        .threads = p->threads};
}

static const void *layer_norm(const DecodeStep *p, long layer, int which) {
    return (const void *)(uintptr_t)p->layers[layer * DECODE_LAYER_FIELDS + which];
}

/* This layer's key (value: second) cache [blocks, block_size, kv_heads, head_dim]. */
static void *cache(const DecodeStep *p, long layer, int value) {
    long size = p->blocks * p->block_size * p->kv_heads * p->head_dim;
    return (char *)p->kv + (size_t)((2 * layer + value) * size) * (p->dtype == F32 ? 4 : 2);
}

static RopeStore rope(const DecodeStep *p, long layer, void *qkv) {
    return (RopeStore){.qkv = qkv, .k_cache = cache(p, layer, 0), .v_cache = cache(p, layer, 1),
                       .cos = p->cos, .sin = p->sin, .slots = p->slots, .tokens = p->n,
                       .heads = p->heads, .kv_heads = p->kv_heads, .head_dim = p->head_dim,
                       .cache_slots = p->blocks * p->block_size, .dtype = p->dtype,
                       .threads = p->threads};
}

static PagedDecode attention(const DecodeStep *p, long layer, const void *qkv, void *out) {
    return (PagedDecode){.q = qkv, .k = cache(p, layer, 0), .v = cache(p, layer, 1),
                         .tables = p->tables, .lens = p->lens, .out = out, .n = p->n,
                         .heads = p->heads, .kv_heads = p->kv_heads, .head_dim = p->head_dim,
                         .blocks = p->blocks, .block_size = p->block_size,
                         .table_width = p->table_width, .q_row_stride = qkv_rows(p),
                         .window = p->window, .scale = p->scale, .dtype = p->dtype,
                         .threads = p->threads};
}

/* The RMSNorm of `rows` heads [rows, head_dim] at `heads`, in place (the Python layers
 * run the same kernel on the same rows: llama.HeadNorm). */
static AddRmsNorm head_norm(const DecodeStep *p, const void *weight, void *heads, long rows) {
    return (AddRmsNorm){.x = NULL, .weight = weight, .residual = heads, .out = heads,
                        .rows = rows, .dim = p->head_dim, .eps = p->eps, .dtype = p->dtype,
                        .threads = p->threads};
}

/* Each token's query heads, then its key heads, normalised in place in `qkv`, when the
 * layer has head norms. */
static void head_norms(const DecodeStep *p, long layer, char *qkv) {
    const void *q_weight = layer_norm(p, layer, Q_NORM), *k_weight = layer_norm(p, layer, K_NORM);
    if (q_weight == NULL || k_weight == NULL) return;
    const long elem = p->dtype == F32 ? 4 : 2;
    for (long t = 0; t < p->n; t++) {
        char *q = qkv + t * qkv_rows(p) * elem;
        AddRmsNorm nq = head_norm(p, q_weight, q, p->heads);
        add_rms_norm_run(&nq);
        AddRmsNorm nk = head_norm(p, k_weight, q + p->heads * p->head_dim * elem, p->kv_heads);
        add_rms_norm_run(&nk);
    }
}

static SiluMul silu(const DecodeStep *p, void *gate_up) {
    return (SiluMul){.gate_up = gate_up, .rows = p->n, .intermediate = p->intermediate,
                     .dtype = p->dtype, .threads = p->threads};
}

const char *decode_step_check(const DecodeStep *p) {
    if (p->n < 1 || p->num_layers < 1) return "no rows or no layers";
    if (p->dtype != F32 && p->dtype != BF16) return "dtype is not float32 or bfloat16";
    const char *problem = NULL;
    AddRmsNorm n = norm(p, NULL, p->final_norm, p->out);
    if ((problem = add_rms_norm_check(&n)) != NULL) return problem;
    RopeStore r = rope(p, 0, NULL);
    if ((problem = rope_store_check(&r)) != NULL) return problem;
    PagedDecode a = attention(p, 0, NULL, NULL);
    if ((problem = paged_decode_check(&a)) != NULL) return problem;
    SiluMul act = silu(p, NULL);
    if ((problem = silu_mul_check(&act)) != NULL) return problem;
    AddRmsNorm heads = head_norm(p, NULL, NULL, p->heads);
    if ((problem = add_rms_norm_check(&heads)) != NULL) return problem;
    const long in[] = {p->hidden, p->heads * p->head_dim, p->hidden, p->intermediate};
    const long rows[] = {qkv_rows(p), p->hidden, 2 * p->intermediate, p->hidden};
    for (long layer = 0; layer < p->num_layers; layer++) {
        for (int which = QKV; which <= DOWN; which++) {
            QuantMatmul m = product(p, layer, which, NULL, in[which], in[which], NULL);
            if (m.n != rows[which]) return "a projection's output size does not fit the model";
            if (m.w == NULL) return "a projection has no weights";
            if ((problem = quant_matmul_check(&m)) != NULL) return problem;
        }
        if (layer_norm(p, layer, INPUT_NORM) == NULL || layer_norm(p, layer, POST_NORM) == NULL)
            return "a layer has no norm weights";
        if ((layer_norm(p, layer, Q_NORM) == NULL) != (layer_norm(p, layer, K_NORM) == NULL))
            return "a layer has a query head norm without a key one, or the reverse";
    }
    return NULL;
}

int decode_step_run(const DecodeStep *p) {
    const long n = p->n, elem = p->dtype == F32 ? 4 : 2;
    const long attn = p->heads * p->head_dim, inter = p->intermediate;
    char *h = malloc((size_t)(n * p->hidden * elem));
    char *delta = malloc((size_t)(n * p->hidden * elem));
    char *qkv = malloc((size_t)(n * qkv_rows(p) * elem));
    char *heads = malloc((size_t)(n * attn * elem));
    char *gate_up = malloc((size_t)(n * 2 * inter * elem));
    int status = (h && delta && qkv && heads && gate_up) ? 0 : -1;
    for (long layer = 0; status == 0 && layer < p->num_layers; layer++) {
        AddRmsNorm first = norm(p, layer ? delta : NULL, layer_norm(p, layer, INPUT_NORM), h);
        add_rms_norm_run(&first);
        QuantMatmul m = product(p, layer, QKV, h, p->hidden, p->hidden, qkv);
        status |= quant_matmul_run(&m);
        head_norms(p, layer, qkv);
        RopeStore r = rope(p, layer, qkv);
        rope_store_run(&r);
        PagedDecode a = attention(p, layer, qkv, heads);
        status |= paged_decode_run(&a);
        m = product(p, layer, O, heads, attn, attn, delta);
        status |= quant_matmul_run(&m);
        AddRmsNorm second = norm(p, delta, layer_norm(p, layer, POST_NORM), h);
        add_rms_norm_run(&second);
        m = product(p, layer, GATE_UP, h, p->hidden, p->hidden, gate_up);
        status |= quant_matmul_run(&m);
        SiluMul act = silu(p, gate_up);
        silu_mul_run(&act);
        m = product(p, layer, DOWN, gate_up, inter, 2 * inter, delta);
        status |= quant_matmul_run(&m);
    }
    if (status == 0) {
        AddRmsNorm last = norm(p, delta, p->final_norm, p->out);
        add_rms_norm_run(&last);
    }
    free(h);
    free(delta);
    free(qkv);
    free(heads);
    free(gate_up);
    return status;
}
