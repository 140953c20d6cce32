// The CUDA driver, loaded at run time: its entry points (cuda_abi.h), the devices' primary contexts,
// and the words for its errors.
//
// Memory: a Driver owns its dlopen handle and the primary contexts it retained (released when it
// goes; the library itself stays loaded, since other libraries of the process share it). It is
// thread-safe: the entry points are the driver's, and the contexts are retained under a lock.
#pragma once

#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "cuda_abi.h"

namespace smddp {
namespace cuda {

// The driver most processes have: the one a GPU's kernel module goes with.
constexpr const char* kDefaultLibrary = "libcuda.so.1";

class Driver {
 public:
  // `library` (a path or a soname: kDefaultLibrary, or the test stand-in) loaded and initialised
  // (cuInit); nullptr with *why set when it cannot be: not there, not a CUDA driver (an entry point
  // missing, named), or cuInit refused (its error, as describe() words it).
  static std::unique_ptr<Driver> load(const std::string& library, std::string* why);
  ~Driver();
  Driver(const Driver&) = delete;
  Driver& operator=(const Driver&) = delete;

  const Api& api() const { return api_; }
  // The GPU step's entry points; step_missing(): those the driver lacks ("": it has them all).
  const StepApi& step() const { return step_; }
  const std::string& step_missing() const { return step_missing_; }
  const std::string& library() const { return library_; }
  int version() const { return version_; }  // cuDriverGetVersion: 1000 * major + 10 * minor
  int device_count() const { return devices_; }

  // Makes `device`'s primary context current on the calling thread (retained the first time, as
  // CuPy and torch use it): every driver call an engine thread makes needs a current context.
  // kSuccess, or the driver's error (kInvalidDevice for a device out of range).
  Result bind(int device);

  // "cuEventQuery: CUDA_ERROR_ILLEGAL_ADDRESS (an illegal memory access was encountered)".
  std::string describe(Result r, const char* call) const;

 private:
  Driver() = default;
  void* lib_ = nullptr;
  std::string library_;
  Api api_{};
  StepApi step_{};
  std::string step_missing_;
  int version_ = 0;
  int devices_ = 0;
  std::mutex mu_;
  std::vector<Context> contexts_;  // per device: retained, or nullptr
};

// `device`'s primary context current for a scope, and the thread's own one current again after it:
// for the engine's calls on a caller's thread (a wait that takes a DONE, a finalizer), whose current
// context is the caller's affair. result(): kSuccess, or why the context could not be made current.
class Bound {
 public:
  Bound(Driver& d, int device);
  ~Bound();
  Bound(const Bound&) = delete;
  Bound& operator=(const Bound&) = delete;
  Result result() const { return result_; }

 private:
  Driver& d_;
  Context was_ = nullptr;
  Result result_ = kSuccess;
  bool restore_ = false;
};

}  // namespace cuda
}  // namespace smddp
