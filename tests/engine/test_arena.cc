// The engine's shared memory: sealed memfd segments (created, attached, their ranges checked) and
// the first-fit arena over them, hammered from four threads at once: every slot aligned, inside its
// segment, never overlapping another live slot (each thread fills its slots with its own pattern and
// finds it intact before freeing), holes merged back, double frees and foreign slots refused. Built and run under
// ASan+UBSan and TSan by `make engine-sanitize`. Exit status 0: every check held.
#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <cstdio>
#include <cstring>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "arena.h"

namespace {

int failures = 0;

void check(bool ok, const std::string& what) {
  if (!ok) {
    std::fprintf(stderr, "test_arena: FAILED: %s\n", what.c_str());
    __atomic_add_fetch(&failures, 1, __ATOMIC_RELAXED);
  }
}

void test_segments() {
  std::string why;
  auto seg = smddp::Segment::create(7, 10000, "smddp-test", &why);
  check(seg != nullptr, "create: " + why);
  if (!seg) return;
  std::uint8_t* p = nullptr;
  check(seg->range(0, 10000, &p).empty() && p == seg->base(), "the whole segment is a range");
  check(!seg->range(1, 10000, &p).empty(), "one byte past the end is refused");
  check(!seg->range(10001, 0, &p).empty(), "an offset past the end is refused");
  check(!seg->range(~std::uint64_t{0}, 2, &p).empty(), "an offset that overflows is refused");
  check(!seg->range(2, ~std::uint64_t{0}, &p).empty(), "a length that overflows is refused");
  std::memset(seg->base(), 0xAB, 10000);
  // Attached by another holder (a dup of the fd, as a peer receives it), read-only: same bytes.
  auto peer = smddp::Segment::attach(7, dup(seg->fd()), 10000, false, &why);
  check(peer != nullptr && peer->base()[9999] == 0xAB && !peer->writable(), "attach read-only: " + why);
  auto bigger = smddp::Segment::attach(7, dup(seg->fd()), 1 << 20, false, &why);
  check(bigger == nullptr && why.find("smaller than") != std::string::npos, "a segment smaller than claimed");
  int pipefd[2];
  check(pipe(pipefd) == 0, "pipe");
  close(pipefd[1]);
  auto piped = smddp::Segment::attach(1, pipefd[0], 16, false, &why);
  check(piped == nullptr && why.find("not a sealed memfd") != std::string::npos, "a pipe is not a segment: " + why);
  const int loose = memfd_create("smddp-test-unsealed", MFD_CLOEXEC);
  check(loose >= 0 && ftruncate(loose, 4096) == 0, "memfd");
  auto unsealed = smddp::Segment::attach(2, loose, 4096, false, &why);
  check(unsealed == nullptr && why.find("not sealed") != std::string::npos, "an unsealed memfd could shrink");
  auto empty = smddp::Segment::create(0, 0, "smddp-test", &why);
  check(empty != nullptr && empty->range(0, 0, &p).empty() && !empty->range(0, 1, &p).empty(), "a zero-size segment");
  seg->close_fd();
  check(seg->fd() == -1 && peer && peer->base()[0] == 0xAB, "the mapping outlives the fd");
}

void hammer(smddp::Arena* arena, int id) {
  std::mt19937_64 rng(static_cast<std::uint64_t>(id) * 7919 + 1);
  struct Held {
    smddp::Slot slot;
    std::shared_ptr<smddp::Segment> seg;
    std::uint8_t mark;
  };
  std::vector<Held> held;
  for (int step = 0; step < 4000; step++) {
    if (held.empty() || rng() % 3 != 0) {
      const std::uint64_t n = rng() % 4 == 0 ? rng() % 70000 : rng() % 600;
      smddp::Slot s;
      std::shared_ptr<smddp::Segment> fresh;
      const std::string why = arena->alloc(n, &s, &fresh);
      check(why.empty(), "alloc: " + why);
      if (!why.empty()) return;
      check(s.offset % smddp::kSlotAlign == 0 && s.nbytes == n, "a slot is aligned and as asked");
      auto seg = arena->segment(s.segment);
      std::uint8_t* p = nullptr;
      check(seg != nullptr && seg->range(s.offset, n, &p).empty(), "a slot lies inside its segment");
      if (!seg || p == nullptr) return;
      const auto mark = static_cast<std::uint8_t>(id * 37 + step);
      std::memset(p, mark, n);
      held.push_back({s, seg, mark});
    } else {
      const std::size_t i = rng() % held.size();
      const Held h = held[i];
      std::uint8_t* p = nullptr;
      (void)h.seg->range(h.slot.offset, h.slot.nbytes, &p);
      bool intact = true;
      for (std::uint64_t k = 0; k < h.slot.nbytes; k++) intact = intact && p[k] == h.mark;
      check(intact, "a live slot was overwritten by another");
      check(arena->free(h.slot).empty(), "free of a live slot");
      held[i] = held.back();
      held.pop_back();
    }
  }
  for (const Held& h : held) check(arena->free(h.slot).empty(), "free at the end");
}

void test_arena() {
  smddp::Arena arena("smddp-test-arena", 1 << 16);
  std::vector<std::thread> threads;
  for (int t = 0; t < 4; t++) threads.emplace_back(hammer, &arena, t);
  for (auto& t : threads) t.join();
  check(arena.in_use() == 0, "everything freed: nothing in use");
  // Every hole merged back: one slot the size of the first segment fits at its start again.
  smddp::Slot s;
  std::shared_ptr<smddp::Segment> fresh;
  check(arena.alloc(1 << 16, &s, &fresh).empty() && s.segment == 0 && s.offset == 0 && fresh == nullptr,
        "holes merge back into whole segments");
  check(!arena.free(smddp::Slot{s.segment, s.offset + 64, s.nbytes}).empty(), "a slot never handed out");
  check(!arena.free(smddp::Slot{s.segment, s.offset, 1}).empty(), "a slot of another size");
  check(arena.free(s).empty(), "free");
  check(!arena.free(s).empty(), "a double free is refused");
  arena.close();
  check(arena.segments().empty() && arena.in_use() == 0, "close drops everything");
}

}  // namespace

int main() {
  test_segments();
  test_arena();
  if (failures == 0) std::printf("test_arena: every check held\n");
  return failures == 0 ? 0 : 1;
}
