/* A residual add and the RMSNorm after it in one pass over the rows (the Llama layer's
 * `h = norm(residual += x)`), on the CPU. torch runs these as an add and a norm made of
 * several ops, each a pass over the rows and a few microseconds of dispatch: at batch 1
 * its 61 norms a step took more time than the attention. The result is rounded as torch
 * rounds it: the sum to the dtype, then x * rstd * weight in float32, once. */
#include <math.h>

#include "kernels.h"
#include "vec.h"

#define PARALLEL_ROWS 64 /* fewer rows stay on one thread: waking others costs more */

INLINE void norm_rows(const AddRmsNorm *p, const int DTYPE) {
#pragma omp parallel for schedule(static) num_threads(p->threads) if (p->rows >= PARALLEL_ROWS)
    for (long r = 0; r < p->rows; r++) {
        long base = r * p->dim;
        vec squares[PARTS] = {0}; /* value j's square in lane j % 16 (see vec.h) */
        for (long j = 0; j < p->dim; j += LANES) {
            vec s = load(element(p->residual, DTYPE, base + j), DTYPE);
            if (p->x != NULL) {
                s += load(element(p->x, DTYPE, base + j), DTYPE);
                if (DTYPE == BF16) s = round_bf16(s); /* the sum as the dtype holds it */
                store(p->residual, DTYPE, base + j, s);
            }
            squares[j / LANES % PARTS] += s * s;
        }
        float rstd = 1.0f / sqrtf(fold(squares) / (float)p->dim + p->eps);
        for (long j = 0; j < p->dim; j += LANES) {
            vec s = load(element(p->residual, DTYPE, base + j), DTYPE);
            vec w = load(element(p->weight, DTYPE, j), DTYPE);
            store(p->out, DTYPE, base + j, s * rstd * w);
        }
    }
}

const char *add_rms_norm_check(const AddRmsNorm *p) {
    if (p->dim <= 0 || p->dim % WIDE != 0) return "row size is not a positive multiple of 16";
    if (p->dtype != F32 && p->dtype != BF16) return "dtype is not float32 or bfloat16";
    if (p->threads < 1) return "threads must be at least 1";
    return NULL;
}

void add_rms_norm_run(const AddRmsNorm *p) {
    if (p->dtype == F32)
        norm_rows(p, F32);
    else
        norm_rows(p, BF16);
}
