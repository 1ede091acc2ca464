/*
 * kvpool._index: the master's key index probed for a batch of keys in C.
 *
 * Why
 *   A scheduler asks the master how much of a prompt is cached: a 128k-token prompt is 1,000
 *   keys in one request. numpy probes the batch in lock-step rounds, a dozen array operations
 *   per round for as many rounds as the longest probe (~250 us for 1,000 keys here, most of a
 *   lookup's time on the master). One pass in C over each key's probe is ~10 us, and a
 *   lookup stops at its first miss.
 *
 * What
 *   The table of kvpool.cluster.master.index.KeyIndex: columns k0, k1 (u64, a key's low and
 *   high halves), nd (u16 node id; 0: never used, 0xFFFF: deleted), open addressing with
 *   linear probing from slot_hash(lo, hi) & (capacity - 1). find() is that module's
 *   KeyIndex._find for many keys; tests/cluster/master/test_index.py checks it against the
 *   numpy probe.
 *
 * The caller holds the index's lock (the master's turn); the GIL stays held throughout.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#define EMPTY 0
#define TOMB 0xFFFF
#define C1 0x9E3779B97F4A7C15ULL
#define C2 0xC2B2AE3D27D4EB4FULL

typedef struct {
    Py_buffer view;
    int held;
} held_buffer;

static int take(PyObject *obj, held_buffer *b, Py_ssize_t itemsize, int writable, const char *name) {
    if (PyObject_GetBuffer(obj, &b->view, writable ? PyBUF_WRITABLE : PyBUF_SIMPLE) < 0)
        return -1;
    b->held = 1;
    if (b->view.len % itemsize) {
        PyErr_Format(PyExc_ValueError, "%s: %zd bytes is not a whole number of %zd-byte items", name, b->view.len,
                     itemsize);
        return -1;
    }
    return 0;
}

static PyObject *find(PyObject *self, PyObject *args) {
    PyObject *objs[6];
    int stop_at_miss = 0;
    if (!PyArg_ParseTuple(args, "OOOOOOp", &objs[0], &objs[1], &objs[2], &objs[3], &objs[4], &objs[5],
                          &stop_at_miss))
        return NULL;
    static const char *names[6] = {"k0", "k1", "nd", "lo", "hi", "out"};
    static const Py_ssize_t sizes[6] = {8, 8, 2, 8, 8, 8};
    held_buffer b[6];
    memset(b, 0, sizeof b);
    PyObject *result = NULL;
    for (int i = 0; i < 6; i++)
        if (take(objs[i], &b[i], sizes[i], i == 5, names[i]) < 0)
            goto done;
    Py_ssize_t capacity = b[0].view.len / 8, n = b[3].view.len / 8;
    if (capacity < 1 || (capacity & (capacity - 1)) || b[1].view.len / 8 != capacity || b[2].view.len / 2 != capacity) {
        PyErr_SetString(PyExc_ValueError, "k0, k1 and nd must have the same power-of-two length");
        goto done;
    }
    if (b[4].view.len / 8 != n || b[5].view.len / 8 < n) {
        PyErr_SetString(PyExc_ValueError, "lo and hi must have the same length, out at least as long");
        goto done;
    }
    const uint64_t *k0 = b[0].view.buf, *k1 = b[1].view.buf, *lo = b[3].view.buf, *hi = b[4].view.buf;
    const uint16_t *nd = b[2].view.buf;
    int64_t *out = b[5].view.buf;
    uint64_t mask = (uint64_t)capacity - 1;
    Py_ssize_t leading = -1;
    for (Py_ssize_t i = 0; i < n; i++) {
        uint64_t h = lo[i] * C1 + hi[i] * C2;
        uint64_t s = (h ^ (h >> 31)) & mask;
        int64_t slot = -1;
        /* The table is never full (at most MAX_LOAD of it), so every probe meets an empty slot;
           the bound only keeps a corrupted table from looping forever. */
        for (uint64_t step = 0; step <= mask; step++, s = (s + 1) & mask) {
            uint16_t state = nd[s];
            if (state == EMPTY)
                break;
            if (state != TOMB && k0[s] == lo[i] && k1[s] == hi[i]) {
                slot = (int64_t)s;
                break;
            }
        }
        out[i] = slot;
        if (slot < 0 && leading < 0) {
            leading = i;
            if (stop_at_miss)
                break;
        }
    }
    result = PyLong_FromSsize_t(leading < 0 ? n : leading);
done:
    for (int i = 0; i < 6; i++)
        if (b[i].held)
            PyBuffer_Release(&b[i].view);
    return result;
}

static PyMethodDef methods[] = {
    {"find", find, METH_VARARGS,
     "find(k0, k1, nd, lo, hi, out, stop_at_miss) -> how many leading keys were found. out[i]: key i's "
     "table slot, -1 where absent (with stop_at_miss, written only up to the first miss)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "kvpool._index", "The master's key index probed in C (see kvpool/_index.c).",
    -1, methods, NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__index(void) { return PyModule_Create(&module); }
