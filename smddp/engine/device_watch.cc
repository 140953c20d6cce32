// The engine's device progress thread (device_watch.h).
#include "device_watch.h"

#include <sched.h>

#include <chrono>
#include <utility>

namespace smddp {

namespace {

std::int64_t now_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

}  // namespace

DeviceWatch::DeviceWatch(cuda::Driver* driver, int device, std::int64_t spin_ns)
    : driver_(driver), device_(device), spin_ns_(spin_ns < 0 ? 0 : spin_ns) {
  thread_ = std::thread([this] { run(); });
}

DeviceWatch::~DeviceWatch() { stop(); }

bool DeviceWatch::watch(cuda::Event event, Done done) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (stopping_) return false;
    pending_.push_back(Pending{event, std::move(done)});
  }
  wake_.notify_one();
  return true;
}

std::size_t DeviceWatch::pending() const {
  std::lock_guard<std::mutex> lock(mu_);
  return pending_.size() + looking_;
}

void DeviceWatch::stop() {
  std::vector<Pending> left;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (stopped_) return;
    stopping_ = true;
  }
  wake_.notify_one();
  if (thread_.joinable()) thread_.join();
  {
    std::lock_guard<std::mutex> lock(mu_);
    stopped_ = true;
    left.swap(pending_);
  }
  for (auto& p : left) p.done(kStopped);
}

void DeviceWatch::run() {
  const cuda::Result bound = driver_->bind(device_);
  std::vector<Pending> mine;  // taken out of pending_ to look at without the lock
  std::vector<std::pair<Done, cuda::Result>> ended;
  std::int64_t last_seen = now_ns();
  std::int64_t nap = 1'000;
  for (;;) {
    {
      std::unique_lock<std::mutex> lock(mu_);
      // What the last look left, back first (oldest first), then what came meanwhile.
      for (auto& p : pending_) mine.push_back(std::move(p));
      pending_.clear();
      pending_.swap(mine);
      looking_ = 0;
      if (stopping_) return;
      if (pending_.empty()) {
        wake_.wait(lock, [this] { return stopping_ || !pending_.empty(); });
        if (stopping_) return;
        last_seen = now_ns();
        nap = 1'000;
      }
      mine.swap(pending_);
      looking_ = mine.size();
    }
    // Looked at outside the lock: cuEventQuery may take a while on a busy driver.
    std::vector<Pending> still;
    for (auto& p : mine) {
      const cuda::Result r = bound != cuda::kSuccess ? bound : driver_->api().event_query(p.event);
      if (r == cuda::kNotReady)
        still.push_back(std::move(p));
      else
        ended.emplace_back(std::move(p.done), r);
    }
    mine.swap(still);
    {
      // The ended ones leave the count before their `done` runs: a `done` that looks at pending()
      // sees itself gone.
      std::lock_guard<std::mutex> lock(mu_);
      looking_ = mine.size();
    }
    for (auto& e : ended) e.first(e.second);
    if (!ended.empty()) {
      ended.clear();
      last_seen = now_ns();
      nap = 1'000;
      continue;
    }
    if (now_ns() - last_seen < spin_ns_) {
      sched_yield();
      continue;
    }
    // Idle past the spin: sleep, in growing steps, unless a new watch or stop() comes first.
    std::unique_lock<std::mutex> lock(mu_);
    if (stopping_) {
      for (auto& p : mine) pending_.push_back(std::move(p));
      mine.clear();
      looking_ = 0;
      return;
    }
    if (wake_.wait_for(lock, std::chrono::nanoseconds(nap), [this] { return stopping_ || !pending_.empty(); })) {
      // A new watch (a copy just enqueued, which lands within microseconds for a small one): spin
      // again from here, as after a wait on an empty list, rather than go on napping in the steps
      // the older watches grew (up to kMaxNapNs late for each new one).
      last_seen = now_ns();
      nap = 1'000;
    } else {
      nap = nap * 2 > kMaxNapNs ? kMaxNapNs : nap * 2;
    }
  }
}

}  // namespace smddp
