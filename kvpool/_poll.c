/*
 * kvpool._poll: a socket polled for bytes with the GIL released (for
 * kvpool.transport.tcp.stream.ReplyPoll).
 *
 * Why
 *   A thread that waits for a peer's next bytes in a blocking recv sleeps, and on a virtual
 *   machine its idle vCPU halts: waking it costs tens of microseconds per message. Polling
 *   for a bounded time avoids that. A Python loop of non-blocking receives would take and
 *   drop the GIL at every try, and a thread that keeps re-taking the GIL holds off every
 *   other thread of its process (they get it only when it blocks, or after the switch
 *   interval): here the loop runs without the GIL, so polling costs the process's other
 *   threads nothing but the CPU it runs on.
 *
 * What
 *   recv_poll(fd, buffers, timeout_ns) -> int
 *     recvmsg(MSG_DONTWAIT) into ``buffers`` (1 to 8 writable, contiguous) until a try brings
 *     bytes: their count (0: the peer closed the stream); -1 when ``timeout_ns`` passed first,
 *     or a signal interrupted (the caller's blocking receive then runs its handlers).
 *     OSError (its errno subclass) for any other failure.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <errno.h>
#include <stdint.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <time.h>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define RELAX() _mm_pause()
#elif defined(__aarch64__)
#define RELAX() __asm__ __volatile__("yield")
#else
#define RELAX() ((void)0)
#endif

#define MAX_BUFFERS 8

static int64_t now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
}

static PyObject *recv_poll(PyObject *self, PyObject *args) {
    int fd;
    PyObject *buffers;
    long long timeout_ns;
    if (!PyArg_ParseTuple(args, "iOL", &fd, &buffers, &timeout_ns))
        return NULL;
    PyObject *seq = PySequence_Fast(buffers, "buffers must be a sequence");
    if (seq == NULL)
        return NULL;
    Py_ssize_t count = PySequence_Fast_GET_SIZE(seq);
    if (count < 1 || count > MAX_BUFFERS) {
        Py_DECREF(seq);
        PyErr_Format(PyExc_ValueError, "recv_poll takes 1 to %d buffers, got %zd", MAX_BUFFERS, count);
        return NULL;
    }
    Py_buffer views[MAX_BUFFERS];
    struct iovec iov[MAX_BUFFERS];
    Py_ssize_t held = 0;
    for (; held < count; held++) {
        if (PyObject_GetBuffer(PySequence_Fast_GET_ITEM(seq, held), &views[held], PyBUF_WRITABLE) < 0)
            break;
        iov[held].iov_base = views[held].buf;
        iov[held].iov_len = (size_t)views[held].len;
    }
    ssize_t got = -1;
    int err = 0;
    if (held == count) {
        struct msghdr msg = {0};
        msg.msg_iov = iov;
        msg.msg_iovlen = (size_t)count;
        Py_BEGIN_ALLOW_THREADS
        int64_t deadline = now_ns() + timeout_ns;
        for (;;) {
            got = recvmsg(fd, &msg, MSG_DONTWAIT);
            if (got >= 0)
                break;
            err = errno;
            if ((err != EAGAIN && err != EWOULDBLOCK) || now_ns() >= deadline)
                break;
            RELAX();
        }
        Py_END_ALLOW_THREADS
    }
    for (Py_ssize_t i = 0; i < held; i++)
        PyBuffer_Release(&views[i]);
    Py_DECREF(seq);
    if (held != count)
        return NULL;  /* a buffer that is not writable or not contiguous: its error is set */
    if (got >= 0)
        return PyLong_FromSsize_t(got);
    if (err == EAGAIN || err == EWOULDBLOCK || err == EINTR)
        return PyLong_FromLong(-1);
    errno = err;
    return PyErr_SetFromErrno(PyExc_OSError);
}

static PyMethodDef methods[] = {
    {"recv_poll", recv_poll, METH_VARARGS,
     "recv_poll(fd, buffers, timeout_ns) -> bytes received (0: stream ended), or -1: none within "
     "timeout_ns (or a signal came). Non-blocking receives with the GIL released."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "kvpool._poll", "A socket polled for bytes with the GIL released (see kvpool/_poll.c).",
    -1, methods, NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__poll(void) { return PyModule_Create(&module); }
