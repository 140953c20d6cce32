// The daemon's compute threads: the chunks of large collectives, run off the threads that made them ready.
//
// The plane hands work here when a hand-off costs less than the work (local_plane.cc, kInlineBytes).
// Two queues: server reductions first (they complete collectives, on which workers wait), then this
// node's local work. Threads and memory: the executor's own mutex guards its queues and nothing else
// (no caller's lock is ever held while it is taken, and it is never held while a task runs); a task
// owns what it captures (the op record it works on) until it has run or been dropped. Tasks of a job
// that failed (`*failed`, read without a lock) are dropped unrun.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <mutex>
#include <thread>
#include <utility>
#include <vector>

namespace smddp {

class Executor {
 public:
  using Task = std::function<void()>;
  // `threads` compute threads (0: none; then nothing may be queued). `failed` outlives the executor.
  Executor(std::uint32_t threads, const std::atomic<bool>* failed);
  ~Executor();
  Executor(const Executor&) = delete;
  Executor& operator=(const Executor&) = delete;

  bool empty() const { return pool_.empty(); }  // no compute threads: callers run their work themselves
  // Queue tasks (server reductions go first when `server`); false once closed (the tasks are dropped).
  bool post(std::vector<Task> tasks, bool server);
  // Tasks queued and not started: (local work, server reductions).
  std::pair<std::size_t, std::size_t> queued();
  // No more tasks; the threads run what was queued before (a failed job's is dropped), then end.
  // Idempotent.
  void close();

 private:
  void loop();

  const std::atomic<bool>* failed_;
  std::mutex mu_;
  std::condition_variable cv_;  // a queue has work, or closed
  std::deque<Task> local_;
  std::deque<Task> server_;
  bool closed_ = false;
  std::vector<std::thread> pool_;
};

}  // namespace smddp
