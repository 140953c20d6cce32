// smddp._engine: the compiled engine's Python face (plain CPython API: no binding library to pin or ship).
//
// Only this file touches Python objects; the engine's own code (frame.*) never does.
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <unistd.h>

#include <cstdint>
#include <initializer_list>
#include <map>
#include <memory>
#include <cstring>
#include <new>
#include <system_error>
#include <string>
#include <vector>

#include "arena.h"
#include "channel.h"
#include "collective.h"
#include "fdpass.h"
#include "frame.h"
#include "layout.h"
#include "local_plane.h"
#include "node_state.h"
#include "reduce.h"
#include "reduce16.h"

// The stable ABI (Py_LIMITED_API, where setup.py builds an abi3 wheel) has no access to a type's
// fields: the heap types' allocator and deallocator come through PyType_GetSlot.
static PyObject* alloc_instance(PyTypeObject* type) {
  auto alloc = reinterpret_cast<allocfunc>(PyType_GetSlot(type, Py_tp_alloc));
  return alloc(type, 0);
}

static void free_instance(PyTypeObject* type, PyObject* self) {
  auto release = reinterpret_cast<freefunc>(PyType_GetSlot(type, Py_tp_free));
  release(self);
}

// Item i of a list or tuple made by PySequence_Fast (borrowed, as PySequence_Fast_GET_ITEM's).
static PyObject* fast_item(PyObject* seq, Py_ssize_t i) {
  return PyList_Check(seq) ? PyList_GetItem(seq, i) : PyTuple_GetItem(seq, i);
}


namespace {

struct ModuleState {
  PyObject* protocol_error;   // smddp.errors.ProtocolError, owned by the module
  PyObject* mismatch_error;   // smddp.errors.CollectiveMismatchError
  PyObject* peer_lost_error;  // smddp.errors.PeerLostError
  PyObject* collective_type;  // the Collective class, owned by the module
  PyObject* node_state_type;  // the NodeState class
  PyObject* segment_type;     // the Segment class
  PyObject* arena_type;       // the Arena class
  PyObject* plane_type;       // the LocalPlane class
  PyObject* channel_type;     // the WorkerChannel class
  PyObject* daemon_channel_type;  // the DaemonChannel class
};

ModuleState* state(PyObject* module) { return static_cast<ModuleState*>(PyModule_GetState(module)); }

PyObject* raise_protocol(PyObject* module, const std::string& why) {
  PyErr_SetString(state(module)->protocol_error, why.c_str());
  return nullptr;
}

// decode_header(data) -> (type, flags, dtype, op, kind, sender, seq, shard, aux, offset, length, count)
PyObject* py_decode_header(PyObject* module, PyObject* arg) {
  Py_buffer view;
  if (PyObject_GetBuffer(arg, &view, PyBUF_SIMPLE) != 0) return nullptr;
  smddp::Header h;
  const std::string why = smddp::decode_header(static_cast<const std::uint8_t*>(view.buf),
                                               static_cast<std::size_t>(view.len), &h);
  PyBuffer_Release(&view);
  if (!why.empty()) return raise_protocol(module, why);
  return Py_BuildValue("(BHBBBkKkkKKK)", static_cast<unsigned char>(h.type), h.flags, h.dtype, h.op, h.kind,
                       static_cast<unsigned long>(h.sender), static_cast<unsigned long long>(h.seq),
                       static_cast<unsigned long>(h.shard), static_cast<unsigned long>(h.aux),
                       static_cast<unsigned long long>(h.offset), static_cast<unsigned long long>(h.length),
                       static_cast<unsigned long long>(h.count));
}

// encode_header(type, sender, seq, shard, aux, offset, length, count, dtype, op, kind) -> bytes
PyObject* py_encode_header(PyObject* module, PyObject* args) {
  unsigned int type = 0, dtype = 0, op = 0, kind = 0;
  unsigned long long sender = 0, seq = 0, shard = 0, aux = 0, offset = 0, length = 0, count = 0;
  if (!PyArg_ParseTuple(args, "IKKKKKKKIII", &type, &sender, &seq, &shard, &aux, &offset, &length, &count,
                        &dtype, &op, &kind))
    return nullptr;
  if (type > 255 || dtype > 255 || op > 255 || kind > 255 || sender > UINT32_MAX || shard > UINT32_MAX ||
      aux > UINT32_MAX)
    return raise_protocol(module, "cannot encode: a field is out of range");
  smddp::Header h;
  h.type = static_cast<smddp::Msg>(type);
  h.sender = static_cast<std::uint32_t>(sender);
  h.seq = seq;
  h.shard = static_cast<std::uint32_t>(shard);
  h.aux = static_cast<std::uint32_t>(aux);
  h.offset = offset;
  h.length = length;
  h.count = count;
  h.dtype = static_cast<std::uint8_t>(dtype);
  h.op = static_cast<std::uint8_t>(op);
  h.kind = static_cast<std::uint8_t>(kind);
  std::uint8_t out[smddp::kHeaderSize];
  const std::string why = smddp::encode_header(h, out);
  if (!why.empty()) return raise_protocol(module, why);
  return PyBytes_FromStringAndSize(reinterpret_cast<const char*>(out), smddp::kHeaderSize);
}

// Every argument as a signed 64-bit integer, refused if negative: values come from the wire.
bool non_negative(PyObject* module, std::initializer_list<long long> values) {
  for (long long v : values) {
    if (v < 0) {
      raise_protocol(module, "out of range: a negative offset, length, shard or size");
      return false;
    }
  }
  return true;
}

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

// reduce16(kind, op, inputs, out, divisor) -> block indices left unwritten (their result holds a NaN):
// the block kernel alone, for its tests; reduce() is what the daemon runs.
// kind: 0 float16, 1 bfloat16; op: 0 sum, 1 min, 2 max; divisor 0.0 for none. Inputs and out are
// C-contiguous buffers of equally many 16-bit elements; out may alias an input element-wise.
PyObject* py_reduce16(PyObject*, PyObject* args) {
  int kind = 0, op = 0;
  PyObject *inputs = nullptr, *out_obj = nullptr;
  float divisor = 0.0f;
  if (!PyArg_ParseTuple(args, "iiOOf", &kind, &op, &inputs, &out_obj, &divisor)) return nullptr;
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
                          static_cast<std::size_t>(k), static_cast<std::size_t>(len / 2), out, divisor, &nan_blocks);
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

PyObject* py_has_f16c(PyObject*, PyObject*) { return PyBool_FromLong(smddp::have_f16c() ? 1 : 0); }


// ---------------------------------------------------------------------------------------- Collective

// A Python object holding one smddp::Collective, shared with the NodeState whose table holds it
// (made by Collective() or handed out by NodeState; the last holder deletes it). Its methods hold
// the GIL throughout: each is a few comparisons, never a wait.
struct CollectiveObject {
  PyObject_HEAD
  std::shared_ptr<smddp::Collective>* c;  // new'd with the object, deleted in tp_dealloc
};

PyObject* module_of(PyObject* self) { return PyType_GetModule(Py_TYPE(self)); }

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

// A Python str as UTF-8 (for the names in error messages).
bool text(PyObject* obj, std::string* out) {
  Py_ssize_t n = 0;
  const char* p = PyUnicode_AsUTF8AndSize(obj, &n);
  if (p == nullptr) return false;
  out->assign(p, static_cast<std::size_t>(n));
  return true;
}

PyObject* chunk_tuple(const smddp::Chunk& c) {
  return Py_BuildValue("(KKK)", static_cast<unsigned long long>(c.index), static_cast<unsigned long long>(c.start),
                       static_cast<unsigned long long>(c.end));
}

PyObject* raise_from(PyObject* self, const std::string& why) { return raise_protocol(module_of(self), why); }

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

// tp_dealloc of a type whose instances each own one engine object through `Member`, deleted with
// them. Heap types: every instance holds a reference to its type, given back here.
template <typename Obj, auto Member>
void dealloc_owner(PyObject* self) {
  PyTypeObject* type = Py_TYPE(self);
  delete (reinterpret_cast<Obj*>(self)->*Member);
  free_instance(type, self);
  Py_DECREF(type);
}

constexpr void (*collective_dealloc)(PyObject*) = &dealloc_owner<CollectiveObject, &CollectiveObject::c>;

// submit(local_rank, who) -> whether every local rank has now submitted
PyObject* collective_submit(PyObject* self, PyObject* args) {
  long long local = 0;
  PyObject* who_obj = nullptr;
  std::string who;
  if (!PyArg_ParseTuple(args, "LU", &local, &who_obj) || !text(who_obj, &who)) return nullptr;
  if (local < 0 || local > static_cast<long long>(UINT32_MAX)) return raise_from(self, who + " is not a local rank");
  bool all_in = false;
  const std::string why = coll(self).submit(static_cast<std::uint32_t>(local), who, &all_in);
  if (!why.empty()) return raise_from(self, why);
  return PyBool_FromLong(all_in ? 1 : 0);
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
  long long local = 0;
  PyObject* who_obj = nullptr;
  std::string who;
  if (!PyArg_ParseTuple(args, "LU", &local, &who_obj) || !text(who_obj, &who)) return nullptr;
  if (local < 0 || local > static_cast<long long>(UINT32_MAX)) return raise_from(self, who + " is not a local rank");
  bool retire = false;
  const std::string why = coll(self).release(static_cast<std::uint32_t>(local), who, &retire);
  if (!why.empty()) return raise_from(self, why);
  return PyBool_FromLong(retire ? 1 : 0);
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
    "smddp._engine.Collective",
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

// A verdict as the smddp.errors exception of its fault; nullptr always (for `return`).
PyObject* raise_verdict(PyObject* self, const smddp::Verdict& v) {
  ModuleState* st = state(module_of(self));
  PyObject* cls = v.fault == smddp::Fault::kMismatch   ? st->mismatch_error
                  : v.fault == smddp::Fault::kPeerLost ? st->peer_lost_error
                                                       : st->protocol_error;
  PyErr_SetString(cls, v.why.c_str());
  return nullptr;
}

bool strings(PyObject* seq, std::vector<std::string>* out) {
  PyObject* fast = PySequence_Fast(seq, "expected a sequence of str");
  if (fast == nullptr) return false;
  const Py_ssize_t n = PySequence_Size(fast);
  bool ok = true;
  for (Py_ssize_t i = 0; ok && i < n; i++) {
    std::string one;
    PyObject* item = fast_item(fast, i);
    ok = PyUnicode_Check(item) && text(item, &one);
    if (ok) out->push_back(one);
    else if (!PyErr_Occurred()) PyErr_SetString(PyExc_TypeError, "expected a sequence of str");
  }
  Py_DECREF(fast);
  return ok;
}

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
    "smddp._engine.NodeState",
    sizeof(NodeStateObject),
    0,
    Py_TPFLAGS_DEFAULT | Py_TPFLAGS_IMMUTABLETYPE,
    kNodeStateSlots,
};

// ---------------------------------------------------------------------------------------- Segment

// A Python object sharing one smddp::Segment: its buffer is the whole mapping (read-only when the
// segment is), so a numpy array made from it keeps the mapping alive for as long as it lives.
struct SegmentObject {
  PyObject_HEAD
  std::shared_ptr<smddp::Segment>* seg;  // new'd with the object, deleted in tp_dealloc
};

smddp::Segment& segment_of(PyObject* self) { return **reinterpret_cast<SegmentObject*>(self)->seg; }

PyObject* wrap_segment(PyObject* module, const std::shared_ptr<smddp::Segment>& seg) {
  auto* type = reinterpret_cast<PyTypeObject*>(state(module)->segment_type);
  PyObject* self = alloc_instance(type);
  if (self == nullptr) return nullptr;
  try {
    reinterpret_cast<SegmentObject*>(self)->seg = new std::shared_ptr<smddp::Segment>(seg);
  } catch (const std::bad_alloc&) {
    Py_DECREF(self);
    return PyErr_NoMemory();
  }
  return self;
}

constexpr void (*segment_dealloc)(PyObject*) = &dealloc_owner<SegmentObject, &SegmentObject::seg>;

int segment_getbuffer(PyObject* self, Py_buffer* view, int flags) {
  smddp::Segment& seg = segment_of(self);
  return PyBuffer_FillInfo(view, self, seg.base(), static_cast<Py_ssize_t>(seg.size()), seg.writable() ? 0 : 1,
                           flags);
}

// segment_create(id, size, name) -> Segment: a new sealed memfd, mapped read-write
PyObject* py_segment_create(PyObject* module, PyObject* args) {
  long long id = 0, size = 0;
  PyObject* name_obj = nullptr;
  std::string name;
  if (!PyArg_ParseTuple(args, "LLU", &id, &size, &name_obj) || !text(name_obj, &name)) return nullptr;
  if (!non_negative(module, {id, size})) return nullptr;
  if (id > static_cast<long long>(UINT32_MAX)) return raise_protocol(module, "segment id out of range");
  std::string why;
  std::shared_ptr<smddp::Segment> seg;
  PyThreadState* ts = PyEval_SaveThread();  // memfd_create, ftruncate and mmap: system calls
  try {
    seg = smddp::Segment::create(static_cast<std::uint32_t>(id), static_cast<std::uint64_t>(size), name, &why);
  } catch (const std::bad_alloc&) {
    why = "out of memory";
  }
  PyEval_RestoreThread(ts);
  if (!seg) {
    PyErr_SetString(PyExc_OSError, why.c_str());
    return nullptr;
  }
  return wrap_segment(module, seg);
}

// segment_attach(id, fd, size, writable) -> Segment; takes the fd over (closed on refusal too)
PyObject* py_segment_attach(PyObject* module, PyObject* args) {
  long long id = 0, size = 0;
  int fd = -1, writable = 0;
  if (!PyArg_ParseTuple(args, "LiLp", &id, &fd, &size, &writable)) return nullptr;
  if (id < 0 || id > static_cast<long long>(UINT32_MAX) || size < 0) {
    if (fd >= 0) close(fd);
    return raise_protocol(module, "segment " + std::to_string(id) + ": id or size out of range");
  }
  std::string why;
  const std::shared_ptr<smddp::Segment> seg =
      smddp::Segment::attach(static_cast<std::uint32_t>(id), fd, static_cast<std::uint64_t>(size), writable != 0, &why);
  if (!seg) return raise_protocol(module, why);
  return wrap_segment(module, seg);
}

// check(offset, nbytes): raises ProtocolError unless the range lies inside the segment
PyObject* segment_check(PyObject* self, PyObject* args) {
  long long offset = 0, nbytes = 0;
  if (!PyArg_ParseTuple(args, "LL", &offset, &nbytes)) return nullptr;
  smddp::Segment& seg = segment_of(self);
  std::uint8_t* p = nullptr;
  const std::string why =
      offset < 0 || nbytes < 0
          ? "segment " + std::to_string(seg.id()) + ": range [" + std::to_string(offset) + ", +" +
                std::to_string(nbytes) + ") outside its " + std::to_string(seg.size()) + " bytes"
          : seg.range(static_cast<std::uint64_t>(offset), static_cast<std::uint64_t>(nbytes), &p);
  if (!why.empty()) return raise_from(self, why);
  Py_RETURN_NONE;
}

PyObject* segment_close_fd(PyObject* self, PyObject*) {
  segment_of(self).close_fd();
  Py_RETURN_NONE;
}

PyObject* get_seg_id(PyObject* self, void*) { return PyLong_FromUnsignedLong(segment_of(self).id()); }
PyObject* get_seg_size(PyObject* self, void*) { return PyLong_FromUnsignedLongLong(segment_of(self).size()); }
PyObject* get_seg_fd(PyObject* self, void*) { return PyLong_FromLong(segment_of(self).fd()); }
PyObject* get_seg_writable(PyObject* self, void*) { return PyBool_FromLong(segment_of(self).writable() ? 1 : 0); }

PyMethodDef kSegmentMethods[] = {
    {"check", segment_check, METH_VARARGS, "check(offset, nbytes): raises ProtocolError if outside the segment"},
    {"close_fd", segment_close_fd, METH_NOARGS, "close_fd(): the fd goes now, the mapping with its last holder"},
    {nullptr, nullptr, 0, nullptr},
};

PyGetSetDef kSegmentGetters[] = {
    {"id", get_seg_id, nullptr, "its id within its owner", nullptr},
    {"size", get_seg_size, nullptr, "bytes", nullptr},
    {"fd", get_seg_fd, nullptr, "its memfd (-1 once closed)", nullptr},
    {"writable", get_seg_writable, nullptr, "mapped read-write", nullptr},
    {nullptr, nullptr, nullptr, nullptr, nullptr},
};

PyType_Slot kSegmentSlots[] = {
    {Py_tp_dealloc, reinterpret_cast<void*>(segment_dealloc)},
    {Py_tp_methods, kSegmentMethods},
    {Py_tp_getset, kSegmentGetters},
    {Py_bf_getbuffer, reinterpret_cast<void*>(segment_getbuffer)},
    {Py_tp_doc, const_cast<char*>("A sealed memfd segment, mapped (smddp/engine/arena.h); its buffer is the mapping.")},
    {0, nullptr},
};

PyType_Spec kSegmentSpec = {
    "smddp._engine.Segment",
    sizeof(SegmentObject),
    0,
    Py_TPFLAGS_DEFAULT | Py_TPFLAGS_IMMUTABLETYPE | Py_TPFLAGS_DISALLOW_INSTANTIATION,
    kSegmentSlots,
};

// ------------------------------------------------------------------------------------------ Arena

struct ArenaObject {
  PyObject_HEAD
  smddp::Arena* arena;
};

smddp::Arena& arena_of(PyObject* self) { return *reinterpret_cast<ArenaObject*>(self)->arena; }

// Arena(name, segment_bytes)
PyObject* arena_new(PyTypeObject* type, PyObject* args, PyObject* kwargs) {
  PyObject* name_obj = nullptr;
  long long segment_bytes = 0;
  std::string name;
  static const char* kw[] = {"name", "segment_bytes", nullptr};
  if (!PyArg_ParseTupleAndKeywords(args, kwargs, "UL", const_cast<char**>(kw), &name_obj, &segment_bytes) ||
      !text(name_obj, &name))
    return nullptr;
  if (segment_bytes < 0) return raise_protocol(PyType_GetModule(type), "segment_bytes must not be negative");
  PyObject* self = alloc_instance(type);
  if (self == nullptr) return nullptr;
  try {
    reinterpret_cast<ArenaObject*>(self)->arena = new smddp::Arena(name, static_cast<std::uint64_t>(segment_bytes));
  } catch (const std::bad_alloc&) {
    Py_DECREF(self);
    return PyErr_NoMemory();
  }
  return self;
}

constexpr void (*arena_dealloc)(PyObject*) = &dealloc_owner<ArenaObject, &ArenaObject::arena>;

// alloc(nbytes) -> (segment, offset, new Segment or None)
PyObject* arena_alloc(PyObject* self, PyObject* arg) {
  const long long nbytes = PyLong_AsLongLong(arg);
  if (nbytes == -1 && PyErr_Occurred()) return nullptr;
  if (nbytes < 0) return raise_from(self, "a slot of a negative size");
  smddp::Slot slot;
  std::shared_ptr<smddp::Segment> fresh;
  std::string why;
  bool oom = false;
  PyThreadState* ts = PyEval_SaveThread();  // may wait for the arena's lock, or make a segment
  try {
    why = arena_of(self).alloc(static_cast<std::uint64_t>(nbytes), &slot, &fresh);
  } catch (const std::bad_alloc&) {
    oom = true;
  }
  PyEval_RestoreThread(ts);
  if (oom) return PyErr_NoMemory();
  if (!why.empty()) {
    PyErr_SetString(PyExc_OSError, why.c_str());
    return nullptr;
  }
  PyObject* seg = fresh ? wrap_segment(module_of(self), fresh) : Py_NewRef(Py_None);
  if (seg == nullptr) return nullptr;
  return Py_BuildValue("(kKN)", static_cast<unsigned long>(slot.segment), static_cast<unsigned long long>(slot.offset), seg);
}

// free(segment, offset, nbytes): ValueError unless it is exactly a live slot
PyObject* arena_free(PyObject* self, PyObject* args) {
  long long segment = 0, offset = 0, nbytes = 0;
  if (!PyArg_ParseTuple(args, "LLL", &segment, &offset, &nbytes)) return nullptr;
  if (segment < 0 || segment > static_cast<long long>(UINT32_MAX) || offset < 0 || nbytes < 0) {
    PyErr_SetString(PyExc_ValueError, "not a slot of this arena");
    return nullptr;
  }
  const std::string why = arena_of(self).free(
      smddp::Slot{static_cast<std::uint32_t>(segment), static_cast<std::uint64_t>(offset), static_cast<std::uint64_t>(nbytes)});
  if (!why.empty()) {
    PyErr_SetString(PyExc_ValueError, why.c_str());
    return nullptr;
  }
  Py_RETURN_NONE;
}

PyObject* arena_close(PyObject* self, PyObject*) {
  arena_of(self).close();
  Py_RETURN_NONE;
}

PyObject* get_in_use(PyObject* self, void*) { return PyLong_FromUnsignedLongLong(arena_of(self).in_use()); }

PyMethodDef kArenaMethods[] = {
    {"alloc", arena_alloc, METH_O, "alloc(nbytes) -> (segment, offset, new Segment or None)"},
    {"free", arena_free, METH_VARARGS, "free(segment, offset, nbytes): ValueError unless a live slot"},
    {"close", arena_close, METH_NOARGS, "close(): drop every segment and slot"},
    {nullptr, nullptr, 0, nullptr},
};

PyGetSetDef kArenaGetters[] = {
    {"in_use", get_in_use, nullptr, "bytes in live slots (rounded to the slot alignment)", nullptr},
    {nullptr, nullptr, nullptr, nullptr, nullptr},
};

PyType_Slot kArenaSlots[] = {
    {Py_tp_new, reinterpret_cast<void*>(arena_new)},
    {Py_tp_dealloc, reinterpret_cast<void*>(arena_dealloc)},
    {Py_tp_methods, kArenaMethods},
    {Py_tp_getset, kArenaGetters},
    {Py_tp_doc, const_cast<char*>("First fit over growing memfd segments (smddp/engine/arena.h); thread-safe.")},
    {0, nullptr},
};

PyType_Spec kArenaSpec = {
    "smddp._engine.Arena",
    sizeof(ArenaObject),
    0,
    Py_TPFLAGS_DEFAULT | Py_TPFLAGS_IMMUTABLETYPE,
    kArenaSlots,
};

// ------------------------------------------------------------------------------------- LocalPlane

// The Segment a Python argument holds, or nullptr with TypeError set.
std::shared_ptr<smddp::Segment> segment_arg(PyObject* module, PyObject* obj) {
  if (!PyObject_TypeCheck(obj, reinterpret_cast<PyTypeObject*>(state(module)->segment_type))) {
    PyErr_SetString(PyExc_TypeError, "expected an smddp._engine.Segment");
    return nullptr;
  }
  return *reinterpret_cast<SegmentObject*>(obj)->seg;
}

struct PlaneObject {
  PyObject_HEAD
  smddp::LocalPlane* plane;
  PyObject* arena;    // the result Arena object, kept alive while the plane uses it
  PyObject* scratch;  // the scratch Arena object (several nodes), or null
};

smddp::LocalPlane& plane_of(PyObject* self) { return *reinterpret_cast<PlaneObject*>(self)->plane; }

// LocalPlane(node, local_size, chunk_bytes, rank_names, me, results, spin_us, push_timeout_s, threads=2, *, nnodes=1, world=local_size, first_rank=0, replicate_bytes=0, node_names=None,
//            scratch=None, heartbeat_s=0.0, trace=False, fabric="tcp", ofi_library="", ofi_provider="efa")
PyObject* plane_new(PyTypeObject* type, PyObject* args, PyObject* kwargs) {
  long long node = 0, local_size = 0, chunk_bytes = 0, threads = 2, nnodes = 1, world = -1, first_rank = 0,
            replicate_bytes = 0;
  PyObject *names_obj = nullptr, *me_obj = nullptr, *arena_obj = nullptr, *node_names_obj = Py_None,
           *scratch_obj = Py_None;
  const char *fabric = "tcp", *ofi_library = "", *ofi_provider = "efa";
  double spin_us = 0, push_timeout_s = 0, heartbeat_s = 0;
  int trace = 0;
  static const char* kw[] = {"node",        "local_size", "chunk_bytes",     "rank_names", "me",
                             "results",     "spin_us",    "push_timeout_s",
                             "threads",     "nnodes",     "world",           "first_rank", "replicate_bytes",
                             "node_names",  "scratch",    "heartbeat_s",     "trace",      "fabric",
                             "ofi_library", "ofi_provider", nullptr};
  if (!PyArg_ParseTupleAndKeywords(args, kwargs, "LLLOUOdd|L$LLLLOOdpsss", const_cast<char**>(kw), &node,
                                   &local_size, &chunk_bytes, &names_obj, &me_obj, &arena_obj, &spin_us,
                                   &push_timeout_s, &threads, &nnodes, &world, &first_rank,
                                   &replicate_bytes, &node_names_obj, &scratch_obj, &heartbeat_s, &trace, &fabric,
                                   &ofi_library, &ofi_provider))
    return nullptr;
  if (world < 0) world = local_size;
  PyObject* module = PyType_GetModule(type);
  if (!non_negative(module, {node, local_size, chunk_bytes, nnodes, first_rank, replicate_bytes})) return nullptr;
  constexpr long long kU32 = static_cast<long long>(UINT32_MAX);
  if (local_size == 0 || chunk_bytes == 0 || nnodes == 0 || node >= nnodes || nnodes > kU32 || local_size > kU32 ||
      world > kU32 || first_rank + local_size > world)
    return raise_protocol(module, "an impossible job layout");
  PyTypeObject* arena_type = reinterpret_cast<PyTypeObject*>(state(module)->arena_type);
  if (!PyObject_TypeCheck(arena_obj, arena_type) ||
      (scratch_obj != Py_None && !PyObject_TypeCheck(scratch_obj, arena_type))) {
    PyErr_SetString(PyExc_TypeError, "results and scratch must be smddp._engine.Arena objects");
    return nullptr;
  }
  if (spin_us < 0 || push_timeout_s <= 0 || threads < 0 || threads > 256 || heartbeat_s < 0) {
    PyErr_SetString(PyExc_ValueError,
                    "spin_us, heartbeat_s and threads (at most 256) must not be negative, push_timeout_s must be positive");
    return nullptr;
  }
  smddp::PlaneConfig cfg;
  if (!strings(names_obj, &cfg.rank_names) || !text(me_obj, &cfg.me)) return nullptr;
  if (node_names_obj != Py_None && !strings(node_names_obj, &cfg.node_names)) return nullptr;
  if (cfg.rank_names.size() != static_cast<std::size_t>(local_size)) {
    PyErr_SetString(PyExc_ValueError, "one rank name per local rank");
    return nullptr;
  }
  if (nnodes > 1 && (cfg.node_names.size() != static_cast<std::size_t>(nnodes) || scratch_obj == Py_None)) {
    PyErr_SetString(PyExc_ValueError, "a job of several nodes needs node_names (one per node) and scratch");
    return nullptr;
  }
  cfg.topo.node = static_cast<std::uint32_t>(node);
  cfg.topo.nnodes = static_cast<std::uint32_t>(nnodes);
  cfg.topo.local_size = static_cast<std::uint32_t>(local_size);
  cfg.topo.world = static_cast<std::uint32_t>(world);
  cfg.topo.first_rank = static_cast<std::uint32_t>(first_rank);
  cfg.topo.chunk_bytes = static_cast<std::uint64_t>(chunk_bytes);
  cfg.topo.replicate_bytes = static_cast<std::uint64_t>(replicate_bytes);
  cfg.spin_ns = static_cast<std::int64_t>(spin_us * 1e3);
  cfg.push_timeout_ns = static_cast<std::int64_t>(push_timeout_s * 1e9);
  cfg.heartbeat_ns = static_cast<std::int64_t>(heartbeat_s * 1e9);
  cfg.threads = static_cast<std::uint32_t>(threads);
  cfg.trace = trace != 0;
  cfg.fabric = fabric;
  cfg.ofi_library = ofi_library;
  cfg.ofi_provider = ofi_provider;
  smddp::Arena* scratch = scratch_obj == Py_None ? nullptr : reinterpret_cast<ArenaObject*>(scratch_obj)->arena;
  PyObject* self = alloc_instance(type);
  if (self == nullptr) return nullptr;
  try {
    reinterpret_cast<PlaneObject*>(self)->plane =
        new smddp::LocalPlane(std::move(cfg), reinterpret_cast<ArenaObject*>(arena_obj)->arena, scratch);
  } catch (const std::bad_alloc&) {
    Py_DECREF(self);
    return PyErr_NoMemory();
  } catch (const std::system_error& e) {
    Py_DECREF(self);
    PyErr_Format(PyExc_OSError, "cannot start the plane's threads: %s", e.what());
    return nullptr;
  } catch (const std::exception& e) {
    Py_DECREF(self);
    PyErr_Format(PyExc_OSError, "cannot start the plane: %s", e.what());
    return nullptr;
  }
  reinterpret_cast<PlaneObject*>(self)->arena = Py_NewRef(arena_obj);
  reinterpret_cast<PlaneObject*>(self)->scratch = scratch_obj == Py_None ? nullptr : Py_NewRef(scratch_obj);
  return self;
}

void plane_dealloc(PyObject* self) {
  PyTypeObject* type = Py_TYPE(self);
  auto* obj = reinterpret_cast<PlaneObject*>(self);
  if (obj->plane != nullptr) {
    Py_BEGIN_ALLOW_THREADS  // joins the link threads
    delete obj->plane;
    Py_END_ALLOW_THREADS
  }
  Py_XDECREF(obj->arena);
  Py_XDECREF(obj->scratch);
  free_instance(type, self);
  Py_DECREF(type);
}

bool local_arg(PyObject* self, long long v, std::uint32_t* out) {
  (void)self;
  if (v < 0 || v > static_cast<long long>(UINT32_MAX)) {
    PyErr_SetString(PyExc_ValueError, "local rank out of range");
    return false;
  }
  *out = static_cast<std::uint32_t>(v);
  return true;
}

// add_worker(local, rank, name, channel, side): the plane takes the fd `side` over (closed on failure too)
PyObject* plane_add_worker(PyObject* self, PyObject* args) {
  long long local = 0, rank = 0;
  int side = -1;
  PyObject *name_obj = nullptr, *seg_obj = nullptr;
  std::string name;
  std::uint32_t i = 0;
  if (!PyArg_ParseTuple(args, "LLUOi", &local, &rank, &name_obj, &seg_obj, &side)) return nullptr;
  if (side < 0) {
    PyErr_SetString(PyExc_ValueError, "add_worker: side is an fd");
    return nullptr;
  }
  std::shared_ptr<smddp::Segment> seg;
  if (!text(name_obj, &name) || !local_arg(self, local, &i) || !non_negative(module_of(self), {rank}) ||
      !(seg = segment_arg(module_of(self), seg_obj))) {
    ::close(side);
    return nullptr;
  }
  std::string why;
  try {
    why = plane_of(self).add_worker(i, static_cast<std::uint32_t>(rank), name, std::move(seg), side);
  } catch (const std::system_error& e) {
    why = std::string("cannot start its thread: ") + e.what();
  }
  if (!why.empty()) return raise_from(self, why);
  Py_RETURN_NONE;
}

// remove_worker(local) -> whether it said BYE
PyObject* plane_remove_worker(PyObject* self, PyObject* arg) {
  const long long local = PyLong_AsLongLong(arg);
  std::uint32_t i = 0;
  if ((local == -1 && PyErr_Occurred()) || !local_arg(self, local, &i)) return nullptr;
  bool bye = false;
  Py_BEGIN_ALLOW_THREADS
  bye = plane_of(self).remove_worker(i);
  Py_END_ALLOW_THREADS
  return PyBool_FromLong(bye ? 1 : 0);
}

// rank_left_early(local, joined, reason) -> recorded; raises when a collective waits for it
PyObject* plane_rank_left_early(PyObject* self, PyObject* args) {
  long long local = 0;
  int joined = 0;
  PyObject* reason_obj = nullptr;
  std::string reason;
  std::uint32_t i = 0;
  if (!PyArg_ParseTuple(args, "LpU", &local, &joined, &reason_obj) || !text(reason_obj, &reason) ||
      !local_arg(self, local, &i))
    return nullptr;
  bool recorded = false;
  smddp::Verdict v;
  Py_BEGIN_ALLOW_THREADS
  v = plane_of(self).rank_left_early(i, joined != 0, reason, &recorded);
  Py_END_ALLOW_THREADS
  if (!v.ok()) return raise_verdict(self, v);
  return PyBool_FromLong(recorded ? 1 : 0);
}

PyObject* plane_left_early(PyObject* self, PyObject* arg) {
  const long long local = PyLong_AsLongLong(arg);
  std::uint32_t i = 0;
  if ((local == -1 && PyErr_Occurred()) || !local_arg(self, local, &i)) return nullptr;
  return PyBool_FromLong(plane_of(self).left_early(i) ? 1 : 0);
}

PyObject* plane_all_ranks_gone(PyObject* self, PyObject*) {
  return PyBool_FromLong(plane_of(self).all_ranks_gone() ? 1 : 0);
}

// name_rank(local, name)
PyObject* plane_name_rank(PyObject* self, PyObject* args) {
  long long local = 0;
  PyObject* name_obj = nullptr;
  std::string name;
  std::uint32_t i = 0;
  if (!PyArg_ParseTuple(args, "LU", &local, &name_obj) || !text(name_obj, &name) || !local_arg(self, local, &i))
    return nullptr;
  plane_of(self).name_rank(i, name);
  Py_RETURN_NONE;
}

// waiting() -> [(seq, age_s, what, [local ranks not submitted yet])]
PyObject* plane_waiting(PyObject* self, PyObject*) {
  const auto rows = plane_of(self).waiting();
  PyObject* out = PyList_New(0);
  if (out == nullptr) return nullptr;
  for (const auto& w : rows) {
    PyObject* ranks = PyList_New(0);
    if (ranks == nullptr) {
      Py_DECREF(out);
      return nullptr;
    }
    for (std::uint32_t r : w.late) {
      PyObject* v = PyLong_FromUnsignedLong(r);
      if (v == nullptr || PyList_Append(ranks, v) != 0) {
        Py_XDECREF(v);
        Py_DECREF(ranks);
        Py_DECREF(out);
        return nullptr;
      }
      Py_DECREF(v);
    }
    PyObject* nodes = PyList_New(0);
    if (nodes == nullptr) {
      Py_DECREF(ranks);
      Py_DECREF(out);
      return nullptr;
    }
    for (std::uint32_t j : w.late_nodes) {
      PyObject* v = PyLong_FromUnsignedLong(j);
      if (v == nullptr || PyList_Append(nodes, v) != 0) {
        Py_XDECREF(v);
        Py_DECREF(nodes);
        Py_DECREF(ranks);
        Py_DECREF(out);
        return nullptr;
      }
      Py_DECREF(v);
    }
    PyObject* row =
        Py_BuildValue("(KdsNN)", static_cast<unsigned long long>(w.seq), w.age_s, w.what.c_str(), ranks, nodes);
    if (row == nullptr || PyList_Append(out, row) != 0) {
      Py_XDECREF(row);
      Py_DECREF(out);
      return nullptr;
    }
    Py_DECREF(row);
  }
  return out;
}

PyObject* plane_abort(PyObject* self, PyObject*) {
  plane_of(self).abort();
  Py_RETURN_NONE;
}

// next_event(timeout_s) -> None, ("peer", node, type, seq, aux, payload) or ("failed", fault, why)
PyObject* plane_next_event(PyObject* self, PyObject* arg) {
  const double timeout = PyFloat_AsDouble(arg);
  if (timeout == -1.0 && PyErr_Occurred()) return nullptr;
  smddp::PlaneEvent e;
  bool got = false;
  Py_BEGIN_ALLOW_THREADS
  got = plane_of(self).next_event(static_cast<std::int64_t>((timeout > 0 ? timeout : 0) * 1e9), &e);
  Py_END_ALLOW_THREADS
  if (!got) Py_RETURN_NONE;
  if (e.kind == smddp::PlaneEvent::kPeer)
    return Py_BuildValue("(sIBKIy#)", "peer", e.peer, static_cast<unsigned char>(e.header.type),
                         static_cast<unsigned long long>(e.header.seq), e.header.aux, e.payload.data(),
                         static_cast<Py_ssize_t>(e.payload.size()));
  return Py_BuildValue("(sis)", "failed", static_cast<int>(e.verdict.fault), e.verdict.why.c_str());
}

bool node_arg(long long v, std::uint32_t* out) {
  if (v < 0 || v > static_cast<long long>(UINT32_MAX)) {
    PyErr_SetString(PyExc_ValueError, "node out of range");
    return false;
  }
  *out = static_cast<std::uint32_t>(v);
  return true;
}

// add_peer(node, fd): the plane owns fd from now on (closed on failure too)
PyObject* plane_add_peer(PyObject* self, PyObject* args) {
  long long node = 0;
  int fd = -1;
  std::uint32_t j = 0;
  if (!PyArg_ParseTuple(args, "Li", &node, &fd) || !node_arg(node, &j)) return nullptr;
  if (fd < 0) {
    PyErr_SetString(PyExc_ValueError, "not a file descriptor");
    return nullptr;
  }
  std::string why;
  Py_BEGIN_ALLOW_THREADS
  why = plane_of(self).add_peer(j, fd);
  Py_END_ALLOW_THREADS
  if (!why.empty()) return raise_from(self, why);
  Py_RETURN_NONE;
}

// send_control(node, header, payload=b"") -> "" or why not
PyObject* plane_send_control(PyObject* self, PyObject* args) {
  long long node = 0;
  Py_buffer header{}, payload{};
  if (!PyArg_ParseTuple(args, "Ly*|y*", &node, &header, &payload)) return nullptr;
  std::uint32_t j = 0;
  bool ok = node_arg(node, &j);
  if (ok && header.len != static_cast<Py_ssize_t>(smddp::kHeaderSize)) {
    PyErr_SetString(PyExc_ValueError, "a header is 56 bytes");
    ok = false;
  }
  std::string why;
  if (ok) {
    std::string body(static_cast<const char*>(payload.buf != nullptr ? payload.buf : ""),
                     static_cast<std::size_t>(payload.buf != nullptr ? payload.len : 0));
    const auto* h = static_cast<const std::uint8_t*>(header.buf);
    Py_BEGIN_ALLOW_THREADS
    why = plane_of(self).send_control(j, h, std::move(body));
    Py_END_ALLOW_THREADS
  }
  PyBuffer_Release(&header);
  if (payload.buf != nullptr) PyBuffer_Release(&payload);
  return ok ? PyUnicode_FromString(why.c_str()) : nullptr;
}

// flush(timeout_s) -> every control frame left
PyObject* plane_flush(PyObject* self, PyObject* arg) {
  const double timeout = PyFloat_AsDouble(arg);
  if (timeout == -1.0 && PyErr_Occurred()) return nullptr;
  bool done = false;
  Py_BEGIN_ALLOW_THREADS
  done = plane_of(self).flush(static_cast<std::int64_t>((timeout > 0 ? timeout : 0) * 1e9));
  Py_END_ALLOW_THREADS
  return PyBool_FromLong(done ? 1 : 0);
}

// fabric() -> (description, {counter: value}); ("", {}) in a job of one node
PyObject* plane_fabric(PyObject* self, PyObject*) {
  std::string d;
  smddp::FabricCounters c;
  Py_BEGIN_ALLOW_THREADS
  d = plane_of(self).fabric_describe();
  c = plane_of(self).fabric_counters();
  Py_END_ALLOW_THREADS
  if (d.empty()) return Py_BuildValue("(s{})", "");
  return Py_BuildValue("(s#{s:K,s:K,s:K,s:K,s:K})", d.data(), static_cast<Py_ssize_t>(d.size()), "registrations",
                       static_cast<unsigned long long>(c.registrations), "temp_registrations",
                       static_cast<unsigned long long>(c.temp_registrations), "messages_in",
                       static_cast<unsigned long long>(c.messages_in), "messages_out",
                       static_cast<unsigned long long>(c.messages_out), "rejected",
                       static_cast<unsigned long long>(c.rejected));
}

// peer_counters() -> [(node, up, bytes_in, bytes_out, queued)]
PyObject* plane_peer_counters(PyObject* self, PyObject*) {
  const std::vector<smddp::PeerCounters> rows = plane_of(self).peer_counters();
  PyObject* out = PyList_New(static_cast<Py_ssize_t>(rows.size()));
  if (out == nullptr) return nullptr;
  for (std::size_t i = 0; i < rows.size(); i++) {
    const auto& r = rows[i];
    PyObject* row = Py_BuildValue("(INKKK)", r.node, PyBool_FromLong(r.up ? 1 : 0),
                                  static_cast<unsigned long long>(r.bytes_in),
                                  static_cast<unsigned long long>(r.bytes_out), static_cast<unsigned long long>(r.queued));
    if (row == nullptr) {
      Py_DECREF(out);
      return nullptr;
    }
    PyList_SetItem(out, static_cast<Py_ssize_t>(i), row);
  }
  return out;
}

// take_traces() -> [(seq, what, [(phase, start, end)])]
PyObject* plane_take_traces(PyObject* self, PyObject*) {
  const std::vector<smddp::Trace> traces = plane_of(self).take_traces();
  PyObject* out = PyList_New(static_cast<Py_ssize_t>(traces.size()));
  if (out == nullptr) return nullptr;
  for (std::size_t i = 0; i < traces.size(); i++) {
    const auto& t = traces[i];
    PyObject* phases = PyList_New(static_cast<Py_ssize_t>(t.phases.size()));
    if (phases == nullptr) {
      Py_DECREF(out);
      return nullptr;
    }
    for (std::size_t k = 0; k < t.phases.size(); k++) {
      PyObject* ph = Py_BuildValue("(sdd)", smddp::phase_name(t.phases[k].first), t.phases[k].second.first,
                                   t.phases[k].second.second);
      if (ph == nullptr) {
        Py_DECREF(phases);
        Py_DECREF(out);
        return nullptr;
      }
      PyList_SetItem(phases, static_cast<Py_ssize_t>(k), ph);
    }
    PyObject* row = Py_BuildValue("(KsN)", static_cast<unsigned long long>(t.seq), t.what.c_str(), phases);
    if (row == nullptr) {
      Py_DECREF(out);
      return nullptr;
    }
    PyList_SetItem(out, static_cast<Py_ssize_t>(i), row);
  }
  return out;
}

PyObject* plane_queued_tasks(PyObject* self, PyObject*) {
  const auto q = plane_of(self).queued_tasks();
  return Py_BuildValue("(nn)", static_cast<Py_ssize_t>(q.first), static_cast<Py_ssize_t>(q.second));
}

// take_completions() -> [(kind, dtype, nbytes, seconds)]
PyObject* plane_take_completions(PyObject* self, PyObject*) {
  const std::vector<smddp::Completion> done = plane_of(self).take_completions();
  PyObject* out = PyList_New(static_cast<Py_ssize_t>(done.size()));
  if (out == nullptr) return nullptr;
  for (std::size_t i = 0; i < done.size(); i++) {
    PyObject* row = Py_BuildValue("(BBKd)", done[i].kind, done[i].dtype, static_cast<unsigned long long>(done[i].nbytes),
                                  done[i].seconds);
    if (row == nullptr) {
      Py_DECREF(out);
      return nullptr;
    }
    PyList_SetItem(out, static_cast<Py_ssize_t>(i), row);
  }
  return out;
}

// counters() -> (collectives, reduced_bytes, reduce_seconds)
PyObject* plane_counters(PyObject* self, PyObject*) {
  const smddp::PlaneCounters c = plane_of(self).counters();
  return Py_BuildValue("(KKd)", static_cast<unsigned long long>(c.collectives),
                       static_cast<unsigned long long>(c.reduced_bytes), c.reduce_seconds);
}

PyObject* plane_close(PyObject* self, PyObject*) {
  Py_BEGIN_ALLOW_THREADS
  plane_of(self).close();
  Py_END_ALLOW_THREADS
  Py_RETURN_NONE;
}

Py_ssize_t plane_len(PyObject* self) { return static_cast<Py_ssize_t>(plane_of(self).in_flight()); }

PyMethodDef kPlaneMethods[] = {
    {"add_worker", plane_add_worker, METH_VARARGS,
     "add_worker(local, rank, name, channel, side): its thread starts (the plane owns the fd side)"},
    {"remove_worker", plane_remove_worker, METH_O, "remove_worker(local) -> it said BYE (its ring handled first)"},
    {"rank_left_early", plane_rank_left_early, METH_VARARGS,
     "rank_left_early(local, joined, reason) -> recorded; raises if a collective waits for it"},
    {"left_early", plane_left_early, METH_O, "left_early(local) -> its process ended without joining"},
    {"all_ranks_gone", plane_all_ranks_gone, METH_NOARGS, "every local rank said BYE or left early"},
    {"name_rank", plane_name_rank, METH_VARARGS, "name_rank(local, name)"},
    {"waiting", plane_waiting, METH_NOARGS,
     "waiting() -> [(seq, age_s, what, [local ranks not submitted], [peer nodes not heard from])]"},
    {"abort", plane_abort, METH_NOARGS, "abort(): the job failed, handle nothing more"},
    {"next_event", plane_next_event, METH_O,
     "next_event(timeout_s) -> None, ('segment', Segment), ('peer', node, type, seq, aux, payload) or "
     "('failed', fault, why)"},
    {"take_completions", plane_take_completions, METH_NOARGS, "take_completions() -> [(kind, dtype, nbytes, s)]"},
    {"add_peer", plane_add_peer, METH_VARARGS, "add_peer(node, fd): the plane owns the authenticated stream"},
    {"send_control", plane_send_control, METH_VARARGS,
     "send_control(node, header, payload=b'') -> '' or why not: a control frame after what is queued"},
    {"flush", plane_flush, METH_O, "flush(timeout_s) -> every control frame left (or its link went down)"},
    {"fabric", plane_fabric, METH_NOARGS,
     "fabric() -> (description, counters): the fabric to the other daemons (\"\" and {} on one node)"},
    {"peer_counters", plane_peer_counters, METH_NOARGS,
     "peer_counters() -> [(node, up, bytes_in, bytes_out, queued)]"},
    {"take_traces", plane_take_traces, METH_NOARGS, "take_traces() -> [(seq, what, [(phase, start, end)])]"},
    {"queued_tasks", plane_queued_tasks, METH_NOARGS, "queued_tasks() -> (local, server): chunks waiting for a compute thread"},
    {"counters", plane_counters, METH_NOARGS, "counters() -> (collectives, reduced_bytes, reduce_seconds)"},
    {"close", plane_close, METH_NOARGS, "close(): stop every thread"},
    {nullptr, nullptr, 0, nullptr},
};

PyType_Slot kPlaneSlots[] = {
    {Py_tp_new, reinterpret_cast<void*>(plane_new)},
    {Py_tp_dealloc, reinterpret_cast<void*>(plane_dealloc)},
    {Py_tp_methods, kPlaneMethods},
    {Py_sq_length, reinterpret_cast<void*>(plane_len)},
    {Py_tp_doc, const_cast<char*>("The daemon's data plane: rings, reductions, the shard exchange (smddp/engine/local_plane.h).")},
    {0, nullptr},
};

PyType_Spec kPlaneSpec = {
    "smddp._engine.LocalPlane",
    sizeof(PlaneObject),
    0,
    Py_TPFLAGS_DEFAULT | Py_TPFLAGS_IMMUTABLETYPE,
    kPlaneSlots,
};

// ---------------------------------------------------------------------------------- WorkerChannel

struct ChannelObject {
  PyObject_HEAD
  smddp::WorkerChannel* ch;
};

smddp::WorkerChannel& channel_of(PyObject* self) { return *reinterpret_cast<ChannelObject*>(self)->ch; }

// WorkerChannel(name)
PyObject* channel_new(PyTypeObject* type, PyObject* args, PyObject* kwargs) {
  PyObject* name_obj = nullptr;
  std::string name, why;
  static const char* kw[] = {"name", nullptr};
  if (!PyArg_ParseTupleAndKeywords(args, kwargs, "U", const_cast<char**>(kw), &name_obj) || !text(name_obj, &name))
    return nullptr;
  std::unique_ptr<smddp::WorkerChannel> ch = smddp::WorkerChannel::create(name, &why);
  if (!ch) {
    PyErr_SetString(PyExc_OSError, why.c_str());
    return nullptr;
  }
  PyObject* self = alloc_instance(type);
  if (self == nullptr) return nullptr;
  reinterpret_cast<ChannelObject*>(self)->ch = ch.release();
  return self;
}

constexpr void (*channel_dealloc)(PyObject*) = &dealloc_owner<ChannelObject, &ChannelObject::ch>;

PyObject* channel_ring_error(PyObject* self, smddp::RingWait r, const char* what) {
  if (r == smddp::RingWait::kTimeout) {
    PyErr_SetString(PyExc_TimeoutError, what);
    return nullptr;
  }
  return raise_from(self, channel_of(self).why());
}

// push(header, timeout_s, spin_us): TimeoutError when the ring stayed full
PyObject* channel_push(PyObject* self, PyObject* args) {
  Py_buffer view;
  double timeout = 0, spin_us = 0;
  if (!PyArg_ParseTuple(args, "y*dd", &view, &timeout, &spin_us)) return nullptr;
  if (view.len != static_cast<Py_ssize_t>(smddp::kHeaderSize)) {
    PyBuffer_Release(&view);
    PyErr_SetString(PyExc_ValueError, "a descriptor is one 56-byte header");
    return nullptr;
  }
  std::uint8_t frame[smddp::kHeaderSize];
  std::memcpy(frame, view.buf, smddp::kHeaderSize);
  PyBuffer_Release(&view);
  // A ring with room takes the descriptor at once: no need to give up the GIL (and wait to get it
  // back, behind the thread that takes DONEs) for that. Only a full ring's wait releases it.
  smddp::RingWait r = channel_of(self).try_push(frame);
  if (r == smddp::RingWait::kTimeout) {
    Py_BEGIN_ALLOW_THREADS
    r = channel_of(self).push(frame, static_cast<std::int64_t>(timeout * 1e9), static_cast<std::int64_t>(spin_us * 1e3));
    Py_END_ALLOW_THREADS
  }
  if (r != smddp::RingWait::kReady) return channel_ring_error(self, r, "the daemon left this worker's submit ring full");
  Py_RETURN_NONE;
}

// pop(timeout_s, spin_us, waiter) -> the next 56-byte header, or None
PyObject* channel_pop(PyObject* self, PyObject* args) {
  double timeout = 0, spin_us = 0;
  int waiter = 0;
  if (!PyArg_ParseTuple(args, "ddp", &timeout, &spin_us, &waiter)) return nullptr;
  std::uint8_t slot[smddp::kSlotBytes];
  smddp::RingWait r;
  Py_BEGIN_ALLOW_THREADS
  r = channel_of(self).pop(slot, static_cast<std::int64_t>(timeout * 1e9), static_cast<std::int64_t>(spin_us * 1e3),
                           waiter != 0);
  Py_END_ALLOW_THREADS
  if (r == smddp::RingWait::kTimeout) Py_RETURN_NONE;
  if (r == smddp::RingWait::kCorrupt) return raise_from(self, channel_of(self).why());
  return PyBytes_FromStringAndSize(reinterpret_cast<const char*>(slot), static_cast<Py_ssize_t>(smddp::kHeaderSize));
}

PyObject* channel_kick(PyObject* self, PyObject*) {
  channel_of(self).kick();
  Py_RETURN_NONE;
}

PyObject* channel_abort(PyObject* self, PyObject*) {
  channel_of(self).abort();
  Py_RETURN_NONE;
}

// release(rank, seq, nbytes, batch_bytes, timeout_s, spin_us): nbytes < 0 never waits for the next push
PyObject* channel_release(PyObject* self, PyObject* args) {
  long long rank = 0, seq = 0, nbytes = 0, batch = 0;
  double timeout = 0, spin_us = 0;
  if (!PyArg_ParseTuple(args, "LLLLdd", &rank, &seq, &nbytes, &batch, &timeout, &spin_us)) return nullptr;
  if (rank < 0 || rank > static_cast<long long>(UINT32_MAX) || seq < 0 || batch < 0) {
    PyErr_SetString(PyExc_ValueError, "release: rank, seq and batch_bytes are non-negative");
    return nullptr;
  }
  smddp::RingWait r;
  Py_BEGIN_ALLOW_THREADS
  r = channel_of(self).release(static_cast<std::uint32_t>(rank), static_cast<std::uint64_t>(seq), nbytes,
                               static_cast<std::uint64_t>(batch), static_cast<std::int64_t>(timeout * 1e9),
                               static_cast<std::int64_t>(spin_us * 1e3));
  Py_END_ALLOW_THREADS
  if (r != smddp::RingWait::kReady) return channel_ring_error(self, r, "the daemon left this worker's submit ring full");
  Py_RETURN_NONE;
}

// The arguments start() and finish() share: the arena and the collective's SUBMIT, its slot and the
// caller's buffer (`writable` for finish's destination), which must hold exactly the slot's bytes.
struct FastArgs {
  smddp::Arena* arena = nullptr;
  smddp::Slot slot;
  smddp::Header submit;
  Py_buffer buf{};
  bool have_buf = false;
  ~FastArgs() {
    if (have_buf) PyBuffer_Release(&buf);
  }
};

bool fast_args(PyObject* self, PyObject* arena, long long kind, long long segment, long long offset, PyObject* buf,
               bool writable, long long rank, long long seq, long long count, long long dtype, long long op,
               FastArgs* out) {
  if (!PyObject_TypeCheck(arena, reinterpret_cast<PyTypeObject*>(state(module_of(self))->arena_type))) {
    PyErr_SetString(PyExc_TypeError, "expected an smddp._engine.Arena");
    return false;
  }
  if (kind < 0 || kind > 255 || dtype < 0 || dtype > 255 || op < 0 || op > 255 || segment < 0 ||
      segment > static_cast<long long>(UINT32_MAX) || offset < 0 || rank < 0 ||
      rank > static_cast<long long>(UINT32_MAX) || seq < 0 || count < 0) {
    PyErr_SetString(PyExc_ValueError, "a fast collective's fields are out of range");
    return false;
  }
  if (PyObject_GetBuffer(buf, &out->buf, writable ? (PyBUF_C_CONTIGUOUS | PyBUF_WRITABLE) : PyBUF_C_CONTIGUOUS) != 0)
    return false;
  out->have_buf = true;
  out->arena = reinterpret_cast<ArenaObject*>(arena)->arena;
  out->slot = smddp::Slot{static_cast<std::uint32_t>(segment), static_cast<std::uint64_t>(offset),
                          static_cast<std::uint64_t>(out->buf.len)};
  smddp::Header& h = out->submit;
  h.type = smddp::Msg::kSubmit;
  h.kind = static_cast<std::uint8_t>(kind);
  h.dtype = static_cast<std::uint8_t>(dtype);
  h.op = static_cast<std::uint8_t>(op);
  h.sender = static_cast<std::uint32_t>(rank);
  h.seq = static_cast<std::uint64_t>(seq);
  h.shard = static_cast<std::uint32_t>(segment);
  h.offset = static_cast<std::uint64_t>(offset);
  h.count = static_cast<std::uint64_t>(count);
  return true;
}

PyObject* fast_error(PyObject* self, smddp::FastEnd end) {
  if (end == smddp::FastEnd::kRingFull) {
    PyErr_SetString(PyExc_TimeoutError, "the daemon left this worker's submit ring full");
    return nullptr;
  }
  return raise_from(self, channel_of(self).why());
}

// start(arena, kind, segment, offset, src, rank, seq, count, dtype, op, timeout_s, spin_us, async=False):
// copies `src` into the slot and pushes its SUBMIT; TimeoutError when the ring stayed full
PyObject* channel_start(PyObject* self, PyObject* args) {
  PyObject *arena = nullptr, *buf = nullptr;
  long long kind = 0, segment = 0, offset = 0, rank = 0, seq = 0, count = 0, dtype = 0, op = 0;
  double timeout = 0, spin_us = 0;
  int async = 0;
  if (!PyArg_ParseTuple(args, "OLLLOLLLLLdd|p", &arena, &kind, &segment, &offset, &buf, &rank, &seq, &count, &dtype,
                        &op, &timeout, &spin_us, &async))
    return nullptr;
  FastArgs a;
  if (!fast_args(self, arena, kind, segment, offset, buf, false, rank, seq, count, dtype, op, &a)) return nullptr;
  smddp::FastEnd end;
  Py_BEGIN_ALLOW_THREADS
  end = channel_of(self).start(*a.arena, a.slot, static_cast<const std::uint8_t*>(a.buf.buf), a.submit,
                               static_cast<std::int64_t>(timeout * 1e9), static_cast<std::int64_t>(spin_us * 1e3),
                               async != 0);
  Py_END_ALLOW_THREADS
  if (end != smddp::FastEnd::kDone) return fast_error(self, end);
  Py_RETURN_NONE;
}

// finish(arena, kind, segment, offset, dst, rank, seq, count, dtype, op, batch_bytes, timeout_s, spin_us)
// -> True once the result is in `dst`, False when it did not come in time (parked: adopt(seq)), None
// when its DONE went the general way (an asynchronous one's, taken while nobody was in its finish)
PyObject* channel_finish(PyObject* self, PyObject* args) {
  PyObject *arena = nullptr, *buf = nullptr;
  long long kind = 0, segment = 0, offset = 0, rank = 0, seq = 0, count = 0, dtype = 0, op = 0, batch = 0;
  double timeout = 0, spin_us = 0;
  if (!PyArg_ParseTuple(args, "OLLLOLLLLLLdd", &arena, &kind, &segment, &offset, &buf, &rank, &seq, &count, &dtype,
                        &op, &batch, &timeout, &spin_us))
    return nullptr;
  FastArgs a;
  if (!fast_args(self, arena, kind, segment, offset, buf, true, rank, seq, count, dtype, op, &a)) return nullptr;
  if (batch < 0) {
    PyErr_SetString(PyExc_ValueError, "finish: batch_bytes is non-negative");
    return nullptr;
  }
  smddp::FastEnd end;
  Py_BEGIN_ALLOW_THREADS
  end = channel_of(self).finish(*a.arena, a.slot, a.submit, static_cast<std::uint8_t*>(a.buf.buf),
                                static_cast<std::uint64_t>(batch), static_cast<std::int64_t>(timeout * 1e9),
                                static_cast<std::int64_t>(spin_us * 1e3));
  Py_END_ALLOW_THREADS
  if (end == smddp::FastEnd::kDone) Py_RETURN_TRUE;
  if (end == smddp::FastEnd::kTimeout) Py_RETURN_FALSE;
  if (end == smddp::FastEnd::kGone) Py_RETURN_NONE;
  return fast_error(self, end);
}

// A sequence number argument (`what` names the call in the error).
bool seq_arg(PyObject* arg, const char* what, std::uint64_t* out) {
  const long long seq = PyLong_AsLongLong(arg);
  if (seq == -1 && PyErr_Occurred()) return false;
  if (seq < 0) {
    PyErr_Format(PyExc_ValueError, "%s: seq is non-negative", what);
    return false;
  }
  *out = static_cast<std::uint64_t>(seq);
  return true;
}

// collect(seq): an asynchronous fast collective has callbacks waiting: its DONE may go the general way
PyObject* channel_collect(PyObject* self, PyObject* arg) {
  std::uint64_t seq = 0;
  if (!seq_arg(arg, "collect", &seq)) return nullptr;
  channel_of(self).collect(seq);
  Py_RETURN_NONE;
}

// adopt(seq) -> the DONE that already came (56 bytes), or None: the collective goes the general way
PyObject* channel_adopt(PyObject* self, PyObject* arg) {
  std::uint64_t seq = 0;
  if (!seq_arg(arg, "adopt", &seq)) return nullptr;
  std::uint8_t slot[smddp::kSlotBytes];
  if (!channel_of(self).adopt(seq, slot)) Py_RETURN_NONE;
  return PyBytes_FromStringAndSize(reinterpret_cast<const char*>(slot), static_cast<Py_ssize_t>(smddp::kHeaderSize));
}

// attach(segment, rank, timeout_s, spin_us): ATTACH of an input segment (its fd beside it)
PyObject* channel_attach(PyObject* self, PyObject* args) {
  PyObject* seg_obj = nullptr;
  long long rank = 0;
  double timeout = 0, spin_us = 0;
  if (!PyArg_ParseTuple(args, "OLdd", &seg_obj, &rank, &timeout, &spin_us) ||
      !non_negative(module_of(self), {rank}))
    return nullptr;
  std::shared_ptr<smddp::Segment> seg = segment_arg(module_of(self), seg_obj);
  if (!seg) return nullptr;
  smddp::RingWait r;
  Py_BEGIN_ALLOW_THREADS
  r = channel_of(self).attach(*seg, static_cast<std::uint32_t>(rank), static_cast<std::int64_t>(timeout * 1e9),
                              static_cast<std::int64_t>(spin_us * 1e3));
  Py_END_ALLOW_THREADS
  if (r != smddp::RingWait::kReady) return channel_ring_error(self, r, "the daemon left this worker's submit ring full");
  Py_RETURN_NONE;
}

// result(id) -> the result segment the daemon sent as `id`, or None
PyObject* channel_result(PyObject* self, PyObject* arg) {
  const long long id = PyLong_AsLongLong(arg);
  if (id == -1 && PyErr_Occurred()) return nullptr;
  if (id < 0 || id > static_cast<long long>(UINT32_MAX)) Py_RETURN_NONE;
  std::shared_ptr<smddp::Segment> seg = channel_of(self).result(static_cast<std::uint32_t>(id));
  if (!seg) Py_RETURN_NONE;
  return wrap_segment(module_of(self), seg);
}

PyObject* channel_close_daemon_end(PyObject* self, PyObject*) {
  channel_of(self).close_daemon_end();
  Py_RETURN_NONE;
}

PyObject* get_channel_segment(PyObject* self, void*) { return wrap_segment(module_of(self), channel_of(self).segment()); }
PyObject* get_channel_daemon_end(PyObject* self, void*) { return PyLong_FromLong(channel_of(self).daemon_end()); }

PyMethodDef kChannelMethods[] = {
    {"push", channel_push, METH_VARARGS, "push(header, timeout_s, spin_us): onto the submit ring"},
    {"pop", channel_pop, METH_VARARGS,
     "pop(timeout_s, spin_us, waiter) -> the next header of the done ring, or None (waiters go first)"},
    {"kick", channel_kick, METH_NOARGS, "kick(): waiters' pops return, to look at their collective again"},
    {"abort", channel_abort, METH_NOARGS, "abort(): pops return None from now on"},
    {"release", channel_release, METH_VARARGS,
     "release(rank, seq, nbytes, batch_bytes, timeout_s, spin_us): RELEASE a result slot (small ones held)"},
    {"start", channel_start, METH_VARARGS,
     "start(arena, kind, segment, offset, src, rank, seq, count, dtype, op, timeout_s, spin_us, async=False): the "
     "fast path's copy-in and SUBMIT"},
    {"finish", channel_finish, METH_VARARGS,
     "finish(arena, kind, segment, offset, dst, rank, seq, count, dtype, op, batch_bytes, timeout_s, spin_us) -> "
     "bool or None: the fast path's wait, copy-out and RELEASE (None: its DONE went the general way)"},
    {"adopt", channel_adopt, METH_O, "adopt(seq) -> DONE or None: a parked fast collective goes the general way"},
    {"collect", channel_collect, METH_O,
     "collect(seq): an asynchronous fast collective's callbacks wait: its DONE may go the general way"},
    {"attach", channel_attach, METH_VARARGS,
     "attach(segment, rank, timeout_s, spin_us): ATTACH an input segment (its fd on the side socket)"},
    {"result", channel_result, METH_O, "result(id) -> the result segment the daemon sent as id, or None"},
    {"close_daemon_end", channel_close_daemon_end, METH_NOARGS,
     "close_daemon_end(): the daemon's end of the side socket is closed here (once passed)"},
    {nullptr, nullptr, 0, nullptr},
};

PyGetSetDef kChannelGetters[] = {
    {"segment", get_channel_segment, nullptr, "the channel's segment (pass its fd to the daemon)", nullptr},
    {"daemon_end", get_channel_daemon_end, nullptr, "the daemon's end of the side socket (pass it with CHANNEL)",
     nullptr},
    {nullptr, nullptr, nullptr, nullptr, nullptr},
};

PyType_Slot kChannelSlots[] = {
    {Py_tp_new, reinterpret_cast<void*>(channel_new)},
    {Py_tp_dealloc, reinterpret_cast<void*>(channel_dealloc)},
    {Py_tp_methods, kChannelMethods},
    {Py_tp_getset, kChannelGetters},
    {Py_tp_doc, const_cast<char*>("A worker's rings to its daemon (smddp/engine/local_plane.h).")},
    {0, nullptr},
};

PyType_Spec kChannelSpec = {
    "smddp._engine.WorkerChannel",
    sizeof(ChannelObject),
    0,
    Py_TPFLAGS_DEFAULT | Py_TPFLAGS_IMMUTABLETYPE,
    kChannelSlots,
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

// DaemonChannel(segment, side): the segment a worker passed with CHANNEL, attached read-write, and
// the side socket's end that came with it (taken over: closed on failure too)
PyObject* daemon_channel_new(PyTypeObject* type, PyObject* args, PyObject* kwargs) {
  PyObject* seg_obj = nullptr;
  int side = -1;
  static const char* kw[] = {"segment", "side", nullptr};
  if (!PyArg_ParseTupleAndKeywords(args, kwargs, "Oi", const_cast<char**>(kw), &seg_obj, &side)) return nullptr;
  if (side < 0) {
    PyErr_SetString(PyExc_ValueError, "DaemonChannel: side is an fd");
    return nullptr;
  }
  PyObject* module = PyType_GetModule(type);
  std::shared_ptr<smddp::Segment> seg = module == nullptr ? nullptr : segment_arg(module, seg_obj);
  if (seg && (!seg->writable() || seg->size() < smddp::channel_bytes())) {
    PyErr_Format(PyExc_ValueError, "a channel is a writable segment of at least %zu bytes", smddp::channel_bytes());
    seg = nullptr;
  }
  PyObject* self = seg ? alloc_instance(type) : nullptr;
  if (self == nullptr) {
    ::close(side);
    return nullptr;
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

// send_segment(segment, node, timeout_s): a result segment's fd on the side socket, then its SEGMENT
PyObject* daemon_channel_send_segment(PyObject* self, PyObject* args) {
  PyObject* seg_obj = nullptr;
  long long node = 0;
  double timeout = 0;
  if (!PyArg_ParseTuple(args, "OLd", &seg_obj, &node, &timeout) || !non_negative(module_of(self), {node}))
    return nullptr;
  std::shared_ptr<smddp::Segment> seg = segment_arg(module_of(self), seg_obj);
  if (!seg) return nullptr;
  smddp::Header h;
  h.type = smddp::Msg::kSegment;
  h.sender = static_cast<std::uint32_t>(node);
  h.shard = seg->id();
  h.offset = seg->size();
  std::uint8_t frame[smddp::kHeaderSize];
  std::string why = smddp::encode_header(h, frame);
  smddp::RingWait r = smddp::RingWait::kCorrupt;
  Py_BEGIN_ALLOW_THREADS
  {
    DaemonEnd& end = end_of(self);
    std::lock_guard<std::mutex> g(end.push_mu);
    bool gone = false;
    if (why.empty()) why = smddp::send_fd(end.side, seg->id(), seg->size(), seg->fd(), &gone);
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
     "send_segment(segment, node, timeout_s): its fd on the side socket, then SEGMENT on the done ring"},
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
    "smddp._engine.DaemonChannel",
    sizeof(DaemonChannelObject),
    0,
    Py_TPFLAGS_DEFAULT | Py_TPFLAGS_IMMUTABLETYPE,
    kDaemonChannelSlots,
};

// ofi_providers(library) -> [provider names offering reliable-datagram tagged messages], or OSError
PyObject* py_ofi_providers(PyObject*, PyObject* arg) {
  std::string library;
  if (!text(arg, &library)) return nullptr;
  std::vector<std::string> names;
  std::string why;
  Py_BEGIN_ALLOW_THREADS
  why = smddp::ofi_providers(library, &names);
  Py_END_ALLOW_THREADS
  if (!why.empty()) {
    PyErr_SetString(PyExc_OSError, why.c_str());
    return nullptr;
  }
  PyObject* out = PyList_New(0);
  if (out == nullptr) return nullptr;
  for (const auto& n : names) {
    PyObject* u = PyUnicode_FromStringAndSize(n.data(), static_cast<Py_ssize_t>(n.size()));
    if (u == nullptr || PyList_Append(out, u) != 0) {
      Py_XDECREF(u);
      Py_DECREF(out);
      return nullptr;
    }
    Py_DECREF(u);
  }
  return out;
}

PyMethodDef kMethods[] = {
    {"ofi_providers", py_ofi_providers, METH_O,
     "ofi_providers(library) -> providers of that libfabric with reliable-datagram tagged messages"},
    {"decode_header", py_decode_header, METH_O,
     "decode_header(data) -> (type, flags, dtype, op, kind, sender, seq, shard, aux, offset, length, count)"},
    {"encode_header", py_encode_header, METH_VARARGS,
     "encode_header(type, sender, seq, shard, aux, offset, length, count, dtype, op, kind) -> bytes"},
    {"locate_reduce", py_locate_reduce, METH_VARARGS,
     "locate_reduce(count, itemsize, nshards, chunk_elems, shard, byte_offset, byte_length) -> (index, start, end)"},
    {"reduce16", py_reduce16, METH_VARARGS,
     "reduce16(kind, op, inputs, out, divisor) -> block indices (NaN) left for the caller"},
    {"reduce", py_reduce, METH_VARARGS,
     "reduce(dtype, op, inputs, out, divisor) -> None: the daemon's kernel, any wire dtype"},
    {"segment_create", py_segment_create, METH_VARARGS, "segment_create(id, size, name) -> Segment (sealed memfd)"},
    {"segment_attach", py_segment_attach, METH_VARARGS,
     "segment_attach(id, fd, size, writable) -> Segment; takes the fd over"},
    {"has_f16c", py_has_f16c, METH_NOARGS, "Whether float16 can be reduced here (x86-64 with AVX2 and F16C)"},
    {"shard_range", py_shard_range, METH_VARARGS, "shard_range(count, nshards, shard) -> (start, end)"},
    {"locate_block", py_locate_block, METH_VARARGS,
     "locate_block(start, end, chunk_bytes, byte_offset, byte_length) -> index"},
    {nullptr, nullptr, 0, nullptr},
};

int exec_module(PyObject* module) {
  PyObject* errors = PyImport_ImportModule("smddp.errors");
  if (errors == nullptr) return -1;
  state(module)->protocol_error = PyObject_GetAttrString(errors, "ProtocolError");
  state(module)->mismatch_error = PyObject_GetAttrString(errors, "CollectiveMismatchError");
  state(module)->peer_lost_error = PyObject_GetAttrString(errors, "PeerLostError");
  Py_DECREF(errors);
  if (state(module)->protocol_error == nullptr || state(module)->mismatch_error == nullptr ||
      state(module)->peer_lost_error == nullptr)
    return -1;
  state(module)->collective_type = PyType_FromModuleAndSpec(module, &kCollectiveSpec, nullptr);
  if (state(module)->collective_type == nullptr) return -1;
  if (PyModule_AddObjectRef(module, "Collective", state(module)->collective_type) != 0) return -1;
  state(module)->node_state_type = PyType_FromModuleAndSpec(module, &kNodeStateSpec, nullptr);
  if (state(module)->node_state_type == nullptr) return -1;
  if (PyModule_AddObjectRef(module, "NodeState", state(module)->node_state_type) != 0) return -1;
  state(module)->segment_type = PyType_FromModuleAndSpec(module, &kSegmentSpec, nullptr);
  if (state(module)->segment_type == nullptr) return -1;
  if (PyModule_AddObjectRef(module, "Segment", state(module)->segment_type) != 0) return -1;
  state(module)->arena_type = PyType_FromModuleAndSpec(module, &kArenaSpec, nullptr);
  if (state(module)->arena_type == nullptr) return -1;
  if (PyModule_AddObjectRef(module, "Arena", state(module)->arena_type) != 0) return -1;
  state(module)->plane_type = PyType_FromModuleAndSpec(module, &kPlaneSpec, nullptr);
  if (state(module)->plane_type == nullptr) return -1;
  if (PyModule_AddObjectRef(module, "LocalPlane", state(module)->plane_type) != 0) return -1;
  state(module)->channel_type = PyType_FromModuleAndSpec(module, &kChannelSpec, nullptr);
  if (state(module)->channel_type == nullptr) return -1;
  if (PyModule_AddObjectRef(module, "WorkerChannel", state(module)->channel_type) != 0) return -1;
  state(module)->daemon_channel_type = PyType_FromModuleAndSpec(module, &kDaemonChannelSpec, nullptr);
  if (state(module)->daemon_channel_type == nullptr) return -1;
  if (PyModule_AddObjectRef(module, "DaemonChannel", state(module)->daemon_channel_type) != 0) return -1;
  if (PyModule_AddIntConstant(module, "CHANNEL_BYTES", static_cast<long>(smddp::channel_bytes())) != 0) return -1;
  if (PyModule_AddIntConstant(module, "HEADER_SIZE", static_cast<long>(smddp::kHeaderSize)) != 0) return -1;
  if (PyModule_AddIntConstant(module, "BLOCK", static_cast<long>(smddp::kReduceBlock)) != 0) return -1;
  if (PyModule_AddIntConstant(module, "SLOT_ALIGN", static_cast<long>(smddp::kSlotAlign)) != 0) return -1;
  return 0;
}

int traverse(PyObject* module, visitproc visit, void* arg) {
  Py_VISIT(state(module)->protocol_error);
  Py_VISIT(state(module)->mismatch_error);
  Py_VISIT(state(module)->peer_lost_error);
  Py_VISIT(state(module)->collective_type);
  Py_VISIT(state(module)->node_state_type);
  Py_VISIT(state(module)->segment_type);
  Py_VISIT(state(module)->arena_type);
  Py_VISIT(state(module)->plane_type);
  Py_VISIT(state(module)->channel_type);
  Py_VISIT(state(module)->daemon_channel_type);
  return 0;
}

int clear(PyObject* module) {
  Py_CLEAR(state(module)->protocol_error);
  Py_CLEAR(state(module)->mismatch_error);
  Py_CLEAR(state(module)->peer_lost_error);
  Py_CLEAR(state(module)->collective_type);
  Py_CLEAR(state(module)->node_state_type);
  Py_CLEAR(state(module)->segment_type);
  Py_CLEAR(state(module)->arena_type);
  Py_CLEAR(state(module)->plane_type);
  Py_CLEAR(state(module)->channel_type);
  Py_CLEAR(state(module)->daemon_channel_type);
  return 0;
}

void free_module(void* module) { clear(static_cast<PyObject*>(module)); }

PyModuleDef_Slot kSlots[] = {{Py_mod_exec, reinterpret_cast<void*>(exec_module)}, {0, nullptr}};

PyModuleDef kModule = {
    PyModuleDef_HEAD_INIT,
    "smddp._engine",
    "smddp's compiled engine: the data plane's code, called from Python for setup and checks.",
    sizeof(ModuleState),
    kMethods,
    kSlots,
    traverse,
    clear,
    free_module,
};

}  // namespace

PyMODINIT_FUNC PyInit__engine() { return PyModuleDef_Init(&kModule); }
