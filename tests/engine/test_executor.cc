// The daemon's compute threads (executor.h): every task runs once, server reductions before local
// work, a failed job's tasks dropped unrun, close() running what was queued before it and refusing
// what comes after, no thread left. Built and run under ASan+UBSan and TSan by `make engine-sanitize`.
// Exit status 0: every check held.
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "executor.h"
#include "plane_test.h"

using plane_test::check;
using smddp::Executor;

namespace {

// Four threads post 5,000 tasks each; every one runs exactly once.
void every_task_once() {
  std::atomic<bool> failed{false};
  std::vector<std::atomic<int>> ran(20'000);
  {
    Executor ex(3, &failed);
    std::vector<std::thread> posters;
    for (int p = 0; p < 4; p++)
      posters.emplace_back([&, p] {
        for (int i = 0; i < 5'000; i += 10) {
          std::vector<Executor::Task> batch;
          for (int k = 0; k < 10; k++) {
            const int id = p * 5'000 + i + k;
            batch.push_back([&ran, id] { ran[id]++; });
          }
          check(ex.post(std::move(batch), (i / 10) % 2 == 0), "post before close");
        }
      });
    for (auto& t : posters) t.join();
    ex.close();  // runs what was queued, then ends its threads
  }
  int wrong = 0;
  for (auto& r : ran) wrong += r.load() != 1;
  check(wrong == 0, std::to_string(wrong) + " tasks did not run exactly once");
}

// One thread, held busy: what is queued meanwhile runs server tasks first, each queue in order.
void server_first() {
  std::atomic<bool> failed{false};
  std::mutex mu;
  std::condition_variable cv;
  bool release = false, started = false;
  std::vector<std::string> order;
  Executor ex(1, &failed);
  ex.post({[&] {
            std::unique_lock<std::mutex> l(mu);
            started = true;
            cv.notify_all();
            cv.wait(l, [&] { return release; });
          }},
          false);
  {
    std::unique_lock<std::mutex> l(mu);
    cv.wait(l, [&] { return started; });
  }
  auto note = [&](std::string s) {
    return [&order, &mu, s] {
      std::lock_guard<std::mutex> l(mu);
      order.push_back(s);
    };
  };
  ex.post({note("local 1"), note("local 2")}, false);
  ex.post({note("server 1")}, true);
  ex.post({note("server 2")}, true);
  check(ex.queued() == std::make_pair(std::size_t{2}, std::size_t{2}), "two of each queued while the thread is busy");
  {
    std::lock_guard<std::mutex> l(mu);
    release = true;
  }
  cv.notify_all();
  ex.close();
  const std::vector<std::string> want{"server 1", "server 2", "local 1", "local 2"};
  check(order == want, "server reductions first, each queue in order");
  check(!ex.post({note("late")}, false), "a post after close is refused");
  check(order.size() == 4, "a task posted after close never runs");
}

// A failed job: what is still queued is dropped, and close() returns.
void failed_job_dropped() {
  std::atomic<bool> failed{false};
  std::atomic<int> ran{0};
  std::mutex mu;
  std::condition_variable cv;
  bool release = false;
  Executor ex(1, &failed);
  ex.post({[&] {
            std::unique_lock<std::mutex> l(mu);
            cv.wait(l, [&] { return release; });
          }},
          false);
  std::vector<Executor::Task> rest;
  for (int i = 0; i < 100; i++) rest.push_back([&ran] { ran++; });
  ex.post(std::move(rest), false);
  failed.store(true);
  {
    std::lock_guard<std::mutex> l(mu);
    release = true;
  }
  cv.notify_all();
  ex.close();
  check(ran.load() == 0, "a failed job's queued tasks were dropped (" + std::to_string(ran.load()) + " ran)");
}

// No threads: the callers run their work themselves; nothing is taken.
void no_threads() {
  std::atomic<bool> failed{false};
  Executor ex(0, &failed);
  check(ex.empty(), "an executor of no threads says so");
  ex.close();
  ex.close();  // idempotent
}

}  // namespace

int main() {
  every_task_once();
  server_first();
  failed_job_dropped();
  no_threads();
  if (plane_test::failures.load() != 0) return 1;
  std::printf("test_executor: every check held\n");
  return 0;
}
