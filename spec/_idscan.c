/* Block ids read straight from a READY's msgpack bytes (spec/PROTOCOL.md W2, W5, L1).
 *
 * Why this exists: every other route from a msgpack array of ints to an integer array
 * builds one Python int per id first (about 11 ns each) and then copies it out again.
 * A READY carries tens of thousands of ids per layer, so that is most of what decoding
 * one costs. msgpack ints are variable-width (1, 2, 3, 5 or 9 bytes by their tag), so
 * finding them needs a sequential scan, which is this file.
 *
 * The rules, in the order they are applied to every list:
 *   - a list is a msgpack array (fixarray, array 16 or array 32) of at most max_len items;
 *   - an item is a non-negative int in one of msgpack's unsigned forms (positive fixint,
 *     uint 8/16/32/64) no larger than max_id;
 *   - the list's bytes end exactly where its last item ends.
 * Anything else (signed forms, nil, bools, floats, strings, a short buffer) is not an
 * error here: the scan answers None and the caller hands the frame to the general
 * decoder, which decides again and words the refusal. So this file can only make a READY
 * faster, never accept one the general decoder would refuse.
 *
 * The scan reads only the bytes it is given and runs without the GIL: the ids land in a
 * bytes object nobody else can see yet.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>

/* The item count of the array header at p[0..n), and its length in *head; -1 if p does
 * not start with an array header. */
static Py_ssize_t
array_count(const uint8_t *p, Py_ssize_t n, Py_ssize_t *head)
{
    if (n < 1)
        return -1;
    if ((p[0] & 0xf0) == 0x90) {
        *head = 1;
        return p[0] & 0x0f;
    }
    if (p[0] == 0xdc && n >= 3) {
        *head = 3;
        return ((Py_ssize_t)p[1] << 8) | p[2];
    }
    if (p[0] == 0xdd && n >= 5) {
        *head = 5;
        return ((Py_ssize_t)p[1] << 24) | ((Py_ssize_t)p[2] << 16) |
               ((Py_ssize_t)p[3] << 8) | p[4];
    }
    return -1;
}

/* Writes the count items after the header into out; 0 on success, -1 where a rule fails. */
static int
read_items(const uint8_t *p, Py_ssize_t n, Py_ssize_t pos, Py_ssize_t count,
           uint64_t max_id, uint32_t *out)
{
    for (Py_ssize_t i = 0; i < count; i++) {
        uint64_t v;
        uint8_t tag;
        if (pos >= n)
            return -1;
        tag = p[pos];
        if (tag < 0x80) {
            v = tag;
            pos += 1;
        } else if (tag == 0xcc && n - pos >= 2) {
            v = p[pos + 1];
            pos += 2;
        } else if (tag == 0xcd && n - pos >= 3) {
            v = ((uint64_t)p[pos + 1] << 8) | p[pos + 2];
            pos += 3;
        } else if (tag == 0xce && n - pos >= 5) {
            v = ((uint64_t)p[pos + 1] << 24) | ((uint64_t)p[pos + 2] << 16) |
                ((uint64_t)p[pos + 3] << 8) | p[pos + 4];
            pos += 5;
        } else if (tag == 0xcf && n - pos >= 9) {
            v = 0;
            for (int b = 1; b <= 8; b++)
                v = (v << 8) | p[pos + b];
            pos += 9;
        } else {
            return -1;
        }
        if (v > max_id)
            return -1;
        out[i] = (uint32_t)v;
    }
    return pos == n ? 0 : -1;
}

PyDoc_STRVAR(scan_doc,
"scan(lists, max_id, max_len) -> (bytes, list[int]) | None\n\n"
"The ids of every msgpack array in ``lists`` (buffers, e.g. msgspec.Raw), one after the\n"
"other as native uint32 in one bytes object, with the end offset of each list; None\n"
"where any list breaks a rule (see the file's header), for the general decoder to word.");

static PyObject *
scan(PyObject *self, PyObject *args)
{
    PyObject *lists, *seq, *data = NULL, *ends = NULL, *result = NULL;
    unsigned long long max_id;
    Py_ssize_t max_len, n_lists, total = 0, got = 0;
    Py_buffer *views;
    Py_ssize_t *heads, *counts;
    int failed = 0;

    if (!PyArg_ParseTuple(args, "OKn:scan", &lists, &max_id, &max_len))
        return NULL;
    seq = PySequence_Fast(lists, "scan: lists must be a sequence");
    if (seq == NULL)
        return NULL;
    n_lists = PySequence_Fast_GET_SIZE(seq);
    views = PyMem_Calloc(n_lists ? n_lists : 1, sizeof(Py_buffer));
    heads = PyMem_Calloc(n_lists ? n_lists : 1, sizeof(Py_ssize_t));
    counts = PyMem_Calloc(n_lists ? n_lists : 1, sizeof(Py_ssize_t));
    if (views == NULL || heads == NULL || counts == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    /* First pass: the headers, so the ids get one allocation of their exact size. */
    while (got < n_lists) {
        Py_ssize_t i = got;
        if (PyObject_GetBuffer(PySequence_Fast_GET_ITEM(seq, i), &views[i], PyBUF_SIMPLE) < 0)
            goto done;
        got++;  /* from here on, released at done */
        counts[i] = array_count(views[i].buf, views[i].len, &heads[i]);
        if (counts[i] < 0 || counts[i] > max_len ||
                counts[i] > views[i].len - heads[i]) {  /* every item takes a byte at least */
            result = Py_None;
            goto done;
        }
        total += counts[i];
    }
    data = PyBytes_FromStringAndSize(NULL, total * (Py_ssize_t)sizeof(uint32_t));
    ends = PyList_New(n_lists);
    if (data == NULL || ends == NULL)
        goto done;
    {
        uint32_t *out = (uint32_t *)PyBytes_AS_STRING(data);
        Py_BEGIN_ALLOW_THREADS
        for (Py_ssize_t i = 0; i < n_lists && !failed; i++) {
            failed = read_items(views[i].buf, views[i].len, heads[i], counts[i],
                                (uint64_t)max_id, out);
            out += counts[i];
        }
        Py_END_ALLOW_THREADS
    }
    if (failed) {
        result = Py_None;
        goto done;
    }
    {
        Py_ssize_t end = 0;
        for (Py_ssize_t i = 0; i < n_lists; i++) {
            PyObject *value;
            end += counts[i];
            value = PyLong_FromSsize_t(end);
            if (value == NULL)
                goto done;
            PyList_SET_ITEM(ends, i, value);
        }
    }
    result = PyTuple_Pack(2, data, ends);
done:
    for (Py_ssize_t i = 0; i < got; i++)
        PyBuffer_Release(&views[i]);
    PyMem_Free(views);
    PyMem_Free(heads);
    PyMem_Free(counts);
    Py_XDECREF(data);
    Py_XDECREF(ends);
    Py_DECREF(seq);
    if (result == Py_None)
        Py_INCREF(result);
    return result;
}

static PyMethodDef methods[] = {
    {"scan", scan, METH_VARARGS, scan_doc},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_idscan",
    "Block ids read from a READY's msgpack bytes without a Python int per id.", -1, methods,
};

PyMODINIT_FUNC
PyInit__idscan(void)
{
    return PyModule_Create(&module);
}
