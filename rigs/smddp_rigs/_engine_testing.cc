// smddp_rigs._engine_testing: the engine's parts as only tests and rigs call them, never shipped.
//
// The same engine sources as smddp._engine (smddp/engine/), bound here for the tests that drive them
// without processes (the header codec, the layouts, the kernels, the collective state machine, the
// daemon's table) and for a stand-in daemon's end of a worker's rings (DaemonChannel). The wheel's
// smddp._engine (module.cc) binds only what smddp runs. Shared helpers: smddp/engine/binding.h.
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <unistd.h>

#include <cstdint>
#include <cstring>
#include <initializer_list>
#include <map>
#include <memory>
#include <mutex>
#include <new>
#include <string>
#include <vector>

#include "arena.h"
#include "binding.h"
#include "channel.h"
#include "collective.h"
#include "fdpass.h"
#include "frame.h"
#include "layout.h"
#include "node_state.h"
#include "reduce.h"
#include "reduce16.h"
#include "ring.h"

namespace {

using namespace smddp::py;

struct ModuleState {
  Errors errors;              // first (binding.h): smddp.errors' classes, owned by the module
  PyObject* collective_type;  // the Collective class
  PyObject* node_state_type;  // the NodeState class
  PyObject* daemon_channel_type;  // the DaemonChannel class
};

ModuleState* state(PyObject* module) { return static_cast<ModuleState*>(PyModule_GetState(module)); }

// locate_reduce(count, itemsize, nshards, chunk_elems, shard, byte_offset, byte_length) -> (index, start, end)
PyObject* py_locate_reduce(PyObject* module, PyObject* args) {
  long long count = 0, itemsize = 0, nshards = 0, chunk_elems = 0, shard = 0, offset = 0, length = 0;
  if (!PyArg_ParseTuple(args, "LLLLLLL", &count, &itemsize, &nshards, &chunk_elems, &shard, &offset, &length))
    return nullptr;
  if (!non_negative(module, {count, itemsize, nshards, chunk_elems, shard, offset, length})) return nullptr;
  if (nshards > static_cast<long long>(UINT32_MAX)) return raise_protocol(module, "too many shards");
  smddp::ChunkAt c;
  const std::string why = smddp::locate_reduce(
      static_cast<std::uint64_t>(count), static_cast<std::uint64_t>(itemsize), static_cast<std::uint32_t>(nshards),
      static_cast<std::uint64_t>(chunk_elems), static_cast<std::uint64_t>(shard), static_cast<std::uint64_t>(offset),
      static_cast<std::uint64_t>(length), &c);
  if (!why.empty()) return raise_protocol(module, why);
  return Py_BuildValue("(KKK)", static_cast<unsigned long long>(c.index),
                       static_cast<unsigned long long>(c.elems.start), static_cast<unsigned long long>(c.elems.end));
}

// shard_range(count, nshards, shard) -> (start, end)
PyObject* py_shard_range(PyObject* module, PyObject* args) {
  long long count = 0, nshards = 0, shard = 0;
  if (!PyArg_ParseTuple(args, "LLL", &count, &nshards, &shard)) return nullptr;
  if (!non_negative(module, {count, nshards, shard})) return nullptr;
  if (nshards == 0 || nshards > static_cast<long long>(UINT32_MAX) || shard >= nshards)
    return raise_protocol(module, "shard out of range");
  const smddp::Range r = smddp::shard_range(static_cast<std::uint64_t>(count), static_cast<std::uint32_t>(nshards),
                                            static_cast<std::uint32_t>(shard));
  return Py_BuildValue("(KK)", static_cast<unsigned long long>(r.start), static_cast<unsigned long long>(r.end));
}

// locate_block(start, end, chunk_bytes, byte_offset, byte_length) -> index
PyObject* py_locate_block(PyObject* module, PyObject* args) {
  long long start = 0, end = 0, chunk = 0, offset = 0, length = 0;
  if (!PyArg_ParseTuple(args, "LLLLL", &start, &end, &chunk, &offset, &length)) return nullptr;
  if (!non_negative(module, {start, end, chunk, offset, length})) return nullptr;
  std::uint64_t index = 0;
  const std::string why = smddp::locate_block(
      {static_cast<std::uint64_t>(start), static_cast<std::uint64_t>(end)}, static_cast<std::uint64_t>(chunk),
      static_cast<std::uint64_t>(offset), static_cast<std::uint64_t>(length), &index);
  if (!why.empty()) return raise_protocol(module, why);
  return PyLong_FromUnsignedLongLong(index);
}

constexpr Py_ssize_t kMaxInputs = 4096;

// Owns the buffers a reduce16 call reads and writes; released in the destructor, with the GIL held.
struct Views {
  std::vector<Py_buffer> views;
  ~Views() {
    for (Py_buffer& v : views) PyBuffer_Release(&v);
  }
  bool get(PyObject* obj, int flags) {
    views.emplace_back();
    if (PyObject_GetBuffer(obj, &views.back(), flags) == 0) return true;
    views.pop_back();
    return false;
  }
};

// reduce16(kind, op, inputs, out, divisor[, portable]) -> block indices left unwritten (their result
// holds a NaN): the block kernel alone, for its tests; reduce() is what the daemon runs.
// kind: 0 float16, 1 bfloat16; op: 0 sum, 1 min, 2 max; divisor 0.0 for none. Inputs and out are
// C-contiguous buffers of equally many 16-bit elements; out may alias an input element-wise.
// portable: bfloat16 by the baseline's loops where the CPU would run the AVX2 ones.
PyObject* py_reduce16(PyObject*, PyObject* args) {
  int kind = 0, op = 0, portable = 0;
  PyObject *inputs = nullptr, *out_obj = nullptr;
  float divisor = 0.0f;
  if (!PyArg_ParseTuple(args, "iiOOf|p", &kind, &op, &inputs, &out_obj, &divisor, &portable)) return nullptr;
  if (kind != 0 && kind != 1) return PyErr_Format(PyExc_ValueError, "unknown kind %d", kind);
  if (op < 0 || op > 2) return PyErr_Format(PyExc_ValueError, "unknown op %d", op);
  if (kind == 0 && !smddp::have_f16c()) return PyErr_Format(PyExc_NotImplementedError, "float16 needs a CPU with F16C");
  PyObject* seq = PySequence_Fast(inputs, "inputs must be a sequence");
  if (seq == nullptr) return nullptr;
  const Py_ssize_t k = PySequence_Size(seq);
  PyObject* result = nullptr;
  {
    Views v;
    std::vector<const std::uint16_t*> ptrs;
    std::vector<std::size_t> nan_blocks;
    if (k < 1 || k > kMaxInputs) {
      PyErr_Format(PyExc_ValueError, "between 1 and %zd inputs, not %zd", kMaxInputs, k);
    } else if (v.get(out_obj, PyBUF_C_CONTIGUOUS | PyBUF_WRITABLE)) {
      const Py_ssize_t len = v.views[0].len;
      bool ok = len % 2 == 0;
      if (!ok) PyErr_SetString(PyExc_ValueError, "out holds an odd number of bytes");
      for (Py_ssize_t j = 0; ok && j < k; j++) {
        ok = v.get(fast_item(seq, j), PyBUF_C_CONTIGUOUS);
        if (ok && v.views.back().len != len) {
          PyErr_Format(PyExc_ValueError, "input %zd holds %zd bytes, out %zd", j, v.views.back().len, len);
          ok = false;
        }
        if (ok) ptrs.push_back(static_cast<const std::uint16_t*>(v.views.back().buf));
      }
      if (ok) {
        bool oom = false;
        auto* out = static_cast<std::uint16_t*>(v.views[0].buf);
        Py_BEGIN_ALLOW_THREADS
        try {
          smddp::reduce16(static_cast<smddp::Half>(kind), static_cast<smddp::Fold>(op), ptrs.data(),
                          static_cast<std::size_t>(k), static_cast<std::size_t>(len / 2), out, divisor, &nan_blocks,
                          portable != 0);
        } catch (const std::bad_alloc&) {
          oom = true;
        }
        Py_END_ALLOW_THREADS
        if (oom) {
          PyErr_NoMemory();
        } else {
          result = PyList_New(static_cast<Py_ssize_t>(nan_blocks.size()));
          for (std::size_t i = 0; result != nullptr && i < nan_blocks.size(); i++) {
            PyObject* b = PyLong_FromSize_t(nan_blocks[i]);
            if (b == nullptr) {
              Py_CLEAR(result);
              break;
            }
            PyList_SetItem(result, static_cast<Py_ssize_t>(i), b);
          }
        }
      }
    }
  }
  Py_DECREF(seq);
  return result;
}

// reduce(dtype, op, inputs, out, divisor) -> None: the daemon's kernel (reduce_wire) for any wire
// dtype and op. Inputs and out are C-contiguous buffers of equally many bytes, a multiple of the
// itemsize; out may alias an input element-wise. divisor: 0 for none (a plain sum for an average).
PyObject* py_reduce(PyObject*, PyObject* args) {
  int dtype = 0, op = 0;
  PyObject *inputs = nullptr, *out_obj = nullptr;
  unsigned long long divisor = 0;
  if (!PyArg_ParseTuple(args, "iiOOK", &dtype, &op, &inputs, &out_obj, &divisor)) return nullptr;
  if (dtype < 0 || dtype > 255 || smddp::dtype_size(static_cast<std::uint8_t>(dtype)) == 0)
    return PyErr_Format(PyExc_ValueError, "dtype %d is not a wire dtype", dtype);
  if (op < 1 || op > 4) return PyErr_Format(PyExc_ValueError, "unknown op %d", op);
  const std::size_t size = smddp::dtype_size(static_cast<std::uint8_t>(dtype));
  PyObject* seq = PySequence_Fast(inputs, "inputs must be a sequence");
  if (seq == nullptr) return nullptr;
  const Py_ssize_t k = PySequence_Size(seq);
  bool ok = false;
  {
    Views v;
    std::vector<const void*> ptrs;
    if (k < 1 || k > kMaxInputs) {
      PyErr_Format(PyExc_ValueError, "between 1 and %zd inputs, not %zd", kMaxInputs, k);
    } else if (v.get(out_obj, PyBUF_C_CONTIGUOUS | PyBUF_WRITABLE)) {
      const Py_ssize_t len = v.views[0].len;
      ok = len % static_cast<Py_ssize_t>(size) == 0;
      if (!ok) PyErr_Format(PyExc_ValueError, "out holds %zd bytes, not whole elements of %zu", len, size);
      for (Py_ssize_t j = 0; ok && j < k; j++) {
        ok = v.get(fast_item(seq, j), PyBUF_C_CONTIGUOUS);
        if (ok && v.views.back().len != len) {
          PyErr_Format(PyExc_ValueError, "input %zd holds %zd bytes, out %zd", j, v.views.back().len, len);
          ok = false;
        }
        if (ok) ptrs.push_back(v.views.back().buf);
      }
      if (ok) {
        void* out = v.views[0].buf;
        const std::size_t n = static_cast<std::size_t>(len) / size;
        std::string why;
        Py_BEGIN_ALLOW_THREADS
        try {
          why = smddp::reduce_wire(static_cast<std::uint8_t>(dtype), static_cast<std::uint8_t>(op), ptrs.data(),
                                   static_cast<std::size_t>(k), n, out, divisor);
        } catch (const std::bad_alloc&) {
          why = "out of memory";
        }
        Py_END_ALLOW_THREADS
        if (!why.empty()) {
          PyErr_SetString(PyExc_ValueError, why.c_str());
          ok = false;
        }
      }
    }
  }
  Py_DECREF(seq);
  if (!ok) return nullptr;
  Py_RETURN_NONE;
}

// ---------------------------------------------------------------------------------------- Collective

// A Python object holding one smddp::Collective, shared with the NodeState whose table holds it
// (made by Collective() or handed out by NodeState; the last holder deletes it). Its methods hold
// the GIL throughout: each is a few comparisons, never a wait.
struct CollectiveObject {
  PyObject_HEAD
  std::shared_ptr<smddp::Collective>* c;  // new'd with the object, deleted in tp_dealloc
};


smddp::Collective& coll(PyObject* self) { return **reinterpret_cast<CollectiveObject*>(self)->c; }

// A new Python Collective sharing `c`.
PyObject* wrap_collective(PyObject* module, const std::shared_ptr<smddp::Collective>& c) {
  auto* type = reinterpret_cast<PyTypeObject*>(state(module)->collective_type);
  PyObject* self = alloc_instance(type);
  if (self == nullptr) return nullptr;
  try {
    reinterpret_cast<CollectiveObject*>(self)->c = new std::shared_ptr<smddp::Collective>(c);
  } catch (const std::bad_alloc&) {
    Py_DECREF(self);
    return PyErr_NoMemory();
  }
  return self;
}


PyObject* chunk_tuple(const smddp::Chunk& c) {
  return Py_BuildValue("(KKK)", static_cast<unsigned long long>(c.index), static_cast<unsigned long long>(c.start),
                       static_cast<unsigned long long>(c.end));
}


// Collective(who, seq, kind, itemsize, widened, count, has_op, root,
//            node, nnodes, local_size, world, chunk_bytes, replicate_bytes)
PyObject* collective_new(PyTypeObject* type, PyObject* args, PyObject* kwargs) {
  PyObject* who_obj = nullptr;
  long long seq = 0, kind = 0, itemsize = 0, count = 0, root = 0, node = 0, nnodes = 0, local_size = 0, world = 0,
            chunk_bytes = 0, replicate_bytes = 0;
  int widened = 0, has_op = 0;
  static const char* kw[] = {"who", "seq", "kind", "itemsize", "widened", "count", "has_op", "root", "node",
                             "nnodes", "local_size", "world", "chunk_bytes", "replicate_bytes", nullptr};
  if (!PyArg_ParseTupleAndKeywords(args, kwargs, "ULLLpLpLLLLLLL", const_cast<char**>(kw), &who_obj, &seq, &kind,
                                   &itemsize, &widened, &count, &has_op, &root, &node, &nnodes, &local_size, &world,
                                   &chunk_bytes, &replicate_bytes))
    return nullptr;
  PyObject* module = PyType_GetModule(type);
  if (!non_negative(module, {seq, kind, itemsize, count, root, node, nnodes, local_size, world, chunk_bytes,
                             replicate_bytes}))
    return nullptr;
  for (long long v : {kind, itemsize, root, node, nnodes, local_size, world})
    if (v > static_cast<long long>(UINT32_MAX)) return raise_protocol(module, "out of range: a field over 32 bits");
  smddp::Spec spec;
  spec.seq = static_cast<std::uint64_t>(seq);
  spec.kind = kind > 255 ? 0 : static_cast<std::uint8_t>(kind);
  spec.itemsize = static_cast<std::uint32_t>(itemsize);
  spec.widened = widened != 0;
  spec.count = static_cast<std::uint64_t>(count);
  spec.has_op = has_op != 0;
  spec.root = static_cast<std::uint32_t>(root);
  smddp::Topology topo;
  topo.node = static_cast<std::uint32_t>(node);
  topo.nnodes = static_cast<std::uint32_t>(nnodes);
  topo.local_size = static_cast<std::uint32_t>(local_size);
  topo.world = static_cast<std::uint32_t>(world);
  topo.chunk_bytes = static_cast<std::uint64_t>(chunk_bytes);
  topo.replicate_bytes = static_cast<std::uint64_t>(replicate_bytes);
  std::string who;
  if (!text(who_obj, &who)) return nullptr;
  const std::string why = smddp::Collective::check(spec, topo);
  if (!why.empty()) return raise_protocol(module, who + ": " + why);
  PyObject* self = alloc_instance(type);
  if (self == nullptr) return nullptr;
  try {
    reinterpret_cast<CollectiveObject*>(self)->c =
        new std::shared_ptr<smddp::Collective>(std::make_shared<smddp::Collective>(spec, topo));
  } catch (const std::bad_alloc&) {
    Py_DECREF(self);
    return PyErr_NoMemory();
  }
  return self;
}


constexpr void (*collective_dealloc)(PyObject*) = &dealloc_owner<CollectiveObject, &CollectiveObject::c>;

// A Collective's step taken by (local_rank, who): the bool it answers, or ProtocolError naming why not.
template <typename Step>
PyObject* local_step(PyObject* self, PyObject* args, Step step) {
  long long local = 0;
  PyObject* who_obj = nullptr;
  std::string who;
  if (!PyArg_ParseTuple(args, "LU", &local, &who_obj) || !text(who_obj, &who)) return nullptr;
  if (local < 0 || local > static_cast<long long>(UINT32_MAX)) return raise_from(self, who + " is not a local rank");
  bool answer = false;
  const std::string why = step(coll(self), static_cast<std::uint32_t>(local), who, &answer);
  if (!why.empty()) return raise_from(self, why);
  return PyBool_FromLong(answer ? 1 : 0);
}

// submit(local_rank, who) -> whether every local rank has now submitted
PyObject* collective_submit(PyObject* self, PyObject* args) {
  return local_step(self, args, [](smddp::Collective& c, std::uint32_t local, const std::string& who, bool* all_in) {
    return c.submit(local, who, all_in);
  });
}

// local_tasks() -> [(shard, index, start, end)]
PyObject* collective_local_tasks(PyObject* self, PyObject*) {
  std::vector<smddp::Chunk> tasks;
  try {
    tasks = coll(self).local_tasks();
  } catch (const std::bad_alloc&) {
    return PyErr_NoMemory();
  }
  PyObject* list = PyList_New(static_cast<Py_ssize_t>(tasks.size()));
  for (std::size_t i = 0; list != nullptr && i < tasks.size(); i++) {
    const smddp::Chunk& c = tasks[i];
    PyObject* t = Py_BuildValue("(kKKK)", static_cast<unsigned long>(c.shard), static_cast<unsigned long long>(c.index),
                                static_cast<unsigned long long>(c.start), static_cast<unsigned long long>(c.end));
    if (t == nullptr) {
      Py_CLEAR(list);
      break;
    }
    PyList_SetItem(list, static_cast<Py_ssize_t>(i), t);
  }
  return list;
}

// The (node, shard, offset, length) of a data frame: from the wire, so checked before anything else.
bool frame_args(PyObject* self, long long from, const std::initializer_list<long long>& wire) {
  if (from < 0 || from > static_cast<long long>(UINT32_MAX)) {
    raise_from(self, "out of range: node " + std::to_string(from));
    return false;
  }
  return non_negative(module_of(self), wire);
}

// locate_partial(from, shard, offset, length, who, me) -> (index, start, end)
PyObject* collective_locate_partial(PyObject* self, PyObject* args) {
  long long from = 0, shard = 0, offset = 0, length = 0;
  PyObject *who_obj = nullptr, *me_obj = nullptr;
  std::string who, me;
  if (!PyArg_ParseTuple(args, "LLLLUU", &from, &shard, &offset, &length, &who_obj, &me_obj) || !text(who_obj, &who) ||
      !text(me_obj, &me) || !frame_args(self, from, {shard, offset, length}))
    return nullptr;
  smddp::Chunk c;
  const std::string why =
      coll(self).locate_partial(static_cast<std::uint32_t>(from), static_cast<std::uint64_t>(shard),
                                static_cast<std::uint64_t>(offset), static_cast<std::uint64_t>(length), who, me, &c);
  if (!why.empty()) return raise_from(self, why);
  return chunk_tuple(c);
}

// partial_arrived(index, from, who) -> whether every node's partial of that chunk is in
PyObject* collective_partial_arrived(PyObject* self, PyObject* args) {
  long long index = 0, from = 0;
  PyObject* who_obj = nullptr;
  std::string who;
  if (!PyArg_ParseTuple(args, "LLU", &index, &from, &who_obj) || !text(who_obj, &who) ||
      !frame_args(self, from, {index}))
    return nullptr;
  bool ready = false;
  const std::string why =
      coll(self).partial_arrived(static_cast<std::uint64_t>(index), static_cast<std::uint32_t>(from), who, &ready);
  if (!why.empty()) return raise_from(self, why);
  return PyBool_FromLong(ready ? 1 : 0);
}

// locate_result(from, shard, offset, length, who) -> (index, start, end), marked as arriving
PyObject* collective_locate_result(PyObject* self, PyObject* args) {
  long long from = 0, shard = 0, offset = 0, length = 0;
  PyObject* who_obj = nullptr;
  std::string who;
  if (!PyArg_ParseTuple(args, "LLLLU", &from, &shard, &offset, &length, &who_obj) || !text(who_obj, &who) ||
      !frame_args(self, from, {shard, offset, length}))
    return nullptr;
  smddp::Chunk c;
  std::string why;
  try {
    why = coll(self).locate_result(static_cast<std::uint32_t>(from), static_cast<std::uint64_t>(shard),
                                   static_cast<std::uint64_t>(offset), static_cast<std::uint64_t>(length), who, &c);
  } catch (const std::bad_alloc&) {
    return PyErr_NoMemory();
  }
  if (!why.empty()) return raise_from(self, why);
  return chunk_tuple(c);
}

// locate_block(from, offset, length, who) -> (index, start, end) in bytes, marked as arriving
PyObject* collective_locate_block(PyObject* self, PyObject* args) {
  long long from = 0, offset = 0, length = 0;
  PyObject* who_obj = nullptr;
  std::string who;
  if (!PyArg_ParseTuple(args, "LLLU", &from, &offset, &length, &who_obj) || !text(who_obj, &who) ||
      !frame_args(self, from, {offset, length}))
    return nullptr;
  smddp::Chunk c;
  std::string why;
  try {
    why = coll(self).locate_block(static_cast<std::uint32_t>(from), static_cast<std::uint64_t>(offset),
                                  static_cast<std::uint64_t>(length), who, &c);
  } catch (const std::bad_alloc&) {
    return PyErr_NoMemory();
  }
  if (!why.empty()) return raise_from(self, why);
  return chunk_tuple(c);
}

// own_chunk(index) -> (shard, index, start, end) of what this node serves
PyObject* collective_own_chunk(PyObject* self, PyObject* arg) {
  const long long i = PyLong_AsLongLong(arg);
  if (i == -1 && PyErr_Occurred()) return nullptr;
  if (i < 0 || static_cast<unsigned long long>(i) >= coll(self).own_chunks())
    return raise_from(self, "chunk " + std::to_string(i) + " is not one this node serves");
  const smddp::Chunk c = coll(self).own_chunk(static_cast<std::uint64_t>(i));
  return Py_BuildValue("(kKKK)", static_cast<unsigned long>(c.shard), static_cast<unsigned long long>(c.index),
                       static_cast<unsigned long long>(c.start), static_cast<unsigned long long>(c.end));
}

PyObject* collective_chunk_completed(PyObject* self, PyObject*) {
  return PyBool_FromLong(coll(self).chunk_completed() ? 1 : 0);
}

PyObject* collective_send_started(PyObject* self, PyObject*) {
  coll(self).send_started();
  Py_RETURN_NONE;
}

PyObject* collective_send_finished(PyObject* self, PyObject*) {
  return PyBool_FromLong(coll(self).send_finished() ? 1 : 0);
}

// release(local_rank, who) -> whether the collective may now retire
PyObject* collective_release(PyObject* self, PyObject* args) {
  return local_step(self, args, [](smddp::Collective& c, std::uint32_t local, const std::string& who, bool* retire) {
    return c.release(local, who, retire);
  });
}

PyObject* collective_lacks_from(PyObject* self, PyObject* arg) {
  const long long j = PyLong_AsLongLong(arg);
  if (j == -1 && PyErr_Occurred()) return nullptr;
  if (j < 0 || j > static_cast<long long>(UINT32_MAX)) return PyBool_FromLong(0);
  return PyBool_FromLong(coll(self).lacks_from(static_cast<std::uint32_t>(j)) ? 1 : 0);
}

PyObject* collective_submitted_by(PyObject* self, PyObject* arg) {
  const long long i = PyLong_AsLongLong(arg);
  if (i == -1 && PyErr_Occurred()) return nullptr;
  if (i < 0 || i > static_cast<long long>(UINT32_MAX)) return PyBool_FromLong(0);
  return PyBool_FromLong(coll(self).submitted_by(static_cast<std::uint32_t>(i)) ? 1 : 0);
}

PyObject* collective_late_nodes(PyObject* self, PyObject*) {
  const std::vector<std::uint32_t> late = coll(self).late_nodes();
  PyObject* list = PyList_New(static_cast<Py_ssize_t>(late.size()));
  for (std::size_t i = 0; list != nullptr && i < late.size(); i++) {
    PyObject* v = PyLong_FromUnsignedLong(late[i]);
    if (v == nullptr) {
      Py_CLEAR(list);
      break;
    }
    PyList_SetItem(list, static_cast<Py_ssize_t>(i), v);
  }
  return list;
}

PyObject* get_replicated(PyObject* self, void*) { return PyBool_FromLong(coll(self).replicated() ? 1 : 0); }
PyObject* get_own_in_input(PyObject* self, void*) { return PyBool_FromLong(coll(self).own_in_input() ? 1 : 0); }
PyObject* get_is_gather(PyObject* self, void*) { return PyBool_FromLong(coll(self).is_gather() ? 1 : 0); }
PyObject* get_done(PyObject* self, void*) { return PyBool_FromLong(coll(self).done() ? 1 : 0); }
PyObject* get_may_retire(PyObject* self, void*) { return PyBool_FromLong(coll(self).may_retire() ? 1 : 0); }
PyObject* get_server_live(PyObject* self, void*) { return PyBool_FromLong(coll(self).server_live() ? 1 : 0); }
PyObject* get_submitted(PyObject* self, void*) { return PyLong_FromUnsignedLong(coll(self).submitted()); }
PyObject* get_server_rows(PyObject* self, void*) { return PyLong_FromUnsignedLong(coll(self).server_rows()); }
PyObject* get_result_bytes(PyObject* self, void*) {
  return PyLong_FromUnsignedLongLong(coll(self).result_bytes());
}
PyObject* get_own_range(PyObject* self, void*) {
  const smddp::Range r = coll(self).own_range();
  return Py_BuildValue("(KK)", static_cast<unsigned long long>(r.start), static_cast<unsigned long long>(r.end));
}

PyMethodDef kCollectiveMethods[] = {
    {"submit", collective_submit, METH_VARARGS, "submit(local_rank, who) -> every local rank is in"},
    {"local_tasks", collective_local_tasks, METH_NOARGS, "local_tasks() -> [(shard, index, start, end)]"},
    {"locate_partial", collective_locate_partial, METH_VARARGS,
     "locate_partial(from, shard, offset, length, who, me) -> (index, start, end)"},
    {"partial_arrived", collective_partial_arrived, METH_VARARGS,
     "partial_arrived(index, from, who) -> every node's partial of the chunk is in"},
    {"locate_result", collective_locate_result, METH_VARARGS,
     "locate_result(from, shard, offset, length, who) -> (index, start, end)"},
    {"locate_block", collective_locate_block, METH_VARARGS,
     "locate_block(from, offset, length, who) -> (index, start, end)"},
    {"own_chunk", collective_own_chunk, METH_O, "own_chunk(index) -> (shard, index, start, end)"},
    {"chunk_completed", collective_chunk_completed, METH_NOARGS, "chunk_completed() -> it just became done"},
    {"send_started", collective_send_started, METH_NOARGS, "send_started()"},
    {"send_finished", collective_send_finished, METH_NOARGS, "send_finished() -> it may now retire"},
    {"release", collective_release, METH_VARARGS, "release(local_rank, who) -> it may now retire"},
    {"lacks_from", collective_lacks_from, METH_O, "lacks_from(node) -> a frame from that node is still due"},
    {"submitted_by", collective_submitted_by, METH_O, "submitted_by(local_rank) -> that rank submitted"},
    {"late_nodes", collective_late_nodes, METH_NOARGS, "late_nodes() -> nodes whose part is missing"},
    {nullptr, nullptr, 0, nullptr},
};

PyGetSetDef kCollectiveGetters[] = {
    {"replicated", get_replicated, nullptr, "every node serves the whole buffer (one network step)", nullptr},
    {"own_in_input", get_own_in_input, nullptr, "the one local input is the node partial as it is", nullptr},
    {"is_gather", get_is_gather, nullptr, "a broadcast or all-gather", nullptr},
    {"done", get_done, nullptr, "every chunk is complete", nullptr},
    {"may_retire", get_may_retire, nullptr, "done, released by every local rank, every send left", nullptr},
    {"server_live", get_server_live, nullptr, "its server rows are still in use", nullptr},
    {"submitted", get_submitted, nullptr, "how many local ranks submitted", nullptr},
    {"server_rows", get_server_rows, nullptr, "rows of own_range() held for every node's partial (0: none)",
     nullptr},
    {"result_bytes", get_result_bytes, nullptr, "bytes of the result every local rank reads", nullptr},
    {"own_range", get_own_range, nullptr, "(start, end): the elements (or block bytes) this node serves", nullptr},
    {nullptr, nullptr, nullptr, nullptr, nullptr},
};

PyType_Slot kCollectiveSlots[] = {
    {Py_tp_new, reinterpret_cast<void*>(collective_new)},
    {Py_tp_dealloc, reinterpret_cast<void*>(collective_dealloc)},
    {Py_tp_methods, kCollectiveMethods},
    {Py_tp_getset, kCollectiveGetters},
    {Py_tp_doc, const_cast<char*>("One collective as a daemon sees it: the state machine without I/O "
                                  "(smddp/engine/collective.h).")},
    {0, nullptr},
};

PyType_Spec kCollectiveSpec = {
    "smddp_rigs._engine_testing.Collective",
    sizeof(CollectiveObject),
    0,
    Py_TPFLAGS_DEFAULT | Py_TPFLAGS_IMMUTABLETYPE,
    kCollectiveSlots,
};

// ---------------------------------------------------------------------------------------- NodeState

// A Python object holding the daemon's smddp::NodeState, which it owns alone. Methods hold the GIL
// (the daemon calls them under its own lock); none waits.
struct NodeStateObject {
  PyObject_HEAD
  smddp::NodeState* s;
};

smddp::NodeState& table(PyObject* self) { return *reinterpret_cast<NodeStateObject*>(self)->s; }



// NodeState(node, nnodes, local_size, world, chunk_bytes, replicate_bytes, node_names, rank_names)
PyObject* node_state_new(PyTypeObject* type, PyObject* args, PyObject* kwargs) {
  long long node = 0, nnodes = 0, local_size = 0, world = 0, chunk_bytes = 0, replicate_bytes = 0;
  PyObject *node_names_obj = nullptr, *rank_names_obj = nullptr;
  static const char* kw[] = {"node", "nnodes", "local_size", "world", "chunk_bytes", "replicate_bytes",
                             "node_names", "rank_names", nullptr};
  if (!PyArg_ParseTupleAndKeywords(args, kwargs, "LLLLLLOO", const_cast<char**>(kw), &node, &nnodes, &local_size,
                                   &world, &chunk_bytes, &replicate_bytes, &node_names_obj, &rank_names_obj))
    return nullptr;
  PyObject* module = PyType_GetModule(type);
  if (!non_negative(module, {node, nnodes, local_size, world, chunk_bytes, replicate_bytes})) return nullptr;
  for (long long v : {node, nnodes, local_size, world})
    if (v > static_cast<long long>(UINT32_MAX)) return raise_protocol(module, "out of range: a field over 32 bits");
  if (nnodes == 0 || local_size == 0 || node >= nnodes || world != nnodes * local_size || chunk_bytes == 0)
    return raise_protocol(module, "an impossible job layout");
  std::vector<std::string> node_names, rank_names;
  if (!strings(node_names_obj, &node_names) || !strings(rank_names_obj, &rank_names)) return nullptr;
  smddp::Topology topo;
  topo.node = static_cast<std::uint32_t>(node);
  topo.nnodes = static_cast<std::uint32_t>(nnodes);
  topo.local_size = static_cast<std::uint32_t>(local_size);
  topo.world = static_cast<std::uint32_t>(world);
  topo.chunk_bytes = static_cast<std::uint64_t>(chunk_bytes);
  topo.replicate_bytes = static_cast<std::uint64_t>(replicate_bytes);
  PyObject* self = alloc_instance(type);
  if (self == nullptr) return nullptr;
  try {
    reinterpret_cast<NodeStateObject*>(self)->s = new smddp::NodeState(topo, node_names, rank_names);
  } catch (const std::bad_alloc&) {
    Py_DECREF(self);
    return PyErr_NoMemory();
  }
  return self;
}

constexpr void (*node_state_dealloc)(PyObject*) = &dealloc_owner<NodeStateObject, &NodeStateObject::s>;

// A local rank or node index from Python, checked against the table's size.
bool index_arg(PyObject* self, long long v, std::uint32_t limit, const char* what, std::uint32_t* out) {
  if (v < 0 || v >= static_cast<long long>(limit)) {
    raise_from(self, std::string(what) + " " + std::to_string(v) + " out of range");
    return false;
  }
  *out = static_cast<std::uint32_t>(v);
  return true;
}

// The fingerprint arguments (seq, kind, dtype, itemsize, widened, count, op, root) as a Spec.
bool spec_args(PyObject* self, long long seq, long long kind, long long dtype, long long itemsize, int widened,
               long long count, long long op, long long root, smddp::Spec* out) {
  if (!non_negative(module_of(self), {seq, kind, dtype, itemsize, count, op, root})) return false;
  if (kind > 255 || dtype > 255 || op > 255 || itemsize > static_cast<long long>(UINT32_MAX) ||
      root > static_cast<long long>(UINT32_MAX)) {
    raise_from(self, "out of range: a fingerprint field");
    return false;
  }
  out->seq = static_cast<std::uint64_t>(seq);
  out->kind = static_cast<std::uint8_t>(kind);
  out->dtype = static_cast<std::uint8_t>(dtype);
  out->itemsize = static_cast<std::uint32_t>(itemsize);
  out->widened = widened != 0;
  out->count = static_cast<std::uint64_t>(count);
  out->op = static_cast<std::uint8_t>(op);
  out->has_op = op != 0;
  out->root = static_cast<std::uint32_t>(root);
  return true;
}

std::uint32_t local_size_of(PyObject* self) { return static_cast<std::uint32_t>(table(self).rank_count()); }

// name_rank(local, name)
PyObject* node_state_name_rank(PyObject* self, PyObject* args) {
  long long local = 0;
  PyObject* name_obj = nullptr;
  std::string name;
  std::uint32_t i = 0;
  if (!PyArg_ParseTuple(args, "LU", &local, &name_obj) || !text(name_obj, &name) ||
      !index_arg(self, local, local_size_of(self), "local rank", &i))
    return nullptr;
  table(self).name_rank(i, name);
  Py_RETURN_NONE;
}

// op_for(seq, kind, dtype, itemsize, widened, count, op, root, who) -> the new Collective, or None when
// it existed (same fingerprint)
PyObject* node_state_op_for(PyObject* self, PyObject* args) {
  long long seq = 0, kind = 0, dtype = 0, itemsize = 0, count = 0, op = 0, root = 0;
  int widened = 0;
  PyObject* who_obj = nullptr;
  std::string who;
  smddp::Spec spec;
  if (!PyArg_ParseTuple(args, "LLLLpLLLU", &seq, &kind, &dtype, &itemsize, &widened, &count, &op, &root, &who_obj) ||
      !text(who_obj, &who) || !spec_args(self, seq, kind, dtype, itemsize, widened, count, op, root, &spec))
    return nullptr;
  std::shared_ptr<smddp::Collective> c;
  bool created = false;
  smddp::Verdict v;
  try {
    v = table(self).op_for(spec, who, &c, &created);
  } catch (const std::bad_alloc&) {
    return PyErr_NoMemory();
  }
  if (!v.ok()) return raise_verdict(self, v);
  if (!created) Py_RETURN_NONE;
  return wrap_collective(module_of(self), c);
}

// submit(local, seq, kind, dtype, itemsize, widened, count, op, root) -> (new Collective or None, all_in)
PyObject* node_state_submit(PyObject* self, PyObject* args) {
  long long local = 0, seq = 0, kind = 0, dtype = 0, itemsize = 0, count = 0, op = 0, root = 0;
  int widened = 0;
  std::uint32_t i = 0;
  smddp::Spec spec;
  if (!PyArg_ParseTuple(args, "LLLLLpLLL", &local, &seq, &kind, &dtype, &itemsize, &widened, &count, &op, &root) ||
      !index_arg(self, local, local_size_of(self), "local rank", &i) ||
      !spec_args(self, seq, kind, dtype, itemsize, widened, count, op, root, &spec))
    return nullptr;
  std::shared_ptr<smddp::Collective> c;
  bool created = false, all_in = false;
  smddp::Verdict v;
  try {
    v = table(self).submit(i, spec, &c, &created, &all_in);
  } catch (const std::bad_alloc&) {
    return PyErr_NoMemory();
  }
  if (!v.ok()) return raise_verdict(self, v);
  PyObject* fresh = created ? wrap_collective(module_of(self), c) : Py_NewRef(Py_None);
  if (fresh == nullptr) return nullptr;
  return Py_BuildValue("(NO)", fresh, all_in ? Py_True : Py_False);
}

// release(local, seq) -> whether it left the table
PyObject* node_state_release(PyObject* self, PyObject* args) {
  long long local = 0, seq = 0;
  std::uint32_t i = 0;
  if (!PyArg_ParseTuple(args, "LL", &local, &seq) || !index_arg(self, local, local_size_of(self), "local rank", &i) ||
      !non_negative(module_of(self), {seq}))
    return nullptr;
  bool retire = false;
  const smddp::Verdict v = table(self).release(i, static_cast<std::uint64_t>(seq), &retire);
  if (!v.ok()) return raise_verdict(self, v);
  return PyBool_FromLong(retire ? 1 : 0);
}

// send_finished(seq) -> whether it left the table
PyObject* node_state_send_finished(PyObject* self, PyObject* arg) {
  const long long seq = PyLong_AsLongLong(arg);
  if (seq == -1 && PyErr_Occurred()) return nullptr;
  if (seq < 0) return PyBool_FromLong(0);
  return PyBool_FromLong(table(self).send_finished(static_cast<std::uint64_t>(seq)) ? 1 : 0);
}

// rank_said_bye(local): raises when a collective still needed it
PyObject* node_state_rank_said_bye(PyObject* self, PyObject* arg) {
  const long long local = PyLong_AsLongLong(arg);
  std::uint32_t i = 0;
  if ((local == -1 && PyErr_Occurred()) || !index_arg(self, local, local_size_of(self), "local rank", &i))
    return nullptr;
  const smddp::Verdict v = table(self).rank_said_bye(i);
  if (!v.ok()) return raise_verdict(self, v);
  Py_RETURN_NONE;
}

// peer_said_bye(node): raises when a collective still waited for it
PyObject* node_state_peer_said_bye(PyObject* self, PyObject* arg) {
  const long long j = PyLong_AsLongLong(arg);
  if ((j == -1 && PyErr_Occurred()) || !non_negative(module_of(self), {j})) return nullptr;
  if (j > static_cast<long long>(UINT32_MAX)) return raise_from(self, "node out of range");
  const smddp::Verdict v = table(self).peer_said_bye(static_cast<std::uint32_t>(j));
  if (!v.ok()) return raise_verdict(self, v);
  Py_RETURN_NONE;
}

// rank_left_early(local, joined, reason) -> whether it was recorded; raises when a collective waits
PyObject* node_state_rank_left_early(PyObject* self, PyObject* args) {
  long long local = 0;
  int joined = 0;
  PyObject* reason_obj = nullptr;
  std::string reason;
  std::uint32_t i = 0;
  if (!PyArg_ParseTuple(args, "LpU", &local, &joined, &reason_obj) || !text(reason_obj, &reason) ||
      !index_arg(self, local, local_size_of(self), "local rank", &i))
    return nullptr;
  bool recorded = false;
  const smddp::Verdict v = table(self).rank_left_early(i, joined != 0, reason, &recorded);
  if (!v.ok()) return raise_verdict(self, v);
  return PyBool_FromLong(recorded ? 1 : 0);
}

PyObject* node_state_all_ranks_gone(PyObject* self, PyObject*) {
  return PyBool_FromLong(table(self).all_ranks_gone() ? 1 : 0);
}

PyObject* node_state_left_early(PyObject* self, PyObject* arg) {
  const long long local = PyLong_AsLongLong(arg);
  std::uint32_t i = 0;
  if ((local == -1 && PyErr_Occurred()) || !index_arg(self, local, local_size_of(self), "local rank", &i))
    return nullptr;
  return PyBool_FromLong(table(self).left_early(i) ? 1 : 0);
}

Py_ssize_t node_state_len(PyObject* self) { return static_cast<Py_ssize_t>(table(self).size()); }

PyMethodDef kNodeStateMethods[] = {
    {"name_rank", node_state_name_rank, METH_VARARGS, "name_rank(local, name): how the rank is named from now on"},
    {"op_for", node_state_op_for, METH_VARARGS,
     "op_for(seq, kind, dtype, itemsize, widened, count, op, root, who) -> new Collective, or None if it existed"},
    {"submit", node_state_submit, METH_VARARGS,
     "submit(local, seq, kind, dtype, itemsize, widened, count, op, root) -> (new Collective or None, all_in)"},
    {"release", node_state_release, METH_VARARGS, "release(local, seq) -> it left the table"},
    {"send_finished", node_state_send_finished, METH_O, "send_finished(seq) -> it left the table"},
    {"rank_said_bye", node_state_rank_said_bye, METH_O, "rank_said_bye(local): raises if a collective needed it"},
    {"peer_said_bye", node_state_peer_said_bye, METH_O, "peer_said_bye(node): raises if a collective waited for it"},
    {"rank_left_early", node_state_rank_left_early, METH_VARARGS,
     "rank_left_early(local, joined, reason) -> recorded; raises if a collective waits for it"},
    {"all_ranks_gone", node_state_all_ranks_gone, METH_NOARGS, "every local rank said BYE or left early"},
    {"left_early", node_state_left_early, METH_O, "left_early(local) -> its process ended without joining"},
    {nullptr, nullptr, 0, nullptr},
};

PyType_Slot kNodeStateSlots[] = {
    {Py_tp_new, reinterpret_cast<void*>(node_state_new)},
    {Py_tp_dealloc, reinterpret_cast<void*>(node_state_dealloc)},
    {Py_tp_methods, kNodeStateMethods},
    {Py_sq_length, reinterpret_cast<void*>(node_state_len)},
    {Py_tp_doc, const_cast<char*>("The daemon's collectives in flight and the job-wide rules around them "
                                  "(smddp/engine/node_state.h).")},
    {0, nullptr},
};

PyType_Spec kNodeStateSpec = {
    "smddp_rigs._engine_testing.NodeState",
    sizeof(NodeStateObject),
    0,
    Py_TPFLAGS_DEFAULT | Py_TPFLAGS_IMMUTABLETYPE,
    kNodeStateSlots,
};

// ---------------------------------------------------------------------------------- DaemonChannel

// The daemon's end of a worker's channel (the plane holds the same two views and side socket for
// each worker): what a stand-in daemon uses to read a real client's descriptors and answer them.
struct DaemonEnd {
  DaemonEnd(std::shared_ptr<smddp::Segment> s, int sd)
      : seg(std::move(s)),
        side(sd),
        submit(seg->base(), smddp::kChannelSlots, false),
        done(seg->base() + smddp::done_ring_offset(), smddp::kChannelSlots, false) {}
  ~DaemonEnd() { ::close(side); }
  DaemonEnd(const DaemonEnd&) = delete;
  DaemonEnd& operator=(const DaemonEnd&) = delete;
  std::shared_ptr<smddp::Segment> seg;  // keeps the mapping while the views use it
  int side;                             // the side socket's daemon end (owned)
  smddp::RingView submit;               // consumer
  smddp::RingView done;                 // producer
  std::mutex pop_mu, push_mu;           // one thread at a time on each side
  std::map<std::uint32_t, std::shared_ptr<smddp::Segment>> inputs;  // ATTACHed (under pop_mu)
};

struct DaemonChannelObject {
  PyObject_HEAD
  DaemonEnd* end;
};

DaemonEnd& end_of(PyObject* self) { return *reinterpret_cast<DaemonChannelObject*>(self)->end; }

// DaemonChannel(fd, size, side): the channel segment a worker passed with CHANNEL (its fd, attached
// read-write here) and the side socket's end that came with it (both taken over: closed on failure too)
PyObject* daemon_channel_new(PyTypeObject* type, PyObject* args, PyObject* kwargs) {
  int fd = -1, side = -1;
  long long size = 0;
  static const char* kw[] = {"fd", "size", "side", nullptr};
  if (!PyArg_ParseTupleAndKeywords(args, kwargs, "iLi", const_cast<char**>(kw), &fd, &size, &side)) return nullptr;
  if (side < 0 || fd < 0 || size < static_cast<long long>(smddp::channel_bytes())) {
    if (fd >= 0) ::close(fd);
    if (side >= 0) ::close(side);
    PyErr_Format(PyExc_ValueError, "DaemonChannel: two fds and a channel of at least %zu bytes", smddp::channel_bytes());
    return nullptr;
  }
  std::string why;
  std::shared_ptr<smddp::Segment> seg = smddp::Segment::attach(0, fd, static_cast<std::uint64_t>(size), true, &why);
  PyObject* self = seg ? alloc_instance(type) : nullptr;
  if (self == nullptr) {
    ::close(side);
    return seg ? nullptr : raise_protocol(PyType_GetModule(type), "the channel: " + why);
  }
  reinterpret_cast<DaemonChannelObject*>(self)->end = new DaemonEnd(std::move(seg), side);
  return self;
}

constexpr void (*daemon_channel_dealloc)(PyObject*) = &dealloc_owner<DaemonChannelObject, &DaemonChannelObject::end>;

// pop(timeout_s) -> the next 56-byte header of the submit ring, or None; an ATTACH is taken in
// here (its fd off the side socket, the segment kept), as the plane does, and not returned
PyObject* daemon_channel_pop(PyObject* self, PyObject* arg) {
  const double timeout = PyFloat_AsDouble(arg);
  if (timeout == -1.0 && PyErr_Occurred()) return nullptr;
  std::uint8_t slot[smddp::kSlotBytes];
  smddp::RingWait r;
  std::string why;
  Py_BEGIN_ALLOW_THREADS
  {
    DaemonEnd& end = end_of(self);
    std::lock_guard<std::mutex> g(end.pop_mu);
    for (;;) {
      r = end.submit.pop(slot, static_cast<std::int64_t>(timeout * 1e9), 0);
      if (r == smddp::RingWait::kCorrupt) why = "the worker broke its submit ring: " + end.submit.why();
      smddp::Header h;
      if (r != smddp::RingWait::kReady || !smddp::decode_header(slot, smddp::kHeaderSize, &h).empty() ||
          h.type != smddp::Msg::kAttach)
        break;
      int fd = -1;
      why = smddp::recv_fd(end.side, h.shard, h.offset, &fd);
      std::shared_ptr<smddp::Segment> seg;
      if (why.empty()) seg = smddp::Segment::attach(h.shard, fd, h.offset, false, &why);
      if (!seg) {
        why = "the worker's ATTACH of " + why;
        r = smddp::RingWait::kCorrupt;
        break;
      }
      end.inputs[h.shard] = std::move(seg);
    }
  }
  Py_END_ALLOW_THREADS
  if (r == smddp::RingWait::kTimeout) Py_RETURN_NONE;
  if (r == smddp::RingWait::kCorrupt) return raise_from(self, why);
  return PyBytes_FromStringAndSize(reinterpret_cast<const char*>(slot), static_cast<Py_ssize_t>(smddp::kHeaderSize));
}

// push(header, timeout_s): onto the done ring; TimeoutError when it stayed full
PyObject* daemon_channel_push(PyObject* self, PyObject* args) {
  Py_buffer view;
  double timeout = 0;
  if (!PyArg_ParseTuple(args, "y*d", &view, &timeout)) return nullptr;
  if (view.len != static_cast<Py_ssize_t>(smddp::kHeaderSize)) {
    PyBuffer_Release(&view);
    PyErr_SetString(PyExc_ValueError, "a descriptor is one 56-byte header");
    return nullptr;
  }
  std::uint8_t frame[smddp::kHeaderSize];
  std::memcpy(frame, view.buf, smddp::kHeaderSize);
  PyBuffer_Release(&view);
  smddp::RingWait r;
  std::string why;
  Py_BEGIN_ALLOW_THREADS
  {
    std::lock_guard<std::mutex> g(end_of(self).push_mu);
    r = end_of(self).done.push(frame, smddp::kHeaderSize, static_cast<std::int64_t>(timeout * 1e9), 0);
    if (r == smddp::RingWait::kCorrupt) why = end_of(self).done.why();
  }
  Py_END_ALLOW_THREADS
  if (r == smddp::RingWait::kTimeout) {
    PyErr_SetString(PyExc_TimeoutError, "the worker left its done ring full");
    return nullptr;
  }
  if (r == smddp::RingWait::kCorrupt) return raise_from(self, "the worker broke its done ring: " + why);
  Py_RETURN_NONE;
}

// send_segment(fd, id, size, node, timeout_s): a result segment's fd (not taken over) on the side
// socket, then its SEGMENT
PyObject* daemon_channel_send_segment(PyObject* self, PyObject* args) {
  int fd = -1;
  long long id = 0, size = 0, node = 0;
  double timeout = 0;
  if (!PyArg_ParseTuple(args, "iLLLd", &fd, &id, &size, &node, &timeout) ||
      !non_negative(module_of(self), {id, size, node}))
    return nullptr;
  if (id > static_cast<long long>(UINT32_MAX)) return raise_from(self, "a segment id out of range");
  smddp::Header h;
  h.type = smddp::Msg::kSegment;
  h.sender = static_cast<std::uint32_t>(node);
  h.shard = static_cast<std::uint32_t>(id);
  h.offset = static_cast<std::uint64_t>(size);
  std::uint8_t frame[smddp::kHeaderSize];
  std::string why = smddp::encode_header(h, frame);
  smddp::RingWait r = smddp::RingWait::kCorrupt;
  Py_BEGIN_ALLOW_THREADS
  {
    DaemonEnd& end = end_of(self);
    std::lock_guard<std::mutex> g(end.push_mu);
    bool gone = false;
    if (why.empty()) why = smddp::send_fd(end.side, static_cast<std::uint32_t>(id), static_cast<std::uint64_t>(size), fd, &gone);
    if (why.empty()) {
      r = end.done.push(frame, smddp::kHeaderSize, static_cast<std::int64_t>(timeout * 1e9), 0);
      if (r == smddp::RingWait::kCorrupt) why = "the worker broke its done ring: " + end.done.why();
    }
  }
  Py_END_ALLOW_THREADS
  if (r == smddp::RingWait::kTimeout) {
    PyErr_SetString(PyExc_TimeoutError, "the worker left its done ring full");
    return nullptr;
  }
  if (r != smddp::RingWait::kReady) return raise_from(self, why);
  Py_RETURN_NONE;
}

PyMethodDef kDaemonChannelMethods[] = {
    {"pop", daemon_channel_pop, METH_O,
     "pop(timeout_s) -> the next header of the submit ring (ATTACHes taken in on the way), or None"},
    {"send_segment", daemon_channel_send_segment, METH_VARARGS,
     "send_segment(fd, id, size, node, timeout_s): the fd on the side socket, then SEGMENT on the done ring"},
    {"push", daemon_channel_push, METH_VARARGS, "push(header, timeout_s): onto the done ring"},
    {nullptr, nullptr, 0, nullptr},
};

PyType_Slot kDaemonChannelSlots[] = {
    {Py_tp_new, reinterpret_cast<void*>(daemon_channel_new)},
    {Py_tp_dealloc, reinterpret_cast<void*>(daemon_channel_dealloc)},
    {Py_tp_methods, kDaemonChannelMethods},
    {Py_tp_doc, const_cast<char*>("The daemon's end of a worker's rings, for a stand-in daemon (smddp/engine/ring.h).")},
    {0, nullptr},
};

PyType_Spec kDaemonChannelSpec = {
    "smddp_rigs._engine_testing.DaemonChannel",
    sizeof(DaemonChannelObject),
    0,
    Py_TPFLAGS_DEFAULT | Py_TPFLAGS_IMMUTABLETYPE,
    kDaemonChannelSlots,
};

PyMethodDef kMethods[] = {
    {"locate_reduce", py_locate_reduce, METH_VARARGS,
     "locate_reduce(count, itemsize, nshards, chunk_elems, shard, byte_offset, byte_length) -> (index, start, end)"},
    {"reduce16", py_reduce16, METH_VARARGS,
     "reduce16(kind, op, inputs, out, divisor[, portable]) -> block indices (NaN) left for the caller"},
    {"reduce", py_reduce, METH_VARARGS,
     "reduce(dtype, op, inputs, out, divisor) -> None: the daemon's kernel, any wire dtype"},
    {"shard_range", py_shard_range, METH_VARARGS, "shard_range(count, nshards, shard) -> (start, end)"},
    {"locate_block", py_locate_block, METH_VARARGS,
     "locate_block(start, end, chunk_bytes, byte_offset, byte_length) -> index"},
    {nullptr, nullptr, 0, nullptr},
};

int exec_module(PyObject* module) {
  if (load_errors(module) != 0) return -1;
  ModuleState* st = state(module);
  if (add_type(module, &kCollectiveSpec, "Collective", &st->collective_type) != 0 ||
      add_type(module, &kNodeStateSpec, "NodeState", &st->node_state_type) != 0 ||
      add_type(module, &kDaemonChannelSpec, "DaemonChannel", &st->daemon_channel_type) != 0)
    return -1;
  if (PyModule_AddIntConstant(module, "HEADER_SIZE", static_cast<long>(smddp::kHeaderSize)) != 0) return -1;
  if (PyModule_AddIntConstant(module, "BLOCK", static_cast<long>(smddp::kReduceBlock)) != 0) return -1;
  return 0;
}

int traverse(PyObject* module, visitproc visit, void* arg) {
  if (int r = visit_errors(module, visit, arg)) return r;
  Py_VISIT(state(module)->collective_type);
  Py_VISIT(state(module)->node_state_type);
  Py_VISIT(state(module)->daemon_channel_type);
  return 0;
}

int clear(PyObject* module) {
  clear_errors(module);
  Py_CLEAR(state(module)->collective_type);
  Py_CLEAR(state(module)->node_state_type);
  Py_CLEAR(state(module)->daemon_channel_type);
  return 0;
}

void free_module(void* module) { clear(static_cast<PyObject*>(module)); }

PyModuleDef_Slot kSlots[] = {{Py_mod_exec, reinterpret_cast<void*>(exec_module)}, {0, nullptr}};

PyModuleDef kModule = {
    PyModuleDef_HEAD_INIT,
    "smddp_rigs._engine_testing",
    "The engine's parts as tests and rigs call them (never in smddp's wheel).",
    sizeof(ModuleState),
    kMethods,
    kSlots,
    traverse,
    clear,
    free_module,
};

}  // namespace

PyMODINIT_FUNC PyInit__engine_testing() { return PyModuleDef_Init(&kModule); }
