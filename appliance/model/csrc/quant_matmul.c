/* Matrix products with weights kept in GGUF's block formats (Q4_0, Q4_1, Q8_0, Q4_K, Q5_K,
 * Q6_K), read in place: decode is bound by the bytes a step reads, and 4.5 bits a weight
 * read 7x fewer than float32.
 *
 * How: each call quantizes its activations per 32 values (one float scale each, as
 * llama.cpp's Q8 activations), into one int8 or, in the precise form, two: the value and
 * its rounding remainder at 1/256 of the step (about 16 bits). Each weight row is then
 * unpacked, in registers, one 32-value group at a time, into small integers with a float
 * scale and offset per 16 values (every format above fits this form), once per tile of
 * up to six activation rows (AVX-512; four elsewhere: see TILE); the groups' integer dot
 * products with the tile's rows accumulate in float. The offsets meet the activation sums
 * (precomputed per 16 values) in one float dot per row at the end. Each row's result is computed the same way
 * whatever the batch, so a row does not change with what it is batched with.
 *
 * This file is compiled once per instruction-set level (setup.py): the AVX2 build uses
 * vpmaddubsw, the AVX-512 build VNNI's vpdpbusd, the generic build plain C (NEON on ARM,
 * through the compiler). The unpacking is written with vector extensions, which each
 * build maps to its own registers. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#if defined(__AVX2__)
#include <immintrin.h>
#endif
#if defined(_OPENMP)
#include <omp.h>
#endif

#include "kernels.h"
#include "vec.h"

#define GROUP 32   /* values per activation block and per unpacked weight group */
/* Activation rows per pass over a weight row: each weight group is unpacked once per tile,
 * so a verify step's 5 rows (k = 4 drafts) are one pass, not two. AVX-512's 32 vector
 * registers take a tile of 6 rows' accumulators and a chunk's weights; at 7 and 8 rows GCC
 * spills (objdump: weight registers read back from the stack), and a tile of 8 cost more
 * than two of 4 (AMD EPYC, benchmarks/cpu_kernels_bench.py). AVX2 has 16 registers: 4 rows. */
#if defined(__AVX512F__)
#define TILE 6
#else
#define TILE 4
#endif
#define M_BLOCK 64 /* activation rows swept per weight row before the next (stay in cache) */
#define ROWS_PER_TASK 8
#define CHUNK 8    /* groups the 32-value block path takes a pass (scales in one vector) */
#if defined(__AVX512F__)
#define SET 4 /* 4-bit groups unpacked into one register by the block path */
#else
#define SET 2
#endif

typedef uint8_t u8x32 __attribute__((vector_size(32)));
typedef uint8_t u8x16 __attribute__((vector_size(16)));

/* One format: values and bytes per block. */
typedef struct {
    int values, bytes;
} Format;

static int format_of(int format, Format *f) {
    switch (format) {
    case QUANT_Q4_0: *f = (Format){32, 18}; return 1;
    case QUANT_Q4_1: *f = (Format){32, 20}; return 1;
    case QUANT_Q8_0: *f = (Format){32, 34}; return 1;
    case QUANT_Q4_K: *f = (Format){256, 144}; return 1;
    case QUANT_Q5_K: *f = (Format){256, 176}; return 1;
    case QUANT_Q6_K: *f = (Format){256, 210}; return 1;
    default: return 0;
    }
}

/* Bytes per block of the formats of 32 values a block (Q4_0, Q4_1, Q8_0). */
INLINE int block32_bytes(int format) {
    return format == QUANT_Q4_0 ? 18 : format == QUANT_Q4_1 ? 20 : 34;
}

/* Whether this build multiplies `format` by the 32-value block path (block_tile()): the
 * formats of one scale per 32 values, whose scales it reads a chunk at a time. */
INLINE int block_path(int format) {
#if defined(__AVX2__)
    return format == QUANT_Q4_0 || format == QUANT_Q4_1 || format == QUANT_Q8_0;
#else
    (void)format;
    return 0;
#endif
}

/* Two consecutive half floats. */
INLINE void fp16_pair(const uint8_t *p, float out[2]) {
#if defined(__F16C__)
    uint32_t both;
    memcpy(&both, p, 4);
    __m128 f = _mm_cvtph_ps(_mm_cvtsi32_si128((int)both));
    _mm_storel_pi((__m64 *)out, f);
#else
    out[0] = fp16(p);
    out[1] = fp16(p + 2);
#endif
}

INLINE u8x32 join16(u8x16 lo, u8x16 hi) {
    return __builtin_shufflevector(lo, hi, 0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15,
                                   16, 17, 18, 19, 20, 21, 22, 23, 24, 25, 26, 27, 28, 29, 30,
                                   31);
}

INLINE u8x16 load16(const uint8_t *p) {
    u8x16 v;
    memcpy(&v, p, 16);
    return v;
}

INLINE u8x32 load32(const uint8_t *p) {
    u8x32 v;
    memcpy(&v, p, 32);
    return v;
}

/* Q4_K / Q5_K: the 6-bit scale and min of sub-block j (llama.cpp's get_scale_min_k4). */
INLINE void scale_min_k4(int j, const uint8_t *q, int *scale, int *min) {
    if (j < 4) {
        *scale = q[j] & 63;
        *min = q[j + 4] & 63;
    } else {
        *scale = (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4);
        *min = (q[j + 4] >> 4) | ((q[j] >> 6) << 4);
    }
}

/* Group `g` (32 values) of a weight row: its values as small integers (0..63, or int8 for
 * Q8_0) and, for its first and last 16 values, the scale and offset that make them
 * weights (weight = scale * value + offset). A compile-time `format` specializes it. */
typedef struct {
    float scale[2], offset[2];
} GroupScales;

INLINE u8x32 unpack_group(const int format, const uint8_t *row, long g, GroupScales *s) {
    const u8x32 low4 = (u8x32){0} + 0xF;
    if (format == QUANT_Q4_0 || format == QUANT_Q4_1 || format == QUANT_Q8_0) {
        const int bytes = block32_bytes(format);
        const uint8_t *b = row + g * bytes;
        if (format == QUANT_Q4_1) { /* d and m side by side: one conversion */
            float dm[2];
            fp16_pair(b, dm);
            s->scale[0] = s->scale[1] = dm[0];
            s->offset[0] = s->offset[1] = dm[1];
        } else {
            float d = fp16(b);
            s->scale[0] = s->scale[1] = d;
            s->offset[0] = s->offset[1] = format == QUANT_Q4_0 ? -8.0f * d : 0.0f;
        }
        if (format == QUANT_Q8_0) return load32(b + 2);
        u8x16 q = load16(b + bytes - 16); /* low nibbles: values 0..15, high: 16..31 */
        return join16(q & 0xF, q >> 4);
    }
    const long block = g / 8;
    const int j = (int)(g % 8);
    if (format == QUANT_Q4_K || format == QUANT_Q5_K) {
        const uint8_t *b = row + block * (format == QUANT_Q4_K ? 144 : 176);
        float d = fp16(b), dmin = fp16(b + 2);
        int sc, m;
        scale_min_k4(j, b + 4, &sc, &m);
        s->scale[0] = s->scale[1] = d * (float)sc;
        s->offset[0] = s->offset[1] = -dmin * (float)m;
        const uint8_t *qs = b + (format == QUANT_Q4_K ? 16 : 48);
        u8x32 q = load32(qs + 32 * (j / 2));
        u8x32 v = (j % 2) ? (q >> 4) : (q & low4);
        /* Q5_K: bit j of qh[l] (32 bytes after the scales) is value l's fifth bit. */
        if (format == QUANT_Q5_K) v |= ((load32(b + 16) >> j) & 1) << 4;
        return v;
    }
    /* Q6_K: ql[128] low 4 bits, qh[64] high 2 bits, int8 scales[16] per 16 values, d;
     * value = d * scale * (v - 32). Each half of 128 values has 4 groups. */
    const uint8_t *b = row + block * 210;
    const int8_t *scales = (const int8_t *)(b + 192);
    float d = fp16(b + 208);
    int half = j / 4, part = j % 4;
    u8x32 low = load32(b + 64 * half + 32 * (part % 2));
    low = part >= 2 ? (low >> 4) : (low & low4);
    u8x32 high = (load32(b + 128 + 32 * half) >> (2 * part)) & 3;
    s->scale[0] = d * (float)scales[2 * j];
    s->scale[1] = d * (float)scales[2 * j + 1];
    s->offset[0] = -32.0f * s->scale[0];
    s->offset[1] = -32.0f * s->scale[1];
    return low | (high << 4);
}

/* Activations quantized per 32: q [m, k] int8, scale [m, k / 32], and per 16 values
 * the sum of the values q stands for [m, k / 16]. With `lo` (the precise form), each
 * value is q * 256 + lo steps of scale: lo [m, k] int8 holds what rounding x to 8 bits
 * left, so activations carry about 16 bits and a dot product is 256 * (w . q) + w . lo. */
typedef struct {
    int8_t *q, *lo;
    float *scale, *sums;
    float *wide;   /* AVX-512 builds: each scale 8 times [m, k / 32 * 8], one vector a pair */
    float *gsums;  /* the sums per 32 values [m, k / 32] (the 32-value block path's) */
    long groups;   /* groups a row of the arrays above holds: k / 32 padded to a CHUNK's
                    * multiple, the padding zero (the block path reads whole chunks) */
    int interleave; /* the Q4 layout (see placed()) rather than the values in order */
} Acts;

/* Where value i of group g goes in a quantized activation row. In order, unless
 * `interleave`: the block path unpacks SET groups of 4-bit weights into one register,
 * their first 16 values from the low nibbles and their last 16 from the high ones, so
 * each set of SET groups is stored as [first halves of its groups | last halves]. */
INLINE long placed(int interleave, long g, int i) {
    if (!interleave) return g * GROUP + i;
    long set = g / SET, within = g % SET;
    return set * SET * GROUP + (i < 16 ? 0 : SET * 16) + within * 16 + i % 16;
}

/* One group's 32 values (float32 or bfloat16 at x) as floats. */
INLINE void load_group(const void *x, int dtype, long g, float v[GROUP]) {
    if (dtype == F32) {
        memcpy(v, (const float *)x + g * GROUP, GROUP * sizeof(float));
        return;
    }
    const uint16_t *h = (const uint16_t *)x + g * GROUP;
    uint32_t bits[GROUP];
    for (int i = 0; i < GROUP; i++) bits[i] = (uint32_t)h[i] << 16;
    memcpy(v, bits, sizeof bits);
}

/* The largest |v|: as integers, the bits of non-negative floats order as the floats do
 * (and so the loop vectorizes). */
INLINE float largest(const float v[GROUP]) {
    uint32_t bits[GROUP], top = 0;
    memcpy(bits, v, sizeof bits);
    for (int i = 0; i < GROUP; i++) {
        uint32_t b = bits[i] & 0x7fffffffu;
        top = b > top ? b : top;
    }
    float out;
    memcpy(&out, &top, 4);
    return out;
}

/* The loops below are written element by element for the compiler to vectorize. */
static void quantize_row(const void *x, int dtype, long k, int interleave, int8_t *q,
                         int8_t *lo, float *scale, float *sums, float *wide, float *gsums) {
    for (long g = 0; g < k / GROUP; g++) {
        float v[GROUP];
        load_group(x, dtype, g, v);
        float d = largest(v) / 127.0f, inv = d > 0.0f ? 1.0f / d : 0.0f;
        int r[GROUP];
        int8_t qv[GROUP], rest[GROUP];
        for (int i = 0; i < GROUP; i++) r[i] = (int)rintf(v[i] * inv); /* to nearest even */
        for (int i = 0; i < GROUP; i++) qv[i] = (int8_t)r[i];
        if (lo != NULL) {
            /* The remainder, within half a step, in steps of d / 256. */
            for (int i = 0; i < GROUP; i++) {
                float e = rintf((v[i] - (float)r[i] * d) * inv * 256.0f);
                e = e > 127.0f ? 127.0f : e < -127.0f ? -127.0f : e;
                rest[i] = (int8_t)(int)e;
                r[i] = r[i] * 256 + (int)e;
            }
        }
        int s0 = 0, s1 = 0;
        for (int i = 0; i < 16; i++) s0 += r[i];
        for (int i = 16; i < GROUP; i++) s1 += r[i];
        long first = placed(interleave, g, 0), last = placed(interleave, g, 16);
        memcpy(q + first, qv, 16);
        memcpy(q + last, qv + 16, 16);
        if (lo != NULL) {
            memcpy(lo + first, rest, 16);
            memcpy(lo + last, rest + 16, 16);
        }
        float step = lo != NULL ? d / 256.0f : d;
        scale[g] = step;
        if (wide != NULL)
            for (int i = 0; i < 8; i++) wide[g * 8 + i] = step;
        sums[2 * g] = step * (float)s0;
        sums[2 * g + 1] = step * (float)s1;
        gsums[g] = step * (float)(s0 + s1);
    }
}

/* The sum over a row's halves of offset * (activation scale * sum of q): what the offsets
 * add to a dot product. Four sums in flight: a single one waits on each add. */
INLINE float offset_dot(const float *offsets, const float *sums, long halves) {
    float acc[4] = {0};
    long h = 0;
    for (; h + 4 <= halves; h += 4)
        for (int i = 0; i < 4; i++) acc[i] += offsets[h + i] * sums[h + i];
    for (; h < halves; h++) acc[0] += offsets[h] * sums[h];
    return (acc[0] + acc[1]) + (acc[2] + acc[3]);
}

#if defined(__AVX2__)
/* acc[i] += group g of weight row `w` . the same group of activation row first + i. */
INLINE __m256i dot32(__m256i wu, __m256i x) {
#if defined(__AVX512VNNI__)
    return _mm256_dpbusd_epi32(_mm256_setzero_si256(), wu, x);
#else
    return _mm256_madd_epi16(_mm256_maddubs_epi16(wu, x), _mm256_set1_epi16(1));
#endif
}

/* One tile's activation rows, their own pointers: held in registers through the loop
 * (Python builds with -fno-strict-aliasing, so fields read through a struct would be
 * read again after every store). */
typedef struct {
    const int8_t *q[TILE], *lo[TILE];
    const float *scale[TILE], *wide[TILE];
} TileRows;

INLINE void group_dot(const int format, const int rows, const int precise, const uint8_t *w,
                      const TileRows *t, long g, float *restrict offsets, __m256 *acc) {
    const int is_signed = format == QUANT_Q8_0;
    GroupScales s;
    __m256i values = (__m256i)unpack_group(format, w, g, &s);
    offsets[2 * g] = s.offset[0];
    offsets[2 * g + 1] = s.offset[1];
    /* int32 lane l of a dot holds bytes 4l..4l+3: lanes 0-3 the first 16 values. */
    __m256 sv = _mm256_set_m128(_mm_set1_ps(s.scale[1]), _mm_set1_ps(s.scale[0]));
    /* The unsigned operand: |w| for Q8_0, its sign moved onto x. */
    __m256i wu = is_signed ? _mm256_sign_epi8(values, values) : values;
    for (int i = 0; i < rows; i++) {
        __m256i x = _mm256_loadu_si256((const __m256i *)(t->q[i] + g * GROUP));
        if (is_signed) x = _mm256_sign_epi8(x, values);
        __m256i dot = dot32(wu, x);
        if (precise) {
            __m256i rest = _mm256_loadu_si256((const __m256i *)(t->lo[i] + g * GROUP));
            if (is_signed) rest = _mm256_sign_epi8(rest, values);
            dot = _mm256_add_epi32(_mm256_slli_epi32(dot, 8), dot32(wu, rest));
        }
        float dx = t->scale[i][g];
        if (format == QUANT_Q6_K) { /* a scale per 16 values */
            __m256 scaled = _mm256_mul_ps(_mm256_cvtepi32_ps(dot), sv);
            acc[i] = _mm256_fmadd_ps(scaled, _mm256_set1_ps(dx), acc[i]);
        } else { /* one scale per 32: fold the activation's in */
            acc[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_set1_ps(s.scale[0] * dx),
                                     acc[i]);
        }
    }
}
#endif

#if defined(__AVX512F__)
/* group_dot for groups g and g + 1 at once, in 512-bit registers (VNNI). */
INLINE void pair_dot(const int format, const int rows, const int precise, const uint8_t *w,
                     const TileRows *t, long g, float *restrict offsets, __m512 *acc) {
    const int is_signed = format == QUANT_Q8_0;
    GroupScales s0, s1;
    __m256i v0 = (__m256i)unpack_group(format, w, g, &s0);
    __m256i v1 = (__m256i)unpack_group(format, w, g + 1, &s1);
    offsets[2 * g] = s0.offset[0];
    offsets[2 * g + 1] = s0.offset[1];
    offsets[2 * g + 2] = s1.offset[0];
    offsets[2 * g + 3] = s1.offset[1];
    __m512i values = _mm512_inserti64x4(_mm512_castsi256_si512(v0), v1, 1);
    __m256 lo = _mm256_set_m128(_mm_set1_ps(s0.scale[1]), _mm_set1_ps(s0.scale[0]));
    __m256 hi = _mm256_set_m128(_mm_set1_ps(s1.scale[1]), _mm_set1_ps(s1.scale[0]));
    __m512 sv = _mm512_insertf32x8(_mm512_castps256_ps512(lo), hi, 1);
    /* The unsigned operand: |w| for Q8_0, x negated where w is negative. */
    __m512i wu = is_signed ? _mm512_abs_epi8(values) : values;
    __mmask64 negative = is_signed ? _mm512_movepi8_mask(values) : 0;
#pragma GCC unroll 8
    for (int i = 0; i < rows; i++) {
        __m512i x = _mm512_loadu_si512((const void *)(t->q[i] + g * GROUP));
        if (is_signed) x = _mm512_mask_sub_epi8(x, negative, _mm512_setzero_si512(), x);
        __m512i dot = _mm512_dpbusd_epi32(_mm512_setzero_si512(), wu, x);
        if (precise) {
            __m512i rest = _mm512_loadu_si512((const void *)(t->lo[i] + g * GROUP));
            if (is_signed) rest = _mm512_mask_sub_epi8(rest, negative, _mm512_setzero_si512(), rest);
            dot = _mm512_add_epi32(_mm512_slli_epi32(dot, 8),
                                   _mm512_dpbusd_epi32(_mm512_setzero_si512(), wu, rest));
        }
        __m512 scaled = _mm512_mul_ps(_mm512_cvtepi32_ps(dot), sv);
        acc[i] = _mm512_fmadd_ps(scaled, _mm512_loadu_ps(t->wide[i] + g * 8), acc[i]);
    }
}
#endif

#if defined(__AVX2__)
/* Which block of a chunk's first `count` stands in for its block j: j itself, or for a
 * block past them (past the span or the row, perhaps past the weights) the last one, so
 * every read stays in the weights and the chunk's loops keep a fixed length. What those
 * stand-ins multiply adds nothing: their scales are zeroed (chunk_scales()), and the
 * activations they meet are a span's zero padding. */
INLINE long real_block(long j, int count) { return j < count ? j : count - 1; }

/* Groups one register of the block path holds: a set of SET 4-bit groups; Q8_0 groups
 * two (AVX-512) or one (AVX2) a register. */
INLINE int chunk_per(int format) {
#if defined(__AVX512F__)
    return format == QUANT_Q8_0 ? 2 : SET;
#else
    return format == QUANT_Q8_0 ? 1 : SET;
#endif
}

/* The weight scales of groups g..g+7 of a row and the offsets (weight = scale * value +
 * offset) that go with them; from group `count` on, zeros. The eight blocks' leading
 * four bytes (d, and m for Q4_1) are read one by one into a vector: a gather instruction
 * took a fifth of a batch-1 product's time on Zen 4. Q4_0's offset is -8 scales; the
 * AVX-512 build takes Q8_0's values as unsigned (+128), so its offset is -128 scales (the
 * AVX2 build moves the weights' signs onto the activations instead: no offset). */
INLINE void chunk_scales(const int format, const uint8_t *w, long g, int count, __m256 *scale,
                         __m256 *offset) {
    const int bytes = block32_bytes(format);
    const uint8_t *b = w + g * bytes;
    int32_t head[CHUNK];
    for (int j = 0; j < CHUNK; j++) memcpy(&head[j], b + real_block(j, count) * bytes, 4);
    /* built in registers, the stand-ins' lanes zeroed by a compare: eight small stores
     * read back as one vector would stall on store forwarding */
    __m256i raw = _mm256_setr_epi32(head[0], head[1], head[2], head[3], head[4], head[5],
                                    head[6], head[7]);
    const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    raw = _mm256_and_si256(raw, _mm256_cmpgt_epi32(_mm256_set1_epi32(count), lane));
#if defined(__AVX512F__)
    __m128i low = _mm256_cvtepi32_epi16(raw);
    __m128i high = _mm256_cvtepi32_epi16(_mm256_srli_epi32(raw, 16));
    const float q8_offset = -128.0f;
#else
    /* the low (high) 16 bits of each lane, packed: bytes 0-7 of each 128-bit half */
    const __m256i pick = _mm256_setr_epi8(0, 1, 4, 5, 8, 9, 12, 13, -1, -1, -1, -1, -1, -1, -1,
                                          -1, 0, 1, 4, 5, 8, 9, 12, 13, -1, -1, -1, -1, -1, -1,
                                          -1, -1);
    __m128i low = _mm256_castsi256_si128(
        _mm256_permute4x64_epi64(_mm256_shuffle_epi8(raw, pick), 0x08));
    __m128i high = _mm256_castsi256_si128(_mm256_permute4x64_epi64(
        _mm256_shuffle_epi8(_mm256_srli_epi32(raw, 16), pick), 0x08));
    const float q8_offset = 0.0f;
#endif
    *scale = _mm256_cvtph_ps(low); /* d */
    if (format == QUANT_Q4_1)
        *offset = _mm256_cvtph_ps(high); /* m */
    else
        *offset = _mm256_mul_ps(*scale, _mm256_set1_ps(format == QUANT_Q4_0 ? -8.0f : q8_offset));
}
#endif

#if defined(__AVX512F__)
/* The packed nibbles of groups g..g+3 (stand-ins from `count` on: see real_block()), a
 * group per 128-bit lane. */
INLINE __m512i nibble_set(const int bytes, const uint8_t *w, long g, int count) {
    const uint8_t *b = w + g * bytes + bytes - 16;
    __m128i part[SET];
    for (int j = 0; j < SET; j++)
        part[j] = _mm_loadu_si128((const __m128i *)(b + real_block(j, count) * bytes));
    __m512i v = _mm512_castsi128_si512(part[0]);
    v = _mm512_inserti32x4(v, part[1], 1);
    v = _mm512_inserti32x4(v, part[2], 2);
    return _mm512_inserti32x4(v, part[3], 3);
}

/* Q8_0 groups g and g + 1 (stand-ins from `count` on) as unsigned bytes, a group per
 * half. */
INLINE __m512i q8_pair(const uint8_t *w, long g, int count) {
    const uint8_t *b = w + g * 34 + 2;
    __m256i lo = _mm256_loadu_si256((const __m256i *)(b + real_block(0, count) * 34));
    __m256i hi = _mm256_loadu_si256((const __m256i *)(b + real_block(1, count) * 34));
    __m512i v = _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1);
    return _mm512_xor_si512(v, _mm512_set1_epi8((char)0x80));
}

/* `sum` + the int32 dot of unsigned weights with activation bytes at x: `first` against
 * x's 64 bytes and, for a Q4 set (`q4`), `last` against the 64 after them. */
INLINE __m512i dot64(const int q4, __m512i sum, __m512i first, __m512i last, const int8_t *x) {
    __m512i dot = _mm512_dpbusd_epi32(sum, first, _mm512_loadu_si512((const void *)x));
    return q4 ? _mm512_dpbusd_epi32(dot, last, _mm512_loadu_si512((const void *)(x + 64))) : dot;
}

/* One chunk (groups g..g+7, `count` of them real) of the block path for a tile's rows. A
 * register holds a pair of Q8_0 groups, or a set of 4 Q4 groups as their first and last
 * halves (`one`, `other`). Two accumulators a row, the offsets' share in lanes 0-7 of
 * the second: a tile of 6 rows' 12 and the chunk's weights fit the 32 registers. */
INLINE void block_chunk(const int format, const int rows, const int precise, const uint8_t *w,
                        const Acts *a, long first, long g, int count, const int regs,
                        __m512 acc[][2]) {
    __m256 scale, offset;
    chunk_scales(format, w, g, count, &scale, &offset);
    const long stride = a->groups * GROUP;
    const int q4 = format != QUANT_Q8_0;
    const int per = chunk_per(format), span = per * GROUP; /* groups, bytes a register */
    __m512i one[4], other[4];
    for (int p = 0; p < regs; p++) {
        if (q4) {
            const __m512i low4 = _mm512_set1_epi8(0xF);
            __m512i packed = nibble_set(block32_bytes(format), w, g + SET * p, count - SET * p);
            one[p] = _mm512_and_si512(packed, low4);
            other[p] = _mm512_and_si512(_mm512_srli_epi16(packed, 4), low4);
        } else {
            one[p] = other[p] = q8_pair(w, g + 2 * p, count - 2 * p);
        }
    }
    /* int32 lane l holds group per * p + l / 4 (Q4) or l / 8 (Q8_0) */
    const __m512i lane_group =
        q4 ? _mm512_set_epi32(3, 3, 3, 3, 2, 2, 2, 2, 1, 1, 1, 1, 0, 0, 0, 0)
           : _mm512_set_epi32(1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0);
#pragma GCC unroll 8
    for (int i = 0; i < rows; i++) {
        const long r = first + i;
        const int8_t *x = a->q + r * stride + g * GROUP;
        const int8_t *rest = precise ? a->lo + r * stride + g * GROUP : NULL;
        __m256 both = _mm256_mul_ps(scale, _mm256_loadu_ps(a->scale + r * a->groups + g));
        __m512 sums = _mm512_castps256_ps512(_mm256_loadu_ps(a->gsums + r * a->groups + g));
        acc[i][1] = _mm512_mask3_fmadd_ps(_mm512_castps256_ps512(offset), sums, acc[i][1], 0xFF);
        __m512 wide = _mm512_castps256_ps512(both);
        for (int p = 0; p < regs; p++) {
            __m512i dot = dot64(q4, _mm512_setzero_si512(), one[p], other[p], x + span * p);
            if (precise) /* 256 * (w . q) + w . lo, the remainder's dot added onto the first */
                dot = dot64(q4, _mm512_slli_epi32(dot, 8), one[p], other[p], rest + span * p);
            __m512i spread = _mm512_add_epi32(lane_group, _mm512_set1_epi32(per * p));
            acc[i][p & 1] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot),
                                            _mm512_permutexvar_ps(spread, wide), acc[i][p & 1]);
        }
    }
}

/* A span's last chunk, of `count` < CHUNK real groups: only the registers those fill
 * (stand-ins pad the last one), a compiled loop for each register count. A span of 18
 * groups (576 inputs) costs 20 groups' work here instead of 24 (AVX2: 18). */
INLINE void tail_chunk(const int format, const int rows, const int precise, const uint8_t *w,
                       const Acts *a, long first, long g, int count, __m512 acc[][2]) {
    switch ((count + chunk_per(format) - 1) / chunk_per(format)) {
    case 1: block_chunk(format, rows, precise, w, a, first, g, count, 1, acc); break;
    case 2: block_chunk(format, rows, precise, w, a, first, g, count, 2, acc); break;
    case 3: block_chunk(format, rows, precise, w, a, first, g, count, 3, acc); break;
    default:
        block_chunk(format, rows, precise, w, a, first, g, count, CHUNK / chunk_per(format), acc);
    }
}

/* out[i] = weight row `w` . activation row first + i (i < rows), for the formats of one
 * scale per 32 values, span by span (`a`: one Acts a span): a chunk of 8 groups a pass,
 * their scales in one vector; each span's float32 lanes are added into float64 ones, so
 * the spans' sums meet exactly (see QuantMatmul.span). Every row is summed in the same
 * order whatever `rows` is. */
INLINE void block_tile(const int format, const int rows, const int precise, const uint8_t *w,
                       const Acts *a, long spans, long span, long first, double *out) {
    const long groups = span / GROUP, span_bytes = groups * block32_bytes(format);
    __m512d total[TILE];
    for (int i = 0; i < rows; i++) total[i] = _mm512_setzero_pd();
    for (long s = 0; s < spans; s++) {
        const uint8_t *ws = w + s * span_bytes;
        __m512 acc[TILE][2];
        for (int i = 0; i < rows; i++) acc[i][0] = acc[i][1] = _mm512_setzero_ps();
        long g = 0;
        for (; g + CHUNK <= groups; g += CHUNK)
            block_chunk(format, rows, precise, ws, a + s, first, g, CHUNK,
                        CHUNK / chunk_per(format), acc);
        if (g < groups)
            tail_chunk(format, rows, precise, ws, a + s, first, g, (int)(groups - g), acc);
        for (int i = 0; i < rows; i++) {
            __m512 sum = _mm512_add_ps(acc[i][0], acc[i][1]);
            total[i] = _mm512_add_pd(total[i], _mm512_cvtps_pd(_mm512_castps512_ps256(sum)));
            total[i] = _mm512_add_pd(total[i], _mm512_cvtps_pd(_mm512_extractf32x8_ps(sum, 1)));
        }
    }
    for (int i = 0; i < rows; i++) out[i] = _mm512_reduce_add_pd(total[i]);
}
#elif defined(__AVX2__)
/* The AVX2 build's block path: the AVX-512 one's (see there) in 256-bit registers, two
 * 4-bit groups a register. vpmaddubsw's 16-bit sums hold Q4 products (at most
 * 4 * 15 * 127) but not unsigned Q8_0 ones, so Q8_0 moves its weights' signs onto the
 * activations instead. */

/* Q4: the int32 dot of a set's unpacked first and last halves with the activation part at
 * x (64 bytes: first halves, then last ones). */
INLINE __m256i q4_dot(__m256i first, __m256i last, const int8_t *x) {
    __m256i sum = _mm256_add_epi16(
        _mm256_maddubs_epi16(first, _mm256_loadu_si256((const __m256i *)x)),
        _mm256_maddubs_epi16(last, _mm256_loadu_si256((const __m256i *)(x + 32))));
    return _mm256_madd_epi16(sum, _mm256_set1_epi16(1));
}

/* Q8_0: the int32 dot of |w| with the 32 activation bytes at x signed as w is. */
INLINE __m256i q8_dot(__m256i magnitude, __m256i w, const int8_t *x) {
    __m256i a = _mm256_sign_epi8(_mm256_loadu_si256((const __m256i *)x), w);
    return _mm256_madd_epi16(_mm256_maddubs_epi16(magnitude, a), _mm256_set1_epi16(1));
}

INLINE void block_chunk(const int format, const int rows, const int precise, const uint8_t *w,
                        const Acts *a, long first, long g, int count, const int regs,
                        __m256 acc[][2], __m256 *offset_acc) {
    __m256 scale, offset;
    chunk_scales(format, w, g, count, &scale, &offset);
    const long stride = a->groups * GROUP;
    const int bytes = block32_bytes(format);
    __m256i one[CHUNK], other[CHUNK];
    for (int p = 0; p < regs; p++) {
        if (format == QUANT_Q8_0) {
            const uint8_t *b = w + (g + real_block(p, count)) * bytes + 2;
            __m256i v = _mm256_loadu_si256((const __m256i *)b);
            one[p] = _mm256_sign_epi8(v, v);
            other[p] = v;
        } else {
            const uint8_t *b = w + g * bytes + bytes - 16;
            __m128i lo = _mm_loadu_si128((const __m128i *)(b + real_block(SET * p, count) * bytes));
            __m128i hi =
                _mm_loadu_si128((const __m128i *)(b + real_block(SET * p + 1, count) * bytes));
            __m256i packed = _mm256_inserti128_si256(_mm256_castsi128_si256(lo), hi, 1);
            const __m256i low4 = _mm256_set1_epi8(0xF);
            one[p] = _mm256_and_si256(packed, low4);
            other[p] = _mm256_and_si256(_mm256_srli_epi16(packed, 4), low4);
        }
    }
    for (int i = 0; i < rows; i++) {
        const long r = first + i;
        const int8_t *x = a->q + r * stride + g * GROUP;
        const int8_t *rest = precise ? a->lo + r * stride + g * GROUP : NULL;
        __m256 both = _mm256_mul_ps(scale, _mm256_loadu_ps(a->scale + r * a->groups + g));
        offset_acc[i] = _mm256_fmadd_ps(offset, _mm256_loadu_ps(a->gsums + r * a->groups + g),
                                        offset_acc[i]);
        for (int p = 0; p < regs; p++) {
            __m256i dot, low;
            __m256i spread;
            if (format == QUANT_Q8_0) {
                dot = q8_dot(one[p], other[p], x + 32 * p);
                if (precise) low = q8_dot(one[p], other[p], rest + 32 * p);
                spread = _mm256_set1_epi32(p);
            } else {
                dot = q4_dot(one[p], other[p], x + 64 * p);
                if (precise) low = q4_dot(one[p], other[p], rest + 64 * p);
                /* int32 lane l holds group SET * p + l / 4 */
                spread = _mm256_setr_epi32(2 * p, 2 * p, 2 * p, 2 * p, 2 * p + 1, 2 * p + 1,
                                           2 * p + 1, 2 * p + 1);
            }
            if (precise) dot = _mm256_add_epi32(_mm256_slli_epi32(dot, 8), low);
            acc[i][p & 1] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot),
                                            _mm256_permutevar8x32_ps(both, spread), acc[i][p & 1]);
        }
    }
}

/* tail_chunk() of the AVX-512 build, in 256-bit registers. */
INLINE void tail_chunk(const int format, const int rows, const int precise, const uint8_t *w,
                       const Acts *a, long first, long g, int count, __m256 acc[][2],
                       __m256 *offset_acc) {
    switch ((count + chunk_per(format) - 1) / chunk_per(format)) {
    case 1: block_chunk(format, rows, precise, w, a, first, g, count, 1, acc, offset_acc); break;
    case 2: block_chunk(format, rows, precise, w, a, first, g, count, 2, acc, offset_acc); break;
    case 3: block_chunk(format, rows, precise, w, a, first, g, count, 3, acc, offset_acc); break;
    default:
        block_chunk(format, rows, precise, w, a, first, g, count, CHUNK / chunk_per(format), acc,
                    offset_acc);
    }
}

INLINE void block_tile(const int format, const int rows, const int precise, const uint8_t *w,
                       const Acts *a, long spans, long span, long first, double *out) {
    const long groups = span / GROUP, span_bytes = groups * block32_bytes(format);
    __m256d total[TILE][2];
    for (int i = 0; i < rows; i++) total[i][0] = total[i][1] = _mm256_setzero_pd();
    for (long s = 0; s < spans; s++) {
        const uint8_t *ws = w + s * span_bytes;
        __m256 acc[TILE][2];
        __m256 offset_acc[TILE];
        for (int i = 0; i < rows; i++)
            acc[i][0] = acc[i][1] = offset_acc[i] = _mm256_setzero_ps();
        long g = 0;
        for (; g + CHUNK <= groups; g += CHUNK)
            block_chunk(format, rows, precise, ws, a + s, first, g, CHUNK,
                        CHUNK / chunk_per(format), acc, offset_acc);
        if (g < groups)
            tail_chunk(format, rows, precise, ws, a + s, first, g, (int)(groups - g), acc,
                       offset_acc);
        for (int i = 0; i < rows; i++) {
            __m256 sum = _mm256_add_ps(_mm256_add_ps(acc[i][0], acc[i][1]), offset_acc[i]);
            total[i][0] = _mm256_add_pd(total[i][0], _mm256_cvtps_pd(_mm256_castps256_ps128(sum)));
            total[i][1] = _mm256_add_pd(total[i][1], _mm256_cvtps_pd(_mm256_extractf128_ps(sum, 1)));
        }
    }
    for (int i = 0; i < rows; i++) {
        __m256d t = _mm256_add_pd(total[i][0], total[i][1]);
        __m128d h = _mm_add_pd(_mm256_castpd256_pd128(t), _mm256_extractf128_pd(t, 1));
        out[i] = _mm_cvtsd_f64(_mm_add_sd(h, _mm_unpackhi_pd(h, h)));
    }
}
#endif

/* out[i] (i < rows) = weight row `w` . activation row first + i, for i < `rows`; the
 * group offsets go to `offsets` [k / 16] on the way. `format` and `rows` are compile-time
 * constants at every call (see tiles()), so each pair gets its own loop. */
INLINE void dot_tile(const int format, const int rows, const int precise, const uint8_t *w,
                     const Acts *a, long first, long k, float *offsets, float *out) {
    const long groups = k / GROUP;
    const int is_signed = format == QUANT_Q8_0;
#if defined(__AVX2__)
    (void)is_signed; /* the generic loop's: the vector code asks the format itself */
    TileRows t;
    for (int i = 0; i < rows; i++) {
        t.q[i] = a->q + (first + i) * a->groups * GROUP;
        t.lo[i] = precise ? a->lo + (first + i) * a->groups * GROUP : NULL;
        t.scale[i] = a->scale + (first + i) * a->groups;
        t.wide[i] = a->wide != NULL ? a->wide + (first + i) * a->groups * 8 : NULL;
    }
#if defined(__AVX512F__)
    __m512 wide[TILE];
    __m256 acc[TILE];
    for (int i = 0; i < rows; i++) {
        wide[i] = _mm512_setzero_ps();
        acc[i] = _mm256_setzero_ps();
    }
    long g = 0;
    for (; g + 2 <= groups; g += 2) pair_dot(format, rows, precise, w, &t, g, offsets, wide);
    if (g < groups) group_dot(format, rows, precise, w, &t, g, offsets, acc);
    for (int i = 0; i < rows; i++)
        acc[i] = _mm256_add_ps(acc[i], _mm256_add_ps(_mm512_castps512_ps256(wide[i]),
                                                     _mm512_extractf32x8_ps(wide[i], 1)));
#else
    __m256 acc[TILE];
    for (int i = 0; i < rows; i++) acc[i] = _mm256_setzero_ps();
    /* Two groups a pass, each with its own accumulators: one chain of fused adds would
     * wait on the one before. */
    __m256 odd[TILE];
    for (int i = 0; i < rows; i++) odd[i] = _mm256_setzero_ps();
    long g = 0;
    for (; g + 2 <= groups; g += 2) {
        group_dot(format, rows, precise, w, &t, g, offsets, acc);
        group_dot(format, rows, precise, w, &t, g + 1, offsets, odd);
    }
    if (g < groups) group_dot(format, rows, precise, w, &t, g, offsets, acc);
    for (int i = 0; i < rows; i++) acc[i] = _mm256_add_ps(acc[i], odd[i]);
#endif
    for (int i = 0; i < rows; i++) {
        __m128 h = _mm_add_ps(_mm256_castps256_ps128(acc[i]), _mm256_extractf128_ps(acc[i], 1));
        h = _mm_add_ps(h, _mm_movehl_ps(h, h));
        h = _mm_add_ss(h, _mm_movehdup_ps(h));
        out[i] = _mm_cvtss_f32(h);
    }
#else
    float acc[TILE] = {0};
    for (long g = 0; g < groups; g++) {
        GroupScales s;
        u8x32 values = unpack_group(format, w, g, &s);
        offsets[2 * g] = s.offset[0];
        offsets[2 * g + 1] = s.offset[1];
        for (int i = 0; i < rows; i++) {
            long r = first + i;
            const int8_t *x = a->q + r * a->groups * GROUP + g * GROUP;
            const int8_t *rest = precise ? a->lo + r * a->groups * GROUP + g * GROUP : NULL;
            int lo = 0, hi = 0;
            for (int j = 0; j < 32; j++) {
                int wj = is_signed ? (int)(int8_t)values[j] : (int)values[j];
                int xj = precise ? x[j] * 256 + rest[j] : x[j];
                if (j < 16) lo += wj * xj; else hi += wj * xj;
            }
            float sum = (float)lo * s.scale[0] + (float)hi * s.scale[1];
            acc[i] += sum * a->scale[r * a->groups + g];
        }
    }
    for (int i = 0; i < rows; i++) out[i] = acc[i];
#endif
    for (int i = 0; i < rows; i++)
        out[i] += offset_dot(offsets, a->sums + (first + i) * 2 * a->groups, k / 16);
}

/* out[i] (i < rows) = weight row `w` . activation row first + i, span by span (`a`: one
 * Acts a span), each span's float32 sum added in float64. */
INLINE void span_tile(const int format, const int rows, const int precise, const uint8_t *w,
                      const Acts *a, long spans, long span, long first, float *offsets,
                      double *out) {
#if defined(__AVX2__)
    if (block_path(format)) {
        block_tile(format, rows, precise, w, a, spans, span, first, out);
        return;
    }
#endif
    Format f;
    format_of(format, &f);
    const long span_bytes = span / f.values * f.bytes;
    for (int i = 0; i < rows; i++) out[i] = 0.0;
    for (long s = 0; s < spans; s++) {
        float part[TILE];
        dot_tile(format, rows, precise, w + s * span_bytes, a + s, first, span, offsets, part);
        for (int i = 0; i < rows; i++) out[i] += part[i];
    }
}

/* Weight row `c` against activation rows m0..m1, TILE at a time, span by span (`a`:
 * one Acts a span). */
INLINE void tiles(const QuantMatmul *p, const int format, const Acts *a, long c, long m0,
                  long m1, float *offsets);

/* A float64 partial sum is stored as it is; a whole product's result is rounded to
 * float32 first, as a shard group's all-reduced partials are. */
INLINE void store_out(const QuantMatmul *p, long r, long c, double total) {
    long at = r * p->out_row_stride + c;
    if (p->out_dtype == F64) {
        ((double *)p->out)[at] = total;
        return;
    }
    float v = (float)total;
    if (p->bias != NULL) v += p->bias[c];
    if (p->out_dtype == F32) {
        ((float *)p->out)[at] = v;
        return;
    }
    ((uint16_t *)p->out)[at] = bf16_bits(v);
}

const char *quant_matmul_check(const QuantMatmul *p) {
    Format f;
    if (!format_of(p->format, &f)) return "unknown weight format";
    if (p->dtype != F32 && p->dtype != BF16) return "dtype is not float32 or bfloat16";
    if (p->m < 0 || p->n < 0 || p->k <= 0 || p->k % f.values != 0)
        return "k must be a positive multiple of the format's block size";
    if (p->row_bytes != p->k / f.values * f.bytes) return "row_bytes does not fit k";
    if (p->span <= 0 || p->span % f.values != 0 || p->k % p->span != 0)
        return "span must be a multiple of the format's block size that divides k";
    if (p->out_dtype != p->dtype && p->out_dtype != F64) return "out_dtype is not x's or float64";
    if (p->out_dtype == F64 && p->bias != NULL) return "float64 partial sums take no bias";
    if (p->x_row_stride < p->k || p->out_row_stride < p->n) return "a row stride is too small";
    if (p->threads < 1) return "threads must be at least 1";
    return NULL;
}

INLINE void tiles(const QuantMatmul *p, const int format, const Acts *a, long c, long m0,
                  long m1, float *offsets) {
    const long span = p->span, spans = p->k / span;
    const uint8_t *w = p->w + c * p->row_bytes;
    const int precise = a->lo != NULL;
    for (long r = m0, rows; r < m1; r += rows) {
        long left = m1 - r;
#if TILE > 4
        /* the rows left in as few tiles as TILE allows, as even as can be (7: 4 + 3, not
         * 6 + 1: the one row would cost a whole pass's unpacking for itself) */
        long count = (left + TILE - 1) / TILE;
        rows = (left + count - 1) / count;
#else
        /* whole tiles first: at 4 rows an even split (5: 3 + 2) was no faster on AVX2 */
        rows = left < TILE ? left : TILE;
#endif
        double total[TILE];
        /* rows and precise as compile-time constants: each pair gets its own loop */
#define TILE_CASE(n)                                                                           \
    case 2 * (n) + 1: span_tile(format, n, 1, w, a, spans, span, r, offsets, total); break; \
    case 2 * (n): span_tile(format, n, 0, w, a, spans, span, r, offsets, total); break;
        switch (rows * 2 + precise) {
#if TILE > 4
            TILE_CASE(6)
            TILE_CASE(5)
#endif
            TILE_CASE(4)
            TILE_CASE(3)
            TILE_CASE(2)
        case 3: span_tile(format, 1, 1, w, a, spans, span, r, offsets, total); break;
        default: span_tile(format, 1, 0, w, a, spans, span, r, offsets, total); break;
        }
#undef TILE_CASE
        for (long i = 0; i < rows; i++) store_out(p, r + i, c, total[i]);
    }
}

/* Output columns first..last (weight rows) for activation rows m0..m1 (`a`: one Acts a
 * span). */
static void columns(const QuantMatmul *p, const Acts *a, long first, long last, long m0,
                    long m1, float *offsets) {
    for (long c = first; c < last; c++) {
        switch (p->format) {
        case QUANT_Q4_0: tiles(p, QUANT_Q4_0, a, c, m0, m1, offsets); break;
        case QUANT_Q4_1: tiles(p, QUANT_Q4_1, a, c, m0, m1, offsets); break;
        case QUANT_Q8_0: tiles(p, QUANT_Q8_0, a, c, m0, m1, offsets); break;
        case QUANT_Q4_K: tiles(p, QUANT_Q4_K, a, c, m0, m1, offsets); break;
        case QUANT_Q5_K: tiles(p, QUANT_Q5_K, a, c, m0, m1, offsets); break;
        default: tiles(p, QUANT_Q6_K, a, c, m0, m1, offsets); break;
        }
    }
}

int quant_matmul_run(const QuantMatmul *p) {
    const long m = p->m, n = p->n, span = p->span, spans = p->k / span;
    if (m == 0 || n == 0) return 0;
    const int threads = p->threads;
    /* Each span's activations on their own [m, groups * 32], rows padded to whole chunks
     * with zeros (calloc): the block path reads whole chunks. */
    const long groups = (span / GROUP + CHUNK - 1) / CHUNK * CHUNK;
    const size_t values = (size_t)spans * (size_t)m * (size_t)groups * GROUP;
    const size_t group_count = values / GROUP;
    int8_t *q = calloc(values, 1);
    int8_t *lo = p->precise ? calloc(values, 1) : NULL;
#if defined(__AVX512F__)
    float *wide = calloc(group_count * 8, sizeof(float));
#else
    float *wide = NULL;
#endif
    float *scales = calloc(group_count, sizeof(float));
    float *gsums = calloc(group_count, sizeof(float));
    float *sums = calloc(group_count * 2, sizeof(float));
    float *offsets = malloc(sizeof(float) * (size_t)(span / 16) * (size_t)threads);
    Acts *acts = malloc(sizeof(Acts) * (size_t)spans);
    int status = (q && scales && gsums && sums && offsets && acts && (lo || !p->precise)) ? 0 : -1;
#if defined(__AVX512F__)
    if (wide == NULL) status = -1;
#endif
    if (status == 0) {
        const int elem = p->dtype == F32 ? 4 : 2;
        const int interleave = block_path(p->format) && p->format != QUANT_Q8_0;
        for (long s = 0; s < spans; s++) {
            const size_t at = (size_t)s * (size_t)m * (size_t)groups; /* its first group */
            acts[s] = (Acts){q + at * GROUP,   lo ? lo + at * GROUP : NULL,
                             scales + at,      sums + at * 2,
                             wide ? wide + at * 8 : NULL,
                             gsums + at,       groups,
                             interleave};
        }
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1 && m >= 16)
        for (long r = 0; r < m; r++) {
            for (long s = 0; s < spans; s++) {
                const Acts *a = acts + s;
                const long g = r * groups;
                quantize_row((const char *)p->x + (size_t)(r * p->x_row_stride + s * span) * elem,
                             p->dtype, span, interleave, a->q + g * GROUP,
                             a->lo ? a->lo + g * GROUP : NULL, a->scale + g, a->sums + g * 2,
                             a->wide ? a->wide + g * 8 : NULL, a->gsums + g);
            }
        }
        const long tasks = (n + ROWS_PER_TASK - 1) / ROWS_PER_TASK;
#pragma omp parallel num_threads(threads) if (threads > 1 && tasks > 1)
        {
#if defined(_OPENMP)
            float *mine = offsets + (size_t)(span / 16) * (size_t)omp_get_thread_num();
#else
            float *mine = offsets;
#endif
            for (long m0 = 0; m0 < m; m0 += M_BLOCK) {
                long m1 = m0 + M_BLOCK < m ? m0 + M_BLOCK : m;
#pragma omp for schedule(static)
                for (long t = 0; t < tasks; t++) {
                    long last = (t + 1) * ROWS_PER_TASK < n ? (t + 1) * ROWS_PER_TASK : n;
                    columns(p, acts, t * ROWS_PER_TASK, last, m0, m1, mine);
                }
            }
        }
    }
    free(q);
    free(lo);
    free(wide);
    free(scales);
    free(gsums);
    free(sums);
    free(offsets);
    free(acts);
    return status;
}

const char *quant_rows_check(const QuantRows *p) {
    Format f;
    if (!format_of(p->format, &f)) return "unknown weight format";
    if (p->dtype != F32 && p->dtype != BF16) return "dtype is not float32 or bfloat16";
    if (p->k <= 0 || p->k % f.values != 0)
        return "k must be a positive multiple of the format's block size";
    if (p->row_bytes != p->k / f.values * f.bytes) return "row_bytes does not fit k";
    if (p->threads < 1) return "threads must be at least 1";
    for (long i = 0; i < p->count; i++)
        if (p->rows[i] < 0 || p->rows[i] >= p->total_rows) return "a row index is out of range";
    return NULL;
}

/* Row `row` of a weight dequantized into out[0:k] (float32 or bfloat16); `format` is a
 * compile-time constant at each call, so the inner loop vectorizes. */
INLINE void dequantize_row(const int format, const uint8_t *row, long k, int dtype, void *out) {
    const int is_signed = format == QUANT_Q8_0;
    for (long g = 0; g < k / GROUP; g++) {
        GroupScales s;
        u8x32 values = unpack_group(format, row, g, &s);
        float v[GROUP];
        for (int j = 0; j < GROUP; j++) {
            float q = is_signed ? (float)(int8_t)values[j] : (float)values[j];
            v[j] = s.scale[j / 16] * q + s.offset[j / 16];
        }
        if (dtype == F32) {
            memcpy((float *)out + g * GROUP, v, sizeof v);
            continue;
        }
        for (int j = 0; j < GROUP; j++) {
            uint32_t bits;
            memcpy(&bits, &v[j], 4);
            bits = bits + 0x7fffu + ((bits >> 16) & 1u);
            ((uint16_t *)out)[g * GROUP + j] = (uint16_t)(bits >> 16);
        }
    }
}

int quant_rows_run(const QuantRows *p) {
    const long k = p->k;
    const size_t row_out = (size_t)k * (p->dtype == F32 ? 4 : 2);
    /* a whole matrix (the prefill's dequantize-then-multiply) is worth the threads */
#pragma omp parallel for schedule(static) num_threads(p->threads) if (p->count * k >= 1L << 18)
    for (long i = 0; i < p->count; i++) {
        const uint8_t *row = p->w + p->rows[i] * p->row_bytes;
        void *out = (char *)p->out + (size_t)i * row_out;
        switch (p->format) {
        case QUANT_Q4_0: dequantize_row(QUANT_Q4_0, row, k, p->dtype, out); break;
        case QUANT_Q4_1: dequantize_row(QUANT_Q4_1, row, k, p->dtype, out); break;
        case QUANT_Q8_0: dequantize_row(QUANT_Q8_0, row, k, p->dtype, out); break;
        case QUANT_Q4_K: dequantize_row(QUANT_Q4_K, row, k, p->dtype, out); break;
        case QUANT_Q5_K: dequantize_row(QUANT_Q5_K, row, k, p->dtype, out); break;
        default: dequantize_row(QUANT_Q6_K, row, k, p->dtype, out); break;
        }
    }
    return 0;
}
