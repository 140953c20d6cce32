// What both of the engine's nanobind modules share: smddp._engine (module.cc, in the wheel) and the
// rigs' smddp_rigs._engine_testing (never shipped). One error table, its translator, and the checks of
// values from Python or the wire before they become engine fields.
//
// Each extension has its own copy (hidden visibility): its own smddp.errors references and translator.
#pragma once

#include <nanobind/nanobind.h>
#include <nanobind/stl/optional.h>

#include <cstdint>
#include <exception>
#include <optional>
#include <string>
#include <system_error>
#include <utility>

#include "node_state.h"

namespace nb = nanobind;

namespace smddp::bind {

// ------------------------------------------------------------------------------------------ errors

// Every error the bindings raise, by the Python class it becomes (translate): smddp.errors' for
// what the wire, the job or a peer did; Python's own for a caller's mistake or the system's refusal.
enum class Err {
  kProtocol,           // smddp.errors.ProtocolError: a frame, ring or range the engine refused
  kMismatch,           // smddp.errors.CollectiveMismatchError
  kPeerLost,           // smddp.errors.PeerLostError
  kCollectiveTimeout,  // smddp.errors.CollectiveTimeoutError
  kTimeout,            // TimeoutError: a ring the daemon left full
  kOS,                 // OSError: memory, threads or files the system would not give
  kValue,              // ValueError
  kType,               // TypeError
  kRuntime,            // RuntimeError: a call out of order (a channel not bound)
  kDevice,             // smddp.errors.DeviceError: the CUDA driver refused a call, or a copy failed
};

struct Raised : std::exception {
  Err err;
  std::string why;
  Raised(Err e, std::string w) : err(e), why(std::move(w)) {}
  const char* what() const noexcept override { return why.c_str(); }
};

[[noreturn]] inline void raise_error(Err err, std::string why) { throw Raised(err, std::move(why)); }

// smddp.errors' five classes, imported once at module init and held for the life of the process
// (strong references, never given back: a translator may run until the interpreter is gone).
inline PyObject* g_smddp_errors[5] = {nullptr, nullptr, nullptr, nullptr, nullptr};

inline PyObject* error_class(Err e) {
  switch (e) {
    case Err::kProtocol: return g_smddp_errors[0];
    case Err::kMismatch: return g_smddp_errors[1];
    case Err::kPeerLost: return g_smddp_errors[2];
    case Err::kCollectiveTimeout: return g_smddp_errors[3];
    case Err::kTimeout: return PyExc_TimeoutError;
    case Err::kOS: return PyExc_OSError;
    case Err::kValue: return PyExc_ValueError;
    case Err::kType: return PyExc_TypeError;
    case Err::kRuntime: return PyExc_RuntimeError;
    case Err::kDevice: return g_smddp_errors[4];
  }
  return PyExc_RuntimeError;
}

inline void translate(const std::exception_ptr& p, void*) {
  try {
    std::rethrow_exception(p);
  } catch (const Raised& r) {
    PyErr_SetString(error_class(r.err), r.why.c_str());
  } catch (const std::system_error& e) {  // a thread the system would not start
    PyErr_Format(PyExc_OSError, "cannot start the engine's threads: %s", e.what());
  }
}

inline void load_errors() {
  nb::module_ errors = nb::module_::import_("smddp.errors");
  const char* names[5] = {"ProtocolError", "CollectiveMismatchError", "PeerLostError", "CollectiveTimeoutError",
                          "DeviceError"};
  for (int i = 0; i < 5; i++) g_smddp_errors[i] = nb::object(errors.attr(names[i])).release().ptr();
  nb::register_exception_translator(translate);
}

[[noreturn]] inline void raise_verdict(const smddp::Verdict& v) {
  raise_error(v.fault == smddp::Fault::kMismatch ? Err::kMismatch
              : v.fault == smddp::Fault::kPeerLost ? Err::kPeerLost
                                                   : Err::kProtocol,
              v.why);
}

inline constexpr const char* kRingFull = "the daemon left this worker's submit ring full";

// ------------------------------------------------------------------------------------ arguments

// Values from the wire or a caller, checked against what the engine's fields hold: a negative or
// too-large one is refused with `err` naming `what`, before anything is touched.
inline std::uint32_t u32(long long v, Err err, const char* what) {
  if (v < 0 || v > static_cast<long long>(UINT32_MAX)) raise_error(err, what);
  return static_cast<std::uint32_t>(v);
}

inline std::uint64_t u64(long long v, Err err, const char* what) {
  if (v < 0) raise_error(err, what);
  return static_cast<std::uint64_t>(v);
}

// A timeout in seconds as nanoseconds: none is `dflt` (the job's), a negative one 0, a huge one about
// 30 years (no overflow).
inline std::int64_t timeout_ns(std::optional<double> t, std::int64_t dflt) {
  if (!t) return dflt;
  const double s = *t;
  return !(s > 0) ? 0 : s >= 1e9 ? static_cast<std::int64_t>(1e18) : static_cast<std::int64_t>(s * 1e9);
}

inline std::int64_t seconds_ns(double s) { return static_cast<std::int64_t>((s > 0 ? s : 0) * 1e9); }
inline std::int64_t spin_ns(double spin_us) { return static_cast<std::int64_t>(spin_us * 1e3); }

// An integer argument that callers pass as smddp's enums (IntEnum) or plain ints; kept as given
// where the record names it back (Started.kind, .dtype).
inline long long integer(nb::handle arg, const char* what) {
  const long long v = PyLong_AsLongLong(arg.ptr());
  if (v == -1 && PyErr_Occurred()) {
    PyErr_Clear();
    raise_error(Err::kType, std::string(what) + " must be an int");
  }
  return v;
}

// A read-only view of a bytes-like object (a header, a payload), released with it.
struct ReadView {
  Py_buffer view{};
  explicit ReadView(nb::handle obj) {
    if (PyObject_GetBuffer(obj.ptr(), &view, PyBUF_SIMPLE) != 0) throw nb::python_error();
  }
  ~ReadView() { PyBuffer_Release(&view); }
  ReadView(const ReadView&) = delete;
  ReadView& operator=(const ReadView&) = delete;
  const std::uint8_t* data() const { return static_cast<const std::uint8_t*>(view.buf); }
  std::size_t size() const { return static_cast<std::size_t>(view.len); }
};

}  // namespace smddp::bind
