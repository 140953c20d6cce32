/* A native front end of smddp's C function table (smddp/engine/capi.h), for the tests: what the C++
 * c10d backend does, in C and nothing else (the header alone, the capsule, no smddp code linked). */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <pthread.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "capi.h"

/* The table in `capsule`, its version and size checked (NULL and an exception otherwise). */
static const smddp_capi* table_of(PyObject* capsule) {
  const smddp_capi* t = (const smddp_capi*)PyCapsule_GetPointer(capsule, SMDDP_CAPI_CAPSULE);
  if (t == NULL) return NULL;
  if (t->version != SMDDP_CAPI_VERSION || t->size < sizeof(smddp_capi)) {
    PyErr_Format(PyExc_RuntimeError, "smddp's C table is version %u (%u bytes); this probe was built for %u (%zu)",
                 t->version, t->size, SMDDP_CAPI_VERSION, sizeof(smddp_capi));
    return NULL;
  }
  return t;
}

/* Callbacks counted down under a lock; a waiter sleeps on the condition. */
typedef struct {
  pthread_mutex_t mu;
  pthread_cond_t cv;
  int left;
  int* statuses; /* by index */
  smddp_work** works;
  int n;
  int twice; /* a callback that came for a work already called back (never allowed) */
} Latch;

static void latch_init(Latch* l, int n, int* statuses, smddp_work** works) {
  pthread_mutex_init(&l->mu, NULL);
  pthread_cond_init(&l->cv, NULL);
  l->left = n;
  l->statuses = statuses;
  l->works = works;
  l->n = n;
  l->twice = 0;
}

static void on_done(void* arg, smddp_work* w, int status) {
  Latch* l = (Latch*)arg;
  pthread_mutex_lock(&l->mu);
  for (int i = 0; i < l->n; i++) {
    if (l->works[i] != w) continue;
    if (l->statuses[i] != -1) l->twice++;
    l->statuses[i] = status;
    break;
  }
  l->left--;
  pthread_cond_broadcast(&l->cv);
  pthread_mutex_unlock(&l->mu);
}

/* Until every callback came, or `timeout_s` passed: whether they all came. */
static int latch_wait(Latch* l, double timeout_s) {
  struct timespec until;
  clock_gettime(CLOCK_REALTIME, &until);
  until.tv_sec += (time_t)timeout_s;
  until.tv_nsec += (long)((timeout_s - (double)(time_t)timeout_s) * 1e9);
  if (until.tv_nsec >= 1000000000L) {
    until.tv_sec++;
    until.tv_nsec -= 1000000000L;
  }
  pthread_mutex_lock(&l->mu);
  int rc = 0;
  while (l->left > 0 && rc == 0) rc = pthread_cond_timedwait(&l->cv, &l->mu, &until);
  const int all = l->left == 0;
  pthread_mutex_unlock(&l->mu);
  return all;
}

/* info(capsule) -> (version, size, rank, world) */
static PyObject* info(PyObject* self, PyObject* args) {
  (void)self;
  PyObject* capsule;
  if (!PyArg_ParseTuple(args, "O", &capsule)) return NULL;
  const smddp_capi* t = table_of(capsule);
  if (t == NULL) return NULL;
  return Py_BuildValue("(IIII)", t->version, t->size, t->rank, t->world);
}

/* run(capsule, kind, dtype, op, root, src, dst, count, mode, timeout_s) -> (status, why, error_class, first)
 * One collective of the caller's buffers (addresses, 0 for none), completed by
 * mode 0: wait(); 1: its done callback (waited for here); 2: both at once; 3: a wait of 50 ms first
 * (`first`, its status: PENDING when the others are late), then wait(); 4: a wait of 50 ms, then
 * abandon() with class "CollectiveTimeoutError" and text "capi_probe gave up" (`first`: what abandon
 * returned), then wait(). A start that fails gives its status and text, error class "". */
static PyObject* run(PyObject* self, PyObject* args) {
  (void)self;
  PyObject* capsule;
  unsigned kind, dtype, op, root;
  unsigned long long src, dst, count;
  int mode;
  double timeout_s;
  if (!PyArg_ParseTuple(args, "OIIIIKKKid", &capsule, &kind, &dtype, &op, &root, &src, &dst, &count, &mode,
                        &timeout_s))
    return NULL;
  const smddp_capi* t = table_of(capsule);
  if (t == NULL) return NULL;
  smddp_collective c;
  memset(&c, 0, sizeof c);
  c.kind = (uint8_t)kind;
  c.dtype = (uint8_t)dtype;
  c.op = (uint8_t)op;
  c.root = root;
  c.src = (const void*)(uintptr_t)src;
  c.dst = (void*)(uintptr_t)dst;
  c.count = count;
  char why[512];
  smddp_work* w = NULL;
  int status, statuses[1] = {-1}, came = 1, twice = 0, first = -1;
  Py_BEGIN_ALLOW_THREADS;
  status = t->start(t->ctx, &c, &w, why, sizeof why);
  if (status == SMDDP_OK) {
    Latch l;
    latch_init(&l, 1, statuses, &w);
    if ((mode == 1 || mode == 2) && t->on_done(w, on_done, &l) != SMDDP_OK) status = -2;
    if (mode == 3) first = t->wait(w, 0.05);
    if (mode == 4 && t->wait(w, 0.05) == SMDDP_PENDING)
      first = t->abandon(w, "CollectiveTimeoutError", "capi_probe gave up");
    if (status == SMDDP_OK && mode != 1) status = t->wait(w, timeout_s);
    if (status != -2 && (mode == 1 || mode == 2)) {
      came = latch_wait(&l, timeout_s);
      if (mode == 1 && came) status = statuses[0];
      if (mode == 2 && came && statuses[0] != status && status != SMDDP_PENDING) status = -3;
    }
    twice = l.twice;
    if (!came) {
      /* The callback may still come: the latch must outlive it. A test that gets here fails. */
      status = -4;
    }
    snprintf(why, sizeof why, "%s", t->why(w));
  }
  Py_END_ALLOW_THREADS;
  if (status == -4) {
    PyErr_SetString(PyExc_RuntimeError, "capi_probe: the done callback did not come in time");
    return NULL; /* (the latch and work leak: the callback may still reach them) */
  }
  if (twice) {
    PyErr_SetString(PyExc_RuntimeError, "capi_probe: a work was called back twice");
    return NULL;
  }
  if (status == -2 || status == -3) {
    PyErr_SetString(PyExc_RuntimeError, status == -2 ? "capi_probe: on_done refused"
                                                     : "capi_probe: the callback and wait() disagree");
    return NULL;
  }
  PyObject* r;
  if (w != NULL) {
    r = Py_BuildValue("(issi)", status, why, t->error_class(w), mode == 3 || mode == 4 ? first : status);
    t->release(w);
  } else {
    r = Py_BuildValue("(issi)", status, why, "", status);
  }
  return r;
}

/* Polls device_query(w) (a 1 ms nap between looks) until it is not PENDING or `timeout_s` passed. */
static int query_until(const smddp_capi* t, smddp_work* w, double timeout_s) {
  int q = t->device_query(w);
  for (long i = 0; q == SMDDP_PENDING && i < (long)(timeout_s * 1000); i++) {
    struct timespec nap = {0, 1000000L};
    nanosleep(&nap, NULL);
    q = t->device_query(w);
  }
  return q;
}

/* device_run(capsule, dtype, op, src, dst, count, device, stream, flags, mode, order_stream, timeout_s,
 *            snap, snap_src, snap_bytes, kind, root)
 *   -> (status, why, error_class, query_at_completion, order, query_at_end)
 * One device collective through start_device (of `kind`, an all-reduce unless given; `root` a
 * broadcast's; `src`, `dst` device addresses; `stream` the caller's;
 * `flags` SMDDP_DEVICE_IN_LINE or 0), completed by mode 0: wait(); 1: its done callback alone. Then:
 * where `snap` is not 0, `snap_bytes` from `snap_src` (the host memory behind `dst`: the stand-in
 * runtime's device memory is host memory) copied into it at once (what a reader that waited for
 * completion alone would read), then
 * device_query (PENDING while its copies back have not landed), device_order(order_stream)
 * where order_stream is not 0 and it completed (else -1), and device_query polled until it is not
 * PENDING (the buffers are the caller's again). A start that fails gives its status and text, error
 * class "", and -1 for the rest. */
static PyObject* device_run(PyObject* self, PyObject* args) {
  (void)self;
  PyObject* capsule;
  unsigned dtype, op, flags;
  unsigned long long src, dst, count, stream, order_stream, snap = 0, snap_src = 0, snap_bytes = 0;
  unsigned kind = SMDDP_ALLREDUCE, root = 0;
  int device, mode;
  double timeout_s;
  if (!PyArg_ParseTuple(args, "OIIKKKiKIiKd|KKKII", &capsule, &dtype, &op, &src, &dst, &count, &device, &stream,
                        &flags, &mode, &order_stream, &timeout_s, &snap, &snap_src, &snap_bytes, &kind, &root))
    return NULL;
  const smddp_capi* t = table_of(capsule);
  if (t == NULL) return NULL;
  if (t->size < offsetof(smddp_capi, device_query) + sizeof t->device_query) {
    PyErr_SetString(PyExc_RuntimeError, "capi_probe: smddp's C table has no device route");
    return NULL;
  }
  smddp_collective c;
  memset(&c, 0, sizeof c);
  c.kind = (uint8_t)kind;
  c.dtype = (uint8_t)dtype;
  c.op = (uint8_t)op;
  c.root = root;
  c.src = (const void*)(uintptr_t)src;
  c.dst = (void*)(uintptr_t)dst;
  c.count = count;
  smddp_device_call d;
  memset(&d, 0, sizeof d);
  d.device = device;
  d.flags = flags;
  d.stream = (uintptr_t)stream;
  char why[512];
  smddp_work* w = NULL;
  int status, statuses[1] = {-1}, came = 1, twice = 0, first = -1, order = -1, last = -1;
  Py_BEGIN_ALLOW_THREADS;
  status = t->start_device(t->ctx, &c, &d, &w, why, sizeof why);
  if (status == SMDDP_OK) {
    Latch l;
    latch_init(&l, 1, statuses, &w);
    if (mode == 1) {
      if (t->on_done(w, on_done, &l) != SMDDP_OK) status = -2;
      came = status == -2 || latch_wait(&l, timeout_s);
      if (status != -2 && came) status = statuses[0];
    } else {
      status = t->wait(w, timeout_s);
    }
    twice = l.twice;
    if (!came) status = -4; /* (the callback may still come: the latch must outlive it) */
    if (status >= 0) {
      if (snap != 0 && snap_src != 0 && snap_bytes > 0)
        memcpy((void*)(uintptr_t)snap, (const void*)(uintptr_t)snap_src, (size_t)snap_bytes);
      first = t->device_query(w);
      if (status == SMDDP_OK && order_stream != 0) order = t->device_order(w, (uintptr_t)order_stream, why, sizeof why);
      last = query_until(t, w, timeout_s);
      if (order != SMDDP_FAILED) snprintf(why, sizeof why, "%s", t->why(w));
    }
  }
  Py_END_ALLOW_THREADS;
  if (status == -4) {
    PyErr_SetString(PyExc_RuntimeError, "capi_probe: the done callback did not come in time");
    return NULL; /* (the latch and work leak: the callback may still reach them) */
  }
  if (twice || status == -2) {
    PyErr_SetString(PyExc_RuntimeError, twice ? "capi_probe: a work was called back twice" : "capi_probe: on_done refused");
    return NULL;
  }
  PyObject* r = Py_BuildValue("(issiii)", status, why, w != NULL ? t->error_class(w) : "", first, order, last);
  if (w != NULL) t->release(w);
  return r;
}

/* allreduce_many(capsule, dtype, op, base, count, n, timeout_s) -> list of statuses
 * `n` all-reduces in place in flight at once, buffer i at base + i * count * itemsize (the caller
 * sized them), all started, then each completed by its done callback alone. */
static PyObject* allreduce_many(PyObject* self, PyObject* args) {
  (void)self;
  PyObject* capsule;
  unsigned dtype, op, itemsize;
  unsigned long long base, count;
  int n;
  double timeout_s;
  if (!PyArg_ParseTuple(args, "OIIIKKid", &capsule, &dtype, &op, &itemsize, &base, &count, &n, &timeout_s))
    return NULL;
  const smddp_capi* t = table_of(capsule);
  if (t == NULL) return NULL;
  if (n <= 0 || n > 100000) {
    PyErr_SetString(PyExc_ValueError, "n is 1 to 100000");
    return NULL;
  }
  int* statuses = (int*)malloc(sizeof(int) * (size_t)n);
  smddp_work** works = (smddp_work**)calloc((size_t)n, sizeof(smddp_work*));
  Latch* l = (Latch*)malloc(sizeof(Latch));
  if (statuses == NULL || works == NULL || l == NULL) {
    free(statuses);
    free(works);
    free(l);
    return PyErr_NoMemory();
  }
  for (int i = 0; i < n; i++) statuses[i] = -1;
  latch_init(l, n, statuses, works);
  char why[512] = "";
  int started = 0, refused = SMDDP_OK, came, twice;
  Py_BEGIN_ALLOW_THREADS;
  for (int i = 0; i < n; i++) {
    smddp_collective c;
    memset(&c, 0, sizeof c);
    c.kind = SMDDP_ALLREDUCE;
    c.dtype = (uint8_t)dtype;
    c.op = (uint8_t)op;
    void* buf = (void*)(uintptr_t)(base + (unsigned long long)i * count * itemsize);
    c.src = buf;
    c.dst = buf;
    c.count = count;
    refused = t->start(t->ctx, &c, &works[i], why, sizeof why);
    if (refused != SMDDP_OK) break;
    started++;
  }
  /* (the ones never started count down at once) */
  pthread_mutex_lock(&l->mu);
  l->left -= n - started;
  pthread_mutex_unlock(&l->mu);
  for (int i = 0; i < started; i++)
    if (t->on_done(works[i], on_done, l) != SMDDP_OK) refused = -2;
  came = latch_wait(l, timeout_s);
  twice = l->twice;
  Py_END_ALLOW_THREADS;
  if (!came) {
    PyErr_SetString(PyExc_RuntimeError, "capi_probe: not every done callback came in time");
    return NULL; /* (leaks: the callbacks may still come) */
  }
  PyObject* out = NULL;
  if (twice) {
    PyErr_SetString(PyExc_RuntimeError, "capi_probe: a work was called back twice");
  } else if (refused != SMDDP_OK) {
    PyErr_Format(PyExc_RuntimeError, "capi_probe: start or on_done refused (%d): %s", refused, why);
  } else {
    out = PyList_New(n);
    for (int i = 0; out != NULL && i < n; i++) PyList_SET_ITEM(out, i, PyLong_FromLong(statuses[i]));
  }
  for (int i = 0; i < started; i++) t->release(works[i]);
  free(statuses);
  free(works);
  free(l);
  return out;
}

static PyMethodDef kMethods[] = {
    {"info", info, METH_VARARGS, "info(capsule) -> (version, size, rank, world)"},
    {"run", run, METH_VARARGS,
     "run(capsule, kind, dtype, op, root, src, dst, count, mode, timeout_s) -> (status, why, error_class, first)"},
    {"device_run", device_run, METH_VARARGS,
     "device_run(capsule, dtype, op, src, dst, count, device, stream, flags, mode, order_stream, timeout_s, "
     "snap=0, snap_src=0, snap_bytes=0, kind=1, root=0) -> "
     "(status, why, error_class, query_at_completion, order, query_at_end)"},
    {"allreduce_many", allreduce_many, METH_VARARGS,
     "allreduce_many(capsule, dtype, op, itemsize, base, count, n, timeout_s) -> statuses"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef kModule = {PyModuleDef_HEAD_INIT, "smddp_rigs._capi_probe",
                                     "A C front end of smddp's C function table, for the tests.", -1, kMethods,
                                     NULL, NULL, NULL, NULL};

PyMODINIT_FUNC PyInit__capi_probe(void) { return PyModule_Create(&kModule); }
