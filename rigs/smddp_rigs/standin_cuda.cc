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
//   steps without betting on durations;
// - memory shared across processes: cuMemAlloc's memory is a memfd, an IPC memory handle names it
//   (the exporter's pid and fd, reached through /proc: only where that process is visible), and
//   cuIpcOpenMemHandle maps it at an address of its own, counted per process; a process's own handle
//   is refused, and one of another device where peer access cannot be had (SMDDP_STANDIN_PEER=0);
// - events shared across processes (CU_EVENT_INTERPROCESS): a shared page counts the records made
//   and reached, so a wait (cuStreamWaitEvent, in any process) holds its stream back until the
//   records made before the wait was called are reached, and no longer; a recording stream's failure
//   fails the waiters;
// - device-to-device copies (peer copies through unified addresses: cuMemcpyDtoDAsync, and 2-D ones,
//   cuMemcpy2DAsync), late as every copy;
// - stream memory operations (cuStreamWriteValue32, cuStreamWaitValue32) on device words, shared
//   across processes through IPC memory: the ordering of one process's stream after another's, with
//   no host between;
// - kernels: cuModuleLoadData takes PTX text (refusing a .version past SMDDP_STANDIN_PTX_MAX), and
//   an entry that has a native body here by its name (the engine's folds, kernels.cu) runs in stream
//   order, late, reading only its device's memory or memory opened through IPC (else it fails its
//   stream with CUDA_ERROR_ILLEGAL_ADDRESS, as a fault does).
//
// Not modelled: the legacy default stream's implicit synchronisation with other blocking streams
// (the engine only ever creates non-blocking ones), timing events, cuCtxEnablePeerAccess (peer
// memory is reached only through IPC here), interprocess events under graph capture.
//
// Memory: the state is one process-wide object that is never destroyed (stream threads may still be
// parked when the process exits); allocations are freed by cuMemFree, streams joined by
// cuStreamDestroy once their work has run.
#include <fcntl.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cmath>
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
#include <string>
#include <thread>
#include <type_traits>
#include <vector>

#include "fold_args.h"

namespace {

using Result = int;
constexpr Result kSuccess = 0, kInvalidValue = 1, kNotInitialized = 3, kNoDevice = 100, kInvalidDevice = 101,
                 kInvalidContext = 201, kInvalidHandle = 400, kNotReady = 600, kIllegalAddress = 700,
                 kHostRegistered = 712, kHostNotRegistered = 713, kCaptureUnsupported = 900,
                 kCaptureInvalidated = 901, kNotPermitted = 800, kUnknown = 999, kInvalidImage = 200,
                 kPeerUnsupported = 217, kUnsupportedPtx = 222, kNotFound = 500, kLaunchFailed = 719;

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

// An interprocess event's state, in a page of shared memory (a memfd) that every process which has
// the event maps: how many records were made, how many reached, and a producer's failure. A record
// counts up at the call; its stream reaching it writes `reached`. A wait or query refers to the
// records made when it is called (so a cross-process wait must come after the record, in host
// order: what CUDA's IPC events ask of their users too).
struct IpcPage {
  std::atomic<std::uint64_t> recorded;
  std::atomic<std::uint64_t> reached;
  std::atomic<std::int32_t> failure;  // a recording stream's failure code (0: none)
  std::atomic<std::int32_t> owner;    // the creating process
};
static_assert(std::atomic<std::uint64_t>::is_always_lock_free, "shared atomics must be address-free");

struct IpcShared {
  IpcPage* page = nullptr;
  int fd = -1;  // the creator's memfd (what a handle names; -1 in a process that opened it)
  ~IpcShared() {
    if (page != nullptr) munmap(page, 4096);
    if (fd >= 0) close(fd);
  }
};

struct Event {
  int device;
  std::shared_ptr<Mark> mark;  // the last record (none: never recorded, which counts as reached)
  std::shared_ptr<IpcShared> ipc;  // an interprocess event's shared page (nullptr: a process-local one)
};

// An operation on a stream: what it runs, and what runs instead once the stream has failed (a
// mark's reach, so that nothing waits for ever on a failed stream); `run` returns its failure.
struct Op {
  std::function<Failure()> run;
  std::function<void(const Failure&)> always;
};

// This library's thread-locals are in the static TLS block (initial-exec; a few bytes of what glibc
// keeps spare for libraries loaded later): as a dlopen'ed library's default (dynamic) TLS, each
// thread's copy would be malloc'ed by the loader and freed by whichever thread later reuses or joins
// its stack, and TSan reported the stream thread's last write of t_stream "racing" that free.
#define SMDDP_STATIC_TLS __attribute__((tls_model("initial-exec")))

struct Stream;
// The stream whose operation the calling thread runs (a host function's, for smddp_standin_fail_running),
// and the failure that operation reports.
SMDDP_STATIC_TLS thread_local Stream* t_stream = nullptr;
SMDDP_STATIC_TLS thread_local Failure* t_failure = nullptr;

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

// How an allocation came to be.
enum class From { kAlloc, kMapped, kOpened };

struct Alloc {
  int device;
  std::uint64_t nbytes;
  unsigned char* host;
  bool owned;  // cuMemAlloc's (freed by cuMemFree); else a caller's mapping or an opened IPC handle
  From from = From::kMapped;
  int fd = -1;                // kAlloc: the memfd behind it (what an IPC handle names)
  std::uint64_t serial = 0;   // kAlloc: this process's number for it; kOpened: the exporter's
  std::int32_t pid = 0;       // kOpened: the exporter
  int opens = 0;              // kOpened: cuIpcOpenMemHandle calls not yet closed
  std::size_t map_len = 0;    // the mmap'd length (kAlloc, kOpened)
};

// What a CUipcMemHandle / CUipcEventHandle (64 opaque bytes) holds here: a memfd of the exporting
// process, reached through /proc (so, as CUDA's, only where that process is visible and ours).
struct IpcWire {
  std::uint32_t magic;  // kIpcMagic
  std::uint32_t kind;   // 1 memory, 2 event
  std::int32_t pid;
  std::int32_t fd;
  std::uint64_t nbytes;
  std::uint64_t serial;
  std::int32_t device;
};
constexpr std::uint32_t kIpcMagic = 0x53444950;  // "SDIP"
struct IpcHandle {
  char reserved[64];
};
static_assert(sizeof(IpcWire) <= sizeof(IpcHandle), "an IPC handle holds 64 bytes");

// A loaded module: the entry points its PTX declares.
struct Module {
  std::set<std::string> entries;
};
// A kernel: its native body (what the stand-in runs for the PTX entry of that name) and the bytes of
// its one by-value argument.
struct Function {
  std::string name;
  std::size_t arg_bytes;
  Result (*body)(const void* args, int device, std::string* why);
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
  std::uint64_t next_serial = 1;
  std::set<Module*> modules;
  std::set<Function*> functions;
  std::atomic<std::uint64_t> copies_d2d{0};
  std::atomic<std::uint64_t> kernels{0};
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
SMDDP_STATIC_TLS thread_local int t_device = -1;
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

constexpr unsigned kEventDisableTiming = 0x2, kEventInterprocess = 0x4;

std::shared_ptr<IpcShared> make_ipc_page() {
  const int fd = memfd_create("smddp-standin-event", MFD_CLOEXEC);
  if (fd < 0) return nullptr;
  void* page = ftruncate(fd, 4096) == 0 ? mmap(nullptr, 4096, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0) : MAP_FAILED;
  if (page == MAP_FAILED) {
    close(fd);
    return nullptr;
  }
  auto ipc = std::make_shared<IpcShared>();
  ipc->fd = fd;
  ipc->page = new (page) IpcPage{};
  ipc->page->owner.store(static_cast<std::int32_t>(getpid()));
  return ipc;
}

// An interprocess event's state at `target` records: kSuccess reached, kNotReady not yet, a
// recording stream's failure, or kUnknown once the process that made it has gone with it unreached
// (a GPU would wait for ever; the stand-in ends the wait so that a test's process can end).
Result ipc_state(const IpcShared& ipc, std::uint64_t target) {
  if (ipc.page->reached.load(std::memory_order_acquire) >= target) return kSuccess;
  if (const std::int32_t f = ipc.page->failure.load(std::memory_order_acquire)) return f;
  const pid_t owner = ipc.page->owner.load();
  if (kill(owner, 0) != 0 && errno == ESRCH) return kUnknown;
  return kNotReady;
}

Result ipc_wait(const IpcShared& ipc, std::uint64_t target) {
  for (;;) {
    const Result r = ipc_state(ipc, target);
    if (r != kNotReady) return r;
    std::this_thread::sleep_for(std::chrono::microseconds(20));
  }
}

// The event `handle` names' shared page, looked up under the table's lock (nullptr: not an
// interprocess event); *known whether it names one at all.
std::shared_ptr<IpcShared> ipc_of(void* handle, bool* known) {
  State& st = state();
  std::lock_guard<std::mutex> lock(st.mu);
  auto* e = static_cast<Event*>(handle);
  *known = st.events.count(e) != 0;
  return *known ? e->ipc : nullptr;
}

// -- the kernels' native bodies: what the stand-in runs for a PTX entry of the same name ----------

// The host memory behind device range [addr, addr + n) as a kernel on `device` reaches it: its own
// device's memory, or another's opened through an IPC handle (CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS);
// nullptr, with *why, where a GPU would fault.
unsigned char* kernel_reach(std::uint64_t addr, std::uint64_t n, int device, std::string* why) {
  State& st = state();
  std::lock_guard<std::mutex> lock(st.mu);
  auto it = st.allocs.upper_bound(addr);
  if (it != st.allocs.begin()) {
    --it;
    const Alloc& a = it->second;
    const std::uint64_t off = addr - it->first;
    if (off <= a.nbytes && n <= a.nbytes - off) {
      if (a.device == device || a.from == From::kOpened) return a.host + off;
      *why = "a kernel on device " + std::to_string(device) + " read device " + std::to_string(a.device) +
             "'s memory without peer access";
      return nullptr;
    }
  }
  *why = "a kernel reached outside every allocation";
  return nullptr;
}

float half_in(std::uint16_t h) {
  // Exact: every float16 is a float32 (numpy's widening); NaNs keep their payload.
  const std::uint32_t sign = static_cast<std::uint32_t>(h >> 15) << 31;
  const int exp = (h >> 10) & 0x1F;
  const std::uint32_t man = h & 0x3FF;
  float f;
  if (exp == 0x1F) {
    std::uint32_t u = sign | 0x7F800000u | (man << 13);
    std::memcpy(&f, &u, 4);
    return f;
  }
  f = exp == 0 ? std::ldexp(static_cast<float>(man), -24) : std::ldexp(static_cast<float>(man | 0x400), exp - 25);
  return sign ? -f : f;
}

std::uint16_t half_out(float f) {
  // Round to nearest even through the hardware's own conversion (x86's F16C, or GCC's soft one);
  // a NaN keeps its top payload bits, quieted.
  std::uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7FFFFFFFu) > 0x7F800000u)
    return static_cast<std::uint16_t>(((u >> 16) & 0x8000u) | 0x7E00u | ((u >> 13) & 0x3FFu));
  const _Float16 h = static_cast<_Float16>(f);
  std::uint16_t out;
  std::memcpy(&out, &h, 2);
  return out;
}

float bf16_in(std::uint16_t h) {
  const std::uint32_t u = static_cast<std::uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

std::uint16_t bf16_out(float f) {
  std::uint32_t u;
  std::memcpy(&u, &f, 4);
  if (f != f) return static_cast<std::uint16_t>((u >> 16) | 0x40u);
  const std::uint32_t lsb = (u >> 16) & 1u;
  return static_cast<std::uint16_t>((u + 0x7FFFu + lsb) >> 16);
}

// One element's fold in the accumulator type (x86's own arithmetic: the CPU's NaN rules are the
// ones the kernels copy), then its average.
template <class A>
A fold_values(const A* v, std::uint32_t k, std::uint32_t op, std::uint64_t divisor) {
  A acc = v[0];
  for (std::uint32_t j = 1; j < k; j++) {
    const A b = v[j];
    if constexpr (std::is_floating_point_v<A>) {
      if (acc != acc) {
        // (a NaN first operand stays; for a sum, quieted below where it is written)
        continue;
      }
    }
    if (op <= 2) {
      if constexpr (std::is_integral_v<A>) {
        using U = std::make_unsigned_t<A>;
        acc = static_cast<A>(static_cast<U>(static_cast<U>(acc) + static_cast<U>(b)));
      } else {
        acc = acc + b;
      }
    } else if (op == 3) {
      acc = (acc < b) ? acc : b;
    } else {
      acc = (acc > b) ? acc : b;
    }
  }
  if (divisor != 0) {
    if constexpr (std::is_floating_point_v<A>) {
      acc = acc / static_cast<A>(divisor);
    } else if constexpr (std::is_signed_v<A>) {
      acc = static_cast<A>(static_cast<std::int64_t>(acc) / static_cast<std::int64_t>(divisor));
    } else {
      acc = static_cast<A>(static_cast<std::uint64_t>(acc) / divisor);
    }
  }
  return acc;
}

template <class A>
A quieted(A x) {
  if constexpr (std::is_same_v<A, float>) {
    std::uint32_t u;
    std::memcpy(&u, &x, 4);
    if (x != x) u |= 0x00400000u;
    std::memcpy(&x, &u, 4);
  } else if constexpr (std::is_same_v<A, double>) {
    std::uint64_t u;
    std::memcpy(&u, &x, 8);
    if (x != x) u |= 0x0008000000000000ull;
    std::memcpy(&x, &u, 8);
  }
  return x;
}

// T: the stored type; A: the accumulator; in/out: widen and narrow.
template <class T, class A, A (*In)(T), T (*Out)(A)>
Result fold_body(const void* raw, int device, std::string* why) {
  FoldArgs a;
  std::memcpy(&a, raw, sizeof a);
  if (a.k < 1 || a.k > SMDDP_MAX_FOLD_INPUTS || a.op < 1 || a.op > 4) {
    *why = "a fold kernel was given bad arguments";
    return kIllegalAddress;
  }
  const std::uint64_t bytes = a.n * sizeof(T);
  auto* out = reinterpret_cast<T*>(kernel_reach(a.dst, bytes, device, why));
  if (out == nullptr) return kIllegalAddress;
  std::vector<const T*> in(a.k);
  for (std::uint32_t j = 0; j < a.k; j++) {
    in[j] = reinterpret_cast<const T*>(kernel_reach(a.src[j], bytes, device, why));
    if (in[j] == nullptr) return kIllegalAddress;
  }
  std::vector<A> v(a.k);
  for (std::uint64_t i = 0; i < a.n; i++) {
    for (std::uint32_t j = 0; j < a.k; j++) v[j] = In(in[j][i]);
    // A sum's NaN is quieted; min/max keep a NaN as it is (the 16-bit narrowing quiets any).
    const A r = fold_values<A>(v.data(), a.k, a.op, a.divisor);
    out[i] = Out(a.op <= 2 ? quieted(r) : r);
  }
  return kSuccess;
}

template <class T>
T same(T x) {
  return x;
}

struct Body {
  const char* name;
  Result (*body)(const void*, int, std::string*);
};
const Body kBodies[] = {
    {"smddp_fold_uint8", fold_body<std::uint8_t, std::uint8_t, same<std::uint8_t>, same<std::uint8_t>>},
    {"smddp_fold_int32", fold_body<std::int32_t, std::int32_t, same<std::int32_t>, same<std::int32_t>>},
    {"smddp_fold_int64", fold_body<std::int64_t, std::int64_t, same<std::int64_t>, same<std::int64_t>>},
    {"smddp_fold_float16", fold_body<std::uint16_t, float, half_in, half_out>},
    {"smddp_fold_bfloat16", fold_body<std::uint16_t, float, bf16_in, bf16_out>},
    {"smddp_fold_float32", fold_body<float, float, same<float>, same<float>>},
    {"smddp_fold_float64", fold_body<double, double, same<double>, same<double>>},
};

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

__attribute__((visibility("default"))) Result cuEventCreate(void** out, unsigned flags) {
  if (out == nullptr) return kInvalidValue;
  if (const Result r = need_context()) return r;
  std::shared_ptr<IpcShared> ipc;
  if ((flags & kEventInterprocess) != 0) {
    if ((flags & kEventDisableTiming) == 0) return kInvalidValue;  // as CUDA: interprocess needs no timing
    ipc = make_ipc_page();
    if (ipc == nullptr) return 2;  // CUDA_ERROR_OUT_OF_MEMORY
  }
  auto* e = new Event{t_device, nullptr, ipc};
  State& st = state();
  std::lock_guard<std::mutex> lock(st.mu);
  st.events.insert(e);
  *out = e;
  return kSuccess;
}

__attribute__((visibility("default"))) Result cuIpcGetEventHandle(IpcHandle* out, void* event) {
  if (out == nullptr) return kInvalidValue;
  State& st = state();
  std::lock_guard<std::mutex> lock(st.mu);
  auto* e = static_cast<Event*>(event);
  if (st.events.count(e) == 0) return kInvalidHandle;
  if (e->ipc == nullptr || e->ipc->fd < 0) return kInvalidValue;  // not made interprocess here
  IpcWire w{kIpcMagic, 2, e->ipc->page->owner.load(), e->ipc->fd, 4096, 0, e->device};
  std::memset(out, 0, sizeof *out);
  std::memcpy(out, &w, sizeof w);
  return kSuccess;
}

__attribute__((visibility("default"))) Result cuIpcOpenEventHandle(void** out, IpcHandle handle) {
  if (out == nullptr) return kInvalidValue;
  if (const Result r = need_context()) return r;
  IpcWire w{};
  std::memcpy(&w, &handle, sizeof w);
  if (w.magic != kIpcMagic || w.kind != 2) return kInvalidValue;
  if (w.pid == static_cast<std::int32_t>(getpid())) return kInvalidContext;
  const std::string path = "/proc/" + std::to_string(w.pid) + "/fd/" + std::to_string(w.fd);
  const int fd = open(path.c_str(), O_RDWR | O_CLOEXEC);
  if (fd < 0) return kInvalidHandle;
  void* page = mmap(nullptr, 4096, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  close(fd);
  if (page == MAP_FAILED) return kInvalidHandle;
  auto ipc = std::make_shared<IpcShared>();
  ipc->page = static_cast<IpcPage*>(page);
  auto* e = new Event{w.device, nullptr, ipc};
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
  bool known = false;
  if (std::shared_ptr<IpcShared> ipc = ipc_of(event, &known)) {
    if (is_capturing(s)) return kCaptureUnsupported;  // (not modelled: IPC events under capture)
    const std::uint64_t seq = ipc->page->recorded.fetch_add(1) + 1;
    s->put(Op{[ipc, seq] {
                std::uint64_t r = ipc->page->reached.load();
                while (r < seq && !ipc->page->reached.compare_exchange_weak(r, seq)) {
                }
                return ok();
              },
              [ipc](const Failure& f) { ipc->page->failure.store(f.code); }});
    return kSuccess;
  }
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
  if (std::shared_ptr<IpcShared> ipc = ipc_of(event, &known)) return ipc_state(*ipc, ipc->page->recorded.load());
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
  if (std::shared_ptr<IpcShared> ipc = ipc_of(event, &known)) return ipc_wait(*ipc, ipc->page->recorded.load());
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
  if (std::shared_ptr<IpcShared> ipc = ipc_of(event, &known)) {
    if (s == nullptr) return kInvalidHandle;
    // The records made by now, in whichever process: the stream holds back until they are reached.
    const std::uint64_t target = ipc->page->recorded.load();
    if (ipc->page->reached.load() >= target) return kSuccess;
    enqueue(s, Op{[ipc, target] {
                    const Result r = ipc_wait(*ipc, target);
                    return r == kSuccess ? ok() : Failure{r, "the interprocess event's work failed"};
                  },
                  nullptr});
    return kSuccess;
  }
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
  // Shared memory (a memfd), so that another process can map it through an IPC handle.
  const std::size_t len = ((n + 4095) / 4096) * 4096;
  const int fd = memfd_create("smddp-standin-device", MFD_CLOEXEC);
  if (fd < 0) return 2;  // CUDA_ERROR_OUT_OF_MEMORY
  void* host = ftruncate(fd, static_cast<off_t>(len)) == 0
                   ? mmap(nullptr, len, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0)
                   : MAP_FAILED;
  if (host == MAP_FAILED) {
    close(fd);
    return 2;
  }
  std::memset(host, kUnset, n);
  State& st = state();
  std::lock_guard<std::mutex> lock(st.mu);
  const std::uint64_t addr = st.next_addr;
  st.next_addr += ((n + 255) / 256) * 256 + kGuard;
  Alloc a{t_device, n, static_cast<unsigned char*>(host), true};
  a.from = From::kAlloc;
  a.fd = fd;
  a.serial = st.next_serial++;
  a.map_len = len;
  st.allocs[addr] = a;
  *out = addr;
  return kSuccess;
}

__attribute__((visibility("default"))) Result cuMemFree_v2(std::uint64_t addr) {
  State& st = state();
  Alloc a{};
  {
    std::lock_guard<std::mutex> lock(st.mu);
    auto it = st.allocs.find(addr);
    if (it == st.allocs.end() || !it->second.owned) return kInvalidValue;
    a = it->second;
    st.allocs.erase(it);
  }
  // (another process that opened it keeps its own mapping, as CUDA keeps the memory until then)
  munmap(a.host, a.map_len);
  close(a.fd);
  return kSuccess;
}

__attribute__((visibility("default"))) Result cuIpcGetMemHandle(IpcHandle* out, std::uint64_t addr) {
  if (out == nullptr) return kInvalidValue;
  if (const Result r = need_context()) return r;
  State& st = state();
  std::lock_guard<std::mutex> lock(st.mu);
  auto it = st.allocs.find(addr);  // the base of an allocation, as CUDA asks
  if (it == st.allocs.end() || it->second.from != From::kAlloc) return kInvalidValue;
  IpcWire w{kIpcMagic, 1, static_cast<std::int32_t>(getpid()), it->second.fd, it->second.nbytes, it->second.serial,
            it->second.device};
  std::memset(out, 0, sizeof *out);
  std::memcpy(out, &w, sizeof w);
  return kSuccess;
}

__attribute__((visibility("default"))) Result cuDeviceCanAccessPeer(int* can, int device, int peer) {
  if (can == nullptr) return kInvalidValue;
  State& st = state();
  std::lock_guard<std::mutex> lock(st.mu);
  if (!st.initialised) return kNotInitialized;
  if (device < 0 || device >= st.devices || peer < 0 || peer >= st.devices) return kInvalidDevice;
  const char* refuse = std::getenv("SMDDP_STANDIN_PEER");
  // A device is not its own peer (CUDA answers 0); SMDDP_STANDIN_PEER=0: no pair may (as PCIe
  // switches or a hypervisor refuse).
  *can = device != peer && !(refuse != nullptr && std::strcmp(refuse, "0") == 0) ? 1 : 0;
  return kSuccess;
}

// flags: CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS (1) or 0. A handle of this process's own memory is
// refused, as CUDA refuses it; so is one of another device where peer access cannot be had.
__attribute__((visibility("default"))) Result cuIpcOpenMemHandle_v2(std::uint64_t* out, IpcHandle handle,
                                                                    unsigned flags) {
  if (out == nullptr || flags > 1) return kInvalidValue;
  if (const Result r = need_context()) return r;
  IpcWire w{};
  std::memcpy(&w, &handle, sizeof w);
  if (w.magic != kIpcMagic || w.kind != 1 || w.nbytes == 0) return kInvalidValue;
  if (w.pid == static_cast<std::int32_t>(getpid())) return kInvalidContext;
  if (w.device != t_device) {
    int can = 0;
    if (cuDeviceCanAccessPeer(&can, t_device, w.device) != kSuccess) return kInvalidDevice;
    if (can == 0) return kPeerUnsupported;
  }
  State& st = state();
  {
    std::lock_guard<std::mutex> lock(st.mu);
    for (auto& kv : st.allocs) {
      Alloc& a = kv.second;
      if (a.from == From::kOpened && a.pid == w.pid && a.serial == w.serial) {
        a.opens++;  // opened again: the same address, counted (as CUDA since 11)
        *out = kv.first;
        return kSuccess;
      }
    }
  }
  const std::string path = "/proc/" + std::to_string(w.pid) + "/fd/" + std::to_string(w.fd);
  const int fd = open(path.c_str(), O_RDWR | O_CLOEXEC);
  if (fd < 0) return kInvalidHandle;  // the process is gone, or not visible from here
  const std::size_t len = ((w.nbytes + 4095) / 4096) * 4096;
  struct stat sb {};
  void* host = fstat(fd, &sb) == 0 && static_cast<std::uint64_t>(sb.st_size) >= len
                   ? mmap(nullptr, len, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0)
                   : MAP_FAILED;
  close(fd);
  if (host == MAP_FAILED) return kInvalidHandle;
  std::lock_guard<std::mutex> lock(st.mu);
  const std::uint64_t addr = st.next_addr;
  st.next_addr += ((w.nbytes + 255) / 256) * 256 + kGuard;
  Alloc a{w.device, w.nbytes, static_cast<unsigned char*>(host), false};
  a.from = From::kOpened;
  a.serial = w.serial;
  a.pid = w.pid;
  a.opens = 1;
  a.map_len = len;
  st.allocs[addr] = a;
  *out = addr;
  return kSuccess;
}

__attribute__((visibility("default"))) Result cuIpcCloseMemHandle(std::uint64_t addr) {
  State& st = state();
  Alloc a{};
  {
    std::lock_guard<std::mutex> lock(st.mu);
    auto it = st.allocs.find(addr);
    if (it == st.allocs.end() || it->second.from != From::kOpened) return kInvalidValue;
    if (--it->second.opens > 0) return kSuccess;
    a = it->second;
    st.allocs.erase(it);
  }
  munmap(a.host, a.map_len);
  return kSuccess;
}

__attribute__((visibility("default"))) Result cuMemcpyDtoDAsync_v2(std::uint64_t dst, std::uint64_t src,
                                                                   std::size_t n, void* stream) {
  if (const Result r = need_context()) return r;
  Stream* s = stream_of(stream);
  if (s == nullptr) return kInvalidHandle;
  // Any two device ranges, of any devices (unified addressing; the driver stages what peers cannot
  // reach): a copy engine's work, late as every copy here.
  unsigned char* to = device_range(dst, n, nullptr);
  unsigned char* from = device_range(src, n, nullptr);
  if (to == nullptr || from == nullptr) return kInvalidValue;
  if (n == 0) return kSuccess;
  state().copies_d2d++;
  enqueue(s, Op{[s, to, from, n] {
                  late(s);
                  std::memmove(to, from, n);
                  return ok();
                },
                nullptr});
  return kSuccess;
}

// CUDA_MEMCPY2D as cuda.h lays it out (written here from the driver API's reference, not taken from
// the engine's cuda_abi.h, so that a wrong layout there fails against this one).
struct Memcpy2DArgs {
  std::size_t srcXInBytes, srcY;
  int srcMemoryType;
  const void* srcHost;
  std::uint64_t srcDevice;
  void* srcArray;
  std::size_t srcPitch, dstXInBytes, dstY;
  int dstMemoryType;
  void* dstHost;
  std::uint64_t dstDevice;
  void* dstArray;
  std::size_t dstPitch, WidthInBytes, Height;
};
static_assert(sizeof(Memcpy2DArgs) == 128, "CUDA_MEMCPY2D");
constexpr int kMemoryTypeDevice = 2;            // CU_MEMORYTYPE_DEVICE
constexpr std::size_t kMaxPitch = 0x7FFFFFFF;  // CU_DEVICE_ATTRIBUTE_MAX_PITCH of today's devices

// A 2-D copy between device ranges: `Height` rows of `WidthInBytes`, each a pitch after the last,
// late as every copy; device memory on both sides only (the engine copies nothing else this way), a
// width past a pitch or a pitch past the largest refused as CUDA refuses them, and both spans
// checked against their allocations.
__attribute__((visibility("default"))) Result cuMemcpy2DAsync_v2(const Memcpy2DArgs* a, void* stream) {
  if (const Result r = need_context()) return r;
  Stream* s = stream_of(stream);
  if (s == nullptr || a == nullptr) return kInvalidHandle;
  if (a->srcMemoryType != kMemoryTypeDevice || a->dstMemoryType != kMemoryTypeDevice ||
      a->WidthInBytes > a->srcPitch || a->WidthInBytes > a->dstPitch || a->srcPitch > kMaxPitch ||
      a->dstPitch > kMaxPitch)
    return kInvalidValue;
  const std::size_t width = a->WidthInBytes, height = a->Height, sp = a->srcPitch, dp = a->dstPitch;
  if (width == 0 || height == 0) return kSuccess;
  // (the spans from the first row's start to the last row's end)
  unsigned char* to = device_range(a->dstDevice + a->dstY * dp + a->dstXInBytes, (height - 1) * dp + width, nullptr);
  unsigned char* from = device_range(a->srcDevice + a->srcY * sp + a->srcXInBytes, (height - 1) * sp + width, nullptr);
  if (to == nullptr || from == nullptr) return kInvalidValue;
  state().copies_d2d++;
  enqueue(s, Op{[s, to, from, width, height, sp, dp] {
                  late(s);
                  for (std::size_t row = 0; row < height; row++) std::memmove(to + row * dp, from + row * sp, width);
                  return ok();
                },
                nullptr});
  return kSuccess;
}

// `n` 32-bit words of device memory set to `value`, in stream order.
__attribute__((visibility("default"))) Result cuMemsetD32Async(std::uint64_t dst, unsigned value, std::size_t n,
                                                               void* stream) {
  if (const Result r = need_context()) return r;
  Stream* s = stream_of(stream);
  if (s == nullptr) return kInvalidHandle;
  if (dst % 4 != 0 || n > (std::uint64_t{1} << 60)) return kInvalidValue;
  std::string why;
  auto* to = reinterpret_cast<std::uint32_t*>(kernel_reach(dst, n * 4, s->device, &why));
  if (to == nullptr) return kInvalidValue;
  enqueue(s, Op{[to, value, n] {
                  for (std::size_t i = 0; i < n; i++) __atomic_store_n(to + i, value, __ATOMIC_RELAXED);
                  return ok();
                },
                nullptr});
  return kSuccess;
}

// Stream memory operations on a 32-bit word of device memory (the device's own or opened through
// IPC): the write lands in stream order after the stream's earlier work (with the fence CUDA's
// default gives); the wait holds the stream back until the word satisfies it (flags: 0 GEQ, a cyclic
// (int32_t)(*addr - value) >= 0; 1 EQ; 2 AND; 3 NOR; CU_STREAM_WAIT_VALUE_FLUSH accepted). A wait
// never satisfied fails its stream after SMDDP_STANDIN_WAIT_LIMIT_MS (60 s unless set) where a GPU
// would wait for ever, so that a test's process can end. SMDDP_STANDIN_WAIT_SKIP=1 makes a broken
// driver whose waits hold nothing back: a test's proof that what it checks depends on them.
__attribute__((visibility("default"))) Result cuStreamWriteValue32_v2(void* stream, std::uint64_t addr,
                                                                      std::uint32_t value, unsigned flags) {
  if (const Result r = need_context()) return r;
  Stream* s = stream_of(stream);
  if (s == nullptr) return kInvalidHandle;
  if (flags > 1 || addr % 4 != 0) return kInvalidValue;
  std::string why;
  auto* word = reinterpret_cast<std::uint32_t*>(kernel_reach(addr, 4, s->device, &why));
  if (word == nullptr) return kInvalidValue;
  enqueue(s, Op{[word, value] {
                  __atomic_store_n(word, value, __ATOMIC_RELEASE);
                  return ok();
                },
                nullptr});
  return kSuccess;
}

__attribute__((visibility("default"))) Result cuStreamWaitValue32_v2(void* stream, std::uint64_t addr,
                                                                     std::uint32_t value, unsigned flags) {
  if (const Result r = need_context()) return r;
  Stream* s = stream_of(stream);
  if (s == nullptr) return kInvalidHandle;
  const unsigned how = flags & ~(1u << 30);
  if (how > 3 || addr % 4 != 0) return kInvalidValue;
  std::string why;
  auto* word = reinterpret_cast<const std::uint32_t*>(kernel_reach(addr, 4, s->device, &why));
  if (word == nullptr) return kInvalidValue;
  const char* limit_env = std::getenv("SMDDP_STANDIN_WAIT_LIMIT_MS");
  const std::int64_t limit_ms = limit_env != nullptr ? std::atoll(limit_env) : 60000;
  const char* skip = std::getenv("SMDDP_STANDIN_WAIT_SKIP");
  if (skip != nullptr && std::strcmp(skip, "1") == 0) return kSuccess;
  enqueue(s, Op{[word, value, how, limit_ms] {
                  const auto until = std::chrono::steady_clock::now() + std::chrono::milliseconds(limit_ms);
                  for (;;) {
                    const std::uint32_t w = __atomic_load_n(word, __ATOMIC_ACQUIRE);
                    const bool met = how == 0   ? static_cast<std::int32_t>(w - value) >= 0
                                     : how == 1 ? w == value
                                     : how == 2 ? (w & value) != 0
                                                : ~(w | value) != 0;
                    if (met) return ok();
                    if (std::chrono::steady_clock::now() > until)
                      return Failure{kLaunchFailed, "a stream memory wait was never satisfied (the stand-in's limit)"};
                    std::this_thread::sleep_for(std::chrono::microseconds(20));
                  }
                },
                nullptr});
  return kSuccess;
}

// PTX text: its entry points are what it declares (".entry name("); a .version past what this
// driver takes (SMDDP_STANDIN_PTX_MAX, "9.0" unless set: a CUDA 13.0 driver's) is refused, as an
// older driver refuses a newer toolkit's PTX.
__attribute__((visibility("default"))) Result cuModuleLoadData(void** out, const void* image) {
  if (out == nullptr || image == nullptr) return kInvalidValue;
  if (const Result r = need_context()) return r;
  const std::string text(static_cast<const char*>(image));
  const std::size_t v = text.find(".version ");
  if (v == std::string::npos || text.find(".target ") == std::string::npos) return kInvalidImage;
  const double version = std::atof(text.c_str() + v + 9);
  const char* max = std::getenv("SMDDP_STANDIN_PTX_MAX");
  if (version > (max != nullptr ? std::atof(max) : 9.0) + 1e-9) return kUnsupportedPtx;
  auto* m = new Module();
  for (std::size_t at = text.find(".entry "); at != std::string::npos; at = text.find(".entry ", at + 7)) {
    const std::size_t b = at + 7, e = text.find('(', b);
    if (e == std::string::npos) break;
    std::string name = text.substr(b, e - b);
    while (!name.empty() && name.back() == ' ') name.pop_back();
    m->entries.insert(name);
  }
  State& st = state();
  std::lock_guard<std::mutex> lock(st.mu);
  st.modules.insert(m);
  *out = m;
  return kSuccess;
}

__attribute__((visibility("default"))) Result cuModuleUnload(void* module) {
  State& st = state();
  auto* m = static_cast<Module*>(module);
  std::lock_guard<std::mutex> lock(st.mu);
  if (st.modules.erase(m) == 0) return kInvalidHandle;
  delete m;  // (its functions stay in the table: a launch of one after this is the caller's bug)
  return kSuccess;
}

// An entry of `module` that has a native body here; CUDA_ERROR_NOT_FOUND for any other.
__attribute__((visibility("default"))) Result cuModuleGetFunction(void** out, void* module, const char* name) {
  if (out == nullptr || name == nullptr) return kInvalidValue;
  State& st = state();
  std::lock_guard<std::mutex> lock(st.mu);
  auto* m = static_cast<Module*>(module);
  if (st.modules.count(m) == 0) return kInvalidHandle;
  if (m->entries.count(name) == 0) return kNotFound;
  for (const Body& b : kBodies) {
    if (std::strcmp(b.name, name) == 0) {
      auto* f = new Function{name, sizeof(FoldArgs), b.body};
      st.functions.insert(f);
      *out = f;
      return kSuccess;
    }
  }
  return kNotFound;
}

// The arguments are copied at the call (as CUDA's are); the body runs in stream order, late as a
// copy (it reads what the stream's earlier work and waits delivered), on the stream's device. A body
// that reaches where it may not fails the stream (CUDA_ERROR_ILLEGAL_ADDRESS, sticky).
__attribute__((visibility("default"))) Result cuLaunchKernel(void* function, unsigned gx, unsigned gy, unsigned gz,
                                                             unsigned bx, unsigned by, unsigned bz, unsigned shared,
                                                             void* stream, void** params, void** extra) {
  if (const Result r = need_context()) return r;
  Stream* s = stream_of(stream);
  if (s == nullptr) return kInvalidHandle;
  auto* f = static_cast<Function*>(function);
  {
    State& st = state();
    std::lock_guard<std::mutex> lock(st.mu);
    if (st.functions.count(f) == 0) return kInvalidHandle;
  }
  if (gx == 0 || gy == 0 || gz == 0 || bx == 0 || by == 0 || bz == 0 || bx * by * bz > 1024 || shared > 48 * 1024 ||
      extra != nullptr || params == nullptr || params[0] == nullptr)
    return kInvalidValue;
  auto args = std::make_shared<std::vector<unsigned char>>(f->arg_bytes);
  std::memcpy(args->data(), params[0], f->arg_bytes);
  const auto body = f->body;
  const int device = s->device;
  state().kernels++;
  enqueue(s, Op{[s, args, body, device] {
                  late(s);
                  std::string why;
                  const Result r = body(args->data(), device, &why);
                  return r == kSuccess ? ok() : Failure{r, why};
                },
                nullptr});
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
    case kInvalidImage: *out = "CUDA_ERROR_INVALID_IMAGE"; break;
    case kPeerUnsupported: *out = "CUDA_ERROR_PEER_ACCESS_UNSUPPORTED"; break;
    case kUnsupportedPtx: *out = "CUDA_ERROR_UNSUPPORTED_PTX_VERSION"; break;
    case kNotFound: *out = "CUDA_ERROR_NOT_FOUND"; break;
    case kLaunchFailed: *out = "CUDA_ERROR_LAUNCH_FAILED"; break;
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
  if (it == st.allocs.end() || it->second.from != From::kMapped) return kInvalidValue;
  st.allocs.erase(it);
  return kSuccess;
}

// -- the torch side's doubles in native code (the C++ torch backend's stand-in hooks) --------------
//
// The calling thread's current stream (the Python runtime's `use` pushes and pops it here, so that
// native callers see the same one), host memory aliased as device memory at addresses of this
// library's own range, and a host wait for a stream on a device: the C++ torch backend's doubles of
// torch's current CUDA stream, a CUDA tensor's address and the host's wait for a stream.

constexpr std::uint64_t kAliasBase = 0xD700000000000000ULL;  // below kDeviceBase, far above the Python runtimes'
SMDDP_STATIC_TLS thread_local std::vector<void*>* t_current = nullptr;
std::atomic<std::uint64_t> g_next_alias{kAliasBase};

__attribute__((visibility("default"))) void smddp_standin_push_current(void* stream) {
  if (t_current == nullptr) t_current = new std::vector<void*>();  // (one a thread, kept: threads are few)
  t_current->push_back(stream);
}

__attribute__((visibility("default"))) void smddp_standin_pop_current() {
  if (t_current != nullptr && !t_current->empty()) t_current->pop_back();
}

// The calling thread's current stream: the legacy default stream where none was made current.
__attribute__((visibility("default"))) void* smddp_standin_current() {
  return t_current == nullptr || t_current->empty() ? reinterpret_cast<void*>(1) : t_current->back();
}

// Host range [host, host + n) as device memory of `device` at a fresh address (*addr), until unmapped.
__attribute__((visibility("default"))) Result smddp_standin_alias(void* host, std::size_t n, int device,
                                                                  std::uint64_t* addr) {
  if (host == nullptr || n == 0 || addr == nullptr) return kInvalidValue;
  {
    State& st = state();
    std::lock_guard<std::mutex> lock(st.mu);
    if (device < 0 || device >= st.devices) return kInvalidDevice;
  }
  const std::uint64_t span = ((n + 255) / 256) * 256 + kGuard;
  const std::uint64_t a = g_next_alias.fetch_add(span);
  if (a + span > kDeviceBase) return kInvalidValue;
  const Result r = smddp_standin_map(a, host, n, device);
  if (r == kSuccess) *addr = a;
  return r;
}

// The host waits for what `stream` of `device` holds so far (a thread with no context of its own).
__attribute__((visibility("default"))) Result smddp_standin_synchronize(void* stream, int device) {
  const int was = t_device;
  void* ctx = nullptr;
  Result r = cuDevicePrimaryCtxRetain(&ctx, device);
  if (r == kSuccess) r = cuCtxSetCurrent(ctx);
  if (r == kSuccess) r = cuStreamSynchronize(stream);
  t_device = was;
  return r;
}

// A new stream of `device` (*out) for a thread with no context of its own.
__attribute__((visibility("default"))) Result smddp_standin_new_stream(int device, void** out) {
  const int was = t_device;
  void* ctx = nullptr;
  Result r = cuDevicePrimaryCtxRetain(&ctx, device);
  if (r == kSuccess) r = cuCtxSetCurrent(ctx);
  if (r == kSuccess) r = cuStreamCreate(out, 1);
  t_device = was;
  return r;
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

// Device-to-device copies (peer copies included) and kernels launched since the process began, into
// `out[2]`.
__attribute__((visibility("default"))) void smddp_standin_device_counts(std::uint64_t* out) {
  out[0] = state().copies_d2d.load();
  out[1] = state().kernels.load();
}

}  // extern "C"
