/* Python bindings of the CPU kernels (appliance.model._cpu_kernels). Tensors come as
 * their data_ptr() and sizes; appliance/model/cpu_kernels/ checks shapes, dtypes and
 * contiguity, each kernel's *_check() what it reads through. Each call releases the GIL. */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include "kernels.h"

static PyObject *paged_decode(PyObject *self, PyObject *args) {
    (void)self;
    unsigned long long q, k, v, tables, lens, out;
    PagedDecode p;
    if (!PyArg_ParseTuple(args, "KKKKKKlllllllllfii", &q, &k, &v, &tables, &lens, &out, &p.n,
                          &p.heads, &p.kv_heads, &p.head_dim, &p.blocks, &p.block_size,
                          &p.table_width, &p.q_row_stride, &p.window, &p.scale, &p.dtype,
                          &p.threads))
        return NULL;
    p.q = (const void *)(uintptr_t)q;
    p.k = (const void *)(uintptr_t)k;
    p.v = (const void *)(uintptr_t)v;
    p.tables = (const int64_t *)(uintptr_t)tables;
    p.lens = (const int64_t *)(uintptr_t)lens;
    p.out = (void *)(uintptr_t)out;
    const char *problem = paged_decode_check(&p);
    if (problem != NULL) {
        PyErr_SetString(PyExc_ValueError, problem);
        return NULL;
    }
    int status;
    Py_BEGIN_ALLOW_THREADS
    status = paged_decode_run(&p);
    Py_END_ALLOW_THREADS
    if (status != 0) return PyErr_NoMemory();
    Py_RETURN_NONE;
}

static PyObject *add_rms_norm(PyObject *self, PyObject *args) {
    (void)self;
    unsigned long long x, weight, residual, out;
    AddRmsNorm p;
    if (!PyArg_ParseTuple(args, "KKKKllfii", &x, &weight, &residual, &out, &p.rows, &p.dim,
                          &p.eps, &p.dtype, &p.threads))
        return NULL;
    p.x = (const void *)(uintptr_t)x;
    p.weight = (const void *)(uintptr_t)weight;
    p.residual = (void *)(uintptr_t)residual;
    p.out = (void *)(uintptr_t)out;
    const char *problem = add_rms_norm_check(&p);
    if (problem != NULL) {
        PyErr_SetString(PyExc_ValueError, problem);
        return NULL;
    }
    Py_BEGIN_ALLOW_THREADS
    add_rms_norm_run(&p);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

static PyObject *rope_store(PyObject *self, PyObject *args) {
    (void)self;
    unsigned long long qkv, cos, sin, slots, k, v;
    RopeStore p;
    if (!PyArg_ParseTuple(args, "KKKKKKlllllii", &qkv, &cos, &sin, &slots, &k, &v, &p.tokens,
                          &p.heads, &p.kv_heads, &p.head_dim, &p.cache_slots, &p.dtype,
                          &p.threads))
        return NULL;
    p.qkv = (void *)(uintptr_t)qkv;
    p.cos = (const void *)(uintptr_t)cos;
    p.sin = (const void *)(uintptr_t)sin;
    p.slots = (const int64_t *)(uintptr_t)slots;
    p.k_cache = (void *)(uintptr_t)k;
    p.v_cache = (void *)(uintptr_t)v;
    const char *problem = rope_store_check(&p);
    if (problem != NULL) {
        PyErr_SetString(PyExc_ValueError, problem);
        return NULL;
    }
    Py_BEGIN_ALLOW_THREADS
    rope_store_run(&p);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

static PyObject *silu_mul(PyObject *self, PyObject *args) {
    (void)self;
    unsigned long long gate_up;
    SiluMul p;
    if (!PyArg_ParseTuple(args, "Kllii", &gate_up, &p.rows, &p.intermediate, &p.dtype,
                          &p.threads))
        return NULL;
    p.gate_up = (void *)(uintptr_t)gate_up;
    const char *problem = silu_mul_check(&p);
    if (problem != NULL) {
        PyErr_SetString(PyExc_ValueError, problem);
        return NULL;
    }
    Py_BEGIN_ALLOW_THREADS
    silu_mul_run(&p);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

static PyObject *quant_matmul(PyObject *self, PyObject *args) {
    (void)self;
    unsigned long long x, w, bias, out;
    QuantMatmul p;
    if (!PyArg_ParseTuple(args, "KKKKllllllliiiii", &x, &w, &bias, &out, &p.m, &p.n, &p.k,
                          &p.row_bytes, &p.x_row_stride, &p.out_row_stride, &p.span,
                          &p.format, &p.dtype, &p.out_dtype, &p.threads, &p.precise))
        return NULL;
    p.x = (const void *)(uintptr_t)x;
    p.w = (const uint8_t *)(uintptr_t)w;
    p.bias = (const float *)(uintptr_t)bias;
    p.out = (void *)(uintptr_t)out;
    const char *problem = quant_matmul_check(&p);
    if (problem != NULL) {
        PyErr_SetString(PyExc_ValueError, problem);
        return NULL;
    }
    int status;
    Py_BEGIN_ALLOW_THREADS
    status = quant_matmul_run(&p);
    Py_END_ALLOW_THREADS
    if (status != 0) return PyErr_NoMemory();
    Py_RETURN_NONE;
}

static PyObject *quant_gemm(PyObject *self, PyObject *args) {
    (void)self;
    unsigned long long x, w, bias, out;
    QuantGemm p;
    if (!PyArg_ParseTuple(args, "KKKKllllllii", &x, &w, &bias, &out, &p.m, &p.n, &p.k,
                          &p.row_bytes, &p.x_row_stride, &p.out_row_stride, &p.format,
                          &p.threads))
        return NULL;
    p.x = (const float *)(uintptr_t)x;
    p.w = (const uint8_t *)(uintptr_t)w;
    p.bias = (const float *)(uintptr_t)bias;
    p.out = (float *)(uintptr_t)out;
    const char *problem = quant_gemm_check(&p);
    if (problem != NULL) {
        PyErr_SetString(PyExc_ValueError, problem);
        return NULL;
    }
    int status;
    Py_BEGIN_ALLOW_THREADS
    status = quant_gemm_run(&p);
    Py_END_ALLOW_THREADS
    if (status != 0) return PyErr_NoMemory();
    Py_RETURN_NONE;
}

static PyObject *quant_rows(PyObject *self, PyObject *args) {
    (void)self;
    unsigned long long w, rows, out;
    QuantRows p;
    if (!PyArg_ParseTuple(args, "KKKlllliii", &w, &rows, &out, &p.count, &p.total_rows, &p.k,
                          &p.row_bytes, &p.format, &p.dtype, &p.threads))
        return NULL;
    p.w = (const uint8_t *)(uintptr_t)w;
    p.rows = (const int64_t *)(uintptr_t)rows;
    p.out = (void *)(uintptr_t)out;
    const char *problem = quant_rows_check(&p);
    if (problem != NULL) {
        PyErr_SetString(PyExc_ValueError, problem);
        return NULL;
    }
    int status;
    Py_BEGIN_ALLOW_THREADS
    status = quant_rows_run(&p);
    Py_END_ALLOW_THREADS
    if (status != 0) return PyErr_NoMemory();
    Py_RETURN_NONE;
}

static PyObject *decode_step(PyObject *self, PyObject *args) {
    (void)self;
    unsigned long long layers, residual, out, kv, final_norm, cos, sin, slots, tables, lens;
    DecodeStep p;
    if (!PyArg_ParseTuple(args, "KlKKKKKKKKKllllllllllffiii", &layers, &p.num_layers,
                          &residual, &out, &kv, &final_norm, &cos, &sin, &slots, &tables, &lens,
                          &p.n, &p.hidden, &p.heads, &p.kv_heads, &p.head_dim, &p.intermediate,
                          &p.blocks, &p.block_size, &p.table_width, &p.window, &p.eps, &p.scale,
                          &p.dtype, &p.threads, &p.precise))
        return NULL;
    p.layers = (const int64_t *)(uintptr_t)layers;
    p.residual = (void *)(uintptr_t)residual;
    p.out = (void *)(uintptr_t)out;
    p.kv = (void *)(uintptr_t)kv;
    p.final_norm = (const void *)(uintptr_t)final_norm;
    p.cos = (const void *)(uintptr_t)cos;
    p.sin = (const void *)(uintptr_t)sin;
    p.slots = (const int64_t *)(uintptr_t)slots;
    p.tables = (const int64_t *)(uintptr_t)tables;
    p.lens = (const int64_t *)(uintptr_t)lens;
    const char *problem = decode_step_check(&p);
    if (problem != NULL) {
        PyErr_SetString(PyExc_ValueError, problem);
        return NULL;
    }
    int status;
    Py_BEGIN_ALLOW_THREADS
    status = decode_step_run(&p);
    Py_END_ALLOW_THREADS
    if (status != 0) return PyErr_NoMemory();
    Py_RETURN_NONE;
}

/* The instruction-set features this CPU (and its OS) offers, of those the builds use. */
static PyObject *cpu_features(PyObject *self, PyObject *args) {
    (void)self;
    (void)args;
    PyObject *out = PyList_New(0);
    if (out == NULL) return NULL;
#if defined(__x86_64__) || defined(__i386__)
    __builtin_cpu_init();
    const struct {
        const char *name;
        int present;
    } features[] = {
        {"avx2", __builtin_cpu_supports("avx2")},
        {"fma", __builtin_cpu_supports("fma")},
        {"f16c", 0},
        {"avx512f", __builtin_cpu_supports("avx512f")},
        {"avx512bw", __builtin_cpu_supports("avx512bw")},
        {"avx512vl", __builtin_cpu_supports("avx512vl")},
        {"avx512dq", __builtin_cpu_supports("avx512dq")},
        {"avx512vnni", __builtin_cpu_supports("avx512vnni")},
        {"avx512bf16", 0},
    };
    for (size_t i = 0; i < sizeof features / sizeof features[0]; i++) {
        int present = features[i].present;
        if (i == 2) { /* F16C: CPUID leaf 1, ECX bit 29 (no __builtin_cpu_supports name) */
            unsigned a, b, c, d;
            __asm__("cpuid" : "=a"(a), "=b"(b), "=c"(c), "=d"(d) : "a"(1), "c"(0));
            present = (c >> 29) & 1;
        }
        if (i == 8) { /* AVX512-BF16: CPUID leaf 7 subleaf 1, EAX bit 5; no AVX-512, no use */
            unsigned a, b, c, d;
            __asm__("cpuid" : "=a"(a), "=b"(b), "=c"(c), "=d"(d) : "a"(0), "c"(0));
            present = 0;
            if (a >= 7 && __builtin_cpu_supports("avx512f")) {
                __asm__("cpuid" : "=a"(a), "=b"(b), "=c"(c), "=d"(d) : "a"(7), "c"(0));
                if (a >= 1) { /* leaf 7's highest subleaf */
                    __asm__("cpuid" : "=a"(a), "=b"(b), "=c"(c), "=d"(d) : "a"(7), "c"(1));
                    present = (a >> 5) & 1;
                }
            }
        }
        if (!present) continue;
        PyObject *name = PyUnicode_FromString(features[i].name);
        if (name == NULL || PyList_Append(out, name) != 0) {
            Py_XDECREF(name);
            Py_DECREF(out);
            return NULL;
        }
        Py_DECREF(name);
    }
#endif
    return out;
}

static PyMethodDef methods[] = {
    {"paged_decode", paged_decode, METH_VARARGS,
     "paged_decode(q, k, v, tables, lens, out, n, heads, kv_heads, head_dim, blocks, "
     "block_size, table_width, q_row_stride, window, scale, dtype, threads)"},
    {"add_rms_norm", add_rms_norm, METH_VARARGS,
     "add_rms_norm(x or 0, weight, residual, out, rows, dim, eps, dtype, threads)"},
    {"rope_store", rope_store, METH_VARARGS,
     "rope_store(qkv, cos, sin, slots, k, v, tokens, heads, kv_heads, head_dim, cache_slots, "
     "dtype, threads)"},
    {"silu_mul", silu_mul, METH_VARARGS,
     "silu_mul(gate_up, rows, intermediate, dtype, threads)"},
    {"quant_matmul", quant_matmul, METH_VARARGS,
     "quant_matmul(x, w, bias or 0, out, m, n, k, row_bytes, x_row_stride, out_row_stride, "
     "span, format, dtype, out_dtype, threads, precise)"},
    {"quant_gemm", quant_gemm, METH_VARARGS,
     "quant_gemm(x, w, bias or 0, out, m, n, k, row_bytes, x_row_stride, out_row_stride, "
     "format, threads)"},
    {"quant_rows", quant_rows, METH_VARARGS,
     "quant_rows(w, rows, out, count, total_rows, k, row_bytes, format, dtype, threads)"},
    {"decode_step", decode_step, METH_VARARGS,
     "decode_step(layers, num_layers, residual, out, kv, final_norm, cos, sin, slots, tables, "
     "lens, n, hidden, heads, kv_heads, head_dim, intermediate, blocks, block_size, "
     "table_width, eps, scale, dtype, threads, precise)"},
    {"cpu_features", cpu_features, METH_NOARGS, "cpu_features() -> [feature names]"},
    {NULL, NULL, 0, NULL},
};

/* Bumped whenever an entry point's arguments change: cpu_kernels/loading.py refuses a module
 * built from older sources (an editable install not re-run after a pull). */
#define ABI 9

/* setup.py builds this file once per instruction-set level: KERNELS_LEVEL names it
 * (generic, avx2, avx512), and the module is _cpu_kernels_<level>. */
#ifndef KERNELS_LEVEL
#define KERNELS_LEVEL generic
#endif
#define STR2(x) #x
#define STR(x) STR2(x)
#define CAT2(a, b) a##b
#define CAT(a, b) CAT2(a, b)

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT,
                                    .m_name = "_cpu_kernels_" STR(KERNELS_LEVEL),
                                    .m_size = -1, .m_methods = methods};

PyMODINIT_FUNC CAT(PyInit__cpu_kernels_, KERNELS_LEVEL)(void) {
    PyObject *m = PyModule_Create(&module);
    if (m != NULL && (PyModule_AddIntConstant(m, "ABI", ABI) != 0 ||
                      PyModule_AddStringConstant(m, "LEVEL", STR(KERNELS_LEVEL)) != 0)) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
