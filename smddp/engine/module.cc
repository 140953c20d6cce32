// smddp._engine: the compiled engine's Python face (plain CPython API: no binding library to pin or ship).
//
// It binds what smddp runs; what only tests and rigs call is smddp_rigs._engine_testing
// (rigs/smddp_rigs/_engine_testing.cc), never in the wheel. Only these two files and binding.h (their
// shared helpers) touch Python objects; the engine's own code never does.
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <unistd.h>

#include <chrono>
#include <cstdint>
#include <initializer_list>
#include <map>
#include <memory>
#include <cstring>
#include <new>
#include <system_error>
#include <string>
#include <type_traits>
#include <vector>

#include "arena.h"
#include "binding.h"
#include "channel.h"
#include "fdpass.h"
#include "frame.h"
#include "local_plane.h"
#include "reduce.h"
#include "reduce16.h"

namespace {

using namespace smddp::py;

// The plane's results, as records whose fields have names (struct sequences, as os.stat_result):
// still tuples, so they unpack as before, and `match` takes them by class.
enum Record {
  kPeerFrame,
  kPlaneFailure,
  kPeerCounters,
  kWaiting,
  kCompletion,
  kTrace,
  kPlaneCounters,
  kWorkerTrace,
  kRecords
};

PyStructSequence_Field kPeerFrameFields[] = {
    {"node", "the peer node that sent it"},
    {"type", "its message type (the wire code: STATUS, REPORT, ERROR or BYE)"},
    {"seq", "its header's seq"},
    {"aux", "its header's aux"},
    {"payload", "its payload, whole (bytes)"},
    {nullptr, nullptr}};
PyStructSequence_Field kPlaneFailureFields[] = {
    {"fault", "what failed: 'protocol', 'mismatch' or 'peer_lost' (the smddp.errors class to raise)"},
    {"why", "the message every rank prints"},
    {nullptr, nullptr}};
PyStructSequence_Field kPeerCountersFields[] = {
    {"node", "the peer node"},
    {"up", "its link is handed over and not down"},
    {"bytes_in", "data frames' bytes received from it, headers included"},
    {"bytes_out", "data frames' bytes sent to it, headers included"},
    {"queued", "frames queued to it that have not left yet"},
    {nullptr, nullptr}};
PyStructSequence_Field kWaitingFields[] = {
    {"seq", "the collective's sequence number"},
    {"age_s", "seconds since this daemon first saw it"},
    {"what", "its fingerprint as messages spell it"},
    {"late", "the local ranks that have not submitted it"},
    {"late_nodes", "the peer nodes whose part has not come"},
    {nullptr, nullptr}};
PyStructSequence_Field kCompletionFields[] = {
    {"kind", "the collectives' kind (wire code)"},
    {"dtype", "their dtype (wire code)"},
    {"size_class", "their size class: an index into PlaneConfig.size_limits (its length: larger than all)"},
    {"bucket", "their latency bucket: an index into PlaneConfig.latency_buckets (its length: slower than all)"},
    {"completed", "how many completed"},
    {"seconds", "their latencies (first sight here to DONE), summed"},
    {nullptr, nullptr}};
PyStructSequence_Field kTraceFields[] = {
    {"seq", "the collective's sequence number"},
    {"what", "its fingerprint as messages spell it"},
    {"phases", "[(phase name, start, end)] in wall-clock seconds"},
    {nullptr, nullptr}};
PyStructSequence_Field kWorkerTraceFields[] = {
    {"seq", "the collective's sequence number"},
    {"kind", "its kind (wire code)"},
    {"dtype", "its dtype (wire code)"},
    {"elements", "its SUBMIT's count (`count` would hide tuple.count)"},
    {"start", "when its start began (wall-clock seconds): the copy in"},
    {"submitted", "when its SUBMIT was on the ring"},
    {"done", "when its DONE was taken up"},
    {"copied", "when its result was copied out"},
    {nullptr, nullptr}};
PyStructSequence_Field kPlaneCountersFields[] = {
    {"collectives", "collectives completed"},
    {"reduced_bytes", "input bytes the reductions read"},
    {"reduce_seconds", "seconds the reductions took"},
    {nullptr, nullptr}};

PyStructSequence_Desc kRecordDescs[kRecords] = {
    {"smddp._engine.PeerFrame", "A control frame from a peer daemon (next_event).", kPeerFrameFields, 5},
    {"smddp._engine.PlaneFailure", "The plane's own failure, with its fault (next_event).", kPlaneFailureFields, 2},
    {"smddp._engine.PeerCounters", "One peer daemon's link as the plane counts it (peer_counters).",
     kPeerCountersFields, 5},
    {"smddp._engine.Waiting", "A collective in flight and not done (waiting).", kWaitingFields, 5},
    {"smddp._engine.Completion", "Collectives completed here, summed by kind, dtype, size class and latency bucket (take_completions).", kCompletionFields, 6},
    {"smddp._engine.Trace", "A retired collective's phases (take_traces).", kTraceFields, 3},
    {"smddp._engine.PlaneCounters", "The plane's running totals (counters).", kPlaneCountersFields, 3},
    {"smddp._engine.WorkerTrace", "A fast collective's phases on its worker (WorkerChannel.take_traces).",
     kWorkerTraceFields, 8},
};
const char* const kRecordNames[kRecords] = {"PeerFrame", "PlaneFailure", "PeerCounters", "Waiting",
                                            "Completion", "Trace", "PlaneCounters", "WorkerTrace"};

struct ModuleState {
  Errors errors;              // first (binding.h): smddp.errors' classes, owned by the module
  PyObject* segment_type;     // the Segment class
  PyObject* arena_type;       // the Arena class
  PyObject* plane_type;       // the LocalPlane class
  PyObject* channel_type;     // the WorkerChannel class
  PyObject* started_type;     // the Started class
  PyObject* records[kRecords];  // the record classes (struct sequences)
};

ModuleState* state(PyObject* module) { return static_cast<ModuleState*>(PyModule_GetState(module)); }

// `tuple` (a new reference, or null on an error already raised) as a record of class `which`, its
// items the record's fields in order; null on failure.
PyObject* record(PyObject* self, Record which, PyObject* tuple) {
  if (tuple == nullptr) return nullptr;
  auto* type = reinterpret_cast<PyTypeObject*>(state(module_of(self))->records[which]);
  PyObject* rec = PyStructSequence_New(type);
  if (rec != nullptr) {
    const Py_ssize_t n = PyTuple_Size(tuple);
    for (Py_ssize_t i = 0; i < n; i++) PyStructSequence_SetItem(rec, i, Py_NewRef(PyTuple_GetItem(tuple, i)));
  }
  Py_DECREF(tuple);
  return rec;
}


PyObject* py_has_f16c(PyObject*, PyObject*) { return PyBool_FromLong(smddp::have_f16c() ? 1 : 0); }


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

// A segment's Python face, or None for none.
PyObject* segment_or_none(PyObject* module, const std::shared_ptr<smddp::Segment>& seg) {
  if (!seg) Py_RETURN_NONE;
  return wrap_segment(module, seg);
}

// A segment id argument. False with an error set when `arg` is not an int; false without one for an
// int outside u32, which names no segment.
bool segment_id(PyObject* arg, std::uint32_t* out) {
  const long long id = PyLong_AsLongLong(arg);
  if ((id == -1 && PyErr_Occurred()) || id < 0 || id > static_cast<long long>(UINT32_MAX)) return false;
  *out = static_cast<std::uint32_t>(id);
  return true;
}

// A slot as alloc() returns it: (segment, offset, the segment made for it or None).
PyObject* slot_tuple(PyObject* module, const smddp::Slot& slot, const std::shared_ptr<smddp::Segment>& fresh) {
  PyObject* seg = segment_or_none(module, fresh);
  if (seg == nullptr) return nullptr;
  return Py_BuildValue("(kKN)", static_cast<unsigned long>(slot.segment), static_cast<unsigned long long>(slot.offset),
                       seg);
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
  return slot_tuple(module_of(self), slot, fresh);
}

// segment(id) -> the arena's segment `id`, or None
PyObject* arena_segment(PyObject* self, PyObject* arg) {
  std::uint32_t id = 0;
  if (!segment_id(arg, &id)) return PyErr_Occurred() ? nullptr : Py_NewRef(Py_None);
  return segment_or_none(module_of(self), arena_of(self).segment(id));
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
    {"segment", arena_segment, METH_O, "segment(id) -> the arena's segment id, or None"},
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

// The fields of a PlaneConfig (smddp.daemon.config), read by name: a wrong type or a missing field
// raises TypeError naming it. `ok` turns false at the first error (the rest then read nothing).
struct ConfigFields {
  PyObject* obj;
  bool ok = true;

  PyObject* get(const char* name) {
    if (!ok) return nullptr;
    PyObject* v = PyObject_GetAttrString(obj, name);
    if (v == nullptr) ok = false;
    return v;
  }
  bool wrong(PyObject* v, const char* name, const char* want) {
    Py_XDECREF(v);
    PyErr_Format(PyExc_TypeError, "PlaneConfig.%s must be %s", name, want);
    ok = false;
    return false;
  }
  long long integer(const char* name) {
    PyObject* v = get(name);
    if (v == nullptr) return 0;
    if (!PyLong_Check(v) || PyBool_Check(v)) return wrong(v, name, "an int"), 0;
    const long long x = PyLong_AsLongLong(v);
    Py_DECREF(v);
    if (x == -1 && PyErr_Occurred()) ok = false;
    return x;
  }
  double real(const char* name) {
    PyObject* v = get(name);
    if (v == nullptr) return 0;
    if (!PyFloat_Check(v) && !(PyLong_Check(v) && !PyBool_Check(v))) return wrong(v, name, "a number"), 0;
    const double x = PyFloat_AsDouble(v);
    Py_DECREF(v);
    if (x == -1.0 && PyErr_Occurred()) ok = false;
    return x;
  }
  bool flag(const char* name) {
    PyObject* v = get(name);
    if (v == nullptr) return false;
    if (!PyBool_Check(v)) return wrong(v, name, "a bool");
    const bool x = v == Py_True;
    Py_DECREF(v);
    return x;
  }
  std::string str(const char* name) {
    PyObject* v = get(name);
    std::string out;
    if (v == nullptr) return out;
    if (!PyUnicode_Check(v)) return wrong(v, name, "a str"), out;
    ok = text(v, &out);
    Py_DECREF(v);
    return out;
  }
  // A sequence of numbers, ascending, at most 255 of them (the plane indexes them with a byte).
  template <typename T>
  std::vector<T> ascending(const char* name) {
    PyObject* v = get(name);
    std::vector<T> out;
    if (v == nullptr) return out;
    const char* want = "a sequence of numbers, ascending, at most 255";
    if (PyUnicode_Check(v) || PyBytes_Check(v) || !PySequence_Check(v)) return wrong(v, name, want), out;
    const Py_ssize_t n = PySequence_Size(v);
    bool good = n >= 0 && n <= 255;
    for (Py_ssize_t i = 0; good && i < n; i++) {
      PyObject* x = PySequence_GetItem(v, i);
      good = x != nullptr && !PyBool_Check(x) && (PyLong_Check(x) || (std::is_floating_point_v<T> && PyFloat_Check(x)));
      T value{};
      if (good) {
        if constexpr (std::is_floating_point_v<T>) {
          value = static_cast<T>(PyFloat_AsDouble(x));
        } else {
          const unsigned long long u = PyLong_AsUnsignedLongLong(x);  // a negative one raises OverflowError
          good = !(u == static_cast<unsigned long long>(-1) && PyErr_Occurred());
          value = static_cast<T>(u);
        }
      }
      Py_XDECREF(x);
      if (good && !out.empty() && !(out.back() < value)) good = false;
      if (good) out.push_back(value);
    }
    if (!good) {
      PyErr_Clear();
      return wrong(v, name, want), std::vector<T>{};
    }
    Py_DECREF(v);
    return out;
  }
  std::vector<std::string> strs(const char* name) {
    PyObject* v = get(name);
    std::vector<std::string> out;
    if (v == nullptr) return out;
    if (PyUnicode_Check(v) || PyBytes_Check(v)) return wrong(v, name, "a sequence of str"), out;
    ok = strings(v, &out);
    Py_DECREF(v);
    return out;
  }
};

// LocalPlane(config, results, scratch=None): `config` a PlaneConfig (smddp.daemon.config)
PyObject* plane_new(PyTypeObject* type, PyObject* args, PyObject* kwargs) {
  PyObject *config = nullptr, *arena_obj = nullptr, *scratch_obj = Py_None;
  static const char* kw[] = {"config", "results", "scratch", nullptr};
  if (!PyArg_ParseTupleAndKeywords(args, kwargs, "OO|O", const_cast<char**>(kw), &config, &arena_obj, &scratch_obj))
    return nullptr;
  ConfigFields f{config};
  const long long node = f.integer("node"), local_size = f.integer("local_size"), world = f.integer("world"),
                  first_rank = f.integer("first_rank"), nnodes = f.integer("nnodes"),
                  chunk_bytes = f.integer("chunk_bytes"), replicate_bytes = f.integer("replicate_bytes"),
                  threads = f.integer("threads");
  const double spin_us = f.real("spin_us"), push_timeout_s = f.real("push_timeout_s"),
               heartbeat_s = f.real("heartbeat_s");
  smddp::PlaneConfig cfg;
  cfg.rank_names = f.strs("rank_names");
  cfg.node_names = f.strs("node_names");
  cfg.me = f.str("me");
  cfg.trace = f.flag("trace");
  cfg.fabric = f.str("fabric");
  cfg.ofi_library = f.str("ofi_library");
  cfg.ofi_provider = f.str("ofi_provider");
  cfg.size_limits = f.ascending<std::uint64_t>("size_limits");
  cfg.latency_buckets = f.ascending<double>("latency_buckets");
  if (!f.ok) return nullptr;
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
    PyObject* row = record(
        self, kWaiting, Py_BuildValue("(KdsNN)", static_cast<unsigned long long>(w.seq), w.age_s, w.what.c_str(), ranks, nodes));
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
    return record(self, kPeerFrame,
                  Py_BuildValue("(IBKIy#)", e.peer, static_cast<unsigned char>(e.header.type),
                                static_cast<unsigned long long>(e.header.seq), e.header.aux, e.payload.data(),
                                static_cast<Py_ssize_t>(e.payload.size())));
  const char* fault = e.verdict.fault == smddp::Fault::kMismatch   ? "mismatch"
                      : e.verdict.fault == smddp::Fault::kPeerLost ? "peer_lost"
                                                                   : "protocol";
  return record(self, kPlaneFailure, Py_BuildValue("(ss)", fault, e.verdict.why.c_str()));
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
    PyObject* row = record(self, kPeerCounters,
                           Py_BuildValue("(INKKK)", r.node, PyBool_FromLong(r.up ? 1 : 0),
                                         static_cast<unsigned long long>(r.bytes_in),
                                         static_cast<unsigned long long>(r.bytes_out),
                                         static_cast<unsigned long long>(r.queued)));
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
    PyObject* row =
        record(self, kTrace, Py_BuildValue("(KsN)", static_cast<unsigned long long>(t.seq), t.what.c_str(), phases));
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

// take_completions() -> [(kind, dtype, size_class, bucket, count, seconds)]
PyObject* plane_take_completions(PyObject* self, PyObject*) {
  const std::vector<smddp::Completion> done = plane_of(self).take_completions();
  PyObject* out = PyList_New(static_cast<Py_ssize_t>(done.size()));
  if (out == nullptr) return nullptr;
  for (std::size_t i = 0; i < done.size(); i++) {
    PyObject* row = record(self, kCompletion,
                           Py_BuildValue("(BBBBKd)", done[i].kind, done[i].dtype, done[i].size_class, done[i].bucket,
                                         static_cast<unsigned long long>(done[i].count), done[i].seconds));
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
  return record(self, kPlaneCounters,
                Py_BuildValue("(KKd)", static_cast<unsigned long long>(c.collectives),
                              static_cast<unsigned long long>(c.reduced_bytes), c.reduce_seconds));
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
     "add_worker(local, rank, name, channel, side): its ring is polled from now on (the plane owns the fd side)"},
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
    {"take_completions", plane_take_completions, METH_NOARGS, "take_completions() -> [(kind, dtype, size_class, bucket, count, seconds)]"},
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

// Owns its channel; `keep` (seq -> the destination object or an address's owner, or null before the
// first) holds each collected collective's destination alive while the channel may still copy into
// it (collect): a taker's copy may be running while the caller's own failure handling gives up its
// references. An entry goes when the collective completes here (pop, finish) or with the channel.
// Memory: the channel object owns its WorkerChannel (deleted with it) and a reference to each of
// the PyObject fields. `live` holds every record begin() made until it finishes, so that shutdown
// finds the collectives nobody waited for; records hold the channel too, so the type is tracked by
// the garbage collector (a client that never shut down leaves such cycles).
struct ChannelObject {
  PyObject_HEAD
  smddp::WorkerChannel* ch;
  PyObject* keep;         // seq -> what keeps a collected collective's destination in place
  PyObject* live;         // seq -> its record: begun and not finished
  PyObject* arena;        // bind(): the worker's arena, begin()'s slots
  PyObject* handle_type;  // bind(): the class begin() makes (Started, or a subclass)
  PyObject* ctx;          // bind(): what each record names as its `_client`
  std::uint32_t rank;     // bind(): the sender of begin()'s SUBMITs
  std::uint64_t batch;    // bind(): RELEASE batch bytes
  std::int64_t timeout_ns;  // bind(): the job's timeout (a wait without one; a RELEASE's ring wait)
  std::int64_t spin_ns;     // bind(): how long a wait spins before it sleeps
};

ChannelObject* chan(PyObject* self) { return reinterpret_cast<ChannelObject*>(self); }

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

int channel_traverse(PyObject* self, visitproc visit, void* arg) {
  ChannelObject* obj = chan(self);
  Py_VISIT(Py_TYPE(self));
  Py_VISIT(obj->keep);
  Py_VISIT(obj->live);
  Py_VISIT(obj->arena);
  Py_VISIT(obj->handle_type);
  Py_VISIT(obj->ctx);
  return 0;
}

// What bind() gave that leads back to the client (its ctx, the records of its live table) let go;
// begin() then refuses until bound again.
void let_go(ChannelObject* obj) {
  Py_CLEAR(obj->live);
  Py_CLEAR(obj->ctx);
  Py_CLEAR(obj->handle_type);
}

// Breaks cycles; the WorkerChannel itself goes only with the object (records still hold it).
int channel_clear(PyObject* self) {
  let_go(chan(self));
  return 0;
}

void channel_dealloc(PyObject* self) {
  PyTypeObject* type = Py_TYPE(self);
  ChannelObject* obj = chan(self);
  PyObject_GC_UnTrack(self);
  delete obj->ch;  // no taker is left to copy into what `keep` holds
  Py_XDECREF(obj->keep);
  Py_XDECREF(obj->live);
  Py_XDECREF(obj->arena);
  Py_XDECREF(obj->handle_type);
  Py_XDECREF(obj->ctx);
  free_instance(type, self);
  Py_DECREF(type);
}

// `seq`'s entry of one of the channel's tables (`keep`, `live`) gone, if there is one (no KeyError
// made and dropped for one that is not). A failure leaves it there until the channel goes: memory,
// not correctness.
void discard(PyObject* table, std::uint64_t seq) {
  if (table == nullptr) return;
  PyObject* key = PyLong_FromUnsignedLongLong(seq);
  const int there = key == nullptr ? -1 : PyDict_Contains(table, key);
  if (there < 0 || (there == 1 && PyDict_DelItem(table, key) != 0)) PyErr_Clear();
  Py_XDECREF(key);
}

// The collective `seq` completed here: its destination need not be kept any longer.
void unkeep(PyObject* self, std::uint64_t seq) { discard(reinterpret_cast<ChannelObject*>(self)->keep, seq); }

// A wait's timeout argument in nanoseconds: None is `dflt` (the job's), a negative one 0, and a
// huge one about 30 years (no overflow).
bool timeout_arg(PyObject* arg, std::int64_t dflt, std::int64_t* out) {
  *out = dflt;
  if (arg == Py_None) return true;
  const double t = PyFloat_AsDouble(arg);
  if (t == -1.0 && PyErr_Occurred()) return false;
  *out = !(t > 0) ? 0 : t >= 1e9 ? static_cast<std::int64_t>(1e18) : static_cast<std::int64_t>(t * 1e9);
  return true;
}

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

// pop(timeout_s, spin_us) -> the next 56-byte header (the background taker's: channel.h); or the seq (an int) of a collected
// collective completed here (collect), or (seq, segment, offset, nbytes) of a collected held one whose result
// was located here (reserve_record: the caller copies it on, and RELEASEs it); or None
PyObject* channel_pop(PyObject* self, PyObject* args) {
  double timeout = 0, spin_us = 0;
  if (!PyArg_ParseTuple(args, "dd", &timeout, &spin_us)) return nullptr;
  std::uint8_t slot[smddp::kSlotBytes];
  smddp::RingWait r;
  bool completed = false;
  smddp::Located at;
  Py_BEGIN_ALLOW_THREADS
  r = channel_of(self).pop(slot, static_cast<std::int64_t>(timeout * 1e9), static_cast<std::int64_t>(spin_us * 1e3),
                           &completed, &at);
  Py_END_ALLOW_THREADS
  if (r == smddp::RingWait::kTimeout) Py_RETURN_NONE;
  if (r == smddp::RingWait::kCorrupt) return raise_from(self, channel_of(self).why());
  if (completed) {
    smddp::Header h;  // the channel decoded it: a DONE
    (void)smddp::decode_header(slot, smddp::kHeaderSize, &h);
    unkeep(self, h.seq);
    if (at.held)
      return Py_BuildValue("(KkKK)", static_cast<unsigned long long>(h.seq), static_cast<unsigned long>(at.segment),
                           static_cast<unsigned long long>(at.offset), static_cast<unsigned long long>(at.nbytes));
    return PyLong_FromUnsignedLongLong(h.seq);
  }
  return PyBytes_FromStringAndSize(reinterpret_cast<const char*>(slot), static_cast<Py_ssize_t>(smddp::kHeaderSize));
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

// An address argument (an int instead of a buffer): `count` elements of `dtype` that the caller keeps
// alive and in place (a torch tensor's data_ptr(): its numpy view costs more than the rest of the
// call). The engine cannot check it; only smddp's own callers pass one. False with ValueError (whose
// message starts with `what`) for a zero address, count or dtype, or a length that overflows.
bool address_arg(PyObject* arg, long long dtype, long long count, const char* what, std::uint8_t** data,
                 std::uint64_t* len) {
  const unsigned long long addr = PyLong_AsUnsignedLongLong(arg);
  if (PyErr_Occurred()) return false;
  const std::uint64_t item = smddp::dtype_size(static_cast<std::uint8_t>(dtype));
  if (addr == 0 || item == 0 || count <= 0 || static_cast<std::uint64_t>(count) > UINT64_MAX / item) {
    PyErr_Format(PyExc_ValueError, "%s needs a non-zero address, count and dtype", what);
    return false;
  }
  *data = reinterpret_cast<std::uint8_t*>(static_cast<std::uintptr_t>(addr));
  *len = static_cast<std::uint64_t>(count) * item;
  return true;
}

PyObject* fast_error(PyObject* self, smddp::FastEnd end) {
  if (end == smddp::FastEnd::kRingFull) {
    PyErr_SetString(PyExc_TimeoutError, "the daemon left this worker's submit ring full");
    return nullptr;
  }
  return raise_from(self, channel_of(self).why());
}

// What a fast collective sends, held for one start() or run() call: a buffer, a tuple of buffers sent
// one after another (a fused buffer's parts, never packed first), or the address of `count` elements
// of `dtype` (address_arg). run()'s is also where its result goes (in place): writable.
struct Sources {
  std::vector<Py_buffer> views;
  std::vector<smddp::Source> sources;
  ~Sources() {
    for (Py_buffer& v : views) PyBuffer_Release(&v);
  }
  bool one(PyObject* obj, bool writable) {
    Py_buffer v;
    if (PyObject_GetBuffer(obj, &v, writable ? (PyBUF_C_CONTIGUOUS | PyBUF_WRITABLE) : PyBUF_C_CONTIGUOUS) != 0)
      return false;
    views.push_back(v);
    sources.push_back(smddp::Source{static_cast<const std::uint8_t*>(v.buf), static_cast<std::uint64_t>(v.len)});
    return true;
  }
  bool take(PyObject* src, long long dtype, long long count, bool writable) {
    if (PyLong_Check(src)) {
      std::uint8_t* data = nullptr;
      std::uint64_t len = 0;
      if (!address_arg(src, dtype, count, "a fast collective's address", &data, &len)) return false;
      sources.push_back(smddp::Source{data, len});
      return true;
    }
    if (!PyTuple_Check(src)) return one(src, writable);
    const Py_ssize_t n = PyTuple_Size(src);
    views.reserve(static_cast<std::size_t>(n));
    for (Py_ssize_t i = 0; i < n; i++)
      if (!one(PyTuple_GetItem(src, i), writable)) return false;
    return true;
  }
  std::uint64_t bytes() const {
    std::uint64_t total = 0;
    for (const smddp::Source& x : sources) total += x.nbytes;
    return total;
  }
};

// The SUBMIT start() and run() push, from their arguments (the channel fills in seq, shard and offset).
bool submit_fields(PyObject* self, PyObject* arena, long long kind, long long rank, long long count, long long dtype,
                   long long op, long long root, smddp::Header* h) {
  if (!PyObject_TypeCheck(arena, reinterpret_cast<PyTypeObject*>(state(module_of(self))->arena_type))) {
    PyErr_SetString(PyExc_TypeError, "expected an smddp._engine.Arena");
    return false;
  }
  constexpr long long kU32 = static_cast<long long>(UINT32_MAX);
  if (kind < 0 || kind > 255 || dtype < 0 || dtype > 255 || op < 0 || op > 255 || rank < 0 || rank > kU32 ||
      count < 0 || root < 0 || root > kU32) {
    PyErr_SetString(PyExc_ValueError, "a fast collective's fields are out of range");
    return false;
  }
  h->type = smddp::Msg::kSubmit;
  h->kind = static_cast<std::uint8_t>(kind);
  h->dtype = static_cast<std::uint8_t>(dtype);
  h->op = static_cast<std::uint8_t>(op);
  h->sender = static_cast<std::uint32_t>(rank);
  h->aux = static_cast<std::uint32_t>(root);
  h->count = static_cast<std::uint64_t>(count);
  return true;
}

// A start() that did not start: None where the caller goes the general way (kHeld), else the error.
PyObject* not_started(PyObject* self, smddp::FastEnd end) {
  if (end == smddp::FastEnd::kHeld) Py_RETURN_NONE;
  if (end == smddp::FastEnd::kArena) {
    PyErr_SetString(PyExc_OSError, channel_of(self).why().c_str());
    return nullptr;
  }
  if (end == smddp::FastEnd::kBacklog) {
    PyErr_SetString(errors(module_of(self))->timeout, channel_of(self).backlog_why().c_str());
    return nullptr;
  }
  return fast_error(self, end);
}

// ----------------------------------------------------------------------------------- Started

// A fast collective started asynchronously (begin), and the handle callers wait on: everything its
// wait (finish) and collect take is kept here, so that none of it crosses the binding again, and a
// wait that completes it returns its result without running any Python. begin() makes it as the
// class bind() named (smddp.client.session.EngineHandle subclasses it with the rest of a Handle:
// callbacks, polls, and _settle for every wait that does not end in its result).
//
// Memory: a reference to each PyObject field. It holds its channel and arena (so they outlive it);
// `keep`, which keeps its destination in place (the destination buffer, or an address's owner; the
// channel's own `keep` holds that too once it is collected, as a taker may copy into it after this
// object is gone); `keepalive` (what else the caller keeps until it finishes), dropped then. The
// channel's `live` table holds the record until it finishes.
struct StartedObject {
  PyObject_HEAD
  PyObject* channel;
  PyObject* arena;
  PyObject* keep;
  PyObject* ctx;        // the channel's bind() ctx: the handle's client
  PyObject* result;     // what wait() returns
  PyObject* keepalive;  // dropped once finished
  PyObject* kind;       // as the caller gave them (smddp's enums)
  PyObject* dtype;
  smddp::Header submit;  // as pushed: seq, kind, dtype, count, sender (finish checks its DONE against it)
  smddp::Slot slot;      // its input slot ({kNoSegment, 0, 0}: none)
  smddp::Delivery out;
  std::uint64_t batch;
  std::int64_t timeout_ns;  // the job's: a wait without a timeout; a collected one's RELEASE
  std::int64_t spin_ns;
  bool finished;   // complete: its result is in place, or it failed (`failed`)
  bool failed;     // finished by the job's failure (_complete(True)): its wait raises (_settle)
  bool collected;  // collect() was asked: a wait that completes it runs _completed() (callbacks)
};

StartedObject* started_of(PyObject* self) { return reinterpret_cast<StartedObject*>(self); }

// Tracked by the garbage collector: `keep`, `result` and `ctx` are the caller's objects, which may
// lead back to the handle that is this record.
int started_traverse(PyObject* self, visitproc visit, void* arg) {
  StartedObject* obj = started_of(self);
  Py_VISIT(Py_TYPE(self));
  Py_VISIT(obj->channel);
  Py_VISIT(obj->arena);
  Py_VISIT(obj->keep);
  Py_VISIT(obj->ctx);
  Py_VISIT(obj->result);
  Py_VISIT(obj->keepalive);
  Py_VISIT(obj->kind);
  Py_VISIT(obj->dtype);
  return 0;
}

// Breaks a cycle through the caller's objects only: a record without its channel or arena cannot be
// waited for.
int started_clear(PyObject* self) {
  StartedObject* obj = started_of(self);
  Py_CLEAR(obj->keep);
  Py_CLEAR(obj->ctx);
  Py_CLEAR(obj->result);
  Py_CLEAR(obj->keepalive);
  return 0;
}

void started_dealloc(PyObject* self) {
  PyTypeObject* type = Py_TYPE(self);
  StartedObject* obj = started_of(self);
  PyObject_GC_UnTrack(self);
  Py_XDECREF(obj->channel);
  Py_XDECREF(obj->arena);
  Py_XDECREF(obj->keep);
  Py_XDECREF(obj->ctx);
  Py_XDECREF(obj->result);
  Py_XDECREF(obj->keepalive);
  Py_XDECREF(obj->kind);
  Py_XDECREF(obj->dtype);
  free_instance(type, self);
  Py_DECREF(type);  // (a subclass's instance: its heap type, which Python's own dealloc leaves to us)
}

// Finished: out of the channel's live table (and its `keep`, where it was collected), and what the
// caller kept until then let go.
void retire(StartedObject* obj) {
  obj->finished = true;
  Py_CLEAR(obj->keepalive);
  discard(chan(obj->channel)->live, obj->submit.seq);
  if (obj->collected) unkeep(obj->channel, obj->submit.seq);
}

// What a wait that did not simply end in the result says, handed to the handle's Python:
// self._settle(end, left_s, waited_s, stream) (`waited_s`: the wait's whole timeout), where `end` is True (finished: it failed), False (not in time,
// or the channel aborted), None (its DONE is another thread's to complete) or the exception the
// channel's refusal makes (not raised: _settle fails the client with it).
PyObject* settle(PyObject* self, PyObject* end, double left_s, double waited_s, PyObject* stream) {
  if (end == nullptr) return nullptr;
  PyObject* r = PyObject_CallMethod(self, "_settle", "OddO", end, left_s, waited_s, stream);
  Py_DECREF(end);
  return r;
}

// The exception a refused finish() stands for (a new reference; null with an error set).
PyObject* refusal(StartedObject* obj, smddp::FastEnd end) {
  if (end == smddp::FastEnd::kRingFull)
    return PyObject_CallFunction(PyExc_TimeoutError, "s", "the daemon left this worker's submit ring full");
  const std::string why = channel_of(obj->channel).why();
  return PyObject_CallFunction(errors(module_of(obj->channel))->protocol, "s", why.c_str());
}

// A held collective's result is in place on the host (a device one's, at `at`): the handle's
// _arrived(segment, offset, nbytes) copies it on to the device (its RELEASE goes once that copy is done) and
// returns what its wait returns. Before the record is finished, so that nobody sees it complete
// before its copy-out is under way. False with an error set when that raised.
bool arrived(PyObject* self, const smddp::Located& at) {
  PyObject* r = PyObject_CallMethod(self, "_arrived", "kKK", static_cast<unsigned long>(at.segment),
                                    static_cast<unsigned long long>(at.offset),
                                    static_cast<unsigned long long>(at.nbytes));
  if (r == nullptr) return false;
  StartedObject* obj = started_of(self);
  PyObject* old = obj->result;
  obj->result = r;
  Py_XDECREF(old);
  return true;
}

PyObject* finished_result(PyObject* self, PyObject* stream) {
  StartedObject* obj = started_of(self);
  if (obj->failed) return settle(self, Py_NewRef(Py_True), 0.0, 0.0, stream);
  return Py_NewRef(obj->result != nullptr ? obj->result : Py_None);
}

// wait(timeout=None, stream=None) -> its result, once in place (the DONE checked, the Delivery
// copied, the input slot freed, its RELEASE held or sent: WorkerChannel::finish, GIL released).
// timeout None: the job's. Anything else is the handle's _settle (settle above). `stream` is for
// device buffers' handles; a host collective has nothing to order on one.
PyObject* started_wait(PyObject* self, PyObject* const* args, Py_ssize_t nargs, PyObject* kwnames) {
  PyObject* timeout = Py_None;
  PyObject* stream = Py_None;
  if (nargs > 2) {
    PyErr_SetString(PyExc_TypeError, "wait() takes at most 2 arguments (timeout, stream)");
    return nullptr;
  }
  if (nargs > 0) timeout = args[0];
  if (nargs > 1) stream = args[1];
  const Py_ssize_t nkw = kwnames == nullptr ? 0 : PyTuple_Size(kwnames);
  for (Py_ssize_t i = 0; i < nkw; i++) {
    PyObject* name = PyTuple_GetItem(kwnames, i);
    PyObject** slot = PyUnicode_CompareWithASCIIString(name, "timeout") == 0  ? &timeout
                      : PyUnicode_CompareWithASCIIString(name, "stream") == 0 ? &stream
                                                                             : nullptr;
    if (slot == nullptr || (slot == &timeout && nargs > 0) || (slot == &stream && nargs > 1)) {
      PyErr_Format(PyExc_TypeError, "wait() got an unexpected or repeated keyword argument %R", name);
      return nullptr;
    }
    *slot = args[nargs + i];
  }
  StartedObject* obj = started_of(self);
  std::int64_t timeout_ns = 0;
  if (!timeout_arg(timeout, obj->timeout_ns, &timeout_ns)) return nullptr;
  if (obj->finished) return finished_result(self, stream);
  smddp::WorkerChannel& ch = channel_of(obj->channel);
  smddp::Arena& arena = *reinterpret_cast<ArenaObject*>(obj->arena)->arena;
  smddp::FastEnd end;
  std::int64_t took_ns = 0;
  smddp::Located at;
  Py_BEGIN_ALLOW_THREADS
  const auto t0 = std::chrono::steady_clock::now();
  end = ch.finish(arena, obj->slot, obj->submit, obj->out, obj->batch, timeout_ns, obj->spin_ns, &at);
  took_ns = std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() - t0).count();
  Py_END_ALLOW_THREADS
  if (end == smddp::FastEnd::kDone) {
    if (at.held && !arrived(self, at)) return nullptr;
    if (!obj->finished) {  // (the handle's copy-out may have failed the job, and it with it)
      retire(obj);
      if (obj->collected) {  // callbacks wait for it: the handle runs them (and takes it off its table)
        PyObject* r = PyObject_CallMethod(self, "_completed", nullptr);
        if (r == nullptr) return nullptr;
        Py_DECREF(r);
      }
    }
    return finished_result(self, stream);
  }
  const double left_s = timeout_ns > took_ns ? static_cast<double>(timeout_ns - took_ns) * 1e-9 : 0.0;
  const double waited_s = static_cast<double>(timeout_ns) * 1e-9;
  if (end == smddp::FastEnd::kTimeout) return settle(self, Py_NewRef(Py_False), left_s, waited_s, stream);
  if (end == smddp::FastEnd::kGone) return settle(self, Py_NewRef(Py_None), left_s, waited_s, stream);
  return settle(self, refusal(obj, end), left_s, waited_s, stream);
}

// collect(drop=False) -> None when it has finished already (the caller completes the handle), else
// whether the channel took it: callbacks wait for it, maybe nobody ever waits, so the taker that meets
// its DONE completes it (WorkerChannel::collect; pop() then returns its seq), its destination kept
// alive by the channel until then. Either way, from now on a wait that completes it runs _completed().
// `drop`: its caller was told it failed (a blocking call that timed out), so its result goes nowhere:
// its DONE is still taken and its RELEASE sent, but nothing is copied into the caller's memory, now
// or by a later wait (asked again, it replaces the destination a first collect() gave the channel).
PyObject* started_collect(PyObject* self, PyObject* const* args, Py_ssize_t nargs) {
  if (nargs > 1) {
    PyErr_SetString(PyExc_TypeError, "collect() takes at most 1 argument (drop)");
    return nullptr;
  }
  const int drop = nargs == 1 ? PyObject_IsTrue(args[0]) : 0;
  if (drop < 0) return nullptr;
  StartedObject* obj = started_of(self);
  if (obj->finished) Py_RETURN_NONE;
  if (drop) {
    obj->out.dst = nullptr;  // a held (device) delivery copies nothing here anyway: its _arrived decides
    obj->out.nbytes = 0;
    PyObject* was = obj->result;  // what wait() returns: nobody's now
    obj->result = Py_NewRef(Py_None);
    Py_XDECREF(was);
  }
  obj->collected = true;  // (under the GIL, as a wait's check of it once finish() returned)
  smddp::WorkerChannel::Collected how;
  how.submit = obj->submit;
  how.out = obj->out;
  how.batch_bytes = obj->batch;
  how.timeout_ns = obj->timeout_ns;
  ChannelObject* ch = chan(obj->channel);
  if (ch->keep == nullptr && (ch->keep = PyDict_New()) == nullptr) return nullptr;
  PyObject* key = PyLong_FromUnsignedLongLong(obj->submit.seq);
  if (key == nullptr) return nullptr;
  // Kept before the channel may copy into it (a taker may meet its DONE as soon as collect returns).
  if (PyDict_SetItem(ch->keep, key, obj->keep != nullptr ? obj->keep : Py_None) != 0) {
    Py_DECREF(key);
    return nullptr;
  }
  const bool taken = ch->ch->collect(obj->submit.seq, how);
  if (!taken && PyDict_DelItem(ch->keep, key) != 0) PyErr_Clear();
  Py_DECREF(key);
  return PyBool_FromLong(taken);
}

// give(timeout_s=None): the SUBMIT of a record reserve_record() made goes (WorkerChannel::give: in
// its place on the ring, whatever order records are given in). TimeoutError when the daemon left
// the ring full; CollectiveTimeoutError when the collectives before it had no result in time
// (WorkerChannel::make_room); ProtocolError when the channel refused it (given twice, a broken ring).
PyObject* started_give(PyObject* self, PyObject* const* args, Py_ssize_t nargs) {
  if (nargs > 1) {
    PyErr_SetString(PyExc_TypeError, "give(timeout_s=None)");
    return nullptr;
  }
  StartedObject* obj = started_of(self);
  std::int64_t timeout_ns = 0;
  if (!timeout_arg(nargs > 0 ? args[0] : Py_None, obj->timeout_ns, &timeout_ns)) return nullptr;
  smddp::WorkerChannel& ch = channel_of(obj->channel);
  smddp::RingWait r;
  const smddp::Header submit = obj->submit;
  const std::int64_t spin_ns = obj->spin_ns;
  bool backlog = false;
  Py_BEGIN_ALLOW_THREADS
  r = ch.give(submit, timeout_ns, spin_ns, &backlog);
  Py_END_ALLOW_THREADS
  if (backlog) {
    PyErr_SetString(errors(module_of(obj->channel))->timeout, ch.backlog_why().c_str());
    return nullptr;
  }
  if (r != smddp::RingWait::kReady)
    return channel_ring_error(obj->channel, r, "the daemon left this worker's submit ring full");
  Py_RETURN_NONE;
}

// _complete(failed): finished other than by its own wait (the DONE thread completed it, collected;
// or the job failed): its wait returns at once, or (failed) raises through _settle.
PyObject* started_complete(PyObject* self, PyObject* failed) {
  StartedObject* obj = started_of(self);
  const int f = PyObject_IsTrue(failed);
  if (f < 0) return nullptr;
  if (f) obj->failed = true;
  retire(obj);
  Py_RETURN_NONE;
}

PyObject* get_started_seq(PyObject* self, void*) { return PyLong_FromUnsignedLongLong(started_of(self)->submit.seq); }
PyObject* get_started_count(PyObject* self, void*) {
  return PyLong_FromUnsignedLongLong(started_of(self)->submit.count);
}
PyObject* or_none(PyObject* o) { return Py_NewRef(o != nullptr ? o : Py_None); }
PyObject* get_started_kind(PyObject* self, void*) { return or_none(started_of(self)->kind); }
PyObject* get_started_dtype(PyObject* self, void*) { return or_none(started_of(self)->dtype); }
PyObject* get_started_ctx(PyObject* self, void*) { return or_none(started_of(self)->ctx); }
PyObject* get_started_result(PyObject* self, void*) { return or_none(started_of(self)->result); }
PyObject* get_started_finished(PyObject* self, void*) { return PyBool_FromLong(started_of(self)->finished); }

PyObject* get_started_slot(PyObject* self, void*) {
  const smddp::Slot& s = started_of(self)->slot;
  if (s.segment == smddp::kNoSegment) Py_RETURN_NONE;
  return Py_BuildValue("(kKK)", static_cast<unsigned long>(s.segment), static_cast<unsigned long long>(s.offset),
                       static_cast<unsigned long long>(s.nbytes));
}

PyMethodDef kStartedMethods[] = {
    {"wait", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(started_wait)), METH_FASTCALL | METH_KEYWORDS,
     "wait(timeout=None, stream=None) -> its result once in place (else the handle's _settle says what)"},
    {"collect", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(started_collect)), METH_FASTCALL,
     "collect(drop=False) -> None (finished already) or bool: whoever takes its DONE completes it (pop returns its "
     "seq); drop: its result goes nowhere"},
    {"_complete", started_complete, METH_O, "_complete(failed): finished other than by its own wait"},
    {"give", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(started_give)), METH_FASTCALL,
     "give(timeout_s=None): a reserved record's SUBMIT goes, in its place on the ring"},
    {nullptr, nullptr, 0, nullptr},
};

PyGetSetDef kStartedGetters[] = {
    {"seq", get_started_seq, nullptr, "its sequence number", nullptr},
    {"kind", get_started_kind, nullptr, "its kind, as begin() was given it", nullptr},
    {"dtype", get_started_dtype, nullptr, "its dtype, as begin() was given it", nullptr},
    {"count", get_started_count, nullptr, "its SUBMIT's count", nullptr},
    {"slot", get_started_slot, nullptr, "its input slot (segment, offset, nbytes), or None", nullptr},
    {"finished", get_started_finished, nullptr, "complete: its result in place, or failed", nullptr},
    {"_client", get_started_ctx, nullptr, "the ctx its channel was bound with", nullptr},
    {"_value", get_started_result, nullptr, "what its wait returns", nullptr},
    {nullptr, nullptr, nullptr, nullptr, nullptr},
};

PyType_Slot kStartedSlots[] = {
    {Py_tp_dealloc, reinterpret_cast<void*>(started_dealloc)},
    {Py_tp_traverse, reinterpret_cast<void*>(started_traverse)},
    {Py_tp_clear, reinterpret_cast<void*>(started_clear)},
    {Py_tp_methods, kStartedMethods},
    {Py_tp_getset, kStartedGetters},
    {Py_tp_doc, const_cast<char*>("A fast collective started asynchronously (WorkerChannel.begin), and its handle.")},
    {0, nullptr},
};

PyType_Spec kStartedSpec = {
    "smddp._engine.Started",
    sizeof(StartedObject),
    0,
    Py_TPFLAGS_DEFAULT | Py_TPFLAGS_BASETYPE | Py_TPFLAGS_IMMUTABLETYPE | Py_TPFLAGS_DISALLOW_INSTANTIATION |
        Py_TPFLAGS_HAVE_GC,
    kStartedSlots,
};

// Where a started collective's result goes: `dst` (a writable buffer, or the address of `count`
// elements of `dtype`, whose owner `owner` must then be) takes its bytes from `src_offset` of a
// result of `result_bytes`. Refused (ProtocolError) when that lies outside the result; *keep is what
// keeps the destination alive (a new reference).
bool delivery_arg(PyObject* self, PyObject* dst, long long src_offset, long long result_bytes, long long dtype,
                  long long count, PyObject* owner, smddp::Delivery* out, PyObject** keep) {
  if (src_offset < 0 || result_bytes < 0) {
    PyErr_SetString(PyExc_ValueError, "a delivery's src_offset and result_bytes are non-negative");
    return false;
  }
  if (PyLong_Check(dst)) {
    if (owner == Py_None) {
      PyErr_SetString(PyExc_ValueError, "a destination address needs the object that owns it");
      return false;
    }
    std::uint8_t* data = nullptr;
    std::uint64_t len = 0;
    if (!address_arg(dst, dtype, count, "a destination address", &data, &len)) return false;
    *out = smddp::Delivery{data, len, static_cast<std::uint64_t>(src_offset), static_cast<std::uint64_t>(result_bytes)};
  } else {
    Py_buffer view;
    if (PyObject_GetBuffer(dst, &view, PyBUF_C_CONTIGUOUS | PyBUF_WRITABLE) != 0) return false;
    *out = smddp::Delivery{static_cast<std::uint8_t*>(view.buf), static_cast<std::uint64_t>(view.len),
                           static_cast<std::uint64_t>(src_offset), static_cast<std::uint64_t>(result_bytes)};
    PyBuffer_Release(&view);  // the object itself is kept: its memory stays where it is
  }
  if (out->src_offset > out->result_bytes || out->nbytes > out->result_bytes - out->src_offset) {
    raise_from(self, "a fast collective's destination lies outside its result");
    return false;
  }
  *keep = Py_NewRef(owner != Py_None ? owner : dst);
  return true;
}

// bind(arena, rank, batch_bytes, timeout_s, spin_us, handle_type, ctx): what every begin() of this
// worker shares, given once: its arena, its rank, the RELEASE batch, the job's timeout and spin, the
// class of the records begin() makes (Started or a subclass) and the ctx each names as its client.
PyObject* channel_bind(PyObject* self, PyObject* args) {
  PyObject *arena = nullptr, *handle_type = nullptr, *ctx = nullptr;
  long long rank = 0, batch = 0;
  double timeout = 0, spin_us = 0;
  if (!PyArg_ParseTuple(args, "OLLddOO", &arena, &rank, &batch, &timeout, &spin_us, &handle_type, &ctx))
    return nullptr;
  ModuleState* st = state(module_of(self));
  if (!PyObject_TypeCheck(arena, reinterpret_cast<PyTypeObject*>(st->arena_type))) {
    PyErr_SetString(PyExc_TypeError, "bind: expected an smddp._engine.Arena");
    return nullptr;
  }
  if (!PyType_Check(handle_type) || !PyType_IsSubtype(reinterpret_cast<PyTypeObject*>(handle_type),
                                                      reinterpret_cast<PyTypeObject*>(st->started_type))) {
    PyErr_SetString(PyExc_TypeError, "bind: handle_type is smddp._engine.Started or a subclass of it");
    return nullptr;
  }
  if (rank < 0 || rank > static_cast<long long>(UINT32_MAX) || batch < 0 || !(timeout >= 0) || !(spin_us >= 0)) {
    PyErr_SetString(PyExc_ValueError, "bind: rank, batch_bytes, timeout_s and spin_us are non-negative");
    return nullptr;
  }
  PyObject* live = PyDict_New();
  if (live == nullptr) return nullptr;
  ChannelObject* obj = chan(self);
  // (A second bind() replaces the first: records already made keep what they hold.)
  PyObject* old[] = {obj->live, obj->arena, obj->handle_type, obj->ctx};
  obj->live = live;
  obj->arena = Py_NewRef(arena);
  obj->handle_type = Py_NewRef(handle_type);
  obj->ctx = Py_NewRef(ctx);
  for (PyObject* o : old) Py_XDECREF(o);
  obj->rank = static_cast<std::uint32_t>(rank);
  obj->batch = static_cast<std::uint64_t>(batch);
  obj->timeout_ns = static_cast<std::int64_t>(timeout * 1e9);
  obj->spin_ns = static_cast<std::int64_t>(spin_us * 1e3);
  Py_RETURN_NONE;
}

// unbind(): what bind() gave, and the live table, let go (shutdown, once it has waited): the channel
// holds its client through them, and the client holds the channel.
PyObject* channel_unbind(PyObject* self, PyObject*) {
  let_go(chan(self));
  Py_RETURN_NONE;
}

// live() -> [record]: what begin() made and nothing has finished yet.
PyObject* channel_live(PyObject* self, PyObject*) {
  PyObject* live = chan(self)->live;
  return live == nullptr ? PyList_New(0) : PyDict_Values(live);
}

// An integer argument of begin() (IntEnums included).
bool int_arg(PyObject* arg, long long* out) {
  *out = PyLong_AsLongLong(arg);
  return !(*out == -1 && PyErr_Occurred());
}

// The rest of a record whose collective is under way (begin, resume): what its wait and collect take,
// the bound channel's settings, and its place in the live table until it finishes (shutdown waits for
// it; should that insert fail, for want of memory, the collective still runs: only shutdown would not
// know it). Nothing here can fail.
void fill_record(PyObject* self, PyObject* started, const smddp::Header& h, const smddp::Slot& slot,
                 const smddp::Delivery& out, PyObject* kind, PyObject* dtype, PyObject* result, PyObject* keepalive) {
  ChannelObject* co = chan(self);
  StartedObject* obj = started_of(started);
  obj->channel = Py_NewRef(self);
  obj->arena = Py_NewRef(co->arena);
  obj->ctx = Py_NewRef(co->ctx);
  obj->result = Py_NewRef(result);
  obj->keepalive = Py_NewRef(keepalive);
  obj->kind = Py_NewRef(kind);
  obj->dtype = Py_NewRef(dtype);
  obj->submit = h;
  obj->slot = slot;
  obj->out = out;
  obj->batch = co->batch;
  obj->timeout_ns = co->timeout_ns;
  obj->spin_ns = co->spin_ns;
  PyObject* key = PyLong_FromUnsignedLongLong(h.seq);
  if (key == nullptr || co->live == nullptr || PyDict_SetItem(co->live, key, started) != 0) PyErr_Clear();
  Py_XDECREF(key);
}

// begin(kind, src, count, dtype, op, root, dst, src_offset, result_bytes, owner, result, keepalive) ->
// a record of bind()'s class, or None (held: starts are closed, shutting down): a slot of the bound
// arena for `src` (Sources; none when it is empty), ATTACHed if new, `src` copied in and the SUBMIT
// pushed under the channel's next sequence number (WorkerChannel::start, asynchronous); its result
// goes to `dst` (delivery_arg) once something waits for it or collects it, and its wait returns
// `result`. Nothing starts when the destination lies outside the result (ProtocolError).
// TimeoutError when the ring stayed full, OSError when the arena cannot grow.
PyObject* channel_begin(PyObject* self, PyObject* const* args, Py_ssize_t nargs) {
  if (nargs != 12) {
    PyErr_SetString(PyExc_TypeError,
                    "begin(kind, src, count, dtype, op, root, dst, src_offset, result_bytes, owner, result, keepalive)");
    return nullptr;
  }
  ChannelObject* co = chan(self);
  if (co->handle_type == nullptr) {
    PyErr_SetString(PyExc_RuntimeError, "begin: the channel is not bound (bind)");
    return nullptr;
  }
  long long kind = 0, count = 0, dtype = 0, op = 0, root = 0, src_offset = 0, result_bytes = 0;
  if (!int_arg(args[0], &kind) || !int_arg(args[2], &count) || !int_arg(args[3], &dtype) || !int_arg(args[4], &op) ||
      !int_arg(args[5], &root) || !int_arg(args[7], &src_offset) || !int_arg(args[8], &result_bytes))
    return nullptr;
  PyObject* src = args[1];
  PyObject* dst = args[6];
  PyObject* owner = args[9];
  smddp::Header h;
  if (!submit_fields(self, co->arena, kind, co->rank, count, dtype, op, root, &h)) return nullptr;
  smddp::Delivery out;
  PyObject* keep = nullptr;
  if (!delivery_arg(self, dst, src_offset, result_bytes, dtype, count, owner, &out, &keep)) return nullptr;
  Sources sources;
  if (!sources.take(src, dtype, count, false)) {
    Py_DECREF(keep);
    return nullptr;
  }
  auto* type = reinterpret_cast<PyTypeObject*>(co->handle_type);
  PyObject* started = alloc_instance(type);  // made first: once pushed, nothing may fail
  if (started == nullptr) {
    Py_DECREF(keep);
    return nullptr;
  }
  started_of(started)->keep = keep;  // (the rest zeroed by the allocation: a failed start leaves nothing else)
  smddp::Arena& a = *reinterpret_cast<ArenaObject*>(co->arena)->arena;
  smddp::Slot slot;
  smddp::FastEnd end;
  Py_BEGIN_ALLOW_THREADS
  end = co->ch->start(a, sources.sources.data(), sources.sources.size(), &h, &slot, co->timeout_ns, co->spin_ns, true);
  Py_END_ALLOW_THREADS
  if (end != smddp::FastEnd::kDone) {
    Py_DECREF(started);
    return not_started(self, end);
  }
  fill_record(self, started, h, slot, out, args[0], args[3], args[10], args[11]);
  return started;
}

// run(kind, buf, count, dtype, op, timeout_s) -> True once the collective is complete and its result
// back in `buf` (in place: an all-reduce; a barrier's is empty), its slot (from the bound arena) freed
// and its RELEASE held; None, with nothing done, once starts are closed (shutting down); (seq, segment,
// offset, nbytes) when it did not complete in time (parked: resume, or adopt(seq)). start() and finish() on one
// thread, the GIL released once. timeout_s None: the job's (bind()); the rest as bind() gave it.
PyObject* channel_run(PyObject* self, PyObject* const* args, Py_ssize_t nargs) {
  if (nargs != 6) {
    PyErr_SetString(PyExc_TypeError, "run(kind, buf, count, dtype, op, timeout_s)");
    return nullptr;
  }
  ChannelObject* co = chan(self);
  if (co->arena == nullptr) {
    PyErr_SetString(PyExc_RuntimeError, "run: the channel is not bound (bind)");
    return nullptr;
  }
  long long kind = 0, count = 0, dtype = 0, op = 0;
  if (!int_arg(args[0], &kind) || !int_arg(args[2], &count) || !int_arg(args[3], &dtype) || !int_arg(args[4], &op))
    return nullptr;
  std::int64_t timeout_ns = 0;
  if (!timeout_arg(args[5], co->timeout_ns, &timeout_ns)) return nullptr;
  smddp::Header h;
  if (!submit_fields(self, co->arena, kind, co->rank, count, dtype, op, 0, &h)) return nullptr;
  PyObject* buf = args[1];
  Sources sources;
  if (PyTuple_Check(buf)) {
    PyErr_SetString(PyExc_TypeError, "run: one buffer, its result in place");
    return nullptr;
  }
  if (!sources.take(buf, dtype, count, true)) return nullptr;
  smddp::Arena& a = *reinterpret_cast<ArenaObject*>(co->arena)->arena;
  const smddp::Source& in = sources.sources.front();
  const smddp::Delivery out{const_cast<std::uint8_t*>(in.data), in.nbytes, 0, in.nbytes};
  const std::int64_t spin_ns = co->spin_ns;
  const std::uint64_t batch = co->batch;
  smddp::WorkerChannel& ch = *co->ch;
  smddp::Slot slot;
  smddp::FastEnd end;
  smddp::WorkerChannel::Streamed streamed;  // a streaming all-reduce's result copied out while it copies in
  Py_BEGIN_ALLOW_THREADS
  end = ch.start(a, &in, 1, &h, &slot, timeout_ns, spin_ns, false, &out, &streamed);
  if (end == smddp::FastEnd::kDone)
    end = ch.finish(a, slot, h, out, batch, timeout_ns, spin_ns, nullptr, &streamed);
  else
    h.seq = 0;  // not started
  Py_END_ALLOW_THREADS
  if (end == smddp::FastEnd::kDone) Py_RETURN_TRUE;
  if (h.seq == 0) return not_started(self, end);
  if (end == smddp::FastEnd::kTimeout)
    return Py_BuildValue("(KkKK)", static_cast<unsigned long long>(h.seq), static_cast<unsigned long>(slot.segment),
                         static_cast<unsigned long long>(slot.offset), static_cast<unsigned long long>(slot.nbytes));
  return fast_error(self, end);
}

// resume(seq, segment, offset, nbytes, kind, count, dtype, op, dst, result) -> a record of bind()'s class,
// or None: a blocking collective that run() parked (its (seq, segment, offset, nbytes)) as an
// asynchronous one from now on (WorkerChannel::unblock), its result to `dst` (in place: the buffer
// run() was given, or a view of the memory at its address; empty for a barrier), as begin()'s records
// are: a wait, or collect() and the taker of its DONE, completes it in the engine. None when it is no
// longer the fast path's (nothing then completes it here). Its phases stay the engine's (timeline).
PyObject* channel_resume(PyObject* self, PyObject* args) {
  unsigned long long seq = 0, offset = 0, nbytes = 0;
  unsigned long segment = 0;
  long long count = 0, dtype = 0, op = 0;
  PyObject *kind_obj = nullptr, *dtype_obj = nullptr, *dst = nullptr, *result = nullptr;
  if (!PyArg_ParseTuple(args, "KkKKOLOLOO", &seq, &segment, &offset, &nbytes, &kind_obj, &count, &dtype_obj, &op,
                        &dst, &result))
    return nullptr;
  ChannelObject* co = chan(self);
  if (co->handle_type == nullptr) {
    PyErr_SetString(PyExc_RuntimeError, "resume: the channel is not bound (bind)");
    return nullptr;
  }
  long long kind = 0;
  if (!int_arg(kind_obj, &kind) || !int_arg(dtype_obj, &dtype)) return nullptr;
  smddp::Header h;
  if (!submit_fields(self, co->arena, kind, co->rank, count, dtype, op, 0, &h)) return nullptr;
  h.seq = seq;
  h.shard = static_cast<std::uint32_t>(segment);
  h.offset = offset;
  // run()'s result goes back whole into its buffer: an all-reduce's count of its dtype, a barrier's none.
  const auto result_bytes = static_cast<long long>(smddp::dtype_size(static_cast<std::uint8_t>(dtype))) * count;
  smddp::Delivery out;
  PyObject* keep = nullptr;
  if (!delivery_arg(self, dst, 0, result_bytes, dtype, count, Py_None, &out, &keep)) return nullptr;
  auto* type = reinterpret_cast<PyTypeObject*>(co->handle_type);
  PyObject* started = alloc_instance(type);  // made first: once unblocked, nothing may fail
  if (started == nullptr) {
    Py_DECREF(keep);
    return nullptr;
  }
  started_of(started)->keep = keep;
  if (!co->ch->unblock(seq)) {
    Py_DECREF(started);
    Py_RETURN_NONE;
  }
  fill_record(self, started, h, smddp::Slot{static_cast<std::uint32_t>(segment), offset, nbytes}, out, kind_obj,
              dtype_obj, result, Py_None);
  return started;
}

// reserve_record(kind, count, dtype, op, root, slot, result_bytes, result, keepalive, handle_type) ->
// a record of `handle_type` (Started or a subclass) for a collective whose data the caller puts in
// `slot` (segment, offset, nbytes) itself, or none (None: a broadcast's receiver, or nothing to send),
// under the channel's next sequence number (WorkerChannel::reserve_fast): the engine's from now on.
// Its SUBMIT goes when the caller gives it (give()); its DONE is checked and its result located by
// whoever takes it (its wait, or collect()'s taker), not copied or RELEASEd: the record's
// _arrived(segment, offset, nbytes) does that (the device path). Its wait returns what _arrived returned.
PyObject* channel_reserve_record(PyObject* self, PyObject* const* args, Py_ssize_t nargs) {
  if (nargs != 10) {
    PyErr_SetString(PyExc_TypeError,
                    "reserve_record(kind, count, dtype, op, root, slot, result_bytes, result, keepalive, handle_type)");
    return nullptr;
  }
  ChannelObject* co = chan(self);
  if (co->handle_type == nullptr) {
    PyErr_SetString(PyExc_RuntimeError, "reserve_record: the channel is not bound (bind)");
    return nullptr;
  }
  long long kind = 0, count = 0, dtype = 0, op = 0, root = 0, result_bytes = 0;
  if (!int_arg(args[0], &kind) || !int_arg(args[1], &count) || !int_arg(args[2], &dtype) || !int_arg(args[3], &op) ||
      !int_arg(args[4], &root) || !int_arg(args[6], &result_bytes))
    return nullptr;
  if (result_bytes < 0) {
    PyErr_SetString(PyExc_ValueError, "reserve_record: result_bytes is non-negative");
    return nullptr;
  }
  smddp::Header h;
  if (!submit_fields(self, co->arena, kind, co->rank, count, dtype, op, root, &h)) return nullptr;
  smddp::Slot slot{smddp::kNoSegment, 0, 0};
  if (args[5] != Py_None) {
    unsigned long seg = 0;
    unsigned long long offset = 0, nbytes = 0;
    if (!PyArg_ParseTuple(args[5], "kKK", &seg, &offset, &nbytes)) return nullptr;
    slot = smddp::Slot{static_cast<std::uint32_t>(seg), offset, nbytes};
  }
  PyObject* type = args[9];
  ModuleState* st = state(module_of(self));
  if (!PyType_Check(type) ||
      !PyType_IsSubtype(reinterpret_cast<PyTypeObject*>(type), reinterpret_cast<PyTypeObject*>(st->started_type))) {
    PyErr_SetString(PyExc_TypeError, "reserve_record: handle_type is smddp._engine.Started or a subclass of it");
    return nullptr;
  }
  PyObject* started = alloc_instance(reinterpret_cast<PyTypeObject*>(type));  // made first: nothing may fail after
  if (started == nullptr) return nullptr;
  h.seq = co->ch->reserve_fast();
  h.shard = slot.segment;
  h.offset = slot.offset;
  smddp::Delivery out;
  out.result_bytes = static_cast<std::uint64_t>(result_bytes);
  out.hold = true;
  fill_record(self, started, h, slot, out, args[0], args[2], args[7], args[8]);
  return started;
}

// close_starts(): no fast collective starts from now on (start and run answer None)
PyObject* channel_close_starts(PyObject* self, PyObject*) {
  channel_of(self).close_starts();
  Py_RETURN_NONE;
}

// blocking() -> [seq]: the blocking fast collectives (run, or start without async) not finished
PyObject* channel_blocking(PyObject* self, PyObject*) {
  const std::vector<std::uint64_t> seqs = channel_of(self).blocking();
  PyObject* out = PyList_New(static_cast<Py_ssize_t>(seqs.size()));
  if (out == nullptr) return nullptr;
  for (std::size_t i = 0; i < seqs.size(); i++) {
    PyObject* v = PyLong_FromUnsignedLongLong(seqs[i]);
    if (v == nullptr || PyList_SetItem(out, static_cast<Py_ssize_t>(i), v) != 0) {  // (steals v)
      Py_DECREF(out);
      return nullptr;
    }
  }
  return out;
}

// alloc(arena, nbytes, rank, timeout_s, spin_us) -> (segment, offset, new Segment or None): a slot for
// the general way's next SUBMIT, its segment ATTACHed first when new (WorkerChannel::alloc)
PyObject* channel_alloc(PyObject* self, PyObject* args) {
  PyObject* arena = nullptr;
  long long nbytes = 0, rank = 0;
  double timeout = 0, spin_us = 0;
  if (!PyArg_ParseTuple(args, "OLLdd", &arena, &nbytes, &rank, &timeout, &spin_us)) return nullptr;
  if (!PyObject_TypeCheck(arena, reinterpret_cast<PyTypeObject*>(state(module_of(self))->arena_type))) {
    PyErr_SetString(PyExc_TypeError, "expected an smddp._engine.Arena");
    return nullptr;
  }
  if (nbytes < 0 || rank < 0 || rank > static_cast<long long>(UINT32_MAX)) {
    PyErr_SetString(PyExc_ValueError, "alloc: nbytes and rank are non-negative");
    return nullptr;
  }
  smddp::Arena& a = *reinterpret_cast<ArenaObject*>(arena)->arena;
  smddp::Slot slot;
  std::shared_ptr<smddp::Segment> fresh;
  std::string arena_why;
  smddp::RingWait r = smddp::RingWait::kReady;
  bool oom = false;
  Py_BEGIN_ALLOW_THREADS
  try {
    r = channel_of(self).alloc(a, static_cast<std::uint64_t>(nbytes), static_cast<std::uint32_t>(rank),
                               static_cast<std::int64_t>(timeout * 1e9), static_cast<std::int64_t>(spin_us * 1e3),
                               &slot, &fresh, &arena_why);
  } catch (const std::bad_alloc&) {
    oom = true;
  }
  Py_END_ALLOW_THREADS
  if (oom) return PyErr_NoMemory();
  if (!arena_why.empty()) {
    PyErr_SetString(PyExc_OSError, arena_why.c_str());
    return nullptr;
  }
  if (r != smddp::RingWait::kReady) return channel_ring_error(self, r, "the daemon left this worker's submit ring full");
  return slot_tuple(module_of(self), slot, fresh);
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

// adopt(seq) -> the DONE that already came (56 bytes), or None: the collective goes the general way
PyObject* channel_adopt(PyObject* self, PyObject* arg) {
  std::uint64_t seq = 0;
  if (!seq_arg(arg, "adopt", &seq)) return nullptr;
  std::uint8_t slot[smddp::kSlotBytes];
  if (!channel_of(self).adopt(seq, slot)) Py_RETURN_NONE;
  return PyBytes_FromStringAndSize(reinterpret_cast<const char*>(slot), static_cast<Py_ssize_t>(smddp::kHeaderSize));
}

// set_trace(on): keep every fast collective's phases for the timeline (take_traces), or stop
PyObject* channel_set_trace(PyObject* self, PyObject* arg) {
  const int on = PyObject_IsTrue(arg);
  if (on < 0) return nullptr;
  channel_of(self).set_trace(on != 0);
  Py_RETURN_NONE;
}

// set_stream(on): large all-reduces stream through the channel's stream block (a job of one node)
PyObject* channel_set_stream(PyObject* self, PyObject* arg) {
  const int on = PyObject_IsTrue(arg);
  if (on < 0) return nullptr;
  channel_of(self).set_stream(on != 0);
  Py_RETURN_NONE;
}

// streamed() -> (copied in as it went, copied out before the DONE): bytes, since the channel began
PyObject* channel_streamed(PyObject* self, PyObject*) {
  const smddp::WorkerChannel& ch = channel_of(self);
  return Py_BuildValue("(KK)", static_cast<unsigned long long>(ch.streamed_in()),
                       static_cast<unsigned long long>(ch.streamed_out()));
}

// take_traces() -> ([WorkerTrace], dropped): the phases kept since the last take, and how many were not
PyObject* channel_take_traces(PyObject* self, PyObject*) {
  std::uint64_t dropped = 0;
  const std::vector<smddp::ChannelTrace> traces = channel_of(self).take_traces(&dropped);
  PyObject* out = PyList_New(static_cast<Py_ssize_t>(traces.size()));
  if (out == nullptr) return nullptr;
  for (std::size_t i = 0; i < traces.size(); i++) {
    const smddp::ChannelTrace& t = traces[i];
    PyObject* row = record(self, kWorkerTrace,
                           Py_BuildValue("(KiiKdddd)", static_cast<unsigned long long>(t.seq), int{t.kind},
                                         int{t.dtype}, static_cast<unsigned long long>(t.count), t.start,
                                         t.submitted, t.done, t.copied));
    if (row == nullptr) {
      Py_DECREF(out);
      return nullptr;
    }
    PyList_SetItem(out, static_cast<Py_ssize_t>(i), row);
  }
  return Py_BuildValue("(NK)", out, static_cast<unsigned long long>(dropped));
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
  std::uint32_t id = 0;
  if (!segment_id(arg, &id)) return PyErr_Occurred() ? nullptr : Py_NewRef(Py_None);
  return segment_or_none(module_of(self), channel_of(self).result(id));
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
     "pop(timeout_s, spin_us) -> the next header of the done ring, the seq of a collected collective it "
     "completed (with where its result lies, for a held one), or None (the fast path's waits go first)"},
    {"abort", channel_abort, METH_NOARGS, "abort(): pops return None from now on"},
    {"release", channel_release, METH_VARARGS,
     "release(rank, seq, nbytes, batch_bytes, timeout_s, spin_us): RELEASE a result slot (small ones held)"},
    {"bind", channel_bind, METH_VARARGS,
     "bind(arena, rank, batch_bytes, timeout_s, spin_us, handle_type, ctx): what every begin() shares"},
    {"begin", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(channel_begin)), METH_FASTCALL,
     "begin(kind, src, count, dtype, op, root, dst, src_offset, result_bytes, owner, result, keepalive) -> a record "
     "of bind()'s class, or None: an asynchronous fast collective's slot, copy-in and SUBMIT under the next seq "
     "(None: starts are closed, shutting down)"},
    {"live", channel_live, METH_NOARGS, "live() -> [record]: begun and not finished"},
    {"unbind", channel_unbind, METH_NOARGS, "unbind(): let go of what bind() gave, and the live table"},
    {"run", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(channel_run)), METH_FASTCALL,
     "run(kind, buf, count, dtype, op, timeout_s) -> True, None or (seq, segment, offset, nbytes): a blocking fast "
     "collective whole, its result in place (None: go the general way; a tuple: not in time, parked)"},
    {"reserve_record", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(channel_reserve_record)),
     METH_FASTCALL, "reserve_record(kind, count, dtype, op, root, slot, result_bytes, result, keepalive, handle_type)"
                    " -> a record whose SUBMIT goes with give() and whose result its _arrived() takes on"},
    {"close_starts", channel_close_starts, METH_NOARGS, "close_starts(): no fast collective starts from now on"},
    {"blocking", channel_blocking, METH_NOARGS, "blocking() -> [seq]: blocking fast collectives not finished"},
    {"alloc", channel_alloc, METH_VARARGS,
     "alloc(arena, nbytes, rank, timeout_s, spin_us) -> (segment, offset, new Segment or None): a slot, its segment "
     "ATTACHed first when new"},
    {"adopt", channel_adopt, METH_O, "adopt(seq) -> DONE or None: a parked fast collective goes the general way"},
    {"resume", channel_resume, METH_VARARGS,
     "resume(seq, segment, offset, nbytes, kind, count, dtype, op, dst, result) -> record or None: a parked "
     "blocking collective as an asynchronous one"},
    {"set_trace", channel_set_trace, METH_O, "set_trace(on): keep each fast collective's phases (take_traces)"},
    {"set_stream", channel_set_stream, METH_O, "set_stream(on): large all-reduces stream (a job of one node)"},
    {"streamed", channel_streamed, METH_NOARGS, "streamed() -> (bytes copied in streaming, result bytes copied out before DONE)"},
    {"take_traces", channel_take_traces, METH_NOARGS,
     "take_traces() -> ([WorkerTrace], dropped): the fast collectives' phases since the last take"},
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
    {Py_tp_traverse, reinterpret_cast<void*>(channel_traverse)},
    {Py_tp_clear, reinterpret_cast<void*>(channel_clear)},
    {Py_tp_methods, kChannelMethods},
    {Py_tp_getset, kChannelGetters},
    {Py_tp_doc, const_cast<char*>("A worker's rings to its daemon (smddp/engine/local_plane.h).")},
    {0, nullptr},
};

PyType_Spec kChannelSpec = {
    "smddp._engine.WorkerChannel",
    sizeof(ChannelObject),
    0,
    Py_TPFLAGS_DEFAULT | Py_TPFLAGS_IMMUTABLETYPE | Py_TPFLAGS_HAVE_GC,
    kChannelSlots,
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
    {"segment_create", py_segment_create, METH_VARARGS, "segment_create(id, size, name) -> Segment (sealed memfd)"},
    {"segment_attach", py_segment_attach, METH_VARARGS,
     "segment_attach(id, fd, size, writable) -> Segment; takes the fd over"},
    {"has_f16c", py_has_f16c, METH_NOARGS, "Whether float16 can be reduced here (x86-64 with AVX2 and F16C)"},
    {nullptr, nullptr, 0, nullptr},
};

int exec_module(PyObject* module) {
  if (load_errors(module) != 0) return -1;
  ModuleState* st = state(module);
  if (add_type(module, &kSegmentSpec, "Segment", &st->segment_type) != 0 ||
      add_type(module, &kArenaSpec, "Arena", &st->arena_type) != 0 ||
      add_type(module, &kPlaneSpec, "LocalPlane", &st->plane_type) != 0 ||
      add_type(module, &kChannelSpec, "WorkerChannel", &st->channel_type) != 0 ||
      add_type(module, &kStartedSpec, "Started", &st->started_type) != 0)
    return -1;
  for (int i = 0; i < kRecords; i++) {
    st->records[i] = reinterpret_cast<PyObject*>(PyStructSequence_NewType(&kRecordDescs[i]));
    if (st->records[i] == nullptr || PyModule_AddObjectRef(module, kRecordNames[i], st->records[i]) != 0) return -1;
  }
  if (PyModule_AddIntConstant(module, "CHANNEL_BYTES", static_cast<long>(smddp::channel_bytes())) != 0) return -1;
  if (PyModule_AddIntConstant(module, "SLOT_ALIGN", static_cast<long>(smddp::kSlotAlign)) != 0) return -1;
  if (PyModule_AddIntConstant(module, "MAX_IN_FLIGHT", static_cast<long>(smddp::kMaxInFlight)) != 0) return -1;
  return 0;
}

int traverse(PyObject* module, visitproc visit, void* arg) {
  if (int r = visit_errors(module, visit, arg)) return r;
  Py_VISIT(state(module)->segment_type);
  Py_VISIT(state(module)->arena_type);
  Py_VISIT(state(module)->plane_type);
  Py_VISIT(state(module)->channel_type);
  Py_VISIT(state(module)->started_type);
  for (PyObject* r : state(module)->records) Py_VISIT(r);
  return 0;
}

int clear(PyObject* module) {
  clear_errors(module);
  Py_CLEAR(state(module)->segment_type);
  Py_CLEAR(state(module)->arena_type);
  Py_CLEAR(state(module)->plane_type);
  Py_CLEAR(state(module)->channel_type);
  Py_CLEAR(state(module)->started_type);
  for (PyObject*& r : state(module)->records) Py_CLEAR(r);
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
