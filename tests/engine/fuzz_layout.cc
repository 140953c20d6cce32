// Bounded fuzz of the engine's layout checks (make engine-sanitize, under ASan+UBSan and TSan): any
// shard, offset and length from the wire is refused or located as a chunk that lies inside its shard.
//
// usage: fuzz_layout [--seconds S] [--threads T] [--seed N]
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <thread>
#include <vector>

#include "layout.h"

namespace {

struct Rng {
  std::uint64_t s;
  std::uint64_t next() {
    s ^= s >> 12;
    s ^= s << 25;
    s ^= s >> 27;
    return s * 2685821657736338717ull;
  }
  // Mostly small values, sometimes any 64-bit value: the bounds live at both ends.
  std::uint64_t pick(std::uint64_t small) { return (next() % 4 == 0) ? next() : next() % small; }
};

int fuzz(std::uint64_t seed, double seconds, std::uint64_t* done) {
  Rng r{seed | 1};
  const auto end = std::chrono::steady_clock::now() + std::chrono::duration<double>(seconds);
  std::uint64_t n = 0;
  while (std::chrono::steady_clock::now() < end) {
    for (int i = 0; i < 1000; ++i, ++n) {
      const std::uint64_t itemsize = std::uint64_t{1} << (r.next() % 4);
      const std::uint64_t count = r.pick(1 << 20);
      const auto nshards = static_cast<std::uint32_t>(1 + r.next() % 64);
      const std::uint64_t chunk = 1 + r.pick(1 << 16);
      const std::uint64_t shard = r.pick(70);
      std::uint64_t off = r.pick(count * itemsize + 64), len = r.pick(chunk * itemsize + 8);
      if (r.next() % 3 == 0) {  // aim at a real chunk, then maybe nudge it
        const smddp::Range s = smddp::shard_range(count, nshards, static_cast<std::uint32_t>(shard % nshards));
        off = (s.start + (s.end > s.start ? r.next() % (s.end - s.start + 1) : 0)) * itemsize;
        len = chunk * itemsize - (r.next() % 2) * itemsize;
      }
      smddp::ChunkAt c;
      if (smddp::locate_reduce(count, itemsize, nshards, chunk, shard, off, len, &c).empty()) {
        const smddp::Range s = smddp::shard_range(count, nshards, static_cast<std::uint32_t>(shard));
        const bool inside = s.start <= c.elems.start && c.elems.start <= c.elems.end && c.elems.end <= s.end;
        if (!inside || c.elems.start * itemsize != off || (c.elems.end - c.elems.start) * itemsize != len ||
            c.elems.end - c.elems.start > chunk) {
          std::fprintf(stderr, "fuzz_layout: accepted a frame that is not a chunk (seed %llu)\n",
                       static_cast<unsigned long long>(seed));
          return 1;
        }
      }
      const std::uint64_t a = r.pick(1 << 20);
      const smddp::Range block{a, a + r.pick(1 << 20)};
      std::uint64_t index = 0;
      if (smddp::locate_block(block, chunk, off, len, &index).empty()) {
        const bool ok = (block.end <= block.start) ? (off == block.start && len == 0)
                                                   : (off == block.start + index * chunk && off + len <= block.end);
        if (!ok) {
          std::fprintf(stderr, "fuzz_layout: accepted a block frame outside its block (seed %llu)\n",
                       static_cast<unsigned long long>(seed));
          return 1;
        }
      }
    }
  }
  *done = n;
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  double seconds = 5;
  int threads = 1;
  std::uint64_t seed = 0x1a7;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string flag = argv[i];
    if (flag == "--seconds") seconds = std::atof(argv[i + 1]);
    else if (flag == "--threads") threads = std::atoi(argv[i + 1]);
    else if (flag == "--seed") seed = std::strtoull(argv[i + 1], nullptr, 0);
  }
  std::vector<std::thread> pool;
  std::vector<std::uint64_t> counts(static_cast<std::size_t>(threads), 0);
  std::vector<int> rcs(static_cast<std::size_t>(threads), 0);
  for (int t = 0; t < threads; ++t)
    pool.emplace_back([&, t] {
      const auto k = static_cast<std::size_t>(t);
      rcs[k] = fuzz(seed + static_cast<std::uint64_t>(t), seconds, &counts[k]);
    });
  std::uint64_t total = 0;
  int rc = 0;
  for (std::size_t t = 0; t < pool.size(); ++t) {
    pool[t].join();
    total += counts[t];
    rc |= rcs[t];
  }
  std::printf("fuzz_layout: %llu inputs on %d thread(s), seed %#llx: %s\n", static_cast<unsigned long long>(total),
              threads, static_cast<unsigned long long>(seed), rc ? "FAILED" : "no crash, no bad acceptance");
  return rc;
}
