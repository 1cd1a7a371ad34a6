/* What the CPU kernels share: float vectors (GCC/Clang vector extensions, which the
 * compiler maps to whatever SIMD the CPU has) and loads and stores of float32 or
 * bfloat16 rows as float32. */
#ifndef APPLIANCE_VEC_H
#define APPLIANCE_VEC_H

#include <stdint.h>
#include <string.h>

enum { F32 = 0, BF16 = 1, F64 = 2 }; /* element types, as cpu_kernels.py numbers them */
#define LANES 16            /* floats per vector: one AVX-512 register, two AVX2 ones */
#define INLINE static inline __attribute__((always_inline))

typedef float vec __attribute__((vector_size(LANES * sizeof(float))));
typedef float half_vec __attribute__((vector_size(LANES / 2 * sizeof(float))));
typedef float quarter_vec __attribute__((vector_size(LANES / 4 * sizeof(float))));
typedef uint16_t vec_u16 __attribute__((vector_size(LANES * sizeof(uint16_t))));
typedef uint32_t vec_u32 __attribute__((vector_size(LANES * sizeof(uint32_t))));

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

/* The sum of a vector's lanes, folded in halves. */
INLINE float fold(vec v) {
    half_vec h = __builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7) +
                 __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15);
    quarter_vec q = __builtin_shufflevector(h, h, 0, 1, 2, 3) +
                    __builtin_shufflevector(h, h, 4, 5, 6, 7);
    return (q[0] + q[2]) + (q[1] + q[3]);
}

#endif
