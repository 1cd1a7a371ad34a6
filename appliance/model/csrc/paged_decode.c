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
#define AHEAD 2            /* blocks asked for ahead of their reading (1 and 4: slower) */
#define MAX_GROUP 64       /* query heads per KV head (the checks and cpu_kernels/attention.py agree) */
#define MAX_SPAN 16        /* rows of one sequence attended together (a verify chunk: 1 + k) */
/* Scores a thread keeps for a span: its rows' query heads times the longest context. One
 * row of 8 query heads a KV head at a 128k context holds this many; a span takes fewer
 * rows at long contexts, so a thread's scratch stays what one row's was. */
#define SPAN_SCORES (1L << 20)

/* Softmax of each of `rows` rows of `len` scores, `stride` apart, in place. */
static void softmax_rows(float *scores, long stride, long rows, long len) {
    for (long r = 0; r < rows; r++) {
        float *s = scores + r * stride, top = -INFINITY, total = 0;
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

/* q . the float32 key at k, as a 16-lane sum (vec.h): q's value j meets the key's in lane
 * j % 16. */
INLINE void token_dot(const vec *q, const float *k, vec part[PARTS], const long DIM) {
    for (long j = 0; j < PARTS; j++) part[j] = q[j] * load(k + j * LANES, F32);
    for (long j = PARTS; j < DIM / LANES; j++) part[j % PARTS] += q[j] * load(k + j * LANES, F32);
}

/* One query head's scores s[0..n) against n float32 keys `stride` apart from k: q (DIM /
 * LANES vectors, pre-scaled) in registers; four tokens' products are folded together
 * (one horizontal reduction for four, not one each). */
INLINE void block_scores(const vec *q, const float *k, long stride, long n, float *s,
                         const long DIM) {
    long t = 0;
    for (; t + 4 <= n; t += 4) {
        vec part[4][PARTS];
        for (int u = 0; u < 4; u++) token_dot(q, k + (t + u) * stride, part[u], DIM);
        fold4(part, s + t);
    }
    for (; t < n; t++) {
        vec part[PARTS];
        token_dot(q, k + t * stride, part, DIM);
        s[t] = fold(part);
    }
}

/* One query head's output sums out[DIM] += its weights s[0..n) times n float32 value rows
 * `stride` apart from v, 64 values at a time, whose sums stay in registers through the
 * tokens (AVX2 has 16 registers). */
INLINE void block_values(const float *v, long stride, long n, const float *s, float *out,
                         const long DIM) {
    enum { SLICE = 64 / LANES };
    for (long j0 = 0; j0 < DIM; j0 += SLICE * LANES) {
        vec acc[SLICE];
        memcpy(acc, out + j0, sizeof acc);
        for (long t = 0; t < n; t++)
            for (long j = 0; j < SLICE; j++)
                acc[j] += s[t] * load(v + t * stride + j0 + j * LANES, F32);
        memcpy(out + j0, acc, sizeof acc);
    }
}

/* `n` tokens of KV head `h` in block `b` of sequence `i` in `cache` (K or V), from the
 * block's token `skip` on, as float32 rows: in place for a float32 cache (*stride:
 * kv_heads * DIM), else widened once into `tile` [block_size, DIM] (*stride: DIM) for
 * every query head to read. */
INLINE const float *block_rows(const PagedDecode *p, const void *cache, long i, long b, long h,
                               long skip, long n, float *tile, long *stride, const long DIM,
                               const int DTYPE) {
    *stride = p->kv_heads * DIM;
    const long row = block_offset(p, i, b, h) + skip * *stride;
    if (DTYPE == F32) return (const float *)cache + row;
    for (long t = 0; t < n; t++)
        for (long j = 0; j < DIM; j += LANES) {
            vec x = load(element(cache, DTYPE, row + t * *stride + j), DTYPE);
            memcpy(tile + t * DIM + j, &x, sizeof x);
        }
    *stride = DIM;
    return tile;
}

/* Asks for KV head `h`'s rows of block `b` of sequence `i` (if its context reaches that
 * block) to be on their way into the cache. A decode step reads every layer's context
 * from memory (8 sequences of 320 tokens hold 118 MB of float32 K and V over SmolLM2's 30
 * layers), in blocks scattered over the pool and a head's rows strided among the others':
 * the hardware prefetchers miss that pattern, and waiting on each block cost bfloat16
 * caches half their time (benchmarks/cpu_kernels_bench.py, 30 layers' pools). */
INLINE void prefetch_block(const PagedDecode *p, const void *cache, long i, long b, long h,
                           const long DIM, const int DTYPE) {
    if (b * p->block_size >= p->lens[i]) return;
    const long size = DTYPE == F32 ? 4 : 2, stride = p->kv_heads * DIM * size;
    const char *row = (const char *)cache + block_offset(p, i, b, h) * size;
    for (long t = 0; t < p->block_size; t++)
        for (long byte = 0; byte < DIM * size; byte += 64)
            __builtin_prefetch(row + t * stride + byte);
}

/* The first token row `i`'s query sees: its window's first, or 0. */
INLINE long first_seen(const PagedDecode *p, long i) {
    const long len = p->lens[i];
    return p->window > 0 && len > p->window ? len - p->window : 0;
}

/* Whether row j reads row j - 1's context plus one token: the next row of one sequence's
 * verify chunk (its draft tokens' queries), whose K/V blocks are the same ones. Tables
 * equal over every block j reads (rows of different sequences sharing all of them read
 * the same memory too); both see from token 0 (no window cut). */
static int extends(const PagedDecode *p, long j) {
    if (p->lens[j] != p->lens[j - 1] + 1 || first_seen(p, j) != 0) return 0;
    const long used = (p->lens[j] + p->block_size - 1) / p->block_size;
    const int64_t *a = p->tables + (j - 1) * p->table_width, *b = a + p->table_width;
    return memcmp(a, b, used * sizeof(int64_t)) == 0;
}

/* The query heads of KV head `h` in rows [i0, i0 + m), each row's context its
 * predecessor's plus one token (a span: extends()), for a head size DIM and dtype fixed
 * when compiled (the loops over a row then unroll into registers). A block at a time,
 * each row's query heads in turn, so the block's keys and values are read from memory
 * (and widened from bfloat16) once, and from the L1 cache by the other heads and rows:
 * a verify chunk of M rows reads its context once, not M times. Each row's sums run in
 * the order a span of one row gives it (its numbers do not depend on the span). Only
 * the tokens from first_seen() on count (a sliding window: spans of one row). Scratch:
 * `scores` [m * group, longest], `sums` [m * group, DIM], `tile` [block_size, DIM]. */
INLINE void attend(const PagedDecode *p, long i0, long m, long h, long longest, float *scores,
                   float *sums, float *tile, const long DIM, const int DTYPE) {
    enum { V_MAX = 128 / LANES };
    const long V = DIM / LANES, group = p->heads / p->kv_heads, bs = p->block_size;
    const long first = first_seen(p, i0), last = p->lens[i0 + m - 1];
    vec q[V_MAX];
    for (long b = first / bs; b * bs < last; b++) {
        const long t0 = b * bs > first ? b * bs : first; /* the block's first seen token */
        const long end = (b + 1) * bs < last ? (b + 1) * bs : last;
        long stride;
        prefetch_block(p, p->k, i0 + m - 1, b + AHEAD, h, DIM, DTYPE);
        const float *k = block_rows(p, p->k, i0, b, h, t0 - b * bs, end - t0, tile, &stride,
                                    DIM, DTYPE);
        for (long r = 0; r < m; r++) {
            const long i = i0 + r, n = (end < p->lens[i] ? end : p->lens[i]) - t0;
            if (n <= 0) continue; /* the block holds only later rows' tokens */
            for (long g = 0; g < group; g++) {
                for (long j = 0; j < V; j++) {
                    long offset = i * p->q_row_stride + (h * group + g) * DIM + j * LANES;
                    q[j] = load(element(p->q, DTYPE, offset), DTYPE) * p->scale;
                }
                block_scores(q, k, stride, n, scores + (r * group + g) * longest + t0 - first,
                             DIM);
            }
        }
    }
    for (long r = 0; r < m; r++)
        softmax_rows(scores + r * group * longest, longest, group, p->lens[i0 + r] - first);
    memset(sums, 0, m * group * DIM * sizeof(float));
    for (long b = first / bs; b * bs < last; b++) {
        const long t0 = b * bs > first ? b * bs : first;
        const long end = (b + 1) * bs < last ? (b + 1) * bs : last;
        long stride;
        prefetch_block(p, p->v, i0 + m - 1, b + AHEAD, h, DIM, DTYPE);
        const float *v = block_rows(p, p->v, i0, b, h, t0 - b * bs, end - t0, tile, &stride,
                                    DIM, DTYPE);
        for (long r = 0; r < m; r++) {
            const long n = (end < p->lens[i0 + r] ? end : p->lens[i0 + r]) - t0;
            if (n <= 0) continue;
            for (long g = 0; g < group; g++)
                block_values(v, stride, n, scores + (r * group + g) * longest + t0 - first,
                             sums + (r * group + g) * DIM, DIM);
        }
    }
    for (long r = 0; r < m; r++)
        for (long g = 0; g < group; g++) {
            const long out = ((i0 + r) * p->heads + h * group + g) * DIM;
            const float *sum = sums + (r * group + g) * DIM;
            for (long j = 0; j < V; j++)
                store(p->out, DTYPE, out + j * LANES, load(sum + j * LANES, F32));
        }
}

#define ATTEND(NAME, DIM, DTYPE)                                                              \
    static void NAME(const PagedDecode *p, long i0, long m, long h, float *scratch,          \
                     long longest) {                                                          \
        const long rows = m * (p->heads / p->kv_heads);                                      \
        float *sums = scratch + rows * longest;                                              \
        attend(p, i0, m, h, longest, scratch, sums, sums + rows * DIM, DIM, DTYPE);          \
    }
ATTEND(attend_64_f32, 64, F32)
ATTEND(attend_64_bf16, 64, BF16)
ATTEND(attend_128_f32, 128, F32)
ATTEND(attend_128_bf16, 128, BF16)

const char *paged_decode_check(const PagedDecode *p) {
    if (p->kv_heads <= 0 || p->heads < p->kv_heads || p->heads % p->kv_heads != 0)
        return "heads do not group over KV heads";
    if (p->heads / p->kv_heads > MAX_GROUP) return "more than 64 query heads share a KV head";
    if (p->head_dim != 64 && p->head_dim != 128) return "head size is not 64 or 128";
    if (p->dtype != F32 && p->dtype != BF16) return "dtype is not float32 or bfloat16";
    if (p->threads < 1) return "threads must be at least 1";
    if (p->window < 0) return "the window is negative";
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

/* The rows cut into pieces, each a span (rows extends() chains, at most MAX_SPAN, and at
 * most what SPAN_SCORES holds at the `longest` context): piece k is rows [starts[k],
 * starts[k + 1]); returns how many. Where too few (piece, KV head) units would leave
 * threads idle (a batch-1 verify chunk: one span, a few KV heads), each span is cut in
 * `cuts` even parts: its context is then read once per part, not per row. starts has
 * room for n + 1. */
static long pieces(const PagedDecode *p, int threads, long longest, long *starts) {
    const long group = p->heads / p->kv_heads, fit = SPAN_SCORES / (group * longest);
    const long most = fit < 1 ? 1 : fit < MAX_SPAN ? fit : MAX_SPAN;
    long count = 0;
    for (long i = 0; i < p->n; i++)
        if (i == 0 || i - starts[count - 1] >= most || !extends(p, i)) starts[count++] = i;
    starts[count] = p->n;
    const long want = 2L * threads, units = count * p->kv_heads;
    if (threads == 1 || units >= want) return count;
    const long cuts = (want + units - 1) / units, spans = count;
    long *cut = malloc((p->n + 1) * sizeof(long));
    if (cut == NULL) return spans; /* uncut: slower, the same numbers */
    count = 0;
    for (long s = 0; s < spans; s++) {
        const long a = starts[s], m = starts[s + 1] - a;
        for (long c = 0; c < cuts; c++)
            if (m * (c + 1) / cuts > m * c / cuts) cut[count++] = a + m * c / cuts;
    }
    cut[count] = p->n;
    memcpy(starts, cut, (count + 1) * sizeof(long));
    free(cut);
    return count;
}

int paged_decode_run(const PagedDecode *p) {
    if (p->n == 0) return 0;
    long longest = 0, work = 0, group = p->heads / p->kv_heads;
    for (long i = 0; i < p->n; i++) {
        const long seen = p->lens[i] - first_seen(p, i);
        longest = seen > longest ? seen : longest;
        work += seen * p->kv_heads;
    }
    /* torch's own OpenMP threads (the extension shares its libgomp, loaded first), as
     * many as torch uses; a small problem stays on one: waking others would cost more. */
    int threads = work >= PARALLEL_WORK ? p->threads : 1;
    long *starts = malloc((p->n + 1) * sizeof(long));
    if (starts == NULL) return -1;
    const long count = pieces(p, threads, longest, starts);
    long widest = 0;
    for (long k = 0; k < count; k++)
        widest = starts[k + 1] - starts[k] > widest ? starts[k + 1] - starts[k] : widest;
    /* attend()'s scratch: scores, sums, tile */
    long per_thread = widest * group * (longest + p->head_dim) + p->block_size * p->head_dim;
    /* Allocated before the threads start: one failing inside would skip the loop that
     * every thread of the team must reach, and the others would wait for it forever. */
    float *scratch = malloc(threads * per_thread * sizeof(float));
    if (scratch == NULL) {
        free(starts);
        return -1;
    }
    void (*one)(const PagedDecode *, long, long, long, float *, long) =
        p->head_dim == 64 ? (p->dtype == F32 ? attend_64_f32 : attend_64_bf16)
                          : (p->dtype == F32 ? attend_128_f32 : attend_128_bf16);
    const long units = count * p->kv_heads;
#pragma omp parallel for schedule(static) num_threads(threads)
    for (long unit = 0; unit < units; unit++) {
        const long k = unit / p->kv_heads;
        one(p, starts[k], starts[k + 1] - starts[k], unit % p->kv_heads,
            scratch + omp_get_thread_num() * per_thread, longest);
    }
    free(scratch);
    free(starts);
    return 0;
}
