/* Decode attention over a paged KV cache on the CPU: one query token per sequence,
 * keys and values read in place through the block table (no gather, no padding).
 *
 * torch's SDPA spends a few microseconds of set-up per (sequence, KV head) whatever the
 * size, which at batch 32 and short contexts was most of a layer's attention; this loop
 * spends that on the arithmetic. Sums and the softmax are in float32, as SDPA's CPU
 * kernel does for 16-bit inputs. Layouts: kernels.h. */
#include <math.h>
#include <omp.h>
#include <stdlib.h>

#include "kernels.h"
#include "vec.h"

#define PARALLEL_WORK 1024 /* (token, KV head) rows to read before using more threads */
#define MAX_GROUP 64       /* query heads per KV head: their rows live on the stack */

/* Softmax of each of `rows` rows of `len` scores, in place. */
static void softmax_rows(float *scores, long rows, long len) {
    for (long r = 0; r < rows; r++) {
        float *s = scores + r * len, top = -INFINITY, total = 0;
        for (long t = 0; t < len; t++) top = s[t] > top ? s[t] : top;
        for (long t = 0; t < len; t++) s[t] = exp_approx(s[t] - top);
        for (long t = 0; t < len; t++) total += s[t];
        float inverse = 1.0f / total;
        for (long t = 0; t < len; t++) s[t] *= inverse;
    }
}

/* Offset (elements) of KV head `h`'s row for token 0 of block `b` of sequence `i`; the
 * block's next tokens follow kv_heads * head_dim elements apart. */
INLINE long block_offset(const PagedDecode *p, long i, long b, long h) {
    long block = p->tables[i * p->table_width + b];
    return (block * p->block_size * p->kv_heads + h) * p->head_dim;
}

/* The query heads of KV head `h` in sequence `i`, for a head size DIM and dtype fixed
 * when compiled (the loops over a row then unroll into registers). Scratch: `scores`
 * [group, len]. */
INLINE void attend(const PagedDecode *p, long i, long h, float *scores, const long DIM,
                   const int DTYPE) {
    enum { V_MAX = 128 / LANES };
    const long V = DIM / LANES, group = p->heads / p->kv_heads, len = p->lens[i];
    const long stride = p->kv_heads * DIM, bs = p->block_size;
    vec q[group][V_MAX], acc[group][V_MAX];
    for (long g = 0; g < group; g++)
        for (long j = 0; j < V; j++) {
            long offset = i * p->q_row_stride + (h * group + g) * DIM + j * LANES;
            q[g][j] = load(element(p->q, DTYPE, offset), DTYPE) * p->scale;
        }
    for (long b = 0, t = 0; t < len; b++) {
        long row = block_offset(p, i, b, h);
        for (long end = t + bs < len ? t + bs : len; t < end; t++, row += stride) {
            vec k[V_MAX];
            for (long j = 0; j < V; j++) k[j] = load(element(p->k, DTYPE, row + j * LANES), DTYPE);
            for (long g = 0; g < group; g++) {
                vec part = q[g][0] * k[0];
                for (long j = 1; j < V; j++) part += q[g][j] * k[j];
                scores[g * len + t] = fold(part);
            }
        }
    }
    softmax_rows(scores, group, len);
    for (long g = 0; g < group; g++)
        for (long j = 0; j < V; j++) acc[g][j] = (vec){0};
    for (long b = 0, t = 0; t < len; b++) {
        long row = block_offset(p, i, b, h);
        for (long end = t + bs < len ? t + bs : len; t < end; t++, row += stride) {
            vec v[V_MAX];
            for (long j = 0; j < V; j++) v[j] = load(element(p->v, DTYPE, row + j * LANES), DTYPE);
            for (long g = 0; g < group; g++)
                for (long j = 0; j < V; j++) acc[g][j] += scores[g * len + t] * v[j];
        }
    }
    for (long g = 0; g < group; g++)
        for (long j = 0; j < V; j++)
            store(p->out, DTYPE, (i * p->heads + h * group + g) * DIM + j * LANES, acc[g][j]);
}

static void attend_64_f32(const PagedDecode *p, long i, long h, float *s) { attend(p, i, h, s, 64, F32); }
static void attend_64_bf16(const PagedDecode *p, long i, long h, float *s) { attend(p, i, h, s, 64, BF16); }
static void attend_128_f32(const PagedDecode *p, long i, long h, float *s) { attend(p, i, h, s, 128, F32); }
static void attend_128_bf16(const PagedDecode *p, long i, long h, float *s) { attend(p, i, h, s, 128, BF16); }

const char *paged_decode_check(const PagedDecode *p) {
    if (p->kv_heads <= 0 || p->heads < p->kv_heads || p->heads % p->kv_heads != 0)
        return "heads do not group over KV heads";
    if (p->heads / p->kv_heads > MAX_GROUP) return "more than 64 query heads share a KV head";
    if (p->head_dim != 64 && p->head_dim != 128) return "head size is not 64 or 128";
    if (p->dtype != F32 && p->dtype != BF16) return "dtype is not float32 or bfloat16";
    if (p->threads < 1) return "threads must be at least 1";
    for (long i = 0; i < p->n; i++) {
        long len = p->lens[i];
        if (len < 1 || len > p->table_width * p->block_size)
            return "a context length is outside its block table";
        for (long b = 0; b < (len + p->block_size - 1) / p->block_size; b++) {
            int64_t block = p->tables[i * p->table_width + b];
            if (block < 0 || block >= p->blocks) return "a block table names a block outside the cache";
        }
    }
    return NULL;
}

int paged_decode_run(const PagedDecode *p) {
    if (p->n == 0) return 0;
    long longest = 0, work = 0, group = p->heads / p->kv_heads, units = p->n * p->kv_heads;
    for (long i = 0; i < p->n; i++) {
        longest = p->lens[i] > longest ? p->lens[i] : longest;
        work += p->lens[i] * p->kv_heads;
    }
    /* torch's own OpenMP threads (the extension shares its libgomp, loaded first), as
     * many as torch uses; a small problem stays on one: waking others would cost more. */
    int threads = work >= PARALLEL_WORK ? p->threads : 1;
    long per_thread = group * longest;
    /* Allocated before the threads start: one failing inside would skip the loop that
     * every thread of the team must reach, and the others would wait for it forever. */
    float *scratch = malloc(threads * per_thread * sizeof(float));
    if (scratch == NULL) return -1;
    void (*one)(const PagedDecode *, long, long, float *) =
        p->head_dim == 64 ? (p->dtype == F32 ? attend_64_f32 : attend_64_bf16)
                          : (p->dtype == F32 ? attend_128_f32 : attend_128_bf16);
#pragma omp parallel for schedule(static) num_threads(threads)
    for (long unit = 0; unit < units; unit++)
        one(p, unit / p->kv_heads, unit % p->kv_heads,
            scratch + omp_get_thread_num() * per_thread);
    free(scratch);
    return 0;
}
