// Plain CPython API helpers of the rigs' smddp_rigs._engine_testing (rigs/smddp_rigs/_engine_testing.cc,
// never shipped), until it too is bound with nanobind as smddp._engine (module.cc) is.
//
// Each module's state begins with `Errors` (smddp.errors' classes the engine raises), so that these
// helpers find them from any module object. Everything here is internal to each extension.
#pragma once

#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <initializer_list>
#include <string>
#include <vector>

#include "node_state.h"

namespace smddp::py {

// The stable ABI (Py_LIMITED_API, where setup.py builds an abi3 wheel) has no access to a type's
// fields: the heap types' allocator and deallocator come through PyType_GetSlot.
inline PyObject* alloc_instance(PyTypeObject* type) {
  auto alloc = reinterpret_cast<allocfunc>(PyType_GetSlot(type, Py_tp_alloc));
  return alloc(type, 0);
}

inline void free_instance(PyTypeObject* type, PyObject* self) {
  auto release = reinterpret_cast<freefunc>(PyType_GetSlot(type, Py_tp_free));
  release(self);
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

// Item i of a list or tuple made by PySequence_Fast (borrowed, as PySequence_Fast_GET_ITEM's).
inline PyObject* fast_item(PyObject* seq, Py_ssize_t i) {
  return PyList_Check(seq) ? PyList_GetItem(seq, i) : PyTuple_GetItem(seq, i);
}

// The first member of each module's state: smddp.errors' classes, owned by the module.
struct Errors {
  PyObject* protocol;   // ProtocolError
  PyObject* mismatch;   // CollectiveMismatchError
  PyObject* peer_lost;  // PeerLostError
  PyObject* timeout;    // CollectiveTimeoutError
};

inline Errors* errors(PyObject* module) { return static_cast<Errors*>(PyModule_GetState(module)); }

// In a module's exec: imports smddp.errors' classes into its state; -1 with the error set.
inline int load_errors(PyObject* module) {
  PyObject* mod = PyImport_ImportModule("smddp.errors");
  if (mod == nullptr) return -1;
  Errors* e = errors(module);
  e->protocol = PyObject_GetAttrString(mod, "ProtocolError");
  e->mismatch = PyObject_GetAttrString(mod, "CollectiveMismatchError");
  e->peer_lost = PyObject_GetAttrString(mod, "PeerLostError");
  e->timeout = PyObject_GetAttrString(mod, "CollectiveTimeoutError");
  Py_DECREF(mod);
  return e->protocol == nullptr || e->mismatch == nullptr || e->peer_lost == nullptr || e->timeout == nullptr ? -1
                                                                                                              : 0;
}

inline int visit_errors(PyObject* module, visitproc visit, void* arg) {
  Errors* e = errors(module);
  Py_VISIT(e->protocol);
  Py_VISIT(e->mismatch);
  Py_VISIT(e->peer_lost);
  Py_VISIT(e->timeout);
  return 0;
}

inline void clear_errors(PyObject* module) {
  Errors* e = errors(module);
  Py_CLEAR(e->protocol);
  Py_CLEAR(e->mismatch);
  Py_CLEAR(e->peer_lost);
  Py_CLEAR(e->timeout);
}

// In a module's exec: the heap type of `spec`, kept in the state's `*slot` and added to the module
// as `name`; -1 with the error set.
inline int add_type(PyObject* module, PyType_Spec* spec, const char* name, PyObject** slot) {
  *slot = PyType_FromModuleAndSpec(module, spec, nullptr);
  if (*slot == nullptr) return -1;
  return PyModule_AddObjectRef(module, name, *slot);
}

inline PyObject* module_of(PyObject* self) { return PyType_GetModule(Py_TYPE(self)); }

// ProtocolError(why); nullptr always (for `return`).
inline PyObject* raise_protocol(PyObject* module, const std::string& why) {
  PyErr_SetString(errors(module)->protocol, why.c_str());
  return nullptr;
}

inline PyObject* raise_from(PyObject* self, const std::string& why) { return raise_protocol(module_of(self), why); }

// A verdict as the smddp.errors exception of its fault; nullptr always (for `return`).
inline PyObject* raise_verdict(PyObject* self, const Verdict& v) {
  Errors* e = errors(module_of(self));
  PyObject* cls = v.fault == Fault::kMismatch ? e->mismatch : v.fault == Fault::kPeerLost ? e->peer_lost : e->protocol;
  PyErr_SetString(cls, v.why.c_str());
  return nullptr;
}

// Every argument as a signed 64-bit integer, refused if negative: values come from the wire.
inline bool non_negative(PyObject* module, std::initializer_list<long long> values) {
  for (long long v : values) {
    if (v < 0) {
      raise_protocol(module, "out of range: a negative offset, length, shard or size");
      return false;
    }
  }
  return true;
}

// A Python str as UTF-8 (for the names in error messages).
inline bool text(PyObject* obj, std::string* out) {
  Py_ssize_t n = 0;
  const char* p = PyUnicode_AsUTF8AndSize(obj, &n);
  if (p == nullptr) return false;
  out->assign(p, static_cast<std::size_t>(n));
  return true;
}

inline bool strings(PyObject* seq, std::vector<std::string>* out) {
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

}  // namespace smddp::py
