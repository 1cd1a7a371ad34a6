/* Rotary position embedding of a step's queries and keys, in place in the q/k/v
 * projection's output, and the keys and values stored in their KV cache slots, in one
 * pass over the rows. torch does this as six element-wise ops and two index copies per
 * layer, each a dispatch of a few microseconds at decode sizes. Each rotated value is
 * computed in float32 and rounded once (torch's ops round the product first). */
#include "kernels.h"
#include "vec.h"

#define PARALLEL_ROWS 64 /* fewer rows stay on one thread: waking others costs more */

INLINE void rotate(void *row, const void *cos, const void *sin, long half, const int DTYPE) {
    for (long j = 0; j < half; j += LANES) {
        vec c = load(element(cos, DTYPE, j), DTYPE), s = load(element(sin, DTYPE, j), DTYPE);
        vec x1 = load(element(row, DTYPE, j), DTYPE);
        vec x2 = load(element(row, DTYPE, half + j), DTYPE);
        store(row, DTYPE, j, x1 * c - x2 * s);
        store(row, DTYPE, half + j, x2 * c + x1 * s);
    }
}

INLINE void copy_row(void *dst, const void *src, long count, const int DTYPE) {
    memcpy(dst, src, count * (DTYPE == F32 ? sizeof(float) : sizeof(uint16_t)));
}

INLINE void rope_rows(const RopeStore *p, const int DTYPE) {
    const long dim = p->head_dim, half = dim / 2, heads = p->heads + 2 * p->kv_heads;
    const long kv_width = p->kv_heads * dim;
#pragma omp parallel for schedule(static) num_threads(p->threads) if (p->tokens >= PARALLEL_ROWS)
    for (long t = 0; t < p->tokens; t++) {
        void *row = (void *)element(p->qkv, DTYPE, t * heads * dim);
        const void *cos = element(p->cos, DTYPE, t * half), *sin = element(p->sin, DTYPE, t * half);
        for (long h = 0; h < p->heads + p->kv_heads; h++)
            rotate((void *)element(row, DTYPE, h * dim), cos, sin, half, DTYPE);
        long slot = p->slots[t] * kv_width;
        copy_row((void *)element(p->k_cache, DTYPE, slot),
                 element(row, DTYPE, p->heads * dim), kv_width, DTYPE);
        copy_row((void *)element(p->v_cache, DTYPE, slot),
                 element(row, DTYPE, (p->heads + p->kv_heads) * dim), kv_width, DTYPE);
    }
}

const char *rope_store_check(const RopeStore *p) {
    if (p->head_dim <= 0 || p->head_dim % (2 * WIDE) != 0)
        return "head size is not a positive multiple of 32";
    if (p->heads < 0 || p->kv_heads < 1) return "bad head counts";
    if (p->dtype != F32 && p->dtype != BF16) return "dtype is not float32 or bfloat16";
    if (p->threads < 1) return "threads must be at least 1";
    for (long t = 0; t < p->tokens; t++)
        if (p->slots[t] < 0 || p->slots[t] >= p->cache_slots) return "a slot is outside the cache";
    return NULL;
}

void rope_store_run(const RopeStore *p) {
    if (p->dtype == F32)
        rope_rows(p, F32);
    else
        rope_rows(p, BF16);
}
