// Bounded fuzz of the engine's layout checks (make engine-sanitize, under ASan+UBSan and TSan): any
// shard, offset and length from the wire is refused or located as a chunk that lies inside its shard.
#include "fuzz.h"
#include "layout.h"

namespace {

bool round(fuzz::Rng& r, std::uint64_t seed) {
  const std::uint64_t itemsize = std::uint64_t{1} << (r.next() % 4);
  const std::uint64_t count = r.pick(1 << 20);
  const auto nshards = static_cast<std::uint32_t>(1 + r.next() % 64);
  const std::uint64_t chunk = 1 + r.pick(1 << 16);
  const std::uint64_t shard = r.pick(70);
  std::uint64_t off = r.pick(count * itemsize + 64), len = r.pick(chunk * itemsize + 8);
  if (r.next() % 3 == 0) {  // aim at a real chunk, then maybe nudge it
    const smddp::Range s = smddp::shard_range(count, nshards, static_cast<std::uint32_t>(shard % nshards));
    // (A shard of every 64-bit index has 2^64 starts: `span + 1` would wrap to 0. libFuzzer found it.)
    const std::uint64_t span = s.end > s.start ? s.end - s.start : 0;
    off = (s.start + (span == UINT64_MAX ? r.next() : r.next() % (span + 1))) * itemsize;
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
      return false;
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
      return false;
    }
  }
  return true;
}

}  // namespace

SMDDP_FUZZ_MAIN("fuzz_layout", 0x1a7, round)
