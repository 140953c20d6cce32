// The daemon's compute threads and their two queues.
#include "executor.h"

namespace smddp {

Executor::Executor(std::uint32_t threads, const std::atomic<bool>* failed) : failed_(failed) {
  try {
    for (std::uint32_t i = 0; i < threads; i++) pool_.emplace_back([this] { loop(); });
  } catch (...) {  // no destructor runs for a constructor that throws: stop what started
    close();
    throw;
  }
}

Executor::~Executor() { close(); }

bool Executor::post(std::vector<Task> tasks, bool server) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (closed_) return false;
    std::deque<Task>& q = server ? server_ : local_;
    for (Task& t : tasks) q.push_back(std::move(t));
  }
  if (tasks.size() == 1) cv_.notify_one();
  else cv_.notify_all();
  return true;
}

std::pair<std::size_t, std::size_t> Executor::queued() {
  std::lock_guard<std::mutex> lock(mu_);
  return {local_.size(), server_.size()};
}

void Executor::loop() {
  std::unique_lock<std::mutex> lock(mu_);
  for (;;) {
    cv_.wait(lock, [this] { return closed_ || !local_.empty() || !server_.empty(); });
    std::deque<Task>& q = server_.empty() ? local_ : server_;  // server work first
    if (q.empty()) return;  // closed, and what was queued before has run
    Task task = std::move(q.front());
    q.pop_front();
    if (failed_->load(std::memory_order_acquire)) continue;  // a failed job's work is dropped
    lock.unlock();
    task();
    task = nullptr;  // what it captured goes before the lock is taken again
    lock.lock();
  }
}

void Executor::close() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    closed_ = true;
  }
  cv_.notify_all();
  for (auto& t : pool_)
    if (t.joinable()) t.join();
  std::lock_guard<std::mutex> lock(mu_);  // no threads (or none left): what is queued is dropped
  local_.clear();
  server_.clear();
}

}  // namespace smddp
