// smddp._engine: the compiled engine's Python face (plain CPython API: no binding library to pin or ship).
//
// Only this file touches Python objects; the engine's own code (frame.*) never does.
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <cstdint>
#include <initializer_list>
#include <new>
#include <string>
#include <vector>

#include "frame.h"
#include "layout.h"
#include "reduce16.h"

namespace {

struct ModuleState {
  PyObject* protocol_error;  // smddp.errors.ProtocolError, owned by the module
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

// reduce16(kind, op, inputs, out, divisor) -> block indices left for the caller (their result holds a NaN).
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
  const Py_ssize_t k = PySequence_Fast_GET_SIZE(seq);
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
        ok = v.get(PySequence_Fast_GET_ITEM(seq, j), PyBUF_C_CONTIGUOUS);
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
            PyList_SET_ITEM(result, static_cast<Py_ssize_t>(i), b);
          }
        }
      }
    }
  }
  Py_DECREF(seq);
  return result;
}

PyObject* py_has_f16c(PyObject*, PyObject*) { return PyBool_FromLong(smddp::have_f16c() ? 1 : 0); }

PyMethodDef kMethods[] = {
    {"decode_header", py_decode_header, METH_O,
     "decode_header(data) -> (type, flags, dtype, op, kind, sender, seq, shard, aux, offset, length, count)"},
    {"encode_header", py_encode_header, METH_VARARGS,
     "encode_header(type, sender, seq, shard, aux, offset, length, count, dtype, op, kind) -> bytes"},
    {"locate_reduce", py_locate_reduce, METH_VARARGS,
     "locate_reduce(count, itemsize, nshards, chunk_elems, shard, byte_offset, byte_length) -> (index, start, end)"},
    {"reduce16", py_reduce16, METH_VARARGS,
     "reduce16(kind, op, inputs, out, divisor) -> block indices (NaN) left for the caller"},
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
  Py_DECREF(errors);
  if (state(module)->protocol_error == nullptr) return -1;
  if (PyModule_AddIntConstant(module, "HEADER_SIZE", static_cast<long>(smddp::kHeaderSize)) != 0) return -1;
  if (PyModule_AddIntConstant(module, "BLOCK", static_cast<long>(smddp::kReduceBlock)) != 0) return -1;
  return 0;
}

int traverse(PyObject* module, visitproc visit, void* arg) {
  Py_VISIT(state(module)->protocol_error);
  return 0;
}

int clear(PyObject* module) {
  Py_CLEAR(state(module)->protocol_error);
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
