// The shared-memory descriptor ring: release/acquire publication, bounded yielding spins, futex sleeps.
#include "ring.h"

#include <linux/futex.h>
#include <sched.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstring>
#include <ctime>
#include <new>

namespace smddp {
namespace {

using Clock = std::chrono::steady_clock;

// A sleeper re-checks at least this often: a wake-up lost to a broken or hostile peer costs latency,
// never a hang, and every wait still ends at its own timeout.
constexpr std::int64_t kSleepSliceNs = 50'000'000;
// How long a spinning wait polls before it starts yielding the core between looks.
constexpr std::int64_t kPollNs = 1'000;

inline void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#endif
}

std::int64_t since(Clock::time_point t0) {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(Clock::now() - t0).count();
}

}  // namespace

void futex_wait(std::atomic<std::uint32_t>* word, std::uint32_t expected, std::int64_t timeout_ns) {
  if (timeout_ns <= 0) return;
  timespec ts{static_cast<time_t>(timeout_ns / 1'000'000'000), static_cast<long>(timeout_ns % 1'000'000'000)};
  // Shared (not FUTEX_PRIVATE_FLAG): the word lives in memory another process maps. EINTR, EAGAIN
  // (the word changed) and ETIMEDOUT all mean: look again.
  (void)syscall(SYS_futex, reinterpret_cast<std::uint32_t*>(word), FUTEX_WAIT, expected, &ts, nullptr, 0);
}

void futex_wake(std::atomic<std::uint32_t>* word, int n) {
  (void)syscall(SYS_futex, reinterpret_cast<std::uint32_t*>(word), FUTEX_WAKE, n, nullptr, nullptr, 0);
}

// futex_waitv's waiter, as the kernel defines it (5.16): declared here, since the headers a wheel is
// built with may predate it; the call's number is the same on every architecture.
struct WaitvEntry {
  std::uint64_t val;
  std::uint64_t uaddr;
  std::uint32_t flags;
  std::uint32_t reserved;
};
constexpr std::uint32_t kWaitvU32 = 2;  // FUTEX2_SIZE_U32; without FUTEX2_PRIVATE: shared words
#ifndef SYS_futex_waitv
#define SYS_futex_waitv 449
#endif

bool futex_wait_any(std::atomic<std::uint32_t>* const* words, const std::uint32_t* expected, std::size_t n,
                    std::int64_t timeout_ns) {
  if (n == 0 || n > kWaitAnyMax || timeout_ns <= 0) return true;
  WaitvEntry v[kWaitAnyMax];
  for (std::size_t i = 0; i < n; i++)
    v[i] = WaitvEntry{expected[i], reinterpret_cast<std::uintptr_t>(words[i]), kWaitvU32, 0};
  // Its timeout is absolute, on the clock named last.
  timespec now{};
  clock_gettime(CLOCK_MONOTONIC, &now);
  std::int64_t ns = now.tv_nsec + timeout_ns % 1'000'000'000;
  timespec until{static_cast<time_t>(now.tv_sec + timeout_ns / 1'000'000'000 + ns / 1'000'000'000),
                 static_cast<long>(ns % 1'000'000'000)};
  const long r = syscall(SYS_futex_waitv, v, static_cast<unsigned>(n), 0u, &until, static_cast<int>(CLOCK_MONOTONIC));
  return !(r < 0 && (errno == ENOSYS || errno == EPERM));
}

bool have_futex_wait_any() {
  // Zero waiters is EINVAL where the call exists and may be made. ENOSYS: an older kernel; EPERM: a
  // seccomp filter that predates it (container runtimes' default profiles before 2022), where every
  // call would fail at once and the poller would never sleep.
  const long r = syscall(SYS_futex_waitv, nullptr, 0u, 0u, nullptr, static_cast<int>(CLOCK_MONOTONIC));
  return r < 0 && errno == EINVAL;
}

// One wait of a producer for space or a consumer for data, once its attempt found none: false when
// `timeout_ns` since `t0` is spent; else spins (up to `spin_ns` since t0), or counts itself among the
// sleepers, re-checks `blocked` (seq_cst, against the other side's publication) and sleeps on `bell`
// for at most a slice. The caller then tries again.
template <class Blocked>
bool wait_turn(Clock::time_point t0, std::int64_t timeout_ns, std::int64_t spin_ns, std::atomic<std::uint32_t>* bell,
               std::atomic<std::uint32_t>* sleepers, Blocked blocked) {
  const std::int64_t waited = since(t0);
  if (waited >= timeout_ns) return false;
  if (waited < spin_ns) {
    // The first microsecond polls; after that each look gives the core away first. On a machine
    // with more runnable threads than cores (four workers and their daemon on two cores) the thread
    // this one waits for runs now instead of after a futex sleep and wake-up, which measured 2-3x
    // slower for a 4 KiB all-reduce; on an idle core sched_yield returns at once and this is a
    // plain spin of at most spin_ns.
    if (waited < kPollNs)
      cpu_relax();
    else
      sched_yield();
    return true;
  }
  const std::uint32_t rung = bell->load(std::memory_order_seq_cst);
  sleepers->fetch_add(1, std::memory_order_seq_cst);
  if (blocked()) {
    const std::int64_t left = timeout_ns - waited;
    futex_wait(bell, rung, left < kSleepSliceNs ? left : kSleepSliceNs);
  }
  sleepers->fetch_sub(1, std::memory_order_seq_cst);
  return true;
}

std::size_t ring_bytes(std::uint32_t capacity) { return sizeof(RingShared) + std::size_t{capacity} * kSlotBytes; }

RingView::RingView(void* base, std::uint32_t capacity, bool init)
    : shared_(static_cast<RingShared*>(base)),
      slots_(static_cast<std::uint8_t*>(base) + sizeof(RingShared)),
      capacity_(capacity),
      mine_(0) {
  if (init) {
    new (shared_) RingShared{};
    shared_->head.store(0, std::memory_order_relaxed);
    shared_->tail.store(0, std::memory_order_relaxed);
    shared_->data_bell.store(0, std::memory_order_relaxed);
    shared_->data_sleepers.store(0, std::memory_order_relaxed);
    shared_->space_bell.store(0, std::memory_order_relaxed);
    shared_->space_sleepers.store(0, std::memory_order_release);
  }
}

bool RingView::sane(std::uint64_t head, std::uint64_t tail) {
  if (head - tail <= capacity_) return true;  // unsigned: a tail past the head is huge too
  why_ = "ring indices out of bounds (head " + std::to_string(head) + ", tail " + std::to_string(tail) +
         ", capacity " + std::to_string(capacity_) + "): the other side broke it";
  return false;
}

void RingView::ring_bell(std::atomic<std::uint32_t>* bell, std::atomic<std::uint32_t>* sleepers) {
  // The index was published with a seq_cst store and a sleeper counts itself with a seq_cst RMW
  // before it re-reads the index (seq_cst): of the two, one sees the other. A sleeper that counted
  // itself before our check is woken; one that counts itself after it sees what we published. (No
  // fence: ThreadSanitizer does not model fences, and these four operations need none.)
  if (sleepers->load(std::memory_order_seq_cst) != 0) {
    bell->fetch_add(1, std::memory_order_seq_cst);
    futex_wake(bell, 1);
  }
}

RingWait RingView::push(const void* data, std::size_t n, std::int64_t timeout_ns, std::int64_t spin_ns) {
  if (n > kSlotBytes) {
    why_ = "descriptor of " + std::to_string(n) + " bytes is larger than a slot";
    return RingWait::kCorrupt;
  }
  const Clock::time_point t0 = Clock::now();
  for (;;) {
    const std::uint64_t tail = shared_->tail.load(std::memory_order_acquire);
    if (!sane(mine_, tail)) return RingWait::kCorrupt;
    if (mine_ - tail < capacity_) {
      std::uint8_t* s = slot(mine_);
      std::memcpy(s, data, n);
      std::memset(s + n, 0, kSlotBytes - n);
      mine_++;
      shared_->head.store(mine_, std::memory_order_seq_cst);  // release, and ordered before ring_bell's check
      ring_bell(&shared_->data_bell, &shared_->data_sleepers);
      return RingWait::kReady;
    }
    if (!wait_turn(t0, timeout_ns, spin_ns, &shared_->space_bell, &shared_->space_sleepers,
                   [this] { return mine_ - shared_->tail.load(std::memory_order_seq_cst) >= capacity_; }))
      return RingWait::kTimeout;
  }
}

std::uint32_t RingView::sleep_begin() {
  const std::uint32_t rung = shared_->data_bell.load(std::memory_order_seq_cst);
  shared_->data_sleepers.fetch_add(1, std::memory_order_seq_cst);
  return rung;
}

bool RingView::empty() { return shared_->head.load(std::memory_order_seq_cst) == mine_; }

void RingView::sleep_end() { shared_->data_sleepers.fetch_sub(1, std::memory_order_seq_cst); }

RingWait RingView::peek() {
  const std::uint64_t head = shared_->head.load(std::memory_order_acquire);
  if (!sane(head, mine_)) return RingWait::kCorrupt;
  return head != mine_ ? RingWait::kReady : RingWait::kTimeout;
}

void RingView::nudge() {
  shared_->data_bell.fetch_add(1, std::memory_order_seq_cst);
  futex_wake(&shared_->data_bell, 1 << 30);
}

RingWait RingView::pop(void* out, std::int64_t timeout_ns, std::int64_t spin_ns, const std::atomic<bool>* cancel) {
  const Clock::time_point t0 = Clock::now();
  for (;;) {
    const std::uint64_t head = shared_->head.load(std::memory_order_acquire);
    if (!sane(head, mine_)) return RingWait::kCorrupt;
    if (head != mine_) {
      std::memcpy(out, slot(mine_), kSlotBytes);
      mine_++;
      shared_->tail.store(mine_, std::memory_order_seq_cst);  // release, and ordered before ring_bell's check
      ring_bell(&shared_->space_bell, &shared_->space_sleepers);
      return RingWait::kReady;
    }
    if (cancel != nullptr && cancel->load(std::memory_order_seq_cst)) return RingWait::kTimeout;
    if (!wait_turn(t0, timeout_ns, spin_ns, &shared_->data_bell, &shared_->data_sleepers, [this, cancel] {
          return shared_->head.load(std::memory_order_seq_cst) == mine_ &&
                 !(cancel != nullptr && cancel->load(std::memory_order_seq_cst));
        }))
      return RingWait::kTimeout;
  }
}

}  // namespace smddp
