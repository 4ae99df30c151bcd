/* Acquire/release access to 64-bit words inside a shared-memory buffer.
 *
 * The ring (mlxrt/ipc/ring.py, whose docstring owns the layout and the
 * ordering argument) needs a handful of atomic operations on words that live
 * in a mapping shared between processes. Python has none, so this module
 * exposes them on a `Region`: a writable buffer (the ring's mmap) held for the
 * Region's lifetime, so the mapping cannot be closed under a running call.
 * Every offset is bounds- and alignment-checked; nothing here knows the ring's
 * layout beyond "a record is one 64-bit word followed by its payload".
 *
 * The GCC/clang __atomic builtins are used rather than C11 _Atomic types
 * because the words are plain memory inside someone else's buffer. 64-bit
 * atomics are lock-free (and therefore address-free) on x86_64 and arm64,
 * which is what makes them valid across processes; the #error below
 * refuses to build where that does not hold.
 *
 * The GIL is held throughout, so close() on another thread cannot release the
 * buffer in the middle of a copy.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#if !defined(__GNUC__) && !defined(__clang__)
#error "mlxrt.ipc._atomics needs the GCC/clang __atomic builtins"
#endif

/* 2 means "always lock-free"; a lock-based atomic would not work across processes. */
#if !defined(__GCC_ATOMIC_LLONG_LOCK_FREE) || __GCC_ATOMIC_LLONG_LOCK_FREE != 2
#error "64-bit atomics must be lock-free to be shared between processes"
#endif

typedef struct {
    PyObject_HEAD
    Py_buffer view;
    int held;
} Region;

/* Pointer to the `size`-byte span at `off`, or NULL with an exception set. */
static char *
span(Region *self, PyObject *off_obj, Py_ssize_t size, int word)
{
    if (!self->held) {
        PyErr_SetString(PyExc_ValueError, "region is released");
        return NULL;
    }
    Py_ssize_t off = PyLong_AsSsize_t(off_obj);
    if (off == -1 && PyErr_Occurred())
        return NULL;
    if (off < 0 || size < 0 || off > self->view.len - size) {
        PyErr_Format(PyExc_IndexError, "span [%zd, %zd) outside region of %zd bytes",
                     off, off + size, self->view.len);
        return NULL;
    }
    char *p = (char *)self->view.buf + off;
    if (word && ((uintptr_t)p & 7u)) {
        PyErr_Format(PyExc_ValueError, "offset %zd is not 8-byte aligned", off);
        return NULL;
    }
    return p;
}

static uint64_t *
word_at(Region *self, PyObject *off_obj)
{
    return (uint64_t *)span(self, off_obj, 8, 1);
}

static int
as_u64(PyObject *obj, uint64_t *out)
{
    unsigned long long v = PyLong_AsUnsignedLongLong(obj);
    if (v == (unsigned long long)-1 && PyErr_Occurred())
        return -1;
    *out = (uint64_t)v;
    return 0;
}

#define NARGS(name, n)                                                              \
    if (nargs != (n)) {                                                             \
        PyErr_Format(PyExc_TypeError, name "() takes %d arguments (%zd given)", (n), \
                     nargs);                                                        \
        return NULL;                                                                \
    }

static int
Region_init(Region *self, PyObject *args, PyObject *kwds)
{
    PyObject *obj;
    if (kwds && PyDict_GET_SIZE(kwds)) {
        PyErr_SetString(PyExc_TypeError, "Region() takes no keyword arguments");
        return -1;
    }
    if (!PyArg_ParseTuple(args, "O:Region", &obj))
        return -1;
    if (self->held) {
        PyBuffer_Release(&self->view);
        self->held = 0;
    }
    if (PyObject_GetBuffer(obj, &self->view, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) < 0)
        return -1;
    self->held = 1;
    if ((uintptr_t)self->view.buf & 7u) {
        PyBuffer_Release(&self->view);
        self->held = 0;
        PyErr_SetString(PyExc_ValueError, "buffer is not 8-byte aligned");
        return -1;
    }
    return 0;
}

static void
Region_dealloc(Region *self)
{
    if (self->held)
        PyBuffer_Release(&self->view);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

/* load_acquire(off) -> int: later reads cannot move before this load. */
static PyObject *
Region_load_acquire(Region *self, PyObject *const *args, Py_ssize_t nargs)
{
    NARGS("load_acquire", 1);
    uint64_t *w = word_at(self, args[0]);
    if (!w)
        return NULL;
    return PyLong_FromUnsignedLongLong(__atomic_load_n(w, __ATOMIC_ACQUIRE));
}

/* load_relaxed(off) -> int: untorn, no ordering (data already acquired). */
static PyObject *
Region_load_relaxed(Region *self, PyObject *const *args, Py_ssize_t nargs)
{
    NARGS("load_relaxed", 1);
    uint64_t *w = word_at(self, args[0]);
    if (!w)
        return NULL;
    return PyLong_FromUnsignedLongLong(__atomic_load_n(w, __ATOMIC_RELAXED));
}

/* store_release(off, value): earlier reads and writes cannot move after it. */
static PyObject *
Region_store_release(Region *self, PyObject *const *args, Py_ssize_t nargs)
{
    NARGS("store_release", 2);
    uint64_t v;
    uint64_t *w = word_at(self, args[0]);
    if (!w || as_u64(args[1], &v) < 0)
        return NULL;
    __atomic_store_n(w, v, __ATOMIC_RELEASE);
    Py_RETURN_NONE;
}

/* compare_exchange(off, expected, desired) -> int: the value seen (== expected on success). */
static PyObject *
Region_compare_exchange(Region *self, PyObject *const *args, Py_ssize_t nargs)
{
    NARGS("compare_exchange", 3);
    uint64_t expected, desired;
    uint64_t *w = word_at(self, args[0]);
    if (!w || as_u64(args[1], &expected) < 0 || as_u64(args[2], &desired) < 0)
        return NULL;
    __atomic_compare_exchange_n(w, &expected, desired, 0, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST);
    return PyLong_FromUnsignedLongLong(expected);
}

/* flag_then_load(flag_off, value, load_off) -> int
 * Store `value` at flag_off, full fence, acquire-load load_off. One half of the
 * sleep/wake handshake: the fence keeps the load from passing the store. */
static PyObject *
Region_flag_then_load(Region *self, PyObject *const *args, Py_ssize_t nargs)
{
    NARGS("flag_then_load", 3);
    uint64_t v;
    uint64_t *flag = word_at(self, args[0]);
    if (!flag || as_u64(args[1], &v) < 0)
        return NULL;
    uint64_t *w = word_at(self, args[2]);
    if (!w)
        return NULL;
    __atomic_store_n(flag, v, __ATOMIC_RELAXED);
    __atomic_thread_fence(__ATOMIC_SEQ_CST);
    return PyLong_FromUnsignedLongLong(__atomic_load_n(w, __ATOMIC_ACQUIRE));
}

/* put(off, word, data, tail_off, tail, flag_off) -> int
 * Write the 8-byte record word at off and the payload after it, release-store
 * `tail` at tail_off (publishing the record), full fence, and return the word
 * at flag_off. The other half of the sleep/wake handshake. */
static PyObject *
Region_put(Region *self, PyObject *const *args, Py_ssize_t nargs)
{
    NARGS("put", 6);
    uint64_t word, tail;
    Py_buffer data;
    if (as_u64(args[1], &word) < 0 || as_u64(args[4], &tail) < 0)
        return NULL;
    uint64_t *tail_w = word_at(self, args[3]);
    uint64_t *flag_w = tail_w ? word_at(self, args[5]) : NULL;
    if (!flag_w)
        return NULL;
    if (PyObject_GetBuffer(args[2], &data, PyBUF_C_CONTIGUOUS) < 0)
        return NULL;
    char *dst = span(self, args[0], 8 + data.len, 1);
    if (!dst) {
        PyBuffer_Release(&data);
        return NULL;
    }
    memcpy(dst, &word, 8);
    memcpy(dst + 8, data.buf, (size_t)data.len);
    PyBuffer_Release(&data);
    __atomic_store_n(tail_w, tail, __ATOMIC_RELEASE);
    __atomic_thread_fence(__ATOMIC_SEQ_CST);
    return PyLong_FromUnsignedLongLong(__atomic_load_n(flag_w, __ATOMIC_RELAXED));
}

/* take(off, n, head_off, head) -> bytes
 * Copy n bytes out from off, then release-store `head` at head_off, handing
 * the space back to the writer only after the copy is complete. */
static PyObject *
Region_take(Region *self, PyObject *const *args, Py_ssize_t nargs)
{
    NARGS("take", 4);
    uint64_t head;
    Py_ssize_t n = PyLong_AsSsize_t(args[1]);
    if (n == -1 && PyErr_Occurred())
        return NULL;
    if (as_u64(args[3], &head) < 0)
        return NULL;
    char *src = span(self, args[0], n, 0);
    uint64_t *head_w = src ? word_at(self, args[2]) : NULL;
    if (!head_w)
        return NULL;
    PyObject *out = PyBytes_FromStringAndSize(src, n);
    if (!out)
        return NULL;
    __atomic_store_n(head_w, head, __ATOMIC_RELEASE);
    return out;
}

/* release(): drop the buffer so the underlying mapping can be closed. */
static PyObject *
Region_release(Region *self, PyObject *Py_UNUSED(ignored))
{
    if (self->held) {
        PyBuffer_Release(&self->view);
        self->held = 0;
    }
    Py_RETURN_NONE;
}

static PyMethodDef Region_methods[] = {
    {"load_acquire", (PyCFunction)(void (*)(void))Region_load_acquire, METH_FASTCALL, NULL},
    {"load_relaxed", (PyCFunction)(void (*)(void))Region_load_relaxed, METH_FASTCALL, NULL},
    {"store_release", (PyCFunction)(void (*)(void))Region_store_release, METH_FASTCALL, NULL},
    {"compare_exchange", (PyCFunction)(void (*)(void))Region_compare_exchange, METH_FASTCALL,
     NULL},
    {"flag_then_load", (PyCFunction)(void (*)(void))Region_flag_then_load, METH_FASTCALL, NULL},
    {"put", (PyCFunction)(void (*)(void))Region_put, METH_FASTCALL, NULL},
    {"take", (PyCFunction)(void (*)(void))Region_take, METH_FASTCALL, NULL},
    {"release", (PyCFunction)Region_release, METH_NOARGS, NULL},
    {NULL, NULL, 0, NULL},
};

static PyTypeObject RegionType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "mlxrt.ipc._atomics.Region",
    .tp_doc = PyDoc_STR("Region(buffer): atomic 64-bit access inside a writable buffer"),
    .tp_basicsize = sizeof(Region),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)Region_init,
    .tp_dealloc = (destructor)Region_dealloc,
    .tp_methods = Region_methods,
};

static struct PyModuleDef atomics_module = {
    PyModuleDef_HEAD_INIT,
    .m_name = "mlxrt.ipc._atomics",
    .m_doc = PyDoc_STR("Acquire/release operations on 64-bit words in a shared buffer."),
    .m_size = -1,
};

PyMODINIT_FUNC
PyInit__atomics(void)
{
    if (PyType_Ready(&RegionType) < 0)
        return NULL;
    PyObject *m = PyModule_Create(&atomics_module);
    if (!m)
        return NULL;
    Py_INCREF(&RegionType);
    if (PyModule_AddObject(m, "Region", (PyObject *)&RegionType) < 0) {
        Py_DECREF(&RegionType);
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
