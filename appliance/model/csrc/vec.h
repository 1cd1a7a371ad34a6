/* What the CPU kernels share: float vectors (GCC/Clang vector extensions, which the
 * compiler maps to whatever SIMD the CPU has) and loads and stores of float32 or
 * bfloat16 rows as float32. */
#ifndef APPLIANCE_VEC_H
#define APPLIANCE_VEC_H

#include <math.h>
#include <stdint.h>
#include <string.h>

#if defined(__F16C__)
#include <immintrin.h>
#endif

enum { F32 = 0, BF16 = 1, F64 = 2 }; /* element types, as cpu_kernels/loading.py numbers them */
#define INLINE static inline __attribute__((always_inline))

/* A vec is one register of the build: GCC keeps a vector wider than the registers in
 * memory across loop iterations (16 floats on AVX2 made decode attention 2.6x slower than
 * on AVX-512). Sums across a vector's lanes are defined on WIDE = 16 lanes in every build
 * (a row's value j in lane j % 16), held as PARTS vecs, so each build adds in the same
 * order and gives the same bits. */
#if defined(__AVX512F__)
#define LANES 16
#elif defined(__AVX__)
#define LANES 8
#else
#define LANES 4 /* SSE2, NEON */
#endif
#define WIDE 16
#define PARTS (WIDE / LANES)

typedef float vec __attribute__((vector_size(LANES * sizeof(float))));
typedef float half_vec __attribute__((vector_size(8 * sizeof(float))));
typedef float quarter_vec __attribute__((vector_size(4 * sizeof(float))));
typedef uint16_t vec_u16 __attribute__((vector_size(LANES * sizeof(uint16_t))));
typedef uint32_t vec_u32 __attribute__((vector_size(LANES * sizeof(uint32_t))));

/* The IEEE half float at p (a block format's scale). */
INLINE float fp16(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, 2);
#if defined(__F16C__)
    return _cvtsh_ss(h);
#else
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16, exp = (h >> 10) & 0x1fu, man = h & 0x3ffu;
    uint32_t bits;
    if (exp == 0) { /* zero or subnormal: man * 2^-24 */
        float f = ldexpf((float)man, -24);
        memcpy(&bits, &f, 4);
        bits |= sign;
    } else if (exp == 31) {
        bits = sign | 0x7f800000u | (man << 13);
    } else {
        bits = sign | ((exp + 112) << 23) | (man << 13);
    }
    float f;
    memcpy(&f, &bits, 4);
    return f;
#endif
}

/* Element `offset` of a float32 or bfloat16 array. */
INLINE const void *element(const void *base, int dtype, long offset) {
    return dtype == F32 ? (const void *)((const float *)base + offset)
                        : (const void *)((const uint16_t *)base + offset);
}

/* LANES elements from `src` as floats. */
INLINE vec load(const void *src, int dtype) {
    vec v;
    if (dtype == F32) {
        memcpy(&v, src, sizeof v);
        return v;
    }
    vec_u16 half;
    memcpy(&half, src, sizeof half);
    vec_u32 bits = __builtin_convertvector(half, vec_u32) << 16; /* bfloat16: the top half */
    memcpy(&v, &bits, sizeof v);
    return v;
}

/* `v` rounded to bfloat16 (to nearest even, as torch rounds), still as floats. */
INLINE vec round_bf16(vec v) {
    vec_u32 bits;
    memcpy(&bits, &v, sizeof bits);
    vec_u32 rounded = (bits + 0x7fffu + ((bits >> 16) & 1u)) & 0xffff0000u;
    vec_u32 nan = (bits & 0x7fffffffu) > 0x7f800000u; /* all ones where v is NaN */
    rounded = (rounded & ~nan) | ((bits | 0x400000u) & 0xffff0000u & nan);
    memcpy(&v, &rounded, sizeof v);
    return v;
}

/* One bfloat16 as a float. */
INLINE float bf16_value(uint16_t bits) {
    uint32_t wide = (uint32_t)bits << 16;
    float f;
    memcpy(&f, &wide, 4);
    return f;
}

/* One float rounded to bfloat16 (to nearest even, as torch rounds; NaN stays NaN). */
INLINE uint16_t bf16_bits(float f) {
    uint32_t bits;
    memcpy(&bits, &f, 4);
    if ((bits & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((bits | 0x400000u) >> 16);
    return (uint16_t)((bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16);
}

/* Stores LANES floats at element `offset` of a float32 or bfloat16 array. */
INLINE void store(void *base, int dtype, long offset, vec v) {
    if (dtype == F32) {
        memcpy((float *)base + offset, &v, sizeof v);
        return;
    }
    vec_u32 bits;
    vec rounded = round_bf16(v);
    memcpy(&bits, &rounded, sizeof bits);
    vec_u16 half = __builtin_convertvector(bits >> 16, vec_u16);
    memcpy((uint16_t *)base + offset, &half, sizeof half);
}

/* e^x, about 1 ulp: e^x = 2^n e^r with n rounded to nearest, |r| <= ln2 / 2, and Cephes'
 * polynomial for e^r. A loop of these vectorizes, libm's expf does not. Below -87 it
 * gives ~1e-38 instead of less (a softmax's far scores); from about 88.4 infinity. */
INLINE float exp_approx(float x) {
    const float round = 12582912.0f; /* 1.5 * 2^23: adding it rounds to an integer */
    x = x < -87.0f ? -87.0f : x > 89.0f ? 89.0f : x; /* 89: n = 128, 2^n infinite */
    float n = (x * 1.44269504088896341f + round) - round;
    float r = x - n * 0.693359375f + n * 2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    int32_t bits = ((int32_t)n + 127) << 23;
    float two_n;
    memcpy(&two_n, &bits, sizeof two_n);
    return p * two_n;
}

/* A 16-lane sum held as PARTS vecs, its lanes 0-7 added to lanes 8-15. */
INLINE half_vec fold_half(const vec part[PARTS]) {
#if LANES == 16
    return __builtin_shufflevector(part[0], part[0], 0, 1, 2, 3, 4, 5, 6, 7) +
           __builtin_shufflevector(part[0], part[0], 8, 9, 10, 11, 12, 13, 14, 15);
#elif LANES == 8
    return part[0] + part[1];
#else
    vec low = part[0] + part[2], high = part[1] + part[3];
    return __builtin_shufflevector(low, high, 0, 1, 2, 3, 4, 5, 6, 7);
#endif
}

/* The sum of a 16-lane sum's lanes, folded in halves (the same order in every build). */
INLINE float fold(const vec part[PARTS]) {
    half_vec h = fold_half(part);
    quarter_vec q = __builtin_shufflevector(h, h, 0, 1, 2, 3) +
                    __builtin_shufflevector(h, h, 4, 5, 6, 7);
    return (q[0] + q[2]) + (q[1] + q[3]);
}

/* fold() of four 16-lane sums into out[0..3], together: a shuffle serves four. */
INLINE void fold4(const vec part[4][PARTS], float *out) {
    half_vec h[4];
    for (int u = 0; u < 4; u++) h[u] = fold_half(part[u]);
    /* [h0's lanes 0-3 folded | h1's], then [h2's | h3's] */
    half_vec a = __builtin_shufflevector(h[0], h[1], 0, 1, 2, 3, 8, 9, 10, 11) +
                 __builtin_shufflevector(h[0], h[1], 4, 5, 6, 7, 12, 13, 14, 15);
    half_vec b = __builtin_shufflevector(h[2], h[3], 0, 1, 2, 3, 8, 9, 10, 11) +
                 __builtin_shufflevector(h[2], h[3], 4, 5, 6, 7, 12, 13, 14, 15);
    /* two lanes a sum: [h0 h0 h1 h1 h2 h2 h3 h3] */
    half_vec c = __builtin_shufflevector(a, b, 0, 1, 4, 5, 8, 9, 12, 13) +
                 __builtin_shufflevector(a, b, 2, 3, 6, 7, 10, 11, 14, 15);
    quarter_vec d = __builtin_shufflevector(c, c, 0, 2, 4, 6) +
                    __builtin_shufflevector(c, c, 1, 3, 5, 7);
    memcpy(out, &d, sizeof d);
}

#endif
