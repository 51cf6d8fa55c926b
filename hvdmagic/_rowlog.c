/* log_metrics in C: the rows a rank logs, in typed columns, without the interpreter.
 *
 * Between training steps the interpreter's caches are cold, and the Python
 * log_metrics (report.py) cost about 1.8 us a call there: the keyword dict, a
 * lock, time.time() and one append per column. Here a call is one C function
 * (METH_FASTCALL: no keyword dict), the GIL is the lock (nothing below calls
 * back into Python once a row is being written), and the clock is
 * clock_gettime. report.py keeps the Python version as the fallback and for
 * HVDMAGIC_PURE_PYTHON=1; both keep the same rows and raise the same errors.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <string.h>
#include <time.h>

typedef struct {
    PyObject *name;
    double *data;
    Py_ssize_t len, cap;
} Column;

static double *steps, *times;
static Py_ssize_t rows, row_cap;
static Column *columns;
static Py_ssize_t ncolumns, column_cap;
static double next_step;        /* the step of a call that gives none */
static int enabled;             /* a no-op until report.open_events() */
static Py_ssize_t limit;        /* rows beyond which a call waits for a flush */
static PyObject *wait_for_flush;
static double gap;              /* metric_rows.GAP_BITS: a row that did not log the metric */
static PyObject *STEP;          /* "step", interned */

static int grow(double **data, Py_ssize_t *cap, Py_ssize_t need) {
    if (need <= *cap) return 0;
    Py_ssize_t cap2 = *cap ? *cap : 256;
    while (cap2 < need) cap2 *= 2;
    double *data2 = PyMem_Realloc(*data, (size_t)cap2 * sizeof(double));
    if (!data2) { PyErr_NoMemory(); return -1; }
    *data = data2;
    *cap = cap2;
    return 0;
}

static int grow_rows(Py_ssize_t need) {  /* steps and times share one capacity */
    Py_ssize_t cap = row_cap;
    if (grow(&steps, &cap, need) < 0) return -1;
    cap = row_cap;
    if (grow(&times, &cap, need) < 0) return -1;
    row_cap = cap;
    return 0;
}

static int pad(Column *c, Py_ssize_t n) {
    if (grow(&c->data, &c->cap, n + 1) < 0) return -1;
    while (c->len < n) c->data[c->len++] = gap;
    return 0;
}

static Column *column_for(PyObject *name) {
    for (Py_ssize_t i = 0; i < ncolumns; i++)   /* keyword names are interned: identity first */
        if (columns[i].name == name) return &columns[i];
    for (Py_ssize_t i = 0; i < ncolumns; i++)
        if (PyUnicode_Compare(columns[i].name, name) == 0) return &columns[i];
    if (ncolumns == column_cap) {
        Py_ssize_t cap2 = column_cap ? column_cap * 2 : 8;
        Column *c2 = PyMem_Realloc(columns, (size_t)cap2 * sizeof(Column));
        if (!c2) { PyErr_NoMemory(); return NULL; }
        columns = c2;
        column_cap = cap2;
    }
    Column *c = &columns[ncolumns++];
    Py_INCREF(name);
    c->name = name;
    c->data = NULL;
    c->len = c->cap = 0;
    return c;
}

/* The same one-line errors as report.py's Python version. */
static int as_double(PyObject *name, PyObject *value, double *out) {
    *out = PyFloat_AsDouble(value);
    if (*out != -1.0 || !PyErr_Occurred()) return 0;
    if (PyErr_ExceptionMatches(PyExc_OverflowError)) {
        PyErr_Format(PyExc_OverflowError, "log_metrics(%U=...) is too large for a float", name);
    } else {
        PyErr_Format(PyExc_TypeError, "log_metrics(%U=...) needs a number, not %s", name,
                     Py_TYPE(value)->tp_name);
    }
    return -1;
}

#define MAX_STACK_METRICS 32

static PyObject *log_metrics(PyObject *module, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames) {
    if (!enabled) Py_RETURN_NONE;
    if (nargs > 1) {
        PyErr_Format(PyExc_TypeError, "log_metrics() takes at most 1 positional argument (%zd given)", nargs);
        return NULL;
    }
    Py_ssize_t nkw = kwnames ? PyTuple_GET_SIZE(kwnames) : 0;
    PyObject *step_obj = nargs ? args[0] : NULL;
    Py_ssize_t step_at = -1;
    for (Py_ssize_t i = 0; i < nkw; i++) {
        PyObject *name = PyTuple_GET_ITEM(kwnames, i);
        if (name == STEP || PyUnicode_Compare(name, STEP) == 0) {
            if (step_obj) {
                PyErr_SetString(PyExc_TypeError, "log_metrics() got multiple values for argument 'step'");
                return NULL;
            }
            step_obj = args[nargs + i];
            step_at = i;
        }
    }
    double step = next_step;
    if (step_obj && step_obj != Py_None && as_double(STEP, step_obj, &step) < 0) return NULL;
    /* Every value is converted before the row is touched: a refused call leaves nothing, and a
       __float__ that runs Python code (a tensor's) cannot interleave with another thread's row. */
    double stack[MAX_STACK_METRICS], *values = stack;
    if (nkw > MAX_STACK_METRICS && !(values = PyMem_Malloc((size_t)nkw * sizeof(double))))
        return PyErr_NoMemory();
    for (Py_ssize_t i = 0; i < nkw; i++) {
        if (i != step_at && as_double(PyTuple_GET_ITEM(kwnames, i), args[nargs + i], &values[i]) < 0) {
            if (values != stack) PyMem_Free(values);
            return NULL;
        }
    }
    int failed = grow_rows(rows + 1) < 0;
    for (Py_ssize_t i = 0; i < nkw && !failed; i++) {
        if (i == step_at) continue;
        Column *c = column_for(PyTuple_GET_ITEM(kwnames, i));
        if (!c || pad(c, rows) < 0) { failed = 1; break; }
        c->data[c->len++] = values[i];
    }
    if (values != stack) PyMem_Free(values);
    if (failed) {  /* out of memory part-way: cut the row back */
        for (Py_ssize_t i = 0; i < ncolumns; i++)
            if (columns[i].len > rows) columns[i].len = rows;
        return NULL;
    }
    struct timespec now;
    clock_gettime(CLOCK_REALTIME, &now);
    steps[rows] = step;
    times[rows] = (double)now.tv_sec + now.tv_nsec * 1e-9;
    rows++;
    next_step = step + 1;
    if (rows >= limit && wait_for_flush)
        return PyObject_CallNoArgs(wait_for_flush);
    Py_RETURN_NONE;
}

static PyObject *as_bytes(const double *data, Py_ssize_t n) {
    return PyBytes_FromStringAndSize((const char *)data, n * (Py_ssize_t)sizeof(double));
}

/* take() -> (steps, times, [(name, column), ...]): the rows logged since the last take, each
   as the bytes of native doubles, columns padded to full length; the buffers start again empty. */
static PyObject *take(PyObject *module, PyObject *unused) {
    /* Detach the buffers first: building the result allocates, a collection can run a __del__,
       and another thread may log meanwhile, into fresh buffers. */
    double *s = steps, *t = times;
    Py_ssize_t n = rows, nc = ncolumns;
    Column *cols = columns;
    steps = times = NULL;
    columns = NULL;
    rows = row_cap = ncolumns = column_cap = 0;
    PyObject *out = NULL, *named = PyList_New(0);
    for (Py_ssize_t i = 0; named && i < nc; i++) {
        if (pad(&cols[i], n) < 0) goto done;
        PyObject *item = Py_BuildValue("(ON)", cols[i].name, as_bytes(cols[i].data, n));
        if (!item || PyList_Append(named, item) < 0) { Py_XDECREF(item); goto done; }
        Py_DECREF(item);
    }
    if (named) out = Py_BuildValue("(NNO)", as_bytes(s, n), as_bytes(t, n), named);
done:
    Py_XDECREF(named);
    for (Py_ssize_t i = 0; i < nc; i++) {
        Py_DECREF(cols[i].name);
        PyMem_Free(cols[i].data);
    }
    PyMem_Free(cols);
    PyMem_Free(s);
    PyMem_Free(t);
    return out;
}

static PyObject *pending(PyObject *module, PyObject *unused) {
    return PyLong_FromSsize_t(rows);
}

/* enable(on, limit, wait_for_flush, gap, next_step): report.open_events() turns the calls on. */
static PyObject *enable(PyObject *module, PyObject *args) {
    int on;
    Py_ssize_t max_rows;
    PyObject *waiter;
    if (!PyArg_ParseTuple(args, "pnOdd", &on, &max_rows, &waiter, &gap, &next_step)) return NULL;
    Py_XSETREF(wait_for_flush, waiter == Py_None ? NULL : Py_NewRef(waiter));
    enabled = on;
    limit = max_rows;
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"log_metrics", (PyCFunction)(void (*)(void))log_metrics, METH_FASTCALL | METH_KEYWORDS,
     "log_metrics(step=None, **metrics)\n--\n\n"
     "Record numeric metrics (loss=..., accuracy=...) at ``step``; rank 0's are charted."},
    {"take", take, METH_NOARGS, "The rows logged since the last take, as bytes of doubles."},
    {"pending", pending, METH_NOARGS, "How many rows wait for a take."},
    {"enable", enable, METH_VARARGS, "enable(on, limit, wait_for_flush, gap, next_step)"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module_def = {PyModuleDef_HEAD_INIT, "hvdmagic._rowlog", NULL, -1, methods, NULL, NULL, NULL, NULL};

PyMODINIT_FUNC PyInit__rowlog(void) {
    if (!STEP && !(STEP = PyUnicode_InternFromString("step"))) return NULL;
    return PyModule_Create(&module_def);
}
