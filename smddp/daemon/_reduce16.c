/* Compiled kernel for 16-bit float reductions (float16, bfloat16), accumulated in float32.
 *
 * It computes exactly what smddp.daemon.kernels' numpy path computes: widen every input to float32,
 * fold left to right (+, or numpy's minimum/maximum, which keep the first operand when the two are
 * equal), divide once for an average, round to nearest even once at the end. NaN payload rules are
 * the one place where compiled code and numpy could disagree (which NaN a+b returns, how a
 * signalling NaN narrows), so a block whose float32 result holds a NaN is not written: its index is
 * returned and the caller reduces that block with numpy. Real gradients hold no NaN, so the fast
 * path covers them, and every NaN case keeps numpy's exact bits.
 *
 * The GIL is released while the loops run: the daemon reduces on several threads.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#define SMDDP_X86 1
#else
#define SMDDP_X86 0
#endif

enum { KIND_F16 = 0, KIND_BF16 = 1 };
enum { OP_SUM = 0, OP_MIN = 1, OP_MAX = 2 };
#define BLOCK 2048 /* elements per block: 8 KiB of float32 accumulator, stays in L1 */
#define MAX_INPUTS 4096

/* Fold one float32 value into the accumulator: + or numpy's minimum/maximum. minimum(a, b) is a only
 * when a < b, so b is taken for equal values (+0 and -0), as numpy does. A NaN on either side must
 * reach the result (which NaN does not matter: NaN blocks are redone by numpy). */
static inline float fold(float a, float b, int op) {
    if (op == OP_SUM) return a + b;
    if (op == OP_MIN) return (a < b || a != a) ? a : b;
    return (a > b || a != a) ? a : b;
}

static inline float bf16_up(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

/* Round to nearest even; only called on non-NaN values. */
static inline uint16_t bf16_down(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    return (uint16_t)((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

/* bfloat16: portable C; the compiler vectorises these loops. Returns 1 if the block holds a NaN. */
static int block_bf16(const uint16_t *const *in, int k, Py_ssize_t off, Py_ssize_t m, uint16_t *out,
                      int op, float divisor) {
    float acc[BLOCK];
    const uint16_t *x0 = in[0] + off;
    for (Py_ssize_t i = 0; i < m; i++) acc[i] = bf16_up(x0[i]);
    for (int j = 1; j < k; j++) {
        const uint16_t *x = in[j] + off;
        if (op == OP_SUM) {
            for (Py_ssize_t i = 0; i < m; i++) acc[i] = acc[i] + bf16_up(x[i]);
        } else if (op == OP_MIN) {
            for (Py_ssize_t i = 0; i < m; i++) acc[i] = fold(acc[i], bf16_up(x[i]), OP_MIN);
        } else {
            for (Py_ssize_t i = 0; i < m; i++) acc[i] = fold(acc[i], bf16_up(x[i]), OP_MAX);
        }
    }
    if (divisor != 0.0f)
        for (Py_ssize_t i = 0; i < m; i++) acc[i] = acc[i] / divisor;
    int nan = 0;
    for (Py_ssize_t i = 0; i < m; i++) nan |= acc[i] != acc[i];
    if (nan) return 1;
    uint16_t *o = out + off;
    for (Py_ssize_t i = 0; i < m; i++) o[i] = bf16_down(acc[i]);
    return 0;
}

#if SMDDP_X86
/* float16 with F16C conversions (8 lanes at a time), chosen at run time when the CPU has them. */
__attribute__((target("avx2,f16c"))) static int block_f16_f16c(const uint16_t *const *in, int k,
                                                               Py_ssize_t off, Py_ssize_t m,
                                                               uint16_t *out, int op, float divisor) {
    float acc[BLOCK] __attribute__((aligned(32)));
    Py_ssize_t v = m & ~(Py_ssize_t)7;
    const uint16_t *x0 = in[0] + off;
    for (Py_ssize_t i = 0; i < v; i += 8)
        _mm256_store_ps(acc + i, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(x0 + i))));
    for (Py_ssize_t i = v; i < m; i++) acc[i] = _cvtsh_ss(x0[i]);
    for (int j = 1; j < k; j++) {
        const uint16_t *x = in[j] + off;
        for (Py_ssize_t i = 0; i < v; i += 8) {
            __m256 a = _mm256_load_ps(acc + i);
            __m256 b = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(x + i)));
            __m256 r;
            if (op == OP_SUM)
                r = _mm256_add_ps(a, b);
            else if (op == OP_MIN) /* a where a < b or a is NaN, else b: as fold() */
                r = _mm256_blendv_ps(b, a, _mm256_or_ps(_mm256_cmp_ps(a, b, _CMP_LT_OQ), _mm256_cmp_ps(a, a, _CMP_UNORD_Q)));
            else
                r = _mm256_blendv_ps(b, a, _mm256_or_ps(_mm256_cmp_ps(a, b, _CMP_GT_OQ), _mm256_cmp_ps(a, a, _CMP_UNORD_Q)));
            _mm256_store_ps(acc + i, r);
        }
        for (Py_ssize_t i = v; i < m; i++) acc[i] = fold(acc[i], _cvtsh_ss(x[i]), op);
    }
    __m256 nan = _mm256_setzero_ps();
    if (divisor != 0.0f) {
        __m256 d = _mm256_set1_ps(divisor);
        for (Py_ssize_t i = 0; i < v; i += 8) _mm256_store_ps(acc + i, _mm256_div_ps(_mm256_load_ps(acc + i), d));
        for (Py_ssize_t i = v; i < m; i++) acc[i] = acc[i] / divisor;
    }
    for (Py_ssize_t i = 0; i < v; i += 8) {
        __m256 a = _mm256_load_ps(acc + i);
        nan = _mm256_or_ps(nan, _mm256_cmp_ps(a, a, _CMP_UNORD_Q));
    }
    int has_nan = _mm256_movemask_ps(nan) != 0;
    for (Py_ssize_t i = v; i < m; i++) has_nan |= acc[i] != acc[i];
    if (has_nan) return 1;
    uint16_t *o = out + off;
    for (Py_ssize_t i = 0; i < v; i += 8)
        _mm_storeu_si128((__m128i *)(o + i), _mm256_cvtps_ph(_mm256_load_ps(acc + i), _MM_FROUND_TO_NEAREST_INT));
    for (Py_ssize_t i = v; i < m; i++) o[i] = _cvtss_sh(acc[i], _MM_FROUND_TO_NEAREST_INT);
    return 0;
}

static int have_f16c(void) {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("f16c");
}
#else
static int have_f16c(void) { return 0; }
#endif

typedef int (*block_fn)(const uint16_t *const *, int, Py_ssize_t, Py_ssize_t, uint16_t *, int, float);

static void release(Py_buffer *views, int n) {
    for (int i = 0; i < n; i++) PyBuffer_Release(&views[i]);
}

/* reduce16(kind, op, inputs, out, divisor) -> list of block indices left for numpy (NaN blocks).
 * kind: 0 float16, 1 bfloat16; op: 0 sum, 1 min, 2 max; divisor 0.0 for none. Inputs and out are
 * C-contiguous buffers of equally many 16-bit elements; out may alias an input element-wise. */
static PyObject *reduce16(PyObject *self, PyObject *args) {
    int kind, op;
    PyObject *inputs, *out_obj;
    float divisor;
    (void)self;
    if (!PyArg_ParseTuple(args, "iiOOf", &kind, &op, &inputs, &out_obj, &divisor)) return NULL;
    if (kind != KIND_F16 && kind != KIND_BF16) return PyErr_Format(PyExc_ValueError, "unknown kind %d", kind);
    if (op < OP_SUM || op > OP_MAX) return PyErr_Format(PyExc_ValueError, "unknown op %d", op);
    if (kind == KIND_F16 && !have_f16c())
        return PyErr_Format(PyExc_NotImplementedError, "float16 needs a CPU with F16C");
    PyObject *seq = PySequence_Fast(inputs, "inputs must be a sequence");
    if (seq == NULL) return NULL;
    Py_ssize_t k = PySequence_Fast_GET_SIZE(seq);
    if (k < 1 || k > MAX_INPUTS) {
        Py_DECREF(seq);
        return PyErr_Format(PyExc_ValueError, "between 1 and %d inputs, not %zd", MAX_INPUTS, k);
    }
    Py_buffer *views = PyMem_Calloc((size_t)k + 1, sizeof(Py_buffer));
    const uint16_t **ptrs = PyMem_Calloc((size_t)k, sizeof(uint16_t *));
    PyObject *result = NULL;
    int got = 0;
    if (views == NULL || ptrs == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    if (PyObject_GetBuffer(out_obj, &views[0], PyBUF_C_CONTIGUOUS | PyBUF_WRITABLE) < 0) goto done;
    got = 1;
    Py_ssize_t n = views[0].len / 2;
    for (Py_ssize_t j = 0; j < k; j++) {
        if (PyObject_GetBuffer(PySequence_Fast_GET_ITEM(seq, j), &views[j + 1], PyBUF_C_CONTIGUOUS) < 0) goto done;
        got++;
        if (views[j + 1].len != views[0].len) {
            PyErr_Format(PyExc_ValueError, "input %zd holds %zd bytes, out %zd", j, views[j + 1].len, views[0].len);
            goto done;
        }
        ptrs[j] = (const uint16_t *)views[j + 1].buf;
    }
    uint16_t *out = (uint16_t *)views[0].buf;
    block_fn fn = block_bf16;
#if SMDDP_X86
    if (kind == KIND_F16) fn = block_f16_f16c;
#endif
    Py_ssize_t nblocks = (n + BLOCK - 1) / BLOCK;
    /* Indices of NaN blocks; rare, so a small growable array filled without the GIL. */
    Py_ssize_t cap = 16, nnan = 0;
    Py_ssize_t *nan_blocks = PyMem_RawMalloc((size_t)cap * sizeof(Py_ssize_t));
    if (nan_blocks == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    int oom = 0;
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t b = 0; b < nblocks; b++) {
        Py_ssize_t off = b * BLOCK, m = n - off < BLOCK ? n - off : BLOCK;
        if (fn(ptrs, (int)k, off, m, out, op, divisor)) {
            if (nnan == cap) {
                Py_ssize_t *grown = PyMem_RawRealloc(nan_blocks, (size_t)cap * 2 * sizeof(Py_ssize_t));
                if (grown == NULL) {
                    oom = 1;
                    break;
                }
                nan_blocks = grown;
                cap *= 2;
            }
            nan_blocks[nnan++] = b;
        }
    }
    Py_END_ALLOW_THREADS
    if (oom) {
        PyErr_NoMemory();
    } else {
        result = PyList_New(nnan);
        for (Py_ssize_t i = 0; result != NULL && i < nnan; i++) {
            PyObject *v = PyLong_FromSsize_t(nan_blocks[i]);
            if (v == NULL) {
                Py_CLEAR(result);
                break;
            }
            PyList_SET_ITEM(result, i, v);
        }
    }
    PyMem_RawFree(nan_blocks);
done:
    if (views != NULL) release(views, got);
    PyMem_Free(views);
    PyMem_Free(ptrs);
    Py_DECREF(seq);
    return result;
}

static PyObject *has_f16c(PyObject *self, PyObject *unused) {
    (void)self;
    (void)unused;
    return PyBool_FromLong(have_f16c());
}

static PyMethodDef methods[] = {
    {"reduce16", reduce16, METH_VARARGS,
     "reduce16(kind, op, inputs, out, divisor) -> block indices (NaN) left for the caller"},
    {"has_f16c", has_f16c, METH_NOARGS, "Whether float16 can be reduced here (x86-64 with AVX2 and F16C)"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_reduce16", "Compiled float16/bfloat16 reduction kernel.", -1, methods,
    NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__reduce16(void) {
    PyObject *m = PyModule_Create(&module);
    if (m != NULL && PyModule_AddIntConstant(m, "BLOCK", BLOCK) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
