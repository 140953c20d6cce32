// The part of the CUDA driver API the engine calls, declared here from NVIDIA's documented ABI.
//
// The driver (libcuda.so.1) is loaded at run time (cuda_driver.h), as NCCL and torch find theirs, so
// the engine builds without a CUDA toolkit and a CPU-only install never touches CUDA. The driver API,
// not the runtime's: a process has one driver whatever runtimes its libraries bundle (CuPy's, torch's),
// and a stream or event handle of any of them is the driver's CUstream or CUevent. The entry points
// named with _v2 are the ones the toolkit's headers map the plain names to (cuda.h's #defines) since
// CUDA 3.2/4.0/11.0; the others have one version. Names are the engine's own; each says which CUDA
// type or constant it stands for. The test stand-in (rigs/smddp_rigs/standin_cuda.cc) exports the
// same symbols.
#pragma once

#include <cstddef>
#include <cstdint>

namespace smddp {
namespace cuda {

using Result = int;  // CUresult
constexpr Result kSuccess = 0;                    // CUDA_SUCCESS
constexpr Result kInvalidValue = 1;               // CUDA_ERROR_INVALID_VALUE
constexpr Result kNotInitialized = 3;             // CUDA_ERROR_NOT_INITIALIZED
constexpr Result kNoDevice = 100;                 // CUDA_ERROR_NO_DEVICE
constexpr Result kInvalidDevice = 101;            // CUDA_ERROR_INVALID_DEVICE
constexpr Result kInvalidContext = 201;           // CUDA_ERROR_INVALID_CONTEXT
constexpr Result kInvalidHandle = 400;            // CUDA_ERROR_INVALID_HANDLE
constexpr Result kNotReady = 600;                 // CUDA_ERROR_NOT_READY
constexpr Result kIllegalAddress = 700;           // CUDA_ERROR_ILLEGAL_ADDRESS
constexpr Result kHostMemoryRegistered = 712;     // CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED
constexpr Result kHostMemoryNotRegistered = 713;  // CUDA_ERROR_HOST_MEMORY_NOT_REGISTERED
constexpr Result kCaptureUnsupported = 900;       // CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED
constexpr Result kCaptureInvalidated = 901;       // CUDA_ERROR_STREAM_CAPTURE_INVALIDATED
constexpr Result kUnknown = 999;                  // CUDA_ERROR_UNKNOWN

struct ContextSt;  // CUctx_st
struct StreamSt;   // CUstream_st
struct EventSt;    // CUevent_st
struct GraphSt;    // CUgraph_st
struct ModuleSt;   // CUmod_st
struct FuncSt;     // CUfunc_st
using Context = ContextSt*;          // CUcontext
using Module = ModuleSt*;            // CUmodule
using Function = FuncSt*;            // CUfunction
using Stream = StreamSt*;            // CUstream
using Event = EventSt*;              // CUevent
using Graph = GraphSt*;              // CUgraph
using DevicePtr = std::uint64_t;     // CUdeviceptr (unsigned long long on LP64)
using DeviceId = int;                // CUdevice
using HostFn = void (*)(void* data);  // CUhostFn
struct IpcMemHandle {                 // CUipcMemHandle: 64 opaque bytes, passed by value
  char reserved[64];
};

// The special stream handles (cuda.h's CU_STREAM_LEGACY, CU_STREAM_PER_THREAD; also what the CUDA
// Array Interface and DLPack use for them). 0 is the default stream, legacy unless compiled otherwise.
inline Stream stream_of(std::uintptr_t handle) { return reinterpret_cast<Stream>(handle); }
constexpr std::uintptr_t kStreamLegacy = 0x1;
constexpr std::uintptr_t kStreamPerThread = 0x2;

constexpr unsigned kStreamNonBlocking = 0x1;      // CU_STREAM_NON_BLOCKING
constexpr unsigned kEventDisableTiming = 0x2;     // CU_EVENT_DISABLE_TIMING
constexpr unsigned kHostRegisterPortable = 0x01;  // CU_MEMHOSTREGISTER_PORTABLE
constexpr unsigned kHostRegisterReadOnly = 0x08;  // CU_MEMHOSTREGISTER_READ_ONLY
constexpr int kPointerDeviceOrdinal = 9;          // CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL
constexpr int kCaptureNone = 0;                   // CU_STREAM_CAPTURE_STATUS_NONE
constexpr int kCaptureActive = 1;                 // CU_STREAM_CAPTURE_STATUS_ACTIVE
constexpr int kCaptureModeGlobal = 0;             // CU_STREAM_CAPTURE_MODE_GLOBAL
constexpr unsigned kIpcLazyPeerAccess = 0x1;      // CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS
constexpr unsigned kWaitValueGeq = 0x0;           // CU_STREAM_WAIT_VALUE_GEQ (cyclic: (int32_t)(*p - v) >= 0)
constexpr unsigned kWriteValueDefault = 0x0;      // CU_STREAM_WRITE_VALUE_DEFAULT (a fence before the write)

// A 2-D copy (CUDA_MEMCPY2D, cuMemcpy2DAsync_v2): `height` rows of `width` bytes, each `*_pitch`
// bytes after the last, the same layout as cuda.h's (size_t and pointers of 8 bytes, the memory type
// an enum, padded).
constexpr int kMemoryTypeDevice = 2;  // CU_MEMORYTYPE_DEVICE
struct Memcpy2D {
  std::size_t src_x = 0;
  std::size_t src_y = 0;
  int src_type = 0;
  const void* src_host = nullptr;
  DevicePtr src_device = 0;
  void* src_array = nullptr;
  std::size_t src_pitch = 0;
  std::size_t dst_x = 0;
  std::size_t dst_y = 0;
  int dst_type = 0;
  void* dst_host = nullptr;
  DevicePtr dst_device = 0;
  void* dst_array = nullptr;
  std::size_t dst_pitch = 0;
  std::size_t width = 0;
  std::size_t height = 0;
};
static_assert(sizeof(Memcpy2D) == 128, "CUDA_MEMCPY2D is 128 bytes");
// The largest pitch a 2-D copy takes on every device CUDA 13 runs on (CU_DEVICE_ATTRIBUTE_MAX_PITCH
// is 2^31 - 1 there); a longer one goes row by row.
constexpr std::size_t kMaxPitch = 0x7FFFFFFF;

// Every entry point the engine resolves, with the symbol it is exported as.
struct Api {
  Result (*init)(unsigned flags);                                                // cuInit
  Result (*driver_version)(int* version);                                        // cuDriverGetVersion
  Result (*device_count)(int* count);                                            // cuDeviceGetCount
  Result (*device_get)(DeviceId* device, int ordinal);                           // cuDeviceGet
  Result (*primary_retain)(Context* ctx, DeviceId device);                       // cuDevicePrimaryCtxRetain
  Result (*primary_release)(DeviceId device);                                    // cuDevicePrimaryCtxRelease_v2
  Result (*ctx_set_current)(Context ctx);                                        // cuCtxSetCurrent
  Result (*ctx_get_current)(Context* ctx);                                       // cuCtxGetCurrent
  Result (*stream_create)(Stream* stream, unsigned flags);                       // cuStreamCreate
  Result (*stream_destroy)(Stream stream);                                       // cuStreamDestroy_v2
  Result (*stream_wait_event)(Stream stream, Event event, unsigned flags);       // cuStreamWaitEvent
  Result (*stream_is_capturing)(Stream stream, int* status);                     // cuStreamIsCapturing
  Result (*stream_synchronize)(Stream stream);                                   // cuStreamSynchronize
  Result (*event_create)(Event* event, unsigned flags);                          // cuEventCreate
  Result (*event_destroy)(Event event);                                          // cuEventDestroy_v2
  Result (*event_record)(Event event, Stream stream);                            // cuEventRecord
  Result (*event_query)(Event event);                                            // cuEventQuery
  Result (*event_synchronize)(Event event);                                      // cuEventSynchronize
  Result (*memcpy_d2h)(void* dst, DevicePtr src, std::size_t n, Stream stream);  // cuMemcpyDtoHAsync_v2
  Result (*memcpy_h2d)(DevicePtr dst, const void* src, std::size_t n, Stream stream);  // cuMemcpyHtoDAsync_v2
  Result (*host_register)(void* p, std::size_t n, unsigned flags);               // cuMemHostRegister_v2
  Result (*host_unregister)(void* p);                                            // cuMemHostUnregister
  Result (*pointer_attribute)(void* data, int attribute, DevicePtr ptr);         // cuPointerGetAttribute
  Result (*error_name)(Result r, const char** name);                             // cuGetErrorName
  Result (*error_string)(Result r, const char** text);                           // cuGetErrorString
};

// The GPU step's entry points (device_step.h): resolved where the driver has them, each nullptr where
// it does not (a driver older than CUDA 11.7 lacks the _v2 stream memory operations), so that their
// absence turns the GPU step off, with the names in its reason, and nothing else.
struct StepApi {
  Result (*mem_alloc)(DevicePtr* p, std::size_t n);                              // cuMemAlloc_v2
  Result (*mem_free)(DevicePtr p);                                               // cuMemFree_v2
  Result (*memset_d32)(DevicePtr p, unsigned value, std::size_t n, Stream stream);  // cuMemsetD32Async
  Result (*memcpy_d2d)(DevicePtr dst, DevicePtr src, std::size_t n, Stream stream);  // cuMemcpyDtoDAsync_v2
  Result (*memcpy_2d)(const Memcpy2D* copy, Stream stream);                      // cuMemcpy2DAsync_v2
  Result (*can_access_peer)(int* can, DeviceId device, DeviceId peer);           // cuDeviceCanAccessPeer
  Result (*ipc_get_mem_handle)(IpcMemHandle* handle, DevicePtr p);               // cuIpcGetMemHandle
  Result (*ipc_open_mem_handle)(DevicePtr* p, IpcMemHandle handle, unsigned flags);  // cuIpcOpenMemHandle_v2
  Result (*ipc_close_mem_handle)(DevicePtr p);                                   // cuIpcCloseMemHandle
  Result (*write_value32)(Stream stream, DevicePtr p, std::uint32_t v, unsigned flags);  // cuStreamWriteValue32_v2
  Result (*wait_value32)(Stream stream, DevicePtr p, std::uint32_t v, unsigned flags);   // cuStreamWaitValue32_v2
  Result (*module_load_data)(Module* m, const void* image);                     // cuModuleLoadData
  Result (*module_unload)(Module m);                                             // cuModuleUnload
  Result (*module_get_function)(Function* f, Module m, const char* name);       // cuModuleGetFunction
  Result (*launch_kernel)(Function f, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by, unsigned bz,
                          unsigned shared, Stream stream, void** params, void** extra);  // cuLaunchKernel
};

}  // namespace cuda
}  // namespace smddp
