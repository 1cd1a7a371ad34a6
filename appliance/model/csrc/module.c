/* Python bindings of the CPU kernels (appliance.model._cpu_kernels). Tensors come as
 * their data_ptr() and sizes; appliance/model/cpu_kernels.py checks shapes, dtypes and
 * contiguity, each kernel's *_check() what it reads through. Each call releases the GIL. */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include "kernels.h"

static PyObject *paged_decode(PyObject *self, PyObject *args) {
    (void)self;
    unsigned long long q, k, v, tables, lens, out;
    PagedDecode p;
    if (!PyArg_ParseTuple(args, "KKKKKKllllllllfii", &q, &k, &v, &tables, &lens, &out, &p.n,
                          &p.heads, &p.kv_heads, &p.head_dim, &p.blocks, &p.block_size,
                          &p.table_width, &p.q_row_stride, &p.scale, &p.dtype, &p.threads))
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

static PyMethodDef methods[] = {
    {"paged_decode", paged_decode, METH_VARARGS,
     "paged_decode(q, k, v, tables, lens, out, n, heads, kv_heads, head_dim, blocks, "
     "block_size, table_width, q_row_stride, scale, dtype, threads)"},
    {"add_rms_norm", add_rms_norm, METH_VARARGS,
     "add_rms_norm(x or 0, weight, residual, out, rows, dim, eps, dtype, threads)"},
    {"rope_store", rope_store, METH_VARARGS,
     "rope_store(qkv, cos, sin, slots, k, v, tokens, heads, kv_heads, head_dim, cache_slots, "
     "dtype, threads)"},
    {NULL, NULL, 0, NULL},
};

/* Bumped whenever an entry point's arguments change: cpu_kernels.py refuses a module
 * built from older sources (an editable install not re-run after a pull). */
#define ABI 3

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, .m_name = "_cpu_kernels", .m_size = -1, .m_methods = methods};

PyMODINIT_FUNC PyInit__cpu_kernels(void) {
    PyObject *m = PyModule_Create(&module);
    if (m != NULL && PyModule_AddIntConstant(m, "ABI", ABI) != 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
