/*
 * kvpool._index: key indexes probed for a batch of keys in C: the master's (find) and an arena
 * owner's shared one, read by same-host processes (find_shared).
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
 *
 * find_shared
 *   A same-host get of a 128-page SGLang batch finds 256 objects in a neighbour's arena through
 *   its shared index (tiers/cxl/index.py) and snapshots each object's header. In Python that was
 *   ~10 us an object (the seqlocked probe, the snapshot, the checks), 2.6-4.6 ms of an 8.6 ms
 *   call that copies 64 MiB. Here it is one pass: per key, the slot read under its seqlock
 *   (tiers.cxl.index.SharedIndexReader._probe), then one private copy of the header the entry
 *   names, checked on that copy (tiers.cxl.reader.CxlArenaReader._indexed_header). The caller
 *   then parses each snapshot (ObjectHeader.unpack_exact: the header's own checksum, its dims)
 *   and checks the spec's size against the entry. tests/tiers/test_cxl.py checks it against the
 *   Python path over damaged entries and headers; tests/tiers/test_shm_index.py, against a
 *   writer in another process, that it never hands back a torn slot.
 *
 *   The owner writes a slot as: seq odd, the fields, seq even (x86 keeps stores in order, and
 *   loads in order): a reader's copy between two equal even reads of seq is one version.
 *   The arena bytes may change at any moment (an extent freed and reused), so every check is
 *   made on the snapshot, never on the arena; the layers are checked later, on their copy.
 *   The caller checks first that neither file was shrunk under its mapping (a read past a
 *   file's end would be SIGBUS).
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

/* A shared-index slot: 8 u64 words (tiers/cxl/index.py). */
enum { SEQ, STATE, HASH_LO, HASH_HI, OFFSET, NBYTES, HEADER_SUM, SLOT_WORDS = 8 };
enum { SLOT_EMPTY = 0, SLOT_LIVE = 1 };
/* An object header's fixed part (kvpool/objformat.py _FIXED): where its fields are. */
#define FIXED_NBYTES 80
#define HEADER_NBYTES_AT 8
#define KEY_DIGEST_AT 44
#define CHECKSUM_AT 68

static uint64_t load_u64(const void *p) {
    uint64_t v;
    memcpy(&v, p, 8);
    return v;
}

/* Key i's slot fields (STATE..HEADER_SUM) as one version: 1 found, 0 absent, -1 the writer kept
   a slot busy for `retries` reads (the caller then asks the master). */
static int probe_shared(const uint64_t *words, uint64_t mask, uint64_t lo, uint64_t hi, int retries,
                        uint64_t row[SLOT_WORDS]) {
    uint64_t s = lo & mask;
    for (uint64_t step = 0; step <= mask; step++, s = (s + 1) & mask) {
        const uint64_t *slot = words + s * SLOT_WORDS;
        int tries = 0;
        for (;; tries++) {
            if (tries >= retries)
                return -1;
            uint64_t seq = __atomic_load_n(&slot[SEQ], __ATOMIC_ACQUIRE);
            if (seq & 1)
                continue;
            for (int w = STATE; w <= HEADER_SUM; w++)
                row[w] = __atomic_load_n(&slot[w], __ATOMIC_RELAXED);
            __atomic_thread_fence(__ATOMIC_ACQUIRE);
            if (__atomic_load_n(&slot[SEQ], __ATOMIC_RELAXED) == seq)
                break;
        }
        if (row[STATE] == SLOT_EMPTY)
            return 0;
        if (row[STATE] == SLOT_LIVE && row[HASH_LO] == lo && row[HASH_HI] == hi)
            return 1;
    }
    return 0;
}

static PyObject *find_shared(PyObject *self, PyObject *args) {
    PyObject *words_obj, *arena_obj, *digests_obj;
    Py_ssize_t max_header;
    int retries;
    if (!PyArg_ParseTuple(args, "OOOni", &words_obj, &arena_obj, &digests_obj, &max_header, &retries))
        return NULL;
    held_buffer b[3];
    memset(b, 0, sizeof b);
    PyObject *result = NULL;
    if (take(words_obj, &b[0], SLOT_WORDS * 8, 0, "words") < 0 || take(arena_obj, &b[1], 1, 0, "arena") < 0 ||
        take(digests_obj, &b[2], 16, 0, "digests") < 0)
        goto done;
    uint64_t slots = (uint64_t)b[0].view.len / (SLOT_WORDS * 8);
    if (slots < 1 || (slots & (slots - 1))) {
        PyErr_SetString(PyExc_ValueError, "words must hold a power-of-two number of 64-byte slots");
        goto done;
    }
    if (max_header < FIXED_NBYTES || retries < 1) {
        PyErr_SetString(PyExc_ValueError, "max_header below a fixed header, or retries < 1");
        goto done;
    }
    const uint64_t *words = b[0].view.buf;
    const uint8_t *arena = b[1].view.buf, *digests = b[2].view.buf;
    const uint64_t capacity = (uint64_t)b[1].view.len;
    const Py_ssize_t n = b[2].view.len / 16;
    result = PyList_New(n);
    if (result == NULL)
        goto done;
    for (Py_ssize_t i = 0; i < n; i++) {
        /* xxh3_128_digest: the 128-bit hash big-endian, high half first */
        const uint8_t *digest = digests + 16 * i;
        uint64_t hi = 0, lo = 0;
        for (int j = 0; j < 8; j++) {
            hi = hi << 8 | digest[j];
            lo = lo << 8 | digest[8 + j];
        }
        uint64_t row[SLOT_WORDS];
        PyObject *item = NULL;
        if (probe_shared(words, slots - 1, lo, hi, retries, row) == 1) {
            uint64_t offset = row[OFFSET], nbytes = row[NBYTES];
            if (capacity >= FIXED_NBYTES && offset <= capacity - FIXED_NBYTES) {
                uint32_t claimed;
                memcpy(&claimed, arena + offset + HEADER_NBYTES_AT, 4);
                uint64_t room = capacity - offset < (uint64_t)max_header ? capacity - offset : (uint64_t)max_header;
                if (claimed >= FIXED_NBYTES && claimed <= room) {
                    PyObject *snapshot = PyBytes_FromStringAndSize((const char *)arena + offset, claimed);
                    if (snapshot == NULL) {
                        Py_CLEAR(result);
                        goto done;
                    }
                    const uint8_t *h = (const uint8_t *)PyBytes_AS_STRING(snapshot);
                    uint32_t length;
                    memcpy(&length, h + HEADER_NBYTES_AT, 4);
                    /* the copy is whole as claimed, names the key and is the version indexed */
                    if (length == claimed && memcmp(h + KEY_DIGEST_AT, digest, 16) == 0 &&
                        load_u64(h + CHECKSUM_AT) == row[HEADER_SUM] && nbytes <= capacity - offset)
                        item = Py_BuildValue("(KNKK)", (unsigned long long)offset, snapshot,
                                             (unsigned long long)nbytes, (unsigned long long)row[HEADER_SUM]);
                    else
                        Py_DECREF(snapshot);
                    if (item == NULL && PyErr_Occurred()) {
                        Py_CLEAR(result);
                        goto done;
                    }
                }
            }
        }
        if (item == NULL) {
            item = Py_None;
            Py_INCREF(item);
        }
        PyList_SET_ITEM(result, i, item);
    }
done:
    for (int i = 0; i < 3; i++)
        if (b[i].held)
            PyBuffer_Release(&b[i].view);
    return result;
}

static PyMethodDef methods[] = {
    {"find", find, METH_VARARGS,
     "find(k0, k1, nd, lo, hi, out, stop_at_miss) -> how many leading keys were found. out[i]: key i's "
     "table slot, -1 where absent (with stop_at_miss, written only up to the first miss)."},
    {"find_shared", find_shared, METH_VARARGS,
     "find_shared(words, arena, digests, max_header, retries) -> [(offset, header snapshot, nbytes, header_sum) "
     "or None] for each 16-byte xxh3_128 digest in digests: found through a shared index's slots (words), "
     "the header copied out of arena once and checked on that copy (whole as it claims, naming the key, "
     "the version indexed). Parse the snapshot before use: its checksum and dims are not checked here."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "kvpool._index", "Key indexes probed in C (see kvpool/_index.c).",
    -1, methods, NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__index(void) { return PyModule_Create(&module); }
