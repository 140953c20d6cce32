// A stand-in CUDA driver: the driver API entry points the engine loads (smddp/engine/cuda_abi.h),
// exported under the driver's own names from a library of its own (libsmddp_standin_cuda.so), so
// that the engine's loader, its device calls and its progress thread run in CI, where no GPU is.
//
// What it models, because the engine's correctness depends on it:
// - streams run their work in order on a thread each, asynchronously to the host (or, set
//   immediate, in the enqueuing thread at once); a stream's work after a failure is skipped and
//   every later event record on it reports the failure, with its words (sticky, as CUDA's); a
//   stream that waits on a failed stream's event fails too (CUDA's sticky errors poison far more);
// - copies land late: each waits SMDDP_STANDIN_COPY_DELAY_US (or the stream's own delay,
//   smddp_standin_stream_config) before it moves a byte; a copy to or from pageable host memory blocks the caller until it is
//   done (CUDA may stage or synchronise such copies; a caller can count on neither);
// - events: each record replaces the point later waits and queries refer to; a stream that waits on
//   an event holds its later work back until the event is reached;
// - contexts: every call that needs one fails with CUDA_ERROR_INVALID_CONTEXT on a thread that has
//   made none current (cuCtxSetCurrent), as the driver does on a fresh thread;
// - several devices (SMDDP_STANDIN_DEVICES, default 1), each stream, event and allocation on one;
// - device memory at addresses far above any host address (cuMemAlloc's from 0xD800...), backed by
//   host memory here, and ranges a caller maps itself (smddp_standin_map: the Python stand-in
//   runtime's arrays, from 0xD000...); a copy naming a range outside every allocation fails
//   (CUDA_ERROR_INVALID_VALUE), and so does a device-to-host copy into read-only registered memory;
// - host functions (cuLaunchHostFunc) run in stream order; one may fail its stream
//   (smddp_standin_fail_running), as a faulting kernel does;
// - graph capture: work on a capturing stream is recorded, not run; host waits on captured work
//   are refused (CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED) (the Python stand-in keeps the graphs it
//   replays itself, and tells this library which streams capture);
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
                 kCaptureInvalidated = 901, kNotPermitted = 800, kUnknown = 999;

constexpr std::uint64_t kDeviceBase = 0xD800000000000000ULL;  // (0xD000...: mapped by callers)
constexpr std::uint64_t kGuard = 1 << 20;  // address gap between allocations: an overrun lands on none
constexpr unsigned char kUnset = 0xA5;     // fresh allocations hold this byte, as cuMemAlloc'd memory holds garbage

// A stream's sticky failure: the driver's code and what failed, in words.
struct Failure {
  Result code = kSuccess;
  std::string text;
  bool failed() const { return code != kSuccess; }
};

// One record of an event: reached when its stream gets there, with the stream's failure then.
struct Mark {
  std::mutex mu;
  std::condition_variable cv;
  bool done = false;
  bool captured = false;  // recorded under capture: reached only when a graph runs, never here
  Failure failure;
  void reach(const Failure& f) {
    {
      std::lock_guard<std::mutex> lock(mu);
      done = true;
      failure = f;
    }
    cv.notify_all();
  }
  Failure wait() {
    std::unique_lock<std::mutex> lock(mu);
    cv.wait(lock, [this] { return done; });
    return failure;
  }
};

struct Event {
  int device;
  std::shared_ptr<Mark> mark;  // the last record (none: never recorded, which counts as reached)
};

// An operation on a stream: what it runs, and what runs instead once the stream has failed (a
// mark's reach, so that nothing waits for ever on a failed stream); `run` returns its failure.
struct Op {
  std::function<Failure()> run;
  std::function<void(const Failure&)> always;
};

struct Stream;
// The stream whose operation the calling thread runs (a host function's, for smddp_standin_fail_running),
// and the failure that operation reports.
thread_local Stream* t_stream = nullptr;
thread_local Failure* t_failure = nullptr;

struct Stream {
  int device = 0;
  std::mutex mu;
  std::condition_variable cv;
  std::deque<Op> queue;
  bool running = false;  // the thread is in an op
  bool closing = false;
  bool detached = false;  // let go with work left: the thread ends once it has run it, and frees this
  Failure failure;        // sticky
  bool capturing = false;
  std::size_t captured = 0;  // ops recorded into the graph under capture
  std::atomic<std::int64_t> delay_us{-1};  // each copy's delay (-1: the process's)
  bool immediate = false;  // every operation runs in the enqueuing thread, at once
  std::mutex run_mu;       // (immediate) one operation at a time, in the order they came
  std::thread thread;

  void put(Op op) {
    if (immediate) {
      std::lock_guard<std::mutex> order(run_mu);
      step(op);
      return;
    }
    {
      std::lock_guard<std::mutex> lock(mu);
      queue.push_back(std::move(op));
    }
    cv.notify_all();
  }
  void step(Op& op) {
    Failure failed;
    {
      std::lock_guard<std::mutex> lock(mu);
      failed = failure;
    }
    if (failed.failed()) {
      if (op.always) op.always(failed);
      return;
    }
    if (!op.run) return;
    Failure reported;
    Stream* outer_stream = t_stream;
    Failure* outer_failure = t_failure;
    t_stream = this;
    t_failure = &reported;
    Failure f = op.run();
    t_stream = outer_stream;
    t_failure = outer_failure;
    if (!f.failed()) f = reported;
    if (f.failed()) {
      std::lock_guard<std::mutex> lock(mu);
      if (!failure.failed()) failure = f;
    }
  }
  // Returns true once the stream is let go (detached) and empty: the caller frees it.
  bool loop() {
    for (;;) {
      Op op;
      {
        std::unique_lock<std::mutex> lock(mu);
        cv.wait(lock, [this] { return closing || !queue.empty(); });
        if (queue.empty()) return detached;
        op = std::move(queue.front());
        queue.pop_front();
        running = true;
      }
      step(op);
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
  bool owned;  // cuMemAlloc's (freed by cuMemFree); else a caller's mapping (smddp_standin_map)
};

struct Hold {
  std::mutex mu;
  std::condition_variable cv;
  bool started = false;
  bool released = false;
};

constexpr int kMaxDevices = 64;

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
  // What becomes of a registration of memory the device may write (smddp_standin_register_mode):
  // 0 as asked; 1 it waits (register_cv, `register_waiting` counting) until the mode is set again;
  // 2 it is refused, as a driver that cannot page-lock that memory refuses it.
  int register_mode = 0;
  int register_waiting = 0;
  std::condition_variable register_cv;
  std::map<std::uint64_t, std::shared_ptr<Hold>> holds;
  std::uint64_t next_hold = 1;
  std::atomic<std::uint64_t> copies_pinned{0};
  std::atomic<std::uint64_t> copies_pageable{0};
  std::atomic<std::uint64_t> copies_d2h{0};
  std::atomic<std::uint64_t> copies_h2d{0};
  // The calls a test watches (smddp_standin_trace): (what, the stream handle as passed), in call order.
  std::mutex trace_mu;
  bool tracing = false;
  std::vector<std::pair<int, std::uintptr_t>> trace;
};

State& state() {
  static State* s = new State();  // never destroyed: stream threads may outlive static destruction
  return *s;
}

// The device whose primary context the calling thread made current (-1: none).
thread_local int t_device = -1;
// The fake contexts' addresses: one byte each, per device, so that a CUcontext names its device.
unsigned char g_contexts[kMaxDevices];

Result need_context() { return t_device < 0 ? kInvalidContext : kSuccess; }

// What the trace names: a copy device to host, host to device, a stream's wait for an event.
constexpr int kTraceD2H = 0, kTraceH2D = 1, kTraceWait = 2;
State& state();
void traced(int what, void* stream) {
  State& st = state();
  std::lock_guard<std::mutex> lock(st.trace_mu);
  if (st.tracing) st.trace.emplace_back(what, reinterpret_cast<std::uintptr_t>(stream));
}

Failure ok() { return Failure{}; }

Stream* start_stream(int device) {
  Stream* s = new Stream();
  s->device = device;
  s->thread = std::thread([s] {
    if (s->loop()) delete s;  // let go (detached) and drained: nothing else holds it
  });
  return s;
}

// The stream a handle names (0 and the legacy handle: the current device's default stream;
// per-thread: the same here), or nullptr.
Stream* stream_of(void* handle) {
  State& st = state();
  const auto h = reinterpret_cast<std::uintptr_t>(handle);
  std::lock_guard<std::mutex> lock(st.mu);
  if (h == 0 || h == 1 || h == 2) {
    if (t_device < 0 || t_device >= st.devices) return nullptr;
    Stream*& d = st.defaults[static_cast<std::size_t>(t_device)];
    if (d == nullptr) {
      d = start_stream(t_device);
      d->delay_us = -1;
    }
    return d;
  }
  auto* s = static_cast<Stream*>(handle);
  return st.streams.count(s) ? s : nullptr;
}

// The last record of the event `handle` names (nullptr: never recorded), the event looked up and its
// record read under one lock, since another thread's cuEventDestroy frees the Event; *known says
// whether `handle` names one.
std::shared_ptr<Mark> last_mark(void* handle, bool* known) {
  State& st = state();
  std::lock_guard<std::mutex> lock(st.mu);
  auto* e = static_cast<Event*>(handle);
  *known = st.events.count(e) != 0;
  return *known ? e->mark : nullptr;
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

// How host range [p, p + n) is registered: 0 not (pageable), 1 inside one registered range, -1 inside
// a read-only one where the device would write it.
int pinned(const void* p, std::size_t n, bool device_writes) {
  State& st = state();
  const auto a = reinterpret_cast<std::uintptr_t>(p);
  std::lock_guard<std::mutex> lock(st.mu);
  auto it = st.registered.upper_bound(a);
  if (it == st.registered.begin()) return 0;
  --it;
  if (a - it->first > it->second.first || n > it->second.first - (a - it->first)) return 0;
  return device_writes && it->second.second ? -1 : 1;
}

void late(const Stream* s) {
  std::int64_t us = s->delay_us.load(std::memory_order_relaxed);
  if (us < 0) us = state().copy_delay_us.load(std::memory_order_relaxed);
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

// Waits for what was put on `s` so far; the stream's failure then (kSuccess: none).
Failure settle(Stream* s) {
  auto mark = std::make_shared<Mark>();
  s->put(Op{[mark] {
              mark->reach(ok());
              return ok();
            },
            [mark](const Failure& f) { mark->reach(f); }});
  return mark->wait();
}

Result copy(Stream* s, unsigned char* dst, const unsigned char* src, std::size_t n, bool pinned_host, bool to_host) {
  if (n == 0) return kSuccess;
  (to_host ? state().copies_d2h : state().copies_h2d)++;
  Op op{[s, dst, src, n] {
          late(s);
          std::memmove(dst, src, n);
          return ok();
        },
        nullptr};
  if (pinned_host) {
    state().copies_pinned++;
    enqueue(s, std::move(op));
    return kSuccess;
  }
  state().copies_pageable++;
  if (is_capturing(s)) return kCaptureUnsupported;  // a copy the host waits for cannot be captured
  s->put(std::move(op));
  return settle(s).code;
}

// Takes the stream `handle` names off the table and tells its thread to end once what was put on
// it has run (`detached`: and to free it then); nullptr when it names none.
Stream* close_stream(void* handle, bool detached) {
  State& st = state();
  auto* s = static_cast<Stream*>(handle);
  {
    std::lock_guard<std::mutex> lock(st.mu);
    if (st.streams.erase(s) == 0) return nullptr;
  }
  // All under its lock: once it is let go, a detached thread frees `s` as soon as it sees `closing`,
  // so nothing here may touch `s` after the lock (its cv, its thread) -- a TSan job caught the
  // cv's notify racing its destruction.
  std::lock_guard<std::mutex> lock(s->mu);
  s->closing = true;
  s->detached = detached;
  if (detached) s->thread.detach();
  s->cv.notify_all();
  return s;
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
    if (st.devices < 0 || st.devices > kMaxDevices) st.devices = 0;
    const char* d = std::getenv("SMDDP_STANDIN_COPY_DELAY_US");
    st.copy_delay_us = d != nullptr ? std::atoll(d) : 0;
    st.defaults.assign(static_cast<std::size_t>(kMaxDevices), nullptr);
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

__attribute__((visibility("default"))) Result cuCtxGetCurrent(void** ctx) {
  if (ctx == nullptr) return kInvalidValue;
  *ctx = t_device < 0 ? nullptr : static_cast<void*>(g_contexts + t_device);
  return kSuccess;
}

__attribute__((visibility("default"))) Result cuCtxSetCurrent(void* ctx) {
  if (ctx == nullptr) {
    t_device = -1;
    return kSuccess;
  }
  const auto* c = static_cast<unsigned char*>(ctx);
  State& st = state();
  int devices;
  {
    std::lock_guard<std::mutex> lock(st.mu);
    devices = st.devices;
  }
  if (c < g_contexts || c >= g_contexts + devices) return kInvalidContext;
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
  // As the driver: work already put runs to the end, then the stream goes.
  Stream* s = close_stream(handle, false);
  if (s == nullptr) return kInvalidHandle;
  s->thread.join();
  delete s;
  return kSuccess;
}

__attribute__((visibility("default"))) Result cuStreamSynchronize(void* handle) {
  if (const Result r = need_context()) return r;
  Stream* s = stream_of(handle);
  if (s == nullptr) return kInvalidHandle;
  if (is_capturing(s)) return kCaptureUnsupported;
  return settle(s).code;
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
  Stream* s = stream_of(stream);
  if (s == nullptr) return kInvalidHandle;
  auto mark = std::make_shared<Mark>();
  {
    // (looked up and written under one lock: another thread's cuEventDestroy frees the Event)
    State& st = state();
    std::lock_guard<std::mutex> lock(st.mu);
    auto* e = static_cast<Event*>(event);
    if (st.events.count(e) == 0 || e->device != s->device) return kInvalidHandle;
    e->mark = mark;
  }
  if (is_capturing(s)) {
    std::lock_guard<std::mutex> lock(mark->mu);
    mark->captured = true;
    return kSuccess;
  }
  s->put(Op{[mark] {
              mark->reach(ok());
              return ok();
            },
            [mark](const Failure& f) { mark->reach(f); }});
  return kSuccess;
}

__attribute__((visibility("default"))) Result cuEventQuery(void* event) {
  bool known = false;
  const std::shared_ptr<Mark> mark = last_mark(event, &known);
  if (!known) return kInvalidHandle;
  if (mark == nullptr) return kSuccess;
  std::lock_guard<std::mutex> lock(mark->mu);
  if (mark->captured) return kCaptureUnsupported;
  if (!mark->done) return kNotReady;
  return mark->failure.code;
}

__attribute__((visibility("default"))) Result cuEventSynchronize(void* event) {
  bool known = false;
  const std::shared_ptr<Mark> mark = last_mark(event, &known);
  if (!known) return kInvalidHandle;
  if (mark == nullptr) return kSuccess;
  {
    std::lock_guard<std::mutex> lock(mark->mu);
    if (mark->captured) return kCaptureUnsupported;
  }
  return mark->wait().code;
}

__attribute__((visibility("default"))) Result cuStreamWaitEvent(void* stream, void* event, unsigned flags) {
  if (flags != 0) return kInvalidValue;
  if (const Result r = need_context()) return r;
  traced(kTraceWait, stream);
  Stream* s = stream_of(stream);
  bool known = false;
  const std::shared_ptr<Mark> mark = last_mark(event, &known);
  if (s == nullptr || !known) return kInvalidHandle;
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
  // The producer's failure becomes this stream's: what follows the wait would read what the
  // failed work never wrote.
  enqueue(s, Op{[mark] { return mark->wait(); }, nullptr});
  return kSuccess;
}

__attribute__((visibility("default"))) Result cuMemcpyDtoHAsync_v2(void* dst, std::uint64_t src, std::size_t n,
                                                                   void* stream) {
  if (const Result r = need_context()) return r;
  traced(kTraceD2H, stream);
  Stream* s = stream_of(stream);
  if (s == nullptr) return kInvalidHandle;
  unsigned char* from = device_range(src, n, nullptr);
  if (from == nullptr || (dst == nullptr && n > 0)) return kInvalidValue;
  const int p = pinned(dst, n, true);
  if (p < 0) return kInvalidValue;  // the device may not write read-only registered memory
  return copy(s, static_cast<unsigned char*>(dst), from, n, p == 1, true);
}

__attribute__((visibility("default"))) Result cuMemcpyHtoDAsync_v2(std::uint64_t dst, const void* src, std::size_t n,
                                                                   void* stream) {
  if (const Result r = need_context()) return r;
  traced(kTraceH2D, stream);
  Stream* s = stream_of(stream);
  if (s == nullptr) return kInvalidHandle;
  unsigned char* to = device_range(dst, n, nullptr);
  if (to == nullptr || (src == nullptr && n > 0)) return kInvalidValue;
  return copy(s, to, static_cast<const unsigned char*>(src), n, pinned(src, n, false) == 1, false);
}

__attribute__((visibility("default"))) Result cuMemHostRegister_v2(void* p, std::size_t n, unsigned flags) {
  if (p == nullptr || n == 0) return kInvalidValue;
  if (const Result r = need_context()) return r;
  State& st = state();
  const auto a = reinterpret_cast<std::uintptr_t>(p);
  std::unique_lock<std::mutex> lock(st.mu);
  if ((flags & 0x08) == 0) {
    if (st.register_mode == 1) {
      st.register_waiting++;
      st.register_cv.wait(lock, [&st] { return st.register_mode != 1; });
      st.register_waiting--;
    }
    if (st.register_mode == 2) return kNotPermitted;
  }
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
  st.allocs[addr] = Alloc{t_device, n, host, true};
  *out = addr;
  return kSuccess;
}

__attribute__((visibility("default"))) Result cuMemFree_v2(std::uint64_t addr) {
  State& st = state();
  unsigned char* host = nullptr;
  {
    std::lock_guard<std::mutex> lock(st.mu);
    auto it = st.allocs.find(addr);
    if (it == st.allocs.end() || !it->second.owned) return kInvalidValue;
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
                  return ok();
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
    case kNotPermitted: *out = "CUDA_ERROR_NOT_PERMITTED"; break;
    case kUnknown: *out = "CUDA_ERROR_UNKNOWN"; break;
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

// -- the stand-in's own controls, for tests and the Python stand-in runtime ----------------------

__attribute__((visibility("default"))) void smddp_standin_set_copy_delay_us(std::int64_t us) {
  state().copy_delay_us = us;
}

// Registrations of memory the device may write (cuMemHostRegister without READ_ONLY) from now on:
// 0 as asked, 1 held until the mode is set again (those held go on then), 2 refused
// (CUDA_ERROR_NOT_PERMITTED). Returns how many wait held at the moment of the call.
__attribute__((visibility("default"))) int smddp_standin_register_mode(int mode) {
  State& st = state();
  std::lock_guard<std::mutex> lock(st.mu);
  if (mode >= 0) {
    st.register_mode = mode;
    st.register_cv.notify_all();
  }
  return st.register_waiting;
}

// The driver's registered host ranges (every caller's: the engine's and the runtime's), at most `n`
// of them into `addrs` / `sizes` / `readonly`; returns how many there are.
__attribute__((visibility("default"))) std::size_t smddp_standin_registered(std::uintptr_t* addrs, std::size_t* sizes,
                                                                            int* readonly, std::size_t n) {
  State& st = state();
  std::lock_guard<std::mutex> lock(st.mu);
  std::size_t i = 0;
  for (const auto& kv : st.registered) {
    if (i < n) {
      addrs[i] = kv.first;
      sizes[i] = kv.second.first;
      readonly[i] = kv.second.second ? 1 : 0;
    }
    i++;
  }
  return st.registered.size();
}

// At least `n` devices from now on (the Python stand-in runtimes of one process may ask for more).
__attribute__((visibility("default"))) Result smddp_standin_set_devices(int n) {
  if (n < 1 || n > kMaxDevices) return kInvalidValue;
  State& st = state();
  std::lock_guard<std::mutex> lock(st.mu);
  if (!st.initialised) return kNotInitialized;
  if (n > st.devices) st.devices = n;
  return kSuccess;
}

// A stream's own settings: each copy's delay (-1: the process's), and whether its operations run
// in the enqueuing thread at once (set before anything is put on it).
__attribute__((visibility("default"))) Result smddp_standin_stream_config(void* stream, std::int64_t delay_us,
                                                                          int immediate) {
  if (const Result r = need_context()) return r;
  Stream* s = stream_of(stream);
  if (s == nullptr) return kInvalidHandle;
  s->delay_us = delay_us;
  std::lock_guard<std::mutex> lock(s->mu);
  s->immediate = immediate != 0;
  return kSuccess;
}

// Lets `stream` go without waiting for its work (cuStreamDestroy waits): its thread ends, and
// frees it, once what was put on it has run (a hold a test never let go ends at its limit).
__attribute__((visibility("default"))) Result smddp_standin_stream_release(void* handle) {
  return close_stream(handle, true) == nullptr ? kInvalidHandle : kSuccess;
}

// Device range [addr, addr + n) of `device` is `host`'s memory (the caller keeps it until unmapped).
__attribute__((visibility("default"))) Result smddp_standin_map(std::uint64_t addr, void* host, std::size_t n,
                                                                int device) {
  if (host == nullptr || n == 0 || addr >= kDeviceBase || addr + n > kDeviceBase) return kInvalidValue;
  State& st = state();
  std::lock_guard<std::mutex> lock(st.mu);
  auto it = st.allocs.lower_bound(addr);
  if (it != st.allocs.end() && it->first < addr + n) return kInvalidValue;
  if (it != st.allocs.begin() && std::prev(it)->first + std::prev(it)->second.nbytes > addr) return kInvalidValue;
  st.allocs[addr] = Alloc{device, n, static_cast<unsigned char*>(host), false};
  return kSuccess;
}

__attribute__((visibility("default"))) Result smddp_standin_unmap(std::uint64_t addr) {
  State& st = state();
  std::lock_guard<std::mutex> lock(st.mu);
  auto it = st.allocs.find(addr);
  if (it == st.allocs.end() || it->second.owned) return kInvalidValue;
  st.allocs.erase(it);
  return kSuccess;
}

// Called from a host function: the operation running fails its stream with `code` and `text`.
__attribute__((visibility("default"))) Result smddp_standin_fail_running(Result code, const char* text) {
  if (t_failure == nullptr || code == kSuccess) return kInvalidValue;
  if (!t_failure->failed()) *t_failure = Failure{code, text != nullptr ? text : ""};
  return kSuccess;
}

// The words of an event's failure (its last record's), copied into `out` (at most `n` bytes with
// the terminating zero); returns its code (kSuccess: none, or not reached).
__attribute__((visibility("default"))) Result smddp_standin_event_failure(void* event, char* out, std::size_t n) {
  bool known = false;
  const std::shared_ptr<Mark> mark = last_mark(event, &known);
  if (!known) return kInvalidHandle;
  if (n > 0) out[0] = '\0';
  if (mark == nullptr) return kSuccess;
  std::lock_guard<std::mutex> lock(mark->mu);
  if (!mark->done) return kSuccess;
  if (n > 0) {
    std::strncpy(out, mark->failure.text.c_str(), n - 1);
    out[n - 1] = '\0';
  }
  return mark->failure.code;
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
                  return ok();
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
  enqueue(s, Op{[error] { return Failure{error, "a kernel failed"}; }, nullptr});
  return kSuccess;
}

// Copies since the process began: (to or from pinned memory, asynchronous) and (pageable, blocking).
__attribute__((visibility("default"))) void smddp_standin_copies(std::uint64_t* pinned_copies,
                                                                 std::uint64_t* pageable_copies) {
  *pinned_copies = state().copies_pinned.load();
  *pageable_copies = state().copies_pageable.load();
}

// The trace of copies and waits, whoever calls (the Python stand-in runtime, the engine): `on` starts
// it afresh, off stops it; take copies up to `n` entries (what, stream) into `what` and `streams` and
// returns how many it holds (more than `n`: some were not copied).
__attribute__((visibility("default"))) void smddp_standin_trace(int on) {
  State& st = state();
  std::lock_guard<std::mutex> lock(st.trace_mu);
  st.tracing = on != 0;
  if (on != 0) st.trace.clear();
}

__attribute__((visibility("default"))) std::size_t smddp_standin_trace_take(int* what, std::uintptr_t* streams,
                                                                           std::size_t n) {
  State& st = state();
  std::lock_guard<std::mutex> lock(st.trace_mu);
  for (std::size_t i = 0; i < n && i < st.trace.size(); i++) {
    what[i] = st.trace[i].first;
    streams[i] = st.trace[i].second;
  }
  return st.trace.size();
}

// The same by direction, whoever enqueued them (the Python stand-in runtime, the engine): device to
// host, host to device, pinned, pageable, into `out[4]`.
__attribute__((visibility("default"))) void smddp_standin_copy_counts(std::uint64_t* out) {
  out[0] = state().copies_d2h.load();
  out[1] = state().copies_h2d.load();
  out[2] = state().copies_pinned.load();
  out[3] = state().copies_pageable.load();
}

}  // extern "C"
