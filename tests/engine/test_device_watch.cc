// The CUDA driver loaded at run time (smddp/engine/cuda_driver.h) and the engine's device progress
// thread (device_watch.h), against the stand-in driver (rigs/smddp_rigs/standin_cuda.cc, built with
// the same sanitizer; its path in SMDDP_STANDIN_CUDA): a library that is missing or is no driver is
// refused naming why; a thread with no current context is refused by the driver, and the watch
// thread binds its device first; watches end in the order the device reaches their events, not the
// order they came in (a held stream's copy ends after a later one on another stream), each after its
// copy's bytes landed; a failed stream's event ends its watch with the error; an event recorded
// under graph capture ends its watch with the capture error instead of never; stop() ends what is
// pending with kStopped on its own thread, and refuses later watches; a done may add a watch; four
// threads' 800 watches on four streams each end exactly once. Built and run under ASan+UBSan and
// TSan by `make engine-sanitize`. Exit status 0: every check held.
#include <dlfcn.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "cuda_driver.h"
#include "device_watch.h"

namespace {

using smddp::DeviceWatch;
namespace cuda = smddp::cuda;

std::atomic<int> failures{0};

void check(bool ok, const std::string& what) {
  if (!ok) {
    std::fprintf(stderr, "test_device_watch: FAILED: %s\n", what.c_str());
    failures++;
  }
}

// The stand-in's own controls, and the allocation entry points the engine does not use.
struct Standin {
  cuda::Result (*mem_alloc)(cuda::DevicePtr*, std::size_t);
  cuda::Result (*mem_free)(cuda::DevicePtr);
  cuda::Result (*begin_capture)(cuda::Stream, int);
  cuda::Result (*end_capture)(cuda::Stream, cuda::Graph*);
  std::uint64_t (*hold)(cuda::Stream, std::int64_t);
  int (*hold_started)(std::uint64_t);
  int (*release)(std::uint64_t);
  cuda::Result (*fail)(cuda::Stream, cuda::Result);
  void (*copies)(std::uint64_t*, std::uint64_t*);
};

template <typename F>
void sym(void* lib, const char* name, F* out) {
  *out = reinterpret_cast<F>(dlsym(lib, name));
  if (*out == nullptr) {
    std::fprintf(stderr, "test_device_watch: the stand-in lacks %s\n", name);
    std::exit(2);
  }
}

Standin standin_of(const std::string& path) {
  void* lib = dlopen(path.c_str(), RTLD_NOW | RTLD_LOCAL);  // the driver's own handle: the same library
  if (lib == nullptr) {
    std::fprintf(stderr, "test_device_watch: cannot load %s\n", path.c_str());
    std::exit(2);
  }
  Standin s{};
  sym(lib, "cuMemAlloc_v2", &s.mem_alloc);
  sym(lib, "cuMemFree_v2", &s.mem_free);
  sym(lib, "cuStreamBeginCapture_v2", &s.begin_capture);
  sym(lib, "cuStreamEndCapture", &s.end_capture);
  sym(lib, "smddp_standin_hold", &s.hold);
  sym(lib, "smddp_standin_hold_started", &s.hold_started);
  sym(lib, "smddp_standin_release", &s.release);
  sym(lib, "smddp_standin_fail", &s.fail);
  sym(lib, "smddp_standin_copies", &s.copies);
  return s;
}

// Until `pred` holds, or 10 s (a hang fails the check that follows, it does not hang the test).
template <typename P>
bool eventually(P pred) {
  const auto end = std::chrono::steady_clock::now() + std::chrono::seconds(10);
  while (!pred()) {
    if (std::chrono::steady_clock::now() > end) return false;
    std::this_thread::sleep_for(std::chrono::microseconds(200));
  }
  return true;
}

void test_loading(const std::string& path) {
  std::string why;
  check(cuda::Driver::load("/nonexistent/libcuda.so.1", &why) == nullptr &&
            why.find("cannot load the CUDA driver (/nonexistent/libcuda.so.1)") != std::string::npos,
        "a missing driver is named: " + why);
  why.clear();
  check(cuda::Driver::load("libm.so.6", &why) == nullptr &&
            why.find("is not a CUDA driver: it lacks cuInit, cuDriverGetVersion") != std::string::npos,
        "a library that is no driver is named with what it lacks: " + why);
  why.clear();
  auto d = cuda::Driver::load(path, &why);
  check(d != nullptr && d->device_count() == 2 && d->version() == 13000, "the stand-in loads with 2 devices: " + why);
  if (!d) return;
  check(d->bind(2) == cuda::kInvalidDevice && d->bind(-1) == cuda::kInvalidDevice, "a device out of range");
  check(d->describe(cuda::kInvalidDevice, "cuCtxSetCurrent") ==
            "cuCtxSetCurrent: CUDA_ERROR_INVALID_DEVICE ((the smddp stand-in driver))",
        "an error in words: " + d->describe(cuda::kInvalidDevice, "cuCtxSetCurrent"));
  check(d->describe(12345, "cuEventQuery") == "cuEventQuery: CUDA error 12345", "an error the driver cannot name");
  // A thread that made no context current is refused, as the driver refuses one.
  std::thread([&] {
    cuda::Stream s = nullptr;
    check(d->api().stream_create(&s, cuda::kStreamNonBlocking) == cuda::kInvalidContext,
          "no stream without a current context");
    check(d->bind(1) == cuda::kSuccess && d->api().stream_create(&s, cuda::kStreamNonBlocking) == cuda::kSuccess,
          "a stream once bound");
    check(d->api().stream_destroy(s) == cuda::kSuccess, "stream destroyed");
  }).join();
}

struct Bed {
  cuda::Driver* d;
  Standin st;
  const cuda::Api& api() { return d->api(); }
  cuda::Stream stream() {
    cuda::Stream s = nullptr;
    check(api().stream_create(&s, cuda::kStreamNonBlocking) == cuda::kSuccess, "stream_create");
    return s;
  }
  cuda::Event event() {
    cuda::Event e = nullptr;
    check(api().event_create(&e, cuda::kEventDisableTiming) == cuda::kSuccess, "event_create");
    return e;
  }
};

void test_order(Bed& b) {
  DeviceWatch w(b.d, 0, 50'000);
  cuda::Stream a = b.stream(), c = b.stream();
  cuda::Event ea = b.event(), ec = b.event();
  std::vector<std::int32_t> host_a(1024, 7), host_c(1024, 9);
  check(b.api().host_register(host_a.data(), 4096, 0) == cuda::kSuccess &&
            b.api().host_register(host_c.data(), 4096, 0) == cuda::kSuccess,
        "pinned");
  cuda::DevicePtr dev_a = 0, dev_c = 0;
  check(b.st.mem_alloc(&dev_a, 4096) == cuda::kSuccess && b.st.mem_alloc(&dev_c, 4096) == cuda::kSuccess, "alloc");
  std::vector<std::int32_t> back_a(1024, 0), back_c(1024, 0);
  check(b.api().host_register(back_a.data(), 4096, 0) == cuda::kSuccess &&
            b.api().host_register(back_c.data(), 4096, 0) == cuda::kSuccess,
        "pinned results");
  // a: held, then its round trip; c: its round trip at once.
  const std::uint64_t hold = b.st.hold(a, 20'000);
  b.api().memcpy_h2d(dev_a, host_a.data(), 4096, a);
  b.api().memcpy_d2h(back_a.data(), dev_a, 4096, a);
  b.api().event_record(ea, a);
  b.api().memcpy_h2d(dev_c, host_c.data(), 4096, c);
  b.api().memcpy_d2h(back_c.data(), dev_c, 4096, c);
  b.api().event_record(ec, c);
  std::mutex mu;
  std::vector<char> order;
  bool a_landed = false, c_landed = false;
  check(w.watch(ea, [&](cuda::Result r) {
    std::lock_guard<std::mutex> lock(mu);
    order.push_back('a');
    a_landed = r == cuda::kSuccess && back_a == host_a;
  }), "watch a");
  check(w.watch(ec, [&](cuda::Result r) {
    std::lock_guard<std::mutex> lock(mu);
    order.push_back('c');
    c_landed = r == cuda::kSuccess && back_c == host_c;
  }), "watch c");
  check(eventually([&] {
    std::lock_guard<std::mutex> lock(mu);
    return order.size() == 1;
  }), "the copy that landed ended its watch while the other's stream was held");
  {
    std::lock_guard<std::mutex> lock(mu);
    check(order == std::vector<char>{'c'} && c_landed, "c first, its bytes in place when its done ran");
    check(back_a[0] == 0, "a's copy has not run: its stream is held");
  }
  check(w.pending() == 1, "one watch pending");
  b.st.release(hold);
  check(eventually([&] { return w.pending() == 0; }), "a ends once released");
  {
    std::lock_guard<std::mutex> lock(mu);
    check(order == (std::vector<char>{'c', 'a'}) && a_landed, "then a, its bytes in place");
  }
  std::uint64_t pinned = 0, pageable = 0;
  b.st.copies(&pinned, &pageable);
  check(pinned >= 4 && pageable == 0, "pinned copies were asynchronous");
  // A copy from pageable memory blocks its caller until it has run: it waits behind a hold.
  std::vector<std::int32_t> loose(16, 5);
  const std::uint64_t hold2 = b.st.hold(c, 20'000);
  std::atomic<bool> returned{false};
  std::thread t([&] {
    check(b.d->bind(0) == cuda::kSuccess, "bind");
    b.api().memcpy_h2d(dev_c, loose.data(), 64, c);
    returned = true;
  });
  check(eventually([&] { return b.st.hold_started(hold2) == 1; }), "hold2 runs");
  std::this_thread::sleep_for(std::chrono::milliseconds(20));
  check(!returned, "a pageable copy does not return while its stream is held");
  b.st.release(hold2);
  t.join();
  b.st.copies(&pinned, &pageable);
  check(returned && pageable == 1, "it returned once its stream ran it");
  for (auto* p : {host_a.data(), host_c.data(), back_a.data(), back_c.data()}) b.api().host_unregister(p);
  b.st.mem_free(dev_a);
  b.st.mem_free(dev_c);
  b.api().event_destroy(ea);
  b.api().event_destroy(ec);
  b.api().stream_destroy(a);
  b.api().stream_destroy(c);
}

void test_errors_and_capture(Bed& b) {
  DeviceWatch w(b.d, 0, 0);
  cuda::Stream s = b.stream(), g = b.stream();
  cuda::Event e = b.event(), ge = b.event();
  b.st.fail(s, cuda::kIllegalAddress);
  b.api().event_record(e, s);
  std::atomic<int> got{1};
  w.watch(e, [&](cuda::Result r) { got = r; });
  check(eventually([&] { return got.load() != 1; }) && got == cuda::kIllegalAddress,
        "a failed stream's event ends its watch with the error");
  check(b.api().event_query(e) == cuda::kIllegalAddress, "and the error is sticky");
  // Under capture, the record is the graph's: no host can wait for it.
  check(b.st.begin_capture(g, cuda::kCaptureModeGlobal) == cuda::kSuccess, "begin capture");
  int status = 0;
  check(b.api().stream_is_capturing(g, &status) == cuda::kSuccess && status == cuda::kCaptureActive, "capturing");
  b.api().event_record(ge, g);
  std::atomic<int> cap{1};
  w.watch(ge, [&](cuda::Result r) { cap = r; });
  check(eventually([&] { return cap.load() != 1; }) && cap == cuda::kCaptureUnsupported,
        "an event under capture ends its watch with the capture error, not never");
  cuda::Graph graph = nullptr;
  check(b.st.end_capture(g, &graph) == cuda::kSuccess, "end capture");
  check(b.api().stream_is_capturing(g, &status) == cuda::kSuccess && status == cuda::kCaptureNone, "not capturing");
  b.api().event_destroy(e);
  b.api().event_destroy(ge);
  b.api().stream_destroy(s);
  b.api().stream_destroy(g);
}

void test_stop_and_chain(Bed& b) {
  cuda::Stream s = b.stream();
  cuda::Event e1 = b.event(), e2 = b.event(), held = b.event();
  {
    DeviceWatch w(b.d, 0, 1'000);
    // A done that adds a watch: e1's done watches e2.
    b.api().event_record(e1, s);
    b.api().event_record(e2, s);
    std::atomic<int> steps{0};
    w.watch(e1, [&](cuda::Result) {
      steps++;
      check(w.watch(e2, [&](cuda::Result r) { steps += r == cuda::kSuccess ? 10 : 100; }), "a done adds a watch");
    });
    check(eventually([&] { return steps.load() == 11; }), "the chained watch ended");
    // stop() ends what is pending, on its own thread, once the watch thread has gone.
    const std::uint64_t hold = b.st.hold(s, 20'000);
    b.api().event_record(held, s);
    std::atomic<int> ended{1};
    std::thread::id where;
    w.watch(held, [&](cuda::Result r) {
      where = std::this_thread::get_id();
      ended = r;
    });
    w.stop();
    check(ended == DeviceWatch::kStopped && where == std::this_thread::get_id(), "stop ends a pending watch here");
    check(!w.watch(e1, [](cuda::Result) {}) && w.pending() == 0, "a watch after stop is refused");
    b.st.release(hold);
  }
  // A device the watch cannot bind ends each watch with that error.
  {
    DeviceWatch w(b.d, 7, 0);
    std::atomic<int> r{1};
    w.watch(e1, [&](cuda::Result x) { r = x; });
    check(eventually([&] { return r.load() != 1; }) && r == cuda::kInvalidDevice, "an unbindable device's error");
  }
  b.api().stream_synchronize(s);
  b.api().event_destroy(e1);
  b.api().event_destroy(e2);
  b.api().event_destroy(held);
  b.api().stream_destroy(s);
}

void test_many(Bed& b) {
  DeviceWatch w(b.d, 1, 20'000);
  constexpr int kThreads = 4, kEach = 200;
  std::vector<std::atomic<int>> ended(kThreads * kEach);
  std::vector<std::thread> ts;
  for (int t = 0; t < kThreads; t++)
    ts.emplace_back([&, t] {
      check(b.d->bind(1) == cuda::kSuccess, "bind 1");
      cuda::Stream s = b.stream();
      std::vector<cuda::Event> evs;
      for (int i = 0; i < kEach; i++) {
        evs.push_back(b.event());
        if (i % 50 == 0) {
          const std::uint64_t h = b.st.hold(s, 20'000);
          std::thread([&b, h] {
            std::this_thread::sleep_for(std::chrono::milliseconds(2));
            b.st.release(h);
          }).detach();
        }
        b.api().event_record(evs.back(), s);
        std::atomic<int>* slot = &ended[static_cast<std::size_t>(t * kEach + i)];
        w.watch(evs.back(), [slot](cuda::Result r) { slot->fetch_add(r == cuda::kSuccess ? 1 : 100); });
      }
      check(eventually([&] {
        for (int i = 0; i < kEach; i++)
          if (ended[static_cast<std::size_t>(t * kEach + i)].load() == 0) return false;
        return true;
      }), "every watch of a thread ended");
      for (auto e : evs) b.api().event_destroy(e);
      b.api().stream_destroy(s);
    });
  for (auto& t : ts) t.join();
  int once = 0;
  for (auto& e : ended) once += e.load() == 1;
  check(once == kThreads * kEach, "800 watches, each ended exactly once, reached: " + std::to_string(once));
}

}  // namespace

int main() {
  const char* path = std::getenv("SMDDP_STANDIN_CUDA");
  if (path == nullptr) {
    std::fprintf(stderr, "test_device_watch: SMDDP_STANDIN_CUDA names the stand-in driver to load\n");
    return 2;
  }
  setenv("SMDDP_STANDIN_DEVICES", "2", 1);
  test_loading(path);
  std::string why;
  auto d = cuda::Driver::load(path, &why);
  if (!d) {
    std::fprintf(stderr, "test_device_watch: %s\n", why.c_str());
    return 1;
  }
  check(d->bind(0) == cuda::kSuccess, "bind 0");
  Bed b{d.get(), standin_of(path)};
  test_order(b);
  test_errors_and_capture(b);
  test_stop_and_chain(b);
  test_many(b);
  if (failures == 0) std::printf("test_device_watch: every check held\n");
  return failures == 0 ? 0 : 1;
}
