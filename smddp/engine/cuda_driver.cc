// The CUDA driver loaded at run time (cuda_driver.h).
#include "cuda_driver.h"

#include <dlfcn.h>

namespace smddp {
namespace cuda {

namespace {

template <typename F>
bool resolve(void* lib, const char* symbol, F* out, std::string* missing) {
  void* p = dlsym(lib, symbol);
  if (p == nullptr) {
    *missing += (missing->empty() ? "" : ", ") + std::string(symbol);
    return false;
  }
  *out = reinterpret_cast<F>(p);
  return true;
}

std::string resolve_all(void* lib, Api* a) {
  std::string missing;
  resolve(lib, "cuInit", &a->init, &missing);
  resolve(lib, "cuDriverGetVersion", &a->driver_version, &missing);
  resolve(lib, "cuDeviceGetCount", &a->device_count, &missing);
  resolve(lib, "cuDeviceGet", &a->device_get, &missing);
  resolve(lib, "cuDevicePrimaryCtxRetain", &a->primary_retain, &missing);
  resolve(lib, "cuDevicePrimaryCtxRelease_v2", &a->primary_release, &missing);
  resolve(lib, "cuCtxSetCurrent", &a->ctx_set_current, &missing);
  resolve(lib, "cuCtxGetCurrent", &a->ctx_get_current, &missing);
  resolve(lib, "cuStreamCreate", &a->stream_create, &missing);
  resolve(lib, "cuStreamDestroy_v2", &a->stream_destroy, &missing);
  resolve(lib, "cuStreamWaitEvent", &a->stream_wait_event, &missing);
  resolve(lib, "cuStreamIsCapturing", &a->stream_is_capturing, &missing);
  resolve(lib, "cuStreamSynchronize", &a->stream_synchronize, &missing);
  resolve(lib, "cuEventCreate", &a->event_create, &missing);
  resolve(lib, "cuEventDestroy_v2", &a->event_destroy, &missing);
  resolve(lib, "cuEventRecord", &a->event_record, &missing);
  resolve(lib, "cuEventQuery", &a->event_query, &missing);
  resolve(lib, "cuEventSynchronize", &a->event_synchronize, &missing);
  resolve(lib, "cuMemcpyDtoHAsync_v2", &a->memcpy_d2h, &missing);
  resolve(lib, "cuMemcpyHtoDAsync_v2", &a->memcpy_h2d, &missing);
  resolve(lib, "cuMemHostRegister_v2", &a->host_register, &missing);
  resolve(lib, "cuMemHostUnregister", &a->host_unregister, &missing);
  resolve(lib, "cuPointerGetAttribute", &a->pointer_attribute, &missing);
  resolve(lib, "cuGetErrorName", &a->error_name, &missing);
  resolve(lib, "cuGetErrorString", &a->error_string, &missing);
  return missing;
}

std::string resolve_step(void* lib, StepApi* a) {
  std::string missing;
  resolve(lib, "cuMemAlloc_v2", &a->mem_alloc, &missing);
  resolve(lib, "cuMemFree_v2", &a->mem_free, &missing);
  resolve(lib, "cuMemsetD32Async", &a->memset_d32, &missing);
  resolve(lib, "cuMemcpyDtoDAsync_v2", &a->memcpy_d2d, &missing);
  resolve(lib, "cuMemcpy2DAsync_v2", &a->memcpy_2d, &missing);
  resolve(lib, "cuDeviceCanAccessPeer", &a->can_access_peer, &missing);
  resolve(lib, "cuIpcGetMemHandle", &a->ipc_get_mem_handle, &missing);
  resolve(lib, "cuIpcOpenMemHandle_v2", &a->ipc_open_mem_handle, &missing);
  resolve(lib, "cuIpcCloseMemHandle", &a->ipc_close_mem_handle, &missing);
  resolve(lib, "cuStreamWriteValue32_v2", &a->write_value32, &missing);
  resolve(lib, "cuStreamWaitValue32_v2", &a->wait_value32, &missing);
  resolve(lib, "cuModuleLoadData", &a->module_load_data, &missing);
  resolve(lib, "cuModuleUnload", &a->module_unload, &missing);
  resolve(lib, "cuModuleGetFunction", &a->module_get_function, &missing);
  resolve(lib, "cuLaunchKernel", &a->launch_kernel, &missing);
  return missing;
}

}  // namespace

std::unique_ptr<Driver> Driver::load(const std::string& library, std::string* why) {
  void* lib = dlopen(library.c_str(), RTLD_NOW | RTLD_LOCAL);
  if (lib == nullptr) {
    const char* e = dlerror();
    *why = "cannot load the CUDA driver (" + library + "): " + (e != nullptr ? e : "not found");
    return nullptr;
  }
  std::unique_ptr<Driver> d(new Driver());
  d->lib_ = lib;
  d->library_ = library;
  const std::string missing = resolve_all(lib, &d->api_);
  if (!missing.empty()) {
    *why = library + " is not a CUDA driver: it lacks " + missing;
    return nullptr;
  }
  d->step_missing_ = resolve_step(lib, &d->step_);
  Result r = d->api_.init(0);
  if (r != kSuccess) {
    *why = library + ": " + d->describe(r, "cuInit");
    return nullptr;
  }
  r = d->api_.driver_version(&d->version_);
  if (r == kSuccess) r = d->api_.device_count(&d->devices_);
  if (r != kSuccess) {
    *why = library + ": " + d->describe(r, "cuDeviceGetCount");
    return nullptr;
  }
  d->contexts_.assign(static_cast<std::size_t>(d->devices_ > 0 ? d->devices_ : 0), nullptr);
  return d;
}

Driver::~Driver() {
  for (std::size_t i = 0; i < contexts_.size(); i++)
    if (contexts_[i] != nullptr) api_.primary_release(static_cast<DeviceId>(i));
  // (lib_ stays loaded: dlclose of a driver other libraries of the process use is never safe.)
}

Result Driver::bind(int device) {
  if (device < 0 || device >= devices_) return kInvalidDevice;
  Context ctx = nullptr;
  {
    std::lock_guard<std::mutex> lock(mu_);
    ctx = contexts_[static_cast<std::size_t>(device)];
    if (ctx == nullptr) {
      DeviceId dev = 0;
      Result r = api_.device_get(&dev, device);
      if (r == kSuccess) r = api_.primary_retain(&ctx, dev);
      if (r != kSuccess) return r;
      contexts_[static_cast<std::size_t>(device)] = ctx;
    }
  }
  return api_.ctx_set_current(ctx);
}

Bound::Bound(Driver& d, int device) : d_(d) {
  result_ = d_.api().ctx_get_current(&was_);
  if (result_ == kSuccess) result_ = d_.bind(device);
  restore_ = true;
}

Bound::~Bound() {
  if (restore_) (void)d_.api().ctx_set_current(was_);
}

std::string Driver::describe(Result r, const char* call) const {
  const char* name = nullptr;
  const char* text = nullptr;
  if (api_.error_name == nullptr || api_.error_name(r, &name) != kSuccess || name == nullptr) name = nullptr;
  if (api_.error_string == nullptr || api_.error_string(r, &text) != kSuccess || text == nullptr) text = nullptr;
  std::string out = std::string(call) + ": ";
  out += name != nullptr ? name : "CUDA error " + std::to_string(r);
  if (text != nullptr) out += std::string(" (") + text + ")";
  return out;
}

}  // namespace cuda
}  // namespace smddp
