/*
 * kvpool._layersum: the per-layer xxh3-64 checksums of kvpool's object format, computed in C,
 * optionally while copying the layers (one pass over the source).
 *
 * Why
 *   A verified same-host read copies an object out of another process's shared arena and
 *   checks every layer of the copy against the header's checksums. Copying and then hashing
 *   costs a memcpy plus the hash on one core (16 MiB: 1.4x a memcpy here; hashing each layer
 *   right after its copy, while in cache, 1.0-1.5x depending on the minute). Hashing the words
 *   as they are stored, in one pass, costs no more than a memcpy: the multiplies hide under
 *   the memory traffic (bench/checksum_bench.py). In Python each layer also costs a call (16
 *   calls for a 64 KiB object of 16 layers).
 *
 * What
 *   XXH3-64 (seed 0, the default secret) of inputs longer than 240 bytes: the "long" variant,
 *   which is the only one an object layer this module is asked about takes (the callers use
 *   xxhash for shorter layers). The output equals xxhash.xxh3_64_intdigest of the same bytes;
 *   tests/test_layersum.py checks it against xxhash on random lengths and contents. Written
 *   from the published XXH3 algorithm (accumulate, scramble, merge); AVX2 where the CPU has
 *   it, portable C otherwise.
 *
 * Not here
 *   Anything about the object format beyond "layers of `step` bytes": kvpool.objformat
 *   compares the digests with the header's and names the first bad layer.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <immintrin.h>
#define LAYERSUM_X86 1
#endif

#define STRIPE 64
#define SECRET_SIZE 192
#define STRIPES_PER_BLOCK ((SECRET_SIZE - STRIPE) / 8) /* 16 */
#define BLOCK (STRIPE * STRIPES_PER_BLOCK)             /* 1024 bytes */
#define MIN_LONG 241                                     /* shorter inputs take other variants */

#define P32_1 0x9E3779B1U
#define P32_2 0x85EBCA77U
#define P32_3 0xC2B2AE3DU
#define P64_1 0x9E3779B185EBCA87ULL
#define P64_2 0xC2B2AE3D27D4EB4FULL
#define P64_3 0x165667B19E3779F9ULL
#define P64_4 0x85EBCA77C2B2AE63ULL
#define P64_5 0x27D4EB2F165667C5ULL

static const uint8_t SECRET[SECRET_SIZE] __attribute__((aligned(64))) = {
    0xb8, 0xfe, 0x6c, 0x39, 0x23, 0xa4, 0x4b, 0xbe, 0x7c, 0x01, 0x81, 0x2c, 0xf7, 0x21, 0xad, 0x1c,
    0xde, 0xd4, 0x6d, 0xe9, 0x83, 0x90, 0x97, 0xdb, 0x72, 0x40, 0xa4, 0xa4, 0xb7, 0xb3, 0x67, 0x1f,
    0xcb, 0x79, 0xe6, 0x4e, 0xcc, 0xc0, 0xe5, 0x78, 0x82, 0x5a, 0xd0, 0x7d, 0xcc, 0xff, 0x72, 0x21,
    0xb8, 0x08, 0x46, 0x74, 0xf7, 0x43, 0x24, 0x8e, 0xe0, 0x35, 0x90, 0xe6, 0x81, 0x3a, 0x26, 0x4c,
    0x3c, 0x28, 0x52, 0xbb, 0x91, 0xc3, 0x00, 0xcb, 0x88, 0xd0, 0x65, 0x8b, 0x1b, 0x53, 0x2e, 0xa3,
    0x71, 0x64, 0x48, 0x97, 0xa2, 0x0d, 0xf9, 0x4e, 0x38, 0x19, 0xef, 0x46, 0xa9, 0xde, 0xac, 0xd8,
    0xa8, 0xfa, 0x76, 0x3f, 0xe3, 0x9c, 0x34, 0x3f, 0xf9, 0xdc, 0xbb, 0xc7, 0xc7, 0x0b, 0x4f, 0x1d,
    0x8a, 0x51, 0xe0, 0x4b, 0xcd, 0xb4, 0x59, 0x31, 0xc8, 0x9f, 0x7e, 0xc9, 0xd9, 0x78, 0x73, 0x64,
    0xea, 0xc5, 0xac, 0x83, 0x34, 0xd3, 0xeb, 0xc3, 0xc5, 0x81, 0xa0, 0xff, 0xfa, 0x13, 0x63, 0xeb,
    0x17, 0x0d, 0xdd, 0x51, 0xb7, 0xf0, 0xda, 0x49, 0xd3, 0x16, 0x55, 0x26, 0x29, 0xd4, 0x68, 0x9e,
    0x2b, 0x16, 0xbe, 0x58, 0x7d, 0x47, 0xa1, 0xfc, 0x8f, 0xf8, 0xb8, 0xd1, 0x7a, 0xd0, 0x31, 0xce,
    0x45, 0xcb, 0x3a, 0x8f, 0x95, 0x16, 0x04, 0x28, 0xaf, 0xd7, 0xfb, 0xca, 0xbb, 0x4b, 0x40, 0x7e,
};

static inline uint64_t read64(const uint8_t *p) {
    uint64_t v;
    memcpy(&v, p, 8);
#if __BYTE_ORDER__ == __ORDER_BIG_ENDIAN__
    v = __builtin_bswap64(v);
#endif
    return v;
}

static inline uint64_t mul128_fold64(uint64_t a, uint64_t b) {
    __uint128_t product = (__uint128_t)a * b;
    return (uint64_t)product ^ (uint64_t)(product >> 64);
}

static uint64_t finish(const uint64_t acc[8], size_t len) {
    const uint8_t *secret = SECRET + 11; /* where the merge reads the secret */
    uint64_t h = (uint64_t)len * P64_1;
    for (int i = 0; i < 4; i++)
        h += mul128_fold64(acc[2 * i] ^ read64(secret + 16 * i), acc[2 * i + 1] ^ read64(secret + 16 * i + 8));
    h ^= h >> 37;
    h *= 0x165667919E3779F9ULL;
    h ^= h >> 32;
    return h;
}

static void init_acc(uint64_t acc[8]) {
    const uint64_t init[8] = {P32_3, P64_1, P64_2, P64_3, P64_4, P32_2, P64_5, P32_1};
    memcpy(acc, init, sizeof(init));
}

/* -- portable ---------------------------------------------------------------------------- */

static inline void stripe_scalar(uint64_t acc[8], const uint8_t *in, const uint8_t *secret) {
    for (int i = 0; i < 8; i++) {
        uint64_t data = read64(in + 8 * i);
        uint64_t key = data ^ read64(secret + 8 * i);
        acc[i ^ 1] += data;
        acc[i] += (uint64_t)(uint32_t)key * (key >> 32);
    }
}

static inline void scramble_scalar(uint64_t acc[8], const uint8_t *secret) {
    for (int i = 0; i < 8; i++) {
        uint64_t a = acc[i];
        a ^= a >> 47;
        a ^= read64(secret + 8 * i);
        acc[i] = a * P32_1;
    }
}

/* XXH3-64 of dst[0:len] after copying src into it (src NULL: dst is only read). A stripe is
   copied, then hashed from the copy while it is in L1. */
static uint64_t layer_scalar(uint8_t *dst, const uint8_t *src, size_t len) {
    uint64_t acc[8];
    init_acc(acc);
    size_t blocks = (len - 1) / BLOCK, done = 0;
    for (size_t b = 0; b < blocks; b++) {
        for (int s = 0; s < STRIPES_PER_BLOCK; s++, done += STRIPE) {
            if (src) memcpy(dst + done, src + done, STRIPE);
            stripe_scalar(acc, dst + done, SECRET + 8 * s);
        }
        scramble_scalar(acc, SECRET + SECRET_SIZE - STRIPE);
    }
    size_t stripes = ((len - 1) - BLOCK * blocks) / STRIPE;
    for (size_t s = 0; s < stripes; s++, done += STRIPE) {
        if (src) memcpy(dst + done, src + done, STRIPE);
        stripe_scalar(acc, dst + done, SECRET + 8 * s);
    }
    if (src) memcpy(dst + done, src + done, len - done);
    stripe_scalar(acc, dst + len - STRIPE, SECRET + SECRET_SIZE - STRIPE - 7);
    return finish(acc, len);
}

/* -- AVX2 -------------------------------------------------------------------------------- */

#ifdef LAYERSUM_X86
#define AVX2 __attribute__((target("avx2")))

AVX2 static inline __m256i round_avx2(__m256i acc, __m256i data, const uint8_t *secret) {
    __m256i key = _mm256_xor_si256(data, _mm256_loadu_si256((const __m256i *)secret));
    __m256i product = _mm256_mul_epu32(key, _mm256_srli_epi64(key, 32));
    __m256i swapped = _mm256_shuffle_epi32(data, _MM_SHUFFLE(1, 0, 3, 2));
    return _mm256_add_epi64(product, _mm256_add_epi64(acc, swapped));
}

AVX2 static inline __m256i scramble_avx2(__m256i acc, const uint8_t *secret) {
    const __m256i prime = _mm256_set1_epi32((int)P32_1);
    acc = _mm256_xor_si256(acc, _mm256_srli_epi64(acc, 47));
    acc = _mm256_xor_si256(acc, _mm256_loadu_si256((const __m256i *)secret));
    __m256i hi = _mm256_shuffle_epi32(acc, _MM_SHUFFLE(0, 3, 0, 1));
    __m256i lo_product = _mm256_mul_epu32(acc, prime);
    __m256i hi_product = _mm256_mul_epu32(hi, prime);
    return _mm256_add_epi64(lo_product, _mm256_slli_epi64(hi_product, 32));
}

/* One stripe: loaded from src once, stored to dst and hashed from the registers (src NULL:
   loaded from dst, nothing stored). What is hashed is what dst holds afterwards. */
#define STRIPE_AVX2(s_off)                                                                          \
    do {                                                                                            \
        const uint8_t *from = src ? src + done : dst + done;                                        \
        __m256i d0 = _mm256_loadu_si256((const __m256i *)from);                                     \
        __m256i d1 = _mm256_loadu_si256((const __m256i *)(from + 32));                              \
        if (src) {                                                                                  \
            _mm256_storeu_si256((__m256i *)(dst + done), d0);                                       \
            _mm256_storeu_si256((__m256i *)(dst + done + 32), d1);                                  \
        }                                                                                           \
        a0 = round_avx2(a0, d0, SECRET + (s_off));                                                  \
        a1 = round_avx2(a1, d1, SECRET + (s_off) + 32);                                             \
        done += STRIPE;                                                                             \
    } while (0)

AVX2 static uint64_t layer_avx2(uint8_t *dst, const uint8_t *src, size_t len) {
    uint64_t acc[8];
    init_acc(acc);
    __m256i a0 = _mm256_loadu_si256((const __m256i *)acc), a1 = _mm256_loadu_si256((const __m256i *)(acc + 4));
    size_t blocks = (len - 1) / BLOCK, done = 0;
    for (size_t b = 0; b < blocks; b++) {
        for (int s = 0; s < STRIPES_PER_BLOCK; s++) STRIPE_AVX2(8 * s);
        a0 = scramble_avx2(a0, SECRET + SECRET_SIZE - STRIPE);
        a1 = scramble_avx2(a1, SECRET + SECRET_SIZE - STRIPE + 32);
    }
    size_t stripes = ((len - 1) - BLOCK * blocks) / STRIPE;
    for (size_t s = 0; s < stripes; s++) STRIPE_AVX2(8 * s);
    if (src) memcpy(dst + done, src + done, len - done);
    _mm256_storeu_si256((__m256i *)acc, a0);
    _mm256_storeu_si256((__m256i *)(acc + 4), a1);
    stripe_scalar(acc, dst + len - STRIPE, SECRET + SECRET_SIZE - STRIPE - 7);
    return finish(acc, len);
}

static int have_avx2(void) {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx2");
}
#endif

typedef uint64_t (*layer_fn)(uint8_t *, const uint8_t *, size_t);
static layer_fn layer = layer_scalar;

/* -- Python ------------------------------------------------------------------------------ */

static PyObject *digests(uint64_t *sums, Py_ssize_t count) {
    PyObject *out = PyTuple_New(count);
    if (out == NULL) return NULL;
    for (Py_ssize_t i = 0; i < count; i++) {
        PyObject *v = PyLong_FromUnsignedLongLong(sums[i]);
        if (v == NULL) {
            Py_DECREF(out);
            return NULL;
        }
        PyTuple_SET_ITEM(out, i, v);
    }
    return out;
}

/* Run over `count` layers of `step` bytes without the GIL; a tuple of their digests. */
static PyObject *run(uint8_t *dst, const uint8_t *src, Py_ssize_t step, Py_ssize_t count) {
    uint64_t small[64];
    uint64_t *sums = count <= 64 ? small : PyMem_RawMalloc(sizeof(uint64_t) * (size_t)count);
    if (sums == NULL) return PyErr_NoMemory();
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t i = 0; i < count; i++)
        sums[i] = layer(dst + i * step, src ? src + i * step : NULL, (size_t)step);
    Py_END_ALLOW_THREADS
    PyObject *out = digests(sums, count);
    if (sums != small) PyMem_RawFree(sums);
    return out;
}

static int layer_count(Py_ssize_t nbytes, Py_ssize_t step, Py_ssize_t *count) {
    if (step < MIN_LONG) {
        PyErr_Format(PyExc_ValueError, "layers of %zd bytes: this computes layers of at least %d", step, MIN_LONG);
        return -1;
    }
    if (nbytes % step) {
        PyErr_Format(PyExc_ValueError, "%zd bytes is not a whole number of %zd-byte layers", nbytes, step);
        return -1;
    }
    *count = nbytes / step;
    return 0;
}

PyDoc_STRVAR(layer_digests_doc,
"layer_digests(data, step) -> tuple[int, ...]\n\n"
"xxh3-64 of each ``step``-byte layer of ``data`` (a contiguous buffer of whole layers;\n"
"``step`` > 240).");

static PyObject *layer_digests(PyObject *self, PyObject *args) {
    Py_buffer data;
    Py_ssize_t step, count;
    if (!PyArg_ParseTuple(args, "y*n:layer_digests", &data, &step)) return NULL;
    PyObject *out = NULL;
    if (layer_count(data.len, step, &count) == 0) out = run((uint8_t *)data.buf, NULL, step, count);
    PyBuffer_Release(&data);
    return out;
}

PyDoc_STRVAR(copy_layer_digests_doc,
"copy_layer_digests(dst, src, step) -> tuple[int, ...]\n\n"
"Copy ``src`` into ``dst`` (writable, the same length, whole ``step``-byte layers; ``step`` >\n"
"240) and return the xxh3-64 of each layer as copied: the digests are of the bytes ``dst``\n"
"holds, even if ``src`` changes meanwhile. The buffers must not overlap.");

static PyObject *copy_layer_digests(PyObject *self, PyObject *args) {
    Py_buffer dst, src;
    Py_ssize_t step, count;
    if (!PyArg_ParseTuple(args, "w*y*n:copy_layer_digests", &dst, &src, &step)) return NULL;
    PyObject *out = NULL;
    if (dst.len != src.len)
        PyErr_Format(PyExc_ValueError, "dst holds %zd bytes, src %zd", dst.len, src.len);
    else if ((char *)dst.buf < (char *)src.buf + src.len && (char *)src.buf < (char *)dst.buf + dst.len)
        PyErr_SetString(PyExc_ValueError, "dst and src overlap");
    else if (layer_count(src.len, step, &count) == 0)
        out = run((uint8_t *)dst.buf, (const uint8_t *)src.buf, step, count);
    PyBuffer_Release(&dst);
    PyBuffer_Release(&src);
    return out;
}

PyDoc_STRVAR(copy_spans_digests_doc,
"copy_spans_digests(dsts, srcs, steps=None) -> tuple[int, ...]\n\n"
"``copy_layer_digests`` of many spans in one call: copy each ``srcs[i]`` into ``dsts[i]``\n"
"(writable, the same length, not overlapping) and return the xxh3-64 of each layer as\n"
"copied, span after span. ``steps[i]``: the layer size of span ``i`` (> 240, dividing its\n"
"length); without ``steps`` every span is one layer (at least 241 bytes). The GIL is\n"
"released once for all of them (a per-span call takes it back after every copy, which\n"
"waits behind other threads).");

static PyObject *copy_spans_digests(PyObject *self, PyObject *args) {
    PyObject *dst_list, *src_list, *step_list = Py_None;
    if (!PyArg_ParseTuple(args, "OO|O:copy_spans_digests", &dst_list, &src_list, &step_list)) return NULL;
    PyObject *dsts = PySequence_Fast(dst_list, "dsts must be a sequence of buffers");
    if (dsts == NULL) return NULL;
    PyObject *srcs = PySequence_Fast(src_list, "srcs must be a sequence of buffers");
    if (srcs == NULL) {
        Py_DECREF(dsts);
        return NULL;
    }
    Py_ssize_t count = PySequence_Fast_GET_SIZE(dsts), held = 0, layers = 0;
    Py_buffer *views = NULL;
    Py_ssize_t *steps = NULL;
    uint64_t *sums = NULL;
    PyObject *out = NULL;
    if (PySequence_Fast_GET_SIZE(srcs) != count) {
        PyErr_Format(PyExc_ValueError, "%zd dsts for %zd srcs", count, PySequence_Fast_GET_SIZE(srcs));
        goto done;
    }
    views = PyMem_Calloc((size_t)(2 * count + 1), sizeof(Py_buffer));
    steps = PyMem_Calloc((size_t)(count + 1), sizeof(Py_ssize_t));
    if (views == NULL || steps == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    if (step_list != Py_None) {
        PyObject *given = PySequence_Fast(step_list, "steps must be a sequence of ints");
        if (given == NULL) goto done;
        if (PySequence_Fast_GET_SIZE(given) != count) {
            PyErr_Format(PyExc_ValueError, "%zd steps for %zd spans", PySequence_Fast_GET_SIZE(given), count);
            Py_DECREF(given);
            goto done;
        }
        for (Py_ssize_t i = 0; i < count; i++) {
            steps[i] = PyLong_AsSsize_t(PySequence_Fast_GET_ITEM(given, i));
            if (steps[i] == -1 && PyErr_Occurred()) {
                Py_DECREF(given);
                goto done;
            }
        }
        Py_DECREF(given);
    }
    for (Py_ssize_t i = 0; i < count; i++, held++) {
        Py_buffer *d = &views[2 * i], *r = &views[2 * i + 1];
        if (PyObject_GetBuffer(PySequence_Fast_GET_ITEM(dsts, i), d, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) < 0)
            goto done;
        if (PyObject_GetBuffer(PySequence_Fast_GET_ITEM(srcs, i), r, PyBUF_C_CONTIGUOUS) < 0) {
            PyBuffer_Release(d);
            goto done;
        }
        if (d->len != r->len || r->len < MIN_LONG) {
            PyErr_Format(PyExc_ValueError, "span %zd: dst holds %zd bytes, src %zd (at least %d each)", i, d->len,
                         r->len, MIN_LONG);
            held++;
            goto done;
        }
        if (steps[i] == 0) steps[i] = r->len;
        Py_ssize_t n;
        if (layer_count(r->len, steps[i], &n) < 0) {
            held++;
            goto done;
        }
        layers += n;
        if ((char *)d->buf < (char *)r->buf + r->len && (char *)r->buf < (char *)d->buf + d->len) {
            PyErr_Format(PyExc_ValueError, "span %zd: dst and src overlap", i);
            held++;
            goto done;
        }
    }
    sums = PyMem_RawMalloc(sizeof(uint64_t) * (size_t)(layers + 1));
    if (sums == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    Py_BEGIN_ALLOW_THREADS
    uint64_t *sum = sums;
    for (Py_ssize_t i = 0; i < count; i++) {
        uint8_t *d = (uint8_t *)views[2 * i].buf;
        const uint8_t *r = (const uint8_t *)views[2 * i + 1].buf;
        for (Py_ssize_t at = 0; at < views[2 * i].len; at += steps[i])
            *sum++ = layer(d + at, r + at, (size_t)steps[i]);
    }
    Py_END_ALLOW_THREADS
    out = digests(sums, layers);
done:
    for (Py_ssize_t i = 0; i < held; i++) {
        PyBuffer_Release(&views[2 * i]);
        PyBuffer_Release(&views[2 * i + 1]);
    }
    PyMem_Free(views);
    PyMem_Free(steps);
    PyMem_RawFree(sums);
    Py_DECREF(dsts);
    Py_DECREF(srcs);
    return out;
}

PyDoc_STRVAR(use_variant_doc,
"use_variant(name) -> str\n\n"
"Compute with ``name`` (\"avx2\" or \"portable\") from now on, in this process; returns the\n"
"variant used before. For tests: the module picks the fastest one the CPU has.");

static PyObject *use_variant(PyObject *self, PyObject *args) {
    const char *name;
    if (!PyArg_ParseTuple(args, "s:use_variant", &name)) return NULL;
    const char *before = layer == layer_scalar ? "portable" : "avx2";
    if (strcmp(name, "portable") == 0) {
        layer = layer_scalar;
#ifdef LAYERSUM_X86
    } else if (strcmp(name, "avx2") == 0 && have_avx2()) {
        layer = layer_avx2;
#endif
    } else {
        PyErr_Format(PyExc_ValueError, "no variant %s on this machine", name);
        return NULL;
    }
    return PyUnicode_FromString(before);
}

static PyMethodDef methods[] = {
    {"use_variant", use_variant, METH_VARARGS, use_variant_doc},
    {"layer_digests", layer_digests, METH_VARARGS, layer_digests_doc},
    {"copy_layer_digests", copy_layer_digests, METH_VARARGS, copy_layer_digests_doc},
    {"copy_spans_digests", copy_spans_digests, METH_VARARGS, copy_spans_digests_doc},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "kvpool._layersum",
    "Per-layer xxh3-64 checksums in C, optionally computed while copying (see kvpool/_layersum.c).",
    -1, methods, NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__layersum(void) {
    PyObject *m = PyModule_Create(&module);
    if (m == NULL) return NULL;
    const char *variant = "portable";
#ifdef LAYERSUM_X86
    if (have_avx2()) {
        layer = layer_avx2;
        variant = "avx2";
    }
#endif
    if (PyModule_AddStringConstant(m, "VARIANT", variant) < 0 || PyModule_AddIntConstant(m, "MIN_STEP", MIN_LONG) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
