// A single-producer/single-consumer descriptor ring in shared memory, with futex sleeps.
//
// Between a worker and its daemon (docs/engine.md, "Rings"): one ring per direction inside memory
// both map (the worker's memfd arena). A slot holds one descriptor of kSlotBytes bytes (a 56-byte
// frame header of docs/protocol.md, padded); the producer writes the slot, then publishes it by
// advancing `head` with release order; the consumer reads `head` with acquire order, copies the slot
// out, and frees it by advancing `tail`. Neither side spins forever: a consumer with nothing to read
// spins for a bounded time, yielding the core between looks (an oversubscribed machine must not be
// starved by spinning), then sleeps on a futex word until the producer rings; a producer facing a
// full ring waits the same way.
//
// The other side may be hostile or broken: indices read from shared memory are checked (a ring whose
// head and tail are further apart than its capacity is corrupt and refused) and every slot address
// comes from this side's own copy of the geometry, never from shared memory. A RingView does not own
// the memory it views; whoever mapped it (the arena) does, and must outlive the view.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <string>

namespace smddp {

constexpr std::size_t kSlotBytes = 64;

// The shared layout: every field that one side writes on its own cache line.
struct alignas(64) RingShared {
  alignas(64) std::atomic<std::uint64_t> head;        // slots published (producer writes)
  alignas(64) std::atomic<std::uint64_t> tail;        // slots consumed (consumer writes)
  alignas(64) std::atomic<std::uint32_t> data_bell;   // futex: bumped when a slot is published to a sleeper
  std::atomic<std::uint32_t> data_sleepers;           // consumers asleep (or about to be) on data_bell
  alignas(64) std::atomic<std::uint32_t> space_bell;  // futex: bumped when a slot is freed for a sleeper
  std::atomic<std::uint32_t> space_sleepers;          // producers asleep (or about to be) on space_bell
};

static_assert(std::atomic<std::uint64_t>::is_always_lock_free, "ring indices must be lock-free across processes");
static_assert(std::atomic<std::uint32_t>::is_always_lock_free, "futex words must be plain 32-bit words");

// Bytes a ring of `capacity` slots needs (capacity a power of two, at least 2).
std::size_t ring_bytes(std::uint32_t capacity);

enum class RingWait { kReady, kTimeout, kCorrupt };

class RingView {
 public:
  // Views the ring at `base` (ring_bytes(capacity) bytes, 64-byte aligned). With `init`, resets it
  // (the creator does that once, before the other side maps it).
  RingView(void* base, std::uint32_t capacity, bool init);

  std::uint32_t capacity() const { return capacity_; }

  // Producer: copy `n` <= kSlotBytes bytes into the next slot and publish it. Waits for space up to
  // `timeout_ns` (spinning up to `spin_ns` of it first); kTimeout if the ring stayed full.
  RingWait push(const void* data, std::size_t n, std::int64_t timeout_ns, std::int64_t spin_ns);
  // Consumer: copy the next slot (kSlotBytes) to `out` and free it. Waits for data the same way; a
  // wait also ends (kTimeout) once `*cancel` is set and nudge() rang.
  RingWait pop(void* out, std::int64_t timeout_ns, std::int64_t spin_ns, const std::atomic<bool>* cancel = nullptr);
  // Wakes a consumer asleep in pop, so that it looks at its cancel flag.
  void nudge();
  // Consumer: whether a slot is ready now (no wait, no copy: kReady or kTimeout); kCorrupt for a broken ring.
  RingWait peek();
  // A consumer that sleeps on several rings at once (futex_wait_any): `sleep_begin` reads the data
  // bell, then counts this consumer among the ring's sleepers (what wait_turn does before one ring's
  // sleep), and returns the bell's value to sleep on; `empty` re-reads the head after it (seq_cst);
  // `sleep_end` uncounts it. kCorrupt cannot come from these: the next pop says it.
  std::uint32_t sleep_begin();
  bool empty();
  void sleep_end();
  std::atomic<std::uint32_t>* data_bell() const { return &shared_->data_bell; }
  // Why the ring was refused, after kCorrupt.
  const std::string& why() const { return why_; }

 private:
  bool sane(std::uint64_t head, std::uint64_t tail);
  void ring_bell(std::atomic<std::uint32_t>* bell, std::atomic<std::uint32_t>* sleepers);
  std::uint8_t* slot(std::uint64_t index) const { return slots_ + (index & (capacity_ - 1)) * kSlotBytes; }

  RingShared* shared_;
  std::uint8_t* slots_;
  std::uint32_t capacity_;
  std::uint64_t mine_;  // this side's own index (head for a producer, tail for a consumer), never
                        // re-read from shared memory, where the other side could change it
  std::string why_;
};

// Futex helpers on a shared (not process-private) 32-bit word: wait while *word == expected, up to
// timeout_ns; wake up to `n` waiters. Exposed for the engine's other sleepers.
void futex_wait(std::atomic<std::uint32_t>* word, std::uint32_t expected, std::int64_t timeout_ns);
void futex_wake(std::atomic<std::uint32_t>* word, int n);
// At most this many words for futex_wait_any (the kernel's limit).
constexpr std::size_t kWaitAnyMax = 128;
// Waits until any of `n` shared words is woken (or differs from its `expected`), up to timeout_ns:
// futex_waitv (Linux 5.16). False, at once, where the call may not be made (have_futex_wait_any).
bool futex_wait_any(std::atomic<std::uint32_t>* const* words, const std::uint32_t* expected, std::size_t n,
                    std::int64_t timeout_ns);
// Whether this process may call futex_waitv (the kernel has it, and no seccomp filter refuses it).
bool have_futex_wait_any();

}  // namespace smddp
