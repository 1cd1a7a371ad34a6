/* The Llama MLP's silu(gate) * up, in place on the fused gate/up projection's output, on
 * the CPU. One kernel for the Python layers and the compiled decode step (decode_step.c),
 * so the two give the same bits: torch's SiLU and libm's expf each round their own way,
 * and a last-bit difference, carried through 30 layers, can change a greedy answer. The
 * rounding is torch's in-place silu_ then mul_: for bfloat16, each result rounded. */
#include "kernels.h"
#include "vec.h"

#define PARALLEL_ROWS 16 /* fewer rows stay on one thread: waking others costs more */

INLINE void silu_rows(const SiluMul *p, const int DTYPE) {
    const long inter = p->intermediate;
#pragma omp parallel for schedule(static) num_threads(p->threads) if (p->rows >= PARALLEL_ROWS)
    for (long r = 0; r < p->rows; r++) {
        const long base = r * 2 * inter;
        for (long j = 0; j < inter; j += LANES) {
            vec g = load(element(p->gate_up, DTYPE, base + j), DTYPE);
            vec up = load(element(p->gate_up, DTYPE, base + inter + j), DTYPE);
            vec s;
            for (int l = 0; l < LANES; l++) s[l] = g[l] / (1.0f + exp_approx(-g[l]));
            if (DTYPE == BF16) s = round_bf16(s);
            store(p->gate_up, DTYPE, base + j, s * up);
        }
    }
}

const char *silu_mul_check(const SiluMul *p) {
    if (p->rows < 0) return "rows must not be negative";
    if (p->intermediate <= 0 || p->intermediate % WIDE != 0)
        return "the MLP width is not a positive multiple of 16";
    if (p->dtype != F32 && p->dtype != BF16) return "dtype is not float32 or bfloat16";
    if (p->threads < 1) return "threads must be at least 1";
    return NULL;
}

void silu_mul_run(const SiluMul *p) {
    if (p->dtype == F32)
        silu_rows(p, F32);
    else
        silu_rows(p, BF16);
}
