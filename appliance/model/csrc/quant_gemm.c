/* A prefill's products with weights in Q4_0, Q4_1 or Q8_0 as an integer GEMM: the
 * activations quantized per 32 values to int16 (scale absmax / 32767, about as precise as
 * quant_matmul.c's two int8 parts), the weights unpacked per call to their small integers
 * (Q4_0: -8..7, Q4_1: 0..15 plus a per-block min, Q8_0: -128..127) in int16 panels.
 *
 * Why: on an AVX2 CPU vpmaddwd does 16 int16 multiply-adds an instruction, twice a float32
 * FMA's 8, so this beats dequantizing to float32 and running a float32 GEMM (which is at
 * the FMA peak). |x| <= 32767 and |w| <= 128 keep a product below 2^22 and a 32-value
 * block's sum below 2^27: each block sums exactly in int32, then meets its two scales
 * (weight's x activation's) in float32; Q4_1's min meets the activation block's float sum.
 *
 * Layout: a panel is NR output features over all k, pairs of consecutive inputs
 * interleaved ([k / 2][NR][2] int16), so one vpmaddwd of a broadcast activation pair with
 * a panel vector gives 8 features' sums over 2 inputs. A microkernel takes MR activation
 * rows by NR features; threads take panels. Nothing is kept between calls.
 *
 * The AVX2 build runs the vpmaddwd microkernel, the AVX-512 build the same on 256-bit
 * registers with VNNI's vpdpwssd (multiply and add in one instruction: the same int32
 * sums); the generic build a plain C loop over the same layout, correct but 8x slower
 * than torch's float32 GEMM: Python does not pick it there (quant_products.py). */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#if defined(__AVX2__)
#include <immintrin.h>
#endif

#include "kernels.h"
#include "vec.h"

#define BLOCK 32 /* values per weight block and per activation scale */
#define PAIRS (BLOCK / 2)
#define MR 6  /* activation rows per microkernel: its 12 int32 sums, 2 panel vectors and 2
               * temporaries fill AVX2's 16 registers */
#define NR 16 /* output features per panel: two ymm of 8 */
#ifndef KC_BLOCKS
#define KC_BLOCKS 16 /* blocks of inputs per pass of the tiles (panel_product()) */
#endif

INLINE int block_bytes(int format) {
    return format == QUANT_Q4_0 ? 18 : format == QUANT_Q4_1 ? 20 : 34;
}

const char *quant_gemm_check(const QuantGemm *p) {
    if (p->format != QUANT_Q4_0 && p->format != QUANT_Q4_1 && p->format != QUANT_Q8_0)
        return "quant_gemm takes Q4_0, Q4_1 or Q8_0 weights only";
    if (p->m < 0 || p->n < 0 || p->k <= 0 || p->k % BLOCK != 0)
        return "k must be a positive multiple of 32";
    if (p->row_bytes != p->k / BLOCK * block_bytes(p->format)) return "row_bytes does not fit k";
    if (p->x_row_stride < p->k || p->out_row_stride < p->n) return "a row stride is too small";
    if (p->threads < 1) return "threads must be at least 1";
    return NULL;
}

typedef int32_t i32x8 __attribute__((vector_size(32)));

/* Row `x` [k] quantized per 32 values into int16 pairs, every MR-th int32 of `q` (the
 * tile layout the microkernel broadcasts from), its scales (absmax / 32767) and, for
 * Q4_1's min, its blocks' float sums, every MR-th float of `scale` and `sum`. In 8-lane
 * vectors (half_vec) that every build maps to its registers, the sums in the same order. */
static void quantize_row(const float *x, long k, int32_t *q, float *scale, float *sum) {
    const float round = 12582912.0f; /* 1.5 * 2^23: adding it rounds to an integer */
    for (long b = 0; b < k / BLOCK; b++) {
        half_vec v[4], amax = {0}, total = {0};
        memcpy(v, x + b * BLOCK, sizeof v);
        for (int j = 0; j < 4; j++) {
            half_vec a = (half_vec)((i32x8)v[j] & 0x7fffffff);
            i32x8 more = a > amax;
            amax = (half_vec)(((i32x8)a & more) | ((i32x8)amax & ~more));
            total += v[j];
        }
        float top = 0.0f, all = 0.0f;
        for (int l = 0; l < 8; l++) {
            top = amax[l] > top ? amax[l] : top;
            all += total[l];
        }
        const float inv = top > 0.0f ? 32767.0f / top : 0.0f;
        for (int j = 0; j < 4; j += 2) {
            i32x8 lo = __builtin_convertvector((v[j] * inv + round) - round, i32x8);
            i32x8 hi = __builtin_convertvector((v[j + 1] * inv + round) - round, i32x8);
            i32x8 even = __builtin_shufflevector(lo, hi, 0, 2, 4, 6, 8, 10, 12, 14);
            i32x8 odd = __builtin_shufflevector(lo, hi, 1, 3, 5, 7, 9, 11, 13, 15);
            i32x8 pairs = (even & 0xFFFF) | (odd << 16);
            for (int l = 0; l < 8; l++) q[(b * PAIRS + j * 4 + l) * MR] = pairs[l];
        }
        /* a NaN among the values is no larger than anything: its block's sum carries it
         * into the scale, so the block's products are NaN as a float product's would be */
        scale[b * MR] = all == all ? top / 32767.0f : all;
        sum[b * MR] = all;
    }
}

/* Block `b` of weight row `row` as int16 values (offset folded for Q4_0), its scale and
 * (Q4_1) min. `format` is a compile-time constant at each call. */
INLINE void unpack_block(const int format, const uint8_t *row, long b, int16_t v[BLOCK],
                         float *scale, float *min) {
    const uint8_t *blk = row + b * block_bytes(format);
    *scale = fp16(blk);
    *min = format == QUANT_Q4_1 ? fp16(blk + 2) : 0.0f;
    if (format == QUANT_Q8_0) {
        for (int j = 0; j < BLOCK; j++) v[j] = (int8_t)blk[2 + j];
        return;
    }
    const uint8_t *qs = blk + (format == QUANT_Q4_1 ? 4 : 2);
    const int offset = format == QUANT_Q4_0 ? 8 : 0;
    for (int j = 0; j < PAIRS; j++) {
        v[j] = (int16_t)((qs[j] & 0xF) - offset);
        v[j + PAIRS] = (int16_t)((qs[j] >> 4) - offset);
    }
}

/* Weight rows c0..c0+cols into a panel: pairs [k / 2][NR] (two int16 in one int32),
 * scales and mins [k / 32][NR]; features past `cols` zero. */
INLINE void pack_panel(const int format, const QuantGemm *p, long c0, int cols, int32_t *pairs,
                       float *scales, float *mins) {
    const long blocks = p->k / BLOCK;
    if (cols < NR) {
        memset(pairs, 0, sizeof(int32_t) * (size_t)(p->k / 2) * NR);
        memset(scales, 0, sizeof(float) * (size_t)blocks * NR);
        memset(mins, 0, sizeof(float) * (size_t)blocks * NR);
    }
    for (int c = 0; c < cols; c++) {
        const uint8_t *row = p->w + (c0 + c) * p->row_bytes;
        for (long b = 0; b < blocks; b++) {
            int16_t v[BLOCK];
            unpack_block(format, row, b, v, scales + b * NR + c, mins + b * NR + c);
            int32_t *dst = pairs + b * PAIRS * NR + c;
            for (int j = 0; j < PAIRS; j++) {
                uint32_t pair = (uint16_t)v[2 * j] | (uint32_t)(uint16_t)v[2 * j + 1] << 16;
                dst[j * NR] = (int32_t)pair;
            }
        }
    }
}

/* The activations, quantized, in tiles of MR rows (the last padded with zeros): tile t's
 * pairs [k / 2][MR] int32 at q + t * k / 2 * MR, its scales and block sums [k / 32][MR]. */
typedef struct {
    int32_t *q;
    float *scale, *sum;
    long k, blocks;
} Acts;

#if defined(__AVX2__)
/* s0, s1 += the activation pair at x (broadcast) times w0, w1's pairs (vpmaddwd). In one
 * asm statement: left to itself, GCC hoists every broadcast and product of a step ahead
 * of the sums and spills an accumulator, whose store-to-load chain then halves the
 * speed. */
INLINE void madd_row(const int32_t *x, __m256i w0, __m256i w1, __m256i *s0, __m256i *s1) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
    /* VNNI's vpdpwssd multiplies and adds in one instruction (the same int32 sums) */
    __m256i xv;
    __asm__("vpbroadcastd %[x], %[xv]\n\t"
            "vpdpwssd %[w0], %[xv], %[s0]\n\t"
            "vpdpwssd %[w1], %[xv], %[s1]"
            : [s0] "+v"(*s0), [s1] "+v"(*s1), [xv] "=&v"(xv)
            : [x] "m"(*x), [w0] "v"(w0), [w1] "v"(w1));
#else
    __m256i xv, t;
    __asm__("vpbroadcastd %[x], %[xv]\n\t"
            "vpmaddwd %[w0], %[xv], %[t]\n\t"
            "vpaddd %[t], %[s0], %[s0]\n\t"
            "vpmaddwd %[w1], %[xv], %[t]\n\t"
            "vpaddd %[t], %[s1], %[s1]"
            : [s0] "+x"(*s0), [s1] "+x"(*s1), [xv] "=&x"(xv), [t] "=&x"(t)
            : [x] "m"(*x), [w0] "x"(w0), [w1] "x"(w1));
#endif
}

/* acc[MR][NR] += tile `t` of the activations @ the panel, over blocks b0..b1. */
INLINE void microkernel(const Acts *a, long t, long b0, long b1, const int32_t *pairs,
                        const float *scales, const float *mins, const int has_min, float *acc) {
    const int32_t *x = a->q + t * (a->k / 2) * MR;
    const float *xscale = a->scale + t * a->blocks * MR, *xsum = a->sum + t * a->blocks * MR;
    for (long b = b0; b < b1; b++) {
        __m256i s[MR][2];
        for (int i = 0; i < MR; i++) s[i][0] = s[i][1] = _mm256_setzero_si256();
        const int32_t *w = pairs + b * PAIRS * NR, *xb = x + b * PAIRS * MR;
#pragma GCC unroll 2
        for (int j = 0; j < PAIRS; j++) {
            __m256i w0 = _mm256_load_si256((const __m256i *)(w + j * NR));
            __m256i w1 = _mm256_load_si256((const __m256i *)(w + j * NR + 8));
            for (int i = 0; i < MR; i++) madd_row(xb + j * MR + i, w0, w1, &s[i][0], &s[i][1]);
        }
        const __m256 d0 = _mm256_loadu_ps(scales + b * NR);
        const __m256 d1 = _mm256_loadu_ps(scales + b * NR + 8);
        /* the float sums wait in memory (acc): the int32 ones take the registers */
        for (int i = 0; i < MR; i++) {
            __m256 xs = _mm256_set1_ps(xscale[b * MR + i]);
            float *f = acc + i * NR;
            __m256 f0 = _mm256_loadu_ps(f), f1 = _mm256_loadu_ps(f + 8);
            f0 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s[i][0]), _mm256_mul_ps(d0, xs), f0);
            f1 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s[i][1]), _mm256_mul_ps(d1, xs), f1);
            if (has_min) {
                __m256 xt = _mm256_set1_ps(xsum[b * MR + i]);
                f0 = _mm256_fmadd_ps(_mm256_loadu_ps(mins + b * NR), xt, f0);
                f1 = _mm256_fmadd_ps(_mm256_loadu_ps(mins + b * NR + 8), xt, f1);
            }
            _mm256_storeu_ps(f, f0);
            _mm256_storeu_ps(f + 8, f1);
        }
    }
}
#else
/* The same sums in plain C (the generic build), a pair's halves taken apart by shifts. */
INLINE int32_t low_half(int32_t pair) { return (int16_t)(uint16_t)((uint32_t)pair & 0xFFFFu); }
INLINE int32_t high_half(int32_t pair) { return (int16_t)(uint16_t)((uint32_t)pair >> 16); }

INLINE void microkernel(const Acts *a, long t, long b0, long b1, const int32_t *pairs,
                        const float *scales, const float *mins, const int has_min, float *acc) {
    const int32_t *x = a->q + t * (a->k / 2) * MR;
    const float *xscale = a->scale + t * a->blocks * MR, *xsum = a->sum + t * a->blocks * MR;
    for (long b = b0; b < b1; b++) {
        int32_t s[MR][NR] = {{0}};
        const int32_t *w = pairs + b * PAIRS * NR, *xb = x + b * PAIRS * MR;
        for (int j = 0; j < PAIRS; j++)
            for (int i = 0; i < MR; i++) {
                const int32_t x0 = low_half(xb[j * MR + i]), x1 = high_half(xb[j * MR + i]);
                for (int c = 0; c < NR; c++)
                    s[i][c] += x0 * low_half(w[j * NR + c]) + x1 * high_half(w[j * NR + c]);
            }
        for (int i = 0; i < MR; i++) {
            const float xs = xscale[b * MR + i], xt = xsum[b * MR + i];
            for (int c = 0; c < NR; c++) {
                float f = acc[i * NR + c] + (float)s[i][c] * (scales[b * NR + c] * xs);
                acc[i * NR + c] = has_min ? f + mins[b * NR + c] * xt : f;
            }
        }
    }
}
#endif

/* Output features c0..c0+cols (one packed panel) for every activation row, summed in
 * `acc` [rows][NR] (rows: m rounded up to whole tiles). The inputs go KC_BLOCKS blocks at
 * a time, every tile over them before the next: the panel's part (16 KiB) stays in L1
 * and the activations' part nearer than their whole while the tiles sweep them. */
static void panel_product(const QuantGemm *p, const Acts *a, long c0, int cols,
                          const int32_t *pairs, const float *scales, const float *mins,
                          float *acc) {
    const int has_min = p->format == QUANT_Q4_1;
    const long tiles = (p->m + MR - 1) / MR;
    memset(acc, 0, sizeof(float) * (size_t)(tiles * MR * NR));
    for (long b0 = 0; b0 < a->blocks; b0 += KC_BLOCKS) {
        const long b1 = b0 + KC_BLOCKS < a->blocks ? b0 + KC_BLOCKS : a->blocks;
        for (long t = 0; t < tiles; t++) {
            float *tile = acc + t * MR * NR;
            if (has_min)
                microkernel(a, t, b0, b1, pairs, scales, mins, 1, tile);
            else
                microkernel(a, t, b0, b1, pairs, scales, mins, 0, tile);
        }
    }
    for (long r = 0; r < p->m; r++) {
        float *out = p->out + r * p->out_row_stride + c0;
        for (int c = 0; c < cols; c++)
            out[c] = p->bias ? acc[r * NR + c] + p->bias[c0 + c] : acc[r * NR + c];
    }
}

static void pack(const QuantGemm *p, long c0, int cols, int32_t *pairs, float *scales,
                 float *mins) {
    switch (p->format) {
    case QUANT_Q4_0: pack_panel(QUANT_Q4_0, p, c0, cols, pairs, scales, mins); break;
    case QUANT_Q4_1: pack_panel(QUANT_Q4_1, p, c0, cols, pairs, scales, mins); break;
    default: pack_panel(QUANT_Q8_0, p, c0, cols, pairs, scales, mins); break;
    }
}

/* Activation row r quantized into its tile (rows past m: zeros). */
static void quantize_tile_row(const QuantGemm *p, const Acts *a, long r) {
    const long k = p->k, blocks = a->blocks;
    const long t = r / MR, i = r % MR, at = t * blocks * MR + i;
    int32_t *q = a->q + t * (k / 2) * MR + i;
    if (r < p->m) {
        quantize_row(p->x + r * p->x_row_stride, k, q, a->scale + at, a->sum + at);
        return;
    }
    for (long j = 0; j < k / 2; j++) q[j * MR] = 0;
    for (long b = 0; b < blocks; b++) a->scale[at + b * MR] = a->sum[at + b * MR] = 0.0f;
}

/* Every panel: packed, then multiplied, by the threads in turn, each with its own
 * buffers (a panel, its scales and mins, its sums). -1 when out of memory. */
static int multiply_panels(const QuantGemm *p, const Acts *a, long rows) {
    const long k = p->k, blocks = a->blocks, panels = (p->n + NR - 1) / NR;
    const int threads = p->threads;
    int status = 0;
#pragma omp parallel num_threads(threads) if (threads > 1 && panels > 1)
    {
        int32_t *pairs = aligned_alloc(64, sizeof(int32_t) * (size_t)(k / 2) * NR);
        float *scales = malloc(sizeof(float) * (size_t)blocks * NR * 2);
        float *acc = malloc(sizeof(float) * (size_t)rows * NR);
        const int ready = pairs != NULL && scales != NULL && acc != NULL;
        if (!ready) {
#pragma omp atomic write
            status = -1;
        }
        /* no early exit: every thread must reach the loop's barrier */
#pragma omp for schedule(static)
        for (long t = 0; t < panels; t++) {
            if (!ready) continue;
            const long c0 = t * NR;
            const int cols = (int)(p->n - c0 < NR ? p->n - c0 : NR);
            float *mins = scales + blocks * NR;
            pack(p, c0, cols, pairs, scales, mins);
            panel_product(p, a, c0, cols, pairs, scales, mins, acc);
        }
        free(pairs);
        free(scales);
        free(acc);
    }
    return status;
}

int quant_gemm_run(const QuantGemm *p) {
    const long m = p->m, k = p->k, blocks = k / BLOCK;
    if (m == 0 || p->n == 0) return 0;
    const long rows = (m + MR - 1) / MR * MR; /* the microkernel reads whole tiles */
    Acts a = {malloc(sizeof(int32_t) * (size_t)(rows * k / 2)),
              malloc(sizeof(float) * (size_t)(rows * blocks)),
              malloc(sizeof(float) * (size_t)(rows * blocks)), k, blocks};
    int status = a.q && a.scale && a.sum ? 0 : -1;
    if (status == 0) {
#pragma omp parallel for schedule(static) num_threads(p->threads) if (p->threads > 1 && m >= 16)
        for (long r = 0; r < rows; r++) quantize_tile_row(p, &a, r);
        status = multiply_panels(p, &a, rows);
    }
    free(a.q);
    free(a.scale);
    free(a.sum);
    return status;
}
