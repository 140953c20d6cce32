// The shared-memory descriptor ring: every descriptor arrives once, in order, whole, between two
// threads and between two processes, with the consumer and the producer made to sleep on their
// futexes (tiny ring, no spinning, pauses); empty and full waits end at their timeout; indices broken
// by the other side are refused, never followed. Built and run under ASan+UBSan and TSan by
// `make engine-sanitize`. Exit status 0: every check held.
#include <sys/mman.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <thread>

#include "ring.h"

namespace {

int failures = 0;

void check(bool ok, const std::string& what) {
  if (!ok) {
    std::fprintf(stderr, "test_ring: FAILED: %s\n", what.c_str());
    failures++;
  }
}

constexpr std::int64_t kSecond = 1'000'000'000;

struct Desc {
  std::uint64_t seq;
  std::uint64_t check;
  std::uint8_t pad[40];
};

std::uint64_t mix(std::uint64_t x) { return x * 0x9E3779B97F4A7C15ull ^ (x >> 7); }

void* shared_map(std::size_t bytes) {
  void* p = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
  check(p != MAP_FAILED, "mmap");
  return p;
}

// Producer side of a run: `n` descriptors, pausing now and then so the consumer goes to sleep.
bool produce(void* base, std::uint32_t cap, std::uint64_t n, std::int64_t spin_ns) {
  smddp::RingView r(base, cap, false);
  for (std::uint64_t i = 0; i < n; i++) {
    Desc d{};
    d.seq = i;
    d.check = mix(i);
    std::memset(d.pad, static_cast<int>(i & 0xFF), sizeof d.pad);
    if (r.push(&d, sizeof d, 10 * kSecond, spin_ns) != smddp::RingWait::kReady) return false;
    if (i % 5000 == 4999) std::this_thread::sleep_for(std::chrono::milliseconds(2));
  }
  return true;
}

// Consumer side: every descriptor once, in order, whole; pausing now and then so the producer fills up.
bool consume(void* base, std::uint32_t cap, std::uint64_t n, std::int64_t spin_ns) {
  smddp::RingView r(base, cap, false);
  for (std::uint64_t i = 0; i < n; i++) {
    std::uint8_t slot[smddp::kSlotBytes];
    if (r.pop(slot, 10 * kSecond, spin_ns) != smddp::RingWait::kReady) {
      std::fprintf(stderr, "test_ring: pop %llu: %s\n", static_cast<unsigned long long>(i), r.why().c_str());
      return false;
    }
    Desc d;
    std::memcpy(&d, slot, sizeof d);
    if (d.seq != i || d.check != mix(i) || d.pad[39] != static_cast<std::uint8_t>(i & 0xFF)) return false;
    for (std::size_t k = sizeof d; k < smddp::kSlotBytes; k++)
      if (slot[k] != 0) return false;  // the producer's stale bytes never leak into a slot
    if (i % 7000 == 6999) std::this_thread::sleep_for(std::chrono::milliseconds(2));
  }
  return true;
}

void test_threads(std::uint32_t cap, std::int64_t spin_ns, std::uint64_t n) {
  void* base = shared_map(smddp::ring_bytes(cap));
  smddp::RingView init(base, cap, true);
  bool produced = false;
  std::thread p([&] { produced = produce(base, cap, n, spin_ns); });
  const bool consumed = consume(base, cap, n, spin_ns);
  p.join();
  check(produced && consumed, "threads, capacity " + std::to_string(cap) + ", spin " + std::to_string(spin_ns));
  munmap(base, smddp::ring_bytes(cap));
}

void test_processes() {
  const std::uint32_t cap = 16;
  void* base = shared_map(smddp::ring_bytes(cap));
  smddp::RingView init(base, cap, true);
  constexpr std::uint64_t kN = 30000;
  const pid_t child = fork();
  if (child == 0) _exit(produce(base, cap, kN, 0) ? 0 : 1);
  const bool consumed = consume(base, cap, kN, 0);
  int status = 0;
  waitpid(child, &status, 0);
  check(consumed && WIFEXITED(status) && WEXITSTATUS(status) == 0, "two processes");
  munmap(base, smddp::ring_bytes(cap));
}

void test_timeouts_and_corruption() {
  const std::uint32_t cap = 4;
  void* base = shared_map(smddp::ring_bytes(cap));
  smddp::RingView prod(base, cap, true), cons(base, cap, false);
  std::uint8_t slot[smddp::kSlotBytes] = {};
  auto t0 = std::chrono::steady_clock::now();
  check(cons.pop(slot, kSecond / 10, 0) == smddp::RingWait::kTimeout, "empty: timeout");
  double waited = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  check(waited >= 0.099 && waited < 2.0, "empty wait bounded: " + std::to_string(waited));
  check(cons.peek() == smddp::RingWait::kTimeout, "peek: empty");
  for (int i = 0; i < 4; i++) check(prod.push(slot, 8, kSecond, 0) == smddp::RingWait::kReady, "fill");
  check(cons.peek() == smddp::RingWait::kReady, "peek: ready");
  t0 = std::chrono::steady_clock::now();
  check(prod.push(slot, 8, kSecond / 10, 1000) == smddp::RingWait::kTimeout, "full: timeout");
  waited = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  check(waited >= 0.099 && waited < 2.0, "full wait bounded: " + std::to_string(waited));
  check(prod.push(slot, smddp::kSlotBytes + 1, kSecond, 0) == smddp::RingWait::kCorrupt, "oversized descriptor");
  // The other side scribbles over the indices: refused, with the reason, without touching memory.
  auto* shared = static_cast<smddp::RingShared*>(base);
  shared->head.store(1000);
  check(cons.pop(slot, kSecond, 0) == smddp::RingWait::kCorrupt, "consumer refuses a head past capacity");
  check(cons.why().find("out of bounds") != std::string::npos, "named: " + cons.why());
  shared->tail.store(~std::uint64_t{0});
  check(prod.push(slot, 8, kSecond, 0) == smddp::RingWait::kCorrupt, "producer refuses a tail past its head");
  munmap(base, smddp::ring_bytes(cap));
}

// One consumer asleep on several rings at once (sleep_begin, empty, futex_wait_any, sleep_end: what
// the daemon's one poller does), fed by a producer process that pushes to one ring at a time, in an
// order it draws, pausing so the consumer sleeps between most of them: each descriptor arrives once,
// in order per ring, and the sleeper is woken by whichever ring it came on (every wait in the
// consumer is a full second, so a lost wake-up shows as a timeout, not as latency).
void test_wait_any() {
  check(smddp::have_futex_wait_any(), "this kernel has futex_waitv");
  constexpr std::uint32_t kRings = 3, kCap = 8;
  constexpr std::uint64_t kN = 3000;
  const std::size_t bytes = smddp::ring_bytes(kCap);
  auto* base = static_cast<std::uint8_t*>(shared_map(kRings * bytes));
  for (std::uint32_t r = 0; r < kRings; r++) smddp::RingView init(base + r * bytes, kCap, true);
  const pid_t child = fork();
  if (child == 0) {
    smddp::RingView rings[kRings] = {{base, kCap, false}, {base + bytes, kCap, false}, {base + 2 * bytes, kCap, false}};
    std::uint64_t sent[kRings] = {};
    for (std::uint64_t i = 0; i < kN; i++) {
      const std::uint32_t r = static_cast<std::uint32_t>(mix(i) % kRings);
      Desc d{};
      d.seq = sent[r]++;
      d.check = mix(d.seq + r);
      if (rings[r].push(&d, sizeof d, 10 * kSecond, 0) != smddp::RingWait::kReady) _exit(1);
      if (i % 3 == 0) std::this_thread::sleep_for(std::chrono::microseconds(200));
    }
    _exit(0);
  }
  smddp::RingView rings[kRings] = {{base, kCap, false}, {base + bytes, kCap, false}, {base + 2 * bytes, kCap, false}};
  std::uint64_t got[kRings] = {}, total = 0, sleeps = 0;
  bool ok = true;
  const auto t0 = std::chrono::steady_clock::now();
  while (ok && total < kN && std::chrono::steady_clock::now() - t0 < std::chrono::seconds(60)) {
    bool any = false;
    for (std::uint32_t r = 0; r < kRings; r++) {
      std::uint8_t slot[smddp::kSlotBytes];
      if (rings[r].pop(slot, 0, 0) != smddp::RingWait::kReady) continue;
      Desc d;
      std::memcpy(&d, slot, sizeof d);
      ok = d.seq == got[r] && d.check == mix(d.seq + r);
      got[r]++;
      total++;
      any = true;
    }
    if (any) continue;
    std::atomic<std::uint32_t>* words[kRings];
    std::uint32_t rung[kRings];
    bool ready = false;
    for (std::uint32_t r = 0; r < kRings; r++) {
      rung[r] = rings[r].sleep_begin();
      words[r] = rings[r].data_bell();
    }
    for (std::uint32_t r = 0; r < kRings; r++) ready = ready || !rings[r].empty();
    if (!ready) {
      const auto s0 = std::chrono::steady_clock::now();
      // Woken, not timed out: a timeout takes all of its 10 s, a wake-up by the producer's next push
      // comes within milliseconds even on a loaded host.
      check(smddp::futex_wait_any(words, rung, kRings, 10 * kSecond), "futex_wait_any is there");
      check(std::chrono::steady_clock::now() - s0 < std::chrono::seconds(5), "woken, not timed out");
      sleeps++;
    }
    for (std::uint32_t r = 0; r < kRings; r++) rings[r].sleep_end();
  }
  int status = 0;
  waitpid(child, &status, 0);
  check(ok && total == kN, "wait_any: every descriptor once, in order per ring (" + std::to_string(total) + ")");
  check(WIFEXITED(status) && WEXITSTATUS(status) == 0, "wait_any: the producer pushed everything");
  check(sleeps > 100, "wait_any: the consumer slept (" + std::to_string(sleeps) + " times)");
  munmap(base, kRings * bytes);
}

}  // namespace

int main() {
  test_processes();  // first: fork before any thread exists
  test_wait_any();
  test_timeouts_and_corruption();
  test_threads(2, 0, 30000);          // tiny, never spinning: both sides sleep on their futexes constantly
  test_threads(64, 20000, 200000);     // spinning 20 us, then sleeping
  test_threads(1024, kSecond, 200000);  // spinning only
  std::printf("test_ring: %s\n", failures ? "FAILED" : "every check held");
  return failures ? 1 : 0;
}
