// A stand-in CUDA driver: the driver API entry points the engine loads (smddp/engine/cuda_abi.h),
// exported under the driver's own names from a library of its own (libsmddp_standin_cuda.so), so
// that the engine's loader, its device calls and its progress thread run in CI, where no GPU is.
//
// What it models, because the engine's correctness depends on it:
// - streams run their work in order on a thread each, asynchronously to the host; a stream's work
//   after a failure is skipped and every later query of it says the error (sticky, as CUDA's);
// - copies land late: each waits SMDDP_STANDIN_COPY_DELAY_US (or smddp_standin_set_copy_delay_us)
//   before it moves a byte; a copy to or from pageable host memory blocks the caller until it is
//   done (CUDA may stage or synchronise such copies; a caller can count on neither);
// - events: each record replaces the point later waits and queries refer to; a stream that waits on
//   an event holds its later work back until the event is reached;
// - contexts: every call that needs one fails with CUDA_ERROR_INVALID_CONTEXT on a thread that has
//   made none current (cuCtxSetCurrent), as the driver does on a fresh thread;
// - several devices (SMDDP_STANDIN_DEVICES, default 1), each stream, event and allocation on one;
// - device memory at addresses far above any host address (0xD000...), backed by host memory here;
//   a copy naming a range outside every allocation fails (CUDA_ERROR_INVALID_VALUE);
// - graph capture: work on a capturing stream is recorded, not run; host waits on captured work
//   are refused (CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED);
// - holds (smddp_standin_hold): a kernel that runs until the test releases it, to order a test's
//   steps without betting on durations.
//
// Not modelled: the legacy default stream's implicit synchronisation with other blocking streams
// (the engine only ever creates non-blocking ones), timing events, peer access.
//
// Memory: the state is one process-wide object that is never destroyed (stream threads may still be
// parked when the process exits); allocations are freed by cuMemFree, streams joined by
// cuStreamDestroy once their work has run.
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <functional>
#include <iterator>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <thread>
#include <vector>

namespace {

using Result = int;
constexpr Result kSuccess = 0, kInvalidValue = 1, kNotInitialized = 3, kNoDevice = 100, kInvalidDevice = 101,
                 kInvalidContext = 201, kInvalidHandle = 400, kNotReady = 600, kIllegalAddress = 700,
                 kHostRegistered = 712, kHostNotRegistered = 713, kCaptureUnsupported = 900,
                 kCaptureInvalidated = 901;

constexpr std::uint64_t kDeviceBase = 0xD000000000000000ULL;
constexpr std::uint64_t kGuard = 1 << 20;  // address gap between allocations: an overrun lands on none
constexpr unsigned char kUnset = 0xA5;     // fresh allocations hold this byte, as cuMemAlloc'd memory holds garbage

// One record of an event: reached when its stream gets there, with the stream's error then.
struct Mark {
  std::mutex mu;
  std::condition_variable cv;
  bool done = false;
  bool captured = false;  // recorded under capture: reached only when a graph runs, never here
  Result error = kSuccess;
  void reach(Result e) {
    {
      std::lock_guard<std::mutex> lock(mu);
      done = true;
      error = e;
    }
    cv.notify_all();
  }
  Result wait() {
    std::unique_lock<std::mutex> lock(mu);
    cv.wait(lock, [this] { return done; });
    return error;
  }
};

struct Event {
  int device;
  std::shared_ptr<Mark> mark;  // the last record (none: never recorded, which counts as reached)
};

// An operation on a stream: returns its error (kSuccess), given the stream's sticky error so far
// (an operation that must run whatever came before, as a mark's reach, takes it; others are skipped).
struct Op {
  std::function<Result()> run;
  std::function<void(Result)> always;  // runs instead of `run` once the stream has failed (marks)
};

struct Stream {
  int device = 0;
  std::mutex mu;
  std::condition_variable cv;
  std::deque<Op> queue;
  bool running = false;  // the thread is in an op
  bool closing = false;
  Result error = kSuccess;  // sticky
  bool capturing = false;
  std::size_t captured = 0;  // ops recorded into the graph under capture
  std::thread thread;

  void put(Op op) {
    {
      std::lock_guard<std::mutex> lock(mu);
      queue.push_back(std::move(op));
    }
    cv.notify_all();
  }
  void loop() {
    for (;;) {
      Op op;
      {
        std::unique_lock<std::mutex> lock(mu);
        cv.wait(lock, [this] { return closing || !queue.empty(); });
        if (queue.empty()) return;
        op = std::move(queue.front());
        queue.pop_front();
        running = true;
      }
      Result failed;
      {
        std::lock_guard<std::mutex> lock(mu);
        failed = error;
      }
      if (failed != kSuccess) {
        if (op.always) op.always(failed);
      } else if (op.run) {
        const Result r = op.run();
        if (r != kSuccess) {
          std::lock_guard<std::mutex> lock(mu);
          error = r;
        }
      }
      {
        std::lock_guard<std::mutex> lock(mu);
        running = false;
      }
      cv.notify_all();
    }
  }
  // Until everything put so far has run.
  void drain() {
    std::unique_lock<std::mutex> lock(mu);
    cv.wait(lock, [this] { return queue.empty() && !running; });
  }
};

struct Alloc {
  int device;
  std::uint64_t nbytes;
  unsigned char* host;
};

struct Hold {
  std::mutex mu;
  std::condition_variable cv;
  bool started = false;
  bool released = false;
};

struct State {
  std::mutex mu;
  bool initialised = false;
  int devices = 1;
  std::atomic<std::int64_t> copy_delay_us{0};
  std::vector<Stream*> defaults;  // per device: the legacy stream, made on first use
  std::set<Stream*> streams;
  std::set<Event*> events;
  std::map<std::uint64_t, Alloc> allocs;  // by device address
  std::uint64_t next_addr = kDeviceBase;
  std::map<std::uintptr_t, std::pair<std::size_t, bool>> registered;  // host address -> (bytes, read-only)
  std::map<std::uint64_t, std::shared_ptr<Hold>> holds;
  std::uint64_t next_hold = 1;
  std::atomic<std::uint64_t> copies_pinned{0};
  std::atomic<std::uint64_t> copies_pageable{0};
};

State& state() {
  static State* s = new State();  // never destroyed: stream threads may outlive static destruction
  return *s;
}

// The device whose primary context the calling thread made current (-1: none).
thread_local int t_device = -1;
// The fake contexts' addresses: one byte each, per device, so that a CUcontext names its device.
unsigned char g_contexts[64];

Result need_context() { return t_device < 0 ? kInvalidContext : kSuccess; }

Stream* start_stream(int device) {
  Stream* s = new Stream();
  s->device = device;
  s->thread = std::thread([s] { s->loop(); });
  return s;
}

// The stream a handle names (0 and the legacy handle: the current device's default stream;
// per-thread: the same here), or nullptr.
Stream* stream_of(void* handle) {
  State& st = state();
  const auto h = reinterpret_cast<std::uintptr_t>(handle);
  std::lock_guard<std::mutex> lock(st.mu);
  if (h == 0 || h == 1 || h == 2) {
    if (t_device < 0) return nullptr;
    Stream*& d = st.defaults[static_cast<std::size_t>(t_device)];
    if (d == nullptr) d = start_stream(t_device);
    return d;
  }
  auto* s = static_cast<Stream*>(handle);
  return st.streams.count(s) ? s : nullptr;
}

Event* event_of(void* handle) {
  State& st = state();
  std::lock_guard<std::mutex> lock(st.mu);
  auto* e = static_cast<Event*>(handle);
  return st.events.count(e) ? e : nullptr;
}

// The host memory behind device range [addr, addr + n), or nullptr when it lies outside every allocation.
unsigned char* device_range(std::uint64_t addr, std::size_t n, int* device) {
  State& st = state();
  std::lock_guard<std::mutex> lock(st.mu);
  auto it = st.allocs.upper_bound(addr);
  if (it == st.allocs.begin()) return nullptr;
  --it;
  const std::uint64_t off = addr - it->first;
  if (off > it->second.nbytes || n > it->second.nbytes - off) return nullptr;
  if (device != nullptr) *device = it->second.device;
  return it->second.host + off;
}

// Whether host range [p, p + n) lies inside one registered range (writable, where the device writes it).
bool pinned(const void* p, std::size_t n, bool device_writes) {
  State& st = state();
  const auto a = reinterpret_cast<std::uintptr_t>(p);
  std::lock_guard<std::mutex> lock(st.mu);
  auto it = st.registered.upper_bound(a);
  if (it == st.registered.begin()) return false;
  --it;
  if (a - it->first > it->second.first || n > it->second.first - (a - it->first)) return false;
  return !(device_writes && it->second.second);
}

void late() {
  const std::int64_t us = state().copy_delay_us.load(std::memory_order_relaxed);
  if (us > 0) std::this_thread::sleep_for(std::chrono::microseconds(us));
}

// Puts `op` on `s`, or (capturing) records it into the graph, where it does not run here.
void enqueue(Stream* s, Op op) {
  {
    std::lock_guard<std::mutex> lock(s->mu);
    if (s->capturing) {
      s->captured++;
      return;
    }
  }
  s->put(std::move(op));
}

bool is_capturing(Stream* s) {
  std::lock_guard<std::mutex> lock(s->mu);
  return s->capturing;
}

Result copy(Stream* s, unsigned char* dst, const unsigned char* src, std::size_t n, bool pinned_host) {
  if (n == 0) return kSuccess;
  if (pinned_host) {
    state().copies_pinned++;
    enqueue(s, Op{[=] {
                    late();
                    std::memmove(dst, src, n);
                    return kSuccess;
                  },
                  nullptr});
    return kSuccess;
  }
  state().copies_pageable++;
  if (is_capturing(s)) return kCaptureUnsupported;  // pageable copies cannot be captured
  auto mark = std::make_shared<Mark>();
  s->put(Op{[=] {
              late();
              std::memmove(dst, src, n);
              mark->reach(kSuccess);
              return kSuccess;
            },
            [mark](Result e) { mark->reach(e); }});
  return mark->wait();
}

}  // namespace

extern "C" {

__attribute__((visibility("default"))) Result cuInit(unsigned flags) {
  if (flags != 0) return kInvalidValue;
  State& st = state();
  std::lock_guard<std::mutex> lock(st.mu);
  if (!st.initialised) {
    const char* n = std::getenv("SMDDP_STANDIN_DEVICES");
    st.devices = n != nullptr ? std::atoi(n) : 1;
    if (st.devices < 0 || st.devices > 64) st.devices = 0;
    const char* d = std::getenv("SMDDP_STANDIN_COPY_DELAY_US");
    st.copy_delay_us = d != nullptr ? std::atoll(d) : 0;
    st.defaults.assign(static_cast<std::size_t>(st.devices), nullptr);
    st.initialised = true;
  }
  return st.devices == 0 ? kNoDevice : kSuccess;
}

__attribute__((visibility("default"))) Result cuDriverGetVersion(int* v) {
  if (v == nullptr) return kInvalidValue;
  *v = 13000;
  return kSuccess;
}

__attribute__((visibility("default"))) Result cuDeviceGetCount(int* n) {
  if (n == nullptr) return kInvalidValue;
  State& st = state();
  std::lock_guard<std::mutex> lock(st.mu);
  if (!st.initialised) return kNotInitialized;
  *n = st.devices;
  return kSuccess;
}

__attribute__((visibility("default"))) Result cuDeviceGet(int* dev, int ordinal) {
  if (dev == nullptr) return kInvalidValue;
  State& st = state();
  std::lock_guard<std::mutex> lock(st.mu);
  if (!st.initialised) return kNotInitialized;
  if (ordinal < 0 || ordinal >= st.devices) return kInvalidDevice;
  *dev = ordinal;
  return kSuccess;
}

__attribute__((visibility("default"))) Result cuDevicePrimaryCtxRetain(void** ctx, int dev) {
  if (ctx == nullptr) return kInvalidValue;
  State& st = state();
  std::lock_guard<std::mutex> lock(st.mu);
  if (!st.initialised) return kNotInitialized;
  if (dev < 0 || dev >= st.devices) return kInvalidDevice;
  *ctx = &g_contexts[dev];
  return kSuccess;
}

__attribute__((visibility("default"))) Result cuDevicePrimaryCtxRelease_v2(int dev) {
  State& st = state();
  std::lock_guard<std::mutex> lock(st.mu);
  return dev < 0 || dev >= st.devices ? kInvalidDevice : kSuccess;
}

__attribute__((visibility("default"))) Result cuCtxSetCurrent(void* ctx) {
  if (ctx == nullptr) {
    t_device = -1;
    return kSuccess;
  }
  const auto* c = static_cast<unsigned char*>(ctx);
  if (c < g_contexts || c >= g_contexts + state().devices) return kInvalidContext;
  t_device = static_cast<int>(c - g_contexts);
  return kSuccess;
}

__attribute__((visibility("default"))) Result cuStreamCreate(void** out, unsigned /*flags*/) {
  if (out == nullptr) return kInvalidValue;
  if (const Result r = need_context()) return r;
  Stream* s = start_stream(t_device);
  State& st = state();
  std::lock_guard<std::mutex> lock(st.mu);
  st.streams.insert(s);
  *out = s;
  return kSuccess;
}

__attribute__((visibility("default"))) Result cuStreamDestroy_v2(void* handle) {
  State& st = state();
  Stream* s = nullptr;
  {
    std::lock_guard<std::mutex> lock(st.mu);
    s = static_cast<Stream*>(handle);
    if (st.streams.erase(s) == 0) return kInvalidHandle;
  }
  // As the driver: work already put runs to the end, then the stream goes.
  {
    std::lock_guard<std::mutex> lock(s->mu);
    s->closing = true;
  }
  s->cv.notify_all();
  s->thread.join();
  delete s;
  return kSuccess;
}

__attribute__((visibility("default"))) Result cuStreamSynchronize(void* handle) {
  if (const Result r = need_context()) return r;
  Stream* s = stream_of(handle);
  if (s == nullptr) return kInvalidHandle;
  if (is_capturing(s)) return kCaptureUnsupported;
  s->drain();
  std::lock_guard<std::mutex> lock(s->mu);
  return s->error;
}

__attribute__((visibility("default"))) Result cuStreamIsCapturing(void* handle, int* status) {
  if (status == nullptr) return kInvalidValue;
  if (const Result r = need_context()) return r;
  Stream* s = stream_of(handle);
  if (s == nullptr) return kInvalidHandle;
  *status = is_capturing(s) ? 1 : 0;
  return kSuccess;
}

__attribute__((visibility("default"))) Result cuStreamBeginCapture_v2(void* handle, int /*mode*/) {
  if (const Result r = need_context()) return r;
  Stream* s = stream_of(handle);
  const auto h = reinterpret_cast<std::uintptr_t>(handle);
  if (s == nullptr) return kInvalidHandle;
  if (h <= 2) return kCaptureUnsupported;  // the legacy stream cannot be captured
  std::lock_guard<std::mutex> lock(s->mu);
  if (s->capturing) return kCaptureInvalidated;
  s->capturing = true;
  s->captured = 0;
  return kSuccess;
}

// The graph itself is not kept (nothing here launches one): *graph names how many operations it holds.
__attribute__((visibility("default"))) Result cuStreamEndCapture(void* handle, void** graph) {
  if (graph == nullptr) return kInvalidValue;
  if (const Result r = need_context()) return r;
  Stream* s = stream_of(handle);
  if (s == nullptr) return kInvalidHandle;
  std::lock_guard<std::mutex> lock(s->mu);
  if (!s->capturing) return kCaptureInvalidated;
  s->capturing = false;
  *graph = reinterpret_cast<void*>(static_cast<std::uintptr_t>(s->captured + 1));
  return kSuccess;
}

__attribute__((visibility("default"))) Result cuEventCreate(void** out, unsigned /*flags*/) {
  if (out == nullptr) return kInvalidValue;
  if (const Result r = need_context()) return r;
  auto* e = new Event{t_device, nullptr};
  State& st = state();
  std::lock_guard<std::mutex> lock(st.mu);
  st.events.insert(e);
  *out = e;
  return kSuccess;
}

__attribute__((visibility("default"))) Result cuEventDestroy_v2(void* handle) {
  State& st = state();
  auto* e = static_cast<Event*>(handle);
  {
    std::lock_guard<std::mutex> lock(st.mu);
    if (st.events.erase(e) == 0) return kInvalidHandle;
  }
  delete e;  // its marks live on in the streams that still hold them
  return kSuccess;
}

__attribute__((visibility("default"))) Result cuEventRecord(void* event, void* stream) {
  if (const Result r = need_context()) return r;
  Event* e = event_of(event);
  Stream* s = stream_of(stream);
  if (e == nullptr || s == nullptr) return kInvalidHandle;
  if (e->device != s->device) return kInvalidHandle;
  auto mark = std::make_shared<Mark>();
  {
    std::lock_guard<std::mutex> lock(state().mu);
    e->mark = mark;
  }
  if (is_capturing(s)) {
    std::lock_guard<std::mutex> lock(mark->mu);
    mark->captured = true;
    return kSuccess;
  }
  s->put(Op{[mark] {
              mark->reach(kSuccess);
              return kSuccess;
            },
            [mark](Result err) { mark->reach(err); }});
  return kSuccess;
}

__attribute__((visibility("default"))) Result cuEventQuery(void* event) {
  Event* e = event_of(event);
  if (e == nullptr) return kInvalidHandle;
  std::shared_ptr<Mark> mark;
  {
    std::lock_guard<std::mutex> lock(state().mu);
    mark = e->mark;
  }
  if (mark == nullptr) return kSuccess;
  std::lock_guard<std::mutex> lock(mark->mu);
  if (mark->captured) return kCaptureUnsupported;
  if (!mark->done) return kNotReady;
  return mark->error;
}

__attribute__((visibility("default"))) Result cuEventSynchronize(void* event) {
  Event* e = event_of(event);
  if (e == nullptr) return kInvalidHandle;
  std::shared_ptr<Mark> mark;
  {
    std::lock_guard<std::mutex> lock(state().mu);
    mark = e->mark;
  }
  if (mark == nullptr) return kSuccess;
  {
    std::lock_guard<std::mutex> lock(mark->mu);
    if (mark->captured) return kCaptureUnsupported;
  }
  return mark->wait();
}

__attribute__((visibility("default"))) Result cuStreamWaitEvent(void* stream, void* event, unsigned flags) {
  if (flags != 0) return kInvalidValue;
  if (const Result r = need_context()) return r;
  Stream* s = stream_of(stream);
  Event* e = event_of(event);
  if (s == nullptr || e == nullptr) return kInvalidHandle;
  std::shared_ptr<Mark> mark;
  {
    std::lock_guard<std::mutex> lock(state().mu);
    mark = e->mark;
  }
  if (mark == nullptr) return kSuccess;
  {
    std::lock_guard<std::mutex> lock(mark->mu);
    if (mark->captured) {
      // A stream that waits on captured work joins the capture, as CUDA's does.
      std::lock_guard<std::mutex> slock(s->mu);
      s->capturing = true;
      return kSuccess;
    }
  }
  enqueue(s, Op{[mark] {
                  // An error of the producer's stream is not this stream's: CUDA orders, it does not
                  // propagate failures across streams.
                  mark->wait();
                  return kSuccess;
                },
                nullptr});
  return kSuccess;
}

__attribute__((visibility("default"))) Result cuMemcpyDtoHAsync_v2(void* dst, std::uint64_t src, std::size_t n,
                                                                   void* stream) {
  if (const Result r = need_context()) return r;
  Stream* s = stream_of(stream);
  if (s == nullptr) return kInvalidHandle;
  unsigned char* from = device_range(src, n, nullptr);
  if (from == nullptr || (dst == nullptr && n > 0)) return kInvalidValue;
  return copy(s, static_cast<unsigned char*>(dst), from, n, pinned(dst, n, true));
}

__attribute__((visibility("default"))) Result cuMemcpyHtoDAsync_v2(std::uint64_t dst, const void* src, std::size_t n,
                                                                   void* stream) {
  if (const Result r = need_context()) return r;
  Stream* s = stream_of(stream);
  if (s == nullptr) return kInvalidHandle;
  unsigned char* to = device_range(dst, n, nullptr);
  if (to == nullptr || (src == nullptr && n > 0)) return kInvalidValue;
  return copy(s, to, static_cast<const unsigned char*>(src), n, pinned(src, n, false));
}

__attribute__((visibility("default"))) Result cuMemHostRegister_v2(void* p, std::size_t n, unsigned flags) {
  if (p == nullptr || n == 0) return kInvalidValue;
  if (const Result r = need_context()) return r;
  State& st = state();
  const auto a = reinterpret_cast<std::uintptr_t>(p);
  std::lock_guard<std::mutex> lock(st.mu);
  auto it = st.registered.lower_bound(a);
  if (it != st.registered.end() && it->first < a + n) return kHostRegistered;
  if (it != st.registered.begin() && std::prev(it)->first + std::prev(it)->second.first > a) return kHostRegistered;
  st.registered[a] = {n, (flags & 0x08) != 0};
  return kSuccess;
}

__attribute__((visibility("default"))) Result cuMemHostUnregister(void* p) {
  State& st = state();
  std::lock_guard<std::mutex> lock(st.mu);
  return st.registered.erase(reinterpret_cast<std::uintptr_t>(p)) ? kSuccess : kHostNotRegistered;
}

__attribute__((visibility("default"))) Result cuPointerGetAttribute(void* data, int attribute, std::uint64_t ptr) {
  if (data == nullptr || attribute != 9) return kInvalidValue;
  int device = -1;
  if (device_range(ptr, 0, &device) == nullptr) return kInvalidValue;
  *static_cast<int*>(data) = device;
  return kSuccess;
}

__attribute__((visibility("default"))) Result cuMemAlloc_v2(std::uint64_t* out, std::size_t n) {
  if (out == nullptr || n == 0) return kInvalidValue;
  if (const Result r = need_context()) return r;
  auto* host = static_cast<unsigned char*>(std::malloc(n));
  if (host == nullptr) return 2;  // CUDA_ERROR_OUT_OF_MEMORY
  std::memset(host, kUnset, n);
  State& st = state();
  std::lock_guard<std::mutex> lock(st.mu);
  const std::uint64_t addr = st.next_addr;
  st.next_addr += ((n + 255) / 256) * 256 + kGuard;
  st.allocs[addr] = Alloc{t_device, n, host};
  *out = addr;
  return kSuccess;
}

__attribute__((visibility("default"))) Result cuMemFree_v2(std::uint64_t addr) {
  State& st = state();
  unsigned char* host = nullptr;
  {
    std::lock_guard<std::mutex> lock(st.mu);
    auto it = st.allocs.find(addr);
    if (it == st.allocs.end()) return kInvalidValue;
    host = it->second.host;
    st.allocs.erase(it);
  }
  std::free(host);
  return kSuccess;
}

__attribute__((visibility("default"))) Result cuLaunchHostFunc(void* stream, void (*fn)(void*), void* data) {
  if (fn == nullptr) return kInvalidValue;
  if (const Result r = need_context()) return r;
  Stream* s = stream_of(stream);
  if (s == nullptr) return kInvalidHandle;
  enqueue(s, Op{[fn, data] {
                  fn(data);
                  return kSuccess;
                },
                nullptr});
  return kSuccess;
}

__attribute__((visibility("default"))) Result cuGetErrorName(Result r, const char** out) {
  if (out == nullptr) return kInvalidValue;
  switch (r) {
    case kSuccess: *out = "CUDA_SUCCESS"; break;
    case kInvalidValue: *out = "CUDA_ERROR_INVALID_VALUE"; break;
    case kNotInitialized: *out = "CUDA_ERROR_NOT_INITIALIZED"; break;
    case kNoDevice: *out = "CUDA_ERROR_NO_DEVICE"; break;
    case kInvalidDevice: *out = "CUDA_ERROR_INVALID_DEVICE"; break;
    case kInvalidContext: *out = "CUDA_ERROR_INVALID_CONTEXT"; break;
    case kInvalidHandle: *out = "CUDA_ERROR_INVALID_HANDLE"; break;
    case kNotReady: *out = "CUDA_ERROR_NOT_READY"; break;
    case kIllegalAddress: *out = "CUDA_ERROR_ILLEGAL_ADDRESS"; break;
    case kHostRegistered: *out = "CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED"; break;
    case kHostNotRegistered: *out = "CUDA_ERROR_HOST_MEMORY_NOT_REGISTERED"; break;
    case kCaptureUnsupported: *out = "CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED"; break;
    case kCaptureInvalidated: *out = "CUDA_ERROR_STREAM_CAPTURE_INVALIDATED"; break;
    default: *out = nullptr; return kInvalidValue;
  }
  return kSuccess;
}

__attribute__((visibility("default"))) Result cuGetErrorString(Result r, const char** out) {
  if (out == nullptr) return kInvalidValue;
  const char* name = nullptr;
  if (cuGetErrorName(r, &name) != kSuccess) {
    *out = nullptr;
    return kInvalidValue;
  }
  *out = "(the smddp stand-in driver)";
  return kSuccess;
}

// -- the stand-in's own controls, for tests -------------------------------------------------------

__attribute__((visibility("default"))) void smddp_standin_set_copy_delay_us(std::int64_t us) {
  state().copy_delay_us = us;
}

// A kernel on `stream` that runs until smddp_standin_release(id) (or `limit_ms` passes, so that a
// failed test cannot hang): returns its id, 0 when the stream is unknown.
__attribute__((visibility("default"))) std::uint64_t smddp_standin_hold(void* stream, std::int64_t limit_ms) {
  if (need_context() != kSuccess) return 0;
  Stream* s = stream_of(stream);
  if (s == nullptr) return 0;
  auto h = std::make_shared<Hold>();
  std::uint64_t id;
  {
    State& st = state();
    std::lock_guard<std::mutex> lock(st.mu);
    id = st.next_hold++;
    st.holds[id] = h;
  }
  enqueue(s, Op{[h, limit_ms] {
                  std::unique_lock<std::mutex> lock(h->mu);
                  h->started = true;
                  h->cv.notify_all();
                  h->cv.wait_for(lock, std::chrono::milliseconds(limit_ms), [&] { return h->released; });
                  return kSuccess;
                },
                nullptr});
  return id;
}

// Whether hold `id` has begun running (its stream reached it).
__attribute__((visibility("default"))) int smddp_standin_hold_started(std::uint64_t id) {
  std::shared_ptr<Hold> h;
  {
    State& st = state();
    std::lock_guard<std::mutex> lock(st.mu);
    auto it = st.holds.find(id);
    if (it == st.holds.end()) return 0;
    h = it->second;
  }
  std::lock_guard<std::mutex> lock(h->mu);
  return h->started ? 1 : 0;
}

__attribute__((visibility("default"))) int smddp_standin_release(std::uint64_t id) {
  std::shared_ptr<Hold> h;
  {
    State& st = state();
    std::lock_guard<std::mutex> lock(st.mu);
    auto it = st.holds.find(id);
    if (it == st.holds.end()) return 0;
    h = it->second;
    st.holds.erase(it);
  }
  {
    std::lock_guard<std::mutex> lock(h->mu);
    h->released = true;
  }
  h->cv.notify_all();
  return 1;
}

// A kernel on `stream` that fails with `error` (sticky: the stream's later work is skipped, and its
// later event records report it), as a kernel's illegal access does.
__attribute__((visibility("default"))) Result smddp_standin_fail(void* stream, Result error) {
  if (const Result r = need_context()) return r;
  Stream* s = stream_of(stream);
  if (s == nullptr) return kInvalidHandle;
  enqueue(s, Op{[error] { return error; }, nullptr});
  return kSuccess;
}

// Copies since the process began: (to or from pinned memory, asynchronous) and (pageable, blocking).
__attribute__((visibility("default"))) void smddp_standin_copies(std::uint64_t* pinned_copies,
                                                                 std::uint64_t* pageable_copies) {
  *pinned_copies = state().copies_pinned.load();
  *pageable_copies = state().copies_pageable.load();
}

}  // extern "C"
