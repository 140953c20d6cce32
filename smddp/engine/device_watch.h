// The engine's device progress thread: it watches CUDA events and runs what waits for each the
// moment its event is reached, in whatever order the device reaches them.
//
// A device collective's steps that wait on the GPU (its copy-in landed: give its SUBMIT; its copy
// back landed: send its RELEASE) are watches: `watch(event, done)` runs `done` on the watch thread
// once the event's last record is reached, or failed. Events are polled, not waited on one by one,
// so a late copy never holds up a later one that landed. The thread spins for `spin_ns` after the
// last thing it saw complete, yielding the core between looks (as the rings' consumers do), then
// sleeps in growing steps up to kMaxNap; a new watch wakes it at once, and it spins again from there.
//
// Threads: watch() from any thread; `done` runs on the watch thread, never under its lock, and may
// call watch(). Engine code only: it never touches a Python object. Memory: the DeviceWatch owns its
// thread and the pending `done`s; the events are the caller's, and must outlive their watch.
#pragma once

#include <condition_variable>
#include <cstdint>
#include <functional>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "cuda_driver.h"

namespace smddp {

class DeviceWatch {
 public:
  // How a watch ended: reached (kSuccess), the device's error for it, or kStopped (the watch ended first).
  static constexpr cuda::Result kStopped = -1;
  static constexpr std::int64_t kMaxNapNs = 200'000;  // the longest sleep between looks once idle

  using Done = std::function<void(cuda::Result)>;

  // The thread makes `device`'s primary context current (Driver::bind) before its first look; a
  // device it cannot bind ends every watch with that error. `driver` outlives the DeviceWatch.
  DeviceWatch(cuda::Driver* driver, int device, std::int64_t spin_ns);
  ~DeviceWatch();  // stop()
  DeviceWatch(const DeviceWatch&) = delete;
  DeviceWatch& operator=(const DeviceWatch&) = delete;

  // Runs `done` on the watch thread once `event` is reached or failed. False (and `done` is not
  // kept) once stopped.
  bool watch(cuda::Event event, Done done);

  // Watches not yet ended.
  std::size_t pending() const;

  // Ends the thread: every watch still pending ends with kStopped, on the calling thread, after the
  // watch thread has gone (so no `done` runs twice or concurrently). Idempotent.
  void stop();

 private:
  struct Pending {
    cuda::Event event;
    Done done;
  };
  void run();

  cuda::Driver* driver_;
  const int device_;
  const std::int64_t spin_ns_;
  mutable std::mutex mu_;
  std::condition_variable wake_;
  std::vector<Pending> pending_;  // under mu_: what the thread looks at next
  std::size_t looking_ = 0;       // under mu_: watches the thread took out to look at
  bool stopping_ = false;
  bool stopped_ = false;
  std::thread thread_;
};

}  // namespace smddp
